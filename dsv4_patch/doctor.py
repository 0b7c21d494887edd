"""``dsv4-serve doctor``: what the patch will do on this machine, before serving.

Reports the vLLM version, the platform, the KV layout DeepSeek-V4 will use, the
resolution of a requested ``kv_cache_dtype``, whether the plugin entry point is
installed and allowed by ``VLLM_PLUGINS``, and, per documented patch, whether
the installed vLLM needs it (by probing the real symbol, like the plugin does).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from importlib.metadata import entry_points
from typing import Any

from dsv4_patch import __version__, patches, rules
from dsv4_patch.node import NodeInfo, canonicalize, probe_node

PLUGIN_NAME = "dsv4_patch"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-cache-dtype", default="auto", help="dtype to resolve (default auto)")
    parser.add_argument("--attention-backend", default=None, help="explicit attention backend")
    parser.add_argument("--platform", default=None, help="override the probed platform")
    parser.add_argument(
        "--capability", default=None, help="override the compute capability, e.g. 10.0"
    )
    parser.add_argument("--json", action="store_true", help="print JSON")


def plugin_status() -> dict[str, Any]:
    """Is the entry point installed, and does VLLM_PLUGINS let vLLM load it?"""
    installed = any(ep.name == PLUGIN_NAME for ep in entry_points(group="vllm.general_plugins"))
    allow = os.environ.get("VLLM_PLUGINS")
    allowed = allow is None or PLUGIN_NAME in [p.strip() for p in allow.split(",")]
    return {"installed": installed, "VLLM_PLUGINS": allow, "allowed": allowed}


def probe_patches() -> list[dict[str, str]]:
    """Import each patch target and report whether the installed vLLM needs it."""
    rows = []
    for spec in patches.PATCHES:
        try:
            module = importlib.import_module(spec.module)
        except ImportError as exc:
            rows.append({"name": spec.name, "needed": "no", "why": f"{spec.module}: {exc}"})
            continue
        needed, why = _needs(spec, module)
        rows.append({"name": spec.name, "needed": needed, "why": why, "target": spec.target})
    return rows


def _needs(spec: patches.PatchSpec, module: Any) -> tuple[str, str]:
    if spec is patches.RESOLVER_PATCH:
        resolver = getattr(module, patches.RESOLVER_NAME, None)
        if resolver is None:
            return "no", "resolver not present"
        if hasattr(resolver, patches.PATCHED_MARK):
            resolver = getattr(resolver, patches.PATCHED_MARK)
        failure = patches.probe_resolver(resolver)
        return ("yes", failure) if failure else ("no", "resolver maps auto -> fp8_ds_mla")
    if spec is patches.PARENT_WATCH:
        if patches.upstream_parent_monitor():
            return "no", f"vLLM has {patches.UPSTREAM_PARENT_MONITOR}"
        return "yes", "the engine core does not watch its parent; applied in spawned processes"
    backend = getattr(module, patches.SM120_CLASS, None)
    if backend is None:
        return "no", "SM120 backend not present"
    check = getattr(backend.supports_combination, patches.PATCHED_MARK, None)
    rejects = patches._sm120_rejects_auto(backend) if check is None else True
    return ("yes", "validator rejects auto on SM12x") if rejects else ("no", "accepts auto")


def probe_cpu_ops(node: NodeInfo) -> dict[str, Any] | None:
    """On the CPU platform: which implementation each DeepSeek-V4 CPU op runs here.

    The same decision ``cpu_ops.install()`` makes in the engine's worker (native kernel
    where the loaded library has it, ours otherwise, ``DSV4_CPU_OPS=torch`` forcing ours).
    """
    if node.platform != "cpu":
        return None
    from dsv4_patch import cpu_ops

    try:
        mode = cpu_ops.requested_mode()
    except ValueError as exc:
        return {"error": str(exc)}
    impls = cpu_ops.probe()
    return {"mode": mode, "library": cpu_ops._loaded_library(), "ops": impls}


def _node(args: argparse.Namespace) -> NodeInfo:
    node = probe_node(args.attention_backend)
    if args.platform or args.capability:
        cap = tuple(int(x) for x in args.capability.split(".")) if args.capability else None
        node = NodeInfo(args.platform or node.platform, cap, node.attention_backend, "declared")  # type: ignore[arg-type]
    return node


def report(args: argparse.Namespace) -> dict[str, Any]:
    """Everything the doctor knows, as JSON-safe data."""
    from dsv4_patch.plugin import _vllm_version

    node = _node(args)
    out: dict[str, Any] = {
        "dsv4_serve": __version__,
        "vllm_version": _vllm_version(),
        "node": node.as_dict(),
        "plugin": plugin_status(),
        "patches": probe_patches(),
        "cpu_ops": probe_cpu_ops(node),
    }
    try:
        canon = canonicalize({"kv_cache_dtype": args.kv_cache_dtype}, node)
    except (rules.LayoutError, rules.KVCacheDtypeError) as exc:
        out["resolution"] = {"requested": args.kv_cache_dtype, "error": str(exc)}
        return out
    res = canon.resolution
    out["layout"] = {
        "layout": canon.decision.layout.value,
        "backend": canon.decision.backend,
        "reason": canon.decision.reason,
    }
    out["resolution"] = {
        "requested": args.kv_cache_dtype,
        "engine_dtype": res.engine_dtype,
        "cache_dtype_str": res.cache_dtype_str,
        "storage": res.storage.value,
        "reason": res.reason,
        "stock_vllm_crashes": rules.stock_vllm_crashes_on(
            out["vllm_version"], canon.decision.layout, args.kv_cache_dtype
        ),
    }
    return out


def render(data: dict[str, Any]) -> str:
    """The report in plain words."""
    node, plugin = data["node"], data["plugin"]
    cap = node["compute_capability"]
    lines = [
        f"dsv4-serve {data['dsv4_serve']} on vLLM {data['vllm_version']}",
        f"platform: {node['platform']}"
        + (f", compute capability {cap}" if cap else "")
        + (f", attention backend {node['attention_backend']}" if node["attention_backend"] else ""),
        "plugin entry point: "
        + ("installed" if plugin["installed"] else "MISSING (pip install dsv4-serve)")
        + ("" if plugin["allowed"] else f"; DISABLED by VLLM_PLUGINS={plugin['VLLM_PLUGINS']!r}"),
    ]
    if "layout" in data:
        lay = data["layout"]
        lines.append(f"KV layout: {lay['layout']} via {lay['backend']} ({lay['reason']})")
    res = data["resolution"]
    if "error" in res:
        lines.append(f"kv_cache_dtype={res['requested']}: REFUSED: {res['error']}")
    else:
        lines.append(
            f"kv_cache_dtype={res['requested']} -> engine {res['engine_dtype']}, workers store "
            f"{res['cache_dtype_str']} ({res['storage']})"
        )
        if res["stock_vllm_crashes"]:
            lines.append("  stock vLLM of this version crashes on this without the plugin")
    for row in data["patches"]:
        lines.append(f"patch {row['name']}: needed={row['needed']} ({row['why']})")
    lines.extend(_render_cpu_ops(data.get("cpu_ops")))
    return "\n".join(lines)


def _render_cpu_ops(ops: dict[str, Any] | None) -> list[str]:
    if ops is None:
        return []
    if "error" in ops:
        return [f"cpu ops: REFUSED: {ops['error']}"]
    by_impl: dict[str, list[str]] = {}
    for name, impl in ops["ops"].items():
        by_impl.setdefault(impl, []).append(name)
    lines = [f"cpu ops ({len(ops['ops'])}, DSV4_CPU_OPS={ops['mode']}, loaded "
             f"{ops['library']}):"]
    for impl, names in sorted(by_impl.items()):
        lines.append(f"  {impl}: {', '.join(names)}")
    return lines


def main(args: argparse.Namespace) -> int:
    data = report(args)
    sys.stdout.write((json.dumps(data, indent=2) if args.json else render(data)) + "\n")
    return 1 if "error" in data["resolution"] else 0
