"""Session affinity's choice (``serving.affinity``): stable, never a drained or
engine-dead replica, guarded by load, failing open to the usual routing. The router that
uses it runs live in ``test_kv_controller`` (stand-ins on the session cluster)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from deployments.config.routing import RoutingSection
from deployments.serving.affinity import Candidate, choose, preferred

S = RoutingSection()


def fleet(n: int, **over: Mapping[str, object]) -> list[Candidate]:
    out = []
    for i in range(n):
        fields = {"replica_id": f"r{i}"} | dict(over.get(f"r{i}", {}))
        out.append(Candidate(**fields))  # type: ignore[arg-type]
    return out


def test_a_session_always_gets_the_same_replica_and_sessions_spread() -> None:
    replicas = fleet(4)
    picks = {f"s{i}": choose(f"s{i}", replicas, S)[0] for i in range(400)}
    assert all(choose(k, list(reversed(replicas)), S)[0] == v for k, v in picks.items())
    counts = Counter(p.replica_id for p in picks.values() if p is not None)
    assert len(counts) == 4 and min(counts.values()) > 60, counts


def test_a_replica_leaving_moves_only_its_own_sessions() -> None:
    before = {f"s{i}": preferred(f"s{i}", fleet(4)) for i in range(400)}
    after = {k: preferred(k, fleet(3)) for k in before}
    moved = [k for k in before if before[k] != after[k]]
    assert moved and all(before[k].replica_id == "r3" for k in moved)  # type: ignore[union-attr]


def test_never_a_drained_or_engine_dead_replica() -> None:
    for i in range(200):
        pick, _ = choose(f"s{i}", fleet(3, r0={"drained": True}, r1={"engine_dead": True}), S)
        assert pick is not None and pick.replica_id == "r2"


def test_fails_open_when_nothing_may_serve_or_no_key() -> None:
    assert choose("s", fleet(2, r0={"drained": True}, r1={"drained": True}), S) == \
        (None, "none_serving")
    assert choose(None, fleet(2), S) == (None, "no_key")
    assert choose("", fleet(2), S) == (None, "no_key")
    assert choose("s", fleet(2), RoutingSection(affinity=False)) == (None, "no_key")


def test_load_guard_sends_to_power_of_two_when_much_busier_or_kv_full() -> None:
    key = "s1"
    home = preferred(key, fleet(3))
    assert home is not None
    hot = {home.replica_id: {"load": 11.0}}
    others = {f"r{i}": {"load": 3.0} for i in range(3) if f"r{i}" != home.replica_id}
    assert choose(key, fleet(3, **others, **hot), S) == (None, "busier")  # 11 > 2*3+4
    warm = {home.replica_id: {"load": 10.0}}
    assert choose(key, fleet(3, **others, **warm), S)[1] == "affinity"  # 10 <= 10
    full = {home.replica_id: {"kv_usage": 0.96}}
    assert choose(key, fleet(3, **full), S) == (None, "kv_full")
