"""Which backend runs a call: a table of preferences per device, filtered by what each backend supports.

``select_backend`` is a pure function of the call's ``DecodeProblem``, the device's compute capability,
what is installed, the user's preference and, for a compiled call, its ``CallContext`` (how many calls of
its graph share a plan, whether the graph is captured in a CUDA graph); the Inductor pass and the eager
path both ask it. The table ranks kernels as they run in a model's step, where one plan serves every layer;
a backend that plans on the host is moved behind one that plans on the device where its graph has no other
call to share that plan with (``HOST_PLAN_MIN_CALLS``). The rows themselves, each with its reason and the
results it rests on, are in ``selection_table``. ``backend_for_append`` picks the writer of
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
# The policy's rows and the kinds of program they name, re-exported: ``selection.TABLE`` is what every caller reads.
from mla_inductor.selection_table import CAPTURED_STEP, ONE_CALL_GRAPH, TABLE, UNCAPTURED, Row  # noqa: F401

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
# backend planning on the host goes behind the next one that plans on the device or needs none
# (docs/results.md#sm90-bf16-one-call-one-sequence).
HOST_PLAN_MIN_CALLS = 2


def graph_kind(context: Optional["CallContext"]) -> str:
    """``CAPTURED_STEP``, ``ONE_CALL_GRAPH`` or ``UNCAPTURED`` (an eager call: ``context`` None, or a whole step
    compiled without CUDA graphs)."""
    if context is None:
        return UNCAPTURED
    if context.calls_sharing_plan < HOST_PLAN_MIN_CALLS:
        return ONE_CALL_GRAPH
    return CAPTURED_STEP if context.captured else UNCAPTURED


def row_matches(row: Row, device: str, problem: DecodeProblem, context: Optional["CallContext"] = None) -> bool:
    """Whether ``row`` applies to ``problem`` on a device of class ``device`` (``context``: a compiled call's)."""
    return (row.device == device and problem.cache_format in row.formats and row.sparse == problem.sparse
            and (row.max_batch is None or (problem.batch is not None and problem.batch <= row.max_batch))
            and (row.max_heads is None or (problem.num_heads is not None and problem.num_heads <= row.max_heads))
            and (row.graph is None or graph_kind(context) == row.graph)
            and (row.captured is None or (context is not None and context.captured == row.captured)))


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


def table_row(problem: DecodeProblem, capability: Optional[tuple[int, int]],
              context: Optional[CallContext] = None) -> Optional[Row]:
    """The first TABLE row matching this device and problem (``context``: a compiled call's, None for an eager
    one), or None where no row does."""
    device = device_class(problem.device_type, capability)
    return next((row for row in TABLE if row_matches(row, device, problem, context)), None)


def table_order(problem: DecodeProblem, capability: Optional[tuple[int, int]],
                context: Optional[CallContext] = None) -> list[str]:
    """Backends to try, best first, for this device and problem (the first matching TABLE row's order)."""
    row = table_row(problem, capability, context)
    if row is not None:
        return list(row.order)
    return ["triton", "reference"] if device_class(problem.device_type, capability) != "cpu" else ["reference"]


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
    ``last_resort`` backend excepted: the reference is never the faster one on a GPU). In the place it leaves
    it puts a note saying why, which ``select_backend`` reports like a refusal."""
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
