"""``torch.ops.mla.prefill_attention``: a prompt's ordinary (un-absorbed) attention on keys/values expanded
from its latents, for the prefill of an MLA model. Schema, fake impl and kernel choice side by side.

    out = torch.ops.mla.prefill_attention(q, k, v, softmax_scale, causal=True)

q [B, H, Q, Dqk], k [B, Hkv, S, Dqk], v [B, Hkv, S, Dv] (sdpa's layout; any strides with a contiguous last
dim; H a multiple of Hkv) -> out [B, Q, H, Dv], contiguous: token-major, the layout HF's attention functions
return, so that the caller's ``reshape(B, Q, H * Dv)`` is a view. ``causal``: query i attends keys 0..i
(then Q == S: a prompt attending to itself); otherwise every query attends every key. No mask: a padded
batch goes to ``torch.nn.functional.scaled_dot_product_attention`` with its mask, in the caller.

The kernel (``prefill_kernel``): FlashInfer's single-request prefill (``flashinfer.single_prefill_with_kv_cache``,
one call per sequence) where it takes the call: CUDA, fp16/bf16, head dims (Dqk, Dv) of (64|128|256, same) or
DeepSeek's (192, 128), strides and pointers 16-byte aligned; its FA3 kernels on SM90, FA2 elsewhere. Torch's
sdpa otherwise (CPU, fp32, other head dims, FlashInfer not installed). Torch's sdpa has no flash kernel for
Dqk != Dv, so on a GPU DeepSeek's dims otherwise run its memory-efficient kernel. FlashInfer builds each
kernel on its first use; one that cannot be imported, built or loaded is left for sdpa, with a warning
(``FlashInferBuilds``); any other error of a call propagates.

Importing this module registers the op (``mla_inductor.hf`` does); FlashInfer is imported on the first call
it takes. The fake impl lets ``torch.compile`` keep the op in its graph.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from mla_inductor._compat import argument_errors_reach_the_user
from mla_inductor.contract import fail

Tensor = torch.Tensor

OP = "prefill_attention"
SDPA = "sdpa"
FLASHINFER_FA3 = "flashinfer-fa3"
FLASHINFER_FA2 = "flashinfer-fa2"
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
FA3_CAPABILITY = (9, 0)  # FlashInfer's FA3 kernels are built for sm_90a only


def _flashinfer_head_dims(head_dim_qk: int, head_dim_vo: int) -> bool:
    """The (Dqk, Dv) pairs FlashInfer's prefill kernels are built for (its ``is_fa3_prefill_head_dim_supported``;
    its FA2 kernels cover the same pairs)."""
    if head_dim_qk == head_dim_vo:
        return head_dim_qk in (64, 128, 256)
    return (head_dim_qk, head_dim_vo) == (192, 128)


# ----------------------------------------------------------------------------- argument checks


def check_prefill_args(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool) -> None:
    """Shapes, dtypes and devices (no data read); ``mla.prefill_attention: ``-prefixed errors."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            fail(OP, ValueError, f"{name} must be 4-D [B, heads, tokens, head_dim], got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            fail(OP, TypeError, f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.stride(-1) != 1:
            fail(OP, ValueError, f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")
    if not q.dtype == k.dtype == v.dtype:
        fail(OP, TypeError, f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        fail(OP, ValueError, f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, H, Q, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        fail(OP, ValueError, f"k and v must have q's batch {B}, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[3] != D:
        fail(OP, ValueError, f"k's head_dim must be q's ({D}), got k {tuple(k.shape)}")
    if v.shape[1] != k.shape[1] or v.shape[2] != k.shape[2]:
        fail(OP, ValueError,
             f"v must be [B, Hkv, S, Dv] with k's Hkv and S, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[1] < 1 or H % k.shape[1] != 0:
        fail(OP, ValueError, f"q's heads ({H}) must be a multiple of k's and v's ({k.shape[1]})")
    if causal and Q != k.shape[2]:
        fail(OP, ValueError, f"causal=True needs as many queries as keys (a prompt attending to itself), got "
                             f"q {tuple(q.shape)}, k {tuple(k.shape)}")
    if not softmax_scale > 0:
        fail(OP, ValueError, f"softmax_scale must be > 0, got {softmax_scale}")


# ----------------------------------------------------------------------------- kernel choice


def prefill_kernel(q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> str:
    """Which kernel runs ``mla.prefill_attention`` on these arguments: ``"flashinfer-fa3"``,
    ``"flashinfer-fa2"`` or ``"sdpa"`` (see ``flashinfer_reason`` for why not FlashInfer)."""
    if flashinfer_reason(q, k, v) is not None:
        return SDPA
    kernel = FLASHINFER_FA3 if torch.cuda.get_device_capability(q.device) == FA3_CAPABILITY else FLASHINFER_FA2
    return SDPA if FLASHINFER_BUILDS.failed(_module_key(kernel, q, v)) else kernel


def _module_key(kernel: str, q: Tensor, v: Tensor) -> tuple:
    """What a FlashInfer single-prefill module is built for (one JIT build each)."""
    return kernel, q.dtype, q.shape[-1], v.shape[-1]


class FlashInferBuilds:
    """FlashInfer builds each prefill kernel on its first use (JIT, minutes on a machine without its prebuilt
    cache; impossible without a CUDA compiler). A kernel whose first call fails because it cannot be imported,
    built or loaded here (``kernel_unusable``) is not called again: its calls go to sdpa, with one warning
    naming the error. Any other error (out of memory, a CUDA error, the library refusing this call) is this
    call's failure: it propagates and the kernel stays on, and a kernel that has run once is never disabled."""

    def __init__(self):
        self.ran: set[tuple] = set()
        self.errors: dict[tuple, str] = {}

    def failed(self, key: tuple) -> bool:
        return key in self.errors

    def run(self, key: tuple, kernel, fallback):
        if key in self.ran:
            return kernel()
        try:
            out = kernel()
        except Exception as e:  # noqa: BLE001 - whatever the build or load raised: see the class docstring
            if not kernel_unusable(e):
                raise
            self.errors[key] = f"{type(e).__name__}: {e}"
            warnings.warn(f"mla.prefill_attention: FlashInfer's prefill kernel {key} cannot be built or loaded "
                          f"here ({self.errors[key]}); its calls run torch's sdpa instead", RuntimeWarning,
                          stacklevel=3)
            return fallback()
        self.ran.add(key)
        return out


FLASHINFER_BUILDS = FlashInferBuilds()


# CUDA errors that say a loaded module has no build for this GPU: the kernel cannot run here, on any call.
NO_BUILD_FOR_THIS_GPU = ("no kernel image is available", "invalid device function")
# Where FlashInfer builds and loads its JIT modules (flashinfer/jit/: ninja, nvcc, the module loader).
_FLASHINFER_BUILD_CODE = "/flashinfer/jit/"


def kernel_unusable(error: Exception) -> bool:
    """Whether a kernel's first call failed because the kernel cannot run here: FlashInfer (or a module it
    needs) does not import, its JIT build or load failed (raised from FlashInfer's ``jit`` package), or the
    module has no build for this GPU. Anything else, out of memory first of all, is the call's own failure."""
    if isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)):
        return False
    if isinstance(error, ImportError) or any(text in str(error) for text in NO_BUILD_FOR_THIS_GPU):
        return True
    return _raised_by_flashinfer_build(error)


def _raised_by_flashinfer_build(error: BaseException) -> bool:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        frame = error.__traceback__
        while frame is not None:
            if _FLASHINFER_BUILD_CODE in frame.tb_frame.f_code.co_filename.replace("\\", "/"):
                return True
            frame = frame.tb_next
        error = error.__cause__ or error.__context__
    return False


def _aligned(t: Tensor) -> bool:
    """Base pointer and every stride but the last a multiple of 16 bytes (what vectorized loads need)."""
    step = 16 // t.element_size()
    return t.data_ptr() % 16 == 0 and all(s % step == 0 for s in t.stride()[:-1])


def flashinfer_reason(q: Tensor, k: Tensor, v: Tensor) -> Optional[str]:
    """None when FlashInfer's prefill takes the call, else why not."""
    if q.device.type != "cuda":
        return f"FlashInfer runs on CUDA, got {q.device}"
    if q.dtype not in FLASHINFER_DTYPES:
        return f"FlashInfer's prefill takes fp16/bf16, got {q.dtype}"
    if not _flashinfer_head_dims(q.shape[-1], v.shape[-1]):
        return f"FlashInfer's prefill has no kernel for head dims (qk {q.shape[-1]}, vo {v.shape[-1]})"
    for name, t in (("q", q), ("k", k), ("v", v)):
        # Its kernels load with 16-byte vectors (FA3: TMA): every stride and the base 16-byte aligned.
        if not _aligned(t):
            return f"{name} is not 16-byte aligned (strides {t.stride()})"
    if max(t.stride(i) for t in (q, k, v) for i in range(3)) >= 2**31:
        return "a stride does not fit FlashInfer's 32-bit strides"
    return flashinfer_unavailable_reason()


def flashinfer_unavailable_reason() -> Optional[str]:
    """None when FlashInfer imports in a version our decode backends take and a CUDA device is present, else
    why not: the FlashInfer decode backend's library check (FlashInfer is imported on the first call)."""
    from mla_inductor.backends import get_backend

    return get_backend("flashinfer_fa2").unavailable_reason()


# ----------------------------------------------------------------------------- the kernels


def sdpa_prefill(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool) -> Tensor:
    """Torch's sdpa, as HF's sdpa attention calls it (``is_causal`` only with more than one query)."""
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    if q.is_cuda:
        # torch 2.11's sdpa on an H100 returned wrong values (relative error 1.4) for a v whose pointer lay 8
        # bytes past 16-byte alignment: hand its CUDA kernels aligned copies of such inputs.
        q, k, v = (t if _aligned(t) else t.contiguous() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, scale=softmax_scale, is_causal=causal and q.shape[2] > 1, **gqa)
    return out.transpose(1, 2).contiguous()


def flashinfer_prefill(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, backend: str) -> Tensor:
    """FlashInfer's single-request prefill, one call per sequence: q[b] as [Q, H, Dqk], k[b] / v[b] as
    [S, Hkv, D] (NHD, transposed views: FlashInfer reads the strides); its output [Q, H, Dv] is already
    token-major."""
    import flashinfer

    run = flashinfer.single_prefill_with_kv_cache
    # NHD views, not kv_layout="HND": FlashInfer's SM90 (FA3) single prefill reads kv_len and num_kv_heads as
    # k.size(0) / k.size(1) whatever the layout (0.6.18), so an HND k gives a wrong kv_len and a zero group
    # size (a division by zero on the host). Its FA2 path reads both layouts; NHD suits both.
    outs = [run(q[b].transpose(0, 1), k[b].transpose(0, 1), v[b].transpose(0, 1), causal=causal, kv_layout="NHD",
                sm_scale=softmax_scale, backend=backend) for b in range(q.shape[0])]
    return outs[0].unsqueeze(0) if len(outs) == 1 else torch.stack(outs)


# ----------------------------------------------------------------------------- the op


@torch.library.custom_op("mla::prefill_attention", mutates_args=())
def prefill_attention(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool = True) -> Tensor:
    """Ordinary attention of a prompt: q [B, H, Q, Dqk], k [B, Hkv, S, Dqk], v [B, Hkv, S, Dv] -> [B, Q, H, Dv]
    contiguous; ``causal`` (Q == S): query i attends keys 0..i. FlashInfer's prefill where it takes the call,
    torch's sdpa otherwise (``prefill_kernel``)."""
    check_prefill_args(q, k, v, softmax_scale, causal)
    if q.shape[0] == 0 or q.shape[2] == 0:
        return q.new_empty(q.shape[0], q.shape[2], q.shape[1], v.shape[-1])
    kernel = prefill_kernel(q, k, v, causal)
    if kernel == SDPA:
        return sdpa_prefill(q, k, v, softmax_scale, causal)
    backend = "fa3" if kernel == FLASHINFER_FA3 else "fa2"
    return FLASHINFER_BUILDS.run(_module_key(kernel, q, v),
                                 lambda: flashinfer_prefill(q, k, v, softmax_scale, causal, backend),
                                 lambda: sdpa_prefill(q, k, v, softmax_scale, causal))


@prefill_attention.register_fake
def _(q, k, v, softmax_scale, causal=True):
    with argument_errors_reach_the_user():
        check_prefill_args(q, k, v, softmax_scale, causal)
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], v.shape[-1])


__all__ = ["FLASHINFER_BUILDS", "FLASHINFER_FA2", "FLASHINFER_FA3", "SDPA", "FlashInferBuilds", "check_prefill_args",
           "flashinfer_reason", "prefill_attention", "prefill_kernel", "sdpa_prefill"]
