"""Which backend runs a call: a table of preferences per device, filtered by what each backend supports.

``select_backend`` is a pure function of the call's ``DecodeProblem``, the device's compute capability,
what is installed, the user's preference and, for a compiled call, its ``CallContext`` (how many calls of
its graph share a plan, whether the graph is captured in a CUDA graph); the Inductor pass and the eager
path both ask it. The table ranks kernels as they run in a model's step, where one plan serves every layer;
a backend that plans on the host is moved behind one that plans on the device where its graph has no other
call to share that plan with (``HOST_PLAN_MIN_CALLS``). ``backend_for_append`` picks the writer of
``mla.cache_append`` the same way, from ``APPEND_ORDER``.

Accuracy is the user's choice: backends that compute with the query quantized to e4m3 (FlashMLA's dense
FP8 kernel) take a call only when the caller opted in, with a static ``q_scale`` on the call or with
``allow_fp8_query()`` / ``$MLA_INDUCTOR_FP8_QUERY=1`` (``DecodeProblem.fp8_query``); otherwise fp8 caches
go to kernels that keep q in bf16.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional, Sequence

import torch

from mla_inductor import backends
from mla_inductor._compat import environment_reader
from mla_inductor.backends import Backend
from mla_inductor.contract import DecodeProblem, check_decode_args

BACKEND_ENV = "MLA_INDUCTOR_BACKEND"
FP8_QUERY_ENV = "MLA_INDUCTOR_FP8_QUERY"
_local = threading.local()
# Read on every eager call and every compiled graph's run: a dict lookup each (``environment_reader``), and the
# preference parsed once per distinct value.
_backend_env = environment_reader(BACKEND_ENV)
_fp8_query_env = environment_reader(FP8_QUERY_ENV)


@dataclass(frozen=True)
class Selection:
    backend: str
    reasons: tuple[str, ...]  # why each backend ahead of the winner was passed over
    measurement: Optional[object] = None  # a tuning.Measurement where timings chose, None where the table did


@dataclass(frozen=True)
class CallContext:
    """Where a compiled call runs, as the Inductor pass sees its graph: how many calls share the plan this
    call's backend would make (the calls over the same block_table / seq_lens / sparse_indices and static
    shapes: one per layer in a whole-step graph, 1 in a graph compiled per layer or an MTP draft layer),
    and whether the graph is likely captured in a CUDA graph (``mode="reduce-overhead"``)."""

    calls_sharing_plan: int
    captured: bool = False


# A host plan is paid once per graph (Inductor's pass hoists it); with fewer calls than this to share it, a
# backend planning on the host goes behind the next one that plans on the device (or needs no plan).
# Measured (docs/benchmarks.md section 2, H100, bf16, S=4096): FlashInfer FA3 per call in a 61-call CUDA-graph
# step 24.6 us (B=1 H=128) / 23.0 us (H=16) vs FlashMLA 25.6 / 28.7 us; a one-call compiled step on FA3
# 197.2 / 263.2 us, its host plan included. Sparse (bf16 cache, top-k 2048): one-call FA3 steps 770-1350 us
# against 165-354 us for our Triton kernel alone (section 1).
HOST_PLAN_MIN_CALLS = 2

# The kinds of program a Row may be limited to (``graph_kind``): a whole step captured in CUDA graphs (at least
# HOST_PLAN_MIN_CALLS calls share a plan: a kernel's own device time decides, not its host cost); a one-call
# graph (fewer share it: a layer compiled alone, an MTP draft layer; every kernel of the call and of its plan
# runs once per graph call); eager calls and whole steps compiled without CUDA graphs (each call's host work
# runs between the kernels: where a kernel is short, the backend with the least host work per call wins).
CAPTURED_STEP = "whole steps in CUDA graphs"
ONE_CALL_GRAPH = "one-call graphs"
UNCAPTURED = "eager calls and steps without CUDA graphs"


def graph_kind(context: Optional["CallContext"]) -> str:
    """``CAPTURED_STEP``, ``ONE_CALL_GRAPH`` or ``UNCAPTURED`` (an eager call: ``context`` None, or a whole step
    compiled without CUDA graphs)."""
    if context is None:
        return UNCAPTURED
    if context.calls_sharing_plan < HOST_PLAN_MIN_CALLS:
        return ONE_CALL_GRAPH
    return CAPTURED_STEP if context.captured else UNCAPTURED


@dataclass(frozen=True)
class Row:
    """Preference order for one device class, cache format group and density; ``evidence`` says why."""

    device: str  # a device_class() value
    formats: tuple[str, ...]
    sparse: bool
    order: tuple[str, ...]
    evidence: str
    max_batch: Optional[int] = None  # the row applies only to calls with a static batch size <= this
    max_heads: Optional[int] = None  # ... with a static head count <= this
    graph: Optional[str] = None  # ... only to calls in this kind of program (CAPTURED_STEP, ONE_CALL_GRAPH, UNCAPTURED)
    captured: Optional[bool] = None  # ... only to compiled calls whose graph is (True) / is not (False) captured

    def matches(self, device: str, problem: DecodeProblem, context: Optional["CallContext"] = None) -> bool:
        return (self.device == device and problem.cache_format in self.formats and self.sparse == problem.sparse
                and (self.max_batch is None or (problem.batch is not None and problem.batch <= self.max_batch))
                and (self.max_heads is None or (problem.num_heads is not None and problem.num_heads <= self.max_heads))
                and (self.graph is None or graph_kind(context) == self.graph)
                and (self.captured is None or (context is not None and context.captured == self.captured)))

    def applies_to(self) -> str:
        """The calls the row is limited to, in words (docs/backends.md)."""
        limits = [f"static B ≤ {self.max_batch}" if self.max_batch is not None else "",
                  f"H ≤ {self.max_heads}" if self.max_heads is not None else "",
                  self.graph or "",
                  {None: "", True: "captured in CUDA graphs", False: "without CUDA graphs"}[self.captured]]
        return ", ".join(limit for limit in limits if limit) or "any"


BF16 = ("bf16", "fp16")
FP8 = ("fp8_e4m3",)
DS = ("fp8_ds_mla",)
FP32 = ("fp32",)

# The SM90 bf16/fp16 dense orders the rows below share.
SM90_TRITON_FIRST = ("triton", "flashmla", "flashinfer_fa3", "flashinfer_fa2", "reference")
SM90_FA3_FIRST = ("flashinfer_fa3", "flashmla", "triton", "flashinfer_fa2", "reference")
# The SM90 fp8_e4m3 dense order where our kernel (q in bf16) beats FlashMLA-fp8 (q in e4m3) for calls allowing both.
SM90_FP8_TRITON_FIRST = ("triton", "flashmla", "flashinfer_fa3", "reference")

# First matching row wins; each backend's supports() then filters (page size, heads, Q, ...), and the
# reference closes every row so a call always runs. The measurements behind each row: docs/benchmarks.md.
TABLE: tuple[Row, ...] = (
    Row("cpu", BF16 + FP8 + DS + FP32, False, ("reference",), "plain Inductor code from the reference"),
    Row("cpu", BF16 + FP8 + DS + FP32, True, ("reference",), "plain Inductor code from the reference"),
    Row("sm90", BF16, False, ("triton", "flashinfer_fa3", "flashmla", "flashinfer_fa2", "reference"),
        "One sequence in a whole step captured in CUDA graphs, any head count: our Triton kernel against "
        "FlashInfer FA3 (the default here before), 61 calls back to back, us per call on an H200: H=16 9.9 vs "
        "19.4, H=32 11.2 vs 19.5, H=64 14.8 vs 20.4, H=128 15.7 vs 20.1 (docs/benchmarks.md section 4, twentieth "
        "run; on the H100, before the split rule and merge of 2026-11-28, H=16 14.4 vs 19.8 and a tie at H=128, "
        "sixth run). Not eagerly or without CUDA graphs, where its two launches cost more host time than FA3's "
        "whole call (H=128: 37.2 vs 30.8 us eager, 31.2 vs 21.9 compiled)",
        max_batch=1, graph=CAPTURED_STEP),
    Row("sm90", BF16, False, SM90_TRITON_FIRST,
        "Up to 8 sequences of at most 64 heads (one program's head block) in a whole step captured in CUDA graphs: "
        "our Triton kernel against FlashMLA (the general row), 61 calls back to back on an H200, us per call with "
        "every sequence at S=4096 / with lengths drawn in [S/8, S]: B=8 H=16 19.6 vs 22.4 / 18.4 vs 19.8 (FA3 "
        "23.3 / 20.2); B=2 H=16 11.4 vs 18.7 / 11.8 vs 19.3; B=4 H=16 14.3 vs 19.9 / 14.0 vs 17.0; B=4 H=32 16.8 vs "
        "20.4 / 15.9 vs 17.9; B=8 H=32 22.2 vs 23.5 / 20.7 vs 20.8; B=4 H=64 21.4 vs 22.0 / 18.5 vs 19.7; B=8 H=64 "
        "26.0 vs 26.4 / 23.2 vs 24.3 (docs/benchmarks.md section 4, twentieth and twenty-first runs). At 128 heads "
        "FlashMLA stays: on varied lengths it led at B=4 and B=8 (21.7 and 27.0 us against Triton's 24.7 and 31.5)",
        max_batch=8, max_heads=64, graph=CAPTURED_STEP),
    Row("sm90", BF16, False, SM90_TRITON_FIRST,
        "H100, one sequence, a graph of one call (a layer compiled alone, an MTP draft layer): our Triton kernel's "
        "two launches (split-KV decode 12.8 us + merge 6.3 us of device time at H=128) against FlashMLA's "
        "schedule, kernel and combine (11.5 + 11.9 + 11.2 us), profiled in one-call graphs; FlashInfer FA3 plans "
        "on the host every graph call (docs/benchmarks.md section 4, eighth run)",
        max_batch=1, graph=ONE_CALL_GRAPH),
    Row("sm90", BF16, False, SM90_TRITON_FIRST,
        "H100, up to 32 sequences, any head count, a graph of one call compiled without CUDA graphs: our Triton "
        "kernel (the Gluon kernel) 104.8 us at B=32 H=128 and 112.9 at B=16, against FlashMLA's 147.7-225.9 and "
        "213.9-237.1 us (its schedule, kernel and combine launched from the host every graph call) and "
        "sgl-flash-mla's direct call 84.1 / 52.0 us (S=4096; docs/benchmarks.md section 4, seventeenth run)",
        max_batch=32, graph=ONE_CALL_GRAPH, captured=False),
    Row("sm90", BF16, False, SM90_TRITON_FIRST,
        "H100, up to 32 sequences, few heads, a graph of one call: our Triton kernel 74.9 us with CUDA graphs and "
        "82.7 without, against FlashMLA's 98.9 / 231.7 us (its schedule and combine run every graph call) and "
        "sgl-flash-mla's direct call 71.3 us (B=32, H=16, S=4096; docs/benchmarks.md section 4, tenth run). "
        "At H=128 with CUDA graphs FlashMLA stays: 100.5-101.8 us against the Gluon kernel's 104.7 at B=32, "
        "68.3-95.5 against 100.2 at B=16 (seventeenth run)",
        max_batch=32, max_heads=16, graph=ONE_CALL_GRAPH),
    Row("sm90", BF16, False, SM90_FA3_FIRST,
        "H100, up to 16 sequences, eager or compiled without CUDA graphs: the step is host-bound, and our call "
        "into FlashInfer FA3 (its kernel call repeated without the wrapper's Python) costs about 40 us of host "
        "time against about 80 us into FlashMLA. Per call, FA3 / FlashMLA eager and compiled: B=8 H=16 "
        "40.8 / 78.5 and 38.7 / 72.3 us, B=16 H=128 50.4 / 95.0 and 50.3 / 72.1 us (61 calls back to back, "
        "S=4096; docs/benchmarks.md section 4, eleventh run). With CUDA graphs FlashMLA stays ahead (B=16 H=128 "
        "47.4 vs 49.8 us)",
        max_batch=16, graph=UNCAPTURED),
    Row("sm90", BF16, False, SM90_FA3_FIRST,
        "H100, up to 32 sequences, few heads, eager or compiled without CUDA graphs: as for B <= 16; at B=32 "
        "H=16 FA3 63.8 / 63.8 us eager / compiled against FlashMLA's 80.5 / 80.5 and sgl-flash-mla's direct call "
        "61.5 (eleventh run). At H=128 FlashMLA's kernel is long enough to hide its host work (compiled 80.7 vs "
        "84.6 us)",
        max_batch=32, max_heads=16, graph=UNCAPTURED),
    Row("sm90", BF16, False, ("flashmla", "flashinfer_fa3", "triton", "flashinfer_fa2", "reference"),
        "H100, compiled, per call in a 61-call CUDA-graph step (docs/benchmarks.md section 2): FlashMLA wins on "
        "variable lengths (H=16: 139 vs FA3's 163 us at B=128, 74.6 vs 86.7 at B=64; section 4, eleventh run) and "
        "is within 5% of FlashInfer FA3 on uniform ones (B=128 H=16: 214.4 vs 211.5 us); it schedules on the "
        "device, where FA3 plans on the host every step. FA3 takes page sizes other than 64"),
    # Calls that allowed an e4m3 query: where our Triton kernel (q kept in bf16, so also the more accurate) is
    # faster than FlashMLA-fp8 with its query quantized in the call, it goes first.
    Row("sm90", FP8, False, SM90_FP8_TRITON_FIRST,
        "H100, one sequence, a call that allowed an e4m3 query: our Triton kernel (q in bf16) ahead of FlashMLA-fp8 "
        "in every program shape, us per call (61 calls back to back) eager / compiled / CUDA graphs: H=128 "
        "36.1 / 28.6 / 18.6 against 163.8 / 126.4 / 23.0, H=16 33.9 / 32.3 / 9.9 against 149.1 / 138.5 / 20.4; "
        "one-call graphs at H=128 23.7 / 22.5 against 226.7 / 40.6 (docs/benchmarks.md section 4, twenty-third "
        "run)",
        max_batch=1),
    Row("sm90", FP8, False, SM90_FP8_TRITON_FIRST,
        "H100, up to 32 sequences, eager or compiled without CUDA graphs, a call that allowed an e4m3 query: "
        "FlashMLA-fp8's call is host-bound there (126-164 us per call at B=1 against 20-23 with CUDA graphs); "
        "our Triton kernel B=32 H=128 100.0 / 99.8 us eager / compiled against 150.5 / 125.7, H=16 "
        "53.4 / 53.2 against 145.1 / 129.0 (twenty-third run). With CUDA graphs FlashMLA-fp8 stays (83.1 against "
        "96.7 at H=128, 48.1 against 50.3 at H=16)",
        max_batch=32, graph=UNCAPTURED),
    Row("sm90", FP8, False, SM90_FP8_TRITON_FIRST,
        "H100, up to 32 sequences, a graph of one call, a call that allowed an e4m3 query: our Triton kernel "
        "102.8 / 101.8 us without / with CUDA graphs at B=32 H=128 against FlashMLA-fp8's 224.8 / 104.4 "
        "(twenty-third run)",
        max_batch=32, graph=ONE_CALL_GRAPH),
    Row("sm90", FP8, False, ("flashmla", "triton", "flashinfer_fa3", "reference"),
        "H100, compiled per call: FlashMLA-fp8 fastest, but it computes with q in e4m3 (one scale per tensor), "
        "so it takes only calls that opted in (a static q_scale, or allow_fp8_query; errors in docs/backends.md); "
        "otherwise our Triton fp8 kernel, which keeps q in bf16 and was ahead of FlashInfer FA3 with an fp8 "
        "cache (docs/benchmarks.md sections 1 and 2)"),
    Row("sm90", DS, False, ("flashmla", "triton", "reference"),
        "FlashMLA's sparse kernel given every visible position as an index reads the 656-byte layout directly "
        "(H 64 or 128 only; other head counts go to our Triton kernel); bench_pass's fp8_ds_mla dense rows "
        "compare the two (docs/benchmarks.md)"),
    Row("sm90", BF16, True, ("flashinfer_fa3", "triton", "reference"),
        "H100 sparse top-k on a bf16 cache: FlashInfer FA3 with page_size 1 (vLLM's SM90 recipe), "
        "docs/benchmarks.md section 2"),
    Row("sm90", DS, True, ("flashmla", "triton", "reference"),
        "FlashMLA sparse decode reads the 656-byte layout directly, 43% fewer bytes than bf16 "
        "(docs/benchmarks.md section 2)"),
    Row("sm100", BF16 + FP8, False, ("flashinfer_trtllm", "flashinfer_fa2", "triton", "reference"),
        "Blackwell datacenter: trtllm-gen MLA is FlashInfer's and vLLM's default on SM100 (untested on SM100)"),
    Row("sm100", BF16 + FP8, True, ("flashinfer_trtllm", "triton", "reference"),
        "trtllm-gen sparse top-k (vLLM's SM100 sparse path; untested on SM100)"),
    Row("sm100", DS, True, ("flashmla", "triton", "reference"), "FlashMLA sparse decode supports SM100"),
    Row("sm120", BF16, False, ("flashinfer_fa2", "triton", "reference"), "consumer Blackwell: FA2 for bf16 (seed)"),
    Row("sm120", FP8, False, ("triton", "flashinfer_xqa", "reference"),
        "consumer Blackwell: Triton for fp8 (seed); XQA MLA (H=128, Q=1) as the fallback"),
    Row("sm80", BF16, False, ("flashinfer_fa2", "triton", "reference"), "Ampere/Ada: FA2 is the CUDA MLA kernel"),
)


def batch_limits() -> tuple[int, ...]:
    """The batch sizes at which the table's choice may change (its rows' ``max_batch``), ascending: a compiled
    graph with a symbolic batch is selected for the size class its traced batch falls in."""
    return tuple(sorted({row.max_batch for row in TABLE if row.max_batch is not None}))


def device_class(device_type: str, capability: Optional[tuple[int, int]]) -> str:
    """'cpu', 'sm80' (Ampere and Ada), 'sm90', 'sm100' (SM100/SM103), 'sm120' or 'cuda' (anything else)."""
    if device_type != "cuda" or capability is None:
        return "cpu"
    major = capability[0]
    return {8: "sm80", 9: "sm90", 10: "sm100", 12: "sm120"}.get(major, "cuda")


def table_order(problem: DecodeProblem, capability: Optional[tuple[int, int]],
                context: Optional[CallContext] = None) -> list[str]:
    """Backends to try, best first, for this device and problem (the first matching TABLE row; ``context``: a
    compiled call's, None for an eager one)."""
    device = device_class(problem.device_type, capability)
    for row in TABLE:
        if row.matches(device, problem, context):
            return list(row.order)
    return ["triton", "reference"] if device != "cpu" else ["reference"]


def user_preference() -> Optional[tuple[str, ...]]:
    """The user's backend priority list: ``prefer_backends(...)`` if active, else ``$MLA_INDUCTOR_BACKEND``
    (comma-separated), else None (use the table)."""
    return _preference_in(_local.__dict__)


def _preference_in(stacks: dict) -> Optional[tuple[str, ...]]:
    """``user_preference`` given this thread's stacks (``_local.__dict__``)."""
    blocks = stacks.get("preferences")
    if blocks:
        return blocks[-1]
    env = _backend_env()
    if not env:  # the common case, read by every compiled graph's run (lowering/records.py): keep it short
        return None
    return _parsed_preference(env)


@functools.lru_cache(maxsize=16)
def _parsed_preference(env: str) -> Optional[tuple[str, ...]]:
    return tuple(n.strip() for n in env.split(",") if n.strip()) or None


def selection_state() -> tuple:
    """Everything besides the call itself that decides its backend: the user's preference, the FP8-query
    opt-in and the registry's generation (a key for choices cached per call signature, built on every eager
    call: the thread's stacks are read once)."""
    stacks = _local.__dict__
    return _preference_in(stacks), _fp8_query_in(stacks), backends.registry_generation()


@contextlib.contextmanager
def prefer_backends(*names: str) -> Iterator[None]:
    """Use these backends, in this order, for calls made (eager) or compiled inside the block."""
    known = backends.registered_backends()
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"prefer_backends needs known backend names, got {names}; known: {sorted(known)}")
    with _pushed("preferences", tuple(names)):
        yield


