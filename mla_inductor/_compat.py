"""The only runtime module that names private torch APIs (``lowering/_compat.py`` fences Inductor's).

Each name here is one private API (or one that differs between the torch releases we support, 2.11
through 2.14) behind a small function, so a torch upgrade that moves one is mended in one place; and the
version reading the package's version gates use (``version_tuple``, on ``packaging``).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import inspect
import logging
import os
import sys
from typing import Callable, Iterator, NamedTuple, Optional, Sequence

import torch
from packaging.version import InvalidVersion, Version

# torch.Tag.cudagraph_unsafe: ops carrying it are run outside CUDA-graph partitions (absent on older torch).
CUDAGRAPH_UNSAFE_TAGS: tuple = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)


def version_tuple(text: str, parts: int = 3) -> tuple[int, ...]:
    """The first ``parts`` release numbers of a version string, parsed by ``packaging`` (PEP 440):
    "0.6.18.post1" -> (0, 6, 18), "13.0" -> (13, 0, 0), "5.23.0.dev0" -> (5, 23, 0), "2.13.0+cu130" ->
    (2, 13, 0). Pre-, post-, dev- and local parts are dropped, so a build of a release passes that release's
    gate; a string that is no version gives zeros. What the package's library and CUDA version gates compare."""
    try:
        release = Version(text).release
    except InvalidVersion:
        return (0,) * parts
    return (release + (0,) * parts)[:parts]


def environment_reader(name: str) -> Callable[[], Optional[str]]:
    """A function returning ``os.environ.get(name)``, for settings read on every op call. It looks the name up
    in ``os.environ``'s own dict of encoded names (the private ``os.environ._data``): a dict lookup, where
    ``os.environ.get`` encodes the name and raises and catches a KeyError when it is unset (many times the
    cost). Every write through ``os.environ`` (``os.environ[...] =``, ``monkeypatch.setenv``,
    ``mock.patch.dict``) is seen at once, exactly as by ``os.environ.get``; ``os.putenv`` is seen by neither.
    Falls back to ``os.environ.get`` where a Python's ``os.environ`` is built otherwise."""
    environ = os.environ
    data = getattr(environ, "_data", None)
    encodekey, decodevalue = getattr(environ, "encodekey", None), getattr(environ, "decodevalue", None)
    if not isinstance(data, dict) or encodekey is None or decodevalue is None:
        return lambda: environ.get(name)
    key, lookup = encodekey(name), data.get

    def read() -> Optional[str]:
        raw = lookup(key)
        return None if raw is None else decodevalue(raw)

    return read


def inductor_loaded() -> bool:
    """Whether Inductor is loaded, read without importing it: ``torch.compile`` loads it when a function is
    wrapped, before the first call compiles anything, so its CUDA graphs may be about to run. Other code may
    load it too (it says nothing of whether a graph was compiled), so callers use it only to skip work that
    would otherwise import Inductor."""
    return "torch._inductor" in sys.modules


def stream_capture_query() -> Callable[[], bool]:
    """``torch.cuda.is_current_stream_capturing`` without its Python wrapper (asked on every FlashInfer / FlashMLA
    call; callers ask only for CUDA tensors): ``torch._C._cuda_isCurrentStreamCapturing`` where this torch is
    built with CUDA (a CPU build has a placeholder of that name that raises), else the public function."""
    query = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
    if query is None or not torch.backends.cuda.is_built():
        return torch.cuda.is_current_stream_capturing
    return query


def raw_stream_query() -> Callable[[int], int]:
    """The current CUDA stream of a device as an int, cheaply (``torch._C._cuda_getCurrentRawStream``; asked
    per call to key per-stream workspaces); where this torch has no CUDA, a function that answers 0."""
    query = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if query is None or not torch.backends.cuda.is_built():
        return lambda device_index: 0
    return query


# ``torch.cuda.current_device()`` without its Python wrapper (asked on every eager call on CUDA tensors, whose
# callers initialized CUDA by making them); a CPU build has no such function and never asks.
current_cuda_device: Callable[[], int] = (
    torch._C._cuda_getDevice if torch.backends.cuda.is_built() and hasattr(torch._C, "_cuda_getDevice")
    else torch.cuda.current_device)


def check_value(cond, message: Callable[[], str]) -> None:
    """``torch._check_value``: a guard for backed symbolic sizes, a runtime assert for unbacked ones."""
    torch._check_value(cond, message)


def assert_on_device(condition: torch.Tensor, message: str) -> None:
    """``torch._assert_async(condition, message)``: a device-side assert; the host does not wait for it (a
    failed one stops the process with "device-side assert triggered"; on CPU it raises RuntimeError)."""
    torch._assert_async(condition, message)


