#!/usr/bin/env bash
# CMake arguments for building llama.cpp on this CPU, printed on stdout.
# A native build (-march=native) is the default, except on CPUs with AMX: there llama.cpp's
# AMX matmul crashes on Q4_K_M weights (ggml-org/llama.cpp#20824, seen here on a Sapphire
# Rapids-class Xeon: SIGSEGV in ggml_backend_amx_mul_mat at the first decode), so the build
# names this CPU's other instruction sets one by one and leaves AMX out.
set -euo pipefail
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has() { [[ " $flags " == *" $1 "* ]]; }
if ! has amx_tile; then
  exit 0
fi
args=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
while read -r cpu opt; do
  if has "$cpu"; then args+=("-DGGML_$opt=ON"); else args+=("-DGGML_$opt=OFF"); fi
done <<'MAP'
sse4_2 SSE42
avx AVX
avx2 AVX2
bmi2 BMI2
fma FMA
f16c F16C
avx_vnni AVX_VNNI
avx512f AVX512
avx512vbmi AVX512_VBMI
avx512_vnni AVX512_VNNI
avx512_bf16 AVX512_BF16
MAP
echo "${args[*]}"
