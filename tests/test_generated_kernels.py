"""csrc/attention/cuda/generated/ is exactly what tools/gen_kernels.py writes from its variant table, and
the table agrees with the launch headers it names."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_kernels", ROOT / "tools" / "gen_kernels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_checked_in_files_match_the_generator():
    gen = load_generator()
    stale = gen.stale_files()
    assert not stale, "regenerate with `python tools/gen_kernels.py`; out of date: " + ", ".join(stale)


def test_stale_files_sees_a_changed_a_missing_and_an_extra_file(tmp_path):
    gen = load_generator()
    gen.write(tmp_path)
    assert gen.stale_files(tmp_path) == []
    names = sorted(gen.generated_files())
    (tmp_path / names[0]).write_text("// edited by hand\n")
    (tmp_path / names[1]).unlink()
    (tmp_path / "fwd_sm80_fp16_hd48.cu").write_text("")
    assert gen.stale_files(tmp_path) == sorted([names[0], names[1], "fwd_sm80_fp16_hd48.cu"])
    gen.write(tmp_path)
    assert gen.stale_files(tmp_path) == []


def test_every_family_has_its_header_and_entry_points():
    gen = load_generator()
    cuda_dir = gen.OUT.parent
    for family in gen.FAMILIES:
        header = (cuda_dir / family.header).read_text()
        for entry in family.entry_points:
            name = entry.split("(", 1)[0]
            assert re.search(rf"cudaError_t {name}\(", header), f"{family.header} defines no {name}"
        assert list(family.head_dims) == sorted(set(family.head_dims)), family.name


def test_tile_table_rules():
    """One default tile per head dim, names unique per head dim, only head dims the family builds."""
    gen = load_generator()
    family = next(f for f in gen.FAMILIES if f.tiles)
    gen.check_tiles(family)
    base = gen.Tile("a", (64,), kv=(64, 2, 2, 0), q=(64, 2, 2, 0), default=True)
    for tiles in (
        (base, gen.Tile("b", (64,), kv=(64, 2, 2, 0), q=(64, 2, 2, 0), default=True)),
        (base, gen.Tile("a", (64,), kv=(128, 2, 2, 0), q=(64, 2, 2, 0))),
        (base, gen.Tile("c", (48,), kv=(64, 2, 2, 0), q=(64, 2, 2, 0))),
    ):
        bad = gen.Family("x", "x.h", (64,), (), tiles=tiles)
        with pytest.raises(ValueError):
            gen.check_tiles(bad)
