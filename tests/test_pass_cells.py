"""FileCheck of the pass's rewrite for every (capability, cache format, sparse) cell, on any machine.

The graph is traced with fake CUDA tensors (FakeTensorMode needs no GPU), the device's capability is
faked, every backend is treated as installed, and the post-grad pass runs on the graph. The rewritten
graph must call exactly what ``select_backend`` picked for the cell: its run op once per layer, its plan
made once per forward (or by the first layer, for backends whose kernel makes it), and nothing of
``mla.paged_decode`` left. GPU runs of the same ops against the reference are in the backend tests.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import FileCheck

import mla_inductor
from mla_inductor.backends import get_backend, registered_backends
from mla_inductor.backends import flashmla
from mla_inductor.info import example_problem
from mla_inductor.selection import CallContext, select_backend

CAPABILITIES = {"SM80": (8, 0), "SM89": (8, 9), "SM90": (9, 0), "SM100": (10, 0), "SM120": (12, 0)}
FORMATS = {"bf16": (torch.bfloat16, 576), "fp8_e4m3": (torch.float8_e4m3fn, 576), "fp8_ds_mla": (torch.uint8, 656)}
EVERYTHING = {name: None for name in registered_backends()}
T, H, PAGES, TOPK = 4, 128, 8, 2048


def two_layers(q_nope, q_pe, cache_a, cache_b, block_table, seq_lens, kv_scale, sparse_indices):
    a = torch.ops.mla.paged_decode(q_nope, q_pe, cache_a, block_table, seq_lens, 0.07, kv_scale, sparse_indices)
    b, lse = torch.ops.mla.paged_decode_with_lse(a, q_pe, cache_b, block_table, seq_lens, 0.07, kv_scale,
                                                 sparse_indices)
    return b, lse


def _fake_inputs(fmt: str, sparse: bool, rows: int = T):
    dtype, width = FORMATS[fmt]
    cuda = dict(device="cuda")
    q = dict(dtype=torch.bfloat16, **cuda)
    return (torch.empty(rows, H, 512, **q), torch.empty(rows, H, 64, **q),
            torch.empty(4 * PAGES, 64, width, dtype=dtype, **cuda),
            torch.empty(4 * PAGES, 64, width, dtype=dtype, **cuda),
            torch.zeros(rows, PAGES, dtype=torch.int32, **cuda), torch.ones(rows, dtype=torch.int32, **cuda),
            torch.ones(1, dtype=torch.float32, **cuda),
            torch.zeros(rows, TOPK, dtype=torch.int32, **cuda) if sparse else None)


# The context of two_layers' calls as the pass sees them here: two calls sharing a plan, no CUDA graphs.
UNCAPTURED = CallContext(calls_sharing_plan=2, captured=False)


def _call(op) -> str:
    namespace, name = op.name().split("::")
    return f"torch.ops.{namespace}.{name}.{op._overloadname}("


def _traced_and_lowered(fmt: str, sparse: bool) -> torch.fx.GraphModule:
    """two_layers traced on fake CUDA tensors, then our post-grad pass, in the fake mode Inductor would use."""
    from torch._inductor.virtualized import V

    from mla_inductor.lowering import MLALoweringPass

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        gm = make_fx(two_layers)(*_fake_inputs(fmt, sparse))
    assert gm.code.count("torch.ops.mla.paged_decode") == 2
    with V.set_fake_mode(mode), mode:
        MLALoweringPass()(gm.graph)
    gm.recompile()
    return gm


@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU of the given capability with every backend library installed, as the pass sees it."""
    from mla_inductor import backends
    from mla_inductor.lowering import graph_pass

    monkeypatch.setattr(backends, "availability", lambda: dict(EVERYTHING))
    monkeypatch.setattr(flashmla, "metadata_shape", lambda *args: (132, 8))  # measured on the GPU otherwise

    def use(capability):
        monkeypatch.setattr(graph_pass, "device_capability", lambda device: capability)
    return use


CELLS = [(cap, fmt, sparse) for cap in CAPABILITIES for fmt in FORMATS for sparse in (False, True)]


def _cell_param(cap, fmt, sparse):
    chosen = select_backend(example_problem("cuda", fmt, sparse, H, 64, batch=T), CAPABILITIES[cap],
                            available=EVERYTHING, preference=()).backend
    # Tracing the reference's gathers on fake CUDA tensors needs a CUDA-enabled torch build (a GPU need
    # not be present); the reference's rewrite itself is FileChecked on CPU in test_compile_cpu.py.
    marks = [pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="the reference traced on fake CUDA "
                                "tensors needs a CUDA-enabled torch build")] if chosen == "reference" else []
    return pytest.param(cap, fmt, sparse, marks=marks, id=f"{cap}-{fmt}-{'sparse' if sparse else 'dense'}-{chosen}")


