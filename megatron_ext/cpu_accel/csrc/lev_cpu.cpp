// LEV modes on CPU: t [h, n, d], Delta [h, d, kappa, r] -> M [n, h, r], and its backward
// (lev/cpu_fused.py). Both directions read t, and backward writes dL/dt, through their head and
// id strides (rows of d contiguous: lev/kernels.py hands the [h, n, d] view of an [n, h, d]
// tensor), and both add the 1 of the coefficients 1 + Delta themselves (into a per-thread
// buffer: one head's table in forward, one (head, coordinate) table in backward), so the caller
// makes no transposed copy of t or dL/dt and no coefficient tensor.
//
// The CPU twin of lev/triton_kernel.py: per (head, id) the d spline values of each rank
// component are evaluated from the three non-zero quadratic B-spline basis values of their
// coordinate and multiplied into the mode at once, so no [h, d, n, kappa] basis or
// [h, d, n, r] spline tensor ever exists. Plain C++ (no torch headers: compiles in about a
// second), called through ctypes with raw pointers and strides.
//
// The product is docs/lev.md step 3e, M = sign * exp(sum_d log(|phi| + eps)), evaluated as the
// product of the signed factors x = phi -/+ eps split into mantissas and exponents (see
// `split` below and lev/kernels.py "The signed product"): no log or exp per factor, and no
// partial product can overflow or underflow.
//
// Backward, with s = dL/dM * M (computed by the caller): dL/dphi = s / x, dL/dDelta[l, c, j] =
// sum_i B_j(t[l, i, c]) dL/dphi, dL/dt through the basis values (and their normalisation), and
// through the sigmoid t = sigmoid(y) of step 3b: the kernel returns dL/dy = dL/dt * t * (1 - t).
// It runs one (head, coordinate) per task so that each task owns its rows of dL/dDelta.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

namespace {

// The quadratic B-spline basis (lev/fused.py _basis_parts). A value t in [0, 1] (a sigmoid) sits
// at s = t * (kappa - 1) near knot c = round(s), f = s - c in [-1/2, 1/2]; knots c - 1, c, c + 1
// carry w0 = (1/2 - f)^2 / 2, w1 = 3/4 - f^2, w2 = (1/2 + f)^2 / 2, a knot outside [0, kappa)
// being dropped (value and slope 0).
template <typename T>
inline T nearest_knot(T t, T last, int32_t& c) {
  const T s = t * last;
  // round(s) = floor(s + 1/2), by truncation of a non-negative value. The clamp keeps memory
  // accesses in range and makes a NaN s a finite knot (f, and so every value, stays NaN).
  const T up = s + T(0.5);
  c = static_cast<int32_t>(std::min(std::max(T(0), up), last));
  return s - static_cast<T>(c);
}

// The three basis values at f (normalised to sum 1 if asked: only a dropped knot makes their
// sum differ from 1), their slopes dw_j/ds and their sum before normalising.
template <typename T>
inline void basis_values(T f, bool keep0, bool keep2, bool normalize, T& v0, T& v1, T& v2,
                         T& d0, T& d1, T& d2, T& total) {
  const T hm = static_cast<T>(0.5) - f, hp = static_cast<T>(0.5) + f;
  const T w0 = keep0 ? static_cast<T>(0.5) * hm * hm : T(0);
  const T w1 = static_cast<T>(0.75) - f * f;
  const T w2 = keep2 ? static_cast<T>(0.5) * hp * hp : T(0);
  total = normalize ? w0 + w1 + w2 : T(1);
  v0 = w0 / total;
  v1 = w1 / total;
  v2 = w2 / total;
  d0 = keep0 ? -hm : T(0);
  d1 = static_cast<T>(-2) * f;
  d2 = keep2 ? hp : T(0);
}

// The basis of a run of values (the forward's d coordinates of one (head, id)), in per-thread
// buffers reused by every task: knot indices (a dropped knot's index is c, its value 0) and
// values.
template <typename T>
struct BasisRun {
  std::vector<int32_t> k0, k1, k2;
  std::vector<T> v0, v1, v2;
  explicit BasisRun(int64_t m) : k0(m), k1(m), k2(m), v0(m), v1(m), v2(m) {}