def fp8_query_allowed() -> bool:
    """Whether every call may go to a backend computing with q in e4m3: ``allow_fp8_query(...)`` if active,
    else ``$MLA_INDUCTOR_FP8_QUERY`` (1 / 0), else no. A call with a static ``q_scale`` opts in by itself."""
    return _fp8_query_in(_local.__dict__)


def _fp8_query_in(stacks: dict) -> bool:
    """``fp8_query_allowed`` given this thread's stacks (``_local.__dict__``)."""
    blocks = stacks.get("fp8_query")
    if blocks:
        return blocks[-1]
    env = _fp8_query_env()
    return env is not None and env.strip() not in ("", "0")


@contextlib.contextmanager
def allow_fp8_query(allowed: bool = True) -> Iterator[None]:
    """Let calls made (eager) or compiled inside the block run on backends that quantize the query to e4m3
    with one scale per tensor, measured each call (``amax(|q|) / 448``) unless the call has a static
    ``q_scale``. Faster on SM90 with an fp8 cache (FlashMLA's dense FP8 kernel) in whole steps captured in CUDA
    graphs and at large batches, at the cost of the error docs/backends.md reports per backend; where our kernel
    keeping q in bf16 is faster (one sequence; up to 32 eager, without CUDA graphs or in a graph of one call) the
    call stays on it. ``allow_fp8_query(False)`` turns it off inside the block."""
    with _pushed("fp8_query", bool(allowed)):
        yield


