#!/usr/bin/env bash
# llama.cpp's `llama-perplexity`, built here from the llama.cpp sources vendored in the PyPI
# sdist of llama-cpp-python (pinned below), for side-by-side runs. Prints the binary's path.
# Development only. Idempotent: the build is cached under eval/.cache/llama.cpp.
# Needs g++ and Python; cmake and ninja come from PyPI into eval/.cache/llama.cpp/venv.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
version=0.3.36
cache="$root/eval/.cache/llama.cpp"
bin="$cache/llama_cpp_python-$version/vendor/llama.cpp/build/bin/llama-perplexity"
if [ -x "$bin" ]; then echo "$bin"; exit 0; fi
mkdir -p "$cache"
[ -x "$cache/venv/bin/python" ] || python3 -m venv "$cache/venv"
"$cache/venv/bin/pip" install --quiet cmake==4.4.5 ninja scikit-build-core >&2
if [ ! -d "$cache/llama_cpp_python-$version" ]; then
  # The sdist only: its build dependencies are installed above, so no isolation is needed.
  "$cache/venv/bin/pip" download --quiet --no-deps --no-binary llama-cpp-python \
    --no-build-isolation "llama-cpp-python==$version" -d "$cache" >&2
  tar xzf "$cache/llama_cpp_python-$version.tar.gz" -C "$cache"
fi
src="$cache/llama_cpp_python-$version/vendor/llama.cpp"
"$cache/venv/bin/cmake" -S "$src" -B "$src/build" -G Ninja \
  -DCMAKE_MAKE_PROGRAM="$cache/venv/bin/ninja" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >&2
"$cache/venv/bin/cmake" --build "$src/build" --target llama-perplexity -j "$(nproc)" >&2
echo "$bin"
