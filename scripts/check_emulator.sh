#!/usr/bin/env bash
# Builds the CUDA kernels' emulator (csrc/emulator) with ThreadSanitizer and UBSan, without torch,
# and runs its self-test: every path of the kernels against the scalar path, with the sanitizers
# watching the barriers, the warp exchange and the vector loads. A data race (a missing
# __syncthreads), undefined behaviour (a misaligned vector load) or a shuffle that not every lane
# reaches fails it. Needs only g++ (C++20) with libtsan and libubsan; ~30 s here.
#
#   CXX   the compiler (default g++)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build/emulator
BIN=build/emulator/selftest-tsan
echo "emulator: building with -fsanitize=thread,undefined"
"${CXX:-g++}" -std=c++20 -O1 -g -fsanitize=thread,undefined -fno-sanitize-recover=all \
  -Wall -Wextra -Werror -ffp-contract=off -Icsrc -pthread \
  csrc/emulator/selftest.cpp csrc/emulator/compare_emulated.cpp csrc/emulator/cuda_shim.cpp \
  csrc/cuda/launch.cpp -o "$BIN"
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" UBSAN_OPTIONS="print_stacktrace=1" "$BIN"
echo "emulator: ok (ThreadSanitizer and UBSan found nothing)"
