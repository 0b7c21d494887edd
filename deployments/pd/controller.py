"""The P/D app's one controller: both pools' KV-spec checks plus the P/D verdict.

Each pool (prefill, decode) is checked exactly as a one-pool app is
(``deployments.control.controller.KVSpecController``: per-replica deadlines, prediction,
per-replica policy, its own Prometheus series tagged by deployment). On top, every
``controller_period_s`` (and on ``?refresh=true``) this controller compares every
prefill replica that answered with every decode replica that answered
(``deployments.pd.compat.judge``), sends each decode replica its whitelist of prefill
replicas (``apply_pd_route``, a ``wire.PDRouteMessage``) and publishes the verdict in
``GET /v1/kv-spec`` (``FleetReport.pd``) and as ``dsv4_pd_*`` gauges.

Each decode replica answers the whitelist with its count of failed KV transfers
(``wire.PDRouteAck``); a count that rose fails all of that replica's pairs in the same
check (``CanaryWatch.take_counts``), and the whitelists are sent again at once.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ray.serve.handle import DeploymentHandle

from deployments.control.canary_wire import CanaryBatch
from deployments.control.controller import KVSpecController
from deployments.control.wire import (
    FleetFinding,
    FleetReport,
    PDPool,
    PDReport,
    PDRouteAck,
    PDRouteMessage,
    PDVerdict,
    State,
)
from deployments.logs import get_logger
from deployments.observe import series
from deployments.pd import compat
from deployments.pd.canary_watch import CanaryWatch

logger = get_logger("pd")

POOLS = ("prefill", "decode")


class _PDMetrics:
    def __init__(self, application: str):
        self._tags = {"pd_application": application}
        gauges = series.make_each(
            series.PD_COMPATIBLE, series.PD_VERDICT, series.PD_PAIRS, series.PD_BLOCKED,
            series.PD_STRANDED, series.PD_CANARY_FAILED, series.PD_CANARY_PASSED,
            series.PD_CANARY_MAX_DELTA, series.PD_FAILED_TRANSFERS)
        (self.compatible, self.verdict, self.pairs, self.blocked, self.stranded,
         self.canary_failed, self.canary_passed, self.canary_delta,
         self.failed_transfers) = gauges
        for gauge in gauges:
            gauge.set_default_tags(dict(self._tags))

    def record(self, pd: PDReport) -> None:
        order = [PDVerdict.NOT_CHECKED, PDVerdict.COMPATIBLE, PDVerdict.PARTIAL,
                 PDVerdict.INCOMPATIBLE]
        self.compatible.set(1 if pd.verdict is PDVerdict.COMPATIBLE else 0)
        self.verdict.set(order.index(pd.verdict))
        self.pairs.set(sum(len(v) for v in pd.allowed.values()))
        self.blocked.set(len(pd.blocked_prefill))
        self.stranded.set(sum(not v for v in pd.allowed.values()))
        self.canary_failed.set(sum(not c.passed for c in pd.canaries))
        self.canary_passed.set(sum(c.passed for c in pd.canaries))
        deltas = [c.max_delta for c in pd.canaries if c.max_delta is not None]
        if deltas:
            self.canary_delta.set(max(deltas))
        for decode, count in pd.failed_kv_transfers.items():
            self.failed_transfers.set(count, tags={"decode_replica": decode})


async def _pool_controller(server: DeploymentHandle | str, dsv4: dict[str, Any],
                           kv_capacity: dict[str, Any] | None) -> KVSpecController:
    """A one-pool controller living inside this actor (its own loop and metrics)."""
    pool = KVSpecController.__new__(KVSpecController)
    await pool.__init__(server, dsv4, kv_capacity)  # type: ignore[misc]  # an async constructor
    return pool


class PDController:
    """One replica: the two pool controllers, the P/D verdict and the decode whitelists."""

    async def __init__(self, prefill: DeploymentHandle, decode: DeploymentHandle | str,  # type: ignore[misc]  # Serve awaits an async __init__
                       dsv4_prefill: dict[str, Any], dsv4_decode: dict[str, Any],
                       kv_capacity: dict[str, dict[str, Any]] | None = None,
                       canary: dict[str, Any] | None = None):
        """``decode`` may be the decode deployment's name: its replicas are the HTTP
        ingress and bind this controller (for ``/v1/kv-spec``), so they cannot be bound
        here too (``deployments.pd.builder``). ``kv_capacity``: ``plan``'s figures per
        pool (``plan.kv_figures.plan_pool_capacities``), so each pool exports its own."""
        capacity = kv_capacity or {}
        self._pools = {"prefill": await _pool_controller(prefill, dsv4_prefill,
                                                         capacity.get("prefill")),
                       "decode": await _pool_controller(decode, dsv4_decode,
                                                        capacity.get("decode"))}
        self._decode = self._pools["decode"]
        self._period = self._decode._settings.controller_period_s
        self._pd = PDReport(verdict=PDVerdict.NOT_CHECKED, message="no P/D check yet")
        self._lock = asyncio.Lock()
        self._metrics = _PDMetrics(self._decode._server.app_name)
        self._canary = CanaryWatch(canary)
        self._by_specs: PDReport | None = None  # the last verdict before the canary gate
        self._loop_task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await self.judge()
                if await self._run_canaries():  # a failing pair leaves in this pass
                    await self.judge()
            except Exception:
                logger.exception("dsv4: P/D check failed; retrying in %ss", self._period)
            await asyncio.sleep(self._period)

    async def judge(self) -> PDReport:
        """Compare the pools' last answers; send every decode replica its whitelist."""
        async with self._lock:
            started = time.time()
            pools = {name: PDPool(deployment=c._server.deployment_name,
                                  state=c.current().state,
                                  replicas=[s.replica_id for s in c.specs])
                     for name, c in self._pools.items()}
            report = compat.judge(self._pools["prefill"].specs, self._decode.specs, pools,
                                     checked_at=started)
            self._by_specs = by_specs = report
            report = self._gate(by_specs)
            if self._decode.specs:
                acks = await self._push(report, started)
                if self._canary.take_counts(acks, by_specs.allowed, started) and \
                        self._canary.settings.enabled:  # a failed transfer: its pairs out now
                    report = self._gate(by_specs)
                    await self._push(report, started)
            report = self._with_counts(report)
            if (report.verdict, report.allowed) != (self._pd.verdict, self._pd.allowed):
                log = logger.info if report.verdict is PDVerdict.COMPATIBLE else logger.warning
                log("dsv4: P/D %s: %s", report.verdict.value, report.message)
            self._pd = report
            self._metrics.record(report)
            return report

    def _gate(self, report: PDReport) -> PDReport:
        return self._canary.gate(report) if self._canary.settings.enabled else report

    def _with_counts(self, report: PDReport) -> PDReport:
        """``report`` with each decode replica's failed-transfer count, or why it has none."""
        unread = self._canary.unread
        message = report.message + "".join(
            f" Failed KV transfers of decode {d} are not read: {why}."
            for d, why in sorted(unread.items()))
        return report.model_copy(update={
            "failed_kv_transfers": dict(self._canary.failed_transfers),
            "message": message.strip()})

    async def _run_canaries(self) -> bool:
        """The due canaries of the pairs the specs allow, each decode replica running its
        own in turn; outside the lock, so ``/v1/kv-spec`` never waits for a canary."""
        report = self._by_specs
        if not self._canary.settings.enabled or report is None or not report.allowed:
            return False
        due = self._canary.due(report.allowed, time.time())
        if not due:
            return False
        batch = CanaryBatch(requests=self._canary.requests(due))
        most = max(len(v) for v in batch.requests.values())
        bound = most * self._canary.settings.timeout_s + 10.0
        try:
            answers = await self._decode._server.broadcast(
                "run_canaries", batch.model_dump(mode="json")).results_async(
                timeout_s=bound, return_exceptions=True)
        except Exception as exc:  # the decode pool is (re)starting: the pairs stay out
            logger.warning("dsv4: P/D canaries of %d pair(s) not run: %r", len(due), exc)
            return False
        self._canary.take(answers)
        return True

    async def _push(self, report: PDReport, checked_at: float) -> list[PDRouteAck]:
        """Send each decode replica its whitelist; return the answers of those that took it."""
        message = PDRouteMessage(checked_at=checked_at, verdict=report.verdict,
                                 allowed=report.allowed)
        acks, late, error = await self._decode._call_each("apply_pd_route",
                                                          message.model_dump(mode="json"))
        failed = [a for a in acks if not isinstance(a, dict)]
        if failed or late or error:
            logger.warning("dsv4: %d decode replica(s) did not take the P/D route (%d late): "
                           "%s", len(failed) + late, late, error or (failed[0] if failed else ""))
        return [PDRouteAck.model_validate(a) for a in acks if isinstance(a, dict)]

    async def check(self) -> dict[str, Any]:
        """Check both pools now, then judge the pairs; return the combined report."""
        await asyncio.gather(*(c.check() for c in self._pools.values()))
        await self.judge()
        return self.current().model_dump(mode="json")

    def current(self) -> FleetReport:
        """The decode pool's report widened to both pools, with the P/D verdict."""
        reports = {name: c.current() for name, c in self._pools.items()}
        decode = reports["decode"]
        rows: list[Any] = []
        problems: list[Any] = []
        odd: dict[str, Any] = {}
        for name in POOLS:
            r = reports[name]
            rows += [row.model_copy(update={"pool": name}) for row in r.replicas]
            problems += [p.model_copy(update={"message": f"{name} pool: {p.message}"})
                         for p in r.problems]
            odd |= r.odd_replicas
        pd = self._pd
        for p in pd.blocked_prefill:
            odd.setdefault(p, "P/D: " + pd.message)
        if pd.verdict is not PDVerdict.COMPATIBLE:
            problems.append(FleetFinding(kind="pd", message=f"P/D {pd.verdict.value}: {pd.message}",
                                    field=",".join(sorted({d.field for d in pd.differences}))
                                    or None))
        state = compat.combined_state(compat.pool_state([r.state for r in
                                                               reports.values()]), pd.verdict)
        running = [r.running_replicas for r in reports.values()]
        return decode.model_copy(update={
            "state": state, "agree": state is State.AGREE, "replicas": rows,
            "problems": problems, "odd_replicas": odd, "pd": pd,
            "answered": sum(r.answered for r in reports.values()),
            "running_replicas": None if None in running else sum(running),
            "deployment": f"{reports['prefill'].deployment} + {decode.deployment}"})

    async def report(self, refresh: bool = False) -> dict[str, Any]:
        """The latest combined verdict; ``refresh`` checks both pools and the pairs now."""
        if refresh:
            bound = self._decode._check_bound_s() + 10.0
            try:
                await asyncio.wait_for(self.check(), bound)
            except TimeoutError:
                logger.warning("dsv4: on-demand P/D check exceeded %.0f s", bound)
        return self.current().model_dump(mode="json")

    async def set_policy(self, policy: str | None) -> dict[str, Any]:
        """``KVSpecController.set_policy`` on both pools, then the pairs judged again."""
        for c in self._pools.values():
            await c.set_policy(policy)
        await self.judge()
        return self.current().model_dump(mode="json")

    async def check_health(self) -> None:
        if self._loop_task.done():
            raise RuntimeError(f"dsv4: the P/D check loop stopped: "
                               f"{self._loop_task.exception()!r}")
        for c in self._pools.values():
            await c.check_health()
