"""The Hopper (SM90) MLA paged-decode kernels, written in Gluon (Triton's explicit-layout dialect).

Same arguments and outputs as ``decode._mla_decode_kernel`` for dense and sparse calls on bf16/fp16, fp8_e4m3
and fp8_ds_mla caches with L=512, R=64 and 64 heads per program (``decode.DecodeLaunch`` launches either; the split
merge is shared). What it does that the ``tl.dot`` kernel cannot express (docs/kernels.md, "The Hopper kernels"):

* The two warpgroups of the program split every product by columns (warps [4, 2]): the logits tile by key
  and the [64, 512] fp32 output by latent column. Triton's ``tl.dot`` chain gave both warpgroups the whole
  logits tile, half of it wasted work.
* P goes to shared memory once and both warpgroups read it as the A operand of the output product. The row
  max is reduced within each warpgroup and the two halves exchanged through a small shared buffer (one
  barrier); the row sum stays per warpgroup until the end (both rescale by the same factor). Gluon's
  reductions across the row cost two barriers each: three barriers per tile instead of six.
* bf16/fp16: each KV tile is copied once (cp.async, 16 bytes per copy) into the wgmma operand layout and read
  by both products straight from shared memory: K^T through a transposed view for the logits, the first 512
  columns as V. STAGES - 1 tiles are in flight while one is computed.
* fp8_e4m3: warp-specialized. A fourth warpgroup (a Gluon worker partition held to fewer registers than the two
  consumer warpgroups) loads each tile to registers (16-byte loads) and widens it to fp16 (one cvt per pair; q is
  pre-scaled by 2^-8 so fp16 cannot overflow) into one of two wide tiles while the consumers run the logits,
  softmax and P V on the other; mbarriers hand the tiles over (ready: widened; free: the consumers' last product
  on it is done). The tile after next is prefetched into L2. The per-tensor scale goes onto the logits and the
  output.
* fp8_ds_mla: the same pipeline; each tile's latent part is dequantized (its four per-128-value scales applied
  in fp16 arithmetic) into fp16 at 2^-8 of its value, q too, so values up to ~1.6e7 stay finite; its bf16 rope
  part is copied as stored (cp.async, no registers) and multiplied by q's rope part in bf16 at 2^-16; the logits
  get 2^16 back and the output 2^8.

``mla_decode_hopper_narrow`` is its variant for few heads (16 per program) on fp8 caches: one warpgroup, the
products swapped so the keys fill wgmma's 64 rows (logits^T = K q^T, out^T += V^T P^T), two programs per SM.

Keys past a row's range, and slots outside the cache, are never read: their copies are predicated off and
load as zeros. Keys past the range (and in sparse calls -1 padding and slots outside the cache) get logits
-inf; a dense block-table entry within the row's length is trusted. A row that sees no key writes out 0 and
lse -inf. Sparse calls read each row's slot list where dense calls read the block table.
Gluon has no interpreter: CPU tests compile this kernel for SM90 (``tests/test_decode_hopper.py``), GPU tests
run it against the reference.
"""
from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                   warpgroup_mma_wait)

    from mla_inductor._compat import gluon_async_load, gluon_cta_barrier, gluon_kernels_compile, gluon_smem_reinterpret

    if not gluon_kernels_compile(gl):
        raise ImportError("this Triton's Gluon predates the forms these kernels are written in")
    _cp_async = gluon_async_load(async_copy)
    _cta_barrier = gluon_cta_barrier(gl)
    _smem_reinterpret = gluon_smem_reinterpret(gl)
    HAVE_GLUON = True
except Exception:  # noqa: BLE001 - Triton without (a recent enough) Gluon: the tl.dot kernel runs everywhere
    HAVE_GLUON = False

# The shapes the kernel is written for; decode.DecodeLaunch checks a call against them.
HEADS_PER_PROGRAM = 64
L_DIM, R_DIM = 512, 64
NUM_WARPS = 8
# (BLOCK_N, STAGES): the default (decode.choose_config's tiling at 64 heads: ~225 KB of shared memory, one
# program per SM on an H100/H200), then the fallback for parts with less shared memory.
TILINGS = ((64, 2), (32, 3))
# The 16-head variant (mla_decode_hopper_narrow): keys per tile (wgmma's M), heads per program, warps.
NARROW_BLOCK_N, NARROW_BLOCK_H, NARROW_NUM_WARPS = 64, 16, 4

