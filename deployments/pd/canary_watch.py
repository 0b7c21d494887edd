"""The controller's side of the P/D output canary: which pairs may carry requests.

A pair the specs allow joins the routing whitelist only after a clean canary; it is
canaried again every ``pd.canary.period_s`` (and at once when it is new: a replaced
replica has a new id, so every pair it forms is new), and leaves the whitelist the
moment a canary fails, until one passes.

Each decode replica also reports how many KV transfers its engine counted as failed
(``wire.PDRouteAck``, read from vLLM's NIXL counter by ``deployments.pd.failed_transfers``).
When that count rises between two checks (``take_counts``), every pair of that decode
replica fails at once -- the counter does not name the prefill replica -- with a result
that names the decode replica and the number, and is due for a canary at once; each
rejoins after a clean canary, as above. A count that went down is a restarted process
counting from 0 again, and a replica's first count is where it starts: neither is a
rise. ``gate`` is called by
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
from deployments.control.canary_wire import CanaryMode, CanaryRequest, CanaryResult
from deployments.control.wire import PDReport, PDRouteAck, PDVerdict
from deployments.logs import get_logger

logger = get_logger("pd")

Pair = tuple[str, str]  # (decode replica, prefill replica)


def rise(before: int | None, now: int | None) -> int:
    """Failed transfers counted between two checks: 0 at a replica's first count, when
    its count is unknown, and when it went down (a restarted process counts from 0)."""
    if before is None or now is None or now < before:
        return 0
    return now - before


class CanaryWatch:
    """The latest canary per pair, and the rule that turns them into a whitelist."""

    def __init__(self, settings: dict[str, Any] | None):
        self.settings = CanarySection.model_validate(settings or {})
        self.results: dict[Pair, CanaryResult] = {}
        self._seed = int(time.time())  # a new prompt per canary, also across restarts
        # Since this controller started: canaries run and failed, and pairs failed by
        # their decode replica's failure counter.
        self.totals = {"run": 0, "failed": 0, "failed_by_counter": 0}
        self.failed_transfers: dict[str, int] = {}  # decode replica -> its last count
        self.unread: dict[str, str] = {}  # decode replica -> why its count is not read

    def due(self, allowed: dict[str, list[str]], now: float) -> list[Pair]:
        """Pairs the specs allow whose canary is missing or older than one period, or
        whose latest result is a failure by their decode replica's counter."""
        out = []
        for decode, prefills in allowed.items():
            for prefill in prefills:
                last = self.results.get((decode, prefill))
                # failed_kv_transfers: failed by its decode's counter, not yet canaried
                if last is None or last.failed_kv_transfers is not None or \
                        now - last.at >= self.settings.period_s:
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

    def take_counts(self, acks: Iterable[PDRouteAck], pairs: dict[str, list[str]],
                    now: float) -> dict[str, int]:
        """Each decode replica's failed-transfer count, from its answer to the whitelist.

        ``pairs``: decode replica -> the prefill replicas the specs allow it. Where a
        count rose since the last check, and the canary is on, every one of those pairs
        fails now (its latest result replaced) and is due for a canary at once. Returns
        decode replica -> failed transfers since the last check, for those that rose.
        """
        rose: dict[str, int] = {}
        answered = set()
        for ack in acks:
            answered.add(ack.replica_id)
            count = ack.failed_kv_transfers
            if count is None:
                why = ack.failed_kv_transfers_unread or "not reported (an older dsv4-serve)"
                if self.unread.get(ack.replica_id) != why:
                    logger.warning("dsv4: P/D decode replica %s does not report its failed KV "
                                   "transfers: %s", ack.replica_id, why)
                self.unread[ack.replica_id] = why
                continue
            self.unread.pop(ack.replica_id, None)
            if n := rise(self.failed_transfers.get(ack.replica_id), count):
                rose[ack.replica_id] = n
            self.failed_transfers[ack.replica_id] = count
        known = set(pairs) | answered
        self.failed_transfers = {d: c for d, c in self.failed_transfers.items() if d in known}
        self.unread = {d: why for d, why in self.unread.items() if d in known}
        for decode, n in rose.items():
            logger.error("dsv4: P/D decode replica %s counted %d failed KV transfer(s) since "
                         "the previous check (%d in all)%s", decode, n,
                         self.failed_transfers[decode],
                         "; its pairs are excluded until a clean canary"
                         if self.settings.enabled else " (pd.canary is off: its pairs stay)")
            if self.settings.enabled:
                for prefill in pairs.get(decode, []):
                    self._fail_by_counter((decode, prefill), n, now)
        return rose

    def _fail_by_counter(self, pair: Pair, failed: int, now: float) -> None:
        """The pair's latest result becomes a failure naming its decode replica's count."""
        decode, prefill = pair
        last = self.results.get(pair)
        reason = (f"decode replica {decode} counted {failed} failed KV transfer(s) since the "
                  f"controller's previous check ({self.failed_transfers[decode]} since it "
                  "started; vLLM's vllm:nixl_num_failed_transfers): the counter does not "
                  "name the prefill replica, so every pair of this decode replica is "
                  "excluded until a clean canary")
        if last is not None and not last.passed and last.failed_kv_transfers is None:
            reason += f"; the pair's last canary: {last.reason}"
        s = self.settings
        self.results[pair] = CanaryResult(
            prefill_replica=prefill, decode_replica=decode, passed=False,
            mode=last.mode if last else CanaryMode.OUTPUT, reason=reason, seed=0,
            prompt_tokens=last.prompt_tokens if last else s.prompt_tokens,
            tolerance=last.tolerance if last else s.tolerance or 0.0,
            kv_load_failure_policy=last.kv_load_failure_policy if last else None,
            failed_kv_transfers=failed, at=now)
        self.totals["failed_by_counter"] += 1

    @staticmethod
    def failed_pairs(report: PDReport) -> int:
        return sum(not r.passed for r in report.canaries)
