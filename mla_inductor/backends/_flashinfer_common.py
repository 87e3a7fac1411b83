"""What the FlashInfer backends share: the lazy import, cached workspaces, and the two backend classes:
the ``BatchMLAPagedAttentionWrapper`` backend that ``flashinfer_fa2`` and ``flashinfer_fa3`` instantiate,
and the page-table backend of ``flashinfer_trtllm`` and ``flashinfer_xqa``. Helpers all backends share
(rows, pages, fp8 query, the op signature) are in ``_common``.

Nothing here imports FlashInfer at module import time (``import mla_inductor`` must stay lean); the
module is imported on first use through ``flashinfer_module()``.

The wrapper backend, shapes (T = B * Q rows, H heads, L = 512, R = 64, P pages of ``page_size``):

- plan (``mla_flashinfer::plan_<fa2|fa3>``, host work, tagged ``cudagraph_unsafe``): builds the CSR
  description on the device and calls ``wrapper.plan()`` of a wrapper cached per static configuration.
  FlashInfer schedules on the host from every request's length: dense calls read them from the host copy
  of seq_lens (``mla_inductor.cache.host_lengths``; ``PagedLatentCache`` keeps one), so the plan never
  waits for the device; without a host copy, and for sparse calls (each row's number of valid slots is
  known on the device only), the lengths are copied from the device: one sync per plan. The last plan of
  each wrapper is kept in ``PLANS`` and reused while block_table / seq_lens / sparse_indices are unchanged,
  so a step whose layers are compiled separately (or run eagerly) still plans once.
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
  (``return_lse_base_on_e=True``), then rows that see nothing are masked on the device (a kernel launched
  only where the last plan has such rows, or when captured in a CUDA graph, whose replays may follow plans
  that have). ``run_<fa2|fa3>_out``: the same for calls whose lse nobody reads (``mla.paged_decode``): the
  kernel is handed no lse (FlashInfer's is optional) and none is allocated, except where rows are finished.
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
from typing import NamedTuple, Optional

import torch

from mla_inductor._compat import stream_capture_query, version_tuple
from mla_inductor._memo import Memo
from mla_inductor.backends import Backend
from mla_inductor.backends._common import (
    DEEPSEEK_DIMS,
    clamp_pages,
    compact_sparse,
    cuda_reason,
    decode_op,
    dims_reason,
    finish_empty_rows,
    PlanCache,
    kernel_lengths,
    skips_empty_calls,
    sm,
    static_shape_reason,
    visible_key_counts,
    VIEWS,
)
from mla_inductor.cache import cache_dtype, host_lengths
from mla_inductor.contract import DecodeProblem, being_captured

Tensor = torch.Tensor

MIN_FLASHINFER_VERSION = (0, 6, 14)
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace for MLA split-k partials
__all__ = ["DEEPSEEK_DIMS", "FlashInferTableBackend", "FlashInferWrapperBackend", "dims_reason", "flashinfer_module",
           "flashinfer_unavailable_reason", "sm", "static_shape_reason", "workspace"]


# ----------------------------------------------------------------------------- library and device

@functools.cache
def flashinfer_unavailable_reason() -> Optional[str]:
    """None when flashinfer >= 0.6.14 imports and a CUDA device is present, else why not (cached)."""
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - a broken install is as unusable as a missing one
        return f"flashinfer is not importable ({type(e).__name__}: {e})"
    version = getattr(flashinfer, "__version__", "0")
    if version_tuple(version) < MIN_FLASHINFER_VERSION:
        return f"flashinfer >= {'.'.join(map(str, MIN_FLASHINFER_VERSION))} is needed, found {version}"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


# The last FlashInfer release line whose wrapper runs its kernel through its own ``_cached_module.run(...,
# _plan_info, ...)``, which ``_DirectRun`` repeats. FlashInfer 0.7 moved planning and running into a planned-backend
# object per plan (``flashinfer/mla/_batch_mla``; the wrapper only mirrors ``_cached_module`` and ``_plan_info``) and
# validates each run against a contract declared at plan time: there, every run goes through ``wrapper.run()``
# (its legacy positional plan and q_nope/q_pe, ckv/kpe run forms are accepted with a DeprecationWarning each).
DIRECT_RUN_BEFORE = (0, 7, 0)


@functools.cache
def direct_runs_supported() -> bool:
    """Whether the installed FlashInfer's wrapper runs can be repeated without ``wrapper.run()`` (``_DirectRun``)."""
    return version_tuple(getattr(flashinfer_module(), "__version__", "0")) < DIRECT_RUN_BEFORE


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


