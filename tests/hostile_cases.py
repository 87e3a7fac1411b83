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

Rows are made by a few builders (``refused``, ``refused_at_run``, ``holds``, and for the families that repeat
one edit over many arguments ``wrong_dtype``, ``wrong_rank``, ``strided``, ``bad_scale``), so that a row
says only what differs.
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
NAN, INF = float("nan"), float("inf")

# ----------------------------------------------------------------------------- rows


def refused(name, edit, error, text, at="compile", *, op=PD, base="dense", gpu_form=True) -> Case:
    """A call refused with ``error`` (message containing ``text``); compiled, ``at`` compile time or run time."""
    return Case(name, op, base, edit, Raises(error, text, at), gpu_form)


def refused_at_run(name, edit, text, *, op=PD, base="dense", gpu_form=True) -> Case:
    """A value only the call sees (not its shapes): ValueError on every CPU call, compiled when the graph runs."""
    return refused(name, edit, ValueError, text, "run", op=op, base=base, gpu_form=gpu_form)


def holds(name, edit, what, check="oracle", *, op=PD, base="dense") -> Case:
    """A valid call at an edge of the contract, giving ``what`` (checked as ``check`` says)."""
    return Case(name, op, base, edit, Returns(what, check))


def _case_name(op, name):
    return f"cache_append: {name}" if op == CA else name


def wrong_dtype(arg, dtype, text, *, op=PD, base="dense") -> Case:
    """``arg`` converted to ``dtype``: a TypeError at compile time."""
    name = _case_name(op, f"{arg} {str(dtype).removeprefix('torch.')}")
    return refused(name, put(arg, lambda a: a[arg].to(dtype)), TypeError, text, op=op, base=base)


def wrong_rank(arg, ndim, text, *, op=PD, base="dense") -> Case:
    """``arg`` with ``ndim`` dimensions, one fewer (its first entry) or one more (a leading 1): a ValueError
    at compile time."""
    def edit(a):
        a[arg] = a[arg][0] if ndim < a[arg].dim() else a[arg][None]
    return refused(_case_name(op, f"{arg} {ndim}-D"), edit, ValueError, text, op=op, base=base)


def strided(arg) -> Case:
    """``arg`` strided in its last dimension: a ValueError at compile time."""
    return refused(f"{arg} strided in its last dim", strided_last_dim(arg), ValueError,
                   f"{arg} must be contiguous in its last dimension")


def bad_scale(name, arg, value: float, *, op=PD, base="dense") -> Case:
    """The one-element scale ``arg`` holding ``value`` (NaN, 0, negative or infinite): refused when it is read."""
    return refused_at_run(name, put(arg, torch.full((1,), value)), f"{arg} must be finite and positive, got {value}",
                          op=op, base=base)


# ----------------------------------------------------------------------------- the table

SEQ_LENS_RANGE = "seq_lens must lie in [0, max_pages * page_size = 20]"
USED_PAGES_RANGE = "block_table entries of used pages must lie in [0, num_pages=8)"
SPARSE_SLOTS_RANGE = "sparse_indices must be -1 or a slot in [0, P * page_size = 32), got min"
APPEND_SLOTS_RANGE = "slot_mapping must be -1 or a slot in [0, P * page_size = 8), got min"
CACHE_DTYPES = "kv_cache must have dtype float32, float16, bfloat16, float8_e4m3fn or uint8"
SCALE_DTYPE = "{} must be a float32 tensor with one element, got dtype torch.{}"
ATTENDED = "the contract's result"
NEVER_READ = "the contract's result: memory a call does not attend is never read"
NOTHING_SEEN = "out 0, lse -inf"
EMPTY = "empty outputs [0, H, L], [0, H]"

