// Forward-only per-row cross entropy of float32 logits on CPU (megatron_ext.cross_entropy_cpu).
//
// loss[i] = log(sum_j exp(x[i, j] - m_i)) - (x[i, target[i]] - m_i), m_i = max_j x[i, j]:
// two passes over each row (the maximum, then the sum of exponentials), both in registers, the
// row read from cache. Rows are split over OpenMP threads; each row is summed by one thread in
// a fixed order, so the result does not depend on the thread count.
//
// The exp (`vexp`) is a polynomial after range reduction: x = k ln2 + r with |r| <= ln2/2,
// exp(r) by Cephes' degree-7 expf polynomial, times 2^k applied as two exact power-of-two
// factors (so results down to the smallest subnormal are scaled correctly). Accuracy, checked
// against float64 over a dense grid of [-104, 0] in tests/models/test_cross_entropy_cpu.py: at
// most 2 ulp for normal results; subnormal results within 1 ulp of the subnormal spacing
// (absolute); exp(-inf) = 0, results below half the smallest subnormal are 0, NaN stays NaN,
// exp(+inf) = +inf. No fused multiply-adds are assumed (-std=c++17 leaves fp-contract off),
// so AVX-512 and AVX2 machines give the same results.
//
// Written with GCC vector extensions (16 float lanes; GCC splits them on narrower machines),
// no intrinsics, so that -march=native picks the instructions.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
static constexpr int L = 16;

static inline vf splat(float v) { return vf{} + v; }

static inline vf load(const float* p) {
    vf v;
    std::memcpy(&v, p, sizeof(v));
    return v;
}

// Lanes [0, count) from p, the rest `fill`.
static inline vf load_tail(const float* p, int64_t count, float fill) {
    float buf[L];
    for (int i = 0; i < L; ++i) buf[i] = i < count ? p[i] : fill;
    return load(buf);
}

static inline vf vexp(vf x) {
    const vf lo = splat(-105.0f), hi = splat(89.0f);
    // NaN compares false and is kept; -inf becomes -105 (exp rounds to 0), +inf 89 (to inf).
    x = x < lo ? lo : x;
    x = x > hi ? hi : x;
    const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
    vf t = x * splat(1.44269504088896341f) + splat(magic);
    vf kf = t - splat(magic);
    vi k = (vi)t - (vi)splat(magic);  // the integer k, from the low mantissa bits of t
    vf r = x - kf * splat(0.693359375f);  // ln2 in two parts (Cephes): exact k * C1
    r = r - kf * splat(-2.12194440e-4f);
    vf p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * (r * r) + r + splat(1.0f);
    vi k1 = k >> 1, k2 = k - k1;  // 2^k = 2^k1 * 2^k2, each a normal float for k in [-152, 128]
    vf s1 = (vf)((k1 + 127) << 23), s2 = (vf)((k2 + 127) << 23);
    return p * s1 * s2;
}

static inline float hmax(vf v) {
    float m = v[0];
    for (int i = 1; i < L; ++i) m = v[i] > m ? v[i] : m;
    return m;
}

static inline double hsum(vf v) {
    double s = 0.0;
    for (int i = 0; i < L; ++i) s += v[i];
    return s;
}

static float row_loss(const float* x, int64_t V, int64_t target) {
    const float ninf = -std::numeric_limits<float>::infinity();
    vf mv = splat(ninf);
    int64_t j = 0;
    for (; j + L <= V; j += L) {
        vf v = load(x + j);
        mv = v > mv ? v : mv;
    }
    if (j < V) {
        vf v = load_tail(x + j, V - j, ninf);
        mv = v > mv ? v : mv;
    }
    float m = hmax(mv);
    // A NaN logit never wins the maximum; it reaches the sum as exp(NaN - m) = NaN. A row of
    // -inf (m = -inf) or with +inf (m = +inf) gives x - m = NaN, as in torch's cross entropy.
    const vf mm = splat(m);
    double total = 0.0;
    const int64_t block = 64 * L;  // float lanes for 64 steps, then into the double total
    for (int64_t b = 0; b < V; b += block) {
        const int64_t end = b + block < V ? b + block : V;
        vf acc = splat(0.0f);
        int64_t i = b;
        for (; i + L <= end; i += L) acc += vexp(load(x + i) - mm);
        if (i < end) acc += vexp(load_tail(x + i, end - i, ninf) - mm);
        total += hsum(acc);
    }
    return (float)(std::log(total) - ((double)x[target] - (double)m));
}

extern "C" {

// logits [n, V] with row stride `stride` (elements), target [n] in [0, V), out [n].
void cross_entropy_f32(const float* logits, int64_t n, int64_t V, int64_t stride,
                       const int64_t* target, float* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; ++i) out[i] = row_loss(logits + i * stride, V, target[i]);
}

// y = exp(x) elementwise with the kernel's exp (for its accuracy tests).
void exp_f32(const float* x, float* y, int64_t n) {
    int64_t i = 0;
    for (; i + L <= n; i += L) {
        vf v = vexp(load(x + i));
        std::memcpy(y + i, &v, sizeof(v));
    }
    if (i < n) {
        vf v = vexp(load_tail(x + i, n - i, 0.0f));
        for (int64_t j = 0; i + j < n; ++j) y[i + j] = v[j];
    }
}
}
