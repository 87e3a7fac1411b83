"""Tests of the Triton MLA paged-decode kernels (mla_inductor/kernels/decode.py).

Without CUDA the kernels run in Triton's interpreter; the interpreter is chosen when ``@triton.jit``
runs (triton's own helpers too), so tests/conftest.py sets TRITON_INTERPRET=1 before anything
imports triton.

Comparisons: the naive float64 per-row loop (tests/naive.py) and the project's reference. Outputs are poisoned with NaN
before every run and checked fully written; inputs are fresh random draws (never zeros).
"""
import math

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

triton = pytest.importorskip("triton", reason="the Triton kernels' tests need triton (torch's CUDA builds bring it; "
                                              "on CPU: pip install triton, whose interpreter runs them)")

from mla_inductor.kernels import decode as tk  # noqa: E402
from mla_inductor.kernels.decode import DecodeConfig, triton_paged_decode  # noqa: E402
from triton_support import INTERPRETER_OK, interpreter_active  # noqa: E402


def _interpreter_active() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tk._mla_decode_kernel, InterpretedFunction) and interpreter_active()


CPU_OK = HAS_CUDA or (_interpreter_active() and INTERPRETER_OK)
DEV = "cuda" if HAS_CUDA else "cpu"
cpu_only = pytest.mark.skipif(not CPU_OK, reason="needs a GPU, or Triton >= 3.8's interpreter with TRITON_INTERPRET=1 "
                                                 f"set before triton is imported (tests/conftest.py does); "
                                                 f"found triton {triton.__version__}")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")

from mla_inductor.cache import pack_fp8_ds_mla  # noqa: E402
from mla_inductor.reference import paged_decode_reference  # noqa: E402
from naive import naive_decode as naive_reference  # noqa: E402


