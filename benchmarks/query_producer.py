"""q made inside the timed step, as a model makes it (``bench_pass.py --q-producer rope``).

The kernel-only rows of bench_pass give the compiled step q as an input: the pass's quantization of q
(FlashMLA-fp8 with a static ``q_scale``: ``q / q_scale``, clamp, cast to e4m3) then has no producer to
fuse into and runs as a kernel of its own, while the fp8 peers are handed a query quantized outside the
timed region. In a model q is computed right before the attention call; this module makes both sides
compute it in the timed step, the same way:

- the producer (``make_query``): from the projection's output ``q_raw`` [T, H, L+R] (bf16, one per
  layer), ``q_nope = q_raw[..., :L] * w_nope`` (a per-channel weight [L], one per layer) and
  ``q_pe = rope(q_raw[..., L:])``, DeepSeek-V3's interleaved rope as transformers'
  ``apply_rotary_pos_emb_interleave`` computes it (pairs ``(x[2i], x[2i+1])`` rotated by angle ``i``,
  written half-split), with the cos / sin of each token's position; ``q = q_nope | q_pe`` [T, H, L+R].
- ours (``produced_query_step``): the producer per layer, then ``mla.paged_decode`` with the static
  ``q_scale``, all in the one compiled step; the pass writes the quantization as aten ops and Inductor
  fuses it, with the rope and the weight, into the producer's kernel. ``Producer.joined`` says how q
  reaches the op: False (``--q-producer rope``): ``q_nope`` and ``q_pe`` as two tensors, as
  ``mla_inductor.hf`` passes the absorbed query and the rope part; True (``rope-joined``): the two slices
  of one ``cat([q_nope, q_pe])`` [T, H, L+R], the layout FlashMLA reads without a copy (vLLM's).
- the peers (``query_writer``): the same producer, then (for kernels taking q in e4m3) the quantization
  as their users write it (``quantize_like_peer``: vLLM's static per-tensor ``_DecodeConcatQuantFP8``,
  torch code it compiles), written into the buffers the peer kernel reads; bench_pass compiles this with
  Inductor too (captured in the peer's CUDA graph), so the peers get the same fusion as ours and the
  comparison is the attention call plus whatever the pass adds.

Each layer has its own q_raw, weight and cos / sin tables (the same values in every layer's tables): in a
model each layer's q depends on the previous layer's output, so Inductor never fuses the producers of
different layers; the step's layers are independent, and with one shared table Inductor would fuse every
layer's producer into one kernel through the shared read, which no model allows.

Why an elementwise weight stands in for DeepSeek's absorbed bmm (``q_nope[T, H, 128] @ W_UK[H, 128, 512]``):
the bmm is an extern cuBLAS call, identical on both sides, that takes no Inductor epilogue (only Triton
bmm templates under max-autotune do); the kernel the quantization fuses into is the pointwise one that
reads the bmm's output (with the rope and the concatenation), which here reads ``q_raw`` and the weight
instead: the same bytes, the same one pass. The bmm itself (W_UK is 16 MB per layer at H=128) would add
the same time to both sides and only dilute the ratio.

Plain torch: every function runs on CPU (tests/test_query_producer.py) and on the GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

FP8_MAX = 448.0
ROPE_THETA = 10000.0


def rope_tables(positions: torch.Tensor, rope_dim: int, theta: float = ROPE_THETA):
    """(cos, sin) [T, 1, rope_dim / 2] fp32 of each token's position (broadcast over heads)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=positions.device) / rope_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's rope on x [T, H, R] (transformers' ``apply_rotary_pos_emb_interleave``): the pairs
    ``(x[2i], x[2i+1])`` rotated by ``angle_i``, written half-split ``[evens' | odds']``; fp32 math, x's dtype."""
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1).to(x.dtype)


