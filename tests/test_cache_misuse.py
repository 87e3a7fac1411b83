"""The caches under misuse: nothing silent, nothing half done.

``PagedLatentCache``: a refused ``reserve`` changes nothing; bad counts, indices and sizes get errors naming
the argument. ``PagedMLACache`` with transformers: a step past ``max_seq_len`` is refused in eager, compiled and
CUDA-graph captured steps (never wrapped onto the last slot); ``use_cache=False`` and a stale cache handed to a
second ``generate()`` are refused, leaving the cache as it was. GPU tests run the failing step in a subprocess
(a device-side assert ends the CUDA context).
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import mla_inductor
from mla_inductor.cache import PagedLatentCache

HERE = Path(__file__).resolve().parent


def small_cache(**overrides):
    kw = dict(num_layers=1, batch_size=2, max_seq_len=8, kv_lora_rank=32, rope_dim=16, page_size=4)
    return PagedLatentCache.allocate(**{**kw, **overrides})


def state(cache: PagedLatentCache):
    """Everything a reserve may change, as plain values."""
    return (list(cache._host_lens), [list(p) for p in cache._host_pages], list(cache._free_pages),
            cache.seq_lens.tolist(), cache.block_table.tolist(), cache.host_seq_lens.tolist())


# ---------------------------------------------------------------------------------------------- PagedLatentCache


@pytest.mark.parametrize("num_tokens, error, text", [
    ([1, 9], ValueError, "sequence 1 would hold 12 tokens, more than max_seq_len allows"),
    (-1, ValueError, "num_tokens must be >= 0, got -1"),
    ([2, -3], ValueError, r"num_tokens\[1\] must be >= 0, got -3"),
    (1.5, TypeError, "num_tokens must be an int or one int per sequence, got float"),
    ([1, 2.0], TypeError, r"num_tokens\[1\] must be an int, got float 2.0"),
    (True, TypeError, "num_tokens must be an int, got bool"),
    ([1, 1, 1], ValueError, "num_tokens must be an int or have 2 entries"),
], ids=["past max_seq_len", "negative", "one negative", "float", "one float", "bool", "three counts for two"])
def test_a_refused_reserve_changes_nothing(num_tokens, error, text):
    """All or nothing: sequence 0 fits where sequence 1 does not, and the lengths, pages and table stay as
    they were; the next reserve continues from the old lengths."""
    cache = small_cache()
    cache.reserve([2, 3])
    before = state(cache)
    with pytest.raises(error, match=f"PagedLatentCache.reserve: {text}"):
        cache.reserve(num_tokens)
    assert state(cache) == before
    slots = cache.reserve([1, 1])
    assert cache.seq_lens.tolist() == [3, 4]
    assert slots.tolist() == [cache._host_pages[0][0] * 4 + 2, cache._host_pages[1][0] * 4 + 3]


def test_a_reserve_out_of_pages_changes_nothing_and_decode_sees_the_old_lengths():
    cache = small_cache(num_pages=3)
    g = torch.Generator().manual_seed(0)
    kv_c, k_pe = torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g)
    cache.append(0, kv_c[:6], k_pe[:6], cache.reserve([3, 3]))
    q_nope, q_pe = torch.randn(2, 3, 32, generator=g), torch.randn(2, 3, 16, generator=g)
    want = cache.decode(0, q_nope, q_pe, 0.1)
    before = state(cache)
    with pytest.raises(RuntimeError, match=r"out of pages: the reserve needs 2 more, 1 are free.*nothing was reserved"):
        cache.reserve([2, 2])  # each sequence needs a second page; one is free
    assert state(cache) == before
    torch.testing.assert_close(cache.decode(0, q_nope, q_pe, 0.1), want, rtol=0, atol=0)
    cache.reserve([1, 0])  # fits in the pages held and the one free
    assert cache.seq_lens.tolist() == [4, 3]


@pytest.mark.parametrize("index, error, text", [
    (-1, IndexError, r"batch_index must be None \(every sequence\) or in \[0, batch_size=2\), got -1"),
    (2, IndexError, r"batch_index must be None \(every sequence\) or in \[0, batch_size=2\), got 2"),
    (5, IndexError, r"batch_index must be None \(every sequence\) or in \[0, batch_size=2\), got 5"),
    (1.0, TypeError, "batch_index must be an int, got float 1.0"),
])
def test_reset_refuses_an_index_outside_the_batch(index, error, text):
    cache = small_cache()
    cache.reserve([2, 3])
    before = state(cache)
    with pytest.raises(error, match=f"PagedLatentCache.reset: {text}"):
        cache.reset(index)
    assert state(cache) == before
    cache.reset(1)
    assert cache.seq_lens.tolist() == [2, 0]


@pytest.mark.parametrize("argument, value, error, text", [
    ("max_seq_len", -5, ValueError, "max_seq_len must be >= 1, got -5"),
    ("max_seq_len", 0, ValueError, "max_seq_len must be >= 1, got 0"),
    ("max_seq_len", 8.0, TypeError, "max_seq_len must be an int, got float 8.0"),
    ("batch_size", 0, ValueError, "batch_size must be >= 1, got 0"),
    ("num_layers", -1, ValueError, "num_layers must be >= 0, got -1"),
    ("num_pages", -2, ValueError, "num_pages must be >= 0, got -2"),
    ("page_size", 0, ValueError, "page_size must be >= 1, got 0"),
    ("kv_lora_rank", -32, ValueError, "kv_lora_rank must be >= 1, got -32"),
])
def test_allocate_refuses_sizes_that_make_no_cache(argument, value, error, text):
    with pytest.raises(error, match=f"PagedLatentCache.allocate: {text}"):
        small_cache(**{argument: value})


# ---------------------------------------------------------------------------------------------- PagedMLACache

def hf_helpers():
    """test_hf's tiny models and helpers (transformers needed: skipped without it)."""
    pytest.importorskip("transformers")
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import test_hf

    return test_hf


