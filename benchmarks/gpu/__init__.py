"""The GPU comparison's scripts: run from the repo root as modules
(`python -m benchmarks.gpu.NAME`), or through the shell scripts here."""
