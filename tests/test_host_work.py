"""Little host work per call (issue 12, item 4): what a call decides once per signature is not decided again.

Counted, not timed: the Triton decode of one call signature is prepared once (checks, launch configuration,
kernel arguments), eagerly and from the compiled graph's op; each call then launches the decode kernel and,
where the sequence is split, the merge (two launches, no others); and ``KernelLaunch`` relaunches a compiled
kernel through the kernel's own launcher, going back to Triton's JIT front door only where the pointers'
alignment or the current device differs from the first launch's. The timings are
``benchmarks/bench_host_overhead.py``'s.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

import mla_inductor
from mla_inductor._memo import Memo
from mla_inductor.kernels import decode as decode_kernels
from mla_inductor.kernels import launch as launch_module
from mla_inductor.kernels.launch import KernelLaunch
from mla_inductor.testing import make_decode_inputs, relative_error
from triton_support import TRITON_DEVICE, needs_triton

# Dims the Triton backend takes (L 256, R 32), small; page 8 and 40 tokens: the CPU configuration splits
# sequences longer than 64 positions (block table width 9 -> 72), so the merge kernel runs too.
TRITON_SMALL = dict(kv_lora_rank=256, rope_dim=32, page_size=8, num_heads=4, q_dtype=torch.bfloat16, fmt="bf16")


# ----------------------------------------------------------------------------- KernelLaunch

class _Compiled:
    """Stands in for triton's CompiledKernel: ``compiled[grid](*args)`` records the launch."""

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        def runner(*args, stream=None):
            grid[0], grid[1], grid[2]  # what triton's launcher reads: a shorter grid raised IndexError on the GPU
            self.log.append(("direct", grid, args))

        return runner


class _Kernel:
    """Stands in for a @triton.jit function: ``kernel[grid](*args, **options)`` records the launch."""

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.log.append(("jit", grid, args, options))
            return _Compiled(self.log)

        return launch


@pytest.fixture
def as_if_on_cuda(monkeypatch):
    """KernelLaunch as on a GPU: CPU tensors count as CUDA ones, the fake compiled kernel as triton's, and the
    current stream is stream 0 (a CUDA build of torch without a GPU driver cannot query one)."""
    device = {"current": 0}
    monkeypatch.setattr(launch_module, "on_cuda", lambda t: True)
    monkeypatch.setattr(launch_module, "compiled_kernel_class", lambda: _Compiled)
    monkeypatch.setattr(launch_module, "current_device", lambda: device["current"])
    monkeypatch.setattr(launch_module, "raw_stream_query", lambda: lambda index: 0)
    return device


def test_a_kernel_launch_goes_through_the_jit_once_then_through_the_compiled_kernel(as_if_on_cuda):
    kernel = _Kernel()
    x, y = torch.randn(64), torch.randn(32)
    launch = KernelLaunch(kernel, (7,), (3, 1.5, "C"), dict(num_warps=4))
    for _ in range(3):
        launch(x, y)
    assert [entry[0] for entry in kernel.log] == ["jit", "direct", "direct"]
    assert kernel.log[0] == ("jit", (7, 1, 1), (x, y, 3, 1.5, "C"), dict(num_warps=4))
    assert kernel.log[1] == ("direct", (7, 1, 1), (x, y, 3, 1.5, "C"))  # every argument in order, constexprs too
    assert (launch.jit_launches, launch.direct_launches) == (1, 2)


def test_a_kernel_launch_relaunches_through_torchs_static_launcher_where_it_loads_the_kernel(as_if_on_cuda,
                                                                                             monkeypatch):
    """Where torch's launcher loads the compiled kernel, a relaunch is one call with the grid, the kernel's
    launch facts and only its run-time arguments (constexprs left out, scratch buffers as trailing Nones)."""
    from mla_inductor._compat import StaticKernel

    calls = []

    def c_launch(*args):
        calls.append(args)

    def load(compiled, device):
        # Parameters: x, y, n (run time), s (run time), C (constexpr); two scratch buffers.
        assert device == 0
        return StaticKernel(c_launch, "fn", 8, 4096, "OOifOO", [0, 1, 2, 3], 2, owner=None)

    class Src:
        class fn:
            arg_names = ["x", "y", "n", "s", "C"]

    class Compiled(_Compiled):
        src = Src

    class Kernel(_Kernel):
        def __getitem__(self, grid):
            return lambda *args, **options: Compiled(self.log)

    kernel = Kernel()
    monkeypatch.setattr(launch_module, "static_triton_kernel", load)
    x, y = torch.randn(64), torch.randn(32)
    launch = KernelLaunch(kernel, (7, 2), (3, 1.5, "C"), dict(num_warps=8))
    for _ in range(3):
        launch(x, y)
    assert launch.static and (launch.jit_launches, launch.direct_launches) == (1, 2)
    assert len(calls) == 2
    function, gx, gy, gz, warps, shared, types, args, stream = calls[0]
    assert (function, gx, gy, gz, warps, shared, types) == ("fn", 7, 2, 1, 8, 4096, "OOifOO")
    assert args[0] is x and args[1] is y and args[2:] == (3, 1.5, None, None)
    assert isinstance(stream, int)


