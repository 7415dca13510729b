#!/bin/bash
set -u
# kiln and llama.cpp on the same GGUF files, alternating, ROUNDS rounds (default 2; kiln
# bench and llama-bench, -p 64 -n 32 -r REPS (default 3) -t 2). Make the files with
# make_random_gguf.py and llama-quantize. The 2-core machine is shared: compare within a
# round, report medians. The first lines name the machine (lscpu's model name, the SIMD
# flags kiln and ggml choose kernels by) and the date, to go beside every figure.
# llama.cpp tools built from the source vendored in the PyPI sdist of llama-cpp-python 0.3.36
# (llama.cpp 0c1e570), CPU build without AMX (see BENCHMARKS.md); on the AMD EPYC machine
# of 2026-11-23 a llama.cpp checkout (d32676d77) built with -DGGML_NATIVE=ON; set LLAMA_BIN
# to its bin/.
B=${LLAMA_BIN:?set LLAMA_BIN to the bin folder of a llama.cpp build}
# KILN: the kiln binary, or several separated by spaces (e.g. before and after a change).
K=${KILN:-$(pwd)/target/release/kiln}
# MODELS: the folder holding tl-Q4_0.gguf, tl-Q8_0.gguf, tl-Q4_K_M.gguf and tl-f16.gguf;
# TYPES: which of them (default all four, e.g. TYPES="Q4_K_M F16").
cd "${MODELS:?set MODELS to the folder of the tl-*.gguf files}" || exit 1
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'); $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs"
echo "# SIMD: $(grep -m1 -o -w -E 'avx2|fma|f16c|avx512f|avx512bw|avx512vl|avx512_vnni|avx512_bf16|amx_tile|amx_int8|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')"
for round in $(seq "${ROUNDS:-2}"); do
for t in ${TYPES:-Q4_0 Q8_0 Q4_K_M F16}; do
  f=tl-$t.gguf; [ $t = F16 ] && f=tl-f16.gguf
  echo "=== round $round $t llama.cpp"; LD_LIBRARY_PATH=$B $B/llama-bench -m $f -p 64 -n 32 -r "${REPS:-3}" -t 2 -o md 2>&1 | grep -E "^\|"
  for k in $K; do
    echo "=== round $round $t kiln $k"; $k bench -m $f -p 64 -n 32 -r "${REPS:-3}" -t 2 2>&1 | grep -E "^\|"
  done
done
done
