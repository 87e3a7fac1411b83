"""Hugging Face DeepSeek-V2/V3 decoding on ``torch.ops.mla.paged_decode`` and a paged latent cache.

    import mla_inductor.lowering
    from mla_inductor import hf

    model = DeepseekV3ForCausalLM(config)                      # transformers >= 5, any dtype/device
    cache = hf.allocate_cache(model, batch_size=4, max_seq_len=1024, fmt="bf16")
    hf.patch_deepseek(model, cache)                            # in place; returns the model
    step = torch.compile(hf.decode_one_token, fullgraph=True)
    tokens = hf.generate(model, input_ids, attention_mask, max_new_tokens=32, decode_step=step)

``patch_deepseek`` splits each layer's ``kv_b_proj`` once into W_UK [H, nope, L] (folded into the
query) and W_UV [H, L, v] (applied to the attention output), and gives each attention module a second
path: called with ``mla_slot_mapping`` (as ``prefill``/``decode_one_token`` do) it appends the new
tokens' normalised latent and rotated rope key with ``mla.cache_append`` and attends with
``mla.paged_decode`` (Q new tokens per sequence, causal), softmax scale = the module's yarn-aware
``scaling``. Called without it (HF's ``forward``/``generate``) the module runs HF's original code, so a
patched model still answers exactly like an unpatched one there.

Padding: batches are left-padded (HF's convention for decoder-only generation). Pad tokens are never
written to the cache (slot -1), each sequence keeps its own length, and its real tokens sit at
positions 0, 1, ... like HF's ``attention_mask.cumsum(-1) - 1``; a pad row of the prefill sits at a
negative position, attends to nothing and is ignored.

transformers is needed only to build models (``build_random_deepseek``); it is imported lazily.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from mla_inductor.cache import PagedLatentCache

__all__ = [
    "allocate_cache",
    "build_random_deepseek",
    "decode_one_token",
    "generate",
    "patch_deepseek",
    "prefill",
]

SUPPORTED_MODELS = {"DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV2ForCausalLM": "deepseek_v2"}
# Rope types whose inv_freq never changes with the sequence length (dynamic/longrope rewrite it per call).
_STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


def _require_transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "mla_inductor.hf needs Hugging Face transformers >= 5 for this: pip install 'transformers>=5' "
            "(or pip install 'mla-inductor[hf]')"
        ) from e
    return transformers


@dataclass
class _PagedState:
    """What every patched attention module of one model shares: the cache to decode on."""

    cache: PagedLatentCache


# --------------------------------------------------------------------------------------------------------
# Patching


def _check_model(model: nn.Module) -> None:
    name = type(model).__name__
    if name not in SUPPORTED_MODELS:
        raise TypeError(
            f"patch_deepseek supports {', '.join(SUPPORTED_MODELS)} (transformers >= 5), got {name}"
            f" ({type(model).__module__}); for the base model or another head, patch the *ForCausalLM"
        )
    config = model.config
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type not in _STATIC_ROPE_TYPES:
        raise NotImplementedError(
            f"patch_deepseek: rope_type {rope_type!r} changes its frequencies with the sequence length; "
            f"supported: {', '.join(_STATIC_ROPE_TYPES)}"
        )
    dtype = model.lm_head.weight.dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"patch_deepseek: the model must be float32, float16 or bfloat16, got {dtype}")


def _check_cache(model: nn.Module, cache: PagedLatentCache) -> None:
    config = model.config
    want = (config.num_hidden_layers, config.kv_lora_rank, config.qk_rope_head_dim)
    got = (len(cache.kv_caches), cache.kv_lora_rank, cache.rope_dim)
    if got != want:
        raise ValueError(f"patch_deepseek: the cache has (layers, kv_lora_rank, rope_dim) = {got}, the model "
                         f"needs {want}; make it with mla_inductor.hf.allocate_cache(model, ...)")
    device = model.lm_head.weight.device
    if cache.block_table.device != device:
        raise ValueError(f"patch_deepseek: the cache is on {cache.block_table.device}, the model on {device}")


def _absorb(attn: nn.Module) -> None:
    """Split ``kv_b_proj`` [H*(nope+v), L] into W_UK [H, nope, L] and W_UV [H, L, v] buffers.

    Laid out for ``bmm`` over heads: q_nope [H, T, nope] @ W_UK -> [H, T, L] and
    latent_out [H, T, L] @ W_UV -> [H, T, v]. Buffers (not plain attributes) so that torch.compile treats
    them as static weights, which CUDA graphs need to avoid copying them every replay.
    """
    H, nope, v = attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim
    w = attn.kv_b_proj.weight.detach().view(H, nope + v, attn.kv_lora_rank)
    attn.register_buffer("mla_w_uk", w[:, :nope, :].contiguous(), persistent=False)
    attn.register_buffer("mla_w_uv", w[:, nope:, :].transpose(1, 2).contiguous(), persistent=False)


def patch_deepseek(model: nn.Module, cache: PagedLatentCache) -> nn.Module:
    """Make an HF ``DeepseekV3ForCausalLM`` / ``DeepseekV2ForCausalLM`` decode through ``cache`` and
    ``torch.ops.mla.paged_decode``; patches the instance in place and returns it.

    ``cache``: a ``PagedLatentCache`` with one layer per decoder layer, ``kv_lora_rank`` L and
    ``rope_dim`` = ``qk_rope_head_dim`` R, on the model's device (``allocate_cache(model, ...)``), whose
    batch size is the batch ``prefill``/``decode_one_token`` will see. Patching an already patched model
    only swaps the cache. Move/cast the model before patching: the absorbed weights are copies.
    """
    _check_model(model)
    _check_cache(model, cache)
    state = getattr(model, "mla_state", None)
    if isinstance(state, _PagedState):
        state.cache = cache
        return model
    state = _PagedState(cache)
    for layer in model.model.layers:
        attn = layer.self_attn
        _absorb(attn)
        attn.mla_state = state
        attn.mla_hf_forward = attn.forward  # HF's own bound forward, for calls without mla_slot_mapping
        attn.forward = types.MethodType(_attention_forward, attn)
    model.mla_state = state
    return model


def allocate_cache(
    model: nn.Module,
    *,
    batch_size: int,
    max_seq_len: int,
    fmt: Optional[str] = None,
    page_size: int = 64,
    kv_scale: float = 1.0,
    num_pages: Optional[int] = None,
) -> PagedLatentCache:
    """A ``PagedLatentCache`` sized for ``model``'s layers and MLA dims on its device.

    ``fmt`` defaults to the model's dtype (``"fp32"``/``"fp16"``/``"bf16"``); ``"fp8_e4m3"`` uses
    ``kv_scale``; ``"fp8_ds_mla"`` needs kv_lora_rank 512 and rope 64 (DeepSeek-V3's dims).
    """
    config = model.config
    weight = model.lm_head.weight
    fmt = fmt or {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[weight.dtype]
    return PagedLatentCache.allocate(
        num_layers=config.num_hidden_layers, batch_size=batch_size, max_seq_len=max_seq_len,
        kv_lora_rank=config.kv_lora_rank, rope_dim=config.qk_rope_head_dim, page_size=page_size, fmt=fmt,
        num_pages=num_pages, kv_scale=kv_scale, device=weight.device,
    )


# --------------------------------------------------------------------------------------------------------
# The patched attention


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rope on x [..., R] with cos/sin [..., R/2] (broadcast), computed in fp32, returned in x's dtype.

    DeepSeek pairs dims (2i, 2i+1) (``interleaved``) or (i, i+R/2). Both layouts come out as
    [first of each pair | second of each pair]: q and k get the same permutation, so q·k is unchanged
    and the cache only ever meets keys in this layout.
    """
    half = x.shape[-1] // 2
    xf = x.float()
    a, b = (xf[..., 0::2], xf[..., 1::2]) if interleaved else (xf[..., :half], xf[..., half:])
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


def _attention_forward(self, hidden_states, *args, mla_slot_mapping=None, mla_rope=None, **kwargs):
    """Patched ``Deepseek{V2,V3}Attention.forward``: hidden_states [B, Q, D] -> ([B, Q, D], None).

    With ``mla_slot_mapping`` [B*Q] int32 (slot per new token, -1 = pad, not written) and ``mla_rope``
    (cos, sin) each [B, Q, R/2] fp32: the paged path. Without: HF's original forward.
    """
    if mla_slot_mapping is None:
        return self.mla_hf_forward(hidden_states, *args, **kwargs)
    cache = self.mla_state.cache
    B, Q, _ = hidden_states.shape
    T, H = B * Q, self.num_heads
    if self.q_lora_rank is None:
        q = self.q_proj(hidden_states)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q_nope, q_pe = q.view(T, H, self.qk_head_dim).split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    kv_c, k_pe = self.kv_a_proj_with_mqa(hidden_states).view(T, -1).split(
        [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    kv_c = self.kv_a_layernorm(kv_c)

    cos, sin = (t.reshape(T, 1, -1) for t in mla_rope)
    # V2 has no rope_interleave attribute: it always pairs adjacent dims (its rope is complex-valued).
    interleaved = getattr(self.config, "rope_interleave", True)
    q_pe = _rotate(q_pe, cos, sin, interleaved)
    k_pe = _rotate(k_pe, cos[:, 0], sin[:, 0], interleaved)

    layer = self.layer_idx
    cache.append(layer, kv_c, k_pe, mla_slot_mapping)
    q_absorbed = torch.bmm(q_nope.transpose(0, 1), self.mla_w_uk).transpose(0, 1)  # [T, H, L], last dim unit
    latent_out = cache.decode(layer, q_absorbed, q_pe, float(self.scaling))  # [T, H, L]
    out = torch.bmm(latent_out.transpose(0, 1), self.mla_w_uv)  # [H, T, v]
    out = out.transpose(0, 1).reshape(B, Q, H * self.v_head_dim)
    return self.o_proj(out), None


# --------------------------------------------------------------------------------------------------------
# Driving the patched model (gpt-fast style phases)


def _state(model: nn.Module) -> _PagedState:
    state = getattr(model, "mla_state", None)
    if not isinstance(state, _PagedState):
        raise RuntimeError("this model is not patched: call mla_inductor.hf.patch_deepseek(model, cache) first")
    return state


def forward_paged(model: nn.Module, input_ids: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Run Q new tokens per sequence through the patched model; returns the last row's logits [B, V].

    input_ids [B, Q] (pads allowed on the left), slot_mapping [B*Q] int32 (from ``cache.reserve``; -1 for
    pads). The cache's ``seq_lens`` must already count the new tokens (``reserve`` does that): the new
    row j of sequence b sits at position ``seq_lens[b] - Q + j``, read on the device, so a compiled step
    never syncs with the host.
    """
    inner = model.model
    cache = model.mla_state.cache
    B, Q = input_ids.shape
    positions = cache.seq_lens[:, None] - Q + torch.arange(Q, device=input_ids.device, dtype=torch.int32)
    rotary = inner.rotary_emb
    # HF's rope, read off its module: yarn/linear frequencies and the yarn attention factor (mscale of cos/sin).
    freqs = positions.clamp_min(0)[..., None].float() * rotary.inv_freq.float()  # [B, Q, R/2]
    scale = rotary.attention_scaling
    rope = (freqs.cos() * scale, freqs.sin() * scale)
    x = inner.embed_tokens(input_ids)
    for layer in inner.layers:
        x = layer(x, mla_slot_mapping=slot_mapping, mla_rope=rope)
    x = inner.norm(x[:, -1])
    return model.lm_head(x)


def _left_padding_counts(attention_mask: torch.Tensor) -> list[int]:
    mask = attention_mask.bool().cpu()
    counts = mask.sum(-1)
    S = mask.shape[1]
    expected = torch.arange(S)[None, :] >= (S - counts)[:, None]
    if not torch.equal(mask, expected):
        raise ValueError("attention_mask must be left-padded (zeros, then ones, per row), as HF generation "
                         "uses for decoder-only models")
    return counts.tolist()


@torch.no_grad()
def prefill(model: nn.Module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Append a (left-padded) prompt batch to the cache through the op (Q = S rows per sequence, causal).

    input_ids [B, S], attention_mask [B, S] of 0/1 (None = no padding). Returns the logits [B, V] of
    each sequence's last token. Pads get slot -1: never written, never attended.
    """
    cache = _state(model).cache
    B, S = input_ids.shape
    if B != cache.batch_size:
        raise ValueError(f"prefill: input_ids has batch {B}, the cache was allocated for {cache.batch_size}")
    if attention_mask is None:
        slots = cache.reserve(S)
    else:
        counts = _left_padding_counts(attention_mask)
        real = cache.reserve(counts)
        slots = torch.full((B, S), -1, dtype=torch.int32, device=input_ids.device)
        # Row-major order of the real positions = reserve's sequence-major order of the new slots.
        slots[attention_mask.bool()] = real
        slots = slots.flatten()
    return forward_paged(model, input_ids, slots)


def decode_one_token(model: nn.Module, tokens: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """One decode step: tokens [B] (int64), slot_mapping [B] int32 from ``cache.reserve(1)`` -> logits [B, V].

    The function to ``torch.compile(..., fullgraph=True)`` (or ``mode="reduce-overhead"`` on GPU): the
    host-side page allocation (``reserve``) stays outside it, and lengths are read from the cache's
    device tensors, which are updated in place.
    """
    return forward_paged(model, tokens[:, None], slot_mapping)


@torch.no_grad()
def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    max_new_tokens: int,
    decode_step: Optional[Callable] = None,
) -> torch.Tensor:
    """Greedy generation on the patched model: [B, S] prompt -> [B, S + max_new_tokens] tokens.

    Like HF's ``generate(do_sample=False)`` with no stop token. Starts from an empty cache for every
    sequence. ``decode_step`` replaces ``decode_one_token`` (e.g. its compiled version).
    """
    cache = _state(model).cache
    step = decode_step or decode_one_token
    cache.reset()
    token = prefill(model, input_ids, attention_mask).argmax(-1)
    out = [input_ids, token[:, None]]
    for _ in range(max_new_tokens - 1):
        token = step(model, token, cache.reserve(1)).argmax(-1)
        out.append(token[:, None])
    return torch.cat(out, dim=1)


# --------------------------------------------------------------------------------------------------------
# Random-weight models (examples, tests, benchmarks; no hub access)


def build_random_deepseek(
    version: str = "v3",
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    attn_implementation: str = "sdpa",
    **config_overrides,
) -> nn.Module:
    """A randomly initialised ``DeepseekV{2,3}ForCausalLM`` from its config class's defaults plus
    ``config_overrides`` (e.g. num_hidden_layers=2, hidden_size=256, ...), in eval mode.

    The defaults are the real model's sizes: override them for anything small.
    """
    transformers = _require_transformers()
    classes = {
        "v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
        "v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
    }
    if version not in classes:
        raise ValueError(f"version must be 'v2' or 'v3', got {version!r}")
    config_cls, model_cls = classes[version]
    config = config_cls(**config_overrides)
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(config)
    return model.to(dtype).eval()
