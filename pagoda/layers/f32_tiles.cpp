// Float32 linears on weights packed in panels, every step of a float32 layer that has them (prepack_linears, the
// default): y (M, N) = x (M, K) @ w^T (+ bias), w packed as (ceil(N / P), K, P), P = 2 * L columns a panel (32
// under AVX-512, 16 under AVX2), zeros past N in the last one (pagoda/layers/linear.py's pack_tiles). Each tile is
// MR rows x P columns of float32 sums kept in 2 * MR registers; each k loads the panel's two vectors once and
// multiplies-adds them with each row's x[k] broadcast. Each thread takes a contiguous share of the panels, streams
// them in order, and runs a block of rows past each panel (K x P floats: 72 KiB for K = 576 under AVX-512, in L2)
// before the next block; at one row that is one pass over its weights, as fast as a read of them.
//
// Why a kernel of our own: on the default model's shapes, a decode step's linears ran 1.03-1.49x faster than
// oneDNN's on its own packed weights at 8-256 rows, and, with each tile's output prefetched (below), 1.00-1.06x on
// the decoder's shapes at 2,048 (`python -m pagoda.bench.f32_tiles`, BENCHMARKS.md, "Float32 linears on tiles of our
// own"); at 1-4 rows it reads the weights as fast as the GEMV (gemv.cpp) or faster; and, being a plain C function
// with the GEMV's signature, it lets a float32 model's batched decode steps run in one C++ call
// (pagoda/model/one_stream.cpp), where oneDNN's matmul cannot be called. Sums run over k in order per output, so
// results differ from F.linear's and oneDNN's by float32 rounding only. Compiled by load_library after cpp_vector.h.
// The AVX2 build (6 x 16 tiles) was measured on the Zen 4 machine only (compiled for Haswell, against oneDNN limited
// to AVX2): 0.99-1.43x oneDNN at 16-2,048 rows.

#include <omp.h>

// Rows a tile: with 32 vector registers (AVX-512), 24 sums and the panel's two vectors (14 rows were no faster, ad
// hoc); with 16 (AVX2), 12 sums, the two panel vectors and the broadcast.
#if defined(__AVX512F__)
constexpr int MR = 12;
#else
constexpr int MR = 6;
#endif
constexpr int64_t P = 2 * L;

// 1: each tile prefetches its output lines for writing (tile, below); 0 for the benchmark's comparison.
#ifndef PAGODA_PREFETCH_Y
#define PAGODA_PREFETCH_Y 1
#endif

static inline vf load_vf(const float* p) {
  vf r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}

