"""The scripts of benchmarks/experiments/trees/ (its README.md says what they answered)."""
