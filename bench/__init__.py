"""Benchmark scripts, run as ``PYTHONPATH=. python bench/NAME.py``; a package so that they share helpers."""
