"""The ``kv_pressure`` autoscaling policy: the pure decision over sequences of loads and
clocks (``serving.autoscale_rule``), and the class Serve's controller runs, fed Ray's own
``AutoscalingContext`` and built from the config Ray parses (``serving.autoscale``)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from unittest import mock

import pytest

from deployments.config.autoscaling import AutoscalingSection
from deployments.serving.autoscale_rule import (
    Observation,
    PolicyState,
    ReplicaLoad,
    decide,
)

S = AutoscalingSection()


def loads(*kv: float, waiting: float = 0.0,
          drained: tuple[int, ...] = ()) -> dict[str, ReplicaLoad]:
    return {f"r{i}": ReplicaLoad(k, waiting, 1.0, i in drained) for i, k in enumerate(kv)}


def run(steps: Sequence[tuple[float, int, int, dict[str, ReplicaLoad]]],
        settings: AutoscalingSection = S, lowest: int = 1,
        highest: int = 8) -> list[tuple[int, str]]:
    """(now, target, running, loads) per call -> (target, reason) per call, state carried."""
    state, out = PolicyState(), []
    for now, target, running, seen in steps:
        d = decide(Observation(now, target, running, seen, lowest, highest), settings, state)
        state = PolicyState.from_dict(d.state.to_dict())  # through Serve's dict
        out.append((d.target, d.reason))
    return out


def test_kv_pressure_scales_up_at_the_first_sample_that_shows_it() -> None:
    assert run([(0, 2, 2, loads(0.5, 0.6)), (10, 2, 2, loads(0.85, 0.8))]) == \
        [(2, "hold"), (3, "kv_pressure")]


def test_queue_depth_scales_up_before_kv_fills() -> None:
    assert run([(0, 1, 1, loads(0.3, waiting=5))]) == [(2, "queue_pressure")]


def test_proportional_step_bounded_by_max_step_and_max_replicas() -> None:
    assert run([(0, 2, 2, loads(1.0, 1.0, waiting=20))])[0] == (6, "queue_pressure")
    assert run([(0, 2, 2, loads(1.0, 1.0, waiting=20))], highest=4)[0] == (4, "bounds")


def test_drained_replicas_are_not_capacity_but_stay_in_the_target() -> None:
    """Two running, one drained: the one serving replica at 0.9 needs a second one; the
    drained one stays up (kept to inspect) on top. Serve's default counted it."""
    d = decide(Observation(0, 2, 2, loads(0.9, 0.0, drained=(1,)), 1, 8), S, PolicyState())
    assert (d.target, d.capacity, d.reason) == (3, 1, "kv_pressure")
    assert d.kv_usage == pytest.approx(0.9)


def test_a_booting_replica_is_not_asked_for_twice() -> None:
    """Target already raised, the new replica not running yet: same pressure, same target."""
    assert run([(0, 2, 2, loads(0.9, 0.9)), (10, 3, 2, loads(0.9, 0.9)),
                (20, 3, 2, loads(0.9, 0.9))]) == \
        [(3, "kv_pressure"), (3, "kv_pressure"), (3, "kv_pressure")]


def test_upscale_delay_needs_pressure_to_last() -> None:
    slow = S.model_copy(update={"upscale_delay_s": 15.0})
    assert run([(0, 1, 1, loads(0.9)), (10, 1, 1, loads(0.9)), (20, 1, 1, loads(0.9))],
               slow) == [(1, "hold"), (1, "hold"), (2, "kv_pressure")]
    assert run([(0, 1, 1, loads(0.9)), (10, 1, 1, loads(0.1)), (20, 1, 1, loads(0.9))],
               slow)[-1] == (1, "hold")  # the quiet sample restarted the clock


