"""Test fixture: KV-transfer faults injected into vLLM's NIXL pull connector (decode side).

Switched on by ``DSV4_TEST_PD_FAULTS=<path of a JSON file>`` in the engine processes
(tests/support/engine_site); the file is read at every transfer, so one pair of engines
serves clean canaries and every fault in turn: ``{"fault": null}`` is clean, else

- ``drop_region``: the READ leaves out every descriptor of region ``region`` (its pages
  never arrive: vllm#57661's truncated region, in the extreme);
- ``truncate_region``: once the READ completes, each received page of region
  ``region`` is zeroed past the bytes a short registration would carry (``keep``:
  ``"named"``, vllm#57661's, the page of the layer the region is named after, default;
  ``"smallest"``; ``"half"``; or a byte count), in the decode worker's own KV cache, before the
  scheduler sees the receive finished;
- ``zero_span``: once the READ completes, bytes ``[start, end)`` of each received page of
  region ``region`` are zeroed, whatever layer pages they hold: ``segment`` i is the i-th
  span between the row's distinct layer-page offsets (``segments``), ``span`` a byte range.
  A corruption anywhere in the row, not only at its tail, which no counter sees.
  ``block: [group, index]`` narrows it to the page of one block of the request (the
  ``index``-th, negative from the end, of KV cache group ``group``'s blocks as the
  scheduler handed them to the read), whole unless a span or segment is given: one block
  lost, the rest of the prompt intact. ``layer: <name>`` narrows it to that layer's page
  in the blocks of its KV cache group, past ``keep`` bytes (default 0): vllm#57661's
  truncated ``compressor.state_cache`` as a packed row carries it;
- ``fail_receive``: posting the READ raises, as a NIXL transfer error does (vllm#52276);
- ``stale_params``: the decode scheduler swaps the request's ``remote_block_ids`` and
  ``remote_request_id`` for the previous remote-prefill request's (vllm#52234).

The decode engine's own code does the rest (failure reporting, kv_load_failure_policy).
Each fault that fires appends one JSON line to ``<file>.log`` (what it did, to which
request, region and how many pages or bytes), so a test proves the fault happened
before it judges whether it was caught.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
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

    def __init__(self, real: Any, worker: Any, fault: dict[str, Any], request_id: str,
                 groups: list[list[int]]):
        self._real, self._worker, self._fault, self._request = real, worker, fault, request_id
        self._groups = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def make_prepped_xfer(self, op: str, local_handle: Any, local_ids: Any,
                          remote_handle: Any, remote_ids: Any, **kwargs: Any) -> Any:
        kind, region = self._fault["fault"], int(self._fault.get("region", 0))
        if kind == "fail_receive":
            log(fault=kind, request=self._request)
            raise RuntimeError("dsv4 test fault: NIXL READ failed (fail_receive)")
        if kind == "drop_region":
            keep = [i for i, d in enumerate(local_ids)
                    if not _in_region(self._worker, d, region)]
            log(fault=kind, request=self._request, region=region,
                region_name=_region_name(self._worker, region),
                descs_dropped=len(local_ids) - len(keep), descs_kept=len(keep))
            local_ids = [local_ids[i] for i in keep]
            remote_ids = [remote_ids[i] for i in keep]
        if kind in ("truncate_region", "zero_span"):
            ids = [int(d) for d in local_ids if _in_region(self._worker, d, region)]
            blocks = chosen_blocks(self._groups, self._fault,
                                   _layer_group(self._worker, self._fault.get("layer")))
            if blocks is not None:
                first = _region_offsets(self._worker)[region]
                ids = [d for d in ids if d - first in blocks]
            self._worker._dsv4_zero[self._request] = (region, ids, self._fault)
            log(fault=f"{kind}_armed", request=self._request, region=region, pages=len(ids),
                groups=[len(g) for g in self._groups],
                block_ids=None if blocks is None else sorted(blocks))
        return self._real.make_prepped_xfer(op, local_handle, local_ids, remote_handle,
                                            remote_ids, **kwargs)


def chosen_blocks(groups: list[list[int]], fault: dict[str, Any],
                  layer_group: int | None = None) -> set[int] | None:
    """The block ids whose received pages ``fault`` zeroes, of the request's local blocks
    per KV cache group: the one ``block: [group, index]`` names, every block of the group
    the named ``layer`` is in (``layer_group``), or None: every page. A block or layer
    the request does not have gives no page (the hook logs that, the engine goes on)."""
    if "block" in fault:
        group, index = (int(x) for x in fault["block"])
        blocks = groups[group] if 0 <= group < len(groups) else []
        return {blocks[index]} if -len(blocks) <= index < len(blocks) else set()
    if "layer" in fault:
        if layer_group is None or not 0 <= layer_group < len(groups):
            return set()
        return set(groups[layer_group])
    return None


def _layer_group(worker: Any, layer: str | None) -> int | None:
    """The transfer group (the order a read's block ids come in) holding ``layer``."""
    config = getattr(worker, "kv_cache_config", None)
    for index, group in enumerate(getattr(config, "transfer_groups", ())):
        if layer in group.layer_names:
            return index
    return None


def log(**fields: Any) -> None:
    """Append what a fault did to ``<fault file>.log`` (one JSON line per event)."""
    path = os.environ.get(ENV)
    if path:
        with open(f"{path}.log", "a") as f:
            f.write(json.dumps(fields) + "\n")


def members(worker: Any, region: int) -> list[tuple[int, int, str]]:
    """(offset, bytes, layer) of each layer's page inside one page of ``region``, by
    offset: vLLM 0.32 registers DeepSeek-V4's packed KV rows (every layer's page of one
    block id) as one region, so a region's page holds many layers' pages."""
    base = worker.kv_caches_base_addr[worker.engine_id][worker.tp_rank][region]
    stride = worker.block_stride_per_layer[region]
    out = []
    for name, cache in getattr(worker, "device_kv_caches", {}).items():
        offset = cache.data_ptr() - base
        if 0 <= offset < stride and cache.ndim > 1:
            out.append((offset, cache[0].nbytes, name))
    return sorted(out)


def keep_bytes(worker: Any, region: int, length: int, keep: Any = "named") -> int:
    """How much of each page of ``region`` a short registration still carries.

    ``"named"``: the page of the layer the region is named after (registered first at
    that address), as vllm#57661's deduplication by base address registers it;
    ``"smallest"``: the smallest layer page at the row's start; ``"half"``: half the
    page (also when the region holds one layer); an int: that many bytes.
    """
    if isinstance(keep, int):
        return keep
    found = members(worker, region)
    if len(found) <= 1 or keep == "half":
        return length // 2
    if keep == "smallest":
        offset, size, _ = found[0]
        return offset + size
    name = _region_name(worker, region)
    offset, size = next(((o, b) for o, b, n in found if n == name), found[0][:2])
    return offset + size


def segments(worker: Any, region: int, length: int) -> list[tuple[int, int, list[str]]]:
    """(start, end, layers) of each span of a ``length``-byte page of ``region`` between
    consecutive distinct layer-page offsets (``members``), with the layers whose pages
    overlap it: the hybrid allocator lays each KV cache group's layers out its own way
    in one shared row, so a span belongs to a layer of each group."""
    found = members(worker, region)
    bounds = sorted({0, length, *(o for o, _, _ in found if o < length)})
    return [(a, b, _overlapping(found, a, b)) for a, b in itertools.pairwise(bounds)]


def _overlapping(found: list[tuple[int, int, str]], start: int, end: int) -> list[str]:
    """The layers of ``found`` (``members``) whose pages overlap ``[start, end)``."""
    return sorted({n for o, size, n in found if o < end and o + size > start})


def span_of(worker: Any, region: int, length: int, fault: dict[str, Any]) -> tuple[int, int]:
    """The bytes ``[start, end)`` of each received page that ``fault`` zeroes (empty for
    a segment the row does not have: the hook logs that, the engine goes on)."""
    if fault["fault"] == "truncate_region":
        return keep_bytes(worker, region, length, fault.get("keep", "named")), length
    if "span" in fault:
        start, end = (int(x) for x in fault["span"])
        return max(0, start), min(length, end)
    if "layer" in fault:
        return layer_span(members(worker, region), length, fault)
    if "segment" not in fault and "block" in fault:
        return 0, length
    found = segments(worker, region, length)
    index = int(fault.get("segment", 0))
    return found[index][:2] if 0 <= index < len(found) else (0, 0)


def layer_span(found: list[tuple[int, int, str]], length: int,
               fault: dict[str, Any]) -> tuple[int, int]:
    """The bytes of layer ``fault["layer"]``'s page in a row (``members``) past the
    ``keep`` bytes that arrive (default 0: the whole page lost); empty if the row has no
    page of that layer."""
    offset, size = next(((o, b) for o, b, n in found if n == fault["layer"]), (0, 0))
    keep = min(size, int(fault.get("keep", 0)))
    return min(length, offset + keep), min(length, offset + size)


def _zero(worker: Any, desc_ids: list[int], region: int,
          fault: dict[str, Any]) -> tuple[int, int, int]:
    """Zero ``span_of`` in each local page named by ``desc_ids``; (start, end, bytes).

    A local descriptor's (address, length) is the worker's own ``src_blocks_data`` row:
    exactly the bytes the READ wrote for that page.
    """
    start, end, zeroed = 0, 0, 0
    for d in desc_ids:
        addr, length = (int(x) for x in worker.src_blocks_data[d][:2])
        start, end = span_of(worker, region, length, fault)
        ctypes.memset(addr + start, 0, max(0, end - start))
        zeroed += max(0, end - start)
    return start, end, zeroed


def _page_bytes(worker: Any, region: int) -> int:
    """The length of one received page of ``region`` (its first local descriptor's)."""
    return int(worker.src_blocks_data[_region_offsets(worker)[region]][1])


def install_worker(module: Any) -> None:
    """Wrap ``NixlPullConnectorWorker._read_blocks`` and ``get_transfer_results`` (what
    the connector asks for finished receives; ``get_finished`` is a wrapper of it)."""
    cls = module.NixlPullConnectorWorker
    read_blocks, transfer_results = cls._read_blocks, cls.get_transfer_results

    @functools.wraps(read_blocks)
    def _read_blocks(self: Any, *args: Any, **kwargs: Any) -> Any:
        fault = current()
        if not fault or fault["fault"] == "stale_params":
            return read_blocks(self, *args, **kwargs)
        if not hasattr(self, "_dsv4_zero"):
            self._dsv4_zero = {}
            log(fault="regions", regions=[
                _layout(self, r) for r in range(len(_region_offsets(self)) - 1)],
                groups=_transfer_groups(self))
        request_id = kwargs.get("request_id", args[2] if len(args) > 2 else None)
        spec = kwargs.get("read_spec", args[0] if args else None)
        groups = [[int(b) for b in g] for g in getattr(spec, "local_block_ids", None) or []]
        real = self.nixl_wrapper
        self.nixl_wrapper = _Faulty(real, self, fault, str(request_id), groups)
        try:
            return read_blocks(self, *args, **kwargs)
        finally:
            self.nixl_wrapper = real

    @functools.wraps(transfer_results)
    def get_transfer_results(self: Any) -> Any:
        results = transfer_results(self)
        pending = getattr(self, "_dsv4_zero", {})
        for req in set(results.finished_recving) - set(results.failed_recving):
            region, ids, fault = pending.pop(req, (0, [], {}))
            if ids:
                start, end, zeroed = _zero(self, ids, region, fault)
                log(fault=fault["fault"], request=req, region=region,
                    region_name=_region_name(self, region), pages=len(ids),
                    kept_per_page=start if fault["fault"] == "truncate_region" else None,
                    span=[start, end],
                    layers=_overlapping(members(self, region), start, end),
                    bytes=zeroed)
        return results

    cls._read_blocks = _read_blocks
    cls.get_transfer_results = get_transfer_results


def _layout(worker: Any, region: int) -> dict[str, Any]:
    """How ``region``'s received page is laid out: its layer pages and the spans between
    them (``zero_span``'s segments)."""
    bounds, page = _region_offsets(worker), _page_bytes(worker, region)
    return {"region": region, "name": _region_name(worker, region),
            "descs": bounds[region + 1] - bounds[region], "members": members(worker, region),
            "page_bytes": page, "segments": segments(worker, region, page)}


def _transfer_groups(worker: Any) -> list[dict[str, Any]]:
    """The KV cache groups a read's block ids come in (``block: [group, index]`` counts
    in this order): each group's spec, tokens per block and layers."""
    config = getattr(worker, "kv_cache_config", None)
    return [{"spec": type(g.kv_cache_spec).__name__,
             "block_size": getattr(g.kv_cache_spec, "block_size", None),
             "layers": list(g.layer_names)}
            for g in getattr(config, "transfer_groups", ())]


def _region_name(worker: Any, region: int) -> str:
    indices = getattr(worker, "_transfer_layer_region_indices", None) or ()
    names = getattr(worker, "region_names", None) or []
    local = indices[region] if region < len(indices) else region
    return names[local] if local < len(names) else f"region {region}"


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
                log(fault="stale_params", request=request.request_id,
                    replayed=previous["remote_request_id"])
        return original(self, request, blocks, num_external_tokens)

    cls.update_state_after_alloc = update_state_after_alloc