@contextlib.contextmanager
def compiling_for_capture() -> Iterator[None]:
    """Graphs compiled inside the block are chosen for as if captured in CUDA graphs, though Inductor makes
    none: their caller captures the whole step in one CUDA graph of its own (``hf.CapturedDecodeStep`` around
    layers compiled one by one), so a backend whose plan runs on the host, which a capture cannot replay, must
    not be chosen."""
    with _pushed("capture", True):
        yield


def capture_expected() -> bool:
    """Whether ``compiling_for_capture`` is active on this thread."""
    return bool(_local.__dict__.get("capture"))


@contextlib.contextmanager
def _pushed(name: str, value) -> Iterator[None]:
    """``value`` on top of this thread's stack ``name`` inside the block (blocks nest; the innermost wins)."""
    stack = _local.__dict__.setdefault(name, [])
    stack.append(value)
    try:
        yield
    finally:
        stack.pop()


def _with_user_choices(problem: DecodeProblem) -> DecodeProblem:
    """The problem as backends judge it: the user's FP8-query choice added to the call's own."""
    if problem.fp8_query or not fp8_query_allowed():
        return problem
    return dataclasses.replace(problem, fp8_query=True)


def rank_backends(
    problem: DecodeProblem,
    capability: Optional[tuple[int, int]],
    *,
    available: Optional[Mapping[str, Optional[str]]] = None,
    preference: Optional[Sequence[str]] = None,
    context: Optional[CallContext] = None,
) -> list[tuple[str, Optional[str]]]:
    """Every backend in the order tried (the user's preference if any, else the table's, adjusted to the
    call's ``context``), each with None if it can run the call or the reason it cannot. ``available`` maps
    backend name -> None or why it is unavailable (default: probe the installed libraries)."""
    known = backends.registered_backends()
    available = backends.availability() if available is None else available
    preference = user_preference() if preference is None else preference
    if preference:
        unknown = [n for n in preference if n not in known]
        if unknown:
            raise ValueError(f"unknown MLA backend(s) {unknown} in the preference (${BACKEND_ENV} or "
                             f"prefer_backends); known: {sorted(known)}")
    problem = _with_user_choices(problem)
    ranked = []
    for name in list(preference) if preference else table_order(problem, capability, context):
        why = available.get(name, "not installed") if name in known else "not registered"
        ranked.append((name, why if why is not None else backends.get_backend(name).supports(problem, capability)))
    if context is not None and not preference:  # a user's order is taken as given
        ranked = _amortize_host_plans(ranked, context)
    return ranked