def test_down_only_after_a_quiet_period_one_at_a_time() -> None:
    quiet = loads(0.1, 0.1, 0.1)
    steps = [(t, 3, 3, quiet) for t in (0, 100, 299)] + [(300, 3, 3, quiet),
                                                         (301, 2, 2, loads(0.1, 0.1)),
                                                         (601, 2, 2, loads(0.1, 0.1))]
    assert run(steps, lowest=1) == [(3, "hold"), (3, "hold"), (3, "hold"), (2, "quiet"),
                                    (2, "hold"), (1, "quiet")]


def test_never_down_into_scale_up_territory_or_with_requests_waiting() -> None:
    """0.3 x 2 replicas on 1 = 0.6 >= kv_usage_down: held; anything waiting: held."""
    assert run([(t, 2, 2, loads(0.3, 0.3)) for t in (0, 400)]) == [(2, "hold")] * 2
    assert run([(t, 2, 2, loads(0.05, 0.05, waiting=1)) for t in (0, 400)]) == \
        [(2, "hold")] * 2


def test_no_flapping_over_a_load_cycle() -> None:
    """A 10-minute cycle sampled every 10 s: load ramps to pressure, stays, falls. The
    target only rises while it is high and only falls (once per delay) after it fell."""
    steps, target, running, history, state = [], 1, 1, [], PolicyState()
    for i in range(60 * 2):
        now = i * 10.0
        phase = (now % 600) / 600
        kv = 0.95 if 0.2 <= phase < 0.5 else 0.05
        d = decide(Observation(now, target, running,
                               {f"r{j}": ReplicaLoad(kv / max(running, 1) * 1, 0, 1)
                                for j in range(running)}, 1, 4), S, state)
        state = d.state
        history.append((now, target, d.target))
        if d.target != target:
            steps.append((now, target, d.target))
        target, running = d.target, d.target  # replicas come up at once here
    ups = [s for s in steps if s[2] > s[1]]
    downs = [s for s in steps if s[2] < s[1]]
    assert ups and downs
    for (t1, _, _), (t2, _, _) in itertools.pairwise(steps):
        assert t2 - t1 >= 10  # never two changes in one tick
    for now, before, _after in downs:  # every step down >= downscale_delay_s after a change
        earlier = [t for t, _, _ in steps if t < now]
        assert not earlier or now - max(earlier) >= S.downscale_delay_s, (now, before)


def test_no_metrics_holds() -> None:
    assert run([(0, 2, 2, {})]) == [(2, "no_metrics")]


def test_gangs_round_up_to_whole_gangs() -> None:
    d = decide(Observation(0, 2, 2, loads(0.9, 0.9), 2, 8), S, PolicyState(), gang_size=2)
    assert d.target == 4


def test_hysteresis_is_validated() -> None:
    with pytest.raises(ValueError, match=r"kv_usage_down=0\.9 >= kv_usage_up=0\.8"):
        AutoscalingSection(kv_usage_down=0.9)


# ------------------------------------------------------ against Ray's own objects


def ray_context(raw: dict[str, dict[object, list[object]]], target: int, running: list[object],
                state: dict[str, object], now: float = 100.0, requests: float = 0.0) -> object:
    from ray.serve.config import AutoscalingContext

    return AutoscalingContext(
        deployment_id=None, deployment_name="DSv4Server:m", app_name="dsv4",
        current_num_replicas=len(running), target_num_replicas=target,
        running_replicas=running, total_num_requests=lambda: requests,
        total_queued_requests=0.0, aggregated_metrics=lambda: {}, raw_metrics=lambda: raw,
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4,
        policy_state=state, last_scale_up_time=None, last_scale_down_time=None,
        current_time=now, config=None)


