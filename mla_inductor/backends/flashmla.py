"""The FlashMLA backend: DeepSeek's FlashMLA decode kernels, from whichever provider is installed.

Three kernels, one backend (``"flashmla"``); the call's cache format picks the kernel:

===========  =====================  ==========================  ==============================================
mode         cache                  query                       kernel (GPU)
===========  =====================  ==========================  ==============================================
dense        bf16 / fp16            same dtype as the cache     dense decode (SM90 only)
dense_fp8    float8_e4m3fn          bf16 / fp16, quantized to   vLLM's dense FP8 extension (SM90 only)
                                    e4m3 per tensor on the GPU
sparse       fp8_ds_mla (656 B)     bf16                        sparse FP8 decode (SM90, SM100), H in {64, 128}
===========  =====================  ==========================  ==============================================

All need kv_lora_rank 512 and rope_dim 64 (head_dim 576, head_dim_v 512) and pages of 64 tokens.

Shapes (T = B * Q rows, H heads, P pages): our ``q_nope [T, H, 512] | q_pe [T, H, 64]`` become FlashMLA's
``q [B, Q, H, 576]``; the cache ``[P, 64, 576 or 656]`` becomes ``[P, 64, 1, 576 or 656]`` (a view);
``sparse_indices [T, K]`` becomes ``indices [B, Q, K]`` (the same slots ``page * 64 + offset``, -1
padding; a view unless K needs padding to a multiple of 64). FlashMLA returns ``out [B, Q, H, 512]`` and ``lse [B, H, Q]`` in natural log, which become
``out [T, H, 512]`` and ``lse [T, H]``. ``causal = Q > 1`` for dense calls: FlashMLA right-aligns the
queries (query j of Q sees keys ``0 .. seq_len - Q + j``), which is our contract. Rows that see nothing
(``seq_len - Q + j < 0``, or an all -1 sparse row) get lse -inf (FlashMLA writes +inf there) and out 0
(the dense and sparse kernels write 0 themselves; the FP8 extension's rows are masked on the GPU).

What the kernels get instead of the caller's tensors (``kernel_tensors``): the block table with -1
garbage clamped to page 0 (no negative page id is ever followed); for the FP8 extension also seq_lens
clamped to >= 1 (it faults on a length-0 sequence); sparse_indices padded with -1 to a multiple of 64
when K is not one (the sparse kernels assert ``topk % 64 == 0``).

Plan and run (all CUDA-graph capturable: no host sync, metadata made and read on the stream):

- ``mla_flashmla::plan`` -> ``[tile_scheduler_metadata int32 [num_sm_parts, M], num_splits int32 [B+1],
  row_counts int32 [T], *kernel_tensors]``. Legacy providers and the FP8 extension have a metadata
  function; the 2026 interface (``FlashMLASchedMeta``) makes the metadata inside the kernel call, so
  there this op runs one decode and keeps only its metadata (for callers planning by hand).
- ``mla_flashmla::decode_and_plan`` (contract's 8 arguments) -> ``[out, lse, *plan]``: a decode that
  also returns the schedule it made for itself. The Inductor pass gives it to the first layer of a
  forward and hands its plan to every later layer, so a forward makes its metadata once and never
  runs an extra attention; a forward with one call gets a plain decode with an empty plan.
- ``mla_flashmla::decode`` (contract's 8 arguments + ``plan``) -> ``(out, lse)``. With an empty plan it
  makes everything itself (the eager path).

Providers (found lazily, first that imports wins; nothing is imported by ``import mla_inductor``):
``flash_mla`` (DeepSeek's package, 2026 ``FlashMLASchedMeta`` interface or the legacy tensor metadata
one, which ``sgl-flash-mla`` also ships), ``vllm.third_party.flashmla.flash_mla_interface`` (vLLM's
build), ``vllm.attention.ops.flashmla`` (older vLLM, legacy interface); the dense FP8 kernel comes from
``vllm._flashmla_extension_C`` only.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Optional

import torch

from mla_inductor._compat import real_tensors
from mla_inductor.backends import Backend
from mla_inductor.backends._common import (
    DEEPSEEK_DIMS,
    clamp_pages,
    cuda_reason,
    decode_op,
    kernel_lengths,
    quantize_query_fp8,
    sm,
    visible_key_counts,
)
from mla_inductor.cache import cache_dtype, cache_format
from mla_inductor.contract import DecodeProblem, empty_decode_outputs

Tensor = torch.Tensor

HEAD_DIM_V = 512  # FlashMLA's only value width (kv_lora_rank)
HEAD_DIM = 576  # latent 512 + rope 64
PAGE_SIZE = 64
TOPK_BLOCK = 64  # the sparse kernels read top-k in blocks of 64
SPARSE_HEADS = (64, 128)
INTERFACE_MODULES = (
    "flash_mla",
    "vllm.third_party.flashmla.flash_mla_interface",
    "vllm.attention.ops.flashmla",
)
FP8_EXTENSION_MODULE = "vllm._flashmla_extension_C"


# ----------------------------------------------------------------------------- providers

@dataclass(frozen=True)
class Provider:
    """Where the kernels come from.

    ``interface``: a module with ``flash_mla_with_kvcache`` and ``get_mla_metadata`` (dense and sparse);
    ``sched_meta``: its ``FlashMLASchedMeta`` class (2026 interface) or None (legacy: metadata tensors
    from ``get_mla_metadata``); ``fp8_ops``: the ``torch.ops._flashmla_extension_C`` namespace or None.
    """

    name: str
    interface: Any = None
    sched_meta: Any = None
    fp8_ops: Any = None
    legacy_sparse: bool = False  # legacy get_mla_metadata takes topk (FlashMLA >= Sep 2025)

    @property
    def has_sparse(self) -> bool:
        return self.interface is not None and (self.sched_meta is not None or self.legacy_sparse)

    # -- metadata --------------------------------------------------------------------------------
    def metadata(self, mode: str, q: Tensor, kcache: Tensor, block_table: Tensor, seq_lens: Tensor,
                 softmax_scale: float, causal: bool, indices: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        """(tile_scheduler_metadata, num_splits) for this call's seq_lens and shapes, on the stream."""
        B, Q, H, _ = q.shape
        if mode == "dense_fp8":
            md, splits = self.fp8_ops.get_mla_decoding_metadata_dense_fp8(seq_lens, Q * H, 1)
            return md, splits
        if self.sched_meta is None:
            kwargs = dict(num_heads_q=H, is_fp8_kvcache=True, topk=indices.shape[-1]) if mode == "sparse" else {}
            md, splits = self.interface.get_mla_metadata(seq_lens, Q * H, 1, **kwargs)
            return md, splits
        # 2026 interface: the kernel call makes the metadata; keep it, drop the output.
        meta = self.sched_meta()
        self._call_interface(mode, q, kcache, block_table, seq_lens, softmax_scale, causal, indices, meta, None)
        return meta.tile_scheduler_metadata, meta.num_splits

    # -- the kernels -----------------------------------------------------------------------------
    def attend(self, mode: str, q: Tensor, kcache: Tensor, block_table: Tensor, seq_lens: Tensor,
               softmax_scale: float, causal: bool, indices: Optional[Tensor], md: Optional[Tensor],
               splits: Optional[Tensor], q_descale: Optional[Tensor] = None,
               k_descale: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """FlashMLA's call: q [B, Q, H, 576], kcache [P, 64, 1, D] -> (out [B, Q, H, 512], lse [B, H, Q],
        md, splits). ``md``/``splits`` None: the metadata is made here (on the stream) and returned, so a
        caller can hand it to later calls over the same seq_lens."""
        if mode == "dense_fp8":
            if md is None:
                md, splits = self.metadata(mode, q, kcache, block_table, seq_lens, softmax_scale, causal, indices)
            out, lse = self.fp8_ops.fwd_kvcache_mla_fp8(q, kcache, HEAD_DIM_V, seq_lens, block_table,
                                                        softmax_scale, causal, md, splits, q_descale, k_descale)
            return out, lse, md, splits
        if self.sched_meta is None:
            if md is None:
                md, splits = self.metadata(mode, q, kcache, block_table, seq_lens, softmax_scale, causal, indices)
            out, lse = self._call_interface(mode, q, kcache, block_table, seq_lens, softmax_scale, causal, indices,
                                            md, splits)
            return out, lse, md, splits
        meta = self.sched_meta()
        if md is not None:
            # A fresh FlashMLASchedMeta holding tensors: the wrapper builds its config from this call
            # and hands the tensors to the kernel, which then skips making metadata.
            meta.tile_scheduler_metadata, meta.num_splits = md, splits
        out, lse = self._call_interface(mode, q, kcache, block_table, seq_lens, softmax_scale, causal, indices,
                                        meta, None)
        # Without tensors the kernel call made the metadata and left it in ``meta``.
        return out, lse, meta.tile_scheduler_metadata, meta.num_splits

    def _call_interface(self, mode, q, kcache, block_table, seq_lens, softmax_scale, causal, indices, md, splits):
        kwargs = dict(softmax_scale=softmax_scale, causal=causal)
        if mode == "sparse":
            kwargs.update(is_fp8_kvcache=True, indices=indices)
        out, lse = self.interface.flash_mla_with_kvcache(q, kcache, block_table, seq_lens, HEAD_DIM_V, md, splits,
                                                         **kwargs)[:2]
        return out, lse


def _import(name: str, tried: list[str]):
    try:
        return importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - a broken install is as unusable as a missing one
        tried.append(f"{name}: {type(e).__name__}: {e}")
        return None


@functools.cache
def find_provider() -> tuple[Optional[Provider], str]:
    """(the installed provider or None, a summary of what was tried). Imports the libraries (cached)."""
    tried: list[str] = []
    interface = None
    for name in INTERFACE_MODULES:
        module = _import(name, tried)
        if module is None:
            continue
        if callable(getattr(module, "flash_mla_with_kvcache", None)) and callable(getattr(module, "get_mla_metadata",
                                                                                          None)):
            interface = (name, module)
            break
        tried.append(f"{name}: has no flash_mla_with_kvcache/get_mla_metadata")
    fp8_ops = None
    if _import(FP8_EXTENSION_MODULE, tried) is not None:
        ops = getattr(torch.ops, "_flashmla_extension_C", None)
        if ops is not None and all(hasattr(ops, n) for n in ("fwd_kvcache_mla_fp8",
                                                             "get_mla_decoding_metadata_dense_fp8")):
            fp8_ops = ops
        else:
            tried.append(f"{FP8_EXTENSION_MODULE}: imported but registers no dense FP8 ops")
    if interface is None and fp8_ops is None:
        return None, "; ".join(tried)
    names = ([interface[0]] if interface else []) + ([FP8_EXTENSION_MODULE] if fp8_ops is not None else [])
    return make_provider(" + ".join(names), interface[1] if interface else None, fp8_ops), "; ".join(tried)


def make_provider(name: str, interface, fp8_ops) -> Provider:
    """A Provider for an interface module (or None) and an FP8 op namespace (or None), its API style read
    from what the module defines."""
    sched_meta = getattr(interface, "FlashMLASchedMeta", None) if interface is not None else None
    legacy_sparse = False
    if interface is not None and sched_meta is None:
        try:
            legacy_sparse = "topk" in inspect.signature(interface.get_mla_metadata).parameters
        except (TypeError, ValueError):  # a builtin without a signature: assume the oldest (dense only)
            legacy_sparse = False
    return Provider(name, interface, sched_meta, fp8_ops, legacy_sparse)


# ----------------------------------------------------------------------------- argument marshalling

def decode_mode(cache_format: str, sparse: bool) -> Optional[str]:
    if sparse:
        return "sparse" if cache_format == "fp8_ds_mla" else None
    return {"bf16": "dense", "fp16": "dense", "fp8_e4m3": "dense_fp8"}.get(cache_format)


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


def kernel_tensors(mode: str, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                   sparse_indices: Optional[Tensor]) -> list[Tensor]:
    """What the kernel reads instead of the caller's tensors (the plan's tail, or made per call):

    - dense: ``[block_table]`` with unused entries (-1 included) clamped into the cache, so no negative
      page id is ever followed;
    - dense_fp8: that table and ``seq_lens`` clamped to >= 1: the FP8 extension (pre-2026 FlashMLA)
      faults on a sequence of length 0 (illegal address, H100); the row is finished afterwards anyway;
    - sparse: ``[]``, or ``sparse_indices`` padded with -1 to a multiple of 64 (the kernels load top-k in
      blocks of 64 and assert ``topk % 64 == 0``).
    """
    if mode == "sparse":
        pad = -sparse_indices.shape[-1] % TOPK_BLOCK
        return [torch.nn.functional.pad(sparse_indices, (0, pad), value=-1)] if pad else []
    table = clamp_pages(block_table, kv_cache.shape[0])
    return [table, kernel_lengths(seq_lens)] if mode == "dense_fp8" else [table]


def _kernel_query(q_nope: Tensor, q_pe: Tensor, B: int) -> Tensor:
    """[T, H, 512] | [T, H, 64] -> [B, Q, H, 576]: a view when the two are slices of one [.., 576] row
    (the usual model layout: no copy), else a concatenated copy."""
    T, H, L = q_nope.shape
    R = q_pe.shape[-1]
    adjacent = (
        q_nope.stride() == q_pe.stride()
        and q_nope.stride(-1) == 1
        and (H == 1 or q_nope.stride(1) >= L + R)
        and q_nope.untyped_storage().data_ptr() == q_pe.untyped_storage().data_ptr()
        and q_pe.storage_offset() == q_nope.storage_offset() + L
    )
    q = q_nope.as_strided((T, H, L + R), q_nope.stride()) if adjacent else torch.cat([q_nope, q_pe], dim=-1)
    return q.view(B, T // B, H, L + R)


def _kernel_inputs(q_nope, q_pe, kv_cache, block_table, sparse_indices):
    B = block_table.shape[0]
    mode = _mode_of(kv_cache, sparse_indices)
    q = _kernel_query(q_nope, q_pe, B)
    causal = mode != "sparse" and q.shape[1] > 1
    return mode, q, kv_cache.unsqueeze(2), causal


def _require_provider() -> Provider:
    provider, tried = find_provider()
    if provider is None:
        raise RuntimeError(f"mla_flashmla.decode: no FlashMLA provider is installed ({tried})")
    return provider


def _unpack(mode, block_table, seq_lens, sparse_indices, tensors, B, Q):
    """(block_table, seq_lens, indices [B, Q, K]) the kernel reads, from ``kernel_tensors``'s list."""
    if mode == "sparse":
        idx = tensors[0] if tensors else sparse_indices
        return block_table, seq_lens, idx.view(B, Q, idx.shape[-1])
    return tensors[0], tensors[1] if mode == "dense_fp8" else seq_lens, None


# Whether the kernel itself writes out = 0 for a row that sees nothing (measured on H100 with a NaN-poisoned
# allocator; lse is +inf there and is always rewritten). Where it does, masking ``out`` would be a wasted pass.
# The FP8 extension is fed seq_lens >= 1, so its empty rows hold real (unwanted) attention output.
KERNEL_ZEROES_EMPTY_ROWS = {"dense": True, "dense_fp8": False, "sparse": True}


def plan_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices=None):
    """The plan: ``[tile_scheduler_metadata, num_splits, row_counts int32 [T], *kernel_tensors(...)]``."""
    mode, q, kcache, causal = _kernel_inputs(q_nope, q_pe, kv_cache, block_table, sparse_indices)
    provider = _require_provider()
    tensors = kernel_tensors(mode, kv_cache, block_table, seq_lens, sparse_indices)
    table, lens, indices = _unpack(mode, block_table, seq_lens, sparse_indices, tensors, *q.shape[:2])
    md, splits = provider.metadata(mode, q, kcache, table, lens, softmax_scale, causal, indices)
    return [md, splits, row_counts(kv_cache, seq_lens, q_nope.shape[0], sparse_indices)] + tensors


def decode_and_plan(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices,
                    plan, need_lse: bool = True) -> tuple[Tensor, Optional[Tensor], list[Tensor]]:
    """FlashMLA decode of one layer: (out [T, H, 512] in q's dtype, lse [T, H] fp32 natural log, the plan
    it ran with). With ``plan == []`` the call schedules itself and returns that schedule as a plan,
    which later layers over the same block_table / seq_lens can reuse. ``need_lse=False``: lse is None
    and no epilogue runs where the kernel already zeroes the rows that see nothing (dense bf16/fp16,
    sparse): out is then FlashMLA's own output, viewed."""
    mode, q, kcache, causal = _kernel_inputs(q_nope, q_pe, kv_cache, block_table, sparse_indices)
    provider = _require_provider()
    T, H, _ = q_nope.shape
    B, Q = q.shape[:2]
    if plan:
        md, splits, counts, tensors = plan[0], plan[1], plan[2], plan[3:]
    else:
        md = splits = None
        counts = row_counts(kv_cache, seq_lens, T, sparse_indices)
        tensors = kernel_tensors(mode, kv_cache, block_table, seq_lens, sparse_indices)
    table, lens, indices = _unpack(mode, block_table, seq_lens, sparse_indices, tensors, B, Q)
    q_descale = None
    if mode == "dense_fp8":
        q, q_descale = quantize_query_fp8(q)
    out, lse, md, splits = provider.attend(mode, q, kcache, table, lens, softmax_scale, causal, indices, md, splits,
                                           q_descale, kv_scale if mode == "dense_fp8" else None)
    out = out.reshape(T, H, HEAD_DIM_V).to(q_nope.dtype)
    plan = plan or [md, splits, counts] + tensors
    zero_out = not KERNEL_ZEROES_EMPTY_ROWS[mode]
    if not need_lse and not zero_out:
        return out, None, plan
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


def run_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices, plan):
    """FlashMLA decode of one layer: (out [T, H, 512] in q's dtype, lse [T, H] fp32, natural log)."""
    return decode_and_plan(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices,
                           plan)[:2]


