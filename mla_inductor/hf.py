"""Hugging Face MLA models (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash, ...) on ``torch.ops.mla.paged_decode``,
through transformers' own extension points: a ``Cache`` subclass and an attention function registered with
``AttentionInterface`` / ``AttentionMaskInterface``. No forward of any module is replaced.

    from mla_inductor import hf                  # the ops; the Inductor pass loads on the first compile

    hf.register()                                # "mla_inductor" for set_attn_implementation / from_pretrained
    model.set_attn_implementation("mla_inductor")
    cache = hf.PagedMLACache(model, batch_size=4, max_seq_len=4096, fmt="bf16")   # or fp8_e4m3 / fp8_ds_mla
    out = model.generate(input_ids, attention_mask=mask, cache=cache, max_new_tokens=64)
    # transformers 5.23 names it past_key_values=cache; **hf.cache_kwargs(cache) runs on both

``generate`` then works as usual (greedy, sampling, left padding, stop tokens, streamers, logits
processors, beam search with a cache of batch x beams). The prompt runs HF's sdpa on keys/values expanded
from its own latents while the latents go into the paged cache; every later step (and any chunk added to
a filled cache) runs ``mla.paged_decode`` on the absorbed query. On GPU ``generate`` compiles its decode
step itself (the cache is ``is_compileable``), and the Inductor pass picks the kernel.

Without ``generate``, the gpt-fast style loop below drives the same forward: ``prefill``,
``decode_one_token`` (the function to ``torch.compile``) and ``generate`` (greedy).

transformers is imported only when one of these names is first used (``mla_inductor._hf`` holds the code
that needs it); ``import mla_inductor.hf`` alone imports nothing from it.
"""

from __future__ import annotations

import functools
import types
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import nn

from mla_inductor._compat import inductor_loaded
from mla_inductor._transformers import (  # noqa: F401
    MAX_TRANSFORMERS_MAJOR,
    MIN_TRANSFORMERS,
    cache_kwargs,
    require_transformers,
)
from mla_inductor.backends import forget_plans, plans_shared_in_capture
from mla_inductor.selection import compiling_for_capture

if TYPE_CHECKING:
    from mla_inductor._hf import PagedMLACache

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CapturedDecodeStep",
    "DCPMLACache",  # noqa: F822 - lazy (module __getattr__: transformers is imported on first use)
    "PagedMLACache",
    "SUPPORTED_MODEL_TYPES",  # noqa: F822 - lazy, as above
    "cache_kwargs",
    "compile_layers",
    "decode_one_token",
    "generate",
    "prefill",
    "register",
]

ATTN_IMPLEMENTATION = "mla_inductor"
_LAZY = ("PagedMLACache", "SUPPORTED_MODEL_TYPES", "check_model")
# DCPMLACache: the paged cache split over a DCP group (mla_inductor.distributed), for generate() under torchrun.
_LAZY_DISTRIBUTED = ("DCPMLACache",)


def _impl():
    require_transformers()
    from mla_inductor import _hf

    return _hf


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(_impl(), name)
    if name in _LAZY_DISTRIBUTED:
        require_transformers()
        from mla_inductor import _hf_distributed

        return getattr(_hf_distributed, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> str:
    """Register ``"mla_inductor"`` with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``
    (idempotent; making a ``PagedMLACache`` does it too). Returns the name, for
    ``from_pretrained(..., attn_implementation=hf.register())``."""
    return _impl().register()


# --------------------------------------------------------------------------------------------------------
# A gpt-fast style loop on the same forward (no generate(): prefill, decode_one_token, generate)


@torch.no_grad()
def prefill(model: nn.Module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
            cache: "PagedMLACache") -> torch.Tensor:
    """Append a (left-padded) prompt batch to ``cache``: input_ids [B, S], attention_mask [B, S] of 0/1
    (None: no padding). Returns the last position's logits [B, V]. Pads are never stored; positions
    continue each sequence's length, as HF's ``generate`` numbers them."""
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"prefill: attention_mask must be [B, S] = {tuple(input_ids.shape)} (the new tokens' "
                         f"columns), got {tuple(attention_mask.shape)}")
    real = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
    positions = cache.seq_lens[:, None].long() + (real.cumsum(-1) - 1).clamp_min(0)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, **cache_kwargs(cache),
                use_cache=True, logits_to_keep=1)
    return out.logits[:, -1]


