"""Tune ahead of time: ``python -m mla_inductor.tune [--model deepseek-v3 | --heads H ...] [--batch 1,16,64]
[--formats bf16,fp8_e4m3,fp8_ds_mla] [--programs captured,uncaptured,one-call] [--export FILE] [--import FILE]``.

Times every eligible backend for each problem class of a model (``mla_inductor.tuning``), stores the winners
where compiled graphs and eager calls on this machine find them, and prints a table. ``--export FILE`` writes
every stored result into one JSON file and ``--import FILE`` merges such a file, so one machine of a cluster
tunes for the others with the same GPU and library versions. Tuning needs a CUDA GPU; export and import do not.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from typing import Optional

import torch

from mla_inductor import tuning
from mla_inductor.contract import DecodeProblem
from mla_inductor.selection import CallContext, select_backend

# name -> (attention heads, kv_lora_rank, rope dim): the decode dims of the model families with MLA.
MODELS = {
    "deepseek-v3": (128, 512, 64),  # also DeepSeek-R1, V3.1, V3.2 (and the 8-layer test model of its shape)
    "deepseek-v2": (128, 512, 64),
    "deepseek-v2-lite": (16, 512, 64),
    "kimi-k2": (64, 512, 64),
}
PROGRAMS = {  # the program kinds, each as a compiled call's context (None: eager calls)
    "captured": CallContext(calls_sharing_plan=tuning.CALLS_PER_STEP, captured=True),
    "uncaptured": None,
    "one-call": CallContext(calls_sharing_plan=1, captured=False),
    "one-call-captured": CallContext(calls_sharing_plan=1, captured=True),
}


def _list(kind):
    return lambda text: [kind(t) for t in text.split(",") if t.strip()]


def problems(args) -> list[tuple[DecodeProblem, str]]:
    """(problem, program name) for every class asked for."""
    heads, rank, rope = MODELS[args.model] if args.model else (args.heads, args.kv_lora_rank, args.rope_dim)
    heads //= args.tp
    out = []
    for fmt, batch, program in itertools.product(args.formats, args.batch, args.programs):
        sparse_options = (False, True) if args.sparse else (False,)
        for sparse in sparse_options:
            out.append((DecodeProblem(device_type="cuda", cache_format=fmt, q_dtype=torch.bfloat16, num_heads=heads,
                                      kv_lora_rank=rank, rope_dim=rope, page_size=args.page_size, sparse=sparse,
                                      topk=args.topk if sparse else None, q_per_seq=1, batch=batch,
                                      fp8_query=args.fp8_query), program))
    return out


def _bar(done: int, total: int, what: str, started: float) -> None:
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {time.perf_counter() - started:5.1f}s "
                     f"{what[:70]:<70}")
    sys.stderr.flush()


def tune(args) -> list[tuple]:
    """Select every class (timing the new ones); returns the table's rows."""
    capability = tuple(torch.cuda.get_device_capability())
    rows = []
    todo = problems(args)
    started = time.perf_counter()
    for done, (problem, program) in enumerate(todo):
        what = f"{problem.cache_format} {'sparse' if problem.sparse else 'dense'} H={problem.num_heads} " \
               f"B={problem.batch} {program}"
        _bar(done, len(todo), what, started)
        t0 = time.perf_counter()
        try:
            selection = select_backend(problem, capability, context=PROGRAMS[program])
        except RuntimeError as e:
            rows.append((problem, program, "none", str(e).splitlines()[0][:60], "", 0.0))
            continue
        m = selection.measurement
        times = ", ".join(f"{n} {us:.1f}" for n, us in m.times) if m else "(table: one candidate)"
        rows.append((problem, program, selection.backend, times, m.source if m else "table",
                     time.perf_counter() - t0))
    _bar(len(todo), len(todo), "done", started)
    sys.stderr.write("\n")
    return rows


def table(rows) -> str:
    lines = ["| cache | sparse | H | B | program | backend | us per call | source | s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for problem, program, backend, times, source, seconds in rows:
        lines.append(f"| {problem.cache_format} | {'yes' if problem.sparse else 'no'} | {problem.num_heads} | "
                     f"{problem.batch} | {program} | {backend} | {times} | {source} | {seconds:.1f} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), help="the model's attention dims (else --heads etc.)")
    p.add_argument("--heads", type=int, default=128, help="attention heads (without --model)")
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--rope-dim", type=int, default=64)
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size: each GPU sees heads / tp")
    p.add_argument("--batch", type=_list(int), default=[1, 16, 64], help="batch sizes (default 1,16,64)")
    p.add_argument("--formats", type=_list(str), default=["bf16", "fp8_e4m3", "fp8_ds_mla"],
                   help="cache formats (default bf16,fp8_e4m3,fp8_ds_mla)")
    p.add_argument("--programs", type=_list(str), default=["captured", "uncaptured", "one-call"],
                   help=f"program kinds, of {', '.join(PROGRAMS)} (default captured,uncaptured,one-call)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--sparse", action="store_true", help="also sparse top-k calls (--topk)")
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--fp8-query", action="store_true", help="calls that allow an e4m3 query")
    p.add_argument("--lengths", choices=tuning.LENGTHS, default=None,
                   help=f"length distribution timed (default ${tuning.LENGTHS_ENV} or varied)")
    p.add_argument("--all-backends", action="store_true",
                   help="time every usable backend, not only those of the selection table's row")
    p.add_argument("--export", metavar="FILE", help="write every stored result into FILE (no tuning)")
    p.add_argument("--import", dest="import_", metavar="FILE", help="merge FILE's results into the store (no tuning)")
    args = p.parse_args(argv)
    unknown = [name for name in args.programs if name not in PROGRAMS]
    if unknown:
        p.error(f"--programs: unknown {unknown}; known: {', '.join(PROGRAMS)}")
    try:
        if args.import_:
            count = tuning.import_results(args.import_)
            print(f"imported {count} results from {args.import_} into {tuning.cache_dir()}")
            return 0
        if args.export:
            count = tuning.export_results(args.export)
            print(f"exported {count} results from {tuning.cache_dir()} to {args.export}")
            return 0
    except tuning.TuningCacheError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("mla_inductor.tune: tuning needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is "
              "False); nothing was measured. --export / --import work without one.", file=sys.stderr)
        return 2
    if args.lengths:
        import os

        os.environ[tuning.LENGTHS_ENV] = args.lengths
    with tuning.autotuning("all" if args.all_backends else "1"):
        try:
            rows = tune(args)
        except tuning.TuningCacheError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    env = tuning.environment()
    print(f"GPU: {env['gpu']}; results in {tuning.results_file(env)}; {tuning.timing_count()} classes timed")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
