"""``model.generate()`` on a DeepSeek-V3-shaped HF model: our attention vs our own compiled loop vs HF's default.

    python benchmarks/bench_generate.py [--out DIR] [--layers 4] [--batch 64] [--context 4096] [--steps 32]
    python benchmarks/bench_generate.py --small --device cpu     # a smoke run of the script itself

The model is bench_e2e.py's: DeepSeek-V3's attention at real dims (H=128 heads, kv_lora_rank 512, rope 64,
nope 128, v 128, hidden 7168, q_lora_rank 1536), ``--layers`` layers with a dense MLP (``--intermediate``),
a ``--vocab`` vocabulary, random bf16 weights (no hub access).

Decode rows: every sequence of the batch starts from ``--context`` tokens of random latents.

- ``generate-mla-deferred``: the same with transformers' own ``DeferredStopCheck`` turned on for CUDA (it reads
  the stop flag one step late, so the host never waits for the device; transformers 5.23 turns it on for mps
  only). A measurement of what that switch is worth, not a way to run: the benchmark flips it, the library never.
- ``generate-mla``: ``model.generate()`` with the ``"mla_inductor"`` attention and a ``PagedMLACache``
  (``--fmt``); transformers compiles the decode step itself (the cache is compileable: ``mode=
  "reduce-overhead"``, CUDA graphs) and the Inductor pass picks the kernel.
- ``loop-mla``: our own loop on the same model and cache: ``torch.compile(hf.decode_one_token,
  fullgraph=True, mode="reduce-overhead")``, argmax, next step. What generate() costs on top is HF's loop.
- ``generate-hf``: ``model.generate()`` as transformers does by default: sdpa attention and a DynamicCache
  holding the same context (latents, expanded through kv_b_proj at every step); not compiled.

A decode step's time is the difference between a run of ``2 + --steps`` and a run of 2 steps, divided by
``--steps`` (the first forward of a generate() call feeds the one new prompt token uncompiled, and cancels
with everything else per call); best of ``--repeats``. Its HBM floor is the bytes a step must read (every
weight once, the batch's embedding rows, each layer's whole KV cache) at the device-to-device copy
bandwidth measured in the same run (read + write bytes of a 2 GiB copy per second).

Where a ``generate()`` step's host time goes: after timing ``generate-mla``, one more run of ``--steps``
steps under cProfile gives the time per step of each part of HF's loop (preparing the inputs, our mask
function inside it, the compiled forward's call with its own checks and its CUDA-graph replay, HF's
bookkeeping, the stop check). On CUDA the stop check reads a flag from the device every step
(transformers 5.23 defers it only on Apple's mps): its time is the device time the host waited for, and
everything the host does between it and the graph's replay (preparing the inputs, the compiled call's
guards and wrappers) is host time the device waits for. ``generate-mla`` minus ``loop-mla`` is that wait
per step (our loop never waits: its host runs ahead of the device). cProfile slows Python down: the parts
are for comparing with each other, not with the ms/step above.

How transformers compiled the step: the ``CompileConfig`` it used and, over the ``generate-mla`` row,
Dynamo's graph breaks, graphs, frames compiled and Inductor's CUDA-graph skips (0, 1, 1, 0 is the fast
path: one graph, compiled once, replayed as one CUDA graph every step).

Prefill rows: one forward of a ``--prefill-len``-token prompt (batch ``--prefill-batch``): ours
(``prefill-mla``: ``mla.prefill_attention`` on keys/values expanded from the prompt's own latents, the
latents written into a fresh paged cache) against HF's sdpa with a DynamicCache (``prefill-hf``); the two
are timed in turn (hf, ours, hf, ours, ...) so that a drifting clock favours neither; median of
``--prefill-repeats``. The kernel column of ``prefill-mla`` is the prompt kernel that ran (FlashInfer's
FA3 / FA2 prefill or torch's sdpa: ``mla_inductor.prefill.prefill_kernel`` on the arguments of the calls
of one more, untimed, forward).

Prints progress and a markdown table; ``--out DIR`` writes bench_generate.md and .json. A row that fails
prints its error and the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import pstats
import statistics
import traceback
from dataclasses import asdict, dataclass, field
from typing import Optional

import timing
import torch
from report import (add_out_argument, environment, environment_line, markdown_table, progress, prompt_kernel_log,
                    step_profile, write_results)

from bench_e2e import REAL_V3_ATTENTION, SMALL_ATTENTION, YARN  # one DeepSeek-V3 shape for both
from mla_inductor.cache import token_width

TARGETS = {"generate-mla / loop-mla": 0.8, "generate-mla / generate-hf": 20.0, "prefill-hf / prefill-mla": 1.0}


@dataclass
class Row:
    name: str
    what: str
    batch: int
    ms: Optional[float] = None
    tokens_per_s: Optional[float] = None
    floor_ms: Optional[float] = None
    kernel: str = ""
    error: Optional[str] = None
    extra: dict = field(default_factory=dict)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def wall_s(fn, device) -> float:
    return timing.wall_seconds(fn, device)


def copy_bandwidth_gbs(device) -> float:
    """Device-to-device copy bandwidth: (read + write bytes) / s of a 2 GiB copy (256 MiB on CPU)."""
    size = (2 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    seconds = min(wall_s(lambda: [dst.copy_(src) for _ in range(5)], device) for _ in range(3)) / 5
    src = dst = None  # free them before the model is built (a lambda above reads both)
    return 2 * size / seconds / 1e9


def build_model(args, device):
    from mla_inductor.testing import random_deepseek_model

    attention = SMALL_ATTENTION if args.small else REAL_V3_ATTENTION
    model = random_deepseek_model(
        "v3", dtype=torch.bfloat16, device=device, seed=0, attn_implementation="sdpa",
        num_hidden_layers=args.layers, first_k_dense_replace=args.layers, intermediate_size=args.intermediate,
        vocab_size=args.vocab, max_position_embeddings=163840, rope_parameters=YARN, pad_token_id=0, **attention,
    )
    model.generation_config.eos_token_id = None  # random weights: every call makes exactly max_new_tokens
    return model


def step_bytes(model, batch: int, context: int, kv_bytes_per_token: int) -> int:
    """What one decode step must read: every weight once (the embedding only for the batch's rows) and
    every layer's cache of context + 1 tokens."""
    weights = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                  if not name.endswith("embed_tokens.weight"))
    embed = model.get_input_embeddings().weight
    config = model.config
    kv = config.num_hidden_layers * batch * (context + 1) * kv_bytes_per_token
    return weights + batch * embed.shape[1] * embed.element_size() + kv


