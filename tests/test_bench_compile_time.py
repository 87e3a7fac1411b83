"""``benchmarks/bench_compile_time.py`` on the CPU: each way compiles in a process of its own, and the report
has both ways' compile and step times for every layer count (a cell that fails says why)."""

from __future__ import annotations

import json

import pytest

from benchmark_modules import load_benchmark


@pytest.mark.slow
def test_bench_compile_time_compiles_the_whole_step_and_each_layer(tmp_path):
    pytest.importorskip("transformers")
    load_benchmark("report")
    bench = load_benchmark("bench_compile_time")
    bench.main(["--layers", "2", "--out", str(tmp_path)])
    (row,) = json.loads((tmp_path / "bench_compile_time.json").read_text())["rows"]
    assert row["layers"] == 2 and "whole_error" not in row and "per_layer_error" not in row, row
    assert row["whole_graphs"] == 1 and row["per_layer_graphs"] == 2  # the cache routes by layer_idx
    for way in bench.WAYS:
        assert row[f"{way}_compile_s"] > row[f"{way}_step_s"] > 0, row


def test_bench_compile_time_refuses_cudagraphs_on_the_cpu():
    load_benchmark("report")
    bench = load_benchmark("bench_compile_time")
    with pytest.raises(SystemExit, match="--cudagraphs needs --device cuda"):
        bench.main(["--cudagraphs"])
