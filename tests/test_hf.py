"""HF MLA models on the op through transformers' own interfaces.

``model.generate()`` with a ``PagedMLACache`` and the ``"mla_inductor"`` attention generates exactly the
tokens of HF's eager attention (CPU fp32, random weights, no hub): greedy, sampling, stop tokens,
streamers, left padding, chunked prefill, continuation, beam search; compiled or not. GPU tests check
bf16 and fp8 caches against HF's sdpa by logits error and top-1 agreement.
"""

import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from transformers_support import transformers_or_skip

transformers = transformers_or_skip("tests/test_hf.py")

import mla_inductor.lowering  # noqa: E402,F401  (the ops and the pass the compiled tests go through)
from mla_inductor import hf  # noqa: E402
from mla_inductor.testing import fill_paged_mla_cache, random_deepseek_model, random_mla_model  # noqa: E402
from source_imports import imported_modules  # noqa: E402
from benchmark_modules import BENCHMARKS, load_benchmark  # noqa: E402


VOCAB = 512
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
            qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
            max_position_embeddings=256, pad_token_id=0)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, beta_fast=32,
            beta_slow=1)
CONFIGS = {
    # DeepSeek-V3-like: q_lora, MoE after one dense layer, yarn with mscale_all_dim (scaling != 1/sqrt(d)).
    "v3_yarn": ("v3", dict(BASE, n_group=2, topk_group=1, rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=1.0))),
    # rope_interleave=False (rotate-half pairs), 128 heads, otherwise tiny.
    "v3_h128_plain": ("v3", dict(BASE, hidden_size=128, num_attention_heads=128, num_key_value_heads=128,
                                 qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, kv_lora_rank=16,
                                 n_group=2, topk_group=1, rope_interleave=False)),
    # DeepSeek-V2-Lite-like: no q_lora (q_proj), yarn whose attention factor scales cos/sin (mscale != mscale_all_dim).
    "v2_yarn_no_qlora": ("v2", dict(BASE, q_lora_rank=None, rope_parameters=dict(YARN, mscale=0.707,
                                                                                   mscale_all_dim=1.0))),
    "v2_plain": ("v2", dict(BASE)),
}
PAD_LENS = (0, 3, 7, 5)
PROMPT_LEN = 12


def make_model(name="v3_yarn", layers=2, attn="eager", **overrides):
    version, kw = CONFIGS[name]
    model = random_deepseek_model(version, attn_implementation=attn, **dict(kw, num_hidden_layers=layers, **overrides))
    model.generation_config.eos_token_id = None  # fixed-length generation unless a test sets a stop token
    return model


def left_padded_prompts(pad_lens=PAD_LENS, length=PROMPT_LEN, seed=0, device="cpu"):
    """[B, length] prompts, row b left-padded with pad_lens[b] zeros, and the 0/1 attention mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(pad_lens), length), generator=g)
    mask = torch.ones_like(ids)
    for b, n in enumerate(pad_lens):
        mask[b, :n] = 0
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


def hf_generate(model, ids, mask, n, **kwargs):
    kwargs.setdefault("do_sample", False)
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, pad_token_id=0, **kwargs)


def use_mla(model, batch, max_seq_len=PROMPT_LEN + 64, **kwargs):
    """Switch ``model`` to the mla_inductor attention and give it a paged cache."""
    model.set_attn_implementation(hf.register())
    return hf.PagedMLACache(model, batch_size=batch, max_seq_len=max_seq_len, page_size=kwargs.pop("page_size", 8),
                            **kwargs)


class CountMLAOps(TorchDispatchMode):
    """Counts the mla.* ops that run (eager)."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()
        self.sparse_calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "mla":
            self.counts[func.__name__.split(".")[0]] += 1
            self.sparse_calls += func.__name__.startswith("paged_decode") and len(args) > 7 and args[7] is not None
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------------------------- generate()


@pytest.mark.slow
@pytest.mark.parametrize("layers", [2, 4])
def test_generate_greedy_identical_to_hf_eager_v3(layers):
    """The acceptance case: random DeepSeek-V3, left-padded batch of 4, 64 new tokens, fp32 on CPU."""
    model = make_model("v3_yarn", layers=layers)
    ids, mask = left_padded_prompts()
    want = hf_generate(model, ids, mask, 64)
    cache = use_mla(model, batch=4)
    with CountMLAOps() as ops:
        got = hf_generate(model, ids, mask, 64, past_key_values=cache)
    assert torch.equal(got, want), f"ours\n{got[:, PROMPT_LEN:]}\nHF eager\n{want[:, PROMPT_LEN:]}"
    # The prompt ran sdpa (no paged_decode); each of the 63 later forwards ran the op in every layer.
    assert ops.counts == {"paged_decode": 63 * layers, "cache_append": 64 * layers}, ops.counts
    # Pads are never stored: each sequence holds its real prompt tokens and the 63 it fed back.
    assert cache.seq_lens.tolist() == (mask.sum(-1) + 63).tolist()
    assert int(cache.get_seq_length()) == PROMPT_LEN + 63


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_generate_greedy_identical_to_hf_eager(name):
    model = make_model(name)
    ids, mask = left_padded_prompts(seed=1)
    want = hf_generate(model, ids, mask, 16)
    got = hf_generate(model, ids, mask, 16, past_key_values=use_mla(model, batch=4))
    assert torch.equal(got, want), f"{name}: ours\n{got[:, PROMPT_LEN:]}\nHF eager\n{want[:, PROMPT_LEN:]}"


def test_sampling_with_a_seed_matches_hf_eager():
    model = make_model("v3_yarn")
    ids, mask = left_padded_prompts(seed=2)
    sampling = dict(do_sample=True, temperature=0.7, top_k=40, top_p=0.95)
    torch.manual_seed(1234)
    want = hf_generate(model, ids, mask, 24, **sampling)
    cache = use_mla(model, batch=4)
    torch.manual_seed(1234)
    got = hf_generate(model, ids, mask, 24, past_key_values=cache, **sampling)
    assert torch.equal(got, want)
    cache.reset()
    assert not torch.equal(got, hf_generate(model, ids, mask, 24, past_key_values=cache))  # greedy differs


class CollectingStreamer(transformers.generation.BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.clone())

    def end(self):
        self.ended = True


