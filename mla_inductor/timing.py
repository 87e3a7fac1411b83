"""Time backends the way a call will run (the GPU side of ``tuning``): ``time_backends``.

Three program shapes (``tuning.ProgramShape.kind``, the kinds the selection table's rows are limited to):

- a whole step captured in CUDA graphs: ``shape.calls`` calls sharing one plan (a plan made on the device runs
  inside the graph once per step; one made on the host runs before, as Inductor leaves it outside the captured
  partitions), each call on its own query and cache; device time per call of the graph's replays (CUDA events).
- eager calls and steps without CUDA graphs: the same calls made through ``torch.ops.mla.paged_decode`` with the
  backend preferred, each step's lengths marked written (so no plan of the previous step is reused); wall time
  per call, host work included.
- a graph of one call: plan and call for every step (captured: the call replayed from a CUDA graph, a host plan
  before each replay); wall time per step.

Lengths are a serving batch's (``shape.varied``: drawn in [seq_len / 8, seq_len], fixed seed) or all equal.
Rounds alternate between the backends (a drift of the host's speed favours none); each backend's first round
also compiles its kernels and is not kept. Past ``BUDGET_S`` seconds for the class, no round starts after
the ``MIN_ROUNDS``-th.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, Optional, Sequence

import torch

from mla_inductor._compat import outside_dispatch_modes
from mla_inductor.backends import get_backend
from mla_inductor.cache import encode_tokens, fp8_scale_for, register_host_lengths
from mla_inductor.contract import DecodeProblem
from mla_inductor.selection import CAPTURED_STEP, ONE_CALL_GRAPH, CallContext, prefer_backends

ROUNDS = 7  # timed rounds per backend (interleaved across backends); the median of each is kept
MIN_ROUNDS = 3  # ... fewer (not below this) where a class's timing has spent BUDGET_S
BUDGET_S = 4.0  # seconds a new problem class may spend being timed, its backends' first runs included

TARGET_MS = 2.0  # each timed round repeats its step until about this long (bounded by MAX_REPEATS)
MAX_REPEATS = 50


def _inputs(problem: DecodeProblem, shape, device: torch.device, calls: int) -> dict:
    """Random inputs of ``shape``'s batch: ``calls`` queries and caches sharing one block table and lengths."""
    g = torch.Generator(device="cpu").manual_seed(0)
    B, S, page = shape.batch, shape.seq_len, problem.page_size
    L, R, H, per_seq = problem.kv_lora_rank, problem.rope_dim, problem.num_heads, problem.q_per_seq or 1
    T = B * per_seq
    pages = -(-S // page)
    lens = (torch.randint(max(1, S // 8), S + 1, (B,), generator=g) if shape.varied
            else torch.full((B,), S))
    host_lens = lens.to(torch.int32)
    seq_lens = host_lens.to(device)
    block_table = torch.randperm(B * pages, generator=g).to(torch.int32).view(B, pages).to(device)
    caches, queries = [], []
    on_device = torch.Generator(device=device).manual_seed(0)  # the large tensors are drawn where they live
    values = torch.randn(B * pages, page, L + R, generator=on_device, device=device)
    kv_scale = (fp8_scale_for(values) if problem.cache_format == "fp8_e4m3"
                else torch.ones(1, device=device))
    base = encode_tokens(values, problem.cache_format, kv_scale)
    del values  # fp32: at a large batch, more memory than the caches
    for i in range(calls):
        caches.append(base if i == 0 else base.clone())  # each call reads its own cache, as each layer does
        q = (torch.randn(T, H, L + R, generator=on_device, device=device) * 0.5).to(problem.q_dtype)
        queries.append((q[..., :L], q[..., L:]))
    sparse = None
    if problem.sparse:
        seq = torch.arange(T) // per_seq
        offsets = (torch.rand(T, problem.topk, generator=g) * lens[seq, None]).long()
        rows = block_table.cpu()[seq[:, None], offsets // page].long()
        sparse = (rows * page + offsets % page).to(torch.int32).to(device)
    return {"queries": queries, "caches": caches, "block_table": block_table, "seq_lens": seq_lens,
            "host_lens": host_lens, "kv_scale": kv_scale, "sparse": sparse, "scale": (L + R) ** -0.5}


def _new_step(x: dict) -> None:
    """Leave the lengths as a decode step's bookkeeping does: written (no plan of the last step is reused),
    their host copy registered."""
    torch.autograd.graph.increment_version(x["seq_lens"])
    register_host_lengths(x["seq_lens"], x["host_lens"])


def _args(x: dict, i: int) -> tuple:
    q_nope, q_pe = x["queries"][i]
    return (q_nope, q_pe, x["caches"][i], x["block_table"], x["seq_lens"], x["scale"], x["kv_scale"], x["sparse"])


def _step_of(name: str, problem: DecodeProblem, shape, x: dict) -> tuple[Callable[[], object], Callable]:
    """(host_plan, step) of one step made of the backend's compiled ops as the pass writes them: ``host_plan()``
    makes the plan where the backend plans on the host (None elsewhere), ``step(held)`` makes the step's calls
    given it: a plan made on the device first (or by the first call, where the decode makes it as a
    by-product), none where one call would use it and the run schedules itself, then every call on it.
    Backends without an op run their eager ``decode``."""
    backend = get_backend(name)
    context = CallContext(shape.calls, shape.captured)
    op, plan_op = backend.compiled_op_for(context), backend.plan_op()
    if op is None:
        def eager(held):
            for i in range(shape.calls):
                backend.decode(*_args(x, i))

        return (lambda: None), eager
    quantized = backend.quantized_query_op(problem)
    if quantized is not None:
        from mla_inductor.backends._common import quantize_query_reference

        q8 = [quantize_query_reference(torch.cat(q, dim=-1)) for q in x["queries"]]
        latent = problem.kv_lora_rank
        plan_args = (q8[0][0][..., :latent], q8[0][0][..., latent:], *_args(x, 0)[2:])

        def run(p, i):
            q, descale = q8[i]
            return quantized(q, descale, *_args(x, i)[2:], p, problem.q_dtype)
    else:
        plan_args = _args(x, 0)

        def run(p, i):
            return op(*_args(x, i), p)
    on_host = plan_op is not None and getattr(backend, "plans_on_host", False)
    unplanned = plan_op is None or (shape.calls == 1 and getattr(backend, "plan_is_optional", False))
    decode_and_plan = None if quantized is not None or unplanned else backend.decode_and_plan_op()

    def step(held):
        first = 0
        if unplanned:
            p = []
        elif on_host:
            p = held
        elif decode_and_plan is not None:
            p, first = list(decode_and_plan(*_args(x, 0))[2:]), 1
        else:
            p = plan_op(*plan_args)
        for i in range(first, shape.calls):
            run(p, i)

    return (lambda: plan_op(*plan_args) if on_host and not unplanned else None), step


def _captured_step(name: str, problem: DecodeProblem, shape, x: dict) -> Callable[[], float]:
    """A round of a captured step: microseconds of device time per call."""
    host_plan, step = _step_of(name, problem, shape, x)
    _new_step(x)
    held = host_plan()  # made once, outside the graph: Inductor leaves a host plan out of the captured partitions
    step(held)  # compiles the kernels, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(held)  # a warm-up on a side stream, as torch.cuda.graphs recommends before capturing
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        step(held)
    graph.replay()
    torch.cuda.synchronize()
    repeats = _repeats(graph.replay)

    def one_round() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1000 / (repeats * shape.calls)

    return one_round


def _uncaptured_step(name: str, problem: DecodeProblem, shape, x: dict) -> Callable[[], float]:
    """A round of eager calls (or a step compiled without CUDA graphs): wall microseconds per call."""
    def step():
        _new_step(x)
        for i in range(shape.calls):
            torch.ops.mla.paged_decode_with_lse(*_args(x, i))

    with prefer_backends(name):
        step()
        torch.cuda.synchronize()
        repeats = _repeats(step)

    def one_round() -> float:
        with prefer_backends(name):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(repeats):
                step()
            torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e6 / (repeats * shape.calls)

    return one_round


def _one_call_graph(name: str, problem: DecodeProblem, shape, x: dict) -> Callable[[], float]:
    """A round of one-call graphs: wall microseconds per graph call, its plan included."""
    host_plan, step = _step_of(name, problem, shape, x)
    _new_step(x)
    held = host_plan()
    step(held)
    torch.cuda.synchronize()
    if shape.captured:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(held)

        def call():
            _new_step(x)
            host_plan()  # a host plan runs outside the graph at every graph call
            graph.replay()
    else:
        def call():
            _new_step(x)
            step(host_plan())

    call()
    torch.cuda.synchronize()
    repeats = _repeats(call)

    def one_round() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e6 / repeats

    return one_round


def _repeats(step: Callable[[], object]) -> int:
    """How many steps make a round of about TARGET_MS."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1000
    return max(1, min(MAX_REPEATS, int(TARGET_MS / max(ms, 1e-3))))


def time_backends(problem: DecodeProblem, shape, names: Sequence[str], device,
                  rounds: Optional[int] = None) -> Mapping[str, object]:
    """Each backend's microseconds per call in each of ``rounds`` rounds (``ROUNDS``) of ``shape``, or
    why it could not run (a string)."""

    rounds = rounds or ROUNDS
    started = time.perf_counter()
    device = torch.device(device)
    how = {CAPTURED_STEP: _captured_step, ONE_CALL_GRAPH: _one_call_graph}.get(shape.kind, _uncaptured_step)
    results: dict[str, object] = {}
    with outside_dispatch_modes(), torch.no_grad(), torch.cuda.device(device):  # real tensors under a compile
        x = _inputs(problem, shape, device, shape.calls)
        timed = {}
        for name in names:
            try:
                timed[name] = how(name, problem, shape, x)
                timed[name]()  # its first round, not kept
                results[name] = []
            except Exception as e:  # noqa: BLE001 - a backend that fails to run here is reported, not chosen
                results[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        for done in range(rounds):
            if done >= MIN_ROUNDS and time.perf_counter() - started > BUDGET_S:
                break  # the class's budget is spent: the rounds so far decide
            for name, one_round in timed.items():
                if isinstance(results[name], list):
                    try:
                        results[name].append(one_round())
                    except Exception as e:  # noqa: BLE001
                        results[name] = f"{type(e).__name__}: {e}"[:300]
        del timed, x  # the inputs and captured graphs: gigabytes at a large batch, returned to the allocator
        torch.cuda.empty_cache()
    return results
