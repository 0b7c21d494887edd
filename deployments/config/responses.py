"""``args.responses``: where the fleet keeps Responses state (``deployments.responses``).

Used only while ``http.responses_store`` is on. SQLite (the default) needs nothing
installed and serves every replica on one machine (the local run, the local
multi-node cluster); Redis/Valkey serves a fleet across machines (KubeRay). The
password never sits in the YAML: it is read from the env var ``password_env`` names.
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from deployments.config.base import _Strict

DEFAULT_PASSWORD_ENV = "DSV4_RESPONSES_STORE_PASSWORD"  # noqa: S105  # the name of an env var, not a password
THIRTY_DAYS_S = 30 * 24 * 3600.0


class ResponsesStore(_Strict):
    """The shared Responses store: backend, bounds, deadlines."""

    backend: Literal["sqlite", "redis"] = Field(
        default="sqlite", description="sqlite: a file every replica on this machine opens; "
        "redis: a Redis/Valkey server every replica reaches (multi-node, KubeRay)")
    sqlite_path: str | None = Field(
        default=None, min_length=1, description="the SQLite file; default "
        "$XDG_STATE_HOME (or ~/.local/state)/dsv4-serve/responses/<app>.sqlite3: this "
        "user's; its directory must be 0700 and the file 0600, owned by this user")
    url: str | None = Field(
        default=None, description="redis://host:port/db (or rediss://); no password in "
        "it: the password comes from password_env")
    password_env: str = Field(default=DEFAULT_PASSWORD_ENV, min_length=1)
    # No braces: each key's records share the Redis Cluster hash tag {<owner>}.
    key_prefix: str = Field(default="dsv4:responses", min_length=1, max_length=200,
                            pattern=r"^[^{}]+$")
    # OpenAI keeps stored responses 30 days. Quotas are per API key (keyless: one key):
    # beyond its records or bytes a key's own oldest records go, never another key's, so
    # the fleet holds at most (keys x max_bytes_per_key) -- size Redis's maxmemory above
    # it. 128 MiB a key holds ~1,000 long conversations (100 KiB a record) or 16 at the
    # largest record; 8 MiB a record is above DeepSeek-V4's 1M-token context as text
    # (~4 bytes a token) with its JSON; larger is refused (413), nothing stored.
    max_age_s: float = Field(default=THIRTY_DAYS_S, gt=0)
    max_records_per_key: int = Field(default=10_000, ge=1)
    max_bytes_per_key: int = Field(default=128 << 20, ge=1024)
    max_record_bytes: int = Field(default=8 << 20, ge=1024)
    # Every store call has this deadline; past it the request fails with a 503.
    timeout_s: float = Field(default=2.0, gt=0, le=60)
    # How often a replica running background responses looks for a cancel made elsewhere.
    cancel_poll_s: float = Field(default=1.0, gt=0, le=60)

    @field_validator("url")
    @classmethod
    def _no_secret_in_url(cls, url: str | None) -> str | None:
        if url is None:
            return None
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            raise ValueError(f"responses.url={parts.scheme}://...: expected redis:// or "
                             "rediss://host:port/db")
        if parts.password or parts.username:
            raise ValueError("responses.url carries credentials: the YAML (and the state "
                             "API that echoes it) must not. Fix: drop them from the URL and "
                             "put the password in the env var responses.password_env names.")
        return url

    @model_validator(mode="after")
    def _backend_complete(self) -> ResponsesStore:
        """A backend without what it needs, or a setting the backend would ignore."""
        if self.backend == "redis" and self.url is None:
            raise ValueError("responses.backend=redis needs responses.url "
                             "(redis://host:port/db). Fix: set it, or use backend: sqlite "
                             "on one machine.")
        if self.backend == "sqlite" and self.url is not None:
            raise ValueError("responses.url is set but responses.backend=sqlite would ignore "
                             "it. Fix: set backend: redis, or remove url.")
        if self.max_record_bytes > self.max_bytes_per_key:
            raise ValueError(f"responses.max_record_bytes={self.max_record_bytes} is above "
                             f"responses.max_bytes_per_key={self.max_bytes_per_key}: such a "
                             "record could never be kept. Fix: lower max_record_bytes or "
                             "raise max_bytes_per_key.")
        if self.backend == "redis" and self.sqlite_path is not None:
            raise ValueError("responses.sqlite_path is set but responses.backend=redis would "
                             "ignore it. Fix: remove sqlite_path.")
        return self