def test_stop_tokens_and_streamer():
    model = make_model("v3_yarn")
    ids, mask = left_padded_prompts(seed=3)
    free = hf_generate(model, ids, mask, 16)[:, PROMPT_LEN:]
    model.generation_config.eos_token_id = int(free[0, 4])  # row 0 stops after 5 tokens, the others later or never
    want = hf_generate(model, ids, mask, 16)
    streamer = CollectingStreamer()
    got = hf_generate(model, ids, mask, 16, past_key_values=use_mla(model, batch=4), streamer=streamer)
    assert torch.equal(got, want)
    assert (got[0, PROMPT_LEN + 5:] == 0).all() and got.shape[1] <= PROMPT_LEN + 16
    # The streamer saw the prompt, then every new token of every row as it was made.
    assert streamer.ended and torch.equal(streamer.chunks[0], ids)
    assert torch.equal(torch.stack(streamer.chunks[1:], 1), got[:, PROMPT_LEN:])


def test_transformers_deferred_stop_check_rolls_our_cache_back(monkeypatch):
    """transformers' DeferredStopCheck (it reads the stop flag one step late so the host never waits for the
    device; transformers 5.23 turns it on for mps only) runs one forward too many once every row has stopped and
    undoes it with ``cache.crop(-1)``: forced on here (as bench_generate's deferred row does), generate() on our
    cache stops early with HF eager's tokens, stop tokens included, and the cache holds exactly the tokens fed."""
    from transformers.generation import utils as generation_utils

    if not hasattr(generation_utils, "DeferredStopCheck"):
        pytest.skip(f"transformers {transformers.__version__} has no DeferredStopCheck")
    model = make_model("v3_yarn")
    ids, mask = left_padded_prompts(seed=3)
    free = hf_generate(model, ids, mask, 16)[:, PROMPT_LEN:]
    # A stop token for every row (row b's token at step 2 + b), so generation ends before its 16 tokens.
    model.generation_config.eos_token_id = [int(free[b, 2 + b]) for b in range(free.shape[0])]
    want = hf_generate(model, ids, mask, 16)
    assert want.shape[1] < PROMPT_LEN + 16, "every row should stop early"

    class HostEvent:  # CPU work is done when queued: the CUDA event's record / synchronize have nothing to wait for
        def __init__(self, device=None, blocking=False):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass

    monkeypatch.setattr(torch, "Event", HostEvent)
    cache = use_mla(model, batch=4)
    crops = []
    crop = cache.crop
    monkeypatch.setattr(cache, "crop", lambda n: (crops.append(n), crop(n))[1])
    with load_benchmark("bench_generate").deferred_stop_check():
        got = hf_generate(model, ids, mask, 16, past_key_values=cache)
    assert crops and crops[-1] == -1, f"transformers did not roll back the one-step-late forward: crop calls {crops}"
    assert torch.equal(got, want), f"ours\n{got[:, PROMPT_LEN:]}\nHF eager\n{want[:, PROMPT_LEN:]}"
    # Every row holds its real prompt tokens and every token fed back (the one-step-late forward undone).
    assert cache.seq_lens.tolist() == (mask.sum(-1) + got.shape[1] - PROMPT_LEN - 1).tolist()


def test_chunked_prefill_and_continuation_attend_to_the_cache():
    """HF's chunked prefill: the first chunk runs sdpa on the empty cache, every later chunk (pads included
    for the long-padded rows) runs mla.paged_decode with Q = chunk on top of what is cached. A second
    generate() continues the returned sequences plus new user tokens on the same cache."""
    model = make_model("v3_yarn")
    ids, mask = left_padded_prompts(seed=4)
    extra = torch.randint(1, VOCAB, (4, 5), generator=torch.Generator().manual_seed(5))

    def two_turns(**kwargs):
        first = hf_generate(model, ids, mask, 8, **kwargs)
        turn = torch.cat([first, extra], 1)
        turn_mask = torch.cat([mask, torch.ones_like(turn[:, PROMPT_LEN:])], 1)
        kwargs.pop("prefill_chunk_size", None)
        return first, hf_generate(model, turn, turn_mask, 8, **kwargs)

    want = two_turns(past_key_values=transformers.DynamicCache(config=model.config))
    cache = use_mla(model, batch=4)
    with CountMLAOps() as ops:
        got = two_turns(past_key_values=cache, prefill_chunk_size=5)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    layers = model.config.num_hidden_layers
    # Chunks 2 and 3 of the prompt, 7 decode steps, the 6-token continuation chunk, 7 more steps.
    assert ops.counts["paged_decode"] == (2 + 7 + 1 + 7) * layers, ops.counts


def test_beam_search_matches_hf_eager():
    model = make_model("v3_yarn")
    ids, mask = left_padded_prompts(seed=6)
    beams = dict(num_beams=3, num_return_sequences=2)
    want = hf_generate(model, ids, mask, 8, **beams)
    got = hf_generate(model, ids, mask, 8, past_key_values=use_mla(model, batch=4 * 3), **beams)
    assert torch.equal(got, want)


def test_prompt_lookup_decoding_crops_the_cache():
    """Assisted generation (prompt lookup): candidates are checked in one forward of several tokens, the
    rejected ones are cropped off the cache (HF's crop(-n))."""
    model = make_model("v3_yarn")
    ids, _ = left_padded_prompts(pad_lens=(0,), seed=2)
    ids = torch.cat([ids, ids], 1)  # a repeated prompt gives the lookup candidates
    mask = torch.ones_like(ids)
    want = hf_generate(model, ids, mask, 16)
    cache = use_mla(model, batch=1)
    crops = []
    crop = cache.crop
    cache.crop = lambda n: (crops.append(n), crop(n))[1]
    got = hf_generate(model, ids, mask, 16, past_key_values=cache, prompt_lookup_num_tokens=3)
    assert torch.equal(got, want)
    assert any(n < 0 for n in crops[1:]), crops  # some candidates were rejected after the first step


def test_without_a_paged_cache_the_attention_is_hf_sdpa():
    """With the mla_inductor attention but HF's DynamicCache (or none), the function falls back to sdpa."""
    model = make_model("v2_plain")
    ids, mask = left_padded_prompts(seed=7)
    want = hf_generate(model, ids, mask, 8)
    model.set_attn_implementation(hf.register())
    with CountMLAOps() as ops:
        got = hf_generate(model, ids, mask, 8)
    assert torch.equal(got, want) and not ops.counts


