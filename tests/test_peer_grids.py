"""The peers' own test grids (tests/grids.py says whose) on hostile inputs, against the float64 oracle.

Every case fills each cache row the call does not attend with garbage (NaN, inf or random bytes) and the
unused block-table entries with 2147480000 or -1, so a path that reads what it must not gives NaN or a
wrong value and fails. On CPU (CI): the reference eager, the compiled CPU path (Inductor code generated
from the reference) and, on small cases, our Triton kernels in Triton's interpreter. On a GPU: every GPU
backend on every case it supports (a backend that cannot run a case is skipped with its reason), eager
and compiled.
"""

import dataclasses

import pytest
import torch

import mla_inductor
from grids import (CASES, INTERPRETER_CASES, build, compiled_decode, one_thread_on_cpu,  # noqa: F401 - a fixture
                   step_args, tolerances, tolerances_for)
from mla_inductor.backends import device_capability, get_backend, registered_backends
from mla_inductor.contract import check_decode_args, empty_decode_outputs
from mla_inductor.testing import backend_call_paths, edge_case_grid, edge_case_inputs, lse_error, relative_error
from naive import naive_decode
from poison import poisoned
from triton_support import needs_triton_on_cpu

GPU_BACKENDS = [name for name in registered_backends() if name != "reference"]


def check_against_oracle(x, out, lse, tols, what):
    want_out, want_lse = naive_decode(*x.args())
    err_out, err_lse = relative_error(out.cpu(), want_out), lse_error(lse.cpu(), want_lse)
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


@pytest.mark.slow
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


# What each Hopper backend refuses of the grid (its supports() on SM90, read on CPU): the GPU tests skip these
# cells, and only these; a supports() that starts refusing more would otherwise turn GPU tests into skips.
SM90_REFUSALS = {
    "flashinfer_fa2": {"flashmla_s140_varlen_h63_q4", "flashmla_s4096_h16_q2_fp8_ds_mla",
                       "flashmla_sparse_s2046_topk2048_q3", "flashmla_sparse_s512_topk64", "vllm_cpu_page16_varlen"},
    "flashmla": {"flashinfer_oob_nan_page16_q17", "flashinfer_oob_nan_page16_q7", "flashinfer_page1_lens",
                 "flashinfer_page1_q5_h64", "flashmla_s140_h126_fp8", "flashmla_s4096_h16_q2_fp8_ds_mla",
                 "q4_longer_than_sequence", "sglang_sparse_topk128_bf16", "sparse_repeated_slot",
                 "vllm_cpu_page16_varlen", "vllm_flashmla_randn_q_fp8_q2", "vllm_triton_l1025_page16_h32",
                 "vllm_triton_l1027_page1_h32"},
    "triton": set(),
}
SM90_REFUSALS["flashinfer_fa3"] = SM90_REFUSALS["flashinfer_fa2"]


@pytest.mark.parametrize("backend_name", sorted(SM90_REFUSALS))
def test_what_each_hopper_backend_refuses_of_the_grid(backend_name):
    backend = get_backend(backend_name)
    refused = set()
    for name, case in CASES.items():
        problem = dataclasses.replace(check_decode_args(*build(case, seed=0).args()), device_type="cuda")
        if backend.supports(problem, (9, 0)) is not None:
            refused.add(name)
    assert refused == SM90_REFUSALS[backend_name]


# And of the edge rows (name-format): FlashInfer takes no fp8_ds_mla cache, FlashMLA's sparse kernel no bf16
# cache; B = 0 reaches no backend (an empty call is answered before selection), so refusing it costs nothing.
_FLASHINFER_EDGE_REFUSALS = {"all_lengths_0-fp8_ds_mla", "all_lengths_0_no_pages-fp8_ds_mla", "batch_0-bf16",
                             "batch_0-fp8_ds_mla", "batch_0-fp8_e4m3", "q4_short_lengths-fp8_ds_mla",
                             "some_lengths_0-fp8_ds_mla", "sparse_all_padding-fp8_ds_mla",
                             "sparse_some_rows_empty-fp8_ds_mla", "sparse_topk_0-fp8_ds_mla",
                             "table_width_0-fp8_ds_mla"}
SM90_EDGE_REFUSALS = {
    "flashinfer_fa2": _FLASHINFER_EDGE_REFUSALS,
    "flashinfer_fa3": _FLASHINFER_EDGE_REFUSALS,
    "flashmla": {"batch_0-bf16", "batch_0-fp8_ds_mla", "batch_0-fp8_e4m3", "sparse_all_padding-bf16",
                 "sparse_some_rows_empty-bf16", "sparse_topk_0-bf16"},
    "triton": set(),
}


