"""The fleet verdict on recorded-shape worker answers: fast, no Ray."""

from __future__ import annotations

from typing import Any

import pytest

from deployments import kvspec


def spec(layer: str, dtype: str | None, page: int, block: int = 256,
         ratio: int | None = None, kind: str = "MLAAttentionSpec") -> dict[str, Any]:
    return {"layer": layer, "spec_type": kind, "cache_dtype_str": dtype,
            "page_size_bytes": page, "block_size": block, "head_size": 512,
            "compress_ratio": ratio}


def worker(block: int = 256, dtype: str = "fp8_ds_mla", rank: int = 0) -> dict[str, Any]:
    specs = [spec(f"layers.{i}.attn", dtype, 37440 * block // 256, block, 4) for i in range(2)]
    specs.append(spec("layers.2.attn", dtype, 1152 * block // 256, block, 128))
    specs.append(spec("layers.0.state", None, 4096, block, None, "SlidingWindowSpec"))
    return {"rank": rank, "pid": 100 + rank, "specs": specs, "patch_record": {"patches": []}}


def replica(rid: str, rank: int, **kw: Any) -> dict[str, Any]:
    return kvspec.summarize_workers([worker(**kw)]) | {"replica_id": rid, "rank": rank}


def test_fingerprint_is_stable_and_order_free() -> None:
    a = worker()
    b = worker() | {"specs": list(reversed(worker()["specs"]))}
    fa, fb = (kvspec.summarize_workers([w])["fingerprint"] for w in (a, b))
    assert fa == fb and fa.startswith("sha256:")
    assert kvspec.summarize_workers([worker(block=64)])["fingerprint"] != fa


def test_summary_fields() -> None:
    s = kvspec.summarize_workers([worker(rank=0), worker(rank=1)])
    assert s["cache_dtypes"] == ["fp8_ds_mla"]  # state-only specs carry no dtype
    assert s["block_sizes"] == [256]
    assert s["page_sizes"] == [1152, 4096, 37440]
    assert s["ranks_disagreeing_with_rank0"] == []
    split = kvspec.summarize_workers([worker(rank=0), worker(block=64, rank=1)])
    assert split["ranks_disagreeing_with_rank0"] == [1]


def test_malformed_worker_answer_is_named() -> None:
    with pytest.raises(kvspec.WorkerSpecError, match="no 'specs'"):
        kvspec.summarize_workers([{"rank": 0}])
    with pytest.raises(kvspec.WorkerSpecError, match="no worker answered"):
        kvspec.summarize_workers([])


def test_agree() -> None:
    report = kvspec.decide([replica("a", 0), replica("b", 1)], [], 2, "fp8_ds_mla")
    assert report["agree"] and report["state"] == "agree" and report["problems"] == []
    assert [r["status"] for r in report["replicas"]] == ["ok", "ok"]


def test_disagree_names_the_odd_replica_and_field() -> None:
    report = kvspec.decide([replica("a", 0), replica("b", 1, block=64)], [], 2, "fp8_ds_mla")
    assert report["state"] == "disagree" and not report["agree"]
    assert list(report["odd_replicas"]) == ["b"]  # tie: the lowest rank is the reference
    [problem] = report["problems"]
    assert problem["replica"] == "b" and problem["field"] == "page_sizes"
    assert [d["field"] for d in problem["differences"]] == ["page_sizes", "block_sizes",
                                                            "layer_groups"]
    assert "block_sizes=[64] vs [256]" in problem["message"]


def test_majority_wins_over_rank() -> None:
    specs = [replica("a", 0, block=64), replica("b", 1), replica("c", 2)]
    report = kvspec.decide(specs, [], 3, "fp8_ds_mla")
    assert list(report["odd_replicas"]) == ["a"]


def test_wrong_layout_is_odd_even_when_alone() -> None:
    report = kvspec.decide([replica("a", 0, dtype="auto")], [], 1, "fp8_ds_mla")
    assert report["state"] == "disagree"
    assert report["problems"][0]["kind"] == "expected"
    assert "expected fp8_ds_mla" in report["odd_replicas"]["a"]


def test_silent_replica_makes_it_incomplete() -> None:
    report = kvspec.decide([replica("a", 0)], [], 2, "fp8_ds_mla")
    assert report["state"] == "incomplete" and not report["agree"]
    assert "1 RUNNING replica(s) did not answer" in report["problems"][0]["message"]
    errored = kvspec.decide([replica("a", 0)], ["a replica failed kv_page_spec: boom"], 2,
                            "fp8_ds_mla")
    assert errored["state"] == "incomplete"
    assert kvspec.decide([], [], 0, "fp8_ds_mla")["state"] == "incomplete"