def test_a_compiled_decode_step_past_max_seq_len_raises_and_writes_nothing():
    """generate()'s compiled decode step (forced on CPU, fullgraph, Inductor) on a cache one token short:
    the step past max_seq_len raises the eager step's ValueError, and nothing of it reaches the cache (no
    token written over the last slot, no length advanced)."""
    t = hf_helpers()
    torch._dynamo.reset()
    model = t.make_model("v3_yarn")
    ids, mask = t.left_padded_prompts(pad_lens=(0, 3, 7, 5), seed=21)
    cache = t.use_mla(model, batch=4, max_seq_len=t.PROMPT_LEN + 2)
    config = t.transformers.CompileConfig(fullgraph=True, mode="default")
    config._compile_all_devices = True  # generate compiles only on accelerators unless told
    with pytest.raises(ValueError, match=r"PagedMLACache: a sequence would hold 15 tokens, more than max_seq_len=14"):
        t.hf_generate(model, ids, mask, 8, past_key_values=cache, compile_config=config)
    # What the prompt and the two steps that fit wrote, and nothing else (an eager run of those steps).
    fits = t.use_mla(model, batch=4, max_seq_len=t.PROMPT_LEN + 2)
    t.hf_generate(model, ids, mask, 3, past_key_values=fits)
    for got, want in zip(cache.kv_caches, fits.kv_caches):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert cache.seq_lens.tolist() == fits.seq_lens.tolist()


def test_own_compiled_decode_loop_past_max_seq_len_raises():
    """hf.decode_one_token compiled whole (what hf.CapturedDecodeStep captures): the same refusal."""
    t = hf_helpers()
    torch._dynamo.reset()
    model = t.make_model("v3_yarn")
    ids, mask = t.left_padded_prompts(seed=22)
    cache = t.use_mla(model, batch=4, max_seq_len=t.PROMPT_LEN + 1)
    step = torch.compile(mla_inductor.hf.decode_one_token, fullgraph=True)
    with torch.no_grad():
        token = mla_inductor.hf.prefill(model, ids, mask, cache=cache).argmax(-1)
        token = step(model, token, cache).argmax(-1)  # row 0 (no padding) now holds max_seq_len tokens
        before = [kv.clone() for kv in cache.kv_caches]
        with pytest.raises(ValueError, match="more than max_seq_len=13"):
            step(model, token, cache)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.kv_caches))


