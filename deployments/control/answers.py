"""A replica's answer to ``kv_page_spec``, validated where it arrives (the controller)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deployments.control.summary import fingerprint
from deployments.control.verdict import NoAnswer
from deployments.control.wire import ReplicaSpec, ReplicaSpecBrief


def parse_answer(answer: Any, held: Mapping[str, ReplicaSpec]) -> ReplicaSpec | NoAnswer:
    """One answer validated on receipt: a full spec (re-hashed) or a brief one.

    ``held``: the validated full specs the controller holds, by replica id; a brief
    answer ("still the spec you hold") is that spec with the verdict it echoes.
    """
    if isinstance(answer, BaseException):
        return NoAnswer(None, f"a replica failed kv_page_spec: "
                               f"{type(answer).__name__}: {answer}")
    try:
        if isinstance(answer, dict) and answer.get("brief") is True:
            return from_brief(ReplicaSpecBrief.model_validate(answer), held)
        spec = ReplicaSpec.model_validate(answer)
    except ValueError as exc:
        return NoAnswer(None, f"a replica answered kv_page_spec with something "
                               f"that is not a ReplicaSpec: {exc}")
    if fingerprint(spec.layers) != spec.fingerprint:
        return NoAnswer(spec.replica_id, (
            f"replica {spec.replica_id} sent fingerprint {spec.fingerprint[:19]} that "
            "does not hash its own layers: not judged"))
    return spec


def from_brief(brief: ReplicaSpecBrief,
               held: Mapping[str, ReplicaSpec]) -> ReplicaSpec | NoAnswer:
    spec = held.get(brief.replica_id)
    if spec is None or spec.fingerprint != brief.fingerprint:
        # Only a race with a replaced cache can get here; the next check asks in full.
        return NoAnswer(brief.replica_id, (
            f"replica {brief.replica_id} answered briefly for a spec this controller "
            "does not hold; asked in full next check"))
    return spec.model_copy(update={"verdict": brief.verdict})
