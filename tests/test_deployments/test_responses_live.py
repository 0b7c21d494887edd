"""The fleet's Responses store, live: the mixed app's 2 replicas with ``http.responses_store``.

Any replica serves any follow-up (no relay, no holder in the id): each response is
retrieved 6 times and continued, streamed and not, through Serve's proxy, which picks
a replica per request (were state per replica, about half of these would 404); a
10-turn ``previous_response_id`` chain through the official client; a background run
cancelled through whichever replica answers; and two API keys that cannot read each
other's responses (the same 404 as a missing id). With ``DSV4_FULL_FAULTS=1``
(``make test-faults``: one more engine boot), a chain continues while the replica
that made its first turns is killed and replaced.
"""

from __future__ import annotations

import time

import openai
import pytest

from deployments.harness.multinode_scenario import FULL_FAULTS
from deployments.http import auth
from tests.support.stack import MIXED_APP, Stack

pytestmark = pytest.mark.slow

MODEL = "dsv4-tiny"
KEY_A = "sk-dsv4-test-owner-a-0123456789abcdef"
KEY_B = "sk-dsv4-test-owner-b-0123456789abcdef"


def _client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=key, timeout=120, max_retries=0)


def test_follow_ups_on_whichever_replica_answers(mixed_app: str) -> None:
    client = _client(mixed_app)
    for _ in range(3):
        first = client.responses.create(model=MODEL, input="hi", max_output_tokens=2,
                                        store=True)
        for _ in range(6):
            assert client.responses.retrieve(first.id).id == first.id
        follow = client.responses.create(model=MODEL, input="more", max_output_tokens=2,
                                         previous_response_id=first.id)
        assert follow.previous_response_id == first.id
        events = list(client.responses.create(model=MODEL, input="again", max_output_tokens=2,
                                              stream=True, previous_response_id=follow.id))
        kinds = [e.type for e in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
        streamed = events[-1].response.id
        for _ in range(4):  # a streamed response is stored before its last event
            assert client.responses.retrieve(streamed).previous_response_id == follow.id
        with pytest.raises(openai.BadRequestError):  # vLLM's answer: a finished response
            client.responses.cancel(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_" + "0" * 32)


def test_ten_turn_chain_with_the_official_client(mixed_app: str) -> None:
    client = _client(mixed_app)
    previous = None
    ids = []
    for turn in range(10):
        resp = client.responses.create(model=MODEL, input=f"turn {turn}", max_output_tokens=2,
                                       previous_response_id=previous)
        # 2 tokens end at the limit: "incomplete" (max_output_tokens), a finished response
        assert resp.status in ("completed", "incomplete"), resp.status
        assert resp.previous_response_id == previous
        ids.append(resp.id)
        previous = resp.id
    for rid in ids:
        assert client.responses.retrieve(rid).id == rid


def test_background_status_and_cancel_from_any_replica(mixed_app: str) -> None:
    client = _client(mixed_app)
    run = client.responses.create(model=MODEL, input="count to a thousand", background=True,
                                  max_output_tokens=1000, store=True)  # http.max_tokens 1024
    assert run.status in ("queued", "in_progress")
    statuses = {client.responses.retrieve(run.id).status for _ in range(4)}
    assert statuses <= {"queued", "in_progress"}, statuses  # 1000 tokens take seconds
    cancelled = client.responses.cancel(run.id)
    assert cancelled.status == "cancelled"
    time.sleep(3)  # the running replica polls the store (responses.cancel_poll_s = 1 s)
    for _ in range(4):
        assert client.responses.retrieve(run.id).status == "cancelled"


def test_two_keys_cannot_read_each_others_responses(serve_stack: Stack,
                                                    mixed_app: str) -> None:
    assert serve_stack.keys_file is not None
    serve_stack.keys_file.write_text(f"{KEY_A}\n{KEY_B}\n")
    time.sleep(auth.FILE_RECHECK_S + 0.5)
    try:
        a, b = _client(mixed_app, KEY_A), _client(mixed_app, KEY_B)
        mine = a.responses.create(model=MODEL, input="secret", max_output_tokens=2)
        for _ in range(4):
            assert a.responses.retrieve(mine.id).id == mine.id
            with pytest.raises(openai.NotFoundError) as err:
                b.responses.retrieve(mine.id)
            assert mine.id in str(err.value)  # vLLM's "not found", as for a missing id
            with pytest.raises(openai.NotFoundError):
                b.responses.create(model=MODEL, input="x", max_output_tokens=2,
                                   previous_response_id=mine.id)
            with pytest.raises(openai.NotFoundError):
                b.responses.cancel(mine.id)
    finally:
        serve_stack.keys_file.write_text(f"{auth.NO_KEYS}\n")  # empty would be a bad edit
        time.sleep(auth.FILE_RECHECK_S + 0.5)


def _server_replicas(app: str) -> dict[str, str]:
    """Ray actor name -> namespace of ``app``'s server replicas."""
    import ray

    return {a["name"]: a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{app}#DSv4Server")}


def _running(app: str) -> int:
    from ray import serve

    deployments = serve.status().applications[app].deployments
    return sum(d.replica_states.get("RUNNING", 0) for name, d in deployments.items()
               if name.startswith("DSv4Server"))


@pytest.mark.skipif(not FULL_FAULTS, reason="one more engine boot: `make test-faults` "
                    "(DSV4_FULL_FAULTS=1) runs it")
def test_chain_continues_while_its_replicas_are_replaced(mixed_app: str) -> None:
    import ray

    client = openai.OpenAI(base_url=mixed_app, api_key="unused", timeout=120, max_retries=3)
    ids: list[str] = []

    def turns(n: int) -> None:
        for _ in range(n):
            resp = client.responses.create(model=MODEL, input="go", max_output_tokens=2,
                                           previous_response_id=ids[-1] if ids else None)
            ids.append(resp.id)

    turns(4)  # on both replicas (Serve's proxy picks per request)
    before = _server_replicas(MIXED_APP)
    assert len(before) == 2, before
    victim = next(iter(before))
    ray.kill(ray.get_actor(victim, namespace=before[victim]), no_restart=True)
    turns(3)  # the survivor serves the chain, including turns made on the killed one
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if victim not in _server_replicas(MIXED_APP) and _running(MIXED_APP) == 2:
            break
        time.sleep(2)
    else:
        raise AssertionError(f"no running replacement for {victim} in 600 s")
    turns(3)
    assert len(ids) == 10
    for rid in ids:  # every turn, whichever replica made it, from whichever answers
        assert client.responses.retrieve(rid).id == rid