@pytest.mark.parametrize("backend_name", sorted(SM90_EDGE_REFUSALS))
def test_what_each_hopper_backend_refuses_of_the_edge_rows(backend_name):
    """The GPU edge-row tests skip what supports() refuses; this pins those refusals on CPU, so a backend that
    starts refusing more cannot turn GPU edge rows into skips unseen."""
    backend = get_backend(backend_name)
    refused = set()
    for name, fmt in EDGE_GRID:
        x = poisoned(edge_case_inputs(name, fmt, seed=len(name)))
        problem = dataclasses.replace(check_decode_args(*x.args()), fp8_query=fmt == "fp8_e4m3", device_type="cuda")
        if backend.supports(problem, (9, 0)) is not None:
            refused.add(f"{name}-{fmt}")
    assert refused == SM90_EDGE_REFUSALS[backend_name]


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
    out, lse = compiled_on(backend_name, x, name)
    check_against_oracle(x, out, lse, tolerances(case, backend_name), f"compiled {backend_name} {name}")


def compiled_on(backend_name, x, what):
    """(out, lse) of a compiled step over ``x`` whose call the pass gives ``backend_name`` (preferred), into a
    NaN-filled allocator; skips where the selection gives another backend even so."""
    with mla_inductor.prefer_backends(backend_name):
        try:
            chosen = mla_inductor.backend_for_call(*x.args()).backend
        except RuntimeError as e:
            if "no MLA backend can run" not in str(e):
                raise
            # The preferred backend declares it cannot take the call (supports()): nothing of it to test.
            pytest.skip(f"{backend_name} does not take {what}: {str(e)[-200:]}")
        if chosen != backend_name:
            pytest.skip(f"the selection gives {chosen} for {what} even when {backend_name} is preferred")
        with compiled_decode(x.softmax_scale, dynamic=False) as (step, _):
            _poison_allocator()
            out, lse = step(*step_args(x))
    torch.cuda.synchronize()
    return out, lse


# ----------------------------------------------------------------------------- edge cases, every backend
# mla_inductor.testing.EDGE_CASES (also run by benchmarks/sanitize_backends.py under compute-sanitizer): all
# lengths 0 with and without cache pages, a zero-width block table, B = 0, Q > 1 over short sequences,
# all-padding and K = 0 sparse rows; unattended memory NaN, unused block-table entries 2147480000. Each backend
# is called the way eager dispatch calls it (``decode``) and the way a compiled graph does (its ops, planned).
EDGE_GRID = edge_case_grid()
EDGE_IDS = [f"{name}-{fmt}" for name, fmt in EDGE_GRID]


def _to(x, device):
    return dataclasses.replace(x, **{k: v.to(device) for k, v in vars(x).items() if isinstance(v, torch.Tensor)})


def check_edge_result(x, out, lse, tols, what):
    """The oracle's result, rows that see nothing exactly out 0 and lse -inf, and the contract's shapes."""
    T, H, L = x.q_nope.shape
    assert tuple(out.shape) == (T, H, L) and tuple(lse.shape) == (T, H), f"{what}: shapes {out.shape} {lse.shape}"
    check_against_oracle(x, out, lse, tols, what)
    _, want_lse = naive_decode(*x.args())
    empty = torch.isinf(want_lse)
    assert bool((out.cpu()[empty] == 0).all()), f"{what}: a row that sees nothing has out != 0"
    assert bool((lse.cpu()[empty] == float("-inf")).all()), f"{what}: a row that sees nothing has lse != -inf"


@pytest.mark.usefixtures("one_thread_on_cpu")
@pytest.mark.parametrize("name,fmt", EDGE_GRID, ids=EDGE_IDS)
def test_reference_edge_cases(name, fmt):
    """CPU: the op eagerly (value checks, then the reference) and the reference backend directly."""
    x = _to(poisoned(edge_case_inputs(name, fmt, num_heads=2, seed=len(name))), "cpu")
    check_decode_args(*x.args())
    check_edge_result(x, *torch.ops.mla.paged_decode_with_lse(*x.args()), tolerances_for(fmt, torch.bfloat16),
                      f"eager {name} {fmt}")
    check_edge_result(x, *get_backend("reference").decode(*x.args()), tolerances_for(fmt, torch.bfloat16),
                      f"reference {name} {fmt}")


@pytest.mark.slow
@needs_triton_on_cpu
@pytest.mark.usefixtures("one_thread_on_cpu")
@pytest.mark.parametrize("name,fmt", EDGE_GRID, ids=EDGE_IDS)
def test_triton_interpreter_edge_cases(name, fmt):
    """Our Triton backend called directly, as eager dispatch and as a compiled graph call it (its op), on
    outputs it allocates itself; small L/R where the format allows (fp8_ds_mla is 512/64 only)."""
    dims = dict(kv_lora_rank=256, rope_dim=32) if fmt != "fp8_ds_mla" else {}
    x = _to(poisoned(edge_case_inputs(name, fmt, num_heads=2, **dims, seed=len(name))), "cpu")
    backend = get_backend("triton")
    assert backend.supports(check_decode_args(*x.args()), None) is None
    tols = tolerances_for(fmt, torch.bfloat16, "triton")
    for what, out, lse in backend_call_paths(backend, x.args()):
        check_edge_result(x, out, lse, tols, f"triton {what} {name} {fmt}")


