"""The KV-spec controller: proves every RUNNING replica stores the same KV pages.

vLLM checks that the ranks of one engine agree; nothing checks separate
replicas (mixed GPU generations, a rolling vLLM upgrade, a node-local backend
override). This Serve deployment does, periodically and on demand:

1. count RUNNING replicas of the server deployment (``serve.status()``), so a
   replica that silently does not answer makes the verdict ``incomplete``;
2. ``broadcast("kv_page_spec")`` to every replica (new ones included: the
   broadcast goes to the current replica set, so autoscaling is followed);
3. decide with ``deployments.kvspec.decide`` and push the verdict back with
   ``broadcast("apply_kv_verdict")``: under ``enforce`` a named replica fails
   its health check and Serve replaces it;
4. publish the report (``GET /v1/kv-spec`` through the ingress) and Prometheus
   gauges (``ray.serve.metrics``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.serve.metrics import Counter, Gauge

from deployments import kvspec
from deployments.config import DSv4Section, Policy

logger = logging.getLogger("ray.serve")


def running_replicas(app_name: str, deployment_name: str) -> int | None:
    """RUNNING replicas of one deployment per Serve, or None if Serve does not list it."""
    app = serve.status().applications.get(app_name)
    if app is None or deployment_name not in app.deployments:
        return None
    return int(app.deployments[deployment_name].replica_states.get("RUNNING", 0))


class _Metrics:
    """Prometheus series; tagged by deployment so several apps can share a cluster."""

    def __init__(self, deployment: str):
        tags = ("llm_deployment",)
        self._tags = {"llm_deployment": deployment}
        self.agree = Gauge("dsv4_kv_spec_agree", "1 if every RUNNING replica has the "
                           "reference KV spec, else 0", tag_keys=tags)
        self.running = Gauge("dsv4_kv_spec_running_replicas", "RUNNING replicas per Serve",
                             tag_keys=tags)
        self.answered = Gauge("dsv4_kv_spec_answered_replicas", "replicas that answered "
                              "kv_page_spec in the last check", tag_keys=tags)
        self.odd = Gauge("dsv4_kv_spec_odd_replicas", "replicas whose KV spec differs from "
                         "the reference or the expected layout", tag_keys=tags)
        self.checks = Counter("dsv4_kv_spec_checks_total", "KV-spec checks run",
                              tag_keys=(*tags, "state"))
        for gauge in (self.agree, self.running, self.answered, self.odd):
            gauge.set_default_tags(dict(self._tags))  # Serve adds its tags in place

    def record(self, report: dict[str, Any]) -> None:
        self.agree.set(1 if report["agree"] else 0)
        self.running.set(report["running_replicas"] or 0)
        self.answered.set(report["answered"])
        self.odd.set(len(report["odd_replicas"]))
        self.checks.inc(tags={**self._tags, "state": report["state"]})


class KVSpecController:
    """One replica; its loop checks every ``controller_period_s`` seconds."""

    async def __init__(self, server: DeploymentHandle, dsv4: dict[str, Any]):
        self._settings = DSv4Section.model_validate(dsv4)
        self._server = server
        self._policy = self._settings.policy
        self._lock = asyncio.Lock()
        self._report: dict[str, Any] = self._empty_report("not checked yet")
        self._metrics = _Metrics(server.deployment_name)
        # Async constructor: the loop task lives on the replica's event loop.
        self._loop_task = asyncio.create_task(self._run())

    def _empty_report(self, why: str) -> dict[str, Any]:
        report = kvspec.decide([], [why], None, self._settings.expected_layout.value)
        return self._decorate(report, started=time.time())

    def _decorate(self, report: dict[str, Any], started: float) -> dict[str, Any]:
        return report | {
            "policy": self._policy.value,
            "deployment": self._server.deployment_name,
            "application": self._server.app_name,
            "checked_at": started,
            "check_seconds": round(time.time() - started, 3),
        }

    async def _run(self) -> None:
        """The periodic check; a failing check is logged and retried, never fatal."""
        while True:
            try:
                await self.check()
            except Exception:
                logger.exception("dsv4: KV-spec check failed; retrying in %ss",
                                 self._settings.controller_period_s)
            await asyncio.sleep(self._settings.controller_period_s)

    async def _collect(self) -> tuple[list[dict[str, Any]], list[str]]:
        """Every replica's kv_page_spec; failures become named errors, not exceptions."""
        timeout = self._settings.broadcast_timeout_s
        try:
            answers = await self._server.broadcast("kv_page_spec").results_async(
                timeout_s=timeout, return_exceptions=True)
        except TimeoutError:
            return [], [f"broadcast kv_page_spec timed out after {timeout}s"]
        except Exception as exc:  # DeploymentUnavailableError while (re)starting
            return [], [f"broadcast kv_page_spec failed: {type(exc).__name__}: {exc}"]
        specs = [a for a in answers if isinstance(a, dict)]
        errors = [f"a replica failed kv_page_spec: {type(a).__name__}: {a}"
                  for a in answers if not isinstance(a, dict)]
        return specs, errors

    async def check(self) -> dict[str, Any]:
        """Run one check now, push the verdict to the replicas, return the report."""
        async with self._lock:
            started = time.time()
            running = await asyncio.to_thread(
                running_replicas, self._server.app_name, self._server.deployment_name)
            specs, errors = await self._collect()
            report = kvspec.decide(specs, errors, running,
                                   self._settings.expected_layout.value)
            report = self._decorate(report, started)
            await self._push_verdict(report)
            self._log_change(report)
            self._report = report
            self._metrics.record(report)
            return report

    async def _push_verdict(self, report: dict[str, Any]) -> None:
        """Tell every replica the verdict; each checks whether it is named."""
        if not report["answered"]:
            return
        verdict = {"policy": self._policy.value, "odd_replicas": report["odd_replicas"],
                   "checked_at": report["checked_at"]}
        acks = await self._server.broadcast("apply_kv_verdict", verdict).results_async(
            timeout_s=self._settings.broadcast_timeout_s, return_exceptions=True)
        failed = [a for a in acks if not isinstance(a, dict)]
        if failed:
            logger.warning("dsv4: %d replica(s) did not take the verdict: %s", len(failed),
                           failed[0])

    def _log_change(self, report: dict[str, Any]) -> None:
        previous = (self._report["state"], sorted(self._report["odd_replicas"]))
        if previous == (report["state"], sorted(report["odd_replicas"])):
            return
        log = logger.info if report["agree"] else logger.warning
        log("dsv4: KV spec %s: %d/%s replicas answered, policy %s; %s", report["state"],
            report["answered"], report["running_replicas"], report["policy"],
            "; ".join(p["message"] for p in report["problems"]) or "one fingerprint")

    async def report(self, refresh: bool = False) -> dict[str, Any]:
        """The latest verdict; ``refresh`` checks now instead of returning the cached one."""
        if refresh:
            return await self.check()
        return self._report

    async def set_policy(self, policy: str) -> dict[str, Any]:
        """Switch enforce/warn at run time (logged); the next check applies it."""
        new = Policy(policy)
        if new is not self._policy:
            logger.warning("dsv4: KV-spec policy %s -> %s", self._policy.value, new.value)
        self._policy = new
        return await self.check()

    async def check_health(self) -> None:
        """The controller is healthy while its loop runs; verdicts never make it unhealthy."""
        if self._loop_task.done():
            exc = self._loop_task.exception()
            raise RuntimeError(f"dsv4: the KV-spec check loop stopped: {exc!r}")
