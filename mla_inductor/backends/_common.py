"""What the backends share, in one place: the ops' signature, why a call is refused, the bookkeeping of
rows and pages every kernel needs, and the fp8 query.

- ``decode_op``: defines a backend's run / plan op on the contract's eight arguments (``contract.
  DECODE_ARGS_SCHEMA``), with the contract's fake outputs by default, so no backend hand-writes them.
- ``cuda_reason``, ``static_shape_reason``, ``dims_reason``, ``sm``: the common ``supports`` refusals.
- ``visible_key_counts`` (how many keys each query row sees), ``compact_sparse`` (valid slots first),
  ``clamp_pages`` (unused block-table entries may hold anything, -1 included), ``kernel_lengths``
  (kernels that take a length cannot run 0): what kernels read instead of the caller's tensors.
- ``finish_empty_rows``: rows that see nothing get out 0 and lse -inf, whatever the kernel wrote.
- ``skips_empty_calls`` (and every op ``decode_op`` defines): a call whose static sizes leave nothing to
  attend (B = 0, no cache pages, a zero-width block table, K = 0 sparse slots) returns the contract's
  result without launching anything: no library kernel takes such inputs (a cache of no pages has no page
  a clamped id could point at). Calls whose rows are empty only by their lengths (known on the device)
  run the kernel on ``kernel_lengths`` and ``clamp_pages`` and are finished by ``finish_empty_rows``.
- ``quantize_query_fp8``: a query in e4m3 with one scale per tensor, on the device; ``quantize_query_reference``
  the same in plain torch (what the Inductor pass writes into the graph).
- ``PlanCache``: one plan per step however the step is split (separately compiled layers, eager calls);
  ``plans_shared_in_capture``: the same among the calls of one captured step.

The cache format of a tensor is ``mla_inductor.cache.cache_format`` (and its dtype ``cache_dtype``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Any, Callable, Iterator, Optional

import torch

from mla_inductor._compat import CUDAGRAPH_UNSAFE_TAGS, version_counter
from mla_inductor._library import define_op
from mla_inductor.cache import FP8_E4M3_MAX
from mla_inductor.contract import (
    DECODE_ARG_NAMES,
    DECODE_ARGS_SCHEMA,
    DecodeProblem,
    attends_nothing,
    empty_decode_outputs,
    nothing_attended,
)

Tensor = torch.Tensor

DEEPSEEK_DIMS = (512, 64)  # (kv_lora_rank, rope_dim) of DeepSeek V2/V3: most libraries' only MLA build

# ----------------------------------------------------------------------------- ops

_RETURNS = {"out_lse": "(Tensor, Tensor)", "out": "Tensor", "tensors": "Tensor[]", "out_lse_plan": "Tensor[]"}
_DEFAULT_FAKES: dict[str, Callable] = {
    "out_lse": lambda *args: empty_decode_outputs(args[0]),
    "out": lambda *args: empty_decode_outputs(args[0])[0],
}


def _empty_call_result(returns: str, fake: Callable, args: tuple):
    """What an op returns for a call that attends nothing: out 0 and lse -inf, and a plan of zeros (the
    fake's shapes) that only calls attending nothing read: a plan is shared by calls of one block table and
    the same per-layer shapes, so they all attend nothing."""
    if returns == "out_lse":
        return nothing_attended(args[0])
    if returns == "out":
        return nothing_attended(args[0])[0]
    plan = [torch.zeros_like(t) for t in fake(*args)]
    return list(nothing_attended(args[0])) + plan[2:] if returns == "out_lse_plan" else plan


def decode_op(qualname: str, impl: Callable, *, returns: str = "out_lse", takes_plan: bool = True,
              fake: Optional[Callable] = None, host_plan: bool = False, call_site: Optional[Callable] = None):
    """Define the op ``qualname`` ("namespace::name") on the contract's eight arguments, followed by
    ``plan: Tensor[]`` when ``takes_plan``, and return its OpOverload (the pass matches nodes by it).

    ``impl(*args)`` computes it; ``returns``: "out_lse" (``(out [T, H, L], lse [T, H] fp32)``), "out",
    "tensors" (a plan) or "out_lse_plan" (``[out, lse, *plan]``); ``fake(*args)``: the outputs' shapes
    (default: the contract's, from ``empty_decode_outputs``; required for the lists). ``impl`` never sees a
    call that attends nothing by its static sizes (``attends_nothing``): the op returns the contract's
    result for it (and a plan of zeros) without running ``impl``. ``host_plan``: the op plans on the
    host: it is tagged ``cudagraph_unsafe`` (CUDA-graph capture leaves it outside). ``call_site(facts)``: the
    op's callable for one site of compiled code (``_library.define_op``); it is asked only for calls whose
    static sizes attend something, so a site needs no ``attends_nothing`` check.

    Registered with the low-level Library API (``_library``): no ``torch.library.custom_op`` layers per call;
    code compiled by Inductor calls the implementation without the dispatcher (``define_op(direct=True)``).
    """
    plan_arg = ", Tensor[] plan" if takes_plan else "=None"  # ops without a plan may omit sparse_indices
    schema = f"({DECODE_ARGS_SCHEMA}{plan_arg}) -> {_RETURNS[returns]}"
    fake = fake or _DEFAULT_FAKES[returns]
    arity = len(DECODE_ARG_NAMES) + takes_plan

    names = (*DECODE_ARG_NAMES, "plan")[:arity]

    def full(*args, **kwargs):
        if kwargs or len(args) < arity:  # the dispatcher leaves out a defaulted sparse_indices, Inductor names it
            args = (*args, *(kwargs.get(n) for n in names[len(args):]))
        if attends_nothing(args[0], args[2], args[3], args[7]):
            return _empty_call_result(returns, fake, args)
        return impl(*args)

    def site(facts):
        if attends_nothing(facts[0], facts[2], facts[3], facts[7]):
            return None
        return call_site(facts)

    full.__doc__ = impl.__doc__
    return define_op(qualname, schema, full, fake, tags=CUDAGRAPH_UNSAFE_TAGS if host_plan else (), direct=True,
                     call_site=site if call_site else None).default


# ----------------------------------------------------------------------------- refusals

def sm(capability: Optional[tuple[int, int]]) -> str:
    return "CPU" if capability is None else f"SM{capability[0]}{capability[1]}"


def cuda_reason(problem: DecodeProblem, capability: Optional[tuple[int, int]]) -> Optional[str]:
    if problem.device_type != "cuda" or capability is None:
        return f"needs a CUDA GPU, got {problem.device_type}"
    return None


def static_shape_reason(problem: DecodeProblem) -> Optional[str]:
    """Kernels that plan or cache per head count, page size and Q need them static."""
    for name, value in (("num_heads", problem.num_heads), ("page_size", problem.page_size),
                        ("q_per_seq", problem.q_per_seq)):
        if value is None:
            return f"needs a static {name} (it is symbolic under dynamic shapes)"
    if problem.sparse and problem.topk is None:
        return "needs a static top-k width"
    return None


def dims_reason(problem: DecodeProblem, allowed=(DEEPSEEK_DIMS,)) -> Optional[str]:
    dims = (problem.kv_lora_rank, problem.rope_dim)
    if dims not in allowed:
        wanted = " or ".join(f"{l}/{r}" for l, r in allowed)
        return f"kv_lora_rank/rope_dim must be {wanted}, got {dims[0]}/{dims[1]}"
    return None


# ----------------------------------------------------------------------------- rows, pages, lengths

def visible_key_counts(seq_lens: Tensor, num_rows: int, sparse_indices: Optional[Tensor] = None,
                       capacity: int = 0) -> Tensor:
    """int32 [T]: how many keys query row ``b*Q + j`` sees. Dense: ``max(0, seq_lens[b] - Q + j + 1)``;
    sparse: its slots in ``[0, capacity)`` (-1 is padding)."""
    if sparse_indices is not None:
        valid = (sparse_indices >= 0) & (sparse_indices < capacity)
        return valid.sum(dim=-1, dtype=torch.int32)
    q_per_seq = num_rows // max(seq_lens.shape[0], 1)
    if q_per_seq == 1:  # one launch instead of five (a host plan pays each launch before its sync)
        return seq_lens.clamp_min(0).to(torch.int32)
    j = torch.arange(q_per_seq, device=seq_lens.device, dtype=torch.int32)
    return (seq_lens[:, None] - q_per_seq + 1 + j).clamp_min(0).reshape(num_rows).to(torch.int32)


def compact_sparse(sparse_indices: Tensor, capacity: int) -> tuple[Tensor, Tensor]:
    """Move each row's valid slots (``0 <= slot < capacity``) to its front, keeping their order.

    sparse_indices int32 [T, K] -> (compacted int32 [T, K] with 0 in the tail, counts int32 [T]).
    Kernels that take a per-row length read a prefix, while the contract allows -1 anywhere; the
    permutation is a cumsum and a scatter (no sort, no host sync). The tail holds slot 0, a real
    slot, so a kernel that reads one entry too many (or a row of count 0 given length 1) stays in bounds.
    """
    idx = sparse_indices
    valid = (idx >= 0) & (idx < capacity)
    ranks = valid.to(torch.int32).cumsum(1, dtype=torch.int32)  # valid entries up to and including k
    counts = ranks[:, -1].contiguous()
    k = torch.arange(idx.shape[1], device=idx.device, dtype=torch.int32)
    dest = torch.where(valid, ranks - 1, counts[:, None] + k - ranks)
    compacted = torch.empty_like(idx).scatter_(1, dest.long(), idx)
    compacted = torch.where(k[None, :] < counts[:, None], compacted, torch.zeros_like(compacted))
    return compacted, counts


def clamp_pages(block_table: Tensor, num_pages: int, out: Optional[Tensor] = None) -> Tensor:
    """The block table with every entry clamped into ``[0, num_pages)``: entries past a sequence's last
    page may hold anything (-1 included); clamped, a kernel's stray read stays inside the cache. (A cache
    of no pages gives 0s, never -1: such a call attends nothing and runs no kernel, see ``skips_empty_calls``.)"""
    return torch.clamp(block_table, 0, max(num_pages - 1, 0), out=out)


def kernel_lengths(lengths: Tensor) -> Tensor:
    """Lengths of at least 1: kernels that take a length per request cannot run (or fault on) 0; those
    rows see nothing by the contract and are finished by ``finish_empty_rows``."""
    return lengths.clamp_min(1)


def skips_empty_calls(decode: Callable) -> Callable:
    """For a backend's ``decode`` / ``decode_with_q_scale`` (self, then the contract's arguments): a call
    that attends nothing by its static sizes returns out 0 and lse -inf (empty for B = 0) without
    reaching ``decode``; the ops ``decode_op`` defines do the same. Reads shapes only: no device sync."""

    @functools.wraps(decode)
    def guarded(self, q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices,
                *rest):
        if attends_nothing(q_nope, kv_cache, block_table, sparse_indices):
            return nothing_attended(q_nope)
        return decode(self, q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices,
                      *rest)

    return guarded


def finish_empty_rows(out: Tensor, lse: Tensor, counts: Tensor) -> None:
    """Rows that see no key get out 0 and lse -inf, whatever the kernel wrote (in place, on device).
    On CUDA a Triton kernel touches only the empty rows (a masked_fill would rewrite all of ``out``)."""
    if out.is_cuda and out.is_contiguous() and lse.is_contiguous():
        from mla_inductor.kernels.empty_rows import zero_empty_rows

        zero_empty_rows(out, lse, counts)
        return
    empty = counts == 0
    out.masked_fill_(empty[:, None, None], 0)
    lse.masked_fill_(empty[:, None], float("-inf"))


# ----------------------------------------------------------------------------- fp8 query

def quantize_query_reference(q: Tensor, q_scale: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """q (any shape) -> (float8_e4m3fn, descale fp32 [1]) in plain torch, one scale for the whole tensor
    (latent and rope alike, as the kernels take one ``descale_q``): ``q_scale`` when given (a static,
    calibrated scale), else ``max(amax(|q|) / 448, tiny)``; ``q8 = clamp(q / descale, ±448)`` in fp32.
    The definition the Triton kernels follow, and the ops the Inductor pass writes into the graph
    (``lowering/fp8_query.py``), where they fuse into q's producers. Values beyond ±448 · descale
    saturate: an uncalibrated ``q_scale`` gives garbage, never inf or NaN."""
    if q_scale is None:
        descale = (q.abs().amax().float() / FP8_E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny).reshape(1)
    else:
        descale = q_scale.reshape(1)
    return (q.float() / descale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), descale


def quantize_query_fp8(q: Tensor, q_scale: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """``quantize_query_reference`` on the device: on CUDA our Triton kernels (two passes, or one with a
    static ``q_scale``; ``kernels.fp8_query``), torch elsewhere. The result is contiguous. For kernels that
    take q in fp8 with one descale (FlashMLA's dense FP8 decode, trtllm-gen and XQA with an fp8 cache)."""
    if q.is_cuda:
        from mla_inductor.kernels.fp8_query import quantize_per_tensor_e4m3, quantize_with_descale_e4m3

        return quantize_per_tensor_e4m3(q) if q_scale is None else quantize_with_descale_e4m3(q, q_scale)
    q8, descale = quantize_query_reference(q, q_scale)
    return q8.contiguous(), descale


# ----------------------------------------------------------------------------- plans shared across calls

def tensor_state(t: Optional[Tensor]) -> Optional[tuple]:
    """What identifies a tensor's contents without reading them: address, shape, strides, dtype, device and
    version counter (bumped by every write through torch). None for None."""
    if t is None:
        return None
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device, version_counter(t))


