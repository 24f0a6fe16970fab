"""Benchmarks: engines side by side in one process, sweeps over budgets, links, k and compile,
tables and plots (``python -m specter.bench RECIPE``; ``python -m specter.bench plot bench.json``)."""
