// The emulated CUDA kernels against the scalar path, in a plain C++ program (no torch), so that it
// can be built with ThreadSanitizer and UBSan (scripts/check_emulator.sh). Every path of the
// kernels runs: vectorised with a tail and two chunks, scalar 1-D (an element-aligned input that
// is not 16-byte aligned), strided 1-D, a 2-D box, mixed dtypes, an empty input, single-tensor
// mode with both outputs. Exits 1 naming the first row that differs.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <random>
#include <string>
#include <vector>

#include "cuda/launch.h"
#include "emulator/emulator.h"
#include "fsdpcheck/scalar.h"

namespace {

using namespace fsdpcheck;

// Bytes whose start is 64-byte aligned plus `shift`, filled with random bits (every pattern:
// NaN, Inf, subnormals, negative zero), and a copy with a few elements replaced.
struct Pair {
  std::vector<char> a_bytes, e_bytes;
  const char* a;
  const char* e;
};

Pair make_pair(int64_t elements, int size, size_t shift, std::mt19937_64& rng) {
  Pair p;
  const size_t n = static_cast<size_t>(elements) * static_cast<size_t>(size);
  p.a_bytes.resize(n + 128);
  p.e_bytes.resize(n + 128);
  auto start = [shift](std::vector<char>& v) {
    const uintptr_t addr = reinterpret_cast<uintptr_t>(v.data());
    return v.data() + ((64 - addr % 64) % 64) + shift;
  };
  char* a = start(p.a_bytes);
  char* e = start(p.e_bytes);
  for (size_t i = 0; i < n; ++i) a[i] = static_cast<char>(rng());
  std::memcpy(e, a, n);
  for (int k = 0; k < 5 && elements > 0; ++k) {
    const size_t at = static_cast<size_t>(rng() % static_cast<uint64_t>(elements));
    for (int b = 0; b < size; ++b) e[at * size + b] = static_cast<char>(rng());
  }
  p.a = a;
  p.e = e;
  return p;
}

// A pair of `elements` finite values (no NaN or infinity, so that most 16-byte vectors take the
// kernels' bit-equal fast path), equal but for a few elements: a different value, a NaN on one
// side, -0.0 against 0.0 (size 2: bfloat16 bits; size 8: float64 bits).
Pair make_clean_pair(int64_t elements, int size, std::mt19937_64& rng) {
  Pair p = make_pair(elements, size, 0, rng);
  char* a = const_cast<char*>(p.a);
  char* e = const_cast<char*>(p.e);
  const int top = size - 1;  // the byte holding the sign and the high exponent bits
  for (int64_t i = 0; i < elements; ++i) a[i * size + top] &= 0x3F;  // exponent well below all ones
  std::memcpy(e, a, static_cast<size_t>(elements * size));
  const int64_t at[] = {3, elements / 2, elements - 1};
  e[at[0] * size] ^= 1;  // a different value
  e[at[1] * size + top] |= 0x7F;  // NaN (bfloat16) or a huge value (float64)
  e[at[1] * size + top - 1] |= static_cast<char>(0xF0);
  std::memset(a + at[2] * size, 0, static_cast<size_t>(size));  // 0.0 against -0.0
  std::memset(e + at[2] * size, 0, static_cast<size_t>(size));
  e[at[2] * size + top] = static_cast<char>(0x80);
  return p;
}

TensorPlan plan_of(const char* a, const char* e, DType da, DType de, std::vector<int64_t> size,
                   std::vector<int64_t> stride_a, std::vector<int64_t> stride_e,
                   std::vector<int64_t> gstride, int64_t gbase) {
  TensorPlan p{};
  p.a = a;
  p.e = e;
  p.dtype_a = da;
  p.dtype_e = de;
  p.gbase = gbase;
  p.ndim = static_cast<int32_t>(size.size());
  p.numel = 1;
  for (int d = 0; d < p.ndim; ++d) {
    p.size[d] = size[d];
    p.stride_a[d] = stride_a[d];
    p.stride_e[d] = stride_e[d];
    p.gstride[d] = gstride[d];
    p.numel *= size[d];
  }
  return p;
}

std::vector<Partial> scalar_rows(const std::vector<TensorPlan>& plans, const Options& o) {
  std::vector<Partial> rows(plans.size());
  for (size_t t = 0; t < plans.size(); ++t) {
    partial_init(rows[t]);
    for (int64_t c = 0; c < plan_chunks(plans[t]); ++c) {
      Partial part;
      process_chunk_scalar(plans[t], c, o, part);
      partial_combine(rows[t], part);
    }
  }
  return rows;
}

bool same_sum(double x, double y) {
  if (std::isnan(x) || std::isnan(y)) return std::isnan(x) && std::isnan(y);
  if (std::isinf(x) || std::isinf(y)) return x == y;
  return std::fabs(x - y) <= 1e-9 * std::fmax(std::fabs(x), std::fabs(y)) + 1e-300;
}

// The emulated rows of one call, with grids of at most `blocks` blocks.
std::vector<Partial> emulated_rows(const std::vector<TensorPlan>& plans, const Options& o,
                                   int64_t blocks) {
  const cuda::LaunchPlan launch = cuda::plan_launches(plans, blocks, blocks);
  const int64_t n = static_cast<int64_t>(plans.size());
  std::vector<Partial> partials(static_cast<size_t>(std::max<int64_t>(launch.meta[n], 1)));
  std::vector<Partial> rows(plans.size());
  cuda::LaunchArgs args;
  args.meta = launch.meta.data();
  args.n = static_cast<int>(n);
  args.total_chunks = launch.meta[n];
  args.options = o;
  args.has_expected = true;
  args.partials = partials.data();
  args.rows = rows.data();
  args.fingerprints = nullptr;
  args.launches = launch.launches.data();
  args.n_launches = static_cast<int>(launch.launches.size());
  cuda::emulate_compare(args);
  return rows;
}

// NOTE: [launches]: every word of every row, float sums included, is the same whatever the grids.
bool check_grids_agree(const std::vector<TensorPlan>& plans, const Options& o) {
  const std::vector<Partial> one = emulated_rows(plans, o, 1);
  for (const int64_t blocks : {2, 5}) {
    const std::vector<Partial> other = emulated_rows(plans, o, blocks);
    if (std::memcmp(one.data(), other.data(), one.size() * sizeof(Partial)) != 0) {
      std::fprintf(stderr, "emulator self-test: rows with grids of 1 and %lld blocks differ\n",
                   static_cast<long long>(blocks));
      return false;
    }
  }
  std::printf("emulator self-test: rows bit-identical (sums included) with grids of 1, 2, 5 "
              "blocks\n");
  return true;
}

// The emulated rows of one call against the scalar path, with grids of at most `blocks` blocks;
// false (and a message) on a difference. Single-tensor mode is the fingerprint alone: only the
// fingerprints are compared.
bool check_launch(const char* what, const std::vector<TensorPlan>& plans, const Options& o,
                  bool single, int64_t blocks) {
  const cuda::LaunchPlan launch = cuda::plan_launches(plans, blocks, blocks);
  const std::vector<int64_t>& meta = launch.meta;
  const int64_t n = static_cast<int64_t>(plans.size());
  std::vector<Partial> partials(static_cast<size_t>(std::max<int64_t>(meta[n], 1)));
  std::vector<Partial> rows(plans.size());
  std::vector<int64_t> fingerprints(plans.size(), 0);
  cuda::LaunchArgs args;
  args.meta = meta.data();
  args.n = static_cast<int>(n);
  args.total_chunks = meta[n];
  args.options = o;
  args.has_expected = !single;
  args.partials = partials.data();
  args.rows = rows.data();
  args.fingerprints = single ? fingerprints.data() : nullptr;
  args.launches = launch.launches.data();
  args.n_launches = static_cast<int>(launch.launches.size());
  cuda::emulate_compare(args);

  std::vector<TensorPlan> scalar_plans = plans;
  if (single) {
    for (TensorPlan& p : scalar_plans) p.e = nullptr;
  }
  const std::vector<Partial> want = scalar_rows(scalar_plans, o);
  for (size_t t = 0; t < plans.size(); ++t) {
    const Partial& x = rows[t];
    const Partial& y = want[t];
    const bool exact = single ? x.fp_a == y.fp_a :
        x.mismatched == y.mismatched && x.nan_a == y.nan_a && x.nan_e == y.nan_e &&
        x.inf_a == y.inf_a && x.inf_e == y.inf_e && x.zeros == y.zeros && x.fp_a == y.fp_a &&
        x.fp_e == y.fp_e && x.max_abs_idx == y.max_abs_idx && x.max_rel_idx == y.max_rel_idx &&
        std::memcmp(&x.max_abs, &y.max_abs, 8) == 0 && std::memcmp(&x.max_rel, &y.max_rel, 8) == 0;
    const bool fp_out = !single || static_cast<uint64_t>(fingerprints[t]) == x.fp_a;
    const bool sums = single || (same_sum(x.sum, y.sum) && same_sum(x.sumsq, y.sumsq));
    if (!exact || !fp_out || !sums) {
      std::fprintf(stderr,
                   "emulator self-test: %s, tensor %zu: emulated rows differ from the scalar "
                   "path (mismatched %lld vs %lld, fingerprint %llx vs %llx, max_abs_index %lld "
                   "vs %lld)\n",
                   what, t, static_cast<long long>(x.mismatched),
                   static_cast<long long>(y.mismatched), static_cast<unsigned long long>(x.fp_a),
                   static_cast<unsigned long long>(y.fp_a), static_cast<long long>(x.max_abs_idx),
                   static_cast<long long>(y.max_abs_idx));
      return false;
    }
  }
  std::printf("emulator self-test: %s: %zu tensors, %lld chunks, %zu launches of at most %lld "
              "blocks, rows equal to the scalar path\n",
              what, plans.size(), static_cast<long long>(meta[n]), launch.launches.size(),
              static_cast<long long>(blocks));
  return true;
}

// NOTE: [special words] (elementwise.h): the word test equals is_nan || is_inf on every pattern
// of the 1- and 2-byte dtypes (each lane position of a word, the other lanes finite), and on
// float32 and float64 around their exponent fields.
template <DType D>
bool check_special_words() {
  using T = Traits<D>;
  using B = typename T::Bits;
  constexpr int kBits = 8 * sizeof(B);
  auto bad = [](uint64_t bits, bool got) {
    std::fprintf(stderr, "emulator self-test: special_word disagrees with is_nan/is_inf on dtype "
                 "%d, bits %llx (%d)\n", static_cast<int>(D), static_cast<unsigned long long>(bits),
                 got);
    return false;
  };
  if constexpr (kBits <= 16) {
    for (uint32_t b = 0; b < (1u << kBits); ++b) {
      const bool want = T::is_nan(static_cast<B>(b)) || T::is_inf(static_cast<B>(b));
      for (int lane = 0; lane < 32 / kBits; ++lane) {
        const uint32_t w = b << (lane * kBits);  // the other lanes zero (finite)
        if ((special_word<D>(w) != 0) != want) return bad(b, !want);
      }
    }
  } else {
    std::mt19937_64 rng(11);
    for (int i = 0; i < (1 << 20); ++i) {
      uint64_t bits = rng();
      if (i % 2 == 0) bits |= kBits == 32 ? 0x7F800000ULL : 0x7FF0000000000000ULL;  // near specials
      const B b = static_cast<B>(bits);
      const bool want = T::is_nan(b) || T::is_inf(b);
      const uint32_t high = static_cast<uint32_t>(static_cast<uint64_t>(b) >> (kBits - 32));
      if ((special_word<D>(high) != 0) != want) return bad(b, !want);
    }
  }
  return true;
}

}  // namespace

