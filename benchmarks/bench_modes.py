"""The op in every way a user runs it, against the fastest peer called directly.

    python benchmarks/bench_modes.py [--parts a,b,c,d] [--quick] [--cases 1x128:fp8_e4m3,...] [--time-limit 510]
        [--a-backends triton,...] [--b-backends triton,...] [--varlen] [--a-query-views] [--dispatcher-calls]
        [--no-call-sites] [--no-kept-views] [--no-eager-repeat] [--out DIR]

Parts (each selectable with ``--parts``; all by default):

a. 61 calls back to back (one DeepSeek-V3 step's attention layers), B in {1, 32, 128}, H in {16, 128}, bf16 and
   fp8_e4m3 caches, S=4096, page 64. Each call has its own query and its own cache (copies of one, reused past 16
   GB), all share block_table / seq_lens. Microseconds per call (step time / 61) for ours eager
   (``torch.ops.mla.paged_decode`` in a Python loop), compiled (``torch.compile``, no CUDA graphs) and compiled
   with CUDA graphs (``mode="reduce-overhead"``), against every peer of the format found (``peers.DIRECT_PEERS``:
   FlashMLA from ``flash_mla`` or vLLM's build, FlashInfer FA3 / FA2) making the same 61 calls, each on its own
   query and cache (as ours), by its own Python call with its plan made once outside the loop
   (``peers.direct_step``, which bench_host_overhead times too). Ours plans once per step: before every step
   seq_lens is marked written (its version counter bumped, its host copy registered again, as
   ``PagedLatentCache.reserve`` leaves it), so a plan cached from the previous step is never reused. Targets:
   ours / fastest peer <= 1.5 (eager), <= 1.2 (compiled), <= 1.0 (CUDA graphs). An fp8_e4m3 case gets two
   rows, one per query precision, each against the peers computing that way: "bf16 q" (our default; FlashInfer's
   fp8 wrappers) and "e4m3 q" (ours under ``mla_inductor.allow_fp8_query()``; every peer, FlashMLA's FP8 kernel
   included, whose e4m3 query costs about 10x the error: ``peers.QUERY_IN_E4M3``). ``--a-rounds N`` times each
   case N times in turn (peers and our three modes; every other round ours first), each cell keeping its
   fastest round (as ``--b-rounds``). Our step slices each call's q_nope / q_pe from its [T, H, 576] query, two
   view ops per call that the peers' steps make once, outside (``peers.split_query``); ``--a-query-views`` hands
   ours the views made once too (``report.query_views``), as a model hands the op its q_nope and q_pe.
   ``--a-backends triton,flashinfer_fa3`` adds a row per named backend after each case's own, as ``--b-backends``
   does in part b: how a selection row for whole steps is decided. ``--varlen`` (parts a and b): each sequence's
   length drawn in [S/8, S] (fixed seed) instead of S for all, where a kernel splitting every sequence alike
   meets schedulers that balance unequal lengths.
b. A one-call compiled graph (an MTP draft layer, a layer compiled alone), with and without CUDA graphs,
   plan included, against the fastest peer's single call (plan outside), on part a's cases with H=128
   (``--all``: H=16 too; fp8_e4m3 cases in both query precisions, as in a). Target <= 1.3. Beside each mode,
   its floor: the same inputs and output compiled in that mode with one small copy kernel instead of the
   attention (what the compiled call itself costs: Dynamo's guards, Inductor's wrapper, the CUDA-graph replay). ``--b-profile`` then prints torch.profiler's kernel table
   of each case's one-call graphs. ``--b-backends triton,flashmla`` adds a row per named backend after each
   case's own: the same graphs with that backend preferred (``mla_inductor.prefer_backends``), timed in the
   same process against the same peer time, which is how a selection row for one-call graphs is decided.
   ``--b-rounds N`` times each case N times in turn (peers, rows, floors) and keeps each cell's fastest round:
   a B=1 graph call is host-bound, and this host's speed drifts within one process. Every other round times our
   rows before the peers (``ours_first``), so that a drift favours neither side.
c. One compiled function called at B = 4, 8, 16, 64 in turn (bf16, ``--all``: fp8_e4m3 too; H=128, S=4096,
   a step of ``--c-calls`` calls, CUDA graphs unless ``--c-no-cudagraphs``) with default ``torch.compile``
   (automatic dynamic), with ``dynamic=True`` and with ``mark_dynamic``, against the same step compiled for
   that B alone. Target: <= 1.05 at every B, and the same backend.
d. The 8-layer DeepSeek-V3-shaped HF model (``bench_e2e.build_model``: real attention dims, small dense
   MLP), context 4096, one decode step (``mla_inductor.hf.decode_one_token``) in four modes: the whole step
   compiled, with and without CUDA graphs, and each decoder layer compiled on its own (regional
   compilation, ``hf.compile_layers``), with and without CUDA graphs (``hf.decode_one_token`` marks each
   CUDA-graph step itself), at B in {1, 16, 64}, bf16 / fp8_e4m3 / fp8_ds_mla caches (``--d-configs`` /
   ``--d-modes`` pick rows, ``--d-profile`` prints torch.profiler's table of each mode). Target: per layer +
   CUDA graphs <= 1.1x the whole step with CUDA graphs.

Timing: ``triton.testing.do_bench`` median (parts a-c): CUDA events around each step, L2 flushed before it, no
host sync between steps; where the host is slower than the kernels (B=1: a direct call's Python and launches take
longer than its kernel), the events span the host's launch time, less the flush's ~0.1 ms head start per step.
Part d: mean wall time of 20 steps after warm-up with a device sync around them, the fastest of ``--d-rounds``
(default 3) such timings of the same compiled step; beside it, the host's own ms per step in that round (the time
to issue a step: where it nears the step's ms the step is host-bound, and a hiccup of the host doubles a round's
mean, as the per-layer steps with CUDA graphs at B=1 can be). A peer's µs per call here and
bench_host_overhead's (host wall with a sync per step) time the same ``direct_step``. Our op's results in parts
a-c are checked against the fp32 reference (relative error printed); the peers' outputs and part d's steps are
timed, not checked. Peers are found by import; one not installed is reported and skipped.
Each part prints its rows as it goes; ``--time-limit`` (seconds, for the whole run) stops starting new rows
once spent, and the report marks what was not run. ``--out DIR`` writes bench_modes.md and bench_modes.json.
``--dispatcher-calls``: compiled code calls our ops through PyTorch's dispatcher, as it did before they were called
directly (``_library.define_op(direct=True)``): the same cases with and without it are an A/B of that change.
``--no-call-sites``: compiled code calls our ops directly, but each call through the op's implementation instead of
its call site's own callable (``define_op``'s ``call_site``): the A/B of call sites. ``--no-kept-views``: the views a
kernel takes of a layer's cache are made on every call instead of kept per cache tensor (``TensorViews``).
``--no-eager-repeat``: every eager call builds its call signature, also one like the op's last call (``ops._Repeat``).
``--tune``: measured selection forced and the table ignored (``MLA_INDUCTOR_AUTOTUNE=all``: every usable backend
timed for each new problem class, the table's order breaking ties only), timed on the run's length distribution
(``--varlen`` or equal lengths), its results kept in a fresh directory unless ``$MLA_INDUCTOR_CACHE_DIR`` names one;
with ``--a-backends`` / ``--b-backends`` naming every backend, each cell's tuned row stands beside each backend's.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

import peers as peer_kernels
import torch
from report import (
    add_out_argument,
    decode_calls,
    query_views,
    environment,
    environment_line,
    lowered_afresh,
    mark_new_step,
    mark_static,
    step_profile,
    markdown_table,
    profile_of,
    median_ms,
    parse_cases,
    progress,
    relative_error,
    require_gpu,
    write_results,
)

import mla_inductor

D_CKV = 512
S = 4096
CALLS = 61
Case = peer_kernels.FormatCase  # one (B, H, cache format) case: the peers' data and what our op takes
TARGETS = {"eager": 1.5, "compiled": 1.2, "cudagraphs": 1.0, "one_call": 1.3, "dynamic": 1.05, "per_layer": 1.1}


# ----------------------------------------------------------------------------- bookkeeping

class Deadline:
    """The run's time budget: parts ask before starting a row and skip it once the budget is spent."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()

    def spent(self) -> bool:
        return self.left() <= 0