def kv_bytes_per_token(config, fmt: str) -> int:
    width = token_width(fmt, config.kv_lora_rank, config.qk_rope_head_dim)
    return width * {"fp32": 4, "fp16": 2, "bf16": 2}.get(fmt, 1)


def random_ids(batch: int, length: int, vocab: int, device) -> torch.Tensor:
    return torch.randint(1, vocab, (batch, length), device=device)  # no pad id: nothing looks like padding


def decode_ms(run_steps, steps: int, repeats: int, device, warmup_steps: int = 4) -> float:
    """ms per decode step from runs of 2 and 2 + steps steps (what is paid once per run cancels)."""
    for _ in range(2):
        wall_s(lambda: run_steps(warmup_steps), device)  # compile, CUDA-graph warm-up and capture
    short = min(wall_s(lambda: run_steps(2), device) for _ in range(repeats))
    long = min(wall_s(lambda: run_steps(2 + steps), device) for _ in range(repeats))
    return 1e3 * max(long - short, 0.0) / steps


# ---------------------------------------------------------------------------------------------------- decode


@contextlib.contextmanager
def deferred_stop_check():
    """transformers' ``DeferredStopCheck`` taken on any device inside the block (transformers decides by
    ``DeferredStopCheck.is_supported``, which answers no unless the device is mps)."""
    from transformers.generation import utils as generation_utils

    check = generation_utils.DeferredStopCheck
    supported = check.__dict__["is_supported"]

    def on_any_device(device, cache, cache_is_returned, is_assistant):
        return supported.__func__(torch.device("mps"), cache, cache_is_returned, is_assistant)

    check.is_supported = staticmethod(on_any_device)
    try:
        yield
    finally:
        check.is_supported = supported


