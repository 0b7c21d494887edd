"""Test fixture: KV-transfer faults injected into vLLM's NIXL pull connector (decode side).

Switched on by ``DSV4_TEST_PD_FAULTS=<path of a JSON file>`` in the engine processes
(tests/support/engine_site); the file is read at every transfer, so one pair of engines
serves clean canaries and every fault in turn: ``{"fault": null}`` is clean, else

- ``drop_region``: the READ leaves out every descriptor of region ``region`` (its pages
  never arrive: vllm#57661's truncated region, in the extreme);
- ``truncate_region``: once the READ completes, the second half of each received page
  of region ``region`` is zeroed (a region registered shorter than its pages);
- ``fail_receive``: posting the READ raises, as a NIXL transfer error does (vllm#52276);
- ``stale_params``: the decode scheduler swaps the request's ``remote_block_ids`` and
  ``remote_request_id`` for the previous remote-prefill request's (vllm#52234).

The decode engine's own code does the rest (failure reporting, kv_load_failure_policy).
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
from typing import Any

WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker"
SCHEDULER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler"
ENV = "DSV4_TEST_PD_FAULTS"


def current() -> dict[str, Any]:
    """The fault in force now (``{}`` when none)."""
    path = os.environ.get(ENV)
    if not path or not os.path.exists(path):
        return {}
    with open(path) as f:
        data = json.load(f) or {}
    return data if data.get("fault") else {}


def _region_offsets(worker: Any) -> list[int]:
    counts = worker.dst_region_num_blocks.get(worker.engine_id) or \
        [worker.dst_num_blocks[worker.engine_id]] * worker.num_regions
    offsets, total = [], 0
    for c in counts:
        offsets.append(total)
        total += c
    return [*offsets, total]


def _in_region(worker: Any, desc_id: int, region: int) -> bool:
    bounds = _region_offsets(worker)
    return bounds[region] <= int(desc_id) < bounds[region + 1]


class _Faulty:
    """The worker's NIXL agent with one fault in ``make_prepped_xfer``."""

    def __init__(self, real: Any, worker: Any, fault: dict[str, Any], request_id: str):
        self._real, self._worker, self._fault, self._request = real, worker, fault, request_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def make_prepped_xfer(self, op: str, local_handle: Any, local_ids: Any,
                          remote_handle: Any, remote_ids: Any, **kwargs: Any) -> Any:
        kind, region = self._fault["fault"], int(self._fault.get("region", 0))
        if kind == "fail_receive":
            raise RuntimeError("dsv4 test fault: NIXL READ failed (fail_receive)")
        if kind == "drop_region":
            keep = [i for i, d in enumerate(local_ids)
                    if not _in_region(self._worker, d, region)]
            local_ids = [local_ids[i] for i in keep]
            remote_ids = [remote_ids[i] for i in keep]
        if kind == "truncate_region":
            self._worker._dsv4_truncate[self._request] = [
                int(d) for d in local_ids if _in_region(self._worker, d, region)]
        return self._real.make_prepped_xfer(op, local_handle, local_ids, remote_handle,
                                            remote_ids, **kwargs)


def _truncate(worker: Any, desc_ids: list[int], region: int) -> None:
    """Zero the second half of each page of ``region`` named by ``desc_ids``."""
    base = worker.kv_caches_base_addr[worker.engine_id][worker.tp_rank][region]
    length = worker.block_len_per_layer[region]
    strides = getattr(worker, "block_stride_per_layer", None) or []
    stride = strides[region] if region < len(strides) and strides[region] else length
    first = _region_offsets(worker)[region]
    for d in desc_ids:
        page = base + (d - first) * stride
        ctypes.memset(page + length // 2, 0, length - length // 2)


def install_worker(module: Any) -> None:
    """Wrap ``NixlPullConnectorWorker._read_blocks`` and ``get_finished``."""
    cls = module.NixlPullConnectorWorker
    read_blocks, get_finished = cls._read_blocks, cls.get_finished

    @functools.wraps(read_blocks)
    def _read_blocks(self: Any, read_spec: Any, dst_engine_id: str, request_id: str,
                     *args: Any, **kwargs: Any) -> Any:
        fault = current()
        if not fault or fault["fault"] == "stale_params":
            return read_blocks(self, read_spec, dst_engine_id, request_id, *args, **kwargs)
        if not hasattr(self, "_dsv4_truncate"):
            self._dsv4_truncate = {}
        real = self.nixl_wrapper
        self.nixl_wrapper = _Faulty(real, self, fault, request_id)
        try:
            return read_blocks(self, read_spec, dst_engine_id, request_id, *args, **kwargs)
        finally:
            self.nixl_wrapper = real

    @functools.wraps(get_finished)
    def _get_finished(self: Any) -> Any:
        sending, recving = get_finished(self)
        pending = getattr(self, "_dsv4_truncate", {})
        fault = current()
        for req in list(recving or ()):
            ids = pending.pop(req, None)
            if ids and fault.get("fault") == "truncate_region":
                _truncate(self, ids, int(fault.get("region", 0)))
        return sending, recving

    cls._read_blocks = _read_blocks
    cls.get_finished = _get_finished


def install_scheduler(module: Any) -> None:
    """Wrap ``NixlPullConnectorScheduler.update_state_after_alloc`` (stale params)."""
    cls = module.NixlPullConnectorScheduler
    original = cls.update_state_after_alloc

    @functools.wraps(original)
    def update_state_after_alloc(self: Any, request: Any, blocks: Any,
                                 num_external_tokens: int) -> Any:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and params.get("remote_block_ids"):
            previous = getattr(self, "_dsv4_previous", None)
            self._dsv4_previous = dict(params)
            if previous and current().get("fault") == "stale_params":
                request.kv_transfer_params = params | {
                    "remote_block_ids": previous["remote_block_ids"],
                    "remote_request_id": previous["remote_request_id"]}
        return original(self, request, blocks, num_external_tokens)

    cls.update_state_after_alloc = update_state_after_alloc
