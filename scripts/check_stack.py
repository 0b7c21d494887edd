"""Import-check one GPU stack on a CPU host (`make check-stacks`): run inside that
stack's venv, installed from scripts/locks/<stack>.txt plus this package.

vLLM, Ray Serve LLM and nixl import without a GPU, so what a GPU node would fail on
first -- a missing module, an ABI break between the locked wheels, the plugin's entry
point -- fails here too. Writes its rows into benchmarks/results/stack_imports.json
(other stacks' rows kept) and exits 1 if any check failed. Stdlib only.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "benchmarks" / "results" / "stack_imports.json"
COLUMNS = ["stack", "check", "result", "seconds", "detail"]
DISTS = ("vllm", "torch", "ray", "flashinfer-python", "nixl", "nixl-cu12", "dsv4-serve")
# Ray Serve LLM: the public module and the server classes the project builds on.
RAY_MODULES = ("ray.serve.llm", "ray.llm._internal.serve.core.server.llm_server",
               "ray.llm._internal.serve.serving_patterns.data_parallel.dp_server",
               "ray.llm._internal.serve.serving_patterns.prefill_decode.builder")
# The V4 family's model modules in vLLM's tree, per architecture (their presence is
# version dependent: V4.1 exists from vLLM 0.30).
MODEL_ARCHS = {"gpu": "DeepseekV4ForCausalLM", "gpu-v41": "DeepseekV41ForCausalLM",
               "gpu-v41-034": "DeepseekV41ForCausalLM"}


def model_class(arch: str) -> str:
    """Import the module vLLM's registry maps `arch` to and return the class's path."""
    from vllm.model_executor.models.registry import _VLLM_MODELS  # vLLM's own table

    module, cls = _VLLM_MODELS[arch]
    for prefix in ("vllm.models.", "vllm.model_executor.models."):
        try:
            mod = importlib.import_module(module if "." in module else prefix + module)
        except ModuleNotFoundError as exc:
            if exc.name is None or not exc.name.startswith(prefix.rstrip(".")):
                raise
            continue
        return f"{mod.__name__}.{getattr(mod, cls).__name__}"
    raise ModuleNotFoundError(f"{arch}: no module {module!r} under vllm.models/"
                              "vllm.model_executor.models")


def plugin() -> str:
    """vLLM finds dsv4_patch through its entry-point group and can call it."""
    found = [e for e in metadata.entry_points(group="vllm.general_plugins")
             if e.name == "dsv4_patch"]
    if not found:
        raise LookupError("no entry point dsv4_patch in group vllm.general_plugins: "
                          "is dsv4-serve installed in this venv?")
    register = found[0].load()
    if not callable(register):
        raise TypeError(f"{found[0].value} is {type(register).__name__}, not callable")
    return found[0].value


def nixl() -> str:
    from nixl._api import nixl_agent, nixl_agent_config  # noqa: F401

    return "nixl._api.nixl_agent"


def checks(stack: str) -> list[tuple[str, Callable[[], str]]]:
    """(name, check) pairs; a check returns a detail or raises."""
    out: list[tuple[str, Callable[[], str]]] = [
        ("import vllm", lambda: importlib.import_module("vllm").__file__ or "")]
    arch = MODEL_ARCHS[stack]
    out.append((f"model class {arch}", lambda: model_class(arch)))
    out.append(("plugin entry point dsv4_patch", plugin))
    out.append(("import nixl", nixl))
    for name in RAY_MODULES:
        out.append((f"import {name}", lambda n=name: importlib.import_module(n).__name__))
    out.append(("import deployments.serving.server",
                lambda: importlib.import_module("deployments.serving.server").__name__))
    return out


def run(stack: str) -> list[list[object]]:
    rows: list[list[object]] = []
    for name, check in checks(stack):
        start = time.monotonic()
        try:
            detail, result = check(), "pass"
        except Exception as exc:  # recorded as a failed row and the exit status
            detail, result = f"{type(exc).__name__}: {exc}", "fail"
            traceback.print_exc()
        rows.append([stack, name, result, round(time.monotonic() - start, 1), detail])
        print(f"{stack}: {name}: {result} ({detail})", flush=True)
    return rows


def versions() -> dict[str, str]:
    found = {}
    for dist in DISTS:
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = "absent"
    return found


def host() -> dict[str, object]:
    flags: list[str] = []
    model = platform.processor()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and not flags:
            model = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            flags = sorted(f for f in have if f in {"avx2", "avx512f", "avx512_bf16"}
                           or f.startswith("amx"))
            break
    return {"cpu_model": model, "flags": flags, "cores": os.cpu_count()}


def write(stack: str, rows: list[list[object]]) -> None:
    old = json.loads(RESULT.read_text()) if RESULT.exists() else {"rows": [], "inputs": {}}
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True, check=False).stdout.strip()
    inputs = dict(old.get("inputs", {}))
    inputs[stack] = {"lock": f"scripts/locks/{stack}.txt",
                     "python": platform.python_version(), **versions()}
    data = {
        "benchmark": "stack_imports",
        "title": "GPU stacks import on a CPU host",
        "what": "each GPU stack installed from its lock (--require-hashes) into a fresh "
                "venv, then vLLM, the DeepSeek-V4 model class, the dsv4_patch plugin entry "
                "point, nixl and Ray Serve LLM's server modules imported without a GPU",
        "command": "make check-stacks",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "host": host(),
        "inputs": inputs,
        "columns": COLUMNS,
        "rows": [r for r in old.get("rows", []) if r[0] != stack] + rows,
        "notes": "CPU host, no CUDA driver: this proves the locked wheels resolve and "
                 "import together, not that kernels run. Not in CI (GBs of downloads).",
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(data, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stack", choices=sorted(MODEL_ARCHS))
    stack = parser.parse_args().stack
    rows = run(stack)
    write(stack, rows)
    return 0 if all(r[2] == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
