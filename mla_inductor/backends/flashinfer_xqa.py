"""FlashInfer's SM120 MLA decode: ``flashinfer.mla.xqa_batch_decode_with_kv_cache_mla`` on SM120/SM121
(RTX PRO 6000 / DGX Spark class GPUs): 128 heads, one new token per sequence, bf16 or fp8_e4m3.

Marshalling (B sequences, Q = 1, H = 128, D = L + R = 576):

    query        [B, 1, 128, 576] = cat(q_nope, q_pe) in bf16, or float8_e4m3fn (per-tensor scale computed
                 on the device) when the cache is fp8: XQA takes (bf16, bf16) or (fp8, fp8) only
    kv_cache     [P, page_size, 576] as given; page_size 16/32/64/128
    block_tables [B, max_pages] clamped into [0, P); seq_lens [B] = max(seq_lens, 1)
    max_seq_len  max_pages * page_size (what XQA derives from the table anyway)
    bmm1_scale   softmax_scale, or for fp8 the tensor softmax_scale * q_scale. Not times kv_scale: the
                 kernel computes its QK scale as q_scale * kv_scale itself (mla_sm120.cu, qkScaleLog2e)
    bmm2_scale   1.0, or for fp8 the tensor kv_scale
    out          bf16 [B, 128, 512]

XQA writes no lse, so a second pass computes it (``lse_pass``: logits over the visible keys in chunks of
pages, fp32 log-sum-exp): that costs about as much memory traffic again as the attention, which is why
the selection should put this backend after one that returns lse natively until the contract says
which calls need lse. Rows that see nothing are masked (out 0, lse -inf).

Untested on SM120: marshalling and lse are unit-tested on CPU.
"""

from __future__ import annotations

import torch

from mla_inductor._compat import version_tuple
from mla_inductor.backends._common import (
    dims_reason,
    finish_empty_rows,
    quantize_query_fp8,
    sm,
    static_shape_reason,
)
from mla_inductor.backends._flashinfer_common import FlashInferTableBackend, flashinfer_module, workspace
from mla_inductor.cache import decode_tokens

PAGE_SIZES = (16, 32, 64, 128)
NUM_HEADS = 128
QK_NOPE_HEAD_DIM = 128  # FlashInfer's DeepSeek table; XQA ignores it
LSE_CHUNK_BYTES = 256 << 20  # fp32 keys gathered per step of lse_pass
_MIN_CUDA = {(12, 0): (12, 8), (12, 1): (12, 9)}  # sm_120a needs CUDA 12.8, sm_121a 12.9


def _cuda_version() -> tuple[int, int]:
    return version_tuple(torch.version.cuda or "0.0", 2)


def xqa_supports(problem, capability):
    if capability not in _MIN_CUDA:
        return f"needs SM120/SM121, got {sm(capability)}"
    if _cuda_version() < _MIN_CUDA[capability]:
        need = ".".join(map(str, _MIN_CUDA[capability]))
        return f"needs a CUDA {need}+ build of torch for {sm(capability)}a, got {torch.version.cuda}"
    why = static_shape_reason(problem) or dims_reason(problem)
    if why:
        return why
    if problem.sparse:
        return "XQA has no sparse (top-k) MLA"
    if problem.q_per_seq != 1:
        return f"needs one query token per sequence (Q=1), got Q={problem.q_per_seq}"
    if problem.num_heads != NUM_HEADS:
        return f"needs num_heads={NUM_HEADS}, got {problem.num_heads}"
    if problem.page_size not in PAGE_SIZES:
        return f"page_size must be one of {PAGE_SIZES}, got {problem.page_size}"
    return None


def lse_pass(q_nope, q_pe, kv_cache, table, seq_lens, softmax_scale, kv_scale):
    """lse [B, H] fp32 (natural log) of Q=1 rows over their first ``seq_lens[b]`` positions.

    q [B, H, L] / [B, H, R], kv_cache [P, page_size, L+R], table int32 [B, max_pages] already clamped.
    """
    B, H, _ = q_nope.shape
    max_pages, page_size = table.shape[1], kv_cache.shape[1]
    q = torch.cat([q_nope, q_pe], dim=-1).float()
    lse = q.new_full((B, H), float("-inf"))
    row_bytes = B * page_size * kv_cache.shape[-1] * 4
    step = max(1, LSE_CHUNK_BYTES // max(row_bytes, 1))
    for first in range(0, max_pages, step):
        pages = table[:, first:first + step].long()  # [B, c]
        keys = decode_tokens(kv_cache[pages], kv_scale).flatten(1, 2)  # [B, c * page_size, L+R] fp32
        positions = first * page_size + torch.arange(keys.shape[1], device=keys.device)
        logits = torch.einsum("bhd,bsd->bhs", q, keys) * softmax_scale
        logits.masked_fill_((positions[None, :] >= seq_lens[:, None].long())[:, None, :], float("-inf"))
        lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=-1))
    return lse


def xqa_run(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices, plan):
    """mla.paged_decode_with_lse on XQA (+ lse_pass): (out [B, 128, 512] bf16, lse [B, 128] fp32)."""
    table, kernel_lens, row_counts = plan
    B, H, L = q_nope.shape
    R = q_pe.shape[-1]
    if kv_cache.dtype == torch.float8_e4m3fn:
        query, q_scale = quantize_query_fp8(torch.cat([q_nope, q_pe], dim=-1))
        bmm1_scale, bmm2_scale = q_scale * softmax_scale, kv_scale.float()
    else:
        query = torch.cat([q_nope, q_pe], dim=-1)
        bmm1_scale, bmm2_scale = float(softmax_scale), 1.0
    out = q_nope.new_empty((B, H, L), dtype=torch.bfloat16)
    flashinfer_module().mla.xqa_batch_decode_with_kv_cache_mla(
        query.view(B, 1, H, L + R),
        kv_cache,
        workspace(q_nope.device, zeroed=True),
        QK_NOPE_HEAD_DIM,
        L,
        R,
        table,
        kernel_lens,
        table.shape[1] * kv_cache.shape[1],
        out=out,
        bmm1_scale=bmm1_scale,
        bmm2_scale=bmm2_scale,
    )
    lse = lse_pass(q_nope, q_pe, kv_cache, table, seq_lens, softmax_scale, kv_scale)
    finish_empty_rows(out, lse, row_counts)
    return out, lse


BACKEND = FlashInferTableBackend("flashinfer_xqa", xqa_run, xqa_supports, "xqa_batch_decode_with_kv_cache_mla")

