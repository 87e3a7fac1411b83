"""The peers' own test grids (tests/grids.py says whose) on hostile inputs, against the float64 oracle.

Every case fills each cache row the call does not attend with garbage (NaN, inf or random bytes) and the
unused block-table entries with 2147480000 or -1, so a path that reads what it must not gives NaN or a
wrong value and fails. On CPU (CI): the reference eager, the compiled CPU path (Inductor code generated
from the reference) and, on small cases, our Triton kernels in Triton's interpreter. On a GPU: every GPU
backend on every case it supports (a backend that cannot run a case is skipped with its reason), eager
and compiled.
"""

import pytest
import torch

import mla_inductor
from grids import (CASES, INTERPRETER_CASES, build, compiled_decode, one_thread_on_cpu,  # noqa: F401 - a fixture
                   step_args, tolerances)
from mla_inductor.backends import BACKEND_MODULES, device_capability, get_backend
from mla_inductor.contract import check_decode_args
from mla_inductor.testing import relative_error
from naive import naive_decode
from triton_support import needs_triton_on_cpu

GPU_BACKENDS = [name for name in BACKEND_MODULES if name != "reference"]


def check_against_oracle(x, out, lse, tols, what):
    want_out, want_lse = naive_decode(*x.args())
    err_out, err_lse = relative_error(out.cpu(), want_out), relative_error(lse.cpu(), want_lse)
    assert err_out < tols[0] and err_lse < tols[1], f"{what}: out error {err_out:.2e}, lse error {err_lse:.2e}"
    assert out.dtype == x.q_nope.dtype and lse.dtype == torch.float32


# ----------------------------------------------------------------------------- CPU (CI)
@pytest.mark.usefixtures("one_thread_on_cpu")
@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_eager(name):
    case = CASES[name]
    x = build(case, seed=len(name))
    out, lse = torch.ops.mla.paged_decode_with_lse(*x.args())  # eager on CPU: value checks, then the reference
    check_against_oracle(x, out, lse, tolerances(case), name)


# The compiled CPU path: one compiled function per group, dynamic shapes. The pass fixes a model's constants
# (heads, page size, new tokens per sequence, top-k) to their traced values with a guard, so a group compiles
# one graph per distinct set of them and shares it between the cases that agree (batch sizes and lengths
# stay symbolic). The generated code also specialises on Q == 1 and on pages of one token; formats the
# groups leave out run compiled in tests/test_fuzz.py.
COMPILED_GROUPS = {
    "dense_q_gt_1": ["flashinfer_oob_nan_page16_q7", "flashinfer_oob_nan_page16_q17", "q4_longer_than_sequence"],
    "dense_q2_page64": ["flashmla_s140_varlen_h3_q2", "flashmla_zero_lengths_h9_q2"],
    "dense_page1": ["flashinfer_page1_lens"],
    "sparse_fp8_ds_mla": ["flashmla_sparse_s512_topk64", "flashmla_sparse_s2046_topk2048_q3"],
}


def model_constants(case) -> tuple:
    return case.heads, case.q_per_seq, case.page_size, case.topk, case.fmt, case.q_dtype


@pytest.mark.usefixtures("one_thread_on_cpu")
@pytest.mark.parametrize("group", sorted(COMPILED_GROUPS))
def test_compiled_cpu(group):
    cases = [(name, CASES[name], build(CASES[name], seed=len(name))) for name in COMPILED_GROUPS[group]]
    with compiled_decode(cases[0][2].softmax_scale) as (step, counter):
        for name, case, x in cases:
            out, lse = step(*step_args(x))
            check_against_oracle(x, out, lse, tolerances(case), f"compiled {name}")
    graphs = len({model_constants(case) for _, case, _ in cases})
    assert counter.frame_count == graphs, f"{counter.frame_count} graphs for group {group}, {graphs} expected"


@needs_triton_on_cpu
@pytest.mark.usefixtures("one_thread_on_cpu")
@pytest.mark.parametrize("name", sorted(INTERPRETER_CASES))
def test_triton_interpreter(name):
    case = INTERPRETER_CASES[name]
    x = build(case, seed=len(name))
    backend = get_backend("triton")
    reason = backend.supports(check_decode_args(*x.args()), None)
    assert reason is None, reason  # the interpreter runs every case here; a refusal is a failure
    out, lse = backend.decode(*x.args())
    check_against_oracle(x, out, lse, tolerances(case, "triton"), f"triton (interpreter) {name}")


# ----------------------------------------------------------------------------- GPU (H100)
def _poison_allocator():
    """Fill the caching allocator's free blocks with NaN, so an output a kernel leaves unwritten is NaN."""
    junk = torch.full((256 << 20,), float("nan"), device="cuda")
    del junk


def _gpu_case(backend_name, name):
    case = CASES[name]
    x = build(case, device="cuda", seed=len(name))
    backend = get_backend(backend_name)
    reason = backend.unavailable_reason() or backend.supports(check_decode_args(*x.args()), device_capability(
        x.q_nope.device))
    if reason is not None:
        pytest.skip(f"{backend_name} cannot run {name}: {reason}")
    return case, x, backend


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("backend_name", GPU_BACKENDS)
def test_gpu_backend(backend_name, name):
    case, x, backend = _gpu_case(backend_name, name)
    for _ in range(2):  # a second call reuses whatever the first planned or cached
        _poison_allocator()
        out, lse = backend.decode(*x.args())
        torch.cuda.synchronize()
        check_against_oracle(x, out, lse, tolerances(case, backend_name), f"{backend_name} {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("backend_name", GPU_BACKENDS)
def test_gpu_backend_compiled(backend_name, name):
    import mla_inductor.lowering  # noqa: F401 - installs the pass

    case, x, _ = _gpu_case(backend_name, name)
    with mla_inductor.prefer_backends(backend_name):
        chosen = mla_inductor.backend_for_call(*x.args()).backend
        if chosen != backend_name:
            pytest.skip(f"the selection gives {chosen} for {name} even when {backend_name} is preferred")
        with compiled_decode(x.softmax_scale, dynamic=False) as (step, _):
            _poison_allocator()
            out, lse = step(*step_args(x))
    torch.cuda.synchronize()
    check_against_oracle(x, out, lse, tolerances(case, backend_name), f"compiled {backend_name} {name}")