def _quick_state(block_table: Tensor, seq_lens: Tensor, sparse_indices: Optional[Tensor]) -> tuple:
    """What can change in a tensor object while it stays the same object: its version counter (every write
    through torch, ``set_`` and ``resize_`` included), and its address and shape (``t.data = other`` replaces
    the tensor's contents without a version bump). Not seen: ``t.data =`` a tensor of the same address and
    shape but other strides or dtype (a reinterpretation of the same memory, which no decode code does)."""
    return (version_counter(block_table), block_table.data_ptr(), block_table.shape, version_counter(seq_lens),
            seq_lens.data_ptr(), seq_lens.shape,
            None if sparse_indices is None else (version_counter(sparse_indices), sparse_indices.data_ptr(),
                                                 sparse_indices.shape))


class PlanCache:
    """The last plan per static configuration, reused while the tensors it was made from are unchanged.

    Inside one compiled graph the Inductor pass plans once for all the calls that share block_table /
    seq_lens. A step split into separately compiled regions (one per decoder layer), or run eagerly, has a
    plan op per call instead; a backend keeping its plans here makes the first of them plan and the others
    reuse that plan until block_table, seq_lens or sparse_indices change. "Unchanged": the same memory, shape,
    strides and version counter (``tensor_state``). The entry holds the tensors, so their memory cannot be
    handed to another tensor while it exists.

    Not seen: writes that bypass torch's version counter (a CUDA-graph replay writing seq_lens, a foreign
    kernel); code writing lengths that way calls ``forget_plans()`` after each write.

    Calls made while a CUDA graph is captured (``captured=True``) never see these plans: a replay must
    recompute its schedule from the lengths it finds. Inside ``plans_shared_in_capture()`` they keep plans of
    their own, made during that capture, for the later calls of the same capture; elsewhere they keep none.

    A plan *op* must hand out copies of the stored tensors, never the stored ones: Inductor may reuse the
    memory of an op's output for another buffer once the output's last reader has run.
    ``hits`` / ``misses`` count lookups (tests and benchmarks read them).
    """

    def __init__(self, name: str):
        self.name = name
        self._entries: dict[Any, tuple[tuple, tuple, Any]] = {}
        self.hits = 0
        self.misses = 0
        _PLAN_CACHES.add(self)

    def _store(self, captured: bool) -> Optional[dict]:
        """Where plans of calls ``captured`` (or not) live: this object's own entries, the innermost
        ``plans_shared_in_capture`` scope's, or None (a capture outside such a scope keeps nothing)."""
        if not captured:
            return self._entries
        scopes = _capture_scopes()
        return scopes[-1].setdefault(self.name, {}) if scopes else None

    def keeps(self, captured: bool = False) -> bool:
        """Whether a plan ``put`` now by a call ``captured`` (or not) would be kept."""
        return not captured or bool(_capture_scopes())

    def get(self, config, block_table: Tensor, seq_lens: Tensor, sparse_indices: Optional[Tensor],
            captured: bool = False):
        """The plan stored for ``config`` (a hashable static description: shapes, dtypes, scale) if it was
        made from these tensors in their present state, else None. The same tensor objects as stored are
        compared by version counter, address and shape only (``_same_objects_unchanged``: the common case, a
        step's calls over one block_table / seq_lens); other ones by their whole ``tensor_state``.
        ``captured``: the call is being captured in a CUDA graph (see the class's docstring)."""
        store = self._store(captured)
        if store is None:
            return None
        entry = store.get(config)
        if entry is not None:
            state, held, plan, quick = entry
            if (held[1] is seq_lens and held[0] is block_table and held[2] is sparse_indices
                    and quick == _quick_state(block_table, seq_lens, sparse_indices)) or \
                    state == (tensor_state(block_table), tensor_state(seq_lens), tensor_state(sparse_indices)):
                self.hits += 1
                return plan
        self.misses += 1
        return None

    def put(self, config, block_table: Tensor, seq_lens: Tensor, sparse_indices: Optional[Tensor], plan,
            captured: bool = False) -> None:
        """Store ``plan`` for ``config`` as made from these tensors now (replacing the previous one); a call
        ``captured`` outside ``plans_shared_in_capture`` stores nothing."""
        store = self._store(captured)
        if store is None:
            return
        state = (tensor_state(block_table), tensor_state(seq_lens), tensor_state(sparse_indices))
        store[config] = (state, (block_table, seq_lens, sparse_indices), plan,
                         _quick_state(block_table, seq_lens, sparse_indices))

    def forget(self, config=None) -> None:
        """Drop the plan of ``config``, or every plan."""
        if config is None:
            self._entries.clear()
        else:
            self._entries.pop(config, None)


