#!/usr/bin/env python3
"""What ptxas made of a kernel, without a GPU: its SASS size and instruction counts by opcode.

    scripts/gpu/sass.py KERNEL A.cubin [B.cubin] [--match REGEX] [--base]

A.cubin (and B.cubin, side by side) as scripts/gpu/kernel_image.py builds them. Prints the
kernel's code bytes and instruction count, then its opcodes with their counts: all of them, or
those matching REGEX (e.g. 'MMA|F2FP'); with two cubins, only the opcodes whose counts differ.
`--base` counts opcodes without their modifiers (HMMA, not HMMA.16816.F32). `--dump` prints
the kernel's whole SASS (of A) instead.

nvdisasm: $NVDISASM, else `nvdisasm` on PATH, else $HARRIER_HOME/nvdisasm/nvdisasm
(`scripts/setup.sh nvdisasm` installs it; kernel_image.py's setup_tool finds it).
Session 53 found with it that ptxas lowers an `mma.sync m16n8k32` e4m3 tile on sm_90 to F2FP
unpacks of both operands and two HMMA.16816 (Hopper has no QMMA outside wgmma), before a
device call was spent on it.
"""
import argparse
import collections
import pathlib
import re
import signal
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from kernel_image import setup_tool  # noqa: E402  ($NVDISASM, PATH, or setup.sh nvdisasm's)

INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?);")
PRED = re.compile(r"^@!?U?P[T0-9]+\s+")


def kernel_sass(cubin: str, kernel: str) -> list[str]:
    """The kernel's SASS lines (nvdisasm's listing between its label and the next section)."""
    out = subprocess.run([setup_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"nvdisasm {cubin}: {out.stderr.strip()}")
    lines, inside = [], False
    for line in out.stdout.splitlines():
        if line.startswith(f".text.{kernel}:"):
            inside = True
        elif inside and line.lstrip().startswith(".section"):
            break
        elif inside:
            lines.append(line)
    if not lines:
        sys.exit(f"{cubin}: no kernel {kernel}")
    return lines


def opcodes(lines: list[str], base: bool) -> collections.Counter:
    counts = collections.Counter()
    for line in lines:
        m = INSTR.search(line)
        if not m:
            continue
        op = PRED.sub("", m.group(1).strip()).split()[0]
        counts[op.split(".")[0] if base else op] += 1
    return counts


def main() -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # (piped into head)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel")
    ap.add_argument("cubins", nargs="+", metavar="CUBIN")
    ap.add_argument("--match", help="only opcodes matching this regular expression")
    ap.add_argument("--base", action="store_true", help="opcodes without their modifiers")
    ap.add_argument("--dump", action="store_true", help="print the kernel's SASS (first cubin)")
    a = ap.parse_args()
    if len(a.cubins) > 2:
        sys.exit("one or two cubins")
    if a.dump:
        print("\n".join(kernel_sass(a.cubins[0], a.kernel)))
        return
    counts = []
    for c in a.cubins:
        n = opcodes(kernel_sass(c, a.kernel), a.base)
        counts.append(n)
        total = sum(n.values())
        print(f"{c}: {a.kernel} {total} instructions, {16 * total} bytes")
    match = re.compile(a.match) if a.match else None
    ops = sorted(set().union(*counts), key=lambda o: (-counts[0][o], o))
    for op in ops:
        if match and not match.search(op):
            continue
        row = [n[op] for n in counts]
        if len(row) == 2 and row[0] == row[1]:
            continue
        print(f"{op:40s} " + " ".join(f"{v:8d}" for v in row))


if __name__ == "__main__":
    main()
