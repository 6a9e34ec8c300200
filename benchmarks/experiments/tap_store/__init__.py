"""The scripts of benchmarks/experiments/tap_store/ (its README.md says what they answered)."""
