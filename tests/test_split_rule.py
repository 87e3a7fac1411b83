"""benchmarks/split_rule.py on the committed H200 logs: the figures docs/benchmarks.md (section 1, tenth run) and
decode.PARTIAL_BYTES_PER_TILE's comment quote, recomputed from the logs by today's rule."""

import os

import pytest
from benchmark_modules import load_benchmark

LOGS = os.path.join(os.path.dirname(__file__), "..", "docs", "data", "splits-h200-2026-11-28")


@pytest.fixture(scope="module")
def rule():
    return load_benchmark("split_rule")


def _run(rule, capsys, *args):
    rule.main([os.path.join(LOGS, f"run{i}.md") for i in args[0]] + list(args[1:]))
    return [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("  ")]


def test_the_rule_against_the_shapes_it_was_fitted_on(rule, capsys):
    # bf16, runs 1-3 (17 shapes): the old rule up to 1.31x the fastest count (geomean 1.094x), today's 1.02x
    # (1.001x); 3.5 and 4.0 MB a tile would have left one shape at 1.05x.
    got = _run(rule, capsys, (1, 2, 3), "--formats=bf16", "--bytes-per-tile=3e6,3.5e6,4e6")
    assert got == ["old rule (partials left out, every count): geomean 1.094x, worst 1.31x, 0 untimed",
                   "rule at 3.0 MB a tile: geomean 1.001x, worst 1.02x, 0 untimed",
                   "rule at 3.5 MB a tile: geomean 1.004x, worst 1.05x, 0 untimed",
                   "rule at 4.0 MB a tile: geomean 1.004x, worst 1.05x, 0 untimed"]


def test_the_rule_against_the_shapes_checked_afterwards(rule, capsys):
    # Runs 4-5, not fitted on: two shapes at 1.05x (16 (row, head block) pairs over 16 tiles), the fp8 16-head
    # variant's three at their fastest count.
    rule.main([os.path.join(LOGS, "run4.md"), os.path.join(LOGS, "run5.md")])
    out = capsys.readouterr().out
    today = out[out.index("rule at 3.0 MB"):]
    assert today.count("1.05x the fastest") == 2 and today.count("1.00x the fastest") == 5
    assert "B=8 H=128 S=1024 bf16: picks 4 (19.0 us" in today and "B=2 H=16 S=8192 fp8 : picks 64 (13.6 us" in today
