"""The CUDA cache writer (a Triton kernel) against the reference writer; CPU runs it in the interpreter."""

import pytest
import torch

pytest.importorskip("triton", reason="the Triton cache writer's tests need triton (torch's CUDA builds bring it; "
                                     "on CPU: pip install triton, whose interpreter runs them)")

from mla_inductor.cache import decode_tokens, encode_tokens  # noqa: E402
from mla_inductor.kernels.cache_append import triton_cache_append  # noqa: E402
from mla_inductor.reference import cache_append_reference  # noqa: E402
from mla_inductor.testing import relative_error  # noqa: E402
from triton_support import needs_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# On the GPU both writers round to nearest: same values. Triton's CPU interpreter truncates when it
# narrows floats, so there the bound is one step of the stored type (bf16: 2^-8, e4m3: 2^-3 relative).
BOUND = ({"fp32": 1e-6, "fp16": 1e-6, "bf16": 1e-6, "fp8_e4m3": 1e-6, "fp8_ds_mla": 1e-6} if DEV == "cuda" else
         {"fp32": 1e-6, "fp16": 1e-3, "bf16": 4e-3, "fp8_e4m3": 0.125, "fp8_ds_mla": 0.125})


# Marked gpu on a CUDA machine so `pytest -m gpu` runs it there; without CUDA it runs in the interpreter.
@needs_triton
@pytest.mark.parametrize("fmt", [pytest.param(f, marks=[pytest.mark.gpu] if DEV == "cuda" else [])
                                 for f in ["bf16", "fp16", "fp32", "fp8_e4m3", "fp8_ds_mla"]])
def test_kernel_writes_what_the_reference_writes(fmt):
    L, R = (512, 64) if fmt == "fp8_ds_mla" else (256, 32)
    g = torch.Generator().manual_seed(3)
    P, page, N = 5, 4, 7
    initial = torch.randn(P, page, L + R, generator=g)
    kv_scale = torch.tensor([0.02 if fmt == "fp8_e4m3" else 1.0])
    cache = encode_tokens(initial, fmt, kv_scale)
    kv_c, k_pe = torch.randn(N, L, generator=g) * 3, torch.randn(N, R, generator=g)
    kv_c[0, :5] = 1000.0  # saturates e4m3 per-tensor
    slots = torch.tensor([3, -1, 0, 19, 7, -1, 12], dtype=torch.int32)
    want = cache.clone()
    cache_append_reference(want, kv_c, k_pe, slots, kv_scale)
    got = cache.to(DEV)
    triton_cache_append(got, kv_c.to(DEV), k_pe.to(DEV), slots.to(DEV), kv_scale.to(DEV))
    got = got.cpu()
    untouched = torch.ones(P * page, dtype=torch.bool)
    untouched[slots[slots >= 0].long()] = False
    flat_got, flat_want = got.reshape(P * page, -1), want.reshape(P * page, -1)
    assert torch.equal(flat_got[untouched].view(torch.uint8), flat_want[untouched].view(torch.uint8))
    written = ~untouched
    err = relative_error(decode_tokens(flat_got[written], kv_scale), decode_tokens(flat_want[written], kv_scale))
    assert err < BOUND[fmt], f"{fmt}: kernel and reference wrote different values (rel err {err:.2e})"


@pytest.mark.parametrize("writer", ["reference", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_ds_mla"])
def test_a_non_finite_value_touches_only_itself_in_both_fp8_formats(fmt, writer):
    """±inf saturates at ±448 (times the scale), NaN stays NaN; the other values of its 128-value tile keep
    their scale and values (fp8_ds_mla's tile scale is the amax of the tile's finite values)."""
    L, R = (512, 64) if fmt == "fp8_ds_mla" else (256, 32)
    g = torch.Generator().manual_seed(5)
    kv_c, k_pe = torch.randn(2, L, generator=g), torch.randn(2, R, generator=g)
    kv_c[0, 3], kv_c[0, 130], kv_c[1, 7] = float("inf"), float("-inf"), float("nan")
    kv_scale = torch.tensor([0.01 if fmt == "fp8_e4m3" else 1.0])
    cache = encode_tokens(torch.zeros(2, 4, L + R), fmt, kv_scale)
    slots = torch.tensor([1, 6], dtype=torch.int32)
    if writer == "reference":
        cache_append_reference(cache, kv_c, k_pe, slots, kv_scale)
    else:
        cache = cache.to(DEV)
        triton_cache_append(cache, kv_c.to(DEV), k_pe.to(DEV), slots.to(DEV), kv_scale.to(DEV))
        cache = cache.cpu()
    rows = decode_tokens(cache.view(8, -1)[slots.long()], kv_scale)
    latent = rows[:, :L]
    tile_amax = kv_c[0, :128].abs().nan_to_num(posinf=0.0).amax()
    top = 448 * float(kv_scale) if fmt == "fp8_e4m3" else float(tile_amax)
    assert float(latent[0, 3]) == pytest.approx(top, rel=1e-6) and float(latent[0, 130]) < 0
    if writer == "reference" or DEV == "cuda":
        # (Triton's interpreter narrows a NaN to a finite e4m3 value; the GPU's conversion keeps it NaN.)
        assert bool(latent[1, 7].isnan()), "NaN stays NaN"
    assert int(latent.isnan().sum()) <= 1, "NaN touches only itself"
    finite = torch.isfinite(kv_c)
    err = relative_error(latent[finite], kv_c[finite])
    assert err < 0.08, f"{fmt}: the values beside the non-finite ones changed (rel err {err:.2e})"
