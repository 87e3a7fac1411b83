"""The transformers releases the HF integration is tested with, the import that checks them, and the one place
that knows how their APIs differ.

Kept apart from ``hf.py`` so that ``testing.py`` (the random-model factory) can check the version without
importing the public HF module.
"""

from __future__ import annotations

from typing import Any, Optional

from mla_inductor._compat import version_tuple

# The tested range (pyproject's ``hf`` extra): DeepSeek-style attention caches the latent and calls
# ``update(kv_nope, k_rot, layer_idx)`` on the cache since these releases.
MIN_TRANSFORMERS = (5, 23)
MAX_TRANSFORMERS_MAJOR = 5
# transformers 5.24 renamed the argument that hands a cache to generate() and to a model's forward from
# ``past_key_values`` to ``cache``; the old name still works there, with a deprecation warning.
CACHE_ARGUMENT_RENAMED = (5, 24)

_cache_keyword: Optional[str] = None  # the installed release's name for it (set by require_transformers)


def require_transformers():
    """Import transformers, or raise ImportError naming the supported range and the found version."""
    global _cache_keyword
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "mla_inductor.hf needs Hugging Face transformers 5.x (>= 5.23): pip install 'mla-inductor[hf]'"
        ) from e
    version = version_tuple(transformers.__version__, 2)
    if version < MIN_TRANSFORMERS or version[0] > MAX_TRANSFORMERS_MAJOR:
        raise ImportError(
            f"mla_inductor.hf needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))}, < "
            f"{MAX_TRANSFORMERS_MAJOR + 1} (MLA attention that caches the latent), found {transformers.__version__}: "
            "pip install 'mla-inductor[hf]'"
        )
    # Settled here, before any model runs: a decode step traced by torch.compile then reads a constant.
    _cache_keyword = "cache" if version >= CACHE_ARGUMENT_RENAMED else "past_key_values"
    return transformers


def cache_keyword() -> str:
    """The name of the keyword argument that hands a cache to ``model.generate()`` and to a model's forward in
    the installed transformers: ``"cache"`` from 5.24 on, ``"past_key_values"`` before."""
    if _cache_keyword is None:
        require_transformers()
    return _cache_keyword


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """``{"cache": cache}`` (transformers >= 5.24) or ``{"past_key_values": cache}`` (5.23): the keyword
    argument that hands ``cache`` to ``model.generate(...)`` or a model's forward without a deprecation
    warning, for code that runs on every supported release (``model.generate(ids, **cache_kwargs(cache))``)."""
    return {cache_keyword(): cache}
