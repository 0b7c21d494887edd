"""Pure rules: what DeepSeek-V4's KV cache looks like on a node, decided without vLLM.

No vLLM import, no Ray import, no I/O: the replica, the planner, the controller, the
doctor and the tests all decide here, before any GPU is touched. Everything mirrors
vLLM's own behaviour, cited per function, so a preflight answer matches what the engine
will do. One module per question:

- ``layouts``    which layout a node's attention writes (platform, capability, backend);
- ``dtypes``     ``kv_cache_dtype`` resolution on a layout, as the fixed upstream decides;
- ``versions``   release numbers, and which releases assert on ``auto``;
- ``byte_model`` bytes per state, page padding, bytes per context token;
- ``prediction`` the per-layer KV specs a model config gives;
- ``family``     V4 vs V4.1: records per GPU, V4.1's resolver, caches from the topology;
- ``plugin_env`` whether ``VLLM_PLUGINS`` lets vLLM load our plugin (not a KV rule).

This face hands every public name on (``from dsv4_patch import rules``; ``rules.X``);
the modules import one another directly, never this face, and nothing outside
the standard library.
"""

from dsv4_patch.rules.byte_model import (
    FP8_DS_MLA_ALIGNMENT,
    FP8_DS_MLA_SCALE_BYTES,
    FP8_DS_MLA_TOKEN_DATA_BYTES,
    HEAD_DIM,
    INDEX_HEAD_DIM,
    INDEXER_SCALE_BYTES,
    NOPE_DIM,
    PLAIN_ROW_ALIGNMENT,
    ROPE_DIM,
    UE8M0_GROUP,
    ModelShape,
    PageBreakdown,
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
    engine_resolver_result,
    packed_refusal,
    resolve_kv_cache_dtype,
    stock_vllm_crashes_on,
    upstream_resolver_decision,
)
from dsv4_patch.rules.family import (
    DSPARK_V41_ARCHITECTURE,
    FIRST_V41_VLLM,
    FP8_DS_MLA,
    NVFP4_DS_MLA,
    PACKED_DTYPES,
    V4_ARCHITECTURES,
    V41_ARCHITECTURES,
    Family,
    KVRecord,
    V41Attention,
    V41Cache,
    V41Topology,
    default_block_size,
    family_of,
    is_mxfp8_node,
    resolve_v41_kv_cache_dtype,
    text_config,
    v41_attention,
    v41_bytes_per_token,
    v41_caches,
    v41_record,
    v41_refusal,
)
from dsv4_patch.rules.layouts import (
    AUTO_VALUES,
    CUDA_SELECTORS,
    DEFAULT_VLLM,
    FLASHINFER_DSV4,
    FLASHMLA_BACKENDS,
    FLASHMLA_DSV4,
    FP8_ALIASES,
    NON_DSV4_FLASHINFER,
    PLATFORMS,
    CudaSelector,
    KVCacheDtypeError,
    Layout,
    LayoutDecision,
    LayoutError,
    Storage,
    cuda_selector,
    detect_layout,
)
from dsv4_patch.rules.plugin_env import (
    PLUGIN_NAME,
    plugin_allowed,
)
from dsv4_patch.rules.prediction import (
    DSV4_ARCHITECTURES,
    DSV4_BLOCK_SIZE,
    FIRST_DSV4_VLLM,
    INDEXER,
    MAIN,
    PredictedLayer,
    predict_layers,
    predictable,
)
from dsv4_patch.rules.versions import (
    ASSERTING_RESOLVER,
    parse_version,
)

__all__ = [
    "ASSERTING_RESOLVER",
    "AUTO_VALUES",
    "CUDA_SELECTORS",
    "DEFAULT_VLLM",
    "DSPARK_V41_ARCHITECTURE",
    "DSV4_ARCHITECTURES",
    "DSV4_BLOCK_SIZE",
    "FIRST_DSV4_VLLM",
    "FIRST_V41_VLLM",
    "FLASHINFER_DSV4",
    "FLASHMLA_BACKENDS",
    "FLASHMLA_DSV4",
    "FP8_ALIASES",
    "FP8_DS_MLA",
    "FP8_DS_MLA_ALIGNMENT",
    "FP8_DS_MLA_SCALE_BYTES",
    "FP8_DS_MLA_TOKEN_DATA_BYTES",
    "HEAD_DIM",
    "INDEXER",
    "INDEXER_SCALE_BYTES",
    "INDEX_HEAD_DIM",
    "MAIN",
    "NON_DSV4_FLASHINFER",
    "NOPE_DIM",
    "NVFP4_DS_MLA",
    "PACKED_DTYPES",
    "PLAIN_ROW_ALIGNMENT",
    "PLATFORMS",
    "PLUGIN_NAME",
    "PROBE_DTYPES",
    "ROPE_DIM",
    "UE8M0_GROUP",
    "V4_ARCHITECTURES",
    "V41_ARCHITECTURES",
    "CudaSelector",
    "Family",
    "KVCacheDtypeError",
    "KVRecord",
    "Layout",
    "LayoutDecision",
    "LayoutError",
    "ModelShape",
    "PageBreakdown",
    "PredictedLayer",
    "Resolution",
    "Storage",
    "UpstreamDecision",
    "V41Attention",
    "V41Cache",
    "V41Topology",
    "cuda_selector",
    "default_block_size",
    "detect_layout",
    "engine_resolver_result",
    "family_of",
    "is_mxfp8_node",
    "kv_bytes_per_token",
    "packed_refusal",
    "padded_page_bytes",
    "page_alignment",
    "page_breakdown",
    "parse_version",
    "plugin_allowed",
    "predict_layers",
    "predictable",
    "resolve_kv_cache_dtype",
    "resolve_v41_kv_cache_dtype",
    "state_bytes",
    "stock_vllm_crashes_on",
    "text_config",
    "upstream_resolver_decision",
    "v41_attention",
    "v41_bytes_per_token",
    "v41_caches",
    "v41_record",
    "v41_refusal",
]