def test_no_forward_is_replaced_and_no_hook_added():
    model = make_model("v3_yarn")
    forwards = {name: type(m).forward for name, m in model.named_modules()}
    hooks = {name: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for name, m in model.named_modules()}
    ids, mask = left_padded_prompts()
    hf_generate(model, ids, mask, 4, past_key_values=use_mla(model, batch=4))
    for name, m in model.named_modules():
        assert "forward" not in vars(m), f"{name}: an instance forward was installed"
        assert type(m).forward is forwards[name], f"{name}: the class forward was replaced"
        assert (dict(m._forward_hooks), dict(m._forward_pre_hooks)) == hooks[name], f"{name}: a hook was added"


# ---------------------------------------------------------------------------------------------- host work per step

HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


def count_host_reads_by_our_hf_code(monkeypatch) -> Counter:
    """Counts, by line, the tensor -> host reads (each a device sync on GPU) whose innermost mla_inductor frame
    is in the HF integration (mla_inductor/_hf*.py); the op's own CPU value checks are not counted."""
    reads = Counter()
    package = Path(hf.__file__).parent

    def counting(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None and Path(frame.f_code.co_filename).parent != package:
                frame = frame.f_back
            if frame is not None and Path(frame.f_code.co_filename).name.startswith("_hf"):
                reads[f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {name}"] += 1
            return original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)

    for name in HOST_READS:
        counting(name)
    return reads


def test_decode_steps_read_nothing_from_the_device_and_build_no_mask(monkeypatch):
    """Per decode step of generate(), our cache, mask function and attention read no tensor on the host and
    build no mask (sdpa_mask): 4 and 12 new tokens cost the same reads and mask builds (the prompt's)."""
    from mla_inductor import _hf

    model = make_model("v3_yarn")
    ids, mask = left_padded_prompts(seed=10)
    want = hf_generate(model, ids, mask, 12)
    cache = use_mla(model, batch=4)
    built = []
    monkeypatch.setattr(_hf, "sdpa_mask", lambda **kw: built.append(kw["q_length"]) or transformers.masking_utils.sdpa_mask(**kw))
    reads = count_host_reads_by_our_hf_code(monkeypatch)

    def run(n):
        cache.reset()
        reads.clear(), built.clear()
        out = hf_generate(model, ids, mask, n, past_key_values=cache)
        return out, dict(reads), list(built)

    _, reads_4, built_4 = run(4)
    got, reads_12, built_12 = run(12)
    assert torch.equal(got, want)
    assert reads_12 == reads_4, f"host reads that grow with the steps: {reads_12} vs {reads_4}"
    assert built_12 == built_4 == [PROMPT_LEN], (built_4, built_12)


def test_own_decode_loop_reads_nothing_from_the_device(monkeypatch):
    """decode_one_token (eager): no host read in our code at all, and no mask (the forward has none)."""
    model = make_model("v3_yarn")
    ids, mask = left_padded_prompts(seed=11)
    cache = use_mla(model, batch=4)
    with torch.no_grad():
        token = hf.prefill(model, ids, mask, cache=cache).argmax(-1)
        reads = count_host_reads_by_our_hf_code(monkeypatch)
        for _ in range(3):
            token = hf.decode_one_token(model, token, cache).argmax(-1)
    assert not reads, dict(reads)


def decode_steps_counting_marks(monkeypatch, device, compiled_steps=0):
    """Two uncompiled decode steps, then ``compiled_steps`` of decode_one_token compiled whole (fullgraph), with
    Inductor loaded (as by torch.compile(layer, mode="reduce-overhead") before its first call); returns how many
    CUDA-graph step marks were made."""
    import torch._inductor  # noqa: F401

    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    model = make_model("v3_yarn").to(device)
    ids, mask = left_padded_prompts(seed=15, device=device)
    cache = use_mla(model, batch=4)
    with torch.no_grad():
        token = hf.prefill(model, ids, mask, cache=cache).argmax(-1)
        for _ in range(2):
            token = hf.decode_one_token(model, token, cache).argmax(-1)
        if compiled_steps:
            torch._dynamo.reset()
            step = torch.compile(hf.decode_one_token, fullgraph=True, backend="eager")
            for _ in range(compiled_steps):
                token = step(model, token, cache).argmax(-1)
    return len(marks)


def test_decode_one_token_marks_no_cuda_graph_step_on_the_cpu(monkeypatch):
    """CPU tensors are never captured: no mark, even with Inductor loaded (transformers and other libraries may
    load it in a program that compiles nothing)."""
    assert decode_steps_counting_marks(monkeypatch, "cpu") == 0


@pytest.mark.gpu
def test_gpu_decode_one_token_marks_each_step_for_cuda_graphs_when_not_compiled_whole(monkeypatch):
    """Uncompiled (layers compiled one by one), every CUDA step marks a CUDA-graph step begin, so per-layer graphs
    may reuse the last step's outputs; compiled whole (fullgraph), the trace holds no mark and no graph break."""
    assert decode_steps_counting_marks(monkeypatch, "cuda", compiled_steps=2) == 2


def decode_logits_per_layer(model, compile_layer) -> torch.Tensor:
    """Two decode steps after a prompt with each decoder layer compiled by ``compile_layer(model)``; the second
    step's logits."""
    ids, mask = left_padded_prompts(seed=21)
    cache = use_mla(model, batch=4)
    with torch.no_grad():
        token = hf.prefill(model, ids, mask, cache=cache).argmax(-1)
        compile_layer(model)
        try:
            token = hf.decode_one_token(model, token, cache).argmax(-1)
            return hf.decode_one_token(model, token, cache)
        finally:
            for layer in model.model.layers:
                layer.__dict__.pop("forward", None)


def test_compile_layers_gives_every_layer_its_own_graph_cache():
    """Compiled one by one through the same forward, the layers share Dynamo's per-function cache and its limit
    (8 graphs: a 61-layer model fails under fullgraph=True); compile_layers gives each its own. The limit is
    lowered to 2 here so that a 3-layer model shows it."""
    torch._dynamo.reset()
    model = make_model("v3_yarn", layers=3, first_k_dense_replace=3)
    want = decode_logits_per_layer(model, lambda m: None)

    def same_function(m):
        for layer in m.model.layers:
            layer.forward = torch.compile(layer.forward, fullgraph=True, backend="eager")

    with torch._dynamo.config.patch(recompile_limit=2):
        torch._dynamo.reset()
        with pytest.raises(Exception, match="[Rr]ecompile|fullgraph=True"):
            decode_logits_per_layer(model, same_function)
        torch._dynamo.reset()
        got = decode_logits_per_layer(model, lambda m: hf.compile_layers(m, fullgraph=True, backend="eager"))
    torch.testing.assert_close(got, want)
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)  # undone by del layer.forward


