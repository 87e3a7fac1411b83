"""Many GPUs: decode context parallelism (DCP) and tensor parallelism (TP) for MLA on torch.distributed.

MLA keeps one latent KV "head" per token, shared by all query heads. Splitting heads across GPUs (TP)
therefore leaves every GPU holding the whole latent cache. DCP splits the *tokens* instead: token ``i``
of every sequence lives on rank ``(i // I) % N`` of an N-rank group (I = interleave size), so each rank
stores about 1/N of the cache and reads 1/N of it per step. Per layer (docs/distributed.md has the bytes):

1. all-gather the absorbed query over heads: every rank gets all N·h heads of its group ([T, N·h, L+R]);
2. local decode: ``mla.paged_decode_with_lse`` over this rank's tokens only ([T, N·h, L] and LSE);
3. exchange and merge, either
   - ``"a2a"`` (the default): one all-to-all of (output | LSE bits) by head block, then
     ``mla.merge_attn_states_n`` (one kernel): two collectives per layer in all, or
   - ``"ag_rs"`` (vLLM's default): all-gather the LSEs [N, T, N·h], rescale the local output by
     ``exp(lse_local - lse)``, reduce-scatter (sum) over heads -> [T, h, L]: three collectives, and the
     rescaling is a dozen small kernels unless the step is compiled (Inductor fuses them).

Everything is written with functional collectives, which ``torch.compile`` traces (no graph break) and
Inductor lowers; the eager path runs the same code.

Layout: a one-process paged cache with *virtual* pages of ``page_size * N`` tokens is split so that rank
r keeps ``page_size`` tokens of every virtual page, in order. All ranks share one block table (the
virtual page ids, which are the local page ids too) and one ``seq_lens`` (global lengths); a rank's
lengths follow from them on the device (``DCPLayout.local_lengths``). ``page_size % I == 0`` makes a
token's local page equal its virtual page.

TP x DCP (vLLM's arrangement, DCP inside the TP group): a TP group of ``tp`` ranks splits the heads,
``h = H / tp`` per rank; consecutive blocks of ``dcp`` ranks of it form the DCP groups, each holding one
copy of the cache split ``dcp`` ways. ``DCPLatentCache`` is ``PagedLatentCache`` split over a DCP group;
for Hugging Face models, ``shard_deepseek_attention_tp`` splits the attention by heads and
``mla_inductor.hf.DCPMLACache`` (a ``PagedMLACache`` split over a DCP group; it derives from transformers'
``Cache``, so it lives with the HF integration) is the cache to pass to ``model.generate`` / ``hf.decode_one_token``.

    dist.init_process_group("nccl")                        # torchrun --nproc-per-node 2 ...
    dcp = make_dcp_group(dcp_size=2, interleave=1, exchange="a2a")
    cache = DCPLatentCache.allocate(dcp, num_layers=61, batch_size=8, max_seq_len=131072, device="cuda")
    out = dcp_decode(q_nope, q_pe, cache.kv_caches[layer], cache.block_table, cache.seq_lens,
                     softmax_scale, cache.kv_scale, dcp)   # q: this rank's heads -> out [T, h, L]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from mla_inductor import _compat
from mla_inductor.backends._common import tensor_state
from mla_inductor.cache import (PagedLatentCache, cache_dtype, fp8_scale_for, host_lengths, register_host_lengths,
                                token_width)
from mla_inductor.contract import being_captured
from mla_inductor.merge import merge_weights

Tensor = torch.Tensor
EXCHANGES = ("ag_rs", "a2a")

__all__ = [
    "DCPGroup",
    "DCPLatentCache",
    "DCPLayout",
    "agreed_fp8_scale",
    "all_gather",
    "all_reduce_sum",
    "all_to_all",
    "check_kv_scale_agrees",
    "dcp_decode",
    "dcp_decode_with_lse",
    "local_decode_with_lse",
    "make_dcp_group",
    "reduce_scatter_sum",
    "shard_deepseek_attention_tp",
    "split_heads",
    "tp_head_range",
]


# --------------------------------------------------------------------------------------------------------
# Collectives (functional: traceable by torch.compile; the private torch API behind them is in _compat)


def all_gather(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    return _compat.all_gather_tensor(x.contiguous(), dim, group)


def reduce_scatter_sum(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Sum ``x`` over ranks and keep this rank's block of dim 0 (dim 0 = N blocks)."""
    return _compat.reduce_scatter_tensor_sum(x.contiguous(), 0, group)


