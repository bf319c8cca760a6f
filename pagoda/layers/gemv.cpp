// Linear layers of bfloat16 and float32 models for steps of a few rows (one stream decoding): y (M, N) = x (M, K)
// @ w^T (+ bias), w (N, K) row-major as nn.Linear stores it, M <= 4. Each weight row is read once, in order, and
// dotted with the M input rows: the step streams the weights from memory, which is its bandwidth floor.
// oneDNN's bfloat16 matmul took about as long for one row as for sixteen (BENCHMARKS.md, "`--prepack-weights`"),
// reading the weights at about a third of the memory's speed. In float32 the GEMV serves one stream's steps in
// one C++ call (pagoda/model/one_stream.cpp), which needs the eager path to run the same arithmetic.
//
// Compiled at start-up by pagoda/layers/linear.py (through pagoda/layers/cpp_build.py), after cpp_vector.h.
// Under AVX-512 BF16, `vdpbf16ps` multiplies 32 pairs of bfloat16 and adds them into 16 float32 lanes;
// elsewhere (or with PAGODA_PORTABLE) each bfloat16 is widened to float32 and multiplied-added. Sums are
// float32, the output rounded to bfloat16 once (bias added before), as F.linear does; the order of the
// additions differs, so results match F.linear's within float32 rounding of the sum.

#if defined(__AVX512BF16__) && !defined(PAGODA_PORTABLE)
#define PAGODA_DPBF16 1
#endif

// Weight rows processed together at 3-4 input rows: their M x ROWS sums are independent chains of fused
// multiply-adds. At 1-2 input rows each weight row is read whole, in order (dot_row, below).
constexpr int64_t ROWS = 4;
// Each weight line is prefetched this many rows ahead of its use (past the end of w, prefetches are
// harmless): 1.55x on one step's weights at 16 rows ahead, against none; 8 and 32 were slower (ad hoc).
constexpr int64_t PREFETCH_ROWS = 16;

static inline float to_f(uint16_t x) { return bf16_to_f(x); }
static inline float to_f(float x) { return x; }
static inline vf load16(const uint16_t* p) { return load_bf16(p); }
static inline vf load16(const float* p) {
  vf r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
static inline void store1(uint16_t* p, float x) { *p = f_to_bf16(x); }
static inline void store1(float* p, float x) { *p = x; }

// Rows [n0, n0 + nr) of the output, nr <= ROWS; T: uint16_t (bfloat16) or float.
template <int M, typename T>
static void dot_rows(const T* x, const T* w, int64_t K, int64_t n0, int64_t nr, float* sums) {
  vf acc[M][ROWS] = {};
  int64_t k = 0;
#ifdef PAGODA_DPBF16
  if constexpr (sizeof(T) == 2) {
    for (; k + 32 <= K; k += 32) {
      __m512bh xv[M];
      for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      for (int64_t r = 0; r < nr; ++r) {
        __builtin_prefetch(w + (n0 + r + PREFETCH_ROWS) * K + k, 0, 3);
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (n0 + r) * K + k);
        for (int m = 0; m < M; ++m) {
          __m512 a;
          std::memcpy(&a, &acc[m][r], sizeof(a));
          a = _mm512_dpbf16_ps(a, xv[m], wv);
          std::memcpy(&acc[m][r], &a, sizeof(a));
        }
      }
    }
  }
#endif
  for (; k + L <= K; k += L) {
    vf xv[M];
    for (int m = 0; m < M; ++m) xv[m] = load16(x + m * K + k);
    for (int64_t r = 0; r < nr; ++r) {
      // float32 rows take a line every 16 elements (one vector under AVX-512, two under AVX2): the same
      // rows-ahead prefetch as the pairs above
      if (sizeof(T) == 4 && k % 16 == 0) __builtin_prefetch(w + (n0 + r + PREFETCH_ROWS) * K + k, 0, 3);
      const vf wv = load16(w + (n0 + r) * K + k);
      for (int m = 0; m < M; ++m) acc[m][r] = madd(xv[m], wv, acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int64_t r = 0; r < nr; ++r) {
      float s = hsum(acc[m][r]);
      for (int64_t j = k; j < K; ++j) s += to_f(x[m * K + j]) * to_f(w[(n0 + r) * K + j]);
      sums[m * ROWS + r] = s;
    }
  }
}

// Independent sums an input row keeps in dot_row: 4 at one row, 2 at two.
template <int M>
constexpr int CHAINS = M == 1 ? 4 : 2;

// One weight row w (K) against the M input rows, read from start to end: each thread streams its rows' bytes in
// order. At 1-2 input rows this ran 1.3-1.9x faster than dot_rows over the default model's linears (both in
// float32 and bfloat16, both on the AVX-512 Zen 4 machine and compiled there for AVX2), where dot_rows's four
// rows read side by side, 2.3 KB apart, left each thread short of the memory's speed (BENCHMARKS.md, "A Zen 4
// machine"). At 3-4 input rows it was 0.76-1.08x dot_rows, which stays for them.
template <int M, typename T>
static inline void dot_row(const T* x, const T* w, int64_t K, float* sums) {
  constexpr int A = CHAINS<M>;
  vf acc[M][A] = {};
  int64_t k = 0;
#ifdef PAGODA_DPBF16
  if constexpr (sizeof(T) == 2) {
    for (; k + 32 * A <= K; k += 32 * A) {
      for (int a = 0; a < A; ++a) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k + 32 * a);
        for (int m = 0; m < M; ++m) {
          __m512 s;
          std::memcpy(&s, &acc[m][a], sizeof(s));
          s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(x + m * K + k + 32 * a), wv);
          std::memcpy(&acc[m][a], &s, sizeof(s));
        }
      }
    }
  }
