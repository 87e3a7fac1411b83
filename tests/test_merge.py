"""mla.merge_attn_states(_n): against attention computed whole (float64), empty parts as vLLM treats them,
opcheck, bad input, the compiled CPU path, and the Triton kernel (GPU, or the interpreter on CPU)."""

import math
import re

import pytest
import torch

import mla_inductor  # noqa: F401  (registers torch.ops.mla.*)
from mla_inductor.merge import merge_reference
from mla_inductor.testing import relative_error
from triton_support import HAS_CUDA, TRITON_RUNS, needs_triton

BOUND = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def split_attention(T=3, H=4, L=40, S=23, parts=3, seed=0, dtype=torch.float32):
    """A small attention problem solved whole and in ``parts`` key ranges, all in float64.

    Row 0 sees no key at all (every part empty), row 1's keys all fall in part 0 (the others empty),
    the other rows see every key. Empty parts get garbage (NaN) outputs and lse -inf or NaN in turn.
    Returns (outs [N, T, H, L] in dtype, lses [N, T, H] fp32, want_out [T, H, L] f64, want_lse [T, H] f64).
    """
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, L, generator=g, dtype=torch.float64)
    k = torch.randn(S, L, generator=g, dtype=torch.float64)
    v = torch.randn(S, L, generator=g, dtype=torch.float64)
    logits = torch.einsum("thl,sl->ths", q, k) * L ** -0.5 * 4  # spread-out weights
    visible = torch.ones(T, S, dtype=torch.bool)
    visible[0] = False
    bounds = [round(i * S / parts) for i in range(parts + 1)]
    visible[1, bounds[1]:] = False

    def attend(mask):  # [T, S] -> out [T, H, L], lse [T, H] (-inf, out 0 where nothing is visible)
        x = logits.masked_fill(~mask[:, None, :], float("-inf"))
        lse = torch.logsumexp(x, dim=-1)
        p = torch.exp(x - lse[..., None]).nan_to_num(0.0)
        return torch.einsum("ths,sl->thl", p, v), lse

    want_out, want_lse = attend(visible)
    outs, lses = [], []
    empty_lses = [float("-inf"), float("nan")]
    for i in range(parts):
        mask = visible.clone()
        mask[:, :bounds[i]] = False
        mask[:, bounds[i + 1]:] = False
        out, lse = attend(mask)
        empty = ~mask.any(-1)
        out[empty] = float("nan")
        lse[empty] = empty_lses[i % 2]
        outs.append(out.to(dtype))
        lses.append(lse.float())
    return torch.stack(outs), torch.stack(lses), want_out, want_lse