def _plans_on_host(name: str) -> bool:
    return getattr(backends.get_backend(name), "plans_on_host", False)


def _last_resort(name: str) -> bool:
    return getattr(backends.get_backend(name), "last_resort", False)


def _amortize_host_plans(ranked: list[tuple[str, Optional[str]]], context: CallContext):
    """Where the graph has fewer than HOST_PLAN_MIN_CALLS calls to share a plan, each usable backend that plans
    on the host goes right behind the first usable one after it that plans on the device or needs none (a
    ``last_resort`` backend excepted: the reference is never the faster one on a GPU). In its old place it
    leaves a note saying why, which ``select_backend`` reports like a refusal."""
    if context.calls_sharing_plan >= HOST_PLAN_MIN_CALLS:
        return ranked
    result = list(ranked)
    moved: set[str] = set()
    i = 0
    while i < len(result):
        name, why = result[i]
        if why is None and name not in moved and _plans_on_host(name):
            after = next((j for j in range(i + 1, len(result)) if result[j][1] is None
                          and not _last_resort(result[j][0]) and not _plans_on_host(result[j][0])), None)
            if after is not None:
                result[i] = (name, _host_plan_note(name, result[after][0], context))
                result.insert(after + 1, (name, None))
                moved.add(name)
        i += 1
    return result