#endif
  for (; k + L * A <= K; k += L * A) {
    for (int a = 0; a < A; ++a) {
      const vf wv = load16(w + k + L * a);
      for (int m = 0; m < M; ++m) acc[m][a] = madd(load16(x + m * K + k + L * a), wv, acc[m][a]);
    }
  }
  for (; k + L <= K; k += L) {
    const vf wv = load16(w + k);
    for (int m = 0; m < M; ++m) acc[m][0] = madd(load16(x + m * K + k), wv, acc[m][0]);
  }
  for (int m = 0; m < M; ++m) {
    vf t = acc[m][0];
    for (int a = 1; a < A; ++a) t += acc[m][a];
    float s = hsum(t);
    for (int64_t j = k; j < K; ++j) s += to_f(x[m * K + j]) * to_f(w[j]);
    sums[m] = s;
  }
}

template <int M, typename T>
static void gemv(const T* x, const T* w, const T* bias, T* y, int64_t N, int64_t K) {
  if constexpr (M <= 2) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      float sums[M];
      dot_row<M>(x, w + n * K, K, sums);
      const float b = bias ? to_f(bias[n]) : 0.0f;
      for (int m = 0; m < M; ++m) store1(y + m * N + n, sums[m] + b);
    }
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t n0 = 0; n0 < N; n0 += ROWS) {
    const int64_t nr = std::min<int64_t>(ROWS, N - n0);
    float sums[M * ROWS];
    dot_rows<M>(x, w, K, n0, nr, sums);
    for (int m = 0; m < M; ++m) {
      for (int64_t r = 0; r < nr; ++r) {
        const float b = bias ? to_f(bias[n0 + r]) : 0.0f;
        store1(y + m * N + n0 + r, sums[m * ROWS + r] + b);
      }
    }
  }
}

template <typename T>
static void gemv_rows(const T* x, const T* w, const T* bias, T* y, int64_t M, int64_t N, int64_t K) {
  switch (M) {
    case 1: return gemv<1>(x, w, bias, y, N, K);
    case 2: return gemv<2>(x, w, bias, y, N, K);
    case 3: return gemv<3>(x, w, bias, y, N, K);
    default: return gemv<4>(x, w, bias, y, N, K);
  }
}

// x (M, K), w (N, K), bias (N) or null, y (M, N): all bfloat16 (all float32), contiguous; 1 <= M <= 4.
extern "C" void pagoda_gemv_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t M,
                                 int64_t N, int64_t K) {
  gemv_rows(x, w, bias, y, M, N, K);
}

extern "C" void pagoda_gemv_f32(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t N,
                                int64_t K) {
  gemv_rows(x, w, bias, y, M, N, K);
}
