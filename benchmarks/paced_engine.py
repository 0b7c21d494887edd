"""A vLLM engine core that emits tokens at a GPU node's rate, for issue 34's cost of a
token at GPU rates through the real serving paths.

A CPU box cannot decode at a GPU node's rate, so this replaces only the engine core's
``EngineCore.step``: every request the real scheduler holds gets ``k`` random token ids
from the model's vocabulary per step, paced so the engine emits ``rate`` tokens per
second in all, and finishes at its ``max_tokens``. Everything in front of the engine
core is vLLM's and ours as they run: the engine process, its workers and KV cache boot
for real (so the replica's KV-spec check holds), and every token crosses ZMQ to the
front end, is detokenized by vLLM's output processor, and streams through vLLM's
OpenAI app, then our edge and each door. So the per-token CPU of ``vllm serve``'s API
server and of each of our paths is measured on the same token stream.

Switched on per process by ``DSV4_BENCH_PACED=<tok/s>:<tokens per chunk>`` with
``benchmarks/paced_site`` first on ``PYTHONPATH`` (``paced_env``): that directory's
``sitecustomize`` calls ``install``, which patches the engine core's module as it is
imported, in every process Ray or vLLM starts from that environment. Benchmark only.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import random
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

FLAG = "DSV4_BENCH_PACED"
TARGET = "vllm.v1.engine.core"
SITE_DIR = Path(__file__).with_name("paced_site")
REPO = Path(__file__).resolve().parents[1]


def paced_env(rate: float, per_chunk: int) -> dict[str, str]:
    """The environment that paces every engine core started from it."""
    path = os.pathsep.join([str(SITE_DIR), str(REPO), os.environ.get("PYTHONPATH", "")])
    return {FLAG: f"{rate:g}:{per_chunk}", "PYTHONPATH": path.rstrip(os.pathsep)}


def parse(value: str) -> tuple[float, int]:
    """``"20000:1"`` -> (20000.0, 1); errors name the flag and the form."""
    try:
        rate, per_chunk = value.split(":")
        parsed = float(rate), int(per_chunk)
    except ValueError:
        parsed = (0.0, 0)
    if parsed[0] <= 0 or parsed[1] < 1:
        raise ValueError(f"{FLAG}={value!r}: expected <tokens per second>:<tokens per "
                         "chunk>, both positive (e.g. 20000:1)")
    return parsed


class Pacer:
    """Step deadlines for ``rate`` tokens/s in all: a step of ``n`` tokens is due
    ``n / rate`` s after the previous one; a late step does not bank time."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.due = time.monotonic()

    def wait(self, tokens: int) -> None:
        now = time.monotonic()
        self.due = max(self.due, now - 0.01) + tokens / self.rate
        if self.due > now:
            time.sleep(self.due - now)


def paced_step(core: Any, rate: float, per_chunk: int) -> tuple[dict[int, Any], bool]:
    """One step: ``per_chunk`` tokens to every unfinished request, then wait its share."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
    from vllm.v1.request import RequestStatus

    scheduler = core.scheduler
    if not scheduler.has_requests():
        return {}, False
    state = core.__dict__.get("_dsv4_paced")
    if state is None:  # once per engine core, not on every step
        state = core.__dict__["_dsv4_paced"] = {
            "pacer": Pacer(rate), "vocab": core.vllm_config.model_config.get_vocab_size(),
            "rng": random.Random(0)}
    outputs: dict[int, list[Any]] = defaultdict(list)
    finished: list[str] = []
    emitted = 0
    for request in list(scheduler.requests.values()):
        if request.is_finished():
            continue
        count = min(per_chunk, request.max_tokens - request.num_output_tokens)
        ids = [state["rng"].randrange(state["vocab"]) for _ in range(count)]
        request.append_output_token_ids(ids)
        emitted += count
        done = request.num_output_tokens >= request.max_tokens
        outputs[request.client_index].append(EngineCoreOutput(
            request_id=request.request_id, new_token_ids=ids,
            finish_reason=FinishReason.LENGTH if done else None))
        if done:
            finished.append(request.request_id)
    if finished:
        scheduler.finish_requests(finished, RequestStatus.FINISHED_LENGTH_CAPPED)
        # schedule(), which this step never calls, forgets them; kept, they would make
        # has_requests() true for ever and the busy loop spin instead of blocking.
        scheduler.finished_req_ids = set()
    state["pacer"].wait(max(emitted, 1))
    return {client: EngineCoreOutputs(outputs=outs) for client, outs in outputs.items()}, True


def patch(module: ModuleType, rate: float, per_chunk: int) -> None:
    """Pace ``EngineCore`` (both step paths) in the imported ``vllm.v1.engine.core``."""
    def step(self: Any, *_: Any) -> tuple[dict[int, Any], bool]:
        return paced_step(self, rate, per_chunk)

    module.EngineCore.step = step
    module.EngineCore.step_with_batch_queue = step
    print(f"dsv4 bench: engine core paced at {rate:g} tok/s, {per_chunk} per chunk "
          f"(pid {os.getpid()})", file=sys.stderr, flush=True)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches ``TARGET`` right after its own code runs, whoever imports it."""

    def __init__(self, rate: float, per_chunk: int) -> None:
        self.rate, self.per_chunk = rate, per_chunk

    def find_spec(self, name: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # once; and the real finders find the module
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            patch(module, self.rate, self.per_chunk)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """From ``sitecustomize``: pace this process's engine core if the flag is set."""
    value = os.environ.get(FLAG)
    if not value:
        return
    rate, per_chunk = parse(value)
    if TARGET in sys.modules:
        patch(sys.modules[TARGET], rate, per_chunk)
    else:
        sys.meta_path.insert(0, _PatchOnImport(rate, per_chunk))
