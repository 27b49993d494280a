"""The docs that list things keep up with the code: every environment knob the C++ host code reads
(env_flag / env_int / env_text in csrc/) is listed in csrc/common/knobs.h, which says it lists every
knob, and in the README's knob table, and those lists name only knobs the code reads; the README's
folder map names every Python module, test file, benchmark and tool."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
READ = re.compile(r'env_(?:flag|int|text)\("(FLASHMOD_[A-Z0-9_]+)"')


def knobs_read() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "csrc").rglob("*"):
        if path.suffix in {".h", ".cuh", ".cpp", ".cu"}:
            names |= set(READ.findall(path.read_text()))
    return names


def knobs_h_list() -> set[str]:
    """The names in knobs.h's comment list ("//   FLASHMOD_X...", one entry per knob)."""
    text = (ROOT / "csrc" / "common" / "knobs.h").read_text()
    return set(re.findall(r"^//   (FLASHMOD_[A-Z0-9_]+)", text, re.MULTILINE))


def readme_table() -> set[str]:
    """The first column of the README's knob table ("| `FLASHMOD_X=...` | ... |")."""
    text = (ROOT / "README.md").read_text()
    return set(re.findall(r"^\| `(FLASHMOD_[A-Z0-9_]+)", text, re.MULTILINE))


def test_the_code_reads_knobs():
    assert len(knobs_read()) > 30


def test_knobs_h_lists_every_knob_read():
    read, listed = knobs_read(), knobs_h_list()
    assert read - listed == set(), f"read in csrc/ but not listed in knobs.h: {sorted(read - listed)}"
    assert listed - read == set(), f"listed in knobs.h but read nowhere: {sorted(listed - read)}"


def test_readme_table_has_every_knob_read():
    read, table = knobs_read(), readme_table()
    assert read - table == set(), f"read in csrc/ but not in the README's knob table: {sorted(read - table)}"
    assert table - read == set(), f"in the README's knob table but read nowhere: {sorted(table - read)}"


def test_folder_map_names_every_file():
    text = (ROOT / "README.md").read_text()
    folder_map = text[text.index("## Folder map") : text.index("## How it is built")]
    files = [
        *(ROOT / "flashmod").glob("*.py"),
        *(ROOT / "tests").rglob("*.py"),
        *(ROOT / "benchmarks").glob("*.py"),
        *(ROOT / "tools").glob("*"),
    ]
    unnamed = sorted(
        str(f.relative_to(ROOT)) for f in files if f.is_file() and f.name != "__init__.py" and f.name not in folder_map
    )
    assert len(files) > 50
    assert unnamed == [], f"not in the README's folder map: {unnamed}"
