"""The replica's Prometheus series of its API key file (``deployments.http.auth``).

``dsv4_api_key_file_stale`` is the one to alert on: 1 while an edit is refused and the
last good keys still serve (the replica's log has the reason). The series are listed in
``deployments.observe.series``.
"""

from __future__ import annotations

from deployments.http.keyfile import KeyFileStatus, KeyFileWatcher
from deployments.observe import series


def key_file_metrics() -> KeyFileWatcher:
    """A watcher that sets the key file's series on every status it is given."""
    stale, keys, refused = series.make_each(series.KEY_FILE_STALE, series.KEY_FILE_KEYS,
                                            series.KEY_FILE_REFUSED)
    seen = 0

    def watch(status: KeyFileStatus) -> None:
        nonlocal seen
        stale.set(1 if status.state == "stale" else 0)
        keys.set(status.keys)
        if status.refused > seen:
            refused.inc(status.refused - seen)
            seen = status.refused

    return watch
