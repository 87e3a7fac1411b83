"""Triton MLA paged-decode kernels (portable path and FP8-KV paths).

One query row attends to the single latent KV "head" of its sequence, so every head of that row reads
the same KV bytes. The kernel therefore packs a block of heads into the M dimension of ``tl.dot``
(``[BLOCK_H, L] x [L, BLOCK_N]`` for the logits, ``[BLOCK_H, BLOCK_N] x [BLOCK_N, L]`` for the output):
one KV tile load feeds all heads of the block, and the matrix units do the arithmetic (wgmma on SM90
when BLOCK_H is 64 and num_warps a multiple of 4, mma.sync for smaller head blocks).

The KV sequence of each row is cut into ``num_splits`` contiguous ranges handled by different
programs (split-KV / flash-decoding); each writes a normalised partial output and its log-sum-exp,
and a small merge kernel combines them. With one split the main kernel writes the final output
directly and no merge runs.

The latent dimension L is processed as four chunks of L/4 (four accumulators, four logits partial
products). That is what lets the fp8_ds_mla layout apply its four per-128-value scales *outside* the
matrix products (exact fp8->bf16 conversion, scale applied to the [BLOCK_H, BLOCK_N] logits and to P),
and it keeps each accumulator a separate register tile.

Entry points: :func:`triton_paged_decode` (checks and launches one call), :class:`DecodeLaunch` (a call
signature prepared once, then launched per call with little host work: what the backend uses).
Everything here imports on a CPU-only machine; CPU tensors run through Triton's interpreter (slow, for
tests only).
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch

from mla_inductor._compat import raw_stream_query, stream_capture_query
from mla_inductor.cache import FP8_DS_MLA_TOKEN_BYTES, cache_format

try:
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except Exception:  # pragma: no cover - triton is a hard dependency in practice
    triton = None
    tl = None
    _HAVE_TRITON = False

__all__ = ["triton_paged_decode", "DecodeConfig", "DecodeLaunch", "choose_config", "FP8_DS_MLA_ROW_BYTES"]

FP8_DS_MLA_ROW_BYTES = FP8_DS_MLA_TOKEN_BYTES  # 512 e4m3 latent + 4 fp32 scales + 64 bf16 rope
_SUPPORTED_L = (256, 512)
_SUPPORTED_R = (32, 64)

# KV cache encodings, passed to the kernel as a constexpr.
_KV_PLAIN = 0  # fp16 / bf16 / fp32 values
_KV_FP8 = 1  # float8_e4m3fn, one per-tensor scale (latent and rope)
_KV_DS = 2  # uint8 rows in the DeepSeek-V3.2 fp8_ds_mla layout

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


if _HAVE_TRITON:

    @triton.jit
    def _chunked_dot(a0, a1, a2, a3, a_rope, b0, b1, b2, b3, b_rope, DOT_PREC: tl.constexpr):
        """The logits tile as a sum over the four latent chunks and the rope part, accumulated in fp32:
        ``a0 @ b0 + a1 @ b1 + a2 @ b2 + a3 @ b3 + a_rope @ b_rope`` (q times K^T, or K times q^T when
        the K tile is the A operand). Inlined into the caller."""
        acc = tl.dot(a0, b0, input_precision=DOT_PREC)
        acc = tl.dot(a1, b1, acc, input_precision=DOT_PREC)
        acc = tl.dot(a2, b2, acc, input_precision=DOT_PREC)
        acc = tl.dot(a3, b3, acc, input_precision=DOT_PREC)
        return tl.dot(a_rope, b_rope, acc, input_precision=DOT_PREC)

    @triton.jit
    def _mla_decode_kernel(
        QN, QP, KV, BT, SEQ, SPARSE, KV_SCALE,
        OUT, LSE, POUT, PLSE,
        qk_scale,  # softmax_scale * log2(e): logits are kept in the log2 domain
        stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,
        stride_kv_row,  # elements per cache row (bytes for the uint8 layouts)
        stride_bt_b, stride_sp_t,
        num_slots,  # P * page_size: bound on every slot we read
        H, Q_PER_SEQ, TOPK,
        L: tl.constexpr, R: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
        KV_MODE: tl.constexpr, IS_SPARSE: tl.constexpr, DOT_PREC: tl.constexpr, EMULATE: tl.constexpr,
        TRANS_LOAD: tl.constexpr, SWAP_QK: tl.constexpr, FP16_MMA: tl.constexpr,
    ):
        LC: tl.constexpr = L // 4
        NUM_HB = tl.cdiv(H, BLOCK_H)
        pid = tl.program_id(0)
        # Head blocks of one (row, split) are adjacent in launch order, so they run together and
        # share the KV tiles through L2.
        hb = pid % NUM_HB
        rest = pid // NUM_HB
        split = rest % NUM_SPLITS
        row = rest // NUM_SPLITS

        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = offs_h < H
        offs_c = tl.arange(0, LC)
        offs_r = tl.arange(0, R)
        offs_n = tl.arange(0, BLOCK_N)

        if IS_SPARSE:
            kv_len = TOPK
            b = row
        else:
            b = row // Q_PER_SEQ
            j = row % Q_PER_SEQ
            # Causal among the new tokens: row j sees positions 0 .. seq_len - Q + j.
            kv_len = tl.load(SEQ + b) - Q_PER_SEQ + j + 1
            kv_len = tl.maximum(kv_len, 0)

        # Balanced per-row split ranges, rounded to whole tiles.
        per_split = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(lo + per_split, kv_len)

        qn_base = QN + row.to(tl.int64) * stride_qn_t + offs_h[:, None] * stride_qn_h
        q0 = tl.load(qn_base + offs_c[None, :], mask=hmask[:, None], other=0.0)
        q1 = tl.load(qn_base + LC + offs_c[None, :], mask=hmask[:, None], other=0.0)
        q2 = tl.load(qn_base + 2 * LC + offs_c[None, :], mask=hmask[:, None], other=0.0)
        q3 = tl.load(qn_base + 3 * LC + offs_c[None, :], mask=hmask[:, None], other=0.0)
        qp = tl.load(QP + row.to(tl.int64) * stride_qp_t + offs_h[:, None] * stride_qp_h + offs_r[None, :],
                     mask=hmask[:, None], other=0.0)
        # cdt: precision the operands are rounded to (q's dtype). mdt: dtype handed to tl.dot, which is cdt
        # except under the CPU interpreter, whose dot multiplies bf16 bit patterns as integers: there the
        # operands are rounded to cdt and then widened, computing the same values.
        cdt = q0.dtype
        if FP16_MMA:
            # fp8 KV with per-tensor scale: e4m3 -> fp16 is one cvt per pair (bf16 needs a detour through
            # fp32), and P in [0, 1] is finer in fp16. q is pre-scaled by 2^-8 (exact) so that |q| up to
            # ~1.6e7 stays finite in fp16; qk_scale gives the 2^8 back.
            cdt = tl.float16
            q0 = q0.to(tl.float32) * 0.00390625
            q1 = q1.to(tl.float32) * 0.00390625
            q2 = q2.to(tl.float32) * 0.00390625
            q3 = q3.to(tl.float32) * 0.00390625
            qp = qp.to(tl.float32) * 0.00390625
            qk_scale = qk_scale * 256.0
        if EMULATE:
            mdt = tl.float32
        else:
            mdt = cdt
        q0 = q0.to(cdt).to(mdt)
        q1 = q1.to(cdt).to(mdt)
        q2 = q2.to(cdt).to(mdt)
        q3 = q3.to(cdt).to(mdt)
        qp = qp.to(cdt).to(mdt)
        if SWAP_QK:
            # Logits computed transposed, K tile as the A operand: see the loop.
            q0 = tl.trans(q0)
            q1 = tl.trans(q1)
            q2 = tl.trans(q2)
            q3 = tl.trans(q3)
            qp = tl.trans(qp)

        if KV_MODE == 1:
            kv_scale = tl.load(KV_SCALE)
            qk_scale = qk_scale * kv_scale

        m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)  # finite: an all-masked tile then gives p = 0, not NaN
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc0 = tl.zeros([BLOCK_H, LC], tl.float32)
        acc1 = tl.zeros([BLOCK_H, LC], tl.float32)
        acc2 = tl.zeros([BLOCK_H, LC], tl.float32)
        acc3 = tl.zeros([BLOCK_H, LC], tl.float32)

        for start in range(lo, hi, BLOCK_N):
            t = start + offs_n
            tmask = t < hi
            if IS_SPARSE:
                slot = tl.load(SPARSE + row.to(tl.int64) * stride_sp_t + t, mask=tmask, other=-1)
            else:
                page = tl.load(BT + b.to(tl.int64) * stride_bt_b + t // PAGE_SIZE, mask=tmask, other=0)
                slot = page * PAGE_SIZE + t % PAGE_SIZE
            valid = tmask & (slot >= 0) & (slot < num_slots)
            slot = tl.where(valid, slot, 0)
            kv_row = KV + slot.to(tl.int64) * stride_kv_row
            vm = valid[:, None]
            if KV_MODE == 0:
                k0 = tl.load(kv_row[:, None] + offs_c[None, :], mask=vm, other=0.0).to(cdt).to(mdt)
                k1 = tl.load(kv_row[:, None] + LC + offs_c[None, :], mask=vm, other=0.0).to(cdt).to(mdt)
                k2 = tl.load(kv_row[:, None] + 2 * LC + offs_c[None, :], mask=vm, other=0.0).to(cdt).to(mdt)
                k3 = tl.load(kv_row[:, None] + 3 * LC + offs_c[None, :], mask=vm, other=0.0).to(cdt).to(mdt)
                kp = tl.load(kv_row[:, None] + L + offs_r[None, :], mask=vm, other=0.0).to(cdt).to(mdt)
                if SWAP_QK:
                    k0t = k0
                    k1t = k1
                    k2t = k2
                    k3t = k3
                    kpt = kp
                else:
                    k0t = tl.trans(k0)
                    k1t = tl.trans(k1)
                    k2t = tl.trans(k2)
                    k3t = tl.trans(k3)
                    kpt = tl.trans(kp)
            else:
                # KV points at float8e4nv here (also for the fp8_ds_mla rows, whose first 512 bytes are
                # e4m3). e4m3 -> bf16/fp16/fp32 is exact; the scales go onto logits and P instead.
                k0 = tl.load(kv_row[:, None] + offs_c[None, :], mask=vm, other=0.0).to(mdt)
                k1 = tl.load(kv_row[:, None] + LC + offs_c[None, :], mask=vm, other=0.0).to(mdt)
                k2 = tl.load(kv_row[:, None] + 2 * LC + offs_c[None, :], mask=vm, other=0.0).to(mdt)
                k3 = tl.load(kv_row[:, None] + 3 * LC + offs_c[None, :], mask=vm, other=0.0).to(mdt)
                if SWAP_QK:
                    k0t = k0
                    k1t = k1
                    k2t = k2
                    k3t = k3
                elif TRANS_LOAD:
                    # The mma.sync path cannot transpose an 8-bit operand in shared memory; a transposed
                    # register copy of the tile stops Triton from pipelining the load at all (seen in the
                    # TTGIR). Loading the tile a second time, already transposed, keeps both loads
                    # asynchronous; the second read hits L2.
                    kvt = kv_row[None, :]
                    k0t = tl.load(kvt + offs_c[:, None], mask=valid[None, :], other=0.0).to(mdt)
                    k1t = tl.load(kvt + LC + offs_c[:, None], mask=valid[None, :], other=0.0).to(mdt)
                    k2t = tl.load(kvt + 2 * LC + offs_c[:, None], mask=valid[None, :], other=0.0).to(mdt)
                    k3t = tl.load(kvt + 3 * LC + offs_c[:, None], mask=valid[None, :], other=0.0).to(mdt)
                else:
                    k0t = tl.trans(k0)
                    k1t = tl.trans(k1)
                    k2t = tl.trans(k2)
                    k3t = tl.trans(k3)
                if KV_MODE == 1:
                    if SWAP_QK:
                        kpt = tl.load(kv_row[:, None] + L + offs_r[None, :], mask=vm, other=0.0).to(mdt)
                    else:
                        kpt = tl.load(kv_row[None, :] + L + offs_r[:, None], mask=valid[None, :],
                                      other=0.0).to(mdt)
                else:
                    sc_row = (kv_row + L).to(tl.pointer_type(tl.float32))
                    s0 = tl.load(sc_row, mask=valid, other=0.0)
                    s1 = tl.load(sc_row + 1, mask=valid, other=0.0)
                    s2 = tl.load(sc_row + 2, mask=valid, other=0.0)
                    s3 = tl.load(sc_row + 3, mask=valid, other=0.0)
                    rp_row = (kv_row + L + 16).to(tl.pointer_type(tl.bfloat16))
                    kp = tl.load(rp_row[:, None] + offs_r[None, :], mask=vm, other=0.0).to(cdt).to(mdt)
                    if SWAP_QK:
                        kpt = kp
                    else:
                        kpt = tl.trans(kp)

            if SWAP_QK:
                # qk^T = K q^T: the K tile is the A operand in its stored (K-contiguous) order, which the
                # mma.sync path reads straight from shared memory even for 8-bit data.
                if KV_MODE == 2:
                    qkt = tl.dot(k0t, q0, input_precision=DOT_PREC) * s0[:, None]
                    qkt += tl.dot(k1t, q1, input_precision=DOT_PREC) * s1[:, None]
                    qkt += tl.dot(k2t, q2, input_precision=DOT_PREC) * s2[:, None]
                    qkt += tl.dot(k3t, q3, input_precision=DOT_PREC) * s3[:, None]
                    qkt = tl.dot(kpt, qp, qkt, input_precision=DOT_PREC)
                else:
                    qkt = _chunked_dot(k0t, k1t, k2t, k3t, kpt, q0, q1, q2, q3, qp, DOT_PREC)
                qk = tl.trans(qkt)
            elif KV_MODE == 2:
                qk = tl.dot(q0, k0t, input_precision=DOT_PREC) * s0[None, :]
                qk += tl.dot(q1, k1t, input_precision=DOT_PREC) * s1[None, :]
                qk += tl.dot(q2, k2t, input_precision=DOT_PREC) * s2[None, :]
                qk += tl.dot(q3, k3t, input_precision=DOT_PREC) * s3[None, :]
                qk = tl.dot(qp, kpt, qk, input_precision=DOT_PREC)
            else:
                qk = _chunked_dot(q0, q1, q2, q3, qp, k0t, k1t, k2t, k3t, kpt, DOT_PREC)
            qk = tl.where(valid[None, :], qk * qk_scale, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
            a2 = alpha[:, None]
            if KV_MODE == 2:
                acc0 = tl.dot((p * s0[None, :]).to(cdt).to(mdt), k0, acc0 * a2, input_precision=DOT_PREC)
                acc1 = tl.dot((p * s1[None, :]).to(cdt).to(mdt), k1, acc1 * a2, input_precision=DOT_PREC)
                acc2 = tl.dot((p * s2[None, :]).to(cdt).to(mdt), k2, acc2 * a2, input_precision=DOT_PREC)
                acc3 = tl.dot((p * s3[None, :]).to(cdt).to(mdt), k3, acc3 * a2, input_precision=DOT_PREC)
            else:
                pc = p.to(cdt).to(mdt)
                acc0 = tl.dot(pc, k0, acc0 * a2, input_precision=DOT_PREC)
                acc1 = tl.dot(pc, k1, acc1 * a2, input_precision=DOT_PREC)
                acc2 = tl.dot(pc, k2, acc2 * a2, input_precision=DOT_PREC)
                acc3 = tl.dot(pc, k3, acc3 * a2, input_precision=DOT_PREC)

        empty = l_i == 0.0
        inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
        if KV_MODE == 1:
            inv = inv * kv_scale
        lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        inv2 = inv[:, None]
        if NUM_SPLITS == 1:
            o_base = OUT + row.to(tl.int64) * H * L + offs_h[:, None] * L + offs_c[None, :]
            odt = OUT.dtype.element_ty
            tl.store(o_base, (acc0 * inv2).to(odt), mask=hmask[:, None])
            tl.store(o_base + LC, (acc1 * inv2).to(odt), mask=hmask[:, None])
            tl.store(o_base + 2 * LC, (acc2 * inv2).to(odt), mask=hmask[:, None])
            tl.store(o_base + 3 * LC, (acc3 * inv2).to(odt), mask=hmask[:, None])
            tl.store(LSE + row.to(tl.int64) * H + offs_h, lse2 * 0.6931471805599453, mask=hmask)
        else:
            # Partial results: [T, H, NUM_SPLITS, L] fp32 and [T, H, NUM_SPLITS] (log2 domain).
            ph = (row.to(tl.int64) * H + offs_h) * NUM_SPLITS + split
            p_base = POUT + ph[:, None] * L + offs_c[None, :]
            tl.store(p_base, acc0 * inv2, mask=hmask[:, None])
            tl.store(p_base + LC, acc1 * inv2, mask=hmask[:, None])
            tl.store(p_base + 2 * LC, acc2 * inv2, mask=hmask[:, None])
            tl.store(p_base + 3 * LC, acc3 * inv2, mask=hmask[:, None])
            tl.store(PLSE + ph, lse2, mask=hmask)

    @triton.jit
    def _mla_merge_kernel(POUT, PLSE, OUT, LSE, NUM_SPLITS, L: tl.constexpr, BLOCK_S: tl.constexpr,
                          BLOCK_L: tl.constexpr, ONE_STEP: tl.constexpr):
        # One program per (row, head, BLOCK_L output columns): combine the split partials by their log-sum-exp
        # weights; ONE_STEP (NUM_SPLITS <= BLOCK_S): all splits at once, else BLOCK_S splits per step of a loop.
        # (A program holding every split's whole row at once spilled its registers at 128 splits, and one
        # program per (row, head) left most SMs idle at one sequence.)
        rh = tl.program_id(0).to(tl.int64)
        col0 = tl.program_id(1) * BLOCK_L
        offs_s = tl.arange(0, BLOCK_S)
        offs_l = col0 + tl.arange(0, BLOCK_L)
        if ONE_STEP:
            smask = offs_s < NUM_SPLITS
            lse = tl.load(PLSE + rh * NUM_SPLITS + offs_s, mask=smask, other=float("-inf"))
            m = tl.max(lse, 0)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            w = tl.exp2(lse - m_safe)  # 0 for empty splits
            tot = tl.sum(w, 0)
            empty = tot == 0.0
            wn = w / tl.where(empty, 1.0, tot)
            part = tl.load(POUT + (rh * NUM_SPLITS + offs_s[:, None]) * L + offs_l[None, :], mask=smask[:, None],
                           other=0.0)
            o = tl.sum(part * wn[:, None], 0)
        else:
            m = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
            for s0 in range(0, NUM_SPLITS, BLOCK_S):
                lse = tl.load(PLSE + rh * NUM_SPLITS + s0 + offs_s, mask=s0 + offs_s < NUM_SPLITS,
                              other=float("-inf"))
                m = tl.maximum(m, tl.max(lse, 0))
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            tot = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
            o = tl.zeros([BLOCK_L], tl.float32)
            for s0 in range(0, NUM_SPLITS, BLOCK_S):
                smask = s0 + offs_s < NUM_SPLITS
                lse = tl.load(PLSE + rh * NUM_SPLITS + s0 + offs_s, mask=smask, other=float("-inf"))
                w = tl.exp2(lse - m_safe)  # 0 for empty splits
                tot += tl.sum(w, 0)
                part = tl.load(POUT + (rh * NUM_SPLITS + s0 + offs_s[:, None]) * L + offs_l[None, :],
                               mask=smask[:, None], other=0.0)
                o += tl.sum(part * w[:, None], 0)
            empty = tot == 0.0
            o = o / tl.where(empty, 1.0, tot)
        tl.store(OUT + rh * L + offs_l, o.to(OUT.dtype.element_ty))
        if col0 == 0:
            lse_out = tl.where(empty, float("-inf"), (m_safe + tl.log2(tl.where(empty, 1.0, tot))) * 0.6931471805599453)
            tl.store(LSE + rh, lse_out)


KERNELS = ("tl_dot", "gluon_sm90", "gluon_sm90_narrow")
# The split merge's tile (``merge_tile``): from MERGE_WHOLE_ROWS_FROM (row, head) pairs up, whole rows and
# MERGE_BLOCK_S splits a step, all at once up to that. H200, the merge alone (a one-off script, docs/triton_notes.md):
# one program per pair holding every split at once spilled at 128 splits (T*H=64: 82.6 -> 20.0 us with a loop and
# 128 columns a program); at T*H=4096 (8 splits) 128 columns a program cost 2x whole rows (26.0 -> 53.2), and the
# loop over 16 splits 1.08-1.13x all at once (T*H=4096-16384). Before/after: docs/results.md#kernels.
MERGE_BLOCK_S, MERGE_WHOLE_ROWS_FROM = 16, 512
# Below MERGE_WHOLE_ROWS_FROM pairs: up to MERGE_FEW_ROWS_MAX_SPLITS splits in one step (one round trip to memory
# instead of two per 16 splits: the loop finds the lse maximum first), and the widest column block that still gives
# MERGE_MIN_PROGRAMS programs in at most MERGE_TILE_VALUES partial values a program (128 a thread in 4 warps), down
# to MERGE_MIN_COLUMNS. H200, the merge alone at every tile (bench_kernels.py --merge-tiles,
# docs/results.md#kernels): the pick is the fastest tile or within 2% at 8 of 10 shapes, 1.07x and 1.12x at 256 pairs.
# Whole calls at one or two sequences: 0.78-0.93x their time with 16 splits a step (one step in 128-column blocks),
# then 0.86-1.01x (these blocks).
MERGE_FEW_ROWS_MAX_SPLITS, MERGE_TILE_VALUES, MERGE_MIN_PROGRAMS, MERGE_MIN_COLUMNS = 128, 16384, 256, 32


class DecodeConfig:
    """Launch parameters of the decode kernel. ``kernel``: "tl_dot" (the ``tl.dot`` kernel, every GPU and the
    interpreter), "gluon_sm90" (``decode_hopper``, the Gluon kernel for SM90: 64 heads per program, dense and
    sparse calls on bf16/fp16, fp8_e4m3 or fp8_ds_mla caches with L=512, R=64) or "gluon_sm90_narrow" (its variant
    for 16 heads per program, fp8_e4m3 and fp8_ds_mla caches; BLOCK_N 64, 4 warps). For "gluon_sm90"
    ``num_stages`` is its pipeline depth; the narrow variant has none; both ignore ``fp8_qk`` / ``fp16_mma``."""

    __slots__ = ("block_h", "block_n", "num_splits", "num_warps", "num_stages", "fp8_qk", "fp16_mma", "kernel")

    def __init__(self, block_h: int, block_n: int, num_splits: int, num_warps: int, num_stages: int,
                 fp8_qk: str = "auto", fp16_mma: Optional[bool] = None, kernel: str = "tl_dot"):
        self.block_h = block_h
        self.block_n = block_n
        self.num_splits = num_splits
        self.num_warps = num_warps
        self.num_stages = num_stages
        # fp8 caches: how the logits product gets the K tile ("swap": K as the A operand, "reload": a
        # second transposed load, "trans": transpose in registers; "auto": reload below 64 heads per block, else trans).
        self.fp8_qk = fp8_qk
        # fp8 per-tensor caches: run the matrix products in fp16 (None: yes).
        self.fp16_mma = fp16_mma
        if kernel not in KERNELS:
            raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
        self.kernel = kernel

    def replace(self, **fields) -> "DecodeConfig":
        """This configuration with ``fields`` (names of its slots) changed, every other one as it is."""
        return DecodeConfig(**{name: fields.pop(name, getattr(self, name)) for name in self.__slots__}, **fields)

    def with_kernel(self, kernel: str) -> "DecodeConfig":
        return self.replace(kernel=kernel)

    def __repr__(self) -> str:
        return (f"DecodeConfig({self.block_h}, {self.block_n}, ns={self.num_splits}, w={self.num_warps}, "
                f"st={self.num_stages}, qk={self.fp8_qk}, f16={self.fp16_mma}, kernel={self.kernel})")


_SM_COUNT = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


# Bytes of split partials (fp32, written by the decode and read back by the merge) that cost about as much time as
# one program's KV tile in the wave model below: the value whose picks came closest to the fastest split count
# measured (``benchmarks/split_rule.py`` on tests/data/split_logs_h200; docs/results.md#kernels).
PARTIAL_BYTES_PER_TILE = 3_000_000


def choose_splits(rows: int, head_blocks: int, kv_len: int, block_n: int, slots: int, max_splits: int = 128,
                  partial_bytes: Optional[int] = None) -> int:
    """Split count from a simple wave model.

    ``slots`` is how many programs the GPU runs at once. Time ~ waves * (tiles per split + c) + m, where c stands
    for the per-program fixed cost (loading Q, writing a partial) and m for the merge pass. Of the counts within 3%
    of the best estimate, the smallest wins: splitting only pays when it fills SMs that would otherwise idle. At
    most ``max_splits``: 128 lets one long sequence at 64 heads per program fill an H100's or H200's 132 SMs (H200,
    kernel called directly, B=1 H=64 S=64k bf16: 60.1 -> 50.0 us with the new merge and 128 splits against the old
    merge and 64, docs/results.md#kernels).

    ``partial_bytes`` (the Gluon kernels, measured on the GPU; None for the tl.dot kernel, whose own picks were the
    fastest count timed at every shape of an H200 sweep without it; docs/results.md#kernels): the bytes
    one more split adds to the call's partials. m then grows by those bytes per split in tiles' worth of time
    (``PARTIAL_BYTES_PER_TILE``), and the counts weighed are powers of two and those that fill whole waves of
    programs: counts between them (13 splits at B=4 H=128 S=4096, 19 at B=6 H=64 S=8192) were slower than both
    neighbours, which the model does not see. ``bench_kernels.py --splits`` times split counts.
    """
    tiles = max(1, -(-kv_len // block_n))
    base = max(1, rows * head_blocks)
    per_split = 0.0 if partial_bytes is None else partial_bytes / PARTIAL_BYTES_PER_TILE
    top = min(max_splits, tiles)
    counts = range(1, top + 1)
    if partial_bytes is not None:
        whole_waves = {w * slots // base for w in range(1, -(-top * base // slots) + 1)}
        counts = [ns for ns in counts if ns & (ns - 1) == 0 or ns in whole_waves]
    costs = {}
    for ns in counts:
        waves = -(-base * ns // slots)
        costs[ns] = waves * (-(-tiles // ns) + 2.0) + (1.0 + ns * per_split if ns > 1 else 0.0)
    best = min(costs.values())
    return next(ns for ns, c in costs.items() if c <= best * 1.03)


# Up to this many (query row, key) pairs a 16-bit call of 16 heads or fewer runs the 64-head Gluon kernel on SM90.
WIDE_FEW_HEADS_MAX_KEYS = 1 << 19


def choose_config(T: int, H: int, kv_len: int, kv_mode: int, device: torch.device,
                  sparse: bool = False) -> DecodeConfig:
    """Heuristic launch configuration (tuned on H100; see docs/triton_notes.md). Cached per shape. ``kv_len``: the
    host-side bound on keys per row (dense: block-table width x page size; sparse: top-k)."""
    return _choose_config_cached(T, H, kv_len, kv_mode, device.type, device.index, sparse)


@functools.lru_cache(maxsize=1024)
def _choose_config_cached(T, H, kv_len, kv_mode, dev_type, dev_index, sparse=False) -> DecodeConfig:
    device = torch.device(dev_type, dev_index) if dev_index is not None else torch.device(dev_type)
    cfg = tl_dot_config(T, H, kv_len, device)
    if not _hopper_kernel_runs_on(device):
        return cfg
    if cfg.block_h in (32, 64):
        # The Gluon kernel (decode_hopper), at the tl.dot kernel's 64-head tiling and splits (from 33 heads up its
        # fallback keeps them): 1.5-1.8x the tl.dot kernel's speed at H=128 from B=16 up on an H100 (2.4x for
        # fp8_ds_mla; docs/results.md#kernels). From 17 to 32 heads too, though half of its 64-row products
        # or more are then empty: at H=32 (DeepSeek-V3 at tensor parallel 4) it still beats the tl.dot kernel's
        # 32-head tiling, most of all on fp8 caches, which the tl.dot kernel widens in the warps that run its
        # products (H100, B=128 S=4096: bf16 1.16x, fp8_e4m3 1.69x, fp8_ds_mla 1.87x; docs/results.md#kernels).
        # DecodeLaunch keeps the tl.dot kernel for calls it does not cover (other L/R or dtypes, an unaligned cache).
        return gluon_config("gluon_sm90", T, H, kv_len, device)
    if cfg.block_h == 16 and kv_mode == _KV_PLAIN and not sparse and T * kv_len <= WIDE_FEW_HEADS_MAX_KEYS:
        # Dense bf16/fp16 at 16 heads or fewer, up to 2^19 (query row, key) pairs: the 64-head Gluon kernel, though
        # 48 or more of its 64 rows are empty. H200, bench_kernels' forced rows (docs/results.md#kernels): 0.78-0.97x
        # the tl.dot kernel's time from B=1 to B=128 at S=4096 and up to B=8 at S=32k (B=16 even);
        # beyond, the tl.dot kernel (two programs per SM) reads at the HBM floor and is ~1% ahead. Sparse calls keep
        # the tl.dot kernel (at 16 heads, top-k 2048, it was ahead at B=1 and B=128 and even at B=32).
        return gluon_config("gluon_sm90", T, H, kv_len, device)
    if cfg.block_h == 16 and kv_mode in (_KV_FP8, _KV_DS):
        # Its 16-head variant (keys on wgmma's M side), two programs per SM: fp8 caches only (ahead of the wide
        # kernel on them from B=16 up, docs/results.md#kernels).
        return gluon_config("gluon_sm90_narrow", T, H, kv_len, device)
    return cfg


def gluon_config(kernel: str, T: int, H: int, kv_len: int, device: torch.device) -> DecodeConfig:
    """The launch configuration of Gluon kernel ``kernel`` for a call of T query rows and H heads, at any head
    count (its own tiling, splits for its programs per SM): what choose_config gives where it picks that kernel,
    and what a benchmark forces where it does not."""
    h = _hopper()
    if kernel == "gluon_sm90_narrow":
        ns = choose_splits(T, -(-H // h.NARROW_BLOCK_H), kv_len, h.NARROW_BLOCK_N, _sm_count(device) * 2,
                           partial_bytes=_partial_bytes(T, H))
        return DecodeConfig(h.NARROW_BLOCK_H, h.NARROW_BLOCK_N, ns, h.NARROW_NUM_WARPS, 1, kernel=kernel)
    if kernel == "gluon_sm90":
        block_n, stages = h.TILINGS[0]
        ns = choose_splits(T, -(-H // h.HEADS_PER_PROGRAM), kv_len, block_n, _sm_count(device),
                           partial_bytes=_partial_bytes(T, H))
        return DecodeConfig(h.HEADS_PER_PROGRAM, block_n, ns, h.NUM_WARPS, stages, kernel=kernel)
    raise ValueError(f"kernel: expected a Gluon kernel ('gluon_sm90' or 'gluon_sm90_narrow'), got {kernel!r}")


def _partial_bytes(T: int, H: int) -> int:
    """Bytes one split adds to a Gluon call's partials: an fp32 output row and log-sum-exp per (row, head)."""
    return _partials_numel(T, H, 1, _hopper().L_DIM) * 4


def tl_dot_tiling(H: int) -> tuple[int, int, int, int, int]:
    """The ``tl.dot`` kernel's tiling on a GPU for H heads: (heads per program, warps, keys per tile, pipeline
    stages, programs per SM)."""
    if H > 32:
        # 64 heads per program on wgmma; BLOCK_N=64 halves the per-tile fixed costs against 32
        # (H100, B=64 H=128 S=4096 bf16: 323 us vs 426 us), at ~220 KB of shared memory: one program per SM.
        return 64, 8, 64, 2, 1
    if H > 16:
        return 32, 4, 32, 3, 2
    return 16, 4, 32, 3, 2


def tl_dot_config(T: int, H: int, kv_len: int, device: torch.device) -> DecodeConfig:
    """The ``tl.dot`` kernel's launch configuration for a call (what every GPU but SM90 runs, and what an SM90
    call the Gluon kernels do not cover falls back to)."""
    if device.type != "cuda":
        # Interpreter: any legal shape computes the same thing; small tiles keep it quick.
        block_h = 16 if H <= 16 else 32
        return DecodeConfig(block_h, 16, 1 if kv_len <= 64 else 2, 4, 1)
    block_h, num_warps, block_n, stages, per_sm = tl_dot_tiling(H)
    hb = -(-H // block_h)
    ns = choose_splits(T, hb, kv_len, block_n, _sm_count(device) * per_sm)
    return DecodeConfig(block_h, block_n, ns, num_warps, stages)


_LAST_COMPILED = None  # most recent compiled decode kernel (benchmarks read its register/spill report)


def _hopper():
    from mla_inductor.kernels import decode_hopper

    return decode_hopper


def _hopper_kernel_runs_on(device: torch.device) -> bool:
    """Whether the Gluon kernel can run on ``device``: an SM90 GPU and a Triton with Gluon's Hopper ops."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
            and _hopper().HAVE_GLUON)


def _hopper_kernel_covers(kernel: str, q_dtype: torch.dtype, kv_dtype: torch.dtype, kv_mode: int, L: int, R: int,
                          kv_row_stride: int) -> bool:
    """Whether a call is one the Gluon kernel ``kernel`` is written for (its device already chosen by
    choose_config); dense and sparse calls alike. The 16-head variant takes fp8 caches only.
    Its cache rows are copied 16 bytes at a time, which needs a row stride of a multiple of 16 elements (what
    Triton specializes on) and a 16-byte aligned cache (checked per call: ``DecodeLaunch.__call__``)."""
    if (L, R) != (_hopper().L_DIM, _hopper().R_DIM) or q_dtype not in (torch.bfloat16, torch.float16):
        return False
    if kv_row_stride % 16:
        return False
    if kernel == "gluon_sm90_narrow":
        return kv_mode in (_KV_FP8, _KV_DS)
    return kv_mode in (_KV_FP8, _KV_DS) or (kv_mode == _KV_PLAIN and kv_dtype == q_dtype)


def _kernel_for(kernel, device: torch.device):
    """The kernel to launch; CPU tensors only run under Triton's interpreter."""
    if device.type != "cuda":
        from triton.runtime.jit import JITFunction

        if isinstance(kernel, JITFunction):
            # The interpreter is chosen when @triton.jit runs (triton's own helpers included), so the
            # variable must be set before triton is first imported.
            raise RuntimeError("triton_paged_decode on CPU tensors needs TRITON_INTERPRET=1 set before triton "
                               "is imported")
    return kernel


def _check_inputs(q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale, sparse_indices):
    if q_nope.dim() != 3 or q_pe.dim() != 3:
        raise ValueError(f"q_nope and q_pe must be [T, H, D]; got {tuple(q_nope.shape)} and {tuple(q_pe.shape)}")
    T, H, L = q_nope.shape
    if q_pe.shape[:2] != (T, H):
        raise ValueError(f"q_pe leading dims {tuple(q_pe.shape[:2])} differ from q_nope's {(T, H)}")
    R = q_pe.shape[2]
    if L not in _SUPPORTED_L:
        raise ValueError(f"q_nope: kv_lora_rank L={L} not supported (supported: {_SUPPORTED_L})")
    if R not in _SUPPORTED_R:
        raise ValueError(f"q_pe: rope dim R={R} not supported (supported: {_SUPPORTED_R})")
    return T, H, L, R


_KV_MODE_OF_FORMAT = {"fp32": _KV_PLAIN, "fp16": _KV_PLAIN, "bf16": _KV_PLAIN, "fp8_e4m3": _KV_FP8,
                      "fp8_ds_mla": _KV_DS}


def _kv_mode(kv_cache: torch.Tensor, L: int, R: int) -> int:
    if kv_cache.dim() != 3:
        raise ValueError(f"kv_cache must be [P, page_size, row]; got shape {tuple(kv_cache.shape)}")
    try:
        fmt = cache_format(kv_cache)
    except TypeError as e:
        raise ValueError(f"kv_cache: {e}") from None
    if fmt == "fp8_ds_mla":
        if kv_cache.shape[2] != FP8_DS_MLA_ROW_BYTES or L != 512 or R != 64:
            raise ValueError(f"kv_cache: uint8 caches must use the fp8_ds_mla layout ([P, page, 656], L=512, R=64); "
                             f"got row {kv_cache.shape[2]} with L={L}, R={R}")
    elif kv_cache.shape[2] != L + R:
        raise ValueError(f"kv_cache: row length {kv_cache.shape[2]} != L + R = {L + R}")
    return _KV_MODE_OF_FORMAT[fmt]


def triton_paged_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_scale: Optional[torch.Tensor],
    sparse_indices: Optional[torch.Tensor] = None,
    config: Optional[DecodeConfig] = None,
    out: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """MLA paged decode attention with absorbed queries.

    Args:
        q_nope: [T, H, L] fp16/bf16/fp32, L in {256, 512}; last dim contiguous. T = B * Q.
        q_pe: [T, H, R], same dtype, R in {32, 64}; last dim contiguous.
        kv_cache: [P, page_size, L + R] fp16/bf16/fp32 or float8_e4m3fn (per-tensor ``kv_scale``), or uint8
            [P, page_size, 656] in the fp8_ds_mla layout (L=512, R=64).
        block_table: int32 [B, max_pages]; entries past a sequence's last page are never read.
        seq_lens: int32 [B], cached tokens per sequence including the Q new ones.
        softmax_scale: scale on q.k.
        kv_scale: fp32 tensor with one element (used for float8_e4m3fn caches; read on device).
        sparse_indices: optional int32 [T, K] slots ``page * page_size + offset``, -1 = padding. When given,
            each row attends exactly to its listed slots (no causal mask); block_table/seq_lens are unused.
        config: optional launch override (benchmarks/tuning); default from :func:`choose_config`.
        out, lse: optional preallocated outputs (contiguous [T, H, L] in q's dtype, fp32 [T, H]).

    Returns:
        (out [T, H, L] in q's dtype, lse [T, H] fp32 natural-log log-sum-exp of the scaled logits).
        Rows with nothing to attend give out 0 and lse -inf.
    """
    _check_inputs(q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale, sparse_indices)
    return _paged_decode_impl(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale,
                              sparse_indices, config, out, lse)


# Split-KV workspaces kept between calls, one per (device, stream). A call's partials are read by its own merge
# kernel, next on the same stream, so the next call on that stream may write them again (stream order): no
# allocation per call, which cost more host time than the merge launch it feeds (one allocation and its two
# views: 11-21 us per call on an H100 system's host, 0.1-2.8 us kept; docs/results.md#program-shapes). Not
# while a CUDA graph is captured: a graph keeps the addresses it recorded, so its workspace comes from the
# graph's own pool, one per capture, as before; and only for eager calls and graphs compiled without CUDA graphs
# (see DecodeLaunch.__call__).
# Workspaces above WORKSPACE_KEEP_BYTES are allocated per call and not kept.
WORKSPACE_KEEP_BYTES = 64 << 20
_WORKSPACES: dict = {}
_capturing = stream_capture_query()
_current_stream = raw_stream_query()


def _split_partials(launch: "DecodeLaunch"):
    """The partials of ``launch``'s eager split-KV call: views of the kept workspace of the current stream (made
    again only when that workspace changed), else a fresh ``_alloc_partials``."""
    T, H, L = launch.out_shape
    ns, device = launch.splits, launch.device
    numel = _partials_numel(T, H, ns, L)
    if device.type != "cuda" or numel * 4 > WORKSPACE_KEEP_BYTES or _capturing():
        return _alloc_partials(T, H, ns, L, device)
    key = (device.index, _current_stream(device.index))
    workspace = _WORKSPACES.get(key)
    if workspace is None or workspace.numel() < numel:
        workspace = _WORKSPACES[key] = torch.empty(numel, dtype=torch.float32, device=device)
    kept = launch.partials
    if kept is None or kept[0] is not workspace:
        kept = launch.partials = (workspace, *_partial_views(workspace, T, H, ns, L))
    return kept[1], kept[2]


def _scratch_lse(launch: "DecodeLaunch") -> Optional[torch.Tensor]:
    """For a call whose lse nobody reads: the [T, H] lse the kernel must write, kept by the launch (an allocation
    per call costs a short call host time), or None where none is kept yet and a CUDA graph is being captured
    (kept memory must not come from the graph's pool). Calls on other streams, or inside a later capture, write
    the same scratch: nobody reads it."""
    scratch = launch.lse_scratch
    if scratch is None:
        if launch.device.type == "cuda" and _capturing():
            return None
        scratch = launch.lse_scratch = torch.empty(*launch.lse_shape, dtype=torch.float32, device=launch.device)
    return scratch


def merge_tile(pairs: int, ns: int, L: int) -> Tuple[int, int]:
    """(splits per step, output columns per program) of the split merge for ``pairs`` (row, head) pairs of ``ns``
    splits each."""
    if pairs >= MERGE_WHOLE_ROWS_FROM:
        return min(_next_pow2(ns), MERGE_BLOCK_S), L
    block_s, block_l = min(_next_pow2(ns), MERGE_FEW_ROWS_MAX_SPLITS), L
    while block_l > MERGE_MIN_COLUMNS and block_l % 2 == 0 and (pairs * (L // block_l) < MERGE_MIN_PROGRAMS
                                                                or block_s * block_l > MERGE_TILE_VALUES):
        block_l //= 2  # halves of an even width: the blocks still tile the row exactly
    return block_s, block_l


def merge_launch(pairs: int, ns: int, L: int, device: torch.device, tile: Optional[Tuple[int, int]] = None):
    """The split merge of ``pairs`` (row, head) pairs of ``ns`` partials each, ``(pout, plse, out, lse)`` its
    arguments: at ``merge_tile``'s tile, or at ``tile`` (splits per step, output columns per program; benchmarks)."""
    from mla_inductor.kernels.launch import KernelLaunch

    block_s, block_l = tile or merge_tile(pairs, ns, L)
    return KernelLaunch(_kernel_for(_mla_merge_kernel, device), (pairs, L // block_l),
                        (ns, L, block_s, block_l, ns <= block_s), dict(num_warps=4))


def _alloc_partials(T: int, H: int, ns: int, L: int, device: torch.device):
    """Split-KV workspace: normalised partial outputs [T, H, ns, L] and log2-domain lse [T, H, ns], two views
    of one allocation (an allocation costs several µs of a short call's host time on a GPU)."""
    workspace = torch.empty(_partials_numel(T, H, ns, L), dtype=torch.float32, device=device)
    return _partial_views(workspace, T, H, ns, L)


def _partials_numel(T: int, H: int, ns: int, L: int) -> int:
    """fp32 values of a split-KV workspace: an output row and a log-sum-exp per (row, head, split)."""
    return T * H * ns * (L + 1)


def _partial_views(workspace: torch.Tensor, T: int, H: int, ns: int, L: int):
    """(partial out [T, H, ns, L], partial lse [T, H, ns]) at the front of a float32 ``workspace``. The lse part
    starts T*H*ns*L floats in: 16-byte aligned, as L is a multiple of 4."""
    rows = T * H * ns
    return workspace[:rows * L].view(T, H, ns, L), workspace[rows * L:rows * (L + 1)].view(T, H, ns)


def _paged_decode_impl(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale,
                       sparse_indices=None, config=None, out=None, lse=None):
    """:func:`triton_paged_decode` without the L/R whitelist.

    Tests run the interpreter at small L (a power of two, multiple of 4) and R to stay fast; the kernel
    itself is generic in them. On GPU, L/4 and R must be at least 16 (tl.dot's minimum).
    """
    launch = DecodeLaunch(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices,
                          config)
    return launch(q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale, sparse_indices, out, lse)


class DecodeLaunch:
    """The decode of one call signature, prepared once: what a call costs on the host is its outputs'
    allocation and the launches.

    A signature is everything but the tensors' addresses and contents: shapes, strides, dtypes and devices
    of every argument, softmax_scale and the launch configuration. Made from an example call, it checks the
    arguments (the checks that read no data), chooses the configuration, computes the kernels' scalar
    arguments and grid, and holds one ``KernelLaunch`` per kernel (the decode, and the merge of the split-KV
    partials where the sequence is split), which relaunch the compiled kernels without Triton's JIT front
    door. Each later call must have the example's signature: the caller keys instances by it (the Triton
    backend: ``contract.call_signature``). Launches per call: one, or two where the sequence is split.
    """

    def __init__(self, q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale,
                 sparse_indices=None, config: Optional[DecodeConfig] = None):
        if q_nope.dim() != 3 or q_pe.dim() != 3:
            raise ValueError(f"q_nope and q_pe must be [T, H, D]; got {tuple(q_nope.shape)} and {tuple(q_pe.shape)}")
        T, H, L = q_nope.shape
        R = q_pe.shape[2]
        if L % 4 or _next_pow2(L) != L or _next_pow2(R) != R:
            raise ValueError(f"q_nope/q_pe: L={L} and R={R} must be powers of two (L a multiple of 4)")
        kv_mode = _kv_mode(kv_cache, L, R)
        if q_nope.stride(-1) != 1 or q_pe.stride(-1) != 1:
            raise ValueError("q_nope / q_pe: last dimension must be contiguous")
        if q_nope.dtype != q_pe.dtype or q_nope.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"q_nope/q_pe: dtypes {q_nope.dtype}/{q_pe.dtype} must match and be fp16, bf16 or fp32")
        if kv_mode == _KV_FP8 and kv_scale is None:
            raise ValueError("kv_scale: required for a float8_e4m3fn kv_cache")
        if kv_cache.stride(2) != 1 or kv_cache.stride(0) != kv_cache.shape[1] * kv_cache.stride(1):
            raise ValueError("kv_cache: rows must be contiguous and pages densely packed ([P, page, row] view)")
        P, page_size = kv_cache.shape[0], kv_cache.shape[1]
        if page_size < 1:
            raise ValueError(f"kv_cache: page_size {page_size} must be >= 1")
        if kv_scale is not None and kv_scale.numel() != 1:
            raise ValueError(f"kv_scale: expected one element, got {kv_scale.numel()}")
        self.out_shape, self.lse_shape = (T, H, L), (T, H)
        self.out_dtype, self.device = q_nope.dtype, q_nope.device
        self.sparse = sparse_indices is not None
        self.ds = kv_mode == _KV_DS
        # Decided by the signature: whether the call launches at all, and which inputs need a copy or a view.
        self.nothing = T == 0 or H == 0
        self.nothing_attended = False
        self.table_copy = self.indices_copy = False
        self.kv_scale_view = kv_scale is not None and (tuple(kv_scale.shape) != (1,) or kv_scale.dtype != torch.float32)
        self.main = self.merge = self.fallback = None
        self.partials = None  # (workspace, partial out, partial lse) of the last split call: _split_partials
        self.lse_scratch = None  # the [T, H] lse out-only calls write and nobody reads: _scratch_lse
        if self.nothing:
            return
        if self.sparse:
            if sparse_indices.dim() != 2 or sparse_indices.shape[0] != T:
                raise ValueError(f"sparse_indices: expected [T={T}, K]; got {tuple(sparse_indices.shape)}")
            if sparse_indices.dtype != torch.int32:
                raise ValueError(f"sparse_indices: dtype must be int32, got {sparse_indices.dtype}")
            self.indices_copy = sparse_indices.stride(1) != 1
            topk = sparse_indices.shape[1]
            kv_len_hint, q_per_seq, stride_bt = topk, 1, 0
            # The stride of the contiguous copy the launch makes (torch strides a 0-wide row by 1): no copy here.
            stride_sp = max(topk, 1) if self.indices_copy else sparse_indices.stride(0)
            self.nothing_attended = topk == 0
            if self.nothing_attended:
                return
        else:
            if block_table.dim() != 2 or block_table.dtype != torch.int32:
                raise ValueError(f"block_table: expected int32 [B, max_pages]; got {block_table.dtype} "
                                 f"{tuple(block_table.shape)}")
            if seq_lens.dim() != 1 or seq_lens.shape[0] != block_table.shape[0] or seq_lens.dtype != torch.int32:
                raise ValueError(f"seq_lens: expected int32 [B={block_table.shape[0]}]; got {seq_lens.dtype} "
                                 f"{tuple(seq_lens.shape)}")
            B = block_table.shape[0]
            if B == 0 or T % B != 0:
                raise ValueError(f"q_nope: T={T} must be a multiple of the batch size B={B}")
            q_per_seq, topk = T // B, 0
            self.table_copy = block_table.stride(1) != 1
            stride_bt = max(block_table.shape[1], 1) if self.table_copy else block_table.stride(0)
            stride_sp = stride_bt  # the dense kernel is handed the block table as its (unread) index tensor
            # Host-side bound on the sequence length: keeps the launch free of device->host syncs.
            kv_len_hint = max(1, block_table.shape[1] * page_size)
        cfg = config or choose_config(T, H, kv_len_hint, kv_mode, self.device, self.sparse)
        if cfg.kernel != "tl_dot" and not _hopper_kernel_runs_on(self.device):
            raise ValueError(f"config: kernel={cfg.kernel!r} runs on SM90 GPUs with a Triton that has Gluon's Hopper "
                             f"ops; this call is on {self.device}: use kernel='tl_dot'")
        # Where a Gluon kernel cannot take the call (or a launch of it fails for lack of shared memory): the tl.dot
        # kernel at its own configuration (at 32 heads its own tiling is 1.3x faster than the 64-head one; at 64
        # heads the tilings agree but the split counts do not: the Gluon kernels' rule weighs the partials, which
        # picked 1.05-1.36x the fastest count's time for the tl.dot kernel where its own rule picked the fastest,
        # docs/results.md#kernels). A caller's 64-head config keeps its splits.
        own = tl_dot_config(T, H, kv_len_hint, self.device)
        self.fallback = cfg.with_kernel("tl_dot") if config is not None and cfg.block_h == own.block_h == 64 else own
        if cfg.kernel != "tl_dot" and not _hopper_kernel_covers(cfg.kernel, q_nope.dtype, kv_cache.dtype, kv_mode, L,
                                                                R, kv_cache.stride(1)):
            cfg = self.fallback
        emulate = self.device.type != "cuda"
        self.kernel_scalars = (
            float(softmax_scale) * _LOG2E, q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
            kv_cache.stride(1), stride_bt, stride_sp, P * page_size, H, q_per_seq, topk)
        self.kernel_constants = dict(
            L=L, R=R, PAGE_SIZE=page_size, KV_MODE=kv_mode, IS_SPARSE=self.sparse,
            DOT_PREC="ieee" if (q_nope.dtype == torch.float32 or emulate) else "tf32", EMULATE=emulate)
        self._use(cfg)

    def _use(self, cfg: DecodeConfig) -> None:
        """Prepare the launches of configuration ``cfg``."""
        from mla_inductor.kernels.launch import KernelLaunch

        self.config = cfg
        T, H, L = self.out_shape
        c = self.kernel_constants
        ns = max(1, int(cfg.num_splits))
        fp8_qk = cfg.fp8_qk
        if fp8_qk == "auto":
            fp8_qk = "reload" if cfg.block_h < 64 else "trans"
        if c["KV_MODE"] == _KV_PLAIN and fp8_qk == "reload":
            fp8_qk = "trans"
        fp16_mma = c["KV_MODE"] == _KV_FP8 and (cfg.fp16_mma is None or cfg.fp16_mma)
        constants = (c["L"], c["R"], c["PAGE_SIZE"], cfg.block_h, cfg.block_n, ns, c["KV_MODE"], c["IS_SPARSE"],
                     c["DOT_PREC"], c["EMULATE"], fp8_qk == "reload", fp8_qk == "swap", fp16_mma)
        grid = (T * ns * triton.cdiv(H, cfg.block_h),)
        self.splits = ns
        self.partials = None
        if cfg.kernel != "tl_dot":
            # Same arguments; the pipeline depth is a constexpr of its own (Gluon has no num_stages).
            kernel, num_warps = _hopper().KERNELS[cfg.kernel]
            self.main = KernelLaunch(kernel, grid, self.kernel_scalars + constants + (cfg.num_stages,),
                                     dict(num_warps=num_warps))
        else:
            self.main = KernelLaunch(_kernel_for(_mla_decode_kernel, self.device), grid,
                                     self.kernel_scalars + constants, dict(num_warps=cfg.num_warps,
                                                                           num_stages=cfg.num_stages))
        self.merge = None
        if ns > 1:
            # Few (row, head) pairs: each program merges BLOCK_L columns, so that more SMs share the work;
            # many: whole rows (4x the programs cost more than they spread: 2x at T*H = 4096).
            self.merge = merge_launch(T * H, ns, L, self.device)

    def __call__(self, q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale, sparse_indices=None, out=None,
                 lse=None, keep_workspace: bool = False, need_lse: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(out [T, H, L], lse [T, H] fp32)`` of a call with the example's signature; ``out`` / ``lse``:
        optional preallocated outputs (contiguous, the contract's dtypes). ``keep_workspace``: the split-KV
        workspace may be the stream's kept one (``_split_partials``): for eager calls and graphs compiled without
        CUDA graphs only, never from code CUDA-graph trees run, whose warm-up calls make every allocation in the
        graph's pool (a workspace kept from there is memory of the pool no output accounts for: "tensor(s) in
        the cudagraph pool not tracked as outputs", H100). ``need_lse=False`` with ``keep_workspace``: nobody reads
        the lse, which the kernel then writes into the launch's kept scratch (``_scratch_lse``); the lse returned is
        that scratch, overwritten by the next such call."""
        if out is None:
            out = torch.empty(*self.out_shape, dtype=self.out_dtype, device=self.device)
        elif out.shape != self.out_shape or out.dtype != self.out_dtype or not out.is_contiguous():
            raise ValueError(f"out: expected contiguous {self.out_dtype} {self.out_shape}; got {out.dtype} "
                             f"{tuple(out.shape)}")
        if lse is None and not need_lse and keep_workspace:
            lse = _scratch_lse(self)
        if lse is None:
            lse = torch.empty(*self.lse_shape, dtype=torch.float32, device=self.device)
        elif lse.shape != self.lse_shape or lse.dtype != torch.float32 or not lse.is_contiguous():
            raise ValueError(f"lse: expected contiguous float32 {self.lse_shape}; got {lse.dtype} {tuple(lse.shape)}")
        if self.nothing:
            return out, lse
        if self.nothing_attended:
            out.zero_()
            lse.fill_(float("-inf"))
            return out, lse
        if self.sparse:
            sp = sparse_indices.contiguous() if self.indices_copy else sparse_indices
            bt = sl = kv_cache  # unused by the sparse kernel: any tensor pointer will do
        else:
            bt = sp = block_table.contiguous() if self.table_copy else block_table
            sl = seq_lens
        # Both fp8 layouts are read through an e4m3 pointer (ds rows: byte offsets == element offsets).
        kv = kv_cache.view(torch.float8_e4m3fn) if self.ds else kv_cache
        if kv_scale is None:
            kv_scale = torch.ones(1, dtype=torch.float32, device=self.device)
        elif self.kv_scale_view:
            kv_scale = kv_scale.reshape(1).float()
        if self.config.kernel != "tl_dot" and kv.data_ptr() % 16:
            # A cache view off 16-byte alignment: the Gluon kernel's copies cannot take it (rare; this launch
            # keeps the tl.dot kernel from now on). Before the partials are made: its split count may differ.
            self._use(self.fallback)
        while True:
            if self.merge is not None:
                if keep_workspace:
                    pout, plse = _split_partials(self)
                else:
                    T, H, L = self.out_shape
                    pout, plse = _alloc_partials(T, H, self.splits, L, self.device)
            else:
                pout, plse = out, lse  # unused
            if self._launch_main(q_nope, q_pe, kv, bt, sl, sp, kv_scale, out, lse, pout, plse):
                break
        if self.merge is not None:
            self.merge(pout, plse, out, lse)
        return out, lse

    def _launch_main(self, *tensors) -> bool:
        """Launch the main kernel; False where it did not fit and another configuration, perhaps of another split
        count (so other partials), is now prepared instead: the caller makes its partials again and retries."""
        global _LAST_COMPILED
        try:
            _LAST_COMPILED = self.main(*tensors)
            return True
        except Exception as e:  # noqa: BLE001
            # A tile that does not fit this GPU's shared memory (e.g. a smaller part than the H100 the
            # defaults were tuned on): halve BLOCK_N and retry (the Gluon kernel: its smaller tiling, then
            # the tl.dot kernel); the result does not depend on it.
            cfg = self.config
            if type(e).__name__ != "OutOfResources" or cfg.block_n <= 16:
                raise
            if cfg.kernel == "gluon_sm90":
                smaller = [t for t in _hopper().TILINGS if t[0] < cfg.block_n]
                self._use(DecodeConfig(cfg.block_h, smaller[0][0], cfg.num_splits, cfg.num_warps,
                                       smaller[0][1], kernel="gluon_sm90") if smaller else self.fallback)
            elif cfg.kernel != "tl_dot":
                self._use(self.fallback)
            else:
                self._use(DecodeConfig(cfg.block_h, cfg.block_n // 2, cfg.num_splits, cfg.num_warps, cfg.num_stages,
                                       cfg.fp8_qk, cfg.fp16_mma))
            return False
