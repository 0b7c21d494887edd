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

from dsv4_patch import __version__, registry, rules
from dsv4_patch.node import NodeInfo, probe_node, resolve_on_node
from dsv4_patch.patch import APPLIED, Patch, Verdict, not_here, target_module
from dsv4_patch.version import vllm_version

PLUGIN_NAME = rules.PLUGIN_NAME


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
    allowed = rules.plugin_allowed(allow)
    return {"installed": installed, "VLLM_PLUGINS": allow, "allowed": allowed}


_PLUGIN_DOES = {
    "yes": "the plugin applies this patch",
    "no": "the plugin leaves it alone",
    "unknown": "the plugin records error and leaves it alone",
}


def probe_patches() -> list[dict[str, str]]:
    """Run every registry patch's own gate and probe on the installed vLLM, as the plugin does.

    One loop over ``registry.all_patches()``: a closed gate or a release without the
    patch's modules is ``needed=no``; a probe that cannot run here is ``needed=unknown``
    (the plugin records ``error``); a probe's ``PatchError`` (a setting that stops the
    model) is ``needed=unknown`` with the error.
    """
    rows: list[dict[str, Any]] = []
    gates: dict[str, Any] = {}
    for spec in registry.all_patches():
        row = {"name": spec.name, "target": spec.target, "affected": spec.affected}
        verdict = _verdict(spec, gates)
        needed = {True: "yes", False: "no", None: "unknown"}[verdict.needed]
        rows.append({**row, "needed": needed, "why": verdict.reason,
                     "plugin_does": _PLUGIN_DOES[needed]})
    return rows


def probe_reads() -> list[dict[str, str | bool]]:
    """Every registry read of vLLM internals with its probe (``registry.all_reads``)."""
    rows: list[dict[str, str | bool]] = []
    for read in registry.all_reads():
        try:
            missing = read.probe()
        except Exception as exc:  # reported, like a patch probe that cannot run here
            missing = f"probe could not run: {type(exc).__name__}: {exc}"
        rows.append({"name": read.name, "target": read.target, "affected": read.affected,
                     "present": missing is None, "detail": missing or "present",
                     "how": read.how})
    return rows


def _verdict(spec: Patch, gates: dict[Any, str | None]) -> Verdict:
    skip = not_here(spec, gates)  # the plugin's own precondition, word for word
    if skip is not None:
        return Verdict(False, skip)
    try:
        module = importlib.import_module(target_module(spec))
        done = vars(module).get(APPLIED, {}).get(spec.name)
        if done is not None:  # the plugin ran in this process: say what it did
            return Verdict(True, done.reason)
        return spec.probe(module)
    except Exception as exc:  # reported as unknown, like the plugin's error record
        return Verdict(None, f"probe could not run: {type(exc).__name__}: {exc}")


def cpu_path() -> dict[str, str]:
    """Whether this vLLM has DeepSeek-V4's CPU path (else the CPU fallbacks step aside)."""
    from dsv4_patch.patches.cpu import gate

    missing = gate.cpu_path_missing()
    if missing is None:
        return {"present": "yes", "why": f"{gate.CPU_DSV4_MODULE} ships with this vLLM"}
    return {"present": "no", "why": missing + "; the CPU fallbacks and ops are skipped"}


def probe_cpu_ops(node: NodeInfo) -> dict[str, Any] | None:
    """On the CPU platform: which implementation each DeepSeek-V4 CPU op runs here.

    The same decision ``cpu_ops.install()`` makes in the engine's worker (native kernel
    where the loaded library has it, ours otherwise, ``DSV4_CPU_OPS=torch`` forcing ours).
    """
    if node.platform != "cpu":
        return None
    from dsv4_patch.patches.cpu import gate
    from dsv4_patch.patches.cpu import ops as cpu_ops

    missing = gate.cpu_path_missing()
    if missing is not None:  # 0.20-0.29: the plugin skips the ops there too
        return {"skipped": missing}

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
        node = NodeInfo(args.platform or node.platform, cap, node.attention_backend, "declared")  # type: ignore[arg-type]  # the parsed capability is tuple[int, ...]; NodeInfo wants a pair
    return node


