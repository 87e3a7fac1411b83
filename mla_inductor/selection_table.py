"""The selection policy as data: which backends each kind of call tries, best first, and why in a line.

``selection.py`` holds the mechanism (matching a call to the first row, the user's preference, moving host
planners behind device planners in one-call graphs); this module holds only the rows. Each row's ``anchor``
names the subsection of docs/results.md whose measurements decided it; ``benchmarks/check_table.py`` lists the
rows the committed measurements contradict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# The kinds of program a Row may be limited to (``Row.graph``; ``selection.graph_kind`` says which a call is in).
# A whole step captured in CUDA graphs: a plan is shared by its layers, and a kernel's own device time decides.
CAPTURED_STEP = "whole steps in CUDA graphs"
# A graph of one call (a layer compiled alone, an MTP draft layer): every kernel of the call and of its plan runs
# once per graph call.
ONE_CALL_GRAPH = "one-call graphs"
# Eager calls and whole steps compiled without CUDA graphs: each call's host work runs between the kernels.
UNCAPTURED = "eager calls and steps without CUDA graphs"

RESULTS_PAGE = "docs/results.md"


@dataclass(frozen=True)
class Row:
    """Preference order for one device class, cache format group and density, with why (``reason``, one line)
    and where the measurements behind it stand (``RESULTS_PAGE#anchor``)."""

    device: str  # a selection.device_class() value
    formats: tuple[str, ...]
    sparse: bool
    order: tuple[str, ...]
    reason: str
    anchor: str
    max_batch: Optional[int] = None  # the row applies only to calls with a static batch size <= this
    max_heads: Optional[int] = None  # ... with a static head count <= this
    graph: Optional[str] = None  # ... only to calls in this kind of program (CAPTURED_STEP, ONE_CALL_GRAPH, UNCAPTURED)
    captured: Optional[bool] = None  # ... only to compiled calls whose graph is (True) / is not (False) captured

    def applies_to(self) -> str:
        """The calls the row is limited to, in words (docs/backends.md)."""
        limits = [f"static B ≤ {self.max_batch}" if self.max_batch is not None else "",
                  f"H ≤ {self.max_heads}" if self.max_heads is not None else "",
                  self.graph or "",
                  {None: "", True: "captured in CUDA graphs", False: "without CUDA graphs"}[self.captured]]
        return ", ".join(limit for limit in limits if limit) or "any"

    @property
    def link(self) -> str:
        """Where the measurements behind the row stand."""
        return f"{RESULTS_PAGE}#{self.anchor}"


BF16 = ("bf16", "fp16")
FP8 = ("fp8_e4m3",)
DS = ("fp8_ds_mla",)
FP32 = ("fp32",)

# The SM90 bf16/fp16 dense orders the rows below share.
SM90_TRITON_FIRST = ("triton", "flashmla", "flashinfer_fa3", "flashinfer_fa2", "reference")
SM90_FA3_FIRST = ("flashinfer_fa3", "flashmla", "triton", "flashinfer_fa2", "reference")
# The SM90 fp8_e4m3 dense order where our kernel (q in bf16) beats FlashMLA-fp8 (q in e4m3) for calls allowing both.
SM90_FP8_TRITON_FIRST = ("triton", "flashmla", "flashinfer_fa3", "reference")

# First matching row wins; each backend's supports() then filters (page size, heads, Q, ...), and the
# reference closes every row so a call always runs.
TABLE: tuple[Row, ...] = (
    Row("cpu", BF16 + FP8 + DS + FP32, False, ("reference",), "plain Inductor code from the reference", "cpu-path"),
    Row("cpu", BF16 + FP8 + DS + FP32, True, ("reference",), "plain Inductor code from the reference",
        "cpu-path-sparse"),
    Row("sm90", BF16, False, ("triton", "flashinfer_fa3", "flashmla", "flashinfer_fa2", "reference"),
        "one sequence in a captured step: our kernel has the shortest device time at any head count",
        "sm90-bf16-captured-one-sequence", max_batch=1, graph=CAPTURED_STEP),
    Row("sm90", BF16, False, SM90_TRITON_FIRST,
        "a few sequences of at most one head block in a captured step: our kernel ahead of FlashMLA",
        "sm90-bf16-captured-few-sequences", max_batch=8, max_heads=64, graph=CAPTURED_STEP),
    Row("sm90", BF16, False, SM90_TRITON_FIRST,
        "one sequence in a one-call graph: our two launches against FlashMLA's three and FA3's host plan",
        "sm90-bf16-one-call-one-sequence", max_batch=1, graph=ONE_CALL_GRAPH),
    Row("sm90", BF16, False, SM90_TRITON_FIRST,
        "a one-call graph without CUDA graphs: FlashMLA launches its schedule and combine from the host",
        "sm90-bf16-one-call-uncaptured", max_batch=32, graph=ONE_CALL_GRAPH, captured=False),
    Row("sm90", BF16, False, SM90_TRITON_FIRST,
        "a one-call graph with few heads: our kernel ahead of FlashMLA's schedule, kernel and combine",
        "sm90-bf16-one-call-few-heads", max_batch=32, max_heads=16, graph=ONE_CALL_GRAPH),
    Row("sm90", BF16, False, SM90_FA3_FIRST,
        "uncaptured calls are host-bound, and our call into FA3 has the least host work",
        "sm90-bf16-uncaptured", max_batch=16, graph=UNCAPTURED),
    Row("sm90", BF16, False, SM90_FA3_FIRST,
        "uncaptured calls with few heads stay host-bound to larger batches: FA3 first",
        "sm90-bf16-uncaptured-few-heads", max_batch=32, max_heads=16, graph=UNCAPTURED),
    Row("sm90", BF16, False, ("flashmla", "flashinfer_fa3", "triton", "flashinfer_fa2", "reference"),
        "FlashMLA schedules on the device and leads on varied lengths; FA3 takes other page sizes",
        "sm90-bf16-general"),
    Row("sm90", FP8, False, SM90_FP8_TRITON_FIRST,
        "one sequence allowing an e4m3 query: our kernel (q in bf16) ahead of FlashMLA-fp8 everywhere",
        "sm90-fp8-one-sequence", max_batch=1),
    Row("sm90", FP8, False, SM90_FP8_TRITON_FIRST,
        "uncaptured calls allowing an e4m3 query: FlashMLA-fp8's call is host-bound, ours is not",
        "sm90-fp8-uncaptured", max_batch=32, graph=UNCAPTURED),
    Row("sm90", FP8, False, SM90_FP8_TRITON_FIRST,
        "a one-call graph allowing an e4m3 query: our kernel ahead of FlashMLA-fp8's three launches",
        "sm90-fp8-one-call", max_batch=32, graph=ONE_CALL_GRAPH),
    Row("sm90", FP8, False, ("flashmla", "triton", "flashinfer_fa3", "reference"),
        "FlashMLA-fp8 is fastest but quantizes q (opted-in calls only); else our kernel, q in bf16",
        "sm90-fp8-general"),
    Row("sm90", DS, False, ("flashmla", "triton", "reference"),
        "FlashMLA's sparse kernel reads the fp8_ds_mla layout directly (H=64 or H=128 only)",
        "sm90-fp8-ds-mla-dense"),
    Row("sm90", BF16, True, ("flashinfer_fa3", "triton", "reference"),
        "FlashInfer FA3 with page size one, vLLM's SM90 sparse recipe", "sm90-bf16-sparse"),
    Row("sm90", DS, True, ("flashmla", "triton", "reference"),
        "FlashMLA's sparse decode reads the fp8_ds_mla layout, fewer bytes than bf16", "sm90-fp8-ds-mla-sparse"),
    Row("sm100", BF16 + FP8, False, ("flashinfer_trtllm", "flashinfer_fa2", "triton", "reference"),
        "trtllm-gen MLA, FlashInfer's and vLLM's default on SM100 (not measured here)", "sm100-dense"),
    Row("sm100", BF16 + FP8, True, ("flashinfer_trtllm", "triton", "reference"),
        "trtllm-gen sparse top-k, vLLM's SM100 sparse path (not measured here)", "sm100-sparse"),
    Row("sm100", DS, True, ("flashmla", "triton", "reference"), "FlashMLA's sparse decode supports SM100",
        "sm100-fp8-ds-mla-sparse"),
    Row("sm120", BF16, False, ("flashinfer_fa2", "triton", "reference"), "consumer Blackwell: FA2 for bf16",
        "sm120-bf16"),
    Row("sm120", FP8, False, ("triton", "flashinfer_xqa", "reference"),
        "consumer Blackwell: our kernel for fp8, XQA MLA (H=128, one query) behind it", "sm120-fp8"),
    Row("sm80", BF16, False, ("flashinfer_fa2", "triton", "reference"), "Ampere and Ada: FA2 is the CUDA MLA kernel",
        "sm80-bf16"),
)
