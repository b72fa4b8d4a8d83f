"""Benchmarks: speed measured side by side in one run, saved as JSON and a plot.

``python -m minillm.bench engine`` compares every generation method of chapters 5-8 (and
Hugging Face ``generate``) on one workload. Results go to ``benchmarks/results/``.
"""
