"""Zero the rows of a decode result that see no key, touching only those rows.

Kernels that take a length per row cannot run a length-0 row, so the backends run it as length 1 and
overwrite the result afterwards: ``out`` 0 and ``lse`` -inf (the contract). A ``masked_fill`` does that
by reading and writing all of ``out`` (8 MiB at B=64, H=128: ~6 us on an H100, per layer); this kernel
has one program per row that returns at once unless the row is empty. No host sync, CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _zero_empty_rows_kernel(OUT, LSE, COUNTS, ROW_NUMEL, H, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if tl.load(COUNTS + row) == 0:
        for start in range(0, ROW_NUMEL, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            tl.store(OUT + row * ROW_NUMEL + offs, tl.zeros([BLOCK], dtype=OUT.dtype.element_ty),
                     mask=offs < ROW_NUMEL)
        h = tl.arange(0, BLOCK_H)
        tl.store(LSE + row * H + h, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=h < H)


def zero_empty_rows(out: torch.Tensor, lse: torch.Tensor, counts: torch.Tensor) -> None:
    """In place: rows ``t`` with ``counts[t] == 0`` get ``out[t] = 0`` and ``lse[t] = -inf``.

    out [T, H, L] and lse [T, H] fp32 contiguous (as ``contract.empty_decode_outputs`` makes them),
    counts int [T], all on one device."""
    T, H, L = out.shape
    if T == 0:
        return
    _zero_empty_rows_kernel[(T,)](out, lse, counts, H * L, H, BLOCK=BLOCK, BLOCK_H=triton.next_power_of_2(H))
