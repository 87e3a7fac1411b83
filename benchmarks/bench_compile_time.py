"""How long a decode step takes to compile: the whole step against each decoder layer on its own.

    python benchmarks/bench_compile_time.py [--device cpu|cuda] [--layers 4,16] [--cudagraphs] [--real-dims]
        [--out DIR]

The HF DeepSeek-V3-shaped model of bench_e2e (``--real-dims``: DeepSeek-V3's attention dims, as bench_modes
part d; default: the small dims, which the CPU compiles in seconds), a ``PagedMLACache`` of 64 tokens, B=2,
one decode step (``mla_inductor.hf.decode_one_token``) compiled two ways: the whole step
(``torch.compile(decode_one_token, fullgraph=True)``) and per layer (``hf.compile_layers(model,
fullgraph=True)``, regional compilation), with ``mode="reduce-overhead"`` under ``--cudagraphs``. Each
(layers, way) runs in a fresh process with an empty Inductor cache directory (``TORCHINDUCTOR_CACHE_DIR``),
as a first compile on a new machine: the figure is the wall time of the first step (the compile) and of the
second (the compiled step), ``time.perf_counter`` with a device sync. Per layer, Dynamo traces every layer
(each is a graph of its own: the cache routes by ``layer_idx``) and Inductor's FX-graph cache serves the
layers after the first, whose graphs are alike; the whole step compiles every layer's ops in one graph.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from report import add_out_argument, environment, environment_line, markdown_table, progress, write_results

WAYS = ("whole", "per_layer")
CONTEXT = 64
BATCH = 2


def child(layers: int, way: str, device: str, cudagraphs: bool, real_dims: bool) -> dict:
    """One compile, in this process: {compile_s, step_s, graphs} (graphs: Dynamo's frame count)."""
    import torch

    import bench_e2e
    import mla_inductor.lowering  # noqa: F401 - the ops and the pass
    from mla_inductor import hf
    from mla_inductor.testing import fill_paged_mla_cache

    dev = torch.device(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model_args = argparse.Namespace(small=not real_dims, layers=layers, intermediate=256, vocab=512)
    model = bench_e2e.build_model(model_args, dev, dtype)
    model.set_attn_implementation(hf.register())
    cache = hf.PagedMLACache(model, batch_size=BATCH, max_seq_len=CONTEXT + 1)
    fill_paged_mla_cache(cache, CONTEXT)
    tokens = torch.randint(1, model_args.vocab, (BATCH,), device=dev)
    mode = "reduce-overhead" if cudagraphs else None
    if way == "whole":
        step = torch.compile(hf.decode_one_token, fullgraph=True, mode=mode)
    else:
        hf.compile_layers(model, fullgraph=True, mode=mode)
        step = hf.decode_one_token
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def timed_step() -> float:
        start = time.perf_counter()
        with torch.no_grad():
            step(model, tokens, cache)
        sync()
        cache.crop(-1)  # back to the fixed context
        return time.perf_counter() - start

    compile_s = timed_step()
    timed_step()  # CUDA graphs record on a later call
    step_s = min(timed_step() for _ in range(3))
    from torch._dynamo.utils import counters

    return dict(compile_s=compile_s, step_s=step_s, graphs=int(counters["stats"]["unique_graphs"]))


def run_child(layers: int, way: str, args) -> dict:
    """``child`` in a fresh process with an empty Inductor cache directory."""
    with tempfile.TemporaryDirectory(prefix="mla_compile_time_") as cache_dir:
        command = [sys.executable, __file__, "--child", "--layers", str(layers), "--way", way, "--device", args.device]
        command += ["--cudagraphs"] * args.cudagraphs + ["--real-dims"] * args.real_dims
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
        done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=Path(__file__).parent)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return dict(error=f"exit {done.returncode}: {tail[0][:200]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--layers", type=lambda text: [int(x) for x in text.split(",")], default=[4, 16],
                        help="decoder layer counts, comma-separated")
    parser.add_argument("--cudagraphs", action="store_true", help='mode="reduce-overhead" (CUDA only)')
    parser.add_argument("--real-dims", action="store_true", help="DeepSeek-V3's attention dims (default: small)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if args.cudagraphs and args.device != "cuda":
        raise SystemExit("--cudagraphs needs --device cuda")
    if args.child:
        print(json.dumps(child(args.layers[0], args.way, args.device, args.cudagraphs, args.real_dims)))
        return
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("bench_compile_time --device cuda needs a CUDA GPU; torch.cuda.is_available() is False "
                             "here. Nothing was run.")
    rows = []
    for layers in args.layers:
        row: dict = {"layers": layers}
        for way in WAYS:
            result = run_child(layers, way, args)
            progress(f"  {layers} layers, {way}: {result}")
            for key, value in result.items():
                row[f"{way}_{key}"] = value
        if isinstance(row.get("per_layer_compile_s"), float) and isinstance(row.get("whole_compile_s"), float):
            row["per_layer_over_whole"] = row["per_layer_compile_s"] / row["whole_compile_s"]
        rows.append(row)
    env = environment()
    columns = ["layers", "whole_compile_s", "per_layer_compile_s", "per_layer_over_whole", "whole_graphs",
               "per_layer_graphs", "whole_step_s", "per_layer_step_s"]
    text = "\n".join([
        f"# bench_compile_time: {environment_line(env)}", "",
        f"device {args.device}, {'DeepSeek-V3' if args.real_dims else 'small'} attention dims, B={BATCH}, context "
        f"{CONTEXT}, {'CUDA graphs' if args.cudagraphs else 'no CUDA graphs'}; seconds (a fresh process and Inductor "
        "cache per cell)", "",
        markdown_table(columns, rows),
    ])
    print(text)
    write_results(args.out, "bench_compile_time", text, {"environment": env, "rows": rows})


if __name__ == "__main__":
    main()
