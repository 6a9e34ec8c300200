"""The scripts of benchmarks/experiments/dflash2/ (its README.md says what they answered)."""
