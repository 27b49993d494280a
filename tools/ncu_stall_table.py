"""Summarizes ncu's source page (CSV, SASS view): stall samples per instruction, per opcode and per
execution count (instructions run once a tile against once a step), and per stall reason over the
whole kernel. Usage: python tools/ncu_stall_table.py report.csv [top]"""

from __future__ import annotations

import csv
import sys
from collections import Counter


def main() -> None:
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40
    with open(path, newline="") as f:
        lines = [line for line in f if line.strip()]
    start = next(i for i, line in enumerate(lines) if line.startswith('"#"') or "Source" in line)
    rows = list(csv.DictReader(lines[start:]))
    if not rows:
        print("no rows")
        return
    cols = rows[0].keys()
    total_col = next(c for c in cols if "Warp Stall Sampling (All" in c)
    reason_cols = [c for c in cols if c.startswith("stall_") or "Stall Sampling" in c and c != total_col]

    def num(x: str) -> float:
        try:
            return float(x.replace(",", ""))
        except ValueError:
            return 0.0

    total = sum(num(r[total_col]) for r in rows)
    print(f"{len(rows)} instructions, {total:.0f} samples; columns: {len(cols)}")
    by_reason = Counter({c: sum(num(r[c]) for r in rows) for c in reason_cols})
    for c, v in by_reason.most_common(12):
        print(f"  {v / total:6.1%}  {c}")

    def opcode(r: dict[str, str]) -> str:  # the instruction's opcode, past a predicate such as @P0
        words = r["Source"].split()
        return words[1] if words and words[0].startswith("@") and len(words) > 1 else words[0] if words else "?"

    by_op = Counter()
    for r in rows:
        by_op[opcode(r)] += num(r[total_col])
    print("by opcode: " + ", ".join(f"{op} {v / total:.1%}" for op, v in by_op.most_common(14)))
    # Instructions that execute equally often belong to one loop level (once a tile, once a step, ...):
    # the samples per execution count say where a kernel's fixed and per-step costs sit.
    by_count = Counter()
    count_instructions = Counter()
    for r in rows:
        executed = num(r.get("Instructions Executed", "0"))
        if executed:
            by_count[executed] += num(r[total_col])
            count_instructions[executed] += 1
    print(
        "by execution count (warp-level): "
        + ", ".join(f"{c:.0f} x{count_instructions[c]} instr {v / total:.1%}" for c, v in by_count.most_common(6))
    )

    # What runs, not where it waits: instructions executed by opcode, per tensor-core instruction (the
    # fp32 backward's splits showed up this way: a tf32 rounding emulated in four instructions).
    executed_by_op = Counter()
    for r in rows:
        executed_by_op[opcode(r).split(".")[0]] += num(r.get("Instructions Executed", "0"))
    mma = sum(v for op, v in executed_by_op.items() if op in ("HMMA", "HGMMA")) or 1.0
    executed = sum(executed_by_op.values())
    print(
        f"executed: {executed:.0f} warp instructions, {executed / mma:.2f} per mma; per mma: "
        + ", ".join(f"{op} {v / mma:.2f}" for op, v in executed_by_op.most_common(12))
    )
    for c, _ in by_count.most_common(3):
        ops = Counter(opcode(r) for r in rows if num(r.get("Instructions Executed", "0")) == c)
        print(f"  level x{c:.0f} ({sum(ops.values())} instr): " + ", ".join(f"{o} {k}" for o, k in ops.most_common(10)))
    ranked = sorted(rows, key=lambda r: -num(r[total_col]))[:top]
    for r in ranked:
        reasons = sorted(((num(r[c]), c) for c in reason_cols), reverse=True)[:2]
        why = "; ".join(f"{c.replace('Warp Stall Sampling', '').strip()} {v:.0f}" for v, c in reasons if v)
        print(f"{num(r[total_col]) / total:6.2%} {r.get('Address', r.get('#', '')):>6} {r['Source'][:70]:70} {why}")


if __name__ == "__main__":
    try:
        main()
    except (StopIteration, KeyError) as e:  # an ncu whose CSV differs: show what it wrote
        print(f"cannot read {sys.argv[1]} ({e!r}); its first lines:")
        with open(sys.argv[1]) as f:
            print("".join(f.readlines()[:4])[:3000])