  void eval(const T* __restrict t, int64_t m, int64_t kappa, bool normalize) {
    const T last = static_cast<T>(kappa - 1);
    int32_t* __restrict i0 = k0.data();
    int32_t* __restrict i1 = k1.data();
    int32_t* __restrict i2 = k2.data();
    T* __restrict a0 = v0.data();
    T* __restrict a1 = v1.data();
    T* __restrict a2 = v2.data();
#pragma omp simd
    for (int64_t q = 0; q < m; ++q) {
      int32_t c;
      const T f = nearest_knot(t[q], last, c);
      const bool keep0 = c >= 1, keep2 = c <= kappa - 2;
      T d0, d1, d2, total;
      basis_values(f, keep0, keep2, normalize, a0[q], a1[q], a2[q], d0, d1, d2, total);
      i0[q] = keep0 ? c - 1 : c;
      i1[q] = c;
      i2[q] = keep2 ? c + 1 : c;
    }
  }
};

// The basis values, slopes and sums of a run of ids (the backward's edge buckets, in bucket
// order), in per-thread buffers reused by every task.
template <typename T>
struct BasisScratch {
  std::vector<T> v0, v1, v2, d0, d1, d2, total;
  explicit BasisScratch(int64_t m) : v0(m), v1(m), v2(m), d0(m), d1(m), d2(m), total(m) {}
};

// The separable product (lev/kernels.py "The signed product", the same in every backend):
// every factor x = phi -/+ eps is split as m * 2^e with 1/2 <= |m| < 1; the mantissas are
// multiplied in the compute dtype, renormalised every kGroup factors, and the integer
// exponents summed, so no partial product can overflow or underflow whatever the factors and
// eps; the result m * 2^E is rounded once (std::ldexp), to inf or 0 only when the exact
// product is out of range. A factor with phi == 0 is eps itself, split in double by the caller
// (so an eps below the compute dtype's range still counts exactly).
constexpr int kGroup = 64;  // |product of 65 mantissas| >= 2^-65: normal in float and double

template <typename T>
struct FloatBits;
template <>
struct FloatBits<float> {
  using U = uint32_t;
  static constexpr int kMant = 23, kExpMax = 0xff, kBias = 127;
};
template <>
struct FloatBits<double> {
  using U = uint64_t;
  static constexpr int kMant = 52, kExpMax = 0x7ff, kBias = 1023;
};

// frexp by bit manipulation (vectorises): x = m * 2^e with 1/2 <= |m| < 1 for finite non-zero
// x (subnormals too, unless kNormal promises there are none); 0, inf and NaN give m = x, e = 0.
template <typename T, bool kNormal = false>
inline T split(T x, int32_t& e) {
  using F = FloatBits<T>;
  using U = typename F::U;
  U bits;
  std::memcpy(&bits, &x, sizeof(T));
  bool sub = false;
  if (!kNormal) {
    sub = ((bits >> F::kMant) & U(F::kExpMax)) == 0 && x != T(0);
    x = sub ? x * static_cast<T>(18446744073709551616.0) : x;  // * 2^64: normal
    std::memcpy(&bits, &x, sizeof(T));
  }
  const int32_t ex = static_cast<int32_t>((bits >> F::kMant) & U(F::kExpMax));
  const bool normal = ex != 0 && ex != F::kExpMax;
  e = normal ? ex - (F::kBias - 1) - (sub ? 64 : 0) : 0;
  const U mask = U(F::kExpMax) << F::kMant;
  bits = normal ? (bits & ~mask) | (U(F::kBias - 1) << F::kMant) : bits;
  std::memcpy(&x, &bits, sizeof(T));
  return x;
}

template <typename T>
inline void renormalise(T* __restrict a, int32_t* __restrict e, int64_t r) {
#pragma omp simd
  for (int64_t rho = 0; rho < r; ++rho) {
    int32_t ex;
    a[rho] = split<T, true>(a[rho], ex);  // |a| >= 2^-65
    e[rho] += ex;
  }
}

// A std::vector on 64-byte (cache line) boundaries: the coefficient rows are read with full
// vector loads, and a row split across two cache lines costs a second load.
template <typename T>
struct CacheAligned {
  using value_type = T;
  CacheAligned() = default;
  template <typename U>
  CacheAligned(const CacheAligned<U>&) {}
  T* allocate(std::size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const CacheAligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheAligned<U>&) const { return false; }
};
template <typename T>
using AlignedVector = std::vector<T, CacheAligned<T>>;

// coeff = 1 + delta, rounded as torch's `1 + Delta` (the coefficients of docs/lev.md step 3d).
template <typename T>
inline void add_one(const T* __restrict delta, T* __restrict coeff, int64_t m) {
#pragma omp simd
  for (int64_t k = 0; k < m; ++k) coeff[k] = T(1) + delta[k];
}

// Vectors of kBytes bytes (GCC/Clang vector extensions), for loops whose lanes must stay in
// registers across iterations: Vec<T, kBytes> of T, and IntVec<T, kBytes> of T's bits (int32
// lanes for float, int64 for double). 32 bytes are AVX registers on x86, pairs of NEON
// registers on ARM; the forward's product loop and the backward's bucket loop use the widest
// the target has, kWideBytes (64 with AVX-512: forward 13.8 against 16.7 ms for 893 ids of
// r = 64, backward 62.5 against 69.4 ms for 2365 ids, one thread).
#if defined(__AVX512F__)
constexpr int kWideBytes = 64;
#else
constexpr int kWideBytes = 32;
#endif
template <typename T, int kBytes>
struct VecOf;
template <int kBytes>
struct VecOf<float, kBytes> {
  typedef float type __attribute__((vector_size(kBytes)));
  typedef int32_t bits __attribute__((vector_size(kBytes)));
};
template <int kBytes>
struct VecOf<double, kBytes> {
  typedef double type __attribute__((vector_size(kBytes)));
  typedef int64_t bits __attribute__((vector_size(kBytes)));
};
template <typename T, int kBytes = 32>
using Vec = typename VecOf<T, kBytes>::type;
template <typename T, int kBytes = 32>
using IntVec = typename VecOf<T, kBytes>::bits;

template <typename T, int kBytes = 32>
inline Vec<T, kBytes> load(const T* p) {
  Vec<T, kBytes> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename T, int kBytes = 32>
inline void store(T* p, Vec<T, kBytes> v) {
  std::memcpy(p, &v, sizeof(v));
}

// The sum of a vector's lanes as a balanced tree (depth log2 of the lanes, not a serial chain).
// A vector wider than 32 bytes first adds its halves as vectors (the tree's first level):
// summing 16 float lanes through memory cost the backward 25 of its 87 ms at 2365 ids.
template <typename T, int kBytes = 32>
inline T lane_sum(Vec<T, kBytes> v) {
  if constexpr (kBytes > 32) {
    Vec<T, kBytes / 2> lo, hi;
    std::memcpy(&lo, &v, sizeof(lo));
    std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
    return lane_sum<T, kBytes / 2>(lo + hi);
  } else {
    constexpr int n = sizeof(Vec<T, kBytes>) / sizeof(T);
    T part[n];
    std::memcpy(part, &v, sizeof(v));
    for (int width = n / 2; width > 0; width /= 2)
      for (int q = 0; q < width; ++q) part[q] += part[q + width];
    return part[0];
  }
}

// `split<T, true>` on every lane: x = m * 2^e with 1/2 <= |m| < 1 for normal x; inf and NaN
// give m = x, e = 0 (no lane may be subnormal or 0).
template <typename T, int kBytes>
inline Vec<T, kBytes> split_normal(Vec<T, kBytes> x, IntVec<T, kBytes>& e) {
  using F = FloatBits<T>;
  using I = IntVec<T, kBytes>;
  using S = typename F::U;
  I bits;
  std::memcpy(&bits, &x, sizeof(x));
  const I ex = (bits >> F::kMant) & F::kExpMax;
  const I finite = ex != F::kExpMax;  // every lane all ones or all zeros
  e = (ex - (F::kBias - 1)) & finite;
  const auto mask = static_cast<S>(F::kExpMax) << F::kMant;
  const I mantissa = (bits & static_cast<S>(~mask)) | (static_cast<S>(F::kBias - 1) << F::kMant);
  bits = (mantissa & finite) | (bits & ~finite);
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// out[q] = std::ldexp(m[q], e[q]) for every lane: the result's exponent is written into m's bits
// where m and the result are normal numbers (exact, so the same value); the other lanes (m 0,
// subnormal, inf or NaN; a result that would be subnormal or overflow) go through std::ldexp.
template <typename T, int kBytes>
inline void store_ldexp(T* __restrict out, Vec<T, kBytes> m, IntVec<T, kBytes> e) {
  using F = FloatBits<T>;
  using I = IntVec<T, kBytes>;
  using S = typename F::U;
  constexpr int kLanes = sizeof(Vec<T, kBytes>) / sizeof(T);
  I bits;
  std::memcpy(&bits, &m, sizeof(bits));
  const I field = (bits >> F::kMant) & F::kExpMax;
  const I usable = (field != 0) & (field != F::kExpMax);  // m normal
  I own;
  const Vec<T, kBytes> mant = split_normal<T, kBytes>(m, own);
  std::memcpy(&bits, &mant, sizeof(bits));
  const I biased = e + own + (F::kBias - 1);  // the result's exponent field
  const I normal = usable & (biased >= 1) & (biased <= F::kExpMax - 1);
  const auto mask = static_cast<S>(F::kExpMax) << F::kMant;
  bits = (bits & static_cast<S>(~mask)) | (biased << F::kMant);
  std::memcpy(out, &bits, sizeof(bits));
  for (int q = 0; q < kLanes; ++q)
    if (!normal[q]) out[q] = std::ldexp(m[q], static_cast<int>(e[q]));
}

// The forward's fast path. A factor's split only keeps partial products in range; where the
// factors of a head are known to lie in eps <= |x| <= bound, `group` of them can be multiplied
// into a running mantissa (in [1/2, 1]) directly, and the mantissa split once per group, with no
// partial product leaving T's normal range. A float product's rounding does not depend on a
// power-of-two scale while it stays normal, so this gives the per-factor path's result bit for
// bit. `safe_group` is that count (0: bound not finite, or fewer than 2 fit).
template <typename T>
int64_t safe_group(T eps, T max_coeff) {
  // |phi| <= max |1 + Delta| (basis values are >= 0 and sum to at most 1); doubled for the
  // rounding of phi and of phi +/- eps.
  const double bound = 2.0 * static_cast<double>(max_coeff) + static_cast<double>(eps);
  if (!(bound <= static_cast<double>(std::numeric_limits<T>::max()))) return 0;
  const double lo = std::ceil(-std::log2(static_cast<double>(eps)));  // |x| >= 2^-lo
  const double hi = std::ceil(std::log2(bound));                       // |x| <= 2^hi
  // 2^-1 * 2^(-lo*G) must stay normal (>= 2^(min_exponent - 1)); 2^(hi*G) below 2^(max - 1).
  double group = kGroup;
  if (lo > 0) group = std::min(group, std::floor(-std::numeric_limits<T>::min_exponent / lo));
  if (hi > 0)
    group = std::min(group, std::floor((std::numeric_limits<T>::max_exponent - 2) / hi));
  return group >= 2 ? static_cast<int64_t>(group) : 0;
}

// max |coeff| over m values, or inf when one is NaN (then `safe_group` is 0).
template <typename T>
T max_abs(const T* __restrict coeff, int64_t m) {
  T top = 0;
  bool nan = false;
#pragma omp simd reduction(max : top) reduction(|| : nan)
  for (int64_t k = 0; k < m; ++k) {
    top = std::max(top, std::abs(coeff[k]));
    nan = nan || coeff[k] != coeff[k];
  }
  return nan ? std::numeric_limits<T>::infinity() : top;
}

// One (head, id) of the forward by the fast path: two vectors of kBytes of rank components at a
// time, their running mantissas and exponents in registers across the d coordinates. table is
// the head's [d, kappa, r] coefficients; r a multiple of the vector width.
template <typename T, int kBytes>
void modes_grouped(const T* __restrict table, const BasisRun<T>& basis, int64_t d,
                   int64_t kappa, int64_t r, T eps, int64_t group, T* __restrict out) {
  using V = Vec<T, kBytes>;
  using I = IntVec<T, kBytes>;
  constexpr int64_t kLanes = sizeof(V) / sizeof(T);
  for (int64_t rho = 0; rho < r; rho += 2 * kLanes) {
    const bool two = rho + kLanes < r;
    V a0 = V{} + T(1), a1 = a0;
    I e0 = {}, e1 = {}, e;
    int64_t since_split = 0;
    for (int64_t c = 0; c < d; ++c) {
      const T* row = table + c * kappa * r + rho;
      const T* __restrict c0 = row + basis.k0[c] * r;
      const T* __restrict c1 = row + basis.k1[c] * r;
      const T* __restrict c2 = row + basis.k2[c] * r;
      const T v0 = basis.v0[c], v1 = basis.v1[c], v2 = basis.v2[c];
      V phi = v0 * load<T, kBytes>(c0) + v1 * load<T, kBytes>(c1) + v2 * load<T, kBytes>(c2);
      a0 *= phi < T(0) ? phi - eps : phi + eps;
      if (two) {
        phi = v0 * load<T, kBytes>(c0 + kLanes) + v1 * load<T, kBytes>(c1 + kLanes) +
              v2 * load<T, kBytes>(c2 + kLanes);
        a1 *= phi < T(0) ? phi - eps : phi + eps;
      }
      if (++since_split == group) {
        a0 = split_normal<T, kBytes>(a0, e);
        e0 += e;
        a1 = split_normal<T, kBytes>(a1, e);
        e1 += e;
        since_split = 0;
      }
    }
    store_ldexp<T, kBytes>(out + rho, a0, e0);
    if (two) store_ldexp<T, kBytes>(out + rho + kLanes, a1, e1);
  }
}

// kEpsNormal: eps is a normal number of T, so every factor |x| >= eps is normal (or inf/NaN),
// and x = +eps at phi == 0 splits into eps's own (rounded) mantissa and exponent: the general
// path's subnormal scaling and phi == 0 selection are then no-ops, skipped.
template <typename T, bool kEpsNormal>
void forward(const T* __restrict t, int64_t t_stride_h, int64_t t_stride_n,
             const T* __restrict delta, T* __restrict modes, int64_t h, int64_t n, int64_t d,
             int64_t kappa, int64_t r, bool normalize, double eps, double eps_mant,
             int32_t eps_exp, int threads) {
  const T eps_t = static_cast<T>(eps);
  const T eps_m = static_cast<T>(eps_mant);
  const int64_t head_size = d * kappa * r;
  // The fast path's vector width: the widest that divides r.
  constexpr int64_t kWide = kWideBytes / sizeof(T), kNarrow = 32 / sizeof(T);
  const int64_t lanes = !kEpsNormal ? 0 : r % kWide == 0 ? kWide : r % kNarrow == 0 ? kNarrow : 0;
#pragma omp parallel num_threads(threads)
  {
    std::vector<T> acc(r);
    std::vector<int32_t> expo(r);
    BasisRun<T> basis(d);
    // 1 + Delta of one head, rebuilt when a thread's (contiguous, static) run of tasks enters
    // the next head: at most h + threads - 1 builds per call.
    AlignedVector<T> coeff(head_size);
    int64_t coeff_head = -1;
    // The fast path's group size for the current head (0: the per-factor path).
    int64_t group = 0;
#pragma omp for schedule(static)
    for (int64_t task = 0; task < h * n; ++task) {
      const int64_t l = task / n, i = task % n;
      if (l != coeff_head) {
        add_one(delta + l * head_size, coeff.data(), head_size);
        coeff_head = l;
        if (lanes > 0) group = safe_group<T>(eps_t, max_abs(coeff.data(), head_size));
      }
      basis.eval(t + l * t_stride_h + i * t_stride_n, d, kappa, normalize);
      if (group > 0) {
        T* out = modes + (i * h + l) * r;
        if (lanes == kWide)
          modes_grouped<T, kWideBytes>(coeff.data(), basis, d, kappa, r, eps_t, group, out);
        else
          modes_grouped<T, 32>(coeff.data(), basis, d, kappa, r, eps_t, group, out);
        continue;
      }
      T* __restrict a = acc.data();
      int32_t* __restrict ex = expo.data();
      for (int64_t rho = 0; rho < r; ++rho) {
        a[rho] = T(1);
        ex[rho] = 0;
      }
      for (int64_t c = 0; c < d; ++c) {
        const T* table = coeff.data() + c * kappa * r;
        const T* __restrict c0 = table + basis.k0[c] * r;
        const T* __restrict c1 = table + basis.k1[c] * r;
        const T* __restrict c2 = table + basis.k2[c] * r;
        const T v0 = basis.v0[c], v1 = basis.v1[c], v2 = basis.v2[c];
#pragma omp simd
        for (int64_t rho = 0; rho < r; ++rho) {
          const T phi = v0 * c0[rho] + v1 * c1[rho] + v2 * c2[rho];
          int32_t e;
          const T m = split<T, kEpsNormal>(phi < T(0) ? phi - eps_t : phi + eps_t, e);
          if (kEpsNormal) {
            a[rho] *= m;
            ex[rho] += e;
          } else {
            const bool zero = phi == T(0);
            a[rho] *= zero ? eps_m : m;
            ex[rho] += zero ? eps_exp : e;
          }
        }
        if ((c + 1) % kGroup == 0) renormalise(a, ex, r);
      }
      T* out = modes + (i * h + l) * r;
      for (int64_t rho = 0; rho < r; ++rho) out[rho] = std::ldexp(a[rho], ex[rho]);
    }
  }
}

template <typename T>
void forward(const T* t, int64_t t_stride_h, int64_t t_stride_n, const T* delta, T* modes,
             int64_t h, int64_t n, int64_t d, int64_t kappa, int64_t r, bool normalize,
             double eps, double eps_mant, int32_t eps_exp, int threads) {
  const bool eps_normal = eps >= static_cast<double>(std::numeric_limits<T>::min()) &&
                          eps <= static_cast<double>(std::numeric_limits<T>::max());
  if (eps_normal) {
    forward<T, true>(t, t_stride_h, t_stride_n, delta, modes, h, n, d, kappa, r, normalize,
                     eps, eps_mant, eps_exp, threads);
  } else {
    forward<T, false>(t, t_stride_h, t_stride_n, delta, modes, h, n, d, kappa, r, normalize,
                      eps, eps_mant, eps_exp, threads);
  }
}

// The three coefficient rows that a bucket of ids reads (knots k0, k1, k2) and the rows of
// dL/dDelta that it adds into.
template <typename T>
struct BucketRows {
  const T* c0;
  const T* c1;
  const T* c2;
  T* g0;
  T* g1;
  T* g2;
};

// One bucket of the backward (ids order[q0:q1], basis values sv*[q]), kNV vectors of kBytes of
// rank components at a time: the three coefficient rows and the three sums into dL/dDelta stay
// in registers across the bucket's ids. Each id's dL/dB_j is kept in vector lanes (lanes[q],
// 3 vectors, summed by the caller), added to chunk by chunk in rank order, as one pass over r
// would add them.
template <typename T, int kNV, int kBytes>
void bucket_vector(const BucketRows<T>& rows, const int32_t* __restrict order,
                   const T* __restrict sv0, const T* __restrict sv1, const T* __restrict sv2,
                   int64_t q0, int64_t q1, const T* __restrict scaled, int64_t s_stride_n,
                   T eps, int64_t r, T* __restrict lanes) {
  using V = Vec<T, kBytes>;
  constexpr int64_t kLanes = sizeof(V) / sizeof(T);
  for (int64_t rho = 0; rho < r; rho += kNV * kLanes) {
    V x0[kNV], x1[kNV], x2[kNV], s0[kNV], s1[kNV], s2[kNV];
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) {
      x0[v] = load<T, kBytes>(rows.c0 + rho + v * kLanes);
      x1[v] = load<T, kBytes>(rows.c1 + rho + v * kLanes);
      x2[v] = load<T, kBytes>(rows.c2 + rho + v * kLanes);
      s0[v] = s1[v] = s2[v] = V{};
    }
    for (int64_t q = q0; q < q1; ++q) {
      const T* __restrict srow = scaled + order[q] * s_stride_n + rho;
      T* __restrict a = lanes + 3 * kLanes * q;
      const T v0 = sv0[q], v1 = sv1[q], v2 = sv2[q];
      V a0 = {}, a1 = {}, a2 = {};  // dL/dB_j
      if (rho > 0) {
        a0 = load<T, kBytes>(a);
        a1 = load<T, kBytes>(a + kLanes);
        a2 = load<T, kBytes>(a + 2 * kLanes);
      }
#pragma GCC unroll 4
      for (int v = 0; v < kNV; ++v) {
        const V phi = v0 * x0[v] + v1 * x1[v] + v2 * x2[v];
        const V g = load<T, kBytes>(srow + v * kLanes) / (phi < T(0) ? phi - eps : phi + eps);
        a0 += g * x0[v];
        a1 += g * x1[v];
        a2 += g * x2[v];
        s0[v] += v0 * g;
        s1[v] += v1 * g;
        s2[v] += v2 * g;
      }
      store<T, kBytes>(a, a0);
      store<T, kBytes>(a + kLanes, a1);
      store<T, kBytes>(a + 2 * kLanes, a2);
    }
    // One row after the other: a dropped knot's row is the middle one.
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) {
      const int64_t at = rho + v * kLanes;
      store<T, kBytes>(rows.g0 + at, load<T, kBytes>(rows.g0 + at) + s0[v]);
      store<T, kBytes>(rows.g1 + at, load<T, kBytes>(rows.g1 + at) + s1[v]);
      store<T, kBytes>(rows.g2 + at, load<T, kBytes>(rows.g2 + at) + s2[v]);
    }
  }
}

// One interior bucket (knot b, 1 <= b <= kappa - 2) of the backward. None of its three knots is
// dropped, so the basis values are the quadratics w_j(f) of f = s - b (w0 = (1/2 - f)^2 / 2,
// w1 = 3/4 - f^2, w2 = (1/2 + f)^2 / 2), which sum to 1 (normalising changes nothing). With x_j
// the three coefficient rows, C = (x0 + x2) / 2 - x1, B = (x2 - x0) / 2 and A = x1 + C / 4:
//   phi      = A + f (B + C f)
//   dL/ds    = sum over the r components of g (B + 2 C f) = P + 2 f Q,  P = g.B, Q = g.C
//   dL/dx_j  = sum over the bucket's ids of w_j(f) g, from S0 = sum g, S1 = sum f g and
//              S2 = sum f^2 g.
// That is six multiply-adds and one add per factor instead of `bucket_vector`'s nine
// multiply-adds, which bound the loop (910 ids of r = 64, 2 threads: the backward took 11.7 ms
// with `bucket_vector` for every bucket, 8.9 ms with this; dropping the division would save
// about 1.3 ms more).
template <typename T, int kNV, int kBytes>
void bucket_interior(const BucketRows<T>& rows, const int32_t* __restrict order,
                     const T* __restrict sf, int64_t q0, int64_t q1, const T* __restrict scaled,
                     int64_t s_stride_n, T eps, int64_t r, T* __restrict lanes) {
  using V = Vec<T, kBytes>;
  constexpr int64_t kLanes = sizeof(V) / sizeof(T);
  for (int64_t rho = 0; rho < r; rho += kNV * kLanes) {
    V pa[kNV], pb[kNV], pc[kNV], s0[kNV], s1[kNV], s2[kNV];
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) {
      const V x0 = load<T, kBytes>(rows.c0 + rho + v * kLanes);
      const V x1 = load<T, kBytes>(rows.c1 + rho + v * kLanes);
      const V x2 = load<T, kBytes>(rows.c2 + rho + v * kLanes);
      // Each sum below has at most one product that can round, so where the compiler fuses a
      // multiply and an add cannot change the result (vector and one-lane paths agree bit for
      // bit, subnormals included).
      pc[v] = T(0.5) * (x0 + x2) - x1;
      pa[v] = x1 + T(0.25) * pc[v];
      pb[v] = T(0.5) * (x2 - x0);
      s0[v] = s1[v] = s2[v] = V{};
    }
    for (int64_t q = q0; q < q1; ++q) {
      const T* __restrict srow = scaled + order[q] * s_stride_n + rho;
      T* __restrict a = lanes + 3 * kLanes * q;
      const T f = sf[q], f2 = f * f;
      V p = {}, c = {};
      if (rho > 0) {
        p = load<T, kBytes>(a);
        c = load<T, kBytes>(a + kLanes);
      }
#pragma GCC unroll 4
      for (int v = 0; v < kNV; ++v) {
        const V phi = pa[v] + f * (pb[v] + f * pc[v]);
        const V g = load<T, kBytes>(srow + v * kLanes) / (phi < T(0) ? phi - eps : phi + eps);
        p += g * pb[v];
        c += g * pc[v];
        s0[v] += g;
        s1[v] += f * g;
        s2[v] += f2 * g;
      }
      store<T, kBytes>(a, p);
      store<T, kBytes>(a + kLanes, c);
    }
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) {
      const int64_t at = rho + v * kLanes;
      // w0 = (1 - 4f + 4f^2) / 8, w1 = 3/4 - f^2, w2 = (1 + 4f + 4f^2) / 8.
      const V even = s0[v] + T(4) * s2[v];
      const V e0 = even - T(4) * s1[v], e2 = even + T(4) * s1[v];
      store<T, kBytes>(rows.g0 + at, load<T, kBytes>(rows.g0 + at) + T(0.125) * e0);
      store<T, kBytes>(rows.g1 + at, load<T, kBytes>(rows.g1 + at) + (T(0.75) * s0[v] - s2[v]));
      store<T, kBytes>(rows.g2 + at, load<T, kBytes>(rows.g2 + at) + T(0.125) * e2);
    }
  }
}

