"""A Hugging Face DeepSeek-V3 split over processes: tensor parallel attention, optionally with decode context
parallelism, generating the same tokens as one process.

    torchrun --nproc-per-node 2 examples/deepseek_tp.py [--dcp 1|2] [--fmt bf16|fp8_e4m3] [--dtype bf16|fp32] [--steps 16]

Every process builds the same small random-weight model (no hub access; needs ``pip install
'transformers>=5'``), keeps H / world heads of each attention layer (``shard_deepseek_attention_tp``:
projections split by heads, an all-reduce after o_proj) and decodes on a paged latent cache: the whole
cache on every process (``--dcp 1``, ``hf.PagedMLACache``), or split by tokens over DCP groups of ``--dcp``
processes (``DCPMLACache``). Rank 0 also runs the unsplit model and reports whether the tokens and logits
agree.
NCCL and one GPU per process where CUDA is present, else gloo on CPU.
"""

import argparse
import time

import torch
import torch.distributed as dist

from mla_inductor import hf
from mla_inductor.distributed import make_dcp_group, shard_deepseek_attention_tp
from mla_inductor.testing import random_deepseek_model, relative_error

SMALL_V3 = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=16, num_key_value_heads=16, q_lora_rank=96, kv_lora_rank=64, qk_rope_head_dim=32,
                qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, n_group=2, topk_group=1,
                num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=4096, pad_token_id=0)
REAL_ATTENTION_DIMS = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)


def prefill_and_decode(model, cache, step, prompt, steps):
    """Greedy: the prompt, then ``steps`` tokens; returns (tokens [B, steps], the last logits [B, V])."""
    cache.reset()
    logits = hf.prefill(model, prompt, cache=cache)
    tokens = []
    for _ in range(steps):
        token = logits.argmax(-1)
        tokens.append(token)
        logits = step(model, token, cache)
    return torch.stack(tokens, 1), logits


def build_model(dtype, device, config):
    model = random_deepseek_model("v3", dtype=dtype, device=device, **config)
    model.set_attn_implementation(hf.register())
    return model


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dcp", type=int, default=1, help="DCP group size (divides the number of processes)")
    p.add_argument("--exchange", default="a2a", choices=["a2a", "ag_rs"])
    p.add_argument("--fmt", default=None, help="cache format: bf16/fp32/fp8_e4m3/fp8_ds_mla (default: model dtype)")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"],
                   help="model dtype (default: bf16 on GPUs, fp32 on CPU)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=16)
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{rank % torch.cuda.device_count()}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(args.dtype, torch.bfloat16 if cuda else torch.float32)
    config = dict(SMALL_V3, **REAL_ATTENTION_DIMS) if cuda else SMALL_V3
    sizes = dict(batch_size=args.batch, max_seq_len=args.prompt_len + args.steps + 1, fmt=args.fmt,
                 page_size=64 if cuda else 16, kv_scale=0.05 if args.fmt == "fp8_e4m3" else 1.0)
    prompt = torch.randint(1, config["vocab_size"], (args.batch, args.prompt_len),
                           generator=torch.Generator().manual_seed(0)).to(device)

    model = shard_deepseek_attention_tp(build_model(dtype, device, config), dist.group.WORLD)
    if args.dcp == 1:
        cache = hf.PagedMLACache(model, **sizes)
    else:
        # page_size: tokens per page on each process (64 on GPUs: FlashMLA's page).
        cache = hf.DCPMLACache(model, make_dcp_group(args.dcp, interleave=1, exchange=args.exchange), **sizes)
    step = torch.compile(hf.decode_one_token, fullgraph=True)

    with torch.no_grad():
        prefill_and_decode(model, cache, step, prompt, 2)  # compile, warm up
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        tokens, logits = prefill_and_decode(model, cache, step, prompt, args.steps)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        if rank == 0:
            whole = build_model(dtype, device, config)
            whole_cache = hf.PagedMLACache(whole, **sizes)
            want_tokens, want_logits = prefill_and_decode(whole, whole_cache, hf.decode_one_token, prompt, args.steps)
            same = int((tokens == want_tokens).sum())
            print(f"TP={world} DCP={args.dcp} ({dist.get_backend()}, {cache.kv_caches[0].dtype} cache): "
                  f"{args.batch * args.steps / seconds:.1f} tokens/s; {same}/{tokens.numel()} tokens as one process, "
                  f"last logits off by {relative_error(logits.float(), want_logits.float()):.1e}")
            print("first sequence ->", tokens[0].tolist())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
