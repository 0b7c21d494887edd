"""Fake (meta) implementations of the DeepSeek-V4 CPU ops: output shapes, no math.

torch.compile traces vLLM's model with fake tensors; each op registered into ``_C``
(``ops``) brings one of these (``torch.library.register_fake``) so tracing knows what
it returns without running ``kernels``. Ops that only write into their arguments
return None.
"""

from __future__ import annotations

from typing import Any

import torch


def none(*args: Any) -> None:
    return None


def like_first(t: torch.Tensor, *args: Any) -> torch.Tensor:
    return torch.empty_like(t)


def qnorm(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor,
          slot_mapping: torch.Tensor, cos_sin: torch.Tensor, q_head_padded: int,
          eps: float, block_size: int) -> torch.Tensor:
    return q.new_empty((q.shape[0], q_head_padded, q.shape[2]))


def logits(q_fp8: torch.Tensor, kv: torch.Tensor, weight: torch.Tensor,
           seq_lens: torch.Tensor, page_table: torch.Tensor, block_size: int,
           max_seq_len: int) -> torch.Tensor:
    return q_fp8.new_empty((q_fp8.shape[0], max_seq_len), dtype=torch.float32)


def inv_rope(o: torch.Tensor, *args: Any) -> torch.Tensor:
    return o.new_empty(o.shape, dtype=torch.float32)


def hc_pre(x: torch.Tensor, hc_fn: torch.Tensor, hc_scale: torch.Tensor,
           hc_base: torch.Tensor, hc_mult: int, *args: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t, _, d = x.shape
    return (x.new_empty((t, d)), x.new_empty((t, hc_mult), dtype=torch.float32),
            x.new_empty((t, hc_mult, hc_mult), dtype=torch.float32))


def hc_post(x: torch.Tensor, residual: torch.Tensor, *args: Any) -> torch.Tensor:
    return x.new_empty(residual.shape)


def hc_head(x: torch.Tensor, *args: Any) -> torch.Tensor:
    return x.new_empty((x.shape[0], x.shape[2]))


def _routing(n_tokens: int, topk: int, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return (like.new_empty((n_tokens, topk), dtype=torch.float32),
            like.new_empty((n_tokens, topk), dtype=torch.int32))


def biased_topk(hidden_states: torch.Tensor, gating_output: torch.Tensor, bias: torch.Tensor,
           topk: int, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return _routing(hidden_states.shape[0], topk, hidden_states)


def hash_topk(gating_output: torch.Tensor, tid2eid: torch.Tensor, topk: int, *args: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    return _routing(gating_output.shape[0], topk, gating_output)
