"""Whether a warp-specialized forward kernel's softmax really runs under its PV matmul: in the SASS
(cuobjdump --dump-sass), the exponentials (MUFU.EX2) between each wait for S
(WARPGROUP.DEPBAR.LE gsb0, 0x1: PV may still run) and the next wait for everything (0x0). ptxas
hoisting that second wait to the softmax's start shows as 0 or a handful there.
Usage: cuobjdump --dump-sass obj.o | python tools/sass_softmax_overlap.py [name-filter]"""

from __future__ import annotations

import re
import sys


def main() -> None:
    wanted = sys.argv[1] if len(sys.argv) > 1 else "attention_fwd_sm90_ws_kernel"
    name, counts, open_wait = None, [], None
    for line in sys.stdin:
        if "Function :" in line:
            if name and counts:
                print(f"{name[:110]}: exp2 under PV per wait = {counts}")
            name, counts, open_wait = line.split("Function :")[1].strip(), [], None
            if wanted not in name:
                name = None
            continue
        if name is None:
            continue
        if re.search(r"DEPBAR\.LE\s+gsb0,\s*0x1", line):
            open_wait = 0
        elif re.search(r"DEPBAR\.LE\s+gsb0,\s*0x0", line) and open_wait is not None:
            counts.append(open_wait)
            open_wait = None
        elif "MUFU.EX2" in line and open_wait is not None:
            open_wait += 1
    if name and counts:
        print(f"{name[:110]}: exp2 under PV per wait = {counts}")


if __name__ == "__main__":
    main()
