"""Where the host time of one eager Triton decode call goes, piece by piece (GPU only).

    python benchmarks/bench_triton_launch.py [--out DIR]

For a B=1 call at two sizes (S=64 H=16: one program, no split; S=4096 H=128: split-KV, a merge kernel), µs
per call of: the whole eager op (``torch.ops.mla.paged_decode``, Triton preferred), the compiled op's
implementation (``mla_triton::decode``), the prepared launch (``DecodeLaunch``), each kernel's direct
relaunch (``KernelLaunch``: through torch's static launcher where it loads the kernel), the decode kernel
relaunched by each launcher, and Triton's own pieces (the current device and stream, its launch
metadata, the C launcher alone), an output allocation, the split-KV workspace made fresh and kept, a no-op
dispatcher call, and the call-signature key. Each is timed over 3,000 calls with a device sync every 100
(``time.perf_counter``); the kernels run while the host goes on, so a figure reads host time where the host
is the slower side. The host of a GPU machine may be shared: compare pieces of one run with each other.
"""

from __future__ import annotations

import argparse
from typing import Optional

import timing
import torch
from report import add_out_argument, write_results


def timed_us(fn, n: int = 3000) -> float:
    return timing.host_seconds(fn, n, warmup=50, sync_every=100) * 1e6


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_triton_launch needs a CUDA GPU; torch.cuda.is_available() is False here. "
                         "Nothing was run.")
    import triton
    from triton.runtime.driver import driver

    import mla_inductor
    from mla_inductor.backends import triton as triton_backend
    from mla_inductor.contract import attends_nothing, call_signature
    from mla_inductor.kernels import decode as decode_kernels
    from mla_inductor.kernels import launch as launch_module
    from mla_inductor.testing import make_decode_inputs

    lines = [f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"]
    data = {}
    for seq, H in (([64], 16), ([4096], 128)):
        x = make_decode_inputs(seq_lens=seq, num_heads=H, page_size=64, device="cuda", seed=5)
        args = x.args()
        q_nope, q_pe, kv, table, lens, _, kv_scale, sparse = args[:8]
        launch = triton_backend.prepared_launch(*args[:8])
        T, heads, L = launch.out_shape
        out = torch.empty(*launch.out_shape, dtype=launch.out_dtype, device="cuda")
        lse = torch.empty(*launch.lse_shape, dtype=torch.float32, device="cuda")
        pout, plse = decode_kernels._alloc_partials(T, heads, launch.splits, L, launch.device)
        tensors = (q_nope, q_pe, kv, table, lens, table, kv_scale, out, lse, pout, plse)
        rows = []
        with mla_inductor.prefer_backends("triton"):
            rows.append(("torch.ops.mla.paged_decode (eager)", lambda: torch.ops.mla.paged_decode(*args)))
        rows += [
            ("mla_triton::decode (the compiled op's implementation)", lambda: triton_backend.DECODE_OP(*args, [])),
            ("DecodeLaunch.__call__ (fresh workspace)",
             lambda: launch(q_nope, q_pe, kv, table, lens, kv_scale, sparse)),
            ("DecodeLaunch.__call__ (kept workspace: eager)",
             lambda: launch(q_nope, q_pe, kv, table, lens, kv_scale, sparse, keep_workspace=True)),
            ("decode kernel, direct relaunch", lambda: launch.main(*tensors)),
        ]
        if launch.merge is not None:
            rows.append(("merge kernel, direct relaunch", lambda: launch.merge(pout, plse, out, lse)))
        launch(q_nope, q_pe, kv, table, lens, kv_scale, sparse)  # the compiled kernel the relaunch holds
        compiled, grid = launch.main.compiled, launch.main.grid
        device = driver.active.get_current_device()
        stream = driver.active.get_current_stream(device)
        every = (*tensors, *launch.main.static_args)
        by_triton = launch_module.triton_runner(compiled, grid, launch.main.static_args)
        by_torch = launch_module.static_runner(compiled, grid, launch.main.static_args, device)
        rows.append(("decode kernel, Triton's launcher (compiled[grid])", lambda: by_triton(tensors)))
        if by_torch is not None:
            rows.append(("decode kernel, torch's static launcher", lambda: by_torch(tensors)))
        rows += [
            ("triton: current device", lambda: driver.active.get_current_device()),
            ("triton: current stream", lambda: driver.active.get_current_stream(device)),
            ("triton: launch metadata", lambda: compiled.launch_metadata(grid, stream, *every)),
            ("triton: the C launcher alone", lambda: compiled.run(grid[0], grid[1], grid[2], stream, compiled.function,
                                                                  compiled.packed_metadata, None, None, None, *every)),
            ("torch.empty (the output)", lambda: torch.empty(*launch.out_shape, dtype=launch.out_dtype, device="cuda")),
        ]
        if launch.merge is not None:
            rows += [("split-KV workspace, fresh (one allocation, two views)",
                      lambda: decode_kernels._alloc_partials(T, heads, launch.splits, L, launch.device)),
                     ("split-KV workspace, kept", lambda: decode_kernels._split_partials(launch))]
        rows += [
            ("a no-op dispatcher call (aten.alias)", lambda: torch.ops.aten.alias(q_nope)),
            ("call_signature (the launch's key)", lambda: call_signature(*args[:8])),
            ("attends_nothing", lambda: attends_nothing(args[0], args[2], args[3], args[7])),
        ]
        case = f"B=1 S={seq[0]} H={H}"
        launchers = ", ".join(f"{name} kernel relaunched by {'torch' if k.static else 'Triton'}"
                              for name, k in (("decode", launch.main), ("merge", launch.merge)) if k is not None)
        lines += ["", f"## {case}: {launch.splits} split(s), {len(every)} kernel arguments; {launchers}"
                  + ("" if by_torch is not None else " (torch's static launcher cannot load the decode kernel here)"),
                  "",
                  "| piece | µs per call |", "|---|---|"]
        data[case] = {}
        for name, fn in rows:
            data[case][name] = timed_us(fn)
            lines.append(f"| {name} | {data[case][name]:.2f} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    write_results(args.out, "bench_triton_launch", text, data)


if __name__ == "__main__":
    main()
