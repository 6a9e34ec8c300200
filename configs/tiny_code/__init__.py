"""The bundled tiny-code pair, stage by stage (scripts/reproduce_tiny_code.sh runs them all)."""
