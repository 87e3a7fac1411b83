"""End-to-end decode step of a DeepSeek-V3-shaped HF model: HF eager vs HF compiled vs patched on the op.

    python benchmarks/bench_e2e.py [--out DIR]                # GPU: B in {1, 16, 64}, context 4096
    python benchmarks/bench_e2e.py --small --device cpu       # a seconds-long smoke run of the script itself

The model: DeepSeek-V3's attention at real dims (H=128 heads, kv_lora_rank L=512, rope R=64, nope 128,
v 128, hidden 7168, q_lora_rank 1536) with few layers (``--layers``, default 4), random weights, a *dense*
MLP of small intermediate size (``--intermediate``, default 2048; no MoE) and a small vocabulary
(``--vocab``): the attention is full size, the rest is cut so the step is attention-heavy but realistic
in shape. Every sequence holds ``--context`` tokens of random latents; each timed step decodes one token
per sequence (the same cache slot is rewritten, so the context stays fixed).

Variants (each needs transformers >= 5):

- ``hf-eager``:   HF's forward, sdpa attention, its DynamicCache (latents, expanded by kv_b_proj each step).
- ``hf-compile``: the same under ``torch.compile`` (default mode; DynamicCache rules out CUDA graphs).
- ``mla-<fmt>``:  the ``"mla_inductor"`` attention and a ``mla_inductor.hf.PagedMLACache`` of format ``fmt``,
  ``torch.compile(hf.decode_one_token, fullgraph=True, mode="reduce-overhead")`` (CUDA graphs on GPU).

Reports ms per step, the attention share of it (all layers' attention modules timed on their own, the
same way as the step: projections, cache write and read, attention), KV-cache bytes per token (per layer
and for the model), and which kernel the Inductor pass chose. A configuration that fails prints its
error and the run goes on. Prints the markdown table; ``--out DIR`` also writes bench_e2e.md and .json.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

import timing
import torch
from report import add_out_argument, environment, progress, write_results

from mla_inductor.cache import token_width

REAL_V3_ATTENTION = dict(hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
                         kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
SMALL_ATTENTION = dict(hidden_size=128, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=64,
                       kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096, mscale=1.0,
            mscale_all_dim=1.0, beta_fast=32, beta_slow=1)


@dataclass
class Row:
    variant: str
    batch: int
    cache_format: str
    bytes_per_token_layer: int
    num_layers: int
    ms_step: Optional[float] = None
    ms_attention: Optional[float] = None
    note: str = ""
    error: Optional[str] = None
    backends: list = field(default_factory=list)


def kv_bytes_per_token(config, fmt: str) -> int:
    """Bytes one token takes in one layer's cache: (L + R) elements, or fp8_ds_mla's 656-byte row.
    HF's DynamicCache for DeepSeek also keeps the latent and rope key (bf16), so it counts like "bf16"."""
    width = token_width(fmt, config.kv_lora_rank, config.qk_rope_head_dim)
    return width * {"fp32": 4, "fp16": 2, "bf16": 2}.get(fmt, 1)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], device, warmup: int, iters: int) -> float:
    """Mean wall time of fn() in ms after warm-up, device synchronised around the timed loop."""
    return timing.mean_ms(fn, device, warmup=warmup, iters=iters)


def build_model(args, device, dtype):
    from mla_inductor.testing import random_deepseek_model

    attention = SMALL_ATTENTION if args.small else REAL_V3_ATTENTION
    return random_deepseek_model(
        "v3", dtype=dtype, device=device, seed=0, num_hidden_layers=args.layers, first_k_dense_replace=args.layers,
        intermediate_size=args.intermediate, vocab_size=args.vocab, max_position_embeddings=163840,
        rope_parameters=YARN, pad_token_id=0, **attention,
    )


# ---------------------------------------------------------------------------------------------------- HF


def _truncate(kv_cache, length: int) -> None:
    # DynamicCache.crop's argument changed meaning within 5.x (absolute length vs tokens to remove); slice directly.
    for layer in kv_cache.layers:
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]


