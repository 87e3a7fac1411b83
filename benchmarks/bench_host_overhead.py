"""Host time our op adds per call, isolated from any kernel: runs on CPU (and on a GPU).

    python benchmarks/bench_host_overhead.py [--device cpu|cuda] [--calls 61] [--steps 40]
        [--cases 1x128:bf16,32x16:bf16,1x128:fp8_e4m3] [--value-checks off|device] [--profile]
        [--real [--real-only]] [--stub [--stub-only]] [--out DIR]

A no-op backend (``register_backend``, as a user would add one) claims every call and returns
preallocated outputs, so what is timed is our own host work: the op's dispatch and Python (contract
checks, selection, the backend's run wrapper, allocations, extra kernels) and, compiled, what the pass
writes into the graph. For each case, ``--calls`` calls back to back per step (one decoder step of a
61-layer model), µs per call (median over ``--steps`` steps, ``time.perf_counter``):

- ``direct``: the no-op backend's kernel function called by hand (the floor: a Python call);
- ``eager``: ``torch.ops.mla.paged_decode`` in a Python loop;
- ``compiled``: the same loop under ``torch.compile`` (no CUDA graphs), all calls in one graph;
- ``planned eager`` / ``planned compiled``: the same with a no-op backend that also has a plan op
  (made once per step: before each step seq_lens is marked written, as a decode step leaves it).

``overhead`` is the mode's time minus ``direct``. ``--value-checks off`` (the default) runs the op as on a
GPU without ``MLA_INDUCTOR_DEBUG``: the data checks CPU calls always make (they read tensor values, which
is free on CPU and a sync on a GPU) are left out, so the CPU numbers show the host work a GPU call pays;
``device`` keeps what the device does (on CPU: the checks every call). ``--profile`` prints the top
functions of a cProfile of each mode (and keeps them in the JSON), naming where the time goes: own and
cumulative µs per op call and calls per op call, by own time (cProfile's overhead inflates them all).

On a GPU, ``--real`` also times the backend the selection picks for real, on a DeepSeek-V3-shaped case
(S=4096, page 64; ``benchmarks/peers.py``), eager and compiled, and the format's peers found by import
(``peers.DIRECT_PEERS``; one not installed is named in the row's ``peers not timed``, so ``best peer`` is
the best of those that ran). A step is ``--calls`` calls back to back, each on its own query and cache as the
layers of a model (``peers.back_to_back_inputs``), ours and the peers' alike; a peer's step is
``peers.direct_step``, its direct call with the plan / schedule / quantized query made once, outside:
the same step bench_modes times. What is timed here: host wall time per call, ``time.perf_counter`` around
the step and one device sync after it (median of ``--steps`` steps); at B=1 the kernel is short and host
time is most of it. bench_modes times the same step with CUDA events (``do_bench``), which read the
same where the host is the slower side. Afterwards, once every real row is timed, it lists the device
kernels one step launches per op call, by name (torch.profiler; columns ``eager launches`` / ``compiled
launches``): the attention kernel and every extra one (a split-KV merge, a plan's kernels shared by the
step's calls, an epilogue); and with ``--profile``, a cProfile of each mode. Both come after all timings
because a finished torch.profiler session leaves CUDA's profiling interface (CUPTI) attached to the
process, which slows every later CUDA call: a row timed after one reads slower than it is.

``--stub`` (any device, CPU included) also times our real backends' own Python with only the library's
kernel call replaced by a no-op: FlashInfer's wrapper backend (``flashinfer_fa3``: a stand-in ``flashinfer``
module whose wrapper keeps only its planned sizes and whose compiled module's ``run`` does nothing), FlashMLA
(a provider whose metadata and kernel return preallocated tensors) and Triton (``KernelLaunch`` launching nothing),
eager and compiled, with seq_lens marked written before each step (one plan per step). What it times is
everything of ours between ``torch.ops.mla.paged_decode`` and the library call: contract, selection, plan
reuse, output allocation, views, the backend's run wrapper. On a GPU the stubs run on CUDA tensors (the
capture query and the device branches included); ``--stub-only`` leaves out the other rows.
``--out DIR`` writes bench_host_overhead.md / .json.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Callable, Optional
from unittest import mock

import timing
import torch
from report import (add_out_argument, decode_calls, environment, environment_line, lowered_afresh, mark_new_step,
                    markdown_table, parse_cases, profile_of, progress, relative_error, write_results)

import mla_inductor
from mla_inductor import contract
from mla_inductor.backends import Backend, register_backend, unregister_backend
from mla_inductor.backends._common import PlanCache, decode_op

L, R, PAGE, PAGES_PER_SEQ = 512, 64, 64, 4
NOOP, NOOP_PLANNED = "noop_overhead", "noop_overhead_planned"


# ----------------------------------------------------------------------------- the no-op backends

class _Outputs:
    """The preallocated (out, lse) the no-op kernel returns, per query shape and dtype."""

    def __init__(self):
        self.by_shape: dict = {}

    def get(self, q_nope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (tuple(q_nope.shape), q_nope.dtype, q_nope.device)
        if key not in self.by_shape:
            self.by_shape[key] = contract.empty_decode_outputs(q_nope)
        return self.by_shape[key]


OUTPUTS = _Outputs()
PLANS = PlanCache("noop_overhead")


def noop_kernel(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices, plan):
    """The no-op backend's kernel: returns preallocated outputs (what a direct call of a library costs,
    minus the library)."""
    return OUTPUTS.get(q_nope)


def noop_plan(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices):
    """A plan kept in a PlanCache, as a real planned backend keeps it: made once per step."""
    config = (tuple(q_nope.shape), q_nope.dtype, kv_cache.dtype, softmax_scale)
    made = PLANS.get(config, block_table, seq_lens, sparse_indices)
    if made is None:
        made = seq_lens.clone()
        PLANS.put(config, block_table, seq_lens, sparse_indices, made)
    return [made]


def _plan_fake(q_nope, q_pe, kv_cache, block_table, seq_lens, *args):
    return [torch.empty_like(seq_lens)]


def _outputs_fake(q_nope, *args):
    # The real op hands out the same buffers each call; the compiled graph only needs their shapes.
    return contract.empty_decode_outputs(q_nope)


RUN_OP = decode_op("mla_bench_overhead::run", noop_kernel, fake=_outputs_fake)
PLAN_OP = decode_op("mla_bench_overhead::plan", noop_plan, returns="tensors", takes_plan=False, fake=_plan_fake)


class NoopBackend(Backend):
    """Claims every call; its kernel does nothing (``planned``: it also has a plan op, like FlashInfer's)."""

    def __init__(self, name: str, planned: bool):
        self.name = name
        self.planned = planned

    def supports(self, problem, capability):
        return None

    def compiled_op(self):
        return RUN_OP

    def plan_op(self):
        return PLAN_OP if self.planned else None

    def decode(self, q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices):
        args = (q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices)
        return noop_kernel(*args, noop_plan(*args) if self.planned else [])


# ----------------------------------------------------------------------------- cases and timing

def make_args(B: int, H: int, fmt: str, device: str) -> tuple:
    """The op's arguments for one case: random q, a small cache (the no-op kernel reads none of it), full
    sequences of PAGES_PER_SEQ pages each; q_nope / q_pe are slices of one [T, H, 576] query."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, L + R, generator=g).to(torch.bfloat16).to(device)
    pages = B * PAGES_PER_SEQ
    cache = torch.randn(pages, PAGE, L + R, generator=g).to(torch.bfloat16)
    if fmt == "fp8_e4m3":
        cache = cache.to(torch.float8_e4m3fn)
    block_table = torch.randperm(pages, generator=g).to(torch.int32).reshape(B, PAGES_PER_SEQ).to(device)
    seq_lens = torch.full((B,), PAGES_PER_SEQ * PAGE, dtype=torch.int32, device=device)
    kv_scale = torch.ones(1, dtype=torch.float32, device=device)
    return q[..., :L], q[..., L:], cache.to(device), block_table, seq_lens, (L + R) ** -0.5, kv_scale


def step_calls(calls: int, op=None) -> Callable:
    """A step making ``calls`` decode calls over the same arguments."""
    op = op or torch.ops.mla.paged_decode

    def step(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, kv_scale):
        return [op(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, kv_scale) for _ in range(calls)]

    return step


def direct_step(calls: int, planned: bool) -> Callable:
    def step(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, kv_scale):
        args = (q_nope, q_pe, kv_cache, block_table, seq_lens, scale, kv_scale, None)
        plan = noop_plan(*args) if planned else []
        return [noop_kernel(*args, plan)[0] for _ in range(calls)]

    return step


def us_per_call(run: Callable[[], object], calls: int, steps: int, before: Callable[[], None], sync) -> float:
    """Median over ``steps`` steps of the step's wall time / ``calls`` (after 3 warm-up steps)."""
    return timing.median_seconds(run, steps, warmup=3, before=before, sync=sync) * 1e6 / calls


def kernels_per_call(run: Callable[[], object], before: Callable[[], None], calls: int) -> dict[str, float]:
    """The device kernels (and copies) one step launches, per op call, by name (torch.profiler, one step)."""
    from torch.profiler import ProfilerActivity, profile

    before()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    counts: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            counts[event.name[:90]] = counts.get(event.name[:90], 0) + 1 / calls
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


@contextlib.contextmanager
def value_checks(policy: str, device: str):
    """``off``: leave out the data checks, as a GPU call without MLA_INDUCTOR_DEBUG does (every module of
    ours that asks ``contract.wants_value_checks`` is told no); ``device``: what the device does."""
    if policy == "device":
        yield
        return
    import mla_inductor.lowering.graph_pass  # noqa: F401 - imported so that its binding is patched too

    modules = [m for name, m in list(sys.modules.items()) if name.startswith("mla_inductor")
               and getattr(m, "wants_value_checks", None) is contract.wants_value_checks]
    with contextlib.ExitStack() as stack:
        for module in modules:
            stack.enter_context(mock.patch.object(module, "wants_value_checks", lambda t: False))
        yield


def fresh_compile(step: Callable) -> Callable:
    """``torch.compile`` of ``step`` (no CUDA graphs), lowered afresh: Inductor's caches would serve a graph
    compiled under another value-check policy."""
    compiled = torch.compile(step, fullgraph=True)
    lowered = False

    def run(*args):
        # Only the compiling call runs under the patched config: entering it costs more host time per call
        # than the op itself, which would be timed as the op's.
        nonlocal lowered
        if lowered:
            return compiled(*args)
        with lowered_afresh():
            result = compiled(*args)
        lowered = True
        return result

    return run


# ----------------------------------------------------------------------------- the no-op measurement

def time_noop_case(B: int, H: int, fmt: str, args: argparse.Namespace) -> dict:
    device = args.device
    op_args = make_args(B, H, fmt, device)
    seq_lens = op_args[4]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    row = {"case": f"B={B} H={H} {fmt}", "device": device}
    profiles = {}
    for planned, backend in ((False, NOOP), (True, NOOP_PLANNED)):
        prefix = "planned " if planned else ""
        host_lens = seq_lens.to("cpu", copy=True)
        before = (lambda: mark_new_step(seq_lens, host_lens)) if planned else (lambda: None)
        with mla_inductor.prefer_backends(backend), value_checks(args.value_checks, device):
            modes = {"direct": (lambda f=direct_step(args.calls, planned): f(*op_args))}
            eager = step_calls(args.calls)
            modes["eager"] = lambda: eager(*op_args)
            torch.compiler.reset()
            compiled = fresh_compile(step_calls(args.calls))
            before()
            compiled(*op_args)  # compiles
            modes["compiled"] = lambda: compiled(*op_args)
            for mode, run in modes.items():
                us = us_per_call(run, args.calls, args.steps, before, sync)
                row[prefix + mode] = us
                if args.profile and mode != "direct":
                    profiles[prefix + mode] = profile_of(run, before, max(3, args.steps // 4), args.calls)
            for mode in ("eager", "compiled"):
                row[f"{prefix}{mode} overhead"] = row[prefix + mode] - row[prefix + "direct"]
            progress(f"  {prefix or 'plain '}: direct {row[prefix + 'direct']:.2f}  eager {row[prefix + 'eager']:.2f}  "
                     f"compiled {row[prefix + 'compiled']:.2f} us/call")
    torch.compiler.reset()
    if profiles:
        row["profiles"] = profiles
        for mode, text in profiles.items():
            progress(f"--- cProfile, {row['case']}, {mode} ({args.calls} calls per step)\n{text}")
    return row


# ----------------------------------------------------------------------------- the real backend (GPU)

class RealCase:
    """One real case's step, ours eager and compiled (compiled on first use): ``--calls`` calls back to back,
    each on its own query and cache (``peers.back_to_back_inputs``; ``cache_budget`` 0: one cache for all)."""

    def __init__(self, B: int, H: int, fmt: str, calls: int, cache_budget: Optional[int] = None):
        import peers as peer_kernels

        self.case = peer_kernels.format_case(B, H, 4096, fmt)
        budget = peer_kernels.CACHE_COPIES_BYTES if cache_budget is None else cache_budget
        qs, caches, self.layers = peer_kernels.back_to_back_inputs(self.case, calls, budget)
        c = self.case.c
        self.step_args = (qs, caches, c["block_table"], c["lens"], self.case.kv_scale)
        self.call_args = (qs[0][..., :L], qs[0][..., L:], self.case.kv_cache, c["block_table"], c["lens"], c["scale"],
                          self.case.kv_scale)
        self.eager_step = decode_calls(c["scale"])
        self.compiled_step = None

    def before(self) -> None:
        mark_new_step(self.case.c["lens"], self.case.host_lens)

    def modes(self) -> dict[str, Callable[[], object]]:
        if self.compiled_step is None:
            torch.compiler.reset()
            self.compiled_step = fresh_compile(decode_calls(self.case.c["scale"]))
            self.before()
            self.compiled_step(*self.step_args)  # compiles
        return {"eager": lambda: self.eager_step(*self.step_args),
                "compiled": lambda: self.compiled_step(*self.step_args)}


def time_real_case(B: int, H: int, fmt: str, args: argparse.Namespace) -> dict:
    """Our op on the backend the selection picks, eager and compiled, and the format's peers' direct steps
    (``peers.direct_step``): host wall µs per call with a device sync per step (S=4096)."""
    import peers as peer_kernels

    real = RealCase(B, H, fmt, args.calls)
    case, sync = real.case, torch.cuda.synchronize
    row = {"case": f"{case.label} S=4096", "device": torch.cuda.get_device_name(),
           "backend": mla_inductor.backend_for_call(*real.call_args).backend}
    steps, not_timed = peer_kernels.direct_steps(peer_kernels.DIRECT_PEERS[fmt], case.c, args.calls, real.layers)
    peer_us = {}
    for name, step in steps.items():
        peer_us[name] = us_per_call(step.run, args.calls, args.steps, lambda: None, sync)
        progress(f"  peer {name}: {peer_us[name]:.1f} us/call, err {relative_error(step.first, case.reference):.1e}")
    for name, why in not_timed.items():
        progress(f"  peer {name}: not timed ({why})")
    del steps
    row["best peer"], row["peer"] = peer_kernels.fastest(peer_us)
    row["peers not timed"] = ", ".join(f"{name} ({why.split(':')[0]})" for name, why in not_timed.items())
    for mode, run in real.modes().items():
        row[mode] = us_per_call(run, args.calls, args.steps, real.before, sync)
        row[f"{mode} ratio"] = row[mode] / row["peer"] if row["peer"] else None
    progress(f"  ours on {row['backend']}: eager {row['eager']:.1f}, compiled {row['compiled']:.1f} us/call")
    del real
    torch.compiler.reset()
    return row


def profile_real_case(B: int, H: int, fmt: str, args: argparse.Namespace, row: dict) -> None:
    """Into ``row``: the device kernels one step of ours launches per call (torch.profiler) and, with
    ``--profile``, a cProfile of each mode. Run after every timing (the module docstring says why); one
    cache for all calls (what a call launches does not depend on where its cache is)."""
    real = RealCase(B, H, fmt, args.calls, cache_budget=0)
    modes = real.modes()
    row["kernels per call"] = {mode: kernels_per_call(run, real.before, args.calls) for mode, run in modes.items()}
    for mode, kernels in row["kernels per call"].items():
        row[f"{mode} launches"] = round(sum(kernels.values()), 2)
        progress(f"--- device kernels per call, real {row['case']}, {mode}: " +
                 "; ".join(f"{n:g} x {name}" for name, n in kernels.items()))
    if args.profile:
        row["profiles"] = {mode: profile_of(run, real.before, 5, args.calls) for mode, run in modes.items()}
        for mode, text in row["profiles"].items():
            progress(f"--- cProfile, real {row['case']}, {mode} ({args.calls} calls per step)\n{text}")
    del real, modes
    torch.compiler.reset()


# ----------------------------------------------------------------------------- real backends, library stubbed

class _StubFlashInferModule:
    """A planned wrapper's compiled module: its ``run`` is the library's kernel call, here a no-op."""

    def run(self, *args):
        return None


class _StubFlashInferWrapper:
    """``flashinfer.mla.BatchMLAPagedAttentionWrapper`` without FlashInfer: ``plan`` keeps a fresh plan info
    and the call's configuration, ``run`` hands the call's tensors and planned state to the compiled module as
    FlashInfer 0.6 does."""

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None, kv_indptr=None,
                 kv_indices=None, kv_len_arr=None, backend="auto"):
        self._float_workspace_buffer = float_workspace_buffer
        self._kv_indices = kv_indices
        self._cached_module = _StubFlashInferModule()

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type, *args, **kwargs):
        self._planned = (num_heads, page_size, causal, sm_scale)
        self._plan_info = [num_heads, page_size]  # a new object per plan, as FlashInfer's

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False,
            return_lse_base_on_e=False, **kwargs):
        num_heads, page_size, causal, sm_scale = self._planned
        self._cached_module.run(self._float_workspace_buffer, self._float_workspace_buffer, self._plan_info, q_nope,
                                q_pe, ckv_cache, kpe_cache, self._kv_indices, out, lse, int(causal), num_heads,
                                page_size, sm_scale, return_lse_base_on_e)
        return (out, lse) if return_lse else out


