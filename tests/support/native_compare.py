"""Our DeepSeek-V4 CPU ops against vLLM's native kernels, on the inputs a real engine makes.

Used by tests/test_dsv4_patch/test_cpu_ops_native.py and runnable on its own for the numbers
(``python -m tests.support.native_compare`` from the repo root). Only meaningful on a host
whose loaded ``vllm/_C`` has the native kernels (AVX512-BF16; see ``ops._loaded_library``).

How: the tiny DeepSeek-V4 runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
one uniprocess worker) with every call of the 16 ops routed through a comparing wrapper.
Per call it runs *our* implementation on clones of the arguments first, then the native
kernel on the real ones (the engine keeps running on native results, so its state is
what a native run produces), then compares every output: the returned tensors and every
argument the schema marks as written (``Tensor(a!)``). ``convert_weight_packed`` outputs
are private formats, so they are not compared; instead each native packed weight is
mapped to our packing of the same weight, and ``bmm_cpu`` gets the matching one.
Random inputs of the real shapes, dtypes, strides and page layouts: the engine's own
activations under fan-in-scaled dummy weights (tests/support/scaled_dummy.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass
class OpStats:
    """What one output of one op looked like, ours vs native, over every call seen."""

    dtype: str = ""
    calls: int = 0
    elements: int = 0  # output elements compared (bytes for uint8 caches)
    unequal: int = 0  # of those, not bit-identical
    max_abs: float = 0.0  # largest |ours - native| over float outputs (fp8 decoded)
    max_ref: float = 0.0  # largest |native| over the same outputs, for scale
    nonfinite_mismatch: int = 0  # elements finite in one and not the other

    @property
    def bit_exact(self) -> bool:
        return self.unequal == 0 and self.nonfinite_mismatch == 0


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _accumulate(stats: OpStats, name: str, ours: torch.Tensor, native: torch.Tensor) -> None:
    """Fold one call's output pair into ``stats``.

    The written arguments include whole KV caches (1 GiB here), so this is where the
    comparison's time goes (a profile: 300 of 400 s in the first version). One bitwise
    pass finds the differing elements; the float statistics look only at those (equal
    bits are equal values and equal finiteness), and the scale (largest finite
    ``|native|``) is one more pass over ``native``.
    """
    stats.dtype = str(native.dtype).removeprefix("torch.")
    stats.calls += 1
    assert ours.shape == native.shape and ours.dtype == native.dtype, (
        name, ours.shape, native.shape, ours.dtype, native.dtype)
    a, b = ours.contiguous(), native.contiguous()
    as_int = _SAME_WIDTH_INT[a.element_size()]
    differ = a.view(as_int) != b.view(as_int)  # bitwise: NaN payloads equal, -0 != +0
    stats.elements += a.numel()
    if not a.is_floating_point() or a.dtype == torch.float8_e4m3fn:
        stats.unequal += int(differ.count_nonzero())
        return
    da, db = a[differ].float(), b[differ].float()
    both_nan = torch.isnan(da) & torch.isnan(db)
    stats.unequal += int(((da != db) & ~both_nan).count_nonzero())  # -0 == +0, as ==
    finite = torch.isfinite(da) & torch.isfinite(db)
    stats.nonfinite_mismatch += int((torch.isfinite(da) != torch.isfinite(db)).count_nonzero())
    if bool(finite.any()):
        stats.max_abs = max(stats.max_abs, float((da - db)[finite].abs().max()))
    scale = b.abs().nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    if scale.numel():
        stats.max_ref = max(stats.max_ref, float(scale.max()))


def _written(schema: Any) -> list[int]:
    """Positions of the arguments the op's schema marks as mutated."""
    return [i for i, arg in enumerate(schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write]


def _clone(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) else x


Pair = tuple[str, torch.Tensor, torch.Tensor]


def _canonical(name: str, args: tuple, pairs: list[Pair]) -> list[Pair]:
    """Drop what an op's contract leaves free before comparing.

    Routing returns (weights, ids) in any expert order: sort each token's pairs by id.
    topk_transform returns a *set* of positions per row (order free): sort each row.
    Paged logits are defined for ``t < seq_lens[b]`` only (ours writes -inf past it,
    the native kernel leaves other values; topk masks by seq_len either way): zero the rest.
    """
    if name in ("biased_topk_cpu", "hash_topk_cpu"):
        (_, ow, nw), (_, oi, ni) = pairs
        oo, no = oi.long().argsort(-1), ni.long().argsort(-1)
        return [("weights", ow.gather(-1, oo), nw.gather(-1, no)),
                ("ids", oi.gather(-1, oo), ni.gather(-1, no))]
    if name == "topk_transform_512_cpu":
        return [(out, o.sort(-1).values, n.sort(-1).values) for out, o, n in pairs]
    if name == "fp8_paged_mqa_logits_cpu":
        (out, o, n), = pairs
        seq_lens = args[3]
        past = torch.arange(o.shape[1]).unsqueeze(0) >= seq_lens.long().unsqueeze(1)
        return [(out, o.masked_fill(past, 0.0), n.masked_fill(past, 0.0))]
    return pairs


def _returns(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


class CompareOps:
    """Run ours beside native for every DeepSeek-V4 CPU op the engine calls.

    A context manager that shadows ``torch.ops._C.<op>`` for the 16 ops with a comparing
    wrapper (vLLM calls them as ``torch.ops._C.<op>`` or through ``vllm._custom_ops``
    wrappers that look that name up at call time; some calls sit inside vLLM's opaque
    attention custom op, which a TorchDispatchMode would not see into).
    """

    def __init__(self) -> None:
        from dsv4_patch.patches.cpu import ops

        self.impls = {op.name: op.impl for op in ops.REGISTRY}
        self.calls: dict[str, int] = dict.fromkeys(self.impls, 0)
        self.stats: dict[str, OpStats] = {}  # "op.output" -> stats
        self.packed: dict[int, torch.Tensor] = {}  # native packed data_ptr -> our packing
        self._native: dict[str, Any] = {}

    def __enter__(self) -> CompareOps:
        import vllm._custom_ops  # noqa: F401  loads the native library

        for name in self.impls:
            self._native[name] = getattr(torch.ops._C, name)
            setattr(torch.ops._C, name, self._wrapper(name))
        return self

    def __exit__(self, *exc: object) -> None:
        for name in self._native:
            delattr(torch.ops._C, name)  # the namespace resolves the real op again

    def _wrapper(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            return self._compare(name, args, kwargs)

        return call

    def _compare(self, name: str, args: tuple, kwargs: dict) -> Any:
        native_op = self._native[name]
        self.calls[name] += 1
        if name == "convert_weight_packed":
            native = native_op(*args, **kwargs)
            self.packed[native.data_ptr()] = self.impls[name](args[0].clone())
            return native
        ours_args = [_clone(a) for a in args]
        if name == "bmm_cpu" and args[3]:  # is_vnni: mat2 is a packed weight
            ours_args[2] = self.packed[args[2].data_ptr()]
        ours_out = self.impls[name](*ours_args, **kwargs)
        native_out = native_op(*args, **kwargs)
        schema = native_op.default._schema
        pairs = [(schema.arguments[i].name, ours_args[i], args[i]) for i in _written(schema)]
        pairs += [(f"return[{j}]", o, n) for j, (o, n) in enumerate(
            zip(_returns(ours_out), _returns(native_out), strict=True))]
        for output, o, n in _canonical(name, args, pairs):
            _accumulate(self.stats.setdefault(f"{name}.{output}", OpStats()), output, o, n)
        return native_out


def run(prompt_lengths: tuple[int, ...] = (2, 40, 300, 2300), max_tokens: int = 4,
        ) -> tuple[dict[str, int], dict[str, OpStats]]:
    """Boot the tiny model in this process under ``CompareOps``; generate; return stats."""
    from dsv4_patch import tiny_model, tiny_tokenizer

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for key, value in tiny_model.CPU_ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    from dsv4_patch.import_hooks import when_imported
    from tests.support import scaled_dummy

    when_imported(scaled_dummy.DUMMY_LOADER_MODULE, scaled_dummy.install_into)
    from tokenizers import Tokenizer
    from vllm import LLM, SamplingParams

    model_dir = tiny_model.ensure_tiny_model()
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tok.encode(tiny_tokenizer.read_corpus(), add_special_tokens=False).ids
    prompts = [{"prompt_token_ids": [0, *[ids[(7 * n + i) % len(ids)] for i in range(n - 1)]]}
               for n in prompt_lengths]
    mode = CompareOps()
    with mode:
        llm = LLM(**tiny_model.cpu_engine_kwargs(model_dir, max_num_seqs=8,
                                                 enable_prefix_caching=False))
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                min_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
    return mode.calls, mode.stats


def main() -> int:
    calls, stats = run()
    rows = {name: {**asdict(s), "bit_exact": s.bit_exact} for name, s in stats.items()}
    print("RESULT " + json.dumps({"calls": calls, "outputs": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
