"""The optional static ``q_scale`` and the e4m3 query (issue: FP8 queries made by the compiler).

``q_scale`` never changes a call's meaning: the reference computes with q as given, and a backend that
quantizes q (FlashMLA's dense FP8 kernel, opt-in) uses it as its per-tensor scale. Here, on CPU: the
argument checks (eager and at compile time), the quantize-dequantize definition of the e4m3 query
against the reference (static and measured scales, random and large-magnitude rope), one scale for
latent and rope, saturation (never inf/NaN) with an uncalibrated scale, the compiled CPU path with a
q_scale, and the Triton one-pass cast for a static scale (interpreter on CPU). The FlashMLA kernel on
such queries is checked on the GPU in test_backend_flashmla.py; the graph the pass writes, in
test_pass_cells.py.
"""

from __future__ import annotations


import pytest
import torch

import mla_inductor
import mla_inductor.contract
from benchmark_modules import BENCHMARKS as BENCH
from mla_inductor.backends._common import quantize_query_fp8, quantize_query_reference
from mla_inductor.reference import paged_decode_reference
from mla_inductor.testing import make_decode_inputs, relative_error
from small_problems import small_inputs
from triton_support import needs_triton

# Relative L2 error (out, lse) of the reference on an e4m3 query (one scale per tensor) against the
# reference on the bf16 query. e4m3 keeps 3 mantissa bits (<= 6.25% per element, unbiased): the logit
# error is a fraction of the logits' size, so it grows with them. Measured here on CPU (seeds 5 and 7):
# random q 4.6e-3 .. 4.8e-3 (lse 8e-4 .. 1.1e-3); rope part x30 (logits dominated by a large rope)
# 4.8e-2 .. 5.0e-2 (lse 8.8e-3 .. 9.5e-3). Bounds ~2.5x above.
FP8_QUERY_TOL = {1.0: (1.5e-2, 3e-3), 30.0: (1.2e-1, 2.5e-2)}


def _dequantized(q: torch.Tensor, q_scale=None) -> torch.Tensor:
    q8, descale = quantize_query_reference(q, q_scale)
    return (q8.float() * descale).to(q.dtype)


def _reference_on_e4m3_query(x, q_scale=None):
    L = x.q_nope.shape[-1]
    qd = _dequantized(torch.cat([x.q_nope, x.q_pe], -1), q_scale)
    return paged_decode_reference(qd[..., :L].contiguous(), qd[..., L:].contiguous(), *x.args()[2:])


# ----------------------------------------------------------------------------- argument checks

def _call_with(q_scale, op=torch.ops.mla.paged_decode):
    x = small_inputs(seq_lens=[5, 9], q_dtype=torch.float32)
    return op(*x.args(), q_scale=q_scale)


@pytest.mark.parametrize("q_scale,exc,msg", [
    (torch.ones(1, dtype=torch.float16), TypeError, "q_scale must be a float32 tensor with one element"),
    (torch.ones(2), TypeError, "q_scale must be a float32 tensor with one element"),
    (torch.full((1,), float("nan")), ValueError, "q_scale must be finite and positive"),
    (torch.zeros(1), ValueError, "q_scale must be finite and positive"),
    (-torch.ones(1), ValueError, "q_scale must be finite and positive"),
    (torch.full((1,), float("inf")), ValueError, "q_scale must be finite and positive"),
])
def test_bad_q_scale_is_refused_eagerly(q_scale, exc, msg):
    for op, name in ((torch.ops.mla.paged_decode, "paged_decode"),
                     (torch.ops.mla.paged_decode_with_lse, "paged_decode_with_lse")):
        with pytest.raises(exc, match=rf"^mla\.{name}: {msg}"):
            _call_with(q_scale, op)


def test_bad_q_scale_is_refused_at_compile_time():
    x = small_inputs(seq_lens=[5, 9], q_dtype=torch.float32)

    def f(q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale, q_scale):
        return torch.ops.mla.paged_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, x.softmax_scale, kv_scale,
                                          q_scale=q_scale)

    torch._dynamo.reset()
    args = (x.q_nope, x.q_pe, x.kv_cache, x.block_table, x.seq_lens, x.kv_scale, torch.ones(3))
    with pytest.raises(Exception) as info:
        torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    chain, e = [], info.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    assert any(isinstance(c, TypeError) and "q_scale must be a float32 tensor" in str(c) for c in chain), chain


@pytest.mark.parametrize("op", [torch.ops.mla.paged_decode.default, torch.ops.mla.paged_decode_with_lse.default])
def test_opcheck_with_q_scale(op):
    x = small_inputs(seq_lens=[5, 17])
    torch.library.opcheck(op, (*x.args(), torch.full((1,), 0.01)))