def report(args: argparse.Namespace) -> dict[str, Any]:
    """Everything the doctor knows, as JSON-safe data."""
    node = _node(args)
    out: dict[str, Any] = {
        "dsv4_serve": __version__,
        "vllm_version": vllm_version(),
        "node": node.as_dict(),
        "plugin": plugin_status(),
        "patches": probe_patches(),
        "reads": probe_reads(),
        "cpu_ops": probe_cpu_ops(node),
    }
    out["v41"] = v41_status(out["vllm_version"], node)
    out["release_rules"] = release_status(out["vllm_version"], node)
    if node.platform == "cpu":
        out["cpu_path"] = cpu_path()
    try:
        resolved = resolve_on_node({"kv_cache_dtype": args.kv_cache_dtype}, node)
    except (rules.LayoutError, rules.KVCacheDtypeError) as exc:
        out["resolution"] = {"requested": args.kv_cache_dtype, "error": str(exc)}
        return out
    res = resolved.resolution
    out["layout"] = {
        "layout": resolved.decision.layout.value,
        "backend": resolved.decision.backend,
        "reason": resolved.decision.reason,
    }
    out["resolution"] = {
        "requested": args.kv_cache_dtype,
        "engine_dtype": res.engine_dtype,
        "cache_dtype_str": res.cache_dtype_str,
        "storage": res.storage.value,
        "reason": res.reason,
        "stock_vllm_crashes": rules.stock_vllm_crashes_on(
            out["vllm_version"], resolved.decision.layout, args.kv_cache_dtype
        ),
    }
    return out


def v41_status(version: str | None, node: NodeInfo) -> str:
    """What this vLLM does with DeepSeek-V4.1, and that the plugin leaves it alone."""
    if version is None or rules.parse_version(version)[:2] < rules.FIRST_V41_VLLM:
        return (f"DeepSeek-V4.1: none in vLLM {version} (first: 0.30); the V4.1 stack is "
                "pip install 'dsv4-serve[gpu-v41]' (Ray Serve 2.60.0 + vLLM 0.33.0)")
    try:
        record = rules.v41_record(node.platform, node.capability, node.attention_backend,
                                  "auto", release=version)
    except (rules.LayoutError, rules.KVCacheDtypeError) as exc:
        return f"DeepSeek-V4.1: left alone by the plugin (vLLM {version} has it); here: {exc}"
    return (f"DeepSeek-V4.1: left alone by the plugin (vLLM {version}'s own resolver is right); "
            f"auto here -> {record.label()} via {record.backend}")


def release_status(version: str | None, node: NodeInfo) -> str:
    """Which release's rules judge this node, and what that release defaults to."""
    if version is None:
        return "release rules: vLLM version unknown; predictions are not made"
    known = version.split("+")[0] in rules.KNOWN_RELEASES
    rel = rules.release_rules(version)
    text = (f"release rules: vLLM {version} "
            + ("(read from its wheel)" if known else
               f"(not a release read here; judged by the newest rules, {rules.NEWEST_RELEASE}'s "
               "-- check docs/kv-table.md after upgrading)")
            + f"; NIXL_CONNECTOR_VERSION {rel.nixl_connector_version}; "
            f"gpu_memory_utilization default "
            f"{rules.default_gpu_memory_utilization(version, node.platform):g}")
    hazard = rules.nixl_region_dedup_hazard(version)
    if hazard:
        text += f"; WARNING (DeepSeek-V4.1 P/D): {hazard}"
    return text


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
        lines.append(f"patch {row['name']}: needed={row['needed']} ({row['why']}); "
                     f"{row['plugin_does']}")
    for row in data.get("reads", []):
        lines.append(f"read {row['name']}: "
                     + ("present" if row["present"] else f"MISSING ({row['detail']})"))
    if "cpu_path" in data:
        lines.append(f"CPU DeepSeek-V4 path: {data['cpu_path']['present']} "
                     f"({data['cpu_path']['why']})")
    if "v41" in data:
        lines.append(data["v41"])
    if "release_rules" in data:
        lines.append(data["release_rules"])
    lines.extend(_render_cpu_ops(data.get("cpu_ops")))
    return "\n".join(lines)


def _render_cpu_ops(ops: dict[str, Any] | None) -> list[str]:
    if ops is None:
        return []
    if "error" in ops:
        return [f"cpu ops: REFUSED: {ops['error']}"]
    if "skipped" in ops:
        return [f"cpu ops: skipped ({ops['skipped']})"]
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