@dataclass
class Results:
    rows: dict[str, list[dict]] = field(default_factory=lambda: {"a": [], "b": [], "c": [], "d": []})
    skipped: dict[str, list[str]] = field(default_factory=lambda: {"a": [], "b": [], "c": [], "d": []})

    def add(self, part: str, row: dict) -> None:
        self.rows[part].append(row)
        progress(f"  [{part}] " + ", ".join(f"{k}={_show(v)}" for k, v in row.items()))

    def skip(self, part: str, what: str, why: str) -> None:
        self.skipped[part].append(f"{what}: {why}")
        progress(f"  [{part}] {what}: not run ({why})")


def _show(v):
    return f"{v:.3g}" if isinstance(v, float) else v


def _ratio(ours: Optional[float], peer: Optional[float]) -> Optional[float]:
    return ours / peer if ours is not None and peer else None


def _free() -> None:
    torch.compiler.reset()  # frees compiled graphs, their CUDA-graph pools and cached inputs
    gc.collect()
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- cases and steps

def make_case(B: int, H: int, fmt: str, seed: int = 0, varlen: bool = False) -> Case:
    case = peer_kernels.format_case(B, H, S, fmt, seed=seed, varlen=varlen)
    mla_inductor.register_host_lengths(case.c["lens"], case.host_lens)
    return case


def decisions_during(fn: Callable[[], object], lower_afresh: bool = True) -> tuple[object, list[str]]:
    """(fn's result, the backends the pass chose while it ran: empty where it compiled nothing). ``lower_afresh``:
    Inductor's graph caches are bypassed (a graph served from them runs no pass); parts a-c compile graphs of
    opaque calls, cheap to lower again. Every decision counts, also one equal to an earlier graph's."""
    from mla_inductor.lowering import decisions_made

    with decisions_made() as made, (lowered_afresh() if lower_afresh else contextlib.nullcontext()):
        result = fn()
    return result, sorted({d.backend for d in made})


