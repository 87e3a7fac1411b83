"""What the compiler pass costs: compiled ``mla.paged_decode`` vs the best peer called directly, and a
61-layer decode step under CUDA graphs vs the same kernels called by hand with one plan.

Usage (GPU machine, project root):
    source .gpu-deps/env.sh; python -m mla_inductor.bench_pass [--quick] [--layers 61]

Cases and peers come from ``.gpu-deps/peers.py`` (imported), timed the same way (do_bench median,
warmup=25, rep=200). Each row prints the backend the pass chose, our time, the best peer's time, and
their ratio (peer time / ours: >= 1 means the compiled op is at least as fast). The table also goes to
$OUT/bench_pass.txt.
"""

from __future__ import annotations

import argparse
import os
import time
import traceback

import torch

D_CKV = 512


def _contract_args(c, kv_cache=None, kv_scale=None):
    q = c["q"]
    one = torch.ones(1, dtype=torch.float32, device=q.device)
    return (q[..., :D_CKV].contiguous(), q[..., D_CKV:].contiguous(),
            c["cache"] if kv_cache is None else kv_cache, c["block_table"], c["lens"], c["scale"],
            one if kv_scale is None else kv_scale)


def _decode(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale):
    return torch.ops.mla.paged_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale)


def _mark_static(tensors) -> None:
    """CUDA-graph trees copy every graph input whose address may change into a static buffer at each
    replay; a KV cache (hundreds of MB) must be marked static, as PagedLatentCache does for its tensors."""
    for t in tensors:
        if isinstance(t, torch.Tensor):
            torch._dynamo.mark_static_address(t)


def _chosen_backend(args) -> str:
    from mla_inductor.selection import backend_for_call

    return backend_for_call(*args).backend


def _bench(fn):
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def compiled_vs_peers(peers, cases, fp8: bool, rows: list) -> None:
    """One mla.paged_decode per compiled step, run as users run decode (CUDA graphs): the step's plan
    (if the backend has one) is part of its cost, where the peers are timed with a plan made once."""
    import mla_inductor.lowering  # noqa: F401  installs the pass

    names = [n for n in peers.PEERS if n.endswith("fp8") == fp8 and "vllm" not in n]
    for cfg in cases:
        varlen = cfg[0] == "var"
        B, H, S = cfg[1:] if varlen else cfg
        c = peers.make_case(B, H, S, varlen=varlen)
        ref = peers.reference(c)
        if fp8:
            cache, k_scale = peers.fp8_cache(c)
            args = _contract_args(c, cache, k_scale.reshape(1).float())
            ref = c["ref_fp8"]
        else:
            args = _contract_args(c)
        torch._dynamo.reset()
        _mark_static(args)
        step = torch.compile(_decode, fullgraph=True, mode="reduce-overhead")
        for _ in range(3):  # warm-up, record, replay
            out = step(*args).clone()
        chosen = _chosen_backend(args)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        ours = _bench(lambda: step(*args))
        best_name, best = None, float("inf")
        for name in names:
            try:
                ms = _bench(peers.PEERS[name](c))
            except Exception as e:  # noqa: BLE001 - a peer that cannot run here is reported, not fatal
                print(f"  peer {name} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            if ms < best:
                best_name, best = name, ms
        label = f"{'var' if varlen else ''}B={B:<4} H={H:<4} S={S:<6} {'fp8 ' if fp8 else 'bf16'}"
        row = (f"{label} compiled->{chosen:<16} {ours*1e3:8.1f} us  best peer {best_name:<20} {best*1e3:8.1f} us  "
               f"peer/ours={best / ours:5.3f}  err={err:.1e}")
        print(row, flush=True)
        rows.append(row)


def layered_step_overhead(peers, layers: int, B: int, H: int, S: int, rows: list) -> None:
    """A decode step of ``layers`` attention calls sharing block_table/seq_lens: compiled with CUDA graphs
    (mode="reduce-overhead") vs the chosen backend's plan op once + run op per layer, captured by hand."""
    import mla_inductor.lowering  # noqa: F401  installs the pass
    from mla_inductor.backends import get_backend

    c = peers.make_case(B, H, S)
    base = _contract_args(c)
    q_nope, q_pe, cache, block_table, seq_lens, scale, kv_scale = base
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
    chosen = _chosen_backend(base)
    backend = get_backend(chosen)
    run_op, plan_op = backend.compiled_op(), backend.plan_op()
    if run_op is None:
        rows.append(f"layers={layers}: backend {chosen} has no op to call by hand; skipped")
        return

    def by_hand():
        plan = plan_op(q_nope, q_pe, caches[0], block_table, seq_lens, scale, kv_scale, None) if plan_op else []
        h = q_nope
        for kv in caches:
            h = h + 0.01 * run_op(h, q_pe, kv, block_table, seq_lens, scale, kv_scale, None, plan)[0]
        return h

    unsafe = plan_op is not None and torch.Tag.cudagraph_unsafe in plan_op.tags
    if unsafe:  # host-side planning cannot be captured: plan outside, capture the layers
        plan = plan_op(q_nope, q_pe, caches[0], block_table, seq_lens, scale, kv_scale, None)

        def layers_only():
            h = q_nope
            for kv in caches:
                h = h + 0.01 * run_op(h, q_pe, kv, block_table, seq_lens, scale, kv_scale, None, plan)[0]
            return h
        body = layers_only
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


def main(argv=None) -> None:
    from mla_inductor.bench import _load_peers

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--layers", type=int, default=61)
    args = p.parse_args(argv)
    peers = _load_peers()
    cases = peers.QUICK if args.quick else peers.FULL
    rows = [f"# {torch.cuda.get_device_name()} torch {torch.__version__} {time.strftime('%Y-%m-%d')}"]
    for fp8 in (False, True):
        try:
            compiled_vs_peers(peers, cases, fp8, rows)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    for B in (16, 64):
        try:
            layered_step_overhead(peers, args.layers, B, 128, 4096, rows)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_pass.txt"), "w") as f:
            f.write("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