@pytest.mark.parametrize("cap,fmt,sparse", [_cell_param(*cell) for cell in CELLS])
def test_each_cell_is_rewritten_into_the_selected_backend(fake_gpu, cap, fmt, sparse):
    capability = CAPABILITIES[cap]
    fake_gpu(capability)
    problem = example_problem("cuda", fmt, sparse, H, 64, batch=T)
    backend = get_backend(select_backend(problem, capability, available=EVERYTHING, preference=()).backend)
    gm = _traced_and_lowered(fmt, sparse)
    code = gm.code
    check = FileCheck().check_not("torch.ops.mla.paged_decode")
    run, plan, first = backend.compiled_op_for(UNCAPTURED), backend.plan_op(), backend.decode_and_plan_op()
    if run is None:  # traced into aten ops (the reference): no opaque MLA kernel at all (only the record op)
        check.check_not("torch.ops.mla_")
    elif first is not None:  # the first layer makes the plan, the second takes it
        check.check_count(_call(first), 1, exactly=True).check_count(_call(run), 1, exactly=True)
        check.check_not(_call(plan))
    else:
        if plan is not None:
            check.check_count(_call(plan), 1, exactly=True)
        out_only = backend.out_only_op_for(UNCAPTURED)
        if out_only is not None:  # the first layer's lse is not read: the out-only op, then the run op
            check.check_count(_call(out_only), 1, exactly=True).check_count(_call(run), 1, exactly=True)
        else:
            check.check_count(_call(run), 2, exactly=True)
    check.run(code)


def test_triton_keeps_its_split_workspace_only_in_graphs_without_cuda_graphs(fake_gpu, monkeypatch):
    """Compiled without CUDA graphs, our Triton kernel's calls keep the split-KV workspace per stream (as eager
    calls do); in a graph CUDA-graph trees capture, whose warm-up allocates in the graph's pool, they make a
    fresh one (the op that keeps none)."""
    from mla_inductor.backends import triton as triton_backend
    from mla_inductor.lowering import graph_pass

    fake_gpu(CAPABILITIES["SM80"])  # bf16 sparse on SM80: our Triton kernel
    code = _traced_and_lowered("bf16", True).code  # one call's lse is read, the other's is not (out only)
    assert code.count(_call(triton_backend.DECODE_KEEPING_WORKSPACE_OP)) == 1, code
    assert code.count(_call(triton_backend.DECODE_OUT_KEEPING_WORKSPACE_OP)) == 1, code
    assert _call(triton_backend.DECODE_OP) not in code
    monkeypatch.setattr(graph_pass, "cudagraphs_enabled", lambda: True)
    code = _traced_and_lowered("bf16", True).code
    assert code.count(_call(triton_backend.DECODE_OP)) == 2, code
    assert "decode_keeping_workspace" not in code


def test_a_backend_with_compiled_op_alone_serves_every_context():
    """``compiled_op()`` stays the interface a backend (a user's too) implements; the pass asks
    ``compiled_op_for(context)``, which answers it unless a backend overrides it."""
    from mla_inductor.backends import Backend

    class UsersBackend(Backend):
        def compiled_op(self):
            return "the user's op"

    for context in (None, UNCAPTURED, CallContext(calls_sharing_plan=1, captured=True)):
        assert UsersBackend().compiled_op_for(context) == "the user's op"


def test_the_cells_reach_every_backend_but_xqa():
    """Every backend is some cell's choice except XQA (a fallback), whose rewrite is checked below."""
    chosen = {select_backend(example_problem("cuda", fmt, sparse, H, 64, batch=T), CAPABILITIES[cap],
                             available=EVERYTHING, preference=()).backend for cap, fmt, sparse in CELLS}
    assert chosen == set(registered_backends()) - {"flashinfer_xqa"}


@pytest.mark.parametrize("backend,cap,fmt", [
    pytest.param("flashinfer_xqa", "SM120", "fp8_e4m3", marks=pytest.mark.skipif(
        torch.version.cuda is None, reason="XQA accepts calls only under a CUDA 12.8+ torch build")),
    ("triton", "SM90", "bf16"), ("flashinfer_fa2", "SM90", "bf16")])
def test_a_preference_changes_the_rewrite(fake_gpu, backend, cap, fmt):
    fake_gpu(CAPABILITIES[cap])
    with mla_inductor.prefer_backends(backend):
        gm = _traced_and_lowered(fmt, False)
    b = get_backend(backend)
    check = FileCheck().check_not("torch.ops.mla.paged_decode")
    if b.plan_op() is not None:
        check.check_count(_call(b.plan_op()), 1, exactly=True)
    check.check_not("mla_flashmla").run(gm.code)
    # Both calls run on the backend: mla.paged_decode (its lse unread) on its out-only op where it has one.
    out_only = b.out_only_op_for(UNCAPTURED)
    runs = [b.compiled_op_for(UNCAPTURED)] + ([out_only] if out_only is not None else [])
    assert [gm.code.count(_call(op)) for op in runs] == ([1, 1] if len(runs) == 2 else [2]), gm.code


# ----------------------------------------------------------------------------- FP8 queries made by the compiler

