"""One-off experiments, a folder per question with its README (benchmarks/README.md lists them);
packages so that tests import their scripts (`benchmarks.experiments.ddpm.ddpm_tpu`)."""
