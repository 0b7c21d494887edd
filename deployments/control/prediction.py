"""What a replica's workers should report (the byte model), and how a report differs from it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from deployments.control.summary import COMPARED, PREDICTED, SHOWN_LAYERS, layer_role
from deployments.control.wire import (
    FleetFinding,
    LayerDifference,
    LayerEntry,
    Prediction,
    ReplicaSpec,
)
from dsv4_patch import rules

# ------------------------------------------------------------------ prediction


def predict(hf_config: Mapping[str, Any] | None, layout: rules.Layout, requested: str | None,
            vllm_version: str | None, source: str,
            node: Mapping[str, Any] | None = None,
            engine: Mapping[str, Any] | None = None) -> Prediction:
    """What the engine will allocate for this config, layout, dtype and vLLM, per layer.

    ``node`` (``NodeInfo.as_dict()``: platform, compute_capability, attention_backend)
    is the replica's own node; DeepSeek-V4.1's record depends on it (vllm#56893,
    vllm#56935), so a V4.1 prediction is always for one node type. ``engine``: the
    engine kwargs vLLM reads (block_size, TP, LoRA, attention and speculative config).
    """
    if hf_config is None:
        return Prediction(source=source, reason="the model's config.json could not be read")
    why = rules.predictable(hf_config, vllm_version)
    if why:
        return Prediction(source=source, reason=why)
    if rules.family_of(hf_config) is rules.Family.V41:
        return _predict_v41(hf_config, requested, source, node or {}, str(vllm_version),
                            engine or {})
    reported = rules.LayoutDecision(layout, "", "the layout the replica reports")
    resolution = rules.build_v4_node(rules.EngineSetup(str(vllm_version), kv_cache_dtype=requested),
                                     reported).resolution
    shape = rules.ModelShape.from_hf_config(hf_config)
    layers = [LayerEntry(layer=f"layers.{p.index}.{p.role}", index=p.index, role=p.role,
                         spec_type="MLAAttentionSpec", cache_dtype_str=p.cache_dtype_str,
                         page_size_bytes=p.page_size_bytes, block_size=p.block_size,
                         head_size=None, compress_ratio=p.compress_ratio)
              for p in rules.predict_layers(shape, resolution)]
    return Prediction(source=source, storage=resolution.storage.value,
                      cache_dtype_str=resolution.cache_dtype_str, layers=layers,
                      fingerprint=_prediction_fingerprint(layers))


def node_type(node: Mapping[str, Any]) -> str:
    """A short name of a node type: ``cuda sm100 FLASHMLA_SPARSE_DSV41``, ``rocm``."""
    cap = node.get("compute_capability")
    parts = [str(node.get("platform") or "unknown")]
    if cap:
        parts.append("sm" + "".join(str(cap).split(".")))
    if node.get("attention_backend"):
        parts.append(str(node["attention_backend"]))
    return " ".join(parts)


def node_capability(node: Mapping[str, Any]) -> tuple[int, int] | None:
    return rules.parse_capability(node.get("compute_capability"))


def engine_setup(node: Mapping[str, Any], release: str, requested: str | None,
                 engine: Mapping[str, Any] | None = None) -> rules.EngineSetup:
    """The pure rules' view of one node running ``engine`` on vLLM ``release``."""
    kwargs = {**(engine or {}), "kv_cache_dtype": requested}
    return rules.EngineSetup.from_engine_kwargs(
        release, str(node.get("platform") or "cpu"), node_capability(node),
        node.get("attention_backend"), kwargs)


def _predict_v41(hf_config: Mapping[str, Any], requested: str | None, source: str,
                 node: Mapping[str, Any], release: str,
                 engine: Mapping[str, Any]) -> Prediction:
    """V4.1's main and indexer caches on this node (the growing caches; peers compare the rest)."""
    try:
        built = rules.build(engine_setup(node, release, requested, engine), hf_config)
    except (rules.LayoutError, rules.KVCacheDtypeError) as exc:
        return Prediction(source=source, node_type=node_type(node), reason=str(exc))
    record, caches = built.record, list(built.caches)
    assert record is not None
    layers = [LayerEntry(layer=f"layers.{c.index}.{c.role}", index=c.index, role=c.role,
                         spec_type="MLAAttentionSpec", cache_dtype_str=c.cache_dtype_str,
                         page_size_bytes=c.page_size_bytes, block_size=c.block_size,
                         head_size=None, compress_ratio=c.compress_ratio)
              for c in caches if c.role in (rules.MAIN, rules.INDEXER)]
    return Prediction(source=f"{source} on {node_type(node)}", storage=record.label(),
                      cache_dtype_str=record.cache_dtype_str, layers=layers,
                      fingerprint=_prediction_fingerprint(layers), node_type=node_type(node),
                      bytes_per_token=rules.v41_bytes_per_token(caches),
                      numerics=record.numerics)


def _prediction_fingerprint(layers: Sequence[LayerEntry]) -> str:
    rows = [e.model_dump(include={"index", "role", *PREDICTED}) for e in layers]
    canonical = json.dumps(rows, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


_DIFFS: dict[tuple[str, str], list[LayerDifference]] = {}


def replica_vs_prediction(spec_fingerprint: str, layers: Sequence[LayerEntry],
                          prediction: Prediction) -> list[LayerDifference]:
    """``prediction_differences``, memoized by (fingerprint, prediction fingerprint).

    A fleet of N alike replicas then costs one comparison, not N (256 Flash-shaped
    replicas: ~40 ms -> ~2 ms per check).
    """
    key = (spec_fingerprint, prediction.fingerprint or "")
    if key not in _DIFFS:
        if len(_DIFFS) > 1024:
            _DIFFS.clear()
        _DIFFS[key] = prediction_differences(layers, prediction)
    return _DIFFS[key]


def prediction_differences(layers: Sequence[LayerEntry],
                           prediction: Prediction) -> list[LayerDifference]:
    """Where the predicted caches (main + indexer, per layer index) differ from the real ones."""
    assert prediction.layers is not None
    actual = {(e.index, e.role): e for e in layers if e.role in (rules.MAIN, rules.INDEXER)}
    diffs = []
    for want in prediction.layers:
        got = actual.pop((want.index, want.role), None)
        name = f"layers.{want.index} {want.role}"
        if got is None:
            diffs.append(LayerDifference(layer=name, field="present", value=False,
                                         reference=True))
            continue
        diffs += [LayerDifference(layer=got.layer, field=f, value=getattr(got, f),
                                  reference=getattr(want, f))
                  for f in PREDICTED if getattr(got, f) != getattr(want, f)]
    diffs += [LayerDifference(layer=e.layer, field="present", value=True, reference=False)
              for e in actual.values()]
    return diffs


def peer_differences(layers: Sequence[LayerEntry],
                     reference: Sequence[LayerEntry]) -> list[LayerDifference]:
    """Layer for layer (by name), the compared fields where a replica differs from a peer."""
    mine, ref = {e.layer: e for e in layers}, {e.layer: e for e in reference}
    diffs = []
    for name in sorted(mine.keys() | ref.keys(), key=lambda n: (layer_role(n)[0] or -1, n)):
        a, b = mine.get(name), ref.get(name)
        if a is None or b is None:
            diffs.append(LayerDifference(layer=name, field="present", value=a is not None,
                                         reference=b is not None))
            continue
        diffs += [LayerDifference(layer=name, field=f, value=getattr(a, f),
                                  reference=getattr(b, f))
                  for f in COMPARED if getattr(a, f) != getattr(b, f)]
    return diffs


def describe_differences(diffs: Sequence[LayerDifference]) -> str:
    shown = "; ".join(f"{d.layer} {d.field}={d.value} vs {d.reference}"
                      for d in diffs[:SHOWN_LAYERS])
    more = f"; and {len(diffs) - SHOWN_LAYERS} more" if len(diffs) > SHOWN_LAYERS else ""
    return shown + more


def layout_problem(layers: Sequence[LayerEntry], expected_layout: str) -> str | None:
    """Why a replica's specs contradict the expected layout, or None.

    fp8_ds_mla: every attention cache must store the packed record (the specs
    with a cache dtype; state-only specs carry None). plain_rows: none may.
    """
    dtypes = [e.cache_dtype_str for e in layers if e.cache_dtype_str is not None]
    if not dtypes:
        return "no layer reports a cache dtype; expected at least one attention layer"
    packed = [d in rules.PACKED_DTYPES for d in dtypes]
    if expected_layout in rules.PACKED_DTYPES and any(d != expected_layout for d in dtypes):
        bad = sorted({d for d in dtypes if d != expected_layout})
        return (f"cache_dtype: expected {expected_layout} on every attention layer, "
                f"found {bad}")
    if expected_layout == "plain_rows" and any(packed):
        found = sorted({d for d in dtypes if d in rules.PACKED_DTYPES})
        return f"cache_dtype: expected plain rows, found {found} layers"
    return None


def judge_alone(spec: ReplicaSpec, own: bool = False) -> list[FleetFinding]:
    """What a replica tells about itself alone: split ranks, layout, its prediction.

    The one judge of a single replica: the controller asks it against the deployment's
    prediction (``own=False``; a canary whose own config explains it is named so), the
    replica itself, before it serves, against its own config's (``own=True``).
    """
    problems = []
    if spec.ranks_disagreeing:
        problems.append(FleetFinding(
            kind="intra_replica", replica=spec.replica_id, field="layers",
            message=f"replica {spec.replica_id}: worker ranks {spec.ranks_disagreeing} "
                    f"report other specs than rank {spec.workers[0].rank} for the same "
                    "layers (one engine, two KV layouts)"))
    bad = layout_problem(spec.layers, spec.expected_layout)
    if bad:
        problems.append(FleetFinding(kind="expected", replica=spec.replica_id, field="cache_dtype",
                                message=f"replica {spec.replica_id}: {bad} (its "
                                        f"expected_layout is {spec.expected_layout})"))
    found = _against_prediction(spec, own)
    return problems + ([found] if found else [])


def _against_prediction(spec: ReplicaSpec, own: bool) -> FleetFinding | None:
    pred = (spec.own_prediction or spec.prediction) if own else spec.prediction
    if pred.layers is None:
        return None
    diffs = replica_vs_prediction(spec.fingerprint, spec.layers, pred)
    if not diffs:
        return None
    if own:
        text = (f"the engine built other KV caches than its own config predicts "
                f"({pred.source}): {describe_differences(diffs)}")
        return FleetFinding(kind="prediction", replica=spec.replica_id, field=diffs[0].field,
                       layers=diffs, message=text)
    mine = spec.own_prediction
    if spec.is_canary and mine is not None and mine.layers is not None and \
            not replica_vs_prediction(spec.fingerprint, spec.layers, mine):
        why = (f"as its replica_overrides entry predicts "
               f"({(spec.override or {}).get('reason', 'canary')}): a canary, odd on purpose")
    else:
        why = "its own config does not explain it either"
    return FleetFinding(
        kind="prediction", replica=spec.replica_id, field=diffs[0].field, layers=diffs,
        message=(f"replica {spec.replica_id} (rank {spec.rank}) differs from the KV spec "
                 f"predicted for the deployment ({spec.prediction.source}) at "
                 f"{len(diffs)} cache(s), {why}: {describe_differences(diffs)}"))


def self_problem(spec: ReplicaSpec) -> str | None:
    """The replica's own check before it serves (``judge_alone`` against its own config)."""
    found = judge_alone(spec, own=True)
    if not found:
        return None
    if found[0].kind == "intra_replica":
        return (f"worker ranks {spec.ranks_disagreeing} report other specs than rank "
                f"{spec.workers[0].rank} for the same layers")
    if found[0].kind == "expected":
        return layout_problem(spec.layers, spec.expected_layout)
    return found[0].message


def node_record_fields(hf_config: Mapping[str, Any], node: Mapping[str, Any],
                       requested: str | None, vllm_version: str | None,
                       engine: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What one pool's node writes per token, from the pure rules (no replica needed)."""
    release = vllm_version or rules.DEFAULT_V41_RELEASE
    built = rules.build(engine_setup(node, release, requested, engine), hf_config)
    if built.record is not None:
        record = built.record
        return {"cache_dtype_str": record.cache_dtype_str, "swa_record_bytes": record.swa_bytes,
                "compressed_record_bytes": record.compressed_bytes,
                "page_alignment": record.alignment, "block_size": record.block_size,
                "kv_bytes_per_token": built.bytes_per_token, "numerics": record.numerics}
    shape = rules.ModelShape.from_hf_config(hf_config)
    storage = rules.Storage(built.numerics)
    return {"cache_dtype_str": built.cache_dtype_str,
            "swa_record_bytes": rules.state_bytes(shape, storage),
            "compressed_record_bytes": rules.state_bytes(shape, storage),
            "page_alignment": rules.page_alignment(storage),
            "block_size": built.block_size,
            "kv_bytes_per_token": built.bytes_per_token, "numerics": built.numerics}
