"""The reference: the contract's meaning in plain PyTorch (float32 math).

It is the CPU kernel, the definition every GPU kernel is tested against, and, traced to aten ops by the
Inductor pass, the source of the compiled CPU path. It is written without data-dependent shapes (the
key dimension is the block table's whole capacity, masked) so that it traces with dynamic shapes, and
it clamps every index it gathers with, so garbage in unused block-table entries is never dereferenced.
"""

from __future__ import annotations

from typing import Optional

import torch

from mla_inductor.cache import cache_format, decode_tokens, encode_tokens

Tensor = torch.Tensor


def gather_slots(
    block_table: Tensor, seq_lens: Tensor, page_size: int, num_pages: int, num_queries: int
) -> tuple[Tensor, Tensor]:
    """Dense case: the flat cache slot of every (query row, key position) and whether it is attended.

    Returns ``slots`` int64 [T, S] and ``visible`` bool [T, S] with S = max_pages * page_size and
    T = B * num_queries; row ``b*Q + j`` sees positions ``t <= seq_lens[b] - Q + j``.
    """
    B, max_pages = block_table.shape
    positions = torch.arange(max_pages * page_size, device=block_table.device)
    pages = block_table.long()[:, positions // page_size].clamp(0, num_pages - 1)  # [B, S]
    slots = pages * page_size + positions % page_size
    last = seq_lens.long()[:, None] - num_queries + torch.arange(num_queries, device=seq_lens.device)  # [B, Q]
    visible = positions[None, None, :] <= last[:, :, None]  # [B, Q, S]
    # Explicit sizes, no -1: with unbacked batch sizes (mark_unbacked) inferring -1 would need a guard.
    T, S = B * num_queries, max_pages * page_size
    return slots[:, None, :].expand(B, num_queries, S).reshape(T, S), visible.reshape(T, S)


def sparse_slots(sparse_indices: Tensor, capacity: int) -> tuple[Tensor, Tensor]:
    """Sparse case: listed slots (clamped into the cache) and which of them are real (not -1)."""
    idx = sparse_indices.long()
    visible = (idx >= 0) & (idx < capacity)
    return idx.clamp(0, capacity - 1), visible


def attend(q_nope: Tensor, q_pe: Tensor, keys: Tensor, visible: Tensor, softmax_scale: float) -> tuple[Tensor, Tensor]:
    """Masked softmax attention of [T, H, L|R] queries over float32 keys [T, S, L+R]; values = latent part.

    Returns out [T, H, L] float32 and lse [T, H] float32 (-inf and out 0 where nothing is visible).
    """
    L = q_nope.shape[-1]
    latent, rope = keys[..., :L], keys[..., L:]
    logits = torch.einsum("thl,tsl->ths", q_nope.float(), latent) + torch.einsum("thr,tsr->ths", q_pe.float(), rope)
    # The row max is taken before scaling and the scale applied to the (non-positive) differences, so a
    # huge scale (1e38) gives the limit, a one-hot softmax, where scaling first overflows to inf - inf.
    sign, scale = (1.0, softmax_scale) if softmax_scale >= 0 else (-1.0, -softmax_scale)
    hidden = ~visible[:, None, :]
    logits = (logits * sign).masked_fill(hidden, float("-inf"))
    # Written out rather than torch.logsumexp, whose decomposition guards on numel (fails for unbacked
    # batch sizes). exp(-inf - -inf) is NaN, so fully masked rows shift by 0: weights 0, sum 0, lse -inf.
    row_max = logits.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    weights = torch.exp(((logits - row_max) * scale).masked_fill(hidden, float("-inf")))
    total = weights.sum(dim=-1)
    lse = torch.log(total) + row_max.squeeze(-1) * scale
    probs = weights / torch.where(total == 0, torch.ones_like(total), total)[..., None]
    return torch.einsum("ths,tsl->thl", probs, latent), lse


def paged_decode_reference(
    q_nope: Tensor,
    q_pe: Tensor,
    kv_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    softmax_scale: float,
    kv_scale: Tensor,
    sparse_indices: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """The contract of ``mla.paged_decode_with_lse``: returns (out [T, H, L] in q's dtype, lse [T, H] fp32)."""
    P, page_size = kv_cache.shape[0], kv_cache.shape[1]
    if sparse_indices is None:
        slots, visible = gather_slots(block_table, seq_lens, page_size, P, q_nope.shape[0] // block_table.shape[0])
    else:
        slots, visible = sparse_slots(sparse_indices, P * page_size)
    rows = kv_cache.reshape(P * page_size, kv_cache.shape[-1])[slots]  # [T, S, width]
    out, lse = attend(q_nope, q_pe, decode_tokens(rows, kv_scale), visible, softmax_scale)
    return out.to(q_nope.dtype), lse


def cache_append_reference(kv_cache: Tensor, kv_c: Tensor, k_pe: Tensor, slot_mapping: Tensor, kv_scale: Tensor) -> None:
    """The contract of ``mla.cache_append``: writes encoded rows into their slots in place (-1 skipped)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    rows = torch.cat([kv_c[keep].float(), k_pe[keep].float()], dim=-1)
    flat = kv_cache.view(kv_cache.shape[0] * kv_cache.shape[1], kv_cache.shape[-1])
    flat[slots] = encode_tokens(rows, cache_format(kv_cache), kv_scale)
