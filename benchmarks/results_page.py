"""docs/results.md, made from the committed results (``benchmarks/results/*.json``).

    python benchmarks/results_page.py            # rewrite docs/results.md
    python benchmarks/results_page.py --check    # exit 1 where the page and the data disagree

Every JSON file is what a benchmark's ``--out DIR`` wrote (``report.write_results``: its command, device, versions
and date come with it), one file per question, the newest run; a new run of the same command replaces its file,
and this script then rewrites the page. Each section answers one question with one table, the command that made
it, the device and versions, and the date; section 3 then has one subsection per selection row
(``selection_table.TABLE``: the anchor each row names), listing the cells of the committed runs the row governs
and whether they agree with it (``check_table.py``'s verdicts).
"""

from __future__ import annotations

import argparse
import difflib
import sys
import textwrap
from pathlib import Path
from typing import Optional

import check_table
from report import markdown_table

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "results.md"
GENERATOR = "python benchmarks/results_page.py"
WIDTH = 150  # prose is wrapped to this; no line of the page is longer than 200 characters

# The committed result each question's table is made from (benchmarks/results/<name>).
KERNELS = "kernels.json"
STEP_MODES = "modes.json"  # parts a and b
PER_LAYER = "modes_per_layer.json"
CHANGING_BATCH = "modes_changing_batch.json"
ACCURACY = "accuracy.json"
GENERATE = "generate.json"
E2E = "e2e.json"

# What measures a row that no committed run compares yet.
MODES = "python benchmarks/bench_modes.py"
ROW_COMMANDS = {
    "cpu-path": "python tests/memory_probe.py eager 16,64,4096 128,64,512",
    "cpu-path-sparse": "python benchmarks/bench_e2e.py --device cpu --small --out DIR",
    "sm90-bf16-one-call-one-sequence": f"{MODES} --parts b --cases 1x128:bf16,1x16:bf16 --all --b-backends "
                                       "triton,flashmla,flashinfer_fa3 --b-rounds 2",
    "sm90-bf16-one-call-uncaptured": f"{MODES} --parts b --cases 32x128:bf16,16x128:bf16 --b-backends triton,flashmla "
                                     "--b-rounds 2",
    "sm90-bf16-one-call-few-heads": f"{MODES} --parts b --all --cases 32x16:bf16 --b-backends triton,flashmla "
                                    "--b-rounds 2",
    "sm90-bf16-uncaptured": f"{MODES} --parts a --cases 8x16:bf16,16x128:bf16 --a-backends flashinfer_fa3,flashmla "
                            "--a-rounds 2",
    "sm90-bf16-uncaptured-few-heads": f"{MODES} --parts a --cases 32x16:bf16 --a-backends flashinfer_fa3,flashmla "
                                      "--a-rounds 2",
    "sm90-bf16-general": f"{MODES} --parts a --cases 64x16:bf16,128x16:bf16 --varlen --a-backends "
                         "flashinfer_fa3,triton --a-rounds 2",
    "sm90-fp8-general": f"{MODES} --parts a --cases 128x128:fp8_e4m3,128x16:fp8_e4m3 --a-rounds 2",
    "sm90-fp8-ds-mla-dense": "python benchmarks/bench_pass.py --out DIR",
    "sm90-bf16-sparse": "python benchmarks/bench_pass.py --out DIR",
    "sm90-fp8-ds-mla-sparse": "python benchmarks/bench_pass.py --out DIR",
}
GPU_ROWS = "python benchmarks/bench_kernels.py --out DIR"  # rows of devices no committed run measured


def _command(command: str, prefix: str = "Command: ") -> list[str]:
    """The command inline where it fits a line, else in a block wrapped with continuations."""
    if len(prefix) + len(command) + 2 <= 198:
        return [f"{prefix}`{command}`"]
    return [prefix.rstrip(": ") + ":", "", *_wrapped_command(command)]


def _wrapped_command(command: str) -> list[str]:
    lines = textwrap.wrap(command, 100, break_long_words=False, break_on_hyphens=False)
    return ["```sh", *[ln + (" \\" if i < len(lines) - 1 else "") for i, ln in enumerate(lines)], "```"]


