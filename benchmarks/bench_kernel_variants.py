"""Our Gluon kernels against other versions of them, in one process: the A/B of a kernel change.

    git show main:mla_inductor/kernels/decode_hopper.py > /tmp/before.py
    python benchmarks/bench_kernel_variants.py --variant before=/tmp/before.py \
        --cases 128x128x4096:fp8,64x128x4096:ds,128x16x4096:fp8 [--rounds 3] [--out DIR]

Each ``--variant NAME=FILE`` is a copy of ``mla_inductor/kernels/decode_hopper.py`` (the same kernel names and
constants); the working tree's kernels are the row ``current``. A case is ``BxHxS:fmt`` with fmt bf16, fp8
(fp8_e4m3) or ds (fp8_ds_mla), made by ``peers.make_case``; every version runs the call exactly as our default
path would (``DecodeLaunch``: same configuration and splits), only the Gluon kernel module differs. Timings
interleave the versions ``--rounds`` times (best median of ``do_bench``), so a slow stretch of the GPU hits
all of them; each version's relative error against the fp32 reference is printed beside it.
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


def prepared_call(case: dict, fmt: str, kernels):
    """Our default call on ``case`` with the Gluon kernels of module ``kernels``: (run, reference)."""
    from mla_inductor.kernels import decode

    current = decode._hopper
    decode._hopper = lambda: kernels  # DecodeLaunch looks the kernels up while it prepares the call
    try:
        run, ref, _ = bench_kernels._ours(case, fmt)
        run()
        torch.cuda.synchronize()
    finally:
        decode._hopper = current
    return run, ref


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FILE",
                        help="another version of mla_inductor/kernels/decode_hopper.py (repeatable)")
    parser.add_argument("--cases", default="128x128x4096:fp8,128x128x4096:bf16,128x16x4096:fp8",
                        help="BxHxS:fmt,... with fmt bf16, fp8 or ds")
    parser.add_argument("--rounds", type=int, default=3)
    report.add_out_argument(parser)
    args = parser.parse_args(argv)
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
    for item in args.cases.split(","):
        shape, _, fmt = item.partition(":")
        B, H, S = (int(x) for x in shape.split("x"))
        case = pm.make_case(B, H, S)
        case["ref"] = pm.reference(case)
        calls = {name: prepared_call(case, fmt or "bf16", module) for name, module in versions.items()}
        errors = {name: report.relative_error(run(), ref) for name, (run, ref) in calls.items()}
        best = {name: float("inf") for name in versions}
        for _ in range(args.rounds):
            for name, (run, _) in calls.items():
                best[name] = min(best[name], report.median_ms(run) * 1e3)
        base = best["current"]
        label = f"B={B} H={H} S={S} {fmt or 'bf16'}"
        print(f"{label}: " + "  ".join(
            f"{name} {us:.1f} us ({us / base:.3f}x, err {errors[name]:.1e})" for name, us in best.items()),
            flush=True)
        records += [dict(case=label, version=name, us=us, vs_current=us / base, rel_err=errors[name])
                    for name, us in best.items()]
    columns = ["case", "version", "us", "vs_current", "rel_err"]
    report.write_results(args.out, "bench_kernel_variants",
                         f"Gluon kernel versions, {report.environment_line(env)}\n\n"
                         + report.markdown_table(columns, records), {"environment": env, "rows": records})


if __name__ == "__main__":
    main()
