"""Our loggers: ``dsv4_serve.<component>``, never Ray's own ``ray.serve`` name.

Messages from our code must be told apart from Ray Serve's (and filtered, or raised
to DEBUG, on their own). Inside a Serve replica nothing configures a ``dsv4_serve``
logger, so the first ``get_logger`` gives the family one stderr handler at INFO
(Ray writes a replica's stderr to its worker log; ``dsv4-serve run`` shows it with
``DSV4_LOG_TO_DRIVER=1``) unless a handler is already there.
"""

from __future__ import annotations

import logging

ROOT = "dsv4_serve"


def get_logger(component: str) -> logging.Logger:
    """The logger of one of our components, e.g. ``dsv4_serve.server``."""
    family = logging.getLogger(ROOT)
    if not family.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        family.addHandler(handler)
        family.setLevel(logging.INFO)
        family.propagate = False  # one line per message, also where root has a handler
    return logging.getLogger(f"{ROOT}.{component}")


def plain_output() -> None:
    """CLI processes (``dsv4-serve run``) print our messages as bare lines, for people."""
    get_logger("cli")
    for handler in logging.getLogger(ROOT).handlers:
        handler.setFormatter(logging.Formatter("%(message)s"))
