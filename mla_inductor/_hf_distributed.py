"""The Hugging Face side of ``mla_inductor.distributed``: ``DCPMLACache``, a ``PagedMLACache`` whose tokens
are split over a DCP group. Imports transformers (through ``mla_inductor._hf``); ``mla_inductor.distributed``
loads it only when ``DCPMLACache`` is first used.

What changes against ``PagedMLACache``: the storage (this rank's ``page_size`` tokens of every page of
``page_size * N`` tokens, the block table and lengths being the whole cache's), the slots new tokens are
written to (this rank's tokens only; the others get -1), and the decode (``dcp_decode``: the query's heads
gathered over the group, the local decode, the exchange and merge). A prompt on an empty cache still runs
HF's own attention over the prompt's tokens, which every rank has.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from mla_inductor._compat import mark_static_address
from mla_inductor._hf import PagedMLACache, check_model
from mla_inductor.cache import PagedLatentCache, cache_dtype, token_width
from mla_inductor.distributed import DCPGroup, check_kv_scale_agrees, dcp_decode


class DCPMLACache(PagedMLACache):
    """A transformers ``Cache`` over a paged MLA latent cache split by tokens over ``dcp``'s ranks.

        model = shard_deepseek_attention_tp(model, tp_group)          # optional: H / tp heads per rank
        model.set_attn_implementation(hf.register())
        cache = DCPMLACache(model, make_dcp_group(2), batch_size=8, max_seq_len=131072)
        logits = hf.decode_one_token(model, tokens, cache)             # or model.generate(cache=cache)

    ``page_size``: tokens per page on each rank (a multiple of the interleave size); every rank must build
    the cache with the same arguments and run the same forwards. fp8_e4m3: ``kv_scale`` must be equal on
    every rank (checked). DSA (top-k) models are not supported.
    """

    def __init__(self, model: nn.Module, dcp: DCPGroup, *, batch_size: int, max_seq_len: int,
                 fmt: Optional[str] = None, page_size: int = 64, kv_scale: float = 1.0):
        if check_model(model).sparse:
            raise NotImplementedError("DCPMLACache: DeepSeek sparse attention (top-k) models are not supported")
        dcp.layout.check_page_size(page_size)
        virtual_page = page_size * dcp.world_size
        # The base class allocates a whole cache for its max_seq_len: give it one page per sequence (it sets up
        # everything else), then put this rank's share of the real size in its place.
        super().__init__(model, batch_size=batch_size, max_seq_len=virtual_page, fmt=fmt, page_size=virtual_page,
                         kv_scale=kv_scale)
        first = self._paged
        index = PagedLatentCache.allocate(
            num_layers=0, batch_size=batch_size, max_seq_len=max_seq_len, kv_lora_rank=first.kv_lora_rank,
            rope_dim=first.rope_dim, page_size=virtual_page, fmt=first.format, kv_scale=kv_scale,
            device=first.block_table.device)
        index.reserve(max_seq_len)  # every sequence owns its pages from the start, as in the base class
        index.seq_lens.zero_()
        width = token_width(first.format, first.kv_lora_rank, first.rope_dim)
        index.kv_caches = [torch.zeros(index.block_table.numel(), page_size, width, dtype=cache_dtype(first.format),
                                       device=first.block_table.device) for _ in first.kv_caches]
        for t in index.kv_caches:
            mark_static_address(t)
        self._paged = index
        self.max_seq_len = max_seq_len
        self.dcp = dcp
        self.local_page_size = page_size
        if first.format.startswith("fp8"):
            check_kv_scale_agrees(index.kv_scale, dcp.group)

    def __repr__(self) -> str:
        return (f"DCPMLACache(rank {self.dcp.layout.rank} of {self.dcp.world_size}, batch_size={self.batch_size}, "
                f"max_seq_len={self.max_seq_len}, format={self.format!r}, page_size={self.local_page_size} per rank)")

    def local_seq_lens(self) -> torch.Tensor:
        """This rank's token count per sequence, int32 [B]."""
        return self.dcp.layout.local_lengths(self.seq_lens)

    def _slots(self, positions: torch.Tensor, real: Optional[torch.Tensor]) -> torch.Tensor:
        # The base class's slots address pages of page_size * N tokens; this rank stores page_size of them.
        return self.dcp.layout.local_slots(super()._slots(positions, real), self.local_page_size)

    def _decode(self, q_latent: torch.Tensor, q_pe: torch.Tensor, layer_idx: int, scaling: float,
                sparse_indices: Optional[torch.Tensor]) -> torch.Tensor:
        """``dcp_decode`` in place of ``mla.paged_decode``: the absorbed query [T, h, L] of this rank's h heads
        gathered over the group, the local decode, the exchange and merge."""
        return dcp_decode(q_latent, q_pe, self.kv_caches[layer_idx], self.block_table, self.seq_lens, scaling,
                          self.kv_scale, self.dcp)
