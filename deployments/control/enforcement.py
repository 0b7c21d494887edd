"""What a verdict does: the policy's allowed actions, the enforcement book, the replica's side."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from deployments.config.dsv4 import node_type_key
from deployments.control.wire import (
    DRAIN_STAT,
    Action,
    FleetFinding,
    FleetReport,
    ReplicaSpec,
    ReplicaVerdict,
    VerdictMessage,
)
from deployments.logs import get_logger

logger = get_logger("kvspec")


class KVLayoutMismatch(RuntimeError):
    """A replica's node or workers contradict its config, or enforce names it odd."""


# ------------------------------------------------------------------ enforcement


ALLOWED = {"warn": (Action.SERVE,), "drain": (Action.SERVE, Action.DRAIN),
           "enforce": (Action.SERVE, Action.DRAIN, Action.FAIL_HEALTH)}


def clamp(action: Action, policy: str) -> Action:
    """The strongest action ``policy`` allows that is no stronger than ``action``."""
    allowed = ALLOWED.get(policy, (Action.SERVE,))
    order = (Action.SERVE, Action.DRAIN, Action.FAIL_HEALTH)
    return max((a for a in allowed if order.index(a) <= order.index(action)),
               key=order.index)


@dataclass
class _Rank:
    fingerprint: str
    attempts: int = 0
    last_at: float = 0.0
    failed: set[str] = field(default_factory=set)


@dataclass
class EnforceBook:
    """Bounded enforcement: replace an odd rank at most ``max_attempts`` times, with backoff.

    Serve replaces a replica that fails health with one of the same rank, config
    and node type; if that one is odd again in the same way (same fingerprint),
    replacing it forever only reboots engines (on a DP preset, the whole gang).
    After ``max_attempts`` replacements -- or while waiting out the backoff
    (``backoff_s * 2**(attempts-1)``) -- the replica is drained instead.
    """

    max_attempts: int
    backoff_s: float
    ranks: dict[Any, _Rank] = field(default_factory=dict)

    def action(self, spec: ReplicaSpec, odd: bool, policy: str,
               now: float) -> tuple[Action, int, str | None]:
        """(action, attempts so far, why it is not the policy's full action)."""
        key = spec.rank if spec.rank is not None else spec.replica_id
        if not odd:
            self.ranks.pop(key, None)
            return Action.SERVE, 0, None
        if policy != "enforce":
            return clamp(Action.DRAIN, policy), 0, None
        book = self.ranks.get(key)
        if book is None or book.fingerprint != spec.fingerprint:
            book = self.ranks[key] = self._recalled(spec, now)
        if spec.replica_id in book.failed:
            return Action.FAIL_HEALTH, book.attempts, None
        if book.attempts >= self.max_attempts:
            return Action.DRAIN, book.attempts, (
                f"enforce gave up: rank {spec.rank} was replaced {book.attempts} time(s) and "
                f"came back odd with the same KV spec (dsv4.enforce_max_attempts="
                f"{self.max_attempts}); drained instead, kept for inspection")
        wait = self.backoff_s * 2 ** (book.attempts - 1) if book.attempts else 0.0
        if now - book.last_at < wait:
            return Action.DRAIN, book.attempts, (
                f"enforce backoff: rank {spec.rank} is odd again after {book.attempts} "
                f"replacement(s); drained for {wait - (now - book.last_at):.0f} s more "
                "before the next one")
        book.attempts += 1
        book.last_at = now
        book.failed.add(spec.replica_id)
        return Action.FAIL_HEALTH, book.attempts, None

    @staticmethod
    def _recalled(spec: ReplicaSpec, now: float) -> _Rank:
        """A rank's book as its live replica remembers it (the verdict it echoes).

        The book lives in the controller; a restarted controller would otherwise
        start every odd rank at 0 attempts and replace a given-up replica again.
        The backoff restarts from now (the last replacement's time is not echoed).
        """
        held = spec.verdict
        if not (held.odd and held.attempts and held.policy == "enforce"):
            return _Rank(spec.fingerprint)
        book = _Rank(spec.fingerprint, attempts=held.attempts, last_at=now)
        if held.action is Action.FAIL_HEALTH:
            book.failed.add(spec.replica_id)  # already being replaced: keep it so
        return book


