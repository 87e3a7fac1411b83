"""What the FlashInfer backends share: the lazy import, cached workspaces, row bookkeeping, and the
``BatchMLAPagedAttentionWrapper`` backend that ``flashinfer_fa2`` and ``flashinfer_fa3`` instantiate.

Nothing here imports FlashInfer at module import time (``import mla_inductor`` must stay lean); the
module is imported on first use through ``flashinfer_module()``.

The wrapper backend, shapes (T = B * Q rows, H heads, L = 512, R = 64, P pages of ``page_size``):

- plan (``mla_flashinfer::plan_<fa2|fa3>``, host sync, tagged ``cudagraph_unsafe``): builds the CSR
  description on the device and calls ``wrapper.plan()`` of a wrapper cached per static configuration.
  Dense: one request per sequence, ``qo_indptr[b] = b * Q``, ``kv_indptr[b] = b * max_pages`` and
  ``kv_indices = block_table.flatten()`` (padded CSR: the kernels read only the first
  ``ceil(kv_len / page_size)`` entries after each ``kv_indptr[b]``, so the row's unused tail is never
  touched; it is clamped into ``[0, P)`` anyway), ``causal = Q > 1`` (FlashInfer right-aligns the
  queries: row j of Q sees ``kv_idx <= kv_len - Q + j``, which is our contract).
  Sparse (top-k, vLLM's SM90 recipe): one request per query row with page_size 1, the row's slots as
  ``kv_indices`` and ``kv_len`` = its number of valid slots; the slots are compacted on the GPU so
  that valid ones come first (the contract allows -1 anywhere, FlashInfer reads a prefix).
  Returns ``[row_counts int32 [T]]``: how many keys each row really sees (0 -> out 0, lse -inf).
- run (``mla_flashinfer::run_<fa2|fa3>``, CUDA-graph safe): ``wrapper.run()`` on strided views of the
  one cache tensor (``ckv = cache[..., :L]``, ``kpe = cache[..., L:]``, no copies), lse in natural log
  (``return_lse_base_on_e=True``), then rows that see nothing are masked on the device.
- fp8_e4m3 caches: FlashInfer takes the per-tensor scale as a Python float, which would need
  ``kv_scale.item()`` (a sync, and a constant baked into a CUDA graph). Instead the scale is folded in
  on the device: logits use ``(s * q) . k = q . (s * k)`` and the output ``sum p * (s * v) = s * sum p * v``,
  so the kernel runs with ckv_scale = kpe_scale = 1.0.

The wrapper is found again by the run from the call's static configuration (shapes, dtypes, scale),
so a run always uses the most recent plan of the same configuration. The Inductor pass plans once per
forward and runs every layer after it; two different block tables of the same configuration in one
graph would share one wrapper (a known limit, see ``_WrapperKey``).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Optional

import torch

from mla_inductor.backends import Backend
from mla_inductor.contract import DecodeProblem, empty_decode_outputs

Tensor = torch.Tensor

MIN_FLASHINFER_VERSION = (0, 6, 14)
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace for MLA split-k partials
DEEPSEEK_DIMS = (512, 64)  # (kv_lora_rank, rope_dim) FlashInfer's MLA kernels are built for
_CUDAGRAPH_UNSAFE = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)
_LIB = torch.library.Library("mla_flashinfer", "FRAGMENT")  # the host-side plan ops (see _register_wrapper_ops)


# ----------------------------------------------------------------------------- library and device

def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


@functools.cache
def flashinfer_unavailable_reason() -> Optional[str]:
    """None when flashinfer >= 0.6.14 imports and a CUDA device is present, else why not (cached)."""
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - a broken install is as unusable as a missing one
        return f"flashinfer is not importable ({type(e).__name__}: {e})"
    version = getattr(flashinfer, "__version__", "0")
    if _version_tuple(version) < MIN_FLASHINFER_VERSION:
        return f"flashinfer >= {'.'.join(map(str, MIN_FLASHINFER_VERSION))} is needed, found {version}"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


def flashinfer_module():
    """The flashinfer package, imported on first use."""
    import flashinfer

    return flashinfer


_WORKSPACES: dict[tuple[str, str], Tensor] = {}


def workspace(device: torch.device, *, zeroed: bool = False) -> Tensor:
    """A WORKSPACE_BYTES uint8 buffer per device, allocated once. ``zeroed``: a separate buffer that
    starts at zero, for kernels keeping semaphores in it (trtllm-gen, XQA), which must never share
    memory with kernels that scribble partial results (the fa2/fa3 wrappers)."""
    key = (str(device), "zeroed" if zeroed else "float")
    if key not in _WORKSPACES:
        alloc = torch.zeros if zeroed else torch.empty
        _WORKSPACES[key] = alloc(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _WORKSPACES[key]


def sm(capability: Optional[tuple[int, int]]) -> str:
    return "CPU" if capability is None else f"SM{capability[0]}{capability[1]}"


def static_shape_reason(problem: DecodeProblem) -> Optional[str]:
    """FlashInfer plans and caches per head count, page size and Q: they must be static."""
    for field, value in (("num_heads", problem.num_heads), ("page_size", problem.page_size),
                         ("q_per_seq", problem.q_per_seq)):
        if value is None:
            return f"needs a static {field} (it is symbolic under dynamic shapes)"
    if problem.sparse and problem.topk is None:
        return "needs a static top-k width"
    return None


def dims_reason(problem: DecodeProblem, allowed=(DEEPSEEK_DIMS,)) -> Optional[str]:
    dims = (problem.kv_lora_rank, problem.rope_dim)
    if dims not in allowed:
        wanted = " or ".join(f"{l}/{r}" for l, r in allowed)
        return f"kv_lora_rank/rope_dim must be {wanted}, got {dims[0]}/{dims[1]}"
    return None


# ----------------------------------------------------------------------------- rows and indices

def dense_row_counts(seq_lens: Tensor, q_per_seq: int) -> Tensor:
    """int32 [B * Q]: keys row ``b*Q + j`` attends (``max(0, seq_lens[b] - Q + j + 1)``)."""
    if q_per_seq == 1:  # one launch instead of five (a host plan pays each launch before its sync)
        return seq_lens.clamp_min(0).to(torch.int32)
    j = torch.arange(q_per_seq, device=seq_lens.device, dtype=torch.int32)
    return (seq_lens[:, None] - q_per_seq + 1 + j).clamp_min(0).reshape(-1).to(torch.int32)


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


def mask_empty_rows(out: Tensor, lse: Tensor, counts: Tensor) -> None:
    """Rows that see no key get out 0 and lse -inf, whatever the kernel wrote (in place, on device).
    On CUDA a Triton kernel touches only the empty rows (a masked_fill would rewrite all of ``out``)."""
    if out.is_cuda and out.is_contiguous() and lse.is_contiguous():
        from mla_inductor.kernels.empty_rows import zero_empty_rows

        zero_empty_rows(out, lse, counts)
        return
    empty = counts == 0
    out.masked_fill_(empty[:, None, None], 0)
    lse.masked_fill_(empty[:, None], float("-inf"))


def quantize_query_fp8(q_nope: Tensor, q_pe: Tensor) -> tuple[Tensor, Tensor]:
    """[T, H, L] and [T, H, R] -> (``[T, H, L+R]`` float8_e4m3fn, q_scale fp32 [1]) with a per-tensor
    scale computed on the device (kernels that want q and cache both in fp8: trtllm-gen, XQA)."""
    q = torch.cat([q_nope, q_pe], dim=-1).float()
    q_scale = (q.abs().amax() / 448.0).clamp_min(torch.finfo(torch.float32).tiny).reshape(1)
    return (q / q_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), q_scale


# ----------------------------------------------------------------------------- the wrapper backend

_wrapper_ids = itertools.count(1)


@dataclass(frozen=True)
class _WrapperKey:
    """One cached ``BatchMLAPagedAttentionWrapper`` per static configuration. The plan op and the run
    op compute the same key from their (fake or real) arguments, which is how a run finds its plan
    without reading a handle on the host. Limit: two plans of equal keys in one graph (two different
    block tables with identical shapes) share the wrapper, so the later plan wins."""

    fi_backend: str
    device: str
    requests: int  # B dense, T sparse (one request per query row)
    qo_len: int  # Q dense, 1 sparse
    num_heads: int
    kv_lora_rank: int
    rope_dim: int
    page_size: int  # kv_cache's page size dense, 1 sparse
    num_indices: int  # B * max_pages dense, T * K sparse
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    causal: bool
    sm_scale: float


class _PlannedWrapper:
    def __init__(self, key: _WrapperKey):
        fi = flashinfer_module()
        device = torch.device(key.device)
        i32 = dict(dtype=torch.int32, device=device)
        # use_cuda_graph=True: plan() copies the CSR arrays into these buffers, whose addresses never
        # change, so a run captured in a CUDA graph reads the fresh plan on replay.
        self.qo_indptr = torch.zeros(key.requests + 1, **i32)
        self.kv_indptr = torch.zeros(key.requests + 1, **i32)
        self.kv_indices = torch.zeros(max(key.num_indices, 1), **i32)
        self.kv_lens = torch.zeros(key.requests, **i32)
        self.wrapper = fi.mla.BatchMLAPagedAttentionWrapper(
            workspace(device), use_cuda_graph=True, qo_indptr=self.qo_indptr, kv_indptr=self.kv_indptr,
            kv_indices=self.kv_indices, kv_len_arr=self.kv_lens, backend=key.fi_backend)
        self.id = next(_wrapper_ids)
        self.key = key
        # plan() reads qo_indptr / kv_indptr / kv_len_arr on the host; the indptrs depend only on the
        # static configuration, so they live on the host (pinned) and the only device->host copy of a
        # plan is the lengths.
        steps = torch.arange(key.requests + 1, dtype=torch.int32)
        per_request = key.num_indices // max(key.requests, 1)
        self.qo_indptr_host = _pinned(steps * key.qo_len)
        self.kv_indptr_host = _pinned(steps * per_request)
        self.kv_lens_host = _pinned(torch.zeros(key.requests, dtype=torch.int32))


def _pinned(t: Tensor) -> Tensor:
    return t.pin_memory() if torch.cuda.is_available() else t


_WRAPPERS: dict[_WrapperKey, _PlannedWrapper] = {}


def _wrapper_key(fi_backend, q_nope, q_pe, kv_cache, block_table, softmax_scale, sparse_indices) -> _WrapperKey:
    T, H, L = q_nope.shape
    B, max_pages = block_table.shape
    sparse = sparse_indices is not None
    Q = T // B
    return _WrapperKey(
        fi_backend=fi_backend,
        device=str(q_nope.device),
        requests=T if sparse else B,
        qo_len=1 if sparse else Q,
        num_heads=H,
        kv_lora_rank=L,
        rope_dim=q_pe.shape[-1],
        page_size=1 if sparse else kv_cache.shape[1],
        num_indices=sparse_indices.numel() if sparse else B * max_pages,
        q_dtype=q_nope.dtype,
        kv_dtype=kv_cache.dtype,
        causal=not sparse and Q > 1,
        sm_scale=float(softmax_scale),
    )


def wrapper_plan(fi_backend, q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale,
                 sparse_indices) -> list[Tensor]:
    """Plan the cached wrapper for this call (host sync). Returns ``[row_counts int32 [T]]``."""
    key = _wrapper_key(fi_backend, q_nope, q_pe, kv_cache, block_table, softmax_scale, sparse_indices)
    entry = _WRAPPERS.get(key)
    if entry is None:
        entry = _WRAPPERS[key] = _PlannedWrapper(key)
    P, page_size = kv_cache.shape[0], kv_cache.shape[1]
    # Everything the device computes is launched before the sync below, while the GPU is still busy with
    # earlier work; after it the GPU idles until the host has planned. The page ids go straight into the
    # wrapper's own buffer, so plan()'s copy into that buffer is a no-op (copy_ of a tensor onto itself).
    kv_indices = entry.kv_indices[:key.num_indices]
    if sparse_indices is None:
        counts = dense_row_counts(seq_lens, key.qo_len)
        # Unused block-table entries may hold anything; clamped, a stray read stays inside the cache.
        torch.clamp(block_table.reshape(-1), 0, P - 1, out=kv_indices)
        kv_lens = seq_lens
    else:
        compacted, counts = compact_sparse(sparse_indices, P * page_size)
        kv_indices.copy_(compacted.reshape(-1))
        kv_lens = counts
    # A length-0 sequence is planned as length 1 (FlashInfer's zero-length work items are avoided); its
    # rows see nothing by the contract and are masked after the run.
    kv_lens = kv_lens.clamp_min(1)
    # The plan's one device->host sync: the lengths (FlashInfer schedules on the host).
    entry.kv_lens_host.copy_(kv_lens)
    entry.wrapper.plan(
        entry.qo_indptr_host, entry.kv_indptr_host, kv_indices, entry.kv_lens_host, key.num_heads, key.kv_lora_rank,
        key.rope_dim, key.page_size, key.causal, key.sm_scale, key.q_dtype, key.kv_dtype)
    return [counts]


def wrapper_run(fi_backend, q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale,
                sparse_indices, plan: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Run the wrapper planned for this configuration: ``(out [T, H, L] q's dtype, lse [T, H] fp32)``."""
    key = _wrapper_key(fi_backend, q_nope, q_pe, kv_cache, block_table, softmax_scale, sparse_indices)
    entry = _WRAPPERS.get(key)
    if entry is None:
        raise RuntimeError(f"mla_flashinfer::run_{fi_backend}: no plan for this configuration ({key}); "
                           f"the plan op must run first")
    L = q_nope.shape[-1]
    cache = kv_cache if sparse_indices is None else kv_cache.reshape(-1, 1, kv_cache.shape[-1])
    ckv, kpe = cache[..., :L], cache[..., L:]
    out, lse = empty_decode_outputs(q_nope)
    scales = {}
    if kv_cache.dtype == torch.float8_e4m3fn:
        # The scale folded into q and out on the device (see the module docstring).
        q_nope = (q_nope * kv_scale).to(q_nope.dtype)
        q_pe = (q_pe * kv_scale).to(q_pe.dtype)
        scales = dict(ckv_scale=1.0, kpe_scale=1.0)
    entry.wrapper.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse, return_lse=True, return_lse_base_on_e=True,
                      **scales)
    if scales:
        out.mul_(kv_scale)
    mask_empty_rows(out, lse, plan[0])
    return out, lse


