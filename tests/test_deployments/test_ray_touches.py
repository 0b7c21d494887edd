"""deployments.ray_touches: every Ray internal documented, probed, and its callers found.

The pinned Ray holds every touch; a touch whose probe finds nothing refuses the build it
belongs to; every ``used_in`` call site imports and resolves (``module:qualname``), so a
caller that moves without its entry moving too fails here, not in a reader's hands.
"""

from __future__ import annotations

import dataclasses

import pytest

from deployments import ray_touches
from deployments.ray_touches import probes


def test_ray_touches_are_documented_and_probed():
    """Every Ray internal has the vLLM patches' documentation fields and a probe that can fail."""
    rows = ray_touches.probe_all()
    assert len(rows) == len(ray_touches.TOUCHES) >= 10
    for row in rows:
        assert all(row[k] for k in ("target", "why", "how", "upstream", "affected", "removal"))
        assert row["present"], row  # the pinned Ray has every one of them
    ray_touches.require(pd=True)
    assert ray_touches.present("serve.broadcast_per_replica_results")
    with pytest.raises(KeyError, match="no Ray touch named 'nope'"):
        ray_touches.present("nope")
    # A missing P/D-only touch refuses a P/D build only; an optional one never.
    gone = dataclasses.replace(ray_touches.TOUCHES[0], name="gone",
                               probe=probes.symbols("ray.serve", "no_such_symbol"))
    ray_touches.require(touches=(dataclasses.replace(gone, pd_only=True),))
    ray_touches.require(pd=True, touches=(dataclasses.replace(gone, required=False),))
    with pytest.raises(RuntimeError, match=r"(?s)gone .*no_such_symbol.*Fix"):
        ray_touches.require(pd=True, touches=(dataclasses.replace(gone, pd_only=True),))
    assert probes.parameter("ray", "init", "_no_such_kwarg")() is not None
    assert probes.symbols("ray.serve", "no_such_symbol")() is not None
    assert probes.source_mentions("ray.serve.llm", "LLMConfig.update_engine_kwargs",
                                  "no such text")() is not None
    assert probes.dataclass_field("ray.llm._internal.common.callbacks.base", "CallbackCtx",
                                  "no_such_field")() is not None


def test_every_probe_is_a_named_function():
    """Probes are plain functions, never lambdas: a traceback or a doctor row names them."""
    for touch in ray_touches.TOUCHES:
        assert touch.probe.__name__ != "<lambda>", touch.name


def test_every_named_call_site_resolves():
    """Each entry's ``used_in`` names importable objects of deployments/ that exist."""
    names = [t.name for t in ray_touches.TOUCHES]
    assert len(names) == len(set(names))
    wrong = [f"{t.name}: {site}: {why}" for t in ray_touches.TOUCHES for site in t.used_in
             if not site.startswith("deployments.")
             or (why := ray_touches.call_site_problem(site)) is not None]
    assert not wrong, "\n".join(wrong)
    assert all(t.used_in for t in ray_touches.TOUCHES)


def test_a_moved_call_site_is_caught():
    assert ray_touches.call_site_problem("deployments.local.drain:drain") is None
    assert "does not exist" in ray_touches.call_site_problem("deployments.local.drain:gone")
    assert "cannot import" in ray_touches.call_site_problem("deployments.nowhere:drain")
    assert "not 'module:qualname'" in ray_touches.call_site_problem("deployments/local/drain.py")
