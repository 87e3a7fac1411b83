"""select_backend: the table's picks, user control, and docs/backends.md generated from it. The measurements
behind the rows are checked against them by benchmarks/check_table.py (tests/test_results_page.py)."""

from pathlib import Path

import pytest
import torch

import mla_inductor
from mla_inductor.backends import registered_backends
from mla_inductor.info import backend_matrix_markdown, example_problem, matrix_rows
from mla_inductor.selection import BACKEND_ENV, EAGER_CAPTURE, TABLE, CallContext, device_class, select_backend
from triton_support import TRITON_DEVICE, needs_triton, needs_triton_on_cpu

EVERYTHING = {name: None for name in registered_backends()}
SM90 = (9, 0)


def test_every_table_backend_is_registered():
    for row in TABLE:
        assert set(row.order) <= set(registered_backends()), row
        assert row.order[-1] == "reference", f"row {row} must end with the reference so every call runs"


def test_device_classes():
    assert [device_class("cuda", c) for c in [(8, 0), (8, 9), (9, 0), (10, 3), (12, 0), (7, 5)]] == [
        "sm80", "sm80", "sm90", "sm100", "sm120", "cuda"]
    assert device_class("cpu", None) == "cpu"


def test_every_cell_selects_a_backend():
    rows = list(matrix_rows(EVERYTHING))
    any_batch = [r for r in rows if r[5] == "any"]
    assert len(any_batch) == 6 * 3 * 2 * 2 * 2
    for dev, fmt, sparse, heads, page, batch, chosen, reasons in rows:
        assert chosen in registered_backends()
        if dev == "cpu":
            assert chosen == "reference"
    # A batch-1 row is listed only where it changes the choice: SM90 dense bf16 goes to FA3.
    assert {(r[0], r[1], r[2], r[6]) for r in rows if r[5] == 1} == {("SM90", "bf16", False, "flashinfer_fa3")}


@pytest.mark.parametrize("batch,want", [(1, "triton"), (2, "flashmla"), (None, "flashmla")])
def test_sm90_bf16_one_sequence_in_a_captured_step_goes_to_triton(batch, want):
    """Only a static B=1 takes the single-sequence row in a whole step captured in CUDA graphs, at any head count;
    a symbolic batch (mark_unbacked) cannot."""
    problem = example_problem("cuda", "bf16", False, 128, 64, batch=batch)
    captured_step = CallContext(61, captured=True)
    assert select_backend(problem, SM90, available=EVERYTHING, preference=(), context=captured_step).backend == want


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("batch,context,want", [
    (1, None, "triton"),                                  # one sequence: Triton in every kind of program
    (1, CallContext(61, captured=False), "triton"),
    (1, CallContext(61, captured=True), "triton"),
    (1, CallContext(1, captured=True), "triton"),
    (32, None, "triton"),                                 # up to 32, eager or without CUDA graphs
    (32, CallContext(61, captured=False), "triton"),
    (32, CallContext(1, captured=False), "triton"),       # up to 32, a graph of one call
    (32, CallContext(1, captured=True), "triton"),
    (32, CallContext(61, captured=True), "flashmla"),     # a whole step in CUDA graphs: FlashMLA-fp8's kernel
    (33, None, "flashmla"),
    (128, None, "flashmla"),
    (None, None, "flashmla"),                             # a symbolic batch (mark_unbacked): the general row
])
def test_sm90_fp8_calls_allowing_an_e4m3_query_go_where_they_are_fastest(heads, batch, context, want):
    """An fp8_e4m3 call that allowed an e4m3 query may run on FlashMLA-fp8, and goes there only where the table
    ranks it ahead of our Triton kernel keeping q in bf16 (docs/results.md#sm90-fp8-one-sequence and the rows after)."""
    fp8 = example_problem("cuda", "fp8_e4m3", False, heads, 64, batch=batch, fp8_query=True)
    assert select_backend(fp8, SM90, available=EVERYTHING, preference=(), context=context).backend == want


