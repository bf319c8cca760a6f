// Shared by Pagoda's C++ kernels (pagoda/layers/cpp_build.py puts it ahead of each source): a vector of
// float32 lanes as wide as the CPU's registers, 16-bit floats loaded into it, and 2^x for x <= 0 on it; and a clock
// for the loops that time their own calls.

#if (defined(__AVX512F__) || defined(__AVX2__)) && !defined(PAGODA_PORTABLE)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <limits>
#include <new>
#include <utility>

#if defined(__AMX_TILE__) && defined(__AVX512F__) && !defined(PAGODA_PORTABLE)  // immintrin.h above
#include <sys/syscall.h>
#include <unistd.h>

// Whether the OS lets this process use AMX tile data (Linux asks each process to request it).
static inline bool amx_granted() {
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

// A thread's use of the AMX tiles (the prompt attention kernel's, the Q4_1/Q8_0 tiles'): all eight tiles 16 rows of
// 64 bytes while it lives; the configuration it found is put back after, since oneDNN's matmuls use the tiles on
// the same OpenMP threads.
class AmxTiles {
  struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  };
  Config saved_;

 public:
  AmxTiles() {
    _tile_storeconfig(&saved_);
    Config c;
    for (int i = 0; i < 8; ++i) c.rows[i] = 16, c.colsb[i] = 64;
    _tile_loadconfig(&c);
  }
  ~AmxTiles() { _tile_loadconfig(&saved_); }
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;
};
#endif

// A scratch buffer that grows to the largest size asked of it and starts on a 64-byte boundary (a cache line):
// std::vector's memory comes from malloc, 16-byte aligned, and then every 64-byte row of an AMX tile load (and
// every 512-bit load) straddles two lines. On the AMX Xeon a tile loop over 16-byte-aligned buffers ran at 0.43-0.61x
// the rate over aligned ones (BENCHMARKS.md, "Tile loads on 64-byte boundaries").
template <typename T>
class LineAlignedBuffer {
  T* data_ = nullptr;
  size_t size_ = 0;

 public:
  LineAlignedBuffer() = default;
  ~LineAlignedBuffer() { std::free(data_); }
  LineAlignedBuffer(const LineAlignedBuffer&) = delete;
  LineAlignedBuffer& operator=(const LineAlignedBuffer&) = delete;
  // At least n elements (contents not kept when it grows).
  T* reserve(size_t n) {
    if (n > size_) {
      std::free(data_);
      const size_t bytes = (n * sizeof(T) + 63) / 64 * 64;  // aligned_alloc wants a multiple of the alignment
      data_ = static_cast<T*>(std::aligned_alloc(64, bytes));
      if (data_ == nullptr) throw std::bad_alloc();
      size_ = n;
    }
    return data_;
  }
};

// Seconds on the monotonic clock (one_stream.cpp's `--profile` timings, the benchmarks' C++ loops).
static inline double seconds_now() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return double(t.tv_sec) + double(t.tv_nsec) * 1e-9;
}

// L float32 lanes: one vector register, 16 under AVX-512, 8 under AVX (AVX2's CPUs), 4 (SSE) elsewhere. GCC's
// vector extension keeps the kernels' accumulators in registers, where arrays indexed in loops would live on
// the stack. A vector wider than the target's registers does not: GCC 12 moves 16-lane vectors on an AVX2 CPU
// through the stack in 8-byte pieces between operations and compares them lane by lane in scalar code, and the
// decode kernel ran at 5 GB/s, SiLU-and-multiply 6.7x slower than torch (BENCHMARKS.md, "An AVX2 CPU").
#if defined(__AVX512F__)
constexpr int64_t L = 16;
#elif defined(__AVX__)
constexpr int64_t L = 8;
#else
constexpr int64_t L = 4;
#endif
typedef float vf __attribute__((vector_size(L * 4)));
typedef int32_t vi32 __attribute__((vector_size(L * 4)));
typedef uint16_t vu16 __attribute__((vector_size(L * 2)));
typedef uint32_t vu32 __attribute__((vector_size(L * 4)));
typedef _Float16 vf16 __attribute__((vector_size(L * 2)));