class OurStep:
    """Our op making ``len(qs)`` calls per step in one mode: "eager", "compiled" or "cudagraphs"."""

    def __init__(self, case: Case, qs: list, caches: list, mode: str, step: Optional[Callable] = None,
                 views: bool = False):
        self.case, self.mode = case, mode
        c = case.c
        if views:  # each call's (q_nope, q_pe) made before the step, as the peers' (--a-query-views)
            qs = query_views(qs)
        self.args = (qs, caches, c["block_table"], c["lens"], case.kv_scale)
        step = step or decode_calls(c["scale"], views=views)
        if mode == "eager":
            q_nope, q_pe = qs[0] if views else (qs[0][..., :D_CKV], qs[0][..., D_CKV:])
            self.fn, self.backends = step, [mla_inductor.backend_for_call(
                q_nope, q_pe, case.kv_cache, c["block_table"], c["lens"], c["scale"], case.kv_scale).backend]
        else:
            torch.compiler.reset()
            if mode == "cudagraphs":
                queries = [t for pair in qs for t in pair] if views else qs
                mark_static([*queries, *caches, c["block_table"], c["lens"], case.kv_scale])
            self.fn = torch.compile(step, fullgraph=True, mode="reduce-overhead" if mode == "cudagraphs" else None)
            _, self.backends = decisions_during(self.run)  # compiles
        for _ in range(2):  # CUDA graphs: warm-up, record
            self.run()
        self.first = self.run()[0].clone()

    def run(self):
        mark_new_step(self.case.c["lens"], self.case.host_lens)
        return self.fn(*self.args)

    def us_per_call(self) -> float:
        return median_ms(self.run) * 1e3 / len(self.args[0])


def peer_steps(case: Case, calls: int, layers: list, results: Results, part: str) -> dict:
    """{peer: its ``peers.direct_step``} for the format's peers that run here (``calls`` calls back to back,
    call i on the entries ``layers[i % len(layers)]``, plan made once, outside); the others recorded as not
    run."""
    steps, not_timed = peer_kernels.direct_steps(peer_kernels.DIRECT_PEERS[case.fmt], case.c, calls, layers)
    for name, why in not_timed.items():
        results.skip(part, f"peer {name}", why)
    return steps


# ----------------------------------------------------------------------------- part a and b

CASES = [(B, H, fmt) for fmt in ("bf16", "fp8_e4m3") for H in (128, 16) for B in (1, 32, 128)]
QUICK_CASES = [(1, 128, "bf16"), (32, 128, "bf16"), (1, 128, "fp8_e4m3"), (128, 16, "bf16")]
ONE_CALL_HEADS = (128,)  # part b's cases: those of part a with these head counts (all with --all)


def part_ab(cases, parts: str, one_call_heads: tuple, deadline: Deadline, results: Results,
            profile_b: bool = False, b_backends: tuple[str, ...] = (), b_rounds: int = 1, a_rounds: int = 1,
            a_views: bool = False, a_backends: tuple[str, ...] = (), varlen: bool = False) -> None:
    for B, H, fmt in cases:
        label = peer_kernels.case_label(B, H, fmt, varlen)
        if deadline.spent():
            for p in "ab":
                if p in parts:
                    results.skip(p, label, "time limit")
            continue
        progress(f"## {label}")
        try:
            case = make_case(B, H, fmt, varlen=varlen)
            if "a" in parts:
                back_to_back(case, results, deadline, rounds=a_rounds, views=a_views, backends=a_backends)
            if "b" in parts and H in one_call_heads:
                if deadline.spent():
                    results.skip("b", label, "time limit")
                else:
                    one_call(case, results, profile=profile_b, backends=b_backends, rounds=b_rounds)
        except Exception as e:  # noqa: BLE001 - one case failing must not stop the others
            traceback.print_exc()
            results.skip("a" if "a" in parts else "b", label, f"failed: {type(e).__name__}: {str(e)[:200]}")
        finally:
            _free()


def _time_ours(case: Case, qs, caches, mode: str, row: dict, views: bool = False) -> None:
    """Time our step in one mode and write its µs, backend and error into ``row`` (``with_peer``: the ratio).
    ``views``: the step takes each call's (q_nope, q_pe) made before it (``OurStep``)."""
    try:
        ours = OurStep(case, qs, caches, mode, views=views)
        us = ours.us_per_call()
        row[f"{mode}_us"] = us
        row[f"{mode}_backend"] = ",".join(ours.backends) or "cached graph"
        row[f"{mode}_err"] = relative_error(ours.first.float(), case.reference)
        del ours
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        row[f"{mode}_us"] = f"failed: {type(e).__name__}: {str(e)[:120]}"
    _free()


def back_to_back(case: Case, results: Results, deadline: Deadline, rounds: int = 1, views: bool = False,
                 backends: tuple[str, ...] = ()) -> None:
    """Part a's rows of one case. ``rounds``: peers and rows timed this many times in turn, each cell keeping
    its fastest round (as part b's ``rounds``). ``views``: our step takes each call's (q_nope, q_pe) made before
    it, as the peers take theirs (``--a-query-views``). ``backends``: then a row per backend, the same steps with
    it preferred (as part b's)."""
    qs, caches, layers = peer_kernels.back_to_back_inputs(case, CALLS)
    steps = peer_steps(case, CALLS, layers, results, "a")

    def time_peers() -> dict:
        times = {}
        for name, step in steps.items():
            times[name] = median_ms(step.run) * 1e3 / CALLS
            progress(f"  peer {name:<20} {times[name]:8.1f} us/call  "
                     f"err={relative_error(step.first, case.reference):.1e}")
        return times

    rows: dict = {}
    for round_index in range(rounds):
        peer_times = None if ours_first(round_index) else time_peers()
        timed = {}
        for variant in variants_of(case, backends):
            suffix, e4m3_query, preferred = variant
            row = timed[variant] = dict(case=variant_label(case, variant), best_peer=None, peer_us=None)
            with query_context(e4m3_query), preferring(preferred):
                for mode in A_MODES:
                    if deadline.spent():
                        row[f"{mode}_us"] = "time limit"
                        continue
                    _time_ours(case, qs, caches, mode, row, views=views)
        peer_times = time_peers() if peer_times is None else peer_times
        for variant, row in timed.items():
            row = with_peer(row, peers_of_class(peer_times, variant[1]), A_MODES)
            rows[variant] = _fastest_round(rows.get(variant), row, A_MODES)
    for row in rows.values():
        results.add("a", row)