@pytest.mark.parametrize("heads,batch,context,want", [
    (16, 1, CallContext(61, captured=True), "triton"),          # a whole step in CUDA graphs: device time decides
    (16, 1, CallContext(61, captured=False), "flashinfer_fa3"),  # compiled without graphs: Triton's launches cost
    (16, 1, None, "flashinfer_fa3"),                            # eager
    (128, 1, CallContext(61, captured=True), "triton"),          # any H
    (16, 2, CallContext(61, captured=True), "triton"),           # up to 8 sequences of <= 64 heads
    (16, 8, CallContext(61, captured=True), "triton"),
    (32, 4, CallContext(61, captured=True), "triton"),
    (64, 8, CallContext(61, captured=True), "triton"),
    (16, 9, CallContext(61, captured=True), "flashmla"),
    (64, 9, CallContext(61, captured=True), "flashmla"),
    (65, 8, CallContext(61, captured=True), "flashmla"),
    (128, 2, CallContext(61, captured=True), "flashmla"),
    (128, 4, CallContext(61, captured=True), "flashmla"),        # FlashMLA ahead on varied lengths
    # One-call graphs (a layer compiled alone, an MTP draft layer) at B=1: Triton's two kernels, any H.
    (16, 1, CallContext(1, captured=True), "triton"),
    (128, 1, CallContext(1, captured=True), "triton"),
    (128, 1, CallContext(1, captured=False), "triton"),
    (128, 2, CallContext(1, captured=True), "flashmla"),        # B >= 2: the general row, FA3's host plan moved
    (128, 1, CallContext(2, captured=False), "flashinfer_fa3"),  # two calls share the plan: not a one-call graph
    # One-call graphs of up to 32 sequences: Triton at H <= 16, and at any H without CUDA graphs;
    # more sequences, or more heads with CUDA graphs: FlashMLA.
    (16, 32, CallContext(1, captured=True), "triton"),
    (16, 32, CallContext(1, captured=False), "triton"),
    (16, 33, CallContext(1, captured=True), "flashmla"),
    (128, 32, CallContext(1, captured=True), "flashmla"),
    (128, 32, CallContext(1, captured=False), "triton"),        # without CUDA graphs, any H
    (128, 33, CallContext(1, captured=False), "flashmla"),
    (16, 32, CallContext(61, captured=True), "flashmla"),       # a whole step: FlashMLA's schedule is shared
    (16, None, CallContext(1, captured=True), "flashmla"),      # a symbolic batch takes no row limited by B
    # Eager calls and whole steps without CUDA graphs (host-bound at small B): FA3 up to B=16 at any H and up to
    # B=32 at H <= 16; beyond, and with CUDA graphs, FlashMLA.
    (128, 16, None, "flashinfer_fa3"),
    (128, 16, CallContext(61, captured=False), "flashinfer_fa3"),
    (128, 17, None, "flashmla"),
    (128, 16, CallContext(61, captured=True), "flashmla"),
    (16, 32, None, "flashinfer_fa3"),
    (16, 32, CallContext(61, captured=False), "flashinfer_fa3"),
    (16, 33, None, "flashmla"),
    (32, 32, None, "flashmla"),
    (16, None, None, "flashmla"),
    # An eager call made while the user captures a CUDA graph: chosen as in a captured one-call graph (FA3's host
    # plan cannot be replayed): Triton at B <= 32 H <= 16, FlashMLA above.
    (16, 8, EAGER_CAPTURE, "triton"),
    (128, 8, EAGER_CAPTURE, "flashmla"),
])
def test_sm90_bf16_one_sequence_rows_by_graph_kind(heads, batch, context, want):
    """The rows limited to a kind of program (captured whole steps at B=1 and at B <= 8 H <= 64; one-call graphs
    at B=1, and at B <= 32 H <= 16 or without CUDA graphs; eager calls and steps without CUDA graphs at B <= 16,
    and B <= 32 H <= 16) apply to exactly those calls."""
    problem = example_problem("cuda", "bf16", False, heads, 64, batch=batch)
    assert select_backend(problem, SM90, available=EVERYTHING, preference=(), context=context).backend == want


@pytest.mark.parametrize("fmt,sparse,available,want", [
    ("bf16", False, EVERYTHING, "flashmla"),
    ("bf16", False, {**EVERYTHING, "flashmla": "not installed"}, "flashinfer_fa3"),
    ("fp8_e4m3", False, EVERYTHING, "triton"),  # FlashMLA-fp8 quantizes q: only for calls that opted in
    ("fp8_e4m3", False, {**EVERYTHING, "flashmla": "not installed"}, "triton"),
    ("fp8_ds_mla", False, EVERYTHING, "flashmla"),  # its sparse kernel, every position as an index
    ("fp8_ds_mla", True, EVERYTHING, "flashmla"),
    ("bf16", False, {"reference": None}, "reference"),
])
def test_sm90_choices_by_format_and_availability(fmt, sparse, available, want):
    problem = example_problem("cuda", fmt, sparse, 128, 64)
    assert select_backend(problem, SM90, available=available, preference=()).backend == want


@pytest.mark.parametrize("heads,want", [(128, "flashmla"), (64, "flashmla"), (16, "triton")])
def test_sm90_dense_fp8_ds_mla_goes_to_flashmla_sparse_kernel_where_it_can(heads, want):
    problem = example_problem("cuda", "fp8_ds_mla", False, heads, 64)
    sel = select_backend(problem, SM90, available=EVERYTHING, preference=())
    assert sel.backend == want
    if want == "triton":
        assert "64 or 128 heads, got 16" in sel.reasons[0]


