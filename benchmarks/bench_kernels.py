"""Our MLA paged decode kernels against the peer kernels, called directly, on the same shapes.

Rows ``triton_*`` are our default path (on an SM90 GPU the Gluon kernel where it covers the call, else the
``tl.dot`` kernel); rows ``tldot_*`` force the ``tl.dot`` kernel (what GPUs other than SM90 run) where the
two differ; on SM90, rows ``wide_*`` force the 64-head Gluon kernel where the default is another kernel (at
H <= 16: the ``tl.dot`` kernel for bf16, the 16-head Gluon variant for fp8 caches): whether it should take those
calls too.

    python benchmarks/bench_kernels.py [--quick | --cases=BxHxS,...] [--ours-only] [--no-sparse | --no-dense]
           [--sparse-cases=BxHxSxTOPK,...] [--only=flashmla,...] [--ours=triton_bf16,wide_bf16,...] [--out DIR]
    python benchmarks/bench_kernels.py --sweep | --overhead [--out DIR]
    python benchmarks/bench_kernels.py --merge-tiles [--merge-cases=PAIRSxSPLITS,...] [--out DIR]
    python benchmarks/bench_kernels.py --splits=8,16,32,64,128 [--cases=BxHxS,...] [--kinds=bf16,fp8,ds]
           [--splits-kernel=default|tl_dot] [--sparse-cases=BxHxSxTOPK,...] [--out DIR]

Peers are found by import (``benchmarks/peers.py``: FlashMLA, FlashInfer, vLLM's Triton MLA); one that is
not installed is reported and skipped. Every row is measured the same way: ``triton.testing.do_bench``
median, warmup=25, rep=200. Each row shows its relative L2 error against the fp32 reference (fp8 rows:
against the reference on the dequantized cache), achieved GB/s (KV bytes only), TFLOP/s, and ``floor``:
measured time over max(bytes / HBM_BPS, FLOPs / PEAK_FLOPS), the H100 SXM bound (other GPUs: read the
ratio with that in mind). ``--out DIR`` writes bench_kernels.md and .json (and a plot, with matplotlib).
``--sweep`` times a grid of launch configs on a few shapes (tuning; see docs/kernels.md);
``--overhead`` compares eager timing, CUDA-graph replay and host time per call for our kernel. ``--splits``
times our default kernel at each split count given (and at its own), launch after launch and in a CUDA graph, with
each kernel's device time (the decode, the split merge), on the cache formats ``--kinds`` names (all three by
default), on our default kernel or (``--splits-kernel=tl_dot``) the ``tl.dot`` kernel it falls back to, and on the
sparse calls ``--sparse-cases`` names (bf16 and fp8_ds_mla): the data behind ``decode.choose_splits``.
``--merge-tiles`` times the split merge alone at each tile (splits per step, output columns per program) on
``--merge-cases`` ((row, head) pairs x splits), against a torch reference: the data behind ``decode.merge_tile``.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from typing import NamedTuple, Optional

import peers as pm
import timing
import torch
import report

HBM_BPS = 3.0e12  # H100 SXM device-to-device copy bandwidth (measured)
PEAK_FLOPS = 989e12  # H100 SXM dense bf16 datasheet
D_CKV, D_PE = 512, 64
_err = report.relative_error
_bench = report.median_ms


def _ours(c, kind, config=None):
    """Closure running our kernel on a peers.make_case case; returns (fn, reference, bytes per token).
    ``config="tldot"``: the default launch configuration on the ``tl.dot`` kernel."""
    q = c["q"]
    qn, qp = q[..., :D_CKV], q[..., D_CKV:]
    one = torch.ones(1, dtype=torch.float32, device=q.device)
    if kind == "bf16":
        cache, scale, ref, per_tok = c["cache"], one, c["ref"], (D_CKV + D_PE) * 2
    elif kind == "fp8":
        cache, k_scale = pm.fp8_cache(c)
        scale, ref, per_tok = k_scale.reshape(1).float(), c["ref_fp8"], D_CKV + D_PE
    elif kind == "ds":
        if "ds" not in c:
            c["ds"] = pm.ds_mla_cache(c["cache"])
            c["ref_ds"] = pm.reference(c, c["ds"][1])
        cache, scale, ref, per_tok = c["ds"][0], one, c["ref_ds"], 656
    else:
        raise ValueError(kind)

    config = _forced(config, qn, qp, cache, c, scale, None)
    return _prepared(qn, qp, cache, c["block_table"], c["lens"], c["scale"], scale, None, config), ref, per_tok


FORCED_GLUON = {"wide": "gluon_sm90"}  # a row prefix -> the Gluon kernel it forces


def _forced(config, qn, qp, cache, c, kv_scale, sparse_indices):
    """``config`` as given; for "tldot" the default launch configuration on the ``tl.dot`` kernel (SameKernel where
    the default already is the tl.dot kernel); for "wide" (FORCED_GLUON) the Gluon kernel of that name at its own
    tiling, on calls whose default is another kernel (SameKernel where it is that one, off SM90, and where that
    Gluon kernel does not cover the call): whether it should take them."""
    if config not in ("tldot", *FORCED_GLUON) and not isinstance(config, SplitChoice):
        return config
    from mla_inductor.kernels import decode

    def launch(cfg=None):
        return decode.DecodeLaunch(qn, qp, cache, c["block_table"], c["lens"], c["scale"], kv_scale, sparse_indices,
                                   cfg)

    default = launch()
    if isinstance(config, SplitChoice):
        base = default.fallback if config.kernel == "tl_dot" and default.config.kernel != "tl_dot" else default.config
        return base.replace(num_splits=config.splits or base.num_splits)
    if config == "tldot":
        if default.config.kernel == "tl_dot":
            raise SameKernel("the default path already runs the tl.dot kernel here")
        return default.fallback
    kernel = FORCED_GLUON[config]
    if default.config.kernel == kernel or not decode._hopper_kernel_runs_on(qn.device):
        raise SameKernel(f"{kernel} is forced only where the default is another kernel, on SM90")
    kv_len = sparse_indices.shape[1] if sparse_indices is not None else c["block_table"].shape[1] * cache.shape[1]
    forced = decode.gluon_config(kernel, qn.shape[0], qn.shape[1], kv_len, qn.device)
    if launch(forced).config.kernel != kernel:
        raise SameKernel(f"{kernel} does not cover this call")
    return forced


class SameKernel(Exception):
    """A forced-kernel row that would time the default row again (not printed)."""


class SplitChoice(NamedTuple):
    """A row's config given as a split count (None: the default's) and the kernel ("default", or "tl_dot": the
    launch configuration the default falls back to on the ``tl.dot`` kernel): that launch configuration with those."""

    splits: Optional[int]
    kernel: str = "default"


def _prepared(qn, qp, cache, block_table, lens, softmax_scale, kv_scale, sparse_indices, config):
    """A call of our kernel as the backend makes it: checked and prepared once (``DecodeLaunch``), then each
    call allocates its outputs and relaunches the compiled kernels. (A fresh ``triton_paged_decode`` per call
    would time Triton's JIT front door too: on a slow host more than the kernel itself.)"""
    from mla_inductor.kernels.decode import DecodeLaunch, triton_paged_decode

    triton_paged_decode(qn, qp, cache, block_table, lens, softmax_scale, kv_scale, sparse_indices, config=config)
    launch = DecodeLaunch(qn, qp, cache, block_table, lens, softmax_scale, kv_scale, sparse_indices, config)

    def run():
        return launch(qn, qp, cache, block_table, lens, kv_scale, sparse_indices)[0]
    run.launch = launch  # what it runs (split_sweep reads its configuration)
    return run


def _ours_sparse(c, kind, config=None):
    q = c["q"]
    qn, qp = q[..., :D_CKV], q[..., D_CKV:]
    one = torch.ones(1, dtype=torch.float32, device=q.device)
    if kind == "bf16":
        cache, ref, per_tok = c["cache"], pm.sparse_reference(c, c["cache"]), 1152
    else:
        packed, deq = pm.ds_mla_cache(c["cache"])
        cache, ref, per_tok = packed, pm.sparse_reference(c, deq), 656
    config = _forced(config, qn, qp, cache, c, one, c["indices"])
    return _prepared(qn, qp, cache, c["block_table"], c["lens"], c["scale"], one, c["indices"], config), ref, per_tok


RECORDS: list = []  # one dict per measured row, for --out


def _row(label, name, ms, kv_bytes, flops, err, extra=""):
    floor = max(kv_bytes / HBM_BPS, flops / PEAK_FLOPS) * 1e3
    RECORDS.append(dict(case=" ".join(label.split()), kernel=name, us=ms * 1e3, gb_per_s=kv_bytes / ms / 1e6,
                        tflop_per_s=flops / ms / 1e9, rel_err=err, over_floor=ms / floor))
    return (f"{label} {name:<22} {ms*1e3:9.1f} us {kv_bytes/ms/1e6:7.0f} GB/s {flops/ms/1e9:6.1f} TF/s "
            f"err={err:.1e} floor={ms/floor:4.2f}x{extra}")


def _failed(label, name, e) -> str:
    if isinstance(e, pm.PeerMissing):
        return f"{label} {name}: not installed: {e}"
    traceback.print_exc(limit=3)
    return f"{label} {name}: FAILED {type(e).__name__}: {str(e)[:300]}"


OURS = ("triton_bf16", "triton_fp8", "triton_ds", "tldot_bf16", "tldot_fp8", "tldot_ds", "wide_bf16", "wide_fp8",
        "wide_ds")
OURS_SPARSE = ("triton_sparse_bf16", "triton_sparse_ds", "tldot_sparse_bf16", "tldot_sparse_ds")


def _forcing(name: str):
    """The kernel a row of ours forces (``_forced``), from its name's prefix: None for the default path."""
    prefix = name.split("_", 1)[0]
    return prefix if prefix in ("tldot", *FORCED_GLUON) else None


def run_dense(cfgs, peer_names, rows, results, ours=OURS):
    broken = set()
    for cfg in cfgs:
        varlen = cfg[0] == "var"
        B, H, S = cfg[1:] if varlen else cfg
        c = pm.make_case(B, H, S, varlen=varlen)
        c["ref"] = pm.reference(c)
        tokens = int(c["lens"].sum())
        label = f"{'var' if varlen else ''}B={B:<4} H={H:<4} S={S:<6}"
        flops = 2 * tokens * H * (D_CKV + D_PE + D_CKV)
        for name in list(ours) + list(peer_names):
            if name in broken:
                continue
            try:
                t0 = time.time()
                if name in OURS:
                    fn, ref, per_tok = _ours(c, name.rsplit("_", 1)[1], _forcing(name))
                else:
                    fn = pm.PEERS[name](c)
                    per_tok = (D_CKV + D_PE) * (1 if name.endswith("fp8") else 2)
                out = fn()
                torch.cuda.synchronize()
                first = time.time() - t0
                if name not in OURS:  # after the call: an fp8 peer's maker stores its dequantized reference
                    ref = pm.peer_reference(name, c)
                err = _err(out, ref)
                ms = _bench(fn)
                row = _row(label, name, ms, tokens * per_tok, flops, err, f" first={first:.1f}s")
                results.setdefault(label, {})[name] = ms * 1e3
            except SameKernel:
                continue
            except Exception as e:  # a peer (or variant) that cannot run here is reported, not fatal
                if name not in OURS:
                    broken.add(name)
                row = _failed(label, name, e)
            print(row, flush=True)
            rows.append(row)


def run_sparse(peer_names, rows, results, cases=pm.SPARSE):
    for B, H, S, topk in cases:
        c = pm.sparse_case(B, H, S, topk)
        label = f"sparse B={B:<4} H={H:<4} S={S:<6} topk={topk}"
        flops = 2 * B * topk * H * (D_CKV + D_PE + D_CKV)
        names = list(OURS_SPARSE) + [n for n in pm.SPARSE_PEERS if n in peer_names]
        for name in names:
            try:
                if name in OURS_SPARSE:
                    fn, ref, per_tok = _ours_sparse(c, name.rsplit("_", 1)[1], _forcing(name))
                else:
                    fn = pm.SPARSE_PEERS[name](c)
                    ref, per_tok = c["ref_sparse"], (656 if "fp8" in name else 1152)
                out = fn()
                torch.cuda.synchronize()
                err = _err(out, ref)
                ms = _bench(fn)
                row = _row(label, name, ms, B * topk * per_tok, flops, err)
                results.setdefault(label, {})[name] = ms * 1e3
            except SameKernel:
                continue
            except Exception as e:  # noqa: BLE001
                row = _failed(label, name, e)
            print(row, flush=True)
            rows.append(row)


def targets(results):
    """The portable-kernel issue's performance targets, checked against this run's numbers."""
    lines = []

    def get(label, name):
        return results.get(label, {}).get(name)

    def chk(desc, ours, bound):
        if ours is None or bound is None:
            lines.append(f"target {desc}: not measured")
        else:
            lines.append(f"target {desc}: ours {ours:.1f} us, bound {bound:.1f} us -> "
                         f"{'MET' if ours <= bound else 'MISSED'}")

    for label, row in results.items():
        if label.startswith("sparse"):
            continue
        if " H=128 " in f" {' '.join(label.split())} ":
            for peer, times in (("flashinfer_fa2", 1.0), ("flashinfer_fa3", 0.6)):
                theirs = get(label, peer)
                chk(f"bf16 {' '.join(label.split())} >= {times}x {peer}", get(label, "triton_bf16"),
                    theirs / times if theirs else None)
        bf16 = get(label, "triton_bf16")
        chk(f"fp8 {' '.join(label.split())} <= 0.75x our bf16", get(label, "triton_fp8"), 0.75 * bf16 if bf16 else None)
    chk("fp8 B=128 H=128 S=4096 <= 400 us", get(f"B={128:<4} H={128:<4} S={4096:<6}", "triton_fp8"), 400.0)
    chk("fp8 B=128 H=16 S=4096 <= 170 us", get(f"B={128:<4} H={16:<4} S={4096:<6}", "triton_fp8"), 170.0)
    for rec in RECORDS:
        if rec["kernel"] in ("triton_ds", "triton_sparse_ds") and int(rec["case"].split("B=")[1].split()[0]) >= 64:
            lines.append(f"target fp8_ds_mla {rec['case']} <= 2.5x floor: {rec['over_floor']:.2f}x -> "
                         f"{'MET' if rec['over_floor'] <= 2.5 else 'MISSED'}")
    return lines


def plot(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"plot skipped: matplotlib not importable ({type(e).__name__})")
        return
    labels = list(results)
    names = sorted({n for v in results.values() for n in v})
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 1.4), 5))
    w = 0.8 / max(1, len(names))
    for i, n in enumerate(names):
        xs = [j + i * w for j in range(len(labels))]
        ax.bar(xs, [results[lab].get(n, 0) for lab in labels], width=w, label=n)
    ax.set_xticks([j + 0.4 for j in range(len(labels))])
    ax.set_xticklabels([" ".join(lab.split()) for lab in labels], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("median time (us), lower is better")
    ax.set_yscale("log")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


# ----------------------------------------------------------------------------- tuning sweep
def sweep(out_dir):
    """Time launch configs on the tuning shapes; prints one line per (shape, kind, config)."""
    from mla_inductor.kernels import decode as tk

    DC = tk.DecodeConfig
    def D(bh, bn, w, st, ns=1, qk="auto", f16=None):
        return DC(bh, bn, ns, w, st, fp8_qk=qk, fp16_mma=f16)

    plans = {
        # fp8 at H>32 runs bf16's configuration: deeper pipelines do not help there (docs/kernels.md).
        (64, 128, 4096): {"bf16": [None], "fp8": [None, D(64, 64, 8, 3), D(64, 32, 8, 4)],
                          "ds": [None, D(64, 32, 8, 3)]},
        (128, 16, 4096): {
            "bf16": [None, D(16, 64, 4, 3, 2, "swap"), D(16, 64, 4, 2, 2, "swap"), D(16, 64, 4, 3, 4, "swap")],
            "fp8": [None, D(16, 32, 4, 2, 2, "reload"), D(16, 32, 4, 4, 2, "reload")],
        },
    }

    def timed(c, kind, cfg, tokens):
        fn, ref, per_tok = _ours(c, kind, cfg)
        out = fn()
        torch.cuda.synchronize()
        err = _err(out, ref)
        ms = _bench(fn)
        regs = ""
        try:  # resource report of the compiled kernel the launch used
            ck = tk._LAST_COMPILED
            regs = f" regs={ck.n_regs} spills={ck.n_spills} smem={ck.metadata.shared}"
        except Exception:  # noqa: BLE001
            pass
        return f": {ms*1e3:8.1f} us {tokens*per_tok/ms/1e6:6.0f} GB/s err={err:.1e}{regs}"

    lines = []
    for (B, H, S), kinds in plans.items():
        c = pm.make_case(B, H, S)
        c["ref"] = pm.reference(c)
        for kind, cfgs in kinds.items():
            for cfg in cfgs:
                _log_line(lines, f"sweep B={B} H={H} S={S} {kind:<5} {cfg or 'default'}",
                          lambda: timed(c, kind, cfg, B * S))
    _write_log(out_dir, "bench_kernels_sweep", lines)


CACHE_FORMATS = ("bf16", "fp8", "ds")


def _kernel_times(fn, calls: int = 20) -> dict:
    """{kernel name: mean device µs per call} of ``fn``'s launches (torch.profiler): which kernel of a call (the
    decode, the split merge) takes its time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times: dict = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name] = times.get(e.name, 0.0) + e.device_time / calls
    return times


MERGE_CASES = [(16, 64), (32, 64), (64, 128), (128, 32), (128, 64), (256, 16), (256, 32), (512, 8), (4096, 2)]


def merge_sweep(shapes, out_dir, device: str = "cuda", L: int = 512):
    """The split merge alone on fresh random partials of each (pairs, splits) in ``shapes``, at every tile (splits
    per step, output columns per program) up to 16384 values a program: µs replayed in a CUDA graph (0 off a GPU:
    the tests' interpreter) and the error against a torch merge; ``decode.merge_tile``'s pick is marked."""
    from mla_inductor.kernels import decode

    dev = torch.device(device)
    lines = []
    for pairs, ns in shapes:
        gen = torch.Generator().manual_seed(pairs * 1000 + ns)
        pout, plse = decode._alloc_partials(pairs, 1, ns, L, dev)
        pout.copy_(torch.randn(pout.shape, generator=gen))
        plse.copy_(torch.randn(plse.shape, generator=gen) * 4)  # log2 domain
        w = torch.exp2(plse - plse.amax(-1, keepdim=True))
        ref = (pout * w[..., None]).sum(-2) / w.sum(-1, keepdim=True)
        pick = decode.merge_tile(pairs, ns, L)
        for block_s in sorted({min(decode._next_pow2(ns), b) for b in (16, 32, 64, 128)}):
            for block_l in (b for b in (32, 64, 128, 256, 512) if b <= L and block_s * b <= 16384):
                out = torch.full((pairs, 1, L), float("nan"), dtype=torch.bfloat16, device=dev)
                lse = torch.full((pairs, 1), float("nan"), dtype=torch.float32, device=dev)
                merge = decode.merge_launch(pairs, ns, L, dev, (block_s, block_l))

                def run(merge=merge, out=out, lse=lse):
                    merge(pout, plse, out, lse)
                    return out

                def measure(run=run):
                    err = _err(run(), ref)
                    us = timing.graph_median_ms(run, rep=100) * 1e3 if \
                        dev.type == "cuda" else 0.0
                    return f": {us:6.1f} us, err={err:.1e}"
                mark = " (merge_tile)" if (block_s, block_l) == pick else ""
                _log_line(lines, f"merge pairs={pairs} splits={ns} block_s={block_s} block_l={block_l}{mark}", measure)
    _write_log(out_dir, "bench_kernels_merge", lines)


def split_sweep(cases, counts, out_dir, kinds=CACHE_FORMATS, kernel="default", sparse_cases=()):
    """Our default kernel (``kernel="tl_dot"``: the ``tl.dot`` kernel the default falls back to) on each case at
    each split count of ``counts`` (the other launch parameters the default's) and at the default's own: µs launch
    after launch (``do_bench``) and replayed in a CUDA graph, and each kernel's device time, for tuning
    ``decode.choose_splits`` where few rows leave SMs idle (one sequence, a few). ``sparse_cases`` (B, H, S,
    top-k): sparse calls too, on the formats of ``kinds`` a sparse call takes (bf16, fp8_ds_mla)."""
    def timed(fn, ref):
        out = fn()
        torch.cuda.synchronize()
        err = _err(out, ref)
        eager = _bench(fn)
        graph = timing.graph_median_ms(fn)
        kernels = ", ".join(f"{name} {us:.1f}" for name, us in _kernel_times(fn).items())
        return f": {eager*1e3:8.1f} us, in a CUDA graph {graph*1e3:8.1f} us, err={err:.1e} (device us: {kernels})"

    def row(ours, c, kind, choice, own=None):
        fn, ref, _ = ours(c, kind, None if choice == SplitChoice(None) else choice)
        if own is None:
            return timed(fn, ref)
        cfg = own["config"] = fn.launch.config
        return f" ({cfg.kernel}, ns={cfg.num_splits})" + timed(fn, ref)

    def sweep(ours, c, case_label, kind):
        label = f"{case_label} {kind:<4}"
        own = {}
        _log_line(lines, f"{label} default", lambda: row(ours, c, kind, SplitChoice(None, kernel), own))
        for n in counts:
            if "config" not in own or n != own["config"].num_splits:
                _log_line(lines, f"{label} ns={n}", lambda: row(ours, c, kind, SplitChoice(n, kernel)))

    lines = []
    for B, H, S in cases:
        c = pm.make_case(B, H, S)
        c["ref"] = pm.reference(c)
        for kind in kinds:
            sweep(_ours, c, f"splits B={B} H={H} S={S}", kind)
    for B, H, S, topk in sparse_cases:
        c = pm.sparse_case(B, H, S, topk)
        for kind in (k for k in kinds if k in ("bf16", "ds")):
            sweep(_ours_sparse, c, f"splits sparse B={B} H={H} S={S} topk={topk}", kind)
    _write_log(out_dir, "bench_kernels_splits", lines)


def overhead(out_dir):
    """Eager do_bench vs CUDA-graph replay vs host time per call, for our kernel on small and large batches.

    Small batches finish on the GPU faster than Python can launch them; eager timings then measure the
    launcher, which a served model avoids by capturing decode steps in CUDA graphs.
    """
    def timed(c, kind):
        fn, ref, per_tok = _ours(c, kind)
        fn()
        torch.cuda.synchronize()
        eager = _bench(fn)
        graph = timing.graph_median_ms(fn)
        host = timing.host_seconds(fn, 50)
        return f" eager {eager*1e3:8.1f} us  graph {graph*1e3:8.1f} us  host/call {host*1e6:6.1f} us"

    lines = []
    for (B, H, S) in [(1, 128, 4096), (16, 128, 4096), (64, 128, 4096), (1, 16, 4096), (32, 16, 4096),
                      (128, 16, 4096)]:
        c = pm.make_case(B, H, S)
        c["ref"] = pm.reference(c)
        for kind in ("bf16", "fp8", "ds"):
            _log_line(lines, f"overhead B={B:<4} H={H:<4} S={S} {kind:<5}", lambda: timed(c, kind))
    _write_log(out_dir, "bench_kernels_overhead", lines)


def _log_line(lines: list, label: str, measure) -> None:
    """Print and keep ``label`` followed by what ``measure()`` returns, or by FAILED and the error: a tuning
    run goes on past a config that does not compile or run."""
    try:
        line = label + measure()
    except Exception as e:  # noqa: BLE001
        line = f"{label}: FAILED {type(e).__name__}: {str(e)[:200]}"
    print(line, flush=True)
    lines.append(line)


def _write_log(out_dir, name: str, lines: list) -> None:
    report.write_results(out_dir, name, "\n".join(["```", *lines, "```"]), {"log": lines})


def _flag(argv, flag: str):
    """The value of the first ``flag=VALUE`` in ``argv``, else None."""
    return next((a.split("=", 1)[1] for a in argv if a.startswith(flag + "=")), None)


def _split_counts(argv) -> "list[int] | None":
    """The counts ``--splits=8,16,...`` names (None without the flag); anything but positive integers is refused."""
    given = _flag(argv, "--splits")
    if given is None:
        return None
    try:
        counts = [int(n) for n in given.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise SystemExit(f"--splits: expected positive split counts such as --splits=8,16,32; got {given!r}")
    return counts


def _choices(argv, flag: str, allowed: tuple, default: tuple, most: int = 0) -> tuple:
    """The values ``flag=A,B`` names among ``allowed`` (at most ``most`` of them, if given), else ``default``."""
    given = _flag(argv, flag)
    if given is None:
        return default
    chosen = tuple(given.split(","))
    if set(chosen) - set(allowed) or (most and len(chosen) > most):
        raise SystemExit(f"{flag}: expected {'one of' if most == 1 else 'values among'} {list(allowed)}; "
                         f"got {given!r}")
    return chosen


def _shapes(argv, flag: str, default):
    """The cases ``flag=AxBxC,...`` names (tuples of ints), else ``default``."""
    given = [a.split("=", 1)[1] for a in argv if a.startswith(flag + "=")]
    if not given:
        return default
    return [tuple(int(v) for v in case.split("x")) for case in given[-1].split(",")]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return
    ours = _choices(argv, "--ours", OURS, OURS)
    counts = _split_counts(argv)
    kinds = _choices(argv, "--kinds", CACHE_FORMATS, CACHE_FORMATS)
    split_kernel, = _choices(argv, "--splits-kernel", ("default", "tl_dot"), ("default",), most=1)
    report.require_gpu("bench_kernels.py")
    out_dir = _flag(argv, "--out")
    if "--out" in argv:
        out_dir = argv[argv.index("--out") + 1]
    env = report.environment(("flashinfer", "flash_mla", "vllm"))
    report.progress(f"# {report.environment_line(env)}")
    if "--sweep" in argv:
        sweep(out_dir)
        return
    if "--overhead" in argv:
        overhead(out_dir)
        return
    if "--merge-tiles" in argv:
        merge_sweep(_shapes(argv, "--merge-cases", MERGE_CASES), out_dir)
        return
    if counts is not None:
        split_sweep(_shapes(argv, "--cases", [(1, 128, 4096), (1, 16, 4096), (1, 64, 32768), (4, 128, 4096)]),
                    counts, out_dir, kinds, split_kernel, _shapes(argv, "--sparse-cases", []))
        return
    quick = "--quick" in argv
    only = _flag(argv, "--only")
    peer_names = [] if "--ours-only" in argv else [n for n in pm.PEERS if not only or n in only.split(",")]
    sparse_peers = [] if "--ours-only" in argv else list(pm.SPARSE_PEERS)
    rows, results = [], {}
    if "--no-dense" not in argv:  # --cases: e.g. 128x16x4096,32x16x4096 (B x H x S)
        run_dense(_shapes(argv, "--cases", pm.QUICK if quick else pm.FULL), peer_names, rows, results, ours)
    if "--no-sparse" not in argv:  # --sparse-cases: e.g. 32x16x16384x2048 (B x H x S x top-k)
        run_sparse(sparse_peers, rows, results, _shapes(argv, "--sparse-cases", pm.SPARSE))
    checks = targets(results)
    rows += checks
    print("\n".join(["", "# summary"] + rows), flush=True)
    columns = ["case", "kernel", "us", "gb_per_s", "tflop_per_s", "rel_err", "over_floor"]
    markdown = "\n".join([f"Kernels called directly, {report.environment_line(env)}", "",
                          report.markdown_table(columns, RECORDS), "", *[f"- {line}" for line in checks]])
    report.write_results(out_dir, "bench_kernels", markdown,
                         {"environment": env, "rows": RECORDS, "targets": checks, "log": rows})
    if out_dir:
        plot(results, os.path.join(out_dir, "bench_kernels.png"))


if __name__ == "__main__":
    main()
