"""A steady background load of a given share of one core, for what-if runs.

The 2-node stand-in keeps ~0.07 cores of Ray's and Serve's daemons busy at rest
(docs/benchmarks.md §2h). Run this beside plain `vllm serve`'s arm to see what that much
background costs an engine that needs both cores, with no Ray in it:

    python -m benchmarks.background_load --cores 0.07 &
    flock /tmp/dsv4-heavy.lock python -m benchmarks.serving_overhead --arms vllm ...
    kill %1

It spins ``cores x period`` seconds of every ``period``, then sleeps: small, frequent
wake-ups, like the daemons' timers.
"""

from __future__ import annotations

import argparse
import time


def burn(cores: float, period_s: float, until: float) -> None:
    """Busy ``cores`` of one core, in slices of ``period_s``, until ``until`` (monotonic)."""
    spin = period_s * cores
    while time.monotonic() < until:
        end = time.perf_counter() + spin
        while time.perf_counter() < end:
            pass
        time.sleep(period_s - spin)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cores", type=float, required=True,
                        help="share of one core to keep busy, 0 < cores < 1")
    parser.add_argument("--period-ms", type=float, default=20.0)
    parser.add_argument("--seconds", type=float, default=3600.0, help="stop after this long")
    args = parser.parse_args()
    if not 0 < args.cores < 1:
        parser.error(f"--cores={args.cores}: expected a share of one core in (0, 1)")
    burn(args.cores, args.period_ms / 1000, time.monotonic() + args.seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
