"""mla-inductor: DeepSeek-style MLA paged decode as a PyTorch op that torch.compile makes fast.

``import mla_inductor`` registers ``torch.ops.mla.paged_decode``, ``paged_decode_with_lse`` and
``cache_append`` and arranges for the Inductor pass (``mla_inductor.lowering``) to rewrite the calls
into the best kernel for the device when a model is compiled. Nothing heavy happens at import: no
Inductor, Triton, FlashInfer or transformers import and no CUDA initialisation; the pass is loaded
by the first compile that reaches Inductor.
"""

from mla_inductor import _compat
from mla_inductor.cache import (
    PagedLatentCache,
    cache_format,
    fp8_scale_for,
    pack_fp8_ds_mla,
    register_host_lengths,
    unpack_fp8_ds_mla,
)
from mla_inductor.backends import forget_plans, plans_shared_in_capture
from mla_inductor.contract import DecodeProblem
from mla_inductor.merge import merge_attn_states, merge_attn_states_n
from mla_inductor.ops import cache_append, paged_decode, paged_decode_with_lse
from mla_inductor.reference import paged_decode_reference
from mla_inductor import tuning  # installs measured selection ahead of the table
from mla_inductor.selection import (
    allow_fp8_query,
    backend_for_call,
    compiling_for_capture,
    prefer_backends,
    select_backend,
)

__version__ = "0.1.0"


def _load_lowering_pass():
    """The one arrow up into the pass: imported (and installed) on the first compile that reaches Inductor."""
    from mla_inductor.lowering import install

    return install()


_compat.install_post_grad_pass_on_first_compile(_load_lowering_pass)


def __getattr__(name: str):
    # ``mla_inductor.lowering.decisions()`` and the rest of the pass's API work before the first compile too:
    # the subpackage is loaded (and its pass installed, as the first compile would) when first named.
    if name == "lowering":
        _load_lowering_pass()
        return globals()["lowering"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "DecodeProblem",
    "allow_fp8_query",
    "backend_for_call",
    "PagedLatentCache",
    "cache_append",
    "cache_format",
    "compiling_for_capture",
    "forget_plans",
    "fp8_scale_for",
    "merge_attn_states",
    "merge_attn_states_n",
    "pack_fp8_ds_mla",
    "paged_decode",
    "paged_decode_reference",
    "paged_decode_with_lse",
    "plans_shared_in_capture",
    "prefer_backends",
    "register_host_lengths",
    "select_backend",
    "unpack_fp8_ds_mla",
]