// The buckets of one (head, coordinate) task, each through `bucket_interior` or (the two edge
// knots, where a knot is dropped) `bucket_vector`, and dL/ds of each id into grad_s (by id).
// table and gtable are the task's [kappa, r] coefficients and dL/dDelta; scaled the head's [n, r]
// rows; the ids order[start[b]:start[b + 1]] are those nearest knot b, sf[q] the f = s - b of
// the q-th; `edge` holds an edge bucket's basis (by q).
template <typename T, int kNV, int kBytes>
void task_buckets(const T* table, T* gtable, const int64_t* __restrict start,
                  const int32_t* __restrict order, const T* __restrict sf, int64_t kappa,
                  const T* scaled, int64_t s_stride_n, T eps, int64_t r, bool normalize,
                  T* lanes, BasisScratch<T>& edge, T* __restrict grad_s) {
  constexpr int64_t kLanes = sizeof(Vec<T, kBytes>) / sizeof(T);
  for (int64_t b = 0; b < kappa; ++b) {
    const int64_t q0 = start[b], q1 = start[b + 1];
    if (q0 == q1) continue;
    // The knots b - 1, b, b + 1; a dropped one shares its row with b and has value 0.
    const bool keep0 = b >= 1, keep2 = b <= kappa - 2;
    const int64_t k0 = keep0 ? b - 1 : b, k2 = keep2 ? b + 1 : b;
    const BucketRows<T> rows{table + k0 * r,  table + b * r,  table + k2 * r,
                             gtable + k0 * r, gtable + b * r, gtable + k2 * r};
    if (keep0 && keep2) {
      bucket_interior<T, kNV, kBytes>(rows, order, sf, q0, q1, scaled, s_stride_n, eps, r,
                                      lanes);
      for (int64_t q = q0; q < q1; ++q) {
        const T* a = lanes + 3 * kLanes * q;
        grad_s[order[q]] = lane_sum<T, kBytes>(load<T, kBytes>(a)) +
                           T(2) * sf[q] * lane_sum<T, kBytes>(load<T, kBytes>(a + kLanes));
      }
      continue;
    }
    for (int64_t q = q0; q < q1; ++q)
      basis_values(sf[q], keep0, keep2, normalize, edge.v0[q], edge.v1[q], edge.v2[q],
                   edge.d0[q], edge.d1[q], edge.d2[q], edge.total[q]);
    bucket_vector<T, kNV, kBytes>(rows, order, edge.v0.data(), edge.v1.data(), edge.v2.data(),
                                  q0, q1, scaled, s_stride_n, eps, r, lanes);
    for (int64_t q = q0; q < q1; ++q) {
      const T* a = lanes + 3 * kLanes * q;
      const T g0 = lane_sum<T, kBytes>(load<T, kBytes>(a));
      const T g1 = lane_sum<T, kBytes>(load<T, kBytes>(a + kLanes));
      const T g2 = lane_sum<T, kBytes>(load<T, kBytes>(a + 2 * kLanes));
      const T d0 = edge.d0[q], d1 = edge.d1[q], d2 = edge.d2[q];
      T gs = g0 * d0 + g1 * d1 + g2 * d2;
      if (normalize) {
        // B_j = w_j / W:  dB_j/ds = (w'_j - B_j W') / W.
        const T gv = g0 * edge.v0[q] + g1 * edge.v1[q] + g2 * edge.v2[q];
        gs = (gs - (d0 + d1 + d2) * gv) / edge.total[q];
      }
      grad_s[order[q]] = gs;
    }
  }
}

