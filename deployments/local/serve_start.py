"""Start Serve on the local cluster without waiting for its proxies before deploying.

``serve.start`` blocks until every HTTP proxy answers ``ready`` (~0.8 s on a 2-core
box, docs/benchmarks.md §2d), yet no replica needs a proxy to start: the controller
deploys without one. So the controller and proxies are created as ``serve.start``
creates them, the app is deployed at once, and the proxies are awaited afterwards,
before anything reports the app's URL (``ray_touches``: ``serve.controller_before_proxies``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deployments import ray_touches
from deployments.logs import get_logger

logger = get_logger("run")

ProxiesReady = Callable[[], None]


def start_serve(http_options: dict[str, Any], proxy_location: str,
                wait_for_proxies: bool = True) -> ProxiesReady:
    """Start Serve's controller and proxies; return what waits for the proxies.

    With ``wait_for_proxies`` (or without the touch) this is ``serve.start``, and the
    returned call does nothing.
    """
    from ray import serve

    if wait_for_proxies or not ray_touches.present("serve.controller_before_proxies"):
        if not wait_for_proxies:
            logger.warning("dsv4: this Ray lacks serve.controller_before_proxies "
                           "(deployments/ray_touches/): Serve's proxies are awaited "
                           "before the app is deployed (slower boot, nothing lost)")
        serve.start(http_options=http_options, proxy_location=proxy_location)
        return lambda: None
    import ray
    from ray._common.usage import usage_lib
    from ray.serve._private import api
    from ray.serve._private.client import ServeControllerClient
    from ray.serve._private.constants import HTTP_PROXY_TIMEOUT
    from ray.serve.context import _set_global_client

    usage_lib.record_library_usage("serve")  # as serve.start does
    controller, proxy_refs = api._create_controller_and_proxy_refs(
        http_options, None, None, None, api._coerce_controller_options(None),
        proxy_location)
    _set_global_client(ServeControllerClient(controller))
    logger.info("dsv4: Serve's controller is up; its %d proxies are awaited after the "
                "deploy starts", len(proxy_refs))

    def proxies_ready() -> None:
        try:
            ray.get(proxy_refs, timeout=HTTP_PROXY_TIMEOUT)
        except ray.exceptions.GetTimeoutError as exc:
            raise TimeoutError(f"Serve's HTTP proxies were not ready within "
                               f"{HTTP_PROXY_TIMEOUT} s of the controller's start. Fix: "
                               "read the proxy's log in Ray's session logs/serve/") from exc

    return proxies_ready