_PLAN_CACHES: "weakref.WeakSet[PlanCache]" = weakref.WeakSet()
_CAPTURE_SCOPES = threading.local()


def _capture_scopes() -> list[dict]:
    scopes = getattr(_CAPTURE_SCOPES, "stack", None)
    if scopes is None:
        scopes = _CAPTURE_SCOPES.stack = []
    return scopes


@contextlib.contextmanager
def plans_shared_in_capture() -> Iterator[None]:
    """For code capturing a whole decode step in one CUDA graph (``hf.CapturedDecodeStep``): the calls
    captured inside share their plans as the calls of one compiled graph do. The first call over a
    block_table / seq_lens schedules and keeps that schedule for the later ones (with layers compiled one by
    one, or run eagerly, each call would otherwise schedule for itself: a metadata kernel per layer in every
    replay). Only plans made during this scope are shared, and each replay remakes them from the lengths it
    finds before the later calls read them; they are dropped when the scope ends (their memory belongs to
    the graph's pool from then on). Calls that are not captured are unaffected. The caller must not write
    block_table / seq_lens between the captured calls in a way torch's version counter does not see."""
    scopes = _capture_scopes()
    scopes.append({})
    try:
        yield
    finally:
        scopes.pop()


def forget_plans() -> None:
    """Drop every backend's stored plans: for code that writes block_table / seq_lens / sparse_indices in a
    way torch's version counter does not see (see ``PlanCache``)."""
    for cache in list(_PLAN_CACHES):
        cache.forget()


