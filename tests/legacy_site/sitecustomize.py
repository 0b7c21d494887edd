"""Imported by every Python process whose PYTHONPATH starts with this folder.

Tests that boot a real engine put this folder (and tests/) on PYTHONPATH so the
engine core and every worker get the vLLM 0.24-0.29 resolver, the same way a
user on Ray Serve LLM 2.60 (vLLM 0.29.0) does. It is installed through a post-import
hook registered here, before vLLM loads general plugins, so when the plugin
is enabled it probes the legacy resolver and must fix it.
"""

import os

if os.environ.get("DSV4_TEST_LEGACY_RESOLVER") == "1":
    import legacy_resolver

    from dsv4_patch.import_hooks import when_imported

    when_imported(legacy_resolver.ATTENTION_MODULE, legacy_resolver.install_into)
