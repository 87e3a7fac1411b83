"""mla.prefill_attention (the prompt's ordinary attention) and what an HF prefill costs on top of HF's sdpa.

The op against a float64 softmax attention written here (CPU: torch's sdpa; GPU: FlashInfer's prefill where
installed), opcheck, bad input in eager and compiled mode; the HF prefill forward's aten ops against HF's
own sdpa + DynamicCache forward, per layer and per forward, so that an extra copy, cast or index op fails.
"""

import re
import sys
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mla_inductor  # noqa: F401  (registers torch.ops.mla.*)
from mla_inductor import prefill
from mla_inductor.testing import TOLERANCE, relative_error

from benchmark_modules import load_benchmark
from transformers_support import transformers_or_skip

prompt_kernel_log = load_benchmark("report").prompt_kernel_log

# DeepSeek's head dims (qk = nope 128 + rope 64, vo 128) with fewer heads; and a GQA shape.
DEEPSEEK = dict(H=8, Hkv=8, Dqk=192, Dv=128)
GQA = dict(H=8, Hkv=2, Dqk=64, Dv=64)


def attention_reference(q, k, v, scale, causal):
    """softmax(q k^T * scale) v in float64, [B, Q, H, Dv] (heads of k/v shared by H / Hkv query heads)."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if causal:
        Q, S = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(Q, S, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def hf_like_inputs(B, Q, H, Hkv, Dqk, Dv, dtype=torch.float32, device="cpu", seed=0):
    """q [B, H, Q, Dqk] contiguous (HF's cat), k [B, Hkv, Q, Dqk] contiguous (HF's new_empty + copies), v a
    strided view [B, Hkv, Q, Dv] of a [B, Q, Hkv, nope + Dv] projection (HF's split of kv_b_proj's output)."""
    g = torch.Generator(device=device).manual_seed(seed)
    nope = Dqk - 64 if Dqk > 64 else Dqk // 2

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)

    q = randn(B, H, Q, Dqk)
    k = randn(B, Hkv, Q, Dqk)
    kv = randn(B, Q, Hkv, nope + Dv).transpose(1, 2)
    v = kv[..., nope:]
    return q, k, v


# ---------------------------------------------------------------------------------------------- the op (CPU)


class _FlashInferSM90Reader:
    """Stands in for FlashInfer's ``single_prefill_with_kv_cache`` as its SM90 (FA3) binding reads its arguments
    (0.6.18): kv_len = k.size(0) and num_kv_heads = k.size(1) whatever ``kv_layout`` says, q / k / v through
    their strides; then float64 attention. A call handing it HND-laid k/v computes with swapped sizes (on the
    GPU: garbage, or a division by zero on the host when S > H)."""

    def __init__(self):
        self.layouts = []

    def single_prefill_with_kv_cache(self, q, k, v, causal, kv_layout, sm_scale, backend):
        self.layouts.append(kv_layout)
        kv_len, num_kv_heads = k.size(0), k.size(1)
        assert num_kv_heads >= 1 and q.size(1) % num_kv_heads == 0, "zero group size: FA3 would divide by zero"
        assert v.size(0) == kv_len and q.size(0) == kv_len, "a causal prompt: as many keys as queries"
        out = attention_reference(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                  sm_scale, causal)
        return out[0].to(q.dtype)


@pytest.mark.parametrize("dims", [DEEPSEEK, GQA], ids=["deepseek", "gqa"])
def test_flashinfer_call_gives_token_major_kv_as_sm90_reads_it(monkeypatch, dims):
    """The FlashInfer call hands k / v as [S, Hkv, D] (NHD) views, the layout FlashInfer's SM90 kernel reads
    whatever its kv_layout argument says; the result equals the reference."""
    fake = _FlashInferSM90Reader()
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    q, k, v = hf_like_inputs(2, 33, **dims, seed=5)
    out = prefill.flashinfer_prefill(q, k, v, 0.3, True, "fa3")
    assert fake.layouts == ["NHD", "NHD"]
    assert relative_error(out, attention_reference(q, k, v, 0.3, True)) < 1e-6


@pytest.mark.parametrize("dims", [DEEPSEEK, GQA], ids=["deepseek", "gqa"])
@pytest.mark.parametrize("B, Q", [(1, 1), (1, 37), (3, 20)])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_reference_on_cpu(dims, B, Q, causal):
    q, k, v = hf_like_inputs(B, Q, **dims, seed=B * 100 + Q)
    scale = 0.37
    assert prefill.prefill_kernel(q, k, v, causal) == prefill.SDPA
    out = torch.ops.mla.prefill_attention(q, k, v, scale, causal)
    want = attention_reference(q, k, v, scale, causal)
    assert out.shape == want.shape and out.is_contiguous()
    assert relative_error(out, want) < TOLERANCE[torch.float32]


def test_sdpa_path_is_hf_sdpa_bit_for_bit():
    """On the fallback the op is exactly what HF's sdpa attention computes (so greedy tokens cannot move)."""
    from torch.nn.functional import scaled_dot_product_attention

    q, k, v = hf_like_inputs(2, 33, **DEEPSEEK)
    hf = scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, scale=0.2, is_causal=True)
    assert torch.equal(torch.ops.mla.prefill_attention(q, k, v, 0.2, True), hf.transpose(1, 2).contiguous())