# ----------------------------------------------------------------------------- views of long-lived tensors

class TensorViews:
    """Views a kernel call takes of a long-lived tensor (a layer's cache: FlashInfer's latent and rope halves,
    FlashMLA's head axis), made on the tensor's first call and returned again while it lives: a view op costs host
    time on every call (``benchmarks/bench_host_overhead.py --stub`` shows it), and a layer's cache is the same
    tensor object every step, so its views are too.

    ``get(t, how, make)``: ``make(alias)`` returns the views (a tuple) of ``alias``, a ``detach()``ed alias of
    ``t``; ``how`` names them (hashable). The views hold the memory, not the tensor object (a view of ``t`` itself
    would keep ``t`` alive): when ``t`` is freed, a weak reference drops its entry and with it the views. An entry
    is checked against ``t``'s address and shape on every use (``t.data = other`` and ``set_`` change them; a
    reinterpretation of the same memory with other strides or dtype is not seen, as in ``PlanCache``). A
    tensor made anew for each call (``stacked[layer]``) misses every time: one ``detach()`` and a weak reference
    more than making the views directly."""

    def __init__(self):
        self._held: dict[tuple, tuple] = {}

    def get(self, t: Tensor, how, make: Callable[[Tensor], tuple]) -> tuple:
        key = (id(t), how)
        held = self._held.get(key)
        if held is not None and held[0]() is t and held[1] == t.data_ptr() and held[2] == t.shape:
            return held[3]
        views = make(t.detach())
        held = self._held

        def forget(ref, key=key):
            entry = held.get(key)
            if entry is not None and entry[0] is ref:
                del held[key]

        held[key] = (weakref.ref(t, forget), t.data_ptr(), t.shape, views)
        return views

    def __len__(self) -> int:
        return len(self._held)


VIEWS = TensorViews()