def _host_plan_note(name: str, instead: str, context: CallContext) -> str:
    calls = context.calls_sharing_plan
    graph = "its CUDA-graph-captured graph" if context.captured else "its graph"
    split = "; the host plan also splits the CUDA graph" if context.captured else ""
    cost = getattr(backends.get_backend(name), "plan_cost", "a plan on the host")
    return (f"plan cost not amortized: {cost}, and {graph} has {calls} call{'s' if calls != 1 else ''} to share "
            f"it{split}; {instead} plans on the device or needs no plan, so it goes first (fewer than "
            f"HOST_PLAN_MIN_CALLS={HOST_PLAN_MIN_CALLS} calls per plan)")


# The function asked before the table (``tuning.measured_selection``, installed when ``mla_inductor.tuning`` is
# imported): (problem, capability, context, the table's ranking) -> a Selection measured for the call, or None.
_MEASUREMENT_HOOK: list = []


def consult_measurements(hook) -> None:
    """Have ``select_backend`` ask ``hook`` before the table wherever neither a preference nor availability is
    given (the real machine's choice)."""
    _MEASUREMENT_HOOK[:] = [hook]


def select_backend(
    problem: DecodeProblem,
    capability: Optional[tuple[int, int]],
    *,
    available: Optional[Mapping[str, Optional[str]]] = None,
    preference: Optional[Sequence[str]] = None,
    context: Optional[CallContext] = None,
) -> Selection:
    """The first backend of the user's preference (or the table's order, adjusted to a compiled call's
    ``context``) that is available and supports the problem, with the reasons the ones ahead of it were
    passed over; where measured selection applies (``mla_inductor.tuning``: stored timings, or timing allowed
    on this GPU), the fastest measured instead. Raises RuntimeError, listing every reason, when none can run the
    call."""
    reasons = []
    ranked = rank_backends(problem, capability, available=available, preference=preference, context=context)
    if _MEASUREMENT_HOOK and preference is None and available is None:
        measured = _MEASUREMENT_HOOK[0](_with_user_choices(problem), capability, context, ranked)
        if measured is not None:
            return measured
    for name, why in ranked:
        if why is None:
            return Selection(name, tuple(reasons))
        reasons.append(f"{name}: {why}")
    raise RuntimeError(f"no MLA backend can run {problem} on capability {capability}: " + "; ".join(reasons))


