"""The layout keeps its promises: one lean import that also installs the pass, arrows that only go down,
backends added by one file, a cache key of the pass's own sources, product text about the product."""

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mla_inductor
from mla_inductor import backends
from mla_inductor.testing import make_decode_inputs
from source_imports import imported_modules

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / "mla_inductor"
HEAVY = ("torch._inductor", "triton", "flashinfer", "transformers", "flash_mla", "vllm")


def _run_ok(code: str) -> None:
    """Run ``code`` in a fresh interpreter (no module imported by other tests); it must print ok."""
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    environment["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
    result = subprocess.run([sys.executable, "-c", code + "print('ok')\n"], capture_output=True, text=True,
                            env=environment, cwd=ROOT, timeout=600)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_import_loads_nothing_heavy_and_leaves_cuda_alone():
    """What ``import mla_inductor`` adds to a bare ``import torch``: no Inductor, Triton, FlashInfer or
    transformers module (``python -X importtime -c "import mla_inductor"`` shows the same), no CUDA."""
    code = ("import sys, torch\n"
            "before = set(sys.modules)\n"
            "import mla_inductor\n"
            f"heavy = sorted(m for m in set(sys.modules) - before if m.split('.')[0] in {HEAVY!r} "
            f"or m.startswith({HEAVY!r}))\n"
            "assert not heavy, heavy\n"
            "assert not torch.cuda.is_initialized(), 'import initialised CUDA'\n"
            "assert hasattr(torch.ops.mla, 'paged_decode') and hasattr(torch.ops.mla, 'cache_append')\n"
            )
    _run_ok(code)


@pytest.mark.slow
def test_import_mla_inductor_alone_makes_compile_substitute_kernels():
    """No ``import mla_inductor.lowering``: the first compile loads the pass, which rewrites the call into
    the reference's Inductor code (no call of the opaque op left), with the reference's result."""
    code = ("import sys, torch\n"
            "import mla_inductor\n"
            "from mla_inductor.testing import make_decode_inputs, relative_error\n"
            "assert 'mla_inductor.lowering' not in sys.modules\n"
            "x = make_decode_inputs([5, 70], num_heads=4, kv_lora_rank=64, rope_dim=16, page_size=16,\n"
            "                       q_dtype=torch.float32, fmt='fp32')\n"
            "from torch._inductor.utils import run_and_get_code\n"
            "step = torch.compile(lambda *a: torch.ops.mla.paged_decode_with_lse(*a), fullgraph=True)\n"
            "(out, lse), code = run_and_get_code(step, *x.args())\n"
            "lines = '\\n'.join(code).splitlines()\n"
            "calls = [l for l in lines if 'torch.ops.mla.paged_decode' in l and not l.strip().startswith('#')]\n"
            "assert not calls, calls\n"
            "ref_out, ref_lse = mla_inductor.paged_decode_reference(*x.args())\n"
            "assert relative_error(out, ref_out) < 1e-5 and relative_error(lse, ref_lse) < 1e-5\n"
            "import mla_inductor.lowering as lowering\n"
            "assert lowering.installed_pass() is not None\n"
            "assert [d.backend for d in lowering.decisions()] == ['reference']\n"
            )
    _run_ok(code)


@pytest.mark.slow
def test_pass_api_answers_before_the_first_compile():
    """``mla_inductor.lowering.decisions()`` right after ``import mla_inductor``: no decision yet, not an
    AttributeError (naming the subpackage loads it and installs its pass, as the first compile would)."""
    code = ("import mla_inductor\n"
            "assert mla_inductor.lowering.decisions() == []\n"
            "assert mla_inductor.lowering.installed_pass() is not None\n"
            "try:\n"
            "    mla_inductor.no_such_name\n"
            "except AttributeError as e:\n"
            "    assert 'no_such_name' in str(e)\n"
            "else:\n"
            "    raise AssertionError('an unknown attribute must still raise AttributeError')\n")
    _run_ok(code)


@pytest.mark.slow
def test_a_user_pass_installed_before_the_import_still_runs_first():
    """Inductor's config already imported with the user's pass in it: ``import mla_inductor`` puts the
    placeholder there at once, and the pass it loads runs the user's pass before its own."""
    code = ("import torch\n"
            "import torch._inductor.config as config\n"
            "from torch._inductor.custom_graph_pass import CustomGraphPass\n"
            "seen = []\n"
            "class Mine(CustomGraphPass):\n"
            "    def __call__(self, graph): seen.append(len(graph.nodes))\n"
            "    def uuid(self): return 'mine'\n"
            "mine = config.post_grad_custom_post_pass = Mine()\n"
            "import mla_inductor\n"
            "assert config.post_grad_custom_post_pass is not mine\n"
            "torch.compile(lambda x: x * 2)(torch.ones(3))\n"
            "import mla_inductor.lowering as lowering\n"
            "assert lowering.installed_pass().previous is mine and seen, seen\n"
            )
    _run_ok(code)


BACKEND_FILE = '''
from mla_inductor.backends import Backend
from mla_inductor.reference import paged_decode_reference

CALLS = []


class MyBackend(Backend):
    name = "my_backend"

    def supports(self, problem, capability):
        return None if problem.device_type == "cpu" else "CPU only"

    def decode(self, *args):
        CALLS.append(args[0].shape)
        return paged_decode_reference(*args)


BACKEND = MyBackend()
'''


def test_a_backend_registered_from_one_file_is_selected(tmp_path, monkeypatch):
    (tmp_path / "my_backend.py").write_text(BACKEND_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    backends.register_backend("my_backend", "my_backend")
    try:
        x = make_decode_inputs([5, 9], num_heads=2, kv_lora_rank=32, rope_dim=16, page_size=4, q_dtype=torch.float32,
                               fmt="fp32")
        with mla_inductor.prefer_backends("my_backend", "reference"):
            assert mla_inductor.backend_for_call(*x.args()).backend == "my_backend"
            out = torch.ops.mla.paged_decode(*x.args())
        import my_backend

        assert my_backend.CALLS == [x.q_nope.shape]
        torch.testing.assert_close(out, mla_inductor.paged_decode_reference(*x.args())[0])
        # A table row ranks it too: the selection reads the registry, not a list of names.
        assert "my_backend" in backends.registered_backends() and "my_backend" in backends.availability()
    finally:
        backends.unregister_backend("my_backend")
    with pytest.raises(ValueError, match="known backend names"):
        mla_inductor.prefer_backends("my_backend").__enter__()


def test_a_backend_object_can_be_registered_and_ranked_by_a_table_row(monkeypatch):
    from mla_inductor import selection

    class Counting(backends.get_backend("reference").__class__):
        name = "counting"

    monkeypatch.setattr(selection, "TABLE", (selection.Row("cpu", ("fp32",), False, ("counting", "reference"),
                                                            "test row", "cpu-path"),) + selection.TABLE)
    backends.register_backend("counting", Counting())
    try:
        x = make_decode_inputs([3], num_heads=2, kv_lora_rank=32, rope_dim=16, page_size=4, q_dtype=torch.float32,
                               fmt="fp32")
        assert mla_inductor.backend_for_call(*x.args()).backend == "counting"
    finally:
        backends.unregister_backend("counting")
    assert mla_inductor.backend_for_call(*x.args()).backend == "reference"


# ----------------------------------------------------------------------------- the pass's cache key

def test_editing_a_benchmark_leaves_the_cache_key_alone(tmp_path, monkeypatch):
    """The key hashes the runtime package and the pass, nothing outside: a copy of the repository where a
    benchmark (and an example, a test, the test helpers) changes keeps its key; a runtime edit changes it."""
    import mla_inductor.lowering.graph_pass as graph_pass

    copy = tmp_path / "repo"
    for part in ("mla_inductor", "lowering", "benchmarks", "examples", "tests"):
        shutil.copytree(ROOT / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(graph_pass.mla_inductor, "__file__", str(copy / "mla_inductor" / "__init__.py"))
    monkeypatch.setattr(graph_pass, "__file__", str(copy / "lowering" / "graph_pass.py"))

    def key() -> bytes:
        graph_pass._source_hash.cache_clear()
        return graph_pass._source_hash()

    files = graph_pass.source_files()
    assert files and all(f.is_relative_to(copy / "mla_inductor") or f.is_relative_to(copy / "lowering") for f in files)
    original = key()
    for edited in ("benchmarks/bench_pass.py", "examples/minimal_decode.py", "tests/test_layout.py",
                   "mla_inductor/testing.py"):
        with open(copy / edited, "a") as f:
            f.write("\n# edited\n")
        assert key() == original, edited
    with open(copy / "mla_inductor" / "selection.py", "a") as f:
        f.write("\n# edited\n")
    assert key() != original
    monkeypatch.undo()
    graph_pass._source_hash.cache_clear()


# ----------------------------------------------------------------------------- arrows only go down

def test_runtime_never_imports_the_pass_benchmarks_or_test_helpers():
    """The runtime package imports down only: never lowering (but for the one lazy install hook in
    __init__.py), benchmarks or the test helpers."""
    for path in RUNTIME.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        for name in imported_modules(path):
            if rel == "mla_inductor/__init__.py" and name in ("mla_inductor.lowering", "mla_inductor.lowering.install"):
                continue
            if rel == "mla_inductor/testing.py":
                continue
            assert not name.startswith(("mla_inductor.lowering", "benchmarks", "lowering")), (rel, name)
            assert not name.startswith("mla_inductor.testing"), (rel, name)
    init = (RUNTIME / "__init__.py").read_text()
    assert init.count("mla_inductor.lowering import") == 1, "one lazy install hook, inside a function"


def test_private_torch_apis_stay_in_the_compat_files():
    private = re.compile(r"torch\._(?!_)[a-z]\w*")
    for path in list(RUNTIME.rglob("*.py")) + list((ROOT / "lowering").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ("mla_inductor/_compat.py", "lowering/_compat.py", "mla_inductor/testing.py"):
            continue
        code = "\n".join(line.split("#")[0] for line in path.read_text().splitlines())
        code = re.sub(r'""".*?"""', "", code, flags=re.S)
        assert not private.findall(code), (rel, private.findall(code))


def _backend_names_in_conditions(path: Path) -> list[tuple[int, str]]:
    names = set(backends.registered_backends())
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        tests = [node.test] if isinstance(node, (ast.If, ast.IfExp, ast.While)) else []
        tests += node.ifs if isinstance(node, ast.comprehension) else []
        for test in tests:
            for const in ast.walk(test):
                if isinstance(const, ast.Constant) and const.value in names:
                    found.append((node.lineno if hasattr(node, "lineno") else 0, const.value))
    return found


def test_no_backend_name_in_a_condition_outside_its_own_file():
    files = list(RUNTIME.rglob("*.py")) + list((ROOT / "lowering").rglob("*.py")) + list(
        (ROOT / "benchmarks").rglob("*.py"))
    for path in files:
        for line, name in _backend_names_in_conditions(path):
            assert path.stem == name, f"{path.relative_to(ROOT)}:{line} tests for backend {name!r}"


# ----------------------------------------------------------------------------- product text

def test_product_text_speaks_of_the_product():
    pattern = re.compile(r"gpu-deps|\$OUT|KINDS|\.\./shared|lent machine")
    parts = ("mla_inductor", "lowering", "benchmarks", "docs", "examples")
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md"] + [p for part in parts
                                    for p in (ROOT / part).rglob("*") if p.is_file() and p.suffix in (".py", ".md")]
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
            if pattern.search(line)]
    assert not hits, hits


# ----------------------------------------------------------------------------- benchmarks anyone can run

BENCHMARKS = ("bench_kernels.py", "bench_pass.py", "bench_e2e.py", "bench_generate.py", "bench_modes.py",
              "bench_triton_launch.py", "bench_kernel_variants.py")


def test_benchmarks_read_no_environment_and_edit_no_import_path():
    for name in BENCHMARKS + ("peers.py", "report.py"):
        code = (ROOT / "benchmarks" / name).read_text()
        assert "os.environ" not in code and "getenv" not in code and "sys.path" not in code, name


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what the benchmarks say without a GPU")
@pytest.mark.parametrize("script", BENCHMARKS)
def test_benchmarks_without_a_gpu_say_so_and_help_works(script):
    path = str(ROOT / "benchmarks" / script)
    result = subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode != 0 and "needs a CUDA GPU" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    helped = subprocess.run([sys.executable, path, "--help"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert helped.returncode == 0 and "--out" in helped.stdout, helped.stderr[-2000:]


