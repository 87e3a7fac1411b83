"""Everything of ``mla_inductor.hf`` that imports transformers: the ``Cache`` subclass over the paged latent
cache, the attention and mask functions registered under ``"mla_inductor"``, and the table of model types
whose attention they serve. Only ``mla_inductor.hf`` imports this module (lazily); kernels never do.

How a DeepSeek-style attention of transformers 5.23 meets us (``DeepseekV3Attention.forward``):

1. it projects the new tokens' latent ``kv_nope`` [B, 1, Q, L] (normalised) and rope key ``k_rot``
   [B, 1, Q, R] (rope applied) and calls ``past_key_values.update(kv_nope, k_rot, layer_idx)``;
2. it expands whatever ``update`` returns through ``kv_b_proj`` into keys [B, H, S, nope+R] and values
   [B, H, S, v] (an empty return cannot be expanded: ``view(..., -1, ...)`` of zero elements fails);
3. it calls the attention function registered under ``config._attn_implementation`` with the module (its
   ``layer_idx``, ``kv_b_proj``, dims), the query [B, H, Q, nope+R] (rope applied, not absorbed), those
   keys/values, the mask built by the registered mask function, and ``scaling`` (yarn-aware).

``PagedMLACache.update`` hands the new latents to the attention function of the same layer (through the
link below) and returns them unchanged, so HF expands only the new tokens. The attention function writes
them into the paged cache with ``mla.cache_append`` (it alone knows which new tokens are padding: the
mask says so) and then either

- runs ordinary attention on the expanded new tokens, for the first forward on an empty cache (a prompt:
  ordinary attention costs less than the absorbed form there): ``mla.prefill_attention`` (FlashInfer's
  prefill kernel where it takes the call, torch's sdpa otherwise) when no token is padding, HF's own sdpa
  with the mask for a padded batch, or
- absorbs the query (W_UK from ``kv_b_proj``), calls ``mla.paged_decode`` over the whole paged cache and
  applies W_UV: decode steps and any chunk appended to a filled cache. The expansion HF made from the
  returned latents is then unused (dead code under ``torch.compile``).

The link: an attention function receives the module but not the cache, so the MLA attention modules of a
model share one small ``_ModelLink`` (attribute ``_mla_inductor_link``) that names the cache of the
forward in progress; that cache holds each layer's new latents until its attention takes them. No forward
of any module is replaced.

Host work per compiled step: torch.compile replays every Python attribute a step writes after its graph
runs (on GPU, before the next step can start: ``generate`` waits for the device every step). What a
forward writes is therefore a fixed handful of attributes and one dict (the latents in flight, empty
again when the forward ends), however many layers the model has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import transformers
from torch import nn
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from mla_inductor._compat import argument_errors_reach_the_user, mark_static_address
from mla_inductor.cache import (HOST_LENGTHS, PagedLatentCache, capacity_message, check_cache_positions,
                                check_cache_step)
from mla_inductor.contract import being_captured
from mla_inductor.prefill import prefill_attention

ATTN_IMPLEMENTATION = "mla_inductor"
_LINK_ATTR = "_mla_inductor_link"
_FORMAT_OF_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


# --------------------------------------------------------------------------------------------------------
# Supported models


@dataclass(frozen=True)
class ModelSupport:
    """A ``config.model_type`` whose attention caches the MLA latent and calls the attention interface.
    ``sparse``: DeepSeek sparse attention (DSA), an indexer picks each query's top-k keys."""

    causal_lm: str
    models: str
    sparse: bool = False


SUPPORTED_MODEL_TYPES: dict[str, ModelSupport] = {
    "deepseek_v2": ModelSupport("DeepseekV2ForCausalLM", "DeepSeek-V2, V2-Lite, V2.5"),
    "deepseek_v3": ModelSupport("DeepseekV3ForCausalLM",
                                "DeepSeek-V3, R1; Kimi-K2 and Kimi-K2.5's text model (loaded as deepseek_v3)"),
    "glm4_moe_lite": ModelSupport("Glm4MoeLiteForCausalLM", "GLM-4.7-Flash"),
    "mistral4": ModelSupport("Mistral4ForCausalLM", "Mistral 4 (MLA with llama-4 query scaling)"),
    "longcat_flash": ModelSupport("LongcatFlashForCausalLM", "LongCat-Flash (two MLA sublayers per layer)"),
    "youtu": ModelSupport("YoutuForCausalLM", "Youtu-LLM"),
    "minicpm3": ModelSupport("MiniCPM3ForCausalLM", "MiniCPM3 (rotate-half rope)"),
    "axk1": ModelSupport("AXK1ForCausalLM", "A.X K1"),
    "deepseek_v32": ModelSupport("DeepseekV32ForCausalLM", "DeepSeek-V3.2 (DSA top-k)", sparse=True),
    "glm_moe_dsa": ModelSupport("GlmMoeDsaForCausalLM", "GLM-5 (DSA top-k, shared indexer layers)", sparse=True),
}


