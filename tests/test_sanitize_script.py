"""benchmarks/sanitize_backends.py: it skips cleanly without a GPU, and every case it runs under
compute-sanitizer is a valid call (the contract's CPU value checks accept it) whose unused memory is
a trap (the reference still gives finite outputs where something is attended)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmark_modules import load_benchmark
from mla_inductor.contract import check_decode_args, check_decode_values

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "sanitize_backends.py"


def _load():
    return load_benchmark("sanitize_backends")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_runs_and_skips_without_a_gpu():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "no CUDA GPU" in result.stdout


def test_every_case_is_a_valid_call_with_trapped_unused_memory():
    module = _load()
    cases = module.all_cases("cpu")
    assert {"edge:all_lengths_0_no_pages-bf16", "edge:batch_0-fp8_ds_mla", "edge:table_width_0-fp8_e4m3",
            "edge:sparse_all_padding-bf16", "edge:q4_short_lengths-fp8_ds_mla"} <= set(cases)
    for i, (name, (make, _)) in enumerate(cases.items()):
        x = make(i)
        check_decode_args(*x.args())
        check_decode_values(x.q_nope, x.kv_cache, x.block_table, x.seq_lens, x.kv_scale, x.sparse_indices)
        unused = torch.arange(x.block_table.shape[1])[None, :] * x.kv_cache.shape[1] >= x.seq_lens.long()[:, None]
        assert bool((x.block_table[unused] < 0).all() or (x.block_table[unused] >= x.kv_cache.shape[0]).all()), name


@pytest.mark.parametrize("name", ["lens_0_1_63_64_65_300", "q4_longer_than_sequence", "page1_odd_lengths",
                                  "sparse_bf16_topk128_h16", "edge:all_lengths_0_no_pages-bf16",
                                  "edge:batch_0-fp8_e4m3", "edge:sparse_topk_0-fp8_ds_mla"])
def test_small_cases_run_on_the_reference(name):
    module = _load()
    from mla_inductor.backends import get_backend

    make, all_paths = module.all_cases("cpu")[name]
    assert module.check_decode(get_backend("reference"), make(0), all_paths).startswith("ok")


def test_a_wrong_result_is_a_mismatch():
    """What makes the script exit 1: a row that sees nothing given anything but out 0 / lse -inf (even a
    value too small to move the relative error), or an output far from the reference."""
    module = _load()
    from mla_inductor.reference import paged_decode_reference

    x = module.all_cases("cpu")["edge:some_lengths_0-bf16"][0](0)
    out, lse = paged_decode_reference(*x.args())
    assert module.judge(out, lse, out, lse).startswith("ok")
    empty = torch.isinf(lse[:, 0]).nonzero()[0, 0]
    bad_out = out.clone()
    bad_out[empty, 0, 0] = 1e-6
    assert module.judge(bad_out, lse, out, lse).startswith("MISMATCH")
    bad_lse = lse.clone()
    bad_lse[empty] = 0.0
    assert module.judge(out, bad_lse, out, lse).startswith("MISMATCH")
    assert module.judge(out * 2, lse, out, lse).startswith("MISMATCH")