def _stub_flashinfer_package():
    import types

    package = types.ModuleType("flashinfer")
    package.__version__ = "0.6.18"
    package.mla = types.SimpleNamespace(BatchMLAPagedAttentionWrapper=_StubFlashInferWrapper)
    return package


class _StubFlashMLAOutputs:
    """FlashMLA's outputs per query shape (``out [B, Q, H, 512]``, ``lse [B, H, Q]``) and its schedule, made once."""

    def __init__(self):
        self.by_shape = {}

    def get(self, q):
        key = (tuple(q.shape), q.device)
        if key not in self.by_shape:
            B, Q, H, _ = q.shape
            self.by_shape[key] = (torch.empty(B, Q, H, 512, dtype=torch.bfloat16, device=q.device),
                                  torch.empty(B, H, Q, dtype=torch.float32, device=q.device))
        return self.by_shape[key]

    def metadata(self, q):
        """The schedule FlashMLA's metadata call returns (contents unread by the stubbed kernel), made once."""
        key = ("metadata", q.shape[0], q.device)
        if key not in self.by_shape:
            self.by_shape[key] = (torch.zeros(8, 8, dtype=torch.int32, device=q.device),
                                  torch.zeros(q.shape[0] + 1, dtype=torch.int32, device=q.device))
        return self.by_shape[key]


