"""Benchmarks (run with ``python -m bench.<name>``)."""
