"""The scripts of benchmarks/experiments/attention_cpu/ (its README.md says what they answered)."""
