"""Test-only hooks for every Python process whose PYTHONPATH starts with this folder.

Engine tests put this folder and the repo root on PYTHONPATH (the hooks live in
``tests.support``); vLLM's engine core and workers are spawned, so this is how a hook
reaches them, as it reaches a user's.
Each hook is a post-import hook registered before vLLM loads general plugins,
switched on by its own environment variable:

- ``DSV4_TEST_LEGACY_RESOLVER=1``: the vLLM 0.24-0.29 asserting resolver
  (tests/support/legacy_resolver.py), which the plugin must find and fix.
- ``DSV4_TEST_SCALED_DUMMY_WEIGHTS=1``: dummy weights at fan-in scale
  (tests/support/scaled_dummy.py), so outputs depend on the context.
- ``DSV4_TEST_REPORT_SPECS=1``: each worker prints its KV cache specs and plugin
  record when vLLM collects them (tests/support/spec_report.py), for releases whose run ends
  before a worker extension could be asked (the release end-to-end checks).
- ``DSV4_TEST_PD_FAULTS=<file>``: KV-transfer faults in vLLM's NIXL pull connector,
  chosen at run time by the file's contents (tests/support/pd_faults.py).
"""

import os

if os.environ.get("DSV4_TEST_LEGACY_RESOLVER") == "1":
    from dsv4_patch.import_hooks import when_imported
    from tests.support import legacy_resolver

    when_imported(legacy_resolver.ATTENTION_MODULE, legacy_resolver.install_into)

if os.environ.get("DSV4_TEST_SCALED_DUMMY_WEIGHTS") == "1":
    from dsv4_patch.import_hooks import when_imported
    from tests.support import scaled_dummy

    when_imported(scaled_dummy.DUMMY_LOADER_MODULE, scaled_dummy.install_into)

if os.environ.get("DSV4_TEST_REPORT_SPECS") == "1":
    from dsv4_patch.import_hooks import when_imported
    from tests.support import spec_report

    when_imported(spec_report.RUNNER_MODULE, spec_report.install_into)
    when_imported(spec_report.ATTENTION_MODULE, spec_report.install_layer_report)

if os.environ.get("DSV4_TEST_PD_FAULTS"):
    from dsv4_patch.import_hooks import when_imported
    from tests.support import pd_faults

    when_imported(pd_faults.WORKER_MODULE, pd_faults.install_worker)
    when_imported(pd_faults.SCHEDULER_MODULE, pd_faults.install_scheduler)
