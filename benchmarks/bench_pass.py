"""What the compiler pass costs: compiled ``mla.paged_decode`` vs the peers called directly, and a
61-layer decode step under CUDA graphs vs the same kernels called by hand with one plan.

    python benchmarks/bench_pass.py [--quick] [--layers 61] [--backends chosen,flashmla,flashinfer_fa3]
        [--cases 0-3 | --case var,64,16,8192 ...] [--formats bf16,fp8_e4m3,fp8_ds_mla]
        [--fp8-queries static,measured,bf16] [--q-producer none,rope,rope-joined] [--no-sparse] [--no-step]
        [--out DIR]

Cases and peers come from ``benchmarks/peers.py`` (peers found by import; one not installed is reported
and skipped) and are timed in the same run, the same way (do_bench median, warmup=25, rep=200). For
each case, cache format and backend:

- ``per call``: a compiled step (CUDA graphs, ``mode="reduce-overhead"``) making ``--layers`` calls
  that share block_table / seq_lens, as the layers of one forward do, each on its own query and its own
  cache (``peers.layer_caches``: L2 never holds a call's cache, as for the peers); its time divided by the
  number of calls. The plan (if the backend has one) is made once per step and is
  part of the time, as in a model; peers are timed with a plan made once outside the loop.
- ``1 call``: a compiled step with one call (plan included), for the backend the table chose.
- ``graphed peer`` (dense cases): the peers within 1.3x of the fastest, each captured ``--layers``
  times in one CUDA graph with its own query and cache per call (plan outside, as in peers.py): the
  same conditions as ``per call``. A single call timed with L2 flushed before it pays launch latency
  and does not run back to back with the next one, so ``graphed/ours`` is what the plugin itself
  costs, and ``peer/ours`` what the acceptance line compares.

Dense fp8_e4m3 rows run once per ``--fp8-queries`` mode: ``static`` (the op given a static q_scale, the
per-tensor scale the fp8 peers quantize their query with, so backends that take q in e4m3 may run),
``measured`` (under ``allow_fp8_query``: the scale measured per call, in the graph) and ``bf16`` (the
default: no opt-in, q stays bf16). Dense fp8_ds_mla rows compare with FlashMLA's sparse kernel called
by hand on every position (sgl-flash-mla's and vLLM's builds).

Where q comes from (``--q-producer``, dense rows; column ``q_made``): ``none`` (the default, the
kernel-only rows above): q is an input of the step, and the peers get it ready-made, quantized outside
the timed region for the fp8 peers. ``rope`` / ``rope-joined``: every call's q is computed in the timed
step as a model computes it (``benchmarks/query_producer.py``: a per-channel weight on the latent part,
DeepSeek's interleaved rope on the rope part), on both sides: ours in the compiled step, where the pass's
quantization of q fuses into that producer; each peer runs the same producer, compiled by Inductor, then
the quantization its users write (fp8 peers: ``q / q_scale``, clamp, e4m3) into the buffers its kernel
reads, captured with the kernel in the same CUDA graph. ``rope`` hands the op q_nope and q_pe as two
tensors (as ``mla_inductor.hf`` does), ``rope-joined`` as the two slices of one [T, H, 576] tensor. These
rows also record ``kernels_per_call``: the Inductor kernels the compiled step launches per call. Here only
``graphed/ours`` compares like with like: a peer's direct call also pays its compiled producer's host
dispatch before the kernel is launched.

The ratio is best peer time / ours (>= 1: the compiled op is at least as fast). ``chosen`` is the
backend the selection table picks here. ``--out DIR`` writes bench_pass.md and bench_pass.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import re
import traceback
from typing import Optional

import peers as peer_kernels
import query_producer
import torch
import report

import mla_inductor

D_CKV = 512
_bench = report.median_ms
_err = report.relative_error
RECORDS: list = []  # one dict per compiled backend and case, for --out


def _chosen_backend(q, kv_cache, block_table, seq_lens, scale, kv_scale, sparse_indices, q_scale=None) -> str:
    args = (q[..., :D_CKV], q[..., D_CKV:], kv_cache, block_table, seq_lens, scale, kv_scale, sparse_indices)
    return mla_inductor.backend_for_call(*args, q_scale).backend


@dataclasses.dataclass(frozen=True)
class MadeQuery:
    """q computed in the step (``--q-producer``): the mode, and the first call's producer inputs."""

    producer: query_producer.Producer
    first: query_producer.ProducedQuery


