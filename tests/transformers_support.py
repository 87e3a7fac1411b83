"""The transformers the HF tests need, or a skip that names the version found (one gate for every test file)."""

import pytest


def transformers_or_skip(who: str):
    """The transformers module where a version ``mla_inductor.hf`` supports is installed; else ``who`` (a test
    module, or a test) is skipped, saying which version it needs and which it found."""
    from mla_inductor._transformers import MIN_TRANSFORMERS

    needed = ".".join(map(str, MIN_TRANSFORMERS))
    transformers = pytest.importorskip("transformers", reason=f"{who} needs transformers>={needed} "
                                                              "(pip install 'mla-inductor[hf]')")
    from mla_inductor._compat import version_tuple

    if version_tuple(transformers.__version__, 2) < MIN_TRANSFORMERS:
        pytest.skip(f"{who} needs transformers>={needed}, found {transformers.__version__}", allow_module_level=True)
    return transformers
