"""Our Gluon kernels against other versions of them, in one process: the A/B of a kernel change.

    git show main:mla_inductor/kernels/decode_hopper.py > /tmp/before.py
    python benchmarks/bench_kernel_variants.py --variant before=/tmp/before.py \
        --cases 128x128x4096:fp8,64x128x4096:ds,128x16x4096:fp8 [--rounds 3] [--out DIR]

Each ``--variant NAME=FILE`` is a copy of ``mla_inductor/kernels/decode_hopper.py`` (the same kernel names and
constants); the working tree's kernels are the row ``current``. A case is ``BxHxS:fmt`` with fmt bf16, fp8
(fp8_e4m3) or ds (fp8_ds_mla), made by ``peers.make_case``, or ``BxHxSxK:fmt`` for a sparse call attending K
listed slots of each row (fmt bf16 or ds; ``peers.sparse_case``); every version runs the call exactly as our
default path would (``DecodeLaunch``: same configuration and splits), only the Gluon kernel module differs. Timings
interleave the versions ``--rounds`` times (best median of ``do_bench``), so a slow stretch of the GPU hits
all of them; each version's relative error against the fp32 reference is printed beside it.

``--launches N`` times nothing: case by case, each version's call is launched once as it is prepared (every
version in the order given, ``current`` first), then N times in turn, and its error printed, for a profiler that
picks launches by count, e.g.
``ncu --kernel-name regex:mla_decode_hopper --launch-skip 3 --launch-count 1 python
benchmarks/bench_kernel_variants.py --launches 5 --cases 128x32x4096:fp8``.
"""
from __future__ import annotations

import argparse
import importlib.util

import bench_kernels
import peers as pm
import report
import torch


def load_variant(name: str, path: str):
    """A decode_hopper.py copy as a module of its own."""
    spec = importlib.util.spec_from_file_location(f"_kernel_variant_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not getattr(module, "HAVE_GLUON", False):
        raise SystemExit(f"--variant {name}: {path} did not load Gluon kernels (HAVE_GLUON is false)")
    return module


def parse_case(item: str) -> tuple[tuple[int, ...], str]:
    """``BxHxS[xK]:fmt`` as ((B, H, S[, K]), fmt); K (sparse top-k) takes bf16 or ds only."""
    shape, _, fmt = item.partition(":")
    fmt = fmt or "bf16"
    try:
        dims = tuple(int(x) for x in shape.split("x"))
    except ValueError:
        dims = ()
    if len(dims) not in (3, 4):
        raise SystemExit(f"--cases: {item!r} is not BxHxS:fmt or BxHxSxK:fmt (K: sparse top-k)")
    formats = ("bf16", "ds") if len(dims) == 4 else ("bf16", "fp8", "ds")
    if fmt not in formats:
        raise SystemExit(f"--cases: {item!r}: fmt must be one of {', '.join(formats)}")
    return dims, fmt


def make_case(dims: tuple[int, ...]) -> dict:
    if len(dims) == 4:
        return pm.sparse_case(*dims)
    case = pm.make_case(*dims)
    case["ref"] = pm.reference(case)
    return case


def prepared_call(case: dict, fmt: str, kernels):
    """Our default call on ``case`` (sparse if it lists ``indices``) with the Gluon kernels of module ``kernels``:
    (run, reference)."""
    from mla_inductor.kernels import decode

    ours = bench_kernels._ours_sparse if "indices" in case else bench_kernels._ours
    current = decode._hopper
    decode._hopper = lambda: kernels  # DecodeLaunch looks the kernels up while it prepares the call
    try:
        run, ref, _ = ours(case, fmt)
        run()
        torch.cuda.synchronize()
    finally:
        decode._hopper = current
    return run, ref


def launch_only(calls: dict, launches: int, fmt: str, dims: tuple) -> None:
    """Each version's call ``launches`` times in turn, then its error (``--launches``: no timing)."""
    for name, (run, ref) in calls.items():
        for _ in range(launches):
            out = run()
        torch.cuda.synchronize()
        print(f"{dims} {fmt} {name}: {launches} launches, err {report.relative_error(out, ref):.1e}", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FILE",
                        help="another version of mla_inductor/kernels/decode_hopper.py (repeatable)")
    parser.add_argument("--cases", default="128x128x4096:fp8,128x128x4096:bf16,128x16x4096:fp8",
                        help="BxHxS:fmt,... with fmt bf16, fp8 or ds; BxHxSxK:fmt for sparse top-K (bf16 or ds)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--launches", type=int, default=0, metavar="N",
                        help="time nothing: launch each version's call N times (for a profiler)")
    report.add_out_argument(parser)
    args = parser.parse_args(argv)
    if args.launches < 0:
        raise SystemExit(f"--launches: expected a count >= 0 (0: time the versions), got {args.launches}")
    cases = [parse_case(item) for item in args.cases.split(",")]
    report.require_gpu("bench_kernel_variants.py")
    from mla_inductor.kernels import decode_hopper

    versions = {"current": decode_hopper}
    for item in args.variant:
        name, _, path = item.partition("=")
        if not path:
            raise SystemExit(f"--variant: expected NAME=FILE, got {item!r}")
        versions[name] = load_variant(name, path)
    env = report.environment()
    report.progress(f"# {report.environment_line(env)}")
    records = []
    for dims, fmt in cases:
        case = make_case(dims)
        calls = {name: prepared_call(case, fmt, module) for name, module in versions.items()}
        if args.launches:
            launch_only(calls, args.launches, fmt, dims)
            continue
        errors = {name: report.relative_error(run(), ref) for name, (run, ref) in calls.items()}
        best = {name: float("inf") for name in versions}
        for _ in range(args.rounds):
            for name, (run, _) in calls.items():
                best[name] = min(best[name], report.median_ms(run) * 1e3)
        base = best["current"]
        label = f"B={dims[0]} H={dims[1]} S={dims[2]}" + (f" top-k {dims[3]}" if len(dims) == 4 else "") + f" {fmt}"
        print(f"{label}: " + "  ".join(
            f"{name} {us:.1f} us ({us / base:.3f}x, err {errors[name]:.1e})" for name, us in best.items()),
            flush=True)
        records += [dict(case=label, version=name, us=us, vs_current=us / base, rel_err=errors[name])
                    for name, us in best.items()]
    if args.launches:
        return
    columns = ["case", "version", "us", "vs_current", "rel_err"]
    report.write_results(args.out, "bench_kernel_variants",
                         f"Gluon kernel versions, {report.environment_line(env)}\n\n"
                         + report.markdown_table(columns, records), {"environment": env, "rows": records})


if __name__ == "__main__":
    main()