def make_query(q_raw: torch.Tensor, w_nope: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """q [T, H, L+R] from the projection's output q_raw [T, H, L+R]: ``q_raw[..., :L] * w_nope`` | the rope of
    ``q_raw[..., L:]`` (L = w_nope's length)."""
    latent = w_nope.shape[-1]
    q_nope = q_raw[..., :latent] * w_nope
    return torch.cat([q_nope, rope_interleaved(q_raw[..., latent:], cos, sin)], dim=-1)


def quantize_like_peer(q: torch.Tensor, q_scale: torch.Tensor) -> torch.Tensor:
    """A static per-tensor e4m3 query as the fp8 peers' users make it (vLLM: ``q / q_scale`` clamped to the
    e4m3 range, one scale for latent and rope)."""
    return (q.float() / q_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


@dataclasses.dataclass
class ProducedQuery:
    """What one layer's producer reads: ``q_raw`` [T, H, L+R] and ``w_nope`` [L] (the layer's own), and
    the cos / sin tables [T, 1, R/2] fp32 (every layer's)."""

    q_raw: torch.Tensor
    w_nope: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def random(cls, num_tokens: int, num_heads: int, latent: int, rope_dim: int, positions: torch.Tensor,
               dtype: torch.dtype = torch.bfloat16, generator: Optional[torch.Generator] = None) -> "ProducedQuery":
        """Random inputs (q_raw ~ N(0, 0.5²) like the kernel-only rows' q, w_nope ~ 1 + N(0, 0.1²)) at
        ``positions`` [T]; made on the CPU with ``generator`` and moved to ``positions``' device."""
        device = positions.device
        q_raw = (torch.randn(num_tokens, num_heads, latent + rope_dim, generator=generator) * 0.5).to(dtype)
        w_nope = (1 + 0.1 * torch.randn(latent, generator=generator)).to(dtype)
        cos, sin = rope_tables(positions, rope_dim)
        return cls(q_raw.to(device), w_nope.to(device), cos, sin)

    def query(self) -> torch.Tensor:
        return make_query(self.q_raw, self.w_nope, self.cos, self.sin)

    def fresh_layer(self) -> "ProducedQuery":
        """Another layer's inputs: new q_raw and w_nope of the same distribution, copies of cos / sin (the
        same positions; a table of its own, see the module's docstring)."""
        q_raw = torch.randn_like(self.q_raw, dtype=torch.float32).mul_(0.5).to(self.q_raw.dtype)
        w_nope = torch.randn_like(self.w_nope, dtype=torch.float32).mul_(0.1).add_(1).to(self.w_nope.dtype)
        return ProducedQuery(q_raw, w_nope, self.cos.clone(), self.sin.clone())

    def layers(self, calls: int) -> list["ProducedQuery"]:
        """This layer's inputs and ``calls - 1`` fresh ones (distinct calls: no common-subexpression merge)."""
        return [self] + [self.fresh_layer() for _ in range(calls - 1)]


@dataclasses.dataclass(frozen=True)
class Producer:
    """A ``--q-producer`` mode: ``joined`` says whether the op gets q's two slices of one [T, H, L+R]
    tensor (True) or q_nope and q_pe as two tensors (False)."""

    name: str
    joined: bool


PRODUCERS = {"rope": Producer("rope", joined=False), "rope-joined": Producer("rope-joined", joined=True)}


def produced_query_step(softmax_scale: float, joined: bool = False) -> Callable:
    """The compiled step of the --q-producer rows: per layer, the producer then ``mla.paged_decode`` with
    the static ``q_scale`` (``joined``: see ``Producer``).
    ``step(q_raws, w_nopes, coss, sins, caches, block_table, seq_lens, kv_scale, sparse_indices, q_scale)``
    (one q_raw, w_nope, cos, sin per layer) -> one output per layer; layer ``i`` reads ``caches[i % len(caches)]``."""

    def step(q_raws, w_nopes, coss, sins, caches, block_table, seq_lens, kv_scale, sparse_indices, q_scale):
        outs = []
        for i, (q_raw, w_nope, cos, sin) in enumerate(zip(q_raws, w_nopes, coss, sins)):
            latent = w_nope.shape[-1]
            if joined:
                q = make_query(q_raw, w_nope, cos, sin)
                q_nope, q_pe = q[..., :latent], q[..., latent:]
            else:
                q_nope, q_pe = q_raw[..., :latent] * w_nope, rope_interleaved(q_raw[..., latent:], cos, sin)
            outs.append(torch.ops.mla.paged_decode(q_nope, q_pe, caches[i % len(caches)], block_table, seq_lens,
                                                   softmax_scale, kv_scale, sparse_indices, q_scale))
        return outs

    return step


def step_arguments(layers: list[ProducedQuery], caches, block_table, seq_lens, kv_scale, sparse_indices, q_scale):
    """``produced_query_step``'s arguments for ``layers`` (one ProducedQuery per call)."""
    return ([p.q_raw for p in layers], [p.w_nope for p in layers], [p.cos for p in layers], [p.sin for p in layers],
            caches, block_table, seq_lens, kv_scale, sparse_indices, q_scale)


# The query layouts the peer kernels read (peers.QUERY_ENTRIES names each peer's): the entry names of a
# case, each written by its writer below into buffers the caller allocates.
def _write_joined(q_raw, w_nope, cos, sin, q_scale, q):
    q.copy_(make_query(q_raw, w_nope, cos, sin))


def _write_split(q_raw, w_nope, cos, sin, q_scale, q_nope, q_pe):
    q_made = make_query(q_raw, w_nope, cos, sin)
    q_nope.copy_(q_made[..., :q_nope.shape[-1]])
    q_pe.copy_(q_made[..., q_nope.shape[-1]:])


def _write_e4m3(q_raw, w_nope, cos, sin, q_scale, q_fp8):
    q_fp8.copy_(quantize_like_peer(make_query(q_raw, w_nope, cos, sin), q_scale))


WRITERS = {("q",): _write_joined, ("q_nope", "q_pe"): _write_split, ("q_fp8",): _write_e4m3}


def query_writer(entries: tuple[str, ...]) -> Callable:
    """``write(q_raw, w_nope, cos, sin, q_scale, *buffers)``: the producer (and the peer's quantization,
    for ``("q_fp8",)``) written into the buffers of ``entries`` (``("q",)`` [T, H, L+R] in q's dtype,
    ``("q_nope", "q_pe")`` [T, H, L] and [T, H, R], ``("q_fp8",)`` [T, H, L+R] float8_e4m3fn)."""
    if entries not in WRITERS:
        raise ValueError(f"query_writer: entries must be one of {sorted(WRITERS)}, got {entries!r}")
    return WRITERS[entries]


def query_buffers(entries: tuple[str, ...], like: torch.Tensor, latent: int) -> list[torch.Tensor]:
    """Empty buffers for ``query_writer(entries)``, shaped after q ``like`` [T, H, L+R]."""
    T, H, width = like.shape
    shapes = {"q": ((T, H, width), like.dtype), "q_nope": ((T, H, latent), like.dtype),
              "q_pe": ((T, H, width - latent), like.dtype), "q_fp8": ((T, H, width), torch.float8_e4m3fn)}
    return [torch.empty(shapes[e][0], dtype=shapes[e][1], device=like.device) for e in entries]
