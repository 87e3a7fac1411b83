"""``mla.cache_append`` on CUDA: one Triton program per new token, no host sync, CUDA-graph capturable.

The reference writer (``reference.cache_append_reference``) selects the valid slots with a boolean
mask, which has a data-dependent size: a device->host sync that breaks CUDA-graph capture of a decode
step. This kernel skips ``slot < 0`` inside the program instead, and quantizes like the reference:
``clamp(x / kv_scale, ±448)`` to e4m3 for fp8 caches; per-128-value tile scales ``amax / 448`` of the
tile's finite values (floored at the smallest normal float) and bf16 rope for the 656-byte fp8_ds_mla rows.
In both fp8 formats ±inf saturates at ±448 and NaN stays NaN, touching no other value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_inductor.cache import FP8_DS_MLA_TILE, FP8_E4M3_MAX, cache_format

_PLAIN, _FP8, _DS = 0, 1, 2
_MODES = {"fp32": _PLAIN, "fp16": _PLAIN, "bf16": _PLAIN, "fp8_e4m3": _FP8, "fp8_ds_mla": _DS}


@triton.jit
def _cache_append_kernel(
    CACHE, KV_C, K_PE, SLOTS, KV_SCALE,
    stride_c, stride_p, row_stride,
    L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    MODE: tl.constexpr, TILE: tl.constexpr, FP8_MAX: tl.constexpr, TINY: tl.constexpr,
):
    i = tl.program_id(0)
    slot = tl.load(SLOTS + i).to(tl.int64)
    if slot >= 0:
        row = CACHE + slot * row_stride
        offs_r = tl.arange(0, BLOCK_R)
        rope = tl.load(K_PE + i * stride_p + offs_r, mask=offs_r < R, other=0.0).to(tl.float32)
        if MODE == 2:  # fp8_ds_mla: [512 e4m3 | 4 fp32 scales | 64 bf16 rope] bytes
            offs_t = tl.arange(0, TILE)
            for t in tl.static_range(L // TILE):
                x = tl.load(KV_C + i * stride_c + t * TILE + offs_t).to(tl.float32)
                ax = tl.abs(x)
                finite = tl.where((x == x) & (ax != float("inf")), ax, 0.0)  # ±inf and NaN set no scale
                scale = tl.maximum(tl.max(finite, axis=0) / FP8_MAX, TINY)
                q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL).to(tl.float8e4nv)
                tl.store(row + t * TILE + offs_t, q.to(tl.uint8, bitcast=True))
                tl.store((row + L + 4 * t).to(tl.pointer_type(tl.float32)), scale)
            rope_ptr = (row + L + 4 * (L // TILE)).to(tl.pointer_type(tl.bfloat16))
            tl.store(rope_ptr + offs_r, rope.to(tl.bfloat16), mask=offs_r < R)
        else:
            offs_l = tl.arange(0, BLOCK_L)
            x = tl.load(KV_C + i * stride_c + offs_l, mask=offs_l < L, other=0.0).to(tl.float32)
            if MODE == 1:
                inv = 1.0 / tl.load(KV_SCALE).to(tl.float32)
                x = tl.clamp(x * inv, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
                rope = tl.clamp(rope * inv, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
            tl.store(row + offs_l, x.to(CACHE.dtype.element_ty), mask=offs_l < L)
            tl.store(row + L + offs_r, rope.to(CACHE.dtype.element_ty), mask=offs_r < R)


def triton_cache_append(kv_cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                        slot_mapping: torch.Tensor, kv_scale: torch.Tensor) -> None:
    """Write token i's ``[kv_c[i] | k_pe[i]]`` into flat slot ``slot_mapping[i]`` (-1 skipped), in place.

    kv_cache [P, page_size, L+R] (or 656-byte fp8_ds_mla rows, contiguous), kv_c [N, L], k_pe [N, R] with
    contiguous last dims, slot_mapping [N] int32/int64, kv_scale [1] fp32 (read on the device).
    """
    N, L = kv_c.shape
    R = k_pe.shape[1]
    if N == 0:
        return
    kv_c = kv_c if kv_c.stride(-1) == 1 else kv_c.contiguous()
    k_pe = k_pe if k_pe.stride(-1) == 1 else k_pe.contiguous()
    fmt = cache_format(kv_cache)
    # The store pointer must have the cache's element type; fp8 stores through the e4m3 dtype itself.
    _cache_append_kernel[(N,)](
        kv_cache, kv_c, k_pe, slot_mapping, kv_scale,
        kv_c.stride(0), k_pe.stride(0), kv_cache.stride(1),
        L=L, R=R, BLOCK_L=triton.next_power_of_2(L), BLOCK_R=triton.next_power_of_2(R),
        MODE=_MODES[fmt], TILE=FP8_DS_MLA_TILE, FP8_MAX=FP8_E4M3_MAX, TINY=torch.finfo(torch.float32).tiny,
    )