def bench_generate_mla_deferred(model, cache, args, device) -> Row:
    from transformers.generation import utils as generation_utils

    if not hasattr(generation_utils, "DeferredStopCheck"):
        raise RuntimeError("this transformers has no DeferredStopCheck")
    with deferred_stop_check():
        row = bench_generate_mla(model, cache, args, device, detail=False)
    row.name, row.what = "generate-mla-deferred", row.what + ", transformers' DeferredStopCheck on"
    return row


def bench_generate_mla(model, cache, args, device, detail: bool = True) -> Row:
    """generate() on our cache; with ``detail``, also its host time per step and (``--trace``) a profile."""
    import mla_inductor.lowering
    from mla_inductor import hf

    row = Row("generate-mla", f"model.generate(), mla_inductor attention, {cache.format} PagedMLACache", args.batch)
    model.set_attn_implementation(hf.register())
    ids = random_ids(args.batch, args.context + 1, model.config.vocab_size, device)
    before = set(mla_inductor.lowering.decisions())

    def run(n):
        cache.set_length(args.context)
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, pad_token_id=0)

    counts = compile_counts()
    row.ms = decode_ms(run, args.steps, args.repeats, device)
    row.extra["compile"] = compile_report(model, counts)
    made = [d for d in mla_inductor.lowering.decisions() if d not in before]
    new = {d.backend for d in made}
    row.kernel = ", ".join(sorted(new)) or selected_kernel(model, cache)
    # Whether the selection table or a measurement chose (measured now, or stored by python -m mla_inductor.tune).
    row.extra["selection"] = sorted({f"{d.backend}: {d.source}" for d in made})
    if not detail:
        return row
    row.extra["host_us_per_step"] = host_time_per_step(run, args.steps, device)
    if args.trace:  # last: a profiler session slows the process's later CUDA calls
        row.extra["trace"] = step_profile(lambda: run(8), device.type, steps=1, rows=30)
        progress(f"--- torch.profiler, one generate() of 8 new tokens\n{row.extra['trace']}")
    return row


def compile_counts() -> dict[str, int]:
    """Dynamo's and Inductor's running totals that tell how a compiled step was built."""
    from torch._dynamo.utils import counters

    return {"graph breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"],
            "frames compiled": counters["frames"]["ok"],
            "CUDA-graph skips": counters["inductor"]["cudagraph_skips"]}


def compile_report(model, before: dict[str, int]) -> dict:
    """The CompileConfig transformers compiles generate()'s decode step with, and what Dynamo/Inductor did
    since ``before`` (``compile_counts()``)."""
    from transformers import CompileConfig

    config = model.generation_config.compile_config or CompileConfig()
    after = compile_counts()
    report = {key: after[key] - before[key] for key in after}
    report["compile_config"] = ", ".join(f"{k}={v!r}" for k, v in config.to_dict().items())
    report["compiled"] = report["graphs"] > 0 or hasattr(model, "_compiled_call")
    return report


# (part, file the function is in, function name, what of it): the parts of HF's decode loop and ours inside
# them. "total": its cumulative time (summed over same-named functions of the file), "outermost": the largest
# cumulative time among them (nested ones), "own": its own time without the functions it calls (for
# compile_wrapper: Dynamo's guard checks, which run in C).
STEP_PARTS = (
    ("prepare_inputs_for_generation (HF)", "generation/utils.py", "prepare_inputs_for_generation", "total"),
    ("- its create_masks_for_generate (HF)", "masking_utils.py", "create_masks_for_generate", "total"),
    ("- - our mask function", "mla_inductor/_hf.py", "mla_attention_mask", "total"),
    ("the compiled forward's call (0 uncompiled)", "torch/_dynamo/eval_frame.py", "compile_wrapper", "total"),
    ("- its own time: Dynamo's guard checks", "torch/_dynamo/eval_frame.py", "compile_wrapper", "own"),
    ("- its CUDA-graph trees call (input copies, replay, outputs)", "torch/_inductor/cudagraph_trees.py", "run",
     "outermost"),
    ("- - the graph's replay launch", "torch/_inductor/cudagraph_trees.py", "run_graph", "total"),
    ("_update_model_kwargs_for_generation (HF)", "generation/utils.py", "_update_model_kwargs_for_generation", "total"),
    ("logits processors (HF)", "generation/logits_process.py", "__call__", "total"),
    ("stopping criteria (HF)", "generation/stopping_criteria.py", "__call__", "total"),
    ("stop check (HF; on CUDA it waits for the device)", "generation/utils.py", "__call__", "total"),
)


