"""Writes csrc/attention/cuda/generated/ from the one table of CUDA attention kernel variants.

    python tools/gen_kernels.py          # rewrite the generated files
    python tools/gen_kernels.py --check  # exit 1 (and name the files) if they differ from the table

A variant is (family, dtype, padded head dim). Each one gets its own translation unit, so ninja
compiles them in parallel, holding the explicit instantiations of its family's entry points; and
kernel_variants.h gets, per family, the list of head dims and an X-macro of (Elem, ScalarKind, D)
that attention_cuda.cpp expands into its dispatch switches. A family with tile variants (TILES:
the Hopper backward) gets a translation unit per (dtype, tile), X(Elem, ScalarKind, D, tile index)
and the tile table itself (kBwdSm90Tiles), which the launch header reads its tile shapes from and
the host picks from by name (FLASHMOD_BWD_SM90_TILE) or by the default flag. Adding a family is one line of
FAMILIES (its launch header defines the entry point templates); adding a head dim is one entry of
a head-dim tuple (plus the tile choice in the family's launch header). The output is checked in;
tests/test_generated_kernels.py fails when it no longer matches this table.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "csrc" / "attention" / "cuda" / "generated"

# (file-name tag, CUDA element type, ScalarKind enumerator)
DTYPES = (("fp16", "__half", "kFloat16"), ("bf16", "__nv_bfloat16", "kBFloat16"))
FP32 = (("fp32", "float", "kFloat32"),)

# Padded head dims: a call runs the variant of the smallest one >= its head_dim.
HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)


@dataclass(frozen=True)
class Tile:
    """A tile variant of the Hopper backward for some head dims. name: its FLASHMOD_BWD_SM90_TILE
    value; kv: the dK/dV kernel's (query rows per step, CTAs per SM its registers must allow,
    shared-memory stages of Q_i/dO_i, overlap: 1 leaves a step's gradient wgmma in flight across
    the next step's barrier); q: the dQ kernel's (key columns per block, CTAs per SM, stages of
    K_j/V_j, overlap); default: the tile that runs when the knob is unset (one per head dim);
    split: how dK and dV share out (0: one warpgroup accumulates both, 1: a launch each, 2: a
    warpgroup each in one CTA)."""

    name: str
    head_dims: tuple[int, ...]
    kv: tuple[int, int, int, int]
    q: tuple[int, int, int, int]
    default: bool = False
    split: int = 0


# Measurements behind the defaults: benchmarks/results/design/cuda-backward.md ("Hopper v4").
BWD_SM90_TILES = (
    # Defaults measured with tools/bwd_sm90_tiles.py on an H100 (fwd+bwd vs SDPA FLASH in one
    # process, B * N = 16k, H * D = 2048, N = 1k/4k/16k, causal and not; runs 1 and 2 in
    # benchmarks/results/2026-11-24-h100-bwd-sm90-tiles-run*.txt, the design log's "Hopper v4").
    # D = 64: dK/dV at three CTAs per SM (164-168 registers of 170), dQ at four (127 of 128):
    # bf16 1.28-1.51x FLASH in run 2, 1.34-1.47x in run 3 (fp16 1.29-1.48x); cta3, dQ at three:
    # 1.21-1.42x; base, two and two: 1.11-1.35x; dQ 7.32 -> 6.30 ms at N = 16k.
    Tile("cta3_q4", (64,), kv=(64, 3, 2, 0), q=(64, 4, 2, 0), default=True),
    # 64 keys x 64-query steps, 64 queries x 64-key blocks, two CTAs per SM, double-buffered.
    # D = 128: bf16 1.32-1.39x, fp16 1.32-1.40x FLASH; its dK/dV (250 registers) and dQ (97 KB of
    # shared memory) leave no room for a third CTA.
    Tile("base", (64,), kv=(64, 2, 2, 0), q=(64, 2, 2, 0)),
    Tile("base", (128,), kv=(64, 2, 2, 0), q=(64, 2, 2, 0), default=True),
    # D = 256: dV and dK by the two warpgroups of one CTA (8 warps an SM, one load of Q_i, dO_i per
    # step): dK/dV 14.8 -> 10.3 ms at N = 16k against a launch each; bf16 1.23-1.33x FLASH (a
    # launch each: 0.98-1.13x).
    # D = 192 the same: bf16 fwd + bwd 1.47-1.63x FLASH, 0.92-1.08x CUDNN at D = 160 / 192. Timed
    # against it and not kept (session 59, fwd + bwd at N = 1k / 4k): a third stage of Q_i, dO_i and
    # of K_j, V_j (1.00-1.01x, a 12-byte spill in dK/dV); the gradient wgmma in flight across the
    # next step's barrier too (0.88-0.93x).
    Tile("pair", (192, 256), kv=(64, 1, 2, 0), q=(64, 1, 2, 0), default=True, split=2),
    # D = 256, one launch per gradient, one CTA per SM (the tiles take ~194 KB).
    Tile("base", (256,), kv=(64, 1, 2, 0), q=(64, 1, 2, 0), split=1),
    # D = 64, both kernels at three CTAs per SM (the default before cta3_q4).
    Tile("cta3", (64,), kv=(64, 3, 2, 0), q=(64, 3, 2, 0)),
    # D = 64, lost against base in run 1 (dK/dV, dQ ms at N = 16k; base 15.8, 9.45): wgmma N = 128
    # score products (kv128: dK/dV 17.1; q128: dQ 11.2), a third stage (even), the gradient wgmma
    # in flight across the next step's barrier (overlap: dK/dV 15.5, dQ 11.5).
    Tile("kv128", (64,), kv=(128, 2, 2, 0), q=(64, 2, 2, 0)),
    Tile("q128", (64,), kv=(64, 2, 2, 0), q=(128, 2, 2, 0)),
    Tile("stage3", (64,), kv=(64, 2, 3, 0), q=(64, 2, 3, 0)),
    Tile("overlap", (64,), kv=(64, 2, 3, 1), q=(64, 2, 3, 1)),
)


@dataclass(frozen=True)
class Family:
    """One kernel family: its name (file prefix, macro name), the launch header that defines its
    entry point templates, the head dims it is built for, its entry points as
    "name(parameter types)", each instantiated as cudaError_t name<Elem, D>(...), and its dtypes."""

    name: str
    header: str
    head_dims: tuple[int, ...]
    entry_points: tuple[str, ...]
    dtypes: tuple[tuple[str, str, str], ...] = DTYPES
    tiles: tuple[Tile, ...] = ()  # entry points then take a third template argument, the tile index

    def tile_entries(self) -> list[tuple[int, Tile, int]]:
        """(index, tile, head dim) per built tile: the index is the tile's row in the table."""
        rows = [(t, d) for t in self.tiles for d in t.head_dims]
        return [(i, t, d) for i, (t, d) in enumerate(rows)]


