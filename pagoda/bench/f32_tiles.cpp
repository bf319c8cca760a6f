// A plain float32 tile kernel for `python -m pagoda.bench.f32_tiles` (pagoda/bench/f32_tiles.py), which times it
// against oneDNN's packed weights, the engine's float32 linears beyond the GEMV's rows: y (M, N) = x (M, K) @ w^T, w
// packed as (N / 32, K, 32) (pagoda_f32_tiles_pack's layout). Each tile is MR rows x 32 columns of float32 sums in
// 2 * MR registers; each k broadcasts a row's value against the panel's two vectors of 16; the threads split the
// panels, each running all rows past its panel (72 KiB at K = 576, in L2). Not in the engine: BENCHMARKS.md, "A lead
// for float32". AVX-512 only (pagoda_f32_tiles_built says whether this build has it). Compiled by load_library after
// cpp_vector.h.

#if defined(__AVX512F__)
constexpr int MR = 12;  // rows a tile: 24 sums and two panel vectors of the 32 registers (14 was no faster, ad hoc)

template <int R>
static inline void tile(const float* x, int64_t K, const float* panel, float* y, int64_t N) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 b0 = _mm512_loadu_ps(panel + k * 32), b1 = _mm512_loadu_ps(panel + k * 32 + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * K + k]);
      acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(y + r * N, acc[r][0]);
    _mm512_storeu_ps(y + r * N + 16, acc[r][1]);
  }
}

// The last rows (fewer than MR) of a panel.
template <int R>
static void tail(const float* x, int64_t K, const float* panel, float* y, int64_t N, int64_t left) {
  if constexpr (R > 0) {
    if (left == R) tile<R>(x, K, panel, y, N);
    else tail<R - 1>(x, K, panel, y, N, left);
  }
}

extern "C" int pagoda_f32_tiles_built() { return 1; }

// y (M, N) = x (M, K) @ w^T, wp: w (N, K) packed by pagoda_f32_tiles_pack; N a multiple of 32.
extern "C" void pagoda_f32_tiles_linear(const float* x, const float* wp, float* y, int64_t M, int64_t N, int64_t K) {
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < N / 32; ++p) {
    const float* panel = wp + p * K * 32;
    int64_t m = 0;
    for (; m + MR <= M; m += MR) tile<MR>(x + m * K, K, panel, y + m * N + p * 32, N);
    tail<MR - 1>(x + m * K, K, panel, y + m * N + p * 32, N, M - m);
  }
}
#else
extern "C" int pagoda_f32_tiles_built() { return 0; }
#endif
