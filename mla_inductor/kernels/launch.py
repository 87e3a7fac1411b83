"""A Triton kernel launched again and again with the same grid, scalars and options, at little host cost.

``kernel[grid](*args)`` runs Triton's JIT front door on every launch: it binds every argument, works out
each one's specialization (dtype, 16-byte alignment of pointers, ints equal to 1 or divisible by 16), turns
the options into a cache key string and looks the compiled kernel up. For our decode kernel (34 arguments)
that is most of a short call's host time. ``KernelLaunch`` fixes everything but the tensors when it is made
(one per call signature: its owner keys it by shapes, strides, dtypes and scalars), so the specialization
can differ between launches only by pointer alignment. The first launch goes through the JIT (compiling if
needed); later ones call the compiled kernel's own launcher (``CompiledKernel[grid]``, Triton's interface
for launching a compiled kernel, the same from Triton 3.3 on: every argument in signature order, constexprs
included), as long as every pointer is 16-byte aligned like the first launch's and the current device is the
one the kernel was loaded on. Otherwise the launch goes through the JIT, which handles any case.

Where torch can load the compiled kernel itself (``_compat.static_triton_kernel``: Inductor's launcher for
Triton cubins), the relaunch is one C call with the tensors and the precomputed run-time scalars; Triton's own
launcher asks the current device, stream and launch metadata in Python first, a noticeable share of a
short launch's host time (docs/results.md#program-shapes).

The tensors must be the kernel's first parameters; everything after them is fixed (``static_args``). Under
Triton's interpreter (CPU tensors) every launch goes through the JIT.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from mla_inductor._compat import current_cuda_device, raw_stream_query, static_triton_kernel
from mla_inductor._memo import Memo


def compiled_kernel_class() -> Optional[type]:
    try:
        from triton.compiler import CompiledKernel
    except Exception:  # noqa: BLE001 - no compiled kernels to relaunch: every launch takes the JIT path
        return None
    return CompiledKernel


def on_cuda(t: torch.Tensor) -> bool:
    """Whether ``t`` is on a CUDA device (elsewhere Triton interprets: nothing compiled to relaunch)."""
    return t.is_cuda


def current_device() -> int:
    """The current CUDA device: the one Triton launches on, and loads a compiled kernel for (asked on every
    relaunch: ``_compat.current_cuda_device``, without ``torch.cuda.current_device``'s Python wrapper)."""
    return current_cuda_device()


def aligned(tensors: tuple) -> bool:
    """Whether every tensor's address is a multiple of 16 bytes (what Triton specializes pointers on)."""
    bits = 0
    for t in tensors:
        bits |= t.data_ptr()
    return not bits & 15


class KernelLaunch:
    """``kernel[grid](*tensors, *static_args, **options)``, relaunched through the compiled kernel.

    ``jit_launches`` / ``direct_launches`` count the two paths (tests pin that repeated calls skip the JIT).
    """

    __slots__ = ("kernel", "grid", "static_args", "options", "compiled", "static", "_runner", "_device",
                 "jit_launches", "direct_launches")

    def __init__(self, kernel, grid: tuple, static_args: tuple, options: dict):
        self.kernel = kernel
        # The compiled kernel's launcher reads grid[0], grid[1] and grid[2] (the JIT pads a shorter grid itself)
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.static_args = static_args
        self.options = options
        self.compiled: Any = None  # the compiled kernel of the first aligned CUDA launch (register reports)
        self.static = False  # whether relaunches go through torch's static launcher (else Triton's)
        self._runner = None
        self._device = None
        self.jit_launches = 0
        self.direct_launches = 0

    def __call__(self, *tensors):
        """Launch on ``tensors`` (the kernel's first arguments); returns the compiled kernel where known."""
        runner = self._runner
        if runner is not None and aligned(tensors) and current_device() == self._device:
            self.direct_launches += 1
            runner(tensors)
            return self.compiled
        self.jit_launches += 1
        compiled = self.kernel[self.grid](*tensors, *self.static_args, **self.options)
        if runner is None and on_cuda(tensors[0]) and aligned(tensors):
            self._keep(compiled)
        return compiled

    def _keep(self, compiled) -> None:
        kind = compiled_kernel_class()
        if kind is not None and isinstance(compiled, kind):
            self.compiled = compiled
            self._device = current_device()
            runner = static_runner(compiled, self.grid, self.static_args, self._device)
            self.static = runner is not None
            self._runner = runner or triton_runner(compiled, self.grid, self.static_args)


def triton_runner(compiled, grid: tuple, static_args: tuple):
    """Relaunch through Triton's launcher for a compiled kernel: every argument in signature order."""
    launcher = compiled[grid]
    return lambda tensors: launcher(*tensors, *static_args)


def static_runner(compiled, grid: tuple, static_args: tuple, device: int):
    """Relaunch through torch's static launcher (one C call), or None where it cannot load this kernel."""
    kernel = static_triton_kernel(compiled, device)
    if kernel is None:
        return None
    first_static = len(compiled.src.fn.arg_names) - len(static_args)
    positions = kernel.runtime_positions
    if positions[:first_static] != list(range(first_static)):
        return None  # a tensor compiled in as a constant: not a launch of this form
    fixed = tuple(static_args[i - first_static] for i in positions[first_static:]) + (None,) * kernel.scratch
    launch, function, (gx, gy, gz) = kernel.launch, kernel.function, grid
    num_warps, shared, arg_types, stream = kernel.num_warps, kernel.shared, kernel.arg_types, raw_stream_query()
    keep = kernel.owner  # the loaded module lives as long as the runner

    def run(tensors, keep=keep):
        launch(function, gx, gy, gz, num_warps, shared, arg_types, tensors + fixed, stream(device))

    return run


_CACHED: Memo = Memo()


def launch(kernel, grid: tuple, tensors: tuple, static_args: tuple, **options):
    """``kernel[grid](*tensors, *static_args, **options)`` through the ``KernelLaunch`` of these grid, scalars
    and options (kept per kernel): for small kernels launched once per call with arguments that follow from
    the call's shapes (their keys are built per launch, cheaper than the JIT's binding)."""
    # The tensors' dtypes too: Triton compiles a kernel per pointer dtype, and the direct relaunch checks none.
    # Their device: a launch keeps the compiled kernel of one device (a step alternating over two GPUs keeps two).
    key = (id(kernel), grid, static_args, tuple(options.items()), tuple(t.dtype for t in tensors),
           tensors[0].get_device())
    prepared = _CACHED.get(key)
    if prepared is None:
        prepared = _CACHED.put(key, KernelLaunch(kernel, grid, static_args, options))
    return prepared(*tensors)
