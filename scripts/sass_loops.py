#!/usr/bin/env python3
"""scripts/sass_loops.py: the main loops of the wgmma kernels in a compiled object, for comparing two
builds of a kernel change before measuring it (bench/NOTES.md, "Session 29").

    scripts/sass_loops.py OBJ_OR_SASS [--kernel SUBSTRING]
    scripts/sass_loops.py --diff BEFORE AFTER [--kernel SUBSTRING]

Each argument is a compiled object (.o, .cubin; cuobjdump disassembles it: from PATH, the CUDA
toolkit, or the pip package nvidia-cuda-cuobjdump) or a file of cuobjdump -sass output. For every
kernel, every backward branch whose body issues wgmma (HGMMA) is a loop; each gets one line: its
static length and the instructions that shape a softmax block (HGMMA, MUFU.EX2, IMAD.WIDE: Philox's
multiplies, FMNMX: row maxima, LDS, BAR.SYNC), and, for the first loop of the kernel (the innermost
block loop), where the multiplies and maxima sit against the loop's wgmma waits (WARPGROUP.DEPBAR):
"W3 M28 | W72 M40" means 3 multiplies and 28 maxima before the first wait past the scores' wait,
the rest after it. ptxas moves such instructions across the waits on small changes elsewhere in a
kernel (session 29: a lambda in the epilogue moved a third of the dropout draw above the maxima,
10-12% of the dropout forward's time), so a change whose p = 0 loops are the same length can still
have moved a dropout loop; --diff prints the kernels whose lines differ.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys

COUNTED = ("HGMMA", "MUFU.EX2", "IMAD.WIDE", "FMNMX", "LDS", "BAR.SYNC")


def cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    candidates = ["/usr/local/cuda/bin/cuobjdump"]
    try:
        import nvidia  # the pip wheels' namespace package (nvidia-cuda-cuobjdump)

        for root in nvidia.__path__:
            for sub in ("cu13/bin", "cuda_cuobjdump/bin"):
                candidates.append(os.path.join(root, sub, "cuobjdump"))
    except ImportError:
        pass
    for path in candidates:
        if os.access(path, os.X_OK):
            return path
    sys.exit("sass_loops.py: no cuobjdump (not in the CUDA toolkit here; pip install nvidia-cuda-cuobjdump)")


def sass_text(path):
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"\x7fELF" or path.endswith((".o", ".cubin", ".fatbin")):
        return subprocess.run([cuobjdump(), "-sass", path], check=True, capture_output=True, text=True).stdout
    with open(path) as f:
        return f.read()


def kernels(text):
    """{function name: [(address, instruction)]}"""
    out, current = {}, None
    for line in text.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            current = out.setdefault(m.group(1), [])
            continue
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if current is not None and m:
            current.append((int(m.group(1), 16), m.group(2)))
    return out


def opcode(instruction):
    words = instruction.split()
    return words[1] if words and words[0].startswith("@") else (words[0] if words else "")


def placement(body):
    """Multiplies and maxima before and after the loop's second wgmma wait (the first waits for S)."""
    waits = [i for i, ins in enumerate(body) if opcode(ins).startswith("WARPGROUP.DEPBAR")]
    if len(waits) < 2:
        return ""
    split = waits[1]

    def count(part, name):
        return sum(opcode(ins).startswith(name) for ins in part)

    before, after = body[waits[0]:split], body[split:]
    return (f"  W{count(before, 'IMAD.WIDE')} M{count(before, 'FMNMX')} |"
            f" W{count(after, 'IMAD.WIDE')} M{count(after, 'FMNMX')}")


def loops(instructions):
    lines = []
    for address, ins in instructions:
        if "BRA" not in opcode(ins):
            continue
        m = re.search(r"0x([0-9a-f]+)", ins)
        if not m or int(m.group(1), 16) >= address:
            continue
        target = int(m.group(1), 16)
        body = [i for a, i in instructions if target <= a <= address and not opcode(i).startswith("NOP")]
        if not any(opcode(i).startswith("HGMMA") for i in body):
            continue
        counts = " ".join(f"{name} {sum(opcode(i).startswith(name) for i in body)}" for name in COUNTED)
        lines.append(f"{len(body):5d} instructions: {counts}" + (placement(body) if not lines else ""))
    return lines


def summary(path, kernel_filter):
    result = {}
    for name, instructions in kernels(sass_text(path)).items():
        if kernel_filter and kernel_filter not in name:
            continue
        found = loops(instructions)
        if found:
            result[name] = found
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--diff", action="store_true", help="compare two builds: BEFORE AFTER")
    parser.add_argument("--kernel", default="", help="only kernels whose mangled name contains this")
    args = parser.parse_args()
    if args.diff:
        if len(args.files) != 2:
            parser.error("--diff takes BEFORE and AFTER")
        before, after = (summary(f, args.kernel) for f in args.files)
        changed = innermost = 0
        for name in sorted(set(before) | set(after)):
            old, new = before.get(name, []), after.get(name, [])
            if old == new:
                continue
            changed += 1
            innermost += old[:1] != new[:1]
            print(name)
            if len(old) != len(new):
                print(f"  {len(old)} loops before, {len(new)} after")
            for i in range(max(len(old), len(new))):  # loop by loop, the ones that differ
                a = old[i] if i < len(old) else "-"
                b = new[i] if i < len(new) else "-"
                if a != b:
                    print(f"  loop {i}: before {a}\n          after  {b}")
        print(f"{changed} of {len(set(before) | set(after))} kernels' loops differ, "
              f"{innermost} in the innermost loop")
        return
    for path in args.files:
        for name, lines in summary(path, args.kernel).items():
            print(name)
            for line in lines:
                print("  " + line)


if __name__ == "__main__":
    main()