def test_the_policy_reads_rays_context_and_serve_parses_its_config() -> None:
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue
    from ray.serve.config import AutoscalingConfig

    from deployments.serving import autoscale

    deployment = autoscale.with_autoscaling_policy(
        {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}, S, gang_size=1)
    config = AutoscalingConfig(**deployment["autoscaling_config"])  # Ray's model, pickled
    policy = _resolve_policy_callable(config.policy)  # what Serve's controller does
    assert isinstance(policy, autoscale.KVPressurePolicy)
    assert policy.settings == S
    ids = [ReplicaID(f"u{i}", DeploymentID("DSv4Server:m", "dsv4")) for i in range(2)]
    samples = {0: autoscale.stats(0.9, 0, 2, False), 1: autoscale.stats(0.0, 0, 0, True)}
    raw: dict[str, dict[object, list[object]]] = {}
    for i, rid in enumerate(ids):
        for key, value in samples[i].items():
            raw.setdefault(key, {})[rid] = [TimeStampedValue(90.0, 0.0),
                                            TimeStampedValue(99.0, value)]
    target, state = policy(ray_context(raw, 2, ids, {}))
    assert target == 3 and state["last_change"] == 100.0 and state["decided"] == 3
    assert policy(ray_context({}, 2, ids, state))[0] == 3  # no samples: hold what it decided
    assert policy(ray_context({}, 2, ids, {}))[0] == 2  # nothing decided yet: Serve's
    # Serve's lazy request count reaches the rule: 12 held by the one serving replica
    # whose engine shows 2 running is 10 waiting, twice waiting_up: 2 serving + the drained.
    calm: dict[str, dict[object, list[object]]] = {
        key: {rid: [TimeStampedValue(99.0, 0.1 if key == autoscale.KV_USAGE
                                     else samples[ids.index(rid)][key])]
              for rid in per}
        for key, per in raw.items()}
    assert policy(ray_context(calm, 2, ids, {}))[0] == 2
    assert policy(ray_context(calm, 2, ids, {}, requests=12.0))[0] == 3


def test_a_user_policy_and_ours_are_not_both_taken() -> None:
    from deployments.serving import autoscale

    with pytest.raises(ValueError, match=r"autoscaling_config\.policy is set"):
        autoscale.with_autoscaling_policy(
            {"autoscaling_config": {"policy": {"policy_function": "x:y"}}}, S, 1)
    mine = {"autoscaling_config": {"policy": {"policy_function": "x:y"}}}
    assert autoscale.with_autoscaling_policy(
        mine, AutoscalingSection(policy="serve_default"), 1) is mine
    assert autoscale.with_autoscaling_policy({"num_replicas": 2}, S, 1) == {"num_replicas": 2}


def test_serves_delays_are_the_policys_not_accepted_and_ignored() -> None:
    from deployments.serving import autoscale

    scaling = {"autoscaling_config": {"upscale_delay_s": 2, "downscale_delay_s": 8}}
    kwargs = autoscale.with_autoscaling_policy(scaling, S, 1)["autoscaling_config"][
        "policy"]["policy_kwargs"]
    assert (kwargs["upscale_delay_s"], kwargs["downscale_delay_s"]) == (2.0, 8.0)
    serve = autoscale.with_autoscaling_policy(scaling, S, 1)["autoscaling_config"]
    assert (serve["upscale_delay_s"], serve["downscale_delay_s"]) == (0, 0)  # counted once
    assert autoscale.KVPressurePolicy(**kwargs).settings.downscale_delay_s == 8.0
    same = AutoscalingSection(downscale_delay_s=8)
    assert autoscale.with_autoscaling_policy(scaling, same, 1)["autoscaling_config"]
    with pytest.raises(ValueError, match=r"downscale_delay_s=8 and dsv4\.autoscaling"
                                         r"\.downscale_delay_s=60"):
        autoscale.with_autoscaling_policy(scaling, AutoscalingSection(downscale_delay_s=60), 1)
    unset = autoscale.with_autoscaling_policy({"autoscaling_config": {}}, S, 1)
    assert unset["autoscaling_config"]["policy"]["policy_kwargs"]["downscale_delay_s"] == \
        S.downscale_delay_s


