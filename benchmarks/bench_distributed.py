"""Decode context parallelism (DCP) on GPUs: what the merge costs, what DCP=2 can gain before communication,
and, on 2 GPUs, DCP=2 against DCP=1 per layer with the collectives included.

Usage (project root):
    python benchmarks/bench_distributed.py [--out DIR] [--quick]                        # parts (a), (b): one GPU
    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py [--out DIR] [--quick]   # (a), (b) on rank 0, + (c)

(a) ``mla.merge_attn_states(_n)`` (our Triton kernel) at H=128, L=512, bf16: achieved bandwidth on the bytes
    it must move (every part's output and LSE read, the merged output and LSE written) against a device copy
    of the same number of bytes and against the largest copy, both timed in the same run.
(b) one GPU, H=128, B in {1, 8}, S in {32k, 128k}, bf16 cache, page 64: rank 0's local step of DCP=2 (its S/2
    tokens, all 128 heads) plus the two-way merge, against the whole S: what DCP=2 gains before any
    communication. Beside it, the bytes each rank moves per layer in the collectives of DCP=2 inside TP=2
    (64 heads per rank) and their time at ``--link-gbps`` (default: 450 GB/s, NVLink 4's per-direction
    bandwidth per H100 SXM; the latency of each collective call comes on top and is not estimated).
(c) torchrun with 2 GPUs (NCCL), same shapes: per layer, one GPU doing all 128 heads over the whole S
    ("1 GPU"), TP=2 with the cache on both GPUs ("TP2 DCP1", 64 heads each), and TP=2 x DCP=2 ("TP2 DCP2",
    64 heads each, half the cache each, collectives included) with each exchange; the collectives alone;
    KV bytes per GPU; and the one-GPU and DCP steps compiled with ``mode="reduce-overhead"`` (CUDA graphs), or
    the measured reason they cannot be (``--profile``: then the compiled DCP step's kernel table).

Timing. (a): ``triton.testing.do_bench`` median (L2 flushed before each call). (b): a step of ``layers``
calls, each on its own cache copy (as each layer of a model has its own cache; at least 256 MB in all, so
L2 never holds the next call's cache), recorded in one CUDA graph (``--mode graph``, the default: the eager
op calls, no compile; a compiled step if capture fails), compiled with ``mode="reduce-overhead"``
(``--mode compiled``) or called eagerly (``--mode eager``), timed with do_bench and divided by ``layers``.
Which one ran is printed on every row. (c): the same per-layer steps on both GPUs at once with a fixed number of
iterations (both ranks must make the same collective calls), the device synchronised around them, the slower rank's time.

Everything printed is also written to DIR/bench_distributed.md and DIR/bench_distributed.json (``--out``).
Without CUDA it says so and exits 0; without 2 GPUs under torchrun, part (c) is skipped with the reason.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from typing import Callable, Optional

import report
import timing
import torch
import torch.distributed as dist

L, R, W = 512, 64, 576  # DeepSeek-V3: kv_lora_rank, rope dim, cache row
PAGE = 64
LAYER_CACHES_BYTES = 256 << 20
MAX_LAYERS = 16


class Setup:
    """Where and at what size the benchmark runs: the GPU at DeepSeek-V3 sizes, or (``--smoke``) the CPU at toy
    sizes, which checks the script itself (every part, part (c) with gloo under torchrun); its times mean nothing."""

    def __init__(self, smoke: bool, heads: int):
        self.smoke = smoke
        self.device = "cpu" if smoke else "cuda"
        self.heads = 8 if smoke else heads

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def free(self) -> None:
        torch._dynamo.reset()
        if self.device == "cuda":
            torch.cuda.empty_cache()

    def bench_ms(self, fn: Callable) -> float:
        """Median ms per call: triton's do_bench on the GPU (L2 flushed before each call)."""
        return timing.median_ms(fn, self.device)


