"""What the tests and the benchmarks both drive the app with; the serving code never imports it.

Here, in the package, because ``benchmarks/`` imports the package and never ``tests/``,
and ``tests/`` never imports ``benchmarks/`` (``tests/test_house/test_imports.py``): the
one copy both use sits on the floor both may import. Top floor: may import every other
floor of ``deployments``; nothing else in ``deployments`` imports it.

- ``standin``: stand-in Serve replicas with the replica contract and no engine (the
  controller measured and tested at 256 replicas).
- ``load``: ``vllm bench serve`` from Python, one call per load run.
- ``kv_poll``: one ``GET /v1/kv-spec`` for pollers that watch it while replicas die.
- ``run_process``: ``dsv4-serve run`` as a process (its serving line, its process tree).
- ``multinode_scenario``: the multi-node story step by step (CI test and benchmark).
- ``haproxy_config``: the HAProxy config Ray renders (dsv4-haproxy tests, thread benchmark).
- ``kuberay_pods``: the pods KubeRay's operator makes from a rendered RayService, as plans.
- ``kuberay_podman``: those plans as podman pods on a private network (``make test-kuberay``).
- ``kuberay_scenario``: the operator's steps and the checks on top (``make test-kuberay``).
- ``records``: result files of the runs kept out of CI (``make image``, ``make test-kuberay``).
- ``canary_runs``: the P/D canary benchmark's runs, pooled per host kind (its record, a
  house test).
"""
