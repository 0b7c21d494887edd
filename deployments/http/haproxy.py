"""The old import path of ``dsv4-haproxy`` (``deployments.doors.haproxy``).

An editable install made before the doors moved runs ``deployments.http.haproxy:main``
from its generated script until ``pip install -e .`` (``make setup``) rewrites it. Delete
this module once every environment is reinstalled; nothing in the tree imports it.
"""

from deployments.doors.haproxy import main

__all__ = ["main"]
