"""Greedy generation with a Hugging Face DeepSeek-V3 decoding through ``torch.ops.mla.paged_decode``.

    python examples/deepseek_generate.py [--device cuda] [--fmt bf16|fp8_e4m3|fp8_ds_mla] [--steps 32]

Builds a small random-weight ``DeepseekV3ForCausalLM`` from a config (no hub access; needs
``pip install 'transformers>=5'``), patches it onto a paged latent cache, compiles the decode step
(``torch.compile(decode_one_token, fullgraph=True)``, CUDA graphs on GPU) and generates for a
left-padded batch. Prints tokens/s and the kernel the Inductor pass chose. CPU fp32 by default, CUDA bf16
when asked (``--device cuda``). On GPU the real attention dims (kv_lora_rank 512, rope 64) are used so
every cache format, ``fp8_ds_mla`` included, works.
"""

import argparse
import time

import torch

import mla_inductor.lowering  # registers torch.ops.mla.* and the Inductor pass
from mla_inductor import hf

# A few layers of DeepSeek-V3's shape, shrunk: layer 0 dense, layer 1 MoE, like the real model's first_k_dense.
SMALL_V3 = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=16, num_key_value_heads=16, q_lora_rank=96, kv_lora_rank=64, qk_rope_head_dim=32,
                qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, n_group=2, topk_group=1,
                num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=4096, pad_token_id=0,
                rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                     original_max_position_embeddings=1024, mscale=1.0, mscale_all_dim=1.0,
                                     beta_fast=32, beta_slow=1))
REAL_ATTENTION_DIMS = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)


def left_padded_batch(batch, length, vocab, device):
    """Prompts [batch, length] of decreasing real length, left-padded with 0, and their 0/1 mask."""
    ids = torch.randint(1, vocab, (batch, length), device=device)
    mask = torch.ones_like(ids)
    for b in range(batch):
        mask[b, : (b * length) // (2 * batch)] = 0
    return ids.masked_fill(mask == 0, 0), mask


def decode_n_tokens(model, cache, step, token, n):
    """n greedy decode steps from token [B]; returns the new tokens [B, n]."""
    out = []
    for _ in range(n):
        token = step(model, token, cache.reserve(1)).argmax(-1)
        out.append(token)
    return torch.stack(out, 1)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--fmt", default=None, help="cache format: fp32/bf16/fp8_e4m3/fp8_ds_mla (default: model dtype)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=32)
    args = p.parse_args()
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    config = dict(SMALL_V3, **REAL_ATTENTION_DIMS) if cuda else SMALL_V3

    model = hf.build_random_deepseek("v3", dtype=dtype, device=args.device, seed=0, **config)
    cache = hf.allocate_cache(model, batch_size=args.batch, max_seq_len=args.prompt_len + args.steps + 1,
                              fmt=args.fmt, page_size=64 if cuda else 16)
    hf.patch_deepseek(model, cache)
    # gpt-fast style: only the per-token step is compiled; reserve() (host-side page allocation) stays outside.
    step = torch.compile(hf.decode_one_token, fullgraph=True, mode="reduce-overhead" if cuda else None)
    prompt, mask = left_padded_batch(args.batch, args.prompt_len, config["vocab_size"], args.device)

    with torch.no_grad():
        token = hf.prefill(model, prompt, mask).argmax(-1)
        t0 = time.perf_counter()
        decode_n_tokens(model, cache, step, token, 2)  # compile + warm up (CUDA graph capture)
        compile_s = time.perf_counter() - t0
        cache.reset()
        token = hf.prefill(model, prompt, mask).argmax(-1)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        generated = decode_n_tokens(model, cache, step, token, args.steps)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0

    print(f"DeepSeek-V3 (random weights, {config['num_hidden_layers']} layers, {config['num_attention_heads']} heads, "
          f"L={config['kv_lora_rank']}, R={config['qk_rope_head_dim']}) on {args.device}, {cache.format} cache, "
          f"batch {args.batch}: {args.steps * args.batch / elapsed:.1f} tokens/s "
          f"({1e3 * elapsed / args.steps:.2f} ms/step; compile + warm-up {compile_s:.1f} s)")
    heads, L, R = config["num_attention_heads"], config["kv_lora_rank"], config["qk_rope_head_dim"]
    q_nope = torch.empty(args.batch, heads, L, dtype=dtype, device=args.device)
    q_pe = torch.empty(args.batch, heads, R, dtype=dtype, device=args.device)
    chosen = mla_inductor.backend_for_call(q_nope, q_pe, cache.kv_caches[0], cache.block_table, cache.seq_lens,
                                           1.0, cache.kv_scale)
    print(f"mla.paged_decode on {cache.format} cache, {heads} heads -> {chosen.backend}")
    print("tokens of sequence 0:", torch.cat([token[:1, None], generated[:1]], 1)[0].tolist())


if __name__ == "__main__":
    main()