def test_the_static_launch_passes_only_the_kernels_run_time_parameters():
    """Triton's signature names every parameter; constexprs (declared, or an int of 1 Triton specialized into a
    constant) are compiled in and not passed (as torch's launcher filters them)."""
    from mla_inductor._compat import _runtime_positions

    class Src:
        class fn:
            arg_names = ["X", "Y", "n", "one", "BLOCK"]

        signature = {"X": "*bf16", "Y": "*fp32", "n": "i32", "one": "i32", "BLOCK": "constexpr"}
        constants = {(3,): 1, (4,): 64}

    assert _runtime_positions(Src) == [0, 1, 2]


def test_a_kernel_launch_keeps_tritons_launcher_where_torch_cannot_load_the_kernel(as_if_on_cuda, monkeypatch):
    monkeypatch.setattr(launch_module, "static_triton_kernel", lambda compiled, device: None)
    kernel = _Kernel()
    x = torch.randn(8)
    launch = KernelLaunch(kernel, (1,), (2,), {})
    launch(x)
    launch(x)
    assert not launch.static
    assert [entry[0] for entry in kernel.log] == ["jit", "direct"]


def test_a_kernel_launch_takes_the_jit_where_the_specialization_or_the_device_may_differ(as_if_on_cuda):
    kernel = _Kernel()
    base = torch.randn(64)
    launch = KernelLaunch(kernel, (1,), (), {})
    launch(base, base)
    launch(base[1:], base)  # 4 bytes off: Triton would specialize the pointer differently
    as_if_on_cuda["current"] = 1  # the compiled kernel was loaded on device 0
    launch(base, base)
    as_if_on_cuda["current"] = 0
    launch(base, base)
    assert [entry[0] for entry in kernel.log] == ["jit", "jit", "jit", "direct"]


def test_a_kernel_launch_first_made_unaligned_never_relaunches(as_if_on_cuda):
    kernel = _Kernel()
    base = torch.randn(64)
    launch = KernelLaunch(kernel, (1,), (), {})
    launch(base[1:])  # compiled for an unaligned pointer: not kept for aligned ones
    launch(base)
    launch(base)
    assert [entry[0] for entry in kernel.log] == ["jit", "jit", "direct"]


def test_small_kernel_launches_are_kept_per_dtype(as_if_on_cuda, monkeypatch):
    """Triton compiles a kernel per pointer dtype and the direct relaunch checks none: tensors of another
    dtype with the same grid and scalars get a launch of their own."""
    monkeypatch.setattr(launch_module, "_CACHED", Memo())
    kernel = _Kernel()
    bf16, fp16 = torch.randn(64).bfloat16(), torch.randn(64).half()
    for t in (bf16, fp16, bf16, fp16):
        launch_module.launch(kernel, (2,), (t,), (64,))
    assert [entry[0] for entry in kernel.log] == ["jit", "jit", "direct", "direct"]
    assert len(launch_module._CACHED) == 2


def test_small_kernel_launches_are_kept_per_device(as_if_on_cuda, monkeypatch):
    """A launch keeps one device's compiled kernel: the same kernel, grid and dtypes on a second GPU get a
    launch of their own, so a step alternating over two GPUs relaunches directly on both."""
    monkeypatch.setattr(launch_module, "_CACHED", Memo())
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: getattr(self, "gpu", -1))
    kernel = _Kernel()
    on_0, on_1 = torch.randn(64), torch.randn(64)
    on_0.gpu, on_1.gpu = 0, 1
    for t in (on_0, on_1, on_0, on_1):
        as_if_on_cuda["current"] = t.gpu  # the op's device guard makes the tensors' device current
        launch_module.launch(kernel, (2,), (t,), (64,))
    assert len(launch_module._CACHED) == 2
    assert [entry[0] for entry in kernel.log] == ["jit", "jit", "direct", "direct"]


def test_a_kernel_launch_on_cpu_always_takes_the_jit():
    kernel = _Kernel()
    launch = KernelLaunch(kernel, (1,), (), {})
    for _ in range(2):
        launch(torch.randn(8))
    assert [entry[0] for entry in kernel.log] == ["jit", "jit"]


# ----------------------------------------------------------------------------- the Triton backend

class _Counted:
    """Counts ``DecodeLaunch`` constructions and kernel launches while active."""

    def __init__(self, monkeypatch):
        self.prepared = 0
        self.launches = 0
        original_init, original_call = decode_kernels.DecodeLaunch.__init__, KernelLaunch.__call__

        def init(launch, *args, **kwargs):
            self.prepared += 1
            original_init(launch, *args, **kwargs)

        def call(launch, *tensors):
            self.launches += 1
            return original_call(launch, *tensors)

        monkeypatch.setattr(decode_kernels.DecodeLaunch, "__init__", init)
        monkeypatch.setattr(KernelLaunch, "__call__", call)


def _triton_inputs(seq_lens, seed=0, **overrides):
    dims = dict(TRITON_SMALL, **overrides)
    return make_decode_inputs(seq_lens=seq_lens, device=TRITON_DEVICE, seed=seed, **dims)