@pytest.mark.parametrize("opt_in,want", [(False, "triton"), (True, "flashmla")])
def test_sm90_fp8_cache_quantizes_q_only_when_opted_in(opt_in, want):
    problem = example_problem("cuda", "fp8_e4m3", False, 128, 64)
    with mla_inductor.allow_fp8_query(opt_in):
        assert select_backend(problem, SM90, available=EVERYTHING, preference=()).backend == want


def test_reasons_name_each_backend_passed_over():
    problem = example_problem("cuda", "bf16", False, 128, 64)
    avail = {**EVERYTHING, "flashmla": "no FlashMLA provider is importable"}
    sel = select_backend(problem, SM90, available=avail, preference=())
    assert sel.reasons[0] == "flashmla: no FlashMLA provider is importable"
    assert all(r.split(":")[0] != sel.backend for r in sel.reasons)


def test_user_preference_by_context_and_env(monkeypatch):
    """Each preference picks a backend the table would not (SM90 bf16: the table's first is flashmla)."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    problem = example_problem("cuda", "bf16", False, 128, 64)
    assert select_backend(problem, SM90, available=EVERYTHING).backend == "flashmla"
    with mla_inductor.prefer_backends("triton", "reference"):
        sel = select_backend(problem, SM90, available=EVERYTHING)
        assert (sel.backend, sel.reasons) == ("triton", ())
        with mla_inductor.prefer_backends("reference"):  # the innermost block wins
            assert select_backend(problem, SM90, available=EVERYTHING).backend == "reference"
    with mla_inductor.prefer_backends("flashmla", "triton"):  # order matters, not membership
        assert select_backend(problem, SM90, available={**EVERYTHING, "flashmla": "not installed"}).backend == "triton"
    assert select_backend(problem, SM90, available=EVERYTHING).backend == "flashmla"  # the block ended
    monkeypatch.setenv(BACKEND_ENV, "reference")
    assert select_backend(problem, SM90, available=EVERYTHING).backend == "reference"
    problem = example_problem("cpu", "bf16", False, 16, 64)
    monkeypatch.setenv(BACKEND_ENV, "nope")
    with pytest.raises(ValueError, match=r"unknown MLA backend\(s\) \['nope'\]"):
        select_backend(problem, None, available=EVERYTHING)
    with pytest.raises(ValueError, match="prefer_backends needs known backend names"):
        with mla_inductor.prefer_backends("nope"):
            pass


def test_no_backend_raises_with_every_reason():
    problem = example_problem("cpu", "bf16", False, 16, 64)
    with pytest.raises(RuntimeError, match="flashmla: needs a CUDA GPU"):
        select_backend(problem, None, available=EVERYTHING, preference=("flashmla",))


def test_eager_call_honours_the_preference():
    from mla_inductor.testing import make_decode_inputs

    x = make_decode_inputs([5], num_heads=2, kv_lora_rank=32, rope_dim=16, page_size=4, q_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="flashinfer_fa3"):
        with mla_inductor.prefer_backends("flashinfer_fa3"):
            torch.ops.mla.paged_decode(*x.args())


def test_docs_backends_md_matches_select_backend():
    doc = (Path(__file__).resolve().parent.parent / "docs" / "backends.md").read_text()
    start = doc.index("<!-- generated: python -m mla_inductor.info --markdown -->\n")
    end = doc.index("<!-- end generated -->")
    generated = doc[start:end].split("\n", 1)[1]
    assert generated == backend_matrix_markdown(), "docs/backends.md is stale: regenerate it"


def test_backend_for_call_answers_from_the_arguments():
    from mla_inductor.testing import make_decode_inputs

    x = make_decode_inputs([5, 9], num_heads=2, kv_lora_rank=256, rope_dim=32, page_size=4)
    assert mla_inductor.backend_for_call(*x.args()).backend == "reference"
    with pytest.raises(ValueError, match="q_pe must be"):
        mla_inductor.backend_for_call(x.q_nope, x.q_pe[:1], *x.args()[2:])


@needs_triton_on_cpu
def test_backend_for_call_follows_a_preference_on_cpu():
    from mla_inductor.testing import make_decode_inputs

    x = make_decode_inputs([5, 9], num_heads=2, kv_lora_rank=256, rope_dim=32, page_size=4)
    with mla_inductor.prefer_backends("triton"):
        assert mla_inductor.backend_for_call(*x.args()).backend == "triton"
