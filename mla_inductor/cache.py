"""Latent KV-cache formats and a small paged cache for code that has no serving engine.

A cache is a tensor ``[num_pages, page_size, token_bytes_or_dim]``; each token row holds the
compressed latent (``L = kv_lora_rank`` values) followed by the decoupled rope key (``R`` values).
Formats (``cache_format(kv_cache)`` names them):

- ``"fp32"`` / ``"fp16"`` / ``"bf16"``: rows of ``L + R`` values in that dtype.
- ``"fp8_e4m3"``: rows of ``L + R`` ``float8_e4m3fn`` values; real value = stored * ``kv_scale``.
- ``"fp8_ds_mla"``: DeepSeek-V3.2's 656-byte uint8 rows (L=512, R=64 only): 512 e4m3 latent values,
  4 float32 scales (one per 128 latent values), 64 bf16 rope values (not quantized).
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch

from mla_inductor._compat import assert_on_device, mark_static_address, version_counter

FP8_E4M3_MAX = 448.0
FP8_DS_MLA_TOKEN_BYTES = 656
FP8_DS_MLA_LATENT = 512
FP8_DS_MLA_ROPE = 64
FP8_DS_MLA_TILE = 128
_DS_SCALES_AT = FP8_DS_MLA_LATENT  # bytes 512..527: 4 float32 tile scales
_DS_ROPE_AT = _DS_SCALES_AT + 4 * (FP8_DS_MLA_LATENT // FP8_DS_MLA_TILE)  # bytes 528..655: bf16 rope

_FORMAT_OF_DTYPE = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.uint8: "fp8_ds_mla",
}
_DTYPE_OF_FORMAT = {fmt: dtype for dtype, fmt in _FORMAT_OF_DTYPE.items()}
CACHE_FORMATS = tuple(_DTYPE_OF_FORMAT)


def cache_format(kv_cache: torch.Tensor) -> str:
    """The format name of a cache tensor (see the module docstring); TypeError for other dtypes."""
    try:
        return _FORMAT_OF_DTYPE[kv_cache.dtype]
    except KeyError:
        raise TypeError(
            f"kv_cache must have dtype float32, float16, bfloat16, float8_e4m3fn or uint8 (fp8_ds_mla), "
            f"got {kv_cache.dtype}"
        ) from None


def cache_dtype(fmt: str) -> torch.dtype:
    if fmt not in _DTYPE_OF_FORMAT:
        raise ValueError(f"format must be one of {CACHE_FORMATS}, got {fmt!r}")
    return _DTYPE_OF_FORMAT[fmt]


def token_width(fmt: str, kv_lora_rank: int, rope_dim: int) -> int:
    """Last dimension of a cache of this format: L + R elements, or 656 bytes for fp8_ds_mla."""
    if fmt == "fp8_ds_mla":
        if (kv_lora_rank, rope_dim) != (FP8_DS_MLA_LATENT, FP8_DS_MLA_ROPE):
            raise ValueError(
                f"fp8_ds_mla stores kv_lora_rank=512 and rope_dim=64 only, got {kv_lora_rank} and {rope_dim}"
            )
        return FP8_DS_MLA_TOKEN_BYTES
    return kv_lora_rank + rope_dim


def pack_fp8_ds_mla(rows: torch.Tensor) -> torch.Tensor:
    """[..., 576] latent|rope (any float dtype) -> [..., 656] uint8 in the fp8_ds_mla layout.

    Each 128-value latent tile gets the scale amax / 448 (the largest finite magnitude maps to e4m3's
    largest finite value), floored at a tiny positive number so an all-zero tile stays zero, not NaN. Like
    the fp8_e4m3 format, a non-finite value touches only itself: ±inf saturates at ±448 · scale, NaN stays
    NaN, and the tile's other values keep their scale.
    """
    if rows.shape[-1] != FP8_DS_MLA_LATENT + FP8_DS_MLA_ROPE:
        raise ValueError(f"rows must end in 576 = 512 latent + 64 rope values, got {tuple(rows.shape)}")
    lead = rows.shape[:-1]
    latent = rows[..., :FP8_DS_MLA_LATENT].float().reshape(*lead, 4, FP8_DS_MLA_TILE)
    finite = torch.where(torch.isfinite(latent), latent.abs(), 0.0)
    scale = (finite.amax(-1, keepdim=True) / FP8_E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q8 = (latent / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    rope = rows[..., FP8_DS_MLA_LATENT:].to(torch.bfloat16)
    return torch.cat(
        [
            q8.reshape(*lead, FP8_DS_MLA_LATENT).view(torch.uint8),
            scale.reshape(*lead, 4).contiguous().view(torch.uint8),
            rope.contiguous().view(torch.uint8),
        ],
        dim=-1,
    )


def unpack_fp8_ds_mla(packed: torch.Tensor) -> torch.Tensor:
    """[..., 656] uint8 fp8_ds_mla rows -> [..., 576] float32 latent|rope."""
    lead = packed.shape[:-1]
    latent = packed[..., :_DS_SCALES_AT].view(torch.float8_e4m3fn).float()
    scale = packed[..., _DS_SCALES_AT:_DS_ROPE_AT].view(torch.float32)
    latent = (latent.reshape(*lead, 4, FP8_DS_MLA_TILE) * scale.unsqueeze(-1)).reshape(*lead, FP8_DS_MLA_LATENT)
    rope = packed[..., _DS_ROPE_AT:].view(torch.bfloat16).float()
    return torch.cat([latent, rope], dim=-1)


def encode_tokens(rows: torch.Tensor, fmt: str, kv_scale: torch.Tensor) -> torch.Tensor:
    """[..., L+R] values -> stored rows of format ``fmt`` (fp8 saturates at ±448 after dividing by kv_scale)."""
    if fmt == "fp8_ds_mla":
        return pack_fp8_ds_mla(rows)
    if fmt == "fp8_e4m3":
        scaled = rows.float() / kv_scale.float().reshape(())
        return scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return rows.to(cache_dtype(fmt))


def decode_tokens(stored: torch.Tensor, kv_scale: torch.Tensor) -> torch.Tensor:
    """Stored cache rows [..., width] -> float32 [..., L+R], scales applied."""
    fmt = cache_format(stored)
    if fmt == "fp8_ds_mla":
        return unpack_fp8_ds_mla(stored)
    if fmt == "fp8_e4m3":
        return stored.float() * kv_scale.float().reshape(())
    return stored.float()


def fp8_scale_for(values: torch.Tensor) -> torch.Tensor:
    """A per-tensor kv_scale (fp32, one element) that maps max|values| onto e4m3's largest value."""
    amax = values.detach().abs().amax().float().clamp_min(torch.finfo(torch.float32).tiny)
    return (amax / FP8_E4M3_MAX).reshape(1)


