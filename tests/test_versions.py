"""Versions read as the libraries provide them: packaging's parser, importlib.metadata, transformers' cache keyword."""

import subprocess
import sys

import pytest

from mla_inductor._compat import version_tuple


@pytest.mark.parametrize("text,parts,expected", [
    ("0.6.18.post1", 3, (0, 6, 18)), ("13.0", 3, (13, 0, 0)), ("5.23.0.dev0", 2, (5, 23)),
    ("2.13.0+cu130", 3, (2, 13, 0)), ("1.0rc1", 2, (1, 0)), ("unknown version", 2, (0, 0)),
])
def test_version_tuple_reads_release_numbers(text, parts, expected):
    assert version_tuple(text, parts) == expected


def test_library_versions_import_no_library():
    """FlashInfer, vLLM or transformers cost seconds to import (and may initialise CUDA): their versions come from
    the installed metadata, and a library that is not installed reads None."""
    code = ("import sys\n"
            "from mla_inductor.backends import library_versions\n"
            "before = set(sys.modules)\n"
            "versions = library_versions(extra=('torch', 'transformers', 'no_such_library_xyz'))\n"
            "import importlib.metadata as m\n"
            "assert versions['torch'] == m.version('torch'), versions\n"
            "assert versions['no_such_library_xyz'] is None, versions\n"
            "new = sorted(n for n in set(sys.modules) - before if n.split('.')[0] in versions)\n"
            "assert not new, new\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_cache_keyword_follows_the_installed_transformers(monkeypatch):
    """generate() and the models' forward take the cache as ``cache`` from transformers 5.24 on (the old name
    warns there) and as ``past_key_values`` before."""
    from mla_inductor import _transformers, hf

    transformers = pytest.importorskip("transformers")
    for version, keyword in (("5.23.0", "past_key_values"), ("5.24.0", "cache"), ("5.25.1", "cache")):
        monkeypatch.setattr(transformers, "__version__", version)
        monkeypatch.setattr(_transformers, "_cache_keyword", None)
        assert hf.cache_kwargs("the cache") == {keyword: "the cache"}, version