# ----------------------------------------------------------------------------- the wrapper backend

class _WrapperKey(NamedTuple):
    """One cached ``BatchMLAPagedAttentionWrapper`` per static configuration. The plan op and the run
    op compute the same key from their (fake or real) arguments, which is how a run finds its plan
    without reading a handle on the host. Limit: two plans of equal keys in one graph (two different
    block tables with identical shapes) share the wrapper, so the later plan wins. (A NamedTuple: it is
    built and hashed by every call.)"""

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
        self.key = key
        # What each run reads of the configuration, computed once: output shapes, the cache's split, fp8.
        rows = key.requests * key.qo_len
        self.out_shape, self.lse_shape = (rows, key.num_heads, key.kv_lora_rank), (rows, key.num_heads)
        self.split = (key.kv_lora_rank, key.rope_dim)  # the kernel reads the cache as these halves (VIEWS)
        self.fp8 = key.kv_dtype == torch.float8_e4m3fn
        self.on_cuda = device.type == "cuda"
        # plan() reads qo_indptr / kv_indptr / kv_len_arr on the host; the indptrs depend only on the
        # static configuration, so they live on the host (pinned, never written again) and the lengths
        # come from the host copy of seq_lens where there is one.
        steps = torch.arange(key.requests + 1, dtype=torch.int32)
        per_request = key.num_indices // max(key.requests, 1)
        self.qo_indptr_host = _pinned(steps * key.qo_len)
        self.kv_indptr_host = _pinned(steps * per_request)
        # plan() uploads its schedule from one pinned buffer per wrapper, asynchronously: the next plan
        # must not rewrite that buffer before the GPU has read it (see wait_for_upload).
        self.uploaded = torch.cuda.Event() if device.type == "cuda" else None
        # Whether the last plan has a query row that sees no key (it then needs finish_empty_rows).
        self.rows_may_be_empty = True
        # The module call wrapper.run() made for the current plan, to repeat without its Python (_DirectRun);
        # None until the first run after each plan, False where it cannot be repeated.
        self.direct_run = None

    def halves(self, kv_cache: Tensor) -> tuple[Tensor, Tensor]:
        return kv_cache.split_with_sizes(self.split, 2)  # one op for both views

    def flat_halves(self, kv_cache: Tensor) -> tuple[Tensor, Tensor]:
        return kv_cache.reshape(-1, 1, kv_cache.shape[-1]).split_with_sizes(self.split, 2)

    def wait_for_upload(self) -> None:
        """Wait for the previous plan's upload, only if the GPU has not reached it yet (the host is then a
        whole step ahead): FlashInfer writes every plan of this wrapper into the same pinned buffer."""
        if self.uploaded is not None and not self.uploaded.query():
            self.uploaded.synchronize()

    def plan_uploaded(self) -> None:
        if self.uploaded is not None:
            self.uploaded.record()


class _RecordingModule:
    """Stands in for a wrapper's compiled module during one ``wrapper.run()``: records the arguments of the
    module's ``run`` call and forwards them."""

    def __init__(self, module):
        self._module = module
        self.args = None

    def __getattr__(self, name):
        return getattr(self._module, name)

    def run(self, *args):
        self.args = args
        return self._module.run(*args)