def backend_for_call(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale,
                     sparse_indices=None, q_scale=None) -> Selection:
    """The backend an eager ``mla.paged_decode`` call with these arguments gets, outside a CUDA-graph capture
    (also a compiled call's in a whole step without CUDA graphs; in other graphs the pass asks with the
    graph's ``CallContext``, and ``mla_inductor.lowering.decisions()`` lists what compiled graphs chose). It
    answers before anything is compiled or run. Only shapes, dtypes and devices are read."""
    problem = check_decode_args(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale,
                                sparse_indices, q_scale)
    return select_backend(problem, backends.device_capability(q_nope.device))


# An eager call made while the user captures a CUDA graph: its replays repeat the call without its host work,
# like a captured graph of one call.
EAGER_CAPTURE = CallContext(calls_sharing_plan=1, captured=True)


def backend_for_eager(problem: DecodeProblem, device: torch.device, captured: bool = False) -> Backend:
    """The backend an eager call runs on (the same choice as the compiler's; ``captured``: the call is made
    while a CUDA graph is captured, chosen as in a captured one-call graph). ``ops`` asks once per call
    signature, user preference, FP8-query opt-in, set of registered backends and capture state, and keeps
    the answer."""
    context = EAGER_CAPTURE if captured else None
    return backends.get_backend(select_backend(problem, backends.device_capability(device), context=context).backend)


