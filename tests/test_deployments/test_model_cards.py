"""``GET /v1/models*`` names the served model id, never where the weights lie (issue 26).

vLLM 0.32's list puts ``BaseModelPath.model_path`` in ``root``; under Ray Serve LLM
that is ``model_source``, a path on the replica's node. vLLM's real app and its
real ``OpenAIModelRegistry`` (no engine), hardened by ``front.harden``.
"""

from __future__ import annotations

from types import SimpleNamespace

from fastapi.testclient import TestClient
from vllm.entrypoints.openai.models.protocol import BaseModelPath
from vllm.entrypoints.openai.models.serving import OpenAIModelRegistry

from deployments.config import HTTPEdge
from deployments.http.edge import Edge
from deployments.http.front import harden, public_cards
from tests.support.vllm_app import vllm_app

MODEL_ID = "deepseek-ai/DeepSeek-V4-Flash"
WEIGHTS = "/mnt/secret-models/dsv4-flash"


def test_the_model_list_shows_the_id_not_the_path() -> None:
    app = vllm_app()
    app.state.openai_serving_models = OpenAIModelRegistry(
        SimpleNamespace(max_model_len=4096), [BaseModelPath(MODEL_ID, WEIGHTS)])
    edge = Edge.start(HTTPEdge(), "127.0.0.1", environ={})
    resp = TestClient(harden(app, edge)).get("/v1/models")
    assert resp.status_code == 200, resp.text
    assert "secret-models" not in resp.text
    [card] = resp.json()["data"]
    assert card["id"] == MODEL_ID and card["root"] == MODEL_ID
    assert int(resp.headers["content-length"]) == len(resp.content)


def test_one_card_and_non_cards_pass_through_unharmed() -> None:
    assert public_cards({"id": "m", "object": "model", "root": WEIGHTS})["root"] == "m"
    assert public_cards({"error": {"code": 404}}) == {"error": {"code": 404}}
    assert public_cards([1, 2]) == [1, 2]
