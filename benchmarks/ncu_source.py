"""Where a kernel's warps wait, by instruction: a summary of Nsight Compute's source page (SASS), no GPU needed.

    ncu --set full --import-source yes --kernel-name regex:mla_decode_hopper --launch-skip 1 --launch-count 1 \
        -o prof python benchmarks/bench_kernel_variants.py --launches 3 --cases 128x32x4096:fp8
    ncu -i prof.ncu-rep --page source --csv --print-source sass > prof.csv
    python benchmarks/ncu_source.py prof.csv [--region NAME=OPCODE:BEFORE:AFTER ...] [--top 10]

The export (plain or .gz) lists every SASS instruction with its warp-state samples ("Warp Stall Sampling (All
Samples)"). A region is a stretch of the code named by an opcode: from the first instruction whose opcode starts
with OPCODE, less BEFORE bytes, to the last one, plus AFTER bytes (hex or decimal), e.g. the consumers of the wide
kernel around their ``HGMMA``s, the widening warpgroup around its ``F2FP.F16.E4M3.UNPACK_B``s. Printed: each
region's share of all samples, then its opcodes by samples (share of the region), then the instructions with the
most samples. The default regions are the wide kernel's two partitions on its fp8 paths.
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import re

SAMPLES = "Warp Stall Sampling (All Samples)"
DEFAULT_REGIONS = ("consumers=HGMMA:0x1000:0x1500", "widening=F2FP.F16.E4M3.UNPACK_B:0x800:0x1000")


def read_export(path: str) -> list[tuple[int, str, float]]:
    """(address, instruction, samples) of every row of an ``ncu --page source --csv`` export."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    header = next(i for i, row in enumerate(rows) if row[:2] == ["Address", "Source"])
    columns = rows[header]
    at, source, samples = columns.index("Address"), columns.index("Source"), columns.index(SAMPLES)
    return [(int(row[at], 16), row[source].strip(), float(row[samples].replace(",", "") or 0))
            for row in rows[header + 1:] if len(row) == len(columns)]


def opcode(instruction: str) -> str:
    """The opcode of a SASS instruction, its predicate (``@P0``, ``@!UP1``) dropped."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0]


def parse_region(text: str) -> tuple[str, str, int, int]:
    """``NAME=OPCODE:BEFORE:AFTER`` as (name, opcode, before, after)."""
    name, _, rest = text.partition("=")
    parts = rest.split(":")
    if not name or len(parts) != 3:
        raise SystemExit(f"--region: expected NAME=OPCODE:BEFORE:AFTER, got {text!r}")
    try:
        return name, parts[0], int(parts[1], 0), int(parts[2], 0)
    except ValueError:
        raise SystemExit(f"--region {text!r}: BEFORE and AFTER are byte counts (e.g. 0x800)") from None


def region_rows(rows, op: str, before: int, after: int) -> list[tuple[int, str, float]]:
    """The rows from the first instruction of opcode ``op`` (a prefix) less ``before`` bytes to its last plus
    ``after``."""
    at = [a for a, ins, _ in rows if opcode(ins).startswith(op)]
    if not at:
        return []
    return [r for r in rows if min(at) - before <= r[0] <= max(at) + after]


def summarize(rows, regions, top: int) -> list[str]:
    total = sum(s for _, _, s in rows) or 1.0
    lines = [f"{total:.0f} samples"]
    for name, op, before, after in regions:
        part = region_rows(rows, op, before, after)
        samples = sum(s for _, _, s in part)
        lines.append(f"{name}: {samples:.0f} samples, {100 * samples / total:.1f}% of all")
        by_opcode = collections.Counter()
        for _, ins, s in part:
            by_opcode[opcode(ins)] += s
        for name_, s in by_opcode.most_common(top):
            lines.append(f"  {name_:32s} {s:7.0f}  {100 * s / (samples or 1.0):5.1f}%")
    lines.append("instructions with the most samples:")
    base = min((a for a, _, _ in rows), default=0)
    for a, ins, s in sorted(rows, key=lambda r: -r[2])[:top]:
        lines.append(f"  +{a - base:#07x} {s:7.0f}  {100 * s / total:4.1f}%  {ins}")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export", help="ncu --page source --csv --print-source sass output (.csv or .csv.gz)")
    parser.add_argument("--region", action="append", metavar="NAME=OPCODE:BEFORE:AFTER",
                        help=f"(repeatable; default: {' '.join(DEFAULT_REGIONS)})")
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args(argv)
    regions = [parse_region(r) for r in (args.region or DEFAULT_REGIONS)]
    print("\n".join(summarize(read_export(args.export), regions, args.top)))


if __name__ == "__main__":
    main()
