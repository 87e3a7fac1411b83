"""The FlashMLA backend: DeepSeek's FlashMLA decode kernels, from whichever provider is installed.

Four kernels, one backend (``"flashmla"``); the call's cache format (and sparse_indices) picks the mode:

=========  ====================  ==========================  =================================================
mode       cache                 query                       kernel (GPU)
=========  ====================  ==========================  =================================================
dense      bf16 / fp16           same dtype as the cache     dense decode (SM90 only)
dense_fp8  float8_e4m3fn         e4m3, one scale per tensor  dense FP8 decode (SM90 only); opt-in (see below)
sparse     fp8_ds_mla (656 B)    bf16                        sparse FP8 decode (SM90, SM100), H in {64, 128}
dense_ds   fp8_ds_mla, dense     bf16                        the sparse kernel, every visible position as an
                                                             index (``dense_slot_indices``), H in {64, 128}
=========  ====================  ==========================  =================================================

All need kv_lora_rank 512 and rope_dim 64 (head_dim 576, head_dim_v 512) and pages of 64 tokens.

dense_fp8 computes with q in e4m3 (and P·V in fp8): a larger error than every other path, which keeps q
in bf16. The backend takes such a call only when the caller opted in (``DecodeProblem.fp8_query``: a
static ``q_scale`` on the call, or ``mla_inductor.allow_fp8_query()``). Compiled, the Inductor pass writes
q's assembly and quantization into the graph (``lowering/fp8_query.py``) and calls
``mla_flashmla::decode_quantized_query`` on the result; eager, ``decode_with_q_scale`` quantizes on the
device (``kernels/fp8_query.py``). One scale covers the latent and the rope part (the kernel takes one
``descale_q``): the static ``q_scale``, or ``max(amax(|q|) / 448, tiny)`` measured per call.

Shapes (T = B * Q rows, H heads, P pages): our ``q_nope [T, H, 512] | q_pe [T, H, 64]`` become FlashMLA's
``q [B, Q, H, 576]``; the cache ``[P, 64, 576 or 656]`` becomes ``[P, 64, 1, 576 or 656]`` (a view);
``sparse_indices [T, K]`` becomes ``indices [B, Q, K]`` (the same slots ``page * 64 + offset``, -1
padding; a view unless K needs padding to a multiple of 64). FlashMLA returns ``out [B, Q, H, 512]`` and
``lse [B, H, Q]`` in natural log, which become ``out [T, H, 512]`` and ``lse [T, H]``. ``causal = Q > 1``
for dense calls: FlashMLA right-aligns the queries (query j of Q sees keys ``0 .. seq_len - Q + j``),
which is our contract; dense_ds writes that causality into its indices. Rows that see nothing
(``seq_len - Q + j < 0``, or an all -1 sparse row) get lse -inf (FlashMLA writes +inf there) and out 0
(the dense and sparse kernels write 0 themselves; the FP8 kernel's rows are masked on the GPU).

What the kernels get instead of the caller's tensors (``kernel_tensors``): the block table with -1
garbage clamped to page 0 (no negative page id is ever followed); for dense_fp8 also seq_lens clamped to
>= 1 (the kernel faults on a length-0 sequence); sparse_indices padded with -1 to a multiple of 64 when K
is not one (the sparse kernels assert ``topk % 64 == 0``); for dense_ds the indices built from the block
table and seq_lens.

Plan and run (all CUDA-graph capturable: no host sync, metadata made and read on the stream):

- ``mla_flashmla::plan`` -> ``[tile_scheduler_metadata int32 [num_sm_parts, M], num_splits int32 [B+1],
  row_counts int32 [T], *kernel_tensors]``. Providers with a metadata function (sgl-flash-mla's
  ``get_mla_decoding_metadata``, the legacy interface, the FP8 extension) make the schedule on the device
  without running attention; the 2026 interface of vLLM's build (``FlashMLASchedMeta``) makes it inside
  the kernel call, so there this op runs one decode and keeps only its metadata.
- ``mla_flashmla::decode_and_plan`` (contract's 8 arguments) -> ``[out, lse, *plan]``: a decode that
  also returns the schedule it made for itself. Offered to the pass only where a provider has no
  metadata function: the first layer of a forward makes the schedule while decoding and hands it to the
  later layers, so a forward never runs an extra attention.
- ``mla_flashmla::decode`` (contract's 8 arguments + ``plan``) -> ``(out, lse)``; ``decode_out`` the same
  returning out only; ``decode_quantized_query`` (q in e4m3 and its descale instead of q_nope / q_pe).
  With an empty plan each makes everything itself (the eager path).

Providers (``find_providers``; imported lazily, nothing by ``import mla_inductor``), each mode served by
the first that has it: ``flash_mla`` from the ``sgl-flash-mla`` wheel (``use_legacy=True`` kernels:
all four modes, metadata on the device), or DeepSeek's own ``flash_mla`` package (2026 or legacy
interface); then vLLM's build, ``vllm.third_party.flashmla.flash_mla_interface`` (dense, sparse,
dense_ds) with ``vllm._flashmla_extension_C`` (dense_fp8); then ``vllm.attention.ops.flashmla`` (older
vLLM, legacy interface). Fallbacks are imported only for modes the earlier providers lack.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from mla_inductor._compat import real_tensors
from mla_inductor._library import define_op
from mla_inductor.backends import Backend
from mla_inductor.backends._common import (
    DEEPSEEK_DIMS,
    PlanCache,
    clamp_pages,
    cuda_reason,
    decode_op,
    kernel_lengths,
    quantize_query_fp8,
    skips_empty_calls,
    sm,
    visible_key_counts,
    VIEWS,
)
from mla_inductor.cache import cache_dtype, cache_format
from mla_inductor.contract import DecodeProblem, being_captured, empty_decode_outputs

Tensor = torch.Tensor

HEAD_DIM_V = 512  # FlashMLA's only value width (kv_lora_rank)
HEAD_DIM = 576  # latent 512 + rope 64
PAGE_SIZE = 64
TOPK_BLOCK = 64  # the sparse kernels read top-k in blocks of 64
SPARSE_HEADS = (64, 128)

MODES = ("dense", "dense_fp8", "sparse", "dense_ds")
MODE_NAMES = {"dense": "dense bf16/fp16", "dense_fp8": "dense fp8_e4m3", "sparse": "sparse fp8_ds_mla",
              "dense_ds": "dense fp8_ds_mla (sparse kernel)"}
SPARSE_KERNEL_MODES = ("sparse", "dense_ds")  # modes run on the sparse kernel, with indices

SGL_MODULE = "flash_mla"  # the sgl-flash-mla wheel (or DeepSeek's own package)
VLLM_INTERFACE = "vllm.third_party.flashmla.flash_mla_interface"
OLD_VLLM_INTERFACE = "vllm.attention.ops.flashmla"
INTERFACE_MODULES = (SGL_MODULE, VLLM_INTERFACE, OLD_VLLM_INTERFACE)
FP8_EXTENSION_MODULE = "vllm._flashmla_extension_C"
FP8_EXTENSION_OPS = ("fwd_kvcache_mla_fp8", "get_mla_decoding_metadata_dense_fp8")


# ----------------------------------------------------------------------------- providers

def sched_meta_class(module: Any) -> Optional[type]:
    """The module's ``FlashMLASchedMeta`` (the 2026 interface's schedule holder), or None. vLLM's build defines
    it in the interface module itself; the ``flash_mla`` packages (sgl-flash-mla, DeepSeek's) do not export it
    from ``__init__`` but define it in ``flash_mla.flash_mla_interface``, and ``flash_mla_with_kvcache``
    asserts ``isinstance`` of exactly that class."""
    cls = getattr(module, "FlashMLASchedMeta", None)
    if cls is not None:
        return cls
    interface = getattr(module, "flash_mla_interface", None)  # set on the package by its own import
    if interface is None and hasattr(module, "__path__"):
        try:
            interface = importlib.import_module(f"{module.__name__}.flash_mla_interface")
        except Exception:  # noqa: BLE001 - no such submodule: not the 2026 interface
            interface = None
    return getattr(interface, "FlashMLASchedMeta", None)


class Provider:
    """One source of FlashMLA kernels.

    ``modes``: which of ``MODES`` it runs; ``hoists_metadata``: it makes the split-KV schedule on the
    device without running attention (else only a kernel call makes it); ``origin``: where it was loaded
    from (version and directory, for ``python -m mla_inductor.info``).
    """

    modes: frozenset = frozenset()
    hoists_metadata: bool = True

    def __init__(self, name: str, module: Any):
        self.name = name
        self.module = module
        self.sched_meta = sched_meta_class(module)  # the 2026 interface's schedule holder (None: legacy)

    @property
    def origin(self) -> str:
        top = sys.modules.get(self.name.split(".")[0], self.module)
        version = getattr(top, "__version__", None)
        path = getattr(self.module, "__file__", None)
        return self.name + (f" {version}" if version else "") + (f" ({os.path.dirname(path)})" if path else "")

    def metadata(self, mode: str, q: Tensor, kcache: Tensor, block_table: Tensor, seq_lens: Tensor,
                 softmax_scale: float, causal: bool, indices: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        """(tile_scheduler_metadata, num_splits) for this call's seq_lens and shapes, on the stream."""
        raise NotImplementedError

    def attend(self, mode: str, q: Tensor, kcache: Tensor, block_table: Tensor, seq_lens: Tensor,
               softmax_scale: float, causal: bool, indices: Optional[Tensor], md: Optional[Tensor],
               splits: Optional[Tensor], q_descale: Optional[Tensor] = None,
               k_descale: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """FlashMLA's call: q [B, Q, H, 576] (e4m3 for dense_fp8), kcache [P, 64, 1, D] -> (out [B, Q, H, 512],
        lse [B, H, Q], md, splits). ``md``/``splits`` None: the metadata is made here (on the stream) and
        returned, so a caller can hand it to later calls over the same seq_lens."""
        if md is None:
            md, splits = self.metadata(mode, q, kcache, block_table, seq_lens, softmax_scale, causal, indices)
        out, lse = self.run_kernel(mode, q, kcache, block_table, seq_lens, softmax_scale, causal, indices, md, splits,
                                   q_descale, k_descale)
        return out, lse, md, splits

    def run_kernel(self, mode, q, kcache, block_table, seq_lens, softmax_scale, causal, indices, md, splits,
                   q_descale, k_descale) -> tuple[Tensor, Tensor]:
        """The attention kernel on the schedule ``md``/``splits`` -> (out, lse): what ``attend`` calls once
        the schedule is made (a provider that cannot make it without attention overrides ``attend``)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, modes={sorted(self.modes)})"


def _sparse_lengths(seq_lens: Tensor, indices: Tensor) -> Tensor:
    """What a sparse schedule is made from: every sequence attends to its K listed slots (-1 included),
    so the scheduler sees K keys per sequence however long the sequence is."""
    return torch.full_like(seq_lens, indices.shape[-1])


class SglFlashMLA(Provider):
    """``flash_mla`` from the sgl-flash-mla wheel: upstream FlashMLA plus the SM90 kernels upstream dropped,
    reached with ``use_legacy=True``, and ``get_mla_decoding_metadata`` making every mode's schedule on the
    device (assigned onto a fresh ``FlashMLASchedMeta`` for the kernel call)."""

    modes = frozenset(MODES)

    def attend(self, mode, q, kcache, block_table, seq_lens, softmax_scale, causal, indices, md, splits,
               q_descale=None, k_descale=None):
        """As ``Provider.attend``; a dense bf16/fp16 call given no schedule hands the kernel call an empty
        ``FlashMLASchedMeta``, which the legacy dense kernel fills on the stream (the library's own default):
        one library call instead of two, the host time of a graph holding one decode call. The other modes
        schedule first (dense fp8 must; the sparse kernel's schedule counts K keys per sequence, ``metadata``)."""
        if md is None and mode != "dense":
            md, splits = self.metadata(mode, q, kcache, block_table, seq_lens, softmax_scale, causal, indices)
        meta = self.sched_meta()
        out, lse = self._call(mode, meta, q, kcache, block_table, seq_lens, softmax_scale, causal, indices, md,
                              splits, q_descale, k_descale)
        return out, lse, meta.tile_scheduler_metadata, meta.num_splits

    def metadata(self, mode, q, kcache, block_table, seq_lens, softmax_scale, causal, indices):
        B, Q, H, _ = q.shape
        if mode in SPARSE_KERNEL_MODES:
            md, splits = self.module.get_mla_decoding_metadata(_sparse_lengths(seq_lens, indices), Q * H, 1, H, True,
                                                               indices.shape[-1], use_legacy=True)
        else:
            md, splits = self.module.get_mla_decoding_metadata(seq_lens, Q * H, 1, H, mode == "dense_fp8", None,
                                                               use_legacy=True)
        return md, splits

    def _call(self, mode, meta, q, kcache, block_table, seq_lens, softmax_scale, causal, indices, md, splits,
              q_descale, k_descale):
        """``flash_mla_with_kvcache`` on ``meta`` holding ``md``/``splits`` (None: the call makes them and leaves
        them in ``meta``) -> (out, lse)."""
        meta.tile_scheduler_metadata, meta.num_splits = md, splits
        kwargs = dict(softmax_scale=softmax_scale, causal=causal, use_legacy=True)
        if mode in SPARSE_KERNEL_MODES:
            kwargs.update(is_fp8_kvcache=True, indices=indices)
            block_table = seq_lens = None
        elif mode == "dense_fp8":
            kwargs.update(is_fp8_kvcache=True, descale_q=q_descale, descale_k=k_descale)
        return self.module.flash_mla_with_kvcache(q, kcache, block_table, seq_lens, HEAD_DIM_V, meta, None,
                                                  **kwargs)[:2]


class SchedMetaFlashMLA(Provider):
    """The 2026 interface (vLLM's build, DeepSeek's package of that time): ``FlashMLASchedMeta``, whose
    schedule only a kernel call makes (an empty one is filled in by the call; one holding tensors is used)."""

    modes = frozenset({"dense", "sparse", "dense_ds"})
    hoists_metadata = False

    def metadata(self, mode, q, kcache, block_table, seq_lens, softmax_scale, causal, indices):
        meta = self.sched_meta()
        self._call(mode, q, kcache, block_table, seq_lens, softmax_scale, causal, indices, meta)
        return meta.tile_scheduler_metadata, meta.num_splits

    def attend(self, mode, q, kcache, block_table, seq_lens, softmax_scale, causal, indices, md, splits,
               q_descale=None, k_descale=None):
        meta = self.sched_meta()
        if md is not None:
            # A fresh FlashMLASchedMeta holding tensors: the wrapper builds its config from this call
            # and hands the tensors to the kernel, which then skips making metadata.
            meta.tile_scheduler_metadata, meta.num_splits = md, splits
        out, lse = self._call(mode, q, kcache, block_table, seq_lens, softmax_scale, causal, indices, meta)
        # Without tensors the kernel call made the metadata and left it in ``meta``.
        return out, lse, meta.tile_scheduler_metadata, meta.num_splits

    def _call(self, mode, q, kcache, block_table, seq_lens, softmax_scale, causal, indices, meta):
        kwargs = dict(softmax_scale=softmax_scale, causal=causal)
        if mode in SPARSE_KERNEL_MODES:
            kwargs.update(is_fp8_kvcache=True, indices=indices)
        return self.module.flash_mla_with_kvcache(q, kcache, block_table, seq_lens, HEAD_DIM_V, meta, None,
                                                  **kwargs)[:2]


class LegacyFlashMLA(Provider):
    """The legacy interface (FlashMLA before 2026, older vLLM): ``get_mla_metadata`` returns the schedule
    tensors; with a ``topk`` parameter (FlashMLA >= Sep 2025) it also schedules sparse decodes."""

    hoists_metadata = True

    def __init__(self, name: str, module: Any, sparse: bool):
        super().__init__(name, module)
        self.modes = frozenset({"dense", "sparse", "dense_ds"} if sparse else {"dense"})

    def metadata(self, mode, q, kcache, block_table, seq_lens, softmax_scale, causal, indices):
        B, Q, H, _ = q.shape
        if mode in SPARSE_KERNEL_MODES:
            md, splits = self.module.get_mla_metadata(_sparse_lengths(seq_lens, indices), Q * H, 1, num_heads_q=H,
                                                      is_fp8_kvcache=True, topk=indices.shape[-1])
        else:
            md, splits = self.module.get_mla_metadata(seq_lens, Q * H, 1)
        return md, splits

    def run_kernel(self, mode, q, kcache, block_table, seq_lens, softmax_scale, causal, indices, md, splits,
                   q_descale, k_descale):
        kwargs = dict(softmax_scale=softmax_scale, causal=causal)
        if mode in SPARSE_KERNEL_MODES:
            kwargs.update(is_fp8_kvcache=True, indices=indices)
        return self.module.flash_mla_with_kvcache(q, kcache, block_table, seq_lens, HEAD_DIM_V, md, splits,
                                                  **kwargs)[:2]


class FP8ExtensionFlashMLA(Provider):
    """vLLM's dense FP8 extension (``torch.ops._flashmla_extension_C``): dense_fp8 only, with a metadata op."""

    modes = frozenset({"dense_fp8"})

    def __init__(self, name: str, module: Any, ops: Any):
        super().__init__(name, module)
        self.ops = ops

    def metadata(self, mode, q, kcache, block_table, seq_lens, softmax_scale, causal, indices):
        B, Q, H, _ = q.shape
        md, splits = self.ops.get_mla_decoding_metadata_dense_fp8(seq_lens, Q * H, 1)
        return md, splits

    def run_kernel(self, mode, q, kcache, block_table, seq_lens, softmax_scale, causal, indices, md, splits,
                   q_descale, k_descale):
        return self.ops.fwd_kvcache_mla_fp8(q, kcache, HEAD_DIM_V, seq_lens, block_table, softmax_scale, causal,
                                            md, splits, q_descale, k_descale)[:2]


@dataclass(frozen=True)
class Providers:
    """What ``find_providers`` found, in the order tried, and what failed (one line per module)."""

    found: tuple[Provider, ...] = ()
    tried: str = ""

    def for_mode(self, mode: str) -> Optional[Provider]:
        """The first provider running ``mode``, or None."""
        return next((p for p in self.found if mode in p.modes), None)

    def covered(self) -> frozenset:
        return frozenset().union(*(p.modes for p in self.found)) if self.found else frozenset()

    def summary(self) -> str:
        """Where each mode's kernel comes from, e.g. ``dense bf16/fp16, ...: flash_mla 1.0.0 (/path)``."""
        by_provider: dict[Provider, list[str]] = {}
        for mode in MODES:
            provider = self.for_mode(mode)
            if provider is not None:
                by_provider.setdefault(provider, []).append(MODE_NAMES[mode])
        return "; ".join(f"{', '.join(modes)} from {p.origin}" for p, modes in by_provider.items())


def _import(name: str, tried: list[str]):
    try:
        return importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - a broken install is as unusable as a missing one
        tried.append(f"{name}: {type(e).__name__}: {e}")
        return None


def _parameters(fn) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: assume the oldest interface
        return ()


def interface_provider(name: str, module: Any, tried: list[str]) -> Optional[Provider]:
    """The provider an interface module makes, its API style read from what it defines; None (and a line
    in ``tried``) when it has no usable decode."""
    decode, metadata = getattr(module, "flash_mla_with_kvcache", None), getattr(module, "get_mla_metadata", None)
    if not callable(decode) or not callable(metadata):
        tried.append(f"{name}: has no flash_mla_with_kvcache/get_mla_metadata")
        return None
    sched_meta = sched_meta_class(module)
    if "use_legacy" in _parameters(decode) and callable(getattr(module, "get_mla_decoding_metadata", None)):
        has_legacy = getattr(module, "has_legacy", None)
        if callable(has_legacy) and not has_legacy():
            tried.append(f"{name}: built without its legacy (SM90, V3.2-format) kernels")
            return None
        if sched_meta is None:
            tried.append(f"{name}: has use_legacy but no FlashMLASchedMeta (in {name}.flash_mla_interface)")
            return None
        return SglFlashMLA(name, module)
    if sched_meta is not None:
        return SchedMetaFlashMLA(name, module)
    return LegacyFlashMLA(name, module, sparse="topk" in _parameters(metadata))


def fp8_extension_provider(tried: list[str]) -> Optional[Provider]:
    module = _import(FP8_EXTENSION_MODULE, tried)
    if module is None:
        return None
    ops = getattr(torch.ops, "_flashmla_extension_C", None)
    if ops is None or not all(hasattr(ops, n) for n in FP8_EXTENSION_OPS):
        tried.append(f"{FP8_EXTENSION_MODULE}: imported but registers no dense FP8 ops")
        return None
    return FP8ExtensionFlashMLA(FP8_EXTENSION_MODULE, module, ops)


@functools.cache
def find_providers() -> Providers:
    """The installed providers, first choice first: ``flash_mla`` (sgl-flash-mla), then vLLM's build (its
    interface, then its FP8 extension), then older vLLM. A later one is imported only while some mode
    has no provider yet (importing vLLM costs seconds). Cached; imports the libraries."""
    tried: list[str] = []
    found: list[Provider] = []
    candidates = [(name, functools.partial(_interface_from_module, name)) for name in INTERFACE_MODULES[:2]]
    candidates.append((FP8_EXTENSION_MODULE, fp8_extension_provider))
    candidates.append((OLD_VLLM_INTERFACE, functools.partial(_interface_from_module, OLD_VLLM_INTERFACE)))
    for _, make in candidates:
        if Providers(tuple(found)).covered() >= frozenset(MODES):
            break
        provider = make(tried)
        if provider is not None and not provider.modes <= Providers(tuple(found)).covered():
            found.append(provider)
    return Providers(tuple(found), "; ".join(tried))


def _interface_from_module(name: str, tried: list[str]) -> Optional[Provider]:
    module = _import(name, tried)
    return None if module is None else interface_provider(name, module, tried)


# ----------------------------------------------------------------------------- argument marshalling

def decode_mode(cache_format: str, sparse: bool) -> Optional[str]:
    if sparse:
        return "sparse" if cache_format == "fp8_ds_mla" else None
    return {"bf16": "dense", "fp16": "dense", "fp8_e4m3": "dense_fp8", "fp8_ds_mla": "dense_ds"}.get(cache_format)


def _mode_of(kv_cache: Tensor, sparse_indices: Optional[Tensor]) -> str:
    fmt = cache_format(kv_cache)
    mode = decode_mode(fmt, sparse_indices is not None)
    if mode is None:
        raise ValueError(f"mla_flashmla.decode: kv_cache of format {fmt} is not supported "
                         f"{'with' if sparse_indices is not None else 'without'} sparse_indices")
    return mode


def row_counts(kv_cache: Tensor, seq_lens: Tensor, num_rows: int, sparse_indices: Optional[Tensor]) -> Tensor:
    """int32 [T]: keys row ``b*Q + j`` sees (0: the row is finished with out 0, lse -inf)."""
    return visible_key_counts(seq_lens, num_rows, sparse_indices, kv_cache.shape[0] * kv_cache.shape[1])


def dense_index_width(max_pages: int, page_size: int) -> int:
    """K of ``dense_slot_indices``: the block table's capacity rounded up to a multiple of 64 (the sparse
    kernels read indices in blocks of 64)."""
    capacity = max_pages * page_size
    return capacity + (-capacity % TOPK_BLOCK)


def dense_slot_indices(block_table: Tensor, seq_lens: Tensor, page_size: int, num_rows: int) -> Tensor:
    """A dense call as a sparse one: int32 [T, K], row ``b*Q + j`` listing the cache slots
    (``page * page_size + offset``) of positions ``0 .. seq_lens[b] - Q + j`` in order, then -1
    (K = ``dense_index_width``). Plain torch on the device, no host sync; entries past a sequence's length
    (garbage or -1 in the block table included) are never looked up as slots. On a GPU, plans use
    ``kernels.slot_indices`` (one launch instead of about a dozen); this is its reference."""
    B, max_pages = block_table.shape
    Q = num_rows // max(B, 1)  # B = 0: no rows
    K = dense_index_width(max_pages, page_size)
    device = block_table.device
    # unsqueeze rather than indexing with None: fake CUDA tensors take no Python indexing in a CPU-only build.
    positions = torch.arange(K, device=device, dtype=torch.int32)
    page_of = (positions // page_size).clamp_max(max_pages - 1).long()
    pages = block_table.gather(1, page_of.unsqueeze(0).expand(B, K))  # [B, K]
    slots = (pages * page_size + positions % page_size).unsqueeze(1)  # [B, 1, K]
    last = seq_lens.unsqueeze(1) - Q + torch.arange(Q, device=device, dtype=torch.int32)  # [B, Q]: last visible
    visible = positions.view(1, 1, K) <= last.unsqueeze(2)  # [B, Q, K]
    return torch.where(visible, slots, -1).reshape(num_rows, K).to(torch.int32)


def _plan_slot_indices(block_table: Tensor, seq_lens: Tensor, page_size: int, num_rows: int) -> Tensor:
    """``dense_slot_indices`` as a plan makes it: one kernel on a GPU."""
    if not block_table.is_cuda:
        return dense_slot_indices(block_table, seq_lens, page_size, num_rows)
    from mla_inductor.kernels.slot_indices import dense_slot_indices_kernel

    return dense_slot_indices_kernel(block_table, seq_lens, page_size, num_rows,
                                     dense_index_width(block_table.shape[1], page_size))


def kernel_tensors(mode: str, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                   sparse_indices: Optional[Tensor], num_rows: int = 0) -> list[Tensor]:
    """What the kernel reads instead of the caller's tensors (the plan's tail, or made per call):

    - dense: ``[block_table]`` with unused entries (-1 included) clamped into the cache, so no negative
      page id is ever followed;
    - dense_fp8: that table and ``seq_lens`` clamped to >= 1: the FP8 kernel (pre-2026 FlashMLA) faults
      on a sequence of length 0 (illegal address, H100); the row is finished afterwards anyway;
    - sparse: ``[]``, or ``sparse_indices`` padded with -1 to a multiple of 64 (the kernels load top-k in
      blocks of 64 and assert ``topk % 64 == 0``);
    - dense_ds: ``[dense_slot_indices(...)]`` for the ``num_rows`` query rows (one kernel on a GPU).
    """
    if mode == "sparse":
        pad = -sparse_indices.shape[-1] % TOPK_BLOCK
        return [torch.nn.functional.pad(sparse_indices, (0, pad), value=-1)] if pad else []
    if mode == "dense_ds":
        return [_plan_slot_indices(block_table, seq_lens, kv_cache.shape[1], num_rows)]
    table = clamp_pages(block_table, kv_cache.shape[0])
    return [table, kernel_lengths(seq_lens)] if mode == "dense_fp8" else [table]


def _kernel_query(q_nope: Tensor, q_pe: Tensor, B: int) -> Tensor:
    """[T, H, 512] | [T, H, 64] -> [B, Q, H, 576]: a view when the two are slices of one [.., 576] row
    (the usual model layout: no copy), else a concatenated copy."""
    T, H, L = q_nope.shape
    R = q_pe.shape[-1]
    stride = q_nope.stride()
    if (stride == q_pe.stride() and stride[-1] == 1 and (H == 1 or stride[1] >= L + R)
            and q_pe.data_ptr() == q_nope.data_ptr() + L * q_nope.element_size() and _same_storage(q_nope, q_pe)):
        Q = T // B
        return q_nope.as_strided((B, Q, H, L + R), (Q * stride[0], stride[0], stride[1], 1))
    return torch.cat([q_nope, q_pe], dim=-1).view(B, T // B, H, L + R)


def _same_storage(a: Tensor, b: Tensor) -> bool:
    # Views of one tensor share their ``_base`` (an attribute read); otherwise compare the storages.
    base = a._base
    return (base is not None and base is b._base) or a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _causal(mode: str, q: Tensor) -> bool:
    # The sparse kernel takes no causal flag: dense_ds writes causality into its indices.
    return mode not in SPARSE_KERNEL_MODES and q.shape[1] > 1


def _provider(mode: str) -> Provider:
    providers = find_providers()
    provider = providers.for_mode(mode)
    if provider is None:
        raise RuntimeError(f"mla_flashmla.decode: no installed FlashMLA provider has the {MODE_NAMES[mode]} kernel "
                           f"(found: {providers.summary() or 'none'}; tried: {providers.tried or 'nothing'})")
    return provider


def _unpack(mode, block_table, seq_lens, sparse_indices, tensors, B, Q):
    """(block_table, seq_lens, indices [B, Q, K]) the kernel reads, from ``kernel_tensors``'s list."""
    if mode in SPARSE_KERNEL_MODES:
        idx = tensors[0] if tensors else sparse_indices
        return block_table, seq_lens, idx.view(B, Q, idx.shape[-1])
    return tensors[0], tensors[1] if mode == "dense_fp8" else seq_lens, None


# Whether the kernel itself writes out = 0 for a row that sees nothing (measured on H100 with a NaN-poisoned
# allocator; lse is +inf there and is always rewritten). Where it does, masking ``out`` would be a wasted pass.
# The FP8 kernel is fed seq_lens >= 1, so its empty rows hold real (unwanted) attention output.
KERNEL_ZEROES_EMPTY_ROWS = {"dense": True, "dense_fp8": False, "sparse": True, "dense_ds": True}


def plan_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices=None):
    """The plan: ``[tile_scheduler_metadata, num_splits, row_counts int32 [T], *kernel_tensors(...)]``.
    Reads only the shapes of q_nope / q_pe (the pass hands it the e4m3 query's slices for dense_fp8)."""
    mode = _mode_of(kv_cache, sparse_indices)
    B, T = block_table.shape[0], q_nope.shape[0]
    q = _kernel_query(q_nope, q_pe, B)
    provider = _provider(mode)
    tensors = kernel_tensors(mode, kv_cache, block_table, seq_lens, sparse_indices, T)
    table, lens, indices = _unpack(mode, block_table, seq_lens, sparse_indices, tensors, B, T // B)
    md, splits = provider.metadata(mode, q, kv_cache.unsqueeze(2), table, lens, softmax_scale, _causal(mode, q),
                                   indices)
    return [md, splits, row_counts(kv_cache, seq_lens, T, sparse_indices)] + tensors


def attend_rows(q: Tensor, q_descale: Optional[Tensor], kv_cache, block_table, seq_lens, softmax_scale, kv_scale,
                sparse_indices, plan, out_dtype: torch.dtype, need_lse: bool = True,
                mode: Optional[str] = None, keep_plan: bool = True) -> tuple[Tensor, Optional[Tensor], list[Tensor]]:
    """FlashMLA decode of one layer on the kernel's query ``q [B, Q, H, 576]`` (e4m3 with ``q_descale`` for
    dense_fp8): (out [T, H, 512] in ``out_dtype``, lse [T, H] fp32 natural log, the plan it ran with).
    With ``plan == []`` the call schedules itself and returns that schedule as a plan, which later layers
    over the same block_table / seq_lens can reuse. ``need_lse=False``: lse is None and no epilogue runs
    where the kernel already zeroes the rows that see nothing (dense bf16/fp16, sparse, dense_ds): out is
    then FlashMLA's own output, viewed. ``mode``: the call's (``_mode_of``), where the caller knows it.
    ``keep_plan=False``: the caller discards the plan (a call planning for itself alone): the row counts are
    then made only where the epilogue reads them, and the plan returned is ``[]``."""
    mode = mode or _mode_of(kv_cache, sparse_indices)
    provider = _provider(mode)
    B, Q, H, _ = q.shape
    T = B * Q
    if plan:
        md, splits, counts, tensors = plan[0], plan[1], plan[2], plan[3:]
    else:
        md = splits = None
        # A kernel launch: made here only for a plan that is kept or an epilogue that reads it (below).
        counts = row_counts(kv_cache, seq_lens, T, sparse_indices) if keep_plan else None
        tensors = kernel_tensors(mode, kv_cache, block_table, seq_lens, sparse_indices, T)
    table, lens, indices = _unpack(mode, block_table, seq_lens, sparse_indices, tensors, B, Q)
    (kcache,) = VIEWS.get(kv_cache, _HEAD_AXIS, _with_head_axis)
    out, lse, md, splits = provider.attend(mode, q, kcache, table, lens, softmax_scale,
                                           _causal(mode, q), indices, md, splits, q_descale,
                                           kv_scale if mode == "dense_fp8" else None)
    out = out.reshape(T, H, HEAD_DIM_V)
    if out.dtype != out_dtype:
        out = out.to(out_dtype)
    plan = plan or ([md, splits, counts] + tensors if keep_plan else [])
    zero_out = not KERNEL_ZEROES_EMPTY_ROWS[mode]
    if not need_lse and not zero_out:
        return out, None, plan
    if counts is None:
        counts = row_counts(kv_cache, seq_lens, T, sparse_indices)
    # lse [B, H, Q] -> [T, H] with -inf for empty rows (and out 0 there where the kernel leaves garbage).
    lse_out = torch.empty((T, H), dtype=torch.float32, device=lse.device) if need_lse else None
    if out.is_cuda and out.is_contiguous():  # one launch
        from mla_inductor.kernels.empty_rows import finish_rows

        finish_rows(out, lse_out, counts, lse_src=lse.transpose(1, 2), zero_out=zero_out)
    else:
        if need_lse:
            minus_inf = torch.full((), float("-inf"), dtype=torch.float32, device=lse.device)
            torch.where((counts > 0).view(B, Q, 1), lse.transpose(1, 2), minus_inf, out=lse_out.view(B, Q, H))
        if zero_out:
            out = out.masked_fill((counts == 0)[:, None, None], 0)
    return out, lse_out, plan


def decode_and_plan(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices,
                    plan, need_lse: bool = True, q_scale: Optional[Tensor] = None, mode: Optional[str] = None,
                    keep_plan: bool = True):
    """``attend_rows`` on the contract's query: q_nope | q_pe as FlashMLA's q (a view where they are slices
    of one row), quantized to e4m3 on the device for dense_fp8 (with ``q_scale`` when given, else its
    measured amax). ``mode`` / ``keep_plan``: as ``attend_rows``'s."""
    q = _kernel_query(q_nope, q_pe, block_table.shape[0])
    q_descale = None
    mode = mode or _mode_of(kv_cache, sparse_indices)
    if mode == "dense_fp8":
        q, q_descale = quantize_query_fp8(q, q_scale)
    return attend_rows(q, q_descale, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices, plan,
                       q_nope.dtype, need_lse, mode, keep_plan)


# The last plan made by an eager call, reused by the next eager calls
# over the same block_table / seq_lens / sparse_indices and shapes: one schedule per step however it is split.
PLANS = PlanCache("flashmla")


def eager_plan_config(q_nope, kv_cache, block_table, sparse_indices) -> tuple:
    """What a plan stored in ``PLANS`` is made for besides the tensors it reads: the call's static shapes."""
    return (q_nope.shape, q_nope.dtype, kv_cache.shape, kv_cache.dtype, block_table.shape, q_nope.device,
            None if sparse_indices is None else sparse_indices.shape)


def decode_reusing_plans(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices,
                         need_lse: bool = True, q_scale: Optional[Tensor] = None, config: Optional[tuple] = None,
                         mode: Optional[str] = None):
    """``decode_and_plan`` for a call given no plan: it takes the plan ``PLANS`` holds for these tensors (the
    schedule, row counts and kernel tensors: three or four small kernels and the metadata call fewer) or makes
    one and stores it. While a CUDA graph is captured the call reads and stores only plans made during that
    capture (``plans_shared_in_capture``; outside it, it plans inline and stores nothing): its replays must
    recompute the plan from the lengths they see. Returns ``(out, lse or None)``. ``config`` / ``mode``:
    ``eager_plan_config(...)`` and the call's mode, where the caller has them already (eager: per signature)."""
    capturing = being_captured(q_nope)
    config = config or eager_plan_config(q_nope, kv_cache, block_table, sparse_indices)
    stored = PLANS.get(config, block_table, seq_lens, sparse_indices, captured=capturing)
    out, lse, plan = decode_and_plan(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale,
                                     sparse_indices, stored or [], need_lse, q_scale, mode,
                                     keep_plan=PLANS.keeps(capturing))
    if stored is None:
        PLANS.put(config, block_table, seq_lens, sparse_indices, plan, captured=capturing)
    return out, lse


def run_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices, plan):
    """FlashMLA decode of one layer: (out [T, H, 512] in q's dtype, lse [T, H] fp32, natural log). A compiled
    call given no plan plans inline and keeps nothing: under CUDA graphs (cudagraph trees) a plan stored past
    the call would be memory of the graph's pool that no output accounts for. The exception: a call captured
    inside ``plans_shared_in_capture`` (a step captured whole by its caller) shares the capture's plans."""
    if not plan and _shares_captured_plans(q_nope):
        return decode_reusing_plans(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale,
                                    sparse_indices)
    return decode_and_plan(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices,
                           plan, keep_plan=False)[:2]


def _shares_captured_plans(q_nope: Tensor) -> bool:
    """Whether a compiled call given no plan takes its plan from the capture's (``plans_shared_in_capture``)."""
    return PLANS.keeps(captured=True) and being_captured(q_nope)


def decode_quantized_query(q, q_descale, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices,
                           plan, out_dtype):
    """dense_fp8 on a query the caller quantized: q [T, H, 576] float8_e4m3fn with its descale [1] fp32
    (one scale for latent and rope) -> (out [T, H, 512] in ``out_dtype``, lse [T, H] fp32)."""
    if q.dtype != torch.float8_e4m3fn or q.shape[-1] != HEAD_DIM:
        raise TypeError(f"mla_flashmla.decode_quantized_query: q must be [T, H, {HEAD_DIM}] float8_e4m3fn, got "
                        f"{q.dtype} {tuple(q.shape)}")
    B = block_table.shape[0]
    kernel_q = q.reshape(B, q.shape[0] // B, q.shape[1], HEAD_DIM)
    return attend_rows(kernel_q, q_descale, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices,
                       plan, out_dtype, keep_plan=False)[:2]


# ----------------------------------------------------------------------------- the ops

@functools.cache
def metadata_shape(provider: Optional[Provider], mode: str, device: torch.device, H: int, Q: int,
                   q_dtype: torch.dtype, kv_dtype: torch.dtype) -> tuple[int, int]:
    """tile_scheduler_metadata's shape ``(num_sm_parts, M)``: it depends on the GPU's SM count, H, Q and
    the FlashMLA build (``provider``, the one ``mode`` runs on now), never on B, seq_lens or top-k, so it is
    measured once on a one-sequence problem (the fake impl needs it; a CUDA call at compile time, never in
    ``supports``)."""
    with real_tensors():
        width = 656 if mode in SPARSE_KERNEL_MODES else HEAD_DIM
        q_nope = torch.zeros(Q, H, HEAD_DIM_V, dtype=q_dtype, device=device)
        q_pe = torch.zeros(Q, H, HEAD_DIM - HEAD_DIM_V, dtype=q_dtype, device=device)
        kv_cache = torch.zeros(1, PAGE_SIZE, width, dtype=kv_dtype, device=device)
        table = torch.zeros(1, 1, dtype=torch.int32, device=device)
        lens = torch.full((1,), Q, dtype=torch.int32, device=device)
        indices = None if mode != "sparse" else torch.zeros(Q, TOPK_BLOCK, dtype=torch.int32, device=device)
        one = torch.ones(1, dtype=torch.float32, device=device)
        md = plan_decode(q_nope, q_pe, kv_cache, table, lens, 1.0, one, indices)[0]
        return tuple(md.shape)


def _fake_plan(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices=None):
    mode = _mode_of(kv_cache, sparse_indices)
    T, H, _ = q_nope.shape
    # The schedule never depends on the query's dtype: an e4m3 query (dense_fp8's plan) is measured as bf16.
    q_dtype = torch.bfloat16 if q_nope.dtype.itemsize == 1 else q_nope.dtype
    q_per_seq = int(T // max(block_table.shape[0], 1)) or 1  # an empty batch (B = 0) plans as Q = 1
    parts, width = metadata_shape(find_providers().for_mode(mode), mode, q_nope.device, int(H), q_per_seq,
                                  q_dtype, kv_cache.dtype)
    if mode == "dense_ds":  # (the GPU's kernel takes no fake tensors)
        tensors = [q_nope.new_empty((T, dense_index_width(block_table.shape[1], kv_cache.shape[1])),
                                    dtype=torch.int32)]
    else:
        tensors = kernel_tensors(mode, kv_cache, block_table, seq_lens, sparse_indices, T)
    return [
        q_nope.new_empty((parts, width), dtype=torch.int32),
        q_nope.new_empty((block_table.shape[0] + 1,), dtype=torch.int32),
        q_nope.new_empty((T,), dtype=torch.int32),
    ] + tensors


def _decode_and_plan_list(*args) -> list[Tensor]:
    """The first layer of a forward: ``[out, lse, *plan]``, its decode and the schedule it made for
    itself (``mla_flashmla::plan``'s result), which the later layers take. The 2026 interface builds the
    schedule inside the kernel call, so this is how a forward gets it without an extra attention."""
    out, lse, plan = decode_and_plan(*args, [])
    return [out, lse] + plan


def _decode_out(*args) -> Tensor:
    """``mla_flashmla::decode`` for a call whose lse nobody reads (``mla.paged_decode``): out only, with no
    epilogue kernel where FlashMLA's output is already the contract's (dense bf16/fp16, sparse, dense_ds).
    A dense call handed its plan (every compiled call but a graph's first) goes straight to the kernel call."""
    q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, _, sparse_indices, plan = args
    mode = _mode_of(kv_cache, sparse_indices)
    if plan and mode == "dense":
        return _attend_dense(_provider(mode), q_nope, q_pe, kv_cache, block_table.shape[0], seq_lens,
                             softmax_scale, plan)
    if not plan and _shares_captured_plans(q_nope):  # (see run_decode)
        return decode_reusing_plans(*args[:8], need_lse=False, mode=mode)[0]
    return decode_and_plan(*args, need_lse=False, mode=mode, keep_plan=False)[0]


_HEAD_AXIS = "head axis"


def _with_head_axis(kv_cache: Tensor) -> tuple[Tensor]:
    """The cache as FlashMLA reads it, [P, page, 1, D] (one KV head): kept per cache tensor (``VIEWS``)."""
    return (kv_cache.unsqueeze(2),)


def _attend_dense(provider: Provider, q_nope, q_pe, kv_cache, B: int, seq_lens, softmax_scale, plan) -> Tensor:
    """out [T, H, 512] of a dense (bf16/fp16 cache) call on ``plan`` ([schedule, splits, row counts, clamped
    table]): one kernel call, which zeroes the rows that see nothing itself."""
    T, H, L = q_nope.shape
    q = _kernel_query(q_nope, q_pe, B)
    (kcache,) = VIEWS.get(kv_cache, _HEAD_AXIS, _with_head_axis)
    out = provider.attend("dense", q, kcache, plan[3], seq_lens, softmax_scale, _causal("dense", q), None, plan[0],
                          plan[1])[0]
    return out.view(T, H, L)


# plan: FlashMLA's schedule for one forward, [tile_scheduler_metadata int32 [num_sm_parts, M], num_splits int32
# [B + 1], row_counts int32 [T]] plus kernel_tensors (the clamped block table and lengths, or the indices);
# no host sync. decode: the contract's arguments and the plan (or [], plan inline) -> (out [T, H, 512] in q's
# dtype, lse fp32).
PLAN_OP = decode_op("mla_flashmla::plan", plan_decode, returns="tensors", takes_plan=False, fake=_fake_plan)
DECODE_OP = decode_op("mla_flashmla::decode", run_decode)
DECODE_OUT_OP = decode_op("mla_flashmla::decode_out", _decode_out, returns="out")
DECODE_AND_PLAN_OP = decode_op(
    "mla_flashmla::decode_and_plan", _decode_and_plan_list, returns="out_lse_plan", takes_plan=False,
    fake=lambda *args: list(empty_decode_outputs(args[0])) + _fake_plan(*args))

def _fake_quantized_query(q, q_descale, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices,
                          plan, out_dtype):
    T, H, _ = q.shape
    return q.new_empty((T, H, HEAD_DIM_V), dtype=out_dtype), q.new_empty((T, H), dtype=torch.float32)


# dense_fp8 on a query already in e4m3: q [T, H, 576] float8_e4m3fn, q_descale [1] fp32, then the contract's
# cache arguments, the plan and the output dtype -> (out [T, H, 512], lse [T, H] fp32).
QUANTIZED_QUERY_OP = define_op(
    "mla_flashmla::decode_quantized_query",
    "(Tensor q, Tensor q_descale, Tensor kv_cache, Tensor block_table, Tensor seq_lens, float softmax_scale, "
    "Tensor kv_scale, Tensor? sparse_indices, Tensor[] plan, ScalarType out_dtype) -> (Tensor, Tensor)",
    decode_quantized_query, _fake_quantized_query, direct=True).default


# ----------------------------------------------------------------------------- the backend

OPT_IN = ("computes with q in e4m3 (one scale per tensor: a larger error, docs/backends.md); opt in with a "
          "static q_scale on the call or mla_inductor.allow_fp8_query()")


class FlashMLABackend(Backend):
    name = "flashmla"
    libraries = ("flash_mla", "vllm")  # the sgl-flash-mla wheel (or DeepSeek's package), or vLLM's build

    def unavailable_reason(self) -> Optional[str]:
        providers = find_providers()
        return None if providers.found else (f"no FlashMLA provider is importable ({providers.tried}); install "
                                             f"one with: pip install --no-deps sgl-flash-mla")

    def loaded_from(self) -> Optional[str]:
        return find_providers().summary() or None

    def supports(self, problem: DecodeProblem, capability: Optional[tuple[int, int]]) -> Optional[str]:
        why = cuda_reason(problem, capability)
        if why:
            return why
        if (problem.kv_lora_rank, problem.rope_dim) != DEEPSEEK_DIMS:
            return (f"FlashMLA needs kv_lora_rank=512 and rope_dim=64 (head_dim 576, head_dim_v 512), "
                    f"got {problem.kv_lora_rank} and {problem.rope_dim}")
        if problem.num_heads is None or problem.q_per_seq is None:
            return "FlashMLA needs static num_heads and Q (its schedule's shape depends on them)"
        if problem.page_size != PAGE_SIZE:
            return f"FlashMLA needs page_size 64, got {problem.page_size if problem.page_size else 'a symbolic one'}"
        mode = decode_mode(problem.cache_format, problem.sparse)
        if mode is None:
            if problem.sparse:
                return f"FlashMLA sparse decode needs the fp8_ds_mla cache, got {problem.cache_format}"
            return (f"FlashMLA dense decode needs a bf16, fp16, fp8_e4m3 or fp8_ds_mla cache, got "
                    f"{problem.cache_format}")
        why = self._mode_reason(mode, problem, capability)
        if why:
            return why
        providers = find_providers()
        if providers.found and providers.for_mode(mode) is None:
            # unavailable_reason() reports a missing library; here only a provider lacking this kernel
            return (f"no installed FlashMLA provider has the {MODE_NAMES[mode]} kernel (found: "
                    f"{providers.summary()})")
        return None

    @staticmethod
    def _mode_reason(mode: str, problem: DecodeProblem, capability) -> Optional[str]:
        if mode in SPARSE_KERNEL_MODES:
            what = "sparse decode" if mode == "sparse" else "dense decode of an fp8_ds_mla cache (its sparse kernel)"
            if capability != (9, 0) and capability[0] != 10:
                return f"FlashMLA {what} needs SM90 or SM100-family GPUs, got {sm(capability)}"
            if problem.num_heads not in SPARSE_HEADS:
                return f"FlashMLA {what} needs 64 or 128 heads, got {problem.num_heads}"
            if problem.q_dtype != torch.bfloat16:
                return f"FlashMLA {what} needs bf16 queries, got {problem.q_dtype}"
            if mode == "sparse" and problem.topk is None:
                return "FlashMLA sparse decode needs a static top-k width (it is padded to a multiple of 64)"
            return None
        if capability != (9, 0):
            return f"FlashMLA dense decode needs SM90 (sm_90a, Hopper), got {sm(capability)}"
        if mode == "dense" and problem.q_dtype != cache_dtype(problem.cache_format):
            return f"FlashMLA dense decode needs queries of the cache's dtype ({problem.cache_format}), got {problem.q_dtype}"
        if mode == "dense_fp8":
            if problem.q_dtype not in (torch.bfloat16, torch.float16):
                return f"FlashMLA dense FP8 decode needs bf16 or fp16 queries, got {problem.q_dtype}"
            if not problem.fp8_query:
                return f"FlashMLA dense FP8 decode {OPT_IN}"
        return None

    def compiled_op(self):
        return DECODE_OP

    # Without a plan a call builds its own metadata; with several layers one plan serves them all.
    plan_is_optional = True

    def plan_op(self):
        return PLAN_OP

    def decode_and_plan_op(self):
        # Only for providers whose schedule a kernel call alone makes (the 2026 interface): there the first
        # layer's decode makes it for the others. With a metadata function the plan op makes it directly.
        providers = find_providers()
        lacking = [m for m in MODES if providers.for_mode(m) is not None and not providers.for_mode(m).hoists_metadata]
        return DECODE_AND_PLAN_OP if lacking else None

    def out_only_op(self):
        return DECODE_OUT_OP

    def quantized_query_op(self, problem: DecodeProblem):
        return QUANTIZED_QUERY_OP if decode_mode(problem.cache_format, problem.sparse) == "dense_fp8" else None

    @skips_empty_calls
    def decode(self, q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices):
        # An eager entry point (compiled graphs call the ops): the plan may be kept for the next eager call.
        return decode_reusing_plans(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale,
                                    sparse_indices)

    @skips_empty_calls
    def decode_with_q_scale(self, q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale,
                            sparse_indices, q_scale):
        return decode_reusing_plans(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale,
                                    sparse_indices, q_scale=q_scale)

    def eager_decode(self, problem: DecodeProblem, args: tuple, with_lse: bool, captured: bool = False):
        # mla.paged_decode reads no lse: where the kernel zeroes the rows that see nothing itself (dense
        # bf16/fp16, sparse, dense_ds) its output is the result and no epilogue kernel runs. The plan's config
        # and the mode follow from the call signature: computed once.
        q_nope, _, kv_cache, block_table, _, _, _, sparse_indices, _ = args
        config = eager_plan_config(q_nope, kv_cache, block_table, sparse_indices)
        mode = _mode_of(kv_cache, sparse_indices)

        def decode(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices, q_scale):
            out, lse = decode_reusing_plans(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale,
                                            sparse_indices, with_lse, q_scale, config, mode)
            return (out, lse) if with_lse else out

        if mode != "dense" or with_lse or captured:  # (a captured call plans inline: decode_reusing_plans)
            return decode
        return _planned_dense_call(decode, config, block_table.shape[0])


def _planned_dense_call(decode: Callable, config: tuple, B: int):
    """An eager ``mla.paged_decode`` on a bf16/fp16 cache: a call whose plan is stored (a step's calls after its
    first) goes from the plan lookup to the provider's kernel call, everything else fixed by the call signature
    (mode, provider, shapes) decided once; any other call is ``decode``'s (it plans). Not for calls made while a
    CUDA graph is captured (they plan inline: ``eager_decode``)."""
    providers = find_providers()
    provider = providers.for_mode("dense")
    if provider is None:
        return decode

    def planned(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices, q_scale):
        plan = PLANS.get(config, block_table, seq_lens, None)  # (never captured: eager_decode)
        if plan is None or find_providers() is not providers:
            return decode(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices,
                          q_scale)
        return _attend_dense(provider, q_nope, q_pe, kv_cache, B, seq_lens, softmax_scale, plan)

    return planned


BACKEND = FlashMLABackend()