def _register_wrapper_ops(fi_backend: str):
    """The plan and run ops of one FlashInfer wrapper backend (``mla_flashinfer::plan_<b>``/``run_<b>``)."""

    def plan(q_nope: Tensor, q_pe: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
             softmax_scale: float, kv_scale: Tensor, sparse_indices: Optional[Tensor]) -> list[Tensor]:
        return wrapper_plan(fi_backend, q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale,
                            sparse_indices)

    # Registered with the low-level Library API rather than torch.library.custom_op: this op runs on the
    # host every decode step, outside the CUDA graph, and custom_op's Python layers (autograd wrapper,
    # redispatch, output checks) were a measurable share of it in an ad-hoc timing on the H100 machine.
    # It has no autograd.
    name = f"plan_{fi_backend}"
    _LIB.define(f"{name}(Tensor q_nope, Tensor q_pe, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
                f"float softmax_scale, Tensor kv_scale, Tensor? sparse_indices) -> Tensor[]", tags=_CUDAGRAPH_UNSAFE)
    _LIB.impl(name, plan, "CompositeExplicitAutograd")
    plan.__doc__ = (f"Plan FlashInfer's {fi_backend} MLA wrapper for this batch (host sync): returns "
                    f"[row_counts int32 [T]] (keys each query row sees).")

    @torch.library.register_fake(f"mla_flashinfer::{name}", lib=_LIB)
    def _(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices):
        return [q_nope.new_empty((q_nope.shape[0],), dtype=torch.int32)]

    def run_fn(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices, plan):
        return wrapper_run(fi_backend, q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale,
                           sparse_indices, plan)

    run_fn.__doc__ = (f"mla.paged_decode_with_lse on FlashInfer's {fi_backend} MLA wrapper, after "
                      f"plan_{fi_backend}: (out [T, H, L], lse [T, H] fp32, natural log).")
    return getattr(torch.ops.mla_flashinfer, name).default, _register_run_op(fi_backend, run_fn)


