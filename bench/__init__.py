"""Benchmarks: ``python -m bench.NAME``; each prints its comparable figure as the last line ``name=value``."""