def test_captured_decode_step_needs_a_cuda_cache_and_our_attention():
    """CUDA graphs exist on CUDA devices only: on the CPU the step says so before anything runs; a model not on
    our attention is refused as everywhere."""
    model = make_model("v3_yarn")
    cache = use_mla(model, batch=4)
    with pytest.raises(ValueError, match=r"CapturedDecodeStep: CUDA graphs need the model and cache on a CUDA "
                                         r"device; the cache is on cpu"):
        hf.CapturedDecodeStep(model, cache)
    model.set_attn_implementation("eager")
    with pytest.raises(RuntimeError, match="attention implementation is 'eager'"):
        hf.CapturedDecodeStep(model, cache)


def test_compile_layers_names_what_it_cannot_compile():
    with pytest.raises(TypeError, match="no decoder layers"):
        hf.compile_layers(torch.nn.Linear(2, 2))


def test_capacity_is_still_checked_without_reading_the_device_each_step():
    """The host-side bound (columns seen) lets steps skip the device read; past it the device is read and a
    sequence that would outgrow max_seq_len is refused, in a chunk and in a step."""
    model = make_model("v3_yarn")
    ids, mask = left_padded_prompts(seed=12)
    cache = use_mla(model, batch=4, max_seq_len=PROMPT_LEN + 2)
    with torch.no_grad():
        token = hf.prefill(model, ids, mask, cache=cache).argmax(-1)
        for _ in range(2):  # row 0 (no padding) fills its PROMPT_LEN + 2 tokens
            token = hf.decode_one_token(model, token, cache).argmax(-1)
        assert cache.seq_lens.tolist() == (mask.sum(-1) + 2).tolist()
        with pytest.raises(ValueError, match="more than max_seq_len"):
            hf.decode_one_token(model, token, cache)
    cache.reset()
    with torch.no_grad(), pytest.raises(ValueError, match="more than max_seq_len"):
        hf.prefill(model, torch.cat([ids, ids], 1), torch.cat([mask, mask], 1), cache=cache)
    cache.reset()  # padding columns do not count: rows 1-3 of a padded chunk fit where the bound says no
    with torch.no_grad():
        hf.prefill(model, ids[1:2].repeat(4, 1), mask[1:2].repeat(4, 1), cache=cache)
        hf.prefill(model, ids[1:2, -3:].repeat(4, 1), mask[1:2, -3:].repeat(4, 1), cache=cache)
    assert cache.seq_lens.tolist() == [int(mask[1].sum()) + 3] * 4


def test_a_replayed_step_leaves_the_capacity_check_to_the_device():
    """hf.CapturedDecodeStep's replays advance the lengths on the device and run none of the cache's Python: each
    replay tells the cache (``_advanced_by_replay``), whose next eager forward then reads the device for its
    capacity check instead of trusting a host count the replays left behind. The replays are stood in for here by
    advancing the lengths in place, as the captured graph does."""
    model = make_model("v3_yarn")
    ids, mask = left_padded_prompts(seed=12)
    cache = use_mla(model, batch=4, max_seq_len=PROMPT_LEN + 2)
    with torch.no_grad():
        token = hf.prefill(model, ids, mask, cache=cache).argmax(-1)
        cache.seq_lens.add_(2)  # two replayed steps: row 0 (no padding) now holds PROMPT_LEN + 2 tokens
        cache._columns.add_(2)
        cache._advanced_by_replay()
        with pytest.raises(ValueError, match="more than max_seq_len"):
            hf.decode_one_token(model, token, cache)


# ---------------------------------------------------------------------------------------------- compiled


@pytest.mark.slow
def test_generate_compiles_its_decode_step_on_our_cache():
    """What generate() does by itself on GPU (the cache is compileable): here forced on CPU, fullgraph."""
    torch._dynamo.reset()
    model = make_model("v3_yarn")
    ids, mask = left_padded_prompts(seed=8)
    want = hf_generate(model, ids, mask, 12)
    config = transformers.CompileConfig(fullgraph=True, mode="default")
    config._compile_all_devices = True  # generate compiles only on accelerators unless told
    cache = use_mla(model, batch=4)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    got = hf_generate(model, ids, mask, 12, past_key_values=cache, compile_config=config)
    assert torch.equal(got, want)
    # One graph for the 11 decode steps: nothing of ours (the mask, the cache's state) changes a guard from
    # one step to the next (the prompt's forward is not compiled).
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1
    cache.reset()  # a second call reuses the compiled step (no recompilation: fullgraph and the same guards)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(hf_generate(model, ids, mask, 12, past_key_values=cache, compile_config=config), want)


