"""The Hopper (SM90) MLA paged-decode kernel, written in Gluon (Triton's explicit-layout dialect).

Same arguments and outputs as ``decode._mla_decode_kernel`` for dense calls on bf16/fp16 and fp8_e4m3 caches
with L=512, R=64 and 64 heads per program (``decode.DecodeLaunch`` launches either; the split merge is
shared). What it does that the ``tl.dot`` kernel cannot express (docs/triton_notes.md, "Open"):

* The two warpgroups of the program split every product by columns (warps [4, 2]): the logits tile by key
  and the [64, 512] fp32 output by latent column. Triton's ``tl.dot`` chain gave both warpgroups the whole
  logits tile (1.53x the useful tensor work at H=128).
* P goes to shared memory once and both warpgroups read it as the A operand of the output product; the
  row max and sum cross the warpgroups through Gluon's reductions.
* Each KV tile is copied once (cp.async, 16 bytes per copy) into the wgmma operand layout and read by both
  products straight from shared memory: K^T through a transposed view for the logits, the first 512
  columns as V. STAGES - 1 tiles are in flight while one is computed.
* fp8_e4m3 tiles land in staging buffers and are widened once per tile to fp16 (one cvt per pair; q is
  pre-scaled by 2^-8 so fp16 cannot overflow) into the tile both products read; the per-tensor scale goes
  onto the logits and the output.

Keys past a row's range, and slots outside the cache, are never read: their copies are predicated off and
land as zeros, and their logits are -inf. A row that sees no key writes out 0 and lse -inf.
Gluon has no interpreter: CPU tests compile this kernel for SM90 (``tests/test_decode_hopper.py``), GPU tests
run it against the reference.
"""
from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

    from mla_inductor._compat import gluon_async_load, gluon_cta_barrier

    _cp_async = gluon_async_load(async_copy)
    _cta_barrier = gluon_cta_barrier(gl)
    HAVE_GLUON = True
except Exception:  # noqa: BLE001 - Triton without Gluon's Hopper ops: the tl.dot kernel runs everywhere
    HAVE_GLUON = False

# The shapes the kernel is written for; decode.DecodeLaunch checks a call against them.
HEADS_PER_PROGRAM = 64
L_DIM, R_DIM = 512, 64
NUM_WARPS = 8
# (BLOCK_N, STAGES): the default (decode.choose_config's tiling at 64 heads: ~225 KB of shared memory, one
# program per SM on an H100/H200), then the fallback for parts with less shared memory.
TILINGS = ((64, 2), (32, 3))