# ----------------------------------------------------------------------------- host copies of the lengths

class HostLengths:
    """Host copies of ``seq_lens`` tensors, for backends whose plan schedules on the CPU (FlashInfer's MLA
    wrapper reads every sequence's length on the host).

    Without a host copy such a plan copies the lengths from the device and waits for them: a device->host
    sync in every decode step, which also stalls the CPU until the GPU has caught up. Whoever writes a
    ``seq_lens`` tensor and knows the values on the host records both right after the write (``record``;
    ``PagedLatentCache`` does it in its own methods, other callers use ``mla_inductor.register_host_lengths``).
    ``lookup`` answers with the host copy while the device tensor is unchanged since: the same tensor (or a
    view of it at the same address and shape) whose version counter has not moved. Anything else gets None
    and the plan falls back to the device->host copy: correct, one sync.

    Writes that bypass torch's version counter (a CUDA-graph replay that writes ``seq_lens``, a foreign
    kernel writing its memory) are not seen: whoever writes the lengths that way must ``record`` again (or
    ``forget``) after each write.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[str, int], _HostCopy] = {}

    def record(self, seq_lens: torch.Tensor, host: torch.Tensor) -> None:
        """``host`` (int32 [B] on the CPU) holds the values ``seq_lens`` (int32 [B], any device) has now.
        ``host`` must not be written afterwards (record a new tensor instead): a plan may still be copying
        from it."""
        if host.device.type != "cpu" or host.dtype != torch.int32 or tuple(host.shape) != tuple(seq_lens.shape):
            raise ValueError(f"register_host_lengths: the host copy must be an int32 CPU tensor of seq_lens' shape "
                             f"{tuple(seq_lens.shape)}, got {host.dtype} {tuple(host.shape)} on {host.device}")
        key = (str(seq_lens.device), seq_lens.data_ptr())
        entries = self._entries

        def drop(ref, key=key):  # the device tensor is gone: its address may be reused by another one
            if key in entries and entries[key].tensor is ref:
                del entries[key]

        entries[key] = _HostCopy(weakref.ref(seq_lens, drop), tuple(seq_lens.shape), version_counter(seq_lens), host)

    def lookup(self, seq_lens: torch.Tensor) -> Optional[torch.Tensor]:
        """The host copy of ``seq_lens`` if it is still current, else None."""
        entry = self._entries.get((str(seq_lens.device), seq_lens.data_ptr()))
        if entry is None or entry.tensor() is None or entry.shape != tuple(seq_lens.shape):
            return None
        return entry.host if version_counter(seq_lens) == entry.version else None

    def forget(self, seq_lens: torch.Tensor) -> None:
        self._entries.pop((str(seq_lens.device), seq_lens.data_ptr()), None)

    def clear(self) -> None:
        self._entries.clear()


@dataclass(frozen=True)
class _HostCopy:
    tensor: weakref.ref  # the device tensor recorded (alive: its address is its own)
    shape: tuple
    version: int
    host: torch.Tensor


HOST_LENGTHS = HostLengths()


def register_host_lengths(seq_lens: torch.Tensor, host_lens: torch.Tensor) -> None:
    """Tell mla-inductor the host values of ``seq_lens`` as it is now, so that a plan needing lengths on the
    host (FlashInfer's) reads them there instead of waiting for a copy from the device.

    Call it after every write of ``seq_lens`` (``host_lens``: int32 CPU tensor of the same shape, a fresh one
    each time, never written afterwards). A ``PagedLatentCache`` does this itself. Without it everything still
    runs: such a plan then copies the lengths from the device (one device->host sync per plan).
    """
    HOST_LENGTHS.record(seq_lens, host_lens)


def host_lengths(seq_lens: torch.Tensor) -> Optional[torch.Tensor]:
    """The host copy registered for ``seq_lens`` if still current (see ``HostLengths``), else None."""
    return HOST_LENGTHS.lookup(seq_lens)


def copy_to_device_async(dst: torch.Tensor, host: torch.Tensor) -> None:
    """``dst.copy_(host)`` without the host waiting for the device: on CUDA from a pinned copy of ``host``
    (the caching host allocator keeps that memory until the copy has run), so no sync."""
    if dst.device.type == "cuda":
        staged = host if host.is_pinned() else host.pin_memory()
        dst.copy_(staged, non_blocking=True)
    else:
        dst.copy_(host)


# ----------------------------------------------------------------------------- capacity inside compiled steps

def capacity_message(cache: str, max_seq_len: int, counted: str, needed: Optional[int] = None) -> str:
    """The refusal of a step that would take a sequence past ``max_seq_len`` (``counted``: "tokens", or
    "columns (padding included)"); ``needed``: the count it would reach, where known."""
    held = (f"{needed} {counted}, more than max_seq_len={max_seq_len}" if needed is not None
            else f"more {counted} than max_seq_len={max_seq_len} allows")
    return f"{cache}: a sequence would hold {held}; make the cache with a larger max_seq_len, or reset() it"


def check_cache_positions(positions: torch.Tensor, max_seq_len: int, cache: str, counted: str) -> torch.Tensor:
    """``positions`` (an integer tensor of token positions a step is about to write) clamped into
    [0, max_seq_len), after checking that none is ``>= max_seq_len``, for steps whose Python does not run
    again (compiled or captured), where no host check can: a ValueError on CPU (eager's type and text), a
    device-side assert on GPUs (no host sync; a failed one stops the process with CUDA's "device-side
    assert triggered", and a compiled graph's Triton assert prints the message). Compute the slots to
    write from the result: on CPU the check then runs before any write; on a GPU no index leaves the block
    table before the assert stops the process."""
    if positions.device.type == "cpu":
        return torch.ops.mla.checked_cache_positions(positions, max_seq_len, cache, counted)
    return assert_cache_positions(positions, max_seq_len, cache, counted)


def assert_cache_positions(positions: torch.Tensor, max_seq_len: int, cache: str, counted: str) -> torch.Tensor:
    """The GPU form of ``check_cache_positions``: a device-side assert (traced into compiled graphs as it is,
    so Inductor's kernel carries the message), then the clamp."""
    assert_on_device((positions < max_seq_len).all(), capacity_message(cache, max_seq_len, counted))
    return positions.clamp(0, max_seq_len - 1)


@torch.library.custom_op("mla::checked_cache_positions", mutates_args=())
def checked_cache_positions(positions: torch.Tensor, max_seq_len: int, cache: str, counted: str) -> torch.Tensor:
    """The CPU form of ``check_cache_positions``: an op, so that a compiled graph calls it as it is and raises
    eager's ValueError (Inductor's own asserts raise RuntimeError); its result (the clamped positions) feeds
    the slots, so neither dead-code elimination nor scheduling puts a write before it."""
    if positions.device.type != "cpu":
        return assert_cache_positions(positions, max_seq_len, cache, counted)
    if positions.numel() and int(positions.max()) >= max_seq_len:
        raise ValueError(capacity_message(cache, max_seq_len, counted, int(positions.max()) + 1))
    return positions.clamp(0, max_seq_len - 1)


@checked_cache_positions.register_fake
def _(positions, max_seq_len, cache, counted):
    return torch.empty_like(positions)


def check_cache_step(positions: torch.Tensor, lengths: torch.Tensor, max_seq_len: int, cache: str,
                     counted: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``check_cache_positions`` for a step that also advances its lengths: returns the checked positions and
    ``lengths`` (the lengths after the step) passed through the check, so that the write of the new lengths
    depends on it and no schedule advances them before a refusal."""
    if positions.device.type == "cpu":
        return torch.ops.mla.checked_cache_step(positions, lengths, max_seq_len, cache, counted)
    return assert_cache_positions(positions, max_seq_len, cache, counted), lengths


@torch.library.custom_op("mla::checked_cache_step", mutates_args=())
def checked_cache_step(positions: torch.Tensor, lengths: torch.Tensor, max_seq_len: int, cache: str,
                       counted: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU form of ``check_cache_step`` (see ``checked_cache_positions``)."""
    return checked_cache_positions(positions, max_seq_len, cache, counted), lengths.clone()


@checked_cache_step.register_fake
def _(positions, lengths, max_seq_len, cache, counted):
    return torch.empty_like(positions), torch.empty_like(lengths)


def _check_count(name: str, value, least: Optional[int]) -> int:
    """``value`` as an int: TypeError unless it is an integer (a bool is not), ValueError below ``least``."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = operator.index(value)
    if least is not None and value < least:
        raise ValueError(f"{name} must be >= {least}, got {value}")
    return value


# ----------------------------------------------------------------------------- a paged cache

@dataclass
class PagedLatentCache:
    """Paged latent caches for ``num_layers`` layers sharing one page allocator and block table.

    ``block_table`` [batch, max_pages] int32 and ``seq_lens`` [batch] int32 live on ``device`` and are
    updated in place, so a compiled (or CUDA-graph captured) decode step sees new lengths without
    re-tracing. Pages are handed out from a free list on the host; ``reset(b)`` returns a sequence's pages.
    ``host_seq_lens`` is the host copy of ``seq_lens`` (pinned on CUDA), replaced by a fresh tensor at each
    change and registered in ``HOST_LENGTHS``, so plans that schedule on the host never wait for the device;
    nothing here waits for the device either (updates are copied from pinned memory, asynchronously).

        cache = PagedLatentCache.allocate(num_layers=2, batch_size=4, max_seq_len=1024, kv_lora_rank=512,
                                          rope_dim=64, page_size=64, fmt="bf16", device="cuda")
        slots = cache.reserve(1)            # one new token per sequence -> slot_mapping [4]
        cache.append(layer, kv_c, k_pe, slots)
        out = cache.decode(layer, q_nope, q_pe, softmax_scale)
    """

    kv_caches: list[torch.Tensor]
    kv_scale: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    page_size: int
    kv_lora_rank: int
    rope_dim: int
    host_seq_lens: Optional[torch.Tensor] = field(default=None, repr=False)
    _free_pages: list[int] = field(default_factory=list, repr=False)
    _host_lens: list[int] = field(default_factory=list, repr=False)
    _host_pages: list[list[int]] = field(default_factory=list, repr=False)

    @classmethod
    def allocate(
        cls,
        *,
        num_layers: int,
        batch_size: int,
        max_seq_len: int,
        kv_lora_rank: int = 512,
        rope_dim: int = 64,
        page_size: int = 64,
        fmt: str = "bf16",
        num_pages: int | None = None,
        kv_scale: float = 1.0,
        device: torch.device | str = "cpu",
    ) -> PagedLatentCache:
        """Room for ``batch_size`` sequences of up to ``max_seq_len`` tokens (``num_pages`` defaults to that)."""
        for name, value, least in (("num_layers", num_layers, 0), ("batch_size", batch_size, 1),
                                   ("max_seq_len", max_seq_len, 1), ("kv_lora_rank", kv_lora_rank, 1),
                                   ("rope_dim", rope_dim, 0), ("page_size", page_size, 1),
                                   ("num_pages", num_pages, 0)):
            if value is not None or name != "num_pages":
                _check_count(f"PagedLatentCache.allocate: {name}", value, least)
        if not fmt.startswith("fp8") and kv_scale != 1.0:
            raise ValueError(f"kv_scale applies to fp8 formats only; format {fmt!r} needs kv_scale=1.0")
        width = token_width(fmt, kv_lora_rank, rope_dim)
        max_pages = -(-max_seq_len // page_size)
        num_pages = batch_size * max_pages if num_pages is None else num_pages
        dtype = cache_dtype(fmt)
        kv_caches = [torch.zeros(num_pages, page_size, width, dtype=dtype, device=device) for _ in range(num_layers)]
        tensors = dict(
            kv_scale=torch.tensor([kv_scale], dtype=torch.float32, device=device),
            block_table=torch.zeros(batch_size, max_pages, dtype=torch.int32, device=device),
            seq_lens=torch.zeros(batch_size, dtype=torch.int32, device=device),
        )
        # These tensors live as long as the cache and change only in place: marked static, CUDA-graph
        # trees (mode="reduce-overhead") read them where they are instead of copying every cache into a
        # static buffer at each replay (hundreds of MB per layer).
        for t in (*kv_caches, *tensors.values()):
            mark_static_address(t)
        cache = cls(
            kv_caches=kv_caches,
            **tensors,
            page_size=page_size,
            kv_lora_rank=kv_lora_rank,
            rope_dim=rope_dim,
            _free_pages=list(range(num_pages - 1, -1, -1)),
            _host_lens=[0] * batch_size,
            _host_pages=[[] for _ in range(batch_size)],
        )
        cache._sync_tables()  # registers the host copy of the (zero) lengths
        return cache

    @property
    def batch_size(self) -> int:
        return self.block_table.shape[0]

    @property
    def format(self) -> str:
        return cache_format(self.kv_caches[0])

    def reserve(self, num_tokens: int | list[int]) -> torch.Tensor:
        """Make room for the next ``num_tokens`` tokens of every sequence (an int, or one count per
        sequence); advance ``seq_lens``; return the slot_mapping int32 [sum(num_tokens)] for cache_append,
        sequence-major.

        All or nothing: every count is checked (a non-negative int, within ``max_seq_len``, pages to spare)
        before anything changes, so a refused call leaves the cache as it was."""
        name = "PagedLatentCache.reserve: num_tokens"
        if isinstance(num_tokens, bool) or (hasattr(num_tokens, "__index__")
                                            and not (isinstance(num_tokens, torch.Tensor) and num_tokens.dim())):
            counts = [_check_count(name, num_tokens, 0)] * self.batch_size
        else:
            try:
                counts = list(num_tokens)
            except TypeError:
                raise TypeError(f"{name} must be an int or one int per sequence, got "
                                f"{type(num_tokens).__name__}") from None
            if len(counts) != self.batch_size:
                raise ValueError(f"{name} must be an int or have {self.batch_size} entries (one per sequence), "
                                 f"got {len(counts)}")
            counts = [_check_count(f"{name}[{b}]", n, 0) for b, n in enumerate(counts)]
        max_pages = self.block_table.shape[1]
        ends = [length + n for length, n in zip(self._host_lens, counts)]
        for b, end in enumerate(ends):
            if -(-end // self.page_size) > max_pages:
                raise ValueError(f"PagedLatentCache.reserve: sequence {b} would hold {end} tokens, more than "
                                 f"max_seq_len allows ({max_pages} pages of {self.page_size}); nothing was reserved")
        new_pages = [max(0, -(-end // self.page_size) - len(pages)) for end, pages in zip(ends, self._host_pages)]
        if sum(new_pages) > len(self._free_pages):
            raise RuntimeError(f"PagedLatentCache is out of pages: the reserve needs {sum(new_pages)} more, "
                               f"{len(self._free_pages)} are free; allocate it with more num_pages (nothing was "
                               "reserved)")
        slots: list[int] = []
        for b, (n, end) in enumerate(zip(counts, ends)):
            pages = self._host_pages[b]
            pages.extend(self._free_pages.pop() for _ in range(new_pages[b]))
            slots.extend(pages[t // self.page_size] * self.page_size + t % self.page_size for t in range(end - n, end))
            self._host_lens[b] = end
        self._sync_tables()
        slot_mapping = torch.empty(len(slots), dtype=torch.int32, device=self.block_table.device)
        copy_to_device_async(slot_mapping, torch.tensor(slots, dtype=torch.int32))
        return slot_mapping

    def reset(self, batch_index: int | None = None) -> None:
        """Forget sequence ``batch_index`` (all sequences if None) and return its pages."""
        if batch_index is not None:
            batch_index = _check_count("PagedLatentCache.reset: batch_index", batch_index, None)
            if not 0 <= batch_index < self.batch_size:
                raise IndexError(f"PagedLatentCache.reset: batch_index must be None (every sequence) or in "
                                 f"[0, batch_size={self.batch_size}), got {batch_index}")
        for b in range(self.batch_size) if batch_index is None else [batch_index]:
            self._free_pages.extend(reversed(self._host_pages[b]))
            self._host_pages[b] = []
            self._host_lens[b] = 0
        self._sync_tables()

    def _sync_tables(self) -> None:
        """Write the host's block table and lengths into the device tensors (no sync), and record the new
        host copy of the lengths."""
        table = torch.zeros(self.block_table.shape, dtype=torch.int32)
        for b, pages in enumerate(self._host_pages):
            table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        lens = torch.tensor(self._host_lens, dtype=torch.int32)
        if self.seq_lens.device.type == "cuda":
            lens = lens.pin_memory()
        copy_to_device_async(self.block_table, table)
        copy_to_device_async(self.seq_lens, lens)
        self.host_seq_lens = lens  # a fresh tensor each time: a plan may still be copying from the old one
        HOST_LENGTHS.record(self.seq_lens, lens)

    def append(self, layer: int, kv_c: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write new tokens' latent [N, L] and rope key [N, R] of one layer into the reserved slots."""
        torch.ops.mla.cache_append(self.kv_caches[layer], kv_c, k_pe, slot_mapping, self.kv_scale)

    def decode(
        self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor, softmax_scale: float
    ) -> torch.Tensor:
        """Attention output [T, H, L] of one layer for the absorbed query (T = batch * new tokens)."""
        return torch.ops.mla.paged_decode(
            q_nope, q_pe, self.kv_caches[layer], self.block_table, self.seq_lens, softmax_scale, self.kv_scale
        )