// t [h, n, d] and grad_t [h, n, d] are read and written through their head and id strides
// (coordinates contiguous; lev/kernels.py hands views of [n, h, d] tensors). Task (l, c) needs
// the n values t[l, :, c] as one run: a thread gathers them for a block of kBlock coordinates
// (one cache line per id) at once, and scatters dL/dt the same way when it leaves the block.
// Gathering one value per line instead (a stride of h*d values: at h*d = 1024 floats every
// such line maps to the same cache set) took this backward from 70 to 88 ms at 2000 ids, one
// thread; contiguous [h, d, n] rows made by torch transpose copies cost 95 ms in all. scaled
// is [h, n, r] through its strides too (rows of r contiguous); with an [h, n, r] layout the d
// tasks of a head stream one contiguous block.
//
// Within a task the ids are taken bucket by bucket of their nearest knot (a counting sort):
// every id of a bucket reads the same three coefficient rows and adds into the same three rows
// of dL/dDelta, so those stay in registers across the bucket (2365 ids, one thread: 72 ->
// 62.5 ms with the 512-bit bucket loop; 69 ms with 256-bit vectors), and an interior bucket's
// spline values are one quadratic in each id's f (`bucket_interior`).
template <typename T>
void backward(const T* __restrict t, int64_t t_stride_h, int64_t t_stride_n,
              const T* __restrict delta, const T* __restrict scaled, int64_t s_stride_h,
              int64_t s_stride_n, T* __restrict grad_delta, T* __restrict grad_t,
              int64_t g_stride_h, int64_t g_stride_n, int64_t h, int64_t n, int64_t d,
              int64_t kappa, int64_t r, bool normalize, double eps, int threads) {
  const T eps_t = static_cast<T>(eps);
  const T last = static_cast<T>(kappa - 1);  // ds/dt
  constexpr int64_t kBlock = 64 / sizeof(T);
  constexpr int64_t kAhead = 16;  // ids ahead that the strided gather and scatter prefetch
  const int64_t blocks_per_head = (d + kBlock - 1) / kBlock;
  // The bucket loop's vectors: the widest that divides r (two at a time where they fit), else
  // one-lane vectors: one rank component at a time, the same operations lane by lane.
  constexpr int64_t kWide = kWideBytes / sizeof(T), kNarrow = 32 / sizeof(T);
  const int64_t lanes_per_id = r % kWide == 0 ? kWide : r % kNarrow == 0 ? kNarrow : 1;
  const auto buckets = r % (2 * kWide) == 0    ? task_buckets<T, 2, kWideBytes>
                       : lanes_per_id == kWide ? task_buckets<T, 1, kWideBytes>
                       : lanes_per_id == kNarrow ? task_buckets<T, 1, 32>
                                                 : task_buckets<T, 1, sizeof(T)>;
#pragma omp parallel num_threads(threads)
  {
    std::vector<T> grad_s(n), sf(n), f_of(n);
    BasisScratch<T> edge(n);
    std::vector<int32_t> order(n), knot(n);
    std::vector<int64_t> start(kappa + 1), cursor(kappa);
    AlignedVector<T> lanes(3 * lanes_per_id * n);
    AlignedVector<T> coeff(kappa * r);
    // t and dL/dt of kBlock coordinates of one head for all n ids, [kBlock, n]: gathered and
    // scattered a cache line (kBlock coordinates of one id) at a time, not one value per line.
    std::vector<T> t_block(kBlock * n), g_block(kBlock * n);
    int64_t block = -1, done_lo = 0, done_hi = 0;  // loaded block; coordinates computed in it
    auto flush = [&]() {
      if (block < 0 || done_hi <= done_lo) return;
      const int64_t l = block / blocks_per_head, c0 = (block % blocks_per_head) * kBlock;
      T* out = grad_t + l * g_stride_h + c0;
      for (int64_t i = 0; i < n; ++i) {
        if (i + kAhead < n) __builtin_prefetch(out + (i + kAhead) * g_stride_n + done_lo, 1);
        for (int64_t j = done_lo; j < done_hi; ++j) out[i * g_stride_n + j] = g_block[j * n + i];
      }
    };
#pragma omp for schedule(static)
    for (int64_t task = 0; task < h * d; ++task) {
      const int64_t l = task / d, c = task % d;
      const int64_t this_block = l * blocks_per_head + c / kBlock, cj = c % kBlock;
      if (this_block != block) {
        flush();
        block = this_block;
        const int64_t c0 = c - cj, width = std::min(kBlock, d - c0);
        const T* in = t + l * t_stride_h + c0;
        for (int64_t i = 0; i < n; ++i) {
          if (i + kAhead < n) __builtin_prefetch(in + (i + kAhead) * t_stride_n);
          for (int64_t q = 0; q < width; ++q) t_block[q * n + i] = in[i * t_stride_n + q];
        }
        done_lo = cj;
      }
      done_hi = cj + 1;
      add_one(delta + task * kappa * r, coeff.data(), kappa * r);
      const T* table = coeff.data();
      T* gtable = grad_delta + task * kappa * r;  // dL/d(1 + Delta) = dL/dDelta
      for (int64_t k = 0; k < kappa * r; ++k) gtable[k] = 0;
      // Each id's nearest knot and f, then the ids bucket by bucket of their knot (a counting
      // sort; within a bucket in id order).
      const T* __restrict tb = t_block.data() + cj * n;
      int32_t* __restrict kn = knot.data();
      T* __restrict fo = f_of.data();
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) fo[i] = nearest_knot(tb[i], last, kn[i]);
      std::fill(start.begin(), start.end(), 0);
      for (int64_t i = 0; i < n; ++i) ++start[kn[i] + 1];
      for (int64_t k = 0; k < kappa; ++k) start[k + 1] += start[k];
      std::copy(start.begin(), start.end() - 1, cursor.begin());
      for (int64_t i = 0; i < n; ++i) {
        const int64_t q = cursor[kn[i]]++;
        order[q] = static_cast<int32_t>(i);
        sf[q] = fo[i];
      }
      buckets(table, gtable, start.data(), order.data(), sf.data(), kappa,
              scaled + l * s_stride_h, s_stride_n, eps_t, r, normalize, lanes.data(), edge,
              grad_s.data());
      T* __restrict gt = g_block.data() + cj * n;
      const T* __restrict gs = grad_s.data();
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const T tv = tb[i];
        gt[i] = gs[i] * last * (tv * (T(1) - tv));  // dL/dy, t = sigmoid(y)
      }
    }
    flush();
  }
}

