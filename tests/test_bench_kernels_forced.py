"""benchmarks/bench_kernels.py's forced rows (``tldot_*``, ``wide_*``, ``narrow_*``): which calls get one and with
what configuration, decided on the host (the timings need a GPU)."""

import pytest
import torch
from benchmark_modules import load_benchmark

from mla_inductor.kernels import decode as dk


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_kernels")


def _call(H):
    g = torch.Generator().manual_seed(0)
    qn = torch.randn(4, H, 512, generator=g, dtype=torch.float32).to(torch.bfloat16)
    qp = torch.randn(4, H, 64, generator=g, dtype=torch.float32).to(torch.bfloat16)
    cache = torch.randn(8, 16, 576, generator=g).to(torch.float8_e4m3fn)
    c = dict(block_table=torch.arange(8, dtype=torch.int32).reshape(4, 2),
             lens=torch.tensor([20, 30, 5, 32], dtype=torch.int32), scale=0.1)
    return qn, qp, cache, c, torch.ones(1)


@pytest.mark.parametrize("mode", ["tldot", "narrow", "wide"])
def test_no_forced_row_where_it_would_time_the_default_or_cannot_run(bench, mode):
    # On this CPU the default is the tl.dot kernel and no Gluon kernel runs: every forced row is left out.
    with pytest.raises(bench.SameKernel):
        bench._forced(mode, *_call(32), None)


@pytest.mark.parametrize("mode,kernel,block_h", [("narrow", "gluon_sm90_narrow", 16), ("wide", "gluon_sm90", 64)])
def test_a_gluon_kernel_forced_at_32_heads_gets_its_own_tiling(bench, monkeypatch, mode, kernel, block_h):
    monkeypatch.setattr(dk, "_hopper_kernel_runs_on", lambda device: True)  # as on an SM90 GPU
    cfg = bench._forced(mode, *_call(32), None)
    assert (cfg.kernel, cfg.block_h) == (kernel, block_h)


def test_the_default_config_is_passed_through(bench):
    cfg = dk.DecodeConfig(16, 16, 1, 4, 1)
    assert bench._forced(cfg, *_call(32), None) is cfg
