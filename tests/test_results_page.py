"""The selection table's reasons and anchors, docs/results.md made from the committed results, and
benchmarks/check_table.py's verdicts (all on CPU: they read committed JSON)."""

import json
import re
import shutil
from pathlib import Path

import pytest
from benchmark_modules import load_benchmark
from selection_grid import PICKS, grid_picks

from mla_inductor.selection import TABLE

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "results.md"
RESULTS = ROOT / "benchmarks" / "results"
# What a reason may name with a digit in it: shapes (H=128, B=1), devices (SM90), formats and FlashInfer's FA2/FA3.
NAMES_WITH_DIGITS = re.compile(r"\b[HBS]=\d+|\b[sS][mM]\d+|fp8(_e4m3|_ds_mla)?|e4m3|bf16|fp16|fp32|\bFA[23]\b")


@pytest.fixture(scope="module")
def page_script():
    return load_benchmark("results_page")


@pytest.fixture(scope="module")
def checker():
    return load_benchmark("check_table")


def test_the_table_picks_the_pinned_backends():
    """Every pick over a grid of calls (devices, formats, densities, query precisions, page sizes, program shapes,
    heads, batches), as pinned in tests/selection_picks.json: a change of the table is a deliberate one
    (``python tests/selection_grid.py`` rewrites the pins)."""
    pinned = json.loads(PICKS.read_text())
    picks = grid_picks()
    changed = [f"{key}: {pinned.get(key)} -> {value}" for key, value in picks.items() if pinned.get(key) != value]
    assert not changed and set(pinned) == set(picks), "\n".join(changed[:10])


def test_reasons_are_one_line_without_figures():
    for row in TABLE:
        assert "\n" not in row.reason and len(row.reason) <= 110, row.reason
        assert not re.search(r"\d", NAMES_WITH_DIGITS.sub("", row.reason)), f"a figure in {row.reason!r}"
        assert not re.search(r"\b(run|before|now|measured at)\b", row.reason), row.reason
    assert sum(len(row.reason) for row in TABLE) < 2500


def test_every_row_names_an_anchor_on_the_results_page():
    page = PAGE.read_text()
    anchors = [row.anchor for row in TABLE]
    assert len(set(anchors)) == len(anchors), "each row has its own subsection"
    missing = [a for a in anchors if f'<a id="{a}"></a>' not in page]
    assert not missing, f"rows whose anchor docs/results.md lacks: {missing}"


def test_the_results_page_is_short_with_short_lines():
    lines = PAGE.read_text().splitlines()
    assert len(lines) <= 400
    assert not [n for n, line in enumerate(lines, 1) if len(line) > 200]


def test_the_page_matches_the_committed_results(page_script, capsys):
    assert page_script.main(["--check"]) == 0, capsys.readouterr().out


def test_an_edited_figure_fails_the_check(page_script, tmp_path, capsys):
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    path = results / page_script.STEP_MODES
    data = json.loads(path.read_text())
    data["rows"]["a"][0]["cudagraphs_us"] += 1.0
    path.write_text(json.dumps(data))
    assert page_script.main(["--check", "--results", str(results)]) == 1
    assert "differs" in capsys.readouterr().out


def test_check_table_reports_every_row(checker, capsys):
    assert checker.main([]) == 0
    out = capsys.readouterr().out
    for row in TABLE:
        assert f"({row.anchor})" in out, row.anchor
    held = [line for line in out.splitlines() if line.startswith("holds")]
    assert any("(sm90-bf16-captured-one-sequence)" in line for line in held)
    assert checker.main(["--only", "modes.json"]) == 0
    assert "modes_captured_h200.json" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        checker.main(["--only", "no_such_run.json"])


def test_check_table_names_a_row_the_data_contradicts(checker, tmp_path, capsys):
    """The one-sequence captured-step row ranks Triton first; a run where Triton measured slower than FA3 in such a
    step contradicts it, and --strict fails."""
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    path = results / "modes_captured_one_sequence_h200.json"
    data = json.loads(path.read_text())
    triton = [r for r in data["rows"]["a"]
              if r["case"].startswith("B=1 H=16 bf16") and r["cudagraphs_backend"] == "triton"]
    assert triton
    for row in triton:
        row["cudagraphs_us"] = 100.0
    path.write_text(json.dumps(data))
    assert checker.main(["--results", str(results)]) == 0
    out = capsys.readouterr().out
    assert "CONTRADICTED sm90 bf16/fp16 dense [static B ≤ 1, whole steps in CUDA graphs]" in out
    assert "B=1 H=16 bf16, CUDA graphs: picks triton" in out
    assert checker.main(["--results", str(results), "--strict"]) == 1


def test_a_fresh_bench_modes_json_is_read_as_written(checker, tmp_path):
    """What ``bench_modes.py --out DIR`` writes (report.write_results with its rows) is read without conversion:
    a GPU run's bench_modes.json can be copied over a file of benchmarks/results/."""
    report = load_benchmark("report")
    rows = {"a": [{"case": "B=4 H=16 bf16", "best_peer": "flashmla", "peer_us": 18.0, "cudagraphs_us": 14.0,
                   "cudagraphs_backend": "triton", "eager_us": "time limit"},
                  {"case": "B=4 H=16 bf16, flashmla preferred", "cudagraphs_us": 19.0,
                   "cudagraphs_backend": "flashmla"}], "b": [], "c": [], "d": []}
    report.write_results(str(tmp_path), "bench_modes", "table", {"environment": {"device": "GPU"}, "rows": rows})
    written = json.loads((tmp_path / "bench_modes.json").read_text())
    assert written["command"].startswith("python ")
    found = checker.verdicts(checker.load_runs(tmp_path))["sm90-bf16-captured-few-sequences"]
    assert [(v.cell.case, v.cell.shape, v.pick, v.times) for v in found] == [
        ("B=4 H=16 bf16", "CUDA graphs", "triton", {"triton": 14.0, "flashmla": 19.0})]


def test_check_table_names_cells_a_run_chose_differently(checker, tmp_path, capsys):
    """A run whose own selection chose another backend than the table picks today (a change of behaviour, or a run
    made with an older table) is listed cell by cell, and --strict fails; a run picking alike passes."""
    report = load_benchmark("report")
    row = {"case": "B=4 H=16 bf16", "best_peer": "flashmla", "peer_us": 18.0, "cudagraphs_us": 14.0,
           "cudagraphs_backend": "triton"}
    report.write_results(str(tmp_path), "bench_modes", "table",
                         {"environment": {}, "rows": {"a": [row], "b": [], "c": [], "d": []}})
    assert checker.main(["--results", str(tmp_path), "--strict"]) == 0
    row["cudagraphs_backend"] = "flashmla"
    report.write_results(str(tmp_path), "bench_modes", "table",
                         {"environment": {}, "rows": {"a": [row], "b": [], "c": [], "d": []}})
    assert checker.main(["--results", str(tmp_path), "--strict"]) == 1
    assert ("PICK DIFFERS bench_modes.json: B=4 H=16 bf16, CUDA graphs: the run chose flashmla, the table picks "
            "triton") in capsys.readouterr().out