// Step 3b without the sigmoid (`LEVBackend.seed_norm`): y = LayerNorm(u) * gain + shift for
// each (id, head) row of d values, u and y [n, h, d] contiguous, gain and shift [h, d] (the
// LayerNorm's weight and bias over the temperature). One pass over u per row instead of torch's
// separate LayerNorm and affine passes. The row statistics are two-pass (mean, then the mean
// square of the centred values, as torch's layer_norm), rstd = 1 / sqrt(var + eps).
template <typename T>
inline void row_stats(const T* __restrict x, int64_t d, T eps, T& mean, T& rstd) {
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < d; ++c) sum += x[c];
  mean = sum / static_cast<T>(d);
  T square = 0;
#pragma omp simd reduction(+ : square)
  for (int64_t c = 0; c < d; ++c) square += (x[c] - mean) * (x[c] - mean);
  rstd = T(1) / std::sqrt(square / static_cast<T>(d) + eps);
}

template <typename T>
void seed_logits(const T* __restrict u, const T* __restrict gain, const T* __restrict shift,
                 T* __restrict y, int64_t n, int64_t h, int64_t d, double eps, int threads) {
  const T eps_t = static_cast<T>(eps);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t row = 0; row < n * h; ++row) {
    const T* __restrict x = u + row * d;
    const T* __restrict g = gain + (row % h) * d;
    const T* __restrict b = shift + (row % h) * d;
    T* __restrict out = y + row * d;
    T mean, rstd;
    row_stats(x, d, eps_t, mean, rstd);
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) out[c] = (x[c] - mean) * rstd * g[c] + b[c];
  }
}