def test_generate_with_hfs_default_compile_config_has_no_graph_break():
    """generate() compiles the decode step itself with transformers' default CompileConfig (fullgraph=False:
    a graph break would split the step silently, each piece its own CUDA graph with Python between them).
    With our cache and attention: no graph break, one graph for every step, none recompiled by a second
    call. Dynamo only (backend "eager"): breaks and guards are decided before any backend runs."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    model = make_model("v3_yarn")
    ids, mask = left_padded_prompts(seed=13)
    want = hf_generate(model, ids, mask, 8)
    config = transformers.CompileConfig()  # what generate() uses by itself on GPU ...
    assert config.fullgraph is False
    config.backend, config.mode = "eager", None  # ... checked by Dynamo alone on CPU
    config._compile_all_devices = True
    cache = use_mla(model, batch=4)
    breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    assert torch.equal(hf_generate(model, ids, mask, 8, past_key_values=cache, compile_config=config), want)
    assert sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] - graphs == 1
    cache.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(hf_generate(model, ids, mask, 8, past_key_values=cache, compile_config=config), want)


def attribute_writes_per_compiled_step(monkeypatch, layers: int) -> int:
    """The Python attribute writes torch.compile replays after each graph of a compiled decode step (Dynamo
    applies them through ``torch._dynamo.utils.object_setattr_ignore_descriptor``), counted over 3 steps of a
    ``layers``-layer model."""
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    model = make_model("v2_plain", layers=layers, first_k_dense_replace=layers)
    ids, mask = left_padded_prompts(seed=14)
    cache = use_mla(model, batch=4)
    step = torch.compile(hf.decode_one_token, fullgraph=True, backend="eager")
    with torch.no_grad():
        token = hf.prefill(model, ids, mask, cache=cache).argmax(-1)
        token = step(model, token, cache).argmax(-1)  # compiles
        writes = Counter()
        original = dynamo_utils.object_setattr_ignore_descriptor

        def counting(obj, name, value):
            writes[name] += 1
            return original(obj, name, value)

        monkeypatch.setattr(dynamo_utils, "object_setattr_ignore_descriptor", counting)
        for _ in range(3):
            token = step(model, token, cache).argmax(-1)
        monkeypatch.undo()
    assert writes, "no attribute write replayed at all: the count no longer sees Dynamo's replay"
    return sum(writes.values())


def test_compiled_step_writes_a_fixed_number_of_attributes_whatever_the_depth(monkeypatch):
    """torch.compile replays every Python attribute a compiled step writes after its graph runs: host time
    that, in generate() (which waits for the device every step), the device idles for. Our cache and
    attention write a fixed handful per step: a 3-layer model writes as many as a 1-layer one."""
    one, three = (attribute_writes_per_compiled_step(monkeypatch, n) for n in (1, 3))
    assert three == one, f"attribute writes per 3 steps: {one} with 1 layer, {three} with 3 layers"


def test_the_model_keeps_no_cache_between_forwards_and_two_caches_take_turns():
    """The link the attention modules share names a cache only while its forward runs: a dropped cache is
    freed, and two caches of one model can take turns (each sees its own tokens)."""
    import gc
    import weakref

    model = make_model("v2_plain")
    ids, mask = left_padded_prompts(seed=15)
    want = hf_generate(model, ids, mask, 6)
    first, second = use_mla(model, batch=4), use_mla(model, batch=4)
    with torch.no_grad():
        tokens = [hf.prefill(model, ids, mask, cache=c).argmax(-1) for c in (first, second)]
        out = [[t[:, None]] for t in tokens]
        for _ in range(5):
            for i, c in enumerate((first, second)):
                tokens[i] = hf.decode_one_token(model, tokens[i], c).argmax(-1)
                out[i].append(tokens[i][:, None])
    for o in out:
        assert torch.equal(torch.cat([ids, *o], 1), want)
    gone = weakref.ref(first)
    del first, second
    gc.collect()
    assert gone() is None, "the model still holds a PagedMLACache after its forwards ended"


@pytest.mark.slow
def test_own_compiled_decode_loop_matches_hf_eager():
    torch._dynamo.reset()
    model = make_model("v2_yarn_no_qlora", first_k_dense_replace=2)  # dense: MoE under compile is covered above
    ids, mask = left_padded_prompts(seed=9)
    want = hf_generate(model, ids, mask, 12)
    cache = use_mla(model, batch=4, page_size=16)  # a page size no other compiled test uses: a new decision
    step = torch.compile(hf.decode_one_token, fullgraph=True)
    before = set(mla_inductor.lowering.decisions())
    with torch._inductor.config.patch(force_disable_caches=True):  # a cached graph would skip the pass
        got = hf.generate(model, ids, mask, max_new_tokens=12, cache=cache, decode_step=step)
    assert torch.equal(got, want)
    new = [d for d in mla_inductor.lowering.decisions() if d not in before]
    assert any(d.backend == "reference" and d.problem.device_type == "cpu" for d in new), new


@pytest.mark.slow
def test_compiled_step_reads_kv_b_proj_only_as_w_uk_and_w_uv():
    """HF expands the latents update() returns; in a decode step nothing reads that expansion, so the
    compiled step drops it: kv_b_proj's weight appears in exactly two matmuls, the absorbed query (W_UK)
    and the output (W_UV), both on views of the weight (no copy)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model = make_model("v2_plain", layers=1, first_k_dense_replace=1)
    ids, mask = left_padded_prompts(seed=12)
    cache = use_mla(model, batch=4)
    hf.prefill(model, ids, mask, cache=cache)
    step = torch.compile(hf.decode_one_token, fullgraph=True)
    with torch.no_grad():
        _, codes = run_and_get_code(step, model, ids[:, -1], cache)
    weight = model.model.layers[0].self_attn.kv_b_proj.weight
    shape = f"({weight.shape[0]}, {weight.shape[1]}), ({weight.shape[1]}, 1)"
    code = "\n".join(codes)
    names = {line.split("assert_size_stride(")[1].split(",")[0] for line in code.splitlines()
             if "assert_size_stride(" in line and shape in line}
    assert len(names) == 1, names  # the one parameter of that shape
    (name,) = names
    uses = [line.strip() for line in code.splitlines() if f"{name}," in line or f"{name})" in line]
    uses = [u for u in uses if not u.startswith(("assert_size_stride", "del ", "return", name))
            and not u.endswith("= args")]
    assert len(uses) == 2 and all("bmm" in u and "reinterpret_tensor" in u for u in uses), uses


# ---------------------------------------------------------------------------------------------- fp8 cache


def forced_logits(model, cache, ids, mask, forced):
    """Logits [B, N, V] of each step when the model is fed ``forced`` [B, N] after the prompt."""
    cache.reset()
    out = [hf.prefill(model, ids, mask, cache=cache)]
    with torch.no_grad():
        for k in range(forced.shape[1] - 1):
            out.append(hf.decode_one_token(model, forced[:, k], cache))
    return torch.stack(out, 1).float()


def top1_agreement(model, prompts, fmt, n, page_size, device="cpu"):
    """Top-1 agreement of a ``fmt`` cache with the model's own dtype cache, teacher-forced on the latter's
    greedy tokens: (rate over all steps, rate over decisive steps, share of decisive steps).

    A random-weight model is nearly flat, so some steps are near-ties that any rounding flips; "decisive"
    steps have a top-1/top-2 gap above 0.05 logit std."""
    batch = prompts[0][0].shape[0]
    ref_cache = use_mla(model, batch=batch, max_seq_len=64, page_size=page_size)
    test_cache = hf.PagedMLACache(model, batch_size=batch, max_seq_len=64, page_size=page_size, fmt=fmt)
    refs = [hf.generate(model, ids, mask, max_new_tokens=n, cache=ref_cache)[:, ids.shape[1]:] for ids, mask in prompts]
    want = torch.cat([forced_logits(model, ref_cache, ids, mask, r) for (ids, mask), r in zip(prompts, refs)])
    got = torch.cat([forced_logits(model, test_cache, ids, mask, r) for (ids, mask), r in zip(prompts, refs)])
    agree = got.argmax(-1) == want.argmax(-1)
    top2 = want.topk(2, dim=-1).values
    decisive = (top2[..., 0] - top2[..., 1]) > 0.05 * want.std(-1)
    return agree.float().mean().item(), agree[decisive].float().mean().item(), decisive.float().mean().item()


