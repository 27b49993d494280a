#!/bin/bash
# Builds each tile-config variant (the FLASHMOD_TUNE_<D> hooks of csrc/cuda/fwd_launch.h and
# FLASHMOD_TUNE_SM90_<D> of fwd_launch_sm90.h), checks it against the fp64 reference, and times it
# against SDPA's FLASH backend in one go; used on the GPU machine:
#   bash benchmarks/tune_variants.sh OUTDIR "name=flags" ...
# e.g. "v1=-DFLASHMOD_TUNE_SM90_64=4 -DFLASHMOD_TUNE_SM90_128=4". Leaves the last variant built.
out=$1; shift
for spec in "$@"; do
  name=${spec%%=*}; flags=${spec#*=}
  echo "=== $name: $flags"
  FLASHMOD_NVCC_EXTRA="$flags" MAX_JOBS=$(nproc) FLASHMOD_CUDA_ARCHS=${FLASHMOD_CUDA_ARCHS:-90a} \
    python setup.py build_ext --inplace > "$out/build-$name.log" 2>&1 || { grep -A3 error "$out/build-$name.log" | head -20; continue; }
  python benchmarks/check_cuda_paths.py > "$out/check-$name.log" 2>&1; tail -1 "$out/check-$name.log"
  python benchmarks/bench_attention.py --kinds paper --dtypes bf16 --dims 64,128 --min-n 1024 \
    --backends ${TUNE_BACKENDS:-FLASH} --out-dir "$out" --tag "tune-$name" 2>/dev/null | grep -E "^paper"
done
