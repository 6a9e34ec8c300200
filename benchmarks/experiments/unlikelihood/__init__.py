"""The scripts of benchmarks/experiments/unlikelihood/ (its README.md says what they answered)."""