int run() {
  // Every dtype of the table (those without special values: the word test must say none).
#define FSDPCHECK_X(E, CODE, NAME, BITS, SIZE, ST, KIND) && check_special_words<DType::k##E>()
  const bool words = true FSDPCHECK_DTYPES(FSDPCHECK_X);
#undef FSDPCHECK_X
  if (!words) return 1;
  std::printf("emulator self-test: the special-value word test agrees with is_nan/is_inf\n");
  std::mt19937_64 rng(7);
  const int64_t big = kChunk + 37;  // two chunks; the vectorised path, then a tail
  const Pair f32 = make_pair(big, 4, 0, rng);
  const Pair bf16 = make_pair(1000, 2, 2, rng);   // element-aligned, not 16-byte aligned
  const Pair f32_8 = make_pair(100, 4, 8, rng);   // 8-byte aligned, not 16
  const Pair i64 = make_pair(3 * 777, 8, 0, rng);  // read with stride 3
  const Pair f64 = make_pair(50 * 64, 8, 0, rng);  // a 20 x 30 box of 50 x 64
  const Pair f16 = make_pair(300, 2, 0, rng);
  const Pair u8 = make_pair(33, 1, 0, rng);
  std::vector<TensorPlan> plans = {
      plan_of(f32.a, f32.e, DType::kFloat32, DType::kFloat32, {big}, {1}, {1}, {1}, 5),
      plan_of(bf16.a, bf16.e, DType::kBFloat16, DType::kBFloat16, {1000}, {1}, {1}, {1}, 0),
      plan_of(f32_8.a, f32_8.e, DType::kFloat32, DType::kFloat32, {100}, {1}, {1}, {1}, 0),
      plan_of(i64.a, i64.e, DType::kInt64, DType::kInt64, {777}, {3}, {1}, {1}, 1 << 20),
      plan_of(f64.a + 8 * (7 * 64 + 11), f64.e + 8 * (7 * 64 + 11), DType::kFloat64,
              DType::kFloat64, {20, 30}, {64, 1}, {64, 1}, {64, 1}, 7 * 64 + 11),
      plan_of(f32.a, f16.e, DType::kFloat32, DType::kFloat16, {300}, {1}, {1}, {1}, 0),
      plan_of(u8.a, u8.e, DType::kUInt8, DType::kUInt8, {0}, {1}, {1}, {1}, 0),
      plan_of(u8.a, u8.e, DType::kUInt8, DType::kUInt8, {33}, {1}, {1}, {1}, 0),
  };
  // Mostly bit-equal data: the vector kernels' fast path, several chunks and tensors per launch
  // (bfloat16: 3 chunks and a tail, then 2 more tensors; float64: one chunk, global stride 2).
  const int64_t clean_n = 3 * kChunk + 5;
  const Pair clean = make_clean_pair(clean_n, 2, rng);
  const Pair clean_small = make_clean_pair(4100, 2, rng);
  const Pair clean64 = make_clean_pair(9000, 8, rng);
  plans.push_back(plan_of(clean.a, clean.e, DType::kBFloat16, DType::kBFloat16, {clean_n}, {1},
                          {1}, {1}, 3));
  plans.push_back(plan_of(clean_small.a, clean_small.e, DType::kBFloat16, DType::kBFloat16, {4100},
                          {1}, {1}, {1}, 0));
  plans.push_back(plan_of(clean.a, clean.e, DType::kBFloat16, DType::kBFloat16, {kChunk}, {1},
                          {1}, {1}, kChunk));
  plans.push_back(plan_of(clean64.a, clean64.e, DType::kFloat64, DType::kFloat64, {9000}, {1},
                          {1}, {2}, 1));
  bool ok = true;
  // The same rows whatever the grids (NOTE: [launches]): one block for everything, two, seven.
  for (const int64_t blocks : {1, 2, 7}) {
    ok = ok && check_launch("compare", plans, Options{CompareParams{1e-3, 0.0, true}, true, true},
                            false, blocks);
  }
  ok = ok && check_grids_agree(plans, Options{CompareParams{1e-3, 0.0, true}, true, true});
  ok = ok && check_launch("compare without fingerprints",
                          {plans[0], plans[4], plans[8], plans[11]},
                          Options{CompareParams{0.3, 0.1, false}, false, false}, false, 2);
  ok = ok && check_launch("compare, fingerprints without statistics", plans,
                          Options{CompareParams{0.0, 0.0, false}, true, false}, false, 3);
  ok = ok && check_launch("compare, statistics without fingerprints", plans,
                          Options{CompareParams{0.0, 0.0, true}, false, true}, false, 3);
  for (const int64_t blocks : {1, 3}) {
    ok = ok && check_launch("fingerprint", plans,
                            Options{CompareParams{0.0, 0.0, true}, true, false, false}, true,
                            blocks);
  }
  return ok ? 0 : 1;
}

int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "emulator self-test: %s\n", e.what());
    return 1;
  }
}