class Report:
    """Lines printed as they come (rank 0 only), and the results, for the markdown and JSON files."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.lines: list[str] = []
        self.results: dict = {}

    def say(self, line: str = "") -> None:
        if self.enabled:
            report.progress(line)
            self.lines.append(line)

    def write(self, out_dir: Optional[str]) -> None:
        if self.enabled:
            markdown = "# bench_distributed\n\n```\n" + "\n".join(self.lines) + "\n```"
            report.write_results(out_dir, "bench_distributed", markdown, self.results)


def environment() -> dict:
    env = report.environment(("flash_mla",))
    if torch.cuda.is_available():
        env["gpus visible"] = torch.cuda.device_count()
        env["cuda"] = torch.version.cuda
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError):  # a build without NCCL
            env["nccl"] = None
    return env


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return report.relative_error(a, b)


# --------------------------------------------------------------------------------------------------------
# (a) the merge kernel's bandwidth


def merge_bytes(N: int, T: int, H: int, Lv: int, itemsize: int = 2) -> int:
    """Bytes the merge must move: every part's output and LSE read, the merged output and LSE written."""
    return N * T * H * (Lv * itemsize + 4) + T * H * (Lv * itemsize + 4)


def copy_gbps(setup: Setup, nbytes: int) -> float:
    """Device-to-device copy moving ``nbytes`` in all (half read, half written), GB/s."""
    src = torch.empty(max(1, nbytes // 4), dtype=torch.bfloat16, device=setup.device)
    dst = torch.empty_like(src)
    ms = setup.bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / ms / 1e6


def part_a(rep: Report, setup: Setup, quick: bool) -> None:
    H = setup.heads
    rep.say(f"== (a) mla.merge_attn_states_n: Triton kernel bandwidth vs a device copy (H={H}, L=512, bf16)")
    peak_bytes = (16 << 20) if setup.smoke else (2 << 30)
    peak = copy_gbps(setup, peak_bytes)
    rep.say(f"device copy of {peak_bytes >> 20} MiB (read + write): {peak:.0f} GB/s")
    if setup.smoke:
        shapes = [(2, 4), (8, 4)]
    else:
        shapes = [(2, t) for t in ((64, 4096) if quick else (1, 8, 64, 512, 4096))]
        shapes += [(8, t) for t in ((64, 1024) if quick else (1, 8, 64, 512, 1024))]
    rows = []
    rep.say(f"{'N':>3} {'T':>5} {'MB moved':>9} {'merge us':>9} {'merge GB/s':>10} {'copy GB/s':>9} "
            f"{'vs copy':>7} {'vs peak copy':>12}")
    for N, T in shapes:
        g = torch.Generator(device=setup.device).manual_seed(N * 10000 + T)
        outs = torch.randn(N, T, H, L, generator=g, device=setup.device).bfloat16()
        lses = torch.randn(N, T, H, generator=g, device=setup.device) * 4
        nbytes = merge_bytes(N, T, H, L)
        ms = setup.bench_ms(lambda: torch.ops.mla.merge_attn_states_n(outs, lses))
        merge = nbytes / ms / 1e6
        same = copy_gbps(setup, nbytes)
        row = dict(N=N, T=T, bytes=nbytes, merge_us=ms * 1e3, merge_gbps=merge, copy_gbps=same,
                   vs_copy=merge / same, vs_peak_copy=merge / peak)
        rows.append(row)
        rep.say(f"{N:>3} {T:>5} {nbytes / 1e6:>9.1f} {ms * 1e3:>9.1f} {merge:>10.0f} {same:>9.0f} "
                f"{merge / same:>7.2f} {merge / peak:>12.2f}")
        outs = lses = None  # free them before the next size (lambdas above read them)
    big = [r for r in rows if r["bytes"] >= 256e6]
    if big:
        worst = min(r["vs_peak_copy"] for r in big)
        rep.say(f"rows moving >= 256 MB (L2 plays no part): merge at >= {worst:.2f} of the peak copy bandwidth")
    rep.results["merge_bandwidth"] = dict(peak_copy_gbps=peak, rows=rows)
    setup.free()


# --------------------------------------------------------------------------------------------------------
# Shapes shared by (b) and (c)


class Problem:
    """B sequences of S tokens, H=128 heads, bf16, pages of 64 tokens laid out sequence after sequence.

    ``whole``: the single-GPU caches [B*S/64, 64, 576] (one per layer) with block table ``table``;
    ``shard(r)``: rank r's part of each under DCP=2, interleave 1 (token i on rank i % 2): the caches
    [B*S/128, 64, 576] with the shared block table ``dcp_table`` (pages of 128 virtual tokens)."""

    def __init__(self, B: int, S: int, layers: int, heads: int, seed: int = 0, device: str = "cuda"):
        self.B, self.S, self.layers, self.heads = B, S, layers, heads
        g = torch.Generator(device=device).manual_seed(seed)
        pages = S // PAGE
        self.whole = [torch.randn(B * pages, PAGE, W, generator=g, device=device).bfloat16() for _ in range(layers)]
        self.table = torch.arange(B * pages, dtype=torch.int32, device=device).view(B, pages)
        self.dcp_table = torch.arange(B * pages // 2, dtype=torch.int32, device=device).view(B, pages // 2)
        self.seq_lens = torch.full((B,), S, dtype=torch.int32, device=device)
        self.kv_scale = torch.ones(1, dtype=torch.float32, device=device)
        q = torch.randn(layers, B, heads, W, generator=g, device=device) * 0.5
        self.q = q.bfloat16()  # [layers, B, H, L+R]: each layer its own query
        self.scale = W ** -0.5

    def shard(self, rank: int) -> list[torch.Tensor]:
        return [c.view(self.B, self.S, W)[:, rank::2].reshape(-1, PAGE, W).contiguous() for c in self.whole]

    @staticmethod
    def layers_for(B: int, S: int, shards: int = 2) -> int:
        per_layer = B * S * W * 2 // shards
        return max(2, min(MAX_LAYERS, math.ceil(LAYER_CACHES_BYTES / per_layer)))

    def kv_bytes(self, caches) -> int:
        return caches[0].numel() * caches[0].element_size()


def problems(rep: Report, setup: Setup, batches, contexts):
    """The Problem of each (B, S), with as many layer caches as ``layers_for`` gives a whole S; says which
    as it comes. The caller drops each one (``del``) before asking for the next."""
    for B in batches:
        for S in contexts:
            layers = Problem.layers_for(B, S, shards=1)
            rep.say(f"-- B={B} S={S}: {layers} layer caches")
            yield Problem(B, S, layers, setup.heads, seed=B + S, device=setup.device)


def collective_bytes(B: int, H: int, dcp: int, tp_heads: int) -> dict:
    """Bytes each rank sends (= receives) per layer in DCP=dcp with ``tp_heads`` query heads per rank, bf16 out."""
    T, h, share = B, tp_heads, (dcp - 1)
    q = share * T * h * W * 2  # all-gather of the absorbed query (L + R per head)
    lse = share * T * H * 4  # all-gather of the LSE of every head of the group
    out = share * T * h * L * 2  # reduce-scatter of the rescaled output
    a2a = share * T * h * (L + 2) * 2  # all-to-all of (output | LSE as two bf16) per head block
    return {"ag_rs": {"all_gather_q": q, "all_gather_lse": lse, "reduce_scatter_out": out, "total": q + lse + out},
            "a2a": {"all_gather_q": q, "all_to_all_out_lse": a2a, "total": q + a2a}}


def captured(step: Callable) -> Callable:
    """``step`` (eager op calls) recorded in one CUDA graph; returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture stream, as torch.cuda.graph requires
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def layers_step(call: Callable, layers: int, mode: str) -> tuple[Callable, str]:
    """A function running ``call(i)`` for every layer i, and how it runs. ``mode``: "graph" records the eager
    calls in one CUDA graph (no compile: quick), falling back to "compiled"; "compiled" is
    ``torch.compile(mode="reduce-overhead")`` (the pass's choice of kernels, CUDA graphs); "eager" calls them."""
    def step():
        return [call(i) for i in range(layers)]

    if mode == "graph":
        try:
            return captured(step), "eager op calls in one CUDA graph"
        except Exception as e:  # noqa: BLE001 - reported, then the next way
            print(f"  CUDA graph capture failed ({type(e).__name__}: {str(e)[:200]}); compiling", flush=True)
            torch.cuda.synchronize()
            mode = "compiled"
    if mode == "compiled":
        torch._dynamo.reset()  # each step compiles afresh (no recompile limit, no stale CUDA-graph pool)
        compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
        try:
            for _ in range(3):  # compile, record, replay
                compiled()
            return compiled, "compiled, CUDA graphs"
        except Exception as e:  # noqa: BLE001 - reported, then timed eager
            print(f"  compiled step failed ({type(e).__name__}: {str(e)[:200]}); timing eager", flush=True)
            return step, f"eager (compiled step failed: {type(e).__name__})"
    return step, "eager"


# --------------------------------------------------------------------------------------------------------
# (b) what DCP=2 gains before communication, on one GPU


def part_b(rep: Report, setup: Setup, batches, contexts, mode: str, link_gbps: float) -> None:
    from mla_inductor.distributed import DCPLayout, local_decode_with_lse
    from mla_inductor.selection import backend_for_call

    H = setup.heads
    rep.say()
    rep.say(f"== (b) one GPU: rank 0's local step of DCP=2 (S/2 tokens, {H} heads) + merge vs the whole S "
            f"(bf16, page {PAGE})")
    rows = []
    for p in problems(rep, setup, batches, contexts):
        B, S, layers = p.B, p.S, p.layers
        shards = [p.shard(0), p.shard(1)]
        layouts = [DCPLayout(2, 0), DCPLayout(2, 1)]

        def whole(i):
            return torch.ops.mla.paged_decode_with_lse(p.q[i, ..., :L], p.q[i, ..., L:], p.whole[i], p.table,
                                                       p.seq_lens, p.scale, p.kv_scale)

        def local(i, rank=0):
            return local_decode_with_lse(p.q[i, ..., :L], p.q[i, ..., L:], shards[rank][i], p.dcp_table,
                                         p.seq_lens, p.scale, p.kv_scale, layouts[rank])

        other = [local(i, rank=1) for i in range(layers)]  # what rank 1 would send: fixed inputs of the merge
        report.mark_static((*p.whole, *shards[0], *shards[1], p.table, p.dcp_table, p.seq_lens, p.kv_scale, p.q,
                            *[x for pair in other for x in pair]))

        def local_and_merge(i):
            out, lse = local(i)
            return torch.ops.mla.merge_attn_states(out, lse, *other[i])

        want, got = whole(0), local_and_merge(0)
        err_out, err_lse = rel_err(got[0], want[0]), rel_err(got[1], want[1])
        chosen_whole = backend_for_call(p.q[0, ..., :L], p.q[0, ..., L:], p.whole[0], p.table, p.seq_lens,
                                        p.scale, p.kv_scale).backend
        chosen_local = backend_for_call(p.q[0, ..., :L], p.q[0, ..., L:], shards[0][0], p.dcp_table,
                                        layouts[0].local_lengths(p.seq_lens), p.scale, p.kv_scale).backend
        times, how = {}, {}
        for name, call in (("whole S", whole), ("local S/2 + merge", local_and_merge), ("local S/2", local)):
            step, how[name] = layers_step(call, layers, "eager" if setup.smoke else mode)
            times[name] = setup.bench_ms(step) / layers
            rep.say(f"   {name:<18} {times[name] * 1e3:8.1f} us per layer  [{how[name]}]")
        outs = torch.randn(2, B, H, L, device=setup.device).bfloat16()
        lses = torch.randn(2, B, H, device=setup.device)
        merge_ms = setup.bench_ms(lambda: torch.ops.mla.merge_attn_states(outs[0], lses[0], outs[1], lses[1]))
        coll = collective_bytes(B, H, dcp=2, tp_heads=H // 2)
        est = {k: v["total"] / (link_gbps * 1e9) * 1e6 for k, v in coll.items()}
        gain = times["whole S"] / times["local S/2 + merge"]
        rep.say(f"   merge alone (own launch) {merge_ms * 1e3:.1f} us; backend whole: {chosen_whole}, local: "
                f"{chosen_local}; merged vs whole: out err {err_out:.1e}, lse err {err_lse:.1e}")
        rep.say(f"   whole / (local + merge) = {gain:.2f}x before communication; KV per GPU "
                f"{p.kv_bytes(p.whole) / 1e6:.1f} -> {p.kv_bytes(shards[0]) / 1e6:.1f} MB per layer")
        ag, a2a = coll["ag_rs"], coll["a2a"]
        rep.say(f"   collectives per layer, DCP=2 in TP=2 ({H // 2} heads per rank), bytes each rank sends: "
                f"ag_rs {ag['total'] / 1e3:.1f} kB (q {ag['all_gather_q'] / 1e3:.1f}, lse "
                f"{ag['all_gather_lse'] / 1e3:.1f}, out {ag['reduce_scatter_out'] / 1e3:.1f}) = {est['ag_rs']:.2f} us "
                f"at {link_gbps:.0f} GB/s; a2a {a2a['total'] / 1e3:.1f} kB = {est['a2a']:.2f} us "
                f"(+ the latency of 3 resp. 2 collective calls)")
        rows.append(dict(B=B, S=S, H=H, layers=layers, us_whole=times["whole S"] * 1e3,
                         us_local_plus_merge=times["local S/2 + merge"] * 1e3, us_local=times["local S/2"] * 1e3,
                         us_merge_alone=merge_ms * 1e3, gain_before_communication=gain, timing=how,
                         backend_whole=chosen_whole, backend_local=chosen_local, err_out=err_out,
                         err_lse=err_lse, collective_bytes_per_rank=coll, collective_us_at_link=est,
                         kv_bytes_whole=p.kv_bytes(p.whole), kv_bytes_shard=p.kv_bytes(shards[0])))
        p = shards = other = outs = lses = None  # free them before the next case
        setup.free()
    rep.results["local_step"] = dict(link_gbps=link_gbps, rows=rows)


# --------------------------------------------------------------------------------------------------------
# (c) 2 GPUs under torchrun


def timed_on_all_ranks(setup: Setup, fn: Callable, iters: int, warmup: int = 5) -> float:
    """ms per call of ``fn`` run ``iters`` times on every rank at once; the slowest rank's time."""
    for _ in range(warmup):
        fn()
    setup.sync()
    dist.barrier()
    ms = timing.mean_ms(fn, setup.device, warmup=0, iters=iters)
    slowest = torch.tensor([ms], device=setup.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)


def compiled_on_all_ranks(step: Callable, mode: str) -> tuple[Optional[Callable], str]:
    """``step`` compiled (``mode="reduce-overhead"``: CUDA graphs): (the compiled step, "CUDA graphs") when it
    compiled without a graph break and Inductor recorded a CUDA graph, else (None or the step, the measured
    reason)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True, mode=mode)
    try:
        for _ in range(3):
            compiled()
    except Exception as e:  # noqa: BLE001 - the reason is the result
        return None, f"compile or capture failed: {type(e).__name__}: {str(e)[:300]}"
    breaks = sum(counters["graph_break"].values())
    skips = counters["inductor"]["cudagraph_skips"]
    if breaks:
        return None, f"{breaks} graph breaks: {dict(counters['graph_break'])}"
    if mode != "reduce-overhead":
        return compiled, f"compiled ({mode}), no CUDA graphs"
    if skips:
        return compiled, f"compiled, but Inductor skipped CUDA graphs ({skips}x; TORCH_LOGS=cudagraphs says why)"
    return compiled, "compiled, CUDA graphs"


def profiled_on_all_ranks(step: Callable, layers: int) -> str:
    """torch.profiler's kernel table of 3 calls of ``step`` (rank 0's; both ranks run it: the collectives pair up),
    by device time: where a layer's microseconds go (the local decode, each collective, the merge)."""
    dist.barrier()
    table = report.step_profile(step, "cuda", steps=3, rows=20, callers=(), sort_by="device_time_total")
    dist.barrier()
    return table


def part_c(rep: Report, setup: Setup, batches, contexts, link_gbps: float, iters: int, exchanges,
           profile: bool = False) -> None:
    from mla_inductor.distributed import DCPGroup, all_gather, all_to_all, dcp_decode, reduce_scatter_sum

    world, rank = dist.get_world_size(), dist.get_rank()
    H = setup.heads
    h = H // world
    rep.say()
    rep.say(f"== (c) {world} ranks ({dist.get_backend()}): DCP=2 vs DCP=1 per layer, collectives included "
            f"(bf16, page {PAGE}, H={H})")
    rows = []
    for p in problems(rep, setup, batches, contexts):  # the same values on both ranks (seeded by B and S)
        B, S, layers = p.B, p.S, p.layers
        shard = p.shard(rank)
        q_mine = p.q[:, :, rank * h:(rank + 1) * h].contiguous()
        report.mark_static((*p.whole, *shard, p.table, p.dcp_table, p.seq_lens, p.kv_scale, p.q, q_mine))

        def one_gpu():
            return [torch.ops.mla.paged_decode(p.q[i, ..., :L], p.q[i, ..., L:], p.whole[i], p.table, p.seq_lens,
                                               p.scale, p.kv_scale) for i in range(layers)]

        def tp_only():
            return [torch.ops.mla.paged_decode(q_mine[i, ..., :L], q_mine[i, ..., L:], p.whole[i], p.table,
                                               p.seq_lens, p.scale, p.kv_scale) for i in range(layers)]

        def dcp_step(dcp):
            return lambda: [dcp_decode(q_mine[i, ..., :L], q_mine[i, ..., L:], shard[i], p.dcp_table, p.seq_lens,
                                       p.scale, p.kv_scale, dcp) for i in range(layers)]

        names = {"one": f"1 GPU ({H} heads, whole S)", "tp": f"TP2 DCP1 ({h} heads, whole S)"}
        steps = {names["one"]: one_gpu, names["tp"]: tp_only}
        dcps = {x: DCPGroup.from_group(exchange=x) for x in exchanges}
        for x, dcp in dcps.items():
            steps[f"TP2 DCP2 {x}"] = dcp_step(dcp)
        want = tp_only()[0]
        row = dict(B=B, S=S, H=H, layers=layers, us={}, err={},
                   kv_bytes_per_gpu={"DCP1": p.kv_bytes(p.whole), "DCP2": p.kv_bytes(shard)})
        for x in exchanges:
            row["err"][x] = rel_err(steps[f"TP2 DCP2 {x}"]()[0], want)
        for name, step in steps.items():
            row["us"][name] = timed_on_all_ranks(setup, step, iters) / layers * 1e3
            rep.say(f"   {name:<30} {row['us'][name]:8.1f} us per layer (eager)")
        # The collectives alone, on this shape's tensors.
        group = next(iter(dcps.values())).group
        q_cat = torch.cat([q_mine[0, ..., :L], q_mine[0, ..., L:]], -1)
        lse = torch.randn(B, H, device=setup.device)
        out_blocks = torch.randn(world * B, h, L, device=setup.device).bfloat16()
        packed = torch.randn(world * B, h, L + 2, device=setup.device).bfloat16()
        collectives = {"ag_rs": lambda: (all_gather(q_cat, 1, group), all_gather(lse, 0, group),
                                         reduce_scatter_sum(out_blocks, group)),
                       "a2a": lambda: (all_gather(q_cat, 1, group), all_to_all(packed, group))}
        paper = collective_bytes(B, H, dcp=world, tp_heads=h)
        row["collectives_us"], row["collectives_paper_us"] = {}, {}
        for x in exchanges:
            row["collectives_us"][x] = timed_on_all_ranks(setup, collectives[x], iters) * 1e3
            row["collectives_paper_us"][x] = paper[x]["total"] / (link_gbps * 1e9) * 1e6
            rep.say(f"   collectives alone, {x:<5} {row['collectives_us'][x]:8.1f} us per layer measured, "
                    f"{row['collectives_paper_us'][x]:.2f} us on paper ({paper[x]['total'] / 1e3:.1f} kB per rank "
                    f"at {link_gbps:.0f} GB/s, latency not counted)")
        base, tp = row["us"][names["one"]], row["us"][names["tp"]]
        for x in exchanges:
            dcp_us = row["us"][f"TP2 DCP2 {x}"]
            rep.say(f"   DCP=2 {x}: {base / dcp_us:.2f}x faster than 1 GPU, {tp / dcp_us:.2f}x than TP2 DCP1; "
                    f"err vs TP2 DCP1 {row['err'][x]:.1e}")
        rep.say(f"   KV bytes per GPU per layer: DCP1 {row['kv_bytes_per_gpu']['DCP1'] / 1e6:.1f} MB, "
                f"DCP2 {row['kv_bytes_per_gpu']['DCP2'] / 1e6:.1f} MB")
        row["compiled"] = {}
        compile_mode = "default" if setup.smoke else "reduce-overhead"
        # The one-GPU step compiled the same way: the DCP step's like-for-like baseline.
        compiled, how = compiled_on_all_ranks(one_gpu, compile_mode)
        entry = {"status": how}
        if compiled is not None:
            entry["us"] = timed_on_all_ranks(setup, compiled, iters) / layers * 1e3
            how += f": {entry['us']:.1f} us per layer"
        row["compiled"]["one"] = entry
        rep.say(f"   compiled 1-GPU step: {how}")
        for x in exchanges:
            compiled, how = compiled_on_all_ranks(steps[f"TP2 DCP2 {x}"], compile_mode)
            entry = {"status": how}
            if compiled is not None:
                entry["err_vs_tp2_dcp1"] = rel_err(compiled()[0], want)
                entry["us"] = timed_on_all_ranks(setup, compiled, iters) / layers * 1e3
                how += f": {entry['us']:.1f} us per layer, err vs TP2 DCP1 {entry['err_vs_tp2_dcp1']:.1e}"
                if isinstance(row["compiled"]["one"].get("us"), float):
                    how += f", speed-up over the compiled 1-GPU step {row['compiled']['one']['us'] / entry['us']:.2f}x"
                if profile and not setup.smoke:
                    table = profiled_on_all_ranks(compiled, layers)
                    rep.say(f"   --- torch.profiler, 3 compiled DCP steps ({x}, {layers} layers each), rank 0, by "
                            f"device time\n{table}")
            row["compiled"][x] = entry
            rep.say(f"   compiled DCP step, {x}: {how}")
        rows.append(row)
        p = shard = steps = q_mine = None  # free them before the next case
        setup.free()
    rep.results["two_gpus"] = dict(world=world, link_gbps=link_gbps, iters=iters, rows=rows)


# --------------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    report.add_out_argument(parser)
    parser.add_argument("--quick", action="store_true", help="B=1 and S=32k only, fewer merge sizes")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--contexts", default="32768,131072")
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--mode", choices=("graph", "compiled", "eager"), default="graph",
                        help="(b): eager op calls recorded in a CUDA graph, a compiled CUDA-graph step, or eager calls")
    parser.add_argument("--link-gbps", type=float, default=450.0, help="per-direction GPU link bandwidth, GB/s")
    parser.add_argument("--iters", type=int, default=50, help="(c): timed iterations per step")
    parser.add_argument("--exchanges", default="ag_rs,a2a")
    parser.add_argument("--parts", default="a,b,c")
    parser.add_argument("--profile", action="store_true",
                        help="(c): after timing each compiled DCP step, torch.profiler's kernel table of 3 of its steps "
                             "(rank 0's, by device time; the profiler slows what follows it)")
    parser.add_argument("--smoke", action="store_true",
                        help="toy sizes on the CPU (gloo under torchrun): checks the script, times mean nothing")
    args = parser.parse_args(argv)
    setup = Setup(args.smoke, args.heads)
    batches = [1] if args.quick or args.smoke else [int(x) for x in args.batches.split(",")]
    contexts = [512] if args.smoke else [32768] if args.quick else [int(x) for x in args.contexts.split(",")]
    exchanges = args.exchanges.split(",")
    parts = set(args.parts.split(","))
    if args.smoke:
        args.iters = 2

    launched = dist.is_available() and dist.is_torchelastic_launched()  # under torchrun
    if launched:
        dist.init_process_group("nccl" if setup.device == "cuda" and torch.cuda.is_available() else "gloo")
    world, rank = (dist.get_world_size(), dist.get_rank()) if launched else (1, 0)
    rep = Report(enabled=rank == 0)
    import mla_inductor.lowering  # noqa: F401  (the compiled steps go through the pass)

    rep.results["environment"] = environment()
    rep.results["argv"] = sys.argv
    rep.results["skipped"] = {}
    rep.say(f"bench_distributed{' --smoke (CPU, toy sizes: times mean nothing)' if args.smoke else ''}: "
            f"{report.environment_line(rep.results['environment'])}")
    if not args.smoke and not torch.cuda.is_available():
        reason = ("needs a CUDA GPU: parts (a) and (b) time GPU kernels, part (c) needs 2 GPUs under torchrun; "
                  f"torch.cuda.is_available() is False here (torch {torch.__version__}). Nothing was run.")
        rep.say(f"skipped: {reason}")
        rep.results["skipped"]["all"] = reason
        rep.write(args.out)
        if launched:
            dist.destroy_process_group()
        return 0
    if launched and setup.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())  # one process per GPU of this host
    started = time.time()
    try:
        if rank == 0:
            if "a" in parts:
                part_a(rep, setup, args.quick)
            if "b" in parts:
                part_b(rep, setup, batches, contexts, args.mode, args.link_gbps)
        if "c" in parts:
            if world != 2:
                reason = (f"part (c) needs 2 GPUs under torchrun (--nproc-per-node 2); this run has world size {world}"
                          f" and {torch.cuda.device_count()} visible GPU(s)")
                rep.say()
                rep.say(f"skipped: {reason}")
                rep.results["skipped"]["c"] = reason
            else:
                dist.barrier()
                part_c(rep, setup, batches, contexts, args.link_gbps, args.iters, exchanges, args.profile)
    except Exception:  # noqa: BLE001 - what ran is still written, then the error goes on
        rep.say("FAILED:\n" + traceback.format_exc())
        rep.results["failed"] = traceback.format_exc()
        rep.write(args.out)
        raise
    finally:
        if launched and dist.is_initialized():
            dist.destroy_process_group()
    rep.say(f"done in {time.time() - started:.0f} s")
    rep.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
