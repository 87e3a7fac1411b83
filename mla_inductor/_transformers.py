"""The transformers releases the HF integration is tested with, and the import that checks them.

Kept apart from ``hf.py`` so that ``testing.py`` (the random-model factory) can check the version without
importing the public HF module.
"""

from __future__ import annotations

from mla_inductor._compat import version_tuple

# The tested range (pyproject's ``hf`` extra): DeepSeek-style attention caches the latent and calls
# ``past_key_values.update(kv_nope, k_rot, layer_idx)`` since these releases.
MIN_TRANSFORMERS = (5, 23)
MAX_TRANSFORMERS_MAJOR = 5


def require_transformers():
    """Import transformers, or raise ImportError naming the supported range and the found version."""
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
    return transformers
