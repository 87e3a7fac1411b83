"""What the compiler pass costs: compiled ``mla.paged_decode`` vs the peers called directly, and a
61-layer decode step under CUDA graphs vs the same kernels called by hand with one plan.

Usage (GPU machine, project root):
    source .gpu-deps/env.sh; python -m mla_inductor.bench_pass [--quick] [--layers 61]
        [--backends chosen,flashmla,flashinfer_fa3] [--cases 0-3 | --case var,64,16,8192 ...]
        [--formats bf16,fp8_e4m3] [--no-sparse] [--no-step]

Cases and peers come from ``.gpu-deps/peers.py`` (imported) and are timed in the same run, the same
way (do_bench median, warmup=25, rep=200). For each case, cache format and backend:

- ``per call``: a compiled step (CUDA graphs, ``mode="reduce-overhead"``) making ``--layers`` calls
  that share block_table / seq_lens, as the layers of one forward do, each on its own query; its time
  divided by the number of calls. The plan (if the backend has one) is made once per step and is
  part of the time, as in a model; peers are timed with a plan made once outside the loop.
- ``1 call``: a compiled step with one call (plan included), for the backend the table chose.

The ratio is best peer time / ours (>= 1: the compiled op is at least as fast). ``chosen`` is the
backend the selection table picks here. Everything printed also goes to $OUT/bench_pass.txt.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
import traceback

import torch

D_CKV = 512


def _bench(fn):
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def _mark_static(tensors) -> None:
    """CUDA-graph trees copy every graph input whose address may change into a static buffer at each
    replay; KV caches (hundreds of MB) must be marked static, as PagedLatentCache does for its tensors."""
    for t in tensors:
        if isinstance(t, torch.Tensor):
            torch._dynamo.mark_static_address(t)


def _err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _chosen_backend(q, kv_cache, block_table, seq_lens, scale, kv_scale, sparse_indices) -> str:
    from mla_inductor.selection import backend_for_call

    return backend_for_call(q[..., :D_CKV], q[..., D_CKV:], kv_cache, block_table, seq_lens, scale, kv_scale,
                            sparse_indices).backend


def _calls_step(calls: int, scale: float):
    """A step of ``calls`` decodes over one cache and page table, each on its own query (identical calls
    would be merged by common-subexpression elimination). q_nope/q_pe are slices of one [T, H, 576]
    query, the layout the kernels read (FlashMLA takes it without a copy)."""

    def step(qs, kv_cache, block_table, seq_lens, kv_scale, sparse_indices):
        return [torch.ops.mla.paged_decode(q[..., :D_CKV], q[..., D_CKV:], kv_cache, block_table, seq_lens, scale,
                                           kv_scale, sparse_indices) for q in qs]

    return step


def time_compiled(backend: str, calls: int, q, kv_cache, block_table, seq_lens, scale, kv_scale,
                  sparse_indices=None):
    """(time of one call in ms, its output) for ``calls`` calls per compiled CUDA-graph step on
    ``backend`` (None: the table's choice)."""
    import mla_inductor

    qs = [q] + [torch.randn_like(q, dtype=torch.float32).mul_(0.5).to(q.dtype) for _ in range(calls - 1)]
    args = (qs, kv_cache, block_table, seq_lens, kv_scale, sparse_indices)
    torch._dynamo.reset()
    _mark_static([*qs, kv_cache, block_table, seq_lens, kv_scale, sparse_indices])
    step = torch.compile(_calls_step(calls, scale), fullgraph=True, mode="reduce-overhead")
    with mla_inductor.prefer_backends(backend) if backend else contextlib.nullcontext():
        for _ in range(3):  # compile, record, replay
            out = step(*args)[0].clone()
    ms = _bench(lambda: step(*args))
    return ms / calls, out


def _best_peer(peers, makers: dict, c, rows: list):
    """(name, ms) of the fastest peer that runs here, each timed now."""
    best_name, best = None, float("inf")
    for name, make in makers.items():
        try:
            fn = make(c)
            fn()
            ms = _bench(fn)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run here is reported, not fatal
            print(f"  peer {name} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        rows.append(f"  peer {name:<22} {ms * 1e3:8.1f} us")
        print(rows[-1], flush=True)
        if ms < best:
            best_name, best = name, ms
    return best_name, best


def _candidates(wanted: list[str], chosen: str, problem_args) -> list[str]:
    """``wanted`` with 'chosen' replaced by the table's choice, minus backends that cannot run the call."""
    from mla_inductor.backends import availability, device_capability, get_backend
    from mla_inductor.contract import check_decode_args

    problem = check_decode_args(*problem_args)
    capability = device_capability(problem_args[0].device)
    names = []
    for name in wanted:
        name = chosen if name == "chosen" else name
        if name in names or availability().get(name, "unknown") is not None:
            continue
        if get_backend(name).supports(problem, capability) is None:
            names.append(name)
    return names


def per_call_rows(label: str, makers: dict, c, q, kv_cache, block_table, seq_lens, scale, kv_scale, sparse_indices,
                  ref, peers, layers: int, wanted: list[str], rows: list) -> None:
    """The peers, then each candidate backend compiled: per call in a ``layers``-call step, and the chosen
    backend's one-call step."""
    rows.append(f"{label}")
    print(label, flush=True)
    best_name, best = _best_peer(peers, makers, c, rows)
    chosen = _chosen_backend(q, kv_cache, block_table, seq_lens, scale, kv_scale, sparse_indices)
    problem_args = (q[..., :D_CKV], q[..., D_CKV:], kv_cache, block_table, seq_lens, scale, kv_scale, sparse_indices)
    for name in _candidates(wanted, chosen, problem_args):
        try:
            ms, out = time_compiled(name, layers, q, kv_cache, block_table, seq_lens, scale, kv_scale, sparse_indices)
            single = ""
            if name == chosen:
                ms1, _ = time_compiled(name, 1, q, kv_cache, block_table, seq_lens, scale, kv_scale, sparse_indices)
                single = f"  1 call {ms1 * 1e3:7.1f} us ({best / ms1:5.3f})"
            row = (f"  ours {name + ('*' if name == chosen else ''):<18} per call {ms * 1e3:7.1f} us  "
                   f"best peer {best_name} {best * 1e3:.1f} us  peer/ours={best / ms:5.3f}{single}  "
                   f"err={_err(out, ref):.1e}")
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row = f"  ours {name}: FAILED {type(e).__name__}: {str(e)[:200]}"
        print(row, flush=True)
        rows.append(row)


def dense_rows(peers, cases, layers: int, wanted: list[str], rows: list, formats=("bf16", "fp8_e4m3")) -> None:
    for cfg in cases:
        varlen = cfg[0] == "var"
        B, H, S = cfg[1:] if varlen else cfg
        c = peers.make_case(B, H, S, varlen=varlen)
        ref = peers.reference(c)
        one = torch.ones(1, dtype=torch.float32, device=c["q"].device)
        cache, k_scale = peers.fp8_cache(c)
        for fmt, kv_cache, kv_scale, want in (("bf16", c["cache"], one, ref),
                                              ("fp8_e4m3", cache, k_scale.reshape(1).float(), c["ref_fp8"])):
            if fmt not in formats:
                continue
            makers = {n: m for n, m in peers.PEERS.items() if n.endswith("fp8") == (fmt != "bf16")}
            label = f"{'var' if varlen else ''}B={B} H={H} S={S} {fmt}"
            per_call_rows(label, makers, c, c["q"], kv_cache, c["block_table"], c["lens"], c["scale"], kv_scale,
                          None, want, peers, layers, wanted, rows)


def sparse_rows(peers, layers: int, wanted: list[str], rows: list) -> None:
    """DSA top-k: a bf16 cache (FlashInfer's page-size-1 recipe) and the 656-byte fp8_ds_mla cache
    (FlashMLA sparse), each against the peer that reads the same cache."""
    for B, H, S, topk in peers.SPARSE:
        c = peers.sparse_case(B, H, S, topk)
        one = torch.ones(1, dtype=torch.float32, device=c["q"].device)
        packed, deq = peers.ds_mla_cache(c["cache"])
        for fmt, kv_cache, peer, cache_for_ref in (("bf16", c["cache"], "flashinfer_fa3_sparse", c["cache"]),
                                                   ("fp8_ds_mla", packed, "flashmla_sparse_fp8", deq)):
            ref = peers.sparse_reference(c, cache_for_ref)
            label = f"sparse B={B} H={H} S={S} topk={topk} {fmt}"
            per_call_rows(label, {peer: peers.SPARSE_PEERS[peer]}, c, c["q"], kv_cache, c["block_table"], c["lens"],
                          c["scale"], one, c["indices"], ref, peers, layers, wanted, rows)


def layered_step_overhead(peers, layers: int, B: int, H: int, S: int, rows: list) -> None:
    """A decode step of ``layers`` attention calls sharing block_table/seq_lens: compiled with CUDA graphs
    (mode="reduce-overhead") vs the chosen backend's ops called by hand with one plan, captured."""
    import mla_inductor.lowering  # noqa: F401  installs the pass
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
    _mark_static([q_nope, q_pe, block_table, seq_lens, kv_scale, *caches])
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


def _select(cases, spec: str):
    if not spec:
        return cases
    lo, _, hi = spec.partition("-")
    return cases[int(lo): int(hi or lo) + 1]


def main(argv=None) -> None:
    import mla_inductor.lowering  # noqa: F401  installs the pass
    from mla_inductor.backends import library_versions
    from mla_inductor.bench import _load_peers

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="peers.QUICK cases only")
    p.add_argument("--layers", type=int, default=61, help="calls per compiled step (DeepSeek-V3: 61)")
    p.add_argument("--backends", default="chosen,flashmla,flashinfer_fa3",
                   help="backends compiled per case ('chosen' = the table's choice)")
    p.add_argument("--cases", default="", help="index range of the dense cases, e.g. 0-3")
    p.add_argument("--case", action="append", default=[],
                   help="a dense case instead of peers.FULL: B,H,S or var,B,H,S (repeatable)")
    p.add_argument("--formats", default="bf16,fp8_e4m3", help="cache formats of the dense cases")
    p.add_argument("--no-sparse", action="store_true")
    p.add_argument("--no-step", action="store_true", help="skip the 61-layer overhead rows")
    args = p.parse_args(argv)
    peers = _load_peers()
    wanted = [n.strip() for n in args.backends.split(",") if n.strip()]
    versions = ", ".join(f"{k} {v}" for k, v in library_versions(("triton",)).items() if v)
    rows = [f"# {torch.cuda.get_device_name()} torch {torch.__version__}, {versions}, {time.strftime('%Y-%m-%d')}",
            f"# per call = a compiled CUDA-graph step of {args.layers} calls / {args.layers}; * = the table's choice"]
    print("\n".join(rows), flush=True)
    cases = [tuple(int(x) if x != "var" else x for x in spec.split(",")) for spec in args.case] or _select(
        peers.QUICK if args.quick else peers.FULL, args.cases)
    sections = [lambda: dense_rows(peers, cases, args.layers, wanted, rows, tuple(args.formats.split(",")))]
    if not args.no_sparse:
        sections.append(lambda: sparse_rows(peers, args.layers, wanted, rows))
    if not args.no_step:
        sections += [lambda B=B: layered_step_overhead(peers, args.layers, B, 128, 4096, rows) for B in (16, 64)]
    for section in sections:
        try:
            section()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_pass.txt"), "w") as f:
            f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
