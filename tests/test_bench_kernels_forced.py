"""benchmarks/bench_kernels.py's forced rows (``tldot_*``, ``wide_*``): which calls get one and with what
configuration, decided on the host (the timings need a GPU)."""

from types import SimpleNamespace

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
    with pytest.raises(SystemExit, match="--ours: expected values among"):
        bench.main(["--ours=triton_bf16,wide_fp4", "--no-sparse"])


def test_the_default_config_is_passed_through(bench):
    cfg = dk.DecodeConfig(16, 16, 1, 4, 1)
    assert bench._forced(cfg, *_call(32), None) is cfg


def test_the_case_flags_name_dense_and_sparse_shapes(bench):
    argv = ["--cases=1x16x4096,2x8x32768", "--sparse-cases=32x16x16384x2048"]
    assert bench._shapes(argv, "--cases", None) == [(1, 16, 4096), (2, 8, 32768)]
    assert bench._shapes(argv, "--sparse-cases", None) == [(32, 16, 16384, 2048)]
    assert bench._shapes(["--ours-only"], "--sparse-cases", "the default") == "the default"


@pytest.mark.parametrize("fp8", [False, True])
def test_a_split_count_row_keeps_the_default_config_but_its_splits(bench, fp8):
    args = _call(16, fp8=fp8)
    cfg = bench._forced(bench.SplitChoice(7), *args, None)
    qn, qp, cache, c, kv_scale = args
    own = dk.DecodeLaunch(qn, qp, cache, c["block_table"], c["lens"], c["scale"], kv_scale, None).config
    assert cfg.num_splits == 7 and repr(cfg.replace(num_splits=own.num_splits)) == repr(own)
    assert bench._forced(bench.SplitChoice(5, kernel="tl_dot"), *args, None).kernel == "tl_dot"


@pytest.mark.parametrize("flag", ["--splits=0,8", "--splits=eight", "--splits="])
def test_bad_split_counts_are_refused(bench, flag):
    with pytest.raises(SystemExit, match="--splits: expected positive split counts"):
        bench.main([flag])


@pytest.mark.parametrize("flag,message", [("--kinds=bf17", "--kinds: expected values among"),
                                          ("--kinds=", "--kinds: expected values among"),
                                          ("--kinds=bf16,fp4", "--kinds: expected values among"),
                                          ("--splits-kernel=gluon", "--splits-kernel: expected one of"),
                                          ("--splits-kernel=default,tl_dot", "--splits-kernel: expected one of")])
def test_bad_split_kinds_and_kernels_are_refused(bench, flag, message):
    with pytest.raises(SystemExit, match=message):
        bench.main(["--splits=8", flag])


def test_the_split_sweep_times_each_count_and_the_default_once(bench, monkeypatch, tmp_path):
    # The loop of --splits, its timings stubbed (they need a GPU): one line per case, format and split count, the
    # default's own count timed once (as the default), each row's config handed to _ours as a SplitChoice.
    import triton.testing

    def case(B, H, S):
        return dict(B=B, H=H, S=S, page=64, block_table=torch.zeros(B, S // 64, dtype=torch.int32),
                    cache=torch.zeros(4, 64, 576), q=torch.zeros(B, H, 576))

    asked = []
    default_cfg = dk.choose_config(1, 16, 4096, dk._KV_PLAIN, torch.device("cpu"))
    default_ns = default_cfg.num_splits

    def ours(c, kind, config=None):
        # The row's launch, as _prepared hands it over: the default's configuration for the default row (with
        # the kernel's name the choice gives).
        asked.append((kind, config))

        def run():
            return torch.zeros(1)
        if config is None or config.splits is None:
            name = "tl_dot" if config is None or config.kernel == "default" else config.kernel
            run.launch = SimpleNamespace(config=SimpleNamespace(kernel=name, num_splits=default_ns))
        return run, torch.zeros(1), 576

    monkeypatch.setattr(bench.pm, "make_case", case)
    monkeypatch.setattr(bench.pm, "reference", lambda c, cache=None: torch.zeros(1))
    monkeypatch.setattr(bench, "_ours", ours)
    monkeypatch.setattr(bench, "_bench", lambda fn: 0.0123)
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, rep, return_mode: 0.0101)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench, "_kernel_times", lambda fn: {"decode": 7.04, "merge": 3.01})
    counts = sorted({1, 2, default_ns})
    bench.split_sweep([(1, 16, 4096)], counts, str(tmp_path))
    assert [k for k, _ in asked] == [k for k in ("bf16", "fp8", "ds") for _ in counts]
    assert all(cfg is None or (isinstance(cfg, bench.SplitChoice) and cfg.splits != default_ns)
               for _, cfg in asked)
    log = (tmp_path / "bench_kernels_splits.md").read_text()
    assert log.count(f"default (tl_dot, ns={default_ns}): ") == 3 and "12.3 us, in a CUDA graph     10.1 us" in log
    assert log.count("(device us: decode 7.0, merge 3.0)") == 3 * len(counts)  # every row
    asked.clear()
    bench.split_sweep([(1, 16, 4096)], counts, str(tmp_path), kinds=("ds",))
    assert [k for k, _ in asked] == ["ds"] * len(counts)
    # --splits-kernel=tl_dot: every row's choice names the kernel.
    asked.clear()
    bench.split_sweep([(1, 16, 4096)], counts, str(tmp_path), kinds=("bf16",), kernel="tl_dot")
    assert [cfg.kernel for _, cfg in asked] == ["tl_dot"] * len(counts) and asked[0][1].splits is None
    # --sparse-cases: sparse calls too, on the formats a sparse call takes (no fp8_e4m3), through _ours_sparse.
    asked.clear()
    monkeypatch.setattr(bench.pm, "sparse_case", lambda B, H, S, topk: case(B, H, S))
    monkeypatch.setattr(bench, "_ours_sparse", ours)
    bench.split_sweep([], counts, str(tmp_path), sparse_cases=[(1, 16, 4096, 2048)])
    assert [k for k, _ in asked] == [k for k in ("bf16", "ds") for _ in counts]
    log = (tmp_path / "bench_kernels_splits.md").read_text()
    assert log.count("splits sparse B=1 H=16 S=4096 topk=2048 ") == 2 * len(counts)


def test_the_merge_sweep_checks_every_tile_against_torch(bench, tmp_path):
    # --merge-tiles on CPU (the interpreter, timings 0): every tile of each shape runs and matches a torch merge of
    # the same random partials, and merge_tile's own pick is among them, marked once per shape.
    bench.merge_sweep([(2, 3), (3, 20)], str(tmp_path), device="cpu", L=64)
    log = (tmp_path / "bench_kernels_merge.md").read_text().splitlines()[1:-1]
    # 3 splits: 4 a step; 20: 16 and 32 a step; each at 32 and 64 columns.
    assert len(log) == 2 + 2 * 2 and not any("FAILED" in ln for ln in log), log
    assert [ln.split(":")[0] for ln in log if "(merge_tile)" in ln] == [
        "merge pairs=2 splits=3 block_s=4 block_l=32 (merge_tile)",
        "merge pairs=3 splits=20 block_s=32 block_l=32 (merge_tile)"]
    errs = [float(ln.rsplit("err=", 1)[1]) for ln in log]
    assert max(errs) < 1e-2, log
