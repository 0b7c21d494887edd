"""The fleet verdict on recorded and byte-model worker answers: fast, no Ray, no engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from deployments.control import wire
from deployments.control.enforcement import (
    EnforceBook,
    KVLayoutMismatch,
    drain_stats,
    raise_if_enforced,
    take_verdict,
    verdicts_held,
)
from deployments.control.prediction import (
    peer_differences,
    predict,
    prediction_differences,
    self_problem,
)
from deployments.control.summary import (
    WorkerSpecError,
    fingerprint,
    summarize_workers,
)
from deployments.control.verdict import NoAnswer, decide
from deployments.control.wire import Action, FleetReport, ReplicaSpec, ReplicaVerdict, State
from deployments.harness.standin import flash_worker_specs, standin_spec
from dsv4_patch import rules
from dsv4_patch.tiny_model import tiny_config

REPO = Path(__file__).resolve().parents[2]
# What a real vLLM 0.32 worker reported for the tiny model (tests.support.engine_boot, recorded).
TINY_WORKERS = json.loads(
    (REPO / "tests" / "support" / "data" / "tiny_worker_specs.json").read_text())
MODELS = REPO / "configs" / "models" / "deepseek-ai"
FP8 = rules.Layout.FP8_DS_MLA


def tiny_prediction(**overrides: Any) -> wire.Prediction:
    return predict(tiny_config(1024) | overrides, FP8, "auto", "0.32.0", "tiny")


# ------------------------------------------------------------------ prediction


def test_prediction_equals_the_real_engine_specs_of_the_tiny_model() -> None:
    kv = summarize_workers(TINY_WORKERS)
    prediction = tiny_prediction()
    assert prediction.layers and len(prediction.layers) == 5  # 2 C4 (main+indexer) + 1 C128
    assert prediction_differences(kv.layers, prediction) == []


@pytest.mark.parametrize(("model", "per_token", "caches"),
                         [("DeepSeek-V4-Flash", 3915.0, 21 * 2 + 20),
                          ("DeepSeek-V4-Pro", 5609.25, 30 * 2 + 31)])
def test_per_layer_prediction_sums_to_the_byte_model(model: str, per_token: float,
                                                     caches: int) -> None:
    cfg = json.loads((MODELS / model / "config.json").read_text())
    prediction = predict(cfg, FP8, "auto", "0.29.0", model)
    assert prediction.cache_dtype_str == "fp8_ds_mla" and len(prediction.layers or []) == caches
    total = sum(e.page_size_bytes or 0 for e in prediction.layers or []) / rules.DSV4_BLOCK_SIZE
    shape = rules.ModelShape.from_hf_config(cfg)
    assert total == per_token == rules.kv_bytes_per_token(shape, rules.Storage.FP8_DS_MLA)


def test_no_prediction_for_unknown_architectures_or_old_vllm() -> None:
    llama = {"architectures": ["LlamaForCausalLM"]}
    assert "LlamaForCausalLM" in (predict(llama, FP8, "auto", "0.32.0", "x").reason or "")
    assert "no DeepSeek-V4" in (predict(tiny_config(1024), FP8, "auto", "0.19.0",
                                               "x").reason or "")
    assert predict(None, FP8, "auto", "0.32.0", "x").layers is None


# ------------------------------------------------------------------ fingerprint


def test_fingerprint_covers_which_layer_has_which_spec() -> None:
    # The issue's case: compress_ratios [0, 4, 128, 4, 0] vs [0, 4, 4, 128, 0] -- the same
    # multiset of caches, a different model. The old multiset fingerprint said agree.
    normal = summarize_workers(TINY_WORKERS)
    swapped = [dict(w, specs=_swap_layers(w["specs"], 2, 3)) for w in TINY_WORKERS]
    odd = summarize_workers(swapped)
    assert sorted(json.dumps(e.model_dump(exclude={"layer", "index"}), sort_keys=True)
                  for e in normal.layers) == sorted(
        json.dumps(e.model_dump(exclude={"layer", "index"}), sort_keys=True)
        for e in odd.layers)
    assert odd.fingerprint != normal.fingerprint
    diffs = peer_differences(odd.layers, normal.layers)
    assert {d.layer.split(".attn")[0] for d in diffs} == {"model.layers.2", "model.layers.3"}
    reversed_order = summarize_workers(
        [dict(w, specs=list(reversed(w["specs"]))) for w in TINY_WORKERS])
    assert reversed_order.fingerprint == normal.fingerprint  # order of the list is irrelevant


def _swap_layers(specs: list[dict[str, Any]], a: int, b: int) -> list[dict[str, Any]]:
    def rename(row: dict[str, Any]) -> dict[str, Any]:
        name = row["layer"]
        for x, y in ((a, b), (b, a)):
            if name.startswith(f"model.layers.{x}."):
                return row | {"layer": f"model.layers.{y}." + name.split(".", 3)[3]}
        return row
    return [rename(r) for r in specs]


def test_split_ranks_and_malformed_answers_are_named() -> None:
    one = TINY_WORKERS[0]
    bad = dict(one, rank=1, specs=[dict(s, page_size_bytes=1) if i == 1 else s
                                   for i, s in enumerate(one["specs"])])
    assert summarize_workers([one, bad]).ranks_disagreeing == [1]
    # PP stages report different layers: that is not a disagreement.
    stage0 = dict(one, specs=one["specs"][:6])
    stage1 = dict(one, rank=1, specs=one["specs"][6:])
    assert summarize_workers([stage0, stage1]).ranks_disagreeing == []
    with pytest.raises(WorkerSpecError, match=r"worker answer 0 .*specs"):
        summarize_workers([{"rank": 0}])
    with pytest.raises(WorkerSpecError, match="no worker answered"):
        summarize_workers([])


# ------------------------------------------------------------------ verdicts


def test_agree_against_the_prediction() -> None:
    report = decide([standin_spec("a", 0), standin_spec("b", 1)], [], 2, "fp8_ds_mla")
    assert report.state is State.AGREE and report.agree and report.problems == []
    assert report.expected.reference == "prediction"
    assert report.expected.fingerprint == report.replicas[0].fingerprint


def test_rank0_canary_is_named_not_the_correct_rank1() -> None:
    """Issue test 1: a 1-1 tie where rank 0 is the odd one (the old vote named rank 1)."""
    specs = [standin_spec("a", 0, reordered=True, canary=True), standin_spec("b", 1)]
    report = decide(specs, [], 2, "fp8_ds_mla")
    assert report.state is State.DISAGREE and list(report.odd_replicas) == ["a"]
    [problem] = report.problems
    assert problem.kind == "prediction" and problem.replica == "a"
    assert {d.layer for d in problem.layers} >= {"model.layers.2.attn", "model.layers.3.attn"}
    assert "canary" in problem.message and "model.layers.2.attn" in problem.message


def test_a_wrong_majority_does_not_win() -> None:
    """Issue test 2: 3 replicas, 2 odd the same way; the conforming one is kept."""
    specs = [standin_spec("a", 0, reordered=True), standin_spec("b", 1, reordered=True),
             standin_spec("c", 2)]
    report = decide(specs, [], 3, "fp8_ds_mla")
    assert sorted(report.odd_replicas) == ["a", "b"]
    assert "its own config does not explain it" in report.odd_replicas["a"]
    assert {r.id: r.status.value for r in report.replicas} == {"a": "odd", "b": "odd",
                                                               "c": "ok"}


def _unpredicted(spec: ReplicaSpec) -> ReplicaSpec:
    return spec.model_copy(update={"prediction": wire.Prediction(
        source="x", reason="architectures=['Other']: unknown")})


def test_without_a_prediction_the_majority_decides_and_ties_go_against_canaries() -> None:
    tie = [_unpredicted(standin_spec("a", 0, reordered=True, canary=True)),
           _unpredicted(standin_spec("b", 1))]
    report = decide(tie, [], 2, "fp8_ds_mla")
    assert list(report.odd_replicas) == ["a"] and report.expected.reference == "majority"
    assert "no prediction" in (report.expected.note or "")
    assert report.problems[0].kind == "mismatch" and report.problems[0].layers
    # Without canaries the majority wins, ties to the lowest rank.
    three = [_unpredicted(standin_spec("a", 0, reordered=True)),
             _unpredicted(standin_spec("b", 1)), _unpredicted(standin_spec("c", 2))]
    assert list(decide(three, [], 3, "fp8_ds_mla").odd_replicas) == ["a"]


def test_intra_replica_disagreement_makes_the_replica_odd() -> None:
    """Issue test 7."""
    report = decide([standin_spec("a", 0, split=True), standin_spec("b", 1)], [], 2,
                           "fp8_ds_mla")
    assert report.state is State.DISAGREE and list(report.odd_replicas) == ["a"]
    assert report.problems[0].kind == "intra_replica"


def test_wrong_layout_is_odd_even_when_alone() -> None:
    report = decide([standin_spec("a", 0, dtype="bfloat16")], [], 1, "fp8_ds_mla")
    assert report.state is State.DISAGREE
    assert report.problems[0].kind == "expected"
    assert "expected fp8_ds_mla" in report.odd_replicas["a"]


def test_no_answer_is_incomplete_and_named() -> None:
    gap = NoAnswer("b", "replica b did not answer within its 3 s deadline")
    report = decide([standin_spec("a", 0)], [gap], 2, "fp8_ds_mla")
    assert report.state is State.INCOMPLETE and not report.agree
    assert {r.id: r.status.value for r in report.replicas} == {"a": "ok", "b": "no_answer"}
    silent = decide([standin_spec("a", 0)], [], 2, "fp8_ds_mla")
    assert silent.state is State.INCOMPLETE
    assert "1 RUNNING replica(s) did not answer" in silent.problems[0].message
    assert decide([], [], 0, "fp8_ds_mla").state is State.INCOMPLETE


def test_a_rollout_judges_each_replica_by_its_own_config() -> None:
    """Old replicas keep their expected_layout and prediction while new ones arrive."""
    old = [standin_spec("a", 0), standin_spec("b", 1)]
    new = standin_spec("c", 0, dtype="auto", expected_layout="plain_rows")  # bf16 rows
    assert self_problem(new) is None
    report = decide([*old, new], [], 3, "plain_rows")
    assert report.state is State.AGREE, [p.message for p in report.problems]
    assert "2 deployment configs are live" in (report.expected.note or "")


# ------------------------------------------------------------------ policies


def test_enforce_is_bounded_with_backoff_then_drains() -> None:
    book = EnforceBook(max_attempts=2, backoff_s=10)
    first = standin_spec("r1", 1, reordered=True)
    assert book.action(first, True, "enforce", now=0) == (Action.FAIL_HEALTH, 1, None)
    assert book.action(first, True, "enforce", now=1)[0] is Action.FAIL_HEALTH  # still it
    second = first.model_copy(update={"replica_id": "r2"})  # Serve's replacement, same rank
    action, attempts, note = book.action(second, True, "enforce", now=5)
    assert (action, attempts) == (Action.DRAIN, 1) and "backoff" in (note or "")
    assert book.action(second, True, "enforce", now=11)[:2] == (Action.FAIL_HEALTH, 2)
    third = first.model_copy(update={"replica_id": "r3"})
    action, attempts, note = book.action(third, True, "enforce", now=100)
    assert (action, attempts) == (Action.DRAIN, 2) and "gave up" in (note or "")
    # A conforming replica at that rank clears the book; warn/drain never replace.
    assert book.action(standin_spec("r4", 1), False, "enforce", now=101)[0] is Action.SERVE
    assert 1 not in book.ranks
    assert book.action(third, True, "warn", now=0)[0] is Action.SERVE
    assert book.action(third, True, "drain", now=0)[0] is Action.DRAIN


def test_a_restarted_controller_remembers_a_given_up_rank_from_its_replica() -> None:
    # The replica drained after 2 replacements echoes that verdict; a new controller
    # (empty book) must not replace it a third time.
    given_up = standin_spec("r3", 1, reordered=True).model_copy(update={
        "verdict": ReplicaVerdict(odd=True, reason="gave up", action=Action.DRAIN,
                                  policy="enforce", attempts=2)})
    fresh = EnforceBook(max_attempts=2, backoff_s=10)
    action, attempts, note = fresh.action(given_up, True, "enforce", now=1000)
    assert (action, attempts) == (Action.DRAIN, 2) and "gave up" in (note or "")
    # Mid-backoff after 1 replacement: drained, the backoff counted again from now.
    waiting = given_up.model_copy(update={"verdict": given_up.verdict.model_copy(
        update={"attempts": 1})})
    fresh = EnforceBook(max_attempts=2, backoff_s=10)
    assert fresh.action(waiting, True, "enforce", now=1000)[:2] == (Action.DRAIN, 1)
    assert fresh.action(waiting, True, "enforce", now=1011)[:2] == (Action.FAIL_HEALTH, 2)
    # A replica whose verdict came from another policy starts a clean book.
    warned = given_up.model_copy(update={"verdict": given_up.verdict.model_copy(
        update={"policy": "warn"})})
    fresh = EnforceBook(max_attempts=2, backoff_s=10)
    assert fresh.action(warned, True, "enforce", now=0)[:2] == (Action.FAIL_HEALTH, 1)


def test_a_replica_obeys_its_own_policy_unless_an_operator_overrides() -> None:
    told = {"checked_at": 1.0, "replicas": {"x": ReplicaVerdict(
        odd=True, reason="r", action=Action.FAIL_HEALTH).model_dump(mode="json")}}
    own = take_verdict(told, "x", "warn", ReplicaVerdict())
    assert own.odd and own.action is Action.SERVE and own.policy == "warn"
    drained = take_verdict(told, "x", "drain", ReplicaVerdict())
    assert drained.action is Action.DRAIN and drain_stats(drained)["dsv4_kv_drain"]
    forced = take_verdict(told | {"policy_override": "enforce"}, "x", "warn",
                                 ReplicaVerdict())
    with pytest.raises(KVLayoutMismatch, match="attempt"):
        raise_if_enforced(forced)
    kept = take_verdict({"checked_at": 2.0, "replicas": {}}, "x", "drain", drained)
    assert kept == drained  # not judged this time: the last word stands


# ------------------------------------------------------------------ wire format


def test_published_schema_is_current() -> None:
    published = (REPO / "docs" / "kv-spec.schema.json").read_text()
    assert published == wire.schema_json(), "run: python -m deployments.control.wire > " \
        "docs/kv-spec.schema.json"


def test_report_round_trips_through_json() -> None:
    report = decide([standin_spec("a", 0, reordered=True, canary=True),
                            standin_spec("b", 1)], [], 2, "fp8_ds_mla")
    again = FleetReport.model_validate(json.loads(json.dumps(report.model_dump(mode="json"))))
    assert again == report
    spec = standin_spec("a", 0)
    assert ReplicaSpec.model_validate(spec.model_dump(mode="json")) == spec


def test_flash_standin_has_flash_layer_kinds() -> None:
    rows = flash_worker_specs()
    assert sum(1 for r in rows if r["layer"].endswith(".attn")) == 41


def test_status_describes_stale_and_silent_replicas() -> None:
    from deployments.cli.status import EXIT, EXIT_INCOMPLETE
    from deployments.control.report import describe

    gap = NoAnswer("b", "replica b did not answer within its 3 s deadline")
    report = decide([standin_spec("a", 0)], [gap], 2, "fp8_ds_mla")
    stale = report.model_copy(update={"state": State.STALE, "previous_state": report.state,
                                      "policy": "enforce", "age_s": 95.0})
    text = describe(FleetReport.model_validate(stale.model_dump(mode="json")))
    assert "KV spec: stale (last completed check: incomplete)" in text
    assert "95 s old" in text and "b: [no_answer]" in text
    assert EXIT.get(stale.state.value, EXIT_INCOMPLETE) == EXIT_INCOMPLETE


# The fingerprint of DeepSeek-V4-Flash's stand-in spec, recorded: the hash must not move
# between dsv4-serve versions, or a rolling upgrade would see old and new replicas differ.
FLASH_FINGERPRINT = "sha256:72f928b84436042ddbc603cb9a960608aeebe8082628c1a17b801d9b307003f3"


def test_fingerprint_is_stable_across_versions() -> None:
    spec = standin_spec("r0", 0)
    assert fingerprint(spec.layers) == spec.fingerprint == FLASH_FINGERPRINT


def test_a_held_spec_is_answered_briefly_and_anything_else_in_full() -> None:
    spec = standin_spec("r0", 0)
    full = wire.answer_kv_page_spec(spec, None)
    assert ReplicaSpec.model_validate(full).fingerprint == spec.fingerprint
    assert "brief" not in wire.answer_kv_page_spec(spec, {"r1": spec.fingerprint})
    assert "layers" in wire.answer_kv_page_spec(spec, {"r0": "sha256:other"})
    brief = wire.answer_kv_page_spec(spec, {"r0": spec.fingerprint})
    assert brief["brief"] is True and "layers" not in brief
    assert len(json.dumps(brief)) < len(json.dumps(full)) / 50
    assert wire.ReplicaSpecBrief.model_validate(brief).fingerprint == spec.fingerprint


def _message(**entry: Any) -> wire.VerdictMessage:
    return wire.VerdictMessage(checked_at=1.0, replicas={"r0": ReplicaVerdict(**entry)})


def test_a_verdict_is_resent_only_when_a_replica_would_act_differently() -> None:
    spec = standin_spec("r0", 0, policy="drain")
    # A new replica holds the default verdict (no policy yet): it must be told once.
    assert not verdicts_held(_message(policy="drain"), [spec])
    taken = take_verdict(_message(policy="drain").model_dump(mode="json"), "r0",
                                "drain", spec.verdict)
    held = spec.model_copy(update={"verdict": taken})
    assert verdicts_held(_message(policy="drain"), [held])
    # enforce's fail_health, clamped by the replica's own drain policy, is a drain:
    odd = dict(odd=True, reason="differs", action=Action.FAIL_HEALTH, attempts=1)
    assert not verdicts_held(_message(**odd), [held])
    taken = take_verdict(_message(**odd).model_dump(mode="json"), "r0", "drain",
                                taken)
    assert taken.action is Action.DRAIN
    assert verdicts_held(_message(**odd), [held.model_copy(update={"verdict": taken})])
    # A replica the message names but that did not answer now: send.
    assert not verdicts_held(_message(**odd), [])


def test_a_drained_replica_closes_its_port_only_if_another_replica_serves() -> None:
    from deployments.control.enforcement import others_serving

    odd = ReplicaVerdict(odd=True, reason="differs", action=Action.DRAIN, attempts=1)
    fine = ReplicaVerdict()
    both_odd = wire.VerdictMessage(checked_at=1.0, replicas={"r0": odd, "r1": odd})
    one_odd = wire.VerdictMessage(checked_at=1.0, replicas={"r0": odd, "r1": fine})
    assert others_serving(one_odd.model_dump(mode="json"), "r0", "drain")
    assert not others_serving(both_odd.model_dump(mode="json"), "r0", "drain")
    assert not others_serving(wire.VerdictMessage(
        checked_at=1.0, replicas={"r0": odd}).model_dump(mode="json"), "r0", "drain")
    # enforce's fail_health, clamped by a drain policy, is a drain too:
    failing = odd.model_copy(update={"action": Action.FAIL_HEALTH})
    clamped = wire.VerdictMessage(checked_at=1.0, replicas={"r0": odd, "r1": failing})
    assert not others_serving(clamped.model_dump(mode="json"), "r0", "drain")


# ------------------------------------------------------ DeepSeek-V4.1 on mixed GPUs


def _mixed(odd: dict[int, str] | None = None, nodes: tuple[str, ...] = (
        "h200", "h200", "b200", "b200")) -> list[ReplicaSpec]:
    from deployments.harness.standin import v41_standin_spec

    layouts = {"sm90": "fp8_ds_mla", "sm100": "nvfp4_ds_mla"}
    return [v41_standin_spec(f"r{i}", i, node, odd_record=(odd or {}).get(i),
                             expected_layouts=layouts) for i, node in enumerate(nodes)]


def test_v41_standin_pages_are_vllms_spec_pages() -> None:
    """The stand-in's rows are the real spec classes' pages (no hand-typed bytes)."""
    from deployments.harness.standin import V41_NODES, v41_worker_specs
    from tests.support.v41_pages import V41_FLASH, real_spec

    topo = rules.V41Topology.from_hf_config(V41_FLASH)
    for name, node in V41_NODES.items():
        major, minor = (int(x) for x in node["compute_capability"].split("."))
        record = rules.v41_record("cuda", (major, minor), node["attention_backend"], "auto")
        real = [real_spec(c, record, topo.head_dim) for c in rules.v41_caches(topo, record)]
        assert [r["page_size_bytes"] for r in v41_worker_specs(node)] == real, name


def test_h200_and_b200_v41_replicas_are_two_conforming_groups_under_enforce() -> None:
    specs = _mixed()
    assert specs[0].fingerprint != specs[2].fingerprint  # really different pages
    report = decide(specs, [], 4, "fp8_ds_mla")
    assert report.state is State.AGREE and not report.odd_replicas, report.problems
    groups = {g.node_type: g for g in report.expected.node_groups}
    assert set(groups) == {"cuda sm90", "cuda sm100"}
    assert groups["cuda sm90"].bytes_per_token == 1827
    assert groups["cuda sm100"].bytes_per_token == 1056
    assert groups["cuda sm100"].cache_dtype_str == "nvfp4_ds_mla"
    assert groups["cuda sm90"].replicas == ["r0", "r1"]
    note = report.expected.note or ""
    assert "nobody is drained" in note and "B/token" in note and "NVFP4" in note
    assert "1.73x" in note  # capacity per GiB, named
    book = EnforceBook(max_attempts=3, backoff_s=0)
    actions = {s.replica_id: book.action(s, s.replica_id in report.odd_replicas, "enforce",
                                         0.0)[0] for s in specs}
    assert set(actions.values()) == {Action.SERVE}


def test_b200_flashmla_and_h200_v41_still_differ_by_record() -> None:
    """Same dtype name on both (fp8_ds_mla), other bytes: 528 B vs 584 B records."""
    specs = _mixed(nodes=("h200", "b200-flashmla"))
    for s in specs:
        s.expected_layout = "fp8_ds_mla"
    report = decide(specs, [], 2, "fp8_ds_mla")
    assert report.state is State.AGREE
    per_token = {g.node_type: g.bytes_per_token for g in report.expected.node_groups}
    assert per_token == {"cuda sm90": 1827, "cuda sm100 FLASHMLA_SPARSE_DSV41": 1656}


def test_a_really_odd_v41_replica_is_still_named_in_a_mixed_fleet() -> None:
    """A B200 replica writing H200's 584 B record contradicts its own node's prediction."""
    specs = _mixed(odd={3: "b200-flashmla"})
    report = decide(specs, [], 4, "fp8_ds_mla")
    assert report.state is State.DISAGREE
    assert set(report.odd_replicas) == {"r3"}
    problem = next(p for p in report.problems if p.replica == "r3")
    assert problem.kind in ("prediction", "expected")
    groups = {g.node_type: g.replicas for g in report.expected.node_groups}
    assert groups == {"cuda sm90": ["r0", "r1"], "cuda sm100": ["r2"]}
    book = EnforceBook(max_attempts=3, backoff_s=0)
    assert book.action(specs[3], True, "enforce", 0.0)[0] is Action.FAIL_HEALTH
    assert book.action(specs[0], False, "enforce", 0.0)[0] is Action.SERVE


def test_v41_prediction_follows_the_replicas_node() -> None:
    cfg = json.loads((MODELS / "DeepSeek-V4.1-Flash" / "config.json").read_text())
    h200 = predict(cfg, FP8, "auto", "0.33.0", "v41", node={
        "platform": "cuda", "compute_capability": "9.0", "attention_backend": None})
    b200 = predict(cfg, FP8, "auto", "0.33.0", "v41", node={
        "platform": "cuda", "compute_capability": "10.0", "attention_backend": None})
    assert (h200.cache_dtype_str, b200.cache_dtype_str) == ("fp8_ds_mla", "nvfp4_ds_mla")
    assert h200.fingerprint != b200.fingerprint
    old = predict(cfg, FP8, "auto", "0.29.0", "v41", node={"platform": "cuda",
                                                           "compute_capability": "9.0"})
    assert old.layers is None and "no DeepSeek-V4.1" in (old.reason or "")
    cpu = predict(cfg, FP8, "auto", "0.32.0", "v41", node={"platform": "cpu"})
    assert cpu.layers is None and "no DeepSeek-V4.1 path" in (cpu.reason or "")


def test_v41_prediction_reads_the_engine_config_and_release() -> None:
    """block_size, TP and LoRA from engine_kwargs and the replica's own vLLM select what
    is predicted (the same ``rules.build`` plan uses)."""
    cfg = json.loads((MODELS / "DeepSeek-V4.1-Flash" / "config.json").read_text())
    b200 = {"platform": "cuda", "compute_capability": "10.0", "attention_backend": None}
    default = predict(cfg, FP8, "auto", "0.34.0", "v41", node=b200)
    blocks = predict(cfg, FP8, "auto", "0.34.0", "v41", node=b200,
                     engine={"block_size": "256"})  # lax mode: "256" is 256
    assert {e.block_size for e in default.layers or []} == {128}
    assert {e.block_size for e in blocks.layers or []} == {256}
    lora = predict(cfg, FP8, "auto", "0.34.0", "v41", node=b200, engine={"enable_lora": True})
    lora_033 = predict(cfg, FP8, "auto", "0.33.0", "v41", node=b200,
                       engine={"enable_lora": True})
    tp16 = predict(cfg, FP8, "auto", "0.34.0", "v41", node=b200,
                   engine={"tensor_parallel_size": 16})
    assert (lora.cache_dtype_str, lora_033.cache_dtype_str, tp16.cache_dtype_str) == \
        ("fp8_ds_mla", "nvfp4_ds_mla", "fp8_ds_mla")
    sm120 = {"platform": "cuda", "compute_capability": "12.0"}
    assert {e.block_size for e in predict(cfg, FP8, "auto", "0.34.0", "v41",
                                          node=sm120).layers or []} == {64}
    rocm = predict(cfg, FP8, "auto", "0.33.0", "v41", node={"platform": "rocm"})
    assert {e.block_size for e in rocm.layers or []} == {64}


def test_expected_layouts_per_node_type() -> None:
    from deployments.config import DSv4Section

    section = DSv4Section.model_validate(
        {"expected_layouts": {"sm90": "fp8_ds_mla", "sm100": "nvfp4_ds_mla"}})
    assert section.expected_for({"platform": "cuda", "compute_capability": "10.0"}) == \
        "nvfp4_ds_mla"
    assert section.expected_for({"platform": "cuda", "compute_capability": "9.0"}) == \
        "fp8_ds_mla"
    assert section.expected_for({"platform": "cpu"}) == "fp8_ds_mla"
    with pytest.raises(ValueError, match="not node types"):
        DSv4Section.model_validate({"expected_layouts": {"h200": "fp8_ds_mla"}})
