// Loops for `python -m pagoda.bench.issue_rates` (pagoda/bench/issue_rates.py): how many 512-bit `vpdpbusd` and
// fused multiply-adds one core issues a second, alone and mixed with the other instructions of the Q4_1 tile
// (pagoda/layers/q4_gemm.cpp), and what an OpenMP parallel region and a barrier cost. Twelve independent
// accumulators each (more than latency times issue rate), register-resident: the asm statements keep the compiler
// from folding the loops away. Each returns its wall time in seconds. AVX-512 VNNI only (the caller checks
// pagoda_issue_rates_built). Compiled by load_library after cpp_vector.h.

#include <omp.h>

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
extern "C" int pagoda_issue_rates_built() { return 1; }

#define PAGODA_R12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define PAGODA_DECL(i)                      \
  __m512i a##i = _mm512_set1_epi32(i + 1); \
  __m512 f##i = _mm512_set1_ps(float(i));
#define PAGODA_DP(i) a##i = _mm512_dpbusd_epi32(a##i, x, y);
#define PAGODA_FMA(i) f##i = _mm512_fmadd_ps(f##i, s, s);
#define PAGODA_SINK(i) sink += _mm512_reduce_add_epi32(a##i) + _mm512_reduce_add_ps(f##i);

// mix: 0, 12 vpdpbusd a step; 1, 12 FMAs; then 8 vpdpbusd (one row and block of the tile) with: 2, four shifts and
// eight ANDs (the nibbles' unpacking); 3, two int-to-float conversions and three integer adds; 4, two float16
// conversions (the scales); 5, one multiply and two multiply-adds (the tile's float work a row and block).
extern "C" double pagoda_issue_rates_loop(int64_t mix, int64_t steps, float* out) {
  PAGODA_R12(PAGODA_DECL)
  __m512i x = _mm512_set1_epi8(3), y = _mm512_set1_epi8(5);
  const __m512i low = _mm512_set1_epi8(0x0f);
  __m512 s = _mm512_set1_ps(1.0001f);
  const double start = seconds_now();
  for (int64_t n = 0; n < steps; ++n) {
    if (mix == 1) {
      PAGODA_R12(PAGODA_FMA)
    } else if (mix == 0) {
      PAGODA_R12(PAGODA_DP)
    } else {
      PAGODA_DP(0) PAGODA_DP(1) PAGODA_DP(2) PAGODA_DP(3) PAGODA_DP(4) PAGODA_DP(5) PAGODA_DP(6) PAGODA_DP(7)
      if (mix == 2) {
        a8 = _mm512_and_si512(_mm512_srli_epi16(a8, 4), low);
        a9 = _mm512_and_si512(_mm512_srli_epi16(a9, 4), low);
        a10 = _mm512_and_si512(_mm512_srli_epi16(a10, 4), low);
        a11 = _mm512_and_si512(_mm512_srli_epi16(a11, 4), low);
      } else if (mix == 3) {
        f8 = _mm512_cvtepi32_ps(a8);
        f9 = _mm512_cvtepi32_ps(a9);
        a8 = _mm512_add_epi32(a8, x);
        a9 = _mm512_add_epi32(a9, x);
        a10 = _mm512_add_epi32(a10, a11);
      } else if (mix == 4) {
        f8 = _mm512_cvtph_ps(_mm512_castsi512_si256(a8));
        f9 = _mm512_cvtph_ps(_mm512_castsi512_si256(a9));
        a8 = _mm512_castps_si512(f9);
        a9 = _mm512_castps_si512(f8);
      } else {
        f8 = _mm512_fmadd_ps(f8, _mm512_mul_ps(f9, s), f10);
        f11 = _mm512_fmadd_ps(f11, s, f8);
      }
    }
    asm volatile("" : "+v"(x), "+v"(s), "+v"(f8), "+v"(f9), "+v"(a8), "+v"(a9));
  }
  const double seconds = seconds_now() - start;
  float sink = 0.0f;
  PAGODA_R12(PAGODA_SINK)
  *out = sink;
  return seconds;
}
#else
extern "C" int pagoda_issue_rates_built() { return 0; }
extern "C" double pagoda_issue_rates_loop(int64_t, int64_t, float*) { return 0.0; }
#endif

// `steps` dependent integer adds, one a cycle: the core's clock (0 where the compiler does not target x86-64).
extern "C" double pagoda_issue_rates_clock(int64_t steps) {
#if defined(__x86_64__)
  int64_t x = 0;
  const double start = seconds_now();
  for (int64_t n = 0; n < steps; ++n) asm volatile("add $1, %0" : "+r"(x));
  return seconds_now() - start;
#else
  return 0.0 * double(steps);
#endif
}

// regions: `steps` parallel regions in turn, each doing nothing but one counter update on thread 1; else one region
// whose threads pass `steps` barriers.
extern "C" double pagoda_issue_rates_omp(int64_t regions, int64_t steps) {
  volatile int64_t counter = 0;
  const double start = seconds_now();
  if (regions) {
    for (int64_t n = 0; n < steps; ++n) {
#pragma omp parallel
      {
        if (omp_get_thread_num() == 1) counter = counter + 1;
      }
    }
  } else {
#pragma omp parallel
    {
      for (int64_t n = 0; n < steps; ++n) {
#pragma omp barrier
      }
    }
  }
  return seconds_now() - start;
}
