"""Kernel backends: one file each, the same small interface, looked up by name.

A backend answers three questions and does one thing:

- ``unavailable_reason()``: None when its library and hardware are present, else why not.
- ``supports(problem, capability)``: None when it can run this call (``DecodeProblem``, the device's
  compute capability or None on CPU), else a one-line reason. Cheap, pure: the selection table and the
  Inductor pass call it on fake arguments.
- ``compiled_op()``: the op the Inductor pass puts in place of ``mla.paged_decode_with_lse``, or None
  to have the pass trace ``decode`` into aten ops (the reference); ``compiled_op_for(context)`` (optional)
  the same for a call in a given ``selection.CallContext``, for a backend whose op depends on it. Its
  arguments are the contract's eight followed by ``plan: list[Tensor]`` (empty for backends without
  ``plan_op``); it returns ``(out, lse)`` with the contract's shapes and strides (``_common.decode_op``
  defines such an op, fake included).
- ``plan_op()``: None, or an op taking the contract's eight arguments and returning ``list[Tensor]``:
  schedule metadata that depends only on block_table / seq_lens / sparse_indices and the static shapes.
  The pass calls it once per forward for all layers sharing those tensors, and hands its result to
  every ``compiled_op`` call (FlashInfer's ``plan()`` once, ``run()`` many; FlashMLA's tile scheduler).
  A plan that does host work (a device sync) is tagged ``torch.Tag.cudagraph_unsafe`` so CUDA-graph
  capture leaves it outside the captured partitions. ``plan_is_optional = True`` says the run op also
  accepts an empty plan (it then schedules itself); the pass uses that when a plan would serve one call
  only, where planning separately costs more than it saves.
- ``decode_and_plan_op()``: None, or an op taking the contract's eight arguments and returning
  ``[out, lse, *plan]``: a decode that also returns the plan it made for itself. Where the plan is a
  by-product of the kernel call (FlashMLA's 2026 interface), the pass gives the first call of a forward
  this op and the later calls its plan, instead of running ``plan_op`` separately.
- ``out_only_op()``: None, or an op with ``compiled_op``'s arguments returning only ``out`` (same shape and
  strides). The pass puts it in place of ``mla.paged_decode``, whose lse nobody reads, where leaving the
  lse out saves work (FlashMLA: its lse must be rewritten into the contract's layout by a kernel of its own).
- ``plans_on_host`` / ``plan_cost``: whether the plan runs on the host (a scheduler on the CPU, outside
  any CUDA graph) and a phrase saying what it costs; selection moves such a backend behind one planning on
  the device where a compiled graph has no other call to share the plan with (``selection.CallContext``).
- ``quantized_query_op(problem)``: None, or (for calls whose kernel computes with q in e4m3, one scale per
  tensor) an op taking ``(q [T, H, L+R] float8_e4m3fn, q_descale [1] fp32, kv_cache, block_table,
  seq_lens, softmax_scale, kv_scale, sparse_indices, plan, out_dtype)`` and returning ``(out [T, H, L] in
  out_dtype, lse [T, H] fp32)``. The pass then writes q's assembly (``q_nope | q_pe``) and quantization
  into the graph as aten ops (``lowering/fp8_query.py``), so Inductor fuses them into q's producers, and
  hands this op the result; the call's static ``q_scale``, if any, is the scale (no amax pass). Such a
  backend's ``supports`` must refuse the call unless ``problem.fp8_query`` (the caller opted in).
- ``decode(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices)``:
  run the call eagerly (plan included); returns ``(out [T, H, L] in q's dtype, lse [T, H] fp32)``.
  ``decode_with_q_scale(..., sparse_indices, q_scale)``: the same given the call's static query scale
  (or None); only a backend that quantizes q overrides it, the others compute with q as given.
- ``eager_decode(problem, args, with_lse)``: optional; the function an eager call runs, bound once per call
  signature (``args``: an example of the op's nine arguments, ``q_scale`` last; every later call with this
  function has their shapes, strides, dtypes, devices and softmax_scale). It takes the nine arguments and
  returns ``(out, lse)`` with the contract's shapes and strides, or ``out`` alone where ``with_lse`` is False
  (``mla.paged_decode``: a backend may then skip work that only the lse needs). Default: ``decode_with_q_scale``.
  Whatever a backend would otherwise redo on every call from those facts belongs here.
- ``loaded_from()``: optional; where the backend's kernels were loaded from (``python -m mla_inductor.info``;
  also part of the pass's cache key, so a graph compiled against one build is never served for another).
- ``append_supports(device_type, capability)`` / ``append(kv_cache, kv_c, k_pe, slot_mapping, kv_scale)``:
  optional; a backend that writes caches (``mla.cache_append``) says where it can and does it.

Backends are found by name in a registry: the built-in ones below, and any added with
``register_backend(name, backend_or_module)`` (a ``Backend`` object, or the import path of a module
defining ``BACKEND``): adding a backend is one new file, plus, optionally, rows of ``selection.TABLE``
that rank it (or ``prefer_backends`` / ``$MLA_INDUCTOR_BACKEND`` naming it). Helpers the backends share
(cache rows, fp8 queries, the op signature) are in ``_common``.

Backend modules import their libraries lazily, so ``import mla_inductor`` needs none of them.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import sys
from typing import Optional, Union

import torch

from mla_inductor.contract import DecodeProblem

# name -> a Backend, or the module defining BACKEND (imported on first use); the selection table ranks them.
_REGISTRY: dict[str, Union[str, "Backend"]] = {
    "reference": "mla_inductor.backends.reference",
    "triton": "mla_inductor.backends.triton",
    "flashinfer_fa2": "mla_inductor.backends.flashinfer_fa2",
    "flashinfer_fa3": "mla_inductor.backends.flashinfer_fa3",
    "flashinfer_trtllm": "mla_inductor.backends.flashinfer_trtllm",
    "flashinfer_xqa": "mla_inductor.backends.flashinfer_xqa",
    "flashmla": "mla_inductor.backends.flashmla",
}
_LOADED: dict[str, "Backend"] = {}
_GENERATION = [0]  # bumped by every (un)registration: choices cached per registry state see the change


class Backend:
    """Base class of a kernel backend (see the package docstring)."""

    name: str = ""
    libraries: tuple[str, ...] = ()  # importable packages whose versions decide what the backend runs
    environment: tuple[str, ...] = ()  # environment variables its answers read (in the pass's cache key)
    plan_is_optional: bool = False
    plans_on_host: bool = False  # the plan runs on the CPU, outside CUDA graphs (see selection.CallContext)
    plan_cost: str = "no plan"
    last_resort: bool = False  # the catch-all that closes every table row, never preferred for its cost

    def unavailable_reason(self) -> Optional[str]:
        return None

    def supports(self, problem: DecodeProblem, capability: Optional[tuple[int, int]]) -> Optional[str]:
        raise NotImplementedError

    def compiled_op(self):
        return None

    def compiled_op_for(self, context):
        """The op for a compiled call in ``context`` (its ``selection.CallContext``: calls sharing its plan, CUDA
        graphs or not): ``compiled_op()`` unless a backend's op depends on where the call runs."""
        return self.compiled_op()

    def plan_op(self):
        return None

    def decode_and_plan_op(self):
        return None

    def out_only_op(self):
        return None

    def out_only_op_for(self, context):
        """The out-only op (``out_only_op``) for a compiled call in ``context``: ``out_only_op()`` unless it depends
        on where the call runs."""
        return self.out_only_op()

    def quantized_query_op(self, problem: DecodeProblem):
        return None

    def decode(self, q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices):
        raise NotImplementedError

    def decode_with_q_scale(self, q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale,
                            sparse_indices, q_scale):
        # q_scale only serves backends that quantize q; the result is defined on q as given.
        return self.decode(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices)

    def eager_decode(self, problem: DecodeProblem, args: tuple, with_lse: bool, captured: bool = False):
        """The run of an eager call signature (the contract's nine arguments -> (out, lse), or out alone where
        ``with_lse`` is False), bound once per signature; ``captured``: whether its calls are made while a CUDA
        graph is captured (fixed per signature: ``ops`` keys on it), so the run need not ask."""
        run = self.decode_with_q_scale

        def decode(*args):
            out, lse = run(*args)
            return (out.contiguous(), lse.contiguous()) if with_lse else out.contiguous()

        return decode

    def loaded_from(self) -> Optional[str]:
        return None

    def append_supports(self, device_type: str, capability: Optional[tuple[int, int]]) -> Optional[str]:
        return "does not write caches"

    def append(self, kv_cache, kv_c, k_pe, slot_mapping, kv_scale) -> None:
        raise NotImplementedError


