"""The whole Serve config file: its applications, ours among them, and Serve's HTTP options."""

from __future__ import annotations

from typing import Any

from pydantic import (
    Field,
    PrivateAttr,
    model_validator,
)

from deployments.config.app_args import AppArgs
from deployments.config.base import IMPORT_PATH, _Open
from deployments.config.parse import parse_app_args

# ------------------------------------------------------------ whole Serve file


class ServeApplication(_Open):
    """One entry of ``applications``; other builders' args are not ours to judge."""

    name: str = "default"
    route_prefix: str | None = "/"
    import_path: str
    args: dict[str, Any] = Field(default_factory=dict)
    # Our args, parsed once (by the loader or the first ``parsed`` call) and kept.
    _parsed: AppArgs | None = PrivateAttr(default=None)

    @property
    def is_ours(self) -> bool:
        return self.import_path == IMPORT_PATH

    @property
    def where(self) -> str:
        return f"applications[{self.name}].args"

    def parse(self, *, refuse: bool = True, label: str | None = None) -> AppArgs:
        """Parse ``args`` (again: after an in-place change) and keep the model.

        ``refuse`` raises on policy problems (``deployments.config.checks``) too.
        """
        self._parsed = parse_app_args(self.args, self.where, refuse=refuse, label=label)
        return self._parsed

    @property
    def parsed(self) -> AppArgs:
        """The validated args (parsed on first use, refusing policy problems)."""
        return self._parsed if self._parsed is not None else self.parse()


# Serve's own default bind address for a config file (ray.serve.schema.HTTPOptionsSchema:
# what `serve deploy` and KubeRay use when http_options.host is absent). `dsv4-serve run`
# uses the same, so one file binds one address whichever launcher runs it.
SERVE_DEFAULT_HOST = "0.0.0.0"  # noqa: S104  # Serve's default, named to refuse it


class HTTPOptions(_Open):
    host: str = SERVE_DEFAULT_HOST
    port: int = Field(default=8000, ge=1, le=65535)


class ServeConfig(_Open):
    """A Serve config file: ``http_options`` and ``applications``."""

    http_options: HTTPOptions = Field(default_factory=HTTPOptions)
    applications: list[ServeApplication] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_routes(self) -> ServeConfig:
        names = [a.name for a in self.applications]
        routes = [a.route_prefix for a in self.applications if a.route_prefix]
        for label, values in (("name", names), ("route_prefix", routes)):
            dupes = sorted({v for v in values if values.count(v) > 1})
            if dupes:
                raise ValueError(
                    f"applications[].{label} {dupes} used more than once; Serve needs "
                    f"each {label} unique. Fix: rename one of them."
                )
        return self

    def replica_ports(self) -> list[tuple[ServeApplication, int]]:
        """Our applications whose replicas answer on a port of their own
        (``http.replica_port``); ``check_replica_ports`` has vetted them."""
        return [(a, p.http.replica_port) for a, p in self.ours()
                if p.http.replica_port is not None]

    def check_replica_ports(self) -> None:
        """``http.replica_port`` next to Serve's options: not the proxy's port, one
        application per port (replicas sharing a port must serve the same app), and at
        route prefix "/" (a replica's own listener serves the app at its root)."""
        seen: dict[int, str] = {}
        for app, port in self.replica_ports():
            where = f"{app.where}.http.replica_port={port}"
            if port == self.http_options.port:
                raise ValueError(f"{where} is http_options.port, where Serve's proxy listens. "
                                 "Fix: give the proxy or the replicas another port.")
            if port in seen:
                raise ValueError(f"{where} is also applications[{seen[port]}]'s: replicas "
                                 "sharing a port must serve one app. Fix: one port per app.")
            if (app.route_prefix or "/") != "/":
                raise ValueError(f"{where} with route_prefix {app.route_prefix!r}: a "
                                 "replica's own port serves its app at /. Fix: route_prefix "
                                 "/ or remove http.replica_port.")
            seen[port] = app.name

    def ingress(self) -> str:
        """The one door of the cluster (``http.ingress``): HAProxy is a cluster-wide Ray
        setting, so every application of one config must ask for the same."""
        doors = {a.name: p.http.ingress for a, p in self.ours()}
        if len(set(doors.values())) > 1:
            listed = ", ".join(f"{name}: {door}" for name, door in doors.items())
            raise ValueError(f"applications ask for different http.ingress ({listed}): Ray's "
                             "HAProxy is on or off for the whole cluster. Fix: one value "
                             "in every application.")
        return next(iter(doors.values()), "serve_proxy")

    def ours(self) -> list[tuple[ServeApplication, AppArgs]]:
        """Our applications with their validated args (parsed once, kept)."""
        return [(a, a.parsed) for a in self.applications if a.is_ours]