def tensor_properties_check(tensors: Sequence[torch.Tensor]) -> Optional[Callable[..., bool]]:
    """A function telling whether the tensors it is given have the dtypes, devices, sizes, strides, dispatch
    keys and requires_grad of ``tensors``, in order: Dynamo's C++ ``TensorGuards`` (private), one C call where
    building and hashing a tuple of those properties takes dozens of Python attribute reads. It keeps no
    reference to the tensors. None where this torch has no such guard."""
    try:
        guards = torch._C._dynamo.guards.TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)
    except (AttributeError, TypeError, RuntimeError):
        return None
    return guards.check


def schema_arguments(op) -> list:
    """The arguments of an OpOverload's schema (``op._schema.arguments``: name, type, default, alias info)."""
    return list(op._schema.arguments)


def op_packet_class() -> type:
    """``torch._ops.OpOverloadPacket``: the class of ``torch.ops.<namespace>.<name>``."""
    return torch._ops.OpOverloadPacket


def eager_call_reaches_kernel() -> Callable[[], bool]:
    """A query: would an op called now go from the dispatcher straight to its kernel? False while a
    TorchDispatchMode (fake tensors, functionalization, tracing, FlopCounter...) or a TorchFunctionMode (``with
    torch.device(...)``) is active, a functorch transform (vmap, grad) runs, or the profiler records (so that it
    still sees the op). Private torch functions; where one is missing the query always says False."""
    c = torch._C
    dispatch_modes = getattr(c, "_len_torch_dispatch_stack", None)
    function_modes = getattr(c, "_is_torch_function_mode_enabled", None)
    functorch = getattr(getattr(c, "_functorch", None), "peek_interpreter_stack", None)
    profiling = getattr(getattr(c, "_autograd", None), "_profiler_enabled", None)
    if None in (dispatch_modes, function_modes, functorch, profiling):
        return lambda: False

    def reaches() -> bool:
        return not (dispatch_modes() or function_modes() or profiling() or functorch() is not None)

    return reaches


def mark_static_address(t: torch.Tensor) -> None:
    """``torch._dynamo.mark_static_address``: CUDA-graph trees read the tensor in place, never copy it."""
    import torch._dynamo

    torch._dynamo.mark_static_address(t)


def version_counter(t: torch.Tensor) -> int:
    """``Tensor._version``: bumped by every in-place write through torch (views share their base's counter).
    Writes that bypass torch (a CUDA-graph replay, a foreign kernel on the raw pointer) do not bump it."""
    return t._version


def current_compile() -> Optional[tuple[int, int, int]]:
    """Which Dynamo compile is running, or None outside one: (the frame's id, that frame's compile number,
    an id of this compile's tracing context), from ``torch._guards.CompileContext`` / ``TracingContext``."""
    from torch._guards import CompileContext, TracingContext

    compile_id = CompileContext.current_compile_id()
    if compile_id is None:
        return None
    return compile_id.frame_id, compile_id.frame_compile_id, id(TracingContext.try_get())


