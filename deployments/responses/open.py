"""The store a replica opens from ``args.responses`` (``deployments.config.responses``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from deployments.config.responses import ResponsesStore as StoreSettings
from deployments.logs import get_logger
from deployments.responses.store import ResponsesStore

logger = get_logger("responses")


def default_sqlite_path(app_name: str) -> Path:
    """The local run directory's store file for one application."""
    return Path(tempfile.gettempdir()) / "dsv4-serve" / "responses" / f"{app_name}.sqlite3"


def open_store(settings: StoreSettings, app_name: str) -> ResponsesStore:
    """The backend ``settings`` name; logs where it is (never the password)."""
    if settings.backend == "redis":
        from deployments.responses.redis_store import RedisStore

        assert settings.url is not None  # the config model refuses redis without a url
        password = os.environ.get(settings.password_env) or None
        if password is None:
            logger.warning("dsv4: Responses store %s without a password (env %s is unset): "
                           "anyone who reaches it reads every stored response",
                           settings.url, settings.password_env)
        logger.info("dsv4: Responses store: Redis/Valkey at %s, prefix %s (max %d records, "
                    "%.0f s)", settings.url, settings.key_prefix, settings.max_count,
                    settings.max_age_s)
        return RedisStore(settings.url, password, settings.key_prefix, settings.max_age_s,
                          settings.max_count, settings.timeout_s)
    from deployments.responses.sqlite import SQLiteStore

    path = Path(settings.sqlite_path) if settings.sqlite_path else default_sqlite_path(app_name)
    logger.info("dsv4: Responses store: SQLite %s (max %d records, %.0f s; one machine)",
                path, settings.max_count, settings.max_age_s)
    return SQLiteStore(path, settings.max_age_s, settings.max_count, settings.timeout_s)
