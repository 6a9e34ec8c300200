"""The scripts of benchmarks/experiments/regen/ (its README.md says what they answered)."""
