"""The scripts of benchmarks/experiments/token_choosers/ (its README.md says what they answered)."""
