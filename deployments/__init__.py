"""deployments: DeepSeek-V4 on Ray Serve LLM with KV-spec consensus.

Floors, bottom to top (a module imports only from its own floor or below):

1. ``logs``, ``resources``, ``serve_env``, ``lifetime``, ``ray_touches``: light shared
   names, the packaged data, Ray Serve's process flags, children that end with their
   parent, and the registry of every Ray internal we touch (probed; shown by
   ``dsv4-serve doctor``).
2. ``config/``: every config model, validated before Ray starts.
3. ``control/`` (the KV-spec controller and its typed wire), ``http/`` (the edge in
   front of vLLM's OpenAI app), ``doors/`` (every way a request reaches a replica: its own
   port, HAProxy, Serve's data plane, and how each closes), ``plan/`` (preflight without
   GPUs), ``k8s/`` (KubeRay manifests).
4. ``serving/``: the server replica and the one-pool application.
5. ``pd/``: the prefill/decode pattern, built on ``serving``.
6. ``app``: ``deployments.app:build_app``, the ``import_path`` users write.
7. ``local/``: the stack on this machine (private Ray, multi-node, deploy, drain).
8. ``cli/``: the ``dsv4-serve`` command.
9. ``harness/``: what the tests and the benchmarks both drive the app with (stand-in
   replicas, the load client, the multi-node scenario); the serving code never imports it.

Each package's ``__init__`` says what its modules do and what it may import.
"""