def provenance(data: dict) -> list[str]:
    """The command, device and versions, and date of a committed result, as the page prints them."""
    env = dict(data.get("environment", {}))
    date = env.pop("date", "not stated")
    device = env.pop("device", "not stated")
    versions = ", ".join(f"{k} {v}" for k, v in env.items())
    return [*_command(data.get("command", "not stated"), "- Command: "), f"- Device: {device}; {versions}",
            f"- Date: {date}", ""]


def not_measured(command: str) -> list[str]:
    return [*_command(command, "Not measured yet: "), ""]


def _num(value, spec: str = ".1f") -> str:
    """A figure as the page prints it; what a run wrote instead of one (an error, "not run") as written."""
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value or "")


def _us(value) -> str:
    return _num(value)


def _ratio(value) -> str:
    return f" ({value:.2f}×)" if isinstance(value, (int, float)) else ""


def kernels_section(runs: dict) -> list[str]:
    out = ["## <a id=\"kernels\"></a>1. Our kernels vs the peers", "",
           "Each kernel called directly (no op, no pass): µs per call (`triton.testing.do_bench` median), its time "
           "over the HBM / tensor-core floor, bytes read per second, relative error against the fp32 reference.", ""]
    data = runs.get(KERNELS)
    if data is None:
        return out + not_measured(GPU_ROWS)
    kernels = list(dict.fromkeys(r["kernel"] for r in data["rows"]))
    by_case: dict = {}
    for r in data["rows"]:
        by_case.setdefault(r["case"], {"case": r["case"]})[r["kernel"]] = (
            f"{_us(r['us'])} ({_num(r.get('over_floor'), '.2f')}× floor, {_num(r.get('gb_per_s'), '.0f')} GB/s, "
            f"err {_num(r.get('rel_err'), '.0e')})")
    rows = list(by_case.values())
    return out + [markdown_table(["case", *kernels], rows), ""] + provenance(data)


def pass_section() -> list[str]:
    return ["## <a id=\"pass-cost\"></a>2. What the pass costs", "",
            "The compiled op against the same kernels called by hand (the pass's own cost per call), and the time "
            "the pass adds to a compile.", "", *not_measured("python benchmarks/bench_pass.py --out DIR"),
            *_command("python benchmarks/bench_compile_time.py --device cuda --out DIR", "and: "), ""]


def _mode_cell(row: dict, mode: str) -> str:
    return f"{_us(row.get(f'{mode}_us'))}{_ratio(row.get(f'{mode}_ratio'))} {row.get(f'{mode}_backend') or ''}".strip()