def decode_one_token(model: nn.Module, tokens: torch.Tensor, cache: "PagedMLACache") -> torch.Tensor:
    """One decode step: tokens [B] -> logits [B, V]. Positions and cache slots come from ``cache.seq_lens``
    on the device, so ``torch.compile(decode_one_token, fullgraph=True, mode="reduce-overhead")`` captures
    the whole step in a CUDA graph with no host work between steps. Called uncompiled (layers compiled one
    by one) on CUDA tensors, it marks the start of a step for CUDA graphs
    (``torch.compiler.cudagraph_mark_step_begin``)."""
    if isinstance(cache, torch.Tensor):
        raise TypeError("decode_one_token(model, tokens, cache): pass the PagedMLACache, not a tensor; the cache "
                        "slots come from the cache's lengths on the device")
    if not torch.compiler.is_compiling() and tokens.is_cuda and inductor_loaded():
        # A new step: CUDA graphs of separately compiled layers (regional compilation, mode="reduce-overhead")
        # may now reuse the previous step's output memory. Without the mark their next replay fails ("accessing
        # tensor output of CUDAGraphs that has been overwritten"), and so does the first step, whose layers are
        # compiled and warmed up one after another. Compiled whole, this function is traced and its one graph
        # needs no mark. CPU tensors are never captured. Without Inductor loaded nothing was compiled with it,
        # and the mark would import it (seconds); where another library loaded it, the mark is a counter update.
        torch.compiler.cudagraph_mark_step_begin()
    positions = cache.seq_lens[:, None].long()
    out = model(input_ids=tokens[:, None], position_ids=positions, **cache_kwargs(cache), use_cache=True,
                logits_to_keep=1)
    return out.logits[:, -1]