def bench_hf(model, args, batch, compiled: bool, device) -> Row:
    """HF's own decode step with a DynamicCache holding ``context`` random latents per sequence."""
    from transformers import DynamicCache

    config = model.config
    L, R, ctx = config.kv_lora_rank, config.qk_rope_head_dim, args.context
    dtype = model.lm_head.weight.dtype
    row = Row("hf-compile" if compiled else "hf-eager", batch, "bf16", kv_bytes_per_token(config, "bf16"),
              config.num_hidden_layers, note="DynamicCache, sdpa")
    model.set_attn_implementation("sdpa")
    kv_cache = DynamicCache(config=config)
    for layer in range(config.num_hidden_layers):
        kv_cache.update(torch.randn(batch, 1, ctx + 1, L, device=device, dtype=dtype),
                        torch.randn(batch, 1, ctx + 1, R, device=device, dtype=dtype), layer)
    # Every step grows the cache to ctx + 1 and slices it back: start from such a slice so that the
    # compiled variant sees the same strides on every call (no recompiles while timing).
    _truncate(kv_cache, ctx)
    tokens = torch.randint(1, config.vocab_size, (batch, 1), device=device)
    positions = torch.full((batch, 1), ctx, device=device, dtype=torch.long)
    forward = torch.compile(model) if compiled else model

    def step():
        out = forward(input_ids=tokens, position_ids=positions, past_key_values=kv_cache, use_cache=True).logits
        _truncate(kv_cache, ctx)  # keep the context fixed across timed steps
        return out

    def attention_only(hidden, rope):
        for layer in model.model.layers:
            layer.self_attn(hidden_states=hidden, position_embeddings=rope, attention_mask=None,
                            past_key_values=kv_cache)
        _truncate(kv_cache, ctx)

    attention = torch.compile(attention_only) if compiled else attention_only
    hidden = torch.randn(batch, 1, config.hidden_size, device=device, dtype=dtype)
    with torch.no_grad():
        rope = model.model.rotary_emb(hidden, positions)
        row.ms_step = time_ms(step, device, args.warmup, args.iters)
        row.ms_attention = time_ms(lambda: attention(hidden, rope), device, args.warmup, args.iters)
    return row


# ---------------------------------------------------------------------------------------------------- ours


def bench_mla(model, args, batch, fmt, device) -> Row:
    import mla_inductor.lowering
    from mla_inductor import hf
    from mla_inductor.testing import fill_paged_mla_cache

    config = model.config
    row = Row(f"mla-{fmt}", batch, fmt, kv_bytes_per_token(config, fmt), config.num_hidden_layers,
              note="paged, compiled" + (", CUDA graphs" if device.type == "cuda" else ""))
    before = set(mla_inductor.lowering.decisions())
    model.set_attn_implementation(hf.register())
    cache = hf.PagedMLACache(model, batch_size=batch, max_seq_len=args.context + 1, fmt=fmt, page_size=args.page_size)
    fill_paged_mla_cache(cache, args.context)
    tokens = torch.randint(1, config.vocab_size, (batch,), device=device)
    mode = "reduce-overhead" if device.type == "cuda" and args.cudagraphs else None
    if device.type == "cuda" and not args.cudagraphs:
        row.note = "paged, compiled, no CUDA graphs"
    step = torch.compile(hf.decode_one_token, fullgraph=True, mode=mode)

    def decode():
        step(model, tokens, cache)
        cache.crop(-1)  # back to the fixed context: the next step rewrites the same slot

    def attention_only(hidden, rope):
        for layer in model.model.layers:
            out, _ = layer.self_attn(hidden_states=hidden, position_embeddings=rope, attention_mask=None,
                                     past_key_values=cache)
        return out

    attention = torch.compile(attention_only, fullgraph=True, mode=mode)
    hidden = torch.randn(batch, 1, config.hidden_size, device=device, dtype=model.lm_head.weight.dtype)
    positions = torch.full((batch, 1), args.context, device=device, dtype=torch.long)
    with torch.no_grad():
        rope = model.model.rotary_emb(hidden, positions)
        row.ms_step = time_ms(decode, device, args.warmup, args.iters)
        row.ms_attention = time_ms(lambda: (attention(hidden, rope), cache.crop(-1)), device, args.warmup, args.iters)
    row.backends = sorted({f"{d.backend}" for d in mla_inductor.lowering.decisions() if d not in before
                           and d.problem.cache_format == fmt})
    return row


# ---------------------------------------------------------------------------------------------------- report