def text_config(model: nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_model(model: nn.Module) -> ModelSupport:
    """The table entry of ``model``'s type, or a ``TypeError`` naming the supported ones."""
    model_type = getattr(text_config(model), "model_type", None)
    support = SUPPORTED_MODEL_TYPES.get(model_type)
    if support is None:
        raise TypeError(
            f"mla_inductor.hf supports model types {', '.join(sorted(SUPPORTED_MODEL_TYPES))}, got "
            f"{model_type!r} ({type(model).__name__})"
        )
    return support


def mla_attention_modules(model: nn.Module) -> dict[int, nn.Module]:
    """The model's MLA attention modules by the cache layer index they pass to ``update``."""
    check_model(model)
    found = {}
    for module in model.modules():
        if hasattr(module, "kv_b_proj") and hasattr(module, "layer_idx") and hasattr(module, "kv_lora_rank"):
            if module.layer_idx in found:
                raise ValueError(f"two MLA attention modules share layer_idx {module.layer_idx}")
            found[module.layer_idx] = module
    if not found:
        raise TypeError(f"{type(model).__name__} has no MLA attention module (one with kv_b_proj and layer_idx)")
    return dict(sorted(found.items()))


def _check_dims(modules: dict[int, nn.Module]) -> tuple[int, int]:
    dims = {(m.kv_lora_rank, m.qk_rope_head_dim) for m in modules.values()}
    if len(dims) != 1:
        raise ValueError(f"all MLA layers must share (kv_lora_rank, qk_rope_head_dim), got {sorted(dims)}")
    for i, m in modules.items():
        H, nope, v, L = m.num_heads, m.qk_nope_head_dim, m.v_head_dim, m.kv_lora_rank
        w = m.kv_b_proj.weight
        if tuple(w.shape) != (H * (nope + v), L) or w.dtype not in _FORMAT_OF_DTYPE:
            raise TypeError(
                f"layer {i}: kv_b_proj.weight must be a float32/float16/bfloat16 [H*(nope+v), L] = "
                f"[{H * (nope + v)}, {L}] matrix, got {w.dtype} {tuple(w.shape)} (quantized kv_b_proj is not supported)"
            )
    return dims.pop()


# --------------------------------------------------------------------------------------------------------
# The link between a cache's update() and the attention function of the same layer


class _ModelLink:
    """Shared by the MLA attention modules of one model: the ``PagedMLACache`` of the forward in progress
    (set by its first layer's ``update``, cleared by its last layer's attention, so no cache outlives its
    forward through the model), or None. A plain attribute, so torch.compile traces the hand-over as an
    ordinary Python side effect, one per forward."""

    def __init__(self, config):
        self.config = config
        self.cache: Optional[PagedMLACache] = None


def _link_of(modules: dict[int, nn.Module]) -> _ModelLink:
    """The model's link, made and given to every MLA attention module on first use."""
    found = {id(link): link for m in modules.values() if (link := m.__dict__.get(_LINK_ATTR)) is not None}
    link = next(iter(found.values())) if len(found) == 1 else _ModelLink(next(iter(modules.values())).config)
    for module in modules.values():
        module.__dict__[_LINK_ATTR] = link
    return link


# --------------------------------------------------------------------------------------------------------
# The cache


class _PagedLayer:
    """What HF's ``Cache`` base reads of each layer; the data lives in the shared paged cache."""

    is_compileable = True
    is_croppable = True
    is_sliding = False
    supports_early_init = False
    is_initialized = True


def _paged_attribute(name: str, doc: str) -> property:
    """A read-only property of ``PagedMLACache`` that is the paged latent cache's attribute ``name``."""
    return property(lambda self: getattr(self._paged, name), doc=doc)


class PagedMLACache(Cache):
    """A transformers ``Cache`` over a paged MLA latent cache, for ``model.generate(cache=...)``
    (``past_key_values=`` in transformers 5.23; ``hf.cache_kwargs(cache)`` names it for the installed release).

        cache = PagedMLACache(model, batch_size=4, max_seq_len=4096, fmt="bf16")   # after model.to(...)
        model.set_attn_implementation("mla_inductor")
        out = model.generate(input_ids, attention_mask=mask, cache=cache, max_new_tokens=64)

    Holds ``batch_size`` sequences of up to ``max_seq_len`` real tokens each (pads of a left-padded prompt
    are never stored). ``fmt``: ``fp32``/``fp16``/``bf16`` (default: the model's dtype), ``fp8_e4m3``
    (per-tensor ``kv_scale``) or ``fp8_ds_mla`` (kv_lora_rank 512, rope 64). Every sequence owns its pages
    from the start and its length lives on the device, so a decode step has no host work and captures in
    a CUDA graph (``is_compileable``: ``generate`` compiles its decode step on GPU).

    Lengths: ``seq_lens`` [B] int32 counts each sequence's real tokens; ``get_seq_length()`` counts the
    input columns seen (pads included), as HF's own caches do, as a 0-d device tensor like ``StaticCache``.

    DSA models (DeepSeek-V3.2, GLM-5): the indexer's keys are kept for every column (a static buffer, as
    in HF's ``StaticIndexedLayer``), the mask spans ``max_seq_len`` columns (pads included, so there
    ``max_seq_len`` bounds the prompt with its padding plus the new tokens), and the top-k columns each
    query gets become ``sparse_indices`` slots of ``mla.paged_decode``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        batch_size: int,
        max_seq_len: int,
        fmt: Optional[str] = None,
        page_size: int = 64,
        kv_scale: float = 1.0,
    ):
        register()
        support = check_model(model)
        modules = mla_attention_modules(model)
        kv_lora_rank, rope_dim = _check_dims(modules)
        weight = next(iter(modules.values())).kv_b_proj.weight
        num_layers = max(modules) + 1
        paged = PagedLatentCache.allocate(
            num_layers=num_layers, batch_size=batch_size, max_seq_len=max_seq_len, kv_lora_rank=kv_lora_rank,
            rope_dim=rope_dim, page_size=page_size, fmt=fmt or _FORMAT_OF_DTYPE[weight.dtype], kv_scale=kv_scale,
            device=weight.device,
        )
        # Every sequence owns ceil(max_seq_len / page_size) pages from the start; lengths are then counted on
        # the device only, so no step needs the host-side page allocator.
        paged.reserve(max_seq_len)
        paged.seq_lens.zero_()
        # The lengths then change inside compiled (CUDA-graph) steps, where no host copy can follow them:
        # a plan that needs them on the host copies them from the device.
        HOST_LENGTHS.forget(paged.seq_lens)
        super().__init__(layers=[_PagedLayer() for _ in range(num_layers)])
        self._paged = paged
        self.max_seq_len = max_seq_len
        # Columns seen (pads included): changes inside compiled decode steps, so it lives on the device.
        self._columns = torch.zeros((), dtype=torch.int64, device=weight.device)
        mark_static_address(self._columns)
        self._link = _link_of(modules)
        self._layers = frozenset(modules)
        # The new latents [B, 1, Q, L] and rope keys [B, 1, Q, R] of each layer whose update() ran and whose
        # attention has not yet taken them: empty between forwards.
        self._in_flight: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._first_layer, self._last_layer = min(modules), max(modules)
        self._has_tokens = False  # host-side: the next forward is a prompt on an empty cache when False
        # generate() marks a cache passed to it at the start of each call (``_is_user_defined``): the first
        # forward of such a call on a filled cache must continue the sequences the cache holds.
        self._passed_to_generate = False
        self._generate_call_begins = False
        # The forward in progress runs ordinary attention (set by its first layer; False between forwards).
        self._prompt_forward = False
        # Columns seen as the host knows them without reading the device (None once a compiled step has run:
        # its count lives in _columns only). It bounds every sequence's length, so the capacity checks of
        # eager forwards read the device only when this bound could exceed max_seq_len.
        self._host_columns: Optional[int] = 0
        # The new tokens' cache slots [B*Q] int32, computed by the forward's first MLA layer for all of them.
        self._new_slots: Optional[torch.Tensor] = None
        # What HF's mask helpers ask of every cache; our layers never change, so the answers are computed once.
        self._layer_flags = ([False] * num_layers, [False] * num_layers, [False] * num_layers)
        self.sparse = support.sparse
        self._indexer_keys = {i: self._indexer_buffer(m, batch_size, max_seq_len, weight.dtype)
                              for i, m in modules.items() if getattr(m, "indexer", None) is not None}

    @staticmethod
    def _indexer_buffer(module, batch_size, max_seq_len, dtype) -> torch.Tensor:
        keys = torch.zeros(batch_size, max_seq_len, module.indexer.head_dim, dtype=dtype,
                           device=module.kv_b_proj.weight.device)
        mark_static_address(keys)
        return keys

    # ---------------------------------------------------------------- what the cache is
    kv_caches = _paged_attribute("kv_caches", "list of [P, page_size, width] caches, one per layer")
    block_table = _paged_attribute("block_table", "[B, max_pages] int32: the pages of each sequence")
    seq_lens = _paged_attribute("seq_lens", "[B] int32 on the device: real tokens held per sequence")
    kv_scale = _paged_attribute("kv_scale", "[1] float32: the fp8 caches' dequantisation scale (1 otherwise)")
    format = _paged_attribute("format", "the cache format: fp32, fp16, bf16, fp8_e4m3 or fp8_ds_mla")
    page_size = _paged_attribute("page_size", "tokens per page")
    kv_lora_rank = _paged_attribute("kv_lora_rank", "L: the latent's width")
    rope_dim = _paged_attribute("rope_dim", "R: the rope key's width")
    batch_size = _paged_attribute("batch_size", "B: the sequences the cache holds")

    @property
    def is_compileable(self) -> bool:
        return True

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_initialized(self) -> bool:
        return True

    @property
    def is_sliding(self) -> list[bool]:
        return self._layer_flags[0]

    @property
    def is_linear(self) -> list[bool]:
        return self._layer_flags[1]

    @property
    def is_dummy(self) -> list[bool]:
        return self._layer_flags[2]

    @property
    def _is_user_defined(self) -> bool:
        return self._passed_to_generate

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        # transformers' generate() sets this on the cache passed to it, at the start of every call
        # (``_prepare_cache_for_generation``): the call's first forward checks that it continues this cache.
        self._passed_to_generate = self._generate_call_begins = bool(value)

    def __repr__(self) -> str:
        return (f"PagedMLACache(batch_size={self.batch_size}, max_seq_len={self.max_seq_len}, format={self.format!r}, "
                f"page_size={self.page_size}, layers={len(self._layers)})")

    # ---------------------------------------------------------------- transformers' Cache interface
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Called by the attention module with the new latent [B, 1, Q, L] and rope key [B, 1, Q, R]; hands
        them to the attention function of the same layer and returns them for HF to expand."""
        if layer_idx not in self._layers:
            raise ValueError(f"PagedMLACache.update: layer {layer_idx} is not an MLA attention layer of the model "
                             f"this cache was made for (layers {sorted(self._layers)})")
        if layer_idx == self._first_layer:  # every layer of a forward has the same batch and dims (_check_dims)
            if self._in_flight:
                raise RuntimeError(f"PagedMLACache.update: the latents of layers {sorted(self._in_flight)} were never "
                                   "attended (an earlier forward failed part-way?); call cache.reset() and start again")
            self._check_forward(key_states, value_states)
            self._begin_forward(key_states.shape[2])
            self._link.cache = self
        self._in_flight[layer_idx] = (key_states, value_states)
        return key_states, value_states

    def _check_forward(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        link = self._link
        if link.config._attn_implementation != ATTN_IMPLEMENTATION:
            raise RuntimeError(
                f"PagedMLACache needs the model's attention implementation {ATTN_IMPLEMENTATION!r}, got "
                f"{link.config._attn_implementation!r}: call model.set_attn_implementation({ATTN_IMPLEMENTATION!r})"
            )
        B, _, _, L = key_states.shape
        if B != self.batch_size:
            raise ValueError(f"PagedMLACache: the forward has batch {B}, the cache was made for {self.batch_size} "
                             "(num_return_sequences / num_beams multiply the batch)")
        if L != self.kv_lora_rank or value_states.shape[-1] != self.rope_dim:
            raise ValueError(f"PagedMLACache.update expects latents [B, 1, Q, {self.kv_lora_rank}] and rope keys "
                             f"[B, 1, Q, {self.rope_dim}], got {tuple(key_states.shape)} and {tuple(value_states.shape)}")

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """DSA: store the new columns' indexer keys [B, S, D]; returns all [B, max_seq_len, D] (columns not
        seen yet are masked by the mask, as with HF's static indexer cache)."""
        keys = self._indexer_keys.get(layer_idx)
        if keys is None:
            raise ValueError(f"PagedMLACache.update_indexer: layer {layer_idx} has no indexer")
        S = indexer_key_states.shape[1]
        columns = self._columns - S + torch.arange(S, device=keys.device)  # update() already counted them
        if self._counted_on_device():  # (eager forwards checked the columns in update())
            columns = check_cache_positions(columns, self.max_seq_len, "PagedMLACache", "columns (padding included)")
        keys.index_copy_(1, columns, indexer_key_states.to(keys.dtype))
        return keys

    def get_seq_length(self, layer_idx: int = 0) -> torch.Tensor:
        return self._columns

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        # Dense: the mask covers the new tokens only (cached tokens are never masked: pads are not stored).
        # DSA: the indexer scores every column, so the mask spans them all, at a fixed size.
        return (self.max_seq_len, 0) if self.sparse else (query_length, 0)

    def get_query_offset(self, layer_idx: int = 0):
        return self._columns if self.sparse else 0

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return self.max_seq_len

    def reset(self) -> None:
        """Forget every sequence (the pages stay allocated; stale indexer keys sit in masked columns)."""
        self.seq_lens.zero_()
        self._columns.zero_()
        self._host_columns = 0
        self._has_tokens = False
        self._prompt_forward = False
        self._new_slots = None
        self._in_flight.clear()
        if self._link.cache is self:
            self._link.cache = None

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` columns (HF's convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"PagedMLACache.crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0:
            return
        # Left padding: each sequence's real tokens are its last columns, so every sequence loses the same
        # number of tokens (all it has, at most).
        self.seq_lens.sub_(-tokens_to_remove).clamp_(min=0)
        self._columns.sub_(-tokens_to_remove).clamp_(min=0)
        if self._host_columns is not None:
            self._host_columns = max(self._host_columns + tokens_to_remove, 0)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: sequence i continues sequence ``beam_idx[i]`` (copies the pages)."""
        beam_idx = beam_idx.to(self.seq_lens.device)
        pages = self.block_table.long()
        for kv in self.kv_caches:
            kv.index_copy_(0, pages.flatten(), kv.index_select(0, pages[beam_idx].flatten()))
        for keys in self._indexer_keys.values():
            keys.copy_(keys.index_select(0, beam_idx))
        self.seq_lens.copy_(self.seq_lens.index_select(0, beam_idx))

    def batch_repeat_interleave(self, repeats: int):
        raise NotImplementedError("PagedMLACache has a fixed batch: make it with the expanded batch size instead")

    def batch_select_indices(self, indices: torch.Tensor):
        raise NotImplementedError("PagedMLACache has a fixed batch: make it with the batch size you need")

    # ---------------------------------------------------------------- filling it directly (tests, benchmarks)
    def set_length(self, num_tokens: int) -> None:
        """Declare that every sequence holds ``num_tokens`` tokens (written directly with ``mla.cache_append``
        at ``slot_mapping(...)``): for benchmarks that start from a long context without a prompt."""
        if not 0 <= num_tokens <= self.max_seq_len:
            raise ValueError(f"num_tokens must be in [0, max_seq_len={self.max_seq_len}], got {num_tokens}")
        self.seq_lens.fill_(num_tokens)
        self._columns.fill_(num_tokens)
        self._host_columns = num_tokens
        self._has_tokens = num_tokens > 0

    def slot_mapping(self, positions: torch.Tensor) -> torch.Tensor:
        """Slots [B*N] int32 of positions [B, N] (sequence b's token at position t lives at slot
        ``block_table[b, t // page_size] * page_size + t % page_size``)."""
        return self._slots(positions.to(self.seq_lens.device).long(), None)

    # ---------------------------------------------------------------- the attention (called by mla_attention)
    def _slots(self, positions: torch.Tensor, real: Optional[torch.Tensor]) -> torch.Tensor:
        ps = self.page_size
        # Clamped so that an index never leaves the block table: masked DSA columns and pads may lie outside
        # (the positions of new tokens were checked against max_seq_len already).
        positions = positions.clamp(0, self.max_seq_len - 1)
        # int32 throughout after the gather (the block table's dtype, the op's slot dtype): one cast, of the
        # offsets within the page.
        slots = self.block_table.gather(1, positions // ps) * ps + (positions % ps).to(torch.int32)
        if real is not None:
            slots = torch.where(real, slots, -1)
        return slots.flatten()

    def _begin_forward(self, num_columns: int) -> None:
        """At the forward's first MLA layer (in ``update``): count the new columns and decide prompt vs
        decode attention for every layer of this forward."""
        if self._counted_on_device():
            self._host_columns = None  # a compiled or captured step counts on the device only
        elif self.sparse:
            columns = self._columns_seen() + num_columns
            if columns > self.max_seq_len:
                raise ValueError(capacity_message("PagedMLACache", self.max_seq_len, "columns (padding included)",
                                                  columns))
        self._columns.add_(num_columns)
        if self._host_columns is not None:
            self._host_columns += num_columns
        # Written only when they change (_end_forward leaves _prompt_forward False): a decode step writes
        # neither (see "Host work" above).
        prompt = not self._has_tokens
        if self._prompt_forward != prompt:
            self._prompt_forward = prompt
        if prompt:
            self._has_tokens = True

    def _advanced_by_replay(self) -> None:
        """A captured decode step was replayed (``hf.CapturedDecodeStep``): it advanced the lengths on the device
        and ran none of this object's Python, so the host's count no longer follows them."""
        self._host_columns = None

    def _counted_on_device(self) -> bool:
        """Whether this forward is compiled or captured in a CUDA graph: its replays run none of its Python, so
        the host's count cannot follow them, and no check may read the device."""
        return torch.compiler.is_compiling() or being_captured(self._columns)

    def _columns_seen(self) -> int:
        """Columns seen before this forward, from the host's count when it has one (no device read)."""
        return int(self._columns) if self._host_columns is None else self._host_columns

    def _begin_attention(self, attention_mask: Optional[torch.Tensor], B: int, Q: int, device) -> None:
        """At the forward's first MLA layer (in the attention): the slots of the new tokens (every layer writes
        its latents there) and each sequence's real new tokens added to its length.

        Left padding: sequence b's real new tokens are its last ones, at positions seq_lens[b] ...
        seq_lens[b] + (its real count) - 1; pads get slot -1 (not stored)."""
        real = self._real_new_tokens(attention_mask, B, Q)
        self._check_capacity(real, Q)
        if self._prompt_forward:
            # An empty cache: every length is 0, so the positions need no read of seq_lens.
            positions = torch.arange(Q, device=device).expand(B, Q) if real is None else real.cumsum(-1) - 1
        elif real is None:  # every new token is real: no mask to read
            positions = self.seq_lens[:, None].long() + torch.arange(Q, device=device)
        else:
            positions = self.seq_lens[:, None].long() + real.cumsum(-1) - 1
        added = Q if real is None else real.sum(-1, dtype=torch.int32)
        if self._counted_on_device():
            # No host check runs in a compiled or captured step: the positions it writes are checked where
            # they are (a ValueError on CPU, a device-side assert on GPUs), never wrapped onto the last slot,
            # and the new lengths pass through the check, so a refused step advances none of them.
            positions, lengths = check_cache_step(positions if real is None else torch.where(real, positions, -1),
                                                  self.seq_lens + added, self.max_seq_len, "PagedMLACache", "tokens")
            self.seq_lens.copy_(lengths)
        else:
            self.seq_lens.add_(added)
        self._new_slots = self._slots(positions, real)

    def _check_capacity(self, real: Optional[torch.Tensor], Q: int) -> None:
        """Eager forwards: no sequence may outgrow max_seq_len. No sequence holds more tokens than the columns
        seen, so the device is read only when that bound does not settle it (compiled and captured steps check
        on the device instead: ``check_cache_positions`` in ``_begin_attention``)."""
        if self._counted_on_device():
            return
        if self._host_columns is not None and self._host_columns <= self.max_seq_len:
            return  # _begin_forward already counted this forward's columns
        new_lens = self.seq_lens + (Q if real is None else real.sum(-1, dtype=torch.int32))
        longest = int(new_lens.max())
        if longest > self.max_seq_len:
            raise ValueError(capacity_message("PagedMLACache", self.max_seq_len, "tokens", longest))

    def _refuse_misuse(self, attention_mask: Optional[torch.Tensor], B: int, Q: int, kwargs: dict) -> None:
        """At the forward's first MLA layer, before anything is written: refuse a forward that would store
        what the cache already holds (``use_cache=False``: each step feeds the whole sequence again), and the
        first forward of a ``generate()`` call that does not continue the sequences a filled cache holds (its
        positions do not start at their lengths: a stale cache given a new prompt). Either leaves the cache
        as it was before this forward."""
        position_ids = kwargs.get("position_ids")
        if (kwargs.get("use_cache") is False and Q > 1 and not self._prompt_forward
                and (self._counted_on_device() or position_ids is None
                     or not self._continues(attention_mask, B, Q, position_ids))):
            # A layer's use_cache is not always the model's (some models' layers default it to False): refused is
            # a forward of several tokens that does not continue the cached ones (read on the host in this case
            # alone; a compiled step, which cannot read it, is refused on the flag and the token count).
            self._abandon_forward(Q)
            with argument_errors_reach_the_user(any_message=True):  # the same ValueError from a compiled step
                raise ValueError("PagedMLACache: the forward runs with use_cache=False, which feeds the whole "
                                 "sequence again at every step while the cache keeps every token it is given; "
                                 "generate with use_cache=True (the default), or without a PagedMLACache")
        if not self._generate_call_begins:
            return
        self._generate_call_begins = False
        if self._prompt_forward or position_ids is None or self._counted_on_device():
            return  # an empty cache: nothing to continue (compiled: no host read; never a generate's first forward)
        if self._continues(attention_mask, B, Q, position_ids):
            return
        held = self.seq_lens.tolist()
        self._abandon_forward(Q)
        raise ValueError(
            f"PagedMLACache: generate() was given a cache that already holds sequences of {held} tokens, and its "
            "input does not continue them (transformers continues a cache only when input_ids, or the attention "
            "mask, span the cached tokens followed by the new ones); call cache.reset() before generating for "
            "new prompts")

    def _continues(self, attention_mask: Optional[torch.Tensor], B: int, Q: int, position_ids) -> bool:
        """Whether this forward's new tokens follow the tokens each sequence holds (a host read)."""
        real = self._real_new_tokens(attention_mask, B, Q)
        count = torch.full((B,), Q, device=self.seq_lens.device) if real is None else real.sum(-1)
        last = position_ids.to(self.seq_lens.device).expand(B, Q)[:, -1].long()
        return bool(((count == 0) | (last == self.seq_lens.long() + count - 1)).all())

    def _abandon_forward(self, Q: int) -> None:
        """Undo what the forward in progress changed (its first layer's ``update``: nothing was written yet)."""
        self._columns.sub_(Q)
        if self._host_columns is not None:
            self._host_columns -= Q
        if self._prompt_forward:
            self._has_tokens = False
        self._in_flight.clear()
        self._end_forward()

    def _end_forward(self) -> None:
        """At the forward's last MLA layer: nothing of this forward outlives it."""
        self._new_slots = None
        self._link.cache = None
        if self._prompt_forward:
            self._prompt_forward = False

    def _real_new_tokens(self, attention_mask: Optional[torch.Tensor], B: int, Q: int) -> Optional[torch.Tensor]:
        """[B, Q] bool: which new tokens are real (None: all of them). A token attends to itself unless it is
        padding, so this is the mask's diagonal (dense: the mask covers the new tokens; DSA: their columns of
        all of them)."""
        if attention_mask is None:
            return None
        kv = self.max_seq_len if self.sparse else Q
        if attention_mask.dtype != torch.bool or attention_mask.dim() != 4 or attention_mask.shape[-2:] != (Q, kv):
            raise ValueError(
                f"mla_inductor attention with a PagedMLACache expects the boolean mask [B, 1, Q={Q}, {kv}] of the "
                f"'{ATTN_IMPLEMENTATION}' mask function, got {attention_mask.dtype} {tuple(attention_mask.shape)}"
            )
        if not self.sparse:
            return attention_mask[:, 0].diagonal(dim1=-2, dim2=-1).expand(B, Q)
        columns = self._columns - Q + torch.arange(Q, device=attention_mask.device)
        return attention_mask[:, 0].gather(-1, columns.view(1, Q, 1).expand(attention_mask.shape[0], Q, 1)).view(-1, Q).expand(B, Q)

    def _sparse_slots(self, indices: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """DSA: the indexer's top-k columns [B, Q, K] -> ``sparse_indices`` [B*Q, K] int32 slots, -1 where a
        column is masked (causal, padding, not seen yet). Left padding: column c of sequence b holds its
        token at position c - (b's pad columns)."""
        B, Q, K = indices.shape
        columns = indices.long()
        allowed = attention_mask[:, 0].expand(B, Q, -1).gather(-1, columns.clamp(0, self.max_seq_len - 1))
        pads = (self._columns - self.seq_lens).long()  # both already count this forward
        positions = columns - pads[:, None, None]
        return self._slots(positions.view(B, Q * K), (allowed & (positions >= 0)).view(B, Q * K)).view(B * Q, K)

    def attend(self, module, query, key, value, attention_mask, scaling, kv_c, k_pe, indices=None, **kwargs):
        """The attention of one layer: query [B, H, Q, nope+R]; keys/values expanded from the new tokens;
        ``indices`` [B, Q, K]: a DSA layer's top-k columns. Returns ([B, Q, H, v], None) like HF's
        attention functions."""
        B, _, Q, _ = query.shape
        layer = module.layer_idx
        if layer == self._first_layer:
            self._refuse_misuse(attention_mask, B, Q, kwargs)
            self._begin_attention(attention_mask, B, Q, query.device)
        slots, prompt = self._new_slots, self._prompt_forward
        if layer == self._last_layer:
            self._end_forward()
        torch.ops.mla.cache_append(self.kv_caches[layer], kv_c.reshape(B * Q, -1), k_pe.reshape(B * Q, -1), slots,
                                   self.kv_scale)
        if prompt:
            if attention_mask is None and indices is None:  # every token real: the causal prompt kernel
                return prefill_attention(query, key, value, scaling, causal=True), None
            if self.sparse and attention_mask is not None:
                attention_mask = attention_mask[..., :Q]  # the prompt fills the first columns
            return sdpa_attention_forward(module, query, key, value, _with_top_k(attention_mask, indices, B, Q),
                                          scaling=scaling, **kwargs)
        sparse_indices = None if indices is None else self._sparse_slots(indices, attention_mask)
        return self._absorbed_attention(module, query, scaling, sparse_indices), None

    def _absorbed_attention(self, module, query: torch.Tensor, scaling: float,
                            sparse_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The decode on the absorbed query: W_UK folded into the query, W_UV applied to the output.

        kv_b_proj.weight [H*(nope+v), L] holds, per head, nope rows of W_UK then v rows of W_UV; both are
        used as views of the live weight (nothing copied, nothing stale after model.to())."""
        B, H, Q, _ = query.shape
        nope, v, L = module.qk_nope_head_dim, module.v_head_dim, module.kv_lora_rank
        T = B * Q
        w = module.kv_b_proj.weight.view(H, nope + v, L)
        q_nope = query[..., :nope].transpose(0, 1).reshape(H, T, nope)
        q_latent = torch.bmm(q_nope, w[:, :nope]).transpose(0, 1)  # [T, H, L], last dim contiguous
        q_pe = query[..., nope:].transpose(1, 2).reshape(T, H, -1)
        out = self._decode(q_latent, q_pe, module.layer_idx, scaling, sparse_indices)  # [T, H, L]
        out = torch.bmm(out.transpose(0, 1), w[:, nope:].transpose(1, 2))  # [H, T, v]
        return out.transpose(0, 1).reshape(B, Q, H, v)

    def _decode(self, q_latent: torch.Tensor, q_pe: torch.Tensor, layer_idx: int, scaling: float,
                sparse_indices: Optional[torch.Tensor]) -> torch.Tensor:
        """The attention over the cache of one layer: absorbed query [T, H, L] + rope query [T, H, R] -> [T, H, L]."""
        return torch.ops.mla.paged_decode(q_latent, q_pe, self.kv_caches[layer_idx], self.block_table,
                                          self.seq_lens, scaling, self.kv_scale, sparse_indices)


def _with_top_k(attention_mask: Optional[torch.Tensor], indices: Optional[torch.Tensor], B: int, Q: int):
    """A DSA layer's boolean mask [B, 1, Q, W] restricted to its top-k columns ``indices`` [B, Q, K] (what
    HF's eager and sdpa paths do before attending); columns >= W are dropped."""
    if indices is None:
        return attention_mask
    if attention_mask is None:
        raise ValueError("a DSA layer needs the boolean attention mask its indexer was given")
    W = attention_mask.shape[-1]
    columns = indices.long()
    columns = torch.where(columns < W, columns, W)  # out of the mask's range: into a column sliced off below
    chosen = torch.zeros(B, Q, W + 1, dtype=torch.bool, device=indices.device).scatter(-1, columns, True)
    return attention_mask & chosen[..., :W].unsqueeze(1)


# --------------------------------------------------------------------------------------------------------
# The functions registered with transformers


def mla_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """``AttentionInterface`` function ``"mla_inductor"``: the paged MLA path when the forward's cache is a
    ``PagedMLACache``, HF's sdpa otherwise (no cache, a ``DynamicCache``, ...)."""
    link = module.__dict__.get(_LINK_ATTR)
    cache = None if link is None else link.cache
    latents = None if cache is None else cache._in_flight.pop(module.layer_idx, None)
    if latents is None:
        B, _, Q, _ = query.shape
        mask = _with_top_k(attention_mask, kwargs.pop("indices", None), B, Q)
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    if dropout:
        raise ValueError("mla_inductor attention is for inference: dropout must be 0 (call model.eval())")
    scaling = module.scaling if scaling is None else scaling
    kv_c, k_pe = latents
    return cache.attend(module, query, key, value, attention_mask, scaling, kv_c, k_pe, **kwargs)


def mla_attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None, **kwargs):
    """``AttentionMaskInterface`` function ``"mla_inductor"``: sdpa's boolean mask. A ``PagedMLACache`` asks
    for a mask over the new tokens only (``get_mask_sizes`` = (Q, 0)); the 2D padding mask covers every
    column seen, so its last Q columns are the ones that matter.

    A decode step (one new token, a mask of one column) needs no mask building: the token sees only itself
    (the cache's tokens are never masked), so the mask is its padding column, copied (``generate`` builds it
    outside the compiled step at every step, and a view would change strides as the 2D mask grows), or
    None without a padding mask."""
    if q_length == 1 and kv_length == 1 and kv_offset == 0 and kwargs.get("mask_function") in (None, causal_mask_function):
        if attention_mask is None:
            return None
        return attention_mask[:, -1].to(torch.bool).contiguous().view(batch_size, 1, 1, 1)
    if attention_mask is not None and kv_length == q_length and kv_offset == 0 and attention_mask.shape[-1] > q_length:
        attention_mask = attention_mask[:, -q_length:]
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, attention_mask=attention_mask, **kwargs)


def register() -> str:
    """Register ``"mla_inductor"`` with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, mla_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, mla_attention_mask)
    return ATTN_IMPLEMENTATION


TRANSFORMERS_VERSION = transformers.__version__