def compile_layers(model: nn.Module, **compile_kwargs) -> list[nn.Module]:
    """Regional compilation: ``torch.compile(..., **compile_kwargs)`` each decoder layer of ``model`` on its own
    (e.g. ``fullgraph=True, mode="reduce-overhead"``), then drive the step with ``decode_one_token`` uncompiled.
    Returns the layers; ``del layer.forward`` undoes it.

    Why not ``layer.forward = torch.compile(layer.forward)`` in a loop: each layer compiles to a graph of its
    own (the cache routes by ``layer_idx``), and Dynamo keeps the graphs of one function together: at most
    ``torch._dynamo.config.recompile_limit`` of them (8; a 61-layer DeepSeek-V3 fails with fullgraph=True and
    runs its later layers uncompiled without it), each call checking the others' guards first. Here every layer
    compiles a copy of the forward's code, so each has its own one-entry cache (Dynamo traces every layer;
    the copies' graphs are alike, so Inductor's FX-graph cache can serve the later ones)."""
    layers = getattr(model.get_decoder() if hasattr(model, "get_decoder") else model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise TypeError(f"compile_layers: {type(model).__name__} has no decoder layers (model.get_decoder().layers)")
    for i, layer in enumerate(layers):
        forward = _own_code_copy(type(layer).forward, f"layer{i}")
        layer.forward = torch.compile(types.MethodType(forward, layer), **compile_kwargs)
    return list(layers)


class CapturedDecodeStep:
    """``decode_one_token(model, tokens, cache)`` as one CUDA graph for the whole step, for a model whose
    layers run eagerly or are compiled one by one (``compile_layers(model, fullgraph=True)``, *without*
    ``mode="reduce-overhead"``)::

        hf.compile_layers(model, fullgraph=True)     # regional compilation: one layer's compile time
        step = hf.CapturedDecodeStep(model, cache)    # one CUDA graph per step
        token = hf.prefill(model, ids, mask, cache=cache).argmax(-1)
        for _ in range(n):
            token = step(token).argmax(-1)

    Per-layer CUDA graphs (``mode="reduce-overhead"``) make a CUDA-graph tree per layer, and each layer's call
    then costs the host its guards, the tree's checks and a launch (a few hundred µs per layer on some hosts:
    more than the device's work at small batches). Here a step costs one copy of ``tokens``, one graph launch
    and one copy of the logits, however many layers the model has; and its layers share one schedule
    (``plans_shared_in_capture``), as the calls of a step compiled whole do, where each separately compiled
    layer would otherwise schedule its own call (a metadata kernel per layer).

    The first call runs the step as usual (compiling the layers, for graphs captured as a whole: a backend
    whose plan runs on the host is not chosen) and returns its logits; the second captures the step and
    replays it; every later call copies ``tokens`` in and replays. Each call returns a new [B, V] logits
    tensor. The graph holds the addresses of the model's weights and of the cache: rebuild it after replacing
    a weight tensor (``load_state_dict`` copies in place and needs nothing) or to use another cache. The
    cache's ``reset``, ``crop``, ``set_length`` and ``reorder_cache`` work between calls (they write in place;
    after ``reset``, ``prefill`` a new prompt before the next step: a call on an empty cache is refused). As in a
    compiled step on a GPU, a replay that would take a sequence past the cache's ``max_seq_len`` stops at a
    device-side assert (nothing in a replay may wait for the device to raise a Python exception).
    """

    def __init__(self, model: nn.Module, cache: "PagedMLACache"):
        check_attention(model)
        seq_lens = cache.seq_lens
        if not seq_lens.is_cuda:
            raise ValueError(f"CapturedDecodeStep: CUDA graphs need the model and cache on a CUDA device; the cache "
                             f"is on {seq_lens.device} (call hf.decode_one_token directly there)")
        self.model, self.cache = model, cache
        self.batch_size = seq_lens.shape[0]
        self._graph: Optional[torch.cuda.CUDAGraph] = None
        self._stream: Optional[torch.cuda.Stream] = None
        self._tokens: Optional[torch.Tensor] = None  # the graph's input, written by each call
        self._logits: Optional[torch.Tensor] = None  # the graph's output, copied out by each call

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step: tokens [B] (integer, on the cache's device) -> logits [B, V]."""
        self._check_tokens(tokens)
        if not self.cache._has_tokens:  # (a host flag: after reset(), a new prompt comes first)
            raise ValueError("CapturedDecodeStep: the cache holds no prompt; add one first (hf.prefill) so that the "
                             "step is a decode step")
        if self._graph is None:
            return self._warm_up_or_capture(tokens)
        self._tokens.copy_(tokens)
        return self._replay()

    def _replay(self) -> torch.Tensor:
        self._graph.replay()
        # The replay wrote the lengths where neither torch's version counters nor the cache's host count see it:
        # a plan stored from them (an eager call's, outside this graph) must be made again, and the cache's
        # capacity checks must read the device.
        forget_plans()
        self.cache._advanced_by_replay()
        return self._logits.clone()

    def _check_tokens(self, tokens: torch.Tensor) -> None:
        device = self.cache.seq_lens.device
        if not isinstance(tokens, torch.Tensor) or tokens.shape != (self.batch_size,) \
                or tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool \
                or tokens.device != device:
            got = (f"{tuple(tokens.shape)} {tokens.dtype} on {tokens.device}" if isinstance(tokens, torch.Tensor)
                   else type(tokens).__name__)
            raise ValueError(f"CapturedDecodeStep: tokens must be [B={self.batch_size}] integer token ids on {device} "
                             f"(the cache's batch and device), got {got}")

    def _warm_up_or_capture(self, tokens: torch.Tensor) -> torch.Tensor:
        if self._stream is None:  # the first call: compiles the layers, for a captured step
            stream = torch.cuda.Stream(tokens.device)
            logits = self._on_side_stream(stream, lambda: self._step(tokens), tokens)
            self._stream = stream  # (only once a warm-up went through: a failed one is run again)
            return logits
        self._tokens = tokens.clone()
        graph = torch.cuda.CUDAGraph()
        try:
            with compiling_for_capture(), plans_shared_in_capture(), torch.cuda.graph(graph, stream=self._stream):
                self._logits = decode_one_token(self.model, self._tokens, self.cache)
        except Exception as e:
            self._tokens = self._logits = None
            raise RuntimeError(
                "CapturedDecodeStep: the decode step could not be captured in a CUDA graph. Layers compiled with "
                "mode='reduce-overhead' make CUDA graphs of their own (compile them without it), and model code "
                "that waits for the device (.item(), data-dependent shapes) cannot be captured. "
                f"The error: {type(e).__name__}: {e}") from e
        self._graph = graph
        return self._replay()

    def _step(self, tokens: torch.Tensor) -> torch.Tensor:
        with compiling_for_capture():
            return decode_one_token(self.model, tokens, self.cache)

    @staticmethod
    def _on_side_stream(stream: torch.cuda.Stream, fn: Callable[[], torch.Tensor],
                        tokens: torch.Tensor) -> torch.Tensor:
        """fn() on the capture's stream (a library's lazy set-up for a stream happens before the capture, as
        torch.cuda.graphs asks), ordered after and before the caller's stream."""
        caller = torch.cuda.current_stream()
        stream.wait_stream(caller)
        tokens.record_stream(stream)  # read there: its memory is not reused before that read
        with torch.cuda.stream(stream):
            out = fn()
        caller.wait_stream(stream)
        out.record_stream(caller)
        return out


def _own_code_copy(fn: Callable, suffix: str) -> Callable:
    """``fn`` with a copy of its code object (Dynamo caches compiled graphs per code object)."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{suffix}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return functools.update_wrapper(copy, fn)


@torch.no_grad()
def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    max_new_tokens: int,
    cache: Optional["PagedMLACache"] = None,
    decode_step: Optional[Callable] = None,
) -> torch.Tensor:
    """Greedy generation without ``model.generate``: [B, S] prompt -> [B, S + max_new_tokens] tokens, like
    ``model.generate(do_sample=False)`` with no stop token. ``cache`` is reset first (default: a new one
    sized for this call; a ValueError before anything runs where the prompt and ``max_new_tokens`` do not fit
    its ``max_seq_len``); ``decode_step`` replaces ``decode_one_token`` (e.g. its compiled version)."""
    check_attention(model)
    B, S = input_ids.shape
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if cache is None:
        cache = _impl().PagedMLACache(model, batch_size=B, max_seq_len=S + max_new_tokens)
    # Refused before anything runs: the prompt's tokens (its columns, padding included, for a DSA cache) and
    # every generated token but the last are stored.
    prompt = S if attention_mask is None or cache.sparse else int(attention_mask.sum(-1).max())
    if prompt + max_new_tokens - 1 > cache.max_seq_len:
        raise ValueError(f"generate: the prompt ({prompt} tokens) and max_new_tokens={max_new_tokens} need "
                         f"{prompt + max_new_tokens - 1} tokens per sequence, more than the cache's max_seq_len="
                         f"{cache.max_seq_len}")
    cache.reset()
    step = decode_step or decode_one_token
    token = prefill(model, input_ids, attention_mask, cache=cache).argmax(-1)
    out = [input_ids, token[:, None]]
    for _ in range(max_new_tokens - 1):
        token = step(model, token, cache).argmax(-1)
        out.append(token[:, None])
    return torch.cat(out, dim=1)


def check_attention(model: nn.Module) -> None:
    """Raise unless ``model`` runs the ``"mla_inductor"`` attention implementation."""
    _impl().check_model(model)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if config._attn_implementation != ATTN_IMPLEMENTATION:
        raise RuntimeError(f"the model's attention implementation is {config._attn_implementation!r}: call "
                           f"mla_inductor.hf.register() and model.set_attn_implementation({ATTN_IMPLEMENTATION!r})")