def _register_run_op(name: str, run_fn):
    """``mla_flashinfer::run_<name>``: ``run_fn(<8 contract args>, plan) -> (out, lse)`` with the contract's
    fake outputs. Returns the OpOverload (the pass matches graph nodes by it, not by the CustomOpDef)."""

    def run(q_nope: Tensor, q_pe: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
            softmax_scale: float, kv_scale: Tensor, sparse_indices: Optional[Tensor],
            plan: list[Tensor]) -> tuple[Tensor, Tensor]:
        return run_fn(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices, plan)

    run.__doc__ = run_fn.__doc__
    run_op = torch.library.custom_op(f"mla_flashinfer::run_{name}", run, mutates_args=())

    @run_op.register_fake
    def _(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices, plan):
        return empty_decode_outputs(q_nope)

    return getattr(torch.ops.mla_flashinfer, f"run_{name}").default


class FlashInferWrapperBackend(Backend):
    """``flashinfer.mla.BatchMLAPagedAttentionWrapper`` with backend ``fa2`` (SM80+) or ``fa3`` (SM90).

    Accepts: CUDA, L/R = 512/64, static H <= 128 / page size / Q, bf16 or fp16 q with the same cache
    dtype, or bf16 q with an fp8_e4m3 cache on SM90 (FlashInfer's FP8 MLA path is Hopper-only), and
    top-k sparse calls with a bf16/fp16 cache (page_size 1 recipe).
    """

    libraries = ("flashinfer",)

    def __init__(self, name: str, fi_backend: str, capability_reason):
        self.name = name
        self.fi_backend = fi_backend
        self._capability_reason = capability_reason
        self._plan_op, self._run_op = _register_wrapper_ops(fi_backend)

    def unavailable_reason(self) -> Optional[str]:
        return flashinfer_unavailable_reason()

    def supports(self, problem: DecodeProblem, capability: Optional[tuple[int, int]]) -> Optional[str]:
        if problem.device_type != "cuda" or capability is None:
            return f"needs a CUDA GPU, got {problem.device_type}"
        why = self._capability_reason(capability) or static_shape_reason(problem) or dims_reason(problem)
        if why:
            return why
        if problem.num_heads > 128:
            return f"num_heads must be <= 128, got {problem.num_heads}"
        fmt, q = problem.cache_format, problem.q_dtype
        if fmt in ("bf16", "fp16"):
            if q != {"bf16": torch.bfloat16, "fp16": torch.float16}[fmt]:
                return f"a {fmt} cache needs q in the same dtype, got {q}"
        elif fmt == "fp8_e4m3":
            if capability[0] != 9:
                return f"fp8_e4m3 caches need SM90 (FlashInfer's FP8 MLA path is Hopper-only), got {sm(capability)}"
            if q != torch.bfloat16:
                return f"fp8_e4m3 caches need bf16 q, got {q}"
            if problem.sparse:
                return "sparse (top-k) calls need a bf16/fp16 cache, got fp8_e4m3"
        else:
            return f"cache format {fmt} is not supported (bf16, fp16, fp8_e4m3)"
        return None

    def compiled_op(self):
        return self._run_op

    def plan_op(self):
        return self._plan_op

    def decode(self, q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices):
        args = (q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices)
        return wrapper_run(self.fi_backend, *args, wrapper_plan(self.fi_backend, *args))