static inline void store_vf(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

// v in every lane: one broadcast (`vf{} + v` is an addition first, since 0 + -0 is not -0; a loop over the lanes
// went through the stack).
static inline vf splat(float v) {
  vf r;
#if defined(__AVX512F__) && !defined(PAGODA_PORTABLE)
  const __m512 b = _mm512_set1_ps(v);
  std::memcpy(&r, &b, sizeof(r));
#elif defined(__AVX__) && !defined(PAGODA_PORTABLE)
  const __m256 b = _mm256_set1_ps(v);
  std::memcpy(&r, &b, sizeof(r));
#else
  for (int64_t i = 0; i < L; ++i) r[i] = v;
#endif
  return r;
}

// R rows x the panel's columns [0, cols) (cols <= P; fewer in a last panel, whose sums past N are not stored).
template <int R>
static inline void tile(const float* x, int64_t K, const float* panel, const float* bias, float* y, int64_t N,
                        int64_t cols) {
  vf acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vf{};
#if PAGODA_PREFETCH_Y
  // The tile's output lines asked for (for writing) before its k loop, so that their fills overlap the loop instead
  // of stalling its stores at the end (an output past the caches, a prompt step's, had each tile's 24 stores miss):
  // 1.01-1.06x at 128-2,048 rows on the decoder's shapes, now 1.00-1.06x oneDNN's at 2,048 (ad hoc, alternated).
  for (int r = 0; r < R; ++r) {
    __builtin_prefetch(y + r * N, 1, 3);
    __builtin_prefetch(y + r * N + L, 1, 3);
  }
#endif
  for (int64_t k = 0; k < K; ++k) {
    const vf b0 = load_vf(panel + k * P), b1 = load_vf(panel + k * P + L);
    for (int r = 0; r < R; ++r) {
      const vf a = splat(x[r * K + k]);
      acc[r][0] = madd(a, b0, acc[r][0]);
      acc[r][1] = madd(a, b1, acc[r][1]);
    }
  }
  vf bias0{}, bias1{};
  if (bias != nullptr && cols == P) {
    bias0 = load_vf(bias);
    bias1 = load_vf(bias + L);
  }
  for (int r = 0; r < R; ++r) {
    if (cols == P) {
      store_vf(y + r * N, acc[r][0] + bias0);
      store_vf(y + r * N + L, acc[r][1] + bias1);
      continue;
    }
    float sums[P];
    store_vf(sums, acc[r][0]);
    store_vf(sums + L, acc[r][1]);
    for (int64_t c = 0; c < cols; ++c) y[r * N + c] = sums[c] + (bias != nullptr ? bias[c] : 0.0f);
  }
}

// The last rows (fewer than MR) of a panel.
template <int R>
static void tail(const float* x, int64_t K, const float* panel, const float* bias, float* y, int64_t N, int64_t cols,
                 int64_t left) {
  if constexpr (R > 0) {
    if (left == R) tile<R>(x, K, panel, bias, y, N, cols);
    else tail<R - 1>(x, K, panel, bias, y, N, cols, left);
  }
}

// The columns a panel holds (pack_tiles packs for it).
extern "C" int64_t pagoda_f32_tiles_panel() { return P; }

// Rows are taken in blocks of about this many bytes of x (a multiple of MR rows), each thread running its panels
// past one block before the next, so that the block stays in its L2 while the panels stream; without blocks every
// panel read all of x from L3. At 2,048 rows on the Zen 4 machine (ad hoc, alternated, GFLOP/s): the down projection
// (K 1,536) 217.8 with blocks of 256 KiB against 206.9 without, the others 205-213 either way; blocks of 64 KiB cost
// 2-10% at 128 rows (the panels re-read more often), 512 KiB gained nothing. PAGODA_ROW_BLOCK_BYTES overrides it (ad hoc
// A/Bs build the kernel with another value through load_library's defines, as PAGODA_PREFETCH_Y).
#ifndef PAGODA_ROW_BLOCK_BYTES
#define PAGODA_ROW_BLOCK_BYTES (256 << 10)
#endif

// x (M, K), wp: w (N, K) packed by pack_tiles, bias (N) or null, y (M, N); all float32, contiguous; M >= 0.
extern "C" void pagoda_f32_tiles_linear(const float* x, const float* wp, const float* bias, float* y, int64_t M,
                                        int64_t N, int64_t K) {
  const int64_t panels = (N + P - 1) / P;
  const int64_t block = std::max<int64_t>(1, PAGODA_ROW_BLOCK_BYTES / (K * 4 * MR)) * MR;
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t p0 = panels * t / threads, p1 = panels * (t + 1) / threads;
    for (int64_t m0 = 0; m0 < M; m0 += block) {
      const int64_t m1 = std::min(M, m0 + block);
      for (int64_t p = p0; p < p1; ++p) {
        const float* panel = wp + p * K * P;
        const float* b = bias != nullptr ? bias + p * P : nullptr;
        const int64_t cols = std::min<int64_t>(P, N - p * P);
        int64_t m = m0;
        for (; m + MR <= m1; m += MR) tile<MR>(x + m * K, K, panel, b, y + m * N + p * P, N, cols);
        tail<MR - 1>(x + m * K, K, panel, b, y + m * N + p * P, N, cols, m1 - m);
      }
    }
  }
}
