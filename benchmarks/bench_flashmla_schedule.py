"""Why our FlashMLA calls read 2-3% slower than sgl-flash-mla's direct call at B >= 32 (GPU only, bf16, S=4096).

    python benchmarks/bench_flashmla_schedule.py [outputs] [profile] [schedules]   (default: all three)

Three checks, on bench_modes' part a inputs (61 calls back to back, each on its own query and cache):

1. ``outputs`` (the answer): µs per call of the peer's direct calls dropping each output at once (``drop``: how
   ``peers.direct_step`` called them until the tenth run) and keeping the step's outputs until it ends
   (``keep``: as our op's step returns them, and ``direct_step`` now does), against our op eager keeping them
   (``op_eager``, bench_modes' step), eager dropping them (``op_eager_drop``) and compiled with CUDA graphs
   (``op_cg``), three rounds in alternating order. A dropped output's block is handed to the next call while
   still in L2.
2. ``profile``: µs per call of the peer and of our eager op (FlashMLA selected), then torch.profiler's kernel
   table of one step of each: which kernels each runs and their average device time.
3. ``schedules``: the peer's own call three ways: with the schedule its first call makes (``internal``), with
   the schedule our plan makes (``get_mla_decoding_metadata(lens, H, 1, H, ...)``: ``ours``) and with the
   head count left out (``no_hq``), two rounds each; then whether our schedule equals the internal one.

``profile`` and ``schedules`` are the code the ninth run's figures in docs/results.md#program-shapes came from
(run from outside the repository then, committed after that run with its printing unchanged).
"""

from __future__ import annotations

import sys

import peers as pk
import torch

import bench_modes as bm
from report import require_gpu


def outputs(cases=((128, 128), (128, 16), (32, 128)), rounds: int = 3) -> None:
    fm = pk._flash_mla()
    for B, H in cases:
        case = bm.make_case(B, H, "bf16")
        c = case.c
        qs, caches, layers = pk.back_to_back_inputs(case, bm.CALLS)
        calls = []
        for layer in layers:
            cc = dict(c, **layer)
            q, kc = cc["q"].unsqueeze(1), cc["cache"].unsqueeze(2)
            meta, _ = fm.get_mla_metadata()
            calls.append(lambda q=q, kc=kc, meta=meta: fm.flash_mla_with_kvcache(
                q, kc, c["block_table"], c["lens"], 512, meta, None, softmax_scale=c["scale"], causal=False,
                use_legacy=True)[0])

        def drop():
            for i in range(bm.CALLS):
                calls[i % len(calls)]()

        def keep():
            return [calls[i % len(calls)]() for i in range(bm.CALLS)]

        def drop_step(qs, caches, block_table, seq_lens, kv_scale):
            out = None
            for i, q in enumerate(qs):
                out = torch.ops.mla.paged_decode(q[..., :512], q[..., 512:], caches[i % len(caches)], block_table,
                                                 seq_lens, c["scale"], kv_scale, None, None)
            return [out]

        drop(), keep()  # the first call makes each meta's schedule
        runs = {"drop": drop, "keep": keep, "op_eager": bm.OurStep(case, qs, caches, "eager").run,
                "op_eager_drop": bm.OurStep(case, qs, caches, "eager", step=drop_step).run,
                "op_cg": bm.OurStep(case, qs, caches, "cudagraphs").run}
        for rnd in range(rounds):
            order = list(runs.items()) if rnd % 2 == 0 else list(runs.items())[::-1]
            print(f"outputs B={B} H={H} round {rnd}: "
                  + ", ".join(f"{n} {bm.median_ms(run) * 1e3 / bm.CALLS:.1f}" for n, run in order), flush=True)
        del runs
        bm._free()


def profile(cases=((128, 128), (32, 128))) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for B, H in cases:
        case = bm.make_case(B, H, "bf16")
        qs, caches, layers = pk.back_to_back_inputs(case, bm.CALLS)
        steps, _ = pk.direct_steps(["sgl_flashmla"], case.c, bm.CALLS, layers)
        peer = steps["sgl_flashmla"]
        ours = bm.OurStep(case, qs, caches, "eager")
        for name, run in [("peer", peer.run), ("ours", ours.run)]:
            print(f"== B={B} H={H} {name}: {bm.median_ms(run) * 1e3 / bm.CALLS:.1f} us/call")
        for name, run in [("peer", peer.run), ("ours", ours.run)]:
            run()
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CUDA]) as p:
                run()
                torch.cuda.synchronize()
            print(f"--- {name} B={B}")
            print(p.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=70))
        del ours, peer, steps
        bm._free()


def schedules(cases=((128, 128), (32, 128), (128, 16))) -> None:
    fm = pk._flash_mla()
    for B, H in cases:
        case = bm.make_case(B, H, "bf16")
        c = case.c
        qs, caches, layers = pk.back_to_back_inputs(case, bm.CALLS)

        def maker(variant, H=H):
            def make(cc):
                q, kc = cc["q"].unsqueeze(1), cc["cache"].unsqueeze(2)
                meta, _ = fm.get_mla_metadata()
                if variant == "ours":
                    meta.tile_scheduler_metadata, meta.num_splits = fm.get_mla_decoding_metadata(
                        cc["lens"], H, 1, H, False, None, use_legacy=True)
                elif variant == "no_hq":
                    meta.tile_scheduler_metadata, meta.num_splits = fm.get_mla_decoding_metadata(
                        cc["lens"], H, 1, use_legacy=True)
                return lambda: fm.flash_mla_with_kvcache(q, kc, cc["block_table"], cc["lens"], 512, meta, None,
                                                         softmax_scale=cc["scale"], causal=False, use_legacy=True)[0]
            return make

        makers = {v: maker(v) for v in ("internal", "ours", "no_hq")}
        steps, not_timed = pk.direct_steps(list(makers), c, bm.CALLS, layers, makers)
        print(B, H, not_timed)
        for rnd in range(2):
            print(f"B={B} H={H} round {rnd}: "
                  + ", ".join(f"{n} {bm.median_ms(s.run) * 1e3 / bm.CALLS:.1f}" for n, s in steps.items()))
        internal, _ = fm.get_mla_metadata()
        q, kc = c["q"].unsqueeze(1), c["cache"].unsqueeze(2)
        fm.flash_mla_with_kvcache(q, kc, c["block_table"], c["lens"], 512, internal, None, softmax_scale=c["scale"],
                                  causal=False, use_legacy=True)
        md, splits = fm.get_mla_decoding_metadata(c["lens"], H, 1, H, False, None, use_legacy=True)
        same = (internal.tile_scheduler_metadata.shape == md.shape
                and bool((internal.tile_scheduler_metadata == md).all()))
        print("internal md", tuple(internal.tile_scheduler_metadata.shape), "ours", tuple(md.shape), "equal", same,
              "splits equal", bool((internal.num_splits == splits).all()))
        print("internal splits", internal.num_splits[:8].tolist(), "ours", splits[:8].tolist())
        del steps
        bm._free()


if __name__ == "__main__":
    require_gpu("bench_flashmla_schedule")
    checks = {"outputs": outputs, "profile": profile, "schedules": schedules}
    for name in sys.argv[1:] or list(checks):
        checks[name]()
