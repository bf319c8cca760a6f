// Float32 (and, below, bfloat16) linears on weights packed in panels, every step of a layer that has them
// (prepack_linears, the default): y (M, N) = x (M, K) @ w^T (+ bias), w packed as (ceil(N / P), K, P), P = 2 * L
// columns a panel (32 under AVX-512, 16 under AVX2), zeros past N in the last one (pagoda/layers/linear.py's
// pack_tiles). Each tile is
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
// An AVX2 build (6 x 16 tiles; load_library with TORCHINDUCTOR_CPP_MARCH=haswell ATEN_CPU_CAPABILITY=avx2, no zmm
// register in it; timed on the Zen 4 machine against oneDNN limited to AVX2 and the GEMV built the same way,
// `python -m pagoda.bench.f32_tiles`): a decode step's linears streamed from memory 1.07x / 1.04x / 1.36x the GEMV
// at 1 / 2 / 4 rows, one shape with its weight in the caches 1.08-1.38x the GEMV at 1 row, 1.56-2.21x the best
// other at 4, 1.32-1.73x at 16, 1.00-1.26x at 128, 1.02-1.22x at 2,048 (BENCHMARKS.md, "An AVX2 build through the
// engine's own compiler"). A build by hand with g++ -march=haswell had lost to the GEMV at 1 row (0.66-0.96x);
// the engine's build does not.

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

// ---- bfloat16 ----
// The same tiles over bfloat16 weights packed in pairs of k: (ceil(N / P), ceil(K / 2), P, 2), each column's w[k]
// and w[k + 1] side by side (zeros past N and past K; linear.py's pack_tiles for a bfloat16 weight), x and y
// bfloat16, sums float32, rounded to bfloat16 (nearest even) once, after the bias, as oneDNN rounds. With AVX-512
// BF16 one `vdpbf16ps` adds both products of a pair to 16 columns' sums (two multiply-adds an instruction, at the
// rate of one); elsewhere each pair is widened to two float32 vectors for two multiply-adds. On the Zen 4 machine,
// 443-456 GFLOP/s at 2,048 rows (~97% of `vdpbf16ps`'s rate; 1.02-1.04x oneDNN's packed weight), and 1.02-1.47x
// the best of the GEMV and oneDNN on a decode step's linears at 1-256 rows (BENCHMARKS.md, "The tiles replace the
// plain weights; bfloat16 linears on the tiles"). A first version tested in its k loop, for every row, whether the
// pair was K's odd last one: 0.90-0.94x oneDNN at 2,048 rows; that pair is now taken after the loop. The widening
// path in an AVX-512 build without BF16, timed on the Zen 4 machine against F.linear with oneDNN limited to AVX2 and
// to AVX512_CORE (`ONEDNN_MAX_CPU_ISA`, ad hoc), on the decoder's shapes: 3.0-4.0x and 1.7-3.6x at 4-2,048 rows,
// 2.1-2.3x and 1.8-3.1x at 1; the GEMV of the same build 1.3-2.1x slower at 1 row, 0.9-1.2x at 4 (the lm_head:
// 0.85-0.95x the GEMV at 1 row, 2.1-2.2x at 4). Not timed on such a CPU itself.

#if defined(__AVX512BF16__) && defined(__AVX512F__) && !defined(PAGODA_PORTABLE)
#define PAGODA_BF16_NATIVE 1
#else
#define PAGODA_BF16_NATIVE 0
#endif

// Whether linear.py gives bfloat16 layers these tiles: builds with 512-bit vectors, where they were measured faster
// than the GEMV and oneDNN (above). Not AVX2 builds: there (built for Haswell as the float32 note above says, timed
// on the Zen 4 machine) they ran 0.51-0.69x the best of the GEMV and F.linear at 1 row and 0.82-1.29x at 4, though
// 1.5-1.85x F.linear at 16-2,048 rows (~55 GFLOP/s: 6 x 16 tiles, x widened row by row); freeing the plain weights
// needs tiles that take every row, so bfloat16 keeps the GEMV and F.linear there.
extern "C" int64_t pagoda_bf16_tiles_enabled() {
#if defined(__AVX512F__) && !defined(PAGODA_PORTABLE)
  return 1;
#else
  return 0;
#endif
}

static inline uint32_t load_pair(const uint16_t* p) {
  uint32_t u;
  std::memcpy(&u, p, sizeof(u));
  return u;
}

// R rows x the panel's columns [0, cols).
template <int R>
static inline void tile(const uint16_t* x, int64_t K, const uint16_t* panel, const uint16_t* bias, uint16_t* y,
                             int64_t N, int64_t cols) {
  // step(w, x_pair): one pair of k, x_pair(row) giving a row's (x[k], x[k + 1]) as 32 bits; with K odd the last is
  // (x[K - 1], 0), so that the row's next element is not read (a NaN there would reach the sums)
#if PAGODA_BF16_NATIVE
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const auto step = [&](const uint16_t* w, auto x_pair) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w), b1 = (__m512bh)_mm512_loadu_si512(w + 2 * L);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(int(x_pair(x + r * K)));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
    }
  };
#else
  vf acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vf{};
  const auto step = [&](const uint16_t* w, auto x_pair) {
    vu32 u[2];
    std::memcpy(u, w, sizeof(u));
    vf lo[2], hi[2];
    for (int h = 0; h < 2; ++h) {
      const vu32 l = u[h] << 16, m = u[h] & 0xffff0000u;
      std::memcpy(&lo[h], &l, sizeof(l));
      std::memcpy(&hi[h], &m, sizeof(m));
    }
    for (int r = 0; r < R; ++r) {
      const uint32_t p = x_pair(x + r * K);
      const vf a0 = splat(bf16_to_f(uint16_t(p))), a1 = splat(bf16_to_f(uint16_t(p >> 16)));
      acc[r][0] = madd(a1, hi[0], madd(a0, lo[0], acc[r][0]));
      acc[r][1] = madd(a1, hi[1], madd(a0, lo[1], acc[r][1]));
    }
  };