def test_a_compiled_dsa_step_past_max_seq_len_raises():
    """DSA (DeepSeek-V3.2): the indexer keeps a key per column, padding included; a compiled step past
    max_seq_len columns is refused before it writes one (eager checks the columns in update())."""
    t = hf_helpers()
    torch._dynamo.reset()
    model = t.family_model("deepseek_v32", index_topk=6)
    ids, mask = t.left_padded_prompts(seed=28)
    cache = t.use_mla(model, batch=4, max_seq_len=t.PROMPT_LEN + 1)
    step = torch.compile(mla_inductor.hf.decode_one_token, fullgraph=True)
    with torch.no_grad():
        token = mla_inductor.hf.prefill(model, ids, mask, cache=cache).argmax(-1)
        token = step(model, token, cache).argmax(-1)  # every row now spans max_seq_len columns
        keys = [k.clone() for k in cache._indexer_keys.values()]
        with pytest.raises(ValueError, match="PagedMLACache: a sequence would hold 14 (columns|tokens).*more than "
                                             "max_seq_len=13"):
            step(model, token, cache)
    assert all(torch.equal(a, b) for a, b in zip(keys, cache._indexer_keys.values()))


def test_the_gpu_form_of_the_capacity_check_keeps_its_assert_and_message_when_compiled():
    """What compiled and captured steps run on GPUs (a device-side assert), run on CPU, where the assert
    raises at once: traced into a graph, it is kept and carries the message naming max_seq_len."""
    from mla_inductor.cache import assert_cache_positions

    def write_at(positions):
        return assert_cache_positions(positions, 8, "PagedMLACache", "tokens") * 2

    torch._dynamo.reset()
    compiled = torch.compile(write_at, fullgraph=True)
    assert compiled(torch.tensor([[3, 7]])).tolist() == [[6, 14]]
    for run in (write_at, compiled):
        with pytest.raises(RuntimeError, match="PagedMLACache: a sequence would hold more tokens than max_seq_len=8 "
                                               "allows"):
            run(torch.tensor([[5, 8]]))


def test_own_generate_refuses_up_front_what_the_cache_cannot_hold():
    t = hf_helpers()
    model = t.make_model("v3_yarn")
    ids, mask = t.left_padded_prompts(seed=23)  # row 0 holds all PROMPT_LEN tokens
    cache = t.use_mla(model, batch=4, max_seq_len=t.PROMPT_LEN + 2)
    with pytest.raises(ValueError, match=r"generate: the prompt \(12 tokens\) and max_new_tokens=4 need 15 tokens per "
                                         r"sequence, more than the cache's max_seq_len=14"):
        mla_inductor.hf.generate(model, ids, mask, max_new_tokens=4, cache=cache)
    assert mla_inductor.hf.generate(model, ids, mask, max_new_tokens=3, cache=cache).shape == (4, t.PROMPT_LEN + 3)


def test_generate_with_use_cache_false_is_refused_and_the_cache_left_as_the_prompt_left_it():
    """use_cache=False feeds the whole sequence at every step: the cache would store it again and again. The
    prompt's forward cannot be told from a cached generate's; the first step that feeds the prompt again is
    refused and leaves the cache holding the prompt alone."""
    t = hf_helpers()
    model = t.make_model("v3_yarn")
    ids, mask = t.left_padded_prompts(seed=24)
    want = t.hf_generate(model, ids, mask, 4)
    cache = t.use_mla(model, batch=4)
    with pytest.raises(ValueError, match="PagedMLACache: the forward runs with use_cache=False"):
        t.hf_generate(model, ids, mask, 4, past_key_values=cache, use_cache=False)
    assert cache.seq_lens.tolist() == mask.sum(-1).tolist()
    cache.reset()
    assert torch.equal(t.hf_generate(model, ids, mask, 4, past_key_values=cache), want)