def test_backend_ops_skip_calls_that_attend_nothing():
    """Every op ``decode_op`` defines returns the contract's empty result (and a plan of zeros) for a call
    whose static sizes leave nothing to attend, without running its implementation; so does a ``decode``
    under ``skips_empty_calls``. Calls that attend something reach the implementation."""
    from mla_inductor.backends._common import decode_op, skips_empty_calls

    def refuse(*args):
        raise AssertionError("the implementation ran on a call that attends nothing")

    def plan_fake(q_nope, *args):
        return [q_nope.new_empty((q_nope.shape[0], 3), dtype=torch.int32)]

    ops = {returns: decode_op(f"mla_edge_test::{returns}", refuse, returns=returns, takes_plan=False,
                              fake=None if returns in ("out_lse", "out") else
                              plan_fake if returns == "tensors" else
                              (lambda *a: [*empty_decode_outputs(a[0]), *plan_fake(*a)]))
           for returns in ("out_lse", "out", "tensors", "out_lse_plan")}
    decode = skips_empty_calls(lambda self, *args: refuse())
    for name in ("all_lengths_0_no_pages", "table_width_0", "batch_0", "sparse_topk_0"):
        x = edge_case_inputs(name, num_heads=2, kv_lora_rank=256, rope_dim=32)
        T, H = x.q_nope.shape[:2]
        for out, lse in (ops["out_lse"](*x.args()), decode(None, *x.args()),
                         ops["out_lse_plan"](*x.args())[:2], (ops["out"](*x.args()), None)):
            assert out.shape == (T, H, 256) and bool((out == 0).all()), name
            assert lse is None or (lse.shape == (T, H) and bool((lse == float("-inf")).all())), name
        plan, = ops["tensors"](*x.args())
        assert plan.shape == (T, 3) and plan.dtype == torch.int32 and bool((plan == 0).all()), name
        assert ops["out_lse_plan"](*x.args())[2].shape == (T, 3), name
    x = edge_case_inputs("all_lengths_0", num_heads=2, kv_lora_rank=256, rope_dim=32)  # empty by its lengths only
    with pytest.raises(AssertionError, match="the implementation ran"):
        ops["out_lse"](*x.args())


@pytest.mark.gpu
@pytest.mark.parametrize("name,fmt", EDGE_GRID, ids=EDGE_IDS)
@pytest.mark.parametrize("backend_name", GPU_BACKENDS)
def test_gpu_backend_edge_cases(backend_name, name, fmt):
    """Every GPU backend on each edge case it supports: ``decode`` and the compiled graph's ops, outputs
    from a NaN-filled allocator. fp8_e4m3 cases opt in to an e4m3 query (FlashMLA's dense FP8 kernel,
    the one that faults on length 0, then runs)."""
    x = _to(poisoned(edge_case_inputs(name, fmt, seed=len(name))), "cuda")
    backend = get_backend(backend_name)
    problem = dataclasses.replace(check_decode_args(*x.args()), fp8_query=fmt == "fp8_e4m3")
    reason = backend.unavailable_reason() or backend.supports(problem, device_capability(x.q_nope.device))
    if reason is not None:
        pytest.skip(f"{backend_name} cannot run {name} {fmt}: {reason}")
    tols = tolerances_for(fmt, torch.bfloat16, backend_name)
    _poison_allocator()
    # (Where the graph quantizes q itself, FlashMLA's dense FP8, its op is covered by tests/test_backend_flashmla.py.)
    for what, out, lse in backend_call_paths(backend, x.args()):
        torch.cuda.synchronize()
        check_edge_result(x, out, lse, tols, f"{backend_name} {what} {name} {fmt}")


# Compiled end to end where a call is empty only by its lengths (the pass then selects a kernel): one graph each.
COMPILED_EDGE = [("all_lengths_0", "bf16"), ("q4_short_lengths", "bf16"), ("sparse_all_padding", "bf16"),
                 ("sparse_all_padding", "fp8_ds_mla")]


@pytest.mark.gpu
@pytest.mark.parametrize("name,fmt", COMPILED_EDGE, ids=[f"{n}-{f}" for n, f in COMPILED_EDGE])
@pytest.mark.parametrize("backend_name", GPU_BACKENDS)
def test_gpu_backend_edge_cases_compiled(backend_name, name, fmt):
    import mla_inductor.lowering  # noqa: F401 - installs the pass

    x = _to(poisoned(edge_case_inputs(name, fmt, seed=len(name))), "cuda")
    backend = get_backend(backend_name)
    reason = backend.unavailable_reason()
    if reason is not None:
        pytest.skip(f"{backend_name}: {reason}")
    out, lse = compiled_on(backend_name, x, f"{name} {fmt}")
    check_edge_result(x, out, lse, tolerances_for(fmt, torch.bfloat16, backend_name),
                      f"compiled {backend_name} {name} {fmt}")
