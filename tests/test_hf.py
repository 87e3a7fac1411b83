"""HF DeepSeek-V2/V3 on the op: the patched model generates exactly what HF's own ``generate`` does.

Small random-weight models (no hub); CPU fp32 for token identity, GPU bf16/fp8 for tolerance and top-1
agreement.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="tests/test_hf.py needs transformers>=5 "
                                   "(pip install 'transformers>=5')")

import mla_inductor.lowering  # noqa: E402,F401  (installs the pass the compiled tests go through)
from mla_inductor import hf  # noqa: E402

if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip(f"tests/test_hf.py needs transformers>=5, found {transformers.__version__}", allow_module_level=True)

VOCAB = 512
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
            qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
            max_position_embeddings=256, pad_token_id=0)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, beta_fast=32,
            beta_slow=1)
CONFIGS = {
    # DeepSeek-V3-like: q_lora, MoE after one dense layer, yarn with mscale_all_dim (scaling != 1/sqrt(d)).
    "v3_yarn": ("v3", dict(BASE, n_group=2, topk_group=1, rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=1.0))),
    # rope_interleave=False (rotate-half pairs), 128 heads, otherwise tiny.
    "v3_h128_plain": ("v3", dict(BASE, hidden_size=128, num_attention_heads=128, num_key_value_heads=128,
                                 qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, kv_lora_rank=16,
                                 n_group=2, topk_group=1, rope_interleave=False)),
    # DeepSeek-V2-Lite-like: no q_lora (q_proj), yarn whose attention factor scales cos/sin (mscale != mscale_all_dim).
    "v2_yarn_no_qlora": ("v2", dict(BASE, q_lora_rank=None, rope_parameters=dict(YARN, mscale=0.707,
                                                                                   mscale_all_dim=1.0))),
    "v2_plain": ("v2", dict(BASE)),
}
NEW_TOKENS = 10


def make_model(name, dtype=torch.float32, device="cpu"):
    version, kw = CONFIGS[name]
    model = hf.build_random_deepseek(version, dtype=dtype, device=device, **kw)
    model.generation_config.eos_token_id = None  # fixed-length generation, like hf.generate
    return model


def left_padded_prompts(pad_lens=(0, 3, 5), length=8, seed=0, device="cpu"):
    """[B, length] prompts, row b left-padded with pad_lens[b] zeros, and the 0/1 attention mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(pad_lens), length), generator=g)
    mask = torch.ones_like(ids)
    for b, n in enumerate(pad_lens):
        mask[b, :n] = 0
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


def hf_generate(model, ids, mask, n=NEW_TOKENS):
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, pad_token_id=0)


def patched(model, batch, fmt=None, kv_scale=1.0, page_size=4):
    cache = hf.allocate_cache(model, batch_size=batch, max_seq_len=64, fmt=fmt, kv_scale=kv_scale,
                              page_size=page_size)
    return hf.patch_deepseek(model, cache)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_eager_greedy_matches_hf_generate(name):
    model = make_model(name)
    ids, mask = left_padded_prompts()
    want = hf_generate(model, ids, mask)
    patched(model, batch=3)
    got = hf.generate(model, ids, mask, max_new_tokens=NEW_TOKENS)
    assert torch.equal(got, want), f"{name}: patched\n{got[:, ids.shape[1]:]}\nHF\n{want[:, ids.shape[1]:]}"
    # Without the paged arguments the patched modules still run HF's own attention.
    assert torch.equal(hf_generate(model, ids, mask), want)


@pytest.mark.parametrize("name", ["v3_yarn", "v2_yarn_no_qlora"])
def test_compiled_decode_step_matches_hf_generate(name):
    torch._dynamo.reset()
    version, kw = CONFIGS[name]
    if version == "v2":
        kw = dict(kw, first_k_dense_replace=2)  # the MoE under compile is covered by v3; keeps CI time down
    model = hf.build_random_deepseek(version, **kw)
    model.generation_config.eos_token_id = None
    ids, mask = left_padded_prompts(pad_lens=(2, 0), seed=1)
    want = hf_generate(model, ids, mask)
    patched(model, batch=2)
    step = torch.compile(hf.decode_one_token, fullgraph=True)
    got = hf.generate(model, ids, mask, max_new_tokens=NEW_TOKENS, decode_step=step)
    assert torch.equal(got, want)


def test_prefill_logits_match_hf():
    model = make_model("v3_yarn")
    ids, mask = left_padded_prompts()
    want = model(ids, attention_mask=mask).logits[:, -1]
    patched(model, batch=3)
    got = hf.prefill(model, ids, mask)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # Pads are never written: each sequence holds exactly its real tokens.
    assert model.mla_state.cache.seq_lens.tolist() == mask.sum(-1).tolist()


def forced_logits(model, ids, mask, forced, step=hf.decode_one_token):
    """Logits [B, N, V] fp32 of each step when the patched model is fed ``forced`` [B, N] after the prompt."""
    cache = model.mla_state.cache
    cache.reset()
    out = [hf.prefill(model, ids, mask)]
    for k in range(forced.shape[1] - 1):
        out.append(step(model, forced[:, k], cache.reserve(1)))
    return torch.stack(out, 1).float()


