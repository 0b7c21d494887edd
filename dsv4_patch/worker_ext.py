"""Worker extension: the worker's own KV cache specs, as plain JSON-safe dicts.

Passed to vLLM as ``worker_extension_cls="dsv4_patch.worker_ext.DSv4WorkerExtension"``;
vLLM mixes it into every worker class, and ``collective_rpc("dsv4_kv_specs")``
calls it on each rank. Only the workers' specs tell the truth: the front-end and
engine core keep ``cache_dtype="auto"`` while workers resolve it to fp8_ds_mla.
Plain dicts only: vLLM spec objects hold ``torch.dtype`` and kill the engine-core
output thread when sent back through ``collective_rpc`` (docs/design.md, section 4).
"""

from __future__ import annotations

import os
import sys
from enum import Enum
from fractions import Fraction
from typing import Any

from dsv4_patch import record
from dsv4_patch.patch import Read

# Spec attributes we report, in the order a reader scans them.
SPEC_FIELDS = (
    "cache_dtype_str",
    "page_size_bytes",
    "real_page_size_bytes",
    "block_size",
    "head_size",
    "num_kv_heads",
    "dtype",
    "alignment",
    "sliding_window",
    "cache_role",
    "model_version",
)


def _plain(value: Any) -> Any:
    """JSON-safe form of a spec attribute (torch.dtype, Enum, Fraction -> str/int)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Enum):
        return _plain(value.value)
    if isinstance(value, Fraction):
        return int(value) if value.denominator == 1 else str(value)
    return str(value)


def spec_to_dict(layer: str, spec: Any) -> dict[str, Any]:
    """One KV cache spec as a flat dict; missing attributes are None."""
    row: dict[str, Any] = {"layer": layer, "spec_type": type(spec).__name__}
    for name in SPEC_FIELDS:
        row[name] = _plain(getattr(spec, name, None))
    ratio = getattr(spec, "tokens_per_state", None)
    row["compress_ratio"] = _plain(ratio) if ratio not in (None, -1) else None
    return row


def ray_node_id() -> str | None:
    """This process's Ray node id when it is a Ray worker (Ray executor), else None.

    Read from an already-imported Ray only: dsv4_patch never imports Ray, and a
    worker started by vLLM's multiprocess executor is not a Ray process at all.
    """
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return str(ray.get_runtime_context().get_node_id())


# The method names callers pass to ``collective_rpc``: this module owns the contract.
KV_SPECS_METHOD = "dsv4_kv_specs"
KV_TRANSFER_METHOD = "dsv4_kv_transfer"


class DSv4WorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    def dsv4_kv_specs(self) -> dict[str, Any]:
        """This rank's KV specs, its rank/pid, and this process's patch record."""
        specs = self.get_kv_cache_spec()  # type: ignore[attr-defined]  # mixed into vLLM's worker, which defines it
        rec = record.current()
        return {
            "rank": int(getattr(self, "rank", 0)),
            "pid": os.getpid(),
            "node_id": ray_node_id(),
            "specs": [spec_to_dict(layer, spec) for layer, spec in sorted(specs.items())],
            "patch_record": rec.as_dict() if rec is not None else None,
        }

    def dsv4_kv_transfer(self) -> dict[str, Any]:
        """This rank's live KV connector: what a P/D transfer depends on (plain JSON).

        Reads (never changes) vLLM internals of the NIXL connector worker, vLLM 0.29-0.32:
        ``vllm.distributed.kv_transfer.kv_transfer_state.get_kv_transfer_group()`` and its
        ``connector_worker`` (``block_len_per_layer``, ``kv_cache_layout``,
        ``backend_name``, ``block_size``, ``compat_hash``, ``_TRANSFER_MODE``); the
        connector version is ``nixl.metadata.NIXL_CONNECTOR_VERSION``. Attributes a
        release lacks come back None and are named in ``reason``, so the P/D check
        reports the field instead of passing it.
        """
        return connector_facts(self)


def connector_facts(worker: Any) -> dict[str, Any]:
    """The connector fields of ``DSv4WorkerExtension.dsv4_kv_transfer``."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    out: dict[str, Any] = {"rank": int(getattr(worker, "rank", 0)), "connector": None}
    if not kv_transfer_state.has_kv_transfer_group():
        return out | {"reason": "no KV connector in this engine"}
    group = kv_transfer_state.get_kv_transfer_group()
    out["connector"] = type(group).__name__
    config = getattr(group, "_kv_transfer_config", None) or getattr(
        getattr(worker, "vllm_config", None), "kv_transfer_config", None)
    out["kv_role"] = getattr(config, "kv_role", None)
    extra = getattr(config, "kv_connector_extra_config", None) or {}
    out["enforce_handshake_compat"] = bool(extra.get("enforce_handshake_compat", True))
    inner = getattr(group, "connector_worker", None)
    missing = []
    for key, attr in (("region_block_lens", "block_len_per_layer"),
                      ("kv_cache_layout", "kv_cache_layout"), ("backend_name", "backend_name"),
                      ("kernel_block_size", "block_size"), ("nixl_compat_hash", "compat_hash"),
                      ("transfer_mode", "_TRANSFER_MODE")):
        value = getattr(inner, attr, None)
        if value is None:
            missing.append(attr)
        out[key] = [int(v) for v in value] if isinstance(value, list) else _plain(value)
    backends = getattr(inner, "attn_backends", None) or []
    out["backend_names"] = sorted({b.get_name() for b in backends}) or (
        [out["backend_name"]] if out["backend_name"] else [])
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata

        out["connector_version"] = int(metadata.NIXL_CONNECTOR_VERSION)
    except (ImportError, AttributeError) as exc:
        missing.append(f"NIXL_CONNECTOR_VERSION ({exc})")
        out["connector_version"] = None
    if missing:
        out["reason"] = f"not readable on this vLLM: {', '.join(missing)}"
    return out


