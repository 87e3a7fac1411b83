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

``SCENARIOS`` (at the end, apart from the op calls) adds stateful misuse of the caches and of ``generate()``:
each runs its calls itself and checks that a refusal changed nothing.

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
MERGE_ARGS = ("out_a", "lse_a", "out_b", "lse_b")
MERGE_N_ARGS = ("outs", "lses")
ARG_NAMES = {"paged_decode_with_lse": DECODE_ARGS, "paged_decode": DECODE_ARGS, "cache_append": APPEND_ARGS,
             "merge_attn_states": MERGE_ARGS, "merge_attn_states_n": MERGE_N_ARGS}
SMALL = dict(num_heads=3, kv_lora_rank=32, rope_dim=16, page_size=4, q_dtype=torch.float32, max_pages=5)
# The valid calls the cases edit: two sequences (5 and 9 tokens) in 4-token pages, a 5-entry block table
# (capacity 20; unused entries -1), a bf16 cache of 8 pages, fp32 queries, H=3, L=32, R=16.
BASES = {
    "dense": dict(seq_lens=[5, 9]),
    "sparse": dict(seq_lens=[5, 9], topk=4),
    "fp8": dict(seq_lens=[5, 9], fmt="fp8_e4m3"),
    "mtp": dict(seq_lens=[5, 9], q_per_seq=2),
    "page1": dict(seq_lens=[5, 9], page_size=1, max_pages=12),  # 12 one-token pages per sequence
    # Other formats, head counts, page sizes, dtypes and lengths (each a valid call of its own).
    "ds": dict(seq_lens=[5, 9], fmt="fp8_ds_mla", kv_lora_rank=512, rope_dim=64),
    "ds_sparse": dict(seq_lens=[5, 9], fmt="fp8_ds_mla", kv_lora_rank=512, rope_dim=64, topk=4),
    "fp8_sparse": dict(seq_lens=[5, 9], fmt="fp8_e4m3", topk=4),
    "h1": dict(seq_lens=[5, 9], num_heads=1),
    "h7": dict(seq_lens=[5, 9], num_heads=7),
    "h128": dict(seq_lens=[3, 2], num_heads=128, max_pages=2),
    "page3": dict(seq_lens=[5, 9], page_size=3, max_pages=4),
    "page16": dict(seq_lens=[5, 9], page_size=16, max_pages=2),
    "bf16q": dict(seq_lens=[5, 9], q_dtype=torch.bfloat16),
    "fp16q": dict(seq_lens=[5, 9], q_dtype=torch.float16, fmt="fp16"),
    "fp32cache": dict(seq_lens=[5, 9], fmt="fp32"),
    "mtp3": dict(seq_lens=[5, 9], q_per_seq=3),
    "long": dict(seq_lens=[70, 130], max_pages=40),  # several 64-position chunks
    "b1": dict(seq_lens=[7]),
    "b16": dict(seq_lens=list(range(1, 17)), max_pages=4),
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
    if base.startswith("merge"):
        return merge_args(base)
    if base == "append_ds":  # fp8_ds_mla: 656-byte rows, L=512, R=64
        g = torch.Generator().manual_seed(1)
        return dict(kv_cache=torch.zeros(APPEND_PAGES, APPEND_PAGE_SIZE, 656, dtype=torch.uint8),
                    kv_c=torch.randn(3, 512, generator=g), k_pe=torch.randn(3, 64, generator=g),
                    slot_mapping=torch.tensor([1, 6, 3], dtype=torch.int32), kv_scale=torch.ones(1))
    if base.startswith("append"):
        fp8 = base == "append_fp8"
        cache = torch.zeros(APPEND_PAGES, APPEND_PAGE_SIZE, 48, dtype=torch.float8_e4m3fn if fp8 else torch.float32)
        g = torch.Generator().manual_seed(1)
        return dict(kv_cache=cache, kv_c=torch.randn(3, 32, generator=g), k_pe=torch.randn(3, 16, generator=g),
                    slot_mapping=torch.tensor([1, 6, 3], dtype=torch.int32),
                    kv_scale=torch.full((1,), 0.02) if fp8 else torch.ones(1))
    x = make_decode_inputs(**{**SMALL, **BASES[base]})
    return dict(zip(DECODE_ARGS, (*x.args(), None)))


def merge_args(base: str) -> dict:
    """Two (``merge``) or three (``merge_n``) partial results of T=2 rows, H=3 heads, L=8, fp32, finite lse."""
    g = torch.Generator().manual_seed(2)
    parts = 3 if base == "merge_n" else 2
    outs, lses = torch.randn(parts, 2, 3, 8, generator=g), torch.randn(parts, 2, 3, generator=g) * 3
    if base == "merge_n":
        return dict(outs=outs, lses=lses)
    return dict(out_a=outs[0], lse_a=lses[0], out_b=outs[1], lse_b=lses[1])


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
    """NaN in cache rows the call does not attend (``slots_of(args)`` lists them); 0xFF bytes (NaN in e4m3, in
    the tile scales and in the bf16 rope) in a uint8 (fp8_ds_mla) cache."""
    def edit(a):
        cache = a["kv_cache"].clone()
        flat = cache.view(-1, cache.shape[-1])
        for slot in slots_of(a):
            flat[slot] = 0xFF if cache.dtype == torch.uint8 else float("nan")
        a["kv_cache"] = cache
    return edit


def nan_in_attended_row(a):
    """NaN in the first cache row of sequence 1 (attended by its rows only)."""
    cache = a["kv_cache"].clone()
    page = int(a["block_table"][1, 0])
    cache[page, 0, 0] = float("nan")
    a["kv_cache"] = cache


def shared_first_page(a):
    """Sequence 1's first page is sequence 0's (a shared prefix)."""
    table = a["block_table"].clone()
    table[1, 0] = table[0, 0]
    a["block_table"] = table


def page_listed_twice(a):
    """Sequence 1 lists its first page again as its second (its keys count at both positions)."""
    table = a["block_table"].clone()
    table[1, 1] = table[1, 0]
    a["block_table"] = table


def wide_block_table(a):
    """The block table as a column slice of a 64-column table (unused columns -1): strided rows."""
    table = a["block_table"]
    wide = torch.full((table.shape[0], 64), -1, dtype=table.dtype)
    wide[:, :table.shape[1]] = table
    a["block_table"] = wide[:, :table.shape[1]]


def strided_seq_lens(a):
    a["seq_lens"] = torch.stack([a["seq_lens"], a["seq_lens"]], dim=1)[:, 0]


def heads_broadcast(a):
    """q_nope and q_pe as one head expanded over H (stride 0 in the head dimension)."""
    for name in ("q_nope", "q_pe"):
        a[name] = a[name][:, :1].expand_as(a[name])


def rows_broadcast(a):
    """Every query row the same memory (stride 0 in T)."""
    for name in ("q_nope", "q_pe"):
        a[name] = a[name][:1].expand_as(a[name])


def overlapping_pages(a):
    """A cache whose pages overlap in memory: page p starts one row after page p-1 (as_strided)."""
    cache = a["kv_cache"]
    P, page, W = cache.shape
    storage = torch.randn(P + page, W, generator=torch.Generator().manual_seed(4)).to(cache.dtype)
    a["kv_cache"] = storage.as_strided((P, page, W), (W, W, 1))


def all_slots_listed(a):
    a["sparse_indices"] = torch.arange(32, dtype=torch.int32).repeat(2, 1)


def sparse_padding_first(a):
    idx = a["sparse_indices"].clone()
    a["sparse_indices"] = torch.cat([torch.full_like(idx[:, :2], -1), idx[:, :2]], dim=1)


def merge_lse(name, index, value):
    """Set one lse entry (in a copy)."""
    return at(name, index, value)


def merge_out(name, index, value):
    """Set one output row (in a copy)."""
    def edit(a):
        a[name] = a[name].clone()
        a[name][index] = value
    return edit


def both_outs(fn):
    def edit(a):
        a["out_a"], a["out_b"] = fn(a["out_a"]), fn(a["out_b"])
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


def on_meta(arg, value=None, *, base="dense") -> Case:
    """``arg`` on the meta device (another device than q_nope's): a ValueError at compile time."""
    return refused(f"{arg} on another device (meta)", put(arg, value or (lambda a: a[arg].to("meta"))), ValueError,
                   f"{arg} must be on cpu like q_nope, got meta", base=base)


def merge_refused(name, edit, error, text, *, n=False) -> Case:
    """A merge call refused at compile time (the merge ops have no value checks)."""
    op = "merge_attn_states_n" if n else "merge_attn_states"
    return refused(f"{op}: {name}", edit, error, text, op=op, base="merge_n" if n else "merge")


def merge_holds(name, edit, what, *, n=False) -> Case:
    """A valid merge call, checked against the float64 merge oracle (tests/test_hostile.py)."""
    op = "merge_attn_states_n" if n else "merge_attn_states"
    return Case(f"{op}: {name}", op, "merge_n" if n else "merge", edit, Returns(what, "merge"))


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
SCALE_NOT_FLOAT = "softmax_scale must be a Python float, got a tensor"
MERGED = "the merge of the parts"
WRITTEN = "rows written as listed"

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


    # --- more refusals: devices, dtypes, ranks, widths, other formats and sizes; softmax_scale not a float
    refused("softmax_scale a 0-d tensor", put("softmax_scale", torch.tensor(0.1)), TypeError, SCALE_NOT_FLOAT),
    refused("softmax_scale a one-element tensor", put("softmax_scale", torch.tensor([0.1])), TypeError,
            SCALE_NOT_FLOAT),
    refused("softmax_scale None", put("softmax_scale", None), RuntimeError, "for argument 'softmax_scale'"),
    *[on_meta(arg) for arg in ("q_pe", "block_table", "seq_lens", "kv_scale")],
    on_meta("q_scale", lambda a: torch.ones(1, device="meta")),
    on_meta("sparse_indices", base="sparse"),
    wrong_dtype("block_table", torch.int16, "block_table must have dtype int32, got torch.int16"),
    wrong_dtype("seq_lens", torch.int16, "seq_lens must have dtype int32, got torch.int16"),
    wrong_dtype("seq_lens", torch.uint8, "seq_lens must have dtype int32, got torch.uint8"),
    wrong_dtype("sparse_indices", torch.float32, "sparse_indices must have dtype int32, got torch.float32",
                base="sparse"),
    wrong_dtype("q_pe", torch.float64, "q_pe must have q_nope's dtype torch.float32, got torch.float64"),
    wrong_rank("block_table", 3, "block_table must be a 2-D tensor [B, max_pages]"),
    wrong_rank("kv_cache", 4, "kv_cache must be a 3-D tensor [P, page_size, L+R]"),
    wrong_rank("sparse_indices", 3, "sparse_indices must be a 2-D tensor [T, K]", base="sparse"),
    refused("q_pe 24 wide (the cache's rope is 16)", put("q_pe", lambda a: torch.cat([a["q_pe"], a["q_pe"][..., :8]], -1)),
            ValueError, "bad query shape for kv_cache rows of L+R=48 values (latent | rope): q_nope [T, H, L] and "
            "q_pe [T, H, R] must have L + R = 48, got q_nope L=32, q_pe R=24"),
    refused("q_nope 16 wide (the cache's latent is 32)", put("q_nope", lambda a: a["q_nope"][..., :16]), ValueError,
            "bad query shape for kv_cache rows of L+R=48 values (latent | rope): q_nope [T, H, L] and q_pe [T, H, R] "
            "must have L + R = 48, got q_nope L=16, q_pe R=16"),
    refused("fp8_ds_mla rows of 640 bytes", put("kv_cache", lambda a: a["kv_cache"][..., :640].contiguous()),
            ValueError, "kv_cache in fp8_ds_mla format must be [P, page_size, 656] uint8, got shape (8, 4, 640)",
            base="ds"),
    bad_scale("fp8_ds_mla cache, kv_scale NaN (unread)", "kv_scale", NAN, base="ds"),
    bad_scale("kv_scale -0.0", "kv_scale", -0.0),
    bad_scale("q_scale -1", "q_scale", -1.0),
    bad_scale("q_scale inf", "q_scale", INF),
    refused_at_run("fp8_ds_mla cache, seq_len 21 > capacity 20", at("seq_lens", 1, 21), SEQ_LENS_RANGE, base="ds"),
    refused_at_run("fp8_ds_mla cache, used page id 8", at("block_table", (0, 1), 8), USED_PAGES_RANGE, base="ds"),
    refused_at_run("fp8_ds_mla sparse call, slot 32", at("sparse_indices", (1, 2), 32), SPARSE_SLOTS_RANGE,
                   base="ds_sparse"),
    refused_at_run("fp8 sparse call, slot -5", at("sparse_indices", (0, 0), -5), f"{SPARSE_SLOTS_RANGE} -5",
                   base="fp8_sparse"),
    refused_at_run("Q=3 per sequence, seq_len 21 > capacity", at("seq_lens", 0, 21), SEQ_LENS_RANGE, base="mtp3"),
    refused_at_run("page_size 3, seq_len 13 > capacity 12", at("seq_lens", 1, 13),
                   "seq_lens must lie in [0, max_pages * page_size = 12], got min 5, max 13", base="page3"),
    refused_at_run("page_size 16, used page id 5 = num_pages", at("block_table", (1, 0), 5),
                   "block_table entries of used pages must lie in [0, num_pages=5)", base="page16"),
    refused_at_run("H=7, seq_len -1", at("seq_lens", 0, -1), f"{SEQ_LENS_RANGE}, got min -1", base="h7"),
    refused_at_run("B=16, seq_len 17 > capacity 16", at("seq_lens", 3, 17),
                   "seq_lens must lie in [0, max_pages * page_size = 16], got min 1, max 17", base="b16"),
    refused_at_run("long sequences, used page id -1 in the 21st entry", at("block_table", (1, 20), -1),
                   "block_table entries of used pages must lie in [0, num_pages=54), got min -1", base="long"),
    refused("paged_decode: q_nope int32", put("q_nope", lambda a: a["q_nope"].int()), TypeError,
            "q_nope must have dtype float32, float16 or bfloat16, got torch.int32", op="paged_decode"),
    refused("paged_decode: softmax_scale a 0-d tensor", put("softmax_scale", torch.tensor(0.1)), TypeError,
            SCALE_NOT_FLOAT, op="paged_decode"),
    refused_at_run("paged_decode: seq_len 21 > capacity 20", at("seq_lens", 1, 21), SEQ_LENS_RANGE,
                   op="paged_decode"),
    bad_scale("paged_decode: kv_scale 0", "kv_scale", 0.0, op="paged_decode"),

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


    # --- more valid calls: non-finite values where they are attended, shared and repeated pages, strided and
    # overlapping layouts, other formats, head counts, page sizes, dtypes, lengths and batch sizes
    holds("NaN in q_nope (row 0, head 0)", at("q_nope", (0, 0, 0), NAN), "NaN in that row and head's out and lse "
          "only"),
    holds("NaN in an attended cache row (sequence 1)", nan_in_attended_row,
          "NaN in the rows that attend it (sequence 1) only"),
    holds("a page shared by both sequences (prefix sharing)", shared_first_page, ATTENDED),
    holds("a page listed twice in one sequence's table", page_listed_twice, "the contract's result: its keys count "
          "at both positions"),
    holds("block table a column slice of a 64-column table", wide_block_table, ATTENDED),
    holds("seq_lens a strided view", strided_seq_lens, ATTENDED),
    holds("q broadcast over heads (stride 0)", heads_broadcast, ATTENDED),
    holds("q broadcast over rows (stride 0)", rows_broadcast, ATTENDED),
    holds("cache pages overlapping in memory (as_strided)", overlapping_pages, ATTENDED),
    holds("softmax_scale -0.1", put("softmax_scale", -0.1), ATTENDED),
    holds("softmax_scale 1e-30", put("softmax_scale", 1e-30), "the mean of the visible latents, to rounding"),
    holds("softmax_scale an int (2)", put("softmax_scale", 2), "scale 2.0: PyTorch's dispatcher converts an int to "
          "the float the schema asks for"),
    holds("q_scale 0.5 on a bf16 cache", put("q_scale", torch.full((1,), 0.5)), "the contract's result (q as given)"),
    holds("sparse: every slot of the cache listed (K=32)", all_slots_listed, ATTENDED, base="sparse"),
    holds("sparse: -1 padding before the listed slots", sparse_padding_first, ATTENDED, base="sparse"),
    holds("sparse: both rows list one slot only", put("sparse_indices", lambda a: torch.full((2, 4), 5, dtype=I32)),
          "the contract's result: one key four times", base="sparse"),
    holds("fp8 cache: NaN bytes in every page no block-table entry names", poison(unused_pages), NEVER_READ,
          base="fp8"),
    holds("fp8_ds_mla cache", lambda a: None, ATTENDED, base="ds"),
    holds("fp8_ds_mla cache: 0xFF bytes in every page no block-table entry names", poison(unused_pages), NEVER_READ,
          base="ds"),
    holds("fp8_ds_mla cache: 0xFF bytes in the last page past seq_len", poison(tail_of_last_page), NEVER_READ,
          base="ds"),
    holds("fp8_ds_mla sparse call", lambda a: None, ATTENDED, base="ds_sparse"),
    holds("fp8_ds_mla sparse call: 0xFF bytes in every page no block-table entry names", poison(unused_pages),
          NEVER_READ, base="ds_sparse"),
    holds("fp8 sparse call", lambda a: None, ATTENDED, base="fp8_sparse"),
    holds("H=1 head", lambda a: None, ATTENDED, base="h1"),
    holds("H=7 heads", lambda a: None, ATTENDED, base="h7"),
    holds("H=128 heads", lambda a: None, ATTENDED, base="h128"),
    holds("page_size 3", lambda a: None, ATTENDED, base="page3"),
    holds("page_size 16 (the cache smaller than a chunk)", lambda a: None, ATTENDED, base="page16"),
    holds("bf16 query on a bf16 cache", lambda a: None, ATTENDED, base="bf16q"),
    holds("fp16 query on an fp16 cache", lambda a: None, ATTENDED, base="fp16q"),
    holds("fp32 cache", lambda a: None, ATTENDED, base="fp32cache"),
    holds("Q=3 per sequence", lambda a: None, ATTENDED, base="mtp3"),
    holds("Q=3 per sequence, seq_len 2 (the first row sees nothing)", at("seq_lens", 0, 2),
          "that row: out 0, lse -inf; the others the contract's", base="mtp3"),
    holds("sequences of 70 and 130 tokens (several chunks)", lambda a: None, ATTENDED, base="long"),
    holds("sequences of 70 and 130 tokens, the first of length 0", at("seq_lens", 0, 0), "its row: out 0, lse -inf",
          base="long"),
    holds("one sequence (B=1)", lambda a: None, ATTENDED, base="b1"),
    holds("B=16 sequences of lengths 1..16", lambda a: None, ATTENDED, base="b16"),
    holds("B=16, every other sequence empty", put("seq_lens", lambda a: a["seq_lens"] * (torch.arange(16, dtype=I32) % 2)),
          "the empty ones: out 0, lse -inf", base="b16"),
    holds("paged_decode: a valid call", lambda a: None, ATTENDED, op="paged_decode"),
    holds("paged_decode: every sequence of length 0", put("seq_lens", lambda a: torch.zeros(2, dtype=I32)), "out 0",
          op="paged_decode"),
    holds("paged_decode: softmax_scale 1e38", put("softmax_scale", 1e38), "the limit: one-hot softmax",
          op="paged_decode"),
    holds("paged_decode: fp8_ds_mla cache", lambda a: None, ATTENDED, op="paged_decode", base="ds"),

    # --- merge_attn_states(_n): argument errors at compile time, and every lse the decode op returns
    merge_refused("out_a 2-D", put("out_a", lambda a: a["out_a"][0]), ValueError,
                  "out_a must be a 3-D tensor [T, H, L], got shape (3, 8)"),
    merge_refused("out_a int32", put("out_a", lambda a: a["out_a"].int()), TypeError,
                  "out_a must have dtype float32, float16 or bfloat16, got torch.int32"),
    merge_refused("out_b float64", put("out_b", lambda a: a["out_b"].double()), TypeError,
                  "out_b must have dtype float32, float16 or bfloat16, got torch.float64"),
    merge_refused("out_b bf16 with fp32 out_a", put("out_b", lambda a: a["out_b"].bfloat16()), ValueError,
                  "out_b must match out_a's shape (2, 3, 8) and dtype torch.float32, got (2, 3, 8) torch.bfloat16"),
    merge_refused("out_b with fewer heads", put("out_b", lambda a: a["out_b"][:, :2]), ValueError,
                  "out_b must match out_a's shape (2, 3, 8) and dtype torch.float32, got (2, 2, 8)"),
    merge_refused("out_b on another device (meta)", put("out_b", lambda a: a["out_b"].to("meta")), ValueError,
                  "out_b must be on cpu like out_a, got meta"),
    merge_refused("lse_a float64", put("lse_a", lambda a: a["lse_a"].double()), TypeError,
                  "lse_a must have dtype float32 (natural-log LSE), got torch.float64"),
    merge_refused("lse_b bf16", put("lse_b", lambda a: a["lse_b"].bfloat16()), TypeError,
                  "lse_b must have dtype float32 (natural-log LSE), got torch.bfloat16"),
    merge_refused("lse_a [T, H, 1]", put("lse_a", lambda a: a["lse_a"][..., None]), ValueError,
                  "lse_a must be [T, H] = [2, 3], got shape (2, 3, 1)"),
    merge_refused("lse_b for one row of two", put("lse_b", lambda a: a["lse_b"][:1]), ValueError,
                  "lse_b must be [T, H] = [2, 3], got shape (1, 3)"),
    merge_refused("lse_a on another device (meta)", put("lse_a", lambda a: a["lse_a"].to("meta")), ValueError,
                  "lse_a must be on cpu like the outputs, got meta"),
    merge_refused("lse_a a Python float", put("lse_a", 0.0), RuntimeError,
                  "Expected a value of type 'Tensor' for argument 'lse_a'"),
    merge_refused("outs 3-D", put("outs", lambda a: a["outs"][0]), ValueError,
                  "outs must be a 4-D tensor [N, T, H, L], got shape (2, 3, 8)", n=True),
    merge_refused("outs int32", put("outs", lambda a: a["outs"].int()), TypeError,
                  "outs must have dtype float32, float16 or bfloat16, got torch.int32", n=True),
    merge_refused("no parts (N=0)", both(put("outs", lambda a: a["outs"][:0]), put("lses", lambda a: a["lses"][:0])),
                  ValueError, "outs must hold at least one part (N >= 1), got shape (0, 2, 3, 8)", n=True),
    merge_refused("lses for 2 parts of 3", put("lses", lambda a: a["lses"][:2]), ValueError,
                  "lses must be [N, T, H] = [3, 2, 3], got shape (2, 2, 3)", n=True),
    merge_refused("lses fp16", put("lses", lambda a: a["lses"].half()), TypeError,
                  "lses must have dtype float32 (natural-log LSE), got torch.float16", n=True),
    merge_refused("lses on another device (meta)", put("lses", lambda a: a["lses"].to("meta")), ValueError,
                  "lses must be on cpu like the outputs, got meta", n=True),
    merge_holds("finite lses", lambda a: None, MERGED),
    merge_holds("part a empty (lse -inf, out NaN)", both(put("lse_a", lambda a: torch.full_like(a["lse_a"], -INF)),
                                                         put("out_a", lambda a: torch.full_like(a["out_a"], NAN))),
                "part b as it is"),
    merge_holds("both parts empty (lse -inf)", both(put("lse_a", lambda a: torch.full_like(a["lse_a"], -INF)),
                                                    put("lse_b", lambda a: torch.full_like(a["lse_b"], -INF))),
                "out 0, lse -inf"),
    merge_holds("lse_b NaN in one entry (an empty part)", merge_lse("lse_b", (0, 1), NAN), "that entry: part a"),
    merge_holds("lse_a +inf in one entry (a huge softmax_scale)", merge_lse("lse_a", (1, 2), INF),
                "that entry: part a, lse +inf (it outweighs the finite part)"),
    merge_holds("lse_a and lse_b +inf in one entry", both(merge_lse("lse_a", (0, 0), INF),
                                                          merge_lse("lse_b", (0, 0), INF)),
                "that entry: the mean of both parts, lse +inf"),
    merge_holds("lse_a +inf, lse_b -inf with out_b NaN", both(merge_lse("lse_a", (1, 1), INF),
                                                              merge_lse("lse_b", (1, 1), -INF),
                                                              merge_out("out_b", (1, 1), NAN)),
                "that entry: part a, lse +inf"),
    merge_holds("lses 1e38 (huge, finite)", both(put("lse_a", lambda a: torch.full_like(a["lse_a"], 1e38)),
                                                 put("lse_b", lambda a: torch.full_like(a["lse_b"], 1e38))), MERGED),
    merge_holds("lses -1e38 (tiny, finite)", both(put("lse_a", lambda a: torch.full_like(a["lse_a"], -1e38)),
                                                  put("lse_b", lambda a: torch.full_like(a["lse_b"], -1e38))), MERGED),
    merge_holds("lse_a = lse_b + 200 (b's weight underflows)", put("lse_a", lambda a: a["lse_b"] + 200),
                "part a, to rounding"),
    merge_holds("NaN and inf in an empty part's output", both(merge_lse("lse_b", (0, 2), -INF),
                                                              merge_out("out_b", (0, 2, 0), NAN),
                                                              merge_out("out_b", (0, 2, 1), INF)),
                "that entry: part a (the empty part's output is never read)"),
    merge_holds("out_a a head-sliced view", put("out_a", lambda a: torch.cat([a["out_a"][:, :1], a["out_a"]], 1)[:, 1:]),
                MERGED),
    merge_holds("out_a strided in its last dim", strided_last_dim("out_a"), MERGED),
    merge_holds("lse_a in transposed storage", put("lse_a", lambda a: a["lse_a"].t().contiguous().t()), MERGED),
    merge_holds("bf16 outputs", both_outs(lambda t: t.bfloat16()), MERGED),
    merge_holds("fp16 outputs", both_outs(lambda t: t.half()), MERGED),
    merge_holds("T=0 rows", lambda a: a.update(out_a=a["out_a"][:0], lse_a=a["lse_a"][:0], out_b=a["out_b"][:0],
                                               lse_b=a["lse_b"][:0]), "empty outputs [0, H, L], [0, H]"),
    merge_holds("L=1", both_outs(lambda t: t[..., :1]), MERGED),
    merge_holds("three parts", lambda a: None, MERGED, n=True),
    merge_holds("one part (N=1)", both(put("outs", lambda a: a["outs"][:1]), put("lses", lambda a: a["lses"][:1])),
                "that part as it is", n=True),
    merge_holds("part 1 empty everywhere (lse -inf, out NaN)", both(merge_lse("lses", 1, -INF),
                                                                    merge_out("outs", 1, NAN)), MERGED, n=True),
    merge_holds("every part empty", put("lses", lambda a: torch.full_like(a["lses"], -INF)), "out 0, lse -inf",
                n=True),
    merge_holds("part 2 lse +inf in one entry", merge_lse("lses", (2, 1, 0), INF), "that entry: part 2, lse +inf",
                n=True),
    merge_holds("parts 0 and 2 lse +inf in one entry", both(merge_lse("lses", (0, 0, 0), INF),
                                                            merge_lse("lses", (2, 0, 0), INF)),
                "that entry: the mean of parts 0 and 2, lse +inf", n=True),
    merge_holds("NaN lse in part 0", merge_lse("lses", (0, 1, 1), NAN), "that entry: parts 1 and 2", n=True),
    merge_holds("outs a strided view (every other part of 6)",
                put("outs", lambda a: torch.stack([a["outs"], a["outs"]], 1).flatten(0, 1)[::2]), MERGED, n=True),
    merge_holds("lses in transposed storage", put("lses", lambda a: a["lses"].transpose(0, 2).contiguous()
                                                  .transpose(0, 2)), MERGED, n=True),
    merge_holds("bf16 outs", put("outs", lambda a: a["outs"].bfloat16()), MERGED, n=True),

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
    refused("cache_append: kv_scale on another device (meta)", put("kv_scale", torch.ones(1, device="meta")),
            ValueError, "kv_scale must be on cpu like kv_cache, got meta", op=CA, base="append"),
    *[refused(f"cache_append: {arg} on another device (meta)", put(arg, lambda a, arg=arg: a[arg].to("meta")),
              ValueError, f"{arg} must be on cpu like kv_cache, got meta", op=CA, base="append")
      for arg in ("kv_c", "k_pe", "slot_mapping")],
    refused("cache_append: kv_scale a Python float", put("kv_scale", 1.0), RuntimeError,
            "Expected a value of type 'Tensor' for argument 'kv_scale'", op=CA, base="append"),
    refused("cache_append: kv_scale with two elements", put("kv_scale", torch.ones(2)), TypeError,
            SCALE_DTYPE.format("kv_scale", "float32") + " and shape (2,)", op=CA, base="append"),
    wrong_dtype("slot_mapping", torch.int16, "slot_mapping must have dtype int32 or int64, got torch.int16",
                op=CA, base="append"),
    wrong_rank("slot_mapping", 2, "slot_mapping must be a 1-D tensor [N]", op=CA, base="append"),
    wrong_dtype("kv_cache", torch.float64, CACHE_DTYPES, op=CA, base="append"),
    wrong_rank("kv_cache", 2, "kv_cache must be a 3-D tensor [P, page_size, L+R]", op=CA, base="append"),
    wrong_dtype("k_pe", torch.int32, "k_pe must have dtype float32, float16 or bfloat16, got torch.int32",
                op=CA, base="append"),
    wrong_rank("k_pe", 1, "k_pe must be a 2-D tensor [N, R]", op=CA, base="append"),
    refused("cache_append: uint8 (fp8_ds_mla) cache with L=32", put("kv_cache", torch.zeros(2, 4, 656, dtype=torch.uint8)),
            ValueError, "a uint8 (fp8_ds_mla) kv_cache needs L=512 and R=64, got L=32, R=16", op=CA, base="append"),
    refused("cache_append: fp8_ds_mla cache, kv_c 256 wide", put("kv_c", lambda a: a["kv_c"][:, :256]), ValueError,
            "a uint8 (fp8_ds_mla) kv_cache needs L=512 and R=64, got L=256, R=64", op=CA, base="append_ds"),
    refused_at_run("cache_append: slot 2**31-1", at("slot_mapping", 0, 2**31 - 1),
                   f"{APPEND_SLOTS_RANGE} 3, max 2147483647", op=CA, base="append"),
    refused_at_run("cache_append: int64 slot 2**40", put("slot_mapping", torch.tensor([1, 2**40, 3])),
                   f"{APPEND_SLOTS_RANGE} 1, max 1099511627776", op=CA, base="append"),
    bad_scale("cache_append: kv_scale NaN (fp8_ds_mla cache, unread)", "kv_scale", NAN, op=CA, base="append_ds"),
    holds("cache_append: slot_mapping int64", put("slot_mapping", lambda a: a["slot_mapping"].long()), WRITTEN,
          "written", op=CA, base="append"),
    holds("cache_append: every slot -1", put("slot_mapping", torch.full((3,), -1, dtype=I32)), "nothing written",
          "written", op=CA, base="append"),
    holds("cache_append: -1 listed twice", put("slot_mapping", torch.tensor([-1, -1, 3], dtype=I32)),
          "slot 3 written, the others skipped", "written", op=CA, base="append"),
    holds("cache_append: the last slot (7)", at("slot_mapping", 0, 7), WRITTEN, "written", op=CA, base="append"),
    holds("cache_append: kv_c and k_pe bf16 (fp32 cache)", both(put("kv_c", lambda a: a["kv_c"].bfloat16()),
                                                               put("k_pe", lambda a: a["k_pe"].bfloat16())),
          WRITTEN, "written", op=CA, base="append"),
    holds("cache_append: kv_c fp16, k_pe fp32", put("kv_c", lambda a: a["kv_c"].half()), WRITTEN, "written", op=CA,
          base="append"),
    holds("cache_append: kv_c bf16 into an fp8 cache", put("kv_c", lambda a: a["kv_c"].bfloat16()),
          "rows written, scaled by kv_scale", "written", op=CA, base="append_fp8"),
    holds("cache_append: kv_c rows strided (every other row)",
          put("kv_c", lambda a: torch.cat([a["kv_c"], a["kv_c"]], 0)[::2]), WRITTEN, "written", op=CA, base="append"),
    holds("cache_append: kv_c strided in its last dim", strided_last_dim("kv_c"), WRITTEN, "written", op=CA,
          base="append"),
    holds("cache_append: NaN and inf in kv_c (fp32 cache)", both(at("kv_c", (0, 0), NAN), at("kv_c", (1, 1), INF)),
          "written as they are", "written", op=CA, base="append"),
    holds("cache_append: ±inf into an fp8 cache", both(at("kv_c", (0, 0), INF), at("k_pe", (2, 3), -INF)),
          "saturated at ±448, the other values as they are", "written", op=CA, base="append_fp8"),
    holds("cache_append: NaN into an fp8 cache", at("kv_c", (1, 5), NAN), "NaN in that value only", "written", op=CA,
          base="append_fp8"),
    holds("cache_append: fp8_ds_mla cache", lambda a: None, "rows written: e4m3 tiles with their scales, bf16 rope",
          "written", op=CA, base="append_ds"),
    holds("cache_append: +inf into an fp8_ds_mla tile", at("kv_c", (0, 3), INF),
          "saturated at +448 · the tile's scale; the tile's other values keep theirs", "written", op=CA,
          base="append_ds"),
    holds("cache_append: -inf into an fp8_ds_mla tile", at("kv_c", (1, 200), -INF),
          "saturated at -448 · the tile's scale; the tile's other values keep theirs", "written", op=CA,
          base="append_ds"),
    holds("cache_append: NaN into an fp8_ds_mla tile", at("kv_c", (2, 511), NAN),
          "NaN in that value only; the tile's other values keep theirs", "written", op=CA, base="append_ds"),
    holds("cache_append: a whole fp8_ds_mla tile of +inf", at("kv_c", (0, slice(128, 256)), INF),
          "saturated (the tile's scale is the smallest)", "written", op=CA, base="append_ds"),
    holds("cache_append: an all-zero fp8_ds_mla tile", at("kv_c", (1, slice(0, 128)), 0.0), "zeros, not NaN",
          "written", op=CA, base="append_ds"),
    holds("cache_append: fp8_ds_mla cache, slot -1", at("slot_mapping", 1, -1), "that token is skipped, the others "
          "written", "written", op=CA, base="append_ds"),
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


# ============================================================================= stateful scenarios
# Misuse that no single op call shows: a cache's methods called with bad counts, indices or sizes, and
# generate() with a PagedMLACache past its capacity, with use_cache=False or with a stale cache. Each scenario
# runs the misuse itself and checks that a refusal left the cache as it was; tests/test_hostile.py checks the
# exception (or the result) and adds the rows to docs/reliability.md's table. ``compiled``: the scenario also
# runs with generate()'s decode steps (or our own decode loop) under torch.compile; host-side cache methods
# have no compiled form and run in one mode.


@dataclass(frozen=True)
class Scenario:
    name: str
    run: Callable[[bool], None]  # run(compiled)
    expect: Union[Raises, Returns]
    compiled: bool = True
    compiled_result: str = ""  # the compiled column where it differs from "the same, from the compiled step"


def _latent_cache(**overrides):
    from mla_inductor.cache import PagedLatentCache

    kw = dict(num_layers=1, batch_size=2, max_seq_len=8, kv_lora_rank=32, rope_dim=16, page_size=4)
    return PagedLatentCache.allocate(**{**kw, **overrides})


def _latent_state(cache) -> tuple:
    return (list(cache._host_lens), [list(p) for p in cache._host_pages], list(cache._free_pages),
            cache.seq_lens.tolist(), cache.block_table.tolist())


def _refused_call_changes_nothing(cache, call: Callable[[object], object]) -> Callable[[bool], None]:
    """A scenario: ``call(cache)`` on a cache holding [2, 3] tokens; where it raises, the cache must be as it
    was, and the next reserve must continue from the old lengths."""
    def run(compiled: bool) -> None:
        c = cache()
        c.reserve([2, 3])
        before = _latent_state(c)
        try:
            call(c)
        except Exception:
            assert _latent_state(c) == before, "a refused call changed the cache"
            c.reserve([1, 1])
            assert c.seq_lens.tolist() == [3, 4]
            raise
    return run


def cache_refuses(name, call, error, text, cache=_latent_cache) -> Scenario:
    return Scenario(name, _refused_call_changes_nothing(cache, call), Raises(error, text, "run"), compiled=False)


_TINY_MODEL = {}


def _tiny_hf():
    """test_hf's helpers and one tiny DeepSeek-V3 model (shared by the scenarios: compiled steps are reused)."""
    import test_hf

    if "model" not in _TINY_MODEL:
        _TINY_MODEL["model"] = test_hf.make_model("v3_yarn")
    return test_hf, _TINY_MODEL["model"]


def _generate(t, model, ids, mask, n, cache, compiled: bool, fullgraph: bool = True, **kwargs):
    if compiled:  # what generate() does by itself on GPU (its decode steps compiled), forced on CPU
        config = t.transformers.CompileConfig(fullgraph=fullgraph, mode="default")
        config._compile_all_devices = True
        kwargs["compile_config"] = config
    return t.hf_generate(model, ids, mask, n, past_key_values=cache, **kwargs)


def _generate_past_capacity(compiled: bool) -> None:
    t, model = _tiny_hf()
    ids, mask = t.left_padded_prompts(seed=31)
    cache = t.use_mla(model, batch=4, max_seq_len=t.PROMPT_LEN + 2)
    try:
        _generate(t, model, ids, mask, 6, cache, compiled)
    except ValueError:
        assert int(cache.seq_lens.max()) <= cache.max_seq_len
        raise


def _own_loop_past_capacity(compiled: bool) -> None:
    from mla_inductor import hf

    t, model = _tiny_hf()
    ids, mask = t.left_padded_prompts(seed=32)
    cache = t.use_mla(model, batch=4, max_seq_len=t.PROMPT_LEN + 1)
    step = torch.compile(hf.decode_one_token, fullgraph=True) if compiled else hf.decode_one_token
    with torch.no_grad():
        token = hf.prefill(model, ids, mask, cache=cache).argmax(-1)
        for _ in range(3):
            token = step(model, token, cache).argmax(-1)


def _without_use_cache(compiled: bool) -> None:
    t, model = _tiny_hf()
    ids, mask = t.left_padded_prompts(seed=33)
    cache = t.use_mla(model, batch=4)
    try:
        # (fullgraph=False: transformers' own forward does not trace whole without a cache in use)
        _generate(t, model, ids, mask, 3, cache, compiled, fullgraph=False, use_cache=False)
    except ValueError:
        assert cache.seq_lens.tolist() == mask.sum(-1).tolist()  # the prompt alone: the re-fed step is refused
        raise


def _stale_cache(compiled: bool) -> None:
    t, model = _tiny_hf()
    ids, mask = t.left_padded_prompts(seed=34)
    cache = t.use_mla(model, batch=4)
    _generate(t, model, ids, mask, 3, cache, compiled)
    held = cache.seq_lens.tolist()
    other, other_mask = t.left_padded_prompts(seed=35)
    try:
        _generate(t, model, other, other_mask, 3, cache, compiled)
    except ValueError:
        assert cache.seq_lens.tolist() == held
        raise


def _continued_cache(compiled: bool) -> None:
    t, model = _tiny_hf()
    ids, mask = t.left_padded_prompts(seed=36)
    cache = t.use_mla(model, batch=4)
    first = _generate(t, model, ids, mask, 3, cache, compiled)
    turn = torch.randint(1, t.VOCAB, (4, 2), generator=torch.Generator().manual_seed(37))
    conversation = torch.cat([first, turn], 1)
    conversation_mask = torch.cat([mask, torch.ones_like(conversation[:, mask.shape[1]:])], 1)
    got = _generate(t, model, conversation, conversation_mask, 3, cache, compiled)
    assert torch.equal(got, t.hf_generate(model, conversation, conversation_mask, 3))


RESERVE = "PagedLatentCache.reserve: "
RESET_RANGE = "PagedLatentCache.reset: batch_index must be None (every sequence) or in [0, batch_size=2), got "
AT_PROMPT = "the same, at the prompt (before any compiled step)"
PAST_CAPACITY = "PagedMLACache: a sequence would hold {} tokens, more than max_seq_len={}"

SCENARIOS = [
    cache_refuses("PagedLatentCache.reserve: one sequence past max_seq_len", lambda c: c.reserve([1, 9]), ValueError,
                  RESERVE + "sequence 1 would hold 12 tokens, more than max_seq_len allows"),
    cache_refuses("PagedLatentCache.reserve: out of pages", lambda c: c.reserve([3, 4]), RuntimeError,
                  "PagedLatentCache is out of pages: the reserve needs 2 more, 1 are free",
                  cache=lambda: _latent_cache(num_pages=3)),
    cache_refuses("PagedLatentCache.reserve(-1)", lambda c: c.reserve(-1), ValueError,
                  RESERVE + "num_tokens must be >= 0, got -1"),
    cache_refuses("PagedLatentCache.reserve([2, -3])", lambda c: c.reserve([2, -3]), ValueError,
                  RESERVE + "num_tokens[1] must be >= 0, got -3"),
    cache_refuses("PagedLatentCache.reserve(1.5)", lambda c: c.reserve(1.5), TypeError,
                  RESERVE + "num_tokens must be an int or one int per sequence, got float"),
    cache_refuses("PagedLatentCache.reserve([1, 1, 1]) on a batch of 2", lambda c: c.reserve([1, 1, 1]), ValueError,
                  RESERVE + "num_tokens must be an int or have 2 entries (one per sequence), got 3"),
    cache_refuses("PagedLatentCache.reset(-1)", lambda c: c.reset(-1), IndexError, RESET_RANGE + "-1"),
    cache_refuses("PagedLatentCache.reset(5) on a batch of 2", lambda c: c.reset(5), IndexError, RESET_RANGE + "5"),
    cache_refuses("PagedLatentCache.reset(1.0)", lambda c: c.reset(1.0), TypeError,
                  "PagedLatentCache.reset: batch_index must be an int, got float 1.0"),
    Scenario("PagedLatentCache.allocate(max_seq_len=-5)", lambda compiled: _latent_cache(max_seq_len=-5),
             Raises(ValueError, "PagedLatentCache.allocate: max_seq_len must be >= 1, got -5", "run"), compiled=False),
    Scenario("PagedLatentCache.allocate(num_pages=-1)", lambda compiled: _latent_cache(num_pages=-1),
             Raises(ValueError, "PagedLatentCache.allocate: num_pages must be >= 0, got -1", "run"), compiled=False),
    Scenario("generate() past PagedMLACache.max_seq_len", _generate_past_capacity,
             Raises(ValueError, PAST_CAPACITY.format(15, 14), "run")),
    Scenario("hf.decode_one_token past max_seq_len", _own_loop_past_capacity,
             Raises(ValueError, PAST_CAPACITY.format(14, 13), "run")),
    Scenario("generate(use_cache=False) with a PagedMLACache", _without_use_cache,
             Raises(ValueError, "PagedMLACache: the forward runs with use_cache=False", "run"),
             compiled_result="the same, at the first step (compiled without fullgraph)"),
    Scenario("generate() of a new prompt on a used cache without reset()", _stale_cache,
             Raises(ValueError, "call cache.reset() before generating for new prompts", "run"),
             compiled_result=AT_PROMPT),
    Scenario("generate() continuing a used cache (input spans the cached tokens)", _continued_cache,
             Returns("HF eager's tokens"), compiled_result="the same, decode steps compiled"),
]