@needs_triton
def test_triton_eager_calls_prepare_once_per_signature_and_launch_decode_and_merge_only(monkeypatch):
    import mla_inductor.ops as ops
    from mla_inductor.backends import triton as triton_backend

    monkeypatch.setattr(ops, "_EAGER_CALLS", Memo())
    monkeypatch.setattr(triton_backend, "_LAUNCHES", Memo())
    counted = _Counted(monkeypatch)
    x = _triton_inputs([40, 13, 66])
    want = mla_inductor.paged_decode_reference(*x.args())
    with mla_inductor.prefer_backends("triton"):
        assert mla_inductor.backend_for_call(*x.args()).backend == "triton"
        for _ in range(3):
            out, lse = torch.ops.mla.paged_decode_with_lse(*x.args())
            assert relative_error(out, want[0]) < 2e-2
            assert torch.allclose(lse, want[1], atol=2e-3, rtol=0)
        assert counted.prepared == 1
        assert counted.launches == 3 * 2  # decode + merge (the CPU configuration splits 72 positions), nothing else
        # Another signature (a wider block table) is prepared afresh, and the first one is still served.
        y = _triton_inputs([40, 13, 66], seed=1, max_pages=12)
        torch.ops.mla.paged_decode_with_lse(*y.args())
        torch.ops.mla.paged_decode_with_lse(*x.args())
        assert counted.prepared == 2
        # The compiled graph's op on a signature eager calls prepared uses the same launch.
        triton_backend.DECODE_OP(*x.args(), [])
        assert counted.prepared == 2


@needs_triton
def test_triton_calls_whose_lse_nobody_reads_write_it_into_a_kept_scratch(monkeypatch):
    """mla.paged_decode on our Triton kernel, eager or compiled without CUDA graphs: the lse the kernel must write
    goes to a scratch the launch keeps (no allocation per call); calls that return the lse get their own."""
    import mla_inductor.ops as ops
    from mla_inductor.backends import triton as triton_backend

    monkeypatch.setattr(ops, "_EAGER_CALLS", Memo())
    monkeypatch.setattr(triton_backend, "_LAUNCHES", Memo())
    x = _triton_inputs([40, 13, 66], seed=4)
    want_out, want_lse = mla_inductor.paged_decode_reference(*x.args())
    with mla_inductor.prefer_backends("triton"):
        outs = [torch.ops.mla.paged_decode(*x.args()) for _ in range(2)]
        (launch,) = triton_backend._LAUNCHES.values()
        scratch = launch.lse_scratch
        assert scratch is not None and scratch.shape == launch.lse_shape
        compiled = triton_backend.DECODE_OUT_KEEPING_WORKSPACE_OP(*x.args(), [])
        assert launch.lse_scratch is scratch
        out, lse = torch.ops.mla.paged_decode_with_lse(*x.args())
        assert launch.lse_scratch is scratch
    for o in (*outs, compiled, out):
        assert relative_error(o, want_out) < 2e-2
    assert lse.untyped_storage().data_ptr() != scratch.untyped_storage().data_ptr()
    assert torch.allclose(lse, want_lse, atol=2e-3, rtol=0)


@needs_triton
def test_the_compiled_graphs_triton_op_prepares_once_per_signature(monkeypatch):
    from mla_inductor.backends import triton as triton_backend

    monkeypatch.setattr(triton_backend, "_LAUNCHES", Memo())
    counted = _Counted(monkeypatch)
    x = _triton_inputs([40, 13, 66], seed=2)
    want = mla_inductor.paged_decode_reference(*x.args())[0]
    for _ in range(3):  # what the compiled graph's wrapper calls, once per layer
        out, _ = triton_backend.DECODE_OP(*x.args(), [])
        assert relative_error(out, want) < 2e-2
    assert counted.prepared == 1
    assert counted.launches == 3 * 2


