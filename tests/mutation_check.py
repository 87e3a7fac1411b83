"""Mutation check of the suite's key tests: break each key behaviour on purpose and see its test fail.

    python tests/mutation_check.py            # prints a markdown list (docs/reliability.md holds its output)
    python tests/mutation_check.py --only cache   # the mutations whose behaviour names "cache"

For each mutation (a small text patch of one source file) the script copies the repository into a
temporary directory (the package laid out as installed: ``lowering/`` inside ``mla_inductor/``), runs the
named tests there unpatched (they must pass), applies the patch, runs them again (they must fail) and
reports both. A patch whose text is no longer in the file is reported as stale: update it with the code.
Not collected by pytest (run it by hand; it takes a few minutes).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    behaviour: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS = (
    Mutation("masked reads: unused block-table entries are never dereferenced",
             "mla_inductor/reference.py", ".clamp(0, num_pages - 1)", "",
             ("tests/test_hostile.py::test_eager[unused block-table entries 2147480000 (the peers' value)]",
              "tests/test_contract.py::test_unused_block_table_entries_may_hold_garbage")),
    Mutation("masked reads: memory a call does not attend never reaches a product",
             "mla_inductor/reference.py", "keys = torch.where(used[..., None], decode_tokens(stored, kv_scale), 0.0)",
             "keys = decode_tokens(stored, kv_scale)",
             ("tests/test_hostile.py::test_eager[NaN in the last page past seq_len]",
              "tests/test_hostile.py::test_compiled[NaN in unused pages that unused block-table entries name]")),
    Mutation("value checks, eager: the data checks run on CPU", "mla_inductor/ops.py",
             "    if wants_value_checks(q_nope):\n", "    if False:\n",
             ("tests/test_hostile.py::test_eager[seq_len 21 > capacity 20]",)),
    Mutation("value checks, compiled: the pass inserts the check op", "lowering/graph_pass.py",
             "check_values = op_name if wants_value_checks(fake[0]) else None", "check_values = None",
             ("tests/test_hostile.py::test_compiled[seq_len 21 > capacity 20]",)),
    Mutation("value checks, compiled: dead-code elimination keeps the check op", "lowering/checks.py",
             "keep_in_graph(CHECK_DECODE_VALUES)", "pass",
             ("tests/test_hostile.py::test_compiled[used page id -1]",)),
    Mutation("value checks, GPU form: the device asserts test what the host checks test", "mla_inductor/contract.py",
             "(~used | ((pages >= 0) & (pages < P))).all()", "(~used | (pages >= 0)).all()",
             ("tests/test_hostile.py::test_device_asserts_refuse_what_the_host_checks_refuse[used page id = num_pages]",)),
    Mutation("value checks: cache_append refuses a bad kv_scale", "mla_inductor/contract.py",
             '    _check_scale_value("cache_append", "kv_scale", kv_scale)\n', "",
             ("tests/test_hostile.py::test_eager[cache_append: kv_scale 0 (fp8 cache)]",)),
    Mutation("value checks: softmax_scale must be finite", "mla_inductor/contract.py",
             "    if not math.isfinite(softmax_scale):\n", "    if False:\n",
             ("tests/test_hostile.py::test_eager[softmax_scale NaN]",)),
    Mutation("documented results: a call that attends nothing gives out 0, lse -inf", "mla_inductor/contract.py",
             "return not (rows and pages and page_size and width)", "return False",
             ("tests/test_hostile.py::test_eager[empty batch: B=0, T=0]",
              "tests/test_hostile.py::test_eager[cache of 0 pages, lengths 0]")),
    Mutation("documented results: a huge softmax_scale gives the one-hot limit", "mla_inductor/reference.py",
             "sign, scale = (1.0, softmax_scale) if softmax_scale >= 0 else (-1.0, -softmax_scale)",
             "sign, scale = softmax_scale, 1.0",
             ("tests/test_hostile.py::test_eager[softmax_scale 1e38]",)),
    Mutation("cache key: TRITON_INTERPRET is in the pass's uuid", "mla_inductor/backends/triton.py",
             'environment = ("TRITON_INTERPRET",)', "environment = ()",
             ("tests/test_compiled_records.py::test_pass_uuid_covers_the_environment_selection_reads",
              "tests/test_compiled_records.py::test_fx_cache_misses_when_triton_interpret_changes")),
    Mutation("cache key: debug mode is in the pass's uuid", "lowering/graph_pass.py",
             'f"debug_checks={debug_checks_enabled()}", ', "",
             ("tests/test_compiled_records.py::test_pass_uuid_covers_the_environment_selection_reads",)),
    Mutation("preference: prefer_backends changes the choice", "mla_inductor/selection.py",
             'with _pushed("preferences", tuple(names)):', 'with _pushed("preferences", ()):',
             ("tests/test_selection.py::test_user_preference_by_context_and_env",)),
    Mutation("preference: a change after compiling warns", "lowering/records.py",
             "if not known.warned and user_preference() != known.preference:", "if False:",
             ("tests/test_compiled_records.py::test_preference_changed_after_compiling_warns_once",
              "tests/test_compiled_records.py::test_preference_set_by_environment_after_compiling_warns")),
    Mutation("decisions after a cache hit: a cached graph's record is read", "lowering/records.py",
             "        _remember(decision, \" (a compiled graph from Inductor's cache)\")\n", "        pass\n",
             ("tests/test_compiled_records.py::test_decisions_and_their_log_survive_an_fx_cache_hit",)),
    Mutation("decisions after a cache hit: the pass writes the record into the graph", "lowering/graph_pass.py",
             "            write_record(graph, made)\n", "",
             ("tests/test_compiled_records.py::test_decisions_and_their_log_survive_an_fx_cache_hit",)),
    Mutation("error types: compile-time errors are the documented ValueError / TypeError",
             "mla_inductor/_compat.py", "        raise passing(str(e)).with_traceback(e.__traceback__) from None\n",
             "        raise\n",
             ("tests/test_contract.py::test_hostile_input_at_compile_time[q_pe heads]",
              "tests/test_hostile.py::test_compiled[q_nope int32]")),
    Mutation("error types: no error log before a compile-time TypeError", "mla_inductor/_compat.py",
             'logging.getLogger("torch._subclasses.fake_tensor").addFilter(_not_a_compile_time_error)', "pass",
             ("tests/test_contract.py::test_hostile_input_at_compile_time[q_nope int]",)),
)


def copy_repository(dest: Path) -> None:
    """The package as installed (``mla_inductor.lowering`` is ``lowering/``), the tests and pytest's config."""
    shutil.copytree(ROOT / "mla_inductor", dest / "mla_inductor", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "lowering", dest / "mla_inductor" / "lowering", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "tests", dest / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "docs", dest / "docs")
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")


