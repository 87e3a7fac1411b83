"""Finishing a decode result on the GPU in one small kernel: rows that see no key get ``out`` 0 and
``lse`` -inf, touching only those rows.

Kernels that take a length per row cannot run a length-0 row, so the backends run it as length 1 and
overwrite the result afterwards (the contract). A ``masked_fill`` does that by reading and writing all of
``out`` (megabytes per layer at large batches); these kernels have one program per row that
leaves ``out`` alone unless the row is empty. ``finish_rows`` also copies a kernel's lse from its own
layout into the contract's, so the whole epilogue is one launch. No host sync, CUDA-graph safe.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from mla_inductor.kernels.launch import launch

BLOCK = 1024


@triton.jit
def _finish_rows_kernel(OUT, LSE, COUNTS, SRC, ROW_NUMEL, H, Q, s_b, s_q, s_h, HAS_LSE: tl.constexpr,
                        COPY_LSE: tl.constexpr, ZERO_OUT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    empty = tl.load(COUNTS + row) == 0
    h = tl.arange(0, BLOCK_H)
    if COPY_LSE:  # LSE[row, h] = SRC[b, j, h] (row = b * Q + j), -inf if the row is empty
        src = tl.load(SRC + (row // Q) * s_b + (row % Q) * s_q + h * s_h, mask=h < H, other=0.0)
        tl.store(LSE + row * H + h, tl.where(empty, float("-inf"), src), mask=h < H)
    if empty:
        if HAS_LSE and not COPY_LSE:
            tl.store(LSE + row * H + h, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=h < H)
        if ZERO_OUT:
            for start in range(0, ROW_NUMEL, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                tl.store(OUT + row * ROW_NUMEL + offs, tl.zeros([BLOCK], dtype=OUT.dtype.element_ty),
                         mask=offs < ROW_NUMEL)


def finish_rows(out: torch.Tensor, lse: Optional[torch.Tensor], counts: torch.Tensor,
                lse_src: Optional[torch.Tensor] = None, zero_out: bool = True) -> None:
    """In place, one launch. ``lse_src`` [B, Q, H] (any strides, fp32): copied into ``lse`` [T = B*Q, H]
    first. Rows ``t`` with ``counts[t] == 0`` (a bool "sees anything" mask works too) get ``lse[t] = -inf``
    and, with ``zero_out``, ``out[t] = 0``. out [T, H, L] and lse [T, H] fp32 contiguous, as
    ``contract.empty_decode_outputs`` makes them; all on one device. ``lse`` None: only ``out`` is touched."""
    T, H, L = out.shape
    if T == 0:
        return
    has_lse = lse is not None
    copy = has_lse and lse_src is not None
    src = lse_src if copy else out
    strides = lse_src.stride() if copy else (0, 0, 0)
    Q = lse_src.shape[1] if copy else 1
    launch(_finish_rows_kernel, (T,), (out, lse if has_lse else out, counts, src),
           (H * L, H, Q, *strides, has_lse, copy, zero_out, BLOCK, triton.next_power_of_2(H)))


def zero_empty_rows(out: torch.Tensor, lse: torch.Tensor, counts: torch.Tensor) -> None:
    """In place: rows ``t`` with ``counts[t] == 0`` get ``out[t] = 0`` and ``lse[t] = -inf``."""
    finish_rows(out, lse, counts)