if HAVE_GLUON:
    # The slot lookup as in decode._mla_decode_kernel, written out again: a Gluon kernel cannot call a @triton.jit
    # helper.
    @gluon.jit
    def _slots(table, b, offs_n, hi, table_stride, num_slots, PAGE_SIZE: gl.constexpr, IS_SPARSE: gl.constexpr):
        """Cache slots of keys ``offs_n`` (any layout) of row ``b`` of ``table`` and whether each is attended: keys
        past ``hi`` and slots outside the cache (sparse -1 padding among them) are not, and are never read.
        Dense calls: ``table`` is the block table (one entry per page); sparse calls: the slot list itself."""
        in_range = offs_n < hi
        if IS_SPARSE:
            slot = gl.load(table + b.to(gl.int64) * table_stride + offs_n, mask=in_range, other=-1)
        else:
            page = gl.load(table + b.to(gl.int64) * table_stride + offs_n // PAGE_SIZE, mask=in_range, other=0)
            slot = page * PAGE_SIZE + offs_n % PAGE_SIZE
        return slot, in_range & (slot >= 0) & (slot < num_slots)

    @gluon.jit
    def _cache_rows(KV, table, b, start, hi, stride_kv_row, table_stride, num_slots, PAGE_SIZE: gl.constexpr,
                    BLOCK_N: gl.constexpr, layout: gl.constexpr, IS_SPARSE: gl.constexpr):
        """Row pointers of keys [start, start + BLOCK_N) in the cache and whether each may be read (``_slots``), as
        a slice of ``layout``."""
        offs_n = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        slot, valid = _slots(table, b, offs_n, hi, table_stride, num_slots, PAGE_SIZE, IS_SPARSE)
        return KV + gl.where(valid, slot, 0).to(gl.int64) * stride_kv_row, valid

    @gluon.jit
    def _attended(table, b, start, hi, table_stride, num_slots, offs_n_s, PAGE_SIZE: gl.constexpr,
                  IS_SPARSE: gl.constexpr):
        """Which keys of the tile at ``start`` take part in the softmax, in the logits' column layout. Dense:
        the keys in range (a block-table entry is trusted within the row's length, as by the tl.dot kernel's
        reads); sparse: listed slots inside the cache (another look at the slot list: cheaper than moving the
        copy's mask across layouts, which costs a CTA barrier)."""
        if IS_SPARSE:
            _, attended = _slots(table, b, start + offs_n_s, hi, table_stride, num_slots, PAGE_SIZE, IS_SPARSE)
        else:
            attended = start + offs_n_s < hi
        return attended

    @gluon.jit
    def _load_tile(KV, table, b, start, hi, stride_kv_row, table_stride, num_slots, kn_buf, kr_buf,
                   L: gl.constexpr, R: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
                   ld_layout: gl.constexpr, IS_SPARSE: gl.constexpr):
        """cp.async of the cache rows of keys [start, start + BLOCK_N) into kn_buf (latent) / kr_buf (rope); keys
        past ``hi`` or on slots outside the cache are never read and land as zeros."""
        row, valid = _cache_rows(KV, table, b, start, hi, stride_kv_row, table_stride, num_slots, PAGE_SIZE, BLOCK_N,
                                 ld_layout, IS_SPARSE)
        offs_l = gl.arange(0, L, layout=gl.SliceLayout(0, ld_layout))
        _cp_async(kn_buf, row[:, None] + offs_l[None, :], mask=valid[:, None])
        offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, ld_layout))
        _cp_async(kr_buf, row[:, None] + L + offs_r[None, :], mask=valid[:, None])

    @gluon.jit
    def _load_columns(rows, valid, col0, COLS: gl.constexpr, layout: gl.constexpr):
        """Columns [col0, col0 + COLS) of the cache rows ``rows`` in registers (zeros where not ``valid``)."""
        offs = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
        return gl.load(rows[:, None] + offs[None, :], mask=valid[:, None], other=0.0)

    @gluon.jit
    def _widen_half(rows, ok, kn_wide, kr_wide, HALF: gl.constexpr, L: gl.constexpr, R: gl.constexpr,
                    layout: gl.constexpr, cdt: gl.constexpr, KV_MODE: gl.constexpr, DS_IN_FP16: gl.constexpr):
        """Half ``HALF`` of the cache rows ``rows`` (16-byte loads; zeros where not ``ok``) widened to ``cdt``:
        0 = latent columns [0, L/2) and the rope, 1 = latent columns [L/2, L). e4m3 (KV_MODE 1) is converted;
        fp8_ds_mla (2) is dequantized (``_widen_half_ds_fp16``, latent columns only, if DS_IN_FP16, else
        ``_widen_half_ds_fp32``)."""
        HL: gl.constexpr = L // 2
        if KV_MODE == 1:
            # Every load of the half before its first store: one wait for memory per half.
            x = _load_columns(rows, ok, HALF * HL, HL, layout)
            if HALF == 0:
                rope = _load_columns(rows, ok, L, R, layout)
            kn_wide.slice(HALF * HL, HL, dim=1).store(x.to(cdt))
            if HALF == 0:
                kr_wide.store(rope.to(cdt))
        elif DS_IN_FP16:
            _widen_half_ds_fp16(rows, ok, kn_wide, HALF, L, layout, cdt)
        else:
            _widen_half_ds_fp32(rows, ok, kn_wide, kr_wide, HALF, L, R, layout, cdt)

    @gluon.jit
    def _times_2_to_the_minus_8(x):
        """x * 2^-8 (fp32), opaque to LLVM: a multiply by a constant followed by a truncation to fp16 is otherwise
        rewritten as the truncation followed by an fp16 multiply (seen in the PTX), which overflows for values past
        65504 that the scaling was there to bring into range."""
        return gl.inline_asm_elementwise("mul.rn.f32 $0, $1, 0f3B800000;", "=r,r", [x], dtype=gl.float32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _fp16_factors(scale):
        """Per-row fp32 scales times 2^-8 as three fp16 factors: (hi + lo) * power. power is the power of two
        (clamped to fp16's range, 2^-24 to 2^15: exact); hi + lo the rest (1.m for scales between ~1.5e-5 and
        ~1.6e7) to ~22 bits, so the scale itself adds no error fp16 would see, and fp16 keeps its precision down to
        scales of ~1e-9."""
        power_of_two = (scale.to(gl.int32, bitcast=True) & 0x7F800000).to(gl.float32, bitcast=True)
        power = gl.minimum(gl.maximum(_times_2_to_the_minus_8(power_of_two), 5.960464477539063e-08), 32768.0)
        rest = _times_2_to_the_minus_8(scale) / power
        hi = rest.to(gl.float16)
        return hi, (rest - hi.to(gl.float32)).to(gl.float16), power.to(gl.float16)

    @gluon.jit
    def _times_fp16(x, hi, lo, power):
        """x * (hi + lo) * power (x [rows, cols] fp16; the factors per row) in fp16 arithmetic, three packed
        instructions per pair of values: x * hi + x * lo with one rounding (fma), then times a power of two
        (exact unless the result lands below fp16's normals: what one rounding to fp16 would give there too)."""
        hi = gl.broadcast(hi[:, None], x)[0]
        lo = gl.broadcast(lo[:, None], x)[0]
        power = gl.broadcast(power[:, None], x)[0]
        return gl.inline_asm_elementwise(
            "{ .reg .b32 t; mul.rn.f16x2 t, $1, $2; fma.rn.f16x2 t, $1, $3, t; mul.rn.f16x2 $0, t, $4; }",
            "=r,r,r,r,r", [x, hi, lo, power], dtype=gl.float16, is_pure=True, pack=2)

    @gluon.jit
    def _widen_half_ds_fp16(rows, ok, kn_wide, HALF: gl.constexpr, L: gl.constexpr, layout: gl.constexpr,
                            cdt: gl.constexpr):
        """Half ``HALF`` (as in ``_widen_half``) of the latent columns of fp8_ds_mla cache rows ``rows`` (read
        through an e4m3 pointer: 512 e4m3, four fp32 scales, one per 128 latent values, 64 bf16 rope values, which
        the wide kernel copies as stored) dequantized to fp16 into kn_wide (zeros where not ``ok``), at 2^-8 of
        their value (the caller's choice of range for fp16). The scales are applied here, so the latent products
        are plain fp16 products. e4m3 values are exact in fp16; the scale goes on in fp16 arithmetic
        (``_fp16_factors``, ``_times_fp16``): about half the instructions of ``_widen_half_ds_fp32``, the same single
        rounding to fp16. The widening warpgroup's choice (its work sets the wide kernel's fp8_ds_mla pace)."""
        gl.static_assert(L == 512)
        gl.static_assert(cdt == gl.float16)
        HL: gl.constexpr = L // 2
        sc = (rows + L + 8 * HALF).to(gl.pointer_type(gl.float32), bitcast=True)  # this half's two scales (bytes)
        # The half's two blocks of 128 values (one scale each): every load before the first store (one wait for
        # memory per half).
        x_lo = _load_columns(rows, ok, HALF * HL, 128, layout)
        x_hi = _load_columns(rows, ok, HALF * HL + 128, 128, layout)
        s_lo = gl.load(sc, mask=ok, other=0.0)
        s_hi = gl.load(sc + 1, mask=ok, other=0.0)
        hi, lo, power = _fp16_factors(s_lo)
        kn_wide.slice(HALF * HL, 128, dim=1).store(_times_fp16(x_lo.to(gl.float16), hi, lo, power))
        hi, lo, power = _fp16_factors(s_hi)
        kn_wide.slice(HALF * HL + 128, 128, dim=1).store(_times_fp16(x_hi.to(gl.float16), hi, lo, power))

    @gluon.jit
    def _widen_half_ds_fp32(rows, ok, kn_wide, kr_wide, HALF: gl.constexpr, L: gl.constexpr, R: gl.constexpr,
                       layout: gl.constexpr, cdt: gl.constexpr):
        """Half ``HALF`` (as in ``_widen_half``) of fp8_ds_mla cache rows ``rows`` (read through an e4m3 pointer:
        512 e4m3, four fp32 scales, one per 128 latent values, 64 bf16 rope values) dequantized to ``cdt`` into
        kn_wide / kr_wide (zeros where not ``ok``), at 2^-8 of their value (the caller's choice of range for
        fp16). The scales are applied here, so both products are plain ``cdt`` products. Through fp32 and one store
        per half: the narrow kernel's choice (its widening is not the bottleneck; each store into a slice of a
        buffer costs it a barrier)."""
        gl.static_assert(L == 512)
        HL: gl.constexpr = L // 2
        sc = (rows + L + 8 * HALF).to(gl.pointer_type(gl.float32), bitcast=True)  # this half's two scales (bytes)
        s_lo = gl.load(sc, mask=ok, other=0.0) * 0.00390625
        s_hi = gl.load(sc + 1, mask=ok, other=0.0) * 0.00390625
        cols = gl.arange(0, HL, layout=gl.SliceLayout(0, layout))[None, :]
        scale = gl.where(cols < 128, s_lo[:, None], s_hi[:, None])
        kn_wide.slice(HALF * HL, HL, dim=1).store(
            (_load_columns(rows, ok, HALF * HL, HL, layout).to(gl.float32) * scale).to(cdt))
        if HALF == 0:
            rope = (rows + L + 16).to(gl.pointer_type(gl.bfloat16), bitcast=True)
            kr_wide.store(_times_2_to_the_minus_8(_load_columns(rope, ok, 0, R, layout).to(gl.float32)).to(cdt))

    @gluon.jit
    def _prefetch_l2(rows, ROW_BYTES: gl.constexpr, layout: gl.constexpr):
        """Prefetch the cache rows ``rows`` (ROW_BYTES each, at most 7 lines of 128 bytes) into L2: eight bytes
        per row spread so that every line of it is touched."""
        gl.static_assert(ROW_BYTES <= 7 * 128)
        offs = gl.minimum(gl.arange(0, 8, layout=gl.SliceLayout(0, layout)) * (ROW_BYTES // 7), ROW_BYTES - 1)
        addr = rows.to(gl.int64, bitcast=True)[:, None] + offs[None, :]
        gl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [addr], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _widen_tile(KV, table, b, start, hi, stride_kv_row, table_stride, num_slots, kn_w, kr_w, ready, free, phase,
                    L: gl.constexpr, R: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
                    f_layout: gl.constexpr, pf_layout: gl.constexpr, cdt: gl.constexpr, KV_MODE: gl.constexpr,
                    IS_SPARSE: gl.constexpr):
        """The widening warpgroup's turn for the tile at ``start``: once the consumers have released kn_w / kr_w
        (``free``), its cache rows widened into them (fp8_ds_mla: the rope copied as stored), then ``ready``; then
        the rows of the tile after next (whose turn comes after the consumers' next tile) are prefetched into L2."""
        rows, ok = _cache_rows(KV, table, b, start, hi, stride_kv_row, table_stride, num_slots, PAGE_SIZE, BLOCK_N,
                               f_layout, IS_SPARSE)
        mbarrier.wait(free, phase ^ 1)  # (a buffer's first use passes: its barrier has completed no phase yet)
        if KV_MODE == 2:
            # The bf16 rope values as stored (see the kernel's ROPE_RAW), copied while the latent part is widened.
            rope = (rows + L + 16).to(gl.pointer_type(gl.bfloat16), bitcast=True)
            offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, f_layout))
            _cp_async(kr_w, rope[:, None] + offs_r[None, :], mask=ok[:, None])
            async_copy.commit_group()
        _widen_half(rows, ok, kn_w, kr_w, 0, L, R, f_layout, cdt, KV_MODE, True)
        _widen_half(rows, ok, kn_w, kr_w, 1, L, R, f_layout, cdt, KV_MODE, True)
        if KV_MODE == 2:
            async_copy.wait_group(0)
        fence_async_shared()  # the stores visible to the consumers' wgmma (the async proxy)
        _cta_barrier()  # (this warpgroup's barrier) every warp's stores done before the one arrival
        mbarrier.arrive(ready, count=1)
        if start + 2 * BLOCK_N < hi:
            rows_pf, _ = _cache_rows(KV, table, b, start + 2 * BLOCK_N, hi, stride_kv_row, table_stride, num_slots,
                                     PAGE_SIZE, BLOCK_N, pf_layout, IS_SPARSE)
            _prefetch_l2(rows_pf, L + R if KV_MODE == 1 else L + 16 + 2 * R, pf_layout)

    @gluon.jit
    def _widen_tiles(KV, table, b, lo, hi, stride_kv_row, table_stride, num_slots, kn_a, kr_a, kn_b, kr_b, ready_a,
                     ready_b, free_a, free_b, L: gl.constexpr, R: gl.constexpr, PAGE_SIZE: gl.constexpr,
                     BLOCK_N: gl.constexpr, cdt: gl.constexpr, KV_MODE: gl.constexpr, IS_SPARSE: gl.constexpr):
        """The widening warpgroup (a worker partition of 4 warps): every tile of [lo, hi) in turn into buffer a
        (even tiles) or b (odd tiles), as the consumers release them."""
        f_layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])  # 16-byte loads of e4m3
        pf_layout: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [4, 1], [1, 0])
        n_tiles = gl.cdiv(hi - lo, BLOCK_N)
        for i in range(0, n_tiles, 2):
            phase = (i // 2) & 1
            _widen_tile(KV, table, b, lo + i * BLOCK_N, hi, stride_kv_row, table_stride, num_slots, kn_a, kr_a,
                        ready_a, free_a, phase, L, R, PAGE_SIZE, BLOCK_N, f_layout, pf_layout, cdt, KV_MODE, IS_SPARSE)
            if i + 1 < n_tiles:
                _widen_tile(KV, table, b, lo + (i + 1) * BLOCK_N, hi, stride_kv_row, table_stride, num_slots, kn_b,
                            kr_b, ready_b, free_b, phase, L, R, PAGE_SIZE, BLOCK_N, f_layout, pf_layout, cdt, KV_MODE,
                            IS_SPARSE)

    @gluon.jit
    def _softmax_start(BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, L: gl.constexpr, s_layout: gl.constexpr,
                       o_layout: gl.constexpr):
        """The online softmax's starting state (m_i, l_part, acc) and the key offsets of a logits tile. l_part is
        the row sum per warpgroup ([BLOCK_H, 2], see _softmax_pv), in the layout its per-tile sums come in."""
        m_i = gl.full([BLOCK_H], -1.0e30, gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_part = _per_warpgroup(gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout), gl.sum)
        acc = gl.zeros([BLOCK_H, L], gl.float32, layout=o_layout)
        return m_i, l_part, acc, gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))

    @gluon.jit
    def _attend_wide_tile(qn_smem, qr_smem, p_smem, xchg, kn, kr, ready, free, phase, table, b,
                          start, hi, table_stride, num_slots, m_i, l_part, acc, qk_scale, offs_n_s,
                          PAGE_SIZE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
                          s_layout: gl.constexpr, o_layout: gl.constexpr, IS_SPARSE: gl.constexpr):
        """The consumers' turn for one widened tile (kn / kr, filled once ``ready`` completes ``phase``): logits,
        softmax, P V; then the tile is handed back (``free``) to the widening warpgroup, which has the whole of the
        next tile's turn to widen the one after it."""
        mbarrier.wait(ready, phase)
        s_acc = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
        s_acc = warpgroup_mma(qn_smem, kn.permute((1, 0)), s_acc, use_acc=False, is_async=True)
        s_acc = warpgroup_mma(qr_smem, kr.permute((1, 0)), s_acc, is_async=True)
        attended = _attended(table, b, start, hi, table_stride, num_slots, offs_n_s, PAGE_SIZE, IS_SPARSE)
        s_acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_acc, ))
        m_i, l_part, acc = _softmax_pv(s_acc, kn, p_smem, xchg, m_i, l_part, acc, attended, qk_scale, o_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        _cta_barrier()  # (the consumers' barrier) both warpgroups are past their products on kn / kr
        mbarrier.arrive(free, count=1)
        return m_i, l_part, acc

    @gluon.jit
    def _attend_wide_tiles(qn_smem, qr_smem, p_smem, xchg, kn_a, kr_a, kn_b, kr_b, ready_a, ready_b, free_a, free_b,
                           table, b, lo, hi, table_stride, num_slots, qk_scale, PAGE_SIZE: gl.constexpr,
                           BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, L: gl.constexpr, s_layout: gl.constexpr,
                           o_layout: gl.constexpr, IS_SPARSE: gl.constexpr):
        """The consumers (the default partition, 8 warps): every widened tile of [lo, hi) in turn. Returns
        (m_i, l_part, acc) as the bf16 path's loop leaves them."""
        m_i, l_part, acc, offs_n_s = _softmax_start(BLOCK_H, BLOCK_N, L, s_layout, o_layout)
        n_tiles = gl.cdiv(hi - lo, BLOCK_N)
        for i in range(0, n_tiles, 2):
            phase = (i // 2) & 1
            m_i, l_part, acc = _attend_wide_tile(qn_smem, qr_smem, p_smem, xchg, kn_a, kr_a, ready_a, free_a, phase,
                                                 table, b, lo + i * BLOCK_N, hi, table_stride, num_slots, m_i, l_part,
                                                 acc, qk_scale, offs_n_s, PAGE_SIZE, BLOCK_H, BLOCK_N, s_layout,
                                                 o_layout, IS_SPARSE)
            if i + 1 < n_tiles:
                m_i, l_part, acc = _attend_wide_tile(qn_smem, qr_smem, p_smem, xchg, kn_b, kr_b, ready_b, free_b,
                                                     phase, table, b, lo + (i + 1) * BLOCK_N, hi, table_stride,
                                                     num_slots, m_i, l_part, acc, qk_scale, offs_n_s, PAGE_SIZE,
                                                     BLOCK_H, BLOCK_N, s_layout, o_layout, IS_SPARSE)
        return m_i, l_part, acc

    @gluon.jit
    def _per_warpgroup(x, reduce: gl.constexpr):
        """``x`` [BLOCK_H, BLOCK_N] (the logits layout: the two warpgroups hold a column half each) reduced over
        each warpgroup's own columns: [BLOCK_H, 2], column w from warpgroup w. No data crosses a warp."""
        return reduce(gl.reshape(x, [x.shape[0], 2, x.shape[1] // 2]), 2)

    @gluon.jit
    def _both_halves(part, xchg, like):
        """The two columns of ``part`` ([BLOCK_H, 2], column w held by warpgroup w) as two [BLOCK_H] tensors in
        the layout of ``like``, through the shared buffer ``xchg`` and one CTA barrier. The caller keeps a barrier
        between this exchange and the next write of ``xchg``."""
        xchg.store(gl.permute(part, (1, 0)))  # [2, BLOCK_H]: a half is a row of the buffer
        _cta_barrier()
        # The same bytes as two [BLOCK_H] buffers, each read straight into the row layout.
        halves = _smem_reinterpret(xchg, gl.float32, xchg.shape, gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        return halves.index(0).load(like.type.layout), halves.index(1).load(like.type.layout)

    @gluon.jit
    def _softmax_pv(s_acc, kn, p_smem, xchg, m_i, l_part, acc, attended, qk_scale, o_layout: gl.constexpr):
        """One tile after its logits ``s_acc``: online softmax, P through shared memory to both warpgroups, then
        issues acc += P V with V = the tile's latent columns ``kn``; keys not ``attended`` get no weight.
        Returns (m_i, l_part, acc in flight).

        The row max is reduced within each warpgroup and the two halves exchanged through ``xchg`` (one barrier;
        a plain ``gl.max`` over the row crosses the warps twice). The row sum is kept per warpgroup (``l_part``,
        [BLOCK_H, 2]): both warpgroups rescale by the same alpha, so the halves add up only at the end."""
        qk = gl.where(attended[None, :], s_acc * qk_scale, float("-inf"))
        m_a, m_b = _both_halves(_per_warpgroup(qk, gl.max), xchg, m_i)
        m_new = gl.maximum(m_i, gl.maximum(m_a, m_b))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(qk - m_new[:, None])
        p_smem.store(p.to(p_smem.dtype))
        fence_async_shared()
        _cta_barrier()
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        # Left in flight: the caller waits (after issuing its next loads).
        acc = warpgroup_mma(p_smem, kn, acc, is_async=True)
        l_part = l_part * gl.convert_layout(alpha, gl.SliceLayout(1, l_part.type.layout))[:, None] \
            + _per_warpgroup(p, gl.sum)
        return m_new, l_part, acc

    @gluon.jit
    def _program_range(BT, SEQ, SPARSE, stride_bt_b, stride_sp_t, H, Q_PER_SEQ, TOPK, BLOCK_H: gl.constexpr,
                       BLOCK_N: gl.constexpr, NUM_SPLITS: gl.constexpr, IS_SPARSE: gl.constexpr):
        """This program's (head block, split, query row, table row b, table, table row stride, lo, hi): keys
        [lo, hi) of row ``row``. Program order and split ranges as in decode._mla_decode_kernel (one grid, one
        merge for every kernel); written out again because a Gluon kernel cannot call a @triton.jit helper."""
        NUM_HB = gl.cdiv(H, BLOCK_H)
        pid = gl.program_id(0)
        hb = pid % NUM_HB
        rest = pid // NUM_HB
        split = rest % NUM_SPLITS
        row = rest // NUM_SPLITS
        if IS_SPARSE:
            # Each row lists its own TOPK slots (-1 padding): its keys' table is its row of SPARSE.
            b = row
            table = SPARSE
            table_stride = stride_sp_t
            kv_len = TOPK
        else:
            b = row // Q_PER_SEQ
            j = row % Q_PER_SEQ
            table = BT
            table_stride = stride_bt_b
            kv_len = gl.maximum(gl.load(SEQ + b) - Q_PER_SEQ + j + 1, 0)
        per_split = gl.cdiv(gl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * per_split
        hi = gl.minimum(lo + per_split, kv_len)
        return hb, split, row, b, table, table_stride, lo, hi

    @gluon.jit
    def _stage_query(QN, QP, row, hb, H, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, qn_smem, qr_smem,
                     L: gl.constexpr, R: gl.constexpr, BLOCK_H: gl.constexpr, layout: gl.constexpr,
                     cdt: gl.constexpr, KV_MODE: gl.constexpr, ROPE_RAW: gl.constexpr = False):
        """q of this program's heads ([BLOCK_H, L] and [BLOCK_H, R]) into shared memory as ``cdt``; heads past H
        as zeros. For fp8 caches at 2^-8 of its value (see the kernels' scaling). ROPE_RAW (fp8_ds_mla, whose rope
        tiles are copied as stored, bf16): the rope part in bf16 at 2^-16, the scale of the latent part's products."""
        offs_h = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, layout))
        hmask = offs_h < H
        offs_l = gl.arange(0, L, layout=gl.SliceLayout(0, layout))
        offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, layout))
        qn = gl.load(QN + row.to(gl.int64) * stride_qn_t + offs_h[:, None] * stride_qn_h + offs_l[None, :],
                     mask=hmask[:, None], other=0.0)
        if KV_MODE != 0:
            qn = _times_2_to_the_minus_8(qn.to(gl.float32)).to(cdt)
        qn_smem.store(qn)
        qp = gl.load(QP + row.to(gl.int64) * stride_qp_t + offs_h[:, None] * stride_qp_h + offs_r[None, :],
                     mask=hmask[:, None], other=0.0)
        if ROPE_RAW:
            qp = _times_2_to_the_minus_8(_times_2_to_the_minus_8(qp.to(gl.float32))).to(gl.bfloat16)
        elif KV_MODE != 0:
            qp = _times_2_to_the_minus_8(qp.to(gl.float32)).to(cdt)
        qr_smem.store(qp)

    @gluon.jit
    def _write_result(acc, m_i, l_i, row, hb, split, OUT, LSE, POUT, PLSE, kv_scale, H, L: gl.constexpr,
                      BLOCK_H: gl.constexpr, NUM_SPLITS: gl.constexpr, KV_MODE: gl.constexpr):
        """Normalize ``acc`` ([BLOCK_H, L] fp32, any layout) by the row sums ``l_i`` and write it with the lse
        (from ``m_i``, log2 domain): out / lse, or this split's partials. A row that saw no key writes 0 and
        -inf. ``kv_scale``: the per-tensor scale of an e4m3 cache (KV_MODE 1; unused otherwise)."""
        empty = l_i == 0.0
        inv = gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, l_i))
        if KV_MODE == 1:
            inv = inv * kv_scale
        elif KV_MODE == 2:
            inv = inv * 256.0
        lse2 = gl.where(empty, float("-inf"), m_i + gl.log2(gl.where(empty, 1.0, l_i)))
        inv_o = gl.convert_layout(inv, gl.SliceLayout(1, acc.type.layout))
        out = acc * inv_o[:, None]
        offs_h_o = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, acc.type.layout))
        offs_l_o = gl.arange(0, L, layout=gl.SliceLayout(0, acc.type.layout))
        hmask_o = offs_h_o < H
        offs_h_s = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=m_i.type.layout)
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

    # TOPK (a sparse call's slots per row) is never compiled in as a constant: Triton specializes an int argument
    # equal to 1, and with TOPK = 1 and one split every bound of the key loop is a constant, which Triton 3.6
    # fails to compile ("PassManager::run failed"; both kernels, every cache format).
    @gluon.jit(do_not_specialize=["TOPK"])
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
        gl.static_assert(KV_MODE == 0 or KV_MODE == 1 or KV_MODE == 2)
        hb, split, row, b, table, table_stride, lo, hi = _program_range(
            BT, SEQ, SPARSE, stride_bt_b, stride_sp_t, H, Q_PER_SEQ, TOPK, BLOCK_H, BLOCK_N, NUM_SPLITS, IS_SPARSE)

        if KV_MODE == 1:
            # e4m3 -> fp16 is one cvt per pair (bf16 needs a detour through fp32); q is pre-scaled by 2^-8 (exact)
            # so fp16 cannot overflow, and qk_scale gives the 2^8 back. The per-tensor scale goes onto the logits
            # and the output.
            cdt: gl.constexpr = gl.float16
            kv_scale = gl.load(KV_SCALE)
            qk_scale = qk_scale * 256.0 * kv_scale
        elif KV_MODE == 2:
            # fp8_ds_mla: the tiles are dequantized into fp16 (11 significant bits: the rounding of e4m3 x scale
            # stays well below bf16's) at 2^-8 of their value, q too, so neither can overflow fp16 for values up to
            # ~1.7e7; the logits get 2^16 back and the output 2^8.
            cdt: gl.constexpr = gl.float16
            qk_scale = qk_scale * 65536.0
            kv_scale = 1.0  # (unused)
        else:
            cdt: gl.constexpr = QN.dtype.element_ty
            kv_scale = 1.0  # (unused)
        # Layouts. Loads: 16-byte vectors along the latent dim; MMA results: two warpgroups side by side.
        VEC: gl.constexpr = 16 // (KV.dtype.element_ty.primitive_bitwidth // 8)  # elements per 16-byte copy
        ld_layout: gl.constexpr = gl.BlockedLayout([1, VEC], [4, 8], [8, 1], [1, 0])
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, BLOCK_N // 2, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, 256, 16])
        qn_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, L], cdt)
        # fp8_ds_mla's rope values are bf16 in the cache: their tiles are copied as stored (cp.async), and the rope
        # part of q is bf16 too, at 2^-16 (the latent part's scale: its products add into the same logits).
        ROPE_RAW: gl.constexpr = KV_MODE == 2
        if ROPE_RAW:
            rdt: gl.constexpr = gl.bfloat16
        else:
            rdt: gl.constexpr = cdt
        qr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, R], rdt)
        kn_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, L], cdt)
        kr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, R], rdt)
        p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], cdt)

        qn_smem = gl.allocate_shared_memory(cdt, [BLOCK_H, L], qn_sl)
        qr_smem = gl.allocate_shared_memory(rdt, [BLOCK_H, R], qr_sl)
        p_smem = gl.allocate_shared_memory(cdt, [BLOCK_H, BLOCK_N], p_sl)
        # Where the two warpgroups exchange their halves of the row max (and at the end of the row sum).
        xchg = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))

        _stage_query(QN, QP, row, hb, H, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, qn_smem, qr_smem, L, R,
                     BLOCK_H, ld_layout, cdt, KV_MODE, ROPE_RAW)

        if KV_MODE != 0:
            # e4m3 tiles are widened (fp8_ds_mla tiles dequantized) by a warpgroup of their own (a worker partition
            # with few registers) into one of two wide tiles while the 8 consumer warps compute on the other: the
            # consumers do only the products and the softmax. Handoffs are mbarriers (ready: a tile is widened;
            # free: the consumers are done with it). Two wide tiles take the shared memory of the bf16 path's two
            # cp.async stages. The two are separate allocations and both loops take two tiles a turn so that each
            # tile's buffers are known at compile time (with one [2, ...] buffer, Triton puts a barrier before every
            # store of the widening: it cannot tell the halves apart).
            kn_a = gl.allocate_shared_memory(cdt, [BLOCK_N, L], kn_sl)
            kr_a = gl.allocate_shared_memory(rdt, [BLOCK_N, R], kr_sl)
            kn_b = gl.allocate_shared_memory(cdt, [BLOCK_N, L], kn_sl)
            kr_b = gl.allocate_shared_memory(rdt, [BLOCK_N, R], kr_sl)
            ready_a = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            ready_b = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            free_a = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            free_b = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(ready_a, count=1)
            mbarrier.init(ready_b, count=1)
            mbarrier.init(free_a, count=1)
            mbarrier.init(free_b, count=1)
            fence_async_shared()
            _cta_barrier()  # q staged and the barriers initialized before either partition starts
            # The widening warpgroup's registers per thread: what each format's widening needs without spilling
            # much (ptxas -v). The consumers get the rest of the CTA's 168 x 384 through setmaxnreg (208 a thread
            # with 88 here: their main loop uses up to ~204).
            WIDEN_REGS: gl.constexpr = 96 if KV_MODE == 2 else 88
            m_i, l_part, acc = gl.warp_specialize(
                [(_attend_wide_tiles, (qn_smem, qr_smem, p_smem, xchg, kn_a, kr_a, kn_b, kr_b, ready_a, ready_b,
                                       free_a, free_b, table, b, lo, hi, table_stride, num_slots, qk_scale, PAGE_SIZE,
                                       BLOCK_H, BLOCK_N, L, s_layout, o_layout, IS_SPARSE)),
                 (_widen_tiles, (KV, table, b, lo, hi, stride_kv_row, table_stride, num_slots, kn_a, kr_a, kn_b, kr_b,
                                 ready_a, ready_b, free_a, free_b, L, R, PAGE_SIZE, BLOCK_N, cdt, KV_MODE, IS_SPARSE))],
                [4], [WIDEN_REGS])
        else:
            m_i, l_part, acc, offs_n_s = _softmax_start(BLOCK_H, BLOCK_N, L, s_layout, o_layout)
            n_tiles = gl.cdiv(hi - lo, BLOCK_N)
            kn_stage = gl.allocate_shared_memory(cdt, [STAGES, BLOCK_N, L], kn_sl)
            kr_stage = gl.allocate_shared_memory(cdt, [STAGES, BLOCK_N, R], kr_sl)
            for s in gl.static_range(STAGES - 1):
                if s < n_tiles:
                    _load_tile(KV, table, b, lo + s * BLOCK_N, hi, stride_kv_row, table_stride, num_slots,
                               kn_stage.index(s), kr_stage.index(s), L, R, PAGE_SIZE, BLOCK_N, ld_layout, IS_SPARSE)
                async_copy.commit_group()
            for i in range(n_tiles):
                stage = i % STAGES
                async_copy.wait_group(STAGES - 2)
                fence_async_shared()
                _cta_barrier()  # tile i visible to both warpgroups; every warp is done with tile i - 1
                nxt = i + STAGES - 1
                if nxt < n_tiles:
                    _load_tile(KV, table, b, lo + nxt * BLOCK_N, hi, stride_kv_row, table_stride, num_slots,
                               kn_stage.index(nxt % STAGES), kr_stage.index(nxt % STAGES), L, R, PAGE_SIZE, BLOCK_N,
                               ld_layout, IS_SPARSE)
                async_copy.commit_group()
                kn = kn_stage.index(stage)
                s_acc = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
                s_acc = warpgroup_mma(qn_smem, kn.permute((1, 0)), s_acc, use_acc=False, is_async=True)
                s_acc = warpgroup_mma(qr_smem, kr_stage.index(stage).permute((1, 0)), s_acc, is_async=True)
                attended = _attended(table, b, lo + i * BLOCK_N, hi, table_stride, num_slots, offs_n_s, PAGE_SIZE,
                                     IS_SPARSE)
                s_acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_acc, ))
                m_i, l_part, acc = _softmax_pv(s_acc, kn, p_smem, xchg, m_i, l_part, acc, attended, qk_scale,
                                               o_layout)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            async_copy.wait_group(0)
        # Every warp is past its last read of xchg (the last tile's P barrier lies between).
        l_a, l_b = _both_halves(l_part, xchg, m_i)
        l_i = l_a + l_b
        _write_result(acc, m_i, l_i, row, hb, split, OUT, LSE, POUT, PLSE, kv_scale, H, L, BLOCK_H, NUM_SPLITS,
                      KV_MODE)

    @gluon.jit
    def _per_warp(x, reduce: gl.constexpr):
        """``x`` [BLOCK_N, BLOCK_H] (the narrow kernel's logits^T: warp w holds keys [16w, 16w + 16)) reduced over
        each warp's own keys: [4, BLOCK_H], row w from warp w. No data crosses a warp."""
        return reduce(gl.reshape(x, [4, x.shape[0] // 4, x.shape[1]]), 1)

    @gluon.jit
    def _max_across_warps(part, xchg, like):
        """The column maxima of ``part`` ([4, BLOCK_H], row w held by warp w) in the layout of ``like``, through
        the shared buffer ``xchg`` and one CTA barrier. The caller keeps a barrier between this exchange and the
        next write of ``xchg``."""
        xchg.store(part)
        _cta_barrier()
        rows = _smem_reinterpret(xchg, gl.float32, xchg.shape, gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        return gl.maximum(gl.maximum(rows.index(0).load(like.type.layout), rows.index(1).load(like.type.layout)),
                          gl.maximum(rows.index(2).load(like.type.layout), rows.index(3).load(like.type.layout)))

    # The same arguments as mla_decode_hopper (DecodeLaunch launches either with one argument list).
    @gluon.jit(do_not_specialize=["TOPK"])
    def mla_decode_hopper_narrow(
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
        """Few heads (16 per program), fp8_e4m3 and fp8_ds_mla caches: one warpgroup, both
        products with the keys on wgmma's M side, whose 64 rows few heads cannot fill: logits^T [keys, heads] =
        K q^T and out^T [L, heads] += V^T P^T (V^T read through a transposed view of the same shared tile). Each
        tile is widened (dequantized) to fp16 into the one shared tile, then both products run; two programs
        share an SM (under half of its shared memory each), so one's widening overlaps the other's products. The
        tile after next is prefetched into L2. Same arguments, scaling and outputs as ``mla_decode_hopper``."""
        # (32 heads per program would not fit two programs per SM, and spilled registers.)
        gl.static_assert(BLOCK_H == 16)
        gl.static_assert(BLOCK_N == 64)  # wgmma's M
        gl.static_assert(KV_MODE == 1 or KV_MODE == 2)
        hb, split, row, b, table, table_stride, lo, hi = _program_range(
            BT, SEQ, SPARSE, stride_bt_b, stride_sp_t, H, Q_PER_SEQ, TOPK, BLOCK_H, BLOCK_N, NUM_SPLITS, IS_SPARSE)
        cdt: gl.constexpr = gl.float16
        if KV_MODE == 1:
            kv_scale = gl.load(KV_SCALE)
            qk_scale = qk_scale * 256.0 * kv_scale
        else:
            qk_scale = qk_scale * 65536.0
            kv_scale = 1.0  # (unused)
        q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # 16-byte loads of q
        f_layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])  # 16-byte loads of e4m3 rows
        pf_layout: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [4, 1], [1, 0])
        st_layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])  # the output's stores
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_H, 16])
        qn_smem = gl.allocate_shared_memory(cdt, [BLOCK_H, L], gl.NVMMASharedLayout.get_default_for([BLOCK_H, L], cdt))
        qr_smem = gl.allocate_shared_memory(cdt, [BLOCK_H, R], gl.NVMMASharedLayout.get_default_for([BLOCK_H, R], cdt))
        kn = gl.allocate_shared_memory(cdt, [BLOCK_N, L], gl.NVMMASharedLayout.get_default_for([BLOCK_N, L], cdt))
        kr = gl.allocate_shared_memory(cdt, [BLOCK_N, R], gl.NVMMASharedLayout.get_default_for([BLOCK_N, R], cdt))
        p_smem = gl.allocate_shared_memory(cdt, [BLOCK_N, BLOCK_H],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], cdt))
        # Where the four warps exchange their keys' maxima (see _max_across_warps).
        xchg = gl.allocate_shared_memory(gl.float32, [4, BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        _stage_query(QN, QP, row, hb, H, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, qn_smem, qr_smem, L, R,
                     BLOCK_H, q_layout, cdt, KV_MODE)

        m_i = gl.full([BLOCK_H], -1.0e30, gl.float32, layout=gl.SliceLayout(0, s_layout))
        # The row sums per warp ([4, BLOCK_H]): every warp rescales by the same alpha, so they add up at the end.
        l_part = _per_warp(gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=s_layout), gl.sum)
        acc = gl.zeros([L, BLOCK_H], gl.float32, layout=s_layout)  # out^T
        offs_n_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        rows, ok = _cache_rows(KV, table, b, lo, hi, stride_kv_row, table_stride, num_slots, PAGE_SIZE, BLOCK_N,
                               f_layout, IS_SPARSE)
        for start in range(lo, hi, BLOCK_N):
            _cta_barrier()  # every warp is done with the previous tile's products (waited) before it is overwritten
            _widen_half(rows, ok, kn, kr, 0, L, R, f_layout, cdt, KV_MODE, False)
            _widen_half(rows, ok, kn, kr, 1, L, R, f_layout, cdt, KV_MODE, False)
            rows, ok = _cache_rows(KV, table, b, start + BLOCK_N, hi, stride_kv_row, table_stride, num_slots,
                                   PAGE_SIZE, BLOCK_N, f_layout, IS_SPARSE)
            fence_async_shared()
            _cta_barrier()
            s_acc = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=s_layout)
            s_acc = warpgroup_mma(kn, qn_smem.permute((1, 0)), s_acc, use_acc=False, is_async=True)
            s_acc = warpgroup_mma(kr, qr_smem.permute((1, 0)), s_acc, is_async=True)
            if start + 2 * BLOCK_N < hi:
                rows_pf, _ = _cache_rows(KV, table, b, start + 2 * BLOCK_N, hi, stride_kv_row, table_stride, num_slots,
                                         PAGE_SIZE, BLOCK_N, pf_layout, IS_SPARSE)
                _prefetch_l2(rows_pf, L + R if KV_MODE == 1 else L + 16 + 2 * R, pf_layout)
            attended = _attended(table, b, start, hi, table_stride, num_slots, offs_n_s, PAGE_SIZE, IS_SPARSE)
            s_acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_acc, ))
            qk = gl.where(attended[:, None], s_acc * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, _max_across_warps(_per_warp(qk, gl.max), xchg, m_i))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(qk - m_new[None, :])
            p_smem.store(p.to(cdt))
            fence_async_shared()
            _cta_barrier()
            acc = warpgroup_mma(kn.permute((1, 0)), p_smem, acc * alpha[None, :], is_async=True)
            l_part = l_part * gl.convert_layout(alpha, gl.SliceLayout(0, l_part.type.layout))[None, :] \
                + _per_warp(p, gl.sum)
            m_i = m_new
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        l_i = gl.convert_layout(gl.sum(l_part, 0), m_i.type.layout)
        out = gl.convert_layout(gl.permute(acc, (1, 0)), st_layout)  # [heads, L], rows of L stored contiguously
        _write_result(out, m_i, l_i, row, hb, split, OUT, LSE, POUT, PLSE, kv_scale, H, L, BLOCK_H, NUM_SPLITS,
                      KV_MODE)

    # The kernels by DecodeConfig.kernel name, with the warps each is written for.
    KERNELS = {"gluon_sm90": (mla_decode_hopper, NUM_WARPS),
               "gluon_sm90_narrow": (mla_decode_hopper_narrow, NARROW_NUM_WARPS)}