def modes_section(runs: dict) -> list[str]:
    out = ["## <a id=\"program-shapes\"></a>3. Each program shape vs the fastest peer's own call", "",
           "Our op as a model calls it, µs per call, with its ratio to the fastest peer's direct call (plan made "
           "outside its loop) and the backend our op chose. Targets: eager ≤ 1.5×, compiled ≤ 1.2×, CUDA graphs "
           "≤ 1.0×, one-call graph ≤ 1.3×, changing batch ≤ 1.05×, per layer ≤ 1.1× the whole step.", ""]
    data = runs.get(STEP_MODES)
    out += ["### <a id=\"modes-step\"></a>Eager, compiled, CUDA graphs: a step of 61 calls back to back", ""]
    if data is None or not data["rows"].get("a"):
        out += not_measured(f"{MODES} --parts a")
    else:
        rows = [{"case": r["case"], "fastest peer": f"{r.get('best_peer')} {_us(r.get('peer_us'))}",
                 **{title: _mode_cell(r, mode) for title, mode in
                    (("eager", "eager"), ("compiled", "compiled"), ("CUDA graphs", "cudagraphs"))}}
                for r in data["rows"]["a"]]
        out += [markdown_table(list(rows[0]), rows), ""] + provenance(data)
    out += ["### <a id=\"modes-one-call\"></a>A graph of one call (a layer compiled alone, an MTP draft layer)", ""]
    if data is None or not data["rows"].get("b"):
        out += not_measured(f"{MODES} --parts b")
    else:
        rows = [{"case": r["case"], "fastest peer": f"{r.get('best_peer')} {_us(r.get('peer_us'))}",
                 "compiled": _mode_cell(r, "compiled"), "its floor": _us(r.get("compiled_floor_us")),
                 "CUDA graphs": _mode_cell(r, "cudagraphs"), "floor": _us(r.get("cudagraphs_floor_us"))}
                for r in data["rows"]["b"]]
        out += [markdown_table(list(rows[0]), rows), "", "Floor: the same graph with one small copy kernel "
                "instead of the attention (what the compiled call itself costs).", ""] + provenance(data)
    data = runs.get(PER_LAYER)
    out += ["### <a id=\"modes-per-layer\"></a>Per layer: an 8-layer DeepSeek-V3-shaped HF model, ms per decode step",
            ""]
    if data is None or not data["rows"].get("d"):
        out += not_measured(f"{MODES} --parts d")
    else:
        modes = [m for m in ("whole+cudagraphs", "per_layer+cudagraphs", "per_layer+captured_step", "whole",
                             "per_layer") if any(isinstance(r.get(f"{m}_ms"), float) for r in data["rows"]["d"])]
        ratios = [k for k in ("per_layer_ratio", "captured_step_ratio") if any(r.get(k) for r in data["rows"]["d"])]
        rows = [{"cache": r["fmt"], "B": r["B"], **{f"{m} ms": _num(r.get(f"{m}_ms"), ".2f") for m in modes},
                 **{k.replace("_", " "): _num(r.get(k), ".2f") for k in ratios},
                 "backends": " / ".join(str(r.get(f"{m}_backend") or "-") for m in modes)} for r in data["rows"]["d"]]
        out += [markdown_table(list(rows[0]), rows), "", "Per layer ratio: each layer compiled alone with CUDA graphs "
                "over the whole step with CUDA graphs; captured step ratio: the layers compiled alone under one CUDA "
                "graph of the step (`hf.CapturedDecodeStep`) over the same.", ""] + provenance(data)
    data = runs.get(CHANGING_BATCH)
    out += ["### <a id=\"modes-changing-batch\"></a>Changing batch: one compiled function called at B = 4, 8, 16, 64",
            ""]
    if data is None or not data["rows"].get("c"):
        out += not_measured(f"{MODES} --parts c")
    else:
        pivot: dict = {}
        for r in data["rows"]["c"]:
            pivot.setdefault((r["fmt"], r["mode"]), {"cache": r["fmt"], "compiled with": r["mode"]})[f"B={r['B']}"] = (
                f"{_us(r['us_per_call'])} / {_us(r['alone_us'])} ({_num(r.get('ratio'), '.2f')}×) "
                f"{r.get('alone_backend')}")
        rows = list(pivot.values())
        out += [markdown_table(list(rows[0]), rows), "", "Each cell: µs per call / the same step compiled for that B "
                "alone (ratio), and the backend the step compiled alone chose.", ""] + provenance(data)
    return out


def _row_title(row) -> str:
    return f"{row.device} {'/'.join(row.formats)} {'sparse' if row.sparse else 'dense'}: {row.applies_to()}"


MAX_CELLS = 5  # cells listed per row: the contradicting ones first (check_table.py lists them all)


def row_subsections(rows, verdicts: dict) -> list[str]:
    """One anchored subsection per selection row: its reason, order and the cells of the committed runs it
    governs, with whether they agree."""
    out = []
    for row in rows:
        found = verdicts.get(row.anchor, [])
        judged = sorted((v for v in found if v.compares),
                        key=lambda v: (not v.contradicts, v.cell.run, v.cell.case, v.cell.shape))
        wrong = [v for v in judged if v.contradicts]
        out += [f"#### <a id=\"{row.anchor}\"></a>{_row_title(row)}", "",
                f"Order: {' → '.join(row.order)}. Why: {row.reason}."]
        if judged:
            slower = f"slower than another backend by more than {check_table.TOLERANCE:.0%}"
            verdict = (f"**Contradicted**: in {len(wrong)} of the {len(judged)} cells compared the pick is {slower}"
                       if wrong else f"Holds: in none of the {len(judged)} cells compared is the pick {slower}")
            shown = judged[:MAX_CELLS]
            hidden = len(judged) - len(shown)
            more = f" ({hidden} more in `check_table.py`'s output)" if hidden else ""
            out += [f"{verdict}{more}; µs per call, fastest first:", ""]
            table = [{"run": v.cell.run.removesuffix(".json"), "case": v.cell.case, "program shape": v.cell.shape,
                      "picks": v.pick, "measured": ", ".join(f"{n} {us:.1f}" for n, us in
                                                          sorted(v.times.items(), key=lambda kv: kv[1])),
                      "verdict": "**pick slower**" if v.contradicts else "holds"} for v in shown]
            out += [markdown_table(list(table[0]), table)]
        else:
            command = ROW_COMMANDS.get(row.anchor, GPU_ROWS if row.device != "sm90" else MODES)
            out += _command(command + (" --out DIR" if "--out" not in command else ""), "Not measured yet: ")
        out.append("")
    return out


