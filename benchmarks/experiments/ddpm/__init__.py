"""The scripts of benchmarks/experiments/ddpm/ (its README.md says what they answered)."""