# A family is one line, e.g. a backward whose launch header defines run_attention_bwd<Elem, D>:
#   Family("bwd_sm80", "bwd_sm80_launch.h", HEAD_DIMS, ("run_attention_bwd(const AttentionBwdParams&, cudaStream_t)",)),
# which adds generated/bwd_sm80_<dtype>_hd<D>.cu and FLASHMOD_BWD_SM80_VARIANTS / kBwdSm80HeadDims.
FAMILIES = (
    Family("fwd_sm80", "fwd_sm80_launch.h", HEAD_DIMS, (
        "run_attention_fwd(const AttentionParams&, const FwdLaunchFlags&, const DeviceWorkspace&, cudaStream_t)",
        "run_attention_fwd_decode(const AttentionParams&, const FwdLaunchFlags&, const DecodeOptions&, "
        "const DeviceWorkspace&, cudaStream_t)",
    )),
    Family("fwd_sm90", "fwd_sm90_launch.h", (64, 128, 192, 256), (
        "run_attention_fwd_sm90(const AttentionParams&, const FwdLaunchFlags&, const DeviceWorkspace&, "
        "cudaStream_t)",
    )),
    Family("fwd_sm90_ws", "fwd_sm90_ws_launch.h", (64, 128, 192, 256), (
        "run_attention_fwd_sm90_ws(const AttentionParams&, const FwdLaunchFlags&, const DeviceWorkspace&, "
        "cudaStream_t)",
    )),
    Family("bwd_sm80", "bwd_sm80_launch.h", HEAD_DIMS, (
        "run_attention_bwd(const AttentionBwdParams&, const BwdRowStats&, cudaStream_t)",
    )),
    Family("bwd_sm90", "bwd_sm90_launch.h", (64, 128, 192, 256), (
        "run_attention_bwd_sm90(const AttentionBwdParams&, const BwdRowStats&, cudaStream_t)",
    ), tiles=BWD_SM90_TILES),
    Family("bwd_tf32", "bwd_tf32_launch.h", HEAD_DIMS, (
        "run_attention_bwd_tf32(const AttentionBwdParams&, const BwdRowStats&, cudaStream_t)",
    ), FP32),
)  # fmt: skip

