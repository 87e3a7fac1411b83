"""The op contract: opcheck on every op and variant, the hostile-input table, the lean import."""

import logging
import os
import subprocess
import sys

import pytest
import torch

import mla_inductor
from small_problems import small_inputs

VARIANTS = {
    "dense_bf16": dict(seq_lens=[5, 17], fmt="bf16"),
    "fp8": dict(seq_lens=[9, 3], fmt="fp8_e4m3"),
    "fp8_ds_mla": dict(seq_lens=[9, 3], fmt="fp8_ds_mla", kv_lora_rank=512, rope_dim=64),
    "sparse": dict(seq_lens=[12, 30], topk=6),
    "mtp_q2": dict(seq_lens=[6, 11], q_per_seq=2),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("op", [torch.ops.mla.paged_decode.default, torch.ops.mla.paged_decode_with_lse.default])
def test_opcheck_decode(op, variant):
    x = small_inputs(**VARIANTS[variant])
    torch.library.opcheck(op, x.args(), test_utils=_opcheck_utils(x.kv_cache))


def _opcheck_utils(kv_cache):
    # test_schema compares inputs before/after with arithmetic that CPU float8 lacks; the other utils
    # (fake tensor, AOT dispatch static and dynamic) run on every format.
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    return tuple(u for u in utils if u != "test_schema") if kv_cache.dtype == torch.float8_e4m3fn else utils


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "fp8_ds_mla"])
def test_opcheck_cache_append(fmt):
    L, R = (512, 64) if fmt == "fp8_ds_mla" else (32, 16)
    x = small_inputs(seq_lens=[8], fmt=fmt, kv_lora_rank=L, rope_dim=R)
    slots = torch.tensor([3, -1, 10], dtype=torch.int32)
    torch.library.opcheck(torch.ops.mla.cache_append.default,
                          (x.kv_cache, torch.randn(3, L), torch.randn(3, R), slots, x.kv_scale),
                          test_utils=_opcheck_utils(x.kv_cache))


def _set(name, value):
    def edit(a):
        a[name] = value(a) if callable(value) else value
    return edit


