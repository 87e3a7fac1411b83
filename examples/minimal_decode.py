"""MLA decode in vanilla PyTorch: one ``torch.ops.mla.paged_decode`` call, then a small model on a paged latent cache.

    python examples/minimal_decode.py [--device cuda] [--steps 32] [--fmt bf16|fp8_e4m3|fp8_ds_mla]

``one_call`` is the README's opening snippet with its inputs made: a batch of absorbed queries against a paged
latent cache, called eagerly and through ``torch.compile`` (which turns the call into the best kernel for the
device; plain Inductor code from the reference on CPU), checked against the reference. ``TinyMLAModel`` then
decodes a few tokens with a hand-written attention block that calls the op. Random weights; no hub access.
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


def one_call(device: str) -> None:
    """The README's opening snippet, its inputs made (on CPU exactly as written there), run eagerly and compiled."""
    B, H, L, R, page_size = 4, 16, 512, 64, 64  # sequences, heads, kv_lora_rank, rope dim, tokens per page
    seq_lens = torch.tensor([300, 17, 1024, 64], dtype=torch.int32)         # tokens cached per sequence
    block_table = torch.arange(B * 16, dtype=torch.int32).view(B, 16)       # the pages of each sequence
    kv_cache = torch.randn(B * 16, page_size, L + R, dtype=torch.bfloat16)  # [pages, page_size, latent | rope]
    q_nope = torch.randn(B, H, L, dtype=torch.bfloat16)                     # the absorbed query (W_UK folded in)
    q_pe = torch.randn(B, H, R, dtype=torch.bfloat16)                       # its rope part
    softmax_scale, kv_scale = (128 + 64) ** -0.5, torch.ones(1)             # kv_scale: float32 [1], 1.0 unless fp8

    seq_lens, block_table, kv_cache, q_nope, q_pe, kv_scale = (
        t.to(device) for t in (seq_lens, block_table, kv_cache, q_nope, q_pe, kv_scale))
    out = torch.ops.mla.paged_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale)

    compiled = torch.compile(lambda *args: torch.ops.mla.paged_decode(*args), fullgraph=True)
    out_compiled = compiled(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale)
    want, _ = mla_inductor.paged_decode_reference(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale,
                                                  kv_scale)
    error = max((o.float() - want.float()).abs().max().item() for o in (out, out_compiled))
    print(f"one mla.paged_decode call: out {tuple(out.shape)} {out.dtype}, eager and compiled within {error:.1e} "
          f"of the reference")
    if error > 2e-2:  # bf16 output: about 3 significant digits
        raise SystemExit(f"mla.paged_decode differs from the reference by {error}")


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
    one_call(args.device)
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
    how = " (the reference decode compiled by Inductor into C++ for the CPU)" if chosen.backend == "reference" and \
        args.device == "cpu" else ""
    print(f"mla.paged_decode on {cache.format} cache, {cfg.heads} heads -> {chosen.backend}{how}")
    print("tokens of sequence 0:", torch.stack(generated, 1)[0].tolist())


if __name__ == "__main__":
    main()