def _stub_flashmla_providers():
    from mla_inductor.backends import flashmla

    outputs = _StubFlashMLAOutputs()

    class StubProvider(flashmla.Provider):
        modes = frozenset(flashmla.MODES)

        def metadata(self, mode, q, kcache, block_table, seq_lens, softmax_scale, causal, indices):
            return outputs.metadata(q)

        def run_kernel(self, mode, q, kcache, block_table, seq_lens, softmax_scale, causal, indices, md, splits,
                       q_descale, k_descale):
            return outputs.get(q)

    return flashmla.Providers((StubProvider("stub_flash_mla", None),))


def _stub_flashinfer(stack: contextlib.ExitStack) -> None:
    # Only this entry: patch.dict(sys.modules) would also drop every module first imported inside.
    previous = sys.modules.get("flashinfer")
    sys.modules["flashinfer"] = _stub_flashinfer_package()
    stack.callback(lambda: sys.modules.__setitem__("flashinfer", previous) if previous is not None
                   else sys.modules.pop("flashinfer", None))


def _stub_flashmla(stack: contextlib.ExitStack) -> None:
    from mla_inductor.backends import flashmla

    providers = _stub_flashmla_providers()
    stack.enter_context(mock.patch.object(flashmla, "find_providers", lambda: providers))
    flashmla.metadata_shape.cache_clear()
    stack.callback(flashmla.metadata_shape.cache_clear)