A = ["q_nope", "q_pe", "kv_cache", "block_table", "seq_lens", "softmax_scale", "kv_scale", "sparse_indices"]
# (case, edit of the argument dict, exception type, text the message must contain)
HOSTILE = [
    ("q_nope 2-D", _set("q_nope", lambda a: a["q_nope"][0]), ValueError, "q_nope must be a 3-D tensor [T, H, L]"),
    ("q_nope int", _set("q_nope", lambda a: a["q_nope"].int()), TypeError, "q_nope must have dtype float32"),
    # Arguments of the wrong Python type are refused by the dispatcher, which names the argument.
    ("q_nope not tensor", _set("q_nope", 1.0), RuntimeError, "Expected a value of type 'Tensor' for argument 'q_nope'"),
    ("q_pe dtype", _set("q_pe", lambda a: a["q_pe"].half()), TypeError, "q_pe must have q_nope's dtype"),
    ("q_pe heads", _set("q_pe", lambda a: a["q_pe"][:, :1]), ValueError, "q_pe must be [T=2, H=3, R]"),
    ("q_nope strided", _set("q_nope", lambda a: a["q_nope"].repeat(1, 1, 2)[..., ::2]), ValueError,
     "q_nope must be contiguous in its last dimension"),
    ("cache width", _set("kv_cache", lambda a: a["kv_cache"][..., :40]), ValueError,
     "bad query shape for kv_cache rows of L+R=40 values (latent | rope): q_nope [T, H, L] and q_pe [T, H, R] must "
     "have L + R = 40, got q_nope L=32, q_pe R=16 (L + R = 48)"),
    ("q_nope wrong L", _set("q_nope", lambda a: a["q_nope"][..., :24]), ValueError,
     "bad query shape for kv_cache rows of L+R=48 values (latent | rope): q_nope [T, H, L] and q_pe [T, H, R] must "
     "have L + R = 48, got q_nope L=24, q_pe R=16"),
    ("q_pe wrong R", _set("q_pe", lambda a: torch.cat([a["q_pe"], a["q_pe"]], -1)), ValueError,
     "bad query shape for kv_cache rows of L+R=48 values (latent | rope): q_nope [T, H, L] and q_pe [T, H, R] must "
     "have L + R = 48, got q_nope L=32, q_pe R=32"),
    ("cache dtype", _set("kv_cache", lambda a: a["kv_cache"].to(torch.float64)), TypeError, "kv_cache must have dtype"),
    ("cache uint8 wrong L", _set("kv_cache", lambda a: torch.zeros(4, 4, 656, dtype=torch.uint8)), ValueError,
     "bad query shape for a uint8 (fp8_ds_mla) kv_cache, whose rows hold L=512 latent and R=64 rope values: "
     "q_nope must be [T, H, 512] and q_pe [T, H, 64], got q_nope L=32, q_pe R=16"),
    ("block_table int64", _set("block_table", lambda a: a["block_table"].long()), TypeError, "block_table must have dtype int32"),
    ("block_table 1-D", _set("block_table", lambda a: a["block_table"][0]), ValueError, "block_table must be a 2-D tensor"),
    ("seq_lens int64", _set("seq_lens", lambda a: a["seq_lens"].long()), TypeError, "seq_lens must have dtype int32"),
    ("seq_lens batch", _set("seq_lens", lambda a: a["seq_lens"][:1]), ValueError, "seq_lens must be [B=2]"),
    ("T not multiple of B", _set("q_nope", lambda a: a["q_nope"][:1]), ValueError, "q_pe must be [T=1"),
    ("T % B", lambda a: a.update(q_nope=a["q_nope"].repeat(2, 1, 1)[:3], q_pe=a["q_pe"].repeat(2, 1, 1)[:3]),
     ValueError, "T=3 must be a positive multiple of the batch size B=2"),
    ("softmax_scale str", _set("softmax_scale", "0.1"), RuntimeError, "for argument 'softmax_scale'"),
    ("kv_scale float", _set("kv_scale", 1.0), TypeError, "kv_scale must be a float32 tensor with one element "
     "(1.0 unless the cache is fp8: torch.ones(1) on q_nope's device), got float 1.0"),
    ("kv_scale int", _set("kv_scale", 1), TypeError, "kv_scale must be a float32 tensor with one element"),
    ("kv_scale fp16", _set("kv_scale", torch.ones(1, dtype=torch.float16)), TypeError,
     "kv_scale must be a float32 tensor with one element"),
    ("kv_scale shape", _set("kv_scale", torch.ones(2)), TypeError, "kv_scale must be a float32 tensor with one element"),
    ("sparse int64", _set("sparse_indices", lambda a: torch.zeros(2, 4, dtype=torch.int64)), TypeError,
     "sparse_indices must have dtype int32"),
    ("sparse rows", _set("sparse_indices", lambda a: torch.zeros(3, 4, dtype=torch.int32)), ValueError,
     "sparse_indices must be [T=2, K]"),
]
# Checks that read values: eager only (CPU always, GPU under MLA_INDUCTOR_DEBUG=1).
HOSTILE_VALUES = [
    ("seq_len too long", _set("seq_lens", lambda a: a["seq_lens"] + 1000), "seq_lens must lie in [0, max_pages * page_size"),
    ("negative seq_len", _set("seq_lens", lambda a: a["seq_lens"] - 1000), "seq_lens must lie in"),
    ("page out of range", lambda a: a["block_table"].__setitem__((0, 0), 999), "block_table entries of used pages"),
    ("sparse slot out of range", _set("sparse_indices", lambda a: torch.full((2, 4), 10**6, dtype=torch.int32)),
     "sparse_indices must be -1 or a slot"),
    ("kv_scale nan", _set("kv_scale", torch.full((1,), float("nan"))), "kv_scale must be finite and positive"),
]


def _arg_dict():
    x = small_inputs(seq_lens=[5, 9], q_dtype=torch.float32)
    return dict(zip(A, x.args()))


