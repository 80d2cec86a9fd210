"""The 8-bit AdamW kernel's instruction count, on CPU: kernels._adamw8_kernel compiled for a Hopper GPU (sm_90) by
the installed Triton, with the ptxas and nvdisasm its wheel bundles, and the SASS counted. No GPU is needed.

    python bench/kernel_sass.py [--out kernel_sass.json] [--sass-dir DIR] [--arch 90]

Why: on an H100 the bf16_sr_8bit step is issue-bound, not bandwidth-bound (its times and bound: the optim_bench
record in bench/results/h100_issue38_8f9d5f9), so the instructions a value are its cost model, and they can be read
on any machine, between GPU sessions.

Rows, one per optimizer state: fp32_master_8bit (fp32 masters of bf16 weights) and bf16_sr_8bit (bf16 weights,
stochastic rounding), the flat step's launch (EVEN, FAST, TILE_ROWS x 128 values, 4 warps):
  static        every SASS instruction of the kernel (its slow paths and reruns included)
  fast_path     the instructions a program executes when no slow path or rerun fires: from the entry, each
                conditional forward branch over a slow-path CALL or over more than 150 instructions (a tier's rerun)
                taken, every other conditional branch not taken, unconditional branches followed, to EXIT
  per_value     fast_path / the values a thread updates (TILE_ROWS x 128 / 128 threads)
  top_opcodes   the fast path's opcodes a value, most frequent first
The fast path is what a tile of ordinary values costs; the figure is an instruction count, not a time (the GPU's
clock, its dual issue and its memory decide that: compare only with optim_bench's times from one card).
--sass-dir writes each row's disassembly.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STATES = {"fp32_master_8bit": dict(HAS_MASTER=True, SR=False), "bf16_sr_8bit": dict(HAS_MASTER=False, SR=True)}
LONG_REGION = 150          # a conditional branch over more instructions than this skips a tier's rerun
NUM_WARPS = 4


def signature(has_master: bool) -> dict[str, str]:
    """_adamw8_kernel's argument types as the flat step launches it (flat_adamw.FlatLowBitAdamW.step)."""
    return dict(grad_ptr="*bf16", param_ptr="*bf16", master_ptr="*fp32" if has_master else "*bf16", mc_ptr="*u8",
                msc_ptr="*fp32", sc_ptr="*u8", ssc_ptr="*fp32", ord_ptr="*i32", base_ptr="*i32", n_blocks="i32",
                n="i32", lr_ptr="*fp32", bias_ptr="*fp64", divisor_ptr="*fp32", step_ptr="*fp32", seed="i32",
                beta1="fp32", one_minus_beta1="fp32", beta2="fp32", one_minus_beta2="fp32", eps="fp32",
                weight_decay="fp32", HAS_MASTER="constexpr", SR="constexpr", ROWS="constexpr", B="constexpr",
                EVEN="constexpr", FAST="constexpr")


def compile_sass(state: str, arch: int) -> str:
    """The SASS text of one state's flat launch, compiled for sm_<arch> with Triton's own tool chain."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from stages.engine import kernels
    sig = signature(STATES[state]["HAS_MASTER"])
    consts = dict(STATES[state], ROWS=kernels.TILE_ROWS, B=128, EVEN=True, FAST=True)
    names = list(sig)
    # every pointer 16-byte aligned, as the flat buffers' separate allocations are (Triton specialises on it)
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(names) if sig[k].startswith("*")}
    src = ASTSource(fn=kernels._adamw8_kernel, signature=sig,
                    constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=NUM_WARPS))
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        return subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout


def parse(sass: str) -> tuple[list[str], dict[str, int]]:
    """(instructions in order, label -> index of the instruction it marks)."""
    ins: list[str] = []
    labels: dict[str, int] = {}
    pending: list[str] = []
    for line in sass.splitlines():
        m = re.match(r"\s*(\.L_x_\d+|\$[\w$.]+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m:
            labels.update({name: len(ins) for name in pending})
            pending = []
            ins.append(m.group(1))
    return ins, labels


def opcode(instruction: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def fast_path(ins: list[str], labels: dict[str, int]) -> list[str]:
    """The module docstring's walk from the entry to EXIT."""
    path, i = [], 0
    while i < len(ins):
        t = ins[i]
        path.append(t)
        if len(path) > 50 * len(ins):
            raise RuntimeError("kernel_sass: the walk does not reach EXIT (a loop the rule does not leave)")
        if t.startswith("EXIT"):
            break
        m = re.match(r"(@!?P\w+\s+)?BRA(?:\.\w+)*\s+(?:!?U?P\w+,\s*)?`\((\.L_x_\d+)\)", t)
        if m:
            target = labels[m.group(2)]
            if not m.group(1):
                i = target
                continue
            skipped = ins[i + 1:target] if target > i else []
            if skipped and (any(opcode(x) == "CALL" for x in skipped) or len(skipped) > LONG_REGION):
                i = target
                continue
        i += 1
    else:
        raise RuntimeError("kernel_sass: ran off the end without an unconditional EXIT")
    return path


def count(sass: str, values_per_thread: int) -> dict:
    ins, labels = parse(sass)
    path = fast_path(ins, labels)
    ops = collections.Counter(opcode(t) for t in path)
    return {"static": len(ins), "fast_path": len(path), "per_value": round(len(path) / values_per_thread, 1),
            "top_opcodes": {o: round(c / values_per_thread, 1) for o, c in ops.most_common(12)}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--sass-dir", type=Path)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100 / H200)")
    args = ap.parse_args(argv)
    try:
        import triton
        from stages.engine import kernels
    except ImportError as e:
        print(f"kernel_sass: refused: Triton is not installed ({e})", file=sys.stderr)
        return 2
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not os.access(nvdisasm, os.X_OK):
        print(f"kernel_sass: refused: this Triton has no bundled nvdisasm at {nvdisasm}", file=sys.stderr)
        return 2
    values_per_thread = kernels.TILE_ROWS * 128 // (NUM_WARPS * 32)
    rows = {}
    for state in STATES:
        sass = compile_sass(state, args.arch)
        if args.sass_dir:
            args.sass_dir.mkdir(parents=True, exist_ok=True)
            (args.sass_dir / f"adamw8_{state}_sm{args.arch}.sass").write_text(sass)
        rows[state] = count(sass, values_per_thread)
        r = rows[state]
        print(f"{state:18s} static {r['static']:5d}  fast path {r['fast_path']:5d}  {r['per_value']:6.1f} a value  "
              + " ".join(f"{o}:{c}" for o, c in r["top_opcodes"].items()))
    record = {"triton": triton.__version__, "arch": f"sm_{args.arch}", "tile_rows": kernels.TILE_ROWS,
              "num_warps": NUM_WARPS, "values_per_thread": values_per_thread, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