#endif
#if PAGODA_PREFETCH_Y
  for (int r = 0; r < R; ++r) __builtin_prefetch(y + r * N, 1, 3);
#endif
  const int64_t pairs = K / 2;
  for (int64_t kk = 0; kk < pairs; ++kk) {
    step(panel + kk * 2 * P, [kk](const uint16_t* row) { return load_pair(row + 2 * kk); });
  }
  if (K & 1) step(panel + pairs * 2 * P, [K](const uint16_t* row) { return uint32_t(row[K - 1]); });
  for (int r = 0; r < R; ++r) {
    vf s[2];
    std::memcpy(s, &acc[r][0], sizeof(s[0]));
    std::memcpy(s + 1, &acc[r][1], sizeof(s[1]));
    uint16_t* out = y + r * N;
    if (cols == P) {  // rounded as f_to_bf16 rounds, vectorized (without its NaN test)
      for (int h = 0; h < 2; ++h) {
        if (bias != nullptr) s[h] += load_bf16(bias + h * L);
        vu32 u;
        std::memcpy(&u, &s[h], sizeof(u));
        const vu16 b = __builtin_convertvector((u + 0x7fffu + ((u >> 16) & 1u)) >> 16, vu16);
        std::memcpy(out + h * L, &b, sizeof(b));
      }
      continue;
    }
    float sums[P];
    std::memcpy(sums, s, sizeof(sums));
    for (int64_t c = 0; c < cols; ++c) out[c] = f_to_bf16(sums[c] + (bias != nullptr ? bf16_to_f(bias[c]) : 0.0f));
  }
}

// The last rows (fewer than MR) of a panel; E float (float32) or uint16_t (bfloat16) picks the tile.
template <int R, typename E>
static void tail(const E* x, int64_t K, const E* panel, const E* bias, E* y, int64_t N, int64_t cols, int64_t left) {
  if constexpr (R > 0) {
    if (left == R) tile<R>(x, K, panel, bias, y, N, cols);
    else tail<R - 1>(x, K, panel, bias, y, N, cols, left);
  }
}

// The columns a panel holds (pack_tiles packs for it).
extern "C" int64_t pagoda_f32_tiles_panel() { return P; }

// Rows are taken in blocks of about this many bytes of x (a multiple of MR rows), each thread running its panels past
// one block before the next, so that the block stays in its L2 while the panels stream; without blocks every panel read
// all of x from L3. At 2,048 rows on the Zen 4 machine (ad hoc, alternated, GFLOP/s): the down projection (K 1,536)
// 217.8 with blocks of 256 KiB against 206.9 without, the others 205-213 either way; blocks of 64 KiB cost 2-10% at 128
// rows (the panels re-read more often), 512 KiB gained nothing. PAGODA_ROW_BLOCK_BYTES overrides it (ad hoc A/Bs build
// the kernel with another value through load_library's defines, as PAGODA_PREFETCH_Y).
#ifndef PAGODA_ROW_BLOCK_BYTES
#define PAGODA_ROW_BLOCK_BYTES (256 << 10)
#endif

// Each thread a contiguous share of the panels (panel_elems elements apart in wp), a block of rows (about
// PAGODA_ROW_BLOCK_BYTES of x) past each in turn, in tiles of MR rows and a tail. Both kernels below run on it.
template <typename E>
static void run_tiles(const E* x, const E* wp, const E* bias, E* y, int64_t M, int64_t N, int64_t K,
                      int64_t panel_elems) {
  const int64_t panels = (N + P - 1) / P;
  const int64_t block = std::max<int64_t>(1, PAGODA_ROW_BLOCK_BYTES / (K * int64_t(sizeof(E)) * MR)) * MR;
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t p0 = panels * t / threads, p1 = panels * (t + 1) / threads;
    for (int64_t m0 = 0; m0 < M; m0 += block) {
      const int64_t m1 = std::min(M, m0 + block);
      for (int64_t p = p0; p < p1; ++p) {
        const E* panel = wp + p * panel_elems;
        const E* b = bias != nullptr ? bias + p * P : nullptr;
        const int64_t cols = std::min<int64_t>(P, N - p * P);
        int64_t m = m0;
        for (; m + MR <= m1; m += MR) tile<MR>(x + m * K, K, panel, b, y + m * N + p * P, N, cols);
        tail<MR - 1>(x + m * K, K, panel, b, y + m * N + p * P, N, cols, m1 - m);
      }
    }
  }
}

// x (M, K), wp: w (N, K) packed by pack_tiles, bias (N) or null, y (M, N); all float32, contiguous; M >= 0.
extern "C" void pagoda_f32_tiles_linear(const float* x, const float* wp, const float* bias, float* y, int64_t M,
                                        int64_t N, int64_t K) {
  run_tiles(x, wp, bias, y, M, N, K, K * P);
}

// x (M, K), wp: w (N, K) packed by pack_tiles, bias (N) or null, y (M, N); all bfloat16 (as uint16), contiguous;
// M >= 0. The GEMV's signature, as the float32 kernel's.
extern "C" void pagoda_bf16_tiles_linear(const uint16_t* x, const uint16_t* wp, const uint16_t* bias, uint16_t* y,
                                         int64_t M, int64_t N, int64_t K) {
  run_tiles(x, wp, bias, y, M, N, K, (K + 1) / 2 * 2 * P);
}
