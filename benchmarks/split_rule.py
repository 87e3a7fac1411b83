"""How well ``decode.choose_splits`` picks, read off ``bench_kernels.py --splits`` logs (no GPU needed).

For every case and cache format a log times (fp32 partials; the default kernel, or the ``tl.dot`` kernel in a
``--splits-kernel=tl_dot`` log), the split count the rule picks with the partials' term and without it (the old rule
of the Gluon kernels, every count weighed; the ``tl.dot`` kernel's rule now), each as its time over the fastest
count the logs timed (CUDA-graph replay). A shape timed in several logs: the first log's figures.

    python benchmarks/split_rule.py LOG.md [LOG.md ...] [--formats=bf16,fp8,ds] [--bytes-per-tile=3e6,3.5e6]
           [--sms=132]
    python benchmarks/split_rule.py --compare BEFORE.md AFTER.md [AFTER.md ...]
    python benchmarks/split_rule.py --merge MERGE_LOG.md

``--formats`` keeps those cache formats' rows (all by default; sparse calls' as ``sparse-bf16``, ``sparse-ds``);
``--bytes-per-tile`` scores the rule at other values of ``decode.PARTIAL_BYTES_PER_TILE`` (the value was chosen so:
by the picks it makes, not by a fit of the model's terms). ``--compare``: the rows the logs share (same case, format
and split count), CUDA-graph µs in each and after over before, with each kernel's device µs where the log has them
(a change's before/after: the same ``--splits`` command on two builds). ``--merge``: per shape of a ``bench_kernels.py
--merge-tiles`` log, ``decode.merge_tile``'s pick (recomputed) against the fastest tile timed. The logs the split rule was
chosen on: tests/data/split_logs_h200/ (README there).
"""
from __future__ import annotations

import math
import re
import sys

from mla_inductor.kernels import decode

_ROW = re.compile(r"splits (sparse )?B=(\d+) H=(\d+) S=(\d+)(?: topk=(\d+))? (\w+)\s+"
                  r"(?:default \((\w+), ns=(\d+)\)|ns=(\d+)):\s+[\d.]+ us, in a CUDA graph\s+([\d.]+)")
_H = decode._hopper()
# Each Gluon kernel's (heads per program, keys per tile, programs per SM), as decode.gluon_config launches it.
_TILING = {"gluon_sm90": (_H.HEADS_PER_PROGRAM, _H.TILINGS[0][0], 1),
           "gluon_sm90_narrow": (_H.NARROW_BLOCK_H, _H.NARROW_BLOCK_N, 2)}


def read_logs(paths) -> dict:
    """{(B, H, keys, format): {"kernel": name, "us": {splits: µs}}}; the first log's figure where several time one.
    Sparse calls: keys is the top-k (what the rule sees) and the format ``sparse-`` and the cache format's."""
    cases: dict = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                m = _ROW.match(line.strip())
                if not m:
                    continue
                keys, fmt = (int(m[5]), f"sparse-{m[6]}") if m[1] else (int(m[4]), m[6])
                case = cases.setdefault((int(m[2]), int(m[3]), keys, fmt), {"kernel": None, "us": {}})
                if m[7]:
                    case["kernel"] = case["kernel"] or m[7]
                case["us"].setdefault(int(m[8] or m[9]), float(m[10]))
    return {k: v for k, v in cases.items() if v["kernel"] in (*_TILING, "tl_dot")}


_TIMED = re.compile(r"splits (.+?)(?: \(\w+, ns=\d+\))?:\s+[\d.]+ us, in a CUDA graph\s+([\d.]+) us.*?"
                    r"(?:\(device us: (.*)\))?$")


def read_rows(path) -> dict:
    """{row label: (CUDA-graph µs, {kernel: device µs})} of one ``--splits`` log."""
    rows = {}
    with open(path) as f:
        for line in f:
            m = _TIMED.match(line.strip())
            if m:
                kernels = dict(k.rsplit(" ", 1) for k in m[3].split(", ")) if m[3] else {}
                rows[m[1]] = (float(m[2]), {k: float(v) for k, v in kernels.items()})
    return rows


def compare(before_path, after_paths) -> list:
    """Lines: each row of ``before_path`` that every log of ``after_paths`` has, its µs in each and the ratios."""
    before, afters = read_rows(before_path), [read_rows(p) for p in after_paths]
    lines = []
    for label, (us, kernels) in before.items():
        if not all(label in a for a in afters):
            continue
        after = [a[label] for a in afters]
        line = f"{label}: {us:.1f} -> " + ", ".join(f"{u:.1f} ({u / us:.2f}x)" for u, _ in after)
        for name, t in kernels.items():
            line += f"; {name} {t:.1f} -> " + ", ".join(f"{k.get(name, float('nan')):.1f}" for _, k in after)
        lines.append(line)
    return lines