HEADER = "kernel_variants.h"
BANNER = "// Generated by tools/gen_kernels.py from its variant table: edit the table, not this file.\n"


def unit_name(family: Family, tag: str, head_dim: int, tile: str = "") -> str:
    return f"{family.name}_{tag}_hd{head_dim}{'_' + tile if tile else ''}.cu"


def check_tiles(family: Family) -> None:
    """Every tile is for head dims of the family, names are unique per head dim, and each head
    dim has exactly one default."""
    entries = family.tile_entries()
    if len(entries) > 64:
        raise ValueError(f"{family.name}: the dispatch key leaves room for 64 tiles")
    for d in family.head_dims:
        names = [t.name for _, t, td in entries if td == d]
        defaults = [t.name for _, t, td in entries if td == d and t.default]
        if len(names) != len(set(names)) or len(defaults) != 1:
            raise ValueError(f"{family.name}, head dim {d}: tiles {names}, defaults {defaults}")
    for _, t, d in entries:
        if d not in family.head_dims:
            raise ValueError(f"{family.name}: tile {t.name} for head dim {d}, not built")


def instantiation_unit(family: Family, elem: str, head_dim: int, tile: int | None = None) -> str:
    """The translation unit of one variant: its family's entry points for (elem, head_dim) and,
    in a family with tiles, the tile of that index."""
    lines = [
        BANNER,
        f'#include "../{family.header}"\n',
        "\n",
        "// clang-format off\n",
        "namespace flashmod::cuda_kernels {\n",
    ]
    for entry in family.entry_points:
        name, params = entry.split("(", 1)
        args = f"{elem}, {head_dim}" + ("" if tile is None else f", {tile}")
        lines.append(f"template cudaError_t {name}<{args}>({params};\n")
    lines += ["}  // namespace flashmod::cuda_kernels\n", "// clang-format on\n"]
    return "".join(lines)


