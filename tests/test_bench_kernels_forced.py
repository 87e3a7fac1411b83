"""benchmarks/bench_kernels.py's forced rows (``tldot_*``, ``wide_*``): which calls get one and with what
configuration, decided on the host (the timings need a GPU)."""

import pytest
import torch
from benchmark_modules import load_benchmark

from mla_inductor.kernels import decode as dk


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_kernels")


@pytest.fixture(autouse=True)
def fresh_choices():
    # choose_config caches its picks per shape and device type: a pick made as on an SM90 GPU (monkeypatched) must
    # not answer another test, and the other way round.
    dk._choose_config_cached.cache_clear()
    yield
    dk._choose_config_cached.cache_clear()


def _call(H, fp8=True, table_width=2):
    """Four query rows over a cache of 8 pages of 16; ``table_width`` pages per block-table row (the kernel's
    host-side bound on the keys: a wide table makes a call as large as choose_config sees it)."""
    g = torch.Generator().manual_seed(0)
    qn = torch.randn(4, H, 512, generator=g, dtype=torch.float32).to(torch.bfloat16)
    qp = torch.randn(4, H, 64, generator=g, dtype=torch.float32).to(torch.bfloat16)
    cache = torch.randn(8, 16, 576, generator=g).to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
    table = torch.arange(4 * table_width, dtype=torch.int32).reshape(4, table_width) % 8
    c = dict(block_table=table, lens=torch.tensor([20, 30, 5, 32], dtype=torch.int32), scale=0.1)
    return qn, qp, cache, c, torch.ones(1)


# Enough pages per row that 4 rows exceed the (query row, key) pairs up to which bf16 at 16 heads runs the wide
# kernel by default.
_MANY_KEYS = dk.WIDE_FEW_HEADS_MAX_KEYS // (4 * 16) + 1


@pytest.mark.parametrize("mode", ["tldot", "wide"])
def test_no_forced_row_where_it_would_time_the_default_or_cannot_run(bench, mode):
    # On this CPU the default is the tl.dot kernel and no Gluon kernel runs: every forced row is left out.
    with pytest.raises(bench.SameKernel):
        bench._forced(mode, *_call(16, fp8=False), None)


@pytest.mark.parametrize("fp8", [False, True])
def test_the_wide_kernel_forced_on_a_16_head_call_gets_its_own_tiling(bench, monkeypatch, fp8):
    # As on an SM90 GPU: at 16 heads a large bf16 call runs the tl.dot kernel by default and fp8 caches the 16-head
    # Gluon variant; the forced row takes the 64-head Gluon kernel at its own tiling.
    monkeypatch.setattr(dk, "_hopper_kernel_runs_on", lambda device: True)
    qn, qp, cache, c, kv_scale = _call(16, fp8=fp8, table_width=2 if fp8 else _MANY_KEYS)
    default = dk.DecodeLaunch(qn, qp, cache, c["block_table"], c["lens"], c["scale"], kv_scale, None).config
    assert default.kernel == ("gluon_sm90_narrow" if fp8 else "tl_dot")
    cfg = bench._forced("wide", qn, qp, cache, c, kv_scale, None)
    assert (cfg.kernel, cfg.block_h) == ("gluon_sm90", 64)


@pytest.mark.parametrize("H,fp8", [(32, False), (32, True), (16, False)])
def test_no_wide_row_where_the_default_already_is_the_wide_kernel(bench, monkeypatch, H, fp8):
    # As on an SM90 GPU: from 17 heads up every format, and a small bf16 call at 16 heads, already runs the 64-head
    # Gluon kernel by default; there the tl.dot row is the other kernel.
    monkeypatch.setattr(dk, "_hopper_kernel_runs_on", lambda device: True)
    with pytest.raises(bench.SameKernel):
        bench._forced("wide", *_call(H, fp8=fp8), None)
    assert bench._forced("tldot", *_call(H, fp8=fp8), None).kernel == "tl_dot"


def test_an_unknown_row_name_is_refused(bench):
    with pytest.raises(SystemExit, match="--ours: unknown row"):
        bench.main(["--ours=triton_bf16,wide_fp4", "--no-sparse"])


def test_the_default_config_is_passed_through(bench):
    cfg = dk.DecodeConfig(16, 16, 1, 4, 1)
    assert bench._forced(cfg, *_call(32), None) is cfg


def test_the_case_flags_name_dense_and_sparse_shapes(bench):
    argv = ["--cases=1x16x4096,2x8x32768", "--sparse-cases=32x16x16384x2048"]
    assert bench._shapes(argv, "--cases", None) == [(1, 16, 4096), (2, 8, 32768)]
    assert bench._shapes(argv, "--sparse-cases", None) == [(32, 16, 16384, 2048)]
    assert bench._shapes(["--ours-only"], "--sparse-cases", "the default") == "the default"
