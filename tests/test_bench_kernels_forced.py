"""benchmarks/bench_kernels.py's forced rows (``tldot_*``, ``wide_bf16``): which calls get one and with what
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


def _call(H, fp8=True):
    g = torch.Generator().manual_seed(0)
    qn = torch.randn(4, H, 512, generator=g, dtype=torch.float32).to(torch.bfloat16)
    qp = torch.randn(4, H, 64, generator=g, dtype=torch.float32).to(torch.bfloat16)
    cache = torch.randn(8, 16, 576, generator=g).to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
    c = dict(block_table=torch.arange(8, dtype=torch.int32).reshape(4, 2),
             lens=torch.tensor([20, 30, 5, 32], dtype=torch.int32), scale=0.1)
    return qn, qp, cache, c, torch.ones(1)


@pytest.mark.parametrize("mode", ["tldot", "wide"])
def test_no_forced_row_where_it_would_time_the_default_or_cannot_run(bench, mode):
    # On this CPU the default is the tl.dot kernel and no Gluon kernel runs: every forced row is left out.
    with pytest.raises(bench.SameKernel):
        bench._forced(mode, *_call(16, fp8=False), None)


def test_the_wide_kernel_forced_on_a_16_head_bf16_call_gets_its_own_tiling(bench, monkeypatch):
    # As on an SM90 GPU: bf16 at 16 heads runs the tl.dot kernel by default; the forced row takes the 64-head
    # Gluon kernel at its own tiling.
    monkeypatch.setattr(dk, "_hopper_kernel_runs_on", lambda device: True)
    cfg = bench._forced("wide", *_call(16, fp8=False), None)
    assert (cfg.kernel, cfg.block_h) == ("gluon_sm90", 64)


@pytest.mark.parametrize("H,fp8", [(32, True), (32, False), (16, True)])
def test_no_wide_row_where_the_default_already_is_a_gluon_kernel(bench, monkeypatch, H, fp8):
    # As on an SM90 GPU: from 17 heads up every format, and fp8 at 16 heads (the 16-head variant), already runs a
    # Gluon kernel by default.
    monkeypatch.setattr(dk, "_hopper_kernel_runs_on", lambda device: True)
    with pytest.raises(bench.SameKernel):
        bench._forced("wide", *_call(H, fp8=fp8), None)


def test_the_default_config_is_passed_through(bench):
    cfg = dk.DecodeConfig(16, 16, 1, 4, 1)
    assert bench._forced(cfg, *_call(32), None) is cfg