def ours_first(round_index: int) -> bool:
    """Whether a round times our rows before the peers: every other round, so that a device or host whose speed
    drifts during a case (clocks falling as the GPU warms, another process on the host) favours neither side."""
    return round_index % 2 == 1


def with_peer(row: dict, peer_times: dict, modes: tuple) -> dict:
    """``row`` with its fastest peer (of ``peer_times``) and each mode's ratio to it."""
    row["best_peer"], row["peer_us"] = peer_kernels.fastest(peer_times)
    for mode in modes:
        us = row.get(f"{mode}_us")
        row[f"{mode}_ratio"] = _ratio(us if isinstance(us, float) else None, row["peer_us"])
    return row


A_MODES = ("eager", "compiled", "cudagraphs")
B_MODES = ("compiled", "cudagraphs")


def query_classes(case: Case) -> list[tuple[str, bool]]:
    """(label suffix, whether q is in e4m3) of the rows a case gets. fp8 caches get two: q kept in bf16 (our
    default) and q in e4m3 (the caller opted in with ``allow_fp8_query``), each against the peers computing
    the same way (``peers_of_class``): the e4m3 query costs about 10x the error."""
    if case.fmt != "fp8_e4m3":
        return [("", False)]
    return [(", bf16 q", False), (", e4m3 q (allow_fp8_query)", True)]


def peers_of_class(times: dict, e4m3_query: bool) -> dict:
    """The peers' times a row of that query class is held against: all of them for an e4m3 query, else those
    keeping q in bf16."""
    return times if e4m3_query else {n: t for n, t in times.items() if n not in peer_kernels.QUERY_IN_E4M3}


def query_context(e4m3_query: bool):
    return mla_inductor.allow_fp8_query() if e4m3_query else contextlib.nullcontext()


def variants_of(case: Case, backends: tuple[str, ...]) -> list[tuple[str, bool, Optional[str]]]:
    """(label suffix, q in e4m3, preferred backend or None) of each row a case gets in parts a and b: every
    query class (``query_classes``), first as the op chooses, then with each of ``backends`` preferred."""
    return [(suffix, e4m3_query, preferred) for suffix, e4m3_query in query_classes(case)
            for preferred in (None, *backends)]


def variant_label(case: Case, variant: tuple[str, bool, Optional[str]]) -> str:
    suffix, _, preferred = variant
    return case.label + suffix + ("" if preferred is None else f", {preferred} preferred")


def preferring(backend: Optional[str]):
    return mla_inductor.prefer_backends(backend) if backend else contextlib.nullcontext()


def one_call(case: Case, results: Results, profile: bool = False, backends: tuple[str, ...] = (),
             rounds: int = 1) -> None:
    """A graph of one call vs the fastest peer's single call (each timed alone, L2 flushed before it).
    ``profile``: then torch.profiler's kernel table of 3 calls in each mode (after this case's timings).
    ``backends``: then a row per backend, the same graphs with it preferred. ``rounds``: the whole case (peers,
    each row's graphs, the floors) is timed this many times in turn, each cell keeping its fastest round."""
    qs, caches = [case.c["q"]], [case.kv_cache]
    variants = variants_of(case, backends)
    rows: dict = {}
    peers = peer_steps(case, 1, [{}], results, "b")

    def time_peers() -> dict:
        return {name: median_ms(step.run) * 1e3 for name, step in peers.items()}

    for round_index in range(rounds):
        peer_times = None if ours_first(round_index) else time_peers()
        floors = {}  # the floor does not call the op: once per round, shown on each variant's row
        timed = {}
        for variant in variants:
            suffix, e4m3_query, preferred = variant
            row = timed[variant] = dict(case=variant_label(case, variant), best_peer=None, peer_us=None)
            with query_context(e4m3_query), preferring(preferred):
                for mode in B_MODES:
                    _time_ours(case, qs, caches, mode, row)
                    if preferred is None:
                        if mode not in floors:
                            floors[mode] = floor_us(case, qs, caches, mode)
                        row[f"{mode}_floor_us"] = floors[mode]
        peer_times = time_peers() if peer_times is None else peer_times
        for variant, row in timed.items():
            row = with_peer(row, peers_of_class(peer_times, variant[1]), B_MODES)
            rows[variant] = _fastest_round(rows.get(variant), row)
    for row in rows.values():
        results.add("b", row)
    if profile:
        for mode in ("compiled", "cudagraphs"):
            step = OurStep(case, qs, caches, mode)
            progress(f"--- torch.profiler, 3 one-call graphs of {case.label}, {mode}, by device time\n"
                     + step_profile(step.run, "cuda", rows=20, callers=(), sort_by="device_time_total"))
            del step
            _free()


def _fastest_round(kept: Optional[dict], row: dict, modes: tuple = B_MODES) -> dict:
    """``kept`` (the first round's row: later rounds compile from Inductor's cache and record no backend) with
    each time the faster of its own and ``row``'s (the peer's too), ratios recomputed."""
    if kept is None:
        return row
    merged = dict(kept)
    for key, value in row.items():
        if key.endswith("_us") and isinstance(value, float) and (not isinstance(kept.get(key), float)
                                                                 or value < kept[key]):
            merged[key] = value
            if key == "peer_us":
                merged["best_peer"] = row["best_peer"]
    for mode in modes:
        merged[f"{mode}_ratio"] = _ratio(merged.get(f"{mode}_us") if isinstance(merged.get(f"{mode}_us"), float)
                                         else None, merged["peer_us"])
    return merged