@needs_triton
def test_a_prepared_triton_decode_still_reads_new_contents(monkeypatch):
    """Prepared once, the decode reads each call's tensors: new lengths, a new query, another cache of the
    same shape give that call's result (nothing about the data is cached)."""
    from mla_inductor.backends import triton as triton_backend

    monkeypatch.setattr(triton_backend, "_LAUNCHES", Memo())
    a, b = _triton_inputs([40, 13, 66], seed=3), _triton_inputs([40, 13, 66], seed=4)
    args_b = list(b.args())
    args_b[3], args_b[4] = a.block_table.clone(), torch.tensor([33, 16, 60], dtype=torch.int32, device=TRITON_DEVICE)
    for args in (a.args(), tuple(args_b)):
        out, lse = triton_backend.DECODE_OP(*args, [])
        want_out, want_lse = mla_inductor.paged_decode_reference(*args)
        assert relative_error(out, want_out) < 2e-2
        assert torch.allclose(lse, want_lse, atol=2e-3, rtol=0)
    assert len(triton_backend._LAUNCHES) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_gpu_triton_decode_relaunches_the_compiled_kernels_and_stays_correct(monkeypatch):
    """On a GPU every call after the first launches the compiled decode and merge kernels directly; a query
    whose pointer is not 16-byte aligned takes the JIT path (its own specialization) and is right too."""
    from mla_inductor.backends import triton as triton_backend

    monkeypatch.setattr(triton_backend, "_LAUNCHES", Memo())
    x = make_decode_inputs(seq_lens=[4096], num_heads=128, page_size=64, device="cuda", seed=5)
    args = x.args()
    want = mla_inductor.paged_decode_reference(*args)[0]
    outs = [triton_backend.DECODE_OP(*args, [])[0] for _ in range(3)]
    (launch,) = triton_backend._LAUNCHES.values()
    assert launch.main.jit_launches == 1 and launch.main.direct_launches == 2
    assert launch.merge is not None and launch.merge.direct_launches == 2  # B=1, S=4096: split
    for out in outs:
        assert relative_error(out, want) < 1e-2
    # q_nope 2 bytes off a 16-byte boundary, same shape and strides: same signature, JIT path.
    q = torch.empty(args[0].numel() + 1, dtype=args[0].dtype, device="cuda")[1:].view(args[0].shape)
    q.copy_(args[0])
    out = triton_backend.DECODE_OP(q, *args[1:], [])[0]
    assert launch.main.jit_launches == 2
    assert relative_error(out, want) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("num_heads", [16, 128])