_MERGE_ROW = re.compile(r"merge pairs=(\d+) splits=(\d+) block_s=(\d+) block_l=(\d+)(?: \(merge_tile\))?:"
                        r"\s+([\d.]+) us")


def merge_picks(path, L: int = 512) -> list:
    """Lines: per (pairs, splits) of a --merge-tiles log, today's merge_tile pick and its µs against the fastest."""
    shapes: dict = {}
    with open(path) as f:
        for line in f:
            m = _MERGE_ROW.match(line.strip())
            if m:
                shapes.setdefault((int(m[1]), int(m[2])), {})[(int(m[3]), int(m[4]))] = float(m[5])
    lines = []
    for (pairs, ns), us in shapes.items():
        tile, best = decode.merge_tile(pairs, ns, L), min(us, key=us.get)
        got = f"{us[tile]:.1f} us, {us[tile] / us[best]:.2f}x" if tile in us else "not timed"
        lines.append(f"pairs={pairs} splits={ns}: picks {tile} ({got}); fastest {best}: {us[best]:.1f} us")
    return lines


def _tiling(kernel: str, H: int) -> tuple:
    """(heads per program, keys per tile, programs per SM) of ``kernel`` at H heads, as the library launches it."""
    if kernel == "tl_dot":
        heads, _, block_n, _, per_sm = decode.tl_dot_tiling(H)
        return heads, block_n, per_sm
    return _TILING[kernel]


def pick(case_key, kernel: str, sms: int, with_partials: bool) -> int:
    B, H, S, _ = case_key
    heads, block_n, per_sm = _tiling(kernel, H)
    partial_bytes = decode._partial_bytes(B, H) if with_partials else None
    return decode.choose_splits(B, -(-H // heads), S, block_n, sms * per_sm, partial_bytes=partial_bytes)


def _label(key) -> str:
    B, H, keys, fmt = key
    return f"B={B} H={H} " + (f"top-k={keys} {fmt}" if fmt.startswith("sparse-") else f"S={keys} {fmt:<4}")


def score(cases: dict, sms: int, with_partials: bool) -> tuple:
    """(per-case lines, geometric mean and worst of time-at-pick over fastest, cases whose pick was not timed)."""
    lines, logs, untimed = [], [], 0
    for key, case in sorted(cases.items()):
        ns, us = pick(key, case["kernel"], sms, with_partials), case["us"]
        best = min(us, key=us.get)
        if ns in us:
            logs.append(math.log(us[ns] / us[best]))
            lines.append(f"  {_label(key)}: picks {ns} ({us[ns]:.1f} us, "
                         f"{us[ns] / us[best]:.2f}x the fastest, {best}: {us[best]:.1f})")
        else:
            untimed += 1
            lines.append(f"  {_label(key)}: picks {ns} (not timed)")
    geo = math.exp(sum(logs) / len(logs)) if logs else float("nan")
    return lines, geo, max((math.exp(v) for v in logs), default=float("nan")), untimed


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or "-h" in argv or "--help" in argv:
        print(__doc__)
        return
    logs = [a for a in argv if not a.startswith("--")]
    if "--merge" in argv:
        print("\n".join(line for log in logs for line in merge_picks(log)))
        return
    if "--compare" in argv:
        if len(logs) < 2:
            raise SystemExit("--compare: expected a log before and one or more after")
        print("\n".join(compare(logs[0], logs[1:])))
        return
    flags = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    sms = int(flags.get("sms", 132))
    formats = flags.get("formats", "bf16,fp8,ds,sparse-bf16,sparse-ds").split(",")
    cases = {k: v for k, v in read_logs(logs).items() if k[3] in formats}
    if not cases:
        raise SystemExit(f"no --splits rows of our kernels in {logs}")
    lines, geo, worst, untimed = score(cases, sms, with_partials=False)
    print(f"without the partials' term (every count): geomean {geo:.3f}x, worst {worst:.2f}x, {untimed} untimed")
    print("\n".join(lines))
    for bpt in [float(v) for v in flags.get("bytes-per-tile", str(decode.PARTIAL_BYTES_PER_TILE)).split(",")]:
        kept, decode.PARTIAL_BYTES_PER_TILE = decode.PARTIAL_BYTES_PER_TILE, bpt
        try:
            lines, geo, worst, untimed = score(cases, sms, with_partials=True)
        finally:
            decode.PARTIAL_BYTES_PER_TILE = kept
        print(f"rule at {bpt / 1e6:.1f} MB a tile: geomean {geo:.3f}x, worst {worst:.2f}x, {untimed} untimed")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