# ----------------------------------------------------------------------------- helpers
def rel_l2(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    den = b.norm()
    return float((a - b).norm() / den) if den > 0 else float((a - b).norm())


def make_case(B, Q, H, L, R, page, seq_lens, dtype=torch.bfloat16, kv="same", seed=0, extra_pages=3,
              device=DEV, q_strided=False, cache_gain=1.0):
    """Random inputs; pages scattered, block-table tail filled with -1 garbage. ``cache_gain`` scales the
    cache's values (before quantization)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    npages = [(int(n) + page - 1) // page for n in seq_lens]
    max_pages = max(1, max(npages))
    total = sum(npages) + extra_pages
    perm = torch.randperm(total, generator=g)
    bt = torch.full((B, max_pages + 1), -1, dtype=torch.int32)
    off = 0
    for b in range(B):
        bt[b, :npages[b]] = perm[off:off + npages[b]].int()
        off += npages[b]
    T = B * Q
    qd = dtype if dtype != "fp8" else torch.bfloat16
    if q_strided:
        # Non-contiguous token/head strides (last dim contiguous), built on the target device.
        bign = (torch.randn(H + 3, T, L + 8, generator=g) * 0.5).to(qd).to(device)
        qn = bign[:H, :, :L].transpose(0, 1)
        bigp = (torch.randn(T, 2 * H, R, generator=g) * 0.5).to(qd).to(device)
        qp = bigp[:, ::2]
    else:
        qn = (torch.randn(T, H, L, generator=g) * 0.5).to(qd).to(device)
        qp = (torch.randn(T, H, R, generator=g) * 0.5).to(qd).to(device)
    raw = torch.randn(total, page, L + R, generator=g) * cache_gain
    kv_scale = torch.tensor([1.0], dtype=torch.float32)
    if kv == "same":
        cache = raw.to(qd)
    elif kv == "fp8":
        kv_scale = (raw.abs().amax() / 448.0).reshape(1).float()
        cache = (raw / kv_scale).to(torch.float8_e4m3fn)
    elif kv == "ds":
        cache = pack_fp8_ds_mla(raw)
    else:
        cache = raw.to(kv)
    d = dict(q_nope=qn, q_pe=qp, kv_cache=cache.to(device), block_table=bt.to(device),
             seq_lens=seq_lens.to(device), softmax_scale=1.0 / math.sqrt(L + R), kv_scale=kv_scale.to(device))
    return d


def run_checked(case, sparse_indices=None, config=None, poison_partials=True):
    """Run the kernel into NaN-poisoned outputs (and workspace); return (out, lse)."""
    T, H, L = case["q_nope"].shape
    dev = case["q_nope"].device
    out = torch.full((T, H, L), float("nan"), dtype=case["q_nope"].dtype, device=dev)
    lse = torch.full((T, H), float("nan"), dtype=torch.float32, device=dev)
    orig = tk._alloc_partials

    def poisoned(*a, **k):
        po, pl = orig(*a, **k)
        return po.fill_(float("nan")), pl.fill_(float("nan"))

    if poison_partials:
        tk._alloc_partials = poisoned
    try:
        o, s = tk._paged_decode_impl(**case, sparse_indices=sparse_indices, config=config, out=out, lse=lse)
    finally:
        tk._alloc_partials = orig
    assert o.data_ptr() == out.data_ptr()
    assert not torch.isnan(o).any(), "output not fully written (NaN poison survived)"
    assert not torch.isnan(s).any(), "lse not fully written (NaN poison survived)"
    return o, s


TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 1e-2, "fp8": 5e-3, "ds": 5e-3}
if not HAS_CUDA:
    # Triton's interpreter converts fp32 -> bf16 by truncation, not round-to-nearest, which doubles the
    # rounding error of P and of the stored output (measured: 3.3e-3 vs 1.6e-3 rel L2 on randn).
    TOL = {k: (v if k is torch.float32 else 2 * v) for k, v in TOL.items()}


def check(case, sparse_indices=None, config=None, tol=1e-2, lse_atol=2e-3):
    out, lse = run_checked(case, sparse_indices, config)
    ref_o, ref_l = naive_reference(**case, sparse_indices=sparse_indices)
    empty = torch.isinf(ref_l)
    assert torch.equal(torch.isinf(lse.cpu()), empty), "empty rows must give lse = -inf exactly there"
    assert (lse.cpu()[empty] < 0).all()
    assert (out.cpu()[empty] == 0).all(), "empty rows must give out = 0"
    if (~empty).any():
        err = rel_l2(out.cpu()[~empty], ref_o[~empty])
        assert err < tol, f"out rel L2 {err:.2e} >= {tol:.1e}"
        lerr = (lse.cpu()[~empty].double() - ref_l[~empty]).abs().max().item()
        assert lerr < lse_atol, f"lse max abs err {lerr:.2e}"
    po, pl = paged_decode_reference(**case, sparse_indices=sparse_indices)
    if (~empty).any():
        err = rel_l2(out.cpu()[~empty], po.cpu()[~empty])
        assert err < tol, f"vs project reference: out rel L2 {err:.2e}"
        lerr = (lse.cpu()[~empty].double() - pl.cpu()[~empty].double()).abs().max().item()
        assert lerr < lse_atol, f"vs project reference: lse err {lerr:.2e}"
    return out, lse


def cfg(bh=16, bn=16, ns=1, warps=4, stages=1):
    return DecodeConfig(bh, bn, ns, warps, stages)


# ----------------------------------------------------------------------------- CPU (interpreter) tests
# Real L/R (512+64 or 256+32) run fast enough in the interpreter at these sizes.
@cpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dense_dtypes(dtype):
    c = make_case(B=3, Q=1, H=16, L=512, R=64, page=16, seq_lens=[37, 16, 5], dtype=dtype, seed=1)
    check(c, config=cfg(ns=1), tol=TOL[dtype])
    check(c, config=cfg(ns=3), tol=TOL[dtype])


@cpu_only
@pytest.mark.parametrize("H,L,R", [(1, 256, 32), (20, 512, 64), (40, 256, 64)])
def test_heads_not_multiple_of_block(H, L, R):
    c = make_case(B=2, Q=1, H=H, L=L, R=R, page=8, seq_lens=[19, 33], seed=H)
    check(c, config=cfg(bh=16, ns=2), tol=TOL[torch.bfloat16])


@cpu_only
def test_edge_seq_lens_page_boundaries():
    # 0 tokens, 1 token, exactly one page, one past a page, two pages.
    c = make_case(B=5, Q=1, H=16, L=256, R=32, page=16, seq_lens=[0, 1, 16, 17, 32], seed=2)
    out, lse = check(c, config=cfg(ns=2))
    assert torch.isinf(lse[0]).all() and (out[0] == 0).all()


@cpu_only
@pytest.mark.parametrize("page", [1, 7])
def test_odd_page_sizes(page):
    c = make_case(B=2, Q=1, H=16, L=256, R=32, page=page, seq_lens=[23, 9], seed=3 + page)
    check(c, config=cfg(bn=16, ns=2))


@cpu_only
def test_mtp_causal_q_gt_1():
    # Q=3 new tokens; the second sequence has fewer cached tokens than Q (first rows see nothing).
    c = make_case(B=2, Q=3, H=16, L=256, R=32, page=8, seq_lens=[21, 2], seed=4)
    out, lse = check(c, config=cfg(ns=2))
    assert torch.isinf(lse[3]).all()


@cpu_only
def test_b1_long_many_splits():
    c = make_case(B=1, Q=1, H=16, L=256, R=32, page=16, seq_lens=[200], seed=5)
    check(c, config=cfg(bn=32, ns=5))
    # More splits than the merge takes per step (16), some of them past the sequence's 13 tiles (empty), and
    # more columns than one merge program writes (128).
    check(c, config=cfg(bn=16, ns=20))
    check(c)  # default config


@cpu_only
def test_config_replace():
    assert cfg(ns=3).with_kernel("gluon_sm90").kernel == "gluon_sm90"
    assert repr(cfg(ns=3).replace(num_splits=5)) == repr(cfg(ns=5))
    with pytest.raises(TypeError):
        cfg().replace(splits=2)  # not a field


@cpu_only
def test_strided_query():
    c = make_case(B=2, Q=2, H=16, L=256, R=32, page=8, seq_lens=[13, 30], seed=6, q_strided=True)
    assert not c["q_nope"].is_contiguous() and c["q_nope"].stride(-1) == 1
    check(c, config=cfg(ns=2))


@cpu_only
@pytest.mark.parametrize("ns,bh", [(1, 16), (2, 16), (2, 64)])
def test_fp8_per_tensor(ns, bh):
    # bh=64 takes the kernel's path without the transposed second load (the wgmma path on GPU).
    c = make_case(B=2, Q=1, H=20, L=512, R=64, page=16, seq_lens=[40, 7], dtype="fp8", kv="fp8", seed=7)
    check(c, config=cfg(bh=bh, ns=ns), tol=TOL["fp8"])


@cpu_only
@pytest.mark.parametrize("ns", [1, 3])
def test_fp8_ds_mla(ns):
    c = make_case(B=2, Q=2, H=20, L=512, R=64, page=8, seq_lens=[30, 11], dtype="fp8", kv="ds", seed=8)
    assert c["kv_cache"].dtype == torch.uint8 and c["kv_cache"].shape[-1] == 656
    check(c, config=cfg(ns=ns), tol=TOL["ds"])


@pytest.mark.slow
@cpu_only
@pytest.mark.parametrize("kv", ["same", "fp8", "ds"])
@pytest.mark.parametrize("qk", ["swap", "reload", "trans"])
def test_qk_variants(kv, qk):
    # Every way the kernel can feed K to the logits product computes the same function.
    dt = torch.bfloat16 if kv == "same" else "fp8"
    c = make_case(B=2, Q=1, H=16, L=512, R=64, page=16, seq_lens=[33, 18], dtype=dt, kv=kv, seed=14)
    tol = TOL[torch.bfloat16] if kv == "same" else TOL[kv]
    check(c, config=DecodeConfig(16, 16, 2, 4, 1, fp8_qk=qk, fp16_mma=(kv != "fp8")), tol=tol)


def _sparse_indices(case, topk, seed, pad_rows=(), pad_frac=0.3, device=DEV):
    g = torch.Generator().manual_seed(seed)
    bt, sl = case["block_table"].cpu(), case["seq_lens"].cpu()
    T = case["q_nope"].shape[0]
    B = bt.shape[0]
    Q = T // B
    page = case["kv_cache"].shape[1]
    idx = torch.full((T, topk), -1, dtype=torch.int32)
    for r in range(T):
        b = r // Q
        n = int(sl[b])
        if r in pad_rows or n == 0:
            continue
        pos = torch.randperm(n, generator=g)[:topk]
        slots = (bt[b, pos // page].long() * page + pos % page).int()
        keep = torch.rand(len(slots), generator=g) > pad_frac
        keep[0] = True
        slots = torch.where(keep, slots, torch.full_like(slots, -1))
        idx[r, :len(slots)] = slots[torch.randperm(len(slots), generator=g)]
    return idx.to(device)


@cpu_only
@pytest.mark.parametrize("kind", ["bf16", "ds"])
def test_sparse(kind):
    dt, kv = (torch.bfloat16, "same") if kind == "bf16" else ("fp8", "ds")
    c = make_case(B=3, Q=1, H=16, L=512, R=64, page=16, seq_lens=[50, 64, 9], dtype=dt, kv=kv, seed=9)
    idx = _sparse_indices(c, topk=40, seed=10, pad_rows=(1,))
    out, lse = check(c, sparse_indices=idx, config=cfg(ns=2), tol=TOL[torch.bfloat16 if kind == "bf16" else "ds"])
    assert torch.isinf(lse[1]).all() and (out[1] == 0).all()
    check(c, sparse_indices=idx, config=cfg(ns=1), tol=TOL[torch.bfloat16 if kind == "bf16" else "ds"])


@cpu_only
@pytest.mark.parametrize("kernel", ["gluon_sm90", "gluon_sm90_narrow"])
@pytest.mark.parametrize("seq_lens", [[40, 7], [100, 7]])
def test_a_gluon_launch_short_of_shared_memory_falls_back_to_the_tl_dot_kernel(kernel, seq_lens, monkeypatch):
    # A GPU with less shared memory than the H100 the Gluon tilings were written for: the launch raises
    # OutOfResources, and the call ends on the tl.dot kernel (the wide kernel first tries its smaller tiling).
    # At 100 keys the tl.dot kernel's own configuration splits the keys where the asked one does not: the call's
    # partials are made for the configuration that runs.
    c = make_case(B=2, Q=1, H=16, L=512, R=64, page=16, seq_lens=seq_lens, dtype="fp8", kv="fp8", seed=3)
    config = (DecodeConfig(64, 64, 1, 8, 2, kernel=kernel) if kernel == "gluon_sm90"
              else DecodeConfig(16, 64, 1, 4, 1, kernel=kernel))
    monkeypatch.setattr(tk, "_hopper_kernel_runs_on", lambda device: True)  # as if on an SM90 GPU
    launch = tk.DecodeLaunch(**c, config=config)
    assert launch.config.kernel == kernel

    class OutOfResources(Exception):  # what Triton raises, matched by name
        pass

    tried = []

    def short_of_shared_memory(launch_of):
        inner = launch_of.main

        def call(*tensors):
            tried.append(launch_of.config.kernel)
            if launch_of.config.kernel != "tl_dot":
                raise OutOfResources("shared memory")
            return inner(*tensors)
        return call

    original_use = tk.DecodeLaunch._use

    def use(self, cfg):
        original_use(self, cfg)
        self.main = short_of_shared_memory(self)

    monkeypatch.setattr(tk.DecodeLaunch, "_use", use)
    launch._use(launch.config)
    out, lse = launch(c["q_nope"], c["q_pe"], c["kv_cache"], c["block_table"], c["seq_lens"], c["kv_scale"])
    assert tried[0] == kernel and tried[-1] == "tl_dot" and launch.config.kernel == "tl_dot"
    # At 16 heads the fallback is the tl.dot kernel's own configuration for the call (a config given for 64 heads
    # per program, the tl.dot kernel's own tiling there, keeps its splits).
    own = tk.tl_dot_config(2, 16, c["block_table"].shape[1] * 16, c["q_nope"].device)
    assert repr(launch.config) == repr(own)
    assert own.num_splits == (1 if seq_lens[0] <= 64 else 2)
    ref_o, ref_lse = naive_reference(**c)
    assert rel_l2(out.float().cpu(), ref_o) < TOL["fp8"]
    assert (lse.cpu().double() - ref_lse).abs().max().item() < 2e-3


@cpu_only
@pytest.mark.parametrize("kernel", ["gluon_sm90", "gluon_sm90_narrow"])
def test_a_gluon_config_off_sm90_is_a_clear_error(kernel):
    if tk._hopper_kernel_runs_on(torch.device(DEV)):
        pytest.skip("this device runs the Gluon kernels")
    c = make_case(B=2, Q=1, H=16, L=512, R=64, page=16, seq_lens=[40, 7], dtype="fp8", kv="fp8", seed=3)
    with pytest.raises(ValueError, match=f"kernel='{kernel}' runs on SM90 GPUs"):
        tk.DecodeLaunch(**c, config=DecodeConfig(16, 64, 1, 4, 1, kernel=kernel))


def _column_strided(t):
    """The same values as ``t`` [rows, cols] in a column-major buffer (stride(1) != 1): the launch copies it."""
    strided = torch.empty(t.shape[::-1], dtype=t.dtype, device=t.device).t()
    strided.copy_(t)
    assert strided.stride(1) != 1 and torch.equal(strided, t)
    return strided


@cpu_only
def test_column_strided_block_table_and_sparse_indices():
    """A block table / sparse index tensor whose rows are not contiguous is copied for the launch, and the
    kernel is told the copy's row stride."""
    c = make_case(B=3, Q=1, H=16, L=512, R=64, page=16, seq_lens=[50, 64, 9], seed=21)
    c["block_table"] = _column_strided(c["block_table"])
    check(c, config=cfg(ns=2))
    idx = _column_strided(_sparse_indices(c, topk=40, seed=22, pad_rows=(1,)))
    check(c, sparse_indices=idx, config=cfg(ns=1))


@cpu_only
def test_fresh_inputs_same_function():
    # Two independent draws through one launch config: guards against anything cached between calls.
    for seed in (11, 12):
        c = make_case(B=2, Q=1, H=16, L=256, R=32, page=4, seq_lens=[10, 27], seed=seed)
        check(c, config=cfg(ns=2))


@cpu_only
def test_public_entry_point_and_default_config():
    c = make_case(B=2, Q=1, H=16, L=512, R=64, page=64, seq_lens=[70, 3], seed=13)
    out, lse = triton_paged_decode(**c)
    ref_o, ref_l = naive_reference(**c)
    assert out.shape == (2, 16, 512) and out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert rel_l2(out, ref_o) < 1e-2


def test_value_errors():
    c = make_case(B=1, Q=1, H=2, L=128, R=32, page=4, seq_lens=[3], device="cpu")
    with pytest.raises(ValueError, match="q_nope"):
        triton_paged_decode(**c)
    c = make_case(B=1, Q=1, H=2, L=256, R=16, page=4, seq_lens=[3], device="cpu")
    with pytest.raises(ValueError, match="q_pe"):
        triton_paged_decode(**c)
    c = make_case(B=1, Q=1, H=2, L=256, R=32, page=4, seq_lens=[3], device="cpu")
    with pytest.raises(ValueError, match="kv_cache"):
        triton_paged_decode(**dict(c, kv_cache=torch.zeros(4, 4, 300, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="kv_cache"):
        triton_paged_decode(**dict(c, kv_cache=c["kv_cache"][..., :100]))
    with pytest.raises(ValueError, match="sparse_indices"):
        triton_paged_decode(**c, sparse_indices=torch.zeros(1, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="block_table"):
        triton_paged_decode(**dict(c, block_table=c["block_table"].long()))


@pytest.mark.slow
@cpu_only
@pytest.mark.parametrize("B,H,ns,tile,one_step", [
    (1, 16, 20, (32, 32), True),      # few (row, head) pairs: every split in one step, narrow column blocks
    (1, 16, 5, (8, 32), True),
    (1, 16, 130, (128, 32), False),   # past 128 splits: a loop
    (32, 16, 2, (2, 256), True),      # from 512 pairs on: whole rows, in one step where ns <= 16
    (32, 16, 20, (16, 256), False),   # and 16 splits a step
])
def test_the_split_merge_spreads_few_rows_over_column_blocks(B, H, ns, tile, one_step):
    """The merge's launch shape (docs/kernels.md, "The split merge"): whole rows from 512 (row, head) pairs;
    below, every split in one step up to 128 (one round trip to memory) and column blocks narrow enough for 256
    programs, at most 16384 partial values a program (a one-step merge of whole rows spills at 128 splits)."""
    c = make_case(B=B, Q=1, H=H, L=256, R=32, page=16, seq_lens=[40] * B, seed=9)
    launch = tk.DecodeLaunch(**c, config=cfg(bn=16, ns=ns))
    assert launch.merge.grid == (B * H, 256 // tile[1], 1)
    assert launch.merge.static_args[1:] == (256, *tile, one_step)
    check(c, config=cfg(bn=16, ns=ns))


@pytest.mark.parametrize("pairs,ns,tile", [
    (16, 64, (64, 32)), (32, 64, (64, 64)), (16, 128, (128, 32)), (64, 128, (128, 128)), (128, 32, (32, 256)),
    (128, 64, (64, 256)), (256, 16, (16, 512)), (256, 32, (32, 512)), (256, 128, (128, 128)), (512, 8, (8, 512)),
    (4096, 2, (2, 512)), (1, 2, (2, 32))])
def test_merge_tiles_at_l512(pairs, ns, tile):
    # The tiles ``bench_kernels.py --merge-tiles`` chooses among (docs/results.md#kernels): 256 programs at the widest
    # column block, at most 16384 values a program (256 pairs of 128 splits: 128 columns, not 512).
    assert tk.merge_tile(pairs, ns, 512) == tile


@pytest.mark.parametrize("L", [512, 256, 66, 100, 20, 576])
def test_merge_column_blocks_tile_the_row_exactly(L):
    for pairs in (1, 7, 64, 300):
        for ns in (2, 9, 64, 128):
            block_s, block_l = tk.merge_tile(pairs, ns, L)
            assert L % block_l == 0 and block_s >= min(ns, 16), (pairs, ns, L, block_s, block_l)


def test_split_heuristic():
    # More work per row than SMs can hide: no split. Few rows: split up to fill the machine.
    assert tk.choose_splits(rows=2048, head_blocks=2, kv_len=4096, block_n=32, slots=132) == 1
    assert tk.choose_splits(rows=1, head_blocks=1, kv_len=4096, block_n=32, slots=132) > 16
    # One long sequence in one head block: up to 128 splits, which fill 128 of 132 SMs.
    assert tk.choose_splits(rows=1, head_blocks=1, kv_len=65536, block_n=64, slots=132) == 128
    ns = tk.choose_splits(rows=64, head_blocks=1, kv_len=4096, block_n=32, slots=264)
    assert 2 <= ns <= 8


def test_split_heuristic_weighs_the_partials_traffic():
    # The Gluon kernels' model (partial_bytes given). One sequence of 128 heads (two 64-head programs per split):
    # without the partials' bytes 64 splits of one tile each fill 128 SMs; with them (131 KB per program against
    # its 74 KB of cache) 32 win, as they did on the GPU. Longer sequences and fewer heads keep theirs.
    def gluon_splits(T, H, S):
        return tk.choose_splits(T, -(-H // 64), S, 64, 132, partial_bytes=T * H * 513 * 4)

    assert tk.choose_splits(1, 2, 4096, 64, 132) == 64
    assert gluon_splits(1, 128, 4096) == 32
    assert (gluon_splits(1, 128, 16384), gluon_splits(1, 64, 32768), gluon_splits(1, 16, 4096)) == (64, 128, 64)
    assert (gluon_splits(2, 128, 4096), gluon_splits(4, 128, 4096)) == (16, 16)
    # Counts weighed: powers of two and whole waves. Twelve sequences of 128 heads (24 programs a split): 5 splits
    # fill one wave of 132 SMs (120 programs); the tl.dot model, every count weighed, takes 11 (two waves).
    assert gluon_splits(12, 128, 16384) == 5 and tk.choose_splits(12, 2, 16384, 64, 132) == 11
    # Three sequences: 22 splits (3 tiles each, 132 programs) were slower than 16 (4 tiles) on the GPU.
    assert gluon_splits(3, 128, 4096) == 16 and tk.choose_splits(3, 2, 4096, 64, 132) == 22
    # From 32 rows up the two models agree at every benchmarked shape (B=32-256, H=8-128, S=1k-128k);
    # below they differ (sparse calls at top-k 2048 up to B=8: one sequence of 128 heads 32 -> 16).
    for T in (32, 64, 128, 256):
        for H in (8, 16, 32, 64, 128):
            for S in (1024, 4096, 8192, 32768, 131072):
                assert gluon_splits(T, H, S) == tk.choose_splits(T, -(-H // 64), S, 64, 132), (T, H, S)
                if H <= 16:  # the 16-head variant (fp8 caches): 16 heads per program, two programs per SM
                    assert tk.choose_splits(T, 1, S, 64, 264, partial_bytes=T * H * 513 * 4) == \
                        tk.choose_splits(T, 1, S, 64, 264), (T, H, S)
    assert (gluon_splits(1, 128, 2048), tk.choose_splits(1, 2, 2048, 64, 132)) == (16, 32)
    assert gluon_splits(8, 64, 2048) != tk.choose_splits(8, 1, 2048, 64, 132)
    # Partials dear enough: one sequence is not split at all.
    assert tk.choose_splits(1, 2, 4096, 64, 132, partial_bytes=10**9) == 1


# ----------------------------------------------------------------------------- GPU tests
@gpu
@needs_cuda
@pytest.mark.parametrize("H,kv", [(1, "bf16"), (16, "bf16"), (20, "bf16"), (40, "bf16"), (64, "bf16"),
                                  (128, "bf16"), (16, "fp8"), (40, "fp8"), (128, "fp8"), (16, "ds"), (128, "ds")])
def test_gpu_dense_deepseek_dims(H, kv):
    dt, kvk = (torch.bfloat16, "same") if kv == "bf16" else ("fp8", "fp8" if kv == "fp8" else "ds")
    c = make_case(B=3, Q=1, H=H, L=512, R=64, page=64, seq_lens=[1000, 1, 64 * 7 + 1], dtype=dt, kv=kvk, seed=H)
    check(c, tol=TOL[torch.bfloat16 if kv == "bf16" else kv])          # default config
    check(c, config=DecodeConfig(64 if H > 32 else 16, 32, 3, 8 if H > 32 else 4, 2),
          tol=TOL[torch.bfloat16 if kv == "bf16" else kv])


@gpu
@needs_cuda
@pytest.mark.parametrize("page,Q", [(1, 1), (7, 2), (16, 4), (64, 2)])
def test_gpu_pages_mtp(page, Q):
    c = make_case(B=4, Q=Q, H=16, L=256, R=32, page=page, seq_lens=[0, 3, 300, 129], seed=page)
    check(c)
    c = make_case(B=4, Q=Q, H=128, L=512, R=64, page=page, seq_lens=[0, 3, 300, 129], dtype="fp8", kv="fp8",
                  seed=page + 1)
    check(c, tol=TOL["fp8"])


@gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["bf16", "ds"])
def test_gpu_sparse(kind):
    dt, kv = (torch.bfloat16, "same") if kind == "bf16" else ("fp8", "ds")
    c = make_case(B=4, Q=1, H=128, L=512, R=64, page=64, seq_lens=[3000, 640, 5, 2048], dtype=dt, kv=kv, seed=21)
    idx = _sparse_indices(c, topk=512, seed=22, pad_rows=(2,))
    check(c, sparse_indices=idx, tol=TOL[torch.bfloat16 if kind == "bf16" else "ds"])


@gpu
@needs_cuda
def test_gpu_long_sequence():
    # 131072 tokens: exercises many splits and 64-bit row offsets over a ~150 MB cache.
    S = 131072
    c = make_case(B=1, Q=1, H=16, L=512, R=64, page=64, seq_lens=[S], seed=31, extra_pages=1)
    out, lse = run_checked(c)
    kv = c["kv_cache"].float()
    rows = kv[c["block_table"][0, : S // 64].long()].reshape(S, -1)
    q = torch.cat([c["q_nope"][0].float(), c["q_pe"][0].float()], -1)
    s = (q @ rows.T) * c["softmax_scale"]
    ref = torch.softmax(s, -1) @ rows[:, :512]
    assert rel_l2(out[0], ref) < 1e-2
    assert (lse[0].double() - torch.logsumexp(s, -1).double()).abs().max() < 2e-3


@gpu
@needs_cuda
def test_gpu_cuda_graph_capture():
    c = make_case(B=8, Q=1, H=128, L=512, R=64, page=64, seq_lens=[700] * 8, dtype="fp8", kv="fp8", seed=41)
    c["seq_lens"].fill_(500)
    triton_paged_decode(**c)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = triton_paged_decode(**c)
    c["seq_lens"].copy_(torch.tensor([700] * 8, dtype=torch.int32))
    c["kv_scale"].mul_(2.0)
    g.replay()
    torch.cuda.synchronize()
    ref_o, _ = naive_reference(**c)
    assert rel_l2(out, ref_o) < TOL["fp8"]


# ----------------------------------------------------------------------------- the Gluon kernel (SM90)
def _sm90_with_gluon() -> bool:
    from mla_inductor.kernels import decode_hopper

    return HAS_CUDA and torch.cuda.get_device_capability() == (9, 0) and decode_hopper.HAVE_GLUON


needs_sm90 = pytest.mark.skipif(not _sm90_with_gluon(), reason="needs an SM90 GPU and a Triton with Gluon")


def poison_unread(case):
    """NaN into every cache slot no sequence reaches (pages past a sequence's length, unused pages)."""
    cache, bt, lens = case["kv_cache"], case["block_table"].cpu(), case["seq_lens"].cpu()
    page = cache.shape[1]
    keep = torch.zeros(cache.shape[0] * page, dtype=torch.bool)
    for b in range(bt.shape[0]):
        n = int(lens[b])
        pages = bt[b, :(n + page - 1) // page].long()
        keep[(pages[:, None] * page + torch.arange(page)[None, :]).reshape(-1)[:n]] = True
    rows = cache.view(-1, cache.shape[-1])
    drop = (~keep).to(cache.device)
    if rows.dtype == torch.float8_e4m3fn:
        rows.view(torch.uint8)[drop] = 0x7F  # e4m3fn NaN
    elif rows.dtype == torch.uint8:
        rows[drop] = 0x7F  # fp8_ds_mla: e4m3 NaN latents, scales and rope values of ~3.4e38
    else:
        rows[drop] = float("nan")


@gpu
@needs_sm90
@pytest.mark.parametrize("kv,dtype", [("same", torch.bfloat16), ("same", torch.float16), ("fp8", "fp8"),
                                      ("ds", "fp8"), ("ds", torch.float16)])  # (fp16 q: its rope part goes bf16)
@pytest.mark.parametrize("H", [16, 40, 128])  # (16: the default for small dense 16-bit calls, 48 rows empty)
@pytest.mark.parametrize("tiling", [(64, 2), (32, 3)])
@pytest.mark.parametrize("page,Q,ns", [(64, 1, 1), (7, 2, 3), (1, 1, 2), (16, 4, 1)])
def test_gpu_hopper_kernel(kv, dtype, H, tiling, page, Q, ns):
    c = make_case(B=3, Q=Q, H=H, L=512, R=64, page=page, seq_lens=[700, 0, 64 * 3 + 5], dtype=dtype, kv=kv,
                  seed=H + page)
    poison_unread(c)
    config = DecodeConfig(64, tiling[0], ns, 8, tiling[1], kernel="gluon_sm90")
    check(c, config=config, tol=TOL[kv if kv in ("fp8", "ds") else dtype])
    launch = tk.DecodeLaunch(**c, config=config)
    assert launch.config.kernel == "gluon_sm90"


@gpu
@needs_sm90
def test_gpu_hopper_kernel_is_the_default_where_it_covers_the_call():
    c = make_case(B=2, Q=1, H=128, L=512, R=64, page=64, seq_lens=[300, 4000], seed=5)
    poison_unread(c)
    assert tk.DecodeLaunch(**c).config.kernel == "gluon_sm90"
    check(c)
    idx = _sparse_indices(c, topk=256, seed=6)
    assert tk.DecodeLaunch(**c, sparse_indices=idx).config.kernel == "gluon_sm90"
    ds = make_case(B=2, Q=1, H=128, L=512, R=64, page=64, seq_lens=[300, 4000], dtype="fp8", kv="ds", seed=7)
    assert tk.DecodeLaunch(**ds).config.kernel == "gluon_sm90"
    check(ds, tol=TOL["ds"])
    for kv, dtype, seed in (("same", torch.bfloat16, 13), ("fp8", "fp8", 14), ("ds", "fp8", 15)):
        # 32 heads (DeepSeek-V3 at tensor parallel 4): the 64-head kernel, half of each product empty.
        h32 = make_case(B=3, Q=1, H=32, L=512, R=64, page=64, seq_lens=[300, 4000, 65], dtype=dtype, kv=kv, seed=seed)
        poison_unread(h32)
        assert tk.DecodeLaunch(**h32).config.kernel == "gluon_sm90"
        check(h32, tol=TOL[kv if kv != "same" else dtype])
    for dtype, seed in ((torch.bfloat16, 8), (torch.float16, 9)):
        # 16 heads on a 16-bit cache, few (row, key) pairs: the 64-head kernel, 48 of its 64 rows empty; many: the
        # tl.dot kernel.
        small = make_case(B=2, Q=1, H=16, L=512, R=64, page=64, seq_lens=[300, 4000], dtype=dtype, seed=seed)
        poison_unread(small)
        assert tk.DecodeLaunch(**small).config.kernel == "gluon_sm90"
        check(small, tol=TOL[dtype])
        # Sparse calls at 16 heads keep the tl.dot kernel.
        assert tk.DecodeLaunch(**small, sparse_indices=_sparse_indices(small, topk=256, seed=seed)).config.kernel \
            == "tl_dot"
    many = make_case(B=2, Q=1, H=16, L=512, R=64, page=64, seq_lens=[300, 270000], seed=10)
    poison_unread(many)
    assert tk.DecodeLaunch(**many).config.kernel == "tl_dot"
    check(many)
    small_fp8 = make_case(B=2, Q=1, H=16, L=512, R=64, page=64, seq_lens=[300, 4000], dtype="fp8", kv="fp8", seed=8)
    poison_unread(small_fp8)
    assert tk.DecodeLaunch(**small_fp8).config.kernel == "gluon_sm90_narrow"
    check(small_fp8, tol=TOL["fp8"])


@gpu
@needs_sm90
@pytest.mark.parametrize("kv", ["fp8", "ds"])
@pytest.mark.parametrize("H", [16, 8, 40])
@pytest.mark.parametrize("page,Q,ns", [(64, 1, 1), (7, 2, 3), (1, 1, 2), (16, 4, 1)])
def test_gpu_hopper_narrow_kernel(kv, H, page, Q, ns):
    # The 16-head variant: H=8 leaves half a head block empty, H=40 takes three blocks (the last one half empty).
    c = make_case(B=3, Q=Q, H=H, L=512, R=64, page=page, seq_lens=[700, 0, 64 * 3 + 5], dtype="fp8", kv=kv,
                  seed=H + page + 1)
    poison_unread(c)
    config = DecodeConfig(16, 64, ns, 4, 1, kernel="gluon_sm90_narrow")
    check(c, config=config, tol=TOL[kv])
    assert tk.DecodeLaunch(**c, config=config).config.kernel == "gluon_sm90_narrow"


def poison_unlisted(case, sparse_indices):
    """NaN (or e4m3 / fp8_ds_mla NaN bytes) in every cache slot the sparse call does not list: slot 0 behind
    the -1 padding included."""
    cache = case["kv_cache"]
    listed = sparse_indices[sparse_indices >= 0].long()
    drop = torch.ones(cache.shape[0] * cache.shape[1], dtype=torch.bool, device=cache.device)
    drop[listed] = False
    rows = cache.view(-1, cache.shape[-1])
    if rows.dtype in (torch.float8_e4m3fn, torch.uint8):
        rows.view(torch.uint8)[drop] = 0x7F
    else:
        rows[drop] = float("nan")


@gpu
@needs_sm90
@pytest.mark.parametrize("kind,H,kernel", [("bf16", 40, "gluon_sm90"), ("bf16", 128, "gluon_sm90"),
                                           ("ds", 40, "gluon_sm90"), ("ds", 128, "gluon_sm90"),
                                           ("ds", 16, "gluon_sm90_narrow"), ("ds", 40, "gluon_sm90_narrow")])
@pytest.mark.parametrize("topk,ns", [(512, 1), (200, 3), (1, 1)])
def test_gpu_hopper_kernel_sparse(kind, H, kernel, topk, ns):
    # Slot lists with -1 padding (30% of each row, and row 2 all padding), top-k not a multiple of the tile; one slot
    # a row (a top-k of 1 compiled in as a constant once broke the kernels' compile).
    dt, kv = (torch.bfloat16, "same") if kind == "bf16" else ("fp8", "ds")
    c = make_case(B=4, Q=1, H=H, L=512, R=64, page=64, seq_lens=[3000, 640, 5, 2048], dtype=dt, kv=kv,
                  seed=H + topk)
    idx = _sparse_indices(c, topk=topk, seed=23, pad_rows=(2,))
    poison_unlisted(c, idx)
    config = (DecodeConfig(64, 64, ns, 8, 2, kernel=kernel) if kernel == "gluon_sm90"
              else DecodeConfig(16, 64, ns, 4, 1, kernel=kernel))
    assert tk.DecodeLaunch(**c, sparse_indices=idx, config=config).config.kernel == kernel
    out, lse = check(c, sparse_indices=idx, config=config, tol=TOL[torch.bfloat16 if kind == "bf16" else "ds"])
    assert torch.isinf(lse[2]).all() and (out[2] == 0).all()


@gpu
@needs_sm90
@pytest.mark.parametrize("kv,q_gain,cache_gain,seed", [("fp8", 2e5, 1.0, 12), ("ds", 1.0, 1e5, 11)])
@pytest.mark.parametrize("H,kernel", [(128, "gluon_sm90"), (16, "gluon_sm90_narrow")])
def test_gpu_hopper_kernel_values_beyond_fp16(kv, q_gain, cache_gain, seed, H, kernel):
    # The Gluon kernel computes fp8 products in fp16 with q (fp8_e4m3) or q and the dequantized cache
    # (fp8_ds_mla) at 2^-8 of their values: values of ~1e5 (past fp16's 65504) must not overflow. The logits are
    # then ~1e4 and the softmax nearly one-hot: out is compared as usual, lse relative to its size.
    c = make_case(B=2, Q=1, H=H, L=512, R=64, page=64, seq_lens=[700, 129], dtype="fp8", kv=kv, seed=seed,
                  cache_gain=cache_gain)
    c["q_nope"] = c["q_nope"] * q_gain
    c["q_pe"] = c["q_pe"] * q_gain
    poison_unread(c)
    assert tk.DecodeLaunch(**c).config.kernel == kernel
    out, lse = run_checked(c)
    ref_o, ref_l = naive_reference(**c)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert rel_l2(out.cpu(), ref_o) < TOL[kv]
    assert ((lse.cpu().double() - ref_l).abs() <= 1e-3 * ref_l.abs()).all()


@gpu
@needs_sm90
def test_gpu_hopper_kernel_leaves_an_unaligned_cache_to_the_tl_dot_kernel():
    c = make_case(B=2, Q=1, H=128, L=512, R=64, page=64, seq_lens=[300, 1000], seed=9)
    cache = c["kv_cache"]
    flat = torch.empty(cache.numel() + 1, dtype=cache.dtype, device=cache.device)
    flat[1:].copy_(cache.reshape(-1))
    c["kv_cache"] = flat[1:].view(cache.shape)  # rows 2 bytes off 16-byte alignment
    launch = tk.DecodeLaunch(**c)
    assert launch.config.kernel == "gluon_sm90"
    out, _ = launch(**{k: v for k, v in c.items() if k != "softmax_scale"})
    assert launch.config.kernel == "tl_dot"
    ref, _ = naive_reference(**c)
    assert rel_l2(out.cpu(), ref) < TOL[torch.bfloat16]


# ----------------------------------------------------------------------------- as a backend of the op
@cpu_only
def test_backend_through_the_op_eager_and_compiled():
    """prefer_backends("triton"): eager calls and the compiled graph both run our kernel."""
    import mla_inductor
    import mla_inductor.lowering  # noqa: F401  installs the pass
    from torch._inductor.utils import run_and_get_code

    c = make_case(B=2, Q=1, H=16, L=256, R=32, page=8, seq_lens=[21, 9], seed=51)
    args = (c["q_nope"], c["q_pe"], c["kv_cache"], c["block_table"], c["seq_lens"], c["softmax_scale"],
            c["kv_scale"])
    want, _ = paged_decode_reference(*args)

    def step(*a):
        return torch.ops.mla.paged_decode(*a)

    with mla_inductor.prefer_backends("triton"):
        assert rel_l2(step(*args), want) < TOL[torch.bfloat16]
        torch._dynamo.reset()
        got, code = run_and_get_code(torch.compile(step, fullgraph=True), *args)
    # Compiled without CUDA graphs: the op that keeps the split-KV workspace per stream, as eager calls do, and
    # (mla.paged_decode reads no lse) writes the lse into the kept scratch. No dispatcher: the call site's own
    # callable (static sizes)
    assert "= extern_kernels.mla_direct.mla_triton.decode_out_keeping_workspace.site_default_" in code[0]
    assert rel_l2(got, want) < TOL[torch.bfloat16]


@cpu_only
def test_call_site_finds_the_launch_of_each_stride_layout():
    """The compiled op's call-site callable (``_DecodeSite``) keys its prepared launches by the tensors' strides
    (shapes and dtypes are the site's): q given as slices of one [T, H, L+R] row and as separate tensors,
    same shapes, each gets its own launch and the reference's result."""
    from mla_inductor.backends.triton import _DecodeSite

    site = _DecodeSite(keep_workspace=True)
    for q_strided in (False, True, False):
        c = make_case(B=2, Q=1, H=16, L=256, R=32, page=8, seq_lens=[21, 9], seed=52, q_strided=q_strided)
        args = (c["q_nope"], c["q_pe"], c["kv_cache"], c["block_table"], c["seq_lens"], c["softmax_scale"],
                c["kv_scale"])
        out, lse = site(*args, None, [])
        want, want_lse = paged_decode_reference(*args)
        assert rel_l2(out, want) < TOL[torch.bfloat16] and rel_l2(lse, want_lse) < 1e-3
    assert len(site.launches) == 2


@gpu
@needs_cuda
def test_gpu_compiled_step_calls_our_op():
    """On a GPU the pass substitutes our op for mla.paged_decode, and the compiled step is correct."""
    import mla_inductor
    import mla_inductor.lowering  # noqa: F401  installs the pass
    from torch._inductor.utils import run_and_get_code

    c = make_case(B=4, Q=1, H=128, L=512, R=64, page=64, seq_lens=[1000, 1, 64, 300], seed=61)
    args = (c["q_nope"], c["q_pe"], c["kv_cache"], c["block_table"], c["seq_lens"], c["softmax_scale"],
            c["kv_scale"])

    def step(*a):
        return torch.ops.mla.paged_decode(*a)

    with mla_inductor.prefer_backends("triton"):
        torch._dynamo.reset()
        got, code = run_and_get_code(torch.compile(step, fullgraph=True), *args)
    assert "= extern_kernels.mla_direct.mla_triton.decode_out_keeping_workspace.site_default_" in "\n".join(code)
    assert rel_l2(got, paged_decode_reference(*args)[0]) < TOL[torch.bfloat16]