def _one_copy(qs, caches, block_table, seq_lens, kv_scale):
    """The one-call step's inputs and output shape with one small kernel instead of the attention: what
    torch.compile's call itself costs (guards, wrapper, CUDA-graph replay)."""
    return [q[..., :D_CKV].clone() for q in qs]


def floor_us(case: Case, qs, caches, mode: str):
    """µs per call of ``_one_copy`` compiled in ``mode``: the floor under a one-call graph of this mode."""
    try:
        step = OurStep(case, qs, caches, mode, step=_one_copy)
        us = step.us_per_call()
        del step
        return us
    except Exception as e:  # noqa: BLE001
        return f"failed: {type(e).__name__}: {str(e)[:120]}"
    finally:
        _free()


# ----------------------------------------------------------------------------- part c

C_BATCHES = (4, 8, 16, 64)
C_MODES = ("automatic", "dynamic=True", "mark_dynamic")


def part_c(fmts, calls: int, cudagraphs: bool, deadline: Deadline, results: Results) -> None:
    for fmt in fmts:
        progress(f"## c: {fmt}, H=128, {calls} calls per step, {'CUDA graphs' if cudagraphs else 'no CUDA graphs'}")
        cases = {B: make_case(B, 128, fmt, seed=B) for B in C_BATCHES}
        inputs = {B: (peer_kernels.layer_queries(cases[B].c["q"], calls), [cases[B].kv_cache]) for B in C_BATCHES}
        alone = {}
        for B in C_BATCHES:  # the reference: a step compiled for this B only
            if deadline.spent():
                results.skip("c", f"{fmt} B={B} alone", "time limit")
                continue
            torch.compiler.reset()
            alone[B] = _timed_dynamic(cases[B], *inputs[B], None, cudagraphs)
        for mode in C_MODES:
            if deadline.spent():
                results.skip("c", f"{fmt} {mode}", "time limit")
                continue
            torch.compiler.reset()
            step = torch.compile(decode_calls(cases[C_BATCHES[0]].c["scale"]), fullgraph=True,
                                 dynamic=True if mode == "dynamic=True" else None,
                                 mode="reduce-overhead" if cudagraphs else None)
            serving = []  # the backends of the graph the last new compile made (later B reuse it)
            for B in C_BATCHES:
                if B not in alone:
                    continue
                try:
                    us, backends, err = _timed_dynamic(cases[B], *inputs[B], step, cudagraphs,
                                                       mark=mode == "mark_dynamic")
                    serving = backends or serving
                    ref_us, ref_backends, _ = alone[B]
                    results.add("c", dict(fmt=fmt, mode=mode, B=B, us_per_call=us, alone_us=ref_us,
                                          ratio=_ratio(us, ref_us), recompiled=bool(backends),
                                          backend=",".join(serving), alone_backend=",".join(ref_backends), err=err))
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    results.skip("c", f"{fmt} {mode} B={B}", f"failed: {type(e).__name__}: {str(e)[:160]}")
        del cases, inputs
        _free()


def _timed_dynamic(case: Case, qs, caches, step, cudagraphs: bool, mark: bool = False):
    """(us per call, backends the pass chose for this call's graph, error) of ``step`` (None: a new one
    compiled for these sizes alone) at this case's B."""
    c = case.c
    if step is None:
        step = torch.compile(decode_calls(c["scale"]), fullgraph=True, dynamic=False,
                             mode="reduce-overhead" if cudagraphs else None)
    args = (qs, caches, c["block_table"], c["lens"], case.kv_scale)
    if mark:
        for t in (*qs, *caches, c["block_table"], c["lens"]):
            torch._dynamo.mark_dynamic(t, 0)
    if cudagraphs:
        mark_static([*qs, *caches, c["block_table"], c["lens"], case.kv_scale])

    def run():
        mark_new_step(c["lens"], case.host_lens)
        return step(*args)

    out, backends = decisions_during(run)
    for _ in range(2):
        out = run()
    err = relative_error(out[0].float(), case.reference)
    return median_ms(run) * 1e3 / len(qs), backends, err


# ----------------------------------------------------------------------------- part d

# The acceptance pair first (per layer vs whole step, with CUDA graphs), then the layers compiled one by one under
# one CUDA graph of the whole step (hf.CapturedDecodeStep), then the modes without CUDA graphs.
D_MODES = ("whole+cudagraphs", "per_layer+cudagraphs", "per_layer+captured_step", "whole", "per_layer")