def test_no_flashinfer_on_cpu_says_why():
    q, k, v = hf_like_inputs(1, 8, **DEEPSEEK, dtype=torch.bfloat16)
    assert "CUDA" in prefill.flashinfer_reason(q, k, v)


def test_empty_prompt():
    q, k, v = hf_like_inputs(2, 0, **DEEPSEEK)
    assert torch.ops.mla.prefill_attention(q, k, v, 0.1, True).shape == (2, 0, 8, 128)


@pytest.mark.parametrize("causal", [True, False])
def test_opcheck(causal):
    q, k, v = hf_like_inputs(2, 12, **DEEPSEEK)
    torch.library.opcheck(torch.ops.mla.prefill_attention.default, (q, k, v, 0.3, causal))
    q, k, v = hf_like_inputs(1, 9, **GQA)
    torch.library.opcheck(torch.ops.mla.prefill_attention.default, (q, k, v, 0.3, causal))


@pytest.mark.slow
def test_compiled_keeps_the_op_in_one_graph():
    q, k, v = hf_like_inputs(1, 16, **DEEPSEEK)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: torch.ops.mla.prefill_attention(q, k, v, 0.25, True) * 2, fullgraph=True)
    assert torch.equal(compiled(q, k, v), torch.ops.mla.prefill_attention(q, k, v, 0.25, True) * 2)


