"""The scripts of benchmarks/experiments/under_load/ (its README.md says what they answered)."""
