"""Per-tensor e4m3 quantization of a query on the GPU in two passes over it (one with a static scale), for
kernels that take q in fp8 with one descale (FlashMLA's dense FP8 decode). The definition, in torch, is
``backends._common.quantize_query_reference``.

``descale = max(amax(|q|) / 448, tiny)``, ``q8 = clamp(q / descale, ±448)`` in fp32 then e4m3. Eager
torch needs a reduction, several scalar kernels and three elementwise passes for the same; each layer
of a decode step pays it, so it is two Triton kernels here: each block of the first writes the max of
its values to its own slot (no atomics, so no buffer to zero first: one launch fewer in the graph),
and every block of the second reduces those partial maxima, then casts its values (block 0 also
writes the descale). With a static scale (the caller's calibrated ``q_scale``) the cast alone runs.
No host sync, CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_inductor.cache import FP8_E4M3_MAX
from mla_inductor.kernels.launch import launch

_FP32_TINY = torch.finfo(torch.float32).tiny

# Measured ad hoc on the H100 (CUDA-graph replays of the two kernels, not a repo benchmark): 2048-value blocks are best for small
# queries (B=1, H=128: 4.0 vs 5.1 us with 4096), 8192 with 8 warps for large ones (B=64: 8.5 vs 8.7 us).
SMALL = 1 << 20  # values


def _launch_config(n: int) -> tuple[int, int]:
    return (2048, 4) if n <= SMALL else (8192, 8)


PARTIALS_CHUNK = 1024  # partial maxima each block of the cast reads per step


@triton.jit
def _absmax_kernel(X, PARTIAL, N, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N, other=0.0).to(tl.float32)
    tl.store(PARTIAL + pid, tl.max(tl.abs(x), axis=0))


@triton.jit
def _scaled_cast_kernel(X, Y, PARTIAL, DESCALE, NUM_PARTIALS, N, FP8_MAX: tl.constexpr, TINY: tl.constexpr,
                        BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    pid = tl.program_id(0)
    amax = tl.zeros((CHUNK,), dtype=tl.float32)
    for start in range(0, NUM_PARTIALS, CHUNK):  # a few KB from L2, the same in every block
        idx = start + tl.arange(0, CHUNK)
        amax = tl.maximum(amax, tl.load(PARTIAL + idx, mask=idx < NUM_PARTIALS, other=0.0))
    descale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, TINY)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N, other=0.0).to(tl.float32)
    y = tl.minimum(tl.maximum(x / descale, -FP8_MAX), FP8_MAX)
    tl.store(Y + offs, y.to(tl.float8e4nv), mask=offs < N)
    if pid == 0:
        tl.store(DESCALE, descale)


def quantize_per_tensor_e4m3(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (any shape, bf16/fp16/fp32) -> (float8_e4m3fn contiguous, same shape; descale fp32 [1])."""
    q = q.contiguous()
    n = q.numel()
    block, warps = _launch_config(n)
    blocks = max(triton.cdiv(n, block), 1)
    partial = torch.empty(blocks, dtype=torch.float32, device=q.device)
    descale = torch.empty(1, dtype=torch.float32, device=q.device)
    q8 = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=q.device)
    launch(_absmax_kernel, (blocks,), (q, partial), (n, block), num_warps=warps)
    launch(_scaled_cast_kernel, (blocks,), (q, q8, partial, descale),
           (blocks, n, FP8_E4M3_MAX, _FP32_TINY, block, PARTIALS_CHUNK), num_warps=warps)
    return q8, descale


@triton.jit
def _cast_with_descale_kernel(X, Y, DESCALE, N, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    descale = tl.load(DESCALE)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N, other=0.0).to(tl.float32)
    y = tl.minimum(tl.maximum(x / descale, -FP8_MAX), FP8_MAX)
    tl.store(Y + offs, y.to(tl.float8e4nv), mask=offs < N)


def quantize_with_descale_e4m3(q: torch.Tensor, descale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (any shape, bf16/fp16/fp32) and a static descale (fp32, one element, on q's device) -> (float8_e4m3fn
    contiguous, same shape; the descale as [1]): one pass, no amax."""
    q = q.contiguous()
    n = q.numel()
    block, warps = _launch_config(n)
    descale = descale.reshape(1)
    q8 = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=q.device)
    launch(_cast_with_descale_kernel, (max(triton.cdiv(n, block), 1),), (q, q8, descale), (n, FP8_E4M3_MAX, block),
           num_warps=warps)
    return q8, descale