if HAVE_GLUON:
    @gluon.jit
    def _load_tile(KV, BT, b, start, hi, stride_kv_row, stride_bt_b, num_slots, kn_buf, kr_buf,
                   L: gl.constexpr, R: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
                   ld_layout: gl.constexpr):
        """cp.async of the cache rows of keys [start, start + BLOCK_N) into kn_buf (latent) / kr_buf (rope); keys
        past ``hi`` or on slots outside the cache are never read and land as zeros."""
        offs_n = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_layout))
        tmask = offs_n < hi
        page = gl.load(BT + b.to(gl.int64) * stride_bt_b + offs_n // PAGE_SIZE, mask=tmask, other=0)
        slot = page * PAGE_SIZE + offs_n % PAGE_SIZE
        valid = tmask & (slot >= 0) & (slot < num_slots)
        slot = gl.where(valid, slot, 0)
        row = KV + slot.to(gl.int64) * stride_kv_row
        offs_l = gl.arange(0, L, layout=gl.SliceLayout(0, ld_layout))
        _cp_async(kn_buf, row[:, None] + offs_l[None, :], mask=valid[:, None])
        offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, ld_layout))
        _cp_async(kr_buf, row[:, None] + L + offs_r[None, :], mask=valid[:, None])

    @gluon.jit
    def mla_decode_hopper(
        QN, QP, KV, BT, SEQ, SPARSE, KV_SCALE,
        OUT, LSE, POUT, PLSE,
        qk_scale,
        stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,
        stride_kv_row,
        stride_bt_b, stride_sp_t,
        num_slots,
        H, Q_PER_SEQ, TOPK,
        L: gl.constexpr, R: gl.constexpr, PAGE_SIZE: gl.constexpr,
        BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, NUM_SPLITS: gl.constexpr,
        KV_MODE: gl.constexpr, IS_SPARSE: gl.constexpr, DOT_PREC: gl.constexpr, EMULATE: gl.constexpr,
        TRANS_LOAD: gl.constexpr, SWAP_QK: gl.constexpr, FP16_MMA: gl.constexpr,
        STAGES: gl.constexpr,
    ):
        gl.static_assert(BLOCK_H == 64)
        gl.static_assert(KV_MODE == 0 or KV_MODE == 1)
        gl.static_assert(not IS_SPARSE)
        # Program order and split ranges as in decode._mla_decode_kernel (one grid, one merge for both kernels);
        # written out again because a Gluon kernel cannot call a @triton.jit helper.
        NUM_HB = gl.cdiv(H, BLOCK_H)
        pid = gl.program_id(0)
        hb = pid % NUM_HB
        rest = pid // NUM_HB
        split = rest % NUM_SPLITS
        row = rest // NUM_SPLITS
        b = row // Q_PER_SEQ
        j = row % Q_PER_SEQ
        kv_len = gl.maximum(gl.load(SEQ + b) - Q_PER_SEQ + j + 1, 0)
        per_split = gl.cdiv(gl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * per_split
        hi = gl.minimum(lo + per_split, kv_len)

        if KV_MODE == 1:
            # e4m3 -> fp16 is one cvt per pair (bf16 needs a detour through fp32); q is pre-scaled by 2^-8 (exact)
            # so fp16 cannot overflow, and qk_scale gives the 2^8 back. The per-tensor scale goes onto the logits
            # and the output.
            cdt: gl.constexpr = gl.float16
            kv_scale = gl.load(KV_SCALE)
            qk_scale = qk_scale * 256.0 * kv_scale
        else:
            cdt: gl.constexpr = QN.dtype.element_ty
        # Layouts. Loads: 16-byte vectors along the latent dim; MMA results: two warpgroups side by side.
        VEC: gl.constexpr = 16 // (KV.dtype.element_ty.primitive_bitwidth // 8)  # elements per 16-byte copy
        ld_layout: gl.constexpr = gl.BlockedLayout([1, VEC], [4, 8], [8, 1], [1, 0])
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, BLOCK_N // 2, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, 256, 16])
        qn_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, L], cdt)
        qr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, R], cdt)
        kn_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, L], cdt)
        kr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, R], cdt)
        p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], cdt)

        qn_smem = gl.allocate_shared_memory(cdt, [BLOCK_H, L], qn_sl)
        qr_smem = gl.allocate_shared_memory(cdt, [BLOCK_H, R], qr_sl)
        p_smem = gl.allocate_shared_memory(cdt, [BLOCK_H, BLOCK_N], p_sl)
        if KV_MODE == 1:
            # The e4m3 tiles land in staging buffers; each tile is widened once into the fp16 tile both products read.
            kdt: gl.constexpr = KV.dtype.element_ty
            kn_stage = gl.allocate_shared_memory(kdt, [STAGES, BLOCK_N, L], gl.NVMMASharedLayout.get_default_for([BLOCK_N, L], kdt))
            kr_stage = gl.allocate_shared_memory(kdt, [STAGES, BLOCK_N, R], gl.NVMMASharedLayout.get_default_for([BLOCK_N, R], kdt))
            kn_wide = gl.allocate_shared_memory(cdt, [BLOCK_N, L], kn_sl)
            kr_wide = gl.allocate_shared_memory(cdt, [BLOCK_N, R], kr_sl)
        else:
            kn_stage = gl.allocate_shared_memory(cdt, [STAGES, BLOCK_N, L], kn_sl)
            kr_stage = gl.allocate_shared_memory(cdt, [STAGES, BLOCK_N, R], kr_sl)

        # q: [64 heads, 512 + 64], rows past H read as zeros.
        offs_h_ld = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_layout))
        hmask_ld = offs_h_ld < H
        offs_l_ld = gl.arange(0, L, layout=gl.SliceLayout(0, ld_layout))
        offs_r_ld = gl.arange(0, R, layout=gl.SliceLayout(0, ld_layout))
        qn = gl.load(QN + row.to(gl.int64) * stride_qn_t + offs_h_ld[:, None] * stride_qn_h + offs_l_ld[None, :],
                     mask=hmask_ld[:, None], other=0.0)
        if KV_MODE == 1:
            qn = (qn.to(gl.float32) * 0.00390625).to(cdt)
        qn_smem.store(qn)
        qp = gl.load(QP + row.to(gl.int64) * stride_qp_t + offs_h_ld[:, None] * stride_qp_h + offs_r_ld[None, :],
                     mask=hmask_ld[:, None], other=0.0)
        if KV_MODE == 1:
            qp = (qp.to(gl.float32) * 0.00390625).to(cdt)
        qr_smem.store(qp)

        n_tiles = gl.cdiv(hi - lo, BLOCK_N)
        for s in gl.static_range(STAGES - 1):
            if s < n_tiles:
                _load_tile(KV, BT, b, lo + s * BLOCK_N, hi, stride_kv_row, stride_bt_b, num_slots, kn_stage.index(s),
                           kr_stage.index(s), L, R, PAGE_SIZE, BLOCK_N, ld_layout)
            async_copy.commit_group()

        m_i = gl.full([BLOCK_H], -1.0e30, gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BLOCK_H, L], gl.float32, layout=o_layout)
        offs_n_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))

        for i in range(n_tiles):
            stage = i % STAGES
            async_copy.wait_group(STAGES - 2)
            fence_async_shared()
            _cta_barrier()  # tile i visible to both warpgroups; every warp is done with tile i - 1
            nxt = i + STAGES - 1
            if nxt < n_tiles:
                _load_tile(KV, BT, b, lo + nxt * BLOCK_N, hi, stride_kv_row, stride_bt_b, num_slots,
                           kn_stage.index(nxt % STAGES), kr_stage.index(nxt % STAGES), L, R, PAGE_SIZE, BLOCK_N, ld_layout)
            async_copy.commit_group()

            if KV_MODE == 1:
                # Every warp is past the previous tile's products (the barrier above), so the wide tile is free.
                kn_wide.store(kn_stage.index(stage).load(ld_layout).to(cdt))
                kr_wide.store(kr_stage.index(stage).load(ld_layout).to(cdt))
                fence_async_shared()
                _cta_barrier()
                kn = kn_wide
                kr = kr_wide
            else:
                kn = kn_stage.index(stage)
                kr = kr_stage.index(stage)
            s_acc = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
            s_acc = warpgroup_mma(qn_smem, kn.permute((1, 0)), s_acc, use_acc=False, is_async=True)
            s_acc = warpgroup_mma(qr_smem, kr.permute((1, 0)), s_acc, is_async=True)
            s_acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_acc, ))

            t = lo + i * BLOCK_N + offs_n_s
            qk = gl.where((t < hi)[None, :], s_acc * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(qk, 1))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            p_smem.store(p.to(cdt))
            fence_async_shared()
            _cta_barrier()
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            acc = warpgroup_mma(p_smem, kn, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))

        async_copy.wait_group(0)
        empty = l_i == 0.0
        inv = gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, l_i))
        if KV_MODE == 1:
            inv = inv * kv_scale
        lse2 = gl.where(empty, float("-inf"), m_i + gl.log2(gl.where(empty, 1.0, l_i)))
        inv_o = gl.convert_layout(inv, gl.SliceLayout(1, o_layout))
        out = acc * inv_o[:, None]
        offs_h_o = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
        offs_l_o = gl.arange(0, L, layout=gl.SliceLayout(0, o_layout))
        hmask_o = offs_h_o < H
        offs_h_s = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, s_layout))
        hmask_s = offs_h_s < H
        if NUM_SPLITS == 1:
            o_ptr = OUT + row.to(gl.int64) * H * L + offs_h_o[:, None] * L + offs_l_o[None, :]
            gl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=hmask_o[:, None])
            gl.store(LSE + row.to(gl.int64) * H + offs_h_s, lse2 * 0.6931471805599453, mask=hmask_s)
        else:
            ph_o = (row.to(gl.int64) * H + offs_h_o) * NUM_SPLITS + split
            gl.store(POUT + ph_o[:, None] * L + offs_l_o[None, :], out, mask=hmask_o[:, None])
            ph_s = (row.to(gl.int64) * H + offs_h_s) * NUM_SPLITS + split
            gl.store(PLSE + ph_s, lse2, mask=hmask_s)
