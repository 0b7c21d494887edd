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
- ``vllm_app``: vLLM's own OpenAI app without an engine (what the edge tests harden).
- ``v41_pages``: V4.1-Flash's config and the page sizes vLLM's spec classes give it.
- ``house``: the repository as files, for the checks in ``tests/test_house/``.
- ``edge_app``: the edge's harness (a stand-in app hardened as a replica hardens vLLM's).
- ``replica_port``: helpers for the replicas' own port (``deployments.doors.listener``).
- ``rule_contracts``: rule helpers only tests use (vLLM contracts, P/D pool comparisons).
- ``redis_server``: a real redis/valkey server on 127.0.0.1 for the session.
- ``promql``: a small PromQL parser (dashboard queries name real metrics).
- ``vllm_series``, ``vllm_fields``: vLLM's Prometheus series and request-model fields,
  read from the installed vLLM.
- ``data/``: recorded worker reports.
"""