def test_q_scale_does_not_change_the_result_where_q_stays_bf16():
    """On CPU (the reference) and on any backend that keeps q as given, q_scale changes nothing."""
    x = small_inputs(seq_lens=[5, 9, 1], q_per_seq=2)
    plain = torch.ops.mla.paged_decode_with_lse(*x.args())
    scaled = torch.ops.mla.paged_decode_with_lse(*x.args(), q_scale=torch.full((1,), 0.003))
    assert torch.equal(plain[0], scaled[0]) and torch.equal(plain[1], scaled[1])


@pytest.mark.slow
def test_compiled_cpu_call_with_q_scale_matches_eager():
    import mla_inductor.lowering  # noqa: F401 - installs the pass
    from torch._inductor.utils import run_and_get_code

    x = small_inputs(seq_lens=[5, 9], q_per_seq=2)
    q_scale = torch.full((1,), 0.01)

    def step(q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale, q_scale):
        return torch.ops.mla.paged_decode_with_lse(q_nope, q_pe, kv_cache, block_table, seq_lens, x.softmax_scale,
                                                   kv_scale, None, q_scale)

    torch._dynamo.reset()
    args = (x.q_nope, x.q_pe, x.kv_cache, x.block_table, x.seq_lens, x.kv_scale, q_scale)
    (out, lse), (code, *_) = run_and_get_code(torch.compile(step, fullgraph=True), *args)
    ref_out, ref_lse = paged_decode_reference(*x.args())
    torch.testing.assert_close(out, ref_out, rtol=1.6e-2, atol=1e-3)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)
    assert "float8" not in code.lower() and "torch.ops.mla.paged_decode" not in code  # the reference keeps q as given


# ----------------------------------------------------------------------------- the e4m3 query's definition