# Who writes new tokens into a cache (``mla.cache_append``): the first that is available and can write
# on the device. Our Triton kernel on CUDA (no host sync, so decode steps capture in CUDA graphs), the
# reference elsewhere.
APPEND_ORDER: tuple[str, ...] = ("triton", "reference")


_APPEND_WRITERS: dict = {}  # (device type, index, registry generation) -> the writer chosen for it


def backend_for_append(device: torch.device) -> Backend:
    """The backend whose ``append`` writes ``mla.cache_append`` calls on this device: chosen once per device and
    set of registered backends. Every decode step appends once per layer, eagerly and from compiled code, and a
    backend's availability check may cost tens of µs (Triton's looks for the package on disk)."""
    key = (device.type, device.index, backends.registry_generation())
    writer = _APPEND_WRITERS.get(key)
    if writer is None:
        writer = _APPEND_WRITERS[key] = _choose_append_writer(device)
    return writer


def _choose_append_writer(device: torch.device) -> Backend:
    capability = backends.device_capability(device)
    reasons = []
    for name in APPEND_ORDER:
        backend = backends.get_backend(name)
        why = backend.unavailable_reason() or backend.append_supports(device.type, capability)
        if why is None:
            return backend
        reasons.append(f"{name}: {why}")
    raise RuntimeError(f"no MLA backend can write a cache on {device}: " + "; ".join(reasons))
