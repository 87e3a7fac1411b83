"""A dense decode call's cache slots as a list of indices, in one small kernel.

FlashMLA runs dense calls on fp8_ds_mla caches with its sparse kernel, which reads a list of cache slots per
query row. Written as torch ops (``backends/flashmla.dense_slot_indices``, the CPU path and the reference),
the list takes about a dozen kernel launches (arange, the page lookup, the slot arithmetic, the visibility
mask, the casts); a plan made once per layer (each decoder layer compiled on its own) pays them in every
layer. Here one program per (query row, block of positions) does it: no host sync, CUDA-graph safe.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from mla_inductor.kernels.launch import launch

BLOCK = 1024


@triton.jit
def _dense_slot_indices_kernel(OUT, TABLE, LENS, K, Q, max_pages, s_table_b, s_table_p,
                               PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # b * Q + j
    pos = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    b = row // Q
    last = tl.load(LENS + b).to(tl.int64) - Q + row % Q  # the last position row (b, j) sees
    inside = pos < K
    visible = inside & (pos <= last)
    page_col = tl.minimum(pos // PAGE_SIZE, max_pages - 1)
    # Only visible positions look their page up: entries past a sequence's length may hold anything.
    page = tl.load(TABLE + b.to(tl.int64) * s_table_b + page_col * s_table_p, mask=visible, other=0)
    slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
    tl.store(OUT + row.to(tl.int64) * K + pos, tl.where(visible, slot, -1).to(tl.int32), mask=inside)


def dense_slot_indices_kernel(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, num_rows: int,
                              width: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int32 [num_rows, width]: row ``b*Q + j`` lists the slots (``page * page_size + offset``) of positions
    ``0 .. seq_lens[b] - Q + j`` in order, then -1 (Q = num_rows / B). block_table int32 [B, max_pages] (any
    strides), seq_lens int32/int64 [B]; same device. The same list as ``backends.flashmla.dense_slot_indices``.
    ``out``: a contiguous int32 [num_rows, width] to write into (else allocated)."""
    B, max_pages = block_table.shape
    if out is None:
        out = torch.empty((num_rows, width), dtype=torch.int32, device=block_table.device)
    if num_rows == 0 or width == 0:
        return out
    launch(_dense_slot_indices_kernel, (num_rows, triton.cdiv(width, BLOCK)), (out, block_table, seq_lens),
           (width, num_rows // B, max_pages, block_table.stride(0), block_table.stride(1), page_size, BLOCK))
    return out