NIXL_WORKER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
NIXL_FACTS = ("block_len_per_layer", "kv_cache_layout", "backend_name", "block_size",
              "compat_hash", "attn_backends")


def _connector_probe() -> str | None:
    """What ``connector_facts`` would not find in the installed vLLM (None: all there)."""
    import importlib
    import inspect

    try:
        state = importlib.import_module("vllm.distributed.kv_transfer.kv_transfer_state")
        metadata = importlib.import_module(
            "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata")
        worker = importlib.import_module(NIXL_WORKER)
    except ImportError as exc:
        return f"cannot import the NIXL connector: {exc}"
    missing = [n for n in ("has_kv_transfer_group", "get_kv_transfer_group")
               if not hasattr(state, n)]
    missing += [] if hasattr(metadata, "NIXL_CONNECTOR_VERSION") else ["NIXL_CONNECTOR_VERSION"]
    cls = getattr(worker, "NixlBaseConnectorWorker", None)
    if cls is None:
        return f"{NIXL_WORKER} has no NixlBaseConnectorWorker"
    source = inspect.getsource(cls)
    missing += [f"NixlBaseConnectorWorker.{n}" for n in NIXL_FACTS if f"self.{n}" not in source]
    missing += [] if hasattr(cls, "_TRANSFER_MODE") else ["NixlBaseConnectorWorker._TRANSFER_MODE"]
    return f"missing: {', '.join(missing)} (those fields read None)" if missing else None


CONNECTOR_READ = Read(
    name="pd.connector_facts",
    module=NIXL_WORKER,
    target="vllm.distributed.kv_transfer.kv_transfer_state:get_kv_transfer_group; "
           "the group's connector_worker (NixlBaseConnectorWorker) "
           + ", ".join(NIXL_FACTS) + ", _TRANSFER_MODE; nixl.metadata:NIXL_CONNECTOR_VERSION",
    why="the P/D check (deployments.pd.compat) compares what a KV transfer depends on: "
        "per-region block lengths, layout, kernel block size, backends, connector version "
        "and transfer mode are known only to the live connector in each worker",
    how="DSv4WorkerExtension.dsv4_kv_transfer reads them with getattr (collective_rpc); "
        "an attribute a release lacks reads None and is named in `reason`, so the check "
        "reports that field instead of passing it",
    upstream="NIXL exposes these only through its handshake (compat hash), not per field",
    affected="vLLM 0.32.0 CPU with NIXL 1.5.1 (checked); GPU 0.29 probed, not assumed",
    remove_when="vLLM's connector exposes its transfer layout publicly (e.g. in the "
                "handshake metadata per field)",
    probe=_connector_probe,
)
