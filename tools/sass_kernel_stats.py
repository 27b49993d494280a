"""Per kernel function in a cuobjdump SASS dump: the instruction count and the opcodes that say where
a Hopper kernel's time may go without running it: HGMMA (wgmma), R2UR (a per-thread value moved to
a uniform register, e.g. a wgmma descriptor ptxas could not keep uniform), LDL/STL (spills), BAR
and SYNCS (barriers), WARPGROUP (wgmma fences and waits). Session 10 found a 10-14% slowdown this
way: 139 R2UR against 76 and a longer main loop once a loop bound derived from threadIdx.
Usage: cuobjdump --dump-sass obj.o | python tools/sass_kernel_stats.py [name-filter]"""

from __future__ import annotations

import collections
import re
import sys

OPCODES = ("HGMMA", "R2UR", "LDL", "STL", "BAR", "SYNCS", "WARPGROUP", "MUFU", "BRA")


def main() -> None:
    wanted = sys.argv[1] if len(sys.argv) > 1 else ""
    text = sys.stdin.read()
    for body in re.split(r"(?m)^\s*Function : ", text)[1:]:
        name = body.split("\n", 1)[0].strip()
        if wanted not in name:
            continue
        ops: collections.Counter[str] = collections.Counter()
        for line in body.split("\n"):
            m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
            if m:
                ops[m.group(1)] += 1
        counts = " ".join(f"{op} {ops[op]}" for op in OPCODES)
        print(f"{name[:120]}\n  {sum(ops.values())} instructions: {counts}")


if __name__ == "__main__":
    main()