def _step_and_args(calls: int, q, caches, block_table, seq_lens, scale, kv_scale, sparse_indices, q_scale,
                   made: Optional[MadeQuery]):
    """(step function, its arguments, the tensors to mark static): ``calls`` calls on q given as inputs
    (``made`` None; the first is ``q``) or on q made in the step from ``made``'s producer inputs."""
    if made is None:  # each call on its own query and cache (identical calls would be merged by CSE)
        qs = peer_kernels.layer_queries(q, calls)
        return report.decode_calls(scale), (qs, caches, block_table, seq_lens, kv_scale, sparse_indices, q_scale), qs
    layers = made.first.layers(calls)
    args = query_producer.step_arguments(layers, caches, block_table, seq_lens, kv_scale, sparse_indices, q_scale)
    step = query_producer.produced_query_step(scale, made.producer.joined)
    return step, args, [t for p in layers for t in (p.q_raw, p.w_nope, p.cos, p.sin)]


KERNEL_LAUNCH = re.compile(r"^\s+\w+\.run\(", re.M)  # a Triton kernel launched by Inductor's wrapper code


def _first_call_counting_kernels(step, args):
    """(the step's first call's output, Inductor kernels its generated code launches, or None where the
    code could not be read)."""
    try:
        from torch._inductor.utils import run_and_get_code
    except ImportError:
        return step(*args), None
    out, codes = run_and_get_code(step, *args)
    return out, (sum(len(KERNEL_LAUNCH.findall(code)) for code in codes) if codes else None)


def compile_calls(backend: str, calls: int, q, kv_cache, block_table, seq_lens, scale, kv_scale,
                  sparse_indices=None, query: "QueryMode" = None, made: Optional[MadeQuery] = None):
    """(step, args, output of the first call, Inductor kernels launched per step or None) of a compiled
    CUDA-graph step making ``calls`` calls on ``backend`` (None: the table's choice), already compiled and
    recorded; ``query``: how the calls treat q (a static q_scale, or allow_fp8_query); ``made``: q computed
    in the step (``--q-producer``; None: q is an input)."""
    query = query or BF16_QUERY
    caches = peer_kernels.layer_caches(kv_cache, calls)
    fn, args, query_inputs = _step_and_args(calls, q, caches, block_table, seq_lens, scale, kv_scale,
                                            sparse_indices, query.q_scale, made)
    torch._dynamo.reset()
    report.mark_static([*query_inputs, *caches, block_table, seq_lens, kv_scale, sparse_indices, query.q_scale])
    step = torch.compile(fn, fullgraph=True, mode="reduce-overhead")
    kernels = None
    with contextlib.ExitStack() as stack:
        if backend:
            stack.enter_context(mla_inductor.prefer_backends(backend))
        stack.enter_context(mla_inductor.allow_fp8_query(query.allow))
        for i in range(3):  # compile, record, replay
            if i == 0 and made is not None:
                first, kernels = _first_call_counting_kernels(step, args)
                out = first[0].clone()
            else:
                out = step(*args)[0].clone()
    return step, args, out, kernels


def time_compiled(backend: str, calls: int, q, kv_cache, block_table, seq_lens, scale, kv_scale,
                  sparse_indices=None, query: "QueryMode" = None, made: Optional[MadeQuery] = None):
    """(time of one call in ms, its output, Inductor kernels launched per call or None) for ``calls`` calls
    per compiled CUDA-graph step on ``backend`` (None: the table's choice)."""
    step, args, out, kernels = compile_calls(backend, calls, q, kv_cache, block_table, seq_lens, scale, kv_scale,
                                             sparse_indices, query, made)
    ms = _bench(functools.partial(step, *args))
    del step, args
    torch._dynamo.reset()  # frees the CUDA-graph pool and the cache copies before the next case
    torch.cuda.empty_cache()
    return ms / calls, out, (kernels / calls if kernels is not None else None)


GRAPHED_PEERS_WITHIN = 1.3  # peers this close to the fastest are also timed inside a CUDA graph


def fresh_query(c: dict) -> dict:
    """Another call's query: the case entries to replace (a new random q of the same distribution)."""
    return dict(q=torch.randn_like(c["q"], dtype=torch.float32).mul_(0.5).to(c["q"].dtype))


