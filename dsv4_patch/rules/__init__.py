"""Pure rules: what DeepSeek-V4/V4.1's KV cache looks like on a node, decided without vLLM.

No vLLM import, no Ray import, no I/O. ``build(EngineSetup, hf_config)`` is the one
answer plan, the controller's prediction, the replica's self-check, doctor and the presets
ask (``build_v4_node`` and ``v41_record``, its node step, where no model config is at
hand: ``kv_cache_dtype: auto`` is resolved there and nowhere else); the modules under it,
one per question:

- ``engine``       the build: attention class, dtype, block, pages, bytes per token;
- ``engine_setup`` what vLLM reads for the build, coerced as vLLM coerces it;
- ``releases``     what each vLLM release decides (keyed by release);
- ``model_config`` one reader of a config's shape (nested V4.1 or flat), capabilities;
- ``layouts``/``dtypes``/``byte_model``/``prediction``  DeepSeek-V4's layout, resolver, bytes;
- ``family``       V4 vs V4.1: records, V4.1's resolver, caches from the topology;
- ``versions``     release numbers; ``plugin_env`` whether vLLM loads our plugin.

This face hands on the names the rest of the package uses; the modules import one
another directly, and a test of one module's internals imports that module.
"""

from dsv4_patch.rules.byte_model import (
    INDEXER_SCALE_BYTES,
    ModelShape,
    kv_bytes_per_token,
    padded_page_bytes,
    page_alignment,
    page_breakdown,
    state_bytes,
)
from dsv4_patch.rules.dtypes import (
    PROBE_DTYPES,
    Resolution,
    UpstreamDecision,
    stock_vllm_crashes_on,
    upstream_resolver_decision,
)
from dsv4_patch.rules.engine import (
    DEFAULT_V41_RELEASE,
    V4Node,
    build,
    build_v4_node,
    v41_record,
)
from dsv4_patch.rules.engine_setup import EngineSetup
from dsv4_patch.rules.family import (
    FIRST_V41_VLLM,
    PACKED_DTYPES,
    Family,
    V41Cache,
    V41Topology,
    family_of,
    v41_bytes_per_token,
    v41_caches,
)
from dsv4_patch.rules.layouts import (
    AUTO_VALUES,
    DEFAULT_VLLM,
    FLASHINFER_DSV4,
    FLASHMLA_DSV4,
    PLATFORMS,
    KVCacheDtypeError,
    Layout,
    LayoutDecision,
    LayoutError,
    Storage,
    detect_layout,
)
from dsv4_patch.rules.model_config import flatten_config, parse_capability
from dsv4_patch.rules.plugin_env import PLUGIN_NAME, plugin_allowed
from dsv4_patch.rules.prediction import DSV4_BLOCK_SIZE, INDEXER, MAIN, predict_layers, predictable
from dsv4_patch.rules.releases import (
    KNOWN_RELEASES,
    NEWEST_RELEASE,
    default_gpu_memory_utilization,
    nixl_mismatch,
    nixl_region_dedup_hazard,
    release_rules,
)
from dsv4_patch.rules.versions import parse_version

__all__ = [
    "AUTO_VALUES", "DEFAULT_V41_RELEASE", "DEFAULT_VLLM", "DSV4_BLOCK_SIZE", "FIRST_V41_VLLM",
    "FLASHINFER_DSV4", "FLASHMLA_DSV4", "INDEXER", "INDEXER_SCALE_BYTES", "KNOWN_RELEASES",
    "MAIN", "NEWEST_RELEASE", "PACKED_DTYPES", "PLATFORMS", "PLUGIN_NAME", "PROBE_DTYPES",
    "EngineSetup", "Family", "KVCacheDtypeError", "Layout", "LayoutDecision", "LayoutError",
    "ModelShape", "Resolution", "Storage", "UpstreamDecision", "V4Node", "V41Cache",
    "V41Topology", "build", "build_v4_node", "default_gpu_memory_utilization", "detect_layout",
    "family_of", "flatten_config", "kv_bytes_per_token", "nixl_mismatch",
    "nixl_region_dedup_hazard", "padded_page_bytes", "page_alignment", "page_breakdown",
    "parse_capability", "parse_version", "plugin_allowed", "predict_layers", "predictable",
    "release_rules", "state_bytes", "stock_vllm_crashes_on", "upstream_resolver_decision",
    "v41_bytes_per_token", "v41_caches", "v41_record",
]