CASES: list[Case] = [
    # --- shapes, dtypes, devices, layouts: refused by the checks the fake impls run, so at compile time
    wrong_rank("q_nope", 2, "q_nope must be a 3-D tensor [T, H, L]"),
    wrong_rank("q_nope", 4, "q_nope must be a 3-D tensor [T, H, L]"),
    wrong_dtype("q_nope", torch.int32, "q_nope must have dtype float32, float16 or bfloat16, got torch.int32"),
    wrong_dtype("q_nope", torch.float64, "q_nope must have dtype float32, float16 or bfloat16, got torch.float64"),
    refused("q_nope a Python float", put("q_nope", 1.0), RuntimeError,
            "Expected a value of type 'Tensor' for argument 'q_nope'"),
    refused("q_pe fp16 with fp32 q_nope", put("q_pe", lambda a: a["q_pe"].half()), TypeError,
            "q_pe must have q_nope's dtype torch.float32, got torch.float16"),
    refused("q_pe with fewer heads", put("q_pe", lambda a: a["q_pe"][:, :1]), ValueError,
            "q_pe must be [T=2, H=3, R] like q_nope, got shape (2, 1, 16)"),
    refused("q_pe with fewer rows", put("q_pe", lambda a: a["q_pe"][:1]), ValueError,
            "q_pe must be [T=2, H=3, R] like q_nope, got shape (1, 3, 16)"),
    wrong_rank("q_pe", 2, "q_pe must be a 3-D tensor [T, H, R]"),
    strided("q_nope"),
    strided("q_pe"),
    refused("kv_cache rows 40 wide (L+R=48)", put("kv_cache", lambda a: a["kv_cache"][..., :40]), ValueError,
            "bad query shape for kv_cache rows of L+R=40 values (latent | rope): q_nope [T, H, L] and q_pe [T, H, R] "
            "must have L + R = 40, got q_nope L=32, q_pe R=16 (L + R = 48); kv_cache shape (8, 4, 40)"),
    wrong_dtype("kv_cache", torch.float64, CACHE_DTYPES),
    wrong_dtype("kv_cache", torch.int32, CACHE_DTYPES),
    wrong_rank("kv_cache", 2, "kv_cache must be a 3-D tensor [P, page_size, L+R]"),
    refused("uint8 (fp8_ds_mla) cache with L=32", put("kv_cache", torch.zeros(8, 4, 656, dtype=torch.uint8)),
            ValueError, "bad query shape for a uint8 (fp8_ds_mla) kv_cache, whose rows hold L=512 latent and R=64 "
            "rope values: q_nope must be [T, H, 512] and q_pe [T, H, 64], got q_nope L=32, q_pe R=16"),
    strided("kv_cache"),
    refused("kv_cache on another device (meta)", put("kv_cache", lambda a: a["kv_cache"].to("meta")), ValueError,
            "kv_cache must be on cpu like q_nope, got meta"),
    wrong_dtype("block_table", torch.int64, "block_table must have dtype int32, got torch.int64"),
    wrong_dtype("block_table", torch.float32, "block_table must have dtype int32, got torch.float32"),
    wrong_rank("block_table", 1, "block_table must be a 2-D tensor [B, max_pages]"),
    wrong_dtype("seq_lens", torch.int64, "seq_lens must have dtype int32, got torch.int64"),
    wrong_rank("seq_lens", 2, "seq_lens must be a 1-D tensor [B]"),
    refused("seq_lens for one sequence of two", put("seq_lens", lambda a: a["seq_lens"][:1]), ValueError,
            "seq_lens must be [B=2] (one length per block_table row), got shape (1,)"),
    refused("T=3 rows for B=2 sequences",
            both(put("q_nope", lambda a: a["q_nope"].repeat(2, 1, 1)[:3]),
                 put("q_pe", lambda a: a["q_pe"].repeat(2, 1, 1)[:3])),
            ValueError, "q_nope's T=3 must be a positive multiple of the batch size B=2"),
    refused("B=0 with T=2 query rows",
            both(put("block_table", lambda a: a["block_table"][:0]), put("seq_lens", lambda a: a["seq_lens"][:0])),
            ValueError, "q_nope's T=2 must be 0 when the batch is empty (B=0)"),
    refused("softmax_scale a string", put("softmax_scale", "0.1"), RuntimeError, "for argument 'softmax_scale'"),
    *[refused(f"softmax_scale {shown}", put("softmax_scale", value), ValueError,
              f"softmax_scale must be finite, got {value}")
      for shown, value in (("NaN", NAN), ("inf", INF), ("-inf", -INF))],
    refused("kv_scale a Python float", put("kv_scale", 1.0), TypeError,
            "kv_scale must be a float32 tensor with one element (1.0 unless the cache is fp8: torch.ones(1) on "
            "q_nope's device), got float 1.0"),
    refused("kv_scale fp16", put("kv_scale", torch.ones(1, dtype=torch.float16)), TypeError,
            SCALE_DTYPE.format("kv_scale", "float16")),
    refused("kv_scale with two elements", put("kv_scale", torch.ones(2)), TypeError,
            SCALE_DTYPE.format("kv_scale", "float32") + " and shape (2,)"),
    wrong_dtype("kv_scale", torch.float64, SCALE_DTYPE.format("kv_scale", "float64"), base="fp8"),
    wrong_dtype("sparse_indices", torch.int64, "sparse_indices must have dtype int32, got torch.int64", base="sparse"),
    refused("sparse_indices for 3 rows of 2", put("sparse_indices", lambda a: a["sparse_indices"].repeat(2, 1)[:3]),
            ValueError, "sparse_indices must be [T=2, K], got shape (3, 4)", base="sparse"),
    wrong_rank("sparse_indices", 1, "sparse_indices must be a 2-D tensor [T, K]", base="sparse"),
    refused("q_scale fp16", put("q_scale", torch.ones(1, dtype=torch.float16)), TypeError,
            SCALE_DTYPE.format("q_scale", "float16")),
    refused("q_scale with two elements", put("q_scale", torch.ones(2)), TypeError,
            SCALE_DTYPE.format("q_scale", "float32") + " and shape (2,)"),

    # --- values: checked on every CPU call, eager and compiled (GPU: MLA_INDUCTOR_DEBUG=1)
    refused_at_run("seq_len 21 > capacity 20", at("seq_lens", 1, 21), f"{SEQ_LENS_RANGE}, got min 5, max 21"),
    refused_at_run("seq_len 10**6", at("seq_lens", 0, 10**6), f"{SEQ_LENS_RANGE}, got min 9, max 1000000"),
    refused_at_run("seq_len -1", at("seq_lens", 0, -1), f"{SEQ_LENS_RANGE}, got min -1, max 9"),
    refused_at_run("seq_len -2**31", at("seq_lens", 1, -2**31), f"{SEQ_LENS_RANGE}, got min -2147483648"),
    refused_at_run("used page id = num_pages", at("block_table", (1, 2), 8), f"{USED_PAGES_RANGE}, got min"),
    refused_at_run("used page id -1", at("block_table", (0, 0), -1), f"{USED_PAGES_RANGE}, got min -1"),
    refused_at_run("used page id 2**31-1", at("block_table", (1, 0), 2**31 - 1), f"{USED_PAGES_RANGE}, got min"),
    refused_at_run("used page id 2147480000 (the peers' unused-entry value)", at("block_table", (0, 1), 2147480000),
                   USED_PAGES_RANGE),
    bad_scale("kv_scale NaN", "kv_scale", NAN),
    bad_scale("kv_scale 0", "kv_scale", 0.0),
    bad_scale("kv_scale -1", "kv_scale", -1.0),
    bad_scale("kv_scale inf", "kv_scale", INF),
    bad_scale("fp8 cache, kv_scale NaN", "kv_scale", NAN, base="fp8"),
    bad_scale("fp8 cache, kv_scale 0", "kv_scale", 0.0, base="fp8"),
    bad_scale("fp8 cache, kv_scale -inf", "kv_scale", -INF, base="fp8"),
    bad_scale("q_scale NaN", "q_scale", NAN),
    bad_scale("q_scale 0", "q_scale", 0.0),
    refused_at_run("sparse slot = P * page_size", at("sparse_indices", (0, 0), 32), SPARSE_SLOTS_RANGE, base="sparse"),
    refused_at_run("sparse slot -2", at("sparse_indices", (1, 3), -2), f"{SPARSE_SLOTS_RANGE} -2", base="sparse"),
    refused_at_run("sparse slot 2**31-1", at("sparse_indices", (1, 0), 2**31 - 1), SPARSE_SLOTS_RANGE, base="sparse"),
    refused_at_run("sparse call, seq_len 21 > capacity 20", at("seq_lens", 0, 21), SEQ_LENS_RANGE, base="sparse"),
    bad_scale("sparse call, kv_scale NaN", "kv_scale", NAN, base="sparse"),
    refused_at_run("Q=2 per sequence, seq_len 21 > capacity", at("seq_lens", 1, 21), SEQ_LENS_RANGE, base="mtp"),
    refused_at_run("Q=2 per sequence, used page id 99", at("block_table", (1, 1), 99), USED_PAGES_RANGE, base="mtp"),

    # --- valid calls at the edges of the contract: the documented result
    holds("unused block-table entries -1", unused_entries(-1), ATTENDED),
    holds("unused block-table entries 2147480000 (the peers' value)", unused_entries(2147480000), ATTENDED),
    holds("unused block-table entries -7", unused_entries(-7), ATTENDED),
    holds("unused block-table entries = num_pages", unused_entries(8), ATTENDED),
    holds("unused block-table entries 2**31-1", unused_entries(2**31 - 1), ATTENDED),
    holds("seq_len = capacity (20)", fill_to_capacity(1), ATTENDED),
    holds("one sequence of length 0", at("seq_lens", 0, 0), "its row: out 0, lse -inf"),
    holds("every sequence of length 0", put("seq_lens", lambda a: torch.zeros(2, dtype=I32)), NOTHING_SEEN),
    holds("Q=2 per sequence, seq_len 1 (the first row sees nothing)", at("seq_lens", 0, 1),
          "that row: out 0, lse -inf; the other the contract's", base="mtp"),
    holds("sparse row of -1 only", at("sparse_indices", 0, -1), "its row: out 0, lse -inf", base="sparse"),
    holds("sparse rows of -1 only", put("sparse_indices", lambda a: torch.full((2, 4), -1, dtype=I32)), NOTHING_SEEN,
          base="sparse"),
    holds("sparse slot listed twice in a row", at("sparse_indices", (1, 1), 8),
          "the contract's result: the slot counts twice", base="sparse"),
    holds("sparse K=0", put("sparse_indices", lambda a: a["sparse_indices"][:, :0]), NOTHING_SEEN, base="sparse"),
    holds("zero-width block table [2, 0], lengths 0",
          both(put("block_table", lambda a: a["block_table"][:, :0]), put("seq_lens", torch.zeros(2, dtype=I32))),
          NOTHING_SEEN),
    refused_at_run("zero-width block table [2, 0], lengths 5 and 9",
                   put("block_table", lambda a: a["block_table"][:, :0]),
                   "seq_lens must lie in [0, max_pages * page_size = 0], got min 5, max 9"),
    holds("cache of 0 pages, lengths 0",
          both(put("kv_cache", lambda a: a["kv_cache"][:0]), put("seq_lens", torch.zeros(2, dtype=I32))), NOTHING_SEEN),
    holds("empty batch: B=0, T=0", batch_of_zero, EMPTY, "empty"),
    holds("T=0 rows for B=2 sequences",
          both(put("q_nope", lambda a: a["q_nope"][:0]), put("q_pe", lambda a: a["q_pe"][:0])), EMPTY, "empty"),
    holds("softmax_scale 1e38", put("softmax_scale", 1e38),
          "the limit: one-hot softmax; lse inf where it exceeds float32"),
    holds("softmax_scale -1e38", put("softmax_scale", -1e38), "the limit: one-hot on the smallest logit"),
    holds("softmax_scale 0", put("softmax_scale", 0.0), "the mean of the visible latents"),
    holds("softmax_scale True", put("softmax_scale", True),
          "scale 1.0: PyTorch's dispatcher converts a bool to the float the schema asks for"),
    holds("q of magnitude 100",
          both(put("q_nope", lambda a: a["q_nope"] * 100), put("q_pe", lambda a: a["q_pe"] * 100)), ATTENDED),
    holds("page_size 1", lambda a: None, ATTENDED, base="page1"),
    refused_at_run("page_size 1, seq_len 13 > capacity 12", at("seq_lens", 1, 13),
                   "seq_lens must lie in [0, max_pages * page_size = 12], got min 5, max 13", base="page1"),
    holds("query rows strided (a view of every other row)", query_rows_strided, ATTENDED),
    holds("cache pages strided (a view of larger pages)", bigger_pages_view, ATTENDED),
    holds("q_scale 1 on a bf16 cache", put("q_scale", torch.ones(1)), "the contract's result (q as given)"),
    holds("NaN in the last page past seq_len", poison(tail_of_last_page), NEVER_READ),
    holds("NaN in unused pages that unused block-table entries name",
          both(unused_entries_name_spare_pages, poison(unused_pages)), NEVER_READ),
    holds("NaN in every page no block-table entry names", poison(unused_pages), NEVER_READ),
    holds("NaN in the slot sparse -1 padding would clamp to (slot 0)",
          both(at("sparse_indices", (0, 3), -1), poison(slot_zero_unlisted)), NEVER_READ, base="sparse"),

    # --- cache_append
    wrong_rank("kv_c", 1, "kv_c must be a 2-D tensor [N, L]", op=CA, base="append"),
    wrong_dtype("kv_c", torch.int32, "kv_c must have dtype float32, float16 or bfloat16, got torch.int32",
                op=CA, base="append"),
    refused("cache_append: k_pe for 2 tokens of 3", put("k_pe", lambda a: a["k_pe"][:2]), ValueError,
            "k_pe must be [N=3, R] like kv_c, got shape (2, 16)", op=CA, base="append"),
    refused("cache_append: k_pe 8 wide (cache rows 48 = 32 + 16)", put("k_pe", lambda a: a["k_pe"][:, :8]), ValueError,
            "kv_cache must be [P, page_size, L+R=40]", op=CA, base="append"),
    wrong_dtype("slot_mapping", torch.float32, "slot_mapping must have dtype int32 or int64, got torch.float32",
                op=CA, base="append"),
    refused("cache_append: slot_mapping for 2 tokens of 3", put("slot_mapping", lambda a: a["slot_mapping"][:2]),
            ValueError, "slot_mapping must be [N=3] (one slot per new token), got shape (2,)", op=CA, base="append"),
    refused("cache_append: kv_cache strided", put("kv_cache", lambda a: a["kv_cache"].transpose(0, 1)), ValueError,
            "kv_cache must be contiguous (cache_append writes whole token rows)", op=CA, base="append"),
    refused("cache_append: kv_scale fp16", put("kv_scale", torch.ones(1, dtype=torch.float16)), TypeError,
            "kv_scale must be a float32 tensor with one element", op=CA, base="append"),
    refused_at_run("cache_append: slot = P * page_size", at("slot_mapping", 1, 8), f"{APPEND_SLOTS_RANGE} 1, max 8",
                   op=CA, base="append"),
    refused_at_run("cache_append: slot -2", at("slot_mapping", 0, -2), f"{APPEND_SLOTS_RANGE} -2",
                   op=CA, base="append"),
    *[bad_scale(f"cache_append: kv_scale {shown} (fp8 cache)", "kv_scale", value, op=CA, base="append_fp8")
      for shown, value in (("0", 0.0), ("NaN", NAN), ("-1", -1.0), ("inf", INF))],
    bad_scale("cache_append: kv_scale NaN (fp32 cache, unread)", "kv_scale", NAN, op=CA, base="append"),
    refused_at_run("cache_append: slot 6 listed twice (the CPU writer refuses it; unspecified on GPU)",
                   at("slot_mapping", 2, 6),
                   "slot_mapping must list each slot at most once (-1 may repeat); slot 6 is listed 2 times",
                   op=CA, base="append", gpu_form=False),
    holds("cache_append: slot -1", at("slot_mapping", 1, -1), "that token is skipped, the others written", "written",
          op=CA, base="append"),
    holds("cache_append: no tokens (N=0)",
          both(put("kv_c", lambda a: a["kv_c"][:0]), put("k_pe", lambda a: a["k_pe"][:0]),
               put("slot_mapping", lambda a: a["slot_mapping"][:0])),
          "nothing written", "written", op=CA, base="append"),
    holds("cache_append: values past ±448 · kv_scale (fp8 cache)", put("kv_c", lambda a: a["kv_c"] * 1e6),
          "rows written, saturated at ±448", "written", op=CA, base="append_fp8"),
]
