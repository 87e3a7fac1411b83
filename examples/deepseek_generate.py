"""``model.generate()`` of a Hugging Face DeepSeek-V3 on ``torch.ops.mla.paged_decode``: same tokens, faster on GPU.

    python examples/deepseek_generate.py [--device cuda] [--fmt bf16|fp8_e4m3|fp8_ds_mla] [--steps 32] [--repeats 3]

Builds a small random-weight ``DeepseekV3ForCausalLM`` (no hub access; ``pip install 'mla-inductor[hf]'``)
and generates greedily for a left-padded batch with HF's attention and with ours:

- HF eager:    transformers' sdpa attention and its DynamicCache, no compile;
- HF compiled: transformers' own recipe, a static cache with generate() compiling the decode step
               (on CPU only with ``--hf-compile``: its compile takes a while there);
- ours:        ``model.set_attn_implementation("mla_inductor")`` and a ``PagedMLACache`` passed as
               generate()'s cache; generate() compiles the decode step (by itself on GPU) and the
               Inductor pass rewrites each ``mla.paged_decode`` into the kernel it picks for the device.

It prints the versions it ran with, checks that HF's attention and ours give the same tokens (and how far
their logits are apart), times ``--repeats`` generate() calls of each variant after a warm-up (the median
tokens/s with its spread, and ms per token of a sequence), and names the kernel the pass chose. CPU fp32 by
default, CUDA bf16 when a GPU is present; on GPU the attention has DeepSeek-V3's real dims (kv_lora_rank
512, rope 64) so every cache format, fp8_ds_mla included, works, layer 1 is a MoE layer, and ours is
compared with HF's fastest variant. On CPU both layers are dense, to keep the compile short, and at this
size every variant is bound by per-operator overhead: the speed-up is a GPU matter
(benchmarks/bench_generate.py), and the CPU figures show only that ours runs.
"""

import argparse
import statistics
import sys
import time
import warnings
from dataclasses import dataclass

import torch
import transformers
from transformers import CompileConfig
from transformers.generation import BaseStreamer

import mla_inductor  # registers torch.ops.mla.*; the Inductor pass loads on the first compile
from mla_inductor import hf
from mla_inductor.testing import random_deepseek_model

# A few layers of DeepSeek-V3's shape, shrunk: layer 0 dense, layer 1 MoE, like the real model's first_k_dense.
SMALL_V3 = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=16, num_key_value_heads=16, q_lora_rank=96, kv_lora_rank=64, qk_rope_head_dim=32,
                qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, n_group=2, topk_group=1,
                num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=4096, pad_token_id=0,
                rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                     original_max_position_embeddings=1024, mscale=1.0, mscale_all_dim=1.0,
                                     beta_fast=32, beta_slow=1))
REAL_ATTENTION_DIMS = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
# torch 2.13's Inductor lowers aten.diagonal (the padding mask's diagonal, in the compiled step) through its own
# deprecated torch._prims_common.check, and warns about that on the caller's behalf.
warnings.filterwarnings("ignore", message=r"`torch\._prims_common\.check` is deprecated", category=FutureWarning)


class Progress(BaseStreamer):
    """Prints a dot per generated token: the first one waits for the decode step's compilation."""

    def __init__(self):
        self.first = True

    def put(self, value):
        if self.first:  # generate() hands the prompt first
            self.first = False
            return
        print(".", end="", flush=True)

    def end(self):
        print(flush=True)


@dataclass
class Variant:
    """One way to generate: its tokens and logits (from the last timed call) and the times of the timed calls."""

    name: str
    tokens: torch.Tensor
    logits: torch.Tensor
    seconds: list[float]

    def tokens_per_second(self, batch: int, steps: int) -> list[float]:
        return sorted(batch * steps / t for t in self.seconds)

    def row(self, batch: int, steps: int) -> str:
        rates = self.tokens_per_second(batch, steps)
        ms_per_token = 1e3 * statistics.median(self.seconds) / steps  # each step makes a token of every sequence
        return (f"{self.name:<40} {statistics.median(rates):9.1f} tokens/s ({rates[0]:.1f}-{rates[-1]:.1f}), "
                f"{ms_per_token:7.2f} ms per token")


def left_padded_batch(batch, length, vocab, device):
    """Prompts [batch, length] of decreasing real length, left-padded with 0, and their 0/1 mask."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for b in range(batch):
        mask[b, : (b * length) // (2 * batch)] = 0
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed_generate(name, model, prompt, mask, args, cache=None, **kwargs) -> Variant:
    """A warm-up generate() (it compiles where the variant compiles), then ``args.repeats`` timed ones with the
    same arguments, each on an emptied cache; the last one's tokens and logits are the ones compared."""
    generate = dict(attention_mask=mask, do_sample=False, max_new_tokens=args.steps, pad_token_id=0,
                    output_logits=True, return_dict_in_generate=True, **kwargs)
    if cache is not None:
        generate.update(hf.cache_kwargs(cache))  # cache= (transformers >= 5.24) or past_key_values= (5.23)
    print(f"[{name}] warm-up", end=" ", flush=True)
    t0 = time.perf_counter()
    model.generate(prompt, streamer=Progress(), **generate)
    print(f"[{name}] warm-up took {time.perf_counter() - t0:.1f} s", flush=True)
    seconds = []
    for _ in range(args.repeats):
        if cache is not None:
            cache.reset()
        sync(args.device)
        t0 = time.perf_counter()
        out = model.generate(prompt, **generate)
        sync(args.device)
        seconds.append(time.perf_counter() - t0)
    return Variant(name, out.sequences, torch.stack(out.logits, 1).float(), seconds)


