"""The fleet's Responses state: one store every replica reads and writes.

With ``http.responses_store`` on, vLLM's per-process Responses dicts are replaced on
each replica by views onto one store (``binding``, the vLLM touch documented in
``dsv4_patch.responses_touch``), so any replica serves retrieve, cancel and
``previous_response_id`` follow-ups (streamed or not), and a stored response outlives
the replica that made it (scale-down, replacement, node loss, rollout). No relay.

* ``store``: the backend protocol and owners. A record is filed under the SHA-256 of
  the API key that created it (``views.OwnerScope`` reads the edge's digest); another
  key gets the same 404 as a missing id; without keys, one owner.
* ``sqlite`` (default): a WAL SQLite file in the local run directory; nothing to install,
  every process on the machine shares it (local run, local multi-node cluster).
* ``redis_store``: Redis/Valkey for fleets across machines (KubeRay); installed by
  ``make setup`` (Debian's redis-server, the ``redis`` client from PyPI). Upstream's
  RFC (vllm#26934) proposes the same split: an in-memory default and a pluggable
  external store.
* Bounds: ``responses.max_age_s`` and ``max_count``, oldest evicted first on every
  write; ``dsv4_responses_store_records`` is the store's size. Every store call has
  ``responses.timeout_s``; a failed write fails the request (503, or a stream ``error``
  event), it never drops state silently.
* Background runs: status from any replica; a cancel from any replica is stored and the
  running replica cancels its task within ``responses.cancel_poll_s``. Replaying a
  background run's event stream stays on the replica running it (events are not
  stored); elsewhere a 400 says so.
"""