def markdown(rows: list[Row], args, device_name: str) -> str:
    lines = [
        f"### DeepSeek-V3-shaped decode step, {args.layers} layers, context {args.context}, {device_name}",
        "",
        "Attention at real dims (H=128, L=512, R=64, hidden 7168, q_lora 1536)" if not args.small
        else "Small smoke-run dims (--small)",
        f"; dense MLP, intermediate {args.intermediate}; vocab {args.vocab}; random weights; "
        f"mean of {args.iters} steps after {args.warmup} warm-up.",
        "",
        "| variant | B | cache | KV bytes/token (layer / model) | ms/step | attention ms | attention share | kernel | notes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        kv = f"{r.bytes_per_token_layer} / {r.bytes_per_token_layer * r.num_layers}"
        if r.error:
            lines.append(f"| {r.variant} | {r.batch} | {r.cache_format} | {kv} | failed | | | | {r.error} |")
            continue
        share = f"{100 * r.ms_attention / r.ms_step:.0f}%" if r.ms_attention and r.ms_step else ""
        lines.append(f"| {r.variant} | {r.batch} | {r.cache_format} | {kv} | {r.ms_step:.3f} | {r.ms_attention:.3f} "
                     f"| {share} | {', '.join(r.backends) or 'HF sdpa'} | {r.note} |")
    lines += ["", "Attention ms: all layers' attention modules alone (projections, cache write/read, attention), "
              "run the same way as the step (eager / compiled / CUDA graphs); the share can exceed what the step "
              "spends there when the step overlaps launches."]
    return "\n".join(lines)


RESULT_TAG = "BENCH_E2E_RESULT "


def run_job(model, args, name: str, batch: int, device, cudagraphs: Optional[bool] = None) -> Row:
    """One configuration in this process; any failure becomes the row's error (traceback printed)."""
    fmt = "bf16" if name.startswith("hf-") else name[len("mla-"):]
    if cudagraphs is not None:
        args = argparse.Namespace(**{**vars(args), "cudagraphs": cudagraphs})
    try:
        model = model if model is not None else build_model(args, device, torch.bfloat16)
        if name.startswith("hf-"):
            return bench_hf(model, args, batch, name == "hf-compile", device)
        return bench_mla(model, args, batch, fmt, device)
    except Exception as e:  # noqa: BLE001 - report and go on with the next configuration
        traceback.print_exc()
        config = model.config if model is not None else argparse.Namespace(kv_lora_rank=512, qk_rope_head_dim=64)
        return Row(name, batch, fmt, kv_bytes_per_token(config, fmt), args.layers, error=_one_line(e))
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def run_isolated(argv: list, name: str, batch: int, extra: tuple = ()) -> Row:
    """One configuration in a fresh interpreter; its output is passed through, its result parsed."""
    cmd = [sys.executable, __file__, *argv, *extra, "--job", f"{name}:{batch}"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            result = Row(**json.loads(line[len(RESULT_TAG):]))
        else:
            print(line)
    if result is None:
        last = [l for l in proc.stdout.splitlines() if l.strip()][-1:] or ["no output"]
        fmt = "bf16" if name.startswith("hf-") else name[len("mla-"):]
        dims = argparse.Namespace(kv_lora_rank=512, qk_rope_head_dim=64)
        result = Row(name, batch, fmt, kv_bytes_per_token(dims, fmt), 0,
                     error=f"subprocess exited with {proc.returncode}: {last[0][:200]}".replace("|", "/"))
    return result


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}".replace("|", "/")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--formats", nargs="+", default=["bf16", "fp8_e4m3", "fp8_ds_mla"])
    p.add_argument("--variants", nargs="+", default=["hf-eager", "hf-compile", "mla"])
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--small", action="store_true", help="tiny dims and context for a CPU smoke run")
    p.add_argument("--no-cudagraphs", dest="cudagraphs", action="store_false",
                   help="compile the patched step without mode='reduce-overhead'")
    p.add_argument("--inline", dest="isolate", action="store_false",
                   help="run every configuration in this process (default: one subprocess each, so a crash, "
                        "an OOM or a failed CUDA-graph capture cannot poison the next configuration)")
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)
    add_out_argument(p)
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("bench_e2e.py: --device cuda needs a CUDA GPU; torch.cuda.is_available() is False here. "
                         "Nothing was run.")
    if not args.device.startswith("cuda") and not args.small:
        raise SystemExit("bench_e2e.py times a DeepSeek-V3-sized decode step and needs a CUDA GPU; without one "
                         "only the smoke run works: --small --device cpu. Nothing was run.")
    if args.small:
        args.context, args.layers, args.intermediate, args.vocab = min(args.context, 64), 2, 64, 256
        args.batches = [b for b in args.batches if b <= 4] or [2]
        args.warmup, args.iters = 2, 2
    device = torch.device(args.device)
    dtype = torch.bfloat16
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"

    if args.job:
        name, batch = args.job.split(":")
        row = run_job(None, args, name, int(batch), device)
        print(RESULT_TAG + json.dumps(dataclasses.asdict(row)), flush=True)
        return
    model = None
    if not args.isolate:
        try:
            model = build_model(args, device, dtype)
        except Exception as e:  # noqa: BLE001 - e.g. transformers missing: nothing to run
            print(f"bench_e2e: cannot build the model: {_one_line(e)}")
            return
    rows: list[Row] = []
    for batch in args.batches:
        jobs = [v for v in ("hf-eager", "hf-compile") if v in args.variants]
        jobs += [f"mla-{fmt}" for fmt in args.formats] if "mla" in args.variants else []
        for name in jobs:
            progress(f"[{name} B={batch}] running")
            t0 = time.perf_counter()
            row = run_isolated(argv, name, batch) if args.isolate else run_job(model, args, name, batch, device)
            if row.error and name.startswith("mla-") and device.type == "cuda" and args.cudagraphs:
                print(f"[{name} B={batch}] with CUDA graphs: {row.error}; again without", flush=True)
                row = (run_isolated(argv, name, batch, ["--no-cudagraphs"]) if args.isolate
                       else run_job(model, args, name, batch, device, cudagraphs=False))
                row.note += " (CUDA-graph capture failed)"
            rows.append(row)
            status = row.error or f"{row.ms_step:.3f} ms/step, attention {row.ms_attention:.3f} ms"
            progress(f"[{name} B={batch}] {status} ({time.perf_counter() - t0:.0f} s)")
    table = markdown(rows, args, device_name)
    print(table)
    write_results(args.out, "bench_e2e", table, {"environment": environment(("transformers",)),
                                                 "rows": [dataclasses.asdict(r) for r in rows]})


if __name__ == "__main__":
    main()
