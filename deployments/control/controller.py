"""The KV-spec controller: proves every RUNNING replica stores the KV pages its config predicts.

vLLM checks that the ranks of one engine agree; nothing checks separate replicas
(mixed GPU generations, a rolling vLLM upgrade, a node-local backend override). This
Serve deployment does, periodically and on demand:

1. count RUNNING replicas (``serve.status()``, bounded by ``dsv4.status_timeout_s``, at
   most one call in flight): a replica that silently does not answer makes the verdict
   ``incomplete``;
2. call ``kv_page_spec`` on every replica, each under its own deadline
   (``dsv4.broadcast_timeout_s``): a hung replica is ``no_answer``, the others are judged;
3. judge (``verdict.decide``: the byte-model prediction first, peers second), choose each
   odd replica's action within its own policy (``enforcement``) and send every replica
   its verdict (``apply_kv_verdict``, a ``wire.VerdictMessage``);
4. publish the report (``GET /v1/kv-spec``, a ``wire.FleetReport``) and the Prometheus
   series (``control.metrics``). A report older than ``dsv4.stale_bound_s`` is served as
   ``stale`` and the controller fails its health check so Serve restarts it.

Ray internals touched, documented and probed in ``deployments.ray_touches``:
``serve.broadcast_per_replica_results`` (fallback ``results_async``, all-or-nothing,
logged) and ``serve.replica_ids`` (naming the replicas that missed a deadline).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments import ray_touches
from deployments.config import DSv4Section, Policy
from deployments.control.answers import parse_answer
from deployments.control.enforcement import EnforceBook, plan_actions, verdicts_held
from deployments.control.metrics import FleetMetrics, ReplicaMetrics
from deployments.control.replicas import alive_replica_ids, call_each, running_replicas
from deployments.control.report import log_change
from deployments.control.verdict import NoAnswer, decide
from deployments.control.wire import (
    Expected,
    FleetFinding,
    FleetReport,
    KVCapacityPlan,
    ReplicaSpec,
    ReplicaVerdict,
    State,
    VerdictMessage,
)
from deployments.logs import get_logger

logger = get_logger("controller")


class KVSpecController:
    """One replica; its loop checks every ``controller_period_s`` seconds."""

    async def __init__(self, server: DeploymentHandle | str, dsv4: dict[str, Any],  # type: ignore[misc]  # Serve awaits an async __init__
                       kv_capacity: dict[str, Any] | None = None):
        """``kv_capacity``: ``plan``'s figures per node type (``plan.kv_figures``)."""
        self._settings = DSv4Section.model_validate(dsv4)
        if isinstance(server, str):  # by name when the servers bind us (a graph has no cycles)
            server = serve.get_deployment_handle(
                server, app_name=serve.get_replica_context().app_name)
        self._server = server
        self._policy_override: str | None = None
        self._lock = asyncio.Lock()
        self._started = time.time()
        self._completed_at: float | None = None
        self._status_call: asyncio.Future[int | None] | None = None
        self._status_since = 0.0
        self._known: dict[str, int | None] = {}  # replica id -> rank, from past answers
        self.specs: list[ReplicaSpec] = []  # the last check's answers (P/D compares them)
        # Validated full specs by replica id: a replica whose spec is held answers
        # with a ReplicaSpecBrief (see wire.answer_kv_page_spec).
        self._held: dict[str, ReplicaSpec] = {}
        self._brief = True  # False once a replica rejected `known` (older dsv4-serve)
        s = self._settings
        self._book = EnforceBook(s.enforce_max_attempts, s.enforce_backoff_s)
        self._metrics = FleetMetrics(server.deployment_name)
        self._capacity = KVCapacityPlan.model_validate(kv_capacity or {"reason": (
            "the controller was given no KV capacity figures (an app built without them)")})
        self._report = self._not_checked()  # reads _capacity
        self._replica_metrics = ReplicaMetrics(server.deployment_name, self._capacity,
                                               server.app_name)
        self._per_replica = ray_touches.present("serve.broadcast_per_replica_results")
        if not self._per_replica:
            logger.warning("dsv4: this Ray has no per-replica broadcast results; one hung "
                           "replica will make a whole check incomplete")
        # Async constructor: the loop task lives on the replica's event loop.
        self._loop_task = asyncio.create_task(self._run())

    # ------------------------------------------------------------------ report

    @property
    def _policy(self) -> str:
        return self._policy_override or self._settings.policy.value

    def _not_checked(self) -> FleetReport:
        return FleetReport(
            state=State.NOT_CHECKED, agree=False, policy=self._policy,
            deployment=self._server.deployment_name, application=self._server.app_name,
            expected=Expected(layout=self._settings.expected_layout.value, reference="none"),
            kv_capacity=self._capacity,
            problems=[FleetFinding(kind="not_checked", message="no check has completed since the "
                              "controller started")])

    def current(self) -> FleetReport:
        """The last report, marked ``stale`` (with its age) when older than the bound."""
        now = time.time()
        since = self._completed_at or self._started
        age = round(now - since, 3)
        report = self._report.model_copy(update={"age_s": age})
        if age <= self._settings.stale_bound_s:
            return report
        stale = FleetFinding(kind="stale", message=(
            f"no check completed in {age:.0f} s (bound {self._settings.stale_bound_s:.0f} s): "
            "the verdict below is from then and may be wrong"))
        return report.model_copy(update={
            "state": State.STALE, "agree": False, "previous_state": self._report.state,
            "problems": [stale, *report.problems]})

    async def report(self, refresh: bool = False, full: bool = False) -> dict[str, Any]:
        """The latest verdict (a ``wire.FleetReport``); ``refresh`` checks now first.

        ``full`` forgets the specs held, so every replica sends its whole spec
        again: the cost of the first check of a restarted controller.
        """
        if full:
            self._held = {}
        if refresh or full:
            await self._bounded_check("on-demand")
        report = self.current()
        self._metrics.record(report)
        return report.model_dump(mode="json")

    def _check_bound_s(self) -> float:
        s = self._settings
        return s.status_timeout_s + 2 * s.broadcast_timeout_s + 5.0

    async def _bounded_check(self, kind: str) -> None:
        """One check under the overall bound; on timeout the report just ages."""
        try:
            await asyncio.wait_for(self.check(), self._check_bound_s())
        except TimeoutError:
            logger.warning("dsv4: %s KV-spec check exceeded %.0f s; the report ages", kind,
                           self._check_bound_s())

    async def _run(self) -> None:
        """The periodic check; a failing check is logged and retried, never fatal."""
        while True:
            try:
                await self._bounded_check("periodic")
            except Exception:
                logger.exception("dsv4: KV-spec check failed; retrying in %ss",
                                 self._settings.controller_period_s)
            self._metrics.record(self.current())
            await asyncio.sleep(self._settings.controller_period_s)

    async def _running(self) -> tuple[int | None, str | None]:
        """RUNNING count from ``serve.status()``, bounded; never two calls in flight.

        A call that missed its deadline keeps running in its thread; while it is
        stuck no new one starts, so a wedged status call cannot pile up threads.
        """
        timeout = self._settings.status_timeout_s
        if self._status_call is not None and not self._status_call.done():
            stuck = time.time() - self._status_since
            return None, f"serve.status() has not answered for {stuck:.0f} s"
        loop = asyncio.get_running_loop()
        self._status_call = loop.run_in_executor(
            None, self._status_target, self._server.app_name, self._server.deployment_name)
        self._status_since = time.time()
        try:
            return await asyncio.wait_for(asyncio.shield(self._status_call), timeout), None
        except TimeoutError:
            return None, f"serve.status() did not answer within {timeout} s"

    def _status_target(self, app_name: str, deployment_name: str) -> int | None:
        """What the status thread runs (a seam: tests make it block like a wedged GCS)."""
        return running_replicas(app_name, deployment_name)

    async def _call_each(self, method: str, *args: Any,
                         **kwargs: Any) -> tuple[list[Any], int, str | None]:
        """``method`` on every replica, each under its own deadline (``replicas.call_each``)."""
        return await call_each(self._server, self._per_replica,
                               self._settings.broadcast_timeout_s, method, *args, **kwargs)

    async def _ask_specs(self) -> tuple[list[Any], int, str | None]:
        """``kv_page_spec`` on every replica, passing the fingerprints already held.

        A replica of an older dsv4-serve (a rolling upgrade) has no ``known``
        parameter: then every replica is asked again without it in the same
        check, and this controller stops sending it (logged once).
        """
        if not (self._brief and self._held):
            return await self._call_each("kv_page_spec")
        known = {rid: spec.fingerprint for rid, spec in self._held.items()}
        answers, late, error = await self._call_each("kv_page_spec", known=known)
        if any(isinstance(a, TypeError) and "known" in str(a) for a in answers):
            logger.warning("dsv4: a replica's kv_page_spec takes no `known` (an older "
                           "dsv4-serve); asking every replica for its full spec from now on")
            self._brief = False
            return await self._call_each("kv_page_spec")
        return answers, late, error

    async def _collect(self) -> tuple[list[ReplicaSpec], list[NoAnswer]]:
        """Every replica's validated ``ReplicaSpec``; failures become named gaps."""
        answers, late, error = await self._ask_specs()
        gaps = [NoAnswer(None, error)] if error else []
        parsed = [parse_answer(answer, self._held) for answer in answers]
        specs = [p for p in parsed if isinstance(p, ReplicaSpec)]
        gaps += [p for p in parsed if not isinstance(p, ReplicaSpec)]
        if late:
            gaps += await self._name_late(late, {s.replica_id for s in specs})
        # Hold what answered, and what is silent now but may answer again.
        self._held = {s.replica_id: s for s in specs} | {
            g.replica: self._held[g.replica] for g in gaps if g.replica in self._held}
        return specs, gaps

    async def _name_late(self, late: int, answered: set[str]) -> list[NoAnswer]:
        """Name the replicas that missed their deadline, where that can be known.

        Broadcast results carry no replica id; a replica that answered before,
        whose actor is still alive and that did not answer now, is a late one.
        """
        timeout = self._settings.broadcast_timeout_s
        try:
            alive = await asyncio.wait_for(asyncio.to_thread(
                alive_replica_ids, self._server.app_name, self._server.deployment_name),
                self._settings.status_timeout_s)
        except (TimeoutError, Exception) as exc:  # naming is best effort; counted anyway
            logger.warning("dsv4: cannot list replica actors to name late ones: %r", exc)
            alive = set()
        suspects = sorted((set(self._known) & alive) - answered)
        msg = f"did not answer kv_page_spec within its {timeout} s deadline"
        if len(suspects) <= late:
            named = [NoAnswer(r, f"replica {r} (rank {self._known[r]}) {msg}")
                     for r in suspects]
            return named + [NoAnswer(None, f"a replica {msg}")] * (late - len(suspects))
        return [NoAnswer(None, f"a replica (one of {suspects}) {msg}")] * late

    async def check(self) -> dict[str, Any]:
        """Run one check now, send each replica its verdict, return the report."""
        async with self._lock:
            started, cpu_started = time.time(), time.process_time()
            (running, status_error), (specs, gaps) = await asyncio.gather(
                self._running(), self._collect())
            report = decide(specs, gaps, running, self._settings.expected_layout.value)
            if status_error:
                report.problems.append(FleetFinding(kind="status", message=status_error))
                if report.state is State.AGREE:
                    report.state, report.agree = State.INCOMPLETE, False
            replaced = plan_actions(self._book, report, specs, self._policy_override, started)
            report = report.model_copy(update={
                "policy": self._policy, "policy_override": self._policy_override,
                "deployment": self._server.deployment_name,
                "application": self._server.app_name, "checked_at": started,
                "check_seconds": round(time.time() - started, 3),
                "check_cpu_seconds": round(time.process_time() - cpu_started, 3),
                "kv_capacity": self._capacity})
            await self._push_verdict(report, specs, started)
            log_change(self._report, report)
            self._known = {s.replica_id: s.rank for s in specs} | {
                g.replica: self._known.get(g.replica) for g in gaps if g.replica}
            # Without the RUNNING count a check is not complete: its answers still
            # drive the verdicts, but the report keeps ageing toward `stale`.
            self._report = report
            self.specs = specs
            if status_error is None:
                self._completed_at = time.time()
            self._metrics.checked(report, replaced)
            self._replica_metrics.record(report, specs, {g.replica for g in gaps if g.replica})
            self._metrics.record(self.current())
            return self.current().model_dump(mode="json")

    async def _push_verdict(self, report: FleetReport, specs: list[ReplicaSpec],
                            checked_at: float) -> None:
        """Tell every replica its verdict; each acts on its own entry.

        Skipped when every answering replica already acts on the verdict it
        would get (each answer echoes it): at steady state a check is then one
        round trip per replica, not two.
        """
        if not report.answered:
            return
        message = VerdictMessage(checked_at=checked_at, policy_override=self._policy_override,
                                 replicas={r.id: ReplicaVerdict(
                                     odd=r.reason is not None, reason=r.reason, action=r.action,
                                     policy=r.policy, attempts=r.attempts,
                                     checked_at=checked_at)
                                     for r in report.replicas if r.status.value != "no_answer"})
        if verdicts_held(message, specs):
            return
        acks, late, error = await self._call_each("apply_kv_verdict",
                                                   message.model_dump(mode="json"))
        failed = [a for a in acks if not isinstance(a, dict)]
        if failed or late or error:
            logger.warning("dsv4: %d replica(s) did not take the verdict (%d late): %s",
                           len(failed) + late, late, error or (failed[0] if failed else ""))

    # ------------------------------------------------------------------ control

    async def set_policy(self, policy: str | None) -> dict[str, Any]:
        """An operator's run-time policy for every replica (logged); checks now.

        The route is ``dsv4-serve policy`` (``deployments.cli.policy``, over a Serve
        handle, so only who can reach the Ray cluster may change it): switching e.g.
        ``warn`` -> ``enforce`` after a rollout without restarting a replica (a
        config change would reboot every engine). ``None`` clears it: each replica
        obeys its own configured ``dsv4.policy`` again. It lives in this controller:
        a restarted controller starts without it (the report's ``policy_override``
        says which is in force).
        """
        new = None if policy is None else Policy(policy).value
        if new != self._policy_override:
            logger.warning("dsv4: KV-spec policy %s -> %s (%s)", self._policy,
                           new or self._settings.policy.value,
                           "operator override for every replica" if new else
                           "override cleared: each replica obeys its own dsv4.policy")
        self._policy_override = new
        return await self.check()

    async def check_health(self) -> None:
        """Unhealthy when the loop died or no check completed within the stale bound.

        Serve then restarts the controller; verdicts themselves never make it unhealthy.
        """
        if self._loop_task.done():
            exc = self._loop_task.exception()
            raise RuntimeError(f"dsv4: the KV-spec check loop stopped: {exc!r}")
        report = self.current()
        if report.state is State.STALE:
            raise RuntimeError(f"dsv4: KV-spec report is stale ({report.age_s:.0f} s > "
                               f"{self._settings.stale_bound_s:.0f} s): "
                               f"{report.problems[0].message}")
