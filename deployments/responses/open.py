"""The store a replica opens from ``args.responses`` (``deployments.config.responses``)."""

from __future__ import annotations

import os
from pathlib import Path

from deployments.config.responses import ResponsesStore as StoreSettings
from deployments.logs import get_logger
from deployments.responses.private import default_dir
from deployments.responses.store import Quota, ResponsesStore

logger = get_logger("responses")


def default_sqlite_path(app_name: str) -> Path:
    """This user's store file for one application (``private.default_dir``)."""
    return default_dir() / f"{app_name}.sqlite3"


def quota_of(settings: StoreSettings) -> Quota:
    return Quota(settings.max_age_s, settings.max_records_per_key,
                 settings.max_bytes_per_key, settings.max_record_bytes)


def open_store(settings: StoreSettings, app_name: str) -> ResponsesStore:
    """The backend ``settings`` name; logs where it is (never the password)."""
    quota = quota_of(settings)
    bounds = (f"per key: {quota.max_records_per_key} records, {quota.max_bytes_per_key} "
              f"bytes; {quota.max_record_bytes} bytes a record; {quota.max_age_s:.0f} s")
    if settings.backend == "redis":
        from deployments.responses.redis_store import RedisStore

        assert settings.url is not None  # the config model refuses redis without a url
        password = os.environ.get(settings.password_env) or None
        if password is None:
            logger.warning("dsv4: Responses store %s without a password (env %s is unset): "
                           "anyone who reaches it reads every stored response",
                           settings.url, settings.password_env)
        logger.info("dsv4: Responses store: Redis/Valkey at %s, prefix %s (%s)",
                    settings.url, settings.key_prefix, bounds)
        return RedisStore(settings.url, password, settings.key_prefix, quota,
                          settings.timeout_s)
    from deployments.responses.sqlite import SQLiteStore

    path = Path(settings.sqlite_path) if settings.sqlite_path else default_sqlite_path(app_name)
    logger.info("dsv4: Responses store: SQLite %s (%s; one machine)", path, bounds)
    return SQLiteStore(path, quota, settings.timeout_s)