def test_fp8_e4m3_cache_top1_agreement_cpu():
    model = make_model("v3_yarn")
    prompts = [left_padded_prompts(pad_lens=(0, 4, 9, 2), length=16, seed=s) for s in range(2)]
    raw, decisive, share = top1_agreement(model, prompts, "fp8_e4m3", n=12, page_size=16)
    print(f"\nfp8_e4m3 (CPU): top-1 agrees with fp32 on {raw:.1%} of steps, {decisive:.1%} of the {share:.0%} decisive")
    assert decisive >= 0.95 and raw >= 0.85, (raw, decisive)


# ---------------------------------------------------------------------------------------------- other models

FAMILY = {
    "glm4_moe_lite": dict(BASE, n_group=1, topk_group=1),
    "mistral4": dict(BASE, n_group=1, topk_group=1),
    "youtu": dict(BASE),
    "minicpm3": dict(BASE),
    "axk1": dict(BASE, n_group=2, topk_group=1),
    "longcat_flash": dict(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_attention_heads=16, kv_lora_rank=32,
                          q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16, head_dim=16, v_head_dim=24,
                          ffn_hidden_size=96, moe_topk=2, n_routed_experts=8, zero_expert_num=2,
                          expert_ffn_hidden_size=32, max_position_embeddings=256, pad_token_id=0),
    # DSA with a top-k larger than any context here: every visible key is picked (the sparse path, dense result).
    "deepseek_v32": dict(BASE, n_group=2, topk_group=1, index_head_dim=32, index_n_heads=4, index_topk=64),
    "glm_moe_dsa": dict(BASE, n_group=1, topk_group=1, index_head_dim=32, index_n_heads=4, index_topk=64),
}


def test_every_supported_model_type_is_tested():
    assert set(hf.SUPPORTED_MODEL_TYPES) == set(FAMILY) | {"deepseek_v2", "deepseek_v3"}
    assert {t for t, s in hf.SUPPORTED_MODEL_TYPES.items() if s.sparse} == {"deepseek_v32", "glm_moe_dsa"}


def family_model(model_type, **overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny configs trip transformers' config sanity warnings
        model = random_mla_model(model_type, attn_implementation="eager", bos_token_id=1, eos_token_id=2,
                                 **dict(FAMILY[model_type], **overrides))
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("model_type", sorted(FAMILY))
def test_other_mla_model_types_generate_like_hf_eager(model_type):
    model = family_model(model_type)
    ids, mask = left_padded_prompts(seed=10)
    want = hf_generate(model, ids, mask, 8)
    with CountMLAOps() as ops:
        got = hf_generate(model, ids, mask, 8, past_key_values=use_mla(model, batch=4))
    assert torch.equal(got, want), model_type
    assert ops.counts["paged_decode"] == 7 * len(hf.PagedMLACache(model, batch_size=1, max_seq_len=1).kv_caches)


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_dsa_top_k_generate_like_hf_eager_with_its_static_cache(model_type):
    """DSA with a top-k (6) smaller than the context: each decode step's query attends to the indexer's 6
    columns through mla.paged_decode's sparse_indices. The reference is HF's eager attention on its static
    cache, whose indexer scores a fixed number of columns (prompt + new - 1) like ours: the indexer's scores
    tie (relu) or nearly tie, and a different column count breaks the ties differently, in HF's own caches
    as in ours."""
    model = family_model(model_type, index_topk=6)
    ids, mask = left_padded_prompts(seed=0)
    want = hf_generate(model, ids, mask, 16, cache_implementation="static")
    cache = use_mla(model, batch=4, max_seq_len=PROMPT_LEN + 16 - 1)
    with CountMLAOps() as ops:
        got = hf_generate(model, ids, mask, 16, past_key_values=cache)
    assert torch.equal(got, want), f"{model_type}: ours\n{got[:, PROMPT_LEN:]}\nHF eager\n{want[:, PROMPT_LEN:]}"
    assert ops.sparse_calls == 15 * model.config.num_hidden_layers


# ---------------------------------------------------------------------------------------------- API and errors


def test_the_cache_answers_hf_and_filling_directly():
    model = make_model("v3_yarn")
    cache = use_mla(model, batch=2, max_seq_len=40)
    assert cache.is_compileable and cache.is_croppable and cache.get_max_length() == 40 and cache.batch_size == 2
    fill_paged_mla_cache(cache, 30)
    assert cache.seq_lens.tolist() == [30, 30] and int(cache.get_seq_length()) == 30
    cache.crop(-4)
    assert cache.seq_lens.tolist() == [26, 26] and int(cache.get_seq_length()) == 26
    with pytest.raises(ValueError, match="negative"):
        cache.crop(3)
    # Continuing from a filled cache: the new token attends to the 26 cached ones through the op.
    with CountMLAOps() as ops:
        logits = hf.decode_one_token(model, torch.tensor([5, 6]), cache)
    assert logits.shape == (2, VOCAB) and torch.isfinite(logits).all() and ops.counts["paged_decode"] == 2
    assert cache.seq_lens.tolist() == [27, 27]
    cache.reset()
    assert cache.seq_lens.tolist() == [0, 0] and int(cache.get_seq_length()) == 0


def test_errors_name_what_is_wrong(monkeypatch):
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4))
    with pytest.raises(TypeError, match="'llama'.*deepseek_v3|deepseek_v3.*'llama'"):
        hf.PagedMLACache(llama, batch_size=1, max_seq_len=8)

    model = make_model("v2_plain")
    ids, mask = left_padded_prompts()
    cache = hf.PagedMLACache(model, batch_size=4, max_seq_len=32)
    with pytest.raises(RuntimeError, match="set_attn_implementation"):  # the model still runs eager attention
        hf_generate(model, ids, mask, 4, past_key_values=cache)
    model.set_attn_implementation(hf.register())
    with pytest.raises(ValueError, match="batch 4.*made for 2"):
        hf_generate(model, ids, mask, 4, past_key_values=hf.PagedMLACache(model, batch_size=2, max_seq_len=32))
    small = hf.PagedMLACache(model, batch_size=4, max_seq_len=PROMPT_LEN + 2)
    with pytest.raises(ValueError, match="max_seq_len"):
        hf_generate(model, ids, mask, 8, past_key_values=small)
    with pytest.raises(TypeError, match="pass the PagedMLACache"):
        hf.decode_one_token(model, ids[:, 0], torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="fp8_ds_mla"):  # needs L=512, R=64
        hf.PagedMLACache(model, batch_size=1, max_seq_len=8, fmt="fp8_ds_mla")

    # transformers may swap its lazy module in sys.modules: patch the one an import finds.
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.1")
    with pytest.raises(ImportError, match=r">= 5\.23.*found 4\.57\.1"):
        hf.register()


