"""The post-grad pass: the one place where ``mla.paged_decode`` nodes are replaced.

For each call it reads the fake arguments, asks ``select_backend`` which backend runs it, and puts in
its place either that backend's op or, for backends without one (the reference), the backend's Python
implementation traced into aten ops, which Inductor then generates as ordinary code.

Dynamic shapes select like static ones. The model's constants (heads, kv_lora_rank, rope dim, page size,
new tokens per sequence, top-k) never change in a model: where one is symbolic (``dynamic=True``) it is
fixed to its traced value with a guard. The batch B stays symbolic and is selected by size class
(``selection.batch_limits``), with a guard only where the selection differs between classes; an unbacked B
(``mark_unbacked``) takes the largest class. Each call is selected in its graph's context
(``selection.CallContext``): how many calls share its plan, and whether the graph is captured.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import operator
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

import mla_inductor
from mla_inductor._compat import is_placeholder_pass
from mla_inductor._library import direct_ops_watched, watch_direct_ops
from mla_inductor.backends import (
    availability,
    device_capability,
    environment_settings,
    get_backend,
    kernel_origins,
    library_versions,
)
from mla_inductor.contract import (
    DECODE_ARG_NAMES,
    OP_ARG_NAMES,
    DecodeProblem,
    attends_nothing,
    check_decode_args,
    debug_checks_enabled,
    empty_decode_outputs,
    nothing_attended,
    wants_value_checks,
)
from mla_inductor.lowering.checks import CHECK_DECODE_VALUES, CHECKED_ARGS
from mla_inductor.lowering.merge_pass import lower_merge_calls
from mla_inductor.lowering.records import decisions_of_graph, log_decision, write_record
from mla_inductor.selection import (
    CallContext,
    batch_limits,
    capture_expected,
    fp8_query_allowed,
    select_backend,
    user_preference,
)
from mla_inductor.tuning import tuning_key

from mla_inductor.lowering._compat import (
    CustomGraphPass,
    Match,
    as_pass_list,
    call_without_dispatcher,
    cudagraph_trees_enabled,
    cudagraphs_enabled,
    functionalized_target,
    direct_calls_supported,
    current_post_grad_pass,
    decide,
    pattern_pass,
    set_post_grad_pass,
    size_hint,
    size_key,
    specialize,
    static_size,
)
from mla_inductor.lowering.fp8_query import quantized_query_call

log = logging.getLogger(__name__)
_DECODE_OPS = {
    torch.ops.mla.paged_decode.default: False,  # op -> returns lse too
    torch.ops.mla.paged_decode_with_lse.default: True,
}


def _bind_decode_args(args: tuple, kwargs: dict, names: tuple[str, ...] = DECODE_ARG_NAMES) -> list[Any]:
    bound = list(args) + [None] * (len(names) - len(args))
    for name, value in kwargs.items():
        bound[names.index(name)] = value
    return bound


def _fake(value: Any) -> Any:
    return value.meta["val"] if isinstance(value, torch.fx.Node) else value


@dataclass
class PlanOps:
    """What the rewrite learned about the ops it put in the graph, for the plan-sharing phase after it."""

    plans: set = field(default_factory=set)  # plan ops inserted
    optional: set = field(default_factory=set)  # of those, plans whose run op also accepts an empty plan
    decode_and_plan: dict = field(default_factory=dict)  # plan op -> op returning [out, lse, *plan]
    out_only: set = field(default_factory=set)  # run ops returning out alone (calls whose lse nobody reads)
    runs: set = field(default_factory=set)  # run ops taking the contract's eight arguments first

    def note(self, backend, with_lse: bool, context: Optional[CallContext] = None) -> None:
        """Record the ops of ``backend`` as the pass is about to use them in ``context`` (what it says now: a
        test may change a backend's answers)."""
        op, plan_op = backend.compiled_op_for(context), backend.plan_op()
        out_only = None if with_lse or op is None else backend.out_only_op_for(context)
        if out_only is not None:
            self.out_only.add(out_only)
        self.runs.update(o for o in (op, out_only) if o is not None)
        if plan_op is not None:
            self.plans.add(plan_op)
            (self.optional.add if backend.plan_is_optional else self.optional.discard)(plan_op)
            self.decode_and_plan.pop(plan_op, None)
            if backend.decode_and_plan_op() is not None:
                self.decode_and_plan[plan_op] = backend.decode_and_plan_op()


def _replacement(backend, problem: Optional[DecodeProblem], with_lse: bool, constants: dict[int, Any],
                 node_positions: list[int], check_values: Optional[str] = None, joined_query: bool = False,
                 context: Optional[CallContext] = None):
    """A function of the call's tensor arguments (constants closed over) computing the backend's result
    (``backend`` None: the call attends nothing). ``check_values``: the op's name, to check the arguments'
    values first (``checks.py``). ``joined_query``: one more argument follows, the tensor q_nope and q_pe
    are the halves of (``_joined_query``), for a backend that quantizes q to quantize whole. ``context``: the
    call's place in its graph (a backend's op may depend on it)."""
    op = plan_op = out_only = quantized = None
    if backend is not None:
        op, plan_op = backend.compiled_op_for(context), backend.plan_op()
        out_only = None if with_lse or op is None else backend.out_only_op_for(context)
        quantized = backend.quantized_query_op(problem)

    def replacement(*tensors):
        joined = tensors[-1] if joined_query else None
        tensors = tensors[:len(node_positions)]
        args = [None] * len(OP_ARG_NAMES)
        for i, value in constants.items():
            args[i] = value
        for i, value in zip(node_positions, tensors):
            args[i] = value
        if check_values is not None:
            CHECK_DECODE_VALUES(*(args[i] for i in CHECKED_ARGS), check_values)
        if backend is None:
            out, lse = nothing_attended(args[0])
            return (out, lse) if with_lse else out
        if quantized is not None:  # q's assembly and quantization become graph ops (lowering/fp8_query.py)
            return quantized_query_call(quantized, plan_op, args, with_lse, joined)
        full = args[:len(DECODE_ARG_NAMES)]  # q_scale serves only backends that quantize q
        plan = plan_op(*full) if plan_op is not None and op is not None else []
        if out_only is not None:
            return out_only(*full, plan)
        out, lse = backend.decode(*full) if op is None else op(*full, plan)
        return (out, lse) if with_lse else out

    return replacement


def _plan_key(node: torch.fx.Node, target=True, by_value=False):
    """Plans are equal when they see the same block_table / seq_lens / sparse_indices nodes, constants and
    per-layer tensors of the same shape and dtype (a plan reads only their metadata). ``target=False``: the
    key of the plan a decode call would share (its op left out). ``by_value``: symbolic sizes compared by the
    values they were traced with (where they have one), not by their symbols."""
    size = _traced_size_key if by_value else size_key

    def meta(a):
        v = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
        if not isinstance(v, torch.Tensor):
            return a
        return tuple(map(size, v.shape)), v.dtype, tuple(map(size, v.stride()))

    # Decode calls carry the optional q_scale as a ninth argument; a plan reads only the contract's eight.
    args = _bind_decode_args(node.args, node.kwargs, OP_ARG_NAMES)[:len(DECODE_ARG_NAMES)]
    q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse = args
    return (node.target if target else None, meta(q_nope), meta(q_pe), meta(kv_cache), meta(kv_scale), block_table,
            seq_lens, softmax_scale, sparse)


def _traced_size_key(size):
    hint = size_hint(size)
    return size_key(size) if hint is None else hint


def _call_contexts(graph: torch.fx.Graph) -> dict[torch.fx.Node, CallContext]:
    """Each decode call's context: how many calls of the graph would share its plan (the same block_table /
    seq_lens / sparse_indices and shapes), and whether the graph will be captured in CUDA graphs. Sizes count
    by their traced values: automatic dynamic gives each layer's query its own symbol for the batch, which
    the calls' own guards (Q = T / B) equate only when each call is lowered, after its selection."""
    calls = [n for n in graph.nodes if n.op == "call_function" and n.target in _DECODE_OPS]
    keys = {n: _plan_key(n, target=False, by_value=True) for n in calls}
    sharing = Counter(keys.values())
    # Captured by Inductor (mode="reduce-overhead"), or by the caller around the whole step (compiling_for_capture).
    captured = cudagraphs_enabled() or capture_expected()
    return {n: CallContext(sharing[keys[n]], captured) for n in calls}


def _share_plans(graph: torch.fx.Graph, ops: PlanOps) -> int:
    """One plan per forward: later plan nodes equal to an earlier one are replaced by it. Returns how many."""
    first: dict = {}
    shared = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in ops.plans:
            continue
        key = _plan_key(node)
        if key in first:
            node.replace_all_uses_with(first[key])
            graph.erase_node(node)
            shared += 1
        else:
            first[key] = node
    for node in first.values():
        if not _drop_single_use_plan(graph, node, ops):
            _plan_in_first_call(graph, node, ops)
    return shared


def _plan_consumers(plan: torch.fx.Node) -> Optional[list[torch.fx.Node]]:
    """The run nodes taking this plan's items, in graph order; None if the plan is used otherwise."""
    if any(item.target is not operator.getitem for item in plan.users):
        return None
    consumers = {user for item in plan.users for user in item.users}
    return [n for n in plan.graph.nodes if n in consumers]


def _drop_single_use_plan(graph: torch.fx.Graph, plan: torch.fx.Node, ops: PlanOps) -> bool:
    """A plan feeding one call only, of a backend that can schedule itself: hand that call [] instead.
    Returns whether it did."""
    consumers = _plan_consumers(plan)
    if plan.target not in ops.optional or consumers is None or len(consumers) != 1:
        return False
    (run,) = consumers
    run.args = tuple([] if isinstance(a, (list, tuple)) and any(i in plan.users for i in a) else a
                     for a in run.args)
    return True


def _plan_in_first_call(graph: torch.fx.Graph, plan: torch.fx.Node, ops: PlanOps) -> None:
    """Where the backend's decode makes the plan as a by-product, the first call of the forward becomes
    ``decode_and_plan(<its 8 arguments>) -> [out, lse, *plan]`` and the later calls take that plan:
    the separate plan node (which would run an extra decode) goes away."""
    decode_and_plan = ops.decode_and_plan.get(plan.target)
    consumers = _plan_consumers(plan)
    if decode_and_plan is None or not consumers or consumers[0].target not in ops.runs:
        return
    first = consumers[0]
    out_only = first.target in ops.out_only
    if not out_only and any(user.target is not operator.getitem for user in first.users):
        return
    eight = first.args[:len(DECODE_ARG_NAMES)]
    with graph.inserting_before(first):
        merged = graph.call_function(decode_and_plan, eight)
    results = list(empty_decode_outputs(_fake(eight[0]))) if out_only else list(first.meta["val"])
    merged.meta["val"] = results + list(plan.meta["val"])
    with graph.inserting_after(merged):
        items = {}
        for item in sorted(plan.users, key=lambda n: n.args[1], reverse=True):
            items[item] = graph.call_function(operator.getitem, (merged, 2 + item.args[1]))
            items[item].meta.update(item.meta)
        if out_only:  # first -> getitem(merged, 0)
            out = graph.call_function(operator.getitem, (merged, 0))
            out.meta.update(first.meta)
            first.replace_all_uses_with(out)
    for result in list(first.users):  # getitem(first, 0 | 1) -> getitem(merged, 0 | 1)
        result.args = (merged, result.args[1])
    graph.erase_node(first)
    for item, replacement in items.items():
        item.replace_all_uses_with(replacement)
        graph.erase_node(item)
    graph.erase_node(plan)


def _specialize_model_constants(fake: list) -> tuple[list[str], Optional[int]]:
    """Fix every symbolic model constant of the call to its traced value (a guard: they never change in a
    model, and the kernels that plan or cache per shape need them static). Returns what was decided, and
    the new tokens per sequence where T = Q * B had to be decided here (else None)."""
    q_nope, q_pe, kv_cache, block_table, sparse = fake[0], fake[1], fake[2], fake[3], fake[7]
    constants = [("num_heads", q_nope.shape[1]), ("kv_lora_rank", q_nope.shape[2]), ("rope_dim", q_pe.shape[2]),
                 ("page_size", kv_cache.shape[1])] + ([("top-k", sparse.shape[1])] if sparse is not None else [])
    notes = []
    for name, size in constants:
        if static_size(size) is None:
            value = specialize(size)
            notes.append(f"{name}: specialized to {value}" if value is not None else f"{name}: unbacked, left symbolic")
    T, B = q_nope.shape[0], block_table.shape[0]
    if static_size(T // B) is not None:
        return notes, None
    t, b = size_hint(T), size_hint(B)
    per_seq = t // b if t is not None and b else None
    if per_seq is not None and decide(T == per_seq * B):
        notes.append(f"q_per_seq: specialized to {per_seq} (T == {per_seq} * B)")
        return notes, per_seq
    notes.append("q_per_seq: unbacked T or B, left symbolic")
    return notes, None


def _batch_class(problem: DecodeProblem, batch, choose) -> tuple[DecodeProblem, Optional[str]]:
    """Select a symbolic batch by size class. The table's batch limits (``batch_limits``) cut the batch sizes
    into classes; ``choose(problem)`` (the backend the selection picks) answers each class at its upper limit
    (None above every limit). The traced B's class and the neighbouring classes choosing alike form its range,
    and only that range's ends are guarded: a graph recompiles only for a batch size that would select another
    backend (none at all where every class selects the same). The problem then carries the traced class's
    upper limit as its batch, which the table's rows answer exactly as they would any B of the range."""
    if problem.batch is not None:
        return problem, None
    limits = batch_limits()
    hint = size_hint(batch)
    if hint is None:
        return problem, f"batch: unbacked, the class above every batch limit {limits}" if limits else "batch: unbacked"
    uppers = [*limits, None]
    choices = [choose(dataclasses.replace(problem, batch=upper)) for upper in uppers]
    traced = next(k for k, upper in enumerate(uppers) if upper is None or hint <= upper)
    first = last = traced
    while first > 0 and choices[first - 1] == choices[traced]:
        first -= 1
    while last < len(uppers) - 1 and choices[last + 1] == choices[traced]:
        last += 1
    lower, upper = (uppers[first - 1] if first else None), uppers[last]
    for guard in ([batch <= upper] if upper is not None else []) + ([batch > lower] if lower is not None else []):
        decide(guard)  # true for the traced B: the guard is what recompiles for a B outside the range
    if upper is None:
        what = f"B > {lower}" if lower is not None else "any B"
    else:
        what = f"{lower} < B <= {upper}" if lower is not None else f"B <= {upper}"
    return dataclasses.replace(problem, batch=uppers[traced]), f"batch: symbolic (traced {hint}), class {what}"


def _lower_decode_call(graph_pass: "MLALoweringPass", match: Match, *args, **kwargs) -> None:
    node = match.nodes[0]
    ops = graph_pass.plan_ops
    with_lse = _DECODE_OPS[node.target]
    bound = _bind_decode_args(args, kwargs, OP_ARG_NAMES)
    fake = [_fake(a) for a in bound]
    op_name = "paged_decode_with_lse" if with_lse else "paged_decode"
    check_values = op_name if wants_value_checks(fake[0]) else None
    node_positions = [i for i, a in enumerate(bound) if isinstance(a, torch.fx.Node)]
    constants = {i: a for i, a in enumerate(bound) if not isinstance(a, torch.fx.Node)}
    if attends_nothing(fake[0], fake[2], fake[3], fake[7]):  # no kernel: out 0, lse -inf (or empty)
        replacement = _replacement(None, None, with_lse, constants, node_positions, check_values)
        match.replace_by_example(replacement, [bound[i] for i in node_positions])
        return
    check_decode_args(*fake, op=op_name)  # a bad call fails with the contract's message before any guard
    notes, per_seq = _specialize_model_constants(fake)
    problem = check_decode_args(*fake, op=op_name)
    if problem.q_per_seq is None and per_seq is not None:
        problem = dataclasses.replace(problem, q_per_seq=per_seq)
    capability = device_capability(fake[0].device)
    context = graph_pass.contexts.get(node)
    problem, batch_note = _batch_class(problem, fake[3].shape[0],
                                       lambda p: select_backend(p, capability, context=context).backend)
    notes += [batch_note] if batch_note else []
    selection = select_backend(problem, capability, context=context)  # measured where tuning applies
    log_decision(problem, capability, selection, context, notes)
    backend = get_backend(selection.backend)
    ops.note(backend, with_lse, context)
    joined = None
    if backend.quantized_query_op(problem) is not None and check_values is None:
        joined = _joined_query(bound[0], bound[1])
    replacement = _replacement(backend, problem, with_lse, constants, node_positions, check_values,
                               joined_query=joined is not None, context=context)
    match.replace_by_example(replacement, [bound[i] for i in node_positions] + ([joined] if joined is not None else []))


def _joined_query(q_nope, q_pe) -> Optional[torch.fx.Node]:
    """The tensor q_nope and q_pe are the two halves of (``q[..., :L]`` and ``q[..., L:]``), if they are:
    quantizing it instead of their concatenation leaves the producer's q one reader, so Inductor fuses the
    producer into the quantization instead of also storing the bf16 q (vLLM passes q this way)."""
    def last_dim_slice(n):
        """(base, its fake value, start, end) of ``base[..., start:end]``, with the schema's defaults (start
        None = 0, end None or past the end = the width) made ints; None for any other node."""
        if not (isinstance(n, torch.fx.Node) and n.target is torch.ops.aten.slice.Tensor and n.args) or n.kwargs:
            return None  # (arguments given by keyword: not read here, so not matched)
        base, dim, start, end, step = (*n.args, *(0, None, None, 1)[len(n.args) - 1:])[:5]
        val = base.meta.get("val") if isinstance(base, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or step != 1 or dim not in (-1, val.dim() - 1):
            return None
        width = val.shape[-1]
        start, end = 0 if start is None else start, width if end is None else end
        if not all(isinstance(x, int) for x in (start, end, width)):
            return None
        # A negative bound is width + bound (q[..., -R:] starts at width - R).
        start, end = (x + width if x < 0 else x for x in (start, end))
        return base, val, start, min(end, width)

    a, b = last_dim_slice(q_nope), last_dim_slice(q_pe)
    if a is None or b is None or a[0] is not b[0]:
        return None
    base, val, start_a, end_a = a
    L, width = _fake(q_nope).shape[-1], val.shape[-1]
    if not isinstance(L, int):
        return None
    if start_a != 0 or end_a != L or b[2] != L or b[3] != width or width != L + _fake(q_pe).shape[-1]:
        return None
    return base


def _environment_key() -> str:
    """What else decides the rewrite: user preference, usable backends, library versions, the GPU."""
    parts = [f"preference={user_preference()}", f"fp8_query={fp8_query_allowed()}",
             # The measured choices stored for this GPU and library versions, and whether new ones are timed.
             f"tuning={tuning_key()}",
             f"debug_checks={debug_checks_enabled()}", f"available={sorted(availability().items())}",
             f"environment={environment_settings()}",
             # Graphs its caller captures (compiling_for_capture) choose as captured ones do.
             f"captured_by_caller={capture_expected()}",
             # Whether the generated code calls our ops directly (a graph cached with direct calls needs them).
             f"direct_calls={direct_ops_watched() and direct_calls_supported()}"]
    parts += [f"{lib}={version}" for lib, version in library_versions().items()]
    # Which build a backend loaded its kernels from decides the ops written (FlashMLA: a plan op where the
    # provider schedules on the device, else decode_and_plan) and the plan's shapes; library versions alone
    # do not tell two installed providers apart.
    parts += [f"{name} from {origin}" for name, origin in kernel_origins().items()]
    if torch.cuda.is_available():
        parts.append(f"gpu={torch.cuda.get_device_name()} sm={torch.cuda.get_device_capability()}")
    return "|".join(parts)


def source_files() -> list[Path]:
    """The sources that decide what the pass writes: the runtime package and the pass itself. Not the test
    helpers (``mla_inductor/testing.py``), nor benchmarks, examples or tests, which live outside both."""
    runtime = Path(mla_inductor.__file__).parent
    files = {p for root in (runtime, Path(__file__).parent) for p in root.rglob("*.py")}
    return sorted(files - {runtime / "testing.py"})


@functools.cache
def _source_hash() -> bytes:
    h = hashlib.sha256()
    for path in source_files():
        h.update(path.read_bytes())
    return h.digest()


def refuse_one_graph_cudagraphs_writing_inputs(graph: torch.fx.Graph) -> None:
    """Raise where Inductor's older CUDA-graph path (``triton.cudagraphs`` with ``triton.cudagraph_trees=False``)
    would capture a graph that holds our ops and writes a CUDA input in a way a second run does not repeat (a
    length counter's increment; our cache writes are the same the second time).

    That path runs a graph's first call twice, once to warm up and once as the first replay: every write to an
    input the graph keeps in place (the caches and lengths the HF integration marks static) happens twice, and
    the decode continues one position off, silently (torch's ``cudagraph_utils.check_for_mutation`` says as much:
    "doesn't work for non-trees because the warmup run would apply mutation twice"; with torch 2.11 such a graph
    was captured anyway, ``tests/test_modes_gpu.py::test_gpu_one_graph_cudagraphs_never_write_lengths_twice``).
    CUDA-graph trees, the default, warm up without capturing and are not affected."""
    if not cudagraphs_enabled() or cudagraph_trees_enabled():
        return
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    ours = [n for n in nodes if n.target in _DECODE_OPS or functionalized_target(n) in _WRITER_OPS]
    if not ours:
        return
    written = [n.args[0] for n in nodes if n.target is torch.ops.aten.copy_.default
               and isinstance(n.args[0], torch.fx.Node) and n.args[0].op == "placeholder"
               and _on_cuda(n.args[0]) and not _written_by_our_cache_writer(n.args[1])]
    if written:
        raise RuntimeError(
            f"mla_inductor: this compiled graph writes {len(written)} of its CUDA inputs in place (the graph's "
            f"{', '.join(p.name for p in written)}; e.g. the sequence lengths) and is compiled with "
            f"triton.cudagraph_trees=False, whose CUDA graphs run the first call twice (warm-up, then the first "
            f"replay): the writes would happen twice and decoding would go on one position off. Use the default "
            f"CUDA-graph trees (torch.compile(..., mode=\"reduce-overhead\")), or compile without CUDA graphs.")


_WRITER_OPS = {torch.ops.mla.cache_append.default}


def _on_cuda(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.device.type == "cuda"


def _written_by_our_cache_writer(value: Any) -> bool:
    """Whether ``value`` is the cache a functionalized ``mla.cache_append`` returns: the same slots get the same
    rows on a second run."""
    return (isinstance(value, torch.fx.Node) and value.target is operator.getitem
            and functionalized_target(value.args[0]) in _WRITER_OPS)


class MLALoweringPass(CustomGraphPass):
    """Inductor post-grad pass rewriting ``mla.paged_decode(_with_lse)`` into the selected backend.

    ``uuid()`` covers this package's source, the user's backend preference and the backend environment,
    so the FX graph cache never serves a graph compiled for another choice.
    """

    def __init__(self, previous: Optional[Any] = None):
        self.previous = previous  # the post-grad pass(es) the user had installed before us
        self.plan_ops = PlanOps()
        self.contexts: dict[torch.fx.Node, CallContext] = {}  # of the graph being rewritten
        self._patterns = None

    def _previous_passes(self) -> list:
        return as_pass_list(self.previous)

    def _decode_patterns(self):
        if self._patterns is None:
            self._patterns = pattern_pass("mla_inductor_lowering", _DECODE_OPS,
                                          functools.partial(_lower_decode_call, self))
        return self._patterns

    def __call__(self, graph: torch.fx.Graph) -> None:
        for previous in self._previous_passes():
            previous(graph)
        refuse_one_graph_cudagraphs_writing_inputs(graph)
        if any(n.op == "call_function" and n.target in _DECODE_OPS for n in graph.nodes):
            self.contexts = _call_contexts(graph)
            try:
                with decisions_of_graph() as made:
                    self._decode_patterns().apply(graph)
            finally:
                self.contexts = {}
            _share_plans(graph, self.plan_ops)
            write_record(graph, made)
            graph.eliminate_dead_code()
        lower_merge_calls(graph)

    def uuid(self) -> Optional[Any]:
        previous = []
        for p in self._previous_passes():
            uuid = p.uuid() if isinstance(p, CustomGraphPass) else None
            if not uuid:
                return None  # an unhashable user pass: Inductor must not cache
            previous.append(uuid)
        h = hashlib.sha256(_source_hash())
        h.update(_environment_key().encode())
        h.update(repr(previous).encode())
        return h.hexdigest()


def installed_pass() -> Optional[MLALoweringPass]:
    current = current_post_grad_pass()
    return current if isinstance(current, MLALoweringPass) else None


_direct_calls_arranged = False


def install() -> MLALoweringPass:
    """Make our pass Inductor's post-grad custom pass (idempotent; keeps a user's pass, run first). It
    takes the place of the placeholder ``import mla_inductor`` put there, if that is still there. The ops the
    pass writes into graphs are then called by the compiled code without the dispatcher (``_library.
    define_op(direct=True)``, ``_compat.call_without_dispatcher``): those defined so far and each later one."""
    global _direct_calls_arranged
    if not _direct_calls_arranged:
        _direct_calls_arranged = True
        watch_direct_ops(call_without_dispatcher)
    current = installed_pass()
    if current is None:
        previous = current_post_grad_pass()
        if is_placeholder_pass(previous):
            previous = previous.previous
        current = MLALoweringPass(previous=previous)
        set_post_grad_pass(current)
    return current


def uninstall() -> None:
    current = installed_pass()
    if current is not None:
        set_post_grad_pass(current.previous)
