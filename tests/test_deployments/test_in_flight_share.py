"""``http.max_in_flight`` is shared by Serve replicas, i.e. DP ranks (issue 26).

flash-h200 runs DP8 gangs, ``max_replicas: 4`` gangs = 32 Serve replicas, each its
own ingress. The share used to divide by the 4 gangs: 2048 per rank, 65,536 for the
fleet against the configured 8192.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deployments.config import AppArgs, load_serve_config
from deployments.config.sizing import Parallel, serve_replicas
from deployments.http.edge import in_flight_share

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _args(name: str) -> AppArgs:
    [(_, args)] = load_serve_config(CONFIGS / f"{name}.yaml").ours()
    return args


def test_flash_h200_admits_its_configured_8192_in_flight() -> None:
    args = _args("flash-h200")
    assert args.llm.deployment_config.max_replicas == 4
    assert args.max_serving_replicas == 32
    share, note = in_flight_share(args.http, args.max_serving_replicas)
    # max_num_seqs is one of the engine kwargs EngineKwargs passes through as extras.
    assert share.max_in_flight == 256 == args.llm.engine_kwargs.max_num_seqs  # type: ignore[attr-defined]  # an extra field EngineKwargs passes through
    assert share.max_in_flight * args.max_serving_replicas == args.http.max_in_flight == 8192
    assert "over at most 32 replicas" in note


def test_without_dp_a_replica_is_one_engine() -> None:
    assert serve_replicas(3, Parallel(tp=8, pp=1)) == 3
    assert serve_replicas(3, Parallel(tp=1, pp=1, dp=8)) == 24


def test_the_built_flash_h200_app_binds_the_rank_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What each replica is bound with by ``build_one_pool_app``, with no Ray: the server
    deployment's options read the connected Ray's runtime env, so the bound kwargs are
    taken at ``bind``."""
    from deployments.serving import builder

    class Bound:
        name = "DSv4DPServer:m"

        def bind(self, bind_kwargs: dict[str, Any]) -> Any:
            return bind_kwargs

    monkeypatch.setattr(builder, "one_pool_server", lambda config: Bound())
    bound = builder.build_one_pool_app(_args("flash-h200"))
    assert bound["serving_replicas"] == 32