def plan_actions(book: EnforceBook, report: FleetReport, specs: Sequence[ReplicaSpec],
                 override: str | None, now: float) -> int:
    """Each answered replica's action (and node type) in ``report``; returns how many
    were told to fail health. ``override``: an operator's policy for every replica."""
    by_id = {s.replica_id: s for s in specs}
    replaced = 0
    for row in report.replicas:
        spec = by_id.get(row.id)
        if spec is None:
            continue
        row.node_type = node_type_key(spec.node)
        policy = override or spec.policy
        before = book.ranks.get(spec.rank if spec.rank is not None else spec.replica_id)
        attempts_before = before.attempts if before else 0
        action, attempts, note = book.action(spec, row.reason is not None, policy, now)
        row.action, row.attempts = action, attempts
        replaced += int(action is Action.FAIL_HEALTH and attempts > attempts_before)
        if note:
            row.reason = f"{row.reason}; {note}"
            report.odd_replicas[row.id] = row.reason
            report.problems.append(FleetFinding(kind="enforce_exhausted", replica=row.id,
                                           message=f"replica {row.id}: {note}"))
    return replaced


def verdicts_held(message: VerdictMessage, specs: Sequence[ReplicaSpec]) -> bool:
    """True if every replica in ``message`` already acts on its entry (as echoed in ``specs``).

    The controller then skips sending it: what ``take_verdict`` would make of
    each entry equals the verdict the replica reported in this check.
    """
    by_id = {s.replica_id: s for s in specs}
    for rid, new in message.replicas.items():
        spec = by_id.get(rid)
        if spec is None:
            return False
        policy = message.policy_override or spec.policy
        now = spec.verdict
        if (now.odd, now.reason, now.action, now.policy, now.attempts) != (
                new.odd, new.reason, clamp(new.action, policy), policy, new.attempts):
            return False
    return True


# ------------------------------------------------------------ the replica's side


def take_verdict(message: dict[str, Any], replica_id: str, own_policy: str,
                 previous: ReplicaVerdict) -> ReplicaVerdict:
    """This replica's entry of a ``VerdictMessage``, clamped to the policy it may obey.

    The replica obeys its own configured policy (during a rollout the old
    replicas keep the policy they were deployed with), or an operator's explicit
    ``set_policy`` override carried in the message; never more than that allows.
    """
    msg = VerdictMessage.model_validate(message)
    mine = msg.replicas.get(replica_id)
    if mine is None:  # not judged in this check (did not answer in time): keep the last word
        return previous
    policy = msg.policy_override or own_policy
    action = clamp(mine.action, policy)
    verdict = mine.model_copy(update={"action": action, "policy": policy})
    if verdict.odd and (verdict.reason, verdict.action) != (previous.reason, previous.action):
        logger.warning("dsv4: KV-spec controller marked this replica odd; action %s under "
                       "policy %s (attempt %s): %s", action.value, policy, verdict.attempts,
                       verdict.reason)
    elif previous.odd and not verdict.odd:
        logger.info("dsv4: KV-spec controller no longer names this replica; serving")
    return verdict


def others_serving(message: dict[str, Any], replica_id: str, own_policy: str) -> bool:
    """Whether a ``VerdictMessage`` leaves some other replica serving (not drained).

    A drained replica closes its share of ``http.replica_port`` only then, as the
    router fails open: draining never takes the whole fleet's door away.
    """
    msg = VerdictMessage.model_validate(message)
    policy = msg.policy_override or own_policy
    return any(clamp(entry.action, policy) is not Action.DRAIN
               for rid, entry in msg.replicas.items() if rid != replica_id)


def drain_stats(verdict: ReplicaVerdict) -> dict[str, Any]:
    """The routing stats ``deployments.serving.router.KVSpecRouter`` reads to skip this replica."""
    return {DRAIN_STAT: verdict.action is Action.DRAIN,
            "dsv4_kv_reason": verdict.reason if verdict.action is Action.DRAIN else None}


def raise_if_enforced(verdict: ReplicaVerdict) -> None:
    if verdict.action is Action.FAIL_HEALTH:
        raise KVLayoutMismatch(
            f"KV spec disagrees with the fleet under policy enforce (attempt "
            f"{verdict.attempts}): {verdict.reason}. Fix: make every replica's node and "
            "engine_kwargs give the same KV spec, or set dsv4.policy: drain/warn to keep "
            "it up while you investigate."
        )