def host_time_per_step(run_steps, steps: int, device) -> dict[str, float]:
    """µs per decode step of each part of ``STEP_PARTS`` over one ``run_steps(2 + steps)`` under cProfile."""
    profile = cProfile.Profile()
    sync(device)
    profile.enable()
    run_steps(2 + steps)
    sync(device)
    profile.disable()
    stats = pstats.Stats(profile).stats  # (file, line, function) -> (calls, primitive calls, own s, cumulative s, ...)
    parts = {}
    for part, file, function, what in STEP_PARTS:
        entries = [entry for (f, _, name), entry in stats.items() if name == function and file in f.replace("\\", "/")]
        if what == "own":
            seconds = sum(entry[2] for entry in entries)
        elif what == "outermost":
            seconds = max((entry[3] for entry in entries), default=0.0)
        else:
            seconds = sum(entry[3] for entry in entries)
        parts[part] = 1e6 * seconds / (2 + steps)
    return parts


def selected_kernel(model, cache) -> str:
    """What the selection table gives this cache's decode call (the pass asks the same question; it does not
    run when Inductor serves the graph from its cache)."""
    import mla_inductor

    config = model.config
    T, H, L, R = cache.batch_size, config.num_attention_heads, cache.kv_lora_rank, cache.rope_dim
    q = torch.empty(T, H, L + R, dtype=torch.bfloat16, device=cache.seq_lens.device)
    chosen = mla_inductor.backend_for_call(q[..., :L], q[..., L:], cache.kv_caches[0], cache.block_table,
                                           cache.seq_lens, 1.0, cache.kv_scale)
    return f"{chosen.backend} (selection table)"


def bench_loop_mla(model, cache, args, device) -> Row:
    from mla_inductor import hf

    row = Row("loop-mla", f"torch.compile(hf.decode_one_token), {cache.format} PagedMLACache", args.batch)
    model.set_attn_implementation(hf.register())
    cuda = device.type == "cuda"
    step = torch.compile(hf.decode_one_token, fullgraph=True, mode="reduce-overhead") if cuda else hf.decode_one_token
    first = random_ids(args.batch, 1, model.config.vocab_size, device)[:, 0]

    def run(n):
        cache.set_length(args.context)
        token = first
        for _ in range(n):
            token = step(model, token, cache).argmax(-1)

    with torch.no_grad():
        row.ms = decode_ms(run, args.steps, args.repeats, device)
    row.kernel = selected_kernel(model, cache)
    return row


def bench_generate_hf(model, args, device) -> Row:
    from transformers import DynamicCache

    row = Row("generate-hf", "model.generate(), sdpa attention, DynamicCache (HF's default)", args.batch)
    model.set_attn_implementation("sdpa")
    config = model.config
    kv_cache = DynamicCache(config=config)
    with torch.no_grad():
        for layer in range(config.num_hidden_layers):
            kv_cache.update(torch.randn(args.batch, 1, args.context, config.kv_lora_rank, device=device,
                                        dtype=torch.bfloat16),
                            torch.randn(args.batch, 1, args.context, config.qk_rope_head_dim, device=device,
                                        dtype=torch.bfloat16), layer)
    ids = random_ids(args.batch, args.context + 1, config.vocab_size, device)

    def run(n):
        extra = kv_cache.get_seq_length() - args.context
        if extra:
            kv_cache.crop(-extra)
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=kv_cache, max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, pad_token_id=0)

    row.ms = decode_ms(run, args.hf_steps, args.repeats, device, warmup_steps=2)
    row.kernel = "HF sdpa on expanded K/V"
    return row


