"""The op contract of ``mla.paged_decode``, ``paged_decode_with_lse`` and ``cache_append``: what a call
means and which arguments are valid. Pure: it registers nothing (``ops.py`` defines the ops on it).

``DecodeProblem`` is what a backend needs to know about a call; ``check_decode_args`` /
``check_append_args`` validate arguments (eager, and fake tensors at compile time);
``DECODE_ARGS_SCHEMA`` is the eight arguments every decode op, ours and each backend's, takes; ``mla.paged_decode``
and ``paged_decode_with_lse`` also take an optional ``q_scale`` (``OP_ARGS_SCHEMA``).
``docs/contract.md`` has the same semantics with a picture.

Shapes (T = B * Q query rows, Q new tokens per sequence, H heads, L = kv_lora_rank, R = rope dim):

    q_nope         [T, H, L]  fp32 / fp16 / bf16    absorbed query (W_UK folded in)
    q_pe           [T, H, R]  same dtype as q_nope  rope part of the query
    kv_cache       [P, page_size, L+R]  fp32 / fp16 / bf16 / float8_e4m3fn
                   or [P, page_size, 656] uint8 (fp8_ds_mla, L=512, R=64)
    block_table    [B, max_pages] int32     page of position t is block_table[b, t // page_size]
    seq_lens       [B] int32                tokens in the cache per sequence, new ones included
    softmax_scale  float
    kv_scale       [1] fp32                 per-tensor scale of an fp8_e4m3 cache (1.0 otherwise)
    sparse_indices [T, K] int32 or None     slots page * page_size + offset, -1 = padding
    q_scale        [1] fp32 or None         static per-tensor scale of the query (see below)
    -> out         [T, H, L]  q's dtype;    lse [T, H] fp32 (natural log), for the _with_lse op

Query row ``b*Q + j`` sits at position ``seq_lens[b] - Q + j`` and attends to positions ``0..p`` of
its sequence; with ``sparse_indices`` it attends to exactly its listed slots. A row with nothing to
attend gives out 0 and lse -inf.

``q_scale`` never changes what a call means: the result is defined on q as given (bf16 / fp16 / fp32).
It is the caller's calibrated scale for backends that compute with q in e4m3 (``q8 = clamp(q / q_scale,
±448)``, one scale for the latent and the rope part, like vLLM's per-layer ``_q_scale``): with it such a
backend skips measuring ``amax(|q|)`` every call, and giving it opts the call in to those backends
(``DecodeProblem.fp8_query``). An uncalibrated scale saturates q at ±448 · q_scale and the output is
garbage: only pass one measured on real activations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from mla_inductor._compat import assert_on_device, check_value, environment_reader, stream_capture_query
from mla_inductor.cache import (
    FP8_DS_MLA_LATENT,
    FP8_DS_MLA_ROPE,
    FP8_DS_MLA_TOKEN_BYTES,
    cache_format,
)

Tensor = torch.Tensor
QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEBUG_ENV = "MLA_INDUCTOR_DEBUG"

# The eight arguments of every decode op (``mla.paged_decode(_with_lse)`` and each backend's run / plan ops),
# as a torch.library schema: one definition instead of a hand-written signature per op.
DECODE_ARG_NAMES = ("q_nope", "q_pe", "kv_cache", "block_table", "seq_lens", "softmax_scale", "kv_scale",
                    "sparse_indices")
DECODE_ARGS_SCHEMA = ("Tensor q_nope, Tensor q_pe, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
                      "float softmax_scale, Tensor kv_scale, Tensor? sparse_indices")
# ``mla.paged_decode(_with_lse)``: the eight, then the optional static query scale.
OP_ARG_NAMES = DECODE_ARG_NAMES + ("q_scale",)
OP_ARGS_SCHEMA = DECODE_ARGS_SCHEMA + "=None, Tensor? q_scale=None"


@dataclass(frozen=True)
class DecodeProblem:
    """What a backend needs to know to accept a call, read from real or fake arguments.

    Sizes that are symbolic under ``torch.compile(dynamic=True)`` are None.
    """

    device_type: str
    cache_format: str
    q_dtype: torch.dtype
    num_heads: Optional[int]
    kv_lora_rank: int
    rope_dim: int
    page_size: Optional[int]
    sparse: bool
    topk: Optional[int] = None
    q_per_seq: Optional[int] = None
    batch: Optional[int] = None  # B, the number of sequences (None: symbolic, e.g. mark_unbacked)
    # The caller accepts q quantized to e4m3 per tensor (a static q_scale was given, or the user allowed
    # it with ``allow_fp8_query``): only then may a backend that computes with an fp8 query take the call.
    fp8_query: bool = False


def _static_int(x) -> Optional[int]:
    if isinstance(x, int):
        return x
    node = getattr(x, "node", None)
    return node.maybe_as_int() if node is not None and hasattr(node, "maybe_as_int") else None


def fail(op: str, exc: type[Exception], msg: str):
    raise exc(f"mla.{op}: {msg}")


def _require(op: str, cond, msg: str) -> None:
    """ValueError(msg) unless ``cond``. A symbolic condition (sizes under torch.compile) is handed to
    ``_compat.check_value``: it holds as a guard for backed sizes and becomes a runtime assert for unbacked
    ones (``mark_unbacked`` batch sizes), where guarding on it would fail to compile."""
    if isinstance(cond, bool):
        if not cond:
            fail(op, ValueError, msg)
    else:
        check_value(cond, lambda: f"mla.{op}: {msg}")


def _check_tensor(op, name, t, ndim, dims_desc):
    if not isinstance(t, torch.Tensor):
        fail(op, TypeError, f"{name} must be a torch.Tensor {dims_desc}, got {type(t).__name__}")
    if t.dim() != ndim:
        fail(op, ValueError, f"{name} must be a {ndim}-D tensor {dims_desc}, got shape {tuple(t.shape)}")


def _check_dtype(op, name, t, allowed, what):
    if t.dtype not in allowed:
        fail(op, TypeError, f"{name} must have dtype {what}, got {t.dtype}")


def _check_device(op, name, t, device, like="q_nope"):
    if t.device != device:
        fail(op, ValueError, f"{name} must be on {device} like {like}, got {t.device}")


def _check_last_dim_contiguous(op, name, t):
    if t.shape[-1] != 1 and t.stride(-1) != 1:
        fail(op, ValueError, f"{name} must be contiguous in its last dimension, got strides {tuple(t.stride())}")


def _check_cache_rows(op, kv_cache, L, R):
    try:
        fmt = cache_format(kv_cache)
    except TypeError as e:
        fail(op, TypeError, str(e))
    if fmt == "fp8_ds_mla":
        if (L, R) != (FP8_DS_MLA_LATENT, FP8_DS_MLA_ROPE):
            fail(op, ValueError, f"a uint8 (fp8_ds_mla) kv_cache needs L=512 and R=64, got L={L}, R={R}")
        if kv_cache.shape[-1] != FP8_DS_MLA_TOKEN_BYTES:
            fail(op, ValueError, f"kv_cache in fp8_ds_mla format must be [P, page_size, 656] uint8, "
                  f"got shape {tuple(kv_cache.shape)}")
    elif kv_cache.shape[-1] != L + R:
        fail(op, ValueError, f"kv_cache must be [P, page_size, L+R={L + R}] (latent | rope), "
              f"got shape {tuple(kv_cache.shape)}")
    return fmt


def _check_query_fits_cache(op, kv_cache, L, R):
    """A decode call's L and R are read from the query: one that does not fit the cache's rows is reported as a
    bad query shape, against what the rows hold (a kv_cache of no cache dtype is left to ``_check_cache_rows``)."""
    try:
        fmt = cache_format(kv_cache)
    except TypeError:
        return
    if fmt == "fp8_ds_mla":
        if (L, R) != (FP8_DS_MLA_LATENT, FP8_DS_MLA_ROPE):
            fail(op, ValueError, f"bad query shape for a uint8 (fp8_ds_mla) kv_cache, whose rows hold L=512 latent "
                  f"and R=64 rope values: q_nope must be [T, H, 512] and q_pe [T, H, 64], got q_nope L={L}, "
                  f"q_pe R={R}")
    elif kv_cache.shape[-1] != L + R:
        fail(op, ValueError, f"bad query shape for kv_cache rows of L+R={kv_cache.shape[-1]} values (latent | rope): "
              f"q_nope [T, H, L] and q_pe [T, H, R] must have L + R = {kv_cache.shape[-1]}, got q_nope L={L}, "
              f"q_pe R={R} (L + R = {L + R}); kv_cache shape {tuple(kv_cache.shape)}")


def _check_scale(op, name, scale, device, what, like="q_nope"):
    if not isinstance(scale, torch.Tensor):
        fail(op, TypeError, f"{name} must be a float32 tensor with one element ({what}), got "
              f"{type(scale).__name__}")
    if scale.dtype != torch.float32 or scale.numel() != 1:
        fail(op, TypeError, f"{name} must be a float32 tensor with one element, got dtype "
              f"{scale.dtype} and shape {tuple(scale.shape)}")
    _check_device(op, name, scale, device, like)


KV_SCALE_FORM = "1.0 unless the cache is fp8: torch.ones(1)"


def _check_kv_scale(op, kv_scale, device, like="q_nope"):
    _check_scale(op, "kv_scale", kv_scale, device, f"{KV_SCALE_FORM} on {like}'s device", like)


def explain_refused_decode_args(*args, op: str = "paged_decode", **kwargs) -> None:
    """For a decode call the dispatcher refused: a Python number (or anything not a tensor) passed as
    ``kv_scale`` or ``q_scale`` gets the contract's TypeError naming the tensor expected; any other refusal is
    left to the dispatcher's own message (it names the argument and the schema's type)."""
    named = dict(zip(OP_ARG_NAMES, args), **kwargs)
    kv_scale, q_scale = named.get("kv_scale"), named.get("q_scale")
    if "kv_scale" in named and not isinstance(kv_scale, torch.Tensor):
        fail(op, TypeError, f"kv_scale must be a float32 tensor with one element ({KV_SCALE_FORM} on q_nope's "
              f"device), got "
              f"{type(kv_scale).__name__} {kv_scale!r}")
    if q_scale is not None and not isinstance(q_scale, torch.Tensor):
        fail(op, TypeError, f"q_scale must be None or a float32 tensor with one element (the static per-tensor "
              f"scale of the query), got {type(q_scale).__name__} {q_scale!r}")


def check_decode_args(
    q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices=None, q_scale=None,
    op: str = "paged_decode",
) -> DecodeProblem:
    """Shape/dtype/device checks that need no data (they run in eager and in the fake impls, so bad
    input fails at compile time too). Returns the call's DecodeProblem."""
    _check_tensor(op, "q_nope", q_nope, 3, "[T, H, L]")
    _check_dtype(op, "q_nope", q_nope, QUERY_DTYPES, "float32, float16 or bfloat16")
    T, H, L = q_nope.shape
    device = q_nope.device
    _check_tensor(op, "q_pe", q_pe, 3, "[T, H, R]")
    if q_pe.dtype != q_nope.dtype:
        fail(op, TypeError, f"q_pe must have q_nope's dtype {q_nope.dtype}, got {q_pe.dtype}")
    _require(op, q_pe.shape[0] == T, f"q_pe must be [T={T}, H={H}, R] like q_nope, got shape {tuple(q_pe.shape)}")
    _require(op, q_pe.shape[1] == H, f"q_pe must be [T={T}, H={H}, R] like q_nope, got shape {tuple(q_pe.shape)}")
    R = q_pe.shape[2]
    _check_tensor(op, "kv_cache", kv_cache, 3, "[P, page_size, L+R]")
    _check_query_fits_cache(op, kv_cache, L, R)
    fmt = _check_cache_rows(op, kv_cache, L, R)
    _check_tensor(op, "block_table", block_table, 2, "[B, max_pages]")
    _check_dtype(op, "block_table", block_table, (torch.int32,), "int32")
    _check_tensor(op, "seq_lens", seq_lens, 1, "[B]")
    _check_dtype(op, "seq_lens", seq_lens, (torch.int32,), "int32")
    B = block_table.shape[0]
    _require(op, seq_lens.shape[0] == B, f"seq_lens must be [B={B}] (one length per block_table row), got "
             f"shape {tuple(seq_lens.shape)}")
    if _static_int(B) == 0:  # an empty batch: a valid call with nothing to compute
        _require(op, T == 0, f"q_nope's T={T} must be 0 when the batch is empty (B=0)")
    else:
        # A symbolic batch size (mark_unbacked) must be >= 1: the graph divides T by it.
        _require(op, B != 0, "block_table must have at least one row (B >= 1)")
        _require(op, T % B == 0, f"q_nope's T={T} must be a positive multiple of the batch size B={B} "
                 f"(T = B * new tokens per sequence)")
    if not isinstance(softmax_scale, (float, int)) or isinstance(softmax_scale, bool):
        fail(op, TypeError, f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale):
        fail(op, ValueError, f"softmax_scale must be finite, got {softmax_scale}")
    _check_kv_scale(op, kv_scale, device)
    if q_scale is not None:
        _check_scale(op, "q_scale", q_scale, device, "the static per-tensor scale of the query, or None")
    topk = None
    if sparse_indices is not None:
        _check_tensor(op, "sparse_indices", sparse_indices, 2, "[T, K]")
        _check_dtype(op, "sparse_indices", sparse_indices, (torch.int32,), "int32")
        _require(op, sparse_indices.shape[0] == T, f"sparse_indices must be [T={T}, K], got shape "
                 f"{tuple(sparse_indices.shape)}")
        _check_device(op, "sparse_indices", sparse_indices, device)
        topk = _static_int(sparse_indices.shape[1])
    for name, t in (("q_pe", q_pe), ("kv_cache", kv_cache), ("block_table", block_table), ("seq_lens", seq_lens)):
        _check_device(op, name, t, device)
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("kv_cache", kv_cache)):
        _check_last_dim_contiguous(op, name, t)
    return DecodeProblem(
        device_type=device.type,
        cache_format=fmt,
        q_dtype=q_nope.dtype,
        num_heads=_static_int(H),
        kv_lora_rank=_static_int(L),
        rope_dim=_static_int(R),
        page_size=_static_int(kv_cache.shape[1]),
        sparse=sparse_indices is not None,
        topk=topk,
        q_per_seq=None if _static_int(B) == 0 else _static_int(T // B),
        batch=_static_int(B),
        fp8_query=q_scale is not None,
    )


def call_signature(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices=None,
                   q_scale=None) -> tuple:
    """Everything about a decode call that ``check_decode_args`` reads, as a key: shapes, strides, dtypes and
    devices of every tensor, and softmax_scale with its type (an int is valid too; a NaN never equals a
    stored key). Calls with equal signatures differ only in their tensors' addresses and contents, so what
    the checks and a backend decide from one holds for all: eager calls and backends cache by it. Assumes
    tensors where the schema has them (the dispatcher checked): AttributeError otherwise."""
    # One flat tuple, the optional tensors inline: built on every eager call.
    return (q_nope.shape, q_nope.stride(), q_nope.dtype, q_nope.device, q_pe.shape, q_pe.stride(), q_pe.dtype,
            q_pe.device, kv_cache.shape, kv_cache.stride(), kv_cache.dtype, kv_cache.device, block_table.shape,
            block_table.stride(), block_table.dtype, block_table.device, seq_lens.shape, seq_lens.stride(),
            seq_lens.dtype, seq_lens.device, type(softmax_scale), softmax_scale,
            None if kv_scale is None else (kv_scale.shape, kv_scale.stride(), kv_scale.dtype, kv_scale.device),
            None if sparse_indices is None else (sparse_indices.shape, sparse_indices.stride(), sparse_indices.dtype,
                                                 sparse_indices.device),
            None if q_scale is None else (q_scale.shape, q_scale.stride(), q_scale.dtype, q_scale.device))


_debug_env = environment_reader(DEBUG_ENV)  # read on every GPU call: a dict lookup (see _compat)


def debug_checks_enabled() -> bool:
    env = _debug_env()
    return env is not None and env not in ("", "0")


def wants_value_checks(t: Tensor) -> bool:
    # Value checks read tensor data: free on CPU, a device sync on GPU, so GPUs do them on request only.
    return t.is_cpu or debug_checks_enabled()  # (is_cpu: no torch.device object made per call)


def check_decode_values(q_nope, kv_cache, block_table, seq_lens, kv_scale, sparse_indices=None,
                        op: str = "paged_decode", q_scale=None) -> None:
    """Checks that read data: lengths fit the block table, used pages and sparse slots are in range."""
    P, page_size = kv_cache.shape[0], kv_cache.shape[1]
    capacity = block_table.shape[1] * page_size
    lens = seq_lens.long()
    if bool((lens < 0).any()) or bool((lens > capacity).any()):
        fail(op, ValueError, f"seq_lens must lie in [0, max_pages * page_size = {capacity}], got "
              f"min {int(lens.min())}, max {int(lens.max())}")
    used = torch.arange(block_table.shape[1], device=lens.device)[None, :] * page_size < lens[:, None]
    pages = block_table.long()[used]
    if pages.numel() and (bool((pages < 0).any()) or bool((pages >= P).any())):
        fail(op, ValueError, f"block_table entries of used pages must lie in [0, num_pages={P}), got "
              f"min {int(pages.min())}, max {int(pages.max())}")
    if sparse_indices is not None:
        idx = sparse_indices.long()
        if idx.numel() and (bool((idx < -1).any()) or bool((idx >= P * page_size).any())):
            fail(op, ValueError, f"sparse_indices must be -1 or a slot in [0, P * page_size = {P * page_size}), "
                  f"got min {int(idx.min())}, max {int(idx.max())}")
    for name, scale in (("kv_scale", kv_scale), ("q_scale", q_scale)):
        if scale is not None:
            _check_scale_value(op, name, scale)


def _check_scale_value(op: str, name: str, scale: Tensor) -> None:
    # kv_scale also for caches that do not read it (the contract's 1.0): a NaN there is a bug one layer away.
    value = float(scale.reshape(()))
    if not math.isfinite(value) or value <= 0:
        fail(op, ValueError, f"{name} must be finite and positive, got {value}")


_capturing = stream_capture_query()


def being_captured(t: Tensor) -> bool:
    """Whether a call on t's device is being captured in a CUDA graph (the current stream is capturing)."""
    return t.is_cuda and _capturing()


def checks_on_device(t: Tensor) -> bool:
    """Whether the value checks of a call on t's device must be device-side asserts: while a CUDA graph is
    captured nothing may wait for the device (compiled graphs always use them on GPUs: lowering/checks.py)."""
    return being_captured(t)


def assert_decode_values_on_device(q_nope, kv_cache, block_table, seq_lens, kv_scale, sparse_indices=None,
                                   op: str = "paged_decode", q_scale=None) -> None:
    """``check_decode_values`` as device-side asserts: nothing waits for the device. The messages name the
    argument and the bound, as the host check's do (the offending values would need a sync)."""
    P, page_size = kv_cache.shape[0], kv_cache.shape[1]
    capacity = block_table.shape[1] * page_size
    lens = seq_lens.long()
    assert_on_device(((lens >= 0) & (lens <= capacity)).all(),
                     f"mla.{op}: seq_lens must lie in [0, max_pages * page_size = {capacity}]")
    used = torch.arange(block_table.shape[1], device=lens.device)[None, :] * page_size < lens[:, None]
    pages = block_table.long()
    assert_on_device((~used | ((pages >= 0) & (pages < P))).all(),
                     f"mla.{op}: block_table entries of used pages must lie in [0, num_pages={P})")
    if sparse_indices is not None:
        idx = sparse_indices.long()
        assert_on_device(((idx >= -1) & (idx < P * page_size)).all(),
                         f"mla.{op}: sparse_indices must be -1 or a slot in [0, P * page_size = {P * page_size})")
    for name, scale in (("kv_scale", kv_scale), ("q_scale", q_scale)):
        if scale is not None:
            _assert_scale_on_device(op, name, scale)


def _assert_scale_on_device(op: str, name: str, scale: Tensor) -> None:
    value = scale.reshape(())
    assert_on_device(torch.isfinite(value) & (value > 0), f"mla.{op}: {name} must be finite and positive")


def empty_decode_outputs(q_nope: Tensor) -> tuple[Tensor, Tensor]:
    """Outputs with the contract's shapes and strides: out [T, H, L] in q's dtype, lse [T, H] fp32."""
    T, H, L = q_nope.shape
    return q_nope.new_empty((T, H, L)), q_nope.new_empty((T, H), dtype=torch.float32)


def attends_nothing(q_nope, kv_cache, block_table, sparse_indices=None) -> bool:
    """Whether the call's static sizes leave no key for any row: no query rows (B = 0), no cache slots,
    a zero-width block table, or K = 0 sparse slots. Symbolic sizes count as nonzero."""
    width = block_table.shape[1] if sparse_indices is None else sparse_indices.shape[1]
    rows, (pages, page_size) = q_nope.shape[0], kv_cache.shape[:2]
    if type(rows) is int and type(pages) is int and type(page_size) is int and type(width) is int:
        return not (rows and pages and page_size and width)  # real tensors (every eager and runtime call)
    return any(_static_int(n) == 0 for n in (rows, pages, page_size, width))


def nothing_attended(q_nope: Tensor) -> tuple[Tensor, Tensor]:
    """The contract's result for rows that see no key: out 0 (q's dtype), lse -inf."""
    T, H, L = q_nope.shape
    return q_nope.new_zeros((T, H, L)), q_nope.new_full((T, H), float("-inf"), dtype=torch.float32)


def check_append_args(kv_cache, kv_c, k_pe, slot_mapping, kv_scale) -> str:
    """Shape/dtype checks of cache_append (eager and fake); returns the cache format."""
    op = "cache_append"
    _check_tensor(op, "kv_c", kv_c, 2, "[N, L]")
    _check_dtype(op, "kv_c", kv_c, QUERY_DTYPES, "float32, float16 or bfloat16")
    N, L = kv_c.shape
    _check_tensor(op, "k_pe", k_pe, 2, "[N, R]")
    if k_pe.shape[0] != N:
        fail(op, ValueError, f"k_pe must be [N={N}, R] like kv_c, got shape {tuple(k_pe.shape)}")
    _check_dtype(op, "k_pe", k_pe, QUERY_DTYPES, "float32, float16 or bfloat16")
    _check_tensor(op, "kv_cache", kv_cache, 3, "[P, page_size, L+R]")
    fmt = _check_cache_rows(op, kv_cache, L, k_pe.shape[1])
    if not kv_cache.is_contiguous():
        fail(op, ValueError, "kv_cache must be contiguous (cache_append writes whole token rows)")
    _check_tensor(op, "slot_mapping", slot_mapping, 1, "[N]")
    _check_dtype(op, "slot_mapping", slot_mapping, (torch.int32, torch.int64), "int32 or int64")
    if slot_mapping.shape[0] != N:
        fail(op, ValueError, f"slot_mapping must be [N={N}] (one slot per new token), got shape "
              f"{tuple(slot_mapping.shape)}")
    _check_kv_scale(op, kv_scale, kv_cache.device, like="kv_cache")
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe), ("slot_mapping", slot_mapping)):
        if t.device != kv_cache.device:
            fail(op, ValueError, f"{name} must be on {kv_cache.device} like kv_cache, got {t.device}")
    return fmt


def check_append_values(kv_cache, slot_mapping, kv_scale) -> None:
    """The checks of cache_append that read data: every slot is -1 or inside the cache, and kv_scale is
    finite and positive (an fp8 cache divides by it)."""
    capacity = kv_cache.shape[0] * kv_cache.shape[1]
    slots = slot_mapping.long()
    if slots.numel() and (bool((slots < -1).any()) or bool((slots >= capacity).any())):
        fail("cache_append", ValueError, f"slot_mapping must be -1 or a slot in [0, P * page_size = "
             f"{capacity}), got min {int(slots.min())}, max {int(slots.max())}")
    _check_scale_value("cache_append", "kv_scale", kv_scale)


def assert_append_values_on_device(kv_cache, slot_mapping, kv_scale) -> None:
    """``check_append_values`` as device-side asserts (nothing waits for the device)."""
    capacity = kv_cache.shape[0] * kv_cache.shape[1]
    slots = slot_mapping.long()
    assert_on_device(((slots >= -1) & (slots < capacity)).all(),
                     f"mla.cache_append: slot_mapping must be -1 or a slot in [0, P * page_size = {capacity})")
    _assert_scale_on_device("cache_append", "kv_scale", kv_scale)
