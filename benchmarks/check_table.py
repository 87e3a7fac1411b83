"""Which selection rows the committed measurements contradict (no GPU needed).

    python benchmarks/check_table.py [--results DIR] [--only FILE] [--strict]

Reads every ``bench_modes.py --out`` JSON under ``benchmarks/results/`` (``--results``): each part a / part b
row times our op in a program shape (part a: eager, compiled, compiled with CUDA graphs, a step of 61 calls; part
b: a graph of one call, without and with CUDA graphs) on the backend it chose, or on the one a ``--a-backends`` /
``--b-backends`` row preferred. A cell is one case (B, H, cache format, lengths, query precision) in one program
shape of one run; the selection row that governs it is the one ``selection.table_row`` matches for that call on
SM90. A row is contradicted where, in a cell it governs, the backend it ranks first (``select_backend`` with every
library installed) measured slower than another backend measured in the same run by more than ``TOLERANCE``.
Prints the contradicted rows with their cells, then the rows that hold and the rows no committed run compares,
then each cell whose run chose another backend than the table picks today (that run's rows with no backend
preferred: a run made with the table of today picks alike in every cell); exits 0 (``--strict``: 1 when some row
is contradicted or some pick differs).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

RESULTS = Path(__file__).resolve().parent / "results"
TOLERANCE = 0.03  # a pick slower than another backend by more than this fraction contradicts its row
SM90 = (9, 0)
PAGE_SIZE = 64  # bench_modes' page size
CALLS = 61  # bench_modes' calls per step in part a
# bench_modes' program shapes: (part, mode) -> (words, calls sharing a plan, captured); eager: no context.
SHAPES = {("a", "eager"): ("eager", None, False), ("a", "compiled"): ("compiled", CALLS, False),
          ("a", "cudagraphs"): ("CUDA graphs", CALLS, True), ("b", "compiled"): ("one-call graph", 1, False),
          ("b", "cudagraphs"): ("one-call graph, CUDA graphs", 1, True)}
_LABEL = re.compile(r"B=(\d+) H=(\d+) (\w+)( varlen)?(, bf16 q|, e4m3 q \(allow_fp8_query\))?(?:, (\w+) preferred)?$")


@dataclass(frozen=True)
class Cell:
    """One case in one program shape of one run; ``e4m3_query``: the call allowed an e4m3 query."""

    run: str  # the JSON file's name
    part: str
    mode: str
    batch: int
    heads: int
    fmt: str
    varlen: bool
    e4m3_query: bool

    @property
    def case(self) -> str:
        query = {("fp8_e4m3", False): ", q in bf16", ("fp8_e4m3", True): ", e4m3 q allowed"}.get(
            (self.fmt, self.e4m3_query), "")
        return f"B={self.batch} H={self.heads} {self.fmt}{' varlen' if self.varlen else ''}{query}"

    @property
    def shape(self) -> str:
        return SHAPES[(self.part, self.mode)][0]


def load_runs(results: Path = RESULTS) -> dict[str, dict]:
    """{file name: its JSON} of every committed result, by name."""
    return {path.name: json.loads(path.read_text()) for path in sorted(results.glob("*.json"))}


def measurements(runs: dict[str, dict]) -> dict[Cell, dict[str, float]]:
    """{cell: {backend: µs per call}} from every bench_modes part a / b row. A row timed with an e4m3 query counts
    only for calls that allowed one; a row keeping q in bf16 counts for both kinds of call."""
    return _read_cells(runs)[0]


def recorded_picks(runs: dict[str, dict]) -> dict[Cell, str]:
    """{cell: the backend the run's own selection chose} (its rows with no backend preferred)."""
    return _read_cells(runs)[1]


def _read_cells(runs: dict[str, dict]) -> tuple[dict, dict]:
    cells: dict[Cell, dict[str, float]] = {}
    picks: dict[Cell, str] = {}
    for run, data in runs.items():
        rows = data.get("rows")
        if not isinstance(rows, dict):
            continue
        for part in ("a", "b"):
            for row in rows.get(part, []):
                label = _LABEL.match(str(row.get("case", "")))
                if label is None:
                    continue
                B, H, fmt, varlen, query, preferred = label.groups()
                e4m3_row = bool(query) and "e4m3" in query
                for (p, mode) in SHAPES:
                    backend, us = row.get(f"{mode}_backend"), row.get(f"{mode}_us")
                    if p != part or not isinstance(us, (int, float)) or not backend or "," in str(backend):
                        continue
                    for allowed in ((True,) if e4m3_row else (False, True) if fmt == "fp8_e4m3" else (False,)):
                        cell = Cell(run, part, mode, int(B), int(H), fmt, bool(varlen), allowed)
                        cells.setdefault(cell, {}).setdefault(str(backend), float(us))
                        if preferred is None and allowed == e4m3_row:
                            picks[cell] = str(backend)
    return cells, picks


def _problem_and_context(cell: Cell):
    from mla_inductor.info import example_problem
    from mla_inductor.selection import CallContext

    _, calls, captured = SHAPES[(cell.part, cell.mode)]
    context = None if calls is None else CallContext(calls, captured=captured)
    problem = example_problem("cuda", cell.fmt, False, cell.heads, PAGE_SIZE, batch=cell.batch,
                              fp8_query=cell.e4m3_query)
    return problem, context


def governing_row(cell: Cell):
    """The selection row that decides this cell's call on SM90."""
    from mla_inductor.selection import table_row

    problem, context = _problem_and_context(cell)
    return table_row(problem, SM90, context)


def ranked_first(cell: Cell) -> str:
    """The backend the table picks for the cell's call, every library installed."""
    from mla_inductor.backends import registered_backends
    from mla_inductor.selection import select_backend

    problem, context = _problem_and_context(cell)
    everything = {name: None for name in registered_backends()}
    return select_backend(problem, SM90, available=everything, preference=(), context=context).backend


@dataclass(frozen=True)
class Verdict:
    cell: Cell
    pick: str
    times: dict  # {backend: µs}

    @property
    def fastest(self) -> str:
        return min(self.times, key=self.times.get)

    @property
    def contradicts(self) -> bool:
        return self.pick in self.times and self.times[self.pick] > self.times[self.fastest] * (1 + TOLERANCE)

    @property
    def compares(self) -> bool:
        """Whether the pick and at least one other backend were measured in the cell."""
        return self.pick in self.times and len(self.times) > 1

    def line(self) -> str:
        times = ", ".join(f"{name} {us:.1f}" for name, us in sorted(self.times.items(), key=lambda kv: kv[1]))
        return f"{self.cell.run}: {self.cell.case}, {self.cell.shape}: picks {self.pick}; µs per call {times}"


def verdicts(runs: dict[str, dict]) -> dict[str, list[Verdict]]:
    """{row anchor: the verdicts of the cells it governs}, every row of the table listed."""
    from mla_inductor.selection import TABLE

    by_row: dict[str, list[Verdict]] = {row.anchor: [] for row in TABLE}
    for cell, times in measurements(runs).items():
        row = governing_row(cell)
        if row is not None:
            by_row[row.anchor].append(Verdict(cell, ranked_first(cell), times))
    return by_row


def report(runs: dict[str, dict]) -> tuple[str, int]:
    """The printed report, and how many rows the data contradicts plus how many cells' picks differ."""
    from mla_inductor.selection import TABLE

    found = verdicts(runs)
    contradicted, holding, untested = [], [], []
    for row in TABLE:
        wrong = [v for v in found[row.anchor] if v.contradicts]
        judged = [v for v in found[row.anchor] if v.compares]
        name = f"{row.device} {'/'.join(row.formats)} {'sparse' if row.sparse else 'dense'} [{row.applies_to()}] " \
               f"({row.anchor})"
        if wrong:
            contradicted.append(f"CONTRADICTED {name}: " + "".join(f"\n    {v.line()}" for v in wrong))
        elif judged:
            holding.append(f"holds        {name}: {len(judged)} cell{'s' if len(judged) != 1 else ''} compared")
        else:
            untested.append(f"no data      {name}")
    differ = [f"PICK DIFFERS {cell.run}: {cell.case}, {cell.shape}: the run chose {chosen}, the table picks "
              f"{ranked_first(cell)}" for cell, chosen in recorded_picks(runs).items() if chosen != ranked_first(cell)]
    lines = [*contradicted, *holding, *untested, *differ,
             f"{len(differ)} cell(s) where a run's own pick differs from the table's today (a run made with another "
             "table, or a change of behaviour)",
             f"{len(contradicted)} row(s) contradicted, {len(holding)} hold, {len(untested)} not compared by the "
             f"committed runs (tolerance {TOLERANCE:.0%})"]
    return "\n".join(lines), len(contradicted) + len(differ)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="the directory of committed JSON results")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 when the data contradicts some row or a run's pick differs from the table's")
    parser.add_argument("--only", default=None, metavar="FILE[,FILE]",
                        help="judge only these files of the results directory (e.g. a run just copied in)")
    args = parser.parse_args(argv)
    runs = load_runs(args.results)
    if args.only:
        names = args.only.split(",")
        unknown = [n for n in names if n not in runs]
        if unknown:
            parser.error(f"--only: no {unknown} in {args.results}; there are {sorted(runs)}")
        runs = {n: runs[n] for n in names}
    text, wrong = report(runs)
    print(text)
    return 1 if args.strict and wrong else 0


if __name__ == "__main__":
    sys.exit(main())
