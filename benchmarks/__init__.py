"""Benchmarks (``python -m benchmarks.<name>``; results in docs/benchmarks.md) and the
harness modules they share with the tests (``standin``, ``load``, ``kv_poll``,
``run_process``, ``multinode_scenario``).

May import ``deployments`` and ``dsv4_patch``; never ``tests`` (tests import from here,
not the reverse).
"""
