"""Benchmarks: run from the repo root as modules (`python -m benchmarks.NAME`)."""
