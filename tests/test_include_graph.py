"""Layering of csrc/: common/ is the floor (it includes nothing from attention/ or softmax/), the
attention and softmax operators do not include each other, and the quoted includes form no cycle."""

from __future__ import annotations

import re
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "csrc"
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
SOURCE_SUFFIXES = {".h", ".cuh", ".cpp", ".cu"}


def include_graph() -> dict[Path, set[Path]]:
    """Every csrc source file mapped to the csrc files its quoted includes resolve to."""
    graph: dict[Path, set[Path]] = {}
    for path in sorted(CSRC.rglob("*")):
        if path.suffix not in SOURCE_SUFFIXES:
            continue
        targets = set()
        for name in INCLUDE.findall(path.read_text()):
            target = (path.parent / name).resolve()
            assert target.is_file(), f"{path.relative_to(CSRC)} includes {name!r}, which does not exist"
            targets.add(target)
        graph[path.resolve()] = targets
    return graph


def area(path: Path) -> str:
    """The top-level folder under csrc/ ('common', 'attention', 'softmax'), or '' for csrc/ itself."""
    parts = path.relative_to(CSRC.resolve()).parts
    return parts[0] if len(parts) > 1 else ""


def test_graph_is_not_empty():
    graph = include_graph()
    assert len(graph) > 20 and sum(len(t) for t in graph.values()) > 20


def test_common_includes_only_common():
    bad = [
        f"{src.relative_to(CSRC)} -> {dst.relative_to(CSRC)}"
        for src, targets in include_graph().items()
        for dst in targets
        if area(src) == "common" and area(dst) != "common"
    ]
    assert not bad, "csrc/common must not include from the operators:\n" + "\n".join(bad)


def test_attention_and_softmax_do_not_include_each_other():
    operators = {"attention", "softmax"}
    bad = [
        f"{src.relative_to(CSRC)} -> {dst.relative_to(CSRC)}"
        for src, targets in include_graph().items()
        for dst in targets
        if area(src) in operators and area(dst) in operators and area(src) != area(dst)
    ]
    assert not bad, "attention/ and softmax/ include each other:\n" + "\n".join(bad)


def find_cycle(graph: dict[Path, set[Path]]) -> list[Path] | None:
    """One include cycle as a path of files (first == last), or None."""
    state: dict[Path, int] = {}  # 1: on the current path, 2: finished
    stack: list[Path] = []

    def visit(node: Path) -> list[Path] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_include_cycle():
    cycle = find_cycle(include_graph())
    assert cycle is None, "include cycle: " + " -> ".join(str(p.relative_to(CSRC)) for p in cycle)


def test_cycle_finder_finds_a_planted_cycle():
    a, b, c = (CSRC / n for n in ("a.h", "b.h", "c.h"))
    assert find_cycle({a: {b}, b: {c}, c: {a}}) == [a, b, c, a]
    assert find_cycle({a: {b}, b: {c}, c: set()}) is None
