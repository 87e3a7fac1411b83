"""The hostile-input table: bad or unusual calls of the mla ops, each with the result the contract promises.

One list, ``CASES``, is the single source: ``tests/test_hostile.py`` runs every case eagerly and under
``torch.compile(fullgraph=True)`` on CPU and checks the promise, and docs/reliability.md's table is generated
from it (``python tests/test_hostile.py --markdown`` prints it; a test fails while the doc differs).

A case edits the arguments of a valid call (``BASES``) and expects either

- ``Raises(type, text, at)``: that exception, its message containing ``text`` (the ``mla.<op>:`` prefix is
  checked too); compiled, it is raised ``at`` compile time (the fake impls: shape, dtype, device, layout)
  or when the graph runs (the value checks the pass puts in), or
- ``Returns(what, check)``: no exception, and the result ``what`` says: ``"oracle"`` compares out and lse
  with the float64 oracle (tests/naive.py) at the query dtype's tolerance, ``"empty"`` checks empty
  outputs of the right shapes; cache_append cases check the cache they wrote.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import torch

from mla_inductor.testing import make_decode_inputs

DECODE_ARGS = ("q_nope", "q_pe", "kv_cache", "block_table", "seq_lens", "softmax_scale", "kv_scale",
               "sparse_indices", "q_scale")
APPEND_ARGS = ("kv_cache", "kv_c", "k_pe", "slot_mapping", "kv_scale")
SMALL = dict(num_heads=3, kv_lora_rank=32, rope_dim=16, page_size=4, q_dtype=torch.float32, max_pages=5)
# The valid calls the cases edit: two sequences (5 and 9 tokens) in 4-token pages, a 5-entry block table
# (capacity 20; unused entries -1), a bf16 cache of 8 pages, fp32 queries, H=3, L=32, R=16.
BASES = {
    "dense": dict(seq_lens=[5, 9]),
    "sparse": dict(seq_lens=[5, 9], topk=4),
    "fp8": dict(seq_lens=[5, 9], fmt="fp8_e4m3"),
    "mtp": dict(seq_lens=[5, 9], q_per_seq=2),
    "page1": dict(seq_lens=[5, 9], page_size=1, max_pages=12),  # 12 one-token pages per sequence
}
APPEND_PAGES, APPEND_PAGE_SIZE = 2, 4  # cache_append: a [2, 4, 48] cache, 3 new tokens into slots 1, 6, 3


@dataclass(frozen=True)
class Raises:
    type: type
    text: str
    at: str  # "compile" or "run": when a compiled call raises it


@dataclass(frozen=True)
class Returns:
    what: str  # what the doc says the call gives
    check: str = "oracle"  # "oracle", "empty", or for cache_append "written"


@dataclass(frozen=True)
class Case:
    name: str
    op: str  # "paged_decode_with_lse" (decode cases) or "cache_append"
    base: str  # a key of BASES, or "append" / "append_fp8"
    edit: Callable[[dict], None]
    expect: Union[Raises, Returns]
    gpu_form: bool = True  # a "run" check that GPUs also make in debug mode (device asserts)


def base_args(base: str) -> dict:
    """The arguments of a valid call, by name (fresh tensors each time)."""
    if base.startswith("append"):
        fp8 = base == "append_fp8"
        cache = torch.zeros(APPEND_PAGES, APPEND_PAGE_SIZE, 48, dtype=torch.float8_e4m3fn if fp8 else torch.float32)
        g = torch.Generator().manual_seed(1)
        return dict(kv_cache=cache, kv_c=torch.randn(3, 32, generator=g), k_pe=torch.randn(3, 16, generator=g),
                    slot_mapping=torch.tensor([1, 6, 3], dtype=torch.int32),
                    kv_scale=torch.full((1,), 0.02) if fp8 else torch.ones(1))
    x = make_decode_inputs(**{**SMALL, **BASES[base]})
    return dict(zip(DECODE_ARGS, (*x.args(), None)))


# ----------------------------------------------------------------------------- edits

def put(name, value):
    """Replace an argument: by a value, or by ``value(args)``."""
    def edit(a):
        a[name] = value(a) if callable(value) else value
    return edit


def both(*edits):
    def edit(a):
        for e in edits:
            e(a)
    return edit


def at(name, index, value):
    """Set one element of an argument tensor (in a copy)."""
    def edit(a):
        a[name] = a[name].clone()
        a[name][index] = value
    return edit


def unused_entries(value):
    """Fill every block-table entry past a sequence's last page with ``value`` (never read)."""
    def edit(a):
        table, page_size = a["block_table"].clone(), a["kv_cache"].shape[1]
        for b, n in enumerate(a["seq_lens"].tolist()):
            table[b, -(-n // page_size):] = value
        a["block_table"] = table
    return edit


def fill_to_capacity(b):
    """Sequence b grows to the table's capacity, its new entries naming pages no sequence uses."""
    def edit(a):
        table, page_size = a["block_table"].clone(), a["kv_cache"].shape[1]
        spare = _spare_pages(a)
        n = int(a["seq_lens"][b])
        free = table.shape[1] - -(-n // page_size)
        table[b, table.shape[1] - free:] = torch.tensor(spare[:free], dtype=table.dtype)
        a["block_table"] = table
        a["seq_lens"] = a["seq_lens"].clone()
        a["seq_lens"][b] = table.shape[1] * page_size
    return edit


def _spare_pages(a) -> list:
    page_size, table = a["kv_cache"].shape[1], a["block_table"]
    used = {int(p) for b, n in enumerate(a["seq_lens"].tolist()) for p in table[b, :-(-n // page_size)]}
    return [p for p in range(a["kv_cache"].shape[0]) if p not in used]


def unused_entries_name_spare_pages(a):
    """Every unused block-table entry names a page no sequence uses (still never read)."""
    table, page_size, spare = a["block_table"].clone(), a["kv_cache"].shape[1], _spare_pages(a)
    for b, n in enumerate(a["seq_lens"].tolist()):
        for i in range(-(-n // page_size), table.shape[1]):
            table[b, i] = spare[(b + i) % len(spare)]
    a["block_table"] = table


def batch_of_zero(a):
    for name in ("q_nope", "q_pe"):
        a[name] = a[name][:0]
    a["block_table"], a["seq_lens"] = a["block_table"][:0], a["seq_lens"][:0]


def strided_last_dim(name):
    return put(name, lambda a: torch.stack([a[name], a[name]], dim=-1)[..., 0])


def bigger_pages_view(a):
    """The cache as a view of larger pages (FlashMLA's test layout ``empty(P, page + 1, W)[:, :page]``)."""
    cache = a["kv_cache"]
    big = torch.zeros(cache.shape[0], cache.shape[1] + 1, cache.shape[2], dtype=cache.dtype)
    big[:, :cache.shape[1]] = cache
    a["kv_cache"] = big[:, :cache.shape[1]]


def query_rows_strided(a):
    for name in ("q_nope", "q_pe"):
        a[name] = torch.cat([a[name], a[name]], dim=0)[::2]


def poison(slots_of):
    """NaN in cache rows the call does not attend (``slots_of(args)`` lists them)."""
    def edit(a):
        cache = a["kv_cache"].clone()
        flat = cache.view(-1, cache.shape[-1])
        for slot in slots_of(a):
            flat[slot] = float("nan")
        a["kv_cache"] = cache
    return edit


def slot_zero_unlisted(a):
    """Slot 0, which no row lists (a reference that clamps -1 padding would read it)."""
    assert 0 not in a["sparse_indices"].flatten().tolist(), "the case needs a call that lists no slot 0"
    return [0]


def tail_of_last_page(a):
    page_size, table = a["kv_cache"].shape[1], a["block_table"]
    n = int(a["seq_lens"][0])
    page = int(table[0, (n - 1) // page_size])
    return [page * page_size + o for o in range(n % page_size or page_size, page_size)]


def unused_pages(a):
    page_size = a["kv_cache"].shape[1]
    return [p * page_size + o for p in _spare_pages(a) for o in range(page_size)]


I32 = torch.int32
PD = "paged_decode_with_lse"
CA = "cache_append"

# ----------------------------------------------------------------------------- the table

CASES: list[Case] = [
    # --- shapes, dtypes, devices, layouts: refused by the checks the fake impls run, so at compile time
    Case("q_nope 2-D", PD, "dense", put("q_nope", lambda a: a["q_nope"][0]),
         Raises(ValueError, "q_nope must be a 3-D tensor [T, H, L]", "compile")),
    Case("q_nope 4-D", PD, "dense", put("q_nope", lambda a: a["q_nope"][None]),
         Raises(ValueError, "q_nope must be a 3-D tensor [T, H, L]", "compile")),
    Case("q_nope int32", PD, "dense", put("q_nope", lambda a: a["q_nope"].int()),
         Raises(TypeError, "q_nope must have dtype float32, float16 or bfloat16, got torch.int32", "compile")),
    Case("q_nope float64", PD, "dense", put("q_nope", lambda a: a["q_nope"].double()),
         Raises(TypeError, "q_nope must have dtype float32, float16 or bfloat16, got torch.float64", "compile")),
    Case("q_nope a Python float", PD, "dense", put("q_nope", 1.0),
         Raises(RuntimeError, "Expected a value of type 'Tensor' for argument 'q_nope'", "compile")),
    Case("q_pe fp16 with fp32 q_nope", PD, "dense", put("q_pe", lambda a: a["q_pe"].half()),
         Raises(TypeError, "q_pe must have q_nope's dtype torch.float32, got torch.float16", "compile")),
    Case("q_pe with fewer heads", PD, "dense", put("q_pe", lambda a: a["q_pe"][:, :1]),
         Raises(ValueError, "q_pe must be [T=2, H=3, R] like q_nope, got shape (2, 1, 16)", "compile")),
    Case("q_pe with fewer rows", PD, "dense", put("q_pe", lambda a: a["q_pe"][:1]),
         Raises(ValueError, "q_pe must be [T=2, H=3, R] like q_nope, got shape (1, 3, 16)", "compile")),
    Case("q_pe 2-D", PD, "dense", put("q_pe", lambda a: a["q_pe"][0]),
         Raises(ValueError, "q_pe must be a 3-D tensor [T, H, R]", "compile")),
    Case("q_nope strided in its last dim", PD, "dense", strided_last_dim("q_nope"),
         Raises(ValueError, "q_nope must be contiguous in its last dimension", "compile")),
    Case("q_pe strided in its last dim", PD, "dense", strided_last_dim("q_pe"),
         Raises(ValueError, "q_pe must be contiguous in its last dimension", "compile")),
    Case("kv_cache rows 40 wide (L+R=48)", PD, "dense", put("kv_cache", lambda a: a["kv_cache"][..., :40]),
         Raises(ValueError, "kv_cache must be [P, page_size, L+R=48] (latent | rope), got shape (8, 4, 40)", "compile")),
    Case("kv_cache float64", PD, "dense", put("kv_cache", lambda a: a["kv_cache"].double()),
         Raises(TypeError, "kv_cache must have dtype float32, float16, bfloat16, float8_e4m3fn or uint8", "compile")),
    Case("kv_cache int32", PD, "dense", put("kv_cache", lambda a: a["kv_cache"].int()),
         Raises(TypeError, "kv_cache must have dtype float32, float16, bfloat16, float8_e4m3fn or uint8", "compile")),
    Case("kv_cache 2-D", PD, "dense", put("kv_cache", lambda a: a["kv_cache"][0]),
         Raises(ValueError, "kv_cache must be a 3-D tensor [P, page_size, L+R]", "compile")),
    Case("uint8 (fp8_ds_mla) cache with L=32", PD, "dense",
         put("kv_cache", torch.zeros(8, 4, 656, dtype=torch.uint8)),
         Raises(ValueError, "a uint8 (fp8_ds_mla) kv_cache needs L=512 and R=64, got L=32, R=16", "compile")),
    Case("kv_cache strided in its last dim", PD, "dense", strided_last_dim("kv_cache"),
         Raises(ValueError, "kv_cache must be contiguous in its last dimension", "compile")),
    Case("kv_cache on another device (meta)", PD, "dense", put("kv_cache", lambda a: a["kv_cache"].to("meta")),
         Raises(ValueError, "kv_cache must be on cpu like q_nope, got meta", "compile")),
    Case("block_table int64", PD, "dense", put("block_table", lambda a: a["block_table"].long()),
         Raises(TypeError, "block_table must have dtype int32, got torch.int64", "compile")),
    Case("block_table float32", PD, "dense", put("block_table", lambda a: a["block_table"].float()),
         Raises(TypeError, "block_table must have dtype int32, got torch.float32", "compile")),
    Case("block_table 1-D", PD, "dense", put("block_table", lambda a: a["block_table"][0]),
         Raises(ValueError, "block_table must be a 2-D tensor [B, max_pages]", "compile")),
    Case("seq_lens int64", PD, "dense", put("seq_lens", lambda a: a["seq_lens"].long()),
         Raises(TypeError, "seq_lens must have dtype int32, got torch.int64", "compile")),
    Case("seq_lens 2-D", PD, "dense", put("seq_lens", lambda a: a["seq_lens"][None]),
         Raises(ValueError, "seq_lens must be a 1-D tensor [B]", "compile")),
    Case("seq_lens for one sequence of two", PD, "dense", put("seq_lens", lambda a: a["seq_lens"][:1]),
         Raises(ValueError, "seq_lens must be [B=2] (one length per block_table row), got shape (1,)", "compile")),
    Case("T=3 rows for B=2 sequences", PD, "dense",
         both(put("q_nope", lambda a: a["q_nope"].repeat(2, 1, 1)[:3]), put("q_pe", lambda a: a["q_pe"].repeat(2, 1, 1)[:3])),
         Raises(ValueError, "q_nope's T=3 must be a positive multiple of the batch size B=2", "compile")),
    Case("B=0 with T=2 query rows", PD, "dense",
         both(put("block_table", lambda a: a["block_table"][:0]), put("seq_lens", lambda a: a["seq_lens"][:0])),
         Raises(ValueError, "q_nope's T=2 must be 0 when the batch is empty (B=0)", "compile")),
    Case("softmax_scale a string", PD, "dense", put("softmax_scale", "0.1"),
         Raises(RuntimeError, "for argument 'softmax_scale'", "compile")),
    Case("softmax_scale NaN", PD, "dense", put("softmax_scale", float("nan")),
         Raises(ValueError, "softmax_scale must be finite, got nan", "compile")),
    Case("softmax_scale inf", PD, "dense", put("softmax_scale", float("inf")),
         Raises(ValueError, "softmax_scale must be finite, got inf", "compile")),
    Case("softmax_scale -inf", PD, "dense", put("softmax_scale", float("-inf")),
         Raises(ValueError, "softmax_scale must be finite, got -inf", "compile")),
    Case("kv_scale a Python float", PD, "dense", put("kv_scale", 1.0),
         Raises(RuntimeError, "Expected a value of type 'Tensor' for argument 'kv_scale'", "compile")),
    Case("kv_scale fp16", PD, "dense", put("kv_scale", torch.ones(1, dtype=torch.float16)),
         Raises(TypeError, "kv_scale must be a float32 tensor with one element, got dtype torch.float16", "compile")),
    Case("kv_scale with two elements", PD, "dense", put("kv_scale", torch.ones(2)),
         Raises(TypeError, "kv_scale must be a float32 tensor with one element, got dtype torch.float32 and shape (2,)",
                "compile")),
    Case("kv_scale float64", PD, "fp8", put("kv_scale", lambda a: a["kv_scale"].double()),
         Raises(TypeError, "kv_scale must be a float32 tensor with one element, got dtype torch.float64", "compile")),
    Case("sparse_indices int64", PD, "sparse", put("sparse_indices", lambda a: a["sparse_indices"].long()),
         Raises(TypeError, "sparse_indices must have dtype int32, got torch.int64", "compile")),
    Case("sparse_indices for 3 rows of 2", PD, "sparse", put("sparse_indices", lambda a: a["sparse_indices"].repeat(2, 1)[:3]),
         Raises(ValueError, "sparse_indices must be [T=2, K], got shape (3, 4)", "compile")),
    Case("sparse_indices 1-D", PD, "sparse", put("sparse_indices", lambda a: a["sparse_indices"][0]),
         Raises(ValueError, "sparse_indices must be a 2-D tensor [T, K]", "compile")),
    Case("q_scale fp16", PD, "dense", put("q_scale", torch.ones(1, dtype=torch.float16)),
         Raises(TypeError, "q_scale must be a float32 tensor with one element, got dtype torch.float16", "compile")),
    Case("q_scale with two elements", PD, "dense", put("q_scale", torch.ones(2)),
         Raises(TypeError, "q_scale must be a float32 tensor with one element, got dtype torch.float32 and shape (2,)",
                "compile")),

    # --- values: checked on every CPU call, eager and compiled (GPU: MLA_INDUCTOR_DEBUG=1)
    Case("seq_len 21 > capacity 20", PD, "dense", at("seq_lens", 1, 21),
         Raises(ValueError, "seq_lens must lie in [0, max_pages * page_size = 20], got min 5, max 21", "run")),
    Case("seq_len 10**6", PD, "dense", at("seq_lens", 0, 10**6),
         Raises(ValueError, "seq_lens must lie in [0, max_pages * page_size = 20], got min 9, max 1000000", "run")),
    Case("seq_len -1", PD, "dense", at("seq_lens", 0, -1),
         Raises(ValueError, "seq_lens must lie in [0, max_pages * page_size = 20], got min -1, max 9", "run")),
    Case("seq_len -2**31", PD, "dense", at("seq_lens", 1, -2**31),
         Raises(ValueError, "seq_lens must lie in [0, max_pages * page_size = 20], got min -2147483648", "run")),
    Case("used page id = num_pages", PD, "dense", at("block_table", (1, 2), 8),
         Raises(ValueError, "block_table entries of used pages must lie in [0, num_pages=8), got min", "run")),
    Case("used page id -1", PD, "dense", at("block_table", (0, 0), -1),
         Raises(ValueError, "block_table entries of used pages must lie in [0, num_pages=8), got min -1", "run")),
    Case("used page id 2**31-1", PD, "dense", at("block_table", (1, 0), 2**31 - 1),
         Raises(ValueError, "block_table entries of used pages must lie in [0, num_pages=8), got min", "run")),
    Case("used page id 2147480000 (the peers' unused-entry value)", PD, "dense", at("block_table", (0, 1), 2147480000),
         Raises(ValueError, "block_table entries of used pages must lie in [0, num_pages=8)", "run")),
    Case("kv_scale NaN", PD, "dense", put("kv_scale", torch.full((1,), float("nan"))),
         Raises(ValueError, "kv_scale must be finite and positive, got nan", "run")),
    Case("kv_scale 0", PD, "dense", put("kv_scale", torch.zeros(1)),
         Raises(ValueError, "kv_scale must be finite and positive, got 0.0", "run")),
    Case("kv_scale -1", PD, "dense", put("kv_scale", -torch.ones(1)),
         Raises(ValueError, "kv_scale must be finite and positive, got -1.0", "run")),
    Case("kv_scale inf", PD, "dense", put("kv_scale", torch.full((1,), float("inf"))),
         Raises(ValueError, "kv_scale must be finite and positive, got inf", "run")),
    Case("fp8 cache, kv_scale NaN", PD, "fp8", put("kv_scale", torch.full((1,), float("nan"))),
         Raises(ValueError, "kv_scale must be finite and positive, got nan", "run")),
    Case("fp8 cache, kv_scale 0", PD, "fp8", put("kv_scale", torch.zeros(1)),
         Raises(ValueError, "kv_scale must be finite and positive, got 0.0", "run")),
    Case("fp8 cache, kv_scale -inf", PD, "fp8", put("kv_scale", torch.full((1,), float("-inf"))),
         Raises(ValueError, "kv_scale must be finite and positive, got -inf", "run")),
    Case("q_scale NaN", PD, "dense", put("q_scale", torch.full((1,), float("nan"))),
         Raises(ValueError, "q_scale must be finite and positive, got nan", "run")),
    Case("q_scale 0", PD, "dense", put("q_scale", torch.zeros(1)),
         Raises(ValueError, "q_scale must be finite and positive, got 0.0", "run")),
    Case("sparse slot = P * page_size", PD, "sparse", at("sparse_indices", (0, 0), 32),
         Raises(ValueError, "sparse_indices must be -1 or a slot in [0, P * page_size = 32), got min", "run")),
    Case("sparse slot -2", PD, "sparse", at("sparse_indices", (1, 3), -2),
         Raises(ValueError, "sparse_indices must be -1 or a slot in [0, P * page_size = 32), got min -2", "run")),
    Case("sparse slot 2**31-1", PD, "sparse", at("sparse_indices", (1, 0), 2**31 - 1),
         Raises(ValueError, "sparse_indices must be -1 or a slot in [0, P * page_size = 32), got min", "run")),
    Case("sparse call, seq_len 21 > capacity 20", PD, "sparse", at("seq_lens", 0, 21),
         Raises(ValueError, "seq_lens must lie in [0, max_pages * page_size = 20]", "run")),
    Case("sparse call, kv_scale NaN", PD, "sparse", put("kv_scale", torch.full((1,), float("nan"))),
         Raises(ValueError, "kv_scale must be finite and positive, got nan", "run")),
    Case("Q=2 per sequence, seq_len 21 > capacity", PD, "mtp", at("seq_lens", 1, 21),
         Raises(ValueError, "seq_lens must lie in [0, max_pages * page_size = 20]", "run")),
    Case("Q=2 per sequence, used page id 99", PD, "mtp", at("block_table", (1, 1), 99),
         Raises(ValueError, "block_table entries of used pages must lie in [0, num_pages=8)", "run")),

    # --- valid calls at the edges of the contract: the documented result
    Case("unused block-table entries -1", PD, "dense", unused_entries(-1), Returns("the contract's result")),
    Case("unused block-table entries 2147480000 (the peers' value)", PD, "dense", unused_entries(2147480000),
         Returns("the contract's result")),
    Case("unused block-table entries -7", PD, "dense", unused_entries(-7), Returns("the contract's result")),
    Case("unused block-table entries = num_pages", PD, "dense", unused_entries(8), Returns("the contract's result")),
    Case("unused block-table entries 2**31-1", PD, "dense", unused_entries(2**31 - 1), Returns("the contract's result")),
    Case("seq_len = capacity (20)", PD, "dense", fill_to_capacity(1), Returns("the contract's result")),
    Case("one sequence of length 0", PD, "dense", at("seq_lens", 0, 0), Returns("its row: out 0, lse -inf")),
    Case("every sequence of length 0", PD, "dense", put("seq_lens", lambda a: torch.zeros(2, dtype=I32)),
         Returns("out 0, lse -inf")),
    Case("Q=2 per sequence, seq_len 1 (the first row sees nothing)", PD, "mtp", at("seq_lens", 0, 1),
         Returns("that row: out 0, lse -inf; the other the contract's")),
    Case("sparse row of -1 only", PD, "sparse", at("sparse_indices", 0, -1), Returns("its row: out 0, lse -inf")),
    Case("sparse rows of -1 only", PD, "sparse", put("sparse_indices", lambda a: torch.full((2, 4), -1, dtype=I32)),
         Returns("out 0, lse -inf")),
    Case("sparse slot listed twice in a row", PD, "sparse", at("sparse_indices", (1, 1), 8),
         Returns("the contract's result: the slot counts twice")),
    Case("sparse K=0", PD, "sparse", put("sparse_indices", lambda a: a["sparse_indices"][:, :0]),
         Returns("out 0, lse -inf")),
    Case("zero-width block table [2, 0], lengths 0", PD, "dense",
         both(put("block_table", lambda a: a["block_table"][:, :0]), put("seq_lens", torch.zeros(2, dtype=I32))),
         Returns("out 0, lse -inf")),
    Case("zero-width block table [2, 0], lengths 5 and 9", PD, "dense", put("block_table", lambda a: a["block_table"][:, :0]),
         Raises(ValueError, "seq_lens must lie in [0, max_pages * page_size = 0], got min 5, max 9", "run")),
    Case("cache of 0 pages, lengths 0", PD, "dense",
         both(put("kv_cache", lambda a: a["kv_cache"][:0]), put("seq_lens", torch.zeros(2, dtype=I32))),
         Returns("out 0, lse -inf")),
    Case("empty batch: B=0, T=0", PD, "dense", batch_of_zero, Returns("empty outputs [0, H, L], [0, H]", "empty")),
    Case("T=0 rows for B=2 sequences", PD, "dense",
         both(put("q_nope", lambda a: a["q_nope"][:0]), put("q_pe", lambda a: a["q_pe"][:0])),
         Returns("empty outputs [0, H, L], [0, H]", "empty")),
    Case("softmax_scale 1e38", PD, "dense", put("softmax_scale", 1e38),
         Returns("the limit: one-hot softmax; lse inf where it exceeds float32")),
    Case("softmax_scale -1e38", PD, "dense", put("softmax_scale", -1e38),
         Returns("the limit: one-hot on the smallest logit")),
    Case("softmax_scale 0", PD, "dense", put("softmax_scale", 0.0), Returns("the mean of the visible latents")),
    Case("softmax_scale True", PD, "dense", put("softmax_scale", True),
         Returns("scale 1.0: PyTorch's dispatcher converts a bool to the float the schema asks for")),
    Case("q of magnitude 100", PD, "dense", both(put("q_nope", lambda a: a["q_nope"] * 100),
                                                 put("q_pe", lambda a: a["q_pe"] * 100)),
         Returns("the contract's result")),
    Case("page_size 1", PD, "page1", lambda a: None, Returns("the contract's result")),
    Case("page_size 1, seq_len 13 > capacity 12", PD, "page1", at("seq_lens", 1, 13),
         Raises(ValueError, "seq_lens must lie in [0, max_pages * page_size = 12], got min 5, max 13", "run")),
    Case("query rows strided (a view of every other row)", PD, "dense", query_rows_strided,
         Returns("the contract's result")),
    Case("cache pages strided (a view of larger pages)", PD, "dense", bigger_pages_view,
         Returns("the contract's result")),
    Case("q_scale 1 on a bf16 cache", PD, "dense", put("q_scale", torch.ones(1)),
         Returns("the contract's result (q as given)")),
    Case("NaN in the last page past seq_len", PD, "dense", poison(tail_of_last_page),
         Returns("the contract's result: memory a call does not attend is never read")),
    Case("NaN in unused pages that unused block-table entries name", PD, "dense",
         both(unused_entries_name_spare_pages, poison(unused_pages)),
         Returns("the contract's result: memory a call does not attend is never read")),
    Case("NaN in every page no block-table entry names", PD, "dense", poison(unused_pages),
         Returns("the contract's result: memory a call does not attend is never read")),
    Case("NaN in the slot sparse -1 padding would clamp to (slot 0)", PD, "sparse",
         both(at("sparse_indices", (0, 3), -1), poison(slot_zero_unlisted)),
         Returns("the contract's result: memory a call does not attend is never read")),

    # --- cache_append
    Case("cache_append: kv_c 1-D", CA, "append", put("kv_c", lambda a: a["kv_c"][0]),
         Raises(ValueError, "kv_c must be a 2-D tensor [N, L]", "compile")),
    Case("cache_append: kv_c int32", CA, "append", put("kv_c", lambda a: a["kv_c"].int()),
         Raises(TypeError, "kv_c must have dtype float32, float16 or bfloat16, got torch.int32", "compile")),
    Case("cache_append: k_pe for 2 tokens of 3", CA, "append", put("k_pe", lambda a: a["k_pe"][:2]),
         Raises(ValueError, "k_pe must be [N=3, R] like kv_c, got shape (2, 16)", "compile")),
    Case("cache_append: k_pe 8 wide (cache rows 48 = 32 + 16)", CA, "append", put("k_pe", lambda a: a["k_pe"][:, :8]),
         Raises(ValueError, "kv_cache must be [P, page_size, L+R=40]", "compile")),
    Case("cache_append: slot_mapping float32", CA, "append", put("slot_mapping", lambda a: a["slot_mapping"].float()),
         Raises(TypeError, "slot_mapping must have dtype int32 or int64, got torch.float32", "compile")),
    Case("cache_append: slot_mapping for 2 tokens of 3", CA, "append",
         put("slot_mapping", lambda a: a["slot_mapping"][:2]),
         Raises(ValueError, "slot_mapping must be [N=3] (one slot per new token), got shape (2,)", "compile")),
    Case("cache_append: kv_cache strided", CA, "append", put("kv_cache", lambda a: a["kv_cache"].transpose(0, 1)),
         Raises(ValueError, "kv_cache must be contiguous (cache_append writes whole token rows)", "compile")),
    Case("cache_append: kv_scale fp16", CA, "append", put("kv_scale", torch.ones(1, dtype=torch.float16)),
         Raises(TypeError, "kv_scale must be a float32 tensor with one element", "compile")),
    Case("cache_append: slot = P * page_size", CA, "append", at("slot_mapping", 1, 8),
         Raises(ValueError, "slot_mapping must be -1 or a slot in [0, P * page_size = 8), got min 1, max 8", "run")),
    Case("cache_append: slot -2", CA, "append", at("slot_mapping", 0, -2),
         Raises(ValueError, "slot_mapping must be -1 or a slot in [0, P * page_size = 8), got min -2", "run")),
    Case("cache_append: kv_scale 0 (fp8 cache)", CA, "append_fp8", put("kv_scale", torch.zeros(1)),
         Raises(ValueError, "kv_scale must be finite and positive, got 0.0", "run")),
    Case("cache_append: kv_scale NaN (fp8 cache)", CA, "append_fp8", put("kv_scale", torch.full((1,), float("nan"))),
         Raises(ValueError, "kv_scale must be finite and positive, got nan", "run")),
    Case("cache_append: kv_scale -1 (fp8 cache)", CA, "append_fp8", put("kv_scale", -torch.ones(1)),
         Raises(ValueError, "kv_scale must be finite and positive, got -1.0", "run")),
    Case("cache_append: kv_scale inf (fp8 cache)", CA, "append_fp8", put("kv_scale", torch.full((1,), float("inf"))),
         Raises(ValueError, "kv_scale must be finite and positive, got inf", "run")),
    Case("cache_append: kv_scale NaN (fp32 cache, unread)", CA, "append", put("kv_scale", torch.full((1,), float("nan"))),
         Raises(ValueError, "kv_scale must be finite and positive, got nan", "run")),
    Case("cache_append: slot 6 listed twice (the CPU writer refuses it; unspecified on GPU)", CA, "append",
         at("slot_mapping", 2, 6),
         Raises(ValueError, "slot_mapping must list each slot at most once (-1 may repeat); slot 6 is listed 2 times",
                "run"), gpu_form=False),
    Case("cache_append: slot -1", CA, "append", at("slot_mapping", 1, -1),
         Returns("that token is skipped, the others written", "written")),
    Case("cache_append: no tokens (N=0)", CA, "append",
         both(put("kv_c", lambda a: a["kv_c"][:0]), put("k_pe", lambda a: a["k_pe"][:0]),
              put("slot_mapping", lambda a: a["slot_mapping"][:0])),
         Returns("nothing written", "written")),
    Case("cache_append: values past ±448 · kv_scale (fp8 cache)", CA, "append_fp8",
         put("kv_c", lambda a: a["kv_c"] * 1e6), Returns("rows written, saturated at ±448", "written")),
]
