"""The scripts of benchmarks/experiments/bf16_divergence/ (its README.md says what they answered)."""