@pytest.mark.parametrize("rope_magnitude", [1.0, 30.0], ids=["random", "large-rope"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
def test_static_q_scale_matches_the_reference_within_fp8_tolerance(rope_magnitude, fmt):
    """A calibrated static scale (measured on other activations of the same distribution, with headroom)
    and the per-call measured scale both stay within the e4m3 bound of the bf16-query reference."""
    x = make_decode_inputs([0, 1, 63, 64, 65, 200], num_heads=8, q_per_seq=2, fmt=fmt, seed=5)
    x.q_pe = (x.q_pe.float() * rope_magnitude).to(x.q_pe.dtype)
    calibration = make_decode_inputs([70], num_heads=8, q_per_seq=12, seed=6)  # other activations
    q_cal = torch.cat([calibration.q_nope.float(), calibration.q_pe.float() * rope_magnitude], -1)
    q_scale = (q_cal.abs().amax() * 1.25 / 448).reshape(1)  # 25% headroom over what calibration saw
    ref = paged_decode_reference(*x.args())
    errors = {}
    for name, scale in (("static", q_scale), ("measured", None)):
        out, lse = _reference_on_e4m3_query(x, scale)
        errors[name] = (relative_error(out, ref[0]), relative_error(lse, ref[1]))
    tol_out, tol_lse = FP8_QUERY_TOL[rope_magnitude]
    for name, (e_out, e_lse) in errors.items():
        assert e_out <= tol_out and e_lse <= tol_lse, (name, errors)
    assert errors["static"][0] > 0  # the query really was quantized
    assert errors["static"][0] <= 1.5 * errors["measured"][0]  # the headroom costs little precision


def test_static_scale_equal_to_the_measured_one_gives_the_same_query():
    q = (torch.randn(6, 4, 576) * 3).to(torch.bfloat16)
    q8, descale = quantize_query_reference(q)
    q8_static, static = quantize_query_reference(q, descale.clone())
    assert torch.equal(q8.view(torch.uint8), q8_static.view(torch.uint8)) and torch.equal(descale, static)


def test_one_scale_covers_latent_and_rope():
    """The kernels take one descale for the whole 576-wide query: the rope part is quantized with the
    latent's scale (and vice versa), never with one of its own."""
    q = torch.randn(4, 2, 576)
    q[..., 512:] *= 50  # the rope part sets the amax
    q8, descale = quantize_query_reference(q)
    assert descale.shape == (1,) and float(descale) == pytest.approx(float(q.abs().amax()) / 448)
    latent_alone, _ = quantize_query_reference(q[..., :512].contiguous(), descale)
    assert torch.equal(q8[..., :512].view(torch.uint8), latent_alone.view(torch.uint8))


def test_uncalibrated_static_scale_saturates_instead_of_overflowing():
    """A q_scale far too small maps q past ±448: values saturate (garbage, as the docs warn), never inf/NaN."""
    x = make_decode_inputs([40, 64], num_heads=4, seed=9)
    q8, descale = quantize_query_reference(torch.cat([x.q_nope, x.q_pe], -1), torch.full((1,), 1e-4))
    assert bool(torch.isfinite(q8.float()).all()) and float(q8.float().abs().max()) == 448.0
    out, lse = _reference_on_e4m3_query(x, torch.full((1,), 1e-4))
    assert bool(torch.isfinite(out).all())
    assert relative_error(out, paged_decode_reference(*x.args())[0]) > FP8_QUERY_TOL[30.0][0]


def test_device_quantization_follows_the_definition_on_cpu():
    q = torch.randn(3, 5, 576).to(torch.bfloat16)
    for q_scale in (None, torch.full((1,), 0.02)):
        got, got_descale = quantize_query_fp8(q, q_scale)
        want, want_descale = quantize_query_reference(q, q_scale)
        assert got.is_contiguous() and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(got_descale, want_descale)


DEV = "cuda" if torch.cuda.is_available() else "cpu"


@needs_triton
@pytest.mark.parametrize("shape", [(3, 2, 5, 576), (17, 1, 128, 576)], ids=["small", "large"])
def test_static_scale_cast_kernel_matches_the_definition(shape):
    """The one-pass Triton cast (CUDA; interpreter on CPU) against quantize_query_reference: bit-equal on
    the GPU (round-to-nearest both); under the interpreter, whose e4m3 conversion is cruder, the same
    saturation and an error bound like test_backend_flashmla's for the two-pass kernel."""
    from mla_inductor.kernels.fp8_query import quantize_with_descale_e4m3

    g = torch.Generator().manual_seed(3)
    q = (torch.randn(*shape, generator=g) * 3).to(torch.bfloat16)
    q_scale = torch.full((1,), 0.01)  # 3 * ~4.5 sigma / 0.01 saturates some values: the clamp is exercised
    q8, descale = quantize_with_descale_e4m3(q.to(DEV), q_scale.to(DEV))
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == q.shape and float(descale) == pytest.approx(0.01)
    want, _ = quantize_query_reference(q, q_scale)
    got = q8.cpu().float()
    assert float(got.abs().max()) == 448.0
    if DEV == "cuda":
        assert torch.equal(q8.cpu().view(torch.uint8), want.view(torch.uint8))
    else:
        target = (q.float() / 0.01).clamp(-448, 448)
        rel = ((got - target).norm() / target.norm()).item()
        torch_rel = ((want.float() - target).norm() / target.norm()).item()
        assert rel <= 3.0 * torch_rel and rel < 0.09, (rel, torch_rel)


# ----------------------------------------------------------------------------- the accuracy benchmark

def test_accuracy_benchmark_without_a_gpu_says_so_and_help_works():
    import subprocess
    import sys

    script = str(BENCH / "bench_accuracy.py")
    if not torch.cuda.is_available():
        result = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
        assert result.returncode != 0 and "needs a CUDA GPU" in result.stderr and "Traceback" not in result.stderr
    helped = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=300)
    assert helped.returncode == 0 and "--out" in helped.stdout, helped.stderr[-2000:]
    assert "os.environ" not in (BENCH / "bench_accuracy.py").read_text()


def test_accuracy_benchmark_rows_on_cpu(monkeypatch):
    """The benchmark's measurement on a tiny CPU case, the reference as the only backend: one row per
    backend and query mode, its own error at bf16 rounding, the fp8 cache's cost in the last column."""
    import importlib

    monkeypatch.syspath_prepend(str(BENCH))
    bench = importlib.import_module("bench_accuracy")
    monkeypatch.setattr(bench, "availability", lambda: {"reference": None})
    monkeypatch.setattr(bench, "RECORDS", [])
    for fmt in ("bf16", "fp8_e4m3"):
        x, bf16 = bench.case_inputs([3, 70], 2, 1, fmt, rope_scale=8.0, device="cpu")
        assert torch.equal(x.q_pe, bf16.q_pe) and x.kv_cache.dtype != torch.float32
        bench.measure("tiny", x, bf16, None, bench.calibrated_q_scale(2, 8.0, seed=1, device="cpu"))
    (bf16_row, fp8_row) = bench.RECORDS
    assert bf16_row["query"] == "bf16 q" and bf16_row["err"] < 5e-3 and bf16_row["err_vs_bf16_cache"] < 5e-3
    assert fp8_row["cache"] == "fp8_e4m3" and fp8_row["err"] < 5e-3 < fp8_row["err_vs_bf16_cache"] < 0.1
    from mla_inductor.backends import flashmla

    problem = mla_inductor.contract.check_decode_args(*x.args())
    modes = bench.query_modes(flashmla.BACKEND, problem, torch.ones(1))
    assert [m[0] for m in modes] == ["e4m3 q, measured scale", "e4m3 q, static scale",
                                     "e4m3 q, static scale 1/16 of calibrated"]
