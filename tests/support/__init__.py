"""What the tests share: helpers, engine harnesses and their data. No test functions.

Imported by the test modules and by ``tests/conftest.py`` (which keeps only pytest hooks
and fixtures); may import ``deployments`` (the harnesses benchmarks share are
``deployments.harness``) and ``dsv4_patch``, never a test module or ``benchmarks``
(``tests/test_house/test_imports.py``).

- ``stack``: the session stack's ``Stack`` and the mixed app's odd replica.
- ``serve_client``: ``wait_agree`` (poll /v1/kv-spec), ``Traffic``, ``check`` (the
  response contract).
- ``procs``: ``pid_alive``, ``alive`` (from ``/proc``).
- ``kv_standins``: controller variants Ray workers import (a stuck ``serve.status()``).
- ``engine_boot``: ``python -m tests.support.engine_boot`` boots a real engine, prints
  its workers' KV specs.
- ``engine_site/``: a ``sitecustomize`` for engine processes (put it and the repo root on
  PYTHONPATH); its hooks: ``legacy_resolver``, ``scaled_dummy``, ``spec_report``.
- ``cpu_compat_cases``, ``native_compare``: scripts run in a fresh interpreter (our
  CPU fallbacks/ops against Triton's interpreter / vLLM's native kernels).
- ``data/``: recorded worker reports.
"""