def part_d(batches, fmts, layers: int, deadline: Deadline, results: Results, configs=None, modes=D_MODES,
           profile: bool = False, rounds: int = 3, host_profile: bool = False) -> None:
    """The HF model's decode step in each mode; the acceptance pair (per layer vs whole, with CUDA graphs)
    first for every configuration, the modes without CUDA graphs after, as time allows."""
    import bench_e2e

    from mla_inductor import hf

    if deadline.spent():
        results.skip("d", "HF model", "time limit")
        return
    model_args = argparse.Namespace(small=False, layers=layers, intermediate=2048, vocab=32768)
    model = bench_e2e.build_model(model_args, torch.device("cuda"), torch.bfloat16)
    configs = configs or [(fmt, B) for fmt in fmts for B in batches]
    measured: dict[tuple, dict] = {cfg: {} for cfg in configs}
    for group in (D_MODES[:3], D_MODES[3:]):
        for fmt, B in configs:
            for mode in (m for m in group if m in modes):
                if deadline.spent():
                    results.skip("d", f"{fmt} B={B} {mode}", "time limit")
                    continue
                try:
                    measured[(fmt, B)][mode] = hf_step_ms(model, hf, bench_e2e, fmt, B, mode, profile=profile,
                                                          rounds=rounds, host_profile=host_profile)
                    progress(f"  [d] {fmt} B={B} {mode}: {measured[(fmt, B)][mode]}")
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    measured[(fmt, B)][mode] = dict(error=f"{type(e).__name__}: {str(e)[:160]}")
                finally:
                    _free()
    for (fmt, B), by_mode in measured.items():
        row = dict(fmt=fmt, B=B)
        for mode in D_MODES:
            m = by_mode.get(mode, {})
            row[f"{mode}_ms"] = m.get("ms", m.get("error", "not run"))
            row[f"{mode}_backend"] = m.get("backends")
            row[f"{mode}_host_ms"] = m.get("host_ms")
        whole_ms = by_mode.get("whole+cudagraphs", {}).get("ms")
        row["per_layer_ratio"] = _ratio(by_mode.get("per_layer+cudagraphs", {}).get("ms"), whole_ms)
        row["captured_step_ratio"] = _ratio(by_mode.get("per_layer+captured_step", {}).get("ms"), whole_ms)
        results.add("d", row)


def hf_step_ms(model, hf, bench_e2e, fmt: str, B: int, mode: str, context: int = S, warmup: int = 5,
               iters: int = 20, device: str = "cuda", profile: bool = False, rounds: int = 3,
               host_profile: bool = False) -> dict:
    """Mean ms of one decode step (``hf.decode_one_token`` on a ``PagedMLACache`` of ``context`` tokens, the
    model on our attention) in ``mode``, the fastest of ``rounds`` timings of ``iters`` steps; the host's ms per
    step of that round (its Python and launches alone: the step is host-bound where it nears the step's ms);
    the backends the pass chose."""
    from mla_inductor.testing import fill_paged_mla_cache

    model.set_attn_implementation(hf.register())
    cache = hf.PagedMLACache(model, batch_size=B, max_seq_len=context + 1, fmt=fmt)
    fill_paged_mla_cache(cache, context)
    tokens = torch.randint(1, model.config.vocab_size, (B,), device=device)
    cudagraphs = mode.endswith("+cudagraphs")
    compile_mode = "reduce-overhead" if cudagraphs else None
    per_layer = mode.startswith("per_layer")
    layers = model.model.layers
    if per_layer:  # regional compilation: every decoder layer compiled on its own
        hf.compile_layers(model, fullgraph=True, mode=compile_mode)
        step = hf.decode_one_token
        if mode == "per_layer+captured_step":  # ... and one CUDA graph of the whole step, made by the library
            captured = hf.CapturedDecodeStep(model, cache)
            step = lambda model, tokens, cache: captured(tokens)  # noqa: E731
    else:
        step = torch.compile(hf.decode_one_token, fullgraph=True, mode=compile_mode)

    def run():
        logits = step(model, tokens, cache)  # uncompiled, decode_one_token marks the CUDA-graph step itself
        cache.crop(-1)  # back to the fixed context: the next step rewrites the same slot
        return logits

    try:
        with torch.no_grad():
            _, backends = decisions_during(run, lower_afresh=False)
            ms, host_ms = min(_step_and_host_ms(run, bench_e2e, device, warmup, iters) for _ in range(rounds))
            if profile:
                progress(f"--- torch.profiler, 3 steps of {fmt} B={B} {mode}\n{step_profile(run, device)}")
            if host_profile:
                for by in ("own", "cumulative"):
                    progress(f"--- cProfile of 10 steps of {fmt} B={B} {mode}, us per step, by {by} time\n"
                             + profile_of(run, lambda: None, 10, 1, top=30, by=by))
        return dict(ms=ms, host_ms=host_ms, backends=",".join(backends) or "cached graph")
    finally:
        if per_layer:
            for layer in layers:
                del layer.forward  # back to the class's forward


def _step_and_host_ms(run: Callable[[], object], bench_e2e, device: str, warmup: int, iters: int) -> tuple:
    """(ms per step with a device sync around ``iters`` steps, ms per step the host took to issue them)."""
    host = []

    def issued():
        start = time.perf_counter()
        result = run()
        host.append(time.perf_counter() - start)
        return result

    ms = bench_e2e.time_ms(issued, torch.device(device), warmup, iters)
    return ms, 1e3 * sum(host[warmup:]) / len(host[warmup:])


# ----------------------------------------------------------------------------- report