def test_gpu_triton_relaunches_through_torchs_static_launcher_are_right(monkeypatch, num_heads):
    """Where this torch has its static launcher, the merge kernel (small, any torch) is relaunched by it; every
    relaunch, whichever launcher, writes the whole output (poisoned with NaN before each call) and follows new
    inputs of the same signature. The decode kernel's launcher is reported (older torch releases refuse its
    shared memory)."""
    from mla_inductor._compat import _static_launcher_class
    from mla_inductor.backends import triton as triton_backend

    monkeypatch.setattr(triton_backend, "_LAUNCHES", Memo())
    x = make_decode_inputs(seq_lens=[4096, 777], num_heads=num_heads, page_size=64, device="cuda", seed=11)
    y = make_decode_inputs(seq_lens=[4096, 777], num_heads=num_heads, page_size=64, device="cuda", seed=12)
    args_x, args_y = x.args(), y.args()
    launch = triton_backend.prepared_launch(*args_x[:8])
    out = torch.empty(*launch.out_shape, dtype=launch.out_dtype, device="cuda")
    lse = torch.empty(*launch.lse_shape, dtype=torch.float32, device="cuda")
    for args in (args_x, args_y, args_x, args_y):
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        launch(*args[:5], args[6], args[7], out=out, lse=lse)
        want_out, want_lse = mla_inductor.paged_decode_reference(*args)
        assert relative_error(out, want_out) < 1e-2
        assert torch.allclose(lse, want_lse, atol=2e-3, rtol=0)
    assert launch.main.direct_launches == 3 and launch.merge is not None and launch.merge.direct_launches == 3
    if _static_launcher_class() is not None and hasattr(torch._C, "_StaticCudaLauncher"):
        assert launch.merge.static
    print(f"H={num_heads}: decode kernel relaunched by {'torch' if launch.main.static else 'Triton'}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_gpu_triton_split_workspace_is_kept_per_stream_and_fresh_under_capture(monkeypatch):
    """An eager split call reuses its stream's workspace (no allocation per call), writes every partial the merge
    reads (the kept workspace poisoned with NaN between calls), keeps another stream's apart; a captured CUDA
    graph and code CUDA-graph trees run (whose warm-up allocates in the graph's pool) keep none; code compiled
    without CUDA graphs uses the stream's kept one."""
    from mla_inductor import ops
    from mla_inductor.backends import triton as triton_backend

    monkeypatch.setattr(triton_backend, "_LAUNCHES", Memo())
    monkeypatch.setattr(ops, "_EAGER_CALLS", Memo())
    monkeypatch.setattr(decode_kernels, "_WORKSPACES", {})
    x = make_decode_inputs(seq_lens=[4096], num_heads=128, page_size=64, device="cuda", seed=6)
    args = x.args()
    want = mla_inductor.paged_decode_reference(*args)[0]

    def decode():
        return torch.ops.mla.paged_decode(*args)

    with mla_inductor.prefer_backends("triton"):
        first = decode()
        (launch,) = triton_backend._LAUNCHES.values()
        assert launch.merge is not None, "B=1, S=4096 should split"
        kept = launch.partials[1].data_ptr()
        launch.partials[1].fill_(float("nan"))
        launch.partials[2].fill_(float("nan"))
        second = decode()
        assert launch.partials[1].data_ptr() == kept and len(decode_kernels._WORKSPACES) == 1
        for out in (first, second):
            assert not out.isnan().any() and relative_error(out, want) < 1e-2
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            other = decode()
        side.synchronize()
        assert len(decode_kernels._WORKSPACES) == 2 and relative_error(other, want) < 1e-2
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = decode()
        assert len(decode_kernels._WORKSPACES) == 2, "a capture must not keep (or replace) a workspace"
        for ws in decode_kernels._WORKSPACES.values():
            ws.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not captured.isnan().any() and relative_error(captured, want) < 1e-2
        torch.compiler.reset()
        step = torch.compile(decode, mode="reduce-overhead")
        for _ in range(3):
            compiled = step().clone()
        assert len(decode_kernels._WORKSPACES) == 2, "code CUDA-graph trees run must not keep a workspace"
        assert relative_error(compiled, want) < 1e-2
        # Compiled without CUDA graphs: the stream's kept workspace, as eagerly (poisoned first).
        for ws in decode_kernels._WORKSPACES.values():
            ws.fill_(float("nan"))
        torch.compiler.reset()
        plain = torch.compile(decode)
        outs = [plain().clone() for _ in range(2)]
        assert len(decode_kernels._WORKSPACES) == 2 and launch.partials[1].data_ptr() == kept
        for out in outs:
            assert not out.isnan().any() and relative_error(out, want) < 1e-2


# ----------------------------------------------------------------------------- FlashInfer's repeated run

class _FakeModule:
    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


class _FakeWrapper:
    """A planned wrapper whose run() hands its compiled module the call's tensors and ``extra(tensors)``."""

    def __init__(self, extra):
        self._cached_module = _FakeModule()
        self.extra = extra

    def run(self, q_nope, q_pe, ckv, kpe, out, lse, **kwargs):
        tensors = (q_nope, q_pe, ckv, kpe, out, lse)
        self._cached_module.run(*tensors, self.extra(tensors), 1.0)


def _call_tensors():
    cache = torch.randn(3, 4, 9)
    return (torch.randn(1, 2, 8), torch.randn(1, 2, 1), cache[..., :8], cache[..., 8:], torch.empty(1, 2, 8),
            torch.empty(1, 2))


def test_flashinfer_direct_run_repeats_the_module_call_with_the_new_tensors():
    from mla_inductor.backends._flashinfer_common import _DirectRun

    workspace = torch.zeros(16)
    wrapper = _FakeWrapper(lambda tensors: workspace)
    direct = _DirectRun.record(wrapper, _call_tensors(), {})
    assert direct
    later = _call_tensors()
    direct(*later)
    args = wrapper._cached_module.calls[-1]
    assert all(a is t for a, t in zip(args[:6], later)) and args[6] is workspace and args[7] == 1.0


def test_flashinfer_direct_run_follows_a_new_plan_while_the_module_stays():
    """After plan(): the recorded call takes the wrapper's new plan info in place of the old one (no second
    recording through wrapper.run()); a plan that replaced the module, or a recording without the plan info
    among its arguments, is not followed."""
    from mla_inductor.backends._flashinfer_common import _DirectRun

    wrapper = _FakeWrapper(lambda tensors: wrapper._plan_info)
    wrapper._plan_info = ["plan 1"]
    direct = _DirectRun.record(wrapper, _call_tensors(), {})
    wrapper._plan_info = ["plan 2"]  # what plan() does
    assert direct.follow_plan(wrapper)
    direct(*_call_tensors())
    assert wrapper._cached_module.calls[-1][6] is wrapper._plan_info
    wrapper._cached_module = _FakeModule()  # a plan that loaded another module
    assert not direct.follow_plan(wrapper)
    unplanned = _FakeWrapper(lambda tensors: torch.zeros(1))
    assert not _DirectRun.record(unplanned, _call_tensors(), {}).follow_plan(unplanned)


def test_flashinfer_direct_run_is_refused_where_another_argument_is_made_from_the_call():
    from mla_inductor.backends._flashinfer_common import _DirectRun

    wrapper = _FakeWrapper(lambda tensors: tensors[4].view(-1))  # a view of out: frozen, it would be stale
    assert _DirectRun.record(wrapper, _call_tensors(), {}) is False


@pytest.mark.parametrize("version, repeated", [("0.6.18.post1", True), ("0.6.14", True), ("0.7.0", False),
                                               ("0.7.2.post1", False)])
def test_flashinfer_runs_are_repeated_only_where_the_wrapper_runs_its_own_module(version, repeated, monkeypatch):
    """FlashInfer 0.7 runs through a planned-backend object the recording does not see: every run goes through
    wrapper.run() there."""
    import sys
    import types

    from mla_inductor.backends import _flashinfer_common

    fake = types.ModuleType("flashinfer")
    fake.__version__ = version
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    _flashinfer_common.direct_runs_supported.cache_clear()
    try:
        assert _flashinfer_common.direct_runs_supported() is repeated
    finally:
        _flashinfer_common.direct_runs_supported.cache_clear()


# ----------------------------------------------------------------------------- what eager calls cache

class _Recording(mla_inductor.backends.Backend):
    """Claims every call, runs the reference and counts its calls."""

    def __init__(self):
        self.calls = 0

    def supports(self, problem, capability):
        return None

    def decode(self, *args):
        self.calls += 1
        return mla_inductor.paged_decode_reference(*args)


def _small_args():
    return make_decode_inputs(seq_lens=[5, 9], num_heads=2, kv_lora_rank=32, rope_dim=16, page_size=4,
                              q_dtype=torch.float32, fmt="fp32", seed=7).args()


def test_eager_calls_see_each_change_of_the_preference_env_var_and_context(monkeypatch):
    """The eager path reads the environment through a cached reader and keys its per-signature choices on
    the preference: a variable set, changed or removed between two calls of one signature, and a
    prefer_backends block, each change which backend the next call runs on."""
    from mla_inductor.backends import register_backend, unregister_backend
    from mla_inductor.selection import BACKEND_ENV, FP8_QUERY_ENV, fp8_query_allowed, user_preference

    recording = _Recording()
    register_backend("recording_test", recording)
    try:
        args = _small_args()
        want = mla_inductor.paged_decode_reference(*args)[0]
        monkeypatch.delenv(BACKEND_ENV, raising=False)
        assert user_preference() is None
        torch.ops.mla.paged_decode(*args)
        assert recording.calls == 0
        monkeypatch.setenv(BACKEND_ENV, " recording_test , reference")
        assert user_preference() == ("recording_test", "reference")
        out = torch.ops.mla.paged_decode(*args)
        assert recording.calls == 1 and torch.allclose(out, want)
        monkeypatch.setenv(BACKEND_ENV, "reference")
        torch.ops.mla.paged_decode(*args)
        assert recording.calls == 1
        with mla_inductor.prefer_backends("recording_test"):
            torch.ops.mla.paged_decode(*args)
            assert recording.calls == 2
        torch.ops.mla.paged_decode(*args)
        assert recording.calls == 2
        monkeypatch.delenv(BACKEND_ENV)
        with mock.patch.dict(os.environ, {BACKEND_ENV: "recording_test"}):
            torch.ops.mla.paged_decode(*args)
            assert recording.calls == 3
        torch.ops.mla.paged_decode(*args)
        assert recording.calls == 3 and user_preference() is None
        # The FP8-query opt-in is read the same way.
        monkeypatch.setenv(FP8_QUERY_ENV, "1")
        assert fp8_query_allowed()
        monkeypatch.setenv(FP8_QUERY_ENV, " 0 ")
        assert not fp8_query_allowed()
        monkeypatch.delenv(FP8_QUERY_ENV)
        assert not fp8_query_allowed()
    finally:
        unregister_backend("recording_test")


def test_an_eager_call_like_the_last_one_skips_its_signature_and_any_difference_is_seen(monkeypatch):
    """A call whose tensors, softmax_scale, optional arguments and selection state are those of the op's last
    call reuses its decision without building the call signature; a difference in any of them (a stride, a
    dtype, a shape, the scale's value or type, a tensor left out, the preference) takes the
    full path, so bad arguments after good ones still raise, naming the argument."""
    from mla_inductor import ops

    signatures = []
    full = ops.call_signature
    monkeypatch.setattr(ops, "call_signature", lambda *a: signatures.append(1) or full(*a))
    monkeypatch.setattr(ops, "_EAGER_CALLS", Memo())
    args = _small_args()
    want = mla_inductor.paged_decode_reference(*args)[0]
    for _ in range(3):
        assert torch.allclose(torch.ops.mla.paged_decode(*args), want)
    assert len(signatures) == 1
    q_nope, q_pe, kv_cache, block_table, seq_lens, scale, kv_scale, _ = args
    wide = torch.cat([block_table, block_table[:, :1]], 1)
    changed = [
        (q_nope.transpose(0, 1).contiguous().transpose(0, 1), 0),  # the same values, other strides
        (wide, 3), (float(scale) * 2, 5), (1, 5),
    ]
    for value, position in changed:
        call = list(args)
        call[position] = value
        before = len(signatures)
        torch.ops.mla.paged_decode(*call)
        assert len(signatures) == before + 1, position
    torch.ops.mla.paged_decode(*args)  # back to the first signature: not the last call's, so the full path
    assert torch.allclose(torch.ops.mla.paged_decode(*args), want)
    with mla_inductor.prefer_backends("reference"):
        before = len(signatures)
        torch.ops.mla.paged_decode(*args)
        assert len(signatures) == before + 1
    for value, position, name in ((block_table.long(), 3, "block_table"), (kv_cache.double(), 2, "kv_cache"),
                                  (None, 6, "kv_scale")):
        torch.ops.mla.paged_decode(*args)
        bad = list(args)
        bad[position] = value
        with pytest.raises((TypeError, ValueError), match=name):
            torch.ops.mla.paged_decode(*bad)
    monkeypatch.setattr(ops, "_EAGER_CALLS", Memo())  # a fresh memo: decided again
    before = len(signatures)
    torch.ops.mla.paged_decode(*args)
    assert len(signatures) == before + 1
    # Two signatures in turn: each call takes the full path, and each signature's check is made once.
    checks = []
    make_check = ops.tensor_properties_check
    monkeypatch.setattr(ops, "tensor_properties_check", lambda tensors: checks.append(1) or make_check(tensors))
    monkeypatch.setattr(ops, "_EAGER_CALLS", Memo())
    other = list(args)
    other[3] = wide
    for _ in range(3):
        torch.ops.mla.paged_decode(*args)
        torch.ops.mla.paged_decode(*other)
    assert len(checks) == 2


def test_eager_calls_without_torchs_tensor_check_take_the_full_path(monkeypatch):
    from mla_inductor import ops

    monkeypatch.setattr(ops, "tensor_properties_check", lambda tensors: None)
    monkeypatch.setattr(ops, "_REPEATS", {})
    monkeypatch.setattr(ops, "_EAGER_CALLS", Memo())
    args = _small_args()
    for _ in range(2):
        assert torch.allclose(torch.ops.mla.paged_decode(*args), mla_inductor.paged_decode_reference(*args)[0])
    assert ops._REPEATS == {}


def test_an_eager_call_made_during_a_capture_is_selected_as_a_captured_one(monkeypatch):
    """The eager path keys its per-signature choice on whether the call is being captured in a CUDA graph, and
    asks the selection for a captured call then (its replays skip the host work a plan on the host needs)."""
    from mla_inductor import ops

    asked = []
    choose = ops.backend_for_eager
    monkeypatch.setattr(ops, "backend_for_eager", lambda problem, device, captured: asked.append(captured) or
                        choose(problem, device, captured))
    monkeypatch.setattr(ops, "_EAGER_CALLS", Memo())
    args = _small_args()
    want = mla_inductor.paged_decode_reference(*args)[0]
    assert torch.allclose(torch.ops.mla.paged_decode(*args), want)
    torch.ops.mla.paged_decode(*args)
    assert asked == [False]  # one choice per signature and capture state
    monkeypatch.setattr(ops, "being_captured", lambda t: True)
    monkeypatch.setattr(ops, "check_decode_values", lambda *a, **k: None)  # device-side asserts while captured
    monkeypatch.setattr(ops, "assert_decode_values_on_device", lambda *a, **k: None)
    assert torch.allclose(torch.ops.mla.paged_decode(*args), want)
    torch.ops.mla.paged_decode(*args)
    assert asked == [False, True]


def test_debug_checks_follow_the_env_var_on_every_call(monkeypatch):
    from mla_inductor.contract import DEBUG_ENV, debug_checks_enabled

    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert not debug_checks_enabled()
    monkeypatch.setenv(DEBUG_ENV, "1")
    assert debug_checks_enabled()
    monkeypatch.setenv(DEBUG_ENV, "0")
    assert not debug_checks_enabled()


def test_a_stored_plan_is_reused_only_while_its_tensors_are_unchanged():
    """PlanCache's fast path (the same tensor objects: version counter, address, shape) and its full one
    (other objects: whole tensor state) both notice every change torch can see."""
    from mla_inductor.backends._common import PlanCache

    plans = PlanCache("test_fast_path")
    table = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    lens = torch.tensor([5, 9], dtype=torch.int32)
    plans.put("cfg", table, lens, None, "plan")
    assert plans.get("cfg", table, lens, None) == "plan"  # same objects
    assert plans.get("cfg", table[:], lens[:], None) == "plan"  # other objects viewing the same, unchanged
    assert plans.get("other", table, lens, None) is None
    lens[0] = 6  # a write: version bump
    assert plans.get("cfg", table, lens, None) is None
    assert plans.get("cfg", table, lens[:], None) is None
    plans.put("cfg", table, lens, None, "plan 2")
    assert plans.get("cfg", table, lens, None) == "plan 2"
    table.add_(1)
    assert plans.get("cfg", table, lens, None) is None
    plans.put("cfg", table, lens, None, "plan 3")
    lens.data = torch.tensor([7, 9], dtype=torch.int32)  # new memory, no version bump
    assert plans.get("cfg", table, lens, None) is None
    plans.put("cfg", table, lens, None, "plan 4")
    lens.set_(torch.tensor([1, 2], dtype=torch.int32))
    assert plans.get("cfg", table, lens, None) is None
    sparse = torch.zeros(2, 4, dtype=torch.int32)
    plans.put("cfg", table, lens, sparse, "plan 5")
    assert plans.get("cfg", table, lens, sparse) == "plan 5"
    assert plans.get("cfg", table, lens, None) is None
    sparse.fill_(1)
    assert plans.get("cfg", table, lens, sparse) is None


def test_captured_calls_share_only_the_plans_of_their_own_capture():
    """A call captured in a CUDA graph never takes a plan made outside the capture (its replays must schedule
    from the lengths they find) and keeps none past it; inside ``plans_shared_in_capture`` the captured calls
    share the plans made during that scope, which end with it. Calls that are not captured keep their own."""
    from mla_inductor import plans_shared_in_capture  # the public name of backends._common's scope
    from mla_inductor.backends._common import PlanCache

    plans = PlanCache("test_capture_scope")
    table = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    lens = torch.tensor([5, 9], dtype=torch.int32)
    plans.put("cfg", table, lens, None, "eager plan")
    assert not plans.keeps(captured=True) and plans.keeps(captured=False)
    assert plans.get("cfg", table, lens, None, captured=True) is None  # outside a scope: nothing shared
    plans.put("cfg", table, lens, None, "captured, no scope", captured=True)
    assert plans.get("cfg", table, lens, None, captured=True) is None
    with plans_shared_in_capture():
        assert plans.keeps(captured=True)
        assert plans.get("cfg", table, lens, None, captured=True) is None  # the eager plan is not the capture's
        plans.put("cfg", table, lens, None, "captured plan", captured=True)
        assert plans.get("cfg", table, lens, None, captured=True) == "captured plan"
        assert plans.get("cfg", table, lens, None) == "eager plan"  # uncaptured calls: their own
        with plans_shared_in_capture():  # a nested capture starts with nothing
            assert plans.get("cfg", table, lens, None, captured=True) is None
        assert plans.get("cfg", table, lens, None, captured=True) == "captured plan"
        lens.add_(1)  # a write torch sees: the capture's plan no longer fits either
        assert plans.get("cfg", table, lens, None, captured=True) is None
        plans.put("cfg", table, lens, None, "captured plan 2", captured=True)
    assert plans.get("cfg", table, lens, None, captured=True) is None  # ended with the scope
    with plans_shared_in_capture():
        assert plans.get("cfg", table, lens, None, captured=True) is None


def test_a_memo_starts_over_at_its_bound():
    """What the runtime works out per signature is kept in a Memo: hits are plain dict lookups, and a program
    making new signatures without end (a changing softmax_scale) empties it instead of growing it."""
    memo = Memo(limit=3)
    for i in range(3):
        assert memo.put(("sig", i), i) == i
    assert memo.get(("sig", 1)) == 1 and len(memo) == 3
    memo.put(("sig", 3), 3)
    assert dict(memo) == {("sig", 3): 3}


def test_the_cache_writer_is_chosen_once_per_device_and_registry(monkeypatch):
    """``mla.cache_append`` runs once per layer and step, eagerly and from compiled code: its writer is chosen
    once per device (availability checks can cost tens of µs: Triton's looks for the package on disk), and
    chosen again when a backend is registered; the appends still write the cache."""
    from mla_inductor import selection
    from mla_inductor.backends import register_backend, unregister_backend

    choices = []
    choose = selection._choose_append_writer
    monkeypatch.setattr(selection, "_choose_append_writer", lambda device: choices.append(device) or choose(device))
    monkeypatch.setattr(selection, "_APPEND_WRITERS", {})
    cache = mla_inductor.PagedLatentCache.allocate(num_layers=1, batch_size=2, max_seq_len=16, kv_lora_rank=32,
                                                   rope_dim=16, page_size=4)
    cache.reserve([3, 5])  # a prompt's tokens (not written here)
    for _ in range(3):
        slots = cache.reserve(1)
        kv_c, k_pe = torch.randn(2, 32), torch.randn(2, 16)
        torch.ops.mla.cache_append(cache.kv_caches[0], kv_c, k_pe, slots, cache.kv_scale)
        rows = cache.kv_caches[0].reshape(-1, 48)[slots.long()]
        assert torch.equal(rows, torch.cat([kv_c, k_pe], -1).to(rows.dtype))
    assert len(choices) == 1
    register_backend("another_test_backend", mla_inductor.backends.get_backend("reference"))
    try:
        torch.ops.mla.cache_append(cache.kv_caches[0], kv_c, k_pe, slots, cache.kv_scale)
        assert len(choices) == 2
    finally:
        unregister_backend("another_test_backend")


def test_views_of_a_tensor_are_made_once_and_follow_its_memory():
    """``TensorViews``: the same views for the same tensor object (made once), equal to the tensor's own slices;
    made again once the tensor's memory is replaced (``t.data = other``); and they never keep the tensor alive:
    freeing it drops its entry, as it does for a tensor made anew for each call."""
    import gc
    import weakref

    from mla_inductor.backends._common import TensorViews

    views = TensorViews()
    made = []

    def halves(t):
        made.append(1)
        return t.split_with_sizes((6, 2), -1)

    cache = torch.randn(3, 4, 8)
    first = views.get(cache, "halves", halves)
    assert views.get(cache, "halves", halves) is first and len(made) == 1
    for view, want in zip(first, (cache[..., :6], cache[..., 6:])):
        assert view.data_ptr() == want.data_ptr() and view.shape == want.shape and view.stride() == want.stride()
    cache.add_(1)  # a write: the views read the tensor's memory
    assert torch.equal(first[1], cache[..., 6:])
    assert views.get(cache, ("flat", 1), lambda t: (t.reshape(-1, 8),))[0].shape == (12, 8)  # another kind
    cache.data = torch.randn(5, 4, 8)  # new memory, same object
    again = views.get(cache, "halves", halves)
    assert len(made) == 2 and again[0].shape == (5, 4, 6) and torch.equal(again[1], cache[..., 6:])
    freed = []
    watch = weakref.ref(cache, lambda ref: freed.append(1))
    del cache, want  # (``want``: a view of the tensor itself, which does keep it)
    gc.collect()
    assert freed == [1] and watch() is None and len(views) == 0
    assert torch.equal(again[1], again[1].clone())  # the views still hold their memory
    stacked = torch.randn(4, 3, 4, 8)
    for layer in range(4):
        views.get(stacked[layer], "halves", halves)  # a fresh tensor each call: its entry goes with it
    assert len(views) == 0
