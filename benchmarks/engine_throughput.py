"""Benchmark: the tiny DeepSeek-V4 on a real vLLM CPU engine -- boot time and tokens/s.

Measures, in one process and one run:
1. engine boot (``vllm.LLM(...)`` until it returns; plugin and CPU fallbacks included),
2. greedy decode throughput of one stream (1 prompt x ``--max-tokens``),
3. greedy decode throughput of a batch of 4 (4 prompts x ``--max-tokens``),
and the batch/single ratio. Every request generates exactly ``--max-tokens``
(``ignore_eos``); tokens/s = generated tokens / wall time of ``generate()`` (prefill
included, 32-token prompts), median of ``--repeats`` after one warm-up.

Prints a table and writes JSON (``--out``), the table also as
``benchmarks/results/engine_throughput.json``. Heavy: run it alone, e.g.
``flock /tmp/dsv4-heavy.lock python -m benchmarks.engine_throughput``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.results import this_command, write_result

REPO = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 32


def _prompts(model_dir: Path, count: int) -> list[dict[str, list[int]]]:
    """``count`` distinct 32-token prompts (BOS + corpus tokens) from the tiny tokenizer."""
    from tokenizers import Tokenizer

    from dsv4_patch.tiny_tokenizer import read_corpus

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tok.encode(read_corpus(), add_special_tokens=False).ids
    step = PROMPT_TOKENS - 1
    return [{"prompt_token_ids": [0, *ids[i * step:(i + 1) * step]]} for i in range(count)]


def _timed_generate(llm: Any, prompts: list[dict[str, list[int]]], max_tokens: int) -> float:
    """Tokens/s of one greedy ``generate()``; checks every request got ``max_tokens``."""
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True
    )
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    got = [len(o.outputs[0].token_ids) for o in outputs]
    if got != [max_tokens] * len(prompts):
        raise RuntimeError(f"requests returned {got} tokens, expected {max_tokens} each")
    return sum(got) / elapsed


def measure(repeats: int, max_tokens: int) -> dict[str, Any]:
    from dsv4_patch import tiny_model

    for key, value in tiny_model.CPU_ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    build_start = time.perf_counter()
    model_dir = tiny_model.ensure_tiny_model()
    build_s = time.perf_counter() - build_start
    from vllm import LLM

    boot_start = time.perf_counter()
    llm = LLM(**tiny_model.cpu_engine_kwargs(model_dir, max_num_seqs=8))
    boot_s = time.perf_counter() - boot_start

    prompts = _prompts(model_dir, 4)
    _timed_generate(llm, prompts, 8)  # warm-up: first-step allocations, lazy imports
    single = [_timed_generate(llm, prompts[:1], max_tokens) for _ in range(repeats)]
    batch = [_timed_generate(llm, prompts, max_tokens) for _ in range(repeats)]
    import torch

    return {
        "model_dir": str(model_dir),
        "ensure_tiny_model_s": round(build_s, 3),
        "boot_s": round(boot_s, 2),
        "prompt_tokens": PROMPT_TOKENS,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "single_tok_s": round(statistics.median(single), 1),
        "batch4_tok_s": round(statistics.median(batch), 1),
        "batch4_over_single": round(statistics.median(batch) / statistics.median(single), 2),
        "runs": {"single": [round(x, 1) for x in single], "batch4": [round(x, 1) for x in batch]},
        "host": {
            "cpus": os.cpu_count(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "machine": platform.machine(),
            "torch_threads": torch.get_num_threads(),
        },
    }


def table_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        ("engine boot", f"{result['boot_s']:.1f} s"),
        ("single stream", f"{result['single_tok_s']:.1f} tok/s"),
        ("batch of 4", f"{result['batch4_tok_s']:.1f} tok/s"),
        ("batch / single", f"{result['batch4_over_single']:.2f}x"),
    ]


def print_table(result: dict[str, Any]) -> None:
    print(f"tiny DeepSeek-V4, {result['host']['cpus']} CPUs "
          f"({result['host']['cpu_capability']}), {result['max_tokens']} tokens/request")
    for name, value in table_rows(result):
        print(f"  {name:<16} {value:>14}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=REPO / "results" / "engine_throughput.json")
    args = parser.parse_args()
    result = measure(args.repeats, args.max_tokens)
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    print(f"wrote {record(result)}")
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow interpreter teardown; the engine dies with us


def record(result: dict[str, Any]) -> Path:
    """The printed table as ``benchmarks/results/engine_throughput.json``."""
    return write_result(
        "engine_throughput", title="Tiny DeepSeek-V4 on a real vLLM CPU engine",
        what=("Engine boot (`vllm.LLM(...)` until it returns) and greedy decode throughput "
              "of one stream and of a batch of 4, every request exactly max_tokens "
              "(ignore_eos); tokens/s over generate()'s wall time, median of the repeats "
              "after one warm-up."),
        command=this_command("benchmarks.engine_throughput"),
        inputs={"repeats": result["repeats"], "max_tokens": result["max_tokens"],
                "prompt_tokens": result["prompt_tokens"],
                "cpu_capability": result["host"]["cpu_capability"],
                "torch_threads": result["host"]["torch_threads"]},
        columns=["measure", "value"], rows=[list(r) for r in table_rows(result)],
        notes=f"Runs (tok/s): {json.dumps(result['runs'])}.")


    sys.exit(main())