def installed_path(file: str) -> str:
    return "mla_inductor/" + file if file.startswith("lowering/") else file


def run_tests(root: Path, tests: tuple[str, ...]) -> tuple[bool, str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", *tests], cwd=root, env=env,
                            capture_output=True, text=True, timeout=1800)
    last = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
    return result.returncode == 0, last


def check(mutation: Mutation, root: Path) -> list[str]:
    path = root / installed_path(mutation.file)
    source = path.read_text()
    if source.count(mutation.old) != 1:
        return [mutation.behaviour, f"`{mutation.file}`", "stale: the patched text is not in the file once", "", ""]
    passed, before = run_tests(root, mutation.tests)
    path.write_text(source.replace(mutation.old, mutation.new))
    try:
        still_passes, after = run_tests(root, mutation.tests)
    finally:
        path.write_text(source)
    tests = ", ".join(f"`{t.split('/', 1)[1]}`" for t in mutation.tests)
    verdict = "fails, as it must" if passed and not still_passes else "**NOT CAUGHT**" if passed else "baseline fails"
    return [mutation.behaviour, f"`{mutation.file}`", tests, before if passed else f"FAILED: {before}",
            f"{verdict} ({after})"]


def markdown_item(row: list[str]) -> str:
    """One mutation's result as a list item of lines short enough for the docs."""
    behaviour, file, tests, before, after = row
    text = f"**{behaviour}** (broken in {file}): {tests}. Unpatched: {before}; patched: {after}."
    return "\n".join(textwrap.wrap(text, width=116, initial_indent="- ", subsequent_indent="  ",
                                   break_long_words=False, break_on_hyphens=False))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help="run the mutations whose behaviour contains this text")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if args.only in m.behaviour]
    rows = []
    with tempfile.TemporaryDirectory(prefix="mla_mutation_") as tmp:
        root = Path(tmp)
        copy_repository(root)
        for i, mutation in enumerate(chosen, 1):
            print(f"[{i}/{len(chosen)}] {mutation.behaviour}", file=sys.stderr, flush=True)
            rows.append(check(mutation, root))
    for row in rows:
        print(markdown_item(row))
    caught = sum("as it must" in row[4] for row in rows)
    print(f"\n{caught} of {len(rows)} mutations caught.")
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
