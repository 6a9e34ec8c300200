"""The scripts of benchmarks/experiments/moe/ (its README.md says what they answered)."""