def selection_section(runs: dict, verdicts: dict) -> list[str]:
    from mla_inductor.selection import TABLE

    sm90 = [row for row in TABLE if row.device == "sm90"]
    out = ["### <a id=\"selection-rows\"></a>The selection rows on SM90 (H100, H200)", "",
           "One subsection per row of `mla_inductor/selection_table.py`, first matching row first: the cells of the "
           "committed runs it governs (part a: a step of 61 calls; part b: one-call graphs), the backend it ranks "
           "first, and every backend timed there. `python benchmarks/check_table.py` prints the same verdicts. "
           "The runs:", ""]
    for name, data in runs.items():
        if name.startswith("modes_") and any(data["rows"].get(p) for p in "ab"):
            env = data["environment"]
            args = data["command"].removeprefix("python benchmarks/bench_modes.py ").removesuffix(" --out DIR")
            out.append(f"- `{name.removesuffix('.json')}` ({env.get('device', '').removeprefix('NVIDIA ')}, "
                       f"{env.get('date')}): `{args}`")
    return out + [""] + row_subsections(sm90, verdicts)


def accuracy_section(runs: dict) -> list[str]:
    out = ["## <a id=\"fp8-accuracy\"></a>4. FP8 accuracy", "",
           "Relative L2 error of each backend against the fp32 reference on the same cache (the kernel's own error), "
           "the largest over the cases (B=16 H=128; B=8 H=16 with two queries a sequence; dense and sparse), on "
           "random data and with the rope part ×8; "
           "`vs bf16 cache`: against the bf16 cache of the same values (adding what the cache format costs).", ""]
    data = runs.get(ACCURACY)
    if data is None:
        return out + not_measured("python benchmarks/bench_accuracy.py --out DIR")
    groups: dict = {}
    for r in data["rows"]:
        if not r.get("err"):  # failed, or the fp32 reference against itself
            continue
        kind = "rope" if "rope" in r["case"] else "random"
        g = groups.setdefault((r["cache"], r["backend"], r["query"]), {})
        for key in ("err", "err_vs_bf16_cache"):
            g[(kind, key)] = max(g.get((kind, key), 0.0), r[key])
    rows = [{"cache": cache, "backend": backend, "query": query,
             **{f"{what}, {data_name}": _num(g.get((kind, key)), ".1e") for what, key in
                (("error", "err"), ("vs bf16 cache", "err_vs_bf16_cache"))
                for kind, data_name in (("random", "random"), ("rope", "rope ×8"))}}
            for (cache, backend, query), g in groups.items()]
    return out + [markdown_table(list(rows[0]), rows), ""] + provenance(data)


def hf_section(runs: dict) -> list[str]:
    out = ["## <a id=\"hf\"></a>5. HF `generate()` and end to end vs HF", "",
           "### <a id=\"hf-generate\"></a>`model.generate()` on the op, a 4-layer DeepSeek-V3-shaped model", ""]
    data = runs.get(GENERATE)
    if data is None:
        out += not_measured("python benchmarks/bench_generate.py --out DIR")
    else:
        rows = [{"row": r["name"], "batch": r["batch"], "ms": _num(r.get("ms"), ".2f") or r.get("error"),
                 "tokens/s": _num(r.get("tokens_per_s"), ".0f"), "HBM floor ms": _num(r.get("floor_ms"), ".2f"),
                 "kernel": r.get("kernel", ""), "what": r["what"]} for r in data["rows"]]
        ratios = [{"ratio": k, "measured": _num(v, ".2f")} for k, v in data.get("ratios", {}).items()]
        out += [markdown_table(list(rows[0]), rows), "", markdown_table(["ratio", "measured"], ratios), ""]
        out += provenance(data)
    out += ["### <a id=\"e2e\"></a>A decode step of a 4-layer DeepSeek-V3-shaped model against HF's own", ""]
    data = runs.get(E2E)
    if data is None:
        out += not_measured("python benchmarks/bench_e2e.py --out DIR")
    else:
        rows = [{"variant": r["variant"], "B": r["batch"], "cache": r["cache_format"],
                 "ms per step": _num(r.get("ms_step"), ".3f") or r.get("error"),
                 "attention ms": _num(r.get("ms_attention"), ".3f"), "kernel": ", ".join(r["backends"]) or "HF sdpa",
                 "notes": r["note"]} for r in data["rows"]]
        out += [markdown_table(list(rows[0]), rows), ""] + provenance(data)
    return out