def variants_header() -> str:
    """kernel_variants.h: per family, its head dims and the X-macro of its variants."""
    out = [
        BANNER,
        "//\n",
        "// Per kernel family F: kFHeadDims (the padded head dims it is built for) and\n",
        "// FLASHMOD_F_VARIANTS(X), which expands X(Elem, ScalarKind enumerator, head dim) once per\n",
        "// built variant; switch on variant_key(dtype, head dim) to call the right instantiation.\n",
        "#pragma once\n",
        "\n",
        "#include <cstdint>\n",
        "\n",
        '#include "../../../common/scalar_kinds.h"\n',
        "\n",
        "namespace flashmod::cuda_kernels {\n",
        "\n",
        "constexpr int variant_key(ScalarKind dtype, int head_dim) {\n",
        "  return static_cast<int>(dtype) * 1024 + head_dim;\n",
        "}\n",
        "\n",
        "template <int N>\n",
        "constexpr bool has_head_dim(const int (&head_dims)[N], int head_dim) {\n",
        "  for (int d : head_dims)\n",
        "    if (d == head_dim) return true;\n",
        "  return false;\n",
        "}\n",
        "\n",
        "// The padded head dim whose kernels serve head_dim d: the smallest of head_dims (ascending)\n",
        "// >= d, or -1.\n",
        "template <int N>\n",
        "constexpr int padded_head_dim(const int (&head_dims)[N], int64_t d) {\n",
        "  for (int pd : head_dims)\n",
        "    if (d <= pd) return pd;\n",
        "  return -1;\n",
        "}\n",
        "\n",
        "// A tile variant (tools/gen_kernels.py, Tile): the dK/dV kernel's query rows per step, CTAs\n",
        "// per SM, stages and overlap flag; the dQ kernel's key columns per block and the same.\n",
        "struct KernelTile {\n",
        "  const char* name;\n",
        "  int head_dim;\n",
        "  int kv_rows, kv_ctas, kv_stages, kv_overlap;\n",
        "  int q_cols, q_ctas, q_stages, q_overlap;\n",
        "  int kv_split;  // dK and dV: 0 one warpgroup, 1 a launch each, 2 a warpgroup each\n",
        "  bool is_default;\n",
        "};\n",
        "\n",
        "constexpr bool same_name(const char* a, const char* b) {\n",
        "  while (*a != 0 && *a == *b) ++a, ++b;\n",
        "  return *a == *b;\n",
        "}\n",
        "\n",
        "// The index of the tile called `name` built for head_dim (an empty name: the default one),\n",
        "// or -1.\n",
        "template <int N>\n",
        "constexpr int find_tile(const KernelTile (&tiles)[N], const char* name, int head_dim) {\n",
        "  for (int i = 0; i < N; ++i)\n",
        "    if (tiles[i].head_dim == head_dim &&\n",
        "        (*name == 0 ? tiles[i].is_default : same_name(tiles[i].name, name)))\n",
        "      return i;\n",
        "  return -1;\n",
        "}\n",
    ]
    for family in FAMILIES:
        camel = "".join(part.capitalize() for part in family.name.split("_"))
        dims = ", ".join(str(d) for d in family.head_dims)
        out += ["\n", f"constexpr int k{camel}HeadDims[] = {{{dims}}};\n"]
        out.append("// clang-format off\n")
        if family.tiles:
            check_tiles(family)
            out.append(f"constexpr KernelTile k{camel}Tiles[] = {{\n")
            for _, t, d in family.tile_entries():
                fields = ", ".join(str(x) for x in (d, *t.kv, *t.q, t.split))
                out.append(f'  {{"{t.name}", {fields}, {str(t.default).lower()}}},\n')
            out.append("};\n")
        out.append(f"#define FLASHMOD_{family.name.upper()}_VARIANTS(X) \\\n")
        if family.tiles:
            items = [
                f"  X({elem}, {kind}, {d}, {i})" for _, elem, kind in family.dtypes for i, _, d in family.tile_entries()
            ]
        else:
            items = [f"  X({elem}, {kind}, {d})" for _, elem, kind in family.dtypes for d in family.head_dims]
        out.append(" \\\n".join(items) + "\n")
        out.append("// clang-format on\n")
    out += ["\n", "}  // namespace flashmod::cuda_kernels\n"]
    return "".join(out)


def generated_files() -> dict[str, str]:
    """Every file of generated/, name -> text."""
    files = {HEADER: variants_header()}
    for family in FAMILIES:
        for tag, elem, _ in family.dtypes:
            if family.tiles:
                for i, t, d in family.tile_entries():
                    files[unit_name(family, tag, d, t.name)] = instantiation_unit(family, elem, d, i)
                continue
            for d in family.head_dims:
                files[unit_name(family, tag, d)] = instantiation_unit(family, elem, d)
    return files


def stale_files(out: Path = OUT) -> list[str]:
    """Names in `out` that differ from the table's output, are missing, or are not in it."""
    want = generated_files()
    have = {p.name for p in out.iterdir() if p.is_file()} if out.is_dir() else set()
    bad = [n for n, text in want.items() if n not in have or (out / n).read_text() != text]
    return sorted(bad + [n for n in have - want.keys()])


def write(out: Path = OUT) -> None:
    out.mkdir(parents=True, exist_ok=True)
    want = generated_files()
    for path in out.iterdir():
        if path.is_file() and path.name not in want:
            path.unlink()
    for name, text in want.items():
        if not (out / name).is_file() or (out / name).read_text() != text:
            (out / name).write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 on a difference")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        if stale:
            print("out of date with tools/gen_kernels.py:", *stale, sep="\n  ")
            return 1
        return 0
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