@pytest.mark.parametrize("case,edit,exc,msg", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_input_eager(case, edit, exc, msg):
    a = _arg_dict()
    edit(a)
    prefix = "" if exc is RuntimeError else r"^mla\.paged_decode: .*"
    with pytest.raises(exc, match=prefix + _re(msg)):
        torch.ops.mla.paged_decode(*a.values())


@pytest.mark.parametrize("case,edit,exc,msg", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_input_at_compile_time(case, edit, exc, msg, error_logs):
    """The documented exception type is what the user catches from torch.compile, message intact, with
    no error log before it (Dynamo would otherwise wrap it in its TorchRuntimeError)."""
    a = _arg_dict()
    edit(a)
    tensors = {k: v for k, v in a.items() if isinstance(v, torch.Tensor)}
    consts = {k: v for k, v in a.items() if k not in tensors}

    def f(**t):
        return torch.ops.mla.paged_decode(**t, **consts)

    torch._dynamo.reset()
    prefix = "" if exc is RuntimeError else r"^mla\.paged_decode: .*"
    with pytest.raises(exc, match=prefix + _re(msg)):
        torch.compile(f, fullgraph=True, backend="aot_eager")(**tensors)
    assert not error_logs, [r.getMessage() for r in error_logs]


@pytest.fixture
def error_logs():
    """ERROR records of torch's loggers (which do not propagate to pytest's caplog)."""
    records = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    logger = logging.getLogger("torch")
    loggers = [logger] + [logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.startswith("torch.")]
    for lg in loggers:
        lg.addHandler(handler)
    yield records
    for lg in loggers:
        lg.removeHandler(handler)


@pytest.mark.parametrize("op", [torch.ops.mla.paged_decode, torch.ops.mla.paged_decode_with_lse])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_python_number_scales_get_the_contracts_type_error(op, compiled):
    """kv_scale=1.0 (the value the docs give it) and a float q_scale, positionally or by keyword: our TypeError
    naming the tensor expected, the same type eagerly and from torch.compile (not the dispatcher's RuntimeError)."""
    a = _arg_dict()
    tensors = {k: v for k, v in a.items() if isinstance(v, torch.Tensor)}
    name = op._qualified_op_name.split("::")[1]
    for scales, msg in (({"kv_scale": 1.0}, "kv_scale must be a float32 tensor with one element (1.0 unless the "
                         "cache is fp8: torch.ones(1) on q_nope's device), got float 1.0"),
                        ({"q_scale": 0.5}, "q_scale must be None or a float32 tensor with one element")):
        call = dict(tensors, softmax_scale=a["softmax_scale"], sparse_indices=None, **scales)
        if compiled:
            torch._dynamo.reset()
            const = {k: v for k, v in call.items() if not isinstance(v, torch.Tensor)}
            run = torch.compile(lambda **t: op(**t, **const), fullgraph=True, backend="aot_eager")
            call = {k: v for k, v in call.items() if k not in const}
        else:
            run = op
        with pytest.raises(TypeError, match=rf"^mla\.{name}: " + _re(msg)):
            run(**call)


@pytest.mark.parametrize("case,edit,msg", HOSTILE_VALUES, ids=[h[0] for h in HOSTILE_VALUES])
def test_hostile_values_eager(case, edit, msg):
    a = _arg_dict()
    a["sparse_indices"] = torch.zeros(2, 4, dtype=torch.int32) if "sparse" in case else None
    edit(a)
    with pytest.raises(ValueError, match=_re(msg)):
        torch.ops.mla.paged_decode(*a.values())


def _re(text):
    import re
    return re.escape(text)


def test_unused_block_table_entries_may_hold_garbage():
    a = _arg_dict()
    a["block_table"] = torch.cat([a["block_table"], torch.full((2, 5), -7, dtype=torch.int32)], dim=1)
    want = torch.ops.mla.paged_decode(*_arg_dict().values())
    assert torch.equal(torch.ops.mla.paged_decode(*a.values()), want)


def test_cache_append_hostile():
    kv = torch.zeros(2, 4, 48)
    with pytest.raises(ValueError, match="slot_mapping must be \\[N=3\\]"):
        torch.ops.mla.cache_append(kv, torch.randn(3, 32), torch.randn(3, 16), torch.zeros(2, dtype=torch.int32),
                                   torch.ones(1))
    with pytest.raises(ValueError, match="kv_cache must be \\[P, page_size, L\\+R=40\\]"):
        torch.ops.mla.cache_append(kv, torch.randn(3, 32), torch.randn(3, 8), torch.zeros(3, dtype=torch.int32),
                                   torch.ones(1))
    with pytest.raises(ValueError, match="slot_mapping must be -1 or a slot in \\[0, P \\* page_size = 8\\)"):
        torch.ops.mla.cache_append(kv, torch.randn(1, 32), torch.randn(1, 16), torch.tensor([8], dtype=torch.int32),
                                   torch.ones(1))
    with pytest.raises(ValueError, match="kv_cache must be contiguous"):
        torch.ops.mla.cache_append(kv.transpose(0, 1), torch.randn(1, 32), torch.randn(1, 16),
                                   torch.tensor([0], dtype=torch.int32), torch.ones(1))


def test_lean_import():
    """``import mla_inductor`` (and its lowering) registers the ops without CUDA or optional libraries."""
    code = (
        "import sys, torch\n"
        "import mla_inductor, mla_inductor.lowering\n"
        "assert hasattr(torch.ops.mla, 'paged_decode') and hasattr(torch.ops.mla, 'cache_append')\n"
        "assert not torch.cuda.is_initialized(), 'import initialised CUDA'\n"
        "bad = [m for m in ('flashinfer', 'flash_mla', 'vllm', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_public_names():
    for name in mla_inductor.__all__:
        assert hasattr(mla_inductor, name), name


def test_compile_errors_without_fullgraph_raise_the_eager_error_then_good_calls_compile():
    """Without fullgraph Dynamo breaks the graph at the refused call and runs it eagerly, which raises the
    plain documented error; the function still compiles for good arguments."""
    from torch._dynamo.testing import CompileCounter

    a = _arg_dict()
    bad = dict(a, q_pe=a["q_pe"][:, :1])
    counter = CompileCounter()
    step = torch.compile(lambda **k: torch.ops.mla.paged_decode(**k) * 2, backend=counter)
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=r"^mla\.paged_decode: q_pe must be \[T=2, H=3, R\]"):
        step(**bad)
    assert torch.equal(step(**a), torch.ops.mla.paged_decode(**a) * 2) and counter.frame_count == 1


# ----------------------------------------------------------------------------- inference only, autocast, misuse


def _decode_args(**kw):
    return small_inputs(seq_lens=[5, 9], q_dtype=torch.float32, **kw).args()[:7]


def _merge_args():
    g = torch.Generator().manual_seed(2)
    return torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, generator=g), torch.randn(2, 3, 8, generator=g), \
        torch.randn(2, 3, generator=g)


INFERENCE_ONLY = {
    "paged_decode": (lambda q, a: torch.ops.mla.paged_decode(q, *a[1:]), _decode_args, "q_nope"),
    "paged_decode_with_lse": (lambda q, a: torch.ops.mla.paged_decode_with_lse(q, *a[1:])[0], _decode_args, "q_nope"),
    "merge_attn_states": (lambda q, a: torch.ops.mla.merge_attn_states(q, *a[1:])[0], _merge_args, "out_a"),
    "merge_attn_states_n": (lambda q, a: torch.ops.mla.merge_attn_states_n(torch.stack([q, a[2]]),
                                                                           torch.stack([a[1], a[3]]))[0],
                            _merge_args, "outs"),
}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("op", sorted(INFERENCE_ONLY))
def test_backward_through_an_op_raises_inference_only(op, compiled):
    """Never a silent None gradient: the forward runs (and matches a call without grad), the backward raises
    naming the op and the argument asking for a gradient."""
    call, make, arg = INFERENCE_ONLY[op]
    args = make()
    fn = torch.compile(call, fullgraph=True) if compiled else call
    q = args[0].clone().requires_grad_()
    out = fn(q, args)
    with torch.no_grad():
        assert torch.allclose(out, call(args[0], args), rtol=1e-5, atol=1e-6)
    assert out.requires_grad
    with pytest.raises(RuntimeError, match=rf"^mla\.{op} \(the gradient of {arg}\): mla ops are inference-only"):
        out.sum().backward()
    assert q.grad is None


def test_calls_without_grad_are_unchanged_and_their_graphs_have_no_backward():
    from torch._inductor.utils import run_and_get_code

    args = _decode_args()
    want = torch.ops.mla.paged_decode(*args)
    q = args[0].clone().requires_grad_()
    with torch.no_grad():
        assert torch.equal(torch.ops.mla.paged_decode(q, *args[1:]), want)
    with torch.inference_mode():
        assert torch.equal(torch.ops.mla.paged_decode(q, *args[1:]), want)
    out = torch.ops.mla.paged_decode(*args)  # grad mode on, nothing requires grad
    assert torch.equal(out, want) and out.grad_fn is None
    torch._dynamo.reset()
    out, codes = run_and_get_code(torch.compile(lambda *a: torch.ops.mla.paged_decode(*a), fullgraph=True), *args)
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-6) and out.grad_fn is None
    assert not any("backward_refused" in code for code in codes)


