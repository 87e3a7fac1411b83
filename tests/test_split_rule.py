"""benchmarks/split_rule.py on the committed H200 logs of `bench_kernels.py --splits` (tests/data/split_logs_h200,
commands in its README): the picks and figures decode.PARTIAL_BYTES_PER_TILE was chosen by, recomputed by today's rule."""

import os

import pytest
from benchmark_modules import load_benchmark

LOGS = os.path.join(os.path.dirname(__file__), "data", "split_logs_h200")


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
    assert got == ["without the partials' term (every count): geomean 1.094x, worst 1.31x, 0 untimed",
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


def test_the_merge_before_and_after_every_split_in_one_step(rule, capsys):
    # The logs' README: the same --splits command on the build before (16 splits a step)
    # and twice on the build after (every split in one step below 512 (row, head) pairs).
    names = ("merge-before", "merge-after-1", "merge-after-2")
    rule.main(["--compare"] + [os.path.join(LOGS, f"{n}.md") for n in names])
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 12
    assert ("B=1 H=64 S=32768 bf16 default: 34.1 -> 26.7 (0.78x), 26.9 (0.79x); mla_decode_hopper 21.3 -> 21.5, "
            "21.3; _mla_merge_kernel 11.2 -> 4.1, 4.2") in out
    assert "B=1 H=128 S=4096 bf16 default: 16.5 -> 15.2 (0.92x), 15.3 (0.93x)" in out[0]
    # Two splits a (row, head) pair's one-step shape never changed: the same time.
    assert "B=2 H=128 S=4096 bf16 default: 21.8 -> 21.9 (1.00x), 21.9 (1.00x)" in "\n".join(out)


def test_the_rule_on_the_new_merge(rule, capsys):
    # Runs 9-10, on the new merge: the rule as it was (3.0 MB a tile) within 1.12x of the fastest count (geomean
    # 1.020x); the misses are the rows where the cheaper merge now favours more splits.
    got = _run(rule, capsys, (9, 10), "--bytes-per-tile=3e6,4.5e6,6e6,9e6")
    assert got[1:] == ["rule at 3.0 MB a tile: geomean 1.020x, worst 1.12x, 0 untimed",
                       "rule at 4.5 MB a tile: geomean 1.020x, worst 1.12x, 0 untimed",
                       "rule at 6.0 MB a tile: geomean 1.018x, worst 1.13x, 0 untimed",
                       "rule at 9.0 MB a tile: geomean 1.018x, worst 1.13x, 0 untimed"]


def test_compare_needs_two_logs(rule):
    with pytest.raises(SystemExit, match="--compare: expected a log before"):
        rule.main(["--compare", os.path.join(LOGS, "run1.md")])


def test_the_rule_on_sparse_calls(rule, capsys):
    # Run 7: sparse calls (top-k 2048 of 16k keys), which took the partials term untimed: the old rule up to 1.25x
    # the fastest count (B=2, B=4 at 64 heads: 32 splits where 16 win), today's up to 1.08x (B=4 H=128: 8 where
    # 16 win).
    got = _run(rule, capsys, (7,), "--formats=sparse-bf16,sparse-ds")
    assert got == ["without the partials' term (every count): geomean 1.107x, worst 1.25x, 0 untimed",
                   "rule at 3.0 MB a tile: geomean 1.019x, worst 1.08x, 0 untimed"]


def test_the_merge_tiles_against_the_sweep(rule, capsys):
    # The logs' README: merge_tile's pick against the fastest tile of bench_kernels.py
    # --merge-tiles at each shape (the sweep the rule was chosen on): the fastest or within 2% at 8 of 10,
    # 1.07x and 1.12x at 256 pairs.
    rule.main(["--merge", os.path.join(LOGS, "merge-tiles-1.md")])
    out = capsys.readouterr().out.splitlines()
    ratios = [float(ln.split("us, ")[1].split("x)")[0]) for ln in out]
    assert len(out) == 10 and sorted(ratios)[-3:] == [1.02, 1.07, 1.12] and max(sorted(ratios)[:7]) == 1.0
    assert "pairs=16 splits=64: picks (64, 32) (2.3 us, 1.00x)" in out[0]


def test_the_merge_column_blocks_before_and_after(rule, capsys):
    # merge-tiles-2.md: --splits=32 on the one-step merge with 128-column
    # blocks, then with blocks by program count.
    rule.main(["--compare", os.path.join(LOGS, "tiles-before.md"), os.path.join(LOGS, "tiles-after.md")])
    out = [ln for ln in capsys.readouterr().out.splitlines() if " default:" in ln]
    assert len(out) == 7
    assert out[0].startswith("B=1 H=16 S=4096 bf16 default: 10.1 -> 8.7 (0.86x); mla_decode_hopper 6.0 -> 6.0; "
                             "_mla_merge_kernel 3.7 -> 2.4")
    assert out[2].startswith("B=1 H=64 S=32768 bf16 default: 27.1 -> 27.3 (1.01x)")
    rule.main(["--merge", os.path.join(LOGS, "merge-tiles-2.md")])
    second = capsys.readouterr().out.splitlines()
    assert len(second) == 6 and "picks (128, 128) (4.2 us, 1.05x)" in second[3]


def test_bf16_partials_were_slower(rule):
    # run6.md (an option since removed): each bf16-partials row against
    # the fp32 row of the same shape, format and split count: slower in 30 of 32, equal in one, faster in one.
    rows = rule.read_rows(os.path.join(LOGS, "run6.md"))
    pairs = [(rows[label.replace(" partials=bf16", "")][0], us) for label, (us, _) in rows.items()
             if " partials=bf16" in label]
    assert len(pairs) == 32
    assert [sum(b > f for f, b in pairs), sum(b == f for f, b in pairs), sum(b < f for f, b in pairs)] == [30, 1, 1]
    assert rows["B=1 H=128 S=4096 bf16 default"][0] == 16.5
    assert rows["B=1 H=128 S=4096 bf16 partials=bf16 default"][0] == 20.7


def test_the_rule_and_the_merge_tiles_on_the_final_build(rule, capsys):
    # The logs' README: on the final merge the split rule picks within
    # 1.02x of the fastest count at all eight shapes of run 11 (the 128-split preference of run 9 at one sequence of
    # 16-32 heads is gone), and the complete --merge-tiles sweep (its nine default shapes) reads merge_tile as
    # merge-tiles-1 did: the fastest tile at six, 1.05x at 64 pairs x 128 splits, 1.10x and 1.12x at 256 pairs.
    got = _run(rule, capsys, (11,))
    assert got == ["without the partials' term (every count): geomean 1.049x, worst 1.15x, 2 untimed",
                   "rule at 3.0 MB a tile: geomean 1.003x, worst 1.02x, 0 untimed"]
    rule.main(["--merge", os.path.join(LOGS, "merge-tiles-3.md")])
    out = capsys.readouterr().out.splitlines()
    ratios = sorted(float(ln.split("us, ")[1].split("x)")[0]) for ln in out)
    assert len(out) == 9 and ratios[-3:] == [1.05, 1.10, 1.12] and max(ratios[:6]) == 1.0


def test_the_tl_dot_kernels_own_rule_against_its_sweep(rule, capsys):
    # Run 12, the tl.dot kernel (12 rows): its own rule (no partials' term) picks the fastest count timed at every
    # row; the Gluon kernels' rule (what the SM90 fallback took at 64 heads before) 1.05-1.36x, geomean 1.147x.
    got = _run(rule, capsys, (12,))
    assert got == ["without the partials' term (every count): geomean 1.000x, worst 1.00x, 0 untimed",
                   "rule at 3.0 MB a tile: geomean 1.147x, worst 1.36x, 0 untimed"]
    rows = [ln for ln in open(os.path.join(LOGS, "run12.md")) if ln.startswith("splits")]
    assert len(rows) == 72 and sum("default (tl_dot" in ln for ln in rows) == 12
