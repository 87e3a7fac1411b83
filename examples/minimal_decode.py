"""MLA decode in vanilla PyTorch: a hand-written attention block on a paged latent cache, compiled.

    python examples/minimal_decode.py [--device cuda] [--steps 32] [--fmt bf16|fp8_e4m3|fp8_ds_mla]

The model calls ``torch.ops.mla.paged_decode`` on the absorbed query; ``torch.compile`` turns that call
into the best kernel for the device (plain Inductor code on CPU). Random weights; no hub access.
"""

import argparse
import time
from dataclasses import dataclass

import torch
from torch import nn

import mla_inductor  # registers torch.ops.mla.*; the Inductor pass loads on the first compile
from mla_inductor import PagedLatentCache


@dataclass
class MLAConfig:
    hidden: int = 1024
    heads: int = 16
    kv_lora_rank: int = 512
    rope_dim: int = 64
    nope_dim: int = 128
    v_dim: int = 128
    layers: int = 2


class MLAAttention(nn.Module):
    """DeepSeek-style MLA with W_UK folded into the query and W_UV applied after attention."""

    def __init__(self, c: MLAConfig):
        super().__init__()
        self.c = c
        self.wq = nn.Linear(c.hidden, c.heads * (c.nope_dim + c.rope_dim), bias=False)
        self.wkv_a = nn.Linear(c.hidden, c.kv_lora_rank + c.rope_dim, bias=False)
        self.w_uk = nn.Parameter(torch.randn(c.heads, c.nope_dim, c.kv_lora_rank) * c.nope_dim ** -0.5)
        self.w_uv = nn.Parameter(torch.randn(c.heads, c.kv_lora_rank, c.v_dim) * c.kv_lora_rank ** -0.5)
        self.wo = nn.Linear(c.heads * c.v_dim, c.hidden, bias=False)
        self.softmax_scale = (c.nope_dim + c.rope_dim) ** -0.5

    def forward(self, x, cache: PagedLatentCache, layer: int, slots):
        c = self.c
        q_nope, q_pe = self.wq(x).view(-1, c.heads, c.nope_dim + c.rope_dim).split([c.nope_dim, c.rope_dim], -1)
        kv_c, k_pe = self.wkv_a(x).split([c.kv_lora_rank, c.rope_dim], -1)  # (rope rotation left out)
        cache.append(layer, kv_c, k_pe, slots)
        q_absorbed = torch.einsum("thn,hnl->thl", q_nope, self.w_uk)
        latent_out = cache.decode(layer, q_absorbed, q_pe.contiguous(), self.softmax_scale)
        return self.wo(torch.einsum("thl,hlv->thv", latent_out, self.w_uv).flatten(1))


class TinyMLAModel(nn.Module):
    def __init__(self, c: MLAConfig, vocab: int = 1000):
        super().__init__()
        self.embed = nn.Embedding(vocab, c.hidden)
        self.blocks = nn.ModuleList(MLAAttention(c) for _ in range(c.layers))
        self.head = nn.Linear(c.hidden, vocab, bias=False)

    def forward(self, tokens, cache, slots):
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            x = x + block(x, cache, i, slots)
        return self.head(x)


def prefill(model, cache, prompt):
    """Feed the prompt one position at a time (the point here is decode, not a prefill kernel)."""
    for t in range(prompt.shape[1]):
        logits = model(prompt[:, t], cache, cache.reserve(1))
    return logits.argmax(-1)


def decode_one_token(model, cache, token, slots):
    return model(token, cache, slots).argmax(-1)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--fmt", default="bf16", choices=["bf16", "fp16", "fp32", "fp8_e4m3", "fp8_ds_mla"])
    args = p.parse_args()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    cfg = MLAConfig()
    model = TinyMLAModel(cfg).to(args.device, dtype).eval()
    cache = PagedLatentCache.allocate(num_layers=cfg.layers, batch_size=args.batch, max_seq_len=256,
                                      kv_lora_rank=cfg.kv_lora_rank, rope_dim=cfg.rope_dim, page_size=64,
                                      fmt=args.fmt, kv_scale=0.05 if args.fmt == "fp8_e4m3" else 1.0,
                                      device=args.device)
    prompt = torch.randint(0, 1000, (args.batch, 8), device=args.device)
    step = torch.compile(decode_one_token, fullgraph=True)
    with torch.no_grad():
        token = prefill(model, cache, prompt)
        token = step(model, cache, token, cache.reserve(1))  # compiles
        start, generated = time.perf_counter(), [token]
        for _ in range(args.steps):
            token = step(model, cache, token, cache.reserve(1))
            generated.append(token)
        if args.device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    print(f"device={args.device} cache={args.fmt} batch={args.batch}: "
          f"{args.steps * args.batch / elapsed:.1f} tokens/s")
    q = torch.empty(args.batch, cfg.heads, cfg.kv_lora_rank, dtype=dtype, device=args.device)
    q_pe = torch.empty(args.batch, cfg.heads, cfg.rope_dim, dtype=dtype, device=args.device)
    chosen = mla_inductor.backend_for_call(q, q_pe, cache.kv_caches[0], cache.block_table, cache.seq_lens,
                                           cfg.nope_dim ** -0.5, cache.kv_scale)
    print(f"mla.paged_decode on {cache.format} cache, {cfg.heads} heads -> {chosen.backend}")
    print("tokens of sequence 0:", torch.stack(generated, 1)[0].tolist())


if __name__ == "__main__":
    main()