# ----------------------------------------------------------------------------- the ops

@functools.cache
def metadata_shape(mode: str, device: torch.device, H: int, Q: int, q_dtype: torch.dtype,
                   kv_dtype: torch.dtype) -> tuple[int, int]:
    """tile_scheduler_metadata's shape ``(num_sm_parts, M)``: it depends on the GPU's SM count, H, Q and
    the FlashMLA version, never on B, seq_lens or top-k, so it is measured once on a one-sequence problem
    (the fake impl needs it; a CUDA call at compile time, never in ``supports``)."""
    with real_tensors():
        width = {"sparse": 656}.get(mode, HEAD_DIM)
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
    parts, width = metadata_shape(mode, q_nope.device, int(H), int(T // block_table.shape[0]), q_nope.dtype,
                                  kv_cache.dtype)
    return [
        q_nope.new_empty((parts, width), dtype=torch.int32),
        q_nope.new_empty((block_table.shape[0] + 1,), dtype=torch.int32),
        q_nope.new_empty((T,), dtype=torch.int32),
    ] + kernel_tensors(mode, kv_cache, block_table, seq_lens, sparse_indices)


def _decode_and_plan_list(*args) -> list[Tensor]:
    """The first layer of a forward: ``[out, lse, *plan]``, its decode and the schedule it made for
    itself (``mla_flashmla::plan``'s result), which the later layers take. FlashMLA's 2026 interface
    builds the schedule inside the kernel call, so this is how a forward gets it without an extra attention."""
    out, lse, plan = decode_and_plan(*args, [])
    return [out, lse] + plan


def _decode_out(*args) -> Tensor:
    """``mla_flashmla::decode`` for a call whose lse nobody reads (``mla.paged_decode``): out only, with no
    epilogue kernel where FlashMLA's output is already the contract's (dense bf16/fp16, sparse)."""
    return decode_and_plan(*args, need_lse=False)[0]


# plan: FlashMLA's schedule for one forward, [tile_scheduler_metadata int32 [num_sm_parts, M], num_splits int32
# [B + 1], row_counts int32 [T]] plus, dense, the clamped block table (and lengths); no host sync.
# decode: the contract's arguments and the plan (or [], plan inline) -> (out [T, H, 512] in q's dtype, lse fp32).
PLAN_OP = decode_op("mla_flashmla::plan", plan_decode, returns="tensors", takes_plan=False, fake=_fake_plan)
DECODE_OP = decode_op("mla_flashmla::decode", run_decode)
DECODE_OUT_OP = decode_op("mla_flashmla::decode_out", _decode_out, returns="out")
DECODE_AND_PLAN_OP = decode_op(
    "mla_flashmla::decode_and_plan", _decode_and_plan_list, returns="tensors", takes_plan=False,
    fake=lambda *args: list(empty_decode_outputs(args[0])) + _fake_plan(*args))


# ----------------------------------------------------------------------------- the backend

class FlashMLABackend(Backend):
    name = "flashmla"
    libraries = ("flash_mla", "vllm")  # DeepSeek's package, or the build inside a vLLM wheel

    def unavailable_reason(self) -> Optional[str]:
        provider, tried = find_provider()
        return None if provider is not None else f"no FlashMLA provider is importable ({tried})"

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
            return (f"FlashMLA dense decode needs a bf16, fp16 or fp8_e4m3 cache, got {problem.cache_format}"
                    + (" (fp8_ds_mla is read only with sparse_indices)" if problem.cache_format == "fp8_ds_mla"
                       else ""))
        if mode == "sparse":
            if capability != (9, 0) and capability[0] != 10:
                return f"FlashMLA sparse decode needs SM90 or SM100-family GPUs, got {sm(capability)}"
            if problem.num_heads not in SPARSE_HEADS:
                return f"FlashMLA sparse decode needs 64 or 128 heads, got {problem.num_heads}"
            if problem.q_dtype != torch.bfloat16:
                return f"FlashMLA sparse decode needs bf16 queries, got {problem.q_dtype}"
            if problem.topk is None:
                return "FlashMLA sparse decode needs a static top-k width (it is padded to a multiple of 64)"
        else:
            if capability != (9, 0):
                return f"FlashMLA dense decode needs SM90 (sm_90a, Hopper), got {sm(capability)}"
            if mode == "dense" and problem.q_dtype != cache_dtype(problem.cache_format):
                return f"FlashMLA dense decode needs queries of the cache's dtype ({problem.cache_format}), got {problem.q_dtype}"
            if mode == "dense_fp8" and problem.q_dtype not in (torch.bfloat16, torch.float16):
                return f"FlashMLA dense FP8 decode needs bf16 or fp16 queries, got {problem.q_dtype}"
        provider, _ = find_provider()
        if provider is None:
            return None  # unavailable_reason() reports the missing library; here only the call is judged
        if mode == "dense_fp8" and provider.fp8_ops is None:
            return f"the FlashMLA provider ({provider.name}) has no dense FP8 kernel (vLLM's {FP8_EXTENSION_MODULE})"
        if mode == "dense" and provider.interface is None:
            return f"the FlashMLA provider ({provider.name}) has no bf16/fp16 dense decode"
        if mode == "sparse" and not provider.has_sparse:
            return f"the FlashMLA provider ({provider.name}) has no sparse decode"
        return None

    def compiled_op(self):
        return DECODE_OP

    # Without a plan a call builds its own metadata; with several layers the first one's (decode_and_plan_op)
    # serves them all. The standalone plan op runs one whole attention on the 2026 interface.
    plan_is_optional = True

    def plan_op(self):
        return PLAN_OP

    def decode_and_plan_op(self):
        return DECODE_AND_PLAN_OP

    def out_only_op(self):
        return DECODE_OUT_OP

    def decode(self, q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices):
        return run_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices, [])


BACKEND = FlashMLABackend()
