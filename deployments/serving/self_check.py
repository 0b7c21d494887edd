"""A replica's check of its own workers' KV specs, before it becomes RUNNING."""

from __future__ import annotations

from deployments.config import Policy
from deployments.control.enforcement import KVLayoutMismatch
from deployments.control.prediction import layout_problem, prediction_differences, self_problem
from deployments.control.wire import ReplicaSpec
from deployments.logs import get_logger

logger = get_logger("server")  # the replica's own log, as the server's


def check_own_spec(spec: ReplicaSpec, *, replica_id: str, rank: int | None, expected: str,
                   policy: Policy, engine_start_s: float | None) -> None:
    """Refuse to serve when the workers contradict the expectation or their own config.

    A wrong layout always refuses. Split ranks, or caches other than this
    replica's own config predicts, refuse under ``enforce``: the replica never
    becomes RUNNING, so a rolling update to such a version is held back while
    the old replicas keep serving. Under warn/drain it starts and is named.
    """
    problem = layout_problem(spec.layers, expected)
    if problem:
        raise KVLayoutMismatch(
            f"replica {replica_id}: workers report {spec.cache_dtypes} but "
            f"dsv4.expected_layout={expected!r}: {problem}. "
            "Fix: check that the dsv4_patch plugin loads in the engine workers "
            "(`dsv4-serve doctor`) and that VLLM_PLUGINS, if set, lists dsv4_patch."
        )
    problem = self_problem(spec)
    if problem and policy is Policy.ENFORCE:
        raise KVLayoutMismatch(
            f"replica {replica_id} (rank {rank}): {problem}. Refusing to "  # noqa: S608  # an error message, not SQL
            "serve under dsv4.policy=enforce (a rolling update stops here; the old "
            "replicas keep serving). Fix: make the engine build what the config "
            "declares, or set dsv4.policy: warn to start it for inspection."
        )
    if problem:
        logger.warning("dsv4: replica %s (rank %s) starts although %s (policy %s)",
                       replica_id, rank, problem, policy.value)
    predicted = "unpredicted: " + (spec.prediction.reason or "") \
        if spec.prediction.layers is None else "as predicted" if not \
        prediction_differences(spec.layers, spec.prediction) else "NOT as predicted"
    logger.info("dsv4: replica %s (rank %s) KV spec %s: %s, pages %s B, blocks %s, %s "
                "(engine up in %ss)", replica_id, rank, spec.fingerprint[:19],
                spec.cache_dtypes, spec.page_sizes, spec.block_sizes, predicted,
                engine_start_s)