def all_to_all(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Send block j of dim 0 to rank j; block i of the result came from rank i (dim 0 = N equal blocks)."""
    return _compat.all_to_all_equal_blocks(x.contiguous(), group)


def all_reduce_sum(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    return _compat.all_reduce_sum(x, group)


# --------------------------------------------------------------------------------------------------------
# Where tokens live


@dataclass(frozen=True)
class DCPLayout:
    """Token ``i`` of a sequence lives on rank ``(i // interleave) % world_size``, at local position
    ``(i // (interleave * world_size)) * interleave + i % interleave`` of that rank's part of the sequence.

    All methods are plain tensor arithmetic (no host sync), so they run inside a compiled step.
    """

    world_size: int
    rank: int
    interleave: int = 1

    def __post_init__(self):
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"DCPLayout: need 0 <= rank < world_size, got rank={self.rank}, "
                             f"world_size={self.world_size}")
        if self.interleave < 1:
            raise ValueError(f"DCPLayout: interleave must be >= 1, got {self.interleave}")

    def check_page_size(self, page_size: int) -> None:
        if page_size < 1 or page_size % self.interleave:
            raise ValueError(f"DCP: page_size ({page_size} tokens per rank per page) must be a positive multiple "
                             f"of the interleave size {self.interleave}")

    def owner(self, positions: Tensor) -> Tensor:
        return (positions // self.interleave) % self.world_size

    def local_position(self, positions: Tensor) -> Tensor:
        """Valid for positions this rank owns."""
        I, N = self.interleave, self.world_size
        return positions // (I * N) * I + positions % I

    def local_lengths(self, lengths: Tensor) -> Tensor:
        """How many of positions ``0 .. lengths-1`` this rank holds (lengths < 0 count as 0); same dtype."""
        I, N = self.interleave, self.world_size
        lengths = lengths.clamp_min(0)
        base = lengths // (I * N) * I
        return base + (lengths - base * N - self.rank * I).clamp(0, I)

    def local_slots(self, virtual_slots: Tensor, page_size: int) -> Tensor:
        """Slots of a one-process cache with pages of ``page_size * world_size`` tokens -> this rank's slots
        in its cache of ``page_size``-token pages; -1 for tokens of other ranks (and for -1 input)."""
        self.check_page_size(page_size)
        virtual_page = page_size * self.world_size
        slots = virtual_slots.long()
        page, offset = slots // virtual_page, slots % virtual_page
        mine = (slots >= 0) & (self.owner(offset) == self.rank)
        local = page * page_size + self.local_position(offset)
        return torch.where(mine, local, torch.full_like(local, -1)).to(virtual_slots.dtype)

    def shard_cache(self, kv_cache: Tensor) -> Tensor:
        """This rank's part [P, page_size, W] of a one-process cache [P, page_size * world_size, W]."""
        virtual_page = kv_cache.shape[1]
        if virtual_page % self.world_size:
            raise ValueError(f"DCP: a one-process cache's page ({virtual_page} tokens) must hold world_size="
                             f"{self.world_size} rank pages")
        self.check_page_size(virtual_page // self.world_size)
        offsets = torch.arange(virtual_page, device=kv_cache.device)
        return kv_cache[:, offsets[self.owner(offsets) == self.rank]].contiguous()


@dataclass(frozen=True)
class DCPGroup:
    """A process group running DCP: its layout (this rank, the group's size, the interleave size) and how
    partial results are exchanged (``"ag_rs"`` or ``"a2a"``, see the module docstring)."""

    group: dist.ProcessGroup
    layout: DCPLayout
    exchange: str = "a2a"

    def __post_init__(self):
        if self.exchange not in EXCHANGES:
            raise ValueError(f"DCPGroup: exchange must be one of {EXCHANGES}, got {self.exchange!r}")

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @classmethod
    def from_group(cls, group: Optional[dist.ProcessGroup] = None, *, interleave: int = 1,
                   exchange: str = "a2a") -> DCPGroup:
        """DCP over ``group`` (default: the whole world); for a device mesh pass ``mesh.get_group(dim)``."""
        group = dist.group.WORLD if group is None else group
        layout = DCPLayout(dist.get_world_size(group), dist.get_rank(group), interleave)
        return cls(group, layout, exchange)


def make_dcp_group(dcp_size: int, tp_group: Optional[dist.ProcessGroup] = None, *, interleave: int = 1,
                   exchange: str = "a2a") -> DCPGroup:
    """This rank's DCP group: consecutive blocks of ``dcp_size`` ranks of ``tp_group`` (default: the world).

    Every rank of ``tp_group`` must call it (it creates one process group per block, collectively).
    """
    tp_group = dist.group.WORLD if tp_group is None else tp_group
    ranks = dist.get_process_group_ranks(tp_group)
    if dcp_size < 1 or len(ranks) % dcp_size:
        raise ValueError(f"make_dcp_group: dcp_size={dcp_size} must divide the TP group's size {len(ranks)}")
    if dcp_size == len(ranks):
        return DCPGroup.from_group(tp_group, interleave=interleave, exchange=exchange)
    mine = None
    for start in range(0, len(ranks), dcp_size):
        group = dist.new_group(ranks[start:start + dcp_size])
        if dist.get_rank() in ranks[start:start + dcp_size]:
            mine = group
    return DCPGroup.from_group(mine, interleave=interleave, exchange=exchange)


# --------------------------------------------------------------------------------------------------------
# The decode path


class StepLengths:
    """This rank's lengths of a step, made once per ``seq_lens`` state in eager calls.

    Each layer's DCP call derives this rank's lengths from the global ``seq_lens``. Made afresh per call, they
    are a new tensor every layer: the backends' plan caches (keyed on the tensors' identity and version) then
    plan every layer again, and a backend planning on the host (FlashInfer) copies them from the device and
    waits. Here the first call of a step makes them, the step's other calls get the same tensor, and where
    ``seq_lens`` has a registered host copy (``register_host_lengths``; ``PagedLatentCache`` and the HF caches
    keep one) this rank's host copy is registered beside them. Traced steps and CUDA-graph captures compute
    them in the graph instead (a capture must read ``seq_lens`` at every replay).
    """

    def __init__(self) -> None:
        self._last: Optional[tuple] = None  # (seq_lens, its state, layout, local lengths)

    def of(self, layout: DCPLayout, seq_lens: Tensor) -> Tensor:
        if _compat.traced() or being_captured(seq_lens):
            return layout.local_lengths(seq_lens)
        state = tensor_state(seq_lens)
        last = self._last
        if last is not None and last[0] is seq_lens and last[1] == state and last[2] == layout:
            return last[3]
        local = layout.local_lengths(seq_lens)
        host = host_lengths(seq_lens)
        if host is not None:
            register_host_lengths(local, layout.local_lengths(host))
        self._last = (seq_lens, state, layout, local)
        return local


STEP_LENGTHS = StepLengths()


def local_decode_with_lse(q_nope: Tensor, q_pe: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                          softmax_scale: float, kv_scale: Tensor, layout: DCPLayout) -> tuple[Tensor, Tensor]:
    """One rank's part of a DCP decode, no communication: attention of every given head over this rank's
    tokens. q_nope [T, H, L], q_pe [T, H, R]; kv_cache this rank's shard; block_table [B, max_pages] and
    seq_lens [B] the global ones. Returns (out [T, H, L], lse [T, H]) of ``mla.paged_decode_with_lse``.

    With Q = T / B > 1 new tokens per sequence, row j sees global positions ``0 .. seq_lens - Q + j``; a
    rank's share of that prefix is not a causal suffix of its own tokens, so every row becomes a sequence
    of its own (block-table row repeated, its own local length).
    """
    B = block_table.shape[0]
    Q = q_nope.shape[0] // B
    if Q == 1:
        lengths, table = STEP_LENGTHS.of(layout, seq_lens), block_table
    else:
        offsets = torch.arange(1 - Q, 1, device=seq_lens.device, dtype=seq_lens.dtype)
        visible = (seq_lens[:, None] + offsets).reshape(B * Q)  # keys row b*Q + j sees: seq_lens - Q + j + 1
        lengths, table = layout.local_lengths(visible), block_table.repeat_interleave(Q, dim=0)
    return torch.ops.mla.paged_decode_with_lse(q_nope, q_pe, kv_cache, table, lengths, softmax_scale, kv_scale)


def _merge_by_all_gather_reduce_scatter(out: Tensor, lse: Tensor, dcp: DCPGroup) -> tuple[Tensor, Tensor]:
    """[T, N·h, L] partial out + [T, N·h] LSE of this rank -> this rank's h heads, merged over ranks."""
    N, rank = dcp.world_size, dcp.layout.rank
    T, H, L = out.shape
    # The merge's own weights (merge.merge_weights: its lse convention, +inf and -inf included).
    weights, merged_lse = merge_weights(all_gather(lse, 0, dcp.group).view(N, T, H).unbind(0))
    # An empty shard weighs 0 and its output is not read.
    weight = weights[rank]
    part = torch.where((weight == 0)[..., None], 0.0, out.float() * weight[..., None]).to(out.dtype)
    # Head block j goes to rank j: lay the blocks out along dim 0 so the collective scatters without a copy.
    h = H // N
    blocks = part.view(T, N, h, L).transpose(0, 1).reshape(N * T, h, L)
    return reduce_scatter_sum(blocks, dcp.group), merged_lse[:, rank * h:(rank + 1) * h].contiguous()


def _merge_by_all_to_all(out: Tensor, lse: Tensor, dcp: DCPGroup) -> tuple[Tensor, Tensor]:
    """Same result as ``_merge_by_all_gather_reduce_scatter``: one all-to-all of (out | lse bits) by head block."""
    N = dcp.world_size
    T, H, L = out.shape
    h = H // N
    # fp32 as 1 (fp32) or 2 (fp16/bf16) elements of out's dtype. The dtype view comes before the new last dim:
    # viewing lse[..., None] instead failed in Inductor (torch 2.11), which gave the size-1 dim stride 0.
    k = 4 // out.element_size()
    lse_bits = lse.contiguous().view(out.dtype).view(T, H, k)
    # One copy builds the send buffer [N, T, h, L + k]: head block j (for rank j) first, (out | lse) per head.
    blocks = torch.cat([out.view(T, N, h, L).transpose(0, 1), lse_bits.view(T, N, h, k).transpose(0, 1)], dim=-1)
    received = all_to_all(blocks.view(N * T, h, L + k), dcp.group).view(N, T, h, L + k)
    lse_bits = received[..., L:]
    if L % k:  # the fp32 view of the lse bits needs their offset and strides to be multiples of k elements
        lse_bits = lse_bits.contiguous()
    return torch.ops.mla.merge_attn_states_n(received[..., :L], lse_bits.view(torch.float32).view(N, T, h))


def dcp_decode_with_lse(q_nope: Tensor, q_pe: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                        softmax_scale: float, kv_scale: Tensor, dcp: DCPGroup) -> tuple[Tensor, Tensor]:
    """MLA decode with the KV cache split over ``dcp``'s ranks (the contract of ``mla.paged_decode_with_lse``
    for this rank's heads). q_nope [T, h, L], q_pe [T, h, R]: this rank's h heads (the same T rows on every
    rank); kv_cache: this rank's shard [P, page_size, W]; block_table [B, max_pages], seq_lens [B] int32:
    global, equal on every rank; kv_scale [1] fp32, equal on every rank. Returns (out [T, h, L], lse [T, h])."""
    layout = dcp.layout
    if layout.world_size == 1:
        return local_decode_with_lse(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, layout)
    L = q_nope.shape[-1]
    q = all_gather(torch.cat([q_nope, q_pe], dim=-1), 1, dcp.group)  # [T, N·h, L+R], one collective
    out, lse = local_decode_with_lse(q[..., :L], q[..., L:], kv_cache, block_table, seq_lens, softmax_scale,
                                     kv_scale, layout)
    if dcp.exchange == "a2a":
        return _merge_by_all_to_all(out, lse, dcp)
    return _merge_by_all_gather_reduce_scatter(out, lse, dcp)


def dcp_decode(q_nope: Tensor, q_pe: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
               softmax_scale: float, kv_scale: Tensor, dcp: DCPGroup) -> Tensor:
    """``dcp_decode_with_lse`` without the LSE: out [T, h, L]."""
    return dcp_decode_with_lse(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, dcp)[0]


# --------------------------------------------------------------------------------------------------------
# FP8 caches: one per-tensor scale for the whole (split) cache


def agreed_fp8_scale(local_values: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The per-tensor e4m3 ``kv_scale`` of the values of all ranks together (max |value| over the group),
    computed from this rank's values: every rank gets the same scale, the one a single process holding all
    values would pick (``cache.fp8_scale_for``)."""
    values = local_values.detach().float().reshape(-1)
    amax = values.abs().amax().reshape(1) if values.numel() else values.new_zeros(1)  # a rank may hold no token
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return fp8_scale_for(amax)


def check_kv_scale_agrees(kv_scale: Tensor, group: dist.ProcessGroup) -> None:
    """ValueError unless every rank of ``group`` holds the same ``kv_scale`` (one collective, eager)."""
    both = torch.cat([kv_scale.float().reshape(1), -kv_scale.float().reshape(1)])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if float(both[0]) != -float(both[1]):
        raise ValueError(f"DCP: kv_scale differs across ranks (from {-float(both[1])} to {float(both[0])}); an fp8 "
                         f"cache split over ranks needs one scale, e.g. from agreed_fp8_scale(values, group)")


# --------------------------------------------------------------------------------------------------------
# A paged latent cache split over a DCP group


class DCPLatentCache:
    """This rank's share of ``num_layers`` paged latent caches split over a DCP group.

    A drop-in for ``PagedLatentCache`` (``append``, ``decode``, ``reserve``, ``reset``, ``block_table``,
    ``seq_lens``, ``kv_scale``, ``kv_caches``...) for code that drives the ops itself (Hugging Face models:
    ``DCPMLACache``). ``block_table`` and ``seq_lens`` are the global ones, equal on every rank (every rank
    runs the same host-side allocator); ``kv_caches[layer]`` [num_pages, page_size, W] holds this rank's
    ``page_size`` tokens of every page of ``page_size * N`` tokens. ``reserve`` returns this rank's slots
    (-1 for tokens other ranks store); ``decode`` runs ``dcp_decode`` for this rank's heads.
    """

    def __init__(self, index: PagedLatentCache, kv_caches: list[Tensor], dcp: DCPGroup, page_size: int):
        self.index = index  # the one-process view: virtual pages of page_size * N tokens, global lengths
        self.kv_caches = kv_caches
        self.dcp = dcp
        self.page_size = page_size

    @classmethod
    def allocate(cls, dcp: DCPGroup, *, num_layers: int, batch_size: int, max_seq_len: int, kv_lora_rank: int = 512,
                 rope_dim: int = 64, page_size: int = 64, fmt: str = "bf16", num_pages: Optional[int] = None,
                 kv_scale: float = 1.0, device: torch.device | str = "cpu") -> DCPLatentCache:
        """Room for ``batch_size`` sequences of up to ``max_seq_len`` tokens, split over ``dcp``'s ranks.
        ``page_size``: tokens per page on each rank (a multiple of the interleave size); ``num_pages``: pages per
        rank (default: enough for every sequence at full length). fp8 caches: ``kv_scale`` must be the same on
        every rank (checked, one collective)."""
        N = dcp.world_size
        dcp.layout.check_page_size(page_size)
        index = PagedLatentCache.allocate(
            num_layers=0, batch_size=batch_size, max_seq_len=max_seq_len, kv_lora_rank=kv_lora_rank,
            rope_dim=rope_dim, page_size=page_size * N, fmt=fmt, num_pages=num_pages, kv_scale=kv_scale,
            device=device)
        if fmt.startswith("fp8"):
            check_kv_scale_agrees(index.kv_scale, dcp.group)
        pages = batch_size * -(-max_seq_len // (page_size * N)) if num_pages is None else num_pages
        width = token_width(fmt, kv_lora_rank, rope_dim)
        kv_caches = [torch.zeros(pages, page_size, width, dtype=cache_dtype(fmt), device=device)
                     for _ in range(num_layers)]
        for t in kv_caches:
            _compat.mark_static_address(t)
        return cls(index, kv_caches, dcp, page_size)

    block_table = property(lambda self: self.index.block_table)
    seq_lens = property(lambda self: self.index.seq_lens)
    kv_scale = property(lambda self: self.index.kv_scale)
    kv_lora_rank = property(lambda self: self.index.kv_lora_rank)
    rope_dim = property(lambda self: self.index.rope_dim)
    batch_size = property(lambda self: self.index.batch_size)

    def local_seq_lens(self) -> Tensor:
        """This rank's token count per sequence, int32 [B]."""
        return self.dcp.layout.local_lengths(self.seq_lens)

    def reserve(self, num_tokens: int | list[int]) -> Tensor:
        """Room for the next tokens of every sequence (as ``PagedLatentCache.reserve``); returns this rank's
        slot_mapping int32 [sum(num_tokens)], sequence-major, -1 where another rank stores the token."""
        return self.dcp.layout.local_slots(self.index.reserve(num_tokens), self.page_size)

    def reset(self, batch_index: Optional[int] = None) -> None:
        self.index.reset(batch_index)

    def append(self, layer: int, kv_c: Tensor, k_pe: Tensor, slot_mapping: Tensor) -> None:
        """Write the new tokens this rank stores (slot >= 0); every rank is given all new tokens."""
        torch.ops.mla.cache_append(self.kv_caches[layer], kv_c, k_pe, slot_mapping, self.kv_scale)

    def decode(self, layer: int, q_nope: Tensor, q_pe: Tensor, softmax_scale: float) -> Tensor:
        """Attention output [T, h, L] of this rank's h heads over the whole (split) cache of one layer."""
        return dcp_decode(q_nope, q_pe, self.kv_caches[layer], self.block_table, self.seq_lens, softmax_scale,
                          self.kv_scale, self.dcp)


# --------------------------------------------------------------------------------------------------------
# Tensor parallelism for HF DeepSeek-V2/V3 attention


def tp_head_range(num_heads: int, group: dist.ProcessGroup) -> tuple[int, int]:
    """The heads [start, stop) this rank computes when ``group`` splits ``num_heads`` heads evenly."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    if num_heads % tp:
        raise ValueError(f"TP: {num_heads} attention heads do not split evenly over {tp} ranks")
    per_rank = num_heads // tp
    return rank * per_rank, (rank + 1) * per_rank


class _AllReducedLinear(nn.Linear):
    """A row-parallel linear layer: this rank's slice of the input features, results summed over ``group``,
    bias (if any) added once after the sum."""

    def __init__(self, weight: Tensor, bias: Optional[Tensor], group: dist.ProcessGroup):
        super().__init__(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                         dtype=weight.dtype)
        with torch.no_grad():
            self.weight.copy_(weight)
            if bias is not None:
                self.bias.copy_(bias)
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        y = all_reduce_sum(nn.functional.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


def _head_rows(linear: nn.Linear, num_heads: int, start: int, stop: int) -> nn.Linear:
    """A column-parallel copy of ``linear``: the output rows of heads [start, stop)."""
    per_head = linear.out_features // num_heads
    weight = linear.weight.detach().view(num_heads, per_head, linear.in_features)[start:stop]
    shard = nn.Linear(linear.in_features, (stop - start) * per_head, bias=linear.bias is not None,
                      device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        shard.weight.copy_(weight.reshape(-1, linear.in_features))
        if linear.bias is not None:
            shard.bias.copy_(linear.bias.detach().view(num_heads, per_head)[start:stop].reshape(-1))
    return shard


def shard_deepseek_attention_tp(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    """Split every attention layer of an HF ``DeepseekV{2,3}ForCausalLM`` over ``group``'s ranks by heads, in place.

    Each rank keeps H/tp heads: the rows of ``q_proj`` / ``q_b_proj`` and ``kv_b_proj`` for its heads, the
    matching columns of ``o_proj``, whose result is summed over the group (all-reduce after o_proj). The
    latent projections (``q_a_proj``, ``kv_a_proj_with_mqa``) stay whole: every rank computes the shared
    latent. Call it on the same model (same weights) on every rank, before making its cache: a
    ``mla_inductor.hf.PagedMLACache`` (TP alone) or a ``DCPMLACache`` over a DCP group inside ``group``
    (TP x DCP). The rest of the model (MLP / MoE, embeddings) stays replicated.
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        raise TypeError(f"shard_deepseek_attention_tp: expected an HF DeepseekV2/V3ForCausalLM, got "
                        f"{type(model).__name__}")
    for layer in layers:
        attn = layer.self_attn
        if getattr(attn, "mla_tp_group", None) is not None:
            raise RuntimeError("shard_deepseek_attention_tp: this model's attention is already sharded")
        H = attn.num_heads
        start, stop = tp_head_range(H, group)
        if attn.q_lora_rank is None:
            attn.q_proj = _head_rows(attn.q_proj, H, start, stop)
        else:
            attn.q_b_proj = _head_rows(attn.q_b_proj, H, start, stop)
        attn.kv_b_proj = _head_rows(attn.kv_b_proj, H, start, stop)
        o = attn.o_proj
        columns = o.weight.detach().view(o.out_features, H, attn.v_head_dim)[:, start:stop]
        attn.o_proj = _AllReducedLinear(columns.reshape(o.out_features, -1),
                                        None if o.bias is None else o.bias.detach(), group)
        attn.num_heads = stop - start
        attn.mla_tp_group = group
    return model


def split_heads(x: Tensor, group_or_size, rank: Optional[int] = None) -> Tensor:
    """This rank's block of dim 1 (heads) of ``x`` [T, H, ...] split evenly over a group (or ``size`` ranks)."""
    if isinstance(group_or_size, int):
        size = group_or_size
    else:
        size, rank = dist.get_world_size(group_or_size), dist.get_rank(group_or_size)
    h = x.shape[1] // size
    return x[:, rank * h:(rank + 1) * h]