def register_backend(name: str, backend: Union[str, Backend]) -> None:
    """Make a backend known under ``name``: a ``Backend`` object, or the import path of a module defining
    ``BACKEND`` (imported on first use). Replaces an earlier registration of the name."""
    if not isinstance(backend, (str, Backend)):
        raise TypeError(f"register_backend needs a Backend or a module path, got {type(backend).__name__}")
    _REGISTRY[name] = backend
    _LOADED.pop(name, None)
    _GENERATION[0] += 1


def unregister_backend(name: str) -> None:
    """Forget a backend added with ``register_backend`` (built-in ones included)."""
    _REGISTRY.pop(name, None)
    _LOADED.pop(name, None)
    _GENERATION[0] += 1


def forget_plans() -> None:
    """Drop every backend's stored plans and every registered host copy of lengths. For code that writes
    block_table / seq_lens / sparse_indices in a way torch's version counter does not see (inside a CUDA
    graph of its own, a foreign kernel): call it after each such write. ``PagedLatentCache`` never needs it."""
    from mla_inductor.backends._common import forget_plans as forget_stored_plans
    from mla_inductor.cache import HOST_LENGTHS

    forget_stored_plans()
    HOST_LENGTHS.clear()


def plans_shared_in_capture():
    """A context manager for code that captures a whole decode step in one CUDA graph of its own
    (``torch.cuda.graph``) around layers compiled one by one or run eagerly: inside it, the captured calls over
    the same block_table / seq_lens share one plan (FlashMLA: one schedule per step instead of one per layer), as
    the calls of a step compiled whole do. Enter it around the capture only (``hf.CapturedDecodeStep`` does);
    calls that are not captured are unaffected."""
    from mla_inductor.backends._common import plans_shared_in_capture as scope

    return scope()


