#!/usr/bin/env bash
# Build llama.cpp's own llama-server from the sources llama-cpp-python vendors (the same
# llama.cpp revision SpecGate runs), for the `llama_server` arm of `specgate bench concurrency`.
#   bash ops/build_llama_server.sh     -> ~/.cache/specgate/llama-server/bin/llama-server
# Needs cmake and a C++ compiler; about 10-15 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${SPECGATE_LLAMA_SERVER_DIR:-$HOME/.cache/specgate/llama-server}
version=$("$PY" -c "import llama_cpp; print(llama_cpp.__version__)")
if [[ -x "$OUT/bin/llama-server" && "$(cat "$OUT/VERSION" 2>/dev/null)" == "$version" ]]; then
  echo "llama-server $version already built: $OUT/bin/llama-server"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY" -m pip download "llama-cpp-python==$version" --no-binary :all: --no-deps -d "$work" -q
tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
src=$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF \
  $(bash ops/cpu_flags.sh) >/dev/null  # native, but never AMX
cmake --build "$work/build" --target llama-server -j "$(nproc)"
mkdir -p "$OUT/bin"
cp "$work/build/bin/llama-server" "$OUT/bin/"
echo "$version" > "$OUT/VERSION"
echo "built $OUT/bin/llama-server ($version)"
