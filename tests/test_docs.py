"""The README's commands are the ones CI and users run."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def readme_commands():
    block = re.search(r"## Install and run\n.*?```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readme_commands_as_written():
    """CI is the README's path: its install, main job and test command, the same lines in the same order (CI
    may run more, e.g. print versions)."""
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = readme_commands()
    assert any("pytest" in c and "-n auto" in c for c in commands), commands
    at = [ci.index(c) if c in ci else None for c in commands]
    assert None not in at and at == sorted(at), dict(zip(commands, at))


def test_readme_main_job_exists():
    main_job = next(c for c in readme_commands() if c.startswith("python examples/"))
    assert (ROOT / main_job.split()[1]).is_file()


@pytest.mark.slow
@pytest.mark.parametrize("script,args", [("examples/deepseek_generate.py", ["--steps", "4", "--device", "cpu"]),
                                         ("examples/minimal_decode.py", ["--steps", "2", "--device", "cpu"])])
def test_examples_run_as_the_readme_says(script, args, tmp_path):
    """The README's main job and the minimal example run on CPU from a clean process (one test each, so that
    pytest-xdist runs them side by side)."""
    # An empty Inductor cache: a graph compiled earlier in the session would skip the pass, whose decisions
    # the examples print; graphs compiled twice within the example are still served from it.
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    result = subprocess.run([sys.executable, str(ROOT / script), *args], capture_output=True, text=True,
                            timeout=600, cwd=ROOT, env=env)
    assert result.returncode == 0, f"{script}:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    assert "tokens/s" in result.stdout and "->" in result.stdout, result.stdout
    # (a warning on stderr is the example's: it must print none, with the transformers installed)
    warned = [line for line in result.stderr.splitlines() if "Warning" in line or "deprecated" in line]
    assert not warned, result.stderr[-3000:]
    if script == "examples/deepseek_generate.py":
        # The main job names what it ran with and times repeats: a median with its spread, and ms per token.
        lines = result.stdout.splitlines()
        assert re.match(r"torch \S+, transformers \S+, mla_inductor \S+, device cpu", lines[0]), lines[0]
        text = result.stdout
        assert re.search(r"ours .* [\d.]+ tokens/s \([\d.]+-[\d.]+\), +[\d.]+ ms per token", text), text
        assert "speed-up is a GPU matter" in text and "ours vs HF" not in text, text  # no CPU ratio offered as one
        assert "-> reference: the reference decode (mla_inductor/reference.py) compiled by Inductor" in text, text


def test_readme_installs_torch_before_the_package_and_names_the_supported_range():
    commands = readme_commands()
    torch_line = next(i for i, c in enumerate(commands) if c.startswith("pip install torch"))
    package_line = next(i for i, c in enumerate(commands) if c.startswith("pip install -e"))
    assert torch_line < package_line, commands
    pyproject = (ROOT / "pyproject.toml").read_text()
    low = re.search(r'"torch>=(\d+\.\d+)"', pyproject).group(1)
    readme = (ROOT / "README.md").read_text()
    assert f"torch {low} to 2.14" in readme and f"torch>={low}" in readme, (low, "README and pyproject disagree")
    assert f"torch {low} through 2.14" in (ROOT / "docs" / "architecture.md").read_text()


def test_readme_benchmark_commands_exist():
    block = re.search(r"## Benchmarks\n.*?```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    scripts = re.findall(r"^(?:python|torchrun .*?) (benchmarks/\S+\.py)", block, re.M)
    assert len(scripts) == len(block.strip().splitlines()), "every line of the block runs a benchmark script"
    assert scripts and all((ROOT / s).is_file() for s in scripts), scripts
    readme = (ROOT / "README.md").read_text()
    unlisted = [p.name for p in (ROOT / "benchmarks").glob("bench_*.py") if f"benchmarks/{p.name}" not in readme]
    assert not unlisted, f"benchmarks the README does not mention: {unlisted}"


def test_readme_first_python_snippet_runs_as_written():
    """The README's first Python block (the op on random inputs) runs as written on CPU, and its output matches
    the float64 oracle of tests/naive.py."""
    block = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    check = ("\nimport sys; sys.path.insert(0, 'tests')\nfrom naive import naive_decode\n"
             "ref = naive_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale)[0]\n"
             "assert out.shape == q_nope.shape and torch.isfinite(out).all()\n"
             "torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)\n"
             "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", block + check], capture_output=True, text=True, timeout=300,
                            cwd=ROOT)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


NOTEBOOK = re.compile(r"\b(fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|[a-z]+teenth|twentieth|"
                      r"twenty-[a-z]+) run\b|docs/benchmarks\.md")


def test_docs_are_a_guide_not_a_log():
    """The user's pages stay short and readable: README and CHANGELOG at most 150 lines, docs/kernels.md at most
    300, no line of any page over 200 characters, and no run narrative in code, tests or README."""
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    too_long = [f"{p.name}:{n}" for p in pages for n, line in enumerate(p.read_text().splitlines(), 1)
                if len(line) > 200]
    assert not too_long, too_long
    for name, most in (("README.md", 150), ("CHANGELOG.md", 150), ("docs/kernels.md", 300)):
        assert len((ROOT / name).read_text().splitlines()) <= most, name
    sources = [ROOT / "README.md", *(p for d in ("mla_inductor", "lowering", "tests") for p in (ROOT / d).rglob("*.py"))]
    cited = [f"{p.relative_to(ROOT)}:{n}" for p in sources for n, line in enumerate(p.read_text().splitlines(), 1)
             if NOTEBOOK.search(line) and p.name != "test_docs.py"]
    assert not cited, cited


def test_every_link_into_the_results_page_names_an_anchor_it_has():
    page = (ROOT / "docs" / "results.md").read_text()
    anchors = set(re.findall(r'<a id="([a-z0-9-]+)"></a>', page))
    texts = [ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md"),
             *(p for d in ("mla_inductor", "lowering", "benchmarks", "tests", "examples") for p in (ROOT / d).rglob("*.py"))]
    missing = [f"{p.relative_to(ROOT)}: #{a}" for p in texts for a in re.findall(r"results\.md#([a-z0-9-]+)", p.read_text())
               if a not in anchors]
    assert not missing, missing
