"""Merging partial attention results: ``torch.ops.mla.merge_attn_states`` and ``merge_attn_states_n``.

Attention over a key set split in parts (pages split across GPUs by decode context parallelism, or
a split-KV kernel's chunks) gives each part an output normalised over its own keys and that part's
log-sum-exp. The merge weighs part ``i`` by ``exp(lse_i - lse)`` with ``lse = log(sum_i exp(lse_i))``:

    out = sum_i exp(lse_i - lse) * out_i          lse = log(sum_i exp(lse_i))

Shapes (T query rows, H heads, L value width, N parts):

    merge_attn_states(out_a [T, H, L], lse_a [T, H], out_b [T, H, L], lse_b [T, H]) -> (out, lse)
    merge_attn_states_n(outs [N, T, H, L], lses [N, T, H])                         -> (out, lse)
    out [T, H, L] in the outputs' dtype (fp32 / fp16 / bf16), lse [T, H] fp32

LSEs are natural logs, as ``mla.paged_decode_with_lse`` and FlashMLA return them (convert a base-2 LSE,
FlashInfer's default, by multiplying with ln 2 first). The LSE convention is the decode op's
(docs/contract.md, "Partial results and their merge"), so that merging the results of a call split in
parts gives the unsplit call's result:

- a finite LSE weighs its part by ``exp(lse_i - lse)``;
- ``-inf``: the part saw no key (*empty*); its output is ignored (it may hold garbage). NaN counts as
  ``-inf`` (what some kernels write for an empty part);
- ``+inf``: the part's sum of exponentials overflowed float32 (the decode op returns it for a huge
  ``softmax_scale``): it outweighs every finite part, and parts that all have ``+inf`` weigh the same
  (their true ratio is lost to the overflow). The merged LSE is then ``+inf``. FlashAttention-2 writes
  ``+inf`` for an empty part: convert such LSEs to ``-inf`` before merging.

A row whose parts are all empty gets out 0 and lse -inf, as the decode op gives a row that sees no key.
Math in fp32; the caller's ``torch.autocast`` does not change it.

Eager calls run a Triton kernel on CUDA (``mla_inductor.kernels.merge_attn_states``) and the plain
PyTorch reference (``merge_reference``) elsewhere; with ``mla_inductor.lowering`` installed, a compiled
CPU graph gets the reference traced into Inductor's own generated code.
"""

from __future__ import annotations

from typing import Sequence

import torch

from mla_inductor._compat import argument_errors_reach_the_user
from mla_inductor._library import define_op, refuse_autograd
from mla_inductor.reference import autocast_off

Tensor = torch.Tensor
OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _fail(op: str, exc: type[Exception], msg: str):
    raise exc(f"mla.{op}: {msg}")


def _check_out(op: str, name: str, t, ndim: int, dims: str) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(op, TypeError, f"{name} must be a torch.Tensor {dims}, got {type(t).__name__}")
    if t.dim() != ndim:
        _fail(op, ValueError, f"{name} must be a {ndim}-D tensor {dims}, got shape {tuple(t.shape)}")
    if t.dtype not in OUT_DTYPES:
        _fail(op, TypeError, f"{name} must have dtype float32, float16 or bfloat16, got {t.dtype}")