// One bfloat16 (the high half of a float32) to float32, and float32 to bfloat16 rounded to nearest even, as
// torch rounds; NaN stays NaN.
static inline float bf16_to_f(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

static inline uint16_t f_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return f != f ? uint16_t(0x7fc0) : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// The sum and the maximum of a vector's lanes (the maximum ignores NaN lanes unless all are NaN).
static inline float hsum(vf x) {
  float s = 0.0f;
  for (int64_t i = 0; i < L; ++i) s += x[i];
  return s;
}

static inline float hmax(vf x) {
  float m = x[0];
  for (int64_t i = 1; i < L; ++i) m = std::max(m, x[i]);
  return m;
}

// 1 / sqrt(mean(h^2) + eps) of a row of dim values as RMSNorm takes it here: the squares summed in L lanes (vec(i):
// float32 values i .. i + L - 1), then the lanes in order, then the tail (at(i): value i). elementwise.cpp's
// add_rms_norm and q4_gemm.cpp's norm ahead of a linear both call it: a fused norm gives the same bits.
template <typename Vec, typename At>
static inline float rms_inverse(int64_t dim, float eps, Vec vec, At at) {
  const int64_t vec_end = dim - dim % L;
  vf acc = {};
  for (int64_t i = 0; i < vec_end; i += L) {
    const vf v = vec(i);
    acc += v * v;
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < L; ++j) sum += acc[j];
  for (int64_t i = vec_end; i < dim; ++i) sum += at(i) * at(i);
  return 1.0f / std::sqrt(sum / float(dim) + eps);
}

// The same by halving: log2(L) dependent steps of a shuffle and an operation, where hsum and hmax chain L - 1 scalar
// ones (GCC keeps their order: float sums do not reassociate); for the kernels' critical paths (a softmax's
// running maximum and sum). The sum's order differs from hsum's; fold_max of a vector with NaN lanes is unspecified.
template <typename Op>
static inline float fold(vf x, Op op) {
#if defined(__AVX512F__)
  x = op(x, __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  x = op(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  x = op(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  x = op(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
#elif defined(__AVX__)
  x = op(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3));
  x = op(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5));
  x = op(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6));
#else
  x = op(x, __builtin_shufflevector(x, x, 2, 3, 0, 1));
  x = op(x, __builtin_shufflevector(x, x, 1, 0, 3, 2));
#endif
  return x[0];
}
static inline float fold_max(vf x) { return fold(x, [](vf a, vf b) { return a > b ? a : b; }); }
static inline float fold_sum(vf x) { return fold(x, [](vf a, vf b) { return a + b; }); }

// Lane j of a butterfly level's two picks from vectors a and b (w: the level's half-span): from a where (j & w) is
// 0, else from b; the low pick takes each pair's first half, the high pick its second. Constant indices, so that the
// compiler emits one shuffle for each (and any compiler with __builtin_shufflevector takes it).
template <int64_t W, size_t... J>
static inline vf pick_low(vf a, vf b, std::index_sequence<J...>) {
  return __builtin_shufflevector(a, b, int((J & W) ? L + J - W : J)...);
}
template <int64_t W, size_t... J>
static inline vf pick_high(vf a, vf b, std::index_sequence<J...>) {
  return __builtin_shufflevector(a, b, int((J & W) ? L + J : J + W)...);
}
template <int64_t W, typename Op>
static inline void fold_levels(vf* y, Op op) {  // 2 W vectors in, W out
  for (int64_t i = 0; i < W; ++i) {
    y[i] = op(pick_low<W>(y[2 * i], y[2 * i + 1], std::make_index_sequence<L>{}),
              pick_high<W>(y[2 * i], y[2 * i + 1], std::make_index_sequence<L>{}));
  }
  if constexpr (W > 1) fold_levels<W / 2>(y, op);
}

// L folds at once: lane i of the result is x[i]'s lanes folded by op. A butterfly: each level pairs the vectors
// and halves the span each lane covers, two shuffles and an op per pair, L - 1 pairs in all (AVX-512: 45
// instructions for 16 folds, where 16 calls of fold take 128 and chain each one's 8). The butterfly leaves
// vector k's fold in lane bitrev(k), so the vectors go in in bit-reversed order.
template <typename Op>
static inline vf fold_each(const vf (&x)[L], Op op) {
  constexpr auto bitrev = [](int64_t k) {
    int64_t r = 0;
    for (int64_t b = 1; b < L; b *= 2) r = 2 * r + ((k & b) ? 1 : 0);
    return r;
  };
  vf y[L];
#pragma GCC unroll 16
  for (int64_t k = 0; k < L; ++k) y[k] = x[bitrev(k)];
  fold_levels<L / 2>(y, op);
  return y[0];
}

// L consecutive bfloat16 (the high halves of float32s) or float16 values as float32.
static inline vf load_bf16(const uint16_t* p) {
#if defined(__AVX512F__) && !defined(PAGODA_PORTABLE)
  // One permute of the 16 halves into the high halves of the lanes, zeroing the low ones (GCC 12 compiles the
  // generic code below to two 8-lane halves put back together, five instructions, where `perf` put a fifth of
  // the bfloat16 decode kernel's samples). A widening load and a shift did it in two instructions on the vector
  // ports the multiply-adds use; the permute is one: bfloat16 decode attention 1.01-1.03x faster
  // (`bench.decode_attention --versus-rev`, four runs), the elementwise ops 0.99-1.24x, the (memory-bound) GEMV
  // unchanged.
  alignas(64) static constexpr uint16_t high_halves[32] = {0, 0, 0, 1, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6, 0, 7,
                                                            0, 8, 0, 9, 0, 10, 0, 11, 0, 12, 0, 13, 0, 14, 0, 15};
  const __m512i u = _mm512_maskz_permutexvar_epi16(
      0xaaaaaaaau, _mm512_load_si512(high_halves),
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  vf r;
  std::memcpy(&r, &u, sizeof(r));
  return r;
#else
  vu16 x;
  std::memcpy(&x, p, sizeof(x));
  const vu32 u = __builtin_convertvector(x, vu32) << 16;
  vf r;
  std::memcpy(&r, &u, sizeof(r));
  return r;
#endif
}

static inline vf load_f16(const _Float16* p) {
#if defined(__F16C__) && !defined(PAGODA_PORTABLE)
  // One vcvtph2ps for the L halves: GCC 12 compiles the generic conversion below to one vcvtph2ps per element,
  // each after a vpinsrw, then unpacks and inserts to gather the lanes; perf found the float16-cache decode
  // kernel busy with those, at 0.4-0.5x the speed of the bfloat16 one on the AVX2 machine. The conversion is
  // exact either way.
#if defined(__AVX512F__)
  const __m512 r = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  const __m256 r = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
  vf out;
  std::memcpy(&out, &r, sizeof(out));
  return out;
#else
  vf16 x;
  std::memcpy(&x, p, sizeof(x));
  return __builtin_convertvector(x, vf);
#endif
}

// 2^x for x <= 0 (scores minus their running maximum, in log2 units), lane by lane: 2^n through the
// exponent bits, 2^f for f = x - n in [-0.5, 0.5] by the Taylor series of e^(f ln 2) to degree 7 (truncation
// error below 1e-8, under float32 rounding). Below -126 it returns 2^-126, not 0: callers zero masked lanes.
// n comes from adding 1.5 * 2^23, which leaves x rounded to an integer in the low mantissa bits of t: t's bits
// shifted up by 23 are n's exponent field, less the bias (the rest shifts out), so 2^n costs a shift and an add,
// not a conversion too; and ln 2's powers sit in the series' coefficients, not in a multiply of f (which makes
// f exact). 15 vector instructions a vector where the conversion and the multiply made 17: SiLU-and-multiply at 128
// rows 1.08x faster (`bench.elementwise --tokens 128 --iters 200 --versus-rev`; at 2,048 rows, memory-bound, the
// same), the prompt kernel's softmax unchanged (0.97-1.0x); largest relative error over [-126, 0] 7.1e-8 against
// 7.7e-8 before (ad hoc, every 97th float against exp2 in double). The counts are
// of the compiled function (g++ 12 -O2 -mavx2 -mfma), constant loads aside.
//
// The polynomial's steps are fused multiply-adds under AVX-512 and FMA whatever the build's -ffp-contract (inductor
// turns contraction off, and the elementwise ops keep it off so that their other arithmetic rounds as torch
// does): one rounding instead of two, and half the dependent chain. With the same in SiLU's reciprocal,
// SiLU-and-multiply runs 1.22-1.37x faster (`bench.elementwise --versus-rev`, BENCHMARKS.md), and its
// bfloat16 output on 2,048 x 1,536 random values stayed bit for bit torch's (ad hoc).
static inline vf madd(vf a, vf b, vf c) {
#if defined(__AVX512F__) && !defined(PAGODA_PORTABLE)
  __m512 va, vb, vc;
  std::memcpy(&va, &a, sizeof(va));
  std::memcpy(&vb, &b, sizeof(vb));
  std::memcpy(&vc, &c, sizeof(vc));
  const __m512 r = _mm512_fmadd_ps(va, vb, vc);
  vf out;
  std::memcpy(&out, &r, sizeof(out));
  return out;
#elif defined(__AVX2__) && defined(__FMA__) && !defined(PAGODA_PORTABLE)
  return vf(_mm256_fmadd_ps(__m256(a), __m256(b), __m256(c)));
#else
  return a * b + c;
#endif
}

// DEGREE: of the series; 7 by default. Code whose results are rounded to 8 bits anyway (the AMX prompt kernel's
// bfloat16 weights) takes 4: relative error under 5e-5.
//
// exp2_neg_n: the same on N vectors in place, step by step across them. One vector's steps are a chain of ~13
// dependent instructions (~50 cycles; ~11 under AVX-512, below); a loop that calls exp2_neg on one vector after
// another keeps only as many in flight as the core's scheduler holds, where N independent chains side by side fill
// both vector ports: SiLU-and-multiply 1.19-1.44x faster with N = 4 (`bench.elementwise --versus-rev`). Not in the
// decode kernel's softmax, where other work already overlaps the chain (0.98-0.99x there).
template <int N, int DEGREE = 7>
static inline void exp2_neg_n(vf* x) {
  static_assert(DEGREE >= 1 && DEGREE <= 7, "the series' terms below go to degree 7");
  // (ln 2)^i / i!
  constexpr float coefficient[8] = {1.0f, 6.9314718055994531e-1f, 2.4022650695910071e-1f, 5.5504108664821580e-2f,
                                    9.6181291076284772e-3f, 1.3333558146428443e-3f, 1.5403530393381609e-4f,
                                    1.5252733804059841e-5f};
#if defined(__AVX512F__) && !defined(PAGODA_PORTABLE)
  // AVX-512: n by `vrndscaleps` (to nearest, ties to even, as the 1.5 * 2^23 trick below) and p * 2^n by
  // `vscalefps`, which is exact where p * two_n is: the same bits as the narrower widths' arithmetic (tests
  // compare them) in 11 vector instructions at degree 7 where that arithmetic compiles to 15 here (g++ -O2
  // -march=native, broadcasts aside). The AMX prompt kernel's softmax 1.03-1.05x (BENCHMARKS.md).
  if constexpr (L == 16) {
    __m512 n[N], f[N], p[N];
#pragma GCC unroll 16
    for (int k = 0; k < N; ++k) {
      // -126 first: `vmaxps` returns its second operand where either is NaN, so NaN stays NaN as below
      const __m512 xk = _mm512_max_ps(_mm512_set1_ps(-126.0f), reinterpret_cast<const __m512&>(x[k]));
      n[k] = _mm512_roundscale_ps(xk, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      f[k] = _mm512_sub_ps(xk, n[k]);
      p[k] = _mm512_set1_ps(coefficient[DEGREE]);
    }
#pragma GCC unroll 8
    for (int i = DEGREE - 1; i >= 0; --i) {
#pragma GCC unroll 16
      for (int k = 0; k < N; ++k) p[k] = _mm512_fmadd_ps(p[k], f[k], _mm512_set1_ps(coefficient[i]));
    }
#pragma GCC unroll 16
    for (int k = 0; k < N; ++k) {
      const __m512 r = _mm512_scalef_ps(p[k], n[k]);
      std::memcpy(&x[k], &r, sizeof(r));
    }
    return;
  }
#endif
  vf t[N], f[N], p[N];
#pragma GCC unroll 16
  for (int k = 0; k < N; ++k) {
    const vf xk = x[k] < -126.0f ? vf{} - 126.0f : x[k];
    t[k] = xk + 12582912.0f;  // 1.5 * 2^23 + n, n = x rounded to an integer
    f[k] = xk - (t[k] - 12582912.0f);
    p[k] = vf{} + coefficient[DEGREE];
  }
#pragma GCC unroll 8
  for (int i = DEGREE - 1; i >= 0; --i) {
#pragma GCC unroll 16
    for (int k = 0; k < N; ++k) p[k] = madd(p[k], f[k], vf{} + coefficient[i]);
  }
#pragma GCC unroll 16
  for (int k = 0; k < N; ++k) {
    vu32 bits;
    std::memcpy(&bits, &t[k], sizeof(bits));
    bits = (bits << 23) + (127u << 23);  // 2^n: n + 127 in the exponent field (n >= -126), zeros below
    vf two_n;
    std::memcpy(&two_n, &bits, sizeof(two_n));
    x[k] = p[k] * two_n;
  }
}

template <int DEGREE = 7>
static inline vf exp2_neg(vf x) {
  exp2_neg_n<1, DEGREE>(&x);
  return x;
}

static inline float exp2_neg(float x) { return exp2_neg<>(vf{} + x)[0]; }

// 1 / d: a division is the costliest instruction here (AVX-512's takes ~16 cycles per vector); its
// 14-bit reciprocal estimate refined by one Newton step (a fused multiply-add and a multiply) is within
// float32 rounding, for 3 instructions.
static inline vf reciprocal(vf d) {
#if defined(__AVX512F__) && !defined(PAGODA_PORTABLE)
  vf r;
  const __m512 e = _mm512_rcp14_ps(reinterpret_cast<__m512&>(d));
  std::memcpy(&r, &e, sizeof(r));
  return r * madd(vf{} - d, r, vf{} + 2.0f);
#else
  return 1.0f / d;
#endif
}

// SiLU, g * sigmoid(g), of N vectors in place, each step across all of them (exp2_neg_n says why); sigmoid through
// e = exp(-|g|) <= 1. The elementwise ops' SiLU-and-multiply (elementwise.cpp) and the packed linears' gate_up
// projection fused with it (q4_gemm.cpp) both run it, so their float32 results are the same bits.
template <int N>
static inline void silu(vf* g) {
  vf e[N];
#pragma GCC unroll 16
  for (int k = 0; k < N; ++k) e[k] = (g[k] < 0.0f ? g[k] : -g[k]) * 1.4426950408889634f;  // -|g| log2(e)
  exp2_neg_n<N>(e);
#pragma GCC unroll 16
  for (int k = 0; k < N; ++k) {
    const vf a = g[k] < 0.0f ? -g[k] : g[k];
    e[k] = a < 87.0f ? e[k] : vf{};  // e^-87 ~ 2^-126: exp2_neg's floor
    const vf sig = (g[k] < 0.0f ? e[k] : vf{} + 1.0f) * reciprocal(1.0f + e[k]);
    g[k] = g[k] * sig;
  }
}

