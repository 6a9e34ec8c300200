"""The scripts of benchmarks/experiments/scan_layers/ (its README.md says what they answered)."""