@pytest.mark.slow
def test_transformers_imported_lazily_and_only_by_the_hf_modules():
    code = "import sys, mla_inductor, mla_inductor.lowering, mla_inductor.hf; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    package = Path(hf.__file__).parent
    runtime = list(package.rglob("*.py"))
    allowed = {"hf.py", "_hf.py", "_hf_distributed.py", "_transformers.py", "testing.py"}
    importers = [p.name for p in runtime if p.name not in allowed
                 and any(n == "transformers" or n.startswith("transformers.") for n in imported_modules(p))]
    assert not importers, f"only {sorted(allowed)} may import transformers, found {importers}"
    # No runtime module imports the test helpers at import time.
    top_level = [p.name for p in runtime if p.name != "testing.py" and any(
        line.startswith(("from mla_inductor.testing", "import mla_inductor.testing")) for line in p.read_text().splitlines())]
    assert not top_level, top_level


# ---------------------------------------------------------------------------------------------------------- GPU

GPU_V3 = dict(BASE, hidden_size=256, intermediate_size=256, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32,
              v_head_dim=32, q_lora_rank=96, n_group=2, topk_group=1, rope_parameters=dict(YARN, mscale=1.0,
                                                                                          mscale_all_dim=1.0))


def gpu_model():
    model = random_deepseek_model("v3", dtype=torch.bfloat16, device="cuda", attn_implementation="sdpa", **GPU_V3)
    model.generation_config.eos_token_id = None
    return model


def hf_logits_of(model, tokens, mask):
    """HF's own logits [B, N, V] for every generated position of ``tokens``, in one sdpa forward."""
    full_mask = torch.cat([mask, torch.ones_like(tokens[:, mask.shape[1]:])], 1)
    with torch.no_grad():
        return model(tokens, attention_mask=full_mask).logits[:, mask.shape[1] - 1:-1].float()


@pytest.mark.gpu
def test_gpu_bf16_generate_agrees_with_hf_sdpa():
    """bf16 on GPU: generate() (its decode step compiled by transformers, our kernel chosen by the pass)
    gives HF's greedy tokens except after a near-tie, and teacher-forced logits within bf16 error."""
    torch._dynamo.reset()
    model = gpu_model()
    ids, mask = left_padded_prompts(device="cuda")
    want = hf_generate(model, ids, mask, 32)
    hf_logits = hf_logits_of(model, want, mask)
    cache = use_mla(model, batch=4, max_seq_len=64, page_size=64)
    got = hf_generate(model, ids, mask, 32, past_key_values=cache)
    top2 = hf_logits.topk(2, dim=-1).values
    near_tie = (top2[..., 0] - top2[..., 1]) <= 0.05 * hf_logits.std(-1)
    for b in range(4):
        diff = (got[b, PROMPT_LEN:] != want[b, PROMPT_LEN:]).nonzero()
        if len(diff):
            k = int(diff[0])
            assert near_tie[b, k], f"row {b} leaves HF's greedy path at step {k}, where HF's choice was decisive"
    ours = forced_logits(model, cache, ids, mask, want[:, PROMPT_LEN:])
    err = ((ours - hf_logits).norm() / hf_logits.norm()).item()
    assert err < 3e-2, f"bf16 logits relative error {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_ds_mla"])
def test_gpu_fp8_cache_top1_agrees_with_bf16(fmt):
    model = gpu_model()
    prompts = [left_padded_prompts(pad_lens=(0, 4, 9, 2), length=16, seed=s, device="cuda") for s in range(4)]
    raw, decisive, share = top1_agreement(model, prompts, fmt, n=16, page_size=64)
    print(f"\n{fmt} (GPU): top-1 agrees with bf16 on {raw:.1%} of steps, {decisive:.1%} of the {share:.0%} decisive")
    assert decisive >= 0.95 and raw >= 0.85, (raw, decisive)


@pytest.mark.slow
def test_bench_generate_runs_as_a_cpu_smoke_test(tmp_path):
    """The GPU benchmark's script logic, at tiny sizes on CPU: every row runs and the results are written."""
    import json

    script = BENCHMARKS / "bench_generate.py"
    result = subprocess.run([sys.executable, str(script), "--small", "--device", "cpu", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "bench_generate.json").read_text())
    rows = {row["name"]: row for row in data["rows"]}
    assert set(rows) == {"prefill-hf", "prefill-mla", "generate-mla", "loop-mla", "generate-hf"}
    assert all(row["error"] is None and row["ms"] is not None for row in rows.values()), rows  # CPU times mean nothing
    assert rows["prefill-mla"]["kernel"] == "sdpa", rows["prefill-mla"]  # the prompt kernel that ran (CPU: sdpa)
    assert set(data["ratios"]) == set(data["targets"]) and (tmp_path / "bench_generate.md").is_file()