def top1_agreement(model, prompts, fmt, batch, n, page_size, kv_scale=1.0, step=hf.decode_one_token):
    """Top-1 agreement of a ``fmt`` cache with the model's own dtype cache, teacher-forced on the latter's
    greedy tokens: (rate over all steps, rate over decisive steps, share of decisive steps).

    A random-weight model is nearly flat (median top-1/top-2 gap ~0.15 logit std), so some steps are
    near-ties that any rounding flips; "decisive" steps have a gap above 0.05 logit std.
    """
    patched(model, batch=batch, page_size=page_size)
    with torch.no_grad():
        refs = [hf.generate(model, ids, mask, max_new_tokens=n)[:, ids.shape[1]:] for ids, mask in prompts]
        want = torch.cat([forced_logits(model, ids, mask, r) for (ids, mask), r in zip(prompts, refs)])
        patched(model, batch=batch, fmt=fmt, page_size=page_size, kv_scale=kv_scale)
        got = torch.cat([forced_logits(model, ids, mask, r, step) for (ids, mask), r in zip(prompts, refs)])
    agree = got.argmax(-1) == want.argmax(-1)
    top2 = want.topk(2, dim=-1).values
    decisive = (top2[..., 0] - top2[..., 1]) > 0.05 * want.std(-1)
    return agree.float().mean().item(), agree[decisive].float().mean().item(), decisive.float().mean().item()


def test_fp8_e4m3_cache_top1_agreement_cpu():
    model = make_model("v3_yarn")
    prompts = [left_padded_prompts(pad_lens=(0, 4, 9, 2), length=16, seed=s) for s in range(2)]
    raw, decisive, share = top1_agreement(model, prompts, "fp8_e4m3", batch=4, n=12, page_size=16)
    print(f"\nfp8_e4m3 (CPU): top-1 agrees with fp32 on {raw:.1%} of steps, {decisive:.1%} of the {share:.0%} decisive")
    assert decisive >= 0.95 and raw >= 0.85, (raw, decisive)


def test_rejects_unsupported_models_and_right_padding():
    class LlamaForCausalLM(torch.nn.Module):
        pass

    with pytest.raises(TypeError, match="LlamaForCausalLM"):
        hf.patch_deepseek(LlamaForCausalLM(), cache=None)
    model = make_model("v2_plain")
    with pytest.raises(RuntimeError, match="not patched"):
        hf.prefill(model, *left_padded_prompts())
    patched(model, batch=2)
    ids = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="left-padded"):
        hf.prefill(model, ids, torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]))
    wrong = hf.allocate_cache(make_model("v3_h128_plain"), batch_size=2, max_seq_len=16)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        hf.patch_deepseek(model, wrong)


def test_transformers_imported_lazily_and_only_by_hf():
    code = "import sys, mla_inductor, mla_inductor.lowering, mla_inductor.hf; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    package = Path(hf.__file__).parent
    importers = [p.name for p in package.rglob("*.py") if p.name != "hf.py" and "transformers" in p.read_text()
                 and "import transformers" in p.read_text()]
    assert not importers, f"only mla_inductor/hf.py may import transformers, found {importers}"


# ---------------------------------------------------------------------------------------------------------- GPU

GPU_V3 = dict(BASE, hidden_size=256, intermediate_size=256, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32,
              v_head_dim=32, q_lora_rank=96, n_group=2, topk_group=1, vocab_size=VOCAB,
              rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=1.0))


def gpu_model():
    model = hf.build_random_deepseek("v3", dtype=torch.bfloat16, device="cuda", **GPU_V3)
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.gpu
def test_bf16_logits_close_to_hf_on_gpu():
    model = gpu_model()
    ids, mask = left_padded_prompts(device="cuda")
    with torch.no_grad():
        full = hf_generate(model, ids, mask)
        full_mask = torch.cat([mask, torch.ones_like(full[:, ids.shape[1]:])], 1)
        # HF's logits for every generated position, computed in one forward over the whole sequence.
        want = model(full, attention_mask=full_mask).logits[:, ids.shape[1] - 1:-1].float()
    patched(model, batch=3, page_size=64)
    with torch.no_grad():
        cache = model.mla_state.cache
        got = [hf.prefill(model, ids, mask)]
        for k in range(NEW_TOKENS - 1):
            got.append(hf.decode_one_token(model, full[:, ids.shape[1] + k], cache.reserve(1)))
    got = torch.stack(got, 1).float()
    err = ((got - want).norm() / want.norm()).item()
    assert err < 3e-2, f"bf16 logits relative error {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_ds_mla"])
def test_fp8_cache_top1_agrees_with_bf16_on_gpu(fmt):
    torch._dynamo.reset()
    model = gpu_model()
    prompts = [left_padded_prompts(pad_lens=(0, 4, 9, 2), length=16, seed=s, device="cuda") for s in range(4)]
    step = torch.compile(hf.decode_one_token, fullgraph=True)
    raw, decisive, share = top1_agreement(model, prompts, fmt, batch=4, n=16, page_size=64, step=step)
    print(f"\n{fmt} (GPU, compiled): top-1 agrees with bf16 on {raw:.1%} of steps, {decisive:.1%} of the "
          f"{share:.0%} decisive")
    assert decisive >= 0.95 and raw >= 0.85, (raw, decisive)