def check_merged(out, lse, want_out, want_lse, dtype):
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    assert torch.equal(out[0], torch.zeros_like(out[0])), "a row whose parts are all empty must give out 0"
    assert torch.equal(lse[0], torch.full_like(lse[0], float("-inf"))), "... and lse -inf"
    assert relative_error(lse, want_lse.float()) < 1e-6
    err = relative_error(out.float(), want_out.float())
    assert err < BOUND[dtype], f"merged output off by {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_merge_n_equals_attention_over_all_keys(dtype, parts):
    outs, lses, want_out, want_lse = split_attention(parts=parts, dtype=dtype)
    out, lse = torch.ops.mla.merge_attn_states_n(outs, lses)
    check_merged(out, lse, want_out, want_lse, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_merge_two_equals_attention_over_all_keys(dtype):
    outs, lses, want_out, want_lse = split_attention(parts=2, dtype=dtype)
    out, lse = torch.ops.mla.merge_attn_states(outs[0], lses[0], outs[1], lses[1])
    check_merged(out, lse, want_out, want_lse, dtype)


def test_merge_is_order_free_and_two_way_agrees_with_n_way():
    outs, lses, _, _ = split_attention(parts=2, seed=1)
    a = torch.ops.mla.merge_attn_states(outs[0], lses[0], outs[1], lses[1])
    b = torch.ops.mla.merge_attn_states(outs[1], lses[1], outs[0], lses[0])
    c = torch.ops.mla.merge_attn_states_n(outs, lses)
    for x, y in ((a, b), (a, c)):
        torch.testing.assert_close(x[0], y[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(x[1], y[1], rtol=1e-6, atol=1e-6)


def test_merge_accepts_strided_parts():
    """Parts as views of a packed exchange buffer (out | lse bits per head), as the all-to-all delivers them."""
    outs, lses, want_out, want_lse = split_attention(parts=3, dtype=torch.float32, seed=2)
    packed = torch.cat([outs, lses[..., None]], dim=-1)  # [N, T, H, L + 1]
    out, lse = torch.ops.mla.merge_attn_states_n(packed[..., :-1], packed[..., -1])
    check_merged(out, lse, want_out, want_lse, torch.float32)


def _opcheck_inputs():
    outs, lses, _, _ = split_attention(parts=3, dtype=torch.bfloat16)
    return outs, lses


def test_opcheck_merge_ops():
    outs, lses = _opcheck_inputs()
    torch.library.opcheck(torch.ops.mla.merge_attn_states.default, (outs[0], lses[0], outs[2], lses[2]))
    torch.library.opcheck(torch.ops.mla.merge_attn_states_n.default, (outs, lses))


BAD_INPUTS = [
    ("out_b must match", ValueError, lambda o, l: (o[0], l[0], o[1, :, :2], l[1])),
    ("lse_a must have dtype float32", TypeError, lambda o, l: (o[0], l[0].double(), o[1], l[1])),
    ("lse_b must be [T, H]", ValueError, lambda o, l: (o[0], l[0], o[1], l[1, :2])),
    ("out_a must be a 3-D tensor", ValueError, lambda o, l: (o, l[0], o[1], l[1])),
    ("out_a must have dtype", TypeError, lambda o, l: (o[0].int(), l[0], o[1], l[1])),
]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("message, error, make", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_names_the_argument(message, error, make, compiled):
    """The documented type in both modes: compiled, the fake impl's error reaches the caller as it is."""
    outs, lses = _opcheck_inputs()
    fn = torch.ops.mla.merge_attn_states
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    with pytest.raises(error, match=re.escape("mla.merge_attn_states: " + message)):
        fn(*make(outs, lses))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_bad_stacked_input_raises_the_documented_type_in_both_modes(compiled):
    outs, lses = _opcheck_inputs()
    fn = torch.ops.mla.merge_attn_states_n
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match=r"^mla.merge_attn_states_n: lses must be \[N, T, H\]"):
        fn(outs, lses[:2])


def test_bad_stacked_input_names_the_argument():
    outs, lses = _opcheck_inputs()
    with pytest.raises(ValueError, match=r"mla.merge_attn_states_n: lses must be \[N, T, H\]"):
        torch.ops.mla.merge_attn_states_n(outs, lses[:2])
    with pytest.raises(ValueError, match="mla.merge_attn_states_n: outs must be a 4-D tensor"):
        torch.ops.mla.merge_attn_states_n(outs[0], lses)


def test_compiled_cpu_merge_is_generated_code():
    """With the pass installed, Inductor generates the merge itself: no call back into the op remains."""
    import mla_inductor.lowering  # noqa: F401
    from torch._inductor.utils import run_and_get_code

    outs, lses, want_out, want_lse = split_attention(parts=3, dtype=torch.bfloat16, seed=3)

    def step(outs, lses):
        out, lse = torch.ops.mla.merge_attn_states_n(outs, lses)
        # Merging with an empty part changes nothing.
        return torch.ops.mla.merge_attn_states(out, lse, outs[0], torch.full_like(lses[0], float("-inf")))

    torch._dynamo.reset()
    (out, lse), codes = run_and_get_code(torch.compile(step, fullgraph=True), outs, lses)
    check_merged(out, lse, want_out, want_lse, torch.bfloat16)
    assert not any("torch.ops.mla" in code for code in codes), "the merge stayed an opaque call"
    assert any("cpp_fused" in code and "merge_attn_states" in code for code in codes), "no generated merge kernel"


# --------------------------------------------------------------------------------------------------------
# One lse convention: the decode op's results, split then merged, equal the unsplit call's

def _halves(x, first):
    """The decode call ``x`` split into the keys at positions < ``first`` (a whole number of pages) and the rest:
    the argument tuples of the two calls (Q = 1: each row attends all its sequence's keys)."""
    q_nope, q_pe, kv_cache, block_table, seq_lens, scale, kv_scale, _ = x.args()
    page_size = kv_cache.shape[1]
    head = (q_nope, q_pe, kv_cache, block_table, seq_lens.clamp(max=first), scale, kv_scale)
    tail = (q_nope, q_pe, kv_cache, block_table[:, first // page_size:].contiguous(),
            (seq_lens - first).clamp(min=0), scale, kv_scale)
    return head, tail


def _merges():
    """Every way to merge two parts: (name, merge(out_a, lse_a, out_b, lse_b) -> (out, lse))."""
    merges = [("merge_attn_states", torch.ops.mla.merge_attn_states),
              ("merge_attn_states_n", lambda oa, la, ob, lb: torch.ops.mla.merge_attn_states_n(
                  torch.stack([oa, ob]), torch.stack([la, lb]))),
              ("compiled", torch.compile(lambda oa, la, ob, lb: torch.ops.mla.merge_attn_states(oa, la, ob, lb),
                                         fullgraph=True))]
    if TRITON_RUNS:
        from mla_inductor.kernels.merge_attn_states import triton_merge_stacked, triton_merge_two

        merges += [("triton two", lambda oa, la, ob, lb: triton_merge_two(oa, la, ob, lb)),
                   ("triton stacked", lambda oa, la, ob, lb: triton_merge_stacked(torch.stack([oa, ob]),
                                                                                torch.stack([la, lb])))]
    return merges


@pytest.mark.parametrize("scale", [0.2, 1e38, -1e38], ids=["0.2", "1e38", "-1e38"])
def test_split_then_merge_equals_the_unsplit_decode_call(scale):
    """For every lse the decode op returns: finite, -inf (a part that sees no key: sequence 0 is one page long),
    +inf (a huge softmax_scale overflows a part's sum; it outweighs the other, finite part). Rows where both
    parts overflow the same way lose their ratio to the overflow (documented) and are left out."""
    from mla_inductor.testing import make_decode_inputs

    x = make_decode_inputs([4, 11, 16], num_heads=4, kv_lora_rank=32, rope_dim=16, page_size=4, q_dtype=torch.float32,
                           fmt="fp32", seed=7)
    x.softmax_scale = scale
    head, tail = _halves(x, 4)
    out, lse = torch.ops.mla.paged_decode_with_lse(*x.args()[:7])
    out_a, lse_a = torch.ops.mla.paged_decode_with_lse(*head)
    out_b, lse_b = torch.ops.mla.paged_decode_with_lse(*tail)
    assert bool((lse_b[0] == float("-inf")).all()), "sequence 0's second part must be empty"
    keep = ~(torch.isinf(lse_a) & (lse_a == lse_b))
    if scale == 1e38:
        assert bool((torch.isposinf(lse_a) ^ torch.isposinf(lse_b)).any()), "the case needs a part of lse +inf"
    for name, merge in _merges():
        got_out, got_lse = merge(out_a.to(DEV), lse_a.to(DEV), out_b.to(DEV), lse_b.to(DEV))
        got_out, got_lse = got_out.cpu(), got_lse.cpu()
        assert torch.equal(got_lse[keep].isposinf(), lse[keep].isposinf()), name
        assert relative_error(got_lse[keep], lse[keep]) < 1e-5, name
        assert relative_error(got_out[keep], out[keep]) < 1e-5, (name, relative_error(got_out[keep], out[keep]))


def test_parts_with_lse_inf_outweigh_finite_parts_and_share_equally():
    out = torch.stack([torch.full((1, 2, 4), v) for v in (1.0, 2.0, 3.0)])
    lse = torch.tensor([[[float("inf"), 5.0]], [[3.0, float("inf")]], [[float("inf"), float("-inf")]]])
    for merged, merged_lse in (torch.ops.mla.merge_attn_states_n(out, lse), merge_reference(out.unbind(0),
                                                                                           lse.unbind(0))):
        assert torch.equal(merged[0, 0], torch.full((4,), 2.0)), "two +inf parts (1 and 3) share equally"
        assert torch.equal(merged[0, 1], torch.full((4,), 2.0)), "the +inf part outweighs the finite one"
        assert bool(merged_lse.isposinf().all())


# --------------------------------------------------------------------------------------------------------
# The Triton kernel: GPU, or the interpreter on CPU tensors (tiny sizes)

DEV = "cuda" if HAS_CUDA else "cpu"
# The interpreter truncates when it narrows fp32 to bf16: one bf16 step (2^-8) of relative error more.
KERNEL_BOUND = {torch.float32: 1e-5, torch.bfloat16: 1e-2 if HAS_CUDA else 1.6e-2}


def _poisoned(T, H, L, dtype):
    return (torch.full((T, H, L), float("nan"), dtype=dtype, device=DEV),
            torch.full((T, H), float("nan"), dtype=torch.float32, device=DEV))


@needs_triton
@pytest.mark.parametrize("dtype", [pytest.param(d, marks=[pytest.mark.gpu] if HAS_CUDA else [])
                                   for d in (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("L", [40, 1536])  # 1536: more than one BLOCK_L chunk
def test_kernel_matches_reference(dtype, L):
    from mla_inductor.kernels.merge_attn_states import triton_merge_stacked, triton_merge_two

    outs, lses, want_out, want_lse = split_attention(T=3, H=3, L=L, parts=3, dtype=dtype, seed=4)
    outs, lses = outs.to(DEV), lses.to(DEV)
    N, T, H, _ = outs.shape
    out, lse = _poisoned(T, H, L, dtype)
    triton_merge_stacked(outs, lses, out=out, lse=lse)
    check_kernel_result(out.cpu(), lse.cpu(), want_out, want_lse, dtype)
    out, lse = _poisoned(T, H, L, dtype)
    out_ab, lse_ab = merge_reference([outs[0], outs[1]], [lses[0], lses[1]])
    # Two-way on strided inputs: out_a a head-sliced view, lse_b transposed storage.
    wide = torch.full((T, H + 1, L), float("nan"), dtype=dtype, device=DEV)
    wide[:, 1:] = out_ab
    lse_b = lses[2].t().contiguous().t()
    triton_merge_two(wide[:, 1:], lse_ab, outs[2], lse_b, out=out, lse=lse)
    check_kernel_result(out.cpu(), lse.cpu(), want_out, want_lse, dtype, rounded_twice=True)


def check_kernel_result(out, lse, want_out, want_lse, dtype, rounded_twice=False):
    assert torch.equal(out[0], torch.zeros_like(out[0])) and bool((lse[0] == float("-inf")).all())
    assert relative_error(lse, want_lse.float()) < 1e-6
    bound = KERNEL_BOUND[dtype] * (2 if rounded_twice else 1)
    err = relative_error(out.float(), want_out.float())
    assert err < bound, f"kernel merge off by {err:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("parts", [2, 8])
def test_kernel_at_decode_sizes_on_gpu(parts):
    """DeepSeek-V3 sizes (H=128, L=512), bf16, eager op dispatch on CUDA, against the reference."""
    g = torch.Generator(device="cuda").manual_seed(5)
    T, H, L = 64, 128, 512
    outs = torch.randn(parts, T, H, L, generator=g, device="cuda").bfloat16()
    lses = torch.randn(parts, T, H, generator=g, device="cuda") * 5
    lses[0, :8] = float("-inf")
    outs[0, :8] = float("nan")
    lses[:, 8:10] = float("inf")
    out, lse = torch.ops.mla.merge_attn_states_n(outs, lses)
    want_out, want_lse = merge_reference(outs.unbind(0), lses.unbind(0))
    assert bool(torch.isfinite(out).all())
    assert relative_error(lse, want_lse) < 1e-6
    assert relative_error(out.float(), want_out.float()) < 1e-2
    a, b = torch.ops.mla.merge_attn_states(outs[0], lses[0], outs[1], lses[1])
    wa, wb = merge_reference([outs[0], outs[1]], [lses[0], lses[1]])
    assert relative_error(b, wb) < 1e-6 and relative_error(a.float(), wa.float()) < 1e-2
    assert math.isfinite(float(a.float().abs().sum()))