class _DirectRun:
    """FlashInfer's kernel call for the current plan of one wrapper, without ``wrapper.run()``'s Python.

    ``BatchMLAPagedAttentionWrapper.run()`` checks its arguments against the plan (q / cache dtypes, out / lse
    shapes, fp8 scales) and hands them, with the planned state (workspaces, plan info, page indices, mask
    mode, heads, page size, sm_scale), to its compiled module's ``run``: as much Python time per call as a
    short decode kernel takes on the device. What it checks is fixed by the wrapper's configuration (``_WrapperKey``: dtypes,
    heads, dims) and by how ``wrapper_run`` calls it (outputs it allocates itself, scales 1.0), so the checks
    need to run once per plan: the first run after each plan goes through ``wrapper.run()`` with the module's
    ``run`` call recorded (``record``), and later runs repeat that call with their own q, cache views, out and
    lse in place. plan() replaces the plan info and may replace the module: after a plan that kept the module,
    the new plan info takes the old one's place in the list (``follow_plan``: the wrappers are made with
    ``use_cuda_graph=True``, so every other planned argument is the same buffer, and page size, scale and
    mask are fixed by the configuration); otherwise the next run records anew. Where the recording does not
    show each per-call tensor exactly once (a FlashInfer passing them differently), every run goes through
    ``wrapper.run()``.
    """

    __slots__ = ("run", "module", "template", "positions", "plan_slot")

    def __init__(self, run, module, template: list, positions: list[int], plan_slot: Optional[int]):
        self.run, self.module, self.template, self.positions = run, module, template, positions
        self.plan_slot = plan_slot

    @staticmethod
    def record(wrapper, tensors: tuple, kwargs: dict):
        """Run ``wrapper.run`` on ``tensors`` (q_nope, q_pe, ckv, kpe, out, lse) and return the ``_DirectRun``
        repeating it, or False where it cannot be repeated."""
        module = getattr(wrapper, "_cached_module", None)
        if module is None or not callable(getattr(module, "run", None)):
            wrapper.run(*tensors[:4], out=tensors[4], lse=tensors[5], **kwargs)
            return False
        recorder = _RecordingModule(module)
        wrapper._cached_module = recorder
        try:
            wrapper.run(*tensors[:4], out=tensors[4], lse=tensors[5], **kwargs)
        finally:
            wrapper._cached_module = module
        if recorder.args is None:
            return False
        positions = [[i for i, a in enumerate(recorder.args) if a is t] for t in tensors]
        if any(len(p) != 1 for p in positions):
            return False
        # Any other tensor argument made from this call's tensors (a view of out, say) would be frozen into
        # the template and written by later calls: such a call is not repeated.
        storages = {t.untyped_storage().data_ptr() for t in tensors}
        placed = {p[0] for p in positions}
        if any(isinstance(a, Tensor) and i not in placed and a.untyped_storage().data_ptr() in storages
               for i, a in enumerate(recorder.args)):
            return False
        template = list(recorder.args)
        for (i,) in positions:
            template[i] = None  # the per-call tensors are not kept alive
        plan_info = getattr(wrapper, "_plan_info", _NOT_PLANNED)
        plan_slots = [i for i, a in enumerate(recorder.args) if a is plan_info]
        return _DirectRun(module.run, module, template, [p[0] for p in positions],
                          plan_slots[0] if len(plan_slots) == 1 else None)

    def follow_plan(self, wrapper) -> bool:
        """After ``wrapper.plan()``: put its new plan info in the old one's place and return True, or return
        False where that cannot be done (the module replaced, the plan info not found when recording)."""
        if self.plan_slot is None or getattr(wrapper, "_cached_module", None) is not self.module:
            return False
        self.template[self.plan_slot] = wrapper._plan_info
        return True

    def __call__(self, *tensors) -> None:
        args = self.template.copy()
        for i, t in zip(self.positions, tensors):
            args[i] = t
        self.run(*args)


_NOT_PLANNED = object()  # a wrapper without plan info: no argument is it


def _pinned(t: Tensor) -> Tensor:
    return t.pin_memory() if torch.cuda.is_available() else t


_WRAPPERS: dict[_WrapperKey, _PlannedWrapper] = {}
# The last plan of each wrapper, reused while block_table / seq_lens / sparse_indices are unchanged: one
# plan per step when the layers are compiled separately or run eagerly.
PLANS = PlanCache("flashinfer_wrapper")
_capturing = stream_capture_query()