def registry_generation() -> int:
    """A number that changes whenever a backend is registered or unregistered."""
    return _GENERATION[0]


def registered_backends() -> tuple[str, ...]:
    """Names of every known backend."""
    return tuple(_REGISTRY)


def get_backend(name: str) -> Backend:
    if name not in _LOADED:
        if name not in _REGISTRY:
            raise ValueError(f"unknown MLA backend {name!r}; known: {', '.join(sorted(_REGISTRY))}")
        entry = _REGISTRY[name]
        _LOADED[name] = entry if isinstance(entry, Backend) else importlib.import_module(entry).BACKEND
    return _LOADED[name]


def availability() -> dict[str, Optional[str]]:
    """Each known backend's ``unavailable_reason()`` (None = usable), a broken import reported as a reason."""
    result = {}
    for name in _REGISTRY:
        try:
            result[name] = get_backend(name).unavailable_reason()
        except Exception as e:  # noqa: BLE001 - a backend that cannot even import is simply unavailable
            result[name] = f"import failed: {type(e).__name__}: {e}"
    return result


def kernel_origins() -> dict[str, str]:
    """Each usable backend's ``loaded_from()`` where it says one (e.g. which FlashMLA build serves which mode)."""
    origins = {}
    for name, why in availability().items():
        if why is None:
            origin = get_backend(name).loaded_from()
            if origin:
                origins[name] = origin
    return origins


def library_versions(extra: tuple[str, ...] = ()) -> dict[str, Optional[str]]:
    """Version of every library a known backend draws on (plus ``extra``), read without importing them
    (``library_version``); None where one is not installed."""
    names = dict.fromkeys(extra)
    for name in _REGISTRY:
        try:
            names.update(dict.fromkeys(get_backend(name).libraries))
        except Exception:  # noqa: BLE001 - a backend that cannot import has no libraries to report
            continue
    return {lib: library_version(lib) for lib in names}


def library_version(import_name: str) -> Optional[str]:
    """The installed version of the package imported as ``import_name`` (e.g. ``flash_mla``, from the
    ``sgl-flash-mla`` distribution), read from its metadata without importing it; for a package without
    metadata (run from a source tree), the ``__version__`` of its module if already imported; else None."""
    for distribution in _distributions_of(import_name):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    module = sys.modules.get(import_name)
    return None if module is None else getattr(module, "__version__", "unknown version")


@functools.cache
def _import_names() -> dict[str, list[str]]:
    """Top-level import name -> the installed distributions providing it (read once: scans every one)."""
    return importlib.metadata.packages_distributions()


def _distributions_of(import_name: str) -> list[str]:
    # The import name itself last: a distribution whose metadata lists no files still answers by its name.
    return list(dict.fromkeys(_import_names().get(import_name, []) + [import_name]))


def environment_settings() -> dict[str, Optional[str]]:
    """The environment variables the known backends' answers read (``Backend.environment``), with their
    values: a graph compiled under one setting must not be served from a cache to another."""
    settings = {}
    for name in _REGISTRY:
        try:
            names = get_backend(name).environment
        except Exception:  # noqa: BLE001 - a backend that cannot import reads nothing
            continue
        settings.update({var: os.environ.get(var) for var in names})
    return dict(sorted(settings.items()))


def device_capability(device: torch.device) -> Optional[tuple[int, int]]:
    """(major, minor) of a CUDA device; None for anything else."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)
