"""FlashInfer's Blackwell MLA decode: ``flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla`` with
``backend="trtllm-gen"`` on SM100/SM103 (B200/GB200/B300), dense and top-k sparse, bf16 or fp8_e4m3.

Marshalling (T = B * Q rows, H heads, D = L + R):

    query        [B, Q, H, D] = cat(q_nope, q_pe) (dense) or [T, 1, H, D] (sparse: one request per row);
                 float8_e4m3fn with a per-tensor scale computed on the device when the cache is fp8
                 (the kernel wants q and cache in one dtype)
    kv_cache     [P, page_size, D] as given (FlashInfer views it as [P, 1, page_size, D])
    block_tables [B, max_pages] clamped into [0, P) (dense) or [T, 1, K] compacted slots (sparse)
    seq_lens     [B] = max(seq_lens, 1) (dense) or [T] = max(valid slots, 1) (sparse)
    max_seq_len  max_pages * page_size (dense) or K (sparse): static bounds, so no host sync
    bmm1_scale   softmax_scale (float) or, for fp8, the fp32 tensor softmax_scale * q_scale * kv_scale
    bmm2_scale   1.0 or, for fp8, the tensor kv_scale (tensors keep the scale on the device)
    out          bf16 [B, Q, H, L] (the kernel writes bf16 only, hence bf16 q), lse fp32 [T, H]

Rows that see nothing are masked afterwards (out 0, lse -inf). ``supports()`` encodes FlashInfer's own
checks (SM10x, L/R 512/64 or 256/64 — 512/64 only when sparse — page 32/64, H <= 64 or H = 128,
bf16 q, bf16/fp8_e4m3 cache), so a call FlashInfer would refuse is refused at selection time with the
reason, and ``select_backend`` moves on to the next backend of the table instead of failing at run time.

Untested on SM100: the marshalling is unit-tested against a recorder. Assumptions to check on a
B200: the lse is natural-log (``LSE_IS_LOG2`` converts if not), and Q > 1
uses the causal mask among the new tokens (speculative decode).
"""

from __future__ import annotations

import math

import torch

from mla_inductor.backends._common import (
    DEEPSEEK_DIMS,
    dims_reason,
    finish_empty_rows,
    quantize_query_fp8,
    sm,
    static_shape_reason,
)
from mla_inductor.backends._flashinfer_common import FlashInferTableBackend, flashinfer_module, workspace

SMALL_DIMS = (256, 64)
QK_NOPE_HEAD_DIM = {DEEPSEEK_DIMS: 128, SMALL_DIMS: 64}  # FlashInfer's table; it only keys its caches
PAGE_SIZES = (32, 64)
LSE_IS_LOG2 = False


def trtllm_supports(problem, capability):
    if capability[0] != 10 or capability[1] not in (0, 3):
        return f"needs SM100/SM103 (trtllm-gen cubins), got {sm(capability)}"
    why = static_shape_reason(problem) or dims_reason(problem, (DEEPSEEK_DIMS,) if problem.sparse
                                                      else (DEEPSEEK_DIMS, SMALL_DIMS))
    if why:
        return why
    if problem.page_size not in PAGE_SIZES:
        return f"page_size must be 32 or 64, got {problem.page_size}"
    H = problem.num_heads
    if not (1 <= H <= 64 or H == 128):
        return f"num_heads must be <= 64 or 128 (trtllm-gen has no 64 < H < 128 kernels), got {H}"
    return None


def trtllm_run(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices, plan):
    """mla.paged_decode_with_lse on trtllm-gen: (out [T, H, L] bf16, lse [T, H] fp32, natural log)."""
    table, kernel_lens, row_counts = plan
    T, H, L = q_nope.shape
    R = q_pe.shape[-1]
    B = block_table.shape[0]
    if kv_cache.dtype == torch.float8_e4m3fn:
        query, q_scale = quantize_query_fp8(torch.cat([q_nope, q_pe], dim=-1))
        bmm1_scale = q_scale * kv_scale * softmax_scale  # fp32 [1], stays on the device
        bmm2_scale = kv_scale.float()
    else:
        query = torch.cat([q_nope, q_pe], dim=-1)
        bmm1_scale, bmm2_scale = float(softmax_scale), 1.0
    if sparse_indices is None:
        query = query.view(B, T // B, H, L + R)
        block_tables, max_seq_len, top_k = table, block_table.shape[1] * kv_cache.shape[1], 0
    else:
        top_k = sparse_indices.shape[1]
        query = query.view(T, 1, H, L + R)
        block_tables, max_seq_len = table.view(T, 1, top_k), top_k
    out = q_nope.new_empty(query.shape[:-1] + (L,), dtype=torch.bfloat16)
    lse = q_nope.new_empty((T, H), dtype=torch.float32)
    flashinfer_module().mla.trtllm_batch_decode_with_kv_cache_mla(
        query=query,
        kv_cache=kv_cache,
        workspace_buffer=workspace(q_nope.device, zeroed=True),
        qk_nope_head_dim=QK_NOPE_HEAD_DIM[(L, R)],
        kv_lora_rank=L,
        qk_rope_head_dim=R,
        block_tables=block_tables,
        seq_lens=kernel_lens,
        max_seq_len=max_seq_len,
        sparse_mla_top_k=top_k,
        out=out,
        bmm1_scale=bmm1_scale,
        bmm2_scale=bmm2_scale,
        backend="trtllm-gen",
        lse=lse,
        return_lse=True,
    )
    out = out.view(T, H, L)
    if LSE_IS_LOG2:
        lse.mul_(math.log(2.0))
    finish_empty_rows(out, lse, row_counts)
    return out, lse


BACKEND = FlashInferTableBackend("flashinfer_trtllm", trtllm_run, trtllm_supports,
                                 "trtllm_batch_decode_with_kv_cache_mla")