def _check_lse(op: str, name: str, t, shape: tuple, dims: str, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(op, TypeError, f"{name} must be a float32 torch.Tensor {dims}, got {type(t).__name__}")
    if t.dtype != torch.float32:
        _fail(op, TypeError, f"{name} must have dtype float32 (natural-log LSE), got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        _fail(op, ValueError, f"{name} must be {dims} = {list(shape)}, got shape {tuple(t.shape)}")
    if t.device != device:
        _fail(op, ValueError, f"{name} must be on {device} like the outputs, got {t.device}")


def check_merge_args(out_a, lse_a, out_b, lse_b) -> None:
    """Shape/dtype/device checks of ``mla.merge_attn_states`` (eager and fake: bad input fails at compile time)."""
    op = "merge_attn_states"
    _check_out(op, "out_a", out_a, 3, "[T, H, L]")
    _check_out(op, "out_b", out_b, 3, "[T, H, L]")
    if tuple(out_b.shape) != tuple(out_a.shape) or out_b.dtype != out_a.dtype:
        _fail(op, ValueError, f"out_b must match out_a's shape {tuple(out_a.shape)} and dtype {out_a.dtype}, "
              f"got {tuple(out_b.shape)} {out_b.dtype}")
    if out_b.device != out_a.device:
        _fail(op, ValueError, f"out_b must be on {out_a.device} like out_a, got {out_b.device}")
    T, H, _ = out_a.shape
    _check_lse(op, "lse_a", lse_a, (T, H), "[T, H]", out_a.device)
    _check_lse(op, "lse_b", lse_b, (T, H), "[T, H]", out_a.device)


def check_merge_n_args(outs, lses) -> None:
    """Shape/dtype/device checks of ``mla.merge_attn_states_n``."""
    op = "merge_attn_states_n"
    _check_out(op, "outs", outs, 4, "[N, T, H, L]")
    N, T, H, _ = outs.shape
    if isinstance(N, int) and N < 1:
        _fail(op, ValueError, f"outs must hold at least one part (N >= 1), got shape {tuple(outs.shape)}")
    _check_lse(op, "lses", lses, (N, T, H), "[N, T, H]", outs.device)


# --------------------------------------------------------------------------------------------------------
# The reference: plain PyTorch, fp32, no data-dependent shapes (traces into Inductor code)


def clean_lse(lse: Tensor) -> Tensor:
    """The LSE in fp32, NaN counted as -inf (an empty part)."""
    lse = lse.float()
    return torch.where(torch.isnan(lse), float("-inf"), lse)


def merge_weights(lses: Sequence[Tensor]) -> tuple[list[Tensor], Tensor]:
    """Each part's weight in the merge, ``exp(lse_i - lse)`` (fp32 [T, H], 0 for an empty part; parts with
    lse +inf share the whole weight), and the merged lse (fp32 [T, H]); the module docstring has the rules."""
    clean = [clean_lse(x) for x in lses]
    top = clean[0]
    for x in clean[1:]:
        top = torch.maximum(top, x)
    # A finite top shifts the exponents; an infinite one does not (all empty: every exp(-inf) is 0; +inf:
    # the +inf parts count 1 each and every finite part 0).
    shift = torch.where(torch.isinf(top), 0.0, top)
    overflowed = top == float("inf")
    weights = [torch.where(overflowed, (x == float("inf")).float(), torch.exp(x - shift)) for x in clean]
    total = weights[0]
    for w in weights[1:]:
        total = total + w
    lse = torch.log(total) + top  # -inf for an all-empty row (log 0 + -inf), +inf where a part overflowed
    inv_total = 1.0 / torch.where(total == 0, 1.0, total)
    return [w * inv_total for w in weights], lse


def merge_reference(outs: Sequence[Tensor], lses: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Merge parts ``outs[i]`` [T, H, L] with LSEs ``lses[i]`` [T, H]; returns (out in outs[0]'s dtype, lse fp32).

    Takes sequences (``tensor.unbind(0)`` of a stacked tensor costs no copy), so two parts need no stack.
    """
    weights, lse = merge_weights(lses)
    out = None
    for part, w in zip(outs, weights):
        # A part of weight 0 (empty) is never read: its output may be anything, NaN included.
        term = torch.where((w == 0)[..., None], 0.0, part.float() * w[..., None])
        out = term if out is None else out + term
    return out.to(outs[0].dtype), lse


# --------------------------------------------------------------------------------------------------------
# The ops


def _on_kernel_device(t: Tensor) -> bool:
    return t.device.type == "cuda"


def _merge_attn_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Merge two partial attention results: ``(out [T, H, L] in out_a's dtype, lse [T, H] fp32)``; see the
    module docstring."""
    check_merge_args(out_a, lse_a, out_b, lse_b)
    if _on_kernel_device(out_a):
        from mla_inductor.kernels.merge_attn_states import triton_merge_two

        return triton_merge_two(out_a, lse_a, out_b, lse_b)
    with autocast_off(out_a):
        out, lse = merge_reference([out_a, out_b], [lse_a, lse_b])
    return out.contiguous(), lse.contiguous()


def _merge_attn_states_fake(out_a, lse_a, out_b, lse_b):
    with argument_errors_reach_the_user():
        check_merge_args(out_a, lse_a, out_b, lse_b)
    return torch.empty_like(out_a, memory_format=torch.contiguous_format), torch.empty_like(
        lse_a, memory_format=torch.contiguous_format)


merge_attn_states = define_op("mla::merge_attn_states",
                              "(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b) -> (Tensor, Tensor)",
                              _merge_attn_states, _merge_attn_states_fake, direct=True)


def _merge_attn_states_n(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """Merge N partial results stacked on dim 0: outs [N, T, H, L], lses [N, T, H] -> ``(out [T, H, L], lse [T, H]
    fp32)``; see the module docstring."""
    check_merge_n_args(outs, lses)
    if _on_kernel_device(outs):
        from mla_inductor.kernels.merge_attn_states import triton_merge_stacked

        return triton_merge_stacked(outs, lses)
    with autocast_off(outs):
        out, lse = merge_reference(outs.unbind(0), lses.unbind(0))
    return out.contiguous(), lse.contiguous()


def _merge_attn_states_n_fake(outs, lses):
    with argument_errors_reach_the_user():
        check_merge_n_args(outs, lses)
    _, T, H, L = outs.shape
    return outs.new_empty((T, H, L)), lses.new_empty((T, H))


merge_attn_states_n = define_op("mla::merge_attn_states_n", "(Tensor outs, Tensor lses) -> (Tensor, Tensor)",
                                _merge_attn_states_n, _merge_attn_states_n_fake, direct=True)

refuse_autograd("mla::merge_attn_states", ("out_a", "lse_a", "out_b", "lse_b"))
refuse_autograd("mla::merge_attn_states_n", ("outs", "lses"))
