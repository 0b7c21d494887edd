"""deployments: DeepSeek-V4 on Ray Serve LLM with KV-spec consensus.

- ``config``     pydantic models of our part of a Serve config (validated before Ray).
- ``server``     the DSv4 ``LLMServer`` subclass: canonicalize, self-check, ``kv_page_spec()``.
- ``controller`` the KV-spec controller: broadcast, consensus, policy, metrics.
- ``app``        ``build_app``: the one Serve application builder.
- ``runner``     ``dsv4-serve run`` / ``status``: the local default.
- ``policy_cli`` ``dsv4-serve policy``: the operator's run-time KV-spec policy.
- ``plan``       preflight without GPUs.
- ``k8s``        RayService manifests rendered from ``configs/``.
- ``cli``        the ``dsv4-serve`` command.
"""