// The backward of `seed_logits` given dL/dy [n, h, d]: dL/du [n, h, d] row by row (LayerNorm's
// backward, dL/du = rstd * (dn - mean(dn) - normed * mean(dn * normed)) with dn = dL/dy * gain),
// then dL/dgain = sum over ids of dL/dy * normed and dL/dshift = sum of dL/dy [h, d], each
// column summed by one thread in id order (the same bits for any thread count).
template <typename T>
void seed_logits_backward(const T* __restrict u, const T* __restrict gain,
                          const T* __restrict grad_y, T* __restrict grad_u,
                          T* __restrict grad_gain, T* __restrict grad_shift, int64_t n, int64_t h,
                          int64_t d, double eps, int threads) {
  const T eps_t = static_cast<T>(eps);
  std::vector<T> means(n * h), rstds(n * h);
#pragma omp parallel num_threads(threads)
  {
    std::vector<T> normed(d);
#pragma omp for schedule(static)
    for (int64_t row = 0; row < n * h; ++row) {
      const T* __restrict x = u + row * d;
      const T* __restrict gy = grad_y + row * d;
      const T* __restrict g = gain + (row % h) * d;
      T* __restrict out = grad_u + row * d;
      T mean, rstd;
      row_stats(x, d, eps_t, mean, rstd);
      means[row] = mean;
      rstds[row] = rstd;
      T sum_dn = 0, sum_dn_normed = 0;
#pragma omp simd reduction(+ : sum_dn, sum_dn_normed)
      for (int64_t c = 0; c < d; ++c) {
        normed[c] = (x[c] - mean) * rstd;
        const T dn = gy[c] * g[c];
        sum_dn += dn;
        sum_dn_normed += dn * normed[c];
      }
      const T a = sum_dn / static_cast<T>(d), b = sum_dn_normed / static_cast<T>(d);
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) out[c] = rstd * (gy[c] * g[c] - a - normed[c] * b);
    }
    // Columns in blocks of one cache line: a task reads one line of u and dL/dy per id.
    constexpr int64_t kBlock = 64 / sizeof(T);
    const int64_t blocks = (d + kBlock - 1) / kBlock;
#pragma omp for schedule(static)
    for (int64_t task = 0; task < h * blocks; ++task) {
      const int64_t l = task / blocks, c0 = (task % blocks) * kBlock;
      const int64_t width = std::min(kBlock, d - c0);
      T sum_g[kBlock] = {}, sum_b[kBlock] = {};
      for (int64_t i = 0; i < n; ++i) {
        const int64_t row = i * h + l;
        const T* __restrict x = u + row * d + c0;
        const T* __restrict gy = grad_y + row * d + c0;
        const T mean = means[row], rstd = rstds[row];
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) {
          sum_g[c] += gy[c] * ((x[c] - mean) * rstd);
          sum_b[c] += gy[c];
        }
      }
      for (int64_t c = 0; c < width; ++c) {
        grad_gain[l * d + c0 + c] = sum_g[c];
        grad_shift[l * d + c0 + c] = sum_b[c];
      }
    }
  }
}

}  // namespace

