"""The controller's side of the P/D output canary: which pairs may carry requests.

A pair the specs allow joins the routing whitelist only after a clean canary; it is
canaried again every ``pd.canary.period_s`` (and at once when it is new: a replaced
replica has a new id, so every pair it forms is new), and leaves the whitelist the
moment a canary fails, until one passes. ``gate`` is called by
``deployments.pd.controller.PDController.judge`` before it pushes the whitelists, so a
failing pair is excluded within one period.

The canaries are sent to the decode pool by broadcast: every decode replica takes the
``CanaryRequest``s addressed to it (``run_canaries``) and runs them one after another
(a canary is a prefill and two engine passes; run together they would slow each other
and user requests).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from deployments.config.pd import CanarySection
from deployments.control.canary_wire import CanaryRequest, CanaryResult
from deployments.control.wire import PDReport, PDVerdict
from deployments.logs import get_logger

logger = get_logger("pd")

Pair = tuple[str, str]  # (decode replica, prefill replica)


class CanaryWatch:
    """The latest canary per pair, and the rule that turns them into a whitelist."""

    def __init__(self, settings: dict[str, Any] | None):
        self.settings = CanarySection.model_validate(settings or {})
        self.results: dict[Pair, CanaryResult] = {}
        self._seed = int(time.time())  # a new prompt per canary, also across restarts
        self.totals = {"run": 0, "failed": 0}  # since this controller started

    def due(self, allowed: dict[str, list[str]], now: float) -> list[Pair]:
        """Pairs the specs allow whose canary is missing or older than one period."""
        out = []
        for decode, prefills in allowed.items():
            for prefill in prefills:
                last = self.results.get((decode, prefill))
                if last is None or now - last.at >= self.settings.period_s:
                    out.append((decode, prefill))
        return out

    def requests(self, pairs: Iterable[Pair]) -> dict[str, list[dict[str, Any]]]:
        """decode replica -> the ``CanaryRequest``s it runs (each with its own seed)."""
        s = self.settings
        out: dict[str, list[dict[str, Any]]] = {}
        for decode, prefill in pairs:
            self._seed += 1
            out.setdefault(decode, []).append(CanaryRequest(
                prefill_replica=prefill, seed=self._seed, prompt_tokens=s.prompt_tokens,
                max_tokens=s.max_tokens, tolerance=s.tolerance,
                median_tolerance=s.median_tolerance,
                timeout_s=s.timeout_s).model_dump(mode="json"))
        return out

    def take(self, answers: Iterable[Any]) -> list[CanaryResult]:
        """Record the replicas' answers (lists of ``CanaryResult`` dicts); log changes."""
        taken = []
        for answer in answers:
            if isinstance(answer, BaseException) or not isinstance(answer, list):
                logger.warning("dsv4: a decode replica did not run its P/D canaries: %r",
                               answer)
                continue
            for raw in answer:
                result = CanaryResult.model_validate(raw)
                self.totals["run"] += 1
                self.totals["failed"] += not result.passed
                before = self.results.get(result.pair)
                self.results[result.pair] = result
                taken.append(result)
                if not result.passed:
                    logger.error("dsv4: P/D canary FAILED for decode %s <- prefill %s: %s "
                                 "(deltas %s, tokens %s); the pair is excluded",
                                 result.decode_replica, result.prefill_replica, result.reason,
                                 [round(d, 3) for d in result.deltas], result.tokens)
                elif before is None or not before.passed:
                    logger.info("dsv4: P/D canary passed for decode %s <- prefill %s "
                                "(max delta %s, %d prompt tokens over the connector, %.1f s)",
                                result.decode_replica, result.prefill_replica,
                                result.max_delta, result.external_tokens or 0, result.seconds)
        return taken

    def gate(self, report: PDReport) -> PDReport:
        """``report`` with ``allowed`` cut to pairs whose latest canary passed."""
        live = {(d, p) for d, ps in report.allowed.items() for p in ps}
        self.results = {k: v for k, v in self.results.items() if k in live}
        allowed = {d: [p for p in ps if (r := self.results.get((d, p))) is not None
                       and r.passed] for d, ps in report.allowed.items()}
        failed = [r for r in self.results.values() if not r.passed]
        message = report.message
        if failed:
            message += " Output canary failed for " + "; ".join(
                f"decode {r.decode_replica} <- prefill {r.prefill_replica}: {r.reason}"
                for r in failed[:3]) + " (excluded until a clean canary)."
        waiting = len(live) - len(self.results)
        if waiting:
            message += f" {waiting} pair(s) wait for their first output canary."
        verdict = report.verdict
        if failed:
            stranded = any(not ps for ps in allowed.values())
            worse = PDVerdict.INCOMPATIBLE if stranded else PDVerdict.PARTIAL
            if report.verdict is not PDVerdict.INCOMPATIBLE:
                verdict = worse
        used = {p for ps in allowed.values() for p in ps}
        blocked = sorted({p for ps in report.allowed.values() for p in ps} - used
                         | set(report.blocked_prefill))
        return report.model_copy(update={
            "allowed": allowed, "message": message.strip(), "verdict": verdict,
            "blocked_prefill": blocked if failed else report.blocked_prefill,
            "canary_totals": dict(self.totals),
            "canaries": sorted(self.results.values(), key=lambda r: r.pair)})

    @staticmethod
    def failed_pairs(report: PDReport) -> int:
        return sum(not r.passed for r in report.canaries)