def distributed_section() -> list[str]:
    return ["## <a id=\"many-gpus\"></a>6. Many GPUs", "",
            "Context parallel decode (each rank attends its share of the cache, the partial results merged by LSE) "
            "against one GPU.", "",
            *not_measured("torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --out DIR")]


def cpu_section(verdicts: dict) -> list[str]:
    from mla_inductor.selection import TABLE

    out = ["## <a id=\"cpu\"></a>7. The CPU path", "",
           "On CPU every call runs plain Inductor code made from the reference (chunked over the context, so its "
           "memory stays bounded: `tests/test_cpu_memory.py` asserts the bounds).", "",
           *not_measured("python benchmarks/bench_e2e.py --device cpu --small --out DIR")]
    return out + row_subsections([row for row in TABLE if row.device == "cpu"], verdicts)


def other_gpus_section(verdicts: dict) -> list[str]:
    from mla_inductor.selection import TABLE

    out = ["## <a id=\"other-gpus\"></a>8. Other GPUs (SM80, SM100, SM120)", "",
           "Their rows follow what FlashInfer and vLLM choose on those devices; no committed run measures them.", ""]
    return out + row_subsections([row for row in TABLE if row.device not in ("cpu", "sm90")], verdicts)


def wrap_prose(lines: list[str]) -> list[str]:
    """Lines of prose wrapped to the page's width; tables, headings, code and list items' own lines kept."""
    out, fenced = [], False
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        if fenced or len(line) <= WIDTH or line.startswith(("|", "#", "```", "<")) or "`" in line and len(line) <= 200:
            out.append(line)
        else:
            indent = "  " if line.startswith("- ") else ""
            out += textwrap.wrap(line, WIDTH, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)
    return out


def page(runs: dict) -> str:
    verdicts = check_table.verdicts(runs)
    lines = ["# Results", "",
             f"Made by `{GENERATOR}` from the committed results in `benchmarks/results/` (each the JSON a benchmark's "
             "`--out DIR` wrote); do not edit by hand: run the command, copy its JSON over the file, regenerate.",
             "Timing is `triton.testing.do_bench`'s median unless a section says otherwise; µs per call, ms per step.",
             "", "Contents: [kernels vs peers](#kernels) · [the pass's cost](#pass-cost) · "
             "[program shapes](#program-shapes) · [selection rows](#selection-rows) · "
             "[FP8 accuracy](#fp8-accuracy) · [HF generate() and end to end](#hf) · [many GPUs](#many-gpus) · "
             "[CPU](#cpu) · [other GPUs](#other-gpus)",
             ""]
    lines += kernels_section(runs) + pass_section() + modes_section(runs) + selection_section(runs, verdicts)
    lines += accuracy_section(runs) + hf_section(runs) + distributed_section() + cpu_section(verdicts)
    lines += other_gpus_section(verdicts)
    lines = wrap_prose(lines)
    while lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 where the page differs from what the data makes")
    parser.add_argument("--results", type=Path, default=check_table.RESULTS, help="the committed results' directory")
    parser.add_argument("--page", type=Path, default=PAGE, help="the page to write or check")
    args = parser.parse_args(argv)
    text = page(check_table.load_runs(args.results))
    if not args.check:
        args.page.write_text(text)
        print(f"wrote {args.page}")
        return 0
    current = args.page.read_text() if args.page.exists() else ""
    if current == text:
        print(f"{args.page} matches {args.results}")
        return 0
    diff = list(difflib.unified_diff(current.splitlines(), text.splitlines(), "page", "from the data", lineterm="",
                                     n=0))
    print(f"{args.page} differs from what {args.results} makes (regenerate: {GENERATOR}):\n" + "\n".join(diff[:40]))
    return 1


if __name__ == "__main__":
    sys.exit(main())
