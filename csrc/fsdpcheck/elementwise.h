// The per-element math of fsdpcheck, shared by the CPU and the CUDA implementation.
//
// Everything that decides an answer lives here: the dtype table, how raw bits become values,
// NaN/Inf classification, the tolerance test, the two difference measures, Fingerprint v1 and
// the combination of partial results. CI has no GPU, so the CPU tests are what exercise this
// file every day; the CUDA kernels must not re-implement any of it.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "fsdpcheck/dtypes.h"

#if defined(__CUDACC__)
#define FSDPCHECK_HD __host__ __device__ __forceinline__
#else
#define FSDPCHECK_HD inline __attribute__((always_inline))
#endif

namespace fsdpcheck {

// The DType enum and the dtype table it comes from: dtypes.h (NOTE: [one dtype table]).

// ---------------------------------------------------------------------------------------------
// Fingerprint v1 (docs/fingerprint-v1.md). A stable format: manifests store these numbers.
// ---------------------------------------------------------------------------------------------
constexpr uint64_t kKeyAdd = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kKeyMul = 0xD6E8FEB86659FD93ULL;

// The murmur3 finalizer on every 32-bit lane of U: uint32_t here and in the CUDA kernels, a GCC
// vector of uint32_t lanes in the CPU's vectorised loops (in place: no vector passed by value).
template <typename U>
FSDPCHECK_HD void fmix32_lanes(U& x) {
  x ^= x >> 16;
  x *= 0x85EBCA6BU;
  x ^= x >> 13;
  x *= 0xC2B2AE35U;
  x ^= x >> 16;
}

FSDPCHECK_HD uint32_t fmix32(uint32_t x) {
  fmix32_lanes(x);
  return x;
}

// key(i) for the element at global row-major linear index i. key(i + d) = key(i) + d * kKeyMul,
// which is how the loops step the key without one 64-bit multiply per element.
FSDPCHECK_HD uint64_t hash_key(uint64_t i) { return (i + kKeyAdd) * kKeyMul; }

// Elements of 1, 2 or 4 bytes: v is the raw bits zero-extended to 32 bits.
FSDPCHECK_HD uint64_t hash_narrow(uint64_t key, uint32_t v) {
  const uint32_t kl = static_cast<uint32_t>(key);
  const uint32_t kh = static_cast<uint32_t>(key >> 32);
  return (static_cast<uint64_t>(fmix32(kh ^ v)) << 32) | fmix32(kl ^ v);
}

// Elements of 8 bytes.
FSDPCHECK_HD uint64_t hash_wide(uint64_t key, uint64_t v) {
  const uint32_t kl = static_cast<uint32_t>(key);
  const uint32_t kh = static_cast<uint32_t>(key >> 32);
  const uint32_t lo = static_cast<uint32_t>(v);
  const uint32_t hi = static_cast<uint32_t>(v >> 32);
  return (static_cast<uint64_t>(fmix32(fmix32(kh ^ hi) ^ lo)) << 32) | fmix32(fmix32(kl ^ lo) ^ hi);
}

// ---------------------------------------------------------------------------------------------
// Raw bits -> value. Decoding from bits (not through compiler float types) keeps CPU and CUDA
// bit-identical and independent of flush-to-zero modes of narrow conversions.
// ---------------------------------------------------------------------------------------------
FSDPCHECK_HD double bits_to_f64(uint64_t b) {
  double d;
  memcpy(&d, &b, sizeof(d));
  return d;
}
FSDPCHECK_HD float bits_to_f32(uint32_t b) {
  float f;
  memcpy(&f, &b, sizeof(f));
  return f;
}

// A small IEEE-like binary float with E exponent bits, M mantissa bits and bias B. E4M3FN has no
// infinities and a single NaN pattern per sign (S.1111.111); the others follow IEEE 754.
template <int E, int M, int B, bool kFN>
FSDPCHECK_HD double minifloat_to_f64(uint32_t bits) {
  const uint32_t mant = bits & ((1u << M) - 1u);
  const uint32_t exp = (bits >> M) & ((1u << E) - 1u);
  const bool neg = (bits >> (E + M)) & 1u;
  constexpr uint32_t kExpMax = (1u << E) - 1u;
  uint64_t out;
  if (kFN) {
    if (exp == kExpMax && mant == (1u << M) - 1u) {
      out = 0x7FF8000000000000ULL;  // NaN
      return bits_to_f64(out | (static_cast<uint64_t>(neg) << 63));
    }
  } else if (exp == kExpMax) {
    out = mant == 0 ? 0x7FF0000000000000ULL : (0x7FF8000000000000ULL | (static_cast<uint64_t>(mant) << (52 - M)));
    return bits_to_f64(out | (static_cast<uint64_t>(neg) << 63));
  }
  double mag;
  if (exp == 0) {
    // Subnormal (or zero): mant * 2^(1 - B - M), exact in float64.
    mag = static_cast<double>(mant) * bits_to_f64(static_cast<uint64_t>(1023 + 1 - B - M) << 52);
  } else {
    mag = bits_to_f64((static_cast<uint64_t>(exp - B + 1023) << 52) | (static_cast<uint64_t>(mant) << (52 - M)));
  }
  return neg ? -mag : mag;
}

// Per-dtype traits: the raw storage type, how to decode, classify and (for integers) read exactly.
template <DType D>
struct Traits;

#define FSDPCHECK_INT_TRAITS(DT, CT, UT)                                              \
  template <>                                                                         \
  struct Traits<DT> {                                                                 \
    using Bits = UT;                                                                  \
    static constexpr bool kInteger = true;                                            \
    FSDPCHECK_HD static int64_t to_i64(Bits b) { return static_cast<CT>(b); }         \
    FSDPCHECK_HD static double to_f64(Bits b) { return static_cast<double>(to_i64(b)); } \
    FSDPCHECK_HD static bool is_nan(Bits) { return false; }                           \
    FSDPCHECK_HD static bool is_inf(Bits) { return false; }                           \
  };
FSDPCHECK_INT_TRAITS(DType::kInt8, int8_t, uint8_t)
FSDPCHECK_INT_TRAITS(DType::kInt16, int16_t, uint16_t)
FSDPCHECK_INT_TRAITS(DType::kInt32, int32_t, uint32_t)
FSDPCHECK_INT_TRAITS(DType::kInt64, int64_t, uint64_t)
FSDPCHECK_INT_TRAITS(DType::kUInt8, uint8_t, uint8_t)
#undef FSDPCHECK_INT_TRAITS

// NOTE: [bool bits] torch stores bool as one byte that is 0 or 1; any other byte value is
// undefined behaviour in torch itself. We hash the raw byte (so a corrupted byte changes the
// fingerprint) but compare truth values, which is what torch.equal sees.
template <>
struct Traits<DType::kBool> {
  using Bits = uint8_t;
  static constexpr bool kInteger = true;
  FSDPCHECK_HD static int64_t to_i64(Bits b) { return b != 0 ? 1 : 0; }
  FSDPCHECK_HD static double to_f64(Bits b) { return b != 0 ? 1.0 : 0.0; }
  FSDPCHECK_HD static bool is_nan(Bits) { return false; }
  FSDPCHECK_HD static bool is_inf(Bits) { return false; }
};

#define FSDPCHECK_FLOAT_CLASSIFY(EXPMASK, MANTMASK)                                   \
  FSDPCHECK_HD static bool is_nan(Bits b) {                                           \
    return (b & (EXPMASK)) == (EXPMASK) && (b & (MANTMASK)) != 0;                     \
  }                                                                                   \
  FSDPCHECK_HD static bool is_inf(Bits b) {                                           \
    return (b & (EXPMASK)) == (EXPMASK) && (b & (MANTMASK)) == 0;                     \
  }                                                                                   \
  FSDPCHECK_HD static int64_t to_i64(Bits) { return 0; }

template <>
struct Traits<DType::kFloat64> {
  using Bits = uint64_t;
  static constexpr bool kInteger = false;
  FSDPCHECK_HD static double to_f64(Bits b) { return bits_to_f64(b); }
  FSDPCHECK_FLOAT_CLASSIFY(0x7FF0000000000000ULL, 0x000FFFFFFFFFFFFFULL)
};
template <>
struct Traits<DType::kFloat32> {
  using Bits = uint32_t;
  static constexpr bool kInteger = false;
  FSDPCHECK_HD static double to_f64(Bits b) { return static_cast<double>(bits_to_f32(b)); }
  FSDPCHECK_FLOAT_CLASSIFY(0x7F800000u, 0x007FFFFFu)
};
template <>
struct Traits<DType::kBFloat16> {
  using Bits = uint16_t;
  static constexpr bool kInteger = false;
  FSDPCHECK_HD static double to_f64(Bits b) {
    return static_cast<double>(bits_to_f32(static_cast<uint32_t>(b) << 16));
  }
  FSDPCHECK_FLOAT_CLASSIFY(0x7F80u, 0x007Fu)
};
template <>
struct Traits<DType::kFloat16> {
  using Bits = uint16_t;
  static constexpr bool kInteger = false;
  FSDPCHECK_HD static double to_f64(Bits b) { return minifloat_to_f64<5, 10, 15, false>(b); }
  FSDPCHECK_FLOAT_CLASSIFY(0x7C00u, 0x03FFu)
};
template <>
struct Traits<DType::kFloat8E5M2> {
  using Bits = uint8_t;
  static constexpr bool kInteger = false;
  FSDPCHECK_HD static double to_f64(Bits b) { return minifloat_to_f64<5, 2, 15, false>(b); }
  FSDPCHECK_FLOAT_CLASSIFY(0x7Cu, 0x03u)
};
template <>
struct Traits<DType::kFloat8E4M3FN> {
  using Bits = uint8_t;
  static constexpr bool kInteger = false;
  FSDPCHECK_HD static double to_f64(Bits b) { return minifloat_to_f64<4, 3, 7, true>(b); }
  FSDPCHECK_HD static bool is_nan(Bits b) { return (b & 0x7Fu) == 0x7Fu; }
  FSDPCHECK_HD static bool is_inf(Bits) { return false; }
  FSDPCHECK_HD static int64_t to_i64(Bits) { return 0; }
};
#undef FSDPCHECK_FLOAT_CLASSIFY

// NOTE: [special words] An element is NaN or infinite exactly when its exponent bits are all
// ones (E4M3FN: when its low 7 bits are; it has no infinity; integers never are). With x the
// exponent field of a lane (masked, in place), x + (that field's lowest bit) reaches the lane's
// top bit exactly when x is all ones, and cannot carry into the next lane (x + lowest <= top
// bit). So for a 32-bit word w of packed elements, special_word<D>(w) = ((w & kMask) + kAdd) &
// kTop is non-zero iff one of its elements is NaN or infinite (8-byte elements: their high
// word). The CUDA vector kernel tests 16 bytes at a time with it; the emulator's self-test holds
// it equal to is_nan || is_inf on every 1- and 2-byte pattern.
template <DType D>
struct SpecialWords {
  static constexpr uint32_t kMask = 0, kAdd = 0, kTop = 0;
};
template <>
struct SpecialWords<DType::kFloat64> {
  static constexpr uint32_t kMask = 0x7FF00000u, kAdd = 0x00100000u, kTop = 0x80000000u;
};
template <>
struct SpecialWords<DType::kFloat32> {
  static constexpr uint32_t kMask = 0x7F800000u, kAdd = 0x00800000u, kTop = 0x80000000u;
};
template <>
struct SpecialWords<DType::kBFloat16> {
  static constexpr uint32_t kMask = 0x7F807F80u, kAdd = 0x00800080u, kTop = 0x80008000u;
};
template <>
struct SpecialWords<DType::kFloat16> {
  static constexpr uint32_t kMask = 0x7C007C00u, kAdd = 0x04000400u, kTop = 0x80008000u;
};
template <>
struct SpecialWords<DType::kFloat8E5M2> {
  static constexpr uint32_t kMask = 0x7C7C7C7Cu, kAdd = 0x04040404u, kTop = 0x80808080u;
};
template <>
struct SpecialWords<DType::kFloat8E4M3FN> {
  static constexpr uint32_t kMask = 0x7F7F7F7Fu, kAdd = 0x01010101u, kTop = 0x80808080u;
};

template <DType D>
FSDPCHECK_HD uint32_t special_word(uint32_t w) {
  using S = SpecialWords<D>;
  return ((w & S::kMask) + S::kAdd) & S::kTop;
}

// Each dtype's Traits against its line of the table: the same storage type, integer exactly
// when the table says Int or Bool, and a float has its SpecialWords (the default, no special
// values, would let the CUDA fast path miss its NaNs and infinities).
#define FSDPCHECK_X(E, CODE, NAME, BITS, SIZE, ST, KIND)                                     \
  static_assert(std::is_same<Traits<DType::k##E>::Bits, BITS>::value,                       \
                NAME ": Traits<D>::Bits is not the storage type of its dtypes.h line");    \
  static_assert(Traits<DType::k##E>::kInteger == (DTypeKind::k##KIND != DTypeKind::kFloat),   \
                NAME ": Traits<D>::kInteger disagrees with the Kind of its dtypes.h line");  \
  static_assert(DTypeKind::k##KIND != DTypeKind::kFloat || SpecialWords<DType::k##E>::kTop != 0, \
                NAME ": a float dtype needs its SpecialWords (NOTE: [special words])");
FSDPCHECK_DTYPES(FSDPCHECK_X)
#undef FSDPCHECK_X

FSDPCHECK_HD int dtype_size(DType d) {
  switch (d) {
#define FSDPCHECK_X(E, CODE, NAME, BITS, SIZE, ST, KIND) \
  case DType::k##E:                                      \
    return SIZE;
    FSDPCHECK_DTYPES(FSDPCHECK_X)
#undef FSDPCHECK_X
  }
  return 1;  // unreachable: plans hold only the codes of the table
}

// Calls f(std::integral_constant-like tag) for a runtime dtype. Used by the generic (mixed-dtype)
// path and by host dispatch.
template <DType D>
struct DTag {
  static constexpr DType value = D;
};

template <typename F>
FSDPCHECK_HD auto visit_dtype(DType d, F&& f) {
  switch (d) {
#define FSDPCHECK_X(E, CODE, NAME, BITS, SIZE, ST, KIND) \
  case DType::k##E:                                      \
    return f(DTag<DType::k##E>{});
    FSDPCHECK_DTYPES(FSDPCHECK_X)
#undef FSDPCHECK_X
  }
  // Unreachable (plans hold only the codes of the table); raw bytes are a safe read.
  return f(DTag<DType::kUInt8>{});
}

// One element, decoded: what the comparison and the statistics need.
struct Value {
  double f;       // the value in float64 (exact for every supported dtype except |int64| > 2^53)
  int64_t i;      // the exact value when `integer`
  bool integer;   // an integer or bool dtype
  bool nan;
  bool inf;
};

template <DType D>
FSDPCHECK_HD Value decode(typename Traits<D>::Bits b) {
  using T = Traits<D>;
  Value v;
  v.f = T::to_f64(b);
  v.i = T::to_i64(b);
  v.integer = T::kInteger;
  v.nan = T::is_nan(b);
  v.inf = T::is_inf(b);
  return v;
}

// One element of type B at p. On the host p may be misaligned (a CPU tensor can be, e.g. from
// torch.frombuffer or a mapped DCP chunk at an odd file offset), so it is read byte-wise, which
// compiles to one plain load; device memory from torch is always element-aligned.
template <typename B>
FSDPCHECK_HD B load_as(const char* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const B*>(p);
#else
  B v;
  __builtin_memcpy(&v, p, sizeof(B));
  return v;
#endif
}

// Raw bits of one element at p, zero-extended; the hash of that element at `key`.
FSDPCHECK_HD uint64_t load_bits(const void* p, int size) {
  const char* c = static_cast<const char*>(p);
  switch (size) {
    case 8:
      return load_as<uint64_t>(c);
    case 4:
      return load_as<uint32_t>(c);
    case 2:
      return load_as<uint16_t>(c);
    default:
      return load_as<uint8_t>(c);
  }
}
FSDPCHECK_HD uint64_t hash_bits(uint64_t key, uint64_t bits, int size) {
  return size == 8 ? hash_wide(key, bits) : hash_narrow(key, static_cast<uint32_t>(bits));
}

FSDPCHECK_HD Value decode_dynamic(DType d, uint64_t bits) {
  return visit_dtype(d, [bits](auto tag) {
    constexpr DType D = decltype(tag)::value;
    using B = typename Traits<D>::Bits;
    return decode<D>(static_cast<B>(bits));
  });
}

// ---------------------------------------------------------------------------------------------
// The comparison of one pair of elements (docs/kernel-api.md, Semantics).
// ---------------------------------------------------------------------------------------------
struct CompareParams {
  double rtol;
  double atol;
  bool equal_nan;
};

struct ElementResult {
  bool mismatch;
  bool has_diff;  // neither side is NaN: abs/rel are defined and take part in the maxima
  double abs_diff;
  double rel_diff;
};

FSDPCHECK_HD double f64_inf() { return bits_to_f64(0x7FF0000000000000ULL); }
FSDPCHECK_HD double f64_abs(double x) { return x < 0 ? -x : x; }

// NOTE: [no contraction] `atol + rtol * |e|` rounded once (a fused multiply-add) or twice (a
// multiply, then an add) can differ in the last bit, and so can the decision: |4 - 3| against
// 0.1 + 0.3 * 3 is a mismatch rounded twice (0.9999999999999999) and a match fused (1.0). nvcc
// fuses by default, g++ does on aarch64 and on x86-64 wherever FMA instructions are enabled.
// So device code multiplies and adds with the round-to-nearest intrinsics, which are never
// fused, and host code is compiled with -ffp-contract=off (CMakeLists.txt): every backend and
// compiler rounds twice.
FSDPCHECK_HD double mul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
FSDPCHECK_HD double add_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

// NOTE: [mismatch rule] Mismatch is NOT (|a - e| <= atol + rtol * |e|), in float64, with:
//   - NaN on exactly one side: mismatch; NaN on both: a match iff equal_nan. No differences.
//   - equal values (including equal infinities and 0.0 vs -0.0): a match, both differences 0.
//   - an infinity against anything else: a mismatch whatever the tolerance.
//   - two integers: the difference is exact (int64 values past 2^53 stay distinct).
// The relative difference is |a - e| / |e|, and +inf when e is 0 or infinite and a != e.
FSDPCHECK_HD ElementResult compare_values(const Value& a, const Value& e, const CompareParams& p) {
  ElementResult r;
  if (a.nan || e.nan) {
    r.mismatch = !(a.nan && e.nan && p.equal_nan);
    r.has_diff = false;
    r.abs_diff = 0.0;
    r.rel_diff = 0.0;
    return r;
  }
  r.has_diff = true;
  double diff;
  bool equal;
  if (a.integer && e.integer) {
    equal = a.i == e.i;
    // |a - e| computed in uint64 cannot overflow; its float64 rounding is >= 1 when a != e.
    const uint64_t ua = static_cast<uint64_t>(a.i), ue = static_cast<uint64_t>(e.i);
    diff = static_cast<double>(a.i >= e.i ? ua - ue : ue - ua);
  } else {
    equal = a.f == e.f;
    diff = f64_abs(a.f - e.f);
  }
  const double mag = f64_abs(e.f);
  if (equal) {
    r.mismatch = false;
    r.abs_diff = 0.0;
    r.rel_diff = 0.0;
    return r;
  }
  r.abs_diff = a.inf || e.inf ? f64_inf() : diff;
  r.rel_diff = (mag == 0.0 || e.inf) ? f64_inf() : r.abs_diff / mag;
  r.mismatch = a.inf || e.inf || !(r.abs_diff <= add_rn(p.atol, mul_rn(p.rtol, mag)));
  return r;
}

// ---------------------------------------------------------------------------------------------
// Partial results of a chunk (and, combined, of a tensor). Also the output row layout.
// ---------------------------------------------------------------------------------------------
struct Partial {
  int64_t mismatched;
  int64_t nan_a;
  int64_t nan_e;
  int64_t inf_a;
  int64_t inf_e;
  int64_t zeros;
  uint64_t fp_a;
  uint64_t fp_e;
  double max_abs;       // -1 when no element had a defined difference
  int64_t max_abs_idx;  // global linear index, -1 when none
  double max_rel;
  int64_t max_rel_idx;
  double sum;
  double sumsq;
};
constexpr int kPartialWords = 14;
static_assert(sizeof(Partial) == kPartialWords * 8, "Partial must be 14 words: it is the output row");

FSDPCHECK_HD void partial_init(Partial& p) {
  p.mismatched = p.nan_a = p.nan_e = p.inf_a = p.inf_e = p.zeros = 0;
  p.fp_a = p.fp_e = 0;
  p.max_abs = -1.0;
  p.max_abs_idx = -1;
  p.max_rel = -1.0;
  p.max_rel_idx = -1;
  p.sum = 0.0;
  p.sumsq = 0.0;
}

// Greater value wins; ties go to the smaller global index. Commutative and associative, so the
// maxima and their indices do not depend on how work was split.
FSDPCHECK_HD void take_max(double& v, int64_t& idx, double cv, int64_t cidx) {
  if (cv > v || (cv == v && cidx >= 0 && (idx < 0 || cidx < idx))) {
    v = cv;
    idx = cidx;
  }
}

FSDPCHECK_HD void partial_combine(Partial& x, const Partial& y) {
  x.mismatched += y.mismatched;
  x.nan_a += y.nan_a;
  x.nan_e += y.nan_e;
  x.inf_a += y.inf_a;
  x.inf_e += y.inf_e;
  x.zeros += y.zeros;
  x.fp_a += y.fp_a;
  x.fp_e += y.fp_e;
  take_max(x.max_abs, x.max_abs_idx, y.max_abs, y.max_abs_idx);
  take_max(x.max_rel, x.max_rel_idx, y.max_rel, y.max_rel_idx);
  x.sum += y.sum;
  x.sumsq += y.sumsq;
}

// NOTE: [tally] A thread's running result before it is folded into a chunk's Partial: the same
// fields with 32-bit counters (a thread sees at most kChunk elements of a chunk, so they cannot
// overflow), which the per-element functions below accept as well as a Partial (they are
// templates on the accumulator). The CUDA kernels keep one per thread for the elements that
// leave their bit-equal fast path.
struct Tally {
  uint64_t fp_a;
  uint64_t fp_e;
  double max_abs;
  int64_t max_abs_idx;
  double max_rel;
  int64_t max_rel_idx;
  double sum;
  double sumsq;
  uint32_t mismatched;
  uint32_t nan_a;
  uint32_t nan_e;
  uint32_t inf_a;
  uint32_t inf_e;
  uint32_t zeros;
};

FSDPCHECK_HD void tally_init(Tally& t) {
  t.mismatched = t.nan_a = t.nan_e = t.inf_a = t.inf_e = t.zeros = 0;
  t.fp_a = t.fp_e = 0;
  t.max_abs = -1.0;
  t.max_abs_idx = -1;
  t.max_rel = -1.0;
  t.max_rel_idx = -1;
  t.sum = 0.0;
  t.sumsq = 0.0;
}

// x gains a thread's tally: its 32-bit counters are widened into the 64-bit totals.
FSDPCHECK_HD void partial_add(Partial& x, const Tally& y) {
  x.mismatched += y.mismatched;
  x.nan_a += y.nan_a;
  x.nan_e += y.nan_e;
  x.inf_a += y.inf_a;
  x.inf_e += y.inf_e;
  x.zeros += y.zeros;
  x.fp_a += y.fp_a;
  x.fp_e += y.fp_e;
  take_max(x.max_abs, x.max_abs_idx, y.max_abs, y.max_abs_idx);
  take_max(x.max_rel, x.max_rel_idx, y.max_rel, y.max_rel_idx);
  x.sum += y.sum;
  x.sumsq += y.sumsq;
}

// The statistics of `actual` (zeros, sum, sum of squares) gain one element of value f.
template <typename Acc>
FSDPCHECK_HD void accumulate_stats(Acc& acc, double f) {
  acc.zeros += f == 0.0;
  acc.sum = add_rn(acc.sum, f);
  acc.sumsq = add_rn(acc.sumsq, mul_rn(f, f));
}

struct Options {
  CompareParams cmp;
  bool fingerprints;
  bool stats;
  bool counts = true;  // NaN and Inf counts (false: a fingerprint alone is wanted)
};

// The whole treatment of one element pair at global index g (key = hash_key(g)). This is the
// reference path: the CUDA kernels call it for every element, the CPU uses it for blocks whose
// bits differ and for mixed dtypes.
template <typename Acc>
FSDPCHECK_HD void accumulate_pair(Acc& acc, const Value& a, const Value& e, uint64_t bits_a,
                                  int size_a, uint64_t bits_e, int size_e, int64_t g, uint64_t key,
                                  const Options& o) {
  if (o.fingerprints) {
    acc.fp_a += hash_bits(key, bits_a, size_a);
    acc.fp_e += hash_bits(key, bits_e, size_e);
  }
  acc.nan_a += a.nan;
  acc.nan_e += e.nan;
  acc.inf_a += a.inf;
  acc.inf_e += e.inf;
  if (o.stats) accumulate_stats(acc, a.f);
  const ElementResult r = compare_values(a, e, o.cmp);
  acc.mismatched += r.mismatch;
  if (r.has_diff) {
    take_max(acc.max_abs, acc.max_abs_idx, r.abs_diff, g);
    take_max(acc.max_rel, acc.max_rel_idx, r.rel_diff, g);
  }
}

// One side only (fingerprint, and counts and statistics when asked, of a single tensor).
template <typename Acc>
FSDPCHECK_HD void accumulate_single(Acc& acc, const Value& a, uint64_t bits_a, int size_a,
                                    uint64_t key, const Options& o) {
  if (o.fingerprints) acc.fp_a += hash_bits(key, bits_a, size_a);
  if (o.counts) {
    acc.nan_a += a.nan;
    acc.inf_a += a.inf;
  }
  if (o.stats) accumulate_stats(acc, a.f);
}

// ---------------------------------------------------------------------------------------------
// Index spaces of one input, after coalescing (host: plan.cpp; device: a copy in shared memory).
// ---------------------------------------------------------------------------------------------

// After coalescing, more dims than this cannot be described (it takes a tensor whose every dim is
// both sliced and non-contiguous; none of FSDP2/TP/DCP produce such a thing).
constexpr int kMaxDims = 8;

// NOTE: [chunks] Every tensor is cut into chunks of kChunk local elements (local row-major order).
// A chunk is the unit of parallel work on both backends and the unit of the first reduction
// phase. Because the cut depends only on the tensor, every result (float sums included) is the
// same whatever the number of threads, blocks or launches.
constexpr int64_t kChunk = int64_t{1} << 16;

// One input (pair) with its index spaces coalesced. Local element with multi-index j (over the
// coalesced dims) lives at a + sum(j[d] * stride_a[d]) elements, e + sum(j[d] * stride_e[d])
// elements, and has global linear index gbase + sum(j[d] * gstride[d]). Local row-major order is
// increasing global index order (a box preserves order), which the maxima's tie rule relies on.
struct TensorPlan {
  const char* a;
  const char* e;  // nullptr: single-tensor mode
  int64_t numel;
  int64_t gbase;
  DType dtype_a;
  DType dtype_e;
  int32_t ndim;
  int32_t pad_;
  int64_t size[kMaxDims];
  int64_t stride_a[kMaxDims];
  int64_t stride_e[kMaxDims];
  int64_t gstride[kMaxDims];
};

FSDPCHECK_HD int64_t plan_chunks(const TensorPlan& p) { return (p.numel + kChunk - 1) / kChunk; }

// Memory offsets (in elements) and global linear index of local linear index l.
struct Location {
  int64_t off_a;
  int64_t off_e;
  int64_t g;
};

FSDPCHECK_HD Location locate(const TensorPlan& p, int64_t l) {
  Location loc{0, 0, p.gbase};
  for (int d = p.ndim - 1; d >= 0; --d) {
    const int64_t j = d == 0 ? l : l % p.size[d];
    l = d == 0 ? 0 : l / p.size[d];
    loc.off_a += j * p.stride_a[d];
    loc.off_e += j * p.stride_e[d];
    loc.g += j * p.gstride[d];
  }
  return loc;
}

// NOTE: [chunk-relative indexing] Decomposing a 64-bit linear index costs a 64-bit division per
// dim, which GPUs emulate in ~100 instructions. Within a chunk an element is at most kChunk past
// the chunk's first element, so each chunk's start is decomposed once (ChunkStart) and every
// element is placed by adding its offset to those digits with carries, in 32-bit arithmetic
// whenever every inner dim is below 2**31 (then digit + carry < 2**32).
struct ChunkStart {
  int64_t digit[kMaxDims];
  bool narrow;  // every inner dim < 2**31: 32-bit digit arithmetic is exact
};

FSDPCHECK_HD ChunkStart chunk_start(const TensorPlan& p, int64_t l0) {
  ChunkStart c;
  c.narrow = true;
  for (int d = p.ndim - 1; d >= 0; --d) {
    c.digit[d] = d == 0 ? l0 : l0 % p.size[d];
    l0 = d == 0 ? 0 : l0 / p.size[d];
    if (d > 0 && p.size[d] >= (int64_t{1} << 31)) c.narrow = false;
  }
  return c;
}

// The location of local element l0 + off, 0 <= off < kChunk (same answer as locate).
FSDPCHECK_HD Location locate_in_chunk(const TensorPlan& p, const ChunkStart& c, int64_t off) {
  Location loc{0, 0, p.gbase};
  uint64_t carry = static_cast<uint64_t>(off);
  for (int d = p.ndim - 1; d >= 0; --d) {
    int64_t j;
    if (d == 0) {
      j = c.digit[0] + static_cast<int64_t>(carry);
    } else if (c.narrow) {
      const uint32_t v = static_cast<uint32_t>(c.digit[d]) + static_cast<uint32_t>(carry);
      const uint32_t s = static_cast<uint32_t>(p.size[d]);
      j = v % s;
      carry = v / s;
    } else {
      const uint64_t v = static_cast<uint64_t>(c.digit[d]) + carry;
      const uint64_t s = static_cast<uint64_t>(p.size[d]);
      j = static_cast<int64_t>(v % s);
      carry = v / s;
    }
    loc.off_a += j * p.stride_a[d];
    loc.off_e += j * p.stride_e[d];
    loc.g += j * p.gstride[d];
  }
  return loc;
}

// A pair whose raw bits are equal: the same result as accumulate_pair, cheaper. One hash serves
// both sides; only NaN (with equal_nan off) can mismatch; the difference is 0 unless NaN.
template <DType D, typename Acc>
FSDPCHECK_HD void accumulate_equal(Acc& acc, typename Traits<D>::Bits b, int64_t g,
                                   uint64_t key, const Options& o) {
  using T = Traits<D>;
  if (o.fingerprints) {
    const uint64_t h = hash_bits(key, b, sizeof(b));
    acc.fp_a += h;
    acc.fp_e += h;
  }
  const bool nan = T::is_nan(b);
  const bool inf = T::is_inf(b);
  acc.nan_a += nan;
  acc.nan_e += nan;
  acc.inf_a += inf;
  acc.inf_e += inf;
  acc.mismatched += nan && !o.cmp.equal_nan;
  if (!nan) {
    take_max(acc.max_abs, acc.max_abs_idx, 0.0, g);
    take_max(acc.max_rel, acc.max_rel_idx, 0.0, g);
  }
  if (o.stats) accumulate_stats(acc, T::to_f64(b));
}

// One element of a same-dtype input (pair, or single when !kHasE): the per-element path of the
// CUDA kernels and of the CPU scalar reference.
template <DType D, bool kHasE, typename Acc>
FSDPCHECK_HD void accumulate_element(Acc& acc, typename Traits<D>::Bits ba,
                                     typename Traits<D>::Bits be, int64_t g, uint64_t key,
                                     const Options& o) {
  constexpr int kSize = sizeof(ba);
  if (!kHasE) {
    accumulate_single(acc, decode<D>(ba), ba, kSize, key, o);
  } else if (ba == be) {
    accumulate_equal<D>(acc, ba, g, key, o);
  } else {
    accumulate_pair(acc, decode<D>(ba), decode<D>(be), ba, kSize, be, kSize, g, key, o);
  }
}

// One element of a pair of different dtypes, read from byte pointers.
FSDPCHECK_HD void accumulate_mixed(Partial& acc, const TensorPlan& p, const Location& loc,
                                   const Options& o) {
  const int size_a = dtype_size(p.dtype_a);
  const int size_e = dtype_size(p.dtype_e);
  const uint64_t ba = load_bits(p.a + loc.off_a * size_a, size_a);
  const uint64_t be = load_bits(p.e + loc.off_e * size_e, size_e);
  accumulate_pair(acc, decode_dynamic(p.dtype_a, ba), decode_dynamic(p.dtype_e, be), ba, size_a,
                  be, size_e, loc.g, hash_key(static_cast<uint64_t>(loc.g)), o);
}

}  // namespace fsdpcheck
