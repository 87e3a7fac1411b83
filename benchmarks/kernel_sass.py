"""What our Gluon kernels' loops issue, read off their SASS: compiled for SM90 with the installed Triton, no GPU needed.

    python benchmarks/kernel_sass.py [--kernel=gluon_sm90] [--kv=bf16|fp8|ds] [--splits=1] [--top=12]
        [--module=FILE] [--block-h=N]

Each loop of the compiled kernel (a backward branch over more than 64 instructions) is listed with its length and
its most frequent opcodes (``cuobjdump -sass`` of the cubin Triton built, with Triton's own cuobjdump). A loop's
body is per warp and per turn (the wide kernel's loops take two tiles a turn): e.g. the consumers' count per tile
against the time a tile takes says whether a warp is issue- or latency-bound. The first line gives the shared memory
the kernel takes and its local-memory stores and loads (``STL`` / ``LDL``: register spills). ``--module`` reads the
kernels of another copy of ``mla_inductor/kernels/decode_hopper.py`` (as ``bench_kernel_variants.py --variant``).
``compile_for_sm90`` is what the CPU tests (tests/test_decode_hopper.py) compile; the figures depend on the Triton
version (3.6 is what the GPU numbers in docs/ ran on).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from typing import Optional

from mla_inductor.kernels import decode_hopper

KV_MODES = {"bf16": 0, "fp8": 1, "ds": 2}


def compile_for_sm90(kv_mode: int, block_n: int, stages: int, splits: int, qdt: str, sparse: bool = False,
                     kernel: str = "gluon_sm90", module=decode_hopper, block_h: int = 0, ints: Optional[dict] = None):
    """Gluon kernel ``kernel`` of ``module`` compiled for SM90 (Triton's ``CompiledKernel``), specialized as a real
    launch is: 16-byte aligned pointers, strides divisible by 16. ``block_h``: heads per program (0: the kernel's
    own). ``ints``: values of some int arguments (e.g. ``{"TOPK": 1}``); one equal to 1 is compiled in as a
    constant unless the kernel declares it ``do_not_specialize``, as Triton's JIT does at a launch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn, num_warps = module.KERNELS[kernel]
    block_h = block_h or (module.NARROW_BLOCK_H if kernel == "gluon_sm90_narrow" else module.HEADS_PER_PROGRAM)
    names = fn.arg_names
    kv = {0: "*" + qdt, 1: "*fp8e4nv", 2: "*fp8e4nv"}[kv_mode]  # fp8_ds_mla rows are read through an e4m3 pointer
    sig = {"QN": "*" + qdt, "QP": "*" + qdt, "KV": kv, "BT": "*i32", "SEQ": "*i32", "SPARSE": "*i32",
           "KV_SCALE": "*fp32", "OUT": "*" + qdt, "LSE": "*fp32", "POUT": "*fp32", "PLSE": "*fp32",
           "qk_scale": "fp32"}
    for n in names[len(sig):names.index("L")]:
        sig[n] = "i32"
    const = dict(L=512, R=64, PAGE_SIZE=64, BLOCK_H=block_h, BLOCK_N=block_n, NUM_SPLITS=splits, KV_MODE=kv_mode,
                 IS_SPARSE=sparse, DOT_PREC="tf32", EMULATE=False, TRANS_LOAD=False, SWAP_QK=False, FP16_MMA=False,
                 STAGES=stages)
    for name, value in (ints or {}).items():
        if value == 1 and not fn.params[names.index(name)].do_not_specialize:
            const[name] = 1
    for k in const:
        sig[k] = "constexpr"
    div = [["tt.divisibility", 16]]
    attrs = {(i,): div for i in range(11)}
    for n in ("stride_qn_t", "stride_qn_h", "stride_qp_t", "stride_qp_h", "stride_kv_row", "stride_bt_b",
              "stride_sp_t", "num_slots"):
        attrs[(names.index(n),)] = div
    return triton.compile(GluonASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps))


def default_tiling(kernel: str, module=decode_hopper) -> tuple[int, int]:
    """(BLOCK_N, STAGES) a call on ``kernel`` gets by default: the wide kernel's first tiling, else 64-key tiles."""
    return module.TILINGS[0] if kernel == "gluon_sm90" else (module.NARROW_BLOCK_N, 1)


def sass_of(cubin: bytes) -> str:
    """``cuobjdump -sass`` of a cubin, with the cuobjdump Triton ships."""
    import triton.backends.nvidia as nvidia

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.+?)\s*;")


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction without its predicate) of every instruction in ``sass``."""
    out = []
    for address, text in _INSTRUCTION.findall(sass):
        out.append((int(address, 16), re.sub(r"^@!?U?P\w+\s+", "", text)))
    return out


def loops(ins: list[tuple[int, str]], least: int = 64) -> list[tuple[int, int, collections.Counter]]:
    """(first address, last address, opcode counts) of every innermost loop: a backward branch over more than
    ``least`` instructions (its body from the branch target to the branch) that holds no other such loop. Branches
    after the last EXIT (out-of-line code jumping back into the kernel) are not loops."""
    end = max((a for a, t in ins if t.startswith("EXIT")), default=ins[-1][0] if ins else 0)
    spans = []
    for address, text in ins:
        m = re.match(r"BRA\s+(?:\S+\s+)?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < address <= end:
            first = int(m.group(1), 16)
            if sum(first <= a <= address for a, _ in ins) > least:
                spans.append((first, address))
    innermost = [(f, l) for f, l in spans if not any((f, l) != (g, m) and f <= g and m <= l for g, m in spans)]
    return [(f, l, collections.Counter(t.split()[0] for a, t in ins if f <= a <= l)) for f, l in innermost]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", default="gluon_sm90", help="a name of the module's KERNELS")
    parser.add_argument("--kv", default="fp8", choices=sorted(KV_MODES))
    parser.add_argument("--splits", type=int, default=1)
    parser.add_argument("--top", type=int, default=12, help="opcodes listed per loop")
    parser.add_argument("--module", metavar="FILE", help="another copy of decode_hopper.py")
    parser.add_argument("--block-h", type=int, default=0, help="heads per program (default: the kernel's own)")
    args = parser.parse_args(argv)
    module = decode_hopper
    if args.module:
        import bench_kernel_variants

        module = bench_kernel_variants.load_variant("sass", args.module)
    if not module.HAVE_GLUON:
        raise SystemExit("kernel_sass.py needs a Triton with Gluon's Hopper ops (3.6 or later)")
    if args.kernel not in module.KERNELS:
        raise SystemExit(f"--kernel: expected one of {sorted(module.KERNELS)}, got {args.kernel!r}")
    import triton

    block_n, stages = default_tiling(args.kernel, module)
    compiled = compile_for_sm90(KV_MODES[args.kv], block_n, stages, args.splits, "bf16", kernel=args.kernel,
                                module=module, block_h=args.block_h)
    ins = instructions(sass_of(compiled.asm["cubin"]))
    spills = collections.Counter(t.split()[0].split(".")[0] for _, t in ins if t.startswith(("STL", "LDL")))
    print(f"# {args.kernel}, {args.kv} cache, {args.splits} split(s), Triton {triton.__version__}, SM90: "
          f"{compiled.metadata.shared} bytes of shared memory, {spills['STL']} STL / {spills['LDL']} LDL")
    for first, last, counts in loops(ins):
        top = ", ".join(f"{n} {op}" for op, n in counts.most_common(args.top))
        print(f"loop {first:#x}-{last:#x}: {sum(counts.values())} instructions: {top}")


if __name__ == "__main__":
    main()