def markdown(results: Results, env: dict, args) -> str:
    out = [f"# bench_modes: {environment_line(env)}", ""]
    sections = {
        "a": ("a. 61 calls back to back, us per call (ours / fastest peer's direct call; targets eager <= 1.5, "
              "compiled <= 1.2, CUDA graphs <= 1.0)",
              ["case", "best_peer", "peer_us", "eager_us", "eager_ratio", "compiled_us", "compiled_ratio",
               "cudagraphs_us", "cudagraphs_ratio", "eager_backend", "compiled_backend", "cudagraphs_backend",
               "eager_err", "compiled_err", "cudagraphs_err"]),
        "b": ("b. one-call compiled graph vs the fastest peer's single call (target <= 1.3)",
              ["case", "best_peer", "peer_us", "compiled_us", "compiled_ratio", "cudagraphs_us", "cudagraphs_ratio",
               "compiled_floor_us", "cudagraphs_floor_us", "compiled_backend", "cudagraphs_backend", "compiled_err",
               "cudagraphs_err"]),
        "c": ("c. one compiled function at B = 4, 8, 16, 64 vs the step compiled for that B alone (target <= 1.05, "
              "same backend)",
              ["fmt", "mode", "B", "us_per_call", "alone_us", "ratio", "recompiled", "backend", "alone_backend",
               "err"]),
        "d": ("d. 8-layer DeepSeek-V3-shaped HF model, ms per decode step (target: per layer + CUDA graphs <= 1.1x "
              "the whole step with CUDA graphs; per_layer+captured_step: the layers compiled one by one under one CUDA "
              "graph of the step, hf.CapturedDecodeStep)",
              ["fmt", "B", *[f"{m}_ms" for m in D_MODES], "per_layer_ratio", "captured_step_ratio",
               *[f"{m}_host_ms" for m in D_MODES],
               *[f"{m}_backend" for m in D_MODES]]),
    }
    for part, (title, columns) in sections.items():
        if part not in args.parts:
            continue
        out += [f"## {title}", "", markdown_table(columns, results.rows[part]) if results.rows[part] else "(no rows)"]
        if results.skipped[part]:
            out += ["", "Not run / not measured:", *[f"- {s}" for s in results.skipped[part]]]
        out.append("")
    return "\n".join(out)


def _d_configs(text: str) -> list[tuple[str, int]]:
    configs = []
    for item in text.split(","):
        fmt, _, batch = item.partition(":")
        if not batch.isdigit():
            raise argparse.ArgumentTypeError(f"--d-configs takes fmt:B items, e.g. fp8_e4m3:1; got {item!r}")
        configs.append((fmt, int(batch)))
    return configs


def calls_through_the_dispatcher() -> None:
    """Keep the pass from arranging direct calls (``lowering/_compat.call_without_dispatcher``): the generated
    code then calls each op through the dispatcher. Must run before the pass is loaded (the first compile)."""
    import sys

    if "mla_inductor.lowering" in sys.modules:
        raise RuntimeError("--dispatcher-calls: the pass is loaded already; its ops are called directly")
    import mla_inductor._library as library

    library.watch_direct_ops = lambda callback: None


def calls_without_sites() -> None:
    """Keep the pass from giving calls their call sites' callables (``_library.define_op``'s ``call_site``): the
    generated code then calls each op's implementation directly. Must run before the pass is loaded."""
    import sys

    if "mla_inductor.lowering" in sys.modules:
        raise RuntimeError("--no-call-sites: the pass is loaded already; its call sites are arranged")
    import mla_inductor._library as library

    watch = library.watch_direct_ops
    library.watch_direct_ops = lambda callback: watch(lambda op, impl, call_site: callback(op, impl, None))


def views_made_per_call() -> None:
    """Make the views a kernel takes of a cache on every call, as before ``backends._common.TensorViews`` kept
    them per cache tensor (the A/B of kept views)."""
    from mla_inductor.backends._common import TensorViews

    TensorViews.get = lambda self, t, how, make: make(t)


def signature_every_eager_call() -> None:
    """Build every eager call's signature, as before a call like the op's last one skipped it (the A/B of
    ``ops._Repeat``)."""
    from mla_inductor import ops

    ops.tensor_properties_check = lambda tensors: None


# The A/B switches: flag, what it does to this process before anything compiles, its help.
AB_SWITCHES = (
    ("--dispatcher-calls", calls_through_the_dispatcher,
     "compiled code calls our ops through the dispatcher, as before they were called directly (an A/B of "
     "_library.define_op(direct=True); eager calls are the same either way)"),
    ("--no-call-sites", calls_without_sites,
     "compiled code calls each op's implementation directly, not its call site's own callable (an A/B of "
     "_library.define_op's call_site)"),
    ("--no-kept-views", views_made_per_call,
     "the views of a layer's cache made on every call, not kept per cache tensor (an A/B of "
     "backends._common.TensorViews)"),
    ("--no-eager-repeat", signature_every_eager_call,
     "every eager call builds its call signature, also one like the op's last call (an A/B of ops._Repeat)"),
)