extern "C" {

void lev_forward_f32(const float* t, int64_t t_stride_h, int64_t t_stride_n,
                     const float* delta, float* modes, int64_t h, int64_t n, int64_t d,
                     int64_t kappa, int64_t r, int normalize, double eps, double eps_mant,
                     int32_t eps_exp, int threads) {
  forward<float>(t, t_stride_h, t_stride_n, delta, modes, h, n, d, kappa, r, normalize != 0,
                 eps, eps_mant, eps_exp, threads);
}

void lev_forward_f64(const double* t, int64_t t_stride_h, int64_t t_stride_n,
                     const double* delta, double* modes, int64_t h, int64_t n, int64_t d,
                     int64_t kappa, int64_t r, int normalize, double eps, double eps_mant,
                     int32_t eps_exp, int threads) {
  forward<double>(t, t_stride_h, t_stride_n, delta, modes, h, n, d, kappa, r, normalize != 0,
                  eps, eps_mant, eps_exp, threads);
}

void lev_backward_f32(const float* t, int64_t t_stride_h, int64_t t_stride_n,
                      const float* delta, const float* scaled, int64_t s_stride_h,
                      int64_t s_stride_n, float* grad_delta, float* grad_t,
                      int64_t g_stride_h, int64_t g_stride_n, int64_t h, int64_t n, int64_t d,
                      int64_t kappa, int64_t r, int normalize, double eps, int threads) {
  backward<float>(t, t_stride_h, t_stride_n, delta, scaled, s_stride_h, s_stride_n, grad_delta,
                  grad_t, g_stride_h, g_stride_n, h, n, d, kappa, r, normalize != 0, eps,
                  threads);
}

void lev_backward_f64(const double* t, int64_t t_stride_h, int64_t t_stride_n,
                      const double* delta, const double* scaled, int64_t s_stride_h,
                      int64_t s_stride_n, double* grad_delta, double* grad_t,
                      int64_t g_stride_h, int64_t g_stride_n, int64_t h, int64_t n, int64_t d,
                      int64_t kappa, int64_t r, int normalize, double eps, int threads) {
  backward<double>(t, t_stride_h, t_stride_n, delta, scaled, s_stride_h, s_stride_n,
                   grad_delta, grad_t, g_stride_h, g_stride_n, h, n, d, kappa, r,
                   normalize != 0, eps, threads);
}

void lev_seed_logits_f32(const float* u, const float* gain, const float* shift, float* y,
                         int64_t n, int64_t h, int64_t d, double eps, int threads) {
  seed_logits<float>(u, gain, shift, y, n, h, d, eps, threads);
}

void lev_seed_logits_f64(const double* u, const double* gain, const double* shift, double* y,
                         int64_t n, int64_t h, int64_t d, double eps, int threads) {
  seed_logits<double>(u, gain, shift, y, n, h, d, eps, threads);
}

void lev_seed_logits_backward_f32(const float* u, const float* gain, const float* grad_y,
                                  float* grad_u, float* grad_gain, float* grad_shift, int64_t n,
                                  int64_t h, int64_t d, double eps, int threads) {
  seed_logits_backward<float>(u, gain, grad_y, grad_u, grad_gain, grad_shift, n, h, d, eps,
                              threads);
}

void lev_seed_logits_backward_f64(const double* u, const double* gain, const double* grad_y,
                                  double* grad_u, double* grad_gain, double* grad_shift,
                                  int64_t n, int64_t h, int64_t d, double eps, int threads) {
  seed_logits_backward<double>(u, gain, grad_y, grad_u, grad_gain, grad_shift, n, h, d, eps,
                               threads);
}

}  // extern "C"