def _wrapper_key(fi_backend, q_nope, q_pe, kv_cache, block_table, softmax_scale, sparse_indices) -> _WrapperKey:
    T, H, L = q_nope.shape
    B, max_pages = block_table.shape
    sparse = sparse_indices is not None
    Q = T // B
    return _WrapperKey(fi_backend, str(q_nope.device), T if sparse else B, 1 if sparse else Q, H, L, q_pe.shape[-1],
                       1 if sparse else kv_cache.shape[1], sparse_indices.numel() if sparse else B * max_pages,
                       q_nope.dtype, kv_cache.dtype, not sparse and Q > 1, float(softmax_scale))


def wrapper_plan(fi_backend, q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale,
                 sparse_indices, key: Optional[_WrapperKey] = None) -> list[Tensor]:
    """Plan the cached wrapper for this call, or reuse its plan if it was made from these block_table /
    seq_lens / sparse_indices as they are now. Returns ``[row_counts int32 [T]]``.

    Dense calls read the lengths from their host copy (``mla_inductor.cache.host_lengths``: no sync); without
    one they are copied from the device (one sync). Sparse calls need each row's count of valid slots on the
    host, which only the device knows: one device->host copy per plan.
    """
    key = key or _wrapper_key(fi_backend, q_nope, q_pe, kv_cache, block_table, softmax_scale, sparse_indices)
    return [planned_counts(key, q_nope, kv_cache, block_table, seq_lens, sparse_indices)]


def planned_counts(key: _WrapperKey, q_nope, kv_cache, block_table, seq_lens, sparse_indices,
                   captured: Optional[bool] = None) -> Tensor:
    """The row counts of the plan ``PLANS`` holds for ``key`` from these tensors as they are now, planning
    (and storing) first where it holds none. Refuses while a CUDA graph is captured (``refuse_capture``);
    ``captured``: whether one is, where the caller knows (None: asked here)."""
    if being_captured(q_nope) if captured is None else captured:
        refuse_capture(key.fi_backend)
    counts = PLANS.get(key, block_table, seq_lens, sparse_indices)
    return counts if counts is not None else make_plan(key, q_nope, kv_cache, block_table, seq_lens, sparse_indices)


def refuse_capture(fi_backend: str) -> None:
    """FlashInfer's wrapper plans on the host from the lengths it reads then: a plan made or looked up while a CUDA
    graph is captured would be replayed with the capture's lengths (wrong results once they change), so the
    call is refused with what to do instead."""
    raise RuntimeError(
        f"mla_inductor: the flashinfer_{fi_backend} backend plans on the host from the sequence lengths, so it "
        f"cannot run inside a CUDA graph you capture (torch.cuda.graph): every replay would reuse the lengths of "
        f"the capture. Capture compiled code with torch.compile(mode=\"reduce-overhead\") (the plan then runs "
        f"outside the graph before each replay), or run the captured calls on a backend that schedules on the "
        f"device: mla_inductor.prefer_backends(\"flashmla\", \"triton\").")


