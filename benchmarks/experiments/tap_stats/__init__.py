"""The scripts of benchmarks/experiments/tap_stats/ (its README.md says what they answered)."""
