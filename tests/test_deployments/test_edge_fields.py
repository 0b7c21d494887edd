"""Every field of every vLLM request model the served routes accept is decided (issue 32).

The fields come from vLLM itself: the installed release's pydantic models (imported),
and the class definitions in each supported release's wheel (an AST walk:
``tests.support.vllm_fields``), recursively through vLLM's nested models. A field
nobody decided in ``deployments.http.fields`` fails here, named with its model and
release: decide it (bound it in ``routes``, or say in ``fields.FREE`` why it is free).
"""

from __future__ import annotations

import pytest

from deployments.http import fields, routes
from tests.support import vllm_fields

# The releases the project runs on: 0.29 (the CPU/GPU stack's floor), 0.32 (installed),
# 0.33 and 0.34 (source).
RELEASES = ("0.29.0", "0.32.0", "0.33.0", "0.34.0")


def _undecided(found: dict[str, set[str]]) -> list[str]:
    missing = []
    for path, model in vllm_fields.REQUEST_MODELS:
        route = routes.find(path)
        assert route is not None, path
        missing += [f"{model}.{f}" for f in sorted(found.get(model, ()))
                    if fields.decide(route, f) is None]
    return missing


def test_every_field_of_the_installed_vllm_is_decided() -> None:
    pytest.importorskip("vllm")
    found = vllm_fields.installed_fields()
    assert set(found) == {m for _, m in vllm_fields.REQUEST_MODELS}
    assert not _undecided(found), (
        "fields of the installed vLLM nobody decided (deployments/http/fields.py): "
        f"{_undecided(found)}")


@pytest.mark.releases
@pytest.mark.parametrize("release", RELEASES)
def test_every_field_of_each_release_is_decided(release: str) -> None:
    found = vllm_fields.wheel_fields(release)
    assert found.get("ChatCompletionRequest"), f"no ChatCompletionRequest in {release}"
    missing = _undecided(found)
    assert not missing, f"vLLM {release}: fields nobody decided: {missing}"


@pytest.mark.releases
def test_the_wheel_walk_sees_what_the_import_sees() -> None:
    """The AST walk used for releases not installed agrees with pydantic on 0.32."""
    pytest.importorskip("vllm")
    assert vllm_fields.wheel_fields("0.32.0") == vllm_fields.installed_fields()


def test_bounded_fields_are_judged_where_vllm_reads_them() -> None:
    chat, messages = routes.EXACT[routes.CHAT_ROUTE], routes.EXACT[routes.MESSAGES_ROUTE]
    decision = fields.decide(messages, "thinking.budget_tokens")
    assert decision is not None and decision.kind == "bounded"
    assert decision.limit == "max_tokens" and decision.coerced == "int"
    assert fields.decide(chat, "vllm_xargs.kv_transfer_params") == fields.decide(
        chat, "kv_transfer_params")
    assert fields.decide(chat, "kv_transfer_params").kind == "refused"  # type: ignore[union-attr]  # decide may return None; a None fails the test
    assert fields.decide(chat, "no_such_field") is None
    responses = routes.EXACT[routes.RESPONSES_ROUTE]
    assert fields.decide(responses, "background").kind == "store"  # type: ignore[union-attr]  # decide may return None; a None fails the test