BAD_INPUTS = [
    ("q must be 4-D", lambda q, k, v: (q[0], k, v, 0.1, True)),
    ("q, k and v must share a dtype", lambda q, k, v: (q.double(), k, v, 0.1, True)),
    ("k's head_dim must be q's", lambda q, k, v: (q, k[..., :64], v, 0.1, True)),
    ("v must be [B, Hkv, S, Dv] with k's Hkv and S", lambda q, k, v: (q, k, v[:, :, :5], 0.1, True)),
    ("k and v must have q's batch", lambda q, k, v: (q, k[:1], v[:1], 0.1, True)),
    ("q's heads (8) must be a multiple of k's and v's (3)", lambda q, k, v: (q, k[:, :3], v[:, :3], 0.1, True)),
    ("causal=True needs as many queries as keys", lambda q, k, v: (q[:, :, :4], k, v, 0.1, True)),
    ("q must have a contiguous last dim", lambda q, k, v: (q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v,
                                                           0.1, True)),
    ("softmax_scale must be > 0", lambda q, k, v: (q, k, v, 0.0, True)),
]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("message, make", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_names_the_argument(message, make, compiled):
    q, k, v = hf_like_inputs(2, 10, **DEEPSEEK)
    fn = torch.ops.mla.prefill_attention
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    with pytest.raises((ValueError, TypeError), match=re.escape("mla.prefill_attention: " + message)):
        fn(*make(q, k, v))


def test_a_flashinfer_kernel_that_fails_its_first_call_is_left_for_sdpa(monkeypatch):
    """FlashInfer builds a kernel on first use; when that fails (no CUDA compiler, say) the call and every later
    one with that kernel run sdpa, with one warning naming the error."""
    builds = prefill.FlashInferBuilds()
    monkeypatch.setattr(prefill, "FLASHINFER_BUILDS", builds)
    monkeypatch.setattr(prefill, "flashinfer_reason", lambda q, k, v: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    calls = []

    def broken_build(*args):
        calls.append(args)
        build_step("ninja: build stopped: nvcc not found")

    monkeypatch.setattr(prefill, "flashinfer_prefill", broken_build)
    q, k, v = hf_like_inputs(1, 12, **DEEPSEEK)
    assert prefill.prefill_kernel(q, k, v) == prefill.FLASHINFER_FA3
    with pytest.warns(RuntimeWarning, match=r"mla.prefill_attention: FlashInfer's prefill kernel .*nvcc not found"):
        out = torch.ops.mla.prefill_attention(q, k, v, 0.3, True)
    assert torch.equal(out, prefill.sdpa_prefill(q, k, v, 0.3, True)) and len(calls) == 1
    assert prefill.prefill_kernel(q, k, v) == prefill.SDPA
    torch.ops.mla.prefill_attention(q, k, v, 0.3, True)
    assert len(calls) == 1  # not tried again


def test_a_flashinfer_kernel_that_ran_is_never_disabled():
    builds = prefill.FlashInferBuilds()
    assert builds.run("key", lambda: 1, lambda: 2) == 1

    def fails():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        builds.run("key", fails, lambda: 2)
    assert not builds.failed("key")


def build_step(message):
    """Raise ``RuntimeError(message)`` from code that lives where FlashInfer builds its modules (a file under
    ``flashinfer/jit/``), as its ninja build does."""
    code = compile("def build(message):\n    raise RuntimeError(message)\n",
                   "/site-packages/flashinfer/jit/cpp_ext.py", "exec")
    namespace = {}
    exec(code, namespace)
    namespace["build"](message)


@pytest.mark.parametrize("error", [
    torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("CUDA error: out of memory"),
    RuntimeError("Failed to allocate memory for the workspace buffer: out of memory"),
    RuntimeError("CUDA error: an illegal memory access was encountered"),
    RuntimeError("CUDA error: device-side assert triggered"),
    RuntimeError("CUDA error: unspecified launch failure"),
    RuntimeError("CUDA error: too many resources requested for launch"),
    ValueError("the library refuses this call's arguments"),
], ids=["torch-out-of-memory", "cuda-out-of-memory", "library-out-of-memory", "illegal-access", "device-assert",
        "launch-failure", "too-many-resources", "refused-arguments"])
def test_a_first_call_failing_for_this_call_only_propagates_and_keeps_the_kernel(error):
    """An error of a kernel's first call that is not a failed import, build or load (out of memory in any
    form, a CUDA error, the library refusing the call) is this call's failure, not the kernel's: it propagates
    (no silent sdpa) and the kernel stays on for later calls."""
    builds = prefill.FlashInferBuilds()

    def fails():
        raise error

    with pytest.raises(type(error), match=re.escape(str(error)[:20])):
        builds.run("key", fails, lambda: pytest.fail("fell back to sdpa"))
    assert not builds.failed("key")
    assert builds.run("key", lambda: 1, lambda: 2) == 1


def raising(error):
    def fails():
        raise error
    return fails


def _build_fails():
    build_step("Ninja build failed: nvcc fatal: Unsupported gpu architecture 'compute_90a'")


def _load_fails_after_a_failed_build():
    try:
        build_step("Ninja build failed")
    except RuntimeError as e:
        raise RuntimeError("loading the module failed") from e


@pytest.mark.parametrize("fails", [
    raising(RuntimeError("CUDA error: no kernel image is available for execution on the device")),
    raising(RuntimeError("CUDA error: invalid device function")),
    raising(ModuleNotFoundError("No module named 'flashinfer'")),
    _build_fails, _load_fails_after_a_failed_build,
], ids=["no-kernel-image", "invalid-device-function", "import", "build", "build-as-cause"])
def test_a_kernel_that_cannot_be_imported_built_or_loaded_falls_back_to_sdpa(fails):
    """FlashInfer not importing, its JIT build failing (raised from its ``jit`` package) or a module without a
    build for this GPU switch the kernel off for the process."""
    builds = prefill.FlashInferBuilds()

    with pytest.warns(RuntimeWarning, match="its calls run torch's sdpa instead"):
        assert builds.run("key", fails, lambda: 2) == 2
    assert builds.failed("key")


# ---------------------------------------------------------------------------------------------- the op (GPU)


def _flashinfer_or_skip(q, k, v):
    """Skips only where FlashInfer is not installed/usable; a call FlashInfer should take and refuses fails."""
    why = prefill.flashinfer_unavailable_reason()
    if why is not None:
        pytest.skip(f"FlashInfer is not usable here: {why}")
    assert prefill.flashinfer_reason(q, k, v) is None, prefill.flashinfer_reason(q, k, v)


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [DEEPSEEK, dict(DEEPSEEK, H=128, Hkv=128)], ids=["deepseek", "deepseek-h128"])
@pytest.mark.parametrize("B, Q", [(1, 1), (1, 200), (1, 1000), (3, 129)])
@pytest.mark.parametrize("causal", [True, False])
def test_flashinfer_matches_reference_on_gpu(dims, B, Q, causal):
    q, k, v = hf_like_inputs(B, Q, **dims, dtype=torch.bfloat16, device="cuda", seed=Q)
    _flashinfer_or_skip(q, k, v)
    kernel = prefill.prefill_kernel(q, k, v, causal)
    expected_kernel = prefill.FLASHINFER_FA3 if torch.cuda.get_device_capability() == (9, 0) else prefill.FLASHINFER_FA2
    assert kernel == expected_kernel
    scale = 1 / (dims["Dqk"] ** 0.5) * 1.3
    out = torch.ops.mla.prefill_attention(q, k, v, scale, causal)
    assert not prefill.FLASHINFER_BUILDS.errors, prefill.FLASHINFER_BUILDS.errors  # it ran, no sdpa fallback
    want = attention_reference(q, k, v, scale, causal)
    assert out.shape == want.shape and out.dtype == torch.bfloat16 and out.is_contiguous()
    err = relative_error(out, want)
    # torch's own sdpa in bf16 on the same inputs: FlashInfer must be as close to the float64 truth.
    sdpa_err = relative_error(prefill.sdpa_prefill(q, k, v, scale, causal), want)
    assert err < TOLERANCE[torch.bfloat16] and err < 2 * sdpa_err + 1e-3, (err, sdpa_err)


@pytest.mark.gpu
def test_flashinfer_output_does_not_depend_on_stale_memory():
    """Two runs with the allocator's free memory filled with NaN in between give the same bits."""
    q, k, v = hf_like_inputs(2, 300, **DEEPSEEK, dtype=torch.bfloat16, device="cuda", seed=5)
    _flashinfer_or_skip(q, k, v)
    first = torch.ops.mla.prefill_attention(q, k, v, 0.07, True)
    assert prefill.prefill_kernel(q, k, v) != prefill.SDPA and not prefill.FLASHINFER_BUILDS.errors  # FlashInfer ran
    poison = torch.full((64 << 20,), float("nan"), device="cuda")  # reuses freed blocks, if any
    del poison
    second = torch.ops.mla.prefill_attention(q, k, v, 0.07, True)
    assert torch.isfinite(first).all() and torch.equal(first, second)


@pytest.mark.gpu
def test_unaligned_strides_fall_back_to_sdpa():
    q, k, v = hf_like_inputs(1, 64, **DEEPSEEK, dtype=torch.bfloat16, device="cuda")
    # Rows of 136 bf16 (272 bytes, a multiple of 16): the view at the row's start is aligned, the one 4
    # elements in starts 8 bytes past a 16-byte boundary.
    base = torch.randn(1, 8, 64, 128 + 8, device="cuda", dtype=torch.bfloat16)
    _flashinfer_or_skip(q, k, base[..., :128])  # the aligned view of the same memory goes to FlashInfer
    v = base[..., 4:132]
    assert prefill.prefill_kernel(q, k, v, True) == prefill.SDPA
    out = torch.ops.mla.prefill_attention(q, k, v, 0.1, True)
    assert relative_error(out, attention_reference(q, k, v, 0.1, True)) < TOLERANCE[torch.bfloat16]


# ---------------------------------------------------------------------------------------------- HF prefill


def _seeded_v3_model(attn_implementation: str, **config):
    """A random-weight DeepSeek-V3 (transformers >= 5.23, else the test skips), seed 0, pad token 0."""
    transformers_or_skip("the HF prefill tests")
    from mla_inductor.testing import random_deepseek_model

    torch.manual_seed(0)
    return random_deepseek_model("v3", attn_implementation=attn_implementation, pad_token_id=0, **config)


class DataOps(TorchDispatchMode):
    """Counts the aten/mla ops that produce or write data (views and aliases are free). The prompt kernel
    ``mla.prefill_attention`` is counted by what its sdpa fallback runs (what HF's sdpa attention runs),
    and separately in ``prompt_kernels``."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()
        self.prompt_kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.mla.prefill_attention.default:
            self.prompt_kernels += 1
            q, k, v, scale, *rest = args
            with self:  # the dispatcher drops arguments equal to their defaults (causal=True)
                return prefill.sdpa_prefill(q, k, v, scale, rest[0] if rest else (kwargs or {}).get("causal", True))
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            # Reached only from inside the prompt kernel (run below autograd, where composite ops such as
            # sdpa are not yet decomposed): decompose it as HF's own sdpa call is, so both count the same ops.
            with self:
                return func.decompose(*args, **(kwargs or {}))
        if not func.is_view:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _prompt_ops(layers, ours, pad_lens):
    """The data ops of one prompt forward of a random dense DeepSeek-V3 (fp32, CPU)."""
    model = _seeded_v3_model(
        "sdpa", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=24, first_k_dense_replace=layers, max_position_embeddings=128)
    from transformers import DynamicCache

    from mla_inductor import hf
    ids = torch.randint(1, 256, (len(pad_lens), 24))
    mask = torch.ones_like(ids)
    for b, n in enumerate(pad_lens):
        mask[b, :n] = 0
    if ours:
        model.set_attn_implementation(hf.register())
        cache = hf.PagedMLACache(model, batch_size=len(pad_lens), max_seq_len=32, page_size=8)
    else:
        cache = DynamicCache(config=model.config)
    with torch.no_grad(), DataOps() as log:
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return log


def _minus(a: Counter, b: Counter) -> dict:
    return {op: a[op] - b[op] for op in set(a) | set(b) if a[op] != b[op]}


# What one prompt forward of ours issues beyond HF's sdpa + DynamicCache, once per forward, whatever the depth:
# the columns seen (get_seq_length) and the lengths (add_ x2), and the new tokens' cache slots: positions
# (arange; padded: cumsum - 1), clamped into the block table, page = position // page_size, the block table's
# entry (gather) * page_size + position % page_size (one cast to int32); padded: pads get slot -1 (where) and
# the lengths count real tokens only (sum).
SLOT_OPS = Counter({"aten.add_.Tensor": 2, "aten.clamp.default": 1, "aten.floor_divide.default": 1,
                    "aten.gather.default": 1, "aten.mul.Tensor": 1, "aten.remainder.Scalar": 1,
                    "aten._to_copy.default": 1, "aten.add.Tensor": 1})
FIXED_EXTRA = {
    "unpadded": SLOT_OPS + Counter({"aten.arange.default": 1}),
    "left-padded": SLOT_OPS + Counter({"aten.cumsum.default": 1, "aten.sub.Tensor": 1, "aten.where.self": 1,
                                       "aten.scalar_tensor.default": 1, "aten.sum.dim_IntList": 1}),
}


@pytest.mark.parametrize("case, pad_lens", [("unpadded", (0,)), ("left-padded", (0, 3, 5))])
def test_prefill_issues_no_op_beyond_hf_sdpa_but_the_cache_write(case, pad_lens):
    """Per layer our prompt forward issues exactly one op HF's sdpa forward does not (``mla.cache_append``,
    the latents into the paged cache; HF's DynamicCache instead concatenates them), and per forward only
    the slot and length ops listed above: an extra copy, ``.contiguous()``, cast or index op fails."""
    transformers_or_skip("the HF prefill tests")
    logs = {(layers, ours): _prompt_ops(layers, ours, pad_lens) for layers in (1, 3) for ours in (False, True)}
    ours_per_2_layers = _minus(logs[3, True].ops, logs[1, True].ops)
    hf_per_2_layers = _minus(logs[3, False].ops, logs[1, False].ops)
    per_layer = {op: n / 2 for op, n in _minus(Counter(ours_per_2_layers), Counter(hf_per_2_layers)).items()}
    ours_only = {op: n for op, n in per_layer.items() if n > 0}
    assert ours_only == {"mla.cache_append.default": 1}, per_layer
    # One forward's extra = the one-layer model's difference less one layer's.
    fixed = Counter(_minus(logs[1, True].ops, logs[1, False].ops))
    fixed.subtract({op: int(n) for op, n in per_layer.items()})
    fixed = +fixed  # HF-only ops (its cache's cats) dropped: they are HF's, not ours
    assert fixed == FIXED_EXTRA[case], _minus(fixed, FIXED_EXTRA[case])
    # Unpadded prompts go through the prompt kernel in every layer; a padded batch through HF's sdpa with its mask.
    assert logs[3, True].prompt_kernels == (3 if case == "unpadded" else 0)
    assert logs[3, False].prompt_kernels == 0


def test_unpadded_prompt_runs_the_prompt_kernel_and_generates_hf_eager_tokens():
    from mla_inductor import hf

    model = _seeded_v3_model(
        "eager", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=24, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, max_position_embeddings=128)
    model.generation_config.eos_token_id = None
    ids = torch.randint(1, 256, (2, 20), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    model.set_attn_implementation(hf.register())
    cache = hf.PagedMLACache(model, batch_size=2, max_seq_len=40, page_size=8)
    with prompt_kernel_log() as log:  # records; the op itself runs
        got = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                             past_key_values=cache)
    assert torch.equal(got, want)
    assert log.kernels == [prefill.SDPA] * 2  # the prompt, once per layer (CPU: sdpa); decode steps never
    assert cache.seq_lens.tolist() == [20 + 11] * 2


@pytest.mark.gpu
def test_hf_prefill_on_gpu_is_as_accurate_as_hf_sdpa():
    """bf16 DeepSeek-V3 (DeepSeek's head dims, 16 heads), 512-token prompt: our prefill's logits are as close to
    the fp32 model's (HF sdpa) as HF's own bf16 sdpa prefill is; the prompt kernel ran FlashInfer when it
    takes the call."""
    model = _seeded_v3_model(
        "sdpa", vocab_size=1024, hidden_size=512, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=256, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=2, max_position_embeddings=1024,
    ).to("cuda")
    from transformers import DynamicCache

    from mla_inductor import hf
    ids = torch.randint(1, 1024, (1, 512), device="cuda")

    def logits(cache):
        return model(ids, past_key_values=cache, use_cache=True).logits.float()

    with torch.no_grad():
        truth = logits(DynamicCache(config=model.config))
        model.to(torch.bfloat16)
        hf_bf16 = logits(DynamicCache(config=model.config))
        model.set_attn_implementation(hf.register())
        with prompt_kernel_log() as record:
            ours = logits(hf.PagedMLACache(model, batch_size=1, max_seq_len=600))
    assert len(record.kernels) == 2, record.kernels
    if prefill.flashinfer_unavailable_reason() is None:  # installed: every layer's prompt ran on it
        assert all(k.startswith("flashinfer") for k in record.kernels), (record.kernels, [
            prefill.flashinfer_reason(*a) for a in record.args])
    ours_err, hf_err = relative_error(ours, truth), relative_error(hf_bf16, truth)
    assert ours_err < 1.5 * hf_err + 1e-3, (ours_err, hf_err)