def make_plan(key: _WrapperKey, q_nope, kv_cache, block_table, seq_lens, sparse_indices) -> Tensor:
    """Plan the wrapper of ``key`` from these block_table / seq_lens / sparse_indices and store the plan in
    ``PLANS``; returns its row counts (``wrapper_plan`` without the lookup)."""
    entry = _WRAPPERS.get(key)
    if entry is None:
        entry = _WRAPPERS[key] = _PlannedWrapper(key)
    entry.wait_for_upload()
    P, page_size = kv_cache.shape[0], kv_cache.shape[1]
    # Device work first (it queues behind earlier work); the page ids go straight into the wrapper's own
    # buffer, so plan()'s copy into that buffer is a no-op (copy_ of a tensor onto itself).
    kv_indices = entry.kv_indices[:key.num_indices]
    if sparse_indices is None:
        counts = visible_key_counts(seq_lens, q_nope.shape[0])
        clamp_pages(block_table.reshape(-1), P, out=kv_indices)
        lens = host_lengths(seq_lens)
        if lens is None:
            lens = seq_lens.cpu()  # no host copy registered: a device->host copy, and its sync
        empty_rows = bool((lens < key.qo_len).any())  # row j of b sees seq_lens[b] - Q + j + 1 keys
    else:
        compacted, counts = compact_sparse(sparse_indices, P * page_size)
        kv_indices.copy_(compacted.reshape(-1))
        lens = counts.cpu()  # the rows' valid slots, known on the device only: a device->host copy
        empty_rows = bool((lens == 0).any())
    # A length-0 sequence is planned as length 1 (FlashInfer's zero-length work items are avoided); a fresh
    # pageable tensor, so plan()'s asynchronous upload of it cannot race a later plan.
    kv_lens = kernel_lengths(lens)
    entry.wrapper.plan(
        entry.qo_indptr_host, entry.kv_indptr_host, kv_indices, kv_lens, key.num_heads, key.kv_lora_rank,
        key.rope_dim, key.page_size, key.causal, key.sm_scale, key.q_dtype, key.kv_dtype)
    entry.plan_uploaded()
    entry.rows_may_be_empty = empty_rows
    direct_run = entry.direct_run
    if not (direct_run and direct_run.follow_plan(entry.wrapper)):
        entry.direct_run = None  # recorded again by the next run
    PLANS.put(key, block_table, seq_lens, sparse_indices, counts)
    return counts


# The compiled graph's run op finds its wrapper's key from the call's shapes (no plan handle crosses the graph):
# per distinct shapes, the key is computed once (a flat tuple of what ``_wrapper_key`` reads, then a dict lookup).
_KEYS_BY_SHAPES: Memo = Memo()


def _run_key(fi_backend, q_nope, q_pe, kv_cache, block_table, softmax_scale, sparse_indices) -> _WrapperKey:
    shapes = (fi_backend, q_nope.shape, q_nope.dtype, q_nope.device, q_pe.shape, kv_cache.shape, kv_cache.dtype,
              block_table.shape, None if sparse_indices is None else sparse_indices.shape, softmax_scale)
    key = _KEYS_BY_SHAPES.get(shapes)
    if key is None:
        key = _KEYS_BY_SHAPES.put(shapes, _wrapper_key(fi_backend, q_nope, q_pe, kv_cache, block_table,
                                                       softmax_scale, sparse_indices))
    return key


def wrapper_run(fi_backend, q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale,
                sparse_indices, plan: list[Tensor], key: Optional[_WrapperKey] = None, with_lse: bool = True):
    """Run the wrapper planned for this configuration: ``(out [T, H, L] q's dtype, lse [T, H] fp32)``, or out
    alone where ``with_lse`` is False. ``key``: the configuration's, where the caller has it already."""
    key = key or _run_key(fi_backend, q_nope, q_pe, kv_cache, block_table, softmax_scale, sparse_indices)
    return run_planned(_planned_entry(key), q_nope, q_pe, kv_cache, kv_scale, sparse_indices, plan[0], with_lse)


def _planned_entry(key: _WrapperKey) -> _PlannedWrapper:
    entry = _WRAPPERS.get(key)
    if entry is None:
        raise RuntimeError(f"mla_flashinfer::run_{key.fi_backend}: no plan for this configuration ({key}); "
                           f"the plan op must run first")
    return entry


class _RunSite:
    """``run_<b>`` / ``run_<b>_out`` at one site of compiled code (``decode_op``'s ``call_site``): the wrapper's
    key is fixed by the site's static shapes, so it is computed once, not looked up by shapes on every call, and
    its wrapper is kept once the site's first call finds it."""

    __slots__ = ("key", "with_lse", "entry", "table")

    def __init__(self, key: _WrapperKey, with_lse: bool):
        self.key, self.with_lse, self.entry, self.table = key, with_lse, None, None

    def __call__(self, q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices=None,
                 plan=()):
        entry = self.entry
        if entry is None or self.table is not _WRAPPERS:  # (a test may start a fresh table)
            entry = self.entry = _planned_entry(self.key)
            self.table = _WRAPPERS
        return run_planned(entry, q_nope, q_pe, kv_cache, kv_scale, sparse_indices, plan[0], self.with_lse)


