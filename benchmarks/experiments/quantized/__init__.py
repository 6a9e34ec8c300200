"""The scripts of benchmarks/experiments/quantized/ (its README.md says what they answered)."""