# ----------------------------------------------------------------------------- table-driven backends

def prepare_tables(q_nope, kv_cache, block_table, seq_lens, sparse_indices) -> list[Tensor]:
    """Layer-independent inputs of the kernels that take a page table (trtllm-gen, XQA), on the device.

    Returns ``[table, kernel_lens, row_counts]``:
    dense  table int32 [B, max_pages] clamped into [0, P) (unused entries may hold anything),
           kernel_lens int32 [B] = max(seq_lens, 1);
    sparse table int32 [T, K] compacted slots (valid first, slot 0 in the tail),
           kernel_lens int32 [T] = max(valid count, 1) (the kernels take a length, not a -1 mask, and
           zero-length rows are unsupported);
    row_counts int32 [T]: keys each query row sees; rows with 0 are masked after the kernel.
    """
    P, page_size = kv_cache.shape[0], kv_cache.shape[1]
    if sparse_indices is None:
        counts = dense_row_counts(seq_lens, q_nope.shape[0] // block_table.shape[0])
        return [block_table.clamp(0, P - 1), seq_lens.clamp_min(1), counts]
    table, counts = compact_sparse(sparse_indices, P * page_size)
    return [table, counts.clamp_min(1), counts]


def register_table_ops(name: str, run_fn):
    """``mla_flashinfer::prepare_<name>`` (``prepare_tables``, no host sync, CUDA-graph safe, shared by all
    layers of a forward) and ``mla_flashinfer::run_<name>`` (``run_fn(<8 contract args>, plan)``)."""

    def prepare(q_nope: Tensor, q_pe: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                softmax_scale: float, kv_scale: Tensor, sparse_indices: Optional[Tensor]) -> list[Tensor]:
        return prepare_tables(q_nope, kv_cache, block_table, seq_lens, sparse_indices)

    prepare.__doc__ = prepare_tables.__doc__
    prepare_op = torch.library.custom_op(f"mla_flashinfer::prepare_{name}", prepare, mutates_args=())

    @prepare_op.register_fake
    def _(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices):
        T = q_nope.shape[0]
        rows = block_table.shape[0] if sparse_indices is None else T
        table = block_table if sparse_indices is None else sparse_indices
        return [table.new_empty(table.shape), q_nope.new_empty((rows,), dtype=torch.int32),
                q_nope.new_empty((T,), dtype=torch.int32)]

    return getattr(torch.ops.mla_flashinfer, f"prepare_{name}").default, _register_run_op(name, run_fn)


class FlashInferTableBackend(Backend):
    """A backend whose kernel takes the page table directly (no host plan): trtllm-gen, XQA."""

    libraries = ("flashinfer",)

    def __init__(self, name: str, run_fn, support_fn, required_attr: str):
        self.name = name
        self._run_fn = run_fn
        self._support_fn = support_fn
        self._required_attr = required_attr
        self._prepare_op, self._run_op = register_table_ops(name.removeprefix("flashinfer_"), run_fn)

    def unavailable_reason(self) -> Optional[str]:
        why = flashinfer_unavailable_reason()
        if why is None and not hasattr(flashinfer_module().mla, self._required_attr):
            why = f"this flashinfer has no flashinfer.mla.{self._required_attr}"
        return why

    def supports(self, problem: DecodeProblem, capability: Optional[tuple[int, int]]) -> Optional[str]:
        if problem.device_type != "cuda" or capability is None:
            return f"needs a CUDA GPU, got {problem.device_type}"
        return self._support_fn(problem, capability)

    def compiled_op(self):
        return self._run_op

    def plan_op(self):
        return self._prepare_op

    def decode(self, q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices):
        plan = prepare_tables(q_nope, kv_cache, block_table, seq_lens, sparse_indices)
        return self._run_fn(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices,
                            plan)