# ---------------------------------------------------------------------------------------------------- prefill


def bench_prefill(model, args, device) -> list[Row]:
    """Both prefill rows, timed in turn (hf, ours, hf, ours, ...): a clock that drifts over the run (a GPU
    warming up) then favours neither."""
    from transformers import DynamicCache

    from mla_inductor import hf

    rows = {"prefill-hf": Row("prefill-hf", f"sdpa attention, DynamicCache, {args.prefill_len}-token prompt",
                              args.prefill_batch),
            "prefill-mla": Row("prefill-mla", "mla_inductor attention: mla.prefill_attention on the prompt's expanded "
                               f"latents, latents into a PagedMLACache, {args.prefill_len}-token prompt",
                               args.prefill_batch)}
    ids = random_ids(args.prefill_batch, args.prefill_len, model.config.vocab_size, device)
    cache = hf.PagedMLACache(model, batch_size=args.prefill_batch, max_seq_len=args.prefill_len, fmt=args.fmt)
    implementation = {"prefill-hf": "sdpa", "prefill-mla": hf.register()}

    def forward(name):
        if name == "prefill-mla":
            cache.reset()
        past = cache if name == "prefill-mla" else DynamicCache(config=model.config)
        model(ids, past_key_values=past, use_cache=True, logits_to_keep=1)

    times = {name: [] for name in rows}
    with torch.no_grad():
        for turn in range(2 + max(args.prefill_repeats, 3)):
            for name in rows:
                model.set_attn_implementation(implementation[name])
                seconds = wall_s(lambda: forward(name), device)
                if turn >= 2:  # two warm-up turns
                    times[name].append(seconds)
    for name, row in rows.items():
        row.ms = 1e3 * statistics.median(times[name])
        row.tokens_per_s = args.prefill_batch * args.prefill_len / (row.ms / 1e3)
    rows["prefill-hf"].kernel = "HF sdpa on expanded K/V"
    model.set_attn_implementation(implementation["prefill-mla"])
    with torch.no_grad(), prompt_kernel_log() as ran:
        forward("prefill-mla")
    rows["prefill-mla"].kernel = ", ".join(sorted(set(ran.kernels))) or "HF sdpa with the padding mask"
    return list(rows.values())


# ---------------------------------------------------------------------------------------------------- report


def run_row(fn, *args) -> Row:
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - report and go on with the next row
        traceback.print_exc()
        message = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        return Row(fn.__name__.removeprefix("bench_").replace("_", "-"), "", 0, error=message)
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def ratios(rows: dict[str, Row]) -> dict[str, Optional[float]]:
    def rate(name):
        row = rows.get(name)
        return None if row is None or row.error or not row.ms else 1.0 / row.ms

    out = {}
    for key in TARGETS:
        a, b = key.split(" / ")
        if a.startswith("prefill"):  # time ratio: > 1 means ours is faster
            ra, rb = rate(b), rate(a)
        else:
            ra, rb = rate(a), rate(b)
        out[key] = ra / rb if ra and rb else None
    return out


