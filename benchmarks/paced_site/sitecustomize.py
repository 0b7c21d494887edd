"""Run at every Python start with this directory on ``PYTHONPATH`` (benchmark only):
paces the vLLM engine core when ``DSV4_BENCH_PACED`` is set (``benchmarks/paced_engine.py``)."""

import os

if os.environ.get("DSV4_BENCH_PACED"):
    from benchmarks.paced_engine import install

    install()