def run_planned(entry: _PlannedWrapper, q_nope, q_pe, kv_cache, kv_scale, sparse_indices, counts: Tensor,
                with_lse: bool = True, capturing: Optional[bool] = None):
    """``wrapper_run`` on the wrapper ``entry`` (planned for this call's configuration; ``counts``: its plan):
    ``(out, lse)``, or ``out`` alone where ``with_lse`` is False. Then the kernel writes no lse (FlashInfer's
    lse is optional) and none is allocated, unless rows that see nothing are to be finished (that reads it).
    ``capturing``: whether a CUDA graph is being captured, where the caller knows (None: asked here)."""
    # Rows that see nothing are finished by a kernel only where the plan has some; a captured run always
    # launches it, since its replays may follow plans that do.
    if capturing is None:
        capturing = entry.on_cuda and _capturing()
    finish = entry.rows_may_be_empty or capturing
    if sparse_indices is None:
        ckv, kpe = VIEWS.get(kv_cache, entry.split, entry.halves)
    else:  # the cache read as one page of slots
        ckv, kpe = VIEWS.get(kv_cache, ("flat", entry.split), entry.flat_halves)
    out = q_nope.new_empty(entry.out_shape)
    lse = q_nope.new_empty(entry.lse_shape, dtype=torch.float32) if with_lse or finish else None
    scales = _NO_SCALES
    if entry.fp8:
        # The scale folded into q and out on the device (see the module docstring): one kernel each,
        # computed in fp32 and written in q's dtype.
        q_nope = torch.mul(q_nope, kv_scale, out=torch.empty_like(q_nope))
        q_pe = torch.mul(q_pe, kv_scale, out=torch.empty_like(q_pe))
        scales = _UNIT_SCALES
    direct_run = entry.direct_run
    if direct_run:
        direct_run(q_nope, q_pe, ckv, kpe, out, lse)  # lse None: the module's lse is optional
    elif direct_run is None and direct_runs_supported():  # recorded with an lse (the module call then names its
        # place), written or not
        recorded = lse if lse is not None else q_nope.new_empty(entry.lse_shape, dtype=torch.float32)
        entry.direct_run = _DirectRun.record(entry.wrapper, (q_nope, q_pe, ckv, kpe, out, recorded),
                                             dict(return_lse=True, return_lse_base_on_e=True, **scales))
    else:
        entry.wrapper.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse, return_lse=lse is not None,
                          return_lse_base_on_e=True, **scales)
    if scales:
        out.mul_(kv_scale)
    if finish:
        finish_empty_rows(out, lse, counts)
    return (out, lse) if with_lse else out


_NO_SCALES: dict = {}
_UNIT_SCALES = dict(ckv_scale=1.0, kpe_scale=1.0)


def _wrapper_plan_fake(q_nope, *args):
    return [q_nope.new_empty((q_nope.shape[0],), dtype=torch.int32)]