def _stub_triton(stack: contextlib.ExitStack) -> None:
    from mla_inductor.kernels import decode as triton_decode
    from mla_inductor.kernels.launch import KernelLaunch

    # The kernel as found for the device (CPU tensors need no interpreter: nothing is launched).
    stack.enter_context(mock.patch.object(triton_decode, "_kernel_for", lambda kernel, device: kernel))
    stack.enter_context(mock.patch.object(KernelLaunch, "__call__", lambda launch, *tensors: None))


# backend -> what replaces its library's kernel call
STUBS = {"flashinfer_fa3": _stub_flashinfer, "flashmla": _stub_flashmla, "triton": _stub_triton}


@contextlib.contextmanager
def stubbed_library(name: str):
    """Backend ``name`` (a key of STUBS) preferred and accepting every call, its library's kernel call a no-op;
    everything of ours around it runs as on a GPU (selection, plans, allocations, views)."""
    from mla_inductor.backends import get_backend

    backend = get_backend(name)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(backend, "unavailable_reason", lambda: None))
        stack.enter_context(mock.patch.object(backend, "supports", lambda problem, capability: None))
        STUBS[name](stack)
        stack.enter_context(mla_inductor.prefer_backends(name))
        yield


def time_stub_case(B: int, H: int, fmt: str, args: argparse.Namespace) -> list[dict]:
    """Each backend of STUBS with its library stubbed: eager and compiled µs per call (plan once per step)."""
    device = args.device
    op_args = make_args(B, H, fmt, device)
    seq_lens = op_args[4]
    host_lens = seq_lens.to("cpu", copy=True)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def before():
        mark_new_step(seq_lens, host_lens)

    rows = []
    for name in STUBS:
        row = {"case": f"B={B} H={H} {fmt}", "backend": name, "device": device}
        with stubbed_library(name), value_checks(args.value_checks, device):
            assert mla_inductor.backend_for_call(*op_args).backend == name
            eager = step_calls(args.calls)
            torch.compiler.reset()
            compiled = fresh_compile(step_calls(args.calls))
            before()
            compiled(*op_args)  # compiles
            modes = {"eager": lambda: eager(*op_args), "compiled": lambda: compiled(*op_args)}
            for mode, run in modes.items():
                row[mode] = us_per_call(run, args.calls, args.steps, before, sync)
            progress(f"  {name} (library stubbed): eager {row['eager']:.2f}  compiled {row['compiled']:.2f} us/call")
            if args.profile:
                row["profiles"] = {mode: profile_of(run, before, max(3, args.steps // 4), args.calls)
                                   for mode, run in modes.items()}
                for mode, text in row["profiles"].items():
                    progress(f"--- cProfile, {name} stubbed, {row['case']}, {mode} ({args.calls} calls per step)\n"
                             f"{text}")
        torch.compiler.reset()
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- report

NOOP_COLUMNS = ["case", "direct", "eager", "eager overhead", "compiled", "compiled overhead", "planned direct",
                "planned eager", "planned eager overhead", "planned compiled", "planned compiled overhead"]
STUB_COLUMNS = ["case", "backend", "eager", "compiled"]
REAL_COLUMNS = ["case", "backend", "best peer", "peer", "eager", "eager ratio", "compiled", "compiled ratio",
                "eager launches", "compiled launches", "peers not timed"]


def markdown(noop_rows: list, real_rows: list, env: dict, args, stub_rows: list = ()) -> str:
    lines = [f"# Host overhead per call ({args.calls} calls per step, median of {args.steps} steps)", "",
             environment_line(env)]
    if noop_rows:
        lines += ["", f"No-op backend, µs per call (value checks: {args.value_checks}); overhead = mode - direct:", "",
                  markdown_table(NOOP_COLUMNS, noop_rows)]
    if stub_rows:
        lines += ["", f"Our backends with the library's kernel call stubbed, µs per call (value checks: "
                  f"{args.value_checks}; one plan per step):", "", markdown_table(STUB_COLUMNS, stub_rows)]
    if real_rows:
        lines += ["", "Real selected backend vs the peers' direct calls (peers.direct_step, as in bench_modes), host "
                  "wall µs per call (device sync per step):", "", markdown_table(REAL_COLUMNS, real_rows)]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--calls", type=int, default=61)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--cases", type=parse_cases, default=parse_cases("1x128:bf16,32x16:bf16,1x128:fp8_e4m3"))
    parser.add_argument("--value-checks", choices=("off", "device"), default="off")
    parser.add_argument("--profile", action="store_true", help="print (and keep) a cProfile of each mode")
    parser.add_argument("--real", action="store_true", help="on a GPU: also the real selected backend and the peers")
    parser.add_argument("--real-only", action="store_true", help="with --real: leave out the no-op backend's rows")
    parser.add_argument("--stub", action="store_true",
                        help="also our FlashInfer / FlashMLA / Triton backends with the library call stubbed")
    parser.add_argument("--stub-only", action="store_true", help="with --stub: only the stubbed backends' rows")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU; torch.cuda.is_available() is False here. Nothing was run.")
    register_backend(NOOP, NoopBackend(NOOP, planned=False))
    register_backend(NOOP_PLANNED, NoopBackend(NOOP_PLANNED, planned=True))
    env = environment()
    progress(environment_line(env))
    noop_rows, real_rows, stub_rows = [], [], []
    try:
        for B, H, fmt in ([] if (args.real and args.real_only) or (args.stub and args.stub_only) else args.cases):
            progress(f"## no-op backend, B={B} H={H} {fmt} on {args.device}")
            noop_rows.append(time_noop_case(B, H, fmt, args))
    finally:
        unregister_backend(NOOP)
        unregister_backend(NOOP_PLANNED)
    if args.stub:
        for B, H, fmt in args.cases:
            progress(f"## our backends, library stubbed, B={B} H={H} {fmt} on {args.device}")
            stub_rows += time_stub_case(B, H, fmt, args)
    if args.real:
        if args.device != "cuda":
            progress("--real needs --device cuda (a GPU): the real backends were not timed")
        else:
            for B, H, fmt in args.cases:
                progress(f"## real backend, B={B} H={H} {fmt}")
                real_rows.append(time_real_case(B, H, fmt, args))
            for (B, H, fmt), row in zip(args.cases, real_rows):  # profilers last: see the module docstring
                progress(f"## real backend, B={B} H={H} {fmt}: kernels per call{', cProfile' if args.profile else ''}")
                profile_real_case(B, H, fmt, args, row)
    text = markdown(noop_rows, real_rows, env, args, stub_rows)
    print(text)
    write_results(args.out, "bench_host_overhead", text, {"environment": env, "noop": noop_rows, "real": real_rows,
                                                         "stub": stub_rows,
                                                         "calls": args.calls, "steps": args.steps,
                                                         "value_checks": args.value_checks})


if __name__ == "__main__":
    main()