@pytest.mark.slow
def test_bench_generate_trace_profiles_the_generate_row_only(tmp_path):
    """--trace adds torch.profiler's table to the generate-mla row; with other rows it is refused (a profiler
    session would slow them)."""
    import json

    script = BENCHMARKS / "bench_generate.py"
    base = [sys.executable, str(script), "--small", "--device", "cpu", "--trace", "--out", str(tmp_path)]
    refused = subprocess.run(base, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "--rows generate-mla only" in refused.stderr, refused.stderr[-2000:]
    result = subprocess.run(base + ["--rows", "generate-mla"], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = json.loads((tmp_path / "bench_generate.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["generate-mla"] and "Self CPU time total" in rows[0]["extra"]["trace"]


def gpu_dsa_model():
    """DeepSeek-V3.2 (DSA) on the GPU, its top-k above every context here: the sparse path, a dense result."""
    model = random_mla_model("deepseek_v32", dtype=torch.bfloat16, device="cuda", attn_implementation="sdpa",
                             **dict(GPU_V3, index_head_dim=128, index_n_heads=4, index_topk=64))
    model.generation_config.eos_token_id = None
    return model


def captured_step_against_plain_steps(make_model, compile_layers: bool, steps: int = 6):
    """The same prompt in two caches; ``steps`` decode steps through ``hf.decode_one_token`` on one and through
    ``hf.CapturedDecodeStep`` on the other (layers eager, or compiled one by one), fed the same tokens. The
    replays run with the graph's output poisoned first and under ``set_sync_debug_mode("error")``. Returns the
    logits of both [steps, B, V], the two caches and the captured step."""
    torch._dynamo.reset()
    model = make_model()
    ids, mask = left_padded_prompts(device="cuda", seed=5)
    plain_cache, graph_cache = (use_mla(model, batch=4, max_seq_len=64, page_size=64) for _ in range(2))
    want, got = [], []
    with torch.no_grad():
        token = hf.prefill(model, ids, mask, cache=plain_cache).argmax(-1)
        hf.prefill(model, ids, mask, cache=graph_cache)
        if compile_layers:
            hf.compile_layers(model, fullgraph=True)
        try:
            step = hf.CapturedDecodeStep(model, graph_cache)
            for i in range(steps):
                want.append(hf.decode_one_token(model, token, plain_cache).float())
                if i >= 2:  # captured: the graph's output poisoned, and nothing may wait for the device
                    step._logits.fill_(float("nan"))
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    got.append(step(token).float())
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                token = want[-1].argmax(-1)
        finally:
            for layer in model.model.layers:
                layer.__dict__.pop("forward", None)
    return torch.stack(want), torch.stack(got), plain_cache, graph_cache, step


@pytest.mark.gpu
@pytest.mark.parametrize("compile_layers", [False, True], ids=["eager_layers", "compiled_layers"])
@pytest.mark.parametrize("make_model", [gpu_model, gpu_dsa_model], ids=["v3", "v32_dsa"])
def test_gpu_captured_decode_step_agrees_with_plain_steps(make_model, compile_layers):
    """hf.CapturedDecodeStep (warm-up, then capture, then replays) gives the logits of plain decode steps within
    bf16 error at every step, its cache advances like the plain one, and a replay writes every logit."""
    want, got, plain_cache, graph_cache, step = captured_step_against_plain_steps(make_model, compile_layers)
    assert step._graph is not None  # the later steps were replays
    assert got.isfinite().all()
    for i in range(len(want)):
        err = ((got[i] - want[i]).norm() / want[i].norm()).item()
        assert err < 2e-2, f"step {i}: logits relative error {err:.3g}"
    assert torch.equal(graph_cache.seq_lens, plain_cache.seq_lens)
    torch.testing.assert_close(graph_cache.get_seq_length(), plain_cache.get_seq_length())


@pytest.mark.gpu
@pytest.mark.parametrize("compile_layers", [False, True], ids=["eager_layers", "compiled_layers"])
def test_gpu_captured_decode_step_shares_one_schedule_among_its_layers(compile_layers, monkeypatch):
    """FlashMLA schedules on the device, once per plan: in a captured step of four layers, the layers after the
    first over the same lengths take the schedule the capture made (eager layers: one schedule per step; compiled
    layers: two, the first layer's graph reads the lengths it has just advanced as a buffer of its own), and the
    replays still agree with plain decode steps. Counts the FlashMLA calls that schedule for themselves."""
    import mla_inductor.backends.flashmla as fm

    scheduling = []
    attend_rows = fm.attend_rows

    def counting(*args, **kwargs):
        scheduling.append(not args[8])  # the plan argument: empty -> the call schedules itself
        return attend_rows(*args, **kwargs)

    monkeypatch.setattr(fm, "attend_rows", counting)

    def four_layers():
        model = random_deepseek_model("v3", dtype=torch.bfloat16, device="cuda", attn_implementation="sdpa",
                                      **dict(GPU_V3, num_hidden_layers=4))
        model.generation_config.eos_token_id = None
        return model

    with mla_inductor.prefer_backends("flashmla"):
        calls = []
        step_call = hf.CapturedDecodeStep.__call__

        def recorded(self, tokens):
            scheduling.clear()
            out = step_call(self, tokens)
            calls.append(list(scheduling))
            return out

        monkeypatch.setattr(hf.CapturedDecodeStep, "__call__", recorded)
        want, got, plain_cache, graph_cache, step = captured_step_against_plain_steps(four_layers, compile_layers)
    capture = calls[1]  # the warm-up, the capture, then replays (which run no Python)
    assert len(capture) == 4, f"FlashMLA calls in the capture: {capture}"
    assert sum(capture) == (2 if compile_layers else 1), f"calls that scheduled themselves: {capture}"
    assert all(len(c) == 0 for c in calls[2:])
    for i in range(len(want)):
        err = ((got[i] - want[i]).norm() / want[i].norm()).item()
        assert err < 2e-2, f"step {i}: logits relative error {err:.3g}"
    assert torch.equal(graph_cache.seq_lens, plain_cache.seq_lens)


@pytest.mark.gpu
def test_gpu_captured_decode_step_refuses_bad_tokens_and_an_empty_cache():
    model = gpu_model()
    cache = use_mla(model, batch=4, max_seq_len=64, page_size=64)
    step = hf.CapturedDecodeStep(model, cache)
    with pytest.raises(ValueError, match="holds no prompt"):
        step(torch.ones(4, dtype=torch.long, device="cuda"))
    for bad in (torch.ones(3, dtype=torch.long, device="cuda"), torch.ones(4, dtype=torch.long),
                torch.ones(4, 1, dtype=torch.long, device="cuda"), torch.ones(4, device="cuda")):
        with pytest.raises(ValueError, match=r"tokens must be \[B=4\] integer token ids on cuda"):
            step(bad)
    # After a prompt and a captured step, reset() empties the cache: the next call is refused until a new prompt.
    ids, mask = left_padded_prompts(device="cuda", seed=7)
    with torch.no_grad():
        token = hf.prefill(model, ids, mask, cache=cache).argmax(-1)
        for _ in range(3):  # warm-up, capture, replay
            token = step(token).argmax(-1)
        # The replays advanced the lengths on the device only: the cache's capacity checks now read the device.
        assert cache._host_columns is None
        cache.reset()
        with pytest.raises(ValueError, match="holds no prompt"):
            step(token)
        token = hf.prefill(model, ids, mask, cache=cache).argmax(-1)
        assert step(token).isfinite().all()