def tune_everything(varlen: bool) -> None:
    """Every decision of the run measured (``--tune``): every usable backend timed per new problem class on the
    run's length distribution, in a fresh results directory (nothing stored by an earlier run is read)."""
    import tempfile

    from mla_inductor import tuning

    tuning.configure(mode="all", lengths="varied" if varlen else "equal",
                     cache_dir=tempfile.mkdtemp(prefix="mla_inductor_tune_"))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="abcd", help="which parts to run: any of a, b, c, d (default: all)")
    p.add_argument("--quick", action="store_true", help="a few cases per part (a smoke run of the script)")
    p.add_argument("--cases", type=parse_cases, default=None,
                   help="parts a/b on these cases only, BxH:fmt,... (fmt bf16 or fp8_e4m3), e.g. 1x128:fp8_e4m3")
    p.add_argument("--all", action="store_true",
                   help="part b at H=16 too and part c with fp8_e4m3 too (by default: H=128, bf16)")
    p.add_argument("--time-limit", type=float, default=510.0,
                   help="seconds for the whole run; rows not started by then are reported as not run")
    p.add_argument("--c-calls", type=int, default=CALLS, help="calls per step in part c")
    p.add_argument("--c-no-cudagraphs", dest="c_cudagraphs", action="store_false",
                   help="part c without CUDA graphs (default: with)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers of the HF model in part d")
    p.add_argument("--d-configs", type=_d_configs, default=None,
                   help="part d on these configurations only, fmt:B,... (e.g. fp8_e4m3:1,fp8_ds_mla:64)")
    p.add_argument("--d-modes", type=lambda text: tuple(text.split(",")), default=None,
                   help=f"part d's modes, comma-separated among {', '.join(D_MODES)} (default: all)")
    p.add_argument("--a-rounds", type=int, default=1,
                   help="part a: time each case this many times in turn, keeping each cell's fastest round")
    p.add_argument("--b-profile", action="store_true",
                   help="part b: after each case's timings, print torch.profiler's kernel table of its one-call graphs "
                        "(the profiler's session slows what follows it: later cases read slower)")
    p.add_argument("--varlen", action="store_true",
                   help="parts a and b: each sequence's length drawn in [S/8, S] (a fixed seed) instead of S for all")
    p.add_argument("--a-backends", type=lambda text: tuple(text.split(",")), default=(),
                   help="part a: after each case's row, a row per backend named (comma-separated) with it preferred")
    p.add_argument("--b-backends", type=lambda text: tuple(text.split(",")), default=(),
                   help="part b: after each case's row, a row per backend named (comma-separated) with it preferred")
    p.add_argument("--b-rounds", type=int, default=1,
                   help="part b: time each case this many times in turn, keeping each cell's fastest round")
    p.add_argument("--a-query-views", action="store_true",
                   help="part a: our step takes each call's (q_nope, q_pe) views made before it, as the peers' "
                        "direct steps take theirs, instead of slicing each call's [T, H, 576] query in the step")
    for flag, _, text in AB_SWITCHES:
        p.add_argument(flag, action="store_true", help=text)
    p.add_argument("--d-rounds", type=int, default=3,
                   help="part d: time each mode's compiled step this many times (20 steps each), keeping the fastest")
    p.add_argument("--d-profile", action="store_true",
                   help="part d: after timing each mode, print torch.profiler's table of 3 steps (the profiler's "
                        "session slows what follows it: time with the same configuration without this flag)")
    p.add_argument("--d-host-profile", action="store_true",
                   help="part d: after timing each mode, print a cProfile of 10 steps (where the host's ms per step go)")
    p.add_argument("--tune", action="store_true",
                   help="measured selection forced, the table ignored (MLA_INDUCTOR_AUTOTUNE=all) on the run's "
                        "length distribution")
    add_out_argument(p)
    args = p.parse_args(argv)
    args.parts = "".join(ch for ch in args.parts if ch in "abcd")
    unknown = set(args.d_modes or ()) - set(D_MODES)
    if unknown:
        p.error(f"--d-modes: unknown {sorted(unknown)}; the modes are {', '.join(D_MODES)}")
    require_gpu("bench_modes.py")
    if args.tune:
        tune_everything(args.varlen)
    for flag, switch, _ in AB_SWITCHES:
        if getattr(args, flag.removeprefix("--").replace("-", "_")):
            switch()
    deadline = Deadline(args.time_limit)
    env = environment(("flashinfer", "flash_mla", "vllm", "transformers"))
    progress(f"# {environment_line(env)}")
    results = Results()
    started = time.perf_counter()
    if "a" in args.parts or "b" in args.parts:
        progress("# parts a/b: 61 calls back to back; one-call graphs")
        part_ab(args.cases or (QUICK_CASES if args.quick else CASES), args.parts,
                (16, 128) if args.all else ONE_CALL_HEADS, deadline, results, profile_b=args.b_profile,
                b_backends=args.b_backends, b_rounds=args.b_rounds, a_rounds=args.a_rounds,
                a_views=args.a_query_views, a_backends=args.a_backends, varlen=args.varlen)
    if "c" in args.parts:
        progress("# part c: one function, changing batch sizes")
        part_c(("bf16", "fp8_e4m3") if args.all else ("bf16",), args.c_calls, args.c_cudagraphs, deadline, results)
    if "d" in args.parts:
        progress("# part d: HF model modes")
        try:
            part_d((1, 16) if args.quick else (1, 16, 64), ("bf16", "fp8_e4m3") if args.quick else
                   ("bf16", "fp8_e4m3", "fp8_ds_mla"), args.layers, deadline, results, configs=args.d_configs,
                   modes=args.d_modes or D_MODES, profile=args.d_profile, rounds=args.d_rounds,
                   host_profile=args.d_host_profile)
        except Exception as e:  # noqa: BLE001 - e.g. transformers missing
            traceback.print_exc()
            results.skip("d", "HF model", f"failed: {type(e).__name__}: {str(e)[:200]}")
    progress(f"# done in {time.perf_counter() - started:.0f} s")
    if args.tune:
        from mla_inductor import tuning

        progress(f"# measured selection: {tuning.timing_count()} problem classes timed, results in "
                 f"{tuning.results_file(tuning.environment())}")
    text = markdown(results, env, args)
    print(text)
    write_results(args.out, "bench_modes", text, {"environment": env, "rows": results.rows,
                                                  "not_run": results.skipped, "targets": TARGETS})


if __name__ == "__main__":
    main()