def test_the_users_target_ongoing_requests_is_a_third_pressure() -> None:
    """Serve's target_ongoing_requests, when set, is honoured, not accepted and ignored:
    8 running per replica over a target of 4 adds replicas, and holds a step down."""
    busy = {f"r{i}": ReplicaLoad(0.1, 0.0, 8.0) for i in range(2)}
    d = decide(Observation(0, 2, 2, busy, 1, 8), S, PolicyState(), target_ongoing=4)
    assert (d.target, d.reason) == (4, "ongoing_requests")
    calm = {f"r{i}": ReplicaLoad(0.05, 0.0, 3.0) for i in range(2)}
    assert decide(Observation(400, 2, 2, calm, 1, 8), S, PolicyState(quiet_since=0.0),
                  target_ongoing=4).reason == "hold"  # 6 on 1 replica > 4
    assert decide(Observation(400, 2, 2, calm, 1, 8), S,
                  PolicyState(quiet_since=0.0)).reason == "quiet"


def test_series_are_set_at_each_change_and_kept_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's agent drops a gauge not set for two export intervals: the policy sets its
    series again every KEEP_ALIVE_S while the decision stands, and logs only changes."""
    from deployments.serving import autoscale

    sets: list[float] = []

    class Gauge:
        def set(self, value: float, tags: dict[str, str]) -> None:
            sets.append(value)

        def inc(self, value: float, tags: dict[str, str]) -> None:
            sets.append(-1.0)

    policy = autoscale.KVPressurePolicy()
    monkeypatch.setattr(policy, "_series", lambda: dict.fromkeys(
        ("target", "capacity", "kv", "waiting", "reason", "changes"), Gauge()))
    state: dict[str, object] = {}
    calls = []
    for now in (0.0, 0.1, 0.2, autoscale.KEEP_ALIVE_S + 0.1):
        sets.clear()
        _target, state = policy(ray_context({}, 2, [], state, now=now))
        calls.append(len(sets))
    assert calls[0] > 0 and calls[1] == calls[2] == 0 and calls[3] == calls[0]


# ------------------------------------- the decided target, through Serve's own loop


def test_a_hold_keeps_the_target_it_decided_while_serve_catches_up() -> None:
    """The live flap: a quiet step 2 -> 1 that Serve has not applied yet (its target
    still 2 on the next tick) must not be undone by the hold that follows; the same on
    the way up, when the pressure dips under the threshold while the new replica boots."""
    quiet = loads(0.1, 0.1)
    down = run([(0, 2, 2, quiet), (8, 2, 2, quiet), (8.1, 2, 2, quiet), (8.2, 2, 2, quiet)],
               S.model_copy(update={"downscale_delay_s": 8.0}))
    assert down == [(2, "hold"), (1, "quiet"), (1, "hold"), (1, "hold")]
    up = run([(0, 2, 2, loads(0.9, 0.9)), (0.1, 2, 2, loads(0.7, 0.7)),
              (0.2, 3, 2, loads(0.7, 0.7))])
    assert up == [(3, "kv_pressure"), (3, "hold"), (3, "hold")]


class ServeLoop:
    """Serve's control loop around the policy, as Ray 2.60 runs it: the policy class
    built by ``_resolve_policy_callable``, wrapped by ``_apply_autoscaling_config`` (which
    applies the config's delays and scaling factors to a custom policy's output too,
    ray#58857), its result clamped to the bounds and made the target at once; replicas
    run ``boot_s`` after they are asked for and stop at once."""

    def __init__(self, deployment: dict[str, object], boot_s: float,
                 monkeypatch: pytest.MonkeyPatch) -> None:
        from ray.serve._private.autoscaling_state import _resolve_policy_callable
        from ray.serve.autoscaling_policy import _apply_autoscaling_config
        from ray.serve.config import AutoscalingConfig

        self.config = AutoscalingConfig(**deployment["autoscaling_config"])  # type: ignore[arg-type]
        inner = _resolve_policy_callable(self.config.policy)
        monkeypatch.setattr(inner, "_series", lambda: dict.fromkeys(
            ("target", "capacity", "kv", "waiting", "reason", "changes"), _NullGauge()))
        self.policy = _apply_autoscaling_config(inner)
        self.boot_s = boot_s
        self.state: dict[str, object] = {}
        self.target = self.config.initial_replicas or self.config.min_replicas
        self.ready_at: list[float] = [0.0] * self.target
        self.ids = itertools.count()
        self.names: list[object] = [self._id() for _ in self.ready_at]
        self.changes: list[tuple[float, int, int]] = []  # (time, from, to) of Serve's target
        self.wanted: list[tuple[float, int]] = []  # (time, what the wrapped policy returned)

    def _id(self) -> object:
        from ray.serve._private.common import DeploymentID, ReplicaID

        return ReplicaID(f"r{next(self.ids)}", DeploymentID("DSv4Server:m", "dsv4"))

    def tick(self, now: float, demand: float) -> None:
        """One control-loop step; ``demand`` is the KV in use, in replicas' worth."""
        from ray.serve._private.common import TimeStampedValue
        from ray.serve.config import AutoscalingContext

        from deployments.serving import autoscale

        running = [n for n, t in zip(self.names, self.ready_at, strict=True) if t <= now]
        share = demand / max(len(running), 1)
        sample = autoscale.stats(min(share, 1.0), max(share - 1.0, 0.0) * 10, 1.0, False)
        raw: dict[str, dict[object, list[object]]] = {}
        for name in running:
            for key, value in sample.items():
                raw.setdefault(key, {})[name] = [TimeStampedValue(now - 0.5, value)]
        ctx = AutoscalingContext(
            deployment_id=None, deployment_name="DSv4Server:m", app_name="dsv4",
            current_num_replicas=len(running), target_num_replicas=self.target,
            running_replicas=running, total_num_requests=float(len(running)),
            total_queued_requests=0.0, aggregated_metrics=lambda: {},
            raw_metrics=lambda: raw, capacity_adjusted_min_replicas=self.config.min_replicas,
            capacity_adjusted_max_replicas=self.config.max_replicas,
            policy_state=self.state, last_scale_up_time=None, last_scale_down_time=None,
            current_time=now, config=self.config)
        with mock.patch("time.time", return_value=now):  # the wrapper's delay clock
            wanted, self.state = self.policy(ctx)
        self.wanted.append((now, wanted))
        new = min(max(int(wanted), self.config.min_replicas), self.config.max_replicas)
        if new != self.target:
            self.changes.append((now, self.target, new))
        while len(self.names) < new:
            self.names.append(self._id())
            self.ready_at.append(now + self.boot_s)
        del self.names[new:], self.ready_at[new:]
        self.target = new


class _NullGauge:
    def set(self, value: float, tags: dict[str, str]) -> None:
        pass

    def inc(self, value: float, tags: dict[str, str]) -> None:
        pass


def load_cycle(t: float) -> float:
    """KV in use (replicas' worth) over a 10-minute cycle: 2 min ramp up to 2.6 replicas'
    worth, 3 min plateau, 2 min ramp down, 3 min quiet at 0.2."""
    phase = t % 600
    if phase < 120:
        return 0.2 + 2.4 * phase / 120
    if phase < 300:
        return 2.6
    if phase < 420:
        return 2.6 - 2.4 * (phase - 300) / 120
    return 0.2


@pytest.mark.parametrize(("scaling", "section"), [
    ({"upscale_delay_s": 2, "downscale_delay_s": 8}, S),  # the multi-node story's
    ({}, S.model_copy(update={"downscale_delay_s": 60.0})),  # Serve's delays unset
], ids=["serve-delays-2-8", "policy-delays-0-60"])
def test_a_ten_minute_load_cycle_through_serves_loop_never_flaps(
        scaling: dict[str, float], section: AutoscalingSection,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two load cycles, Serve's loop every 1 s, replicas booting in 30 s: the target
    goes up with the ramp and back to 1 in the quiet, each direction only after the
    other's delay, in a bounded number of changes; the policy's own answer never turns
    around within the delay either (the live flap: quiet, hold, quiet, hold...)."""
    from deployments.serving import autoscale

    deployment = autoscale.with_autoscaling_policy(
        {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4} | scaling},
        section, gang_size=1)
    loop = ServeLoop(deployment, boot_s=30.0, monkeypatch=monkeypatch)
    down_s = float(scaling.get("downscale_delay_s", section.downscale_delay_s))
    up_s = float(scaling.get("upscale_delay_s", section.upscale_delay_s))
    for i in range(2 * 600):
        loop.tick(float(i), load_cycle(float(i)))
    changes = loop.changes
    for cycle in (0, 1):
        seen = [c for c in changes if cycle * 600 <= c[0] < (cycle + 1) * 600]
        directions = ["up" if new > old else "down" for _, old, new in seen]
        assert directions and directions == sorted(directions, reverse=True), seen  # ups, downs
        assert "down" in directions and seen[-1][2] == 1, seen  # back to 1 in the quiet
        assert len(seen) <= 6, seen  # at most 3 up, 3 down
        first_up = next(t for t, old, new in seen if new > old)
        pressure = next(float(t) for t in range(cycle * 600, cycle * 600 + 600)
                        if load_cycle(t) >= 0.8)
        assert first_up - pressure <= up_s + 1.0, (first_up, pressure)
    for (t1, a1, b1), (t2, a2, b2) in itertools.pairwise(changes):
        if (b2 > a2) != (b1 > a1) and b2 < a2:  # a step down after a step up
            assert t2 - t1 >= down_s, changes
        if b2 < a2 and b1 < a1:  # two steps down
            assert t2 - t1 >= down_s, changes
    wanted = loop.wanted
    for (t1, w1), (_t2, w2), (t3, w3) in zip(wanted, wanted[1:], wanted[2:], strict=False):
        assert not (w1 == w3 != w2 and t3 - t1 < down_s), (t1, w1, w2, w3)  # no A, B, A


def test_requests_the_engine_has_not_counted_yet_are_waiting() -> None:
    """vLLM sets its counts once per engine step, and a CPU step prefilling a batch can
    take a minute: Serve's own count of the requests its replicas hold is the floor.
    16 streams on one replica whose engine last reported an idle step: queue pressure at
    once (16 waiting over waiting_up=5), not when the step ends."""
    idle = {"r0": ReplicaLoad(0.06, 0.0, 0.0)}
    d = decide(Observation(0, 1, 1, idle, 1, 2, requests=16.0), S, PolicyState())
    assert (d.target, d.reason, d.waiting_per_replica) == (2, "bounds", 16.0)
    assert decide(Observation(0, 1, 1, idle, 1, 2), S, PolicyState()).reason == "hold"


def test_the_engines_counts_stand_where_they_are_larger_than_serves() -> None:
    """Serve's count is averaged over its look-back window: where the engine reports more
    waiting (a burst Serve has not averaged in yet), the engine's count stands."""
    seen = {"r0": ReplicaLoad(0.1, 6.0, 8.0)}
    d = decide(Observation(0, 1, 1, seen, 1, 8, requests=2.0), S, PolicyState())
    assert (d.reason, d.waiting_per_replica) == ("queue_pressure", 6.0)


def test_no_step_down_while_replicas_hold_requests_the_engines_do_not_show() -> None:
    """Quiet means nothing waits: requests Serve counts beyond what the engines run hold a
    step down, as vLLM's own waiting count does."""
    calm = {f"r{i}": ReplicaLoad(0.05, 0.0, 1.0) for i in range(2)}
    quiet = PolicyState(quiet_since=0.0)
    assert decide(Observation(400, 2, 2, calm, 1, 8, requests=2.0), S, quiet).reason == "quiet"
    assert decide(Observation(400, 2, 2, calm, 1, 8, requests=5.0), S, quiet).reason == "hold"
