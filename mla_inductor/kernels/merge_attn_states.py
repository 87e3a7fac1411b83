"""``mla.merge_attn_states(_n)`` on CUDA: one Triton program per block of (row, head) pairs.

A memory-bound kernel: it reads every part's output once and writes the merged output once, so its
speed is measured against a device copy's bandwidth (benchmarks/bench_distributed.py). Each program
takes ``BLOCK_R`` (row, head) pairs and the whole value width in ``BLOCK_L`` chunks: it first reads the
parts' LSEs (a few bytes) to get each part's weight, then reads only the parts with a non-zero weight,
so an empty part costs no output bytes and its (possibly garbage) output is never read. No host sync:
CUDA-graph capturable. CPU tensors run through Triton's interpreter (tests only).

Semantics are ``mla_inductor.merge.merge_reference``'s: -inf (or NaN) LSE = an empty part, +inf = a part
whose sum overflowed (it outweighs every finite part; +inf parts weigh the same), a row whose parts are all
empty gets out 0 and lse -inf, math in fp32.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

# 4096 elements per part per program: 8 KiB of bf16 loads in flight per part at L = 512.
_TILE_ELEMENTS = 4096
_MAX_BLOCK_L = 1024


@triton.jit
def _clean_lse(x):
    return tl.where(x != x, float("-inf"), x)


@triton.jit
def _shift(top):
    # A finite top shifts the exponents; an infinite one does not (see _weight).
    return tl.where((top == float("inf")) | (top == float("-inf")), 0.0, top)


@triton.jit
def _weight(lse, top, shift):
    # Under a +inf top the +inf parts count 1 each and the finite ones 0; all empty (top -inf): every part 0.
    return tl.where(top == float("inf"), tl.where(lse == float("inf"), 1.0, 0.0), tl.exp(lse - shift))


@triton.jit
def _store_lse(LSE_OUT, rows, row_ok, top, total):
    tl.store(LSE_OUT + rows, tl.log(total) + top, mask=row_ok)


@triton.jit
def _merge_two_kernel(
    OUT, LSE_OUT, OUT_A, LSE_A, OUT_B, LSE_B,
    ROWS, H, L,
    a_st, a_sh, b_st, b_sh, la_st, la_sh, lb_st, lb_sh,
    BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < ROWS
    t, h = rows // H, rows % H
    lse_a = _clean_lse(tl.load(LSE_A + t * la_st + h * la_sh, mask=row_ok, other=float("-inf")))
    lse_b = _clean_lse(tl.load(LSE_B + t * lb_st + h * lb_sh, mask=row_ok, other=float("-inf")))
    top = tl.maximum(lse_a, lse_b)
    shift = _shift(top)
    w_a, w_b = _weight(lse_a, top, shift), _weight(lse_b, top, shift)
    total = w_a + w_b
    _store_lse(LSE_OUT, rows, row_ok, top, total)
    inv = 1.0 / tl.where(total == 0.0, 1.0, total)
    w_a, w_b = w_a * inv, w_b * inv
    base_a, base_b = t * a_st + h * a_sh, t * b_st + h * b_sh
    for l0 in range(0, L, BLOCK_L):
        cols = l0 + tl.arange(0, BLOCK_L)
        ok = row_ok[:, None] & (cols[None, :] < L)
        part_a = tl.load(OUT_A + base_a[:, None] + cols[None, :], mask=ok & (w_a > 0)[:, None], other=0.0)
        part_b = tl.load(OUT_B + base_b[:, None] + cols[None, :], mask=ok & (w_b > 0)[:, None], other=0.0)
        merged = part_a.to(tl.float32) * w_a[:, None] + part_b.to(tl.float32) * w_b[:, None]
        tl.store(OUT + rows[:, None] * L + cols[None, :], merged.to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _merge_stacked_kernel(
    OUT, LSE_OUT, OUTS, LSES,
    ROWS, H, L, N,
    s_n, s_t, s_h, ls_n, ls_t, ls_h,
    BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < ROWS
    t, h = rows // H, rows % H
    lse_at = t * ls_t + h * ls_h
    top = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for n in range(N):
        top = tl.maximum(top, _clean_lse(tl.load(LSES + n * ls_n + lse_at, mask=row_ok, other=float("-inf"))))
    shift = _shift(top)
    total = tl.zeros([BLOCK_R], tl.float32)
    for n in range(N):
        total += _weight(_clean_lse(tl.load(LSES + n * ls_n + lse_at, mask=row_ok, other=float("-inf"))), top, shift)
    _store_lse(LSE_OUT, rows, row_ok, top, total)
    inv = 1.0 / tl.where(total == 0.0, 1.0, total)
    base = t * s_t + h * s_h
    for l0 in range(0, L, BLOCK_L):
        cols = l0 + tl.arange(0, BLOCK_L)
        ok = row_ok[:, None] & (cols[None, :] < L)
        acc = tl.zeros([BLOCK_R, BLOCK_L], tl.float32)
        for n in range(N):
            lse = _clean_lse(tl.load(LSES + n * ls_n + lse_at, mask=row_ok, other=float("-inf")))
            w = _weight(lse, top, shift) * inv
            part = tl.load(OUTS + n * s_n + base[:, None] + cols[None, :], mask=ok & (w > 0)[:, None], other=0.0)
            acc += part.to(tl.float32) * w[:, None]
        tl.store(OUT + rows[:, None] * L + cols[None, :], acc.to(OUT.dtype.element_ty), mask=ok)


def _blocks(L: int) -> tuple[int, int]:
    block_l = min(triton.next_power_of_2(L), _MAX_BLOCK_L)
    return max(1, _TILE_ELEMENTS // block_l), block_l


def _unit_last_dim(t: torch.Tensor) -> torch.Tensor:
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _outputs(like: torch.Tensor, T: int, H: int, L: int, out, lse):
    out = torch.empty((T, H, L), dtype=like.dtype, device=like.device) if out is None else out
    lse = torch.empty((T, H), dtype=torch.float32, device=like.device) if lse is None else lse
    return out, lse


def triton_merge_two(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
                     out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None):
    """out_a/out_b [T, H, L] (any strides), lse_a/lse_b [T, H] fp32 -> (out [T, H, L] contiguous in out_a's
    dtype, lse [T, H] fp32 contiguous), written into ``out``/``lse`` when given (contiguous, same shapes).
    Arguments are assumed checked (``merge.check_merge_args``)."""
    T, H, L = out_a.shape
    out, lse = _outputs(out_a, T, H, L, out, lse)
    rows = T * H
    if rows == 0:
        return out, lse
    out_a, out_b = _unit_last_dim(out_a), _unit_last_dim(out_b)
    block_r, block_l = _blocks(L)
    _merge_two_kernel[(triton.cdiv(rows, block_r),)](
        out, lse, out_a, lse_a, out_b, lse_b, rows, H, L,
        out_a.stride(0), out_a.stride(1), out_b.stride(0), out_b.stride(1),
        lse_a.stride(0), lse_a.stride(1), lse_b.stride(0), lse_b.stride(1),
        BLOCK_R=block_r, BLOCK_L=block_l,
    )
    return out, lse


def triton_merge_stacked(outs: torch.Tensor, lses: torch.Tensor, out: Optional[torch.Tensor] = None,
                         lse: Optional[torch.Tensor] = None):
    """outs [N, T, H, L] (any strides), lses [N, T, H] fp32 -> (out [T, H, L] contiguous in outs' dtype, lse
    [T, H] fp32 contiguous), written into ``out``/``lse`` when given. Arguments are assumed checked
    (``merge.check_merge_n_args``)."""
    N, T, H, L = outs.shape
    out, lse = _outputs(outs, T, H, L, out, lse)
    rows = T * H
    if rows == 0:
        return out, lse
    outs = _unit_last_dim(outs)
    block_r, block_l = _blocks(L)
    _merge_stacked_kernel[(triton.cdiv(rows, block_r),)](
        out, lse, outs, lses, rows, H, L, N, *outs.stride()[:3], *lses.stride(),
        BLOCK_R=block_r, BLOCK_L=block_l,
    )
    return out, lse
