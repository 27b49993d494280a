#!/bin/bash
# Builds each tile-config variant (csrc/cuda/fwd_launch.h's FLASHMOD_TUNE_<D> hooks) and times it
# against SDPA's FLASH backend in one go; used on the GPU machine:
#   bash benchmarks/tune_variants.sh OUTDIR "name=flags" ...
# e.g. "v1=-DFLASHMOD_TUNE_64=1 -DFLASHMOD_TUNE_128=7". Leaves the last variant built.
out=$1; shift
for spec in "$@"; do
  name=${spec%%=*}; flags=${spec#*=}
  echo "=== $name: $flags"
  FLASHMOD_NVCC_EXTRA="$flags" MAX_JOBS=16 FLASHMOD_CUDA_ARCHS=${FLASHMOD_CUDA_ARCHS:-90a} \
    python setup.py build_ext --inplace > "$out/build-$name.log" 2>&1 || { grep -A3 error "$out/build-$name.log" | head -20; continue; }
  python benchmarks/bench_attention.py --kinds paper --dtypes bf16 --dims 64,128 --min-n 1024 \
    --backends FLASH --out-dir "$out" --tag "tune-$name" 2>/dev/null | grep -E "^paper"
done
