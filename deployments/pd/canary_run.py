"""The decode replica's side of the P/D output canary: run one through a pair, score it.

``deployments.pd.canary`` holds the rules; this runs them on the decode replica, the
only process that holds both ends: its prefill handle (whose router, in this process,
honours the canary's pin: ``deployments.pd.route.pinned``) and its own engine.

1. The prompt goes to the pinned prefill replica exactly as Ray's P/D orchestrator
   sends a user's (its connector backend's ``prepare_prefill_request``: one token,
   ``do_remote_decode``), with a fresh ``cache_salt``.
2. The decode engine generates greedily with the returned ``kv_transfer_params``
   (pages pulled over the connector), with each token's logprob and the count of
   prompt tokens it did not compute (``num_cached_tokens``: the per-request form of
   vLLM's ``prompt_tokens_by_source``; the salt rules out local prefix hits).
3. The reference: the same greedy request prefilled and decoded on the decode engine
   alone (another salt, ``skip_reading_prefix_cache``), started with step 1 so both
   engines work at once. Where its tokens match the pair's, their logprobs compare
   directly; where a near tie (or a fault) made them pick differently, the decode engine
   scores prompt + the pair's tokens alone (``prompt_logprobs``), which always applies.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
import uuid
from typing import Any

from deployments.control.canary_wire import CanaryMode, CanaryRequest, CanaryResult
from deployments.logs import get_logger
from deployments.pd import canary
from deployments.pd import route as pd_route

logger = get_logger("pd")


class PDCanaryMixin:
    """``run_canary`` for ``DSv4PDDecodeServer`` (Ray's ``PDDecodeServer`` underneath)."""

    _replica_id: str

    async def run_canary(self, message: dict[str, Any]) -> dict[str, Any]:
        """Run one canary through the pair (this replica, ``prefill_replica``)."""
        req = CanaryRequest.model_validate(message)
        started = time.monotonic()
        try:
            result = await asyncio.wait_for(self._canary(req), req.timeout_s)
        except TimeoutError:
            result = self._failed(req, f"no answer within {req.timeout_s:g} s (the pinned "
                                  "prefill replica is gone or the transfer hangs)")
        except Exception as exc:  # the pair is not proven; the reason is reported, not lost
            logger.exception("dsv4: P/D canary through %s failed", req.prefill_replica)
            result = self._failed(req, f"the canary raised {exc!r}")
        result.seconds, result.at = time.monotonic() - started, time.time()
        return result.model_dump(mode="json")

    def _failed(self, req: CanaryRequest, reason: str) -> CanaryResult:
        return CanaryResult(prefill_replica=req.prefill_replica,
                            decode_replica=self._replica_id, passed=False,
                            mode=CanaryMode.OUTPUT, reason=reason, seed=req.seed,
                            prompt_tokens=req.prompt_tokens,
                            tolerance=req.tolerance or 0.0)

    def _engine_client(self) -> Any:
        return self.engine._engine_client  # type: ignore[attr-defined]  # Ray Serve LLM's LLMServer.engine (registry: llm.pd_canary_engine)

    async def _canary(self, req: CanaryRequest) -> CanaryResult:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        client = self._engine_client()
        vcfg = client.vllm_config
        n = canary.prompt_length(req.prompt_tokens, vcfg.model_config.max_model_len,
                                 req.max_tokens)
        ids = canary.prompt(req.seed, n, vcfg.model_config.get_vocab_size())
        mode, why = canary.mode(vcfg.load_config.load_format, dict(os.environ))
        salt = uuid.uuid4().hex
        request_id = f"{pd_route.CANARY_PREFIX}{salt}"
        body = CompletionRequest(model=self._llm_config.model_id,  # type: ignore[attr-defined]  # LLMServer sets it
                                 prompt=ids, max_tokens=req.max_tokens, temperature=0.0,
                                 ignore_eos=True, cache_salt=salt, request_id=request_id)
        prefill = self._get_connector_backend().prepare_prefill_request(  # type: ignore[attr-defined]  # PDOrchestratorMixin (registry: llm.pd_canary_engine)
            request=body, peer=None)
        pd_route.ROUTE.pins[request_id] = req.prefill_replica
        t0 = time.monotonic()
        # The reference runs alone on this engine while the pair's prefill runs on the
        # prefill replica: the two engines work at once, the canary takes one prefill's time.
        reference = asyncio.ensure_future(self._generate(
            client, ids, uuid.uuid4().hex, request_id + "-r", req.max_tokens,
            top=canary.REFERENCE_TOP))
        try:
            return await self._through_pair(req, client, body, prefill, request_id, ids,
                                            reference, t0, mode, why)
        finally:
            if not reference.done():
                reference.cancel()

    async def _through_pair(self, req: CanaryRequest, client: Any, body: Any, prefill: Any,
                            request_id: str, ids: list[int], reference: Any, t0: float,
                            mode: CanaryMode, why: str) -> CanaryResult:
        vcfg, n, salt = client.vllm_config, len(ids), body.cache_salt
        platform = vcfg.device_config.device_type
        tol = canary.tolerance(platform, req.tolerance)
        median_tol = canary.median_tolerance(platform, req.median_tolerance)
        try:
            stream = self._prefill_handle.completions.remote(prefill, None)  # type: ignore[attr-defined]  # PDDecodeServer's handle
            chunk = await stream.__anext__()
            async for _ in stream:
                pass
        finally:
            pd_route.ROUTE.pins.pop(request_id, None)
        t1 = time.monotonic()
        result = CanaryResult(prefill_replica=req.prefill_replica,
                              decode_replica=self._replica_id, passed=False, mode=mode,
                              seed=req.seed, prompt_tokens=n, tolerance=tol,
                              median_tolerance=median_tol,
                              kv_load_failure_policy=getattr(vcfg.kv_transfer_config,
                                                             "kv_load_failure_policy", None))
        if not getattr(chunk, "kv_transfer_params", None):  # an ErrorResponse has none
            result.reason = f"the prefill replica answered no transfer params: {chunk!r}"[:300]
            return result
        # vLLM 0.32 reports the prefill side's cache hits as the decode request's
        # num_cached_tokens when the params carry them (output_processor.py); without
        # them it reports the decode engine's own: local hits (none: salted) + external.
        params = {k: v for k, v in chunk.kv_transfer_params.items()
                  if k != "remote_prefill_cached_tokens"}
        decoded = await self._generate(client, ids, salt, request_id + "-d", req.max_tokens,
                                       kv_transfer_params=params)
        t2 = time.monotonic()
        out = decoded.outputs[0]
        result.tokens = list(out.token_ids)
        result.finish_reason = out.finish_reason
        result.external_tokens = decoded.num_cached_tokens
        through = [step[t].logprob for step, t in zip(out.logprobs or [], out.token_ids,
                                                      strict=False)]
        if result.tokens and len(through) == len(result.tokens) and \
                out.finish_reason not in ("error", "abort"):
            ref = (await reference).outputs[0]
            result.deltas = canary.match_reference(
                result.tokens, through,
                [{t: lp.logprob for t, lp in step.items()} for step in ref.logprobs or []]) \
                or await self._scored(client, ids, result.tokens, through, request_id)
            result.max_delta = max(result.deltas)
            result.median_delta = statistics.median(result.deltas)
        result.phase_s = {"prefill": round(t1 - t0, 3), "decode": round(t2 - t1, 3),
                          "reference": round(time.monotonic() - t2, 3)}
        result.reason = canary.judge(
            canary_mode=mode, prompt_tokens=n, max_tokens=req.max_tokens,
            tokens=result.tokens, token_deltas=result.deltas, tolerance_nats=tol,
            external_tokens=result.external_tokens, finish_reason=result.finish_reason,
            median_tolerance_nats=median_tol)
        result.passed = not result.reason
        logger.info("dsv4: P/D canary %s <- %s: %s in %.1f s (%s), max delta %s",
                    self._replica_id, req.prefill_replica,
                    "passed" if result.passed else f"FAILED ({result.reason})",
                    time.monotonic() - t0, result.phase_s, result.max_delta)
        if result.passed and mode is CanaryMode.TRANSFER_ONLY:
            result.reason = why
        return result

    async def _scored(self, client: Any, ids: list[int], tokens: list[int],
                      through: list[float], request_id: str) -> list[float]:
        """Deltas against prompt + the pair's tokens scored alone (prompt logprobs): for
        when the local reference picked other tokens (a near tie, or a fault)."""
        scored = await self._generate(client, ids + tokens, uuid.uuid4().hex,
                                      request_id + "-s", 1, score=True)
        alone = [scored.prompt_logprobs[len(ids) + i][t].logprob
                 for i, t in enumerate(tokens)]
        return canary.deltas(through, alone)

    @staticmethod
    async def _generate(client: Any, ids: list[int], salt: str, request_id: str,
                        max_tokens: int, kv_transfer_params: dict[str, Any] | None = None,
                        score: bool = False, top: int = 0) -> Any:
        """The final ``RequestOutput`` of one greedy request on this replica's engine
        (its own prefill unless ``kv_transfer_params``; no prefix-cache reads)."""
        from vllm import SamplingParams

        # ignore_eos: a greedy canary that meets the end-of-sequence token must still
        # decode all its tokens (a short answer is a failure, not a clean stop).
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, logprobs=None if score else top,
            ignore_eos=True,
            prompt_logprobs=0 if score else None,
            skip_reading_prefix_cache=None if kv_transfer_params else True,
            extra_args={"kv_transfer_params": dict(kv_transfer_params)}
            if kv_transfer_params else None)
        final = None
        async for output in client.generate({"prompt_token_ids": ids, "cache_salt": salt},
                                            params, request_id):
            final = output
        if final is None:
            raise RuntimeError(f"the decode engine returned nothing for {request_id}")
        return final