@pytest.mark.parametrize("op", ["decode", "merge"])
def test_eager_cpu_calls_ignore_the_callers_autocast(op):
    """An fp32 call made inside ``torch.autocast`` computes in fp32, as the compiled call does."""
    if op == "decode":
        args = _decode_args()
        call = lambda: torch.ops.mla.paged_decode_with_lse(*args)  # noqa: E731
    else:
        args = _merge_args()
        call = lambda: torch.ops.mla.merge_attn_states(*args)  # noqa: E731
    want = call()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = call()
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_compiled_call_whose_output_is_unused_still_checks_its_values():
    """Eager raises for seq_len past the block table; so does the compiled function that drops the output."""
    args = list(_decode_args())
    args[4] = torch.tensor([5, 21], dtype=torch.int32)

    def step(*a):
        torch.ops.mla.paged_decode_with_lse(*a)
        return a[0] * 2

    message = r"^mla\.paged_decode_with_lse: seq_lens must lie in \[0, max_pages \* page_size = 12\]"
    with pytest.raises(ValueError, match=message):
        step(*args)
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=message):
        torch.compile(step, fullgraph=True)(*args)


def test_a_softmax_scale_that_varies_between_compiled_calls_raises_saying_keep_it_constant():
    """Dynamo compiles a float argument's value into the graph: a value that changes every call would recompile
    per call until Dynamo's recompile limit. A few values compile (models of one class with different scales
    share their forward's code); the next raises, and the values compiled before keep running."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from mla_inductor.ops import SCALES_PER_COMPILED_FUNCTION

    args = _decode_args()
    counter = CompileCounterWithBackend("inductor")
    step = torch.compile(lambda scale, *a: torch.ops.mla.paged_decode(*a[:5], scale, a[6]), backend=counter,
                         fullgraph=True)
    torch._dynamo.reset()
    scales = [0.25 * (i + 1) for i in range(SCALES_PER_COMPILED_FUNCTION)]
    first = step(scales[0], *args)
    for scale in scales[1:]:
        step(scale, *args)
    compiled = counter.frame_count
    with pytest.raises(ValueError, match=r"^mla\.paged_decode: softmax_scale changes between calls of one compiled "
                                         r"function \(compiled for 0\.25, 0\.5, 0\.75; now 2\.0\).*keep "
                                         r"softmax_scale constant"):
        step(2.0, *args)
    assert torch.equal(step(scales[0], *args), first) and counter.frame_count == compiled, "recompiled"