def time_peer_graphed(make, c, cache_key: str, calls: int, fresh=fresh_query) -> float:
    """ms per call of a peer captured ``calls`` times in one CUDA graph, each call on its own query and
    cache as in ``time_compiled``: the peer under the same conditions as ours (back-to-back calls, no
    launch latency, no L2 flush between calls), which separates what the plugin costs from how a
    single call is timed. ``cache_key``: the case entry the peer reads its cache from; ``fresh(c)``: the
    entries giving another call its own query."""
    copies = peer_kernels.layer_caches(c[cache_key], calls)
    layers = tuple(dict({} if i == 0 else fresh(c), **{cache_key: cache}) for i, cache in enumerate(copies))
    step = peer_kernels.direct_step("peer", c, calls, layers, makers={"peer": make})
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.run()
    ms = _bench(graph.replay) / calls
    del graph, step, copies
    torch.cuda.empty_cache()
    return ms


def _best_peer(peers, makers: dict, c, rows: list, cache_key: Optional[str] = None, calls: int = 0,
               fresh=fresh_query):
    """((name, ms) of the fastest peer that runs here, each timed now as peers.py does, and (name, ms)
    of the fastest in a ``calls``-call CUDA graph among those within GRAPHED_PEERS_WITHIN of it; (None,
    inf) without ``cache_key``). ``fresh``: as in ``time_peer_graphed``."""
    times = {}
    for name, make in makers.items():
        try:
            fn = make(c)
            fn()
            times[name] = _bench(fn)
        except peer_kernels.PeerMissing as e:
            print(f"  peer {name}: not installed: {e}", flush=True)
            continue
        except Exception as e:  # noqa: BLE001 - a peer that cannot run here is reported, not fatal
            print(f"  peer {name} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        rows.append(f"  peer {name:<22} {times[name] * 1e3:8.1f} us")
        print(rows[-1], flush=True)
    if not times:
        return (None, float("inf")), (None, float("inf"))
    best = peer_kernels.fastest(times)
    graphed = {}
    for name, ms in times.items():
        if cache_key is None or ms > GRAPHED_PEERS_WITHIN * best[1]:
            continue
        try:
            graphed[name] = time_peer_graphed(makers[name], c, cache_key, calls, fresh)
        except Exception as e:  # noqa: BLE001
            print(f"  peer {name} in a CUDA graph failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        rows.append(f"  peer {name:<22} {graphed[name] * 1e3:8.1f} us per call in a {calls}-call CUDA graph")
        print(rows[-1], flush=True)
    best_graphed = peer_kernels.fastest(graphed) if graphed else (None, float("inf"))
    return best, best_graphed


def _candidates(wanted: list[str], chosen: str, problem_args, query: "QueryMode") -> list[str]:
    """``wanted`` with 'chosen' replaced by the table's choice, minus backends that cannot run the call."""
    from mla_inductor.backends import availability, device_capability, get_backend
    from mla_inductor.contract import check_decode_args

    problem = check_decode_args(*problem_args, query.q_scale)
    if query.allow:
        problem = dataclasses.replace(problem, fp8_query=True)
    capability = device_capability(problem_args[0].device)
    names = []
    for name in wanted:
        name = chosen if name == "chosen" else name
        if name in names or availability().get(name, "unknown") is not None:
            continue
        if get_backend(name).supports(problem, capability) is None:
            names.append(name)
    return names


@dataclasses.dataclass(frozen=True)
class QueryMode:
    """How the compiled calls treat q: ``q_scale`` (a static per-tensor scale given to the op) and
    ``allow`` (under ``allow_fp8_query``); both off: q stays bf16 (the default)."""

    name: str
    q_scale: Optional[torch.Tensor] = None
    allow: bool = False


BF16_QUERY = QueryMode("bf16 q")


def fp8_query_modes(names: list[str], q_scale: torch.Tensor) -> list[QueryMode]:
    """The ``--fp8-queries`` modes of an fp8_e4m3 row; ``q_scale``: the static scale (as the peers take it)."""
    known = {"static": QueryMode("static q_scale", q_scale=q_scale),
             "measured": QueryMode("measured q scale", allow=True), "bf16": BF16_QUERY}
    return [known[n] for n in names]


def per_call_rows(label: str, makers: dict, c, q, kv_cache, block_table, seq_lens, scale, kv_scale, sparse_indices,
                  ref, peers, layers: int, wanted: list[str], rows: list, cache_key: Optional[str] = None,
                  queries: tuple = (BF16_QUERY,), made: Optional[MadeQuery] = None) -> None:
    """The peers (also in a ``layers``-call CUDA graph when ``cache_key`` names their cache), then for each
    query mode each candidate backend compiled: per call in a ``layers``-call step, and the chosen
    backend's one-call step. ``made``: q computed in the step on both sides (``--q-producer``; ``c``
    then carries the first call's producer inputs, see ``produced_case``)."""
    rows.append(f"{label}")
    print(label, flush=True)
    if made is not None:
        makers = {name: produced_peer(make, peers.QUERY_ENTRIES.get(name, ("q",))) for name, make in makers.items()}
    peer_times = _best_peer(peers, makers, c, rows, cache_key, layers,
                            fresh_query if made is None else fresh_produced_query)
    call = (q, kv_cache, block_table, seq_lens, scale, kv_scale, sparse_indices)
    problem_args = (q[..., :D_CKV], q[..., D_CKV:], kv_cache, block_table, seq_lens, scale, kv_scale, sparse_indices)
    for query in queries:
        if len(queries) > 1:
            rows.append(f" {query.name}")
            print(rows[-1], flush=True)
        with mla_inductor.allow_fp8_query(query.allow):
            chosen = _chosen_backend(*call, query.q_scale)
        for name in _candidates(wanted, chosen, problem_args, query):
            _compiled_row(label, query, name, chosen, peer_times, call, ref, layers, rows, made)


def _compiled_row(label: str, query: QueryMode, name: str, chosen: str, peer_times, call, ref, layers: int,
                  rows: list, made: Optional[MadeQuery] = None) -> None:
    """Time ``name`` compiled on ``call`` (q, kv_cache, block_table, seq_lens, scale, kv_scale,
    sparse_indices) per call in a ``layers``-call step (and in a one-call step if it is the table's
    choice); one record and one printed row. ``made``: q computed in the step (``--q-producer``)."""
    (best_name, best), (graphed_name, graphed) = peer_times
    try:
        ms, out, kernels = time_compiled(name, layers, *call, query, made)
        single, ms1 = "", None
        if name == chosen:
            ms1, _, _ = time_compiled(name, 1, *call, query, made)
            single = f"  1 call {ms1 * 1e3:7.1f} us ({best / ms1:5.3f})"
        RECORDS.append(dict(case=label, query=query.name, q_made=made.producer.name if made else "input",
                            backend=name, chosen=name == chosen,
                            us_per_call=ms * 1e3, best_peer=best_name, peer_us=best * 1e3 if best_name else None,
                            peer_over_ours=best / ms if best_name else None, graphed_peer=graphed_name,
                            graphed_over_ours=graphed / ms if graphed_name else None,
                            us_one_call=ms1 * 1e3 if ms1 else None, rel_err=_err(out, ref),
                            kernels_per_call=kernels))
        in_graph = (f"  graphed peer {graphed_name} {graphed * 1e3:.1f} us  graphed/ours={graphed / ms:5.3f}"
                    if graphed_name else "")
        launched = f"  {kernels:.2f} Inductor kernels per call" if kernels is not None else ""
        row = (f"  ours {name + ('*' if name == chosen else ''):<18} per call {ms * 1e3:7.1f} us  "
               f"best peer {best_name} {best * 1e3:.1f} us  peer/ours={best / ms:5.3f}{in_graph}{single}  "
               f"err={_err(out, ref):.1e}{launched}")
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        row = f"  ours {name}: FAILED {type(e).__name__}: {str(e)[:200]}"
    print(row, flush=True)
    rows.append(row)


# ----------------------------------------------------------------------------- q made in the step (--q-producer)

def produced_case(peers, base: dict, producer: query_producer.Producer, seed: int = 0) -> tuple[dict, MadeQuery]:
    """A dense case whose query is made by ``producer`` (first call's inputs in ``c["produced"]``, q in
    ``c["q"]``, its static scale in ``c["q_scale"]``), on ``base``'s cache and page table; and the
    ``MadeQuery`` for our compiled step."""
    c = {key: base[key] for key in ("B", "H", "S", "page", "lens", "block_table", "cache", "scale")}
    positions = c["lens"].long() - 1  # the decoded token's position in each sequence
    made = query_producer.ProducedQuery.random(c["B"], c["H"], D_CKV, peers.D_PE, positions,
                                               generator=torch.Generator().manual_seed(seed))
    c.update(produced=made, q=made.query())
    c["q_scale"] = peers.query_scale(c)
    return c, MadeQuery(producer, made)


@functools.cache
def compiled_writer(entries: tuple[str, ...]):
    """``query_producer.query_writer(entries)`` compiled by Inductor (one fused kernel, as ours gets)."""
    return torch.compile(query_producer.query_writer(entries), fullgraph=True, dynamic=False)


def produced_peer(make, entries: tuple[str, ...]):
    """A peer maker whose call first writes its query (``entries``: the case entries ``make``'s kernel reads
    it from, ``peers.QUERY_ENTRIES``) from the case's producer inputs ``c["produced"]``, then runs the
    kernel: the producer and the peer's quantization in the timed call, as ours has them."""
    writer = compiled_writer(entries)

    def make_produced(c: dict):
        made = c["produced"]
        q = made.query()  # the call's q in bf16: the kernel's reference
        buffers = query_producer.query_buffers(entries, q, made.w_nope.shape[-1])

        def write():
            writer(made.q_raw, made.w_nope, made.cos, made.sin, c["q_scale"], *buffers)

        write()
        case = dict(c, q=q)
        case.update(zip(entries, buffers))  # "q" itself, where the kernel reads the bf16 q in place
        kernel = make(case)

        def run():
            write()
            return kernel()

        return run

    return make_produced


def fresh_produced_query(c: dict) -> dict:
    """Another call's producer inputs (``time_peer_graphed``'s ``fresh`` for --q-producer rows)."""
    return dict(produced=c["produced"].fresh_layer())


def dense_rows(peers, cases, layers: int, wanted: list[str], rows: list, formats=("bf16", "fp8_e4m3", "fp8_ds_mla"),
               fp8_queries=("static", "measured", "bf16"), q_producers=("none",)) -> None:
    """Each case, for each ``--q-producer`` mode ("none": q given, else ``query_producer.PRODUCERS``),
    each cache format in ``formats``."""
    for cfg in cases:
        varlen = cfg[0] == "var"
        B, H, S = cfg[1:] if varlen else cfg
        base = peers.make_case(B, H, S, varlen=varlen)
        for mode in q_producers:
            c, made = (base, None) if mode == "none" else produced_case(peers, base, query_producer.PRODUCERS[mode])
            dense_format_rows(peers, c, varlen, layers, wanted, rows, formats, fp8_queries, made)


def dense_format_rows(peers, c: dict, varlen: bool, layers: int, wanted: list[str], rows: list, formats,
                      fp8_queries, made: Optional[MadeQuery] = None) -> None:
    """One dense case's rows, each cache format in ``formats`` (``made``: q made in the step)."""
    B, H, S = c["B"], c["H"], c["S"]
    ref = peers.reference(c)
    one = torch.ones(1, dtype=torch.float32, device=c["q"].device)
    cache, k_scale = peers.fp8_cache(c)
    variants = [("bf16", c["cache"], one, ref, "cache"),
                ("fp8_e4m3", cache, k_scale.reshape(1).float(), c["ref_fp8"], "cache_fp8")]
    if "fp8_ds_mla" in formats:
        c["cache_ds"], deq_ds = peers.ds_mla_cache(c["cache"])
        variants.append(("fp8_ds_mla", c["cache_ds"], one, peers.reference(c, deq_ds), "cache_ds"))
    for fmt, kv_cache, kv_scale, want, key in variants:
        if fmt not in formats:
            continue
        makers = peers.DENSE_DS_PEERS if key == "cache_ds" else {
            n: m for n, m in peers.PEERS.items() if n.endswith("fp8") == (key == "cache_fp8")}
        queries = (fp8_query_modes(list(fp8_queries), peers.query_scale(c)) if key == "cache_fp8"
                   else [BF16_QUERY])
        label = f"{'var' if varlen else ''}B={B} H={H} S={S} {fmt}"
        if made is not None:
            label += f", q made in the step ({made.producer.name})"
        per_call_rows(label, makers, c, c["q"], kv_cache, c["block_table"], c["lens"], c["scale"], kv_scale,
                      None, want, peers, layers, wanted, rows, cache_key=key, queries=tuple(queries), made=made)


def sparse_rows(peers, layers: int, wanted: list[str], rows: list) -> None:
    """DSA top-k: a bf16 cache (FlashInfer's page-size-1 recipe) and the 656-byte fp8_ds_mla cache
    (FlashMLA sparse), each against the peer that reads the same cache."""
    for B, H, S, topk in peers.SPARSE:
        c = peers.sparse_case(B, H, S, topk)
        one = torch.ones(1, dtype=torch.float32, device=c["q"].device)
        packed, deq = peers.ds_mla_cache(c["cache"])
        for fmt, kv_cache, names, cache_for_ref in (
                ("bf16", c["cache"], ("flashinfer_fa3_sparse",), c["cache"]),
                ("fp8_ds_mla", packed, ("flashmla_sparse_fp8", "sgl_flashmla_sparse_fp8"), deq)):
            ref = peers.sparse_reference(c, cache_for_ref)
            label = f"sparse B={B} H={H} S={S} topk={topk} {fmt}"
            per_call_rows(label, {n: peers.SPARSE_PEERS[n] for n in names}, c, c["q"], kv_cache, c["block_table"],
                          c["lens"], c["scale"], one, c["indices"], ref, peers, layers, wanted, rows)


def layered_step_overhead(peers, layers: int, B: int, H: int, S: int, rows: list) -> None:
    """A decode step of ``layers`` attention calls sharing block_table/seq_lens: compiled with CUDA graphs
    (mode="reduce-overhead") vs the chosen backend's ops called by hand with one plan, captured."""
    from mla_inductor.backends import get_backend

    c = peers.make_case(B, H, S)
    q, cache, block_table, seq_lens, scale = c["q"], c["cache"], c["block_table"], c["lens"], c["scale"]
    q_nope, q_pe = q[..., :D_CKV].contiguous(), q[..., D_CKV:].contiguous()
    kv_scale = torch.ones(1, dtype=torch.float32, device=q.device)
    caches = [cache.clone() for _ in range(layers)]

    def step(q_nope, q_pe, block_table, seq_lens, kv_scale, caches):
        h = q_nope
        for kv in caches:
            h = h + 0.01 * torch.ops.mla.paged_decode(h, q_pe, kv, block_table, seq_lens, scale, kv_scale)
        return h

    torch._dynamo.reset()
    report.mark_static([q_nope, q_pe, block_table, seq_lens, kv_scale, *caches])
    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):
        compiled(q_nope, q_pe, block_table, seq_lens, kv_scale, caches)
    chosen = _chosen_backend(q, cache, block_table, seq_lens, scale, kv_scale, None)
    backend = get_backend(chosen)
    run_op, plan_op, decode_and_plan_op = backend.compiled_op(), backend.plan_op(), backend.decode_and_plan_op()
    if run_op is None:
        rows.append(f"layers={layers}: backend {chosen} has no op to call by hand; skipped")
        return
    unsafe = plan_op is not None and torch.Tag.cudagraph_unsafe in plan_op.tags

    def layers_by_hand(plan, first: int = 0):
        h = q_nope if first == 0 else plan.pop(0)
        for kv in caches[first:]:
            h = h + 0.01 * run_op(h, q_pe, kv, block_table, seq_lens, scale, kv_scale, None, plan)[0]
        return h

    def by_hand():
        if decode_and_plan_op is not None:  # the first layer makes the plan while decoding
            out, _, *plan = decode_and_plan_op(q_nope, q_pe, caches[0], block_table, seq_lens, scale, kv_scale, None)
            return layers_by_hand([q_nope + 0.01 * out] + plan, first=1)
        plan = plan_op(q_nope, q_pe, caches[0], block_table, seq_lens, scale, kv_scale, None) if plan_op else []
        return layers_by_hand(plan)

    if unsafe:  # host-side planning cannot be captured: plan outside, capture the layers
        plan = plan_op(q_nope, q_pe, caches[0], block_table, seq_lens, scale, kv_scale, None)
        body = lambda: layers_by_hand(list(plan))  # noqa: E731
    else:
        body = by_hand
    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    if unsafe:
        def hand():
            plan_op(q_nope, q_pe, caches[0], block_table, seq_lens, scale, kv_scale, None)
            graph.replay()
    else:
        hand = graph.replay
    t_hand = _bench(hand)
    t_compiled = _bench(lambda: compiled(q_nope, q_pe, block_table, seq_lens, kv_scale, caches))
    row = (f"{layers}-layer step B={B} H={H} S={S} via {chosen}: compiled+cudagraphs {t_compiled*1e3:8.1f} us, "
           f"by hand (one plan, captured) {t_hand*1e3:8.1f} us, overhead {100 * (t_compiled / t_hand - 1):+.1f}%")
    print(row, flush=True)
    rows.append(row)
    RECORDS.append(dict(case=f"{layers}-layer step B={B} H={H} S={S}", backend=chosen, chosen=True,
                        step_us=t_compiled * 1e3, by_hand_us=t_hand * 1e3, overhead=t_compiled / t_hand - 1))


def _select(cases, spec: str):
    if not spec:
        return cases
    lo, _, hi = spec.partition("-")
    return cases[int(lo): int(hi or lo) + 1]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="peers.QUICK cases only")
    p.add_argument("--layers", type=int, default=61, help="calls per compiled step (DeepSeek-V3: 61)")
    p.add_argument("--backends", default="chosen,flashmla,flashinfer_fa3",
                   help="backends compiled per case ('chosen' = the table's choice)")
    p.add_argument("--cases", default="", help="index range of the dense cases, e.g. 0-3")
    p.add_argument("--case", action="append", default=[],
                   help="a dense case instead of peers.FULL: B,H,S or var,B,H,S (repeatable)")
    p.add_argument("--formats", default="bf16,fp8_e4m3,fp8_ds_mla", help="cache formats of the dense cases")
    p.add_argument("--fp8-queries", default="static,measured,bf16",
                   help="how the dense fp8_e4m3 rows treat q: static (a q_scale), measured (allow_fp8_query), bf16")
    p.add_argument("--q-producer", default="none",
                   help="where the dense rows' q comes from, comma-separated: none (an input of the step, the "
                        "kernel-only rows), rope (made in the timed step on both sides, q_nope and q_pe as two "
                        "tensors), rope-joined (likewise, the two slices of one [T, H, 576] tensor)")
    p.add_argument("--no-sparse", action="store_true")
    p.add_argument("--no-step", action="store_true", help="skip the 61-layer overhead rows")
    report.add_out_argument(p)
    args = p.parse_args(argv)
    q_producers = tuple(m.strip() for m in args.q_producer.split(",") if m.strip())
    unknown = [m for m in q_producers if m != "none" and m not in query_producer.PRODUCERS]
    if unknown or not q_producers:
        p.error(f"--q-producer: expected none, {', '.join(query_producer.PRODUCERS)}, got {args.q_producer!r}")
    report.require_gpu("bench_pass.py")
    peers = peer_kernels
    wanted = [n.strip() for n in args.backends.split(",") if n.strip()]
    env = report.environment(("flashinfer", "flash_mla", "vllm"))
    rows = [f"# {report.environment_line(env)}",
            f"# per call = a compiled CUDA-graph step of {args.layers} calls / {args.layers}; * = the table's choice"]
    report.progress("\n".join(rows))
    cases = [tuple(int(x) if x != "var" else x for x in spec.split(",")) for spec in args.case] or _select(
        peers.QUICK if args.quick else peers.FULL, args.cases)
    sections = [("dense", lambda: dense_rows(peers, cases, args.layers, wanted, rows,
                                              tuple(args.formats.split(",")), tuple(args.fp8_queries.split(",")),
                                              q_producers))]
    if not args.no_sparse:
        sections.append(("sparse", lambda: sparse_rows(peers, args.layers, wanted, rows)))
    if not args.no_step:
        sections += [(f"{args.layers}-layer step B={B}",
                      lambda B=B: layered_step_overhead(peers, args.layers, B, 128, 4096, rows)) for B in (16, 64)]
    for name, section in sections:
        report.progress(f"## {name}")
        try:
            section()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    columns = ["case", "query", "q_made", "backend", "chosen", "us_per_call", "best_peer", "peer_us", "peer_over_ours",
               "graphed_peer", "graphed_over_ours", "us_one_call", "rel_err", "kernels_per_call", "step_us",
               "by_hand_us", "overhead"]
    markdown = "\n".join([f"Compiled op vs the peers, {report.environment_line(env)}", "",
                          report.markdown_table(columns, RECORDS)])
    report.write_results(args.out, "bench_pass", markdown, {"environment": env, "rows": RECORDS, "log": rows})


if __name__ == "__main__":
    main()
