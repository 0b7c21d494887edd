"""KubeRay RayService manifests rendered from ``configs/`` and checked.

``params`` (ports, paths, the presets and their scaling), ``render`` (a preset -> a
manifest), ``lint`` (a rendered manifest against its config and our security rules).
The CLI face is ``deployments.cli.k8s``.
"""