def fp8_query_layers(q_nope, q_pe, cache_a, cache_b, block_table, seq_lens, kv_scale, q_scale):
    a = torch.ops.mla.paged_decode(q_nope, q_pe, cache_a, block_table, seq_lens, 0.07, kv_scale, None, q_scale)
    b, lse = torch.ops.mla.paged_decode_with_lse(a, q_pe, cache_b, block_table, seq_lens, 0.07, kv_scale,
                                                 q_scale=q_scale)
    return b, lse


# Sequences in the FP8-query graphs below: more than 32, where calls that allowed an e4m3 query go to FlashMLA-fp8
# in every kind of program (at most 32 eager or without CUDA graphs, our Triton kernel is the faster one).
FP8_QUERY_ROWS = 64


def _lowered_fp8_query_layers(static_scale: bool, allow: bool, rows: int = FP8_QUERY_ROWS) -> str:
    from torch._inductor.virtualized import V

    from mla_inductor.lowering import MLALoweringPass

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        inputs = list(_fake_inputs("fp8_e4m3", False, rows)[:7])
        inputs.append(torch.ones(1, dtype=torch.float32, device="cuda") if static_scale else None)
        gm = make_fx(fp8_query_layers)(*inputs)
    with V.set_fake_mode(mode), mode, (mla_inductor.allow_fp8_query() if allow else contextlib.nullcontext()):
        MLALoweringPass()(gm.graph)
    gm.recompile()
    return gm.code


QUANTIZE_TO_E4M3 = "torch.ops.prims.convert_element_type.default(clamp_max_default"


@pytest.mark.parametrize("static_scale,allow", [(True, False), (False, True), (True, True)],
                         ids=["static-q_scale", "allowed-dynamic", "static-and-allowed"])
def test_fp8_query_is_assembled_and_quantized_in_the_graph(fake_gpu, static_scale, allow):
    """SM90, fp8_e4m3 cache, the caller opted in: each call becomes q's assembly (cat) and quantization
    (amax unless the scale is static, div, clamp, cast to e4m3) as aten ops Inductor can fuse into q's
    producers, then FlashMLA's op on the e4m3 query; one plan for both layers, on the device."""
    fake_gpu(CAPABILITIES["SM90"])
    code = _lowered_fp8_query_layers(static_scale, allow)
    run, plan = flashmla.QUANTIZED_QUERY_OP, flashmla.PLAN_OP
    assert "torch.ops.mla.paged_decode" not in code and "torch.ops.mla_flashmla.decode.default(" not in code, code
    assert code.count(_call(plan)) == 1, code  # made once, by the first layer's query shape, for both
    check = FileCheck()
    for _ in range(2):
        check.check("torch.ops.aten.cat.default([")
        if not static_scale:
            check.check("torch.ops.aten.amax.default(")
        check.check("torch.ops.aten.div.Tensor(").check(QUANTIZE_TO_E4M3).check("torch.float8_e4m3fn)")
        check.check(_call(run))
    check.run(code)
    if static_scale:  # the static scale is the descale: no amax pass anywhere
        assert "aten.amax" not in code and code.count("q_scale_1") >= 3, code
    assert code.count(_call(run)) == 2 and code.count(", torch.bfloat16)") == 2, code  # out dtype: q's


def test_fp8_cache_keeps_a_bf16_query_by_default(fake_gpu):
    """Without a q_scale or allow_fp8_query, an fp8 cache goes to a kernel that reads q in bf16 (ours on
    SM90): no quantization of q in the graph, and FlashMLA-fp8 says why it passed."""
    fake_gpu(CAPABILITIES["SM90"])
    code = _lowered_fp8_query_layers(static_scale=False, allow=False)
    assert "mla_flashmla" not in code and "aten.amax" not in code and QUANTIZE_TO_E4M3 not in code, code
    triton = get_backend("triton")  # one call's lse is read, the other's is not (its out-only op)
    assert code.count(_call(triton.compiled_op_for(UNCAPTURED))) == 1, code
    assert code.count(_call(triton.out_only_op_for(UNCAPTURED))) == 1, code
    problem = example_problem("cuda", "fp8_e4m3", False, H, 64, batch=FP8_QUERY_ROWS)
    sel = select_backend(problem, CAPABILITIES["SM90"], available=EVERYTHING, preference=())
    assert sel.backend == "triton" and "opt in with a static q_scale" in sel.reasons[0], sel


def test_an_allowed_fp8_query_stays_in_bf16_where_our_kernel_is_faster(fake_gpu):
    """Up to 32 sequences without CUDA graphs, a call that allowed an e4m3 query runs our Triton kernel on q in
    bf16 (faster there): nothing is quantized in the graph."""
    fake_gpu(CAPABILITIES["SM90"])
    code = _lowered_fp8_query_layers(static_scale=False, allow=True, rows=T)
    assert "mla_flashmla" not in code and "aten.amax" not in code and QUANTIZE_TO_E4M3 not in code, code
    triton = get_backend("triton")
    assert code.count(_call(triton.compiled_op_for(UNCAPTURED))) == 1, code
