"""The scripts of benchmarks/experiments/draft_sampling/ (its README.md says what they answered)."""
