"""Benchmarks (``python -m benchmarks.<name>``; results and method in docs/benchmarks.md).

May import ``deployments`` and ``dsv4_patch`` (the harnesses they share with the tests are
``deployments.harness``); never ``tests``, and no test imports a benchmark
(``tests/test_house/test_imports.py``).
"""
