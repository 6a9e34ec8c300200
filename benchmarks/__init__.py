"""Benchmark scripts (run as `python benchmarks/NAME.py`); a package so tests and scripts import
its helpers (`benchmarks.timing`, `benchmarks.text_quality`)."""
