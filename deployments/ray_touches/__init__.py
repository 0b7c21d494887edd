"""Every touch of Ray internals in ``deployments/``: one documented, probed registry.

Ray Serve LLM 2.60 (pinned in pyproject) exposes ``LLMConfig``, the builders, the
ingress class and ``LLMServer``; everything below reaches past that public face.
Each entry says, like the vLLM patches of ``dsv4_patch.patches``: the target
symbol, why we need it, how we use it, the upstream state, the Ray versions it is
known to hold on, and when to delete it. ``probe()`` checks the real symbol in the
installed Ray without side effects. ``build_app`` refuses to build when a
``required`` touch is missing (``require()``), so a Ray upgrade fails loudly at
deploy time instead of at the first request; ``dsv4-serve doctor`` lists them all.

Optional touches (``required=False``) never refuse a build: the drain's request
count (logged when it fails), the controller's per-replica broadcast results
(``deployments.control.replicas`` falls back to ``results_async``, logged), the local
multi-node cluster of ``dsv4-serve run --nodes``. Touches only a P/D app uses
(``pd_only``) refuse only a P/D build (``require(pd=True)``).

A touch whose probe imports Ray Serve LLM's server, and so vLLM and torch (``loads_llm``),
is required by the processes that import it anyway: a server replica as it starts, and
Ray Serve LLM's builders (``require(llm=True)``). A one-pool build by import path
(``deployments.serving.server_options``) requires only the others, so it stays light.

Code that behaves differently when a touch is absent asks ``present(name)``;
it never probes Ray itself (one place per touch). Each entry names its call sites as
importable objects (``used_in``: ``"deployments.local.drain:drain"``), which
``tests/test_deployments/test_ray_touches.py`` resolves, so a moved caller fails a test.

``probes``: ``RayTouch`` and the probe builders; ``served``: the touches of the served app
(replicas, controller, builders); ``doors``: those of the replica's doors (the proxy's
bind, direct ingress and HAProxy, the data plane, the stopping flag); ``local``: those
of the local cluster (head, drain, nodes); ``transfers``: what a P/D decode replica
reads for the health of its KV transfers (vLLM's NIXL failure counter).
"""

from __future__ import annotations

from deployments.ray_touches import doors, local, served, transfers
from deployments.ray_touches.probes import RayTouch, call_site_problem

__all__ = ["TOUCHES", "RayTouch", "call_site_problem", "present", "probe_all", "render",
           "require"]

TOUCHES: tuple[RayTouch, ...] = (*served.TOUCHES, *transfers.TOUCHES, *doors.TOUCHES,
                                 *local.TOUCHES)


def probe_all() -> list[dict[str, str | bool]]:
    """Every touch with its probe result, as JSON-safe rows (``dsv4-serve doctor``)."""
    rows: list[dict[str, str | bool]] = []
    for touch in TOUCHES:
        missing = touch.probe()
        rows.append({"name": touch.name, "target": touch.target,
                     "used_in": ", ".join(touch.used_in),
                     "required": touch.required, "pd_only": touch.pd_only,
                     "loads_llm": touch.loads_llm,
                     "present": missing is None,
                     "detail": missing or "present", "why": touch.why, "how": touch.how,
                     "upstream": touch.upstream, "affected": touch.affected,
                     "removal": touch.removal})
    return rows


def present(name: str) -> bool:
    """Whether the named touch holds in the installed Ray (the probe of its entry)."""
    touch = next((t for t in TOUCHES if t.name == name), None)
    if touch is None:
        raise KeyError(f"no Ray touch named {name!r} in deployments/ray_touches/ "
                       f"(known: {', '.join(t.name for t in TOUCHES)})")
    return touch.probe() is None


def require(pd: bool = False, llm: bool = True,
            touches: tuple[RayTouch, ...] = TOUCHES) -> None:
    """Raise if a required touch is missing from the installed Ray (build_app, replicas).

    ``pd``: the app is a prefill/decode one, so its ``pd_only`` touches count too.
    ``llm``: this process imports Ray Serve LLM's server, so ``loads_llm`` touches count.
    """
    missing = [f"{t.name} ({t.target}): {detail}" for t in touches
               if t.required and (pd or not t.pd_only) and (llm or not t.loads_llm)
               for detail in [t.probe()] if detail]
    if missing:
        raise RuntimeError(
            "this Ray lacks internals dsv4-serve builds on:\n  " + "\n  ".join(missing)
            + "\nFix: install the pinned ray[serve]==2.60.0 (pyproject.toml), or update "
            "deployments/ray_touches/ and the code it names for this Ray.")


def render(rows: list[dict[str, str | bool]]) -> list[str]:
    """Doctor lines: one per touch."""
    return [f"ray touch {r['name']}: {'present' if r['present'] else 'MISSING'}"
            + ("" if r["present"] else f" ({r['detail']})")
            + ("" if r["required"] else "; optional") + ("; P/D apps" if r.get("pd_only") else "")
            + ("; required by replicas and Ray Serve LLM builds"
               if r.get("loads_llm") and r["required"] else "")
            + f" [{r['used_in']}]" for r in rows]
