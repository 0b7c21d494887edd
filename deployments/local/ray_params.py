"""Node options Ray takes only from ``ray start``: set on the ``RayParams`` Ray builds.

``ray.init`` (the one-node head, ``ray_head.quiet_head``) and Ray's fake node provider
(worker nodes of ``--nodes``, ``node_provider``) build ``RayParams`` themselves from a
fixed set of arguments, and neither passes ``no_monitor`` or ``include_log_monitor``.
Both look the class up by its module name when they build it, so for the duration of
the call the name points at a subclass that sets the values after Ray's own
``__init__``. The Ray touches that use it are ``ray.quiet_local_head`` and
``ray.fake_nodes_one_log_monitor`` (``deployments/ray_touches/``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def ray_params_set(**values: object) -> Iterator[None]:
    """While it lasts, every ``RayParams`` built by its module name has ``values`` set."""
    from ray._private import parameter

    real = parameter.RayParams

    class SetParams(real):  # type: ignore[misc, valid-type]  # Ray's RayParams, read as Any at runtime
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            for name, value in values.items():
                setattr(self, name, value)

    parameter.RayParams = SetParams
    try:
        yield
    finally:
        parameter.RayParams = real