def _define_wrapper_ops(fi_backend: str):
    """``mla_flashinfer::plan_<b>`` (host work, run outside CUDA graphs), ``run_<b>`` and ``run_<b>_out`` (out
    alone, no lse written: for calls whose lse nobody reads) of one wrapper backend."""

    def plan(*args) -> list[Tensor]:
        # A copy: Inductor may reuse an op's output memory after its last reader, and PLANS keeps the original.
        return [counts.clone() for counts in wrapper_plan(fi_backend, *args)]

    def run(*args) -> tuple[Tensor, Tensor]:
        return wrapper_run(fi_backend, *args)

    def run_out(*args) -> Tensor:
        return wrapper_run(fi_backend, *args, with_lse=False)

    plan.__doc__ = (f"Plan FlashInfer's {fi_backend} MLA wrapper for this batch (on the host): returns "
                    f"[row_counts int32 [T]] (keys each query row sees).")
    run.__doc__ = (f"mla.paged_decode_with_lse on FlashInfer's {fi_backend} MLA wrapper, after plan_{fi_backend}: "
                   f"(out [T, H, L], lse [T, H] fp32, natural log).")
    run_out.__doc__ = (f"mla.paged_decode on FlashInfer's {fi_backend} MLA wrapper, after plan_{fi_backend}: "
                       f"out [T, H, L].")

    def run_site(with_lse: bool):
        def call_site(facts) -> _RunSite:
            q_nope, q_pe, kv_cache, block_table, _, softmax_scale, _, sparse_indices, _ = facts
            return _RunSite(_wrapper_key(fi_backend, q_nope, q_pe, kv_cache, block_table, softmax_scale,
                                         sparse_indices), with_lse)
        return call_site

    return (decode_op(f"mla_flashinfer::plan_{fi_backend}", plan, returns="tensors", takes_plan=False,
                      fake=_wrapper_plan_fake, host_plan=True),
            decode_op(f"mla_flashinfer::run_{fi_backend}", run, call_site=run_site(True)),
            decode_op(f"mla_flashinfer::run_{fi_backend}_out", run_out, returns="out", call_site=run_site(False)))


class FlashInferWrapperBackend(Backend):
    """``flashinfer.mla.BatchMLAPagedAttentionWrapper`` with backend ``fa2`` (SM80+) or ``fa3`` (SM90).

    Accepts: CUDA, L/R = 512/64, static H <= 128 / page size / Q, bf16 or fp16 q with the same cache
    dtype, or bf16 q with an fp8_e4m3 cache on SM90 (FlashInfer's FP8 MLA path is Hopper-only), and
    top-k sparse calls with a bf16/fp16 cache (page_size 1 recipe).
    """

    libraries = ("flashinfer",)
    plans_on_host = True
    plan_cost = ("a host plan per graph (FlashInfer's scheduler on the CPU; it runs outside CUDA graphs, and "
                 "copies the lengths from the device where no host copy is registered)")

    def __init__(self, name: str, fi_backend: str, capability_reason):
        self.name = name
        self.fi_backend = fi_backend
        self._capability_reason = capability_reason
        self._plan_op, self._run_op, self._run_out_op = _define_wrapper_ops(fi_backend)

    def unavailable_reason(self) -> Optional[str]:
        return flashinfer_unavailable_reason()

    def supports(self, problem: DecodeProblem, capability: Optional[tuple[int, int]]) -> Optional[str]:
        why = (cuda_reason(problem, capability) or self._capability_reason(capability)
               or static_shape_reason(problem) or dims_reason(problem))
        if why:
            return why
        if problem.num_heads > 128:
            return f"num_heads must be <= 128, got {problem.num_heads}"
        if problem.q_per_seq > 2 and problem.num_heads % 16:
            # Measured on SM90 (FA2 and FA3, FlashInfer 0.6.18): wrong rows at H=63, Q=4 (FlashMLA's test grid,
            # tests/test_peer_grids.py), while H=16 Q=4 and H=63 Q=2 are right; refused until understood.
            return (f"more than 2 queries per sequence need a head count that is a multiple of 16, got "
                    f"q_per_seq={problem.q_per_seq}, num_heads={problem.num_heads}")
        fmt, q = problem.cache_format, problem.q_dtype
        if fmt in ("bf16", "fp16"):
            if q != cache_dtype(fmt):
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

    def out_only_op(self):
        return self._run_out_op

    @skips_empty_calls
    def decode(self, q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices):
        args = (q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices)
        key = _wrapper_key(self.fi_backend, q_nope, q_pe, kv_cache, block_table, softmax_scale, sparse_indices)
        return wrapper_run(self.fi_backend, *args, wrapper_plan(self.fi_backend, *args, key=key), key=key)

    def eager_decode(self, problem: DecodeProblem, args: tuple, with_lse: bool, captured: bool = False):
        # The wrapper's key follows from the call signature: computed once, not per call. A call whose plan is
        # stored (the step's calls after its first) goes from the plan lookup straight to the run.
        q_nope, q_pe, kv_cache, block_table, _, softmax_scale, _, sparse_indices, _ = args
        key = _wrapper_key(self.fi_backend, q_nope, q_pe, kv_cache, block_table, softmax_scale, sparse_indices)

        def decode(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices, q_scale):
            counts = planned_counts(key, q_nope, kv_cache, block_table, seq_lens, sparse_indices, captured)
            return run_planned(_WRAPPERS[key], q_nope, q_pe, kv_cache, kv_scale, sparse_indices, counts, with_lse,
                               capturing=False)

        return decode


