"""Benchmarks anyone can rerun: python benchmarks/bench.py (figures: docs/benchmarks.md)."""