def markdown(rows: list[Row], derived: dict, args, env: dict, bandwidth: float) -> str:
    dims = ("small smoke-run dims (--small)" if args.small
            else "DeepSeek-V3 attention dims (H=128, L=512, R=64, hidden 7168)")
    lines = [
        f"### model.generate() on a DeepSeek-V3-shaped model: {args.layers} layers, {dims}, dense MLP "
        f"{args.intermediate}, vocab {args.vocab}",
        "",
        environment_line(env),
        "",
        f"Decode: batch {args.batch}, context {args.context}, {args.fmt} cache; ms/step from runs of 2 and "
        f"2 + {args.steps} steps ({args.hf_steps} for generate-hf), best of {args.repeats}. HBM floor: bytes a "
        f"step must read at the measured copy bandwidth {bandwidth:.0f} GB/s. Prefill: {args.prefill_len}-token "
        f"prompt, batch {args.prefill_batch}, the two rows timed in turn, median of {args.prefill_repeats}.",
        "",
    ]
    table = []
    for r in rows:
        table.append({
            "row": r.name, "what": r.what or "", "batch": r.batch,
            "ms": None if r.error else r.ms,
            "tokens/s": None if r.error else r.tokens_per_s,
            "HBM floor ms": r.floor_ms,
            "x floor": (r.ms / r.floor_ms) if r.ms and r.floor_ms and not r.error else None,
            "kernel": r.error or r.kernel,
        })
    lines.append(markdown_table(["row", "what", "batch", "ms", "tokens/s", "HBM floor ms", "x floor", "kernel"],
                                table))
    lines += ["", "| ratio | measured | target (issue 15) |", "|---|---|---|"]
    for key, value in derived.items():
        shown = f"{value:.2f}" if value is not None else "n/a"
        lines.append(f"| {key} | {shown} | >= {TARGETS[key]} |")
    by_name = {r.name: r for r in rows if r.ms and not r.error}
    if "generate-mla-deferred" in by_name and "loop-mla" in by_name:
        lines += ["", f"With transformers' DeferredStopCheck on (generate-mla-deferred, not a target row): "
                  f"{by_name['loop-mla'].ms / by_name['generate-mla-deferred'].ms:.2f}x loop-mla."]
    if "generate-mla" in by_name and "loop-mla" in by_name:
        wait = by_name["generate-mla"].ms - by_name["loop-mla"].ms
        lines += ["", f"HF's loop per step (generate-mla - loop-mla): {wait:.3f} ms; the target (>= 0.8x loop-mla) "
                  f"allows {by_name['loop-mla'].ms * (1 / TARGETS['generate-mla / loop-mla'] - 1):.3f} ms."]
    built = next((r.extra["compile"] for r in rows if "compile" in r.extra), None)
    if built:
        how = (f"transformers compiled the decode step ({built['compile_config']}): {built['graph breaks']} graph "
               f"breaks, {built['graphs']} graphs from {built['frames compiled']} frames compiled, "
               f"{built['CUDA-graph skips']} CUDA-graph skips over the generate-mla row"
               if built["compiled"] else "transformers did not compile the decode step (it does so on CUDA only)")
        lines += ["", how + "."]
    chosen = next((r.extra["selection"] for r in rows if r.extra.get("selection")), None)
    if chosen:
        lines += ["", f"generate-mla's decode calls chose (backend: source): {'; '.join(chosen)}."]
    host = next((r.extra["host_us_per_step"] for r in rows if "host_us_per_step" in r.extra), None)
    if host:
        lines += ["", f"Where a generate-mla step's host time goes (cProfile over 2 + {args.steps} steps, µs per "
                  "step; the profiler slows Python down, so compare the parts with each other):", ""]
        parts = [{"part": k, "µs per step": v} for k, v in host.items()]
        lines.append(markdown_table(["part", "µs per step"], parts))
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per run (generate-mla, loop-mla)")
    p.add_argument("--hf-steps", type=int, default=4, help="decode steps timed per run of generate-hf (slow)")
    p.add_argument("--fmt", default="bf16", help="our cache format: bf16, fp8_e4m3 or fp8_ds_mla")
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--prefill-len", type=int, default=4096)
    p.add_argument("--prefill-batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill-repeats", type=int, default=10, help="timed forwards of each prefill row (median)")
    p.add_argument("--rows", nargs="+",
                   default=["prefill", "generate-mla", "generate-mla-deferred", "loop-mla", "generate-hf"],
                   help="which rows to run (prefill = both prefill rows)")
    p.add_argument("--trace", action="store_true",
                   help="after timing generate-mla, print torch.profiler's table of one generate() of 8 tokens "
                        "(device->host syncs show as cudaStreamSynchronize / cudaMemcpyAsync); with --rows "
                        "generate-mla only, since a profiler session slows what runs after it")
    p.add_argument("--small", action="store_true", help="tiny model and context: a smoke run (CPU allowed)")
    add_out_argument(p)
    args = p.parse_args(argv)
    if args.trace and args.rows != ["generate-mla"]:
        p.error("--trace runs with --rows generate-mla only (a profiler session slows the rows after it)")
    device = torch.device(args.device)
    if args.small:
        args.layers, args.intermediate, args.vocab = 2, 64, 256
        args.batch, args.context, args.steps, args.hf_steps = min(args.batch, 2), min(args.context, 64), 2, 2
        args.prefill_len, args.repeats, args.prefill_repeats = min(args.prefill_len, 64), 1, 3
    elif device.type != "cuda" or not torch.cuda.is_available():
        raise SystemExit("bench_generate.py times decode on a CUDA GPU and needs a CUDA GPU; torch.cuda.is_available() "
                         f"is {torch.cuda.is_available()} here (torch {torch.__version__}). Nothing was run. "
                         "(--small --device cpu runs a smoke test of the script.)")

    from mla_inductor import hf
    from mla_inductor.testing import fill_paged_mla_cache

    env = environment(("transformers", "flashinfer", "flash_mla"))
    progress(f"bench_generate: {environment_line(env)}")
    bandwidth = copy_bandwidth_gbs(device)
    progress(f"copy bandwidth {bandwidth:.0f} GB/s (read + write)")
    progress(f"building the model ({args.layers} layers)")
    model = build_model(args, device)
    floor = {fmt: 1e3 * step_bytes(model, args.batch, args.context, kv_bytes_per_token(model.config, fmt))
             / (bandwidth * 1e9) for fmt in (args.fmt, "bf16")}

    rows: list[Row] = []
    with torch.no_grad():
        if "prefill" in args.rows:
            progress(f"[prefill-hf, prefill-mla] {args.prefill_len}-token prompt, batch {args.prefill_batch}, "
                     f"timed in turn")
            prefill_rows = run_row(bench_prefill, model, args, device)
            rows.extend(prefill_rows if isinstance(prefill_rows, list) else [prefill_rows])
        cache = None
        if {"generate-mla", "loop-mla"} & set(args.rows):
            progress(f"filling a {args.fmt} PagedMLACache: batch {args.batch}, context {args.context}")
            model.set_attn_implementation(hf.register())
            cache = hf.PagedMLACache(model, batch_size=args.batch, max_seq_len=args.context + args.steps + 8,
                                     fmt=args.fmt)
            fill_paged_mla_cache(cache, args.context)
        mla_rows = (("generate-mla", bench_generate_mla), ("generate-mla-deferred", bench_generate_mla_deferred),
                    ("loop-mla", bench_loop_mla))
        for name, bench in mla_rows:
            if name == "generate-mla-deferred" and name in args.rows and device.type != "cuda":
                progress(f"[{name}] not run: transformers' DeferredStopCheck records device events (CUDA only here)")
                continue
            if name in args.rows:
                progress(f"[{name}] compiling and capturing the decode step, then timing")
                row = run_row(bench, model, cache, args, device)
                row.floor_ms = floor[args.fmt]
                rows.append(row)
        del cache
        if "generate-hf" in args.rows:
            progress("[generate-hf] HF's default decode (expands the whole context every step)")
            row = run_row(bench_generate_hf, model, args, device)
            row.floor_ms = floor["bf16"]
            rows.append(row)
    for r in rows:
        if r.ms and r.tokens_per_s is None and not r.error:
            r.tokens_per_s = r.batch / (r.ms / 1e3)
        rate = f"{r.tokens_per_s:.0f} tokens/s" if r.tokens_per_s else "too fast to tell from the noise"
        progress(f"[{r.name}] " + (r.error or f"{r.ms:.3f} ms, {rate}"))

    derived = ratios({r.name: r for r in rows})
    table = markdown(rows, derived, args, env, bandwidth)
    print(table)
    write_results(args.out, "bench_generate", table, {
        "environment": env, "args": vars(args), "copy_bandwidth_gbs": bandwidth,
        "rows": [asdict(r) for r in rows], "ratios": derived, "targets": TARGETS,
    })


if __name__ == "__main__":
    main()