# ----------------------------------------------------------------------------- table-driven backends

def prepare_tables(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale,
                   sparse_indices=None) -> list[Tensor]:
    """Layer-independent inputs of the kernels that take a page table (trtllm-gen, XQA), on the device.

    Returns ``[table, kernel_lens, row_counts]``:
    dense  table int32 [B, max_pages] clamped into [0, P) (unused entries may hold anything),
           kernel_lens int32 [B] = max(seq_lens, 1);
    sparse table int32 [T, K] compacted slots (valid first, slot 0 in the tail),
           kernel_lens int32 [T] = max(valid count, 1) (the kernels take a length, not a -1 mask, and
           zero-length rows are unsupported);
    row_counts int32 [T]: keys each query row sees; rows with 0 are finished after the kernel.
    """
    P, page_size = kv_cache.shape[0], kv_cache.shape[1]
    if sparse_indices is None:
        counts = visible_key_counts(seq_lens, q_nope.shape[0])
        return [clamp_pages(block_table, P), kernel_lengths(seq_lens), counts]
    table, counts = compact_sparse(sparse_indices, P * page_size)
    return [table, kernel_lengths(counts), counts]


def _prepare_fake(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices=None):
    T = q_nope.shape[0]
    rows = block_table.shape[0] if sparse_indices is None else T
    table = block_table if sparse_indices is None else sparse_indices
    return [table.new_empty(table.shape), q_nope.new_empty((rows,), dtype=torch.int32),
            q_nope.new_empty((T,), dtype=torch.int32)]


class FlashInferTableBackend(Backend):
    """A backend whose kernel takes the page table directly (no host plan): trtllm-gen, XQA."""

    libraries = ("flashinfer",)

    def __init__(self, name: str, run_fn, support_fn, required_attr: str):
        self.name = name
        self._run_fn = run_fn
        self._support_fn = support_fn
        self._required_attr = required_attr
        short = name.removeprefix("flashinfer_")
        # prepare: no host sync, CUDA-graph safe, shared by all layers of a forward.
        self._prepare_op = decode_op(f"mla_flashinfer::prepare_{short}", prepare_tables, returns="tensors",
                                     takes_plan=False, fake=_prepare_fake)
        self._run_op = decode_op(f"mla_flashinfer::run_{short}", run_fn)

    def unavailable_reason(self) -> Optional[str]:
        why = flashinfer_unavailable_reason()
        if why is None and not hasattr(flashinfer_module().mla, self._required_attr):
            why = f"this flashinfer has no flashinfer.mla.{self._required_attr}"
        return why

    def supports(self, problem: DecodeProblem, capability: Optional[tuple[int, int]]) -> Optional[str]:
        why = cuda_reason(problem, capability) or self._support_fn(problem, capability)
        if why:
            return why
        # Both kernels write bf16 output and take q and cache in one dtype (q quantized for an fp8 cache).
        if problem.q_dtype != torch.bfloat16:
            return f"needs bf16 q (the kernel writes bf16 output), got {problem.q_dtype}"
        if problem.cache_format not in ("bf16", "fp8_e4m3"):
            return f"cache format must be bf16 or fp8_e4m3, got {problem.cache_format}"
        return None

    def compiled_op(self):
        return self._run_op

    def plan_op(self):
        return self._prepare_op

    @skips_empty_calls
    def decode(self, q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices):
        plan = prepare_tables(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices)
        return self._run_fn(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices,
                            plan)