def test_a_stale_cache_is_refused_and_a_continuation_accepted():
    """A used cache handed to generate() again: continuing its sequences (input_ids and mask spanning the
    cached tokens and new ones, transformers' own convention) is right; a new prompt without reset() is
    refused and leaves the cache as it was."""
    t = hf_helpers()
    model = t.make_model("v3_yarn")
    ids, mask = t.left_padded_prompts(seed=25)
    other, other_mask = t.left_padded_prompts(seed=26)
    cache = t.use_mla(model, batch=4)
    first = t.hf_generate(model, ids, mask, 4, past_key_values=cache)
    held, columns = cache.seq_lens.tolist(), int(cache.get_seq_length())
    for prompt, prompt_mask in ((other, other_mask), (first[:, :-1], torch.ones_like(first[:, :-1]))):
        with pytest.raises(ValueError, match=r"already holds sequences of .* call cache.reset\(\) before generating"):
            t.hf_generate(model, prompt, prompt_mask, 3, past_key_values=cache)
        assert cache.seq_lens.tolist() == held and int(cache.get_seq_length()) == columns
    # Continuing: the whole conversation so far plus a new turn, its mask spanning all of it.
    turn = torch.randint(1, t.VOCAB, (4, 3), generator=torch.Generator().manual_seed(27))
    conversation = torch.cat([first, turn], 1)
    conversation_mask = torch.cat([mask, torch.ones_like(first[:, mask.shape[1]:]), torch.ones_like(turn)], 1)
    want = t.hf_generate(model, conversation, conversation_mask, 3)
    assert torch.equal(t.hf_generate(model, conversation, conversation_mask, 3, past_key_values=cache), want)
    cache.reset()  # after reset() a new prompt is a prompt
    assert torch.equal(t.hf_generate(model, other, other_mask, 3, past_key_values=cache),
                       t.hf_generate(model, other, other_mask, 3))


# ---------------------------------------------------------------------------------------------- GPU

PAST_CAPACITY = """
import sys
sys.path.insert(0, {tests!r})
import torch
from test_hf import gpu_model, hf_generate, left_padded_prompts, use_mla, PROMPT_LEN
from mla_inductor import hf

model = gpu_model()
ids, mask = left_padded_prompts(device="cuda", seed=5)
cache = use_mla(model, batch=4, max_seq_len=PROMPT_LEN + 3, page_size=64, fmt={fmt!r})
if {how!r} == "generate":  # generate() compiles its decode step itself on GPU
    out = hf_generate(model, ids, mask, 3, past_key_values=cache)  # fits: prompt + 2 steps
    torch.cuda.synchronize()
    print("within max_seq_len ok", flush=True)
    cache.reset()
    out = hf_generate(model, ids, mask, 12, past_key_values=cache)
else:
    with torch.no_grad():
        token = hf.prefill(model, ids, mask, cache=cache).argmax(-1)
        if {how!r} == "captured_compiled_layers":
            hf.compile_layers(model, fullgraph=True)
        step = hf.CapturedDecodeStep(model, cache)
        for _ in range(3):  # warm-up, capture + replay, replay: row 0 holds PROMPT_LEN + 3 tokens
            token = step(token).argmax(-1)
        torch.cuda.synchronize()
        print("within max_seq_len ok", flush=True)
        for _ in range(3):
            token = step(token).argmax(-1)
torch.cuda.synchronize()
print("past max_seq_len returned", cache.seq_lens.tolist(), flush=True)
"""
PAST_CAPACITY_RUNS = [*((how, fmt) for how in ("generate", "captured_compiled_layers")
                        for fmt in ("bf16", "fp8_e4m3", "fp8_ds_mla")), ("captured_eager_layers", "bf16")]


@pytest.mark.gpu
@pytest.mark.parametrize("how, fmt", PAST_CAPACITY_RUNS)
def test_gpu_step_past_max_seq_len_stops_with_a_device_assert(how, fmt):
    """On GPU a compiled generate() step and a hf.CapturedDecodeStep replay past max_seq_len stop at the
    cache's own device-side assert: no wrap onto the last slot, no illegal memory access, no result. Compiled
    code asserts in an Inductor kernel, which prints the message; eager layers captured assert with torch's
    own kernel (its text may not reach stderr)."""
    script = textwrap.dedent(PAST_CAPACITY.format(tests=str(HERE), fmt=fmt, how=how))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
    assert "within max_seq_len ok" in result.stdout, result.stderr[-3000:]
    assert "past max_seq_len returned" not in result.stdout, result.stdout
    assert result.returncode != 0 and "device-side assert" in result.stderr, result.stderr[-3000:]
    assert "illegal memory access" not in result.stderr, result.stderr[-3000:]
    if how != "captured_eager_layers":
        assert "more tokens than max_seq_len=15 allows" in result.stderr, result.stderr[-3000:]