def compile_config(device):
    """generate() compiles its decode step by itself on GPU; on CPU only when asked (HF's switch for that)."""
    config = CompileConfig(mode="reduce-overhead" if device == "cuda" else "default")
    config._compile_all_devices = True
    return config


def versions_line(device: str) -> str:
    if device == "cuda":
        where = f"cuda ({torch.cuda.get_device_name()}, sm{''.join(map(str, torch.cuda.get_device_capability()))})"
    else:
        where = f"cpu ({torch.get_num_threads()} threads)"
    return (f"torch {torch.__version__}, transformers {transformers.__version__}, "
            f"mla_inductor {mla_inductor.__version__}, device {where}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--fmt", default=None, help="our cache format: fp32/bf16/fp8_e4m3/fp8_ds_mla (default: model dtype)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed generate() calls per variant (after a warm-up)")
    p.add_argument("--hf-compile", action=argparse.BooleanOptionalAction, default=None,
                   help="also time HF's own compiled generate (default: on GPU only)")
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    config = dict(SMALL_V3, **REAL_ATTENTION_DIMS) if cuda else dict(SMALL_V3, first_k_dense_replace=2)
    hf_compile = cuda if args.hf_compile is None else args.hf_compile

    print(versions_line(args.device))
    model = random_deepseek_model("v3", dtype=dtype, device=args.device, seed=0, attn_implementation="sdpa", **config)
    model.generation_config.eos_token_id = None  # random weights: generate exactly --steps tokens
    prompt, mask = left_padded_batch(args.batch, args.prompt_len, config["vocab_size"], args.device)
    print(f"DeepSeek-V3 (random weights, {config['num_hidden_layers']} layers, {config['num_attention_heads']} heads, "
          f"L={config['kv_lora_rank']}, R={config['qk_rope_head_dim']}, {dtype}) on {args.device}, batch "
          f"{args.batch} left-padded, {args.steps} new tokens each, {args.repeats} timed runs per variant")

    with torch.no_grad():
        theirs = [timed_generate("HF eager (sdpa, DynamicCache)", model, prompt, mask, args)]
        if hf_compile:
            theirs.append(timed_generate("HF compiled (static cache)", model, prompt, mask, args,
                                         cache_implementation="static", compile_config=compile_config(args.device)))
        model.set_attn_implementation(hf.register())
        cache = hf.PagedMLACache(model, batch_size=args.batch, max_seq_len=args.prompt_len + args.steps,
                                 fmt=args.fmt, page_size=64 if cuda else 16)
        before = set(mla_inductor.lowering.decisions())
        ours = timed_generate(f"ours (mla_inductor, {cache.format} paged cache)", model, prompt, mask, args,
                              cache=cache, compile_config=compile_config(args.device))

    print(f"tokens/s: median of {args.repeats} generate() calls (min-max); ms per token: a call's median time / "
          f"{args.steps} new tokens per sequence (its prompt forward included)")
    for variant in theirs + [ours]:
        print(variant.row(args.batch, args.steps))
    if not hf_compile:
        print(f"{'HF compiled (static cache)':<40} skipped on CPU (pass --hf-compile)")
    if cuda:
        best = max(theirs, key=lambda v: statistics.median(v.tokens_per_second(args.batch, args.steps)))
        ratio = statistics.median(ours.tokens_per_second(args.batch, args.steps)) / statistics.median(
            best.tokens_per_second(args.batch, args.steps))
        print(f"ours vs HF's fastest here ({best.name}): {ratio:.2f}x tokens/s (medians)")
    else:
        print("On CPU, at this size, every variant is bound by per-operator overhead: these figures show that ours "
              "runs, not a speed-up. The speed-up is a GPU matter (run this on a GPU, or benchmarks/bench_generate.py).")
    want = theirs[0]
    print(f"greedy tokens, HF's attention vs ours: {(ours.tokens == want.tokens).float().mean().item():.1%} identical; "
          f"logits differ by at most {(ours.logits - want.logits).abs().max().item():.2e}")
    print(f"mla.paged_decode ({cache.format} cache, {config['num_attention_heads']} heads) -> "
          f"{describe(chosen_kernel(before, cache), args.device)}")
    print("tokens of sequence 0:", ours.tokens[0, args.prompt_len:].tolist())
    if not cuda and cache.format == "fp32" and not torch.equal(ours.tokens, want.tokens):
        sys.exit("HF's attention and ours disagree on CPU in fp32")  # on GPU, bf16/fp8 rounding may split near-ties


def describe(backend: str, device: str) -> str:
    """The pass's choice in words: on CPU, Inductor generates the decode's code from the reference
    implementation (there is no hand-written CPU kernel to pick)."""
    if device == "cpu" and backend.startswith("reference"):
        return (f"{backend}: the reference decode (mla_inductor/reference.py) compiled by Inductor into C++ for "
                "the CPU, inside the compiled step")
    return backend


def chosen_kernel(before, cache) -> str:
    """The pass's record of what it chose for our decode step; when Inductor served the graph from its cache
    (the pass did not run), the same question asked of the selection table."""
    new = sorted({d.backend for d in mla_inductor.lowering.decisions() if d not in before})
    if new:
        return ", ".join(new)
    H, L, R = 1, cache.kv_lora_rank, cache.rope_dim
    q = torch.empty(cache.batch_size, H, L + R, dtype=torch.bfloat16 if cache.format != "fp32" else torch.float32,
                    device=cache.seq_lens.device)
    chosen = mla_inductor.backend_for_call(q[..., :L], q[..., L:], cache.kv_caches[0], cache.block_table,
                                           cache.seq_lens, 1.0, cache.kv_scale)
    return f"{chosen.backend} (graph from Inductor's cache; the selection table's answer)"


if __name__ == "__main__":
    main()
