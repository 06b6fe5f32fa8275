// The dtypes the kernels compare: one table, every list in C++ made from it.
//
// FSDPCHECK_DTYPES(X) calls X once per dtype with its columns:
//   X(Enum, Code, Name, Bits, Size, ScalarType, Kind)
//   Enum        DType::k<Enum>
//   Code        its DType code (host <-> device metadata, SASS kernel names; not part of any file
//               format: fingerprints and manifests never store it). Below 256: a launch record
//               packs it in 8 bits (cuda/launch.h)
//   Name        torch's name for it (torch.<Name>); what build_info() reports and Python reads
//   Bits        the unsigned storage type of one element (Traits<D>::Bits must be this type)
//   Size        its size in bytes (= sizeof(Bits))
//   ScalarType  at::ScalarType::<ScalarType>
//   Kind        Float, Int or Bool (DTypeKind::k<Kind>; Traits<D>::kInteger is Kind != Float)
//
// NOTE: [one dtype table] The DType enum, dtype_size, visit_dtype, the torch dtype -> DType
// mapping and its error message (plan.cpp), the CPU's per-dtype statistics (compare_cpu.cpp),
// the CUDA launch switch (compare_kernels.h), the emulator's self-test and build_info()
// (module.cpp) are all generated from this table; Python reads build_info() (fsdpcheck.kernels)
// and bench/sass_report.py reads this file. A new dtype is a line here, its Traits and
// SpecialWords in elementwise.h (a static_assert there holds them to this line), and its tests.
// This file is included by nvcc, the host compiler and the emulator: no torch header here.
#pragma once

#include <cstdint>

// clang-format off
#define FSDPCHECK_DTYPES(X)                                                    \
  X(Float64,       0, "float64",       uint64_t, 8, Double,        Float)      \
  X(Float32,       1, "float32",       uint32_t, 4, Float,         Float)      \
  X(Float16,       2, "float16",       uint16_t, 2, Half,          Float)      \
  X(BFloat16,      3, "bfloat16",      uint16_t, 2, BFloat16,      Float)      \
  X(Float8E4M3FN,  4, "float8_e4m3fn", uint8_t,  1, Float8_e4m3fn, Float)      \
  X(Float8E5M2,    5, "float8_e5m2",   uint8_t,  1, Float8_e5m2,   Float)      \
  X(Int8,          6, "int8",          uint8_t,  1, Char,          Int)        \
  X(Int16,         7, "int16",         uint16_t, 2, Short,         Int)        \
  X(Int32,         8, "int32",         uint32_t, 4, Int,           Int)        \
  X(Int64,         9, "int64",         uint64_t, 8, Long,          Int)        \
  X(UInt8,        10, "uint8",         uint8_t,  1, Byte,          Int)        \
  X(Bool,         11, "bool",          uint8_t,  1, Bool,          Bool)
// clang-format on

namespace fsdpcheck {

enum class DType : int32_t {
#define FSDPCHECK_X(E, CODE, NAME, BITS, SIZE, ST, KIND) k##E = CODE,
  FSDPCHECK_DTYPES(FSDPCHECK_X)
#undef FSDPCHECK_X
};

#define FSDPCHECK_X(E, CODE, NAME, BITS, SIZE, ST, KIND) +1
constexpr int kNumDTypes = 0 FSDPCHECK_DTYPES(FSDPCHECK_X);
#undef FSDPCHECK_X

// How the values of a dtype read: a float (NaN and infinities possible), an integer, or bool.
enum class DTypeKind : int32_t { kFloat, kInt, kBool };

constexpr const char* dtype_kind_name(DTypeKind k) {
  return k == DTypeKind::kFloat ? "float" : k == DTypeKind::kInt ? "int" : "bool";
}

// The table's own consistency: codes fit the launch record's 8 bits, sizes are the storage
// types' (duplicate codes fail to compile in every generated switch).
#define FSDPCHECK_X(E, CODE, NAME, BITS, SIZE, ST, KIND)                                   \
  static_assert((CODE) >= 0 && (CODE) < 256, NAME ": a DType code must fit in 8 bits");   \
  static_assert(sizeof(BITS) == (SIZE), NAME ": Size must be sizeof(Bits)");
FSDPCHECK_DTYPES(FSDPCHECK_X)
#undef FSDPCHECK_X

}  // namespace fsdpcheck