def real_tensors():
    """A context in which tensors are real even inside a fake-tensor trace (for measuring on the device
    while a fake impl runs): ``torch._subclasses.fake_tensor.unset_fake_temporarily``."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


# ----------------------------------------------------------------------------- Triton kernel launches


class StaticKernel(NamedTuple):
    """A compiled Triton kernel loaded by torch's own launcher for Triton cubins (Inductor's
    ``StaticallyLaunchedCudaKernel`` and ``torch._C._StaticCudaLauncher``, private): one C call per launch,
    where Triton's launcher first asks the current device and stream and its launch metadata in Python, a
    noticeable share of a short call's host time (docs/results.md#program-shapes).

    ``launch(function, grid_x, grid_y, grid_z, num_warps, shared, arg_types, args, stream)`` is the C entry;
    ``runtime_positions``: which of the kernel's parameters (in signature order) are passed at run time (the
    rest are constexprs compiled in); ``scratch``: the trailing ``None`` arguments the cubin takes for Triton's
    (unused, size 0) global / profile scratch buffers.
    """

    launch: Callable
    function: int
    num_warps: int
    shared: int
    arg_types: str
    runtime_positions: list
    scratch: int
    owner: object  # torch's kernel object: it owns the loaded module (unloaded when collected)


def _static_launcher_class():
    for module in ("torch._inductor.runtime.static_triton_launcher",  # torch >= 2.12
                   "torch._inductor.runtime.static_cuda_launcher"):
        try:
            return importlib.import_module(module).StaticallyLaunchedCudaKernel
        except (ImportError, AttributeError):
            continue
    return None


def _runtime_positions(src) -> list[int]:
    """The kernel parameters Triton passes at run time, in order (as torch's launcher filters them)."""
    names = list(src.fn.arg_names)

    def index(key) -> int:
        return names.index(key) if isinstance(key, str) else key[0] if isinstance(key, tuple) else key

    signature = {index(k): v for k, v in src.signature.items()}
    constants = {index(k) for k in getattr(src, "constants", {})}
    return [i for i in sorted(signature) if signature[i] != "constexpr" and i not in constants]


def static_triton_kernel(compiled, device_index: int) -> Optional[StaticKernel]:
    """``compiled`` (a Triton ``CompiledKernel`` for a CUDA device) loaded on ``device_index`` by torch's static
    launcher, or None where this torch, Triton or kernel cannot be launched that way (the caller keeps
    Triton's own launcher): no such torch API, no cubin, launch hooks, more than one CTA, scratch memory in
    use, launch attributes (PDL, cooperative grids) or a torch that refuses the kernel (older releases take
    at most 48 KB of shared memory)."""
    cls = _static_launcher_class()
    launcher = getattr(torch._C, "_StaticCudaLauncher", None)
    cubin = getattr(compiled, "asm", {}).get("cubin")
    if cls is None or launcher is None or cubin is None or not torch.backends.cuda.is_built():
        return None
    if getattr(compiled.metadata, "launch_pdl", False) or getattr(compiled.metadata, "launch_cooperative_grid", False):
        return None  # launch attributes torch's launcher does not set (as Inductor checks too)
    scratch = 0
    for size_name in ("global_scratch_size", "profile_scratch_size"):
        size = getattr(compiled.metadata, size_name, None)
        if size:
            return None  # Triton would allocate it per launch: not ours to imitate
        scratch += size is not None
    import tempfile

    with tempfile.TemporaryDirectory(prefix="mla_inductor_cubin_") as folder:
        path = os.path.join(folder, f"{compiled.src.fn.__name__}.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        had_path = hasattr(compiled, "_cubin_path")
        previous = getattr(compiled, "_cubin_path", None)
        compiled._cubin_path = path  # where torch's class reads the cubin from (Inductor sets it the same way)
        try:
            kernel = cls(compiled)
            try:
                kernel.load_kernel(device_index)
            except TypeError:  # torch < 2.9: loads on the current device
                kernel.load_kernel()
        except (NotImplementedError, RuntimeError, AttributeError, KeyError, TypeError):
            return None
        finally:
            if had_path:
                compiled._cubin_path = previous
            else:
                del compiled._cubin_path
    positions = _runtime_positions(compiled.src)
    if len(positions) != len(kernel.arg_tys) or kernel.function is None:
        return None
    return StaticKernel(launcher._launch_kernel, kernel.function, kernel.num_warps, kernel.shared,
                        kernel.arg_tys + "O" * scratch, positions, scratch, kernel)


def gluon_async_load(async_copy_module):
    """Gluon's cp.async builtin (global -> shared, predicated): ``async_load`` in newer Triton (3.9 keeps the old
    name only to raise), ``async_copy_global_to_shared`` in Triton 3.5-3.6. Same arguments (smem, pointers, mask)."""
    return getattr(async_copy_module, "async_load", None) or async_copy_module.async_copy_global_to_shared


def gluon_cta_barrier(gl_module):
    """Gluon's barrier of every thread of a program: ``barrier`` in newer Triton, ``thread_barrier`` in 3.5-3.6."""
    return getattr(gl_module, "barrier", None) or gl_module.thread_barrier


def gluon_kernels_compile(gl_module) -> bool:
    """Whether this Triton's Gluon takes the forms our Gluon kernels are written in: ``warp_specialize`` given a
    list of (function, arguments) pairs (Triton 3.6 on; 3.5 took the default and the worker partitions' arguments
    apart, and its ``_reinterpret`` builtin cannot be called from kernel code). Older ones run the tl.dot kernel."""
    try:
        params = list(inspect.signature(gl_module.warp_specialize).parameters)
    except (AttributeError, TypeError, ValueError):
        return False
    return params[:1] == ["functions_and_args"]


def gluon_smem_reinterpret(gl_module):
    """Gluon's view of a shared buffer with another dtype / shape / layout (desc, dtype, shape, layout), called as a
    builtin from kernel code: ``reinterpret`` in newer Triton, ``_reinterpret`` in 3.6 (3.5's cannot be called
    from kernel code; ``gluon_kernels_compile`` keeps 3.5 off the Gluon kernels)."""
    desc = gl_module.shared_memory_descriptor
    return getattr(desc, "reinterpret", None) or desc._reinterpret


# ----------------------------------------------------------------------------- collectives

# Traced steps use functional collectives, which return new tensors instead of writing into an argument: that
# is what lets torch.compile trace them (Inductor lowers them). Eager calls use c10d's collectives into a fresh
# output, the same NCCL / gloo work without functional collectives' eager layers (an autograd-function
# dispatch, a tensor subclass and a separate wait op per call), which eager DCP pays three times per layer.


def _functional_collectives():
    """``torch.distributed._functional_collectives``, imported on first use, so ``import mla_inductor`` loads
    none of torch.distributed's modules."""
    import torch.distributed._functional_collectives as funcol

    return funcol


def traced() -> bool:
    """Whether Dynamo is tracing the calling code (``torch.compiler.is_compiling``)."""
    return torch.compiler.is_compiling()


def all_gather_tensor(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` (rank order)."""
    world = torch.distributed.get_world_size(group)
    if traced():
        funcol = _functional_collectives()
        # torch 2.13 renamed all_gather_tensor / reduce_scatter_tensor to *_single; 2.11 has the old names only.
        gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
        # Gathered along dim 0, then rearranged here: for another dim, torch 2.11's all_gather_tensor calls a
        # helper Dynamo refuses to trace (torch._utils._maybe_view_chunk_cat), which broke compiled DCP steps.
        gathered = funcol.wait_tensor(gather(x, 0, group))
    else:
        gathered = x.new_empty((world * x.shape[0], *x.shape[1:]))
        torch.distributed.all_gather_into_tensor(gathered, x, group=group)
    dim %= x.dim()
    if dim == 0:
        return gathered
    # [world·d0, ...] -> [world, d0, ...] -> rank blocks next to ``dim`` -> merged into it (also for d0 == 0).
    return gathered.view(world, *x.shape).movedim(0, dim).flatten(dim, dim + 1)


def reduce_scatter_tensor_sum(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """``x`` summed over ranks, this rank's block of ``dim`` kept."""
    if traced() or dim != 0:
        funcol = _functional_collectives()
        scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
        return funcol.wait_tensor(scatter(x, "sum", dim, group))
    out = x.new_empty((x.shape[0] // torch.distributed.get_world_size(group), *x.shape[1:]))
    torch.distributed.reduce_scatter_tensor(out, x, op=torch.distributed.ReduceOp.SUM, group=group)
    return out


def all_to_all_equal_blocks(x: torch.Tensor, group) -> torch.Tensor:
    """Block j of dim 0 sent to rank j; block i of the result came from rank i."""
    if traced():
        funcol = _functional_collectives()
        return funcol.wait_tensor(funcol.all_to_all_single(x, None, None, group))
    out = torch.empty_like(x)
    torch.distributed.all_to_all_single(out, x, group=group)
    return out


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` summed over ranks, as a new tensor (``x`` is left as it is)."""
    if traced():
        funcol = _functional_collectives()
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))
    out = x.clone()
    torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.SUM, group=group)
    return out


# ----------------------------------------------------------------------------- argument errors at compile time

# Dynamo runs each op's fake impl while it traces and wraps what it raises in its own TorchRuntimeError
# (torch 2.11 to 2.14), all but its own ``torch._dynamo.exc.Unsupported`` errors, which it re-raises as they
# are. An argument error raised by a fake impl is therefore re-raised as a subclass of both the documented
# type and ``Unsupported``: the user catches the ValueError / TypeError the docs promise (with
# fullgraph=True; without it Dynamo breaks the graph there and the eager op raises the plain error).
_COMPILE_TIME_ERRORS: dict[type, type] = {}


@contextlib.contextmanager
def argument_errors_reach_the_user(any_message: bool = False) -> Iterator[None]:
    """Around a fake impl: an ``mla.``-prefixed ValueError / TypeError (any, with ``any_message``: a refusal
    raised from traced Python code of ours) leaves it as a subclass that Dynamo passes through unwrapped (see
    above). Outside a Dynamo trace nothing changes but the class."""
    try:
        yield
    except (ValueError, TypeError) as e:
        passing = _compile_time_error(type(e)) if any_message or str(e).startswith("mla.") else None
        if passing is None:
            raise
        raise passing(str(e)).with_traceback(e.__traceback__) from None


def _compile_time_error(base: type) -> type | None:
    """The subclass of ``base`` (ValueError or TypeError) that also derives from Dynamo's ``Unsupported``;
    None while Dynamo is not loaded (then nothing traces, and importing it would cost seconds)."""
    dynamo_exc = sys.modules.get("torch._dynamo.exc")
    if dynamo_exc is None:
        return None
    if base not in _COMPILE_TIME_ERRORS:
        unsupported = dynamo_exc.Unsupported

        def __init__(self, msg: str) -> None:
            unsupported.__init__(self, msg)

        _COMPILE_TIME_ERRORS[base] = type(f"Compile{base.__name__}", (base, unsupported), {
            "__init__": __init__, "__module__": __name__,
            "__doc__": f"A {base.__name__} raised while torch.compile traces an mla op; Dynamo re-raises it as is."})
        # FakeTensorMode logs every TypeError raised under it, traceback and all, before Dynamo re-raises
        # it: ours is the user's input error, already in the exception, so that record is dropped.
        logging.getLogger("torch._subclasses.fake_tensor").addFilter(_not_a_compile_time_error)
    return _COMPILE_TIME_ERRORS[base]


def _not_a_compile_time_error(record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    return not isinstance(error, tuple(_COMPILE_TIME_ERRORS.values()))


# ----------------------------------------------------------------------------- installing the pass lazily

INDUCTOR_CONFIG = "torch._inductor.config"


def install_post_grad_pass_on_first_compile(load_pass: Callable[[], object]) -> None:
    """Make Inductor run our post-grad pass without importing Inductor now.

    Inductor reads its post-grad custom pass from ``torch._inductor.config.post_grad_custom_post_pass``
    (when it lowers a graph, and for its FX-graph-cache key). That module is first imported by the first
    ``torch.compile`` that reaches Inductor. Here a placeholder pass is put there as soon as the module
    exists: at once if it is already imported, else right after its import (an import hook). The
    placeholder is a ``CustomGraphPass``; its first use (a call, or ``uuid()`` for the cache key) calls
    ``load_pass()``, which imports the real pass, installs it in the placeholder's stead (keeping the
    placeholder's ``previous``: whatever pass the user had there) and returns it; the placeholder then
    hands the call on.
    """
    config = sys.modules.get(INDUCTOR_CONFIG)
    if config is not None:
        _install_placeholder(config, load_pass)
        return
    if not any(isinstance(f, _AfterImport) and f.name == INDUCTOR_CONFIG for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(INDUCTOR_CONFIG, lambda module: _install_placeholder(module, load_pass)))


def is_placeholder_pass(obj) -> bool:
    return getattr(obj, "_mla_inductor_placeholder", False)


def _install_placeholder(config, load_pass) -> None:
    from torch._inductor.custom_graph_pass import CustomGraphPass  # imported by the config module itself

    current = config.post_grad_custom_post_pass
    if is_placeholder_pass(current):
        return

    class PlaceholderPass(CustomGraphPass):
        """Stands for mla_inductor's pass until Inductor first uses it (see the function above)."""

        _mla_inductor_placeholder = True

        def __init__(self, previous):
            self.previous = previous

        def __call__(self, graph):
            return load_pass()(graph)

        def uuid(self):
            return load_pass().uuid()

    config.post_grad_custom_post_pass = PlaceholderPass(current)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` right after module ``name`` is first imported, then steps aside."""

    def __init__(self, name: str, callback):
        self.name = name
        self.callback = callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = None
        for finder in list(sys.meta_path):  # whoever would have found it without us
            spec = getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _CallbackLoader(spec.loader, self.callback)
        return spec


class _CallbackLoader(importlib.abc.Loader):
    def __init__(self, loader, callback):
        self.loader = loader
        self.callback = callback

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        # The config module may replace itself in sys.modules (torch's config modules change their class).
        self.callback(sys.modules.get(module.__name__, module))


def while_loop(cond_fn: Callable, body_fn: Callable, carried: Sequence[torch.Tensor],
               additional: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``torch.ops.higher_order.while_loop`` (prototype control flow, torch 2.11 to 2.14).

    Eager: a Python loop calling ``body_fn(*carried, *additional)`` while ``cond_fn`` (a 0-d bool
    tensor) holds. Traced (make_fx, the Inductor pass): one ``while_loop`` node whose subgraphs Inductor
    generates as kernels run in a loop, so the loop's memory is that of one iteration. The functions
    must not close over tensors (pass them in ``additional``) and must return carries of unchanged
    shape, dtype and strides.
    """
    return torch.ops.higher_order.while_loop(cond_fn, body_fn, tuple(carried), tuple(additional))


def outside_dispatch_modes():
    """A context in which new tensors are real even inside a compile (Inductor's pass runs under its fake
    mode): the dispatch modes in force are set aside (``torch.utils._python_dispatch._disable_current_modes``)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()
