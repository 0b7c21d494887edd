"""Prefill/decode compatibility: may this prefill replica hand its KV pages to that decode one?

Pure functions over the typed replica answers (``deployments.control.wire.ReplicaSpec`` with
its ``TransferSpec``): no Ray, no vLLM, so they are tested on recorded data.

Why our own check. vLLM's NIXL handshake compares one hash
(``vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py``,
``compute_nixl_compatibility_hash``) and checks block size and layout only once a
request is in flight. That hash covers the model *path string*: a byte-identical copy
of the model at another path fails the handshake and every request gets a 500, so
recipes turn the hash off (``enforce_handshake_compat: false``), and then nothing checks
anything. Here every pair is compared on what a transfer depends on, by content:

* the model's identity: sha256 of ``config.json`` and the tokenizer files, not their path;
* the per-layer KV fingerprint (cache dtype, page bytes, block size, head size,
  compress ratio of every layer: ``deployments.control``);
* group block sizes, NIXL's per-region block lengths and KV cache layout, the
  kernel block size;
* the resolved cache dtypes, the attention backend names;
* the connector, its version and transfer mode (pull/READ vs push/WRITE);
* the vLLM version.

A decode replica routes only to the prefill replicas proven compatible with it
(``allowed``); a prefill replica that did not answer is not proven, so it gets nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from deployments.control.prediction import describe_differences, peer_differences
from deployments.control.wire import PDDifference, PDPool, PDReport, PDVerdict, ReplicaSpec, State
from dsv4_patch import rules

# The files that decide what token ids and KV pages mean. Weights are left out on
# purpose: they are gigabytes, and two different checkpoints of one architecture
# still exchange pages that fit (garbage numerically, which no page check can see).
MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt",
               "chat_template.jinja", "generation_config.json")
PRODUCER_ROLES = frozenset({"kv_producer", "kv_both"})
CONSUMER_ROLES = frozenset({"kv_consumer", "kv_both"})
SHOWN = 3


def model_identity(model_dir: str | Path) -> tuple[str | None, list[str]]:
    """(sha256 over the model's config and tokenizer files by name and content, files).

    None when the directory has no ``config.json``: an identity that cannot be read is
    not proven, and the pair is then reported as differing on ``model_hash``.
    """
    root = Path(model_dir)
    if not (root / "config.json").is_file():
        return None, []
    digest = hashlib.sha256()
    files = []
    for name in MODEL_FILES:
        path = root / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
            files.append(name)
    return "sha256:" + digest.hexdigest(), files


def _fields(spec: ReplicaSpec) -> dict[str, Any]:
    t = spec.transfer
    assert t is not None
    return {
        "model_hash": t.model_hash,
        "fingerprint": spec.fingerprint,
        "block_sizes": spec.block_sizes,
        "region_block_lens": t.region_block_lens,
        "kv_cache_layout": t.kv_cache_layout,
        "kernel_block_size": t.kernel_block_size,
        "cache_dtypes": spec.cache_dtypes,
        "backend_names": t.backend_names,
        "connector": t.connector,
        "connector_version": t.connector_version,
        "transfer_mode": t.transfer_mode,
        "vllm_version": spec.versions.get("vllm"),
        # The record its own node writes (DeepSeek-V4.1: per GPU); None on V4 predictions.
        "kv_record": spec.prediction.storage if spec.prediction.node_type else None,
    }


# Fields where "both unknown" is no proof either: None never matches.
MUST_BE_KNOWN = frozenset({"model_hash", "connector", "transfer_mode", "vllm_version"})


def compare(prefill: ReplicaSpec, decode: ReplicaSpec) -> list[PDDifference]:
    """Every field on which ``prefill`` cannot hand its KV pages to ``decode``."""
    def diff(field: str, p: Any, d: Any, **extra: Any) -> PDDifference:
        return PDDifference(field=field, prefill_replica=prefill.replica_id,
                            decode_replica=decode.replica_id, prefill=p, decode=d, **extra)

    missing = [(s, n) for s, n in ((prefill, "prefill"), (decode, "decode"))
               if s.transfer is None]
    if missing:
        return [diff("transfer", prefill.transfer is not None, decode.transfer is not None)]
    out = []
    assert prefill.transfer is not None and decode.transfer is not None
    if prefill.transfer.kv_role not in PRODUCER_ROLES:
        out.append(diff("kv_role", prefill.transfer.kv_role, decode.transfer.kv_role))
    elif decode.transfer.kv_role not in CONSUMER_ROLES:
        out.append(diff("kv_role", prefill.transfer.kv_role, decode.transfer.kv_role))
    mine, theirs = _fields(prefill), _fields(decode)
    for field, p in mine.items():
        d = theirs[field]
        unknown = field in MUST_BE_KNOWN and (p is None or d is None)
        if p == d and not unknown:
            continue
        layers = peer_differences(decode.layers, prefill.layers) \
            if field == "fingerprint" else []
        out.append(diff(field, p, d, layers=layers))
    return out


def describe(d: PDDifference) -> str:
    """One difference as a sentence that names the field, both replicas and both values."""
    text = (f"{d.field}: prefill {d.prefill_replica} has {_short(d.prefill)}, decode "
            f"{d.decode_replica} has {_short(d.decode)}")
    if d.layers:
        text += f" ({describe_differences(d.layers)})"
    if d.field == "vllm_version" and d.prefill and d.decode:
        nixl = rules.nixl_mismatch(str(d.prefill), str(d.decode))
        if nixl:
            text += f" ({nixl})"
    return text


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 90 else text[:90] + "..."


def judge(prefill: Sequence[ReplicaSpec], decode: Sequence[ReplicaSpec],
          pools: dict[str, PDPool], checked_at: float | None = None,
          compare_fn: Callable[[ReplicaSpec, ReplicaSpec], list[PDDifference]] = compare,
          ) -> PDReport:
    """The P/D verdict over every (prefill, decode) pair that answered.

    ``allowed`` is a whitelist: a decode replica routes only to prefill replicas
    compared with it and found equal on every field.
    """
    if not prefill or not decode:
        side = "prefill" if not prefill else "decode"
        return PDReport(verdict=PDVerdict.NOT_CHECKED, pools=pools, checked_at=checked_at,
                        message=f"no {side} replica has answered: no KV transfers until "
                        "both pools are checked")
    allowed: dict[str, list[str]] = {}
    differences: list[PDDifference] = []
    for d in decode:
        allowed[d.replica_id] = []
        for p in prefill:
            found = compare_fn(p, d)
            differences += found
            if not found:
                allowed[d.replica_id].append(p.replica_id)
    used = {p for ids in allowed.values() for p in ids}
    blocked = sorted(p.replica_id for p in prefill if p.replica_id not in used)
    stranded = sorted(d for d, ids in allowed.items() if not ids)
    if stranded:
        verdict = PDVerdict.INCOMPATIBLE
    elif differences:
        verdict = PDVerdict.PARTIAL
    else:
        verdict = PDVerdict.COMPATIBLE
    return PDReport(verdict=verdict, pools=pools, allowed=allowed, blocked_prefill=blocked,
                    differences=differences, checked_at=checked_at,
                    message=_message(verdict, differences, stranded, blocked))


def _message(verdict: PDVerdict, differences: Sequence[PDDifference],
             stranded: Sequence[str], blocked: Sequence[str]) -> str:
    if verdict is PDVerdict.COMPATIBLE:
        return "every prefill replica is KV-compatible with every decode replica"
    fields = sorted({d.field for d in differences})
    shown = "; ".join(describe(d) for d in differences[:SHOWN])
    more = f"; and {len(differences) - SHOWN} more" if len(differences) > SHOWN else ""
    head = (f"decode replica(s) {list(stranded)} have no compatible prefill replica and "
            "serve their requests alone (prefill on the decode engine, no KV transfer)"
            if stranded else f"prefill replica(s) {list(blocked)} get no requests")
    return (f"{head}; differing fields {fields}: {shown}{more}. Fix: give both pools the "
            "same model files, vLLM, connector and KV settings, or remove the odd replicas")


def pool_state(states: Sequence[State]) -> State:
    """The combined state of the pools: the worst of them."""
    for state in (State.DISAGREE, State.STALE, State.NOT_CHECKED, State.INCOMPLETE):
        if state in states:
            return state
    return State.AGREE


def combined_state(pools: State, verdict: PDVerdict) -> State:
    """The app's state: the pools' state, made ``disagree`` by any P/D difference."""
    if verdict in (PDVerdict.INCOMPATIBLE, PDVerdict.PARTIAL):
        return State.DISAGREE
    if verdict is PDVerdict.NOT_CHECKED and pools is State.AGREE:
        return State.NOT_CHECKED
    return pools


# ------------------------------------------------------------ before any traffic
