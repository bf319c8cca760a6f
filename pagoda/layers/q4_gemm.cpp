// Linear layers with 4-bit weights and 8-bit activations, the arithmetic llama.cpp runs for a Q4_1 model on a
// CPU: y (M, N) = x (M, K) @ w^T (+ bias), with w in Q4_1 blocks and x quantized per block as the layer runs.
// On a CPU with AMX tiles, steps of q4amx::MIN_ROWS rows or more widen the weights to bfloat16 instead (q4amx,
// below).
//
// Along K, weights and activations come in blocks of QK = 32. A weight block (one output column, 32 k) holds
// w = d * q + m: q in 0..15 (4 bits), d and m float16. An activation block holds x ~ dx * xq: xq in -127..127
// with dx = max |x| / 127, and sx, the exact float sum of the block's x. A block's product is then sum(w x) ~
// d * dx * sum(q xq) + m * sx: the only rounding is xq's (a relative error up to 1/254 of the block's largest
// |x|); sum(q xq) is an exact integer.
//
// Why: on AVX2, `vpmaddubsw` multiplies 32 pairs of bytes (q unsigned, xq signed) and adds neighbours into 16
// int16 lanes in one instruction, where an FMA does 8 float32 multiply-adds; the weights take 0.625 bytes
// each (4 bits, and d and m as float16 per 32: the GGUF file's own bytes) instead of 4: a tile stays in L1, one
// stream reads 6.4x fewer.
// No saturation: a pair is at most 2 * 15 * 127 = 3,810, and 8 pairs of one lane summed in int16 stay under
// 32,767 (30,480).
//
// Packed weight layout (pagoda/layers/q4_linear.py packs it): columns in tiles of NR = 16, then K blocks; per
// (tile, block) one record of 320 bytes, so that a thread reads one contiguous stream: first 256 bytes of q: for
// p in 0..3, for half h in 0..1 (columns 8h..8h+7), for column c, for i in 0..3: the byte (q[k = 4p + i] |
// q[k = 16 + 4p + i] << 4) of column 8h + c. One 32-byte load is then 8 columns' 4-k groups p (low nibbles) and
// 4 + p (high nibbles), each int32 lane one column, what `vpmaddubsw` against a broadcast 4-byte group of xq
// needs. Then the 16 columns' d, then their m, float16.
//
// Compiled at start-up by pagoda/layers/q4_linear.py (through pagoda/layers/cpp_build.py), after cpp_vector.h.
// Without AVX2 and F16C (or with PAGODA_PORTABLE) the same sums run in plain C++ (much slower; tests compare
// the two).

#if defined(__AVX2__) && defined(__F16C__) && !defined(PAGODA_PORTABLE)  // F16C: the scales
#define PAGODA_Q4_AVX2 1
// AVX-512 VNNI: `vpdpbusd` multiplies 64 byte pairs (unsigned x signed) and adds each 4 neighbours into an int32
// lane of the accumulator, what `vpmaddubsw`, `vpmaddwd` against ones and an add do in three; the VNNI tiles
// (below) are 512-bit. The integer sums are the same (no step saturates: see above and at Q8_0), so the outputs
// are too (tests build both on such a CPU, the AVX2 one with PAGODA_NO_VNNI, and compare them).
#if defined(__AVX512VNNI__) && defined(__AVX512F__) && !defined(PAGODA_NO_VNNI)
#define PAGODA_Q4_VNNI 1
// AMX with bfloat16 tiles (the Xeons since Sapphire Rapids): steps of q4amx::MIN_ROWS rows or more take the Q4_1
// and Q8_0 weights widened to bfloat16 against the rows rounded to bfloat16 (q4amx below); not with PAGODA_NO_AMX.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && !defined(PAGODA_NO_AMX)
#define PAGODA_Q4_AMX 1
#include <omp.h>
#endif
#endif
#endif

#include <type_traits>

// 2 if this build runs the AVX-512 VNNI kernels, 1 the AVX2 ones, 0 the plain C++ ones (pagoda/layers/q4_linear.py
// warns then).
extern "C" int pagoda_q4_vectorized() {
#if defined(PAGODA_Q4_VNNI)
  return 2;
#elif defined(PAGODA_Q4_AVX2)
  return 1;
#else
  return 0;
#endif
}

constexpr int64_t QK = 32;
// Output columns per tile: H vectors of 8. With ROWS rows, a k-group's 2 x ROWS broadcast activations, ROWS x H
// int16 sums and one weight vector's two nibble halves fill the 16 AVX2 registers. On the AVX2 machine
// (BENCHMARKS.md, "4-bit weights"), at 4-512 rows of the default model's shapes, ROWS x H = 3 x 2 ran at
// 110-126 G multiply-adds/s; 2 x 2, 2 x 3, 2 x 4 and 1 x 4 were within 10% of it or slower, 4 x 2 (which
// spills) 10% slower. 16 columns: any width a multiple of 16 fits (24 would exclude 4,096).
constexpr int H = 2;
constexpr int64_t NR = 8 * H;
constexpr int64_t TILE_BYTES = NR * QK / 2;
constexpr int64_t RECORD_Q4 = TILE_BYTES + 2 * NR * 2;  // q, then d and m (float16)
// Rows that share one pass over a tile's weights: 3 in the AVX2 tiles (above); 4 in the AVX-512 VNNI tiles, whose
// 32 vector registers hold 4 rows' three accumulators (two int32 sums and the float one) and whose activations
// come as broadcast memory operands. On the Zen 4 machine (`vpdpbusd` 4 cycles of latency, two 256-bit halves a
// cycle) the VNNI Q4_1 tile at 3, 4, 6 and 8 rows ran 1.15x, 1.17-1.19x, ~1.14x and 1.14x as fast as the 256-bit
// tile of 3 rows that came before it, at 16-512 rows of the default model's shapes (BENCHMARKS.md).
constexpr int ROWS = 3;
#ifdef PAGODA_Q4_VNNI
constexpr int ROWS_TILE = 4;
#else
constexpr int ROWS_TILE = ROWS;
#endif
// The first pass over a tile (its first group of rows) prefetches the record this many records ahead of the one
// it reads: each thread's records are one contiguous stream (tiles follow each other), and at one row the
// kernel's arithmetic between loads left the hardware prefetcher behind. On the AVX2 machine, one 70 MB Q4_1
// call at one row went from 15.3-17.8 to 17.2-21.0 GB/s, what a plain read of the same records reached
// (16.7-20.5 GB/s), and one stream's 120 layer calls ran 1.13-1.19x faster; 4, 16, 32 and 64 records ahead did
// about as well (BENCHMARKS.md, "Prefetching the packed weights").
constexpr int64_t PREFETCH_RECORDS = 8;

// One block of quantize (below): p (QK floats) -> out (QK int8), *dx, *sx, and *xsum where xsum is not null.
static inline void quantize_block(const float* p, int8_t* out, float* dx, float* sx, int32_t* xsum) {
#ifdef PAGODA_Q4_AVX2
  __m256 v[4];
  for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(p + 8 * j);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                            _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m256 sum = _mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3]));
  float lanes[8], sums[8];
  _mm256_storeu_ps(lanes, mx);
  _mm256_storeu_ps(sums, sum);
  float amax = 0.0f, s = 0.0f;
  for (int j = 0; j < 8; ++j) {
    amax = std::max(amax, lanes[j]);
    s += sums[j];
  }
  const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  __m256i q[4];  // rounded to nearest, ties to even (the default MXCSR mode)
  for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
  // the packs interleave 4-value groups per 128-bit lane: (0, 4, 1, 5, 2, 6, 3, 7) puts them back in order
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  if (xsum) {  // the int32 values before packing (in -127..127: the packs do not saturate them)
    int32_t ints[8];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(ints),
                        _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    int32_t total = 0;
    for (int j = 0; j < 8; ++j) total += ints[j];
    *xsum = total;
  }
#else
  float amax = 0.0f, s = 0.0f;
  for (int64_t j = 0; j < QK; ++j) {
    amax = std::max(amax, std::fabs(p[j]));
    s += p[j];
  }
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  int32_t total = 0;
  for (int64_t j = 0; j < QK; ++j) total += out[j] = int8_t(std::nearbyintf(p[j] * inv));
  if (xsum) *xsum = total;
#endif
  *dx = amax / 127.0f;
  *sx = s;
}

// x (M, K) float32 -> xq (M, K) int8, dx and sx (M, K / QK) float32, and where xsum is not null each block's sum
// of xq (M, K / QK) int32 (the VNNI Q8_0 tile's correction, below); K a multiple of QK. Rounding is to nearest,
// ties to even (nearbyintf in the default rounding mode), as torch.round.
static void quantize(const float* x, int8_t* xq, float* dx, float* sx, int32_t* xsum, int64_t M, int64_t K) {
  const int64_t blocks = M * (K / QK);
#pragma omp parallel for schedule(static) if (blocks >= 512)
  for (int64_t i = 0; i < blocks; ++i)
    quantize_block(x + i * QK, xq + i * QK, dx + i, sx + i, xsum ? xsum + i : nullptr);
}

extern "C" void pagoda_q8_quantize(const float* x, int8_t* xq, float* dx, float* sx, int64_t M, int64_t K) {
  quantize(x, xq, dx, sx, nullptr, M, K);
}

// The n-th float16 value from p, as float32.
static inline float f16_at(const uint8_t* p, int64_t n) {
  _Float16 h;
  std::memcpy(&h, p + 2 * n, sizeof(h));
  return float(h);
}

#ifdef PAGODA_Q4_AVX2
static inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// 8 float16 values (a record's scales) as float32.
static inline __m256 load8_f16(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Prefetches the lines of one record into L1 (`prefetcht0`; past the end of the weights, prefetches are harmless).
// Not `prefetchnta`, which this had until the Xeon of 2026-12-05 (AMX): there it made one stream's 30 layers of
// Q4_1 calls 2.5x slower than `prefetcht0` (6.1 against 2.4 ms, a read of their bytes 2.9 ms); on the Zen 4 machine
// the two were within 1% (BENCHMARKS.md).
template <int64_t BYTES>
static inline void prefetch_record(const uint8_t* p) {
  for (int64_t i = 0; i < BYTES; i += 64) __builtin_prefetch(p + i, 0, 3);
}

// A tile's R x 16 float32 sums, plus the bias, to y[r * N + 0..15] (both kernels below end so).
template <int R>
static void store_tile(const __m256 (&acc)[R][H], const float* bias, float* y, int64_t N) {
  for (int h = 0; h < H; ++h) {
    const __m256 bv = bias ? _mm256_loadu_ps(bias + h * 8) : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * N + h * 8, _mm256_add_ps(acc[r][h], bv));
  }
}

// Rows [0, R) of xq (row stride K) against one tile (16 columns) of the packed weights; writes y[r * N + 0..15].
#ifdef PAGODA_Q4_VNNI
// AVX-512 VNNI: a tile's 16 columns are one 512-bit vector, a record's 64 bytes for k-group p one load (the
// layout above puts columns 0-7 and 8-15 side by side). Each (row, nibble half) sums into its own accumulator:
// with one accumulator a row and both halves' `vpdpbusd` chained into it (as the AVX2 tile below chains its
// adds), a block was 8 dependent `vpdpbusd` (4 cycles each here) per accumulator, and the loop waited on them.
// The two halves' int32 sums are added once a block (exact: integers). Against that 256-bit tile with one chain
// per (row, half of the columns): see ROWS_TILE.
template <int R>
static void tile_rows(const int8_t* xq, const float* dx, const float* sx, int64_t K, const uint8_t* w,
                      const float* bias, float* y, int64_t N, bool prefetch) {
  const int64_t nb = K / QK;
  const __m512i low = _mm512_set1_epi8(0x0f);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* qb = w + b * RECORD_Q4;
    if (prefetch) prefetch_record<RECORD_Q4>(qb + PREFETCH_RECORDS * RECORD_Q4);
    __m512i s_lo[R], s_hi[R];
    for (int r = 0; r < R; ++r) s_lo[r] = s_hi[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m512i v = _mm512_loadu_si512(qb + p * 64);
      const __m512i lo = _mm512_and_si512(v, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      for (int r = 0; r < R; ++r) {
        const int8_t* a = xq + r * K + b * QK + p * 4;
        s_lo[r] = _mm512_dpbusd_epi32(s_lo[r], lo, _mm512_set1_epi32(load4(a)));
        s_hi[r] = _mm512_dpbusd_epi32(s_hi[r], hi, _mm512_set1_epi32(load4(a + 16)));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + TILE_BYTES)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + TILE_BYTES + 2 * NR)));
    for (int r = 0; r < R; ++r) {
      const __m512 sums = _mm512_cvtepi32_ps(_mm512_add_epi32(s_lo[r], s_hi[r]));
      acc[r] = _mm512_fmadd_ps(sums, _mm512_mul_ps(d, _mm512_set1_ps(dx[r * nb + b])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * nb + b]), acc[r]);
    }
  }
  const __m512 bv = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * N, _mm512_add_ps(acc[r], bv));
}
#else
template <int R>
static void tile_rows(const int8_t* xq, const float* dx, const float* sx, int64_t K, const uint8_t* w,
                      const float* bias, float* y, int64_t N, bool prefetch) {
  const int64_t nb = K / QK;
  const __m256i low = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);  // the sums' widening
  __m256 acc[R][H];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) acc[r][h] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* qb = w + b * RECORD_Q4;
    if (prefetch) prefetch_record<RECORD_Q4>(qb + PREFETCH_RECORDS * RECORD_Q4);
    __m256i s[R][H];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < H; ++h) s[r][h] = _mm256_setzero_si256();
    // p not unrolled: unrolled, GCC 12 hoists a block's 64 multiplies ahead of their adds and spills the sums
    // (79 against 99 G multiply-adds/s, BENCHMARKS.md)
#pragma GCC unroll 1
    for (int p = 0; p < 4; ++p) {
      __m256i alo[R], ahi[R];
      for (int r = 0; r < R; ++r) {
        const int8_t* a = xq + r * K + b * QK + p * 4;
        alo[r] = _mm256_set1_epi32(load4(a));
        ahi[r] = _mm256_set1_epi32(load4(a + 16));
      }
      for (int h = 0; h < H; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + (p * H + h) * 32));
        const __m256i lo = _mm256_and_si256(v, low);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int r = 0; r < R; ++r)  // int16 sums, widened once a block below
          s[r][h] = _mm256_add_epi16(s[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo, alo[r]),
                                                                _mm256_maddubs_epi16(hi, ahi[r])));
      }
    }
    for (int h = 0; h < H; ++h) {
      const __m256 d = load8_f16(qb + TILE_BYTES + h * 16);
      const __m256 m = load8_f16(qb + TILE_BYTES + 2 * NR + h * 16);
      for (int r = 0; r < R; ++r) {
        const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[r][h], ones));
        acc[r][h] = _mm256_fmadd_ps(sums, _mm256_mul_ps(d, _mm256_set1_ps(dx[r * nb + b])), acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[r * nb + b]), acc[r][h]);
      }
    }
  }
  store_tile<R>(acc, bias, y, N);
}
#endif  // PAGODA_Q4_VNNI
#else
template <int R>
static void tile_rows(const int8_t* xq, const float* dx, const float* sx, int64_t K, const uint8_t* w,
                      const float* bias, float* y, int64_t N, bool) {
  const int64_t nb = K / QK;
  for (int r = 0; r < R; ++r) {
    float acc[NR] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* qb = w + b * RECORD_Q4;
      const int8_t* a = xq + r * K + b * QK;
      for (int64_t n = 0; n < NR; ++n) {
        const int64_t h = n / 8, c = n % 8;
        int32_t isum = 0;
        for (int p = 0; p < 4; ++p) {
          for (int i = 0; i < 4; ++i) {
            const uint8_t byte = qb[(p * H + h) * 32 + c * 4 + i];
            isum += int32_t(byte & 0x0f) * a[p * 4 + i] + int32_t(byte >> 4) * a[16 + p * 4 + i];
          }
        }
        acc[n] += float(isum) * (f16_at(qb + TILE_BYTES, n) * dx[r * nb + b]) +
                  f16_at(qb + TILE_BYTES + 2 * NR, n) * sx[r * nb + b];
      }
    }
    for (int64_t n = 0; n < NR; ++n) y[r * N + n] = acc[n] + (bias ? bias[n] : 0.0f);
  }
}
#endif

// Q8_0 weights (the default model's lm_head is Q8_0 in its file): w = d * q, q in -127..127, d float16, per
// block of 32, packed like Q4_1 but a byte a weight: per (tile, block) 512 bytes, for k-group g in 0..7, half h,
// column c, i in 0..3: q[k = 4g + i] of column 8h + c, then the 16 columns' d. `vpmaddubsw` wants one
// operand unsigned: |q| against xq carrying q's sign (`vpsignb`). A pair is at most 2 * 127 * 127 = 32,258,
// so each product goes to int32 at once (`vpmaddwd`), not summed in int16 as the 4-bit ones are.
constexpr int64_t TILE_BYTES_Q8 = NR * QK;
constexpr int64_t RECORD_Q8 = TILE_BYTES_Q8 + NR * 2;

#ifdef PAGODA_Q4_VNNI
// AVX-512 VNNI, as the Q4_1 tile above: 16 columns a vector, two accumulators a row (even and odd k-groups).
// `vpsignb` has no 512-bit form, so the unsigned operand is q + 128 (the sign bit flipped, shared by the rows):
// its sum is the wanted one plus 128 * the block's sum of xq (xsum), taken off before the conversion to float.
// Exact: q + 128 <= 255, and a block's sums stay far inside int32.
template <int R>
static void tile_rows_q8(const int8_t* xq, const float* dx, const int32_t* xsum, int64_t K, const uint8_t* w,
                         const float* bias, float* y, int64_t N, bool prefetch) {
  const int64_t nb = K / QK;
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* qb = w + b * RECORD_Q8;
    if (prefetch) prefetch_record<RECORD_Q8>(qb + PREFETCH_RECORDS * RECORD_Q8);
    __m512i s[2][R];
    for (int r = 0; r < R; ++r) s[0][r] = s[1][r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      const __m512i u = _mm512_xor_si512(_mm512_loadu_si512(qb + g * 64), flip);
      for (int r = 0; r < R; ++r)
        s[g % 2][r] = _mm512_dpbusd_epi32(s[g % 2][r], u, _mm512_set1_epi32(load4(xq + r * K + b * QK + g * 4)));
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + TILE_BYTES_Q8)));
    for (int r = 0; r < R; ++r) {
      const __m512i sums =
          _mm512_sub_epi32(_mm512_add_epi32(s[0][r], s[1][r]), _mm512_set1_epi32(128 * xsum[r * nb + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(d, _mm512_set1_ps(dx[r * nb + b])), acc[r]);
    }
  }
  const __m512 bv = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * N, _mm512_add_ps(acc[r], bv));
}
#elif defined(PAGODA_Q4_AVX2)
template <int R>
static void tile_rows_q8(const int8_t* xq, const float* dx, int64_t K, const uint8_t* w, const float* bias, float* y,
                         int64_t N, bool prefetch) {
  const int64_t nb = K / QK;
  const __m256i ones = _mm256_set1_epi16(1);  // the sums' widening
  __m256 acc[R][H];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) acc[r][h] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const auto* qb = reinterpret_cast<const int8_t*>(w + b * RECORD_Q8);
    if (prefetch) prefetch_record<RECORD_Q8>(w + (b + PREFETCH_RECORDS) * RECORD_Q8);
    __m256i s[R][H];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < H; ++h) s[r][h] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int g = 0; g < 8; ++g) {
      __m256i a[R];
      for (int r = 0; r < R; ++r) a[r] = _mm256_set1_epi32(load4(xq + r * K + b * QK + g * 4));
      for (int h = 0; h < H; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + (g * H + h) * 32));
        const __m256i av = _mm256_abs_epi8(v);
        for (int r = 0; r < R; ++r)
          s[r][h] = _mm256_add_epi32(
              s[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(a[r], v)), ones));
      }
    }
    for (int h = 0; h < H; ++h) {
      const __m256 d = load8_f16(w + b * RECORD_Q8 + TILE_BYTES_Q8 + h * 16);
      for (int r = 0; r < R; ++r)
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][h]), _mm256_mul_ps(d, _mm256_set1_ps(dx[r * nb + b])),
                                    acc[r][h]);
    }
  }
  store_tile<R>(acc, bias, y, N);
}
#else
template <int R>
static void tile_rows_q8(const int8_t* xq, const float* dx, int64_t K, const uint8_t* w, const float* bias, float* y,
                         int64_t N, bool) {
  const int64_t nb = K / QK;
  for (int r = 0; r < R; ++r) {
    float acc[NR] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const auto* qb = reinterpret_cast<const int8_t*>(w + b * RECORD_Q8);
      const int8_t* a = xq + r * K + b * QK;
      for (int64_t n = 0; n < NR; ++n) {
        const int64_t h = n / 8, c = n % 8;
        int32_t isum = 0;
        for (int g = 0; g < 8; ++g)
          for (int i = 0; i < 4; ++i) isum += int32_t(qb[(g * H + h) * 32 + c * 4 + i]) * a[g * 4 + i];
        acc[n] += float(isum) * (f16_at(w + b * RECORD_Q8 + TILE_BYTES_Q8, n) * dx[r * nb + b]);
      }
    }
    for (int64_t n = 0; n < NR; ++n) y[r * N + n] = acc[n] + (bias ? bias[n] : 0.0f);
  }
}
#endif

// Runs tile(t, m, rows) for each tile t of NR columns and each group of Rows rows, then the tail (fewer), from m.
// Threads split the tiles; each runs all rows against its tile, whose weights (15 KiB of Q4_1 for K = 1,536) stay
// in L1 while the rows stream past. Blocking the rows too (32-256 KiB of xq at a time, so that they stay in L2)
// made no difference that the machine's drift did not swamp (ad hoc).
template <int R, typename Tile>
static void tail_rows(const Tile& tile, int64_t t, int64_t m, int64_t left) {
  if constexpr (R > 0) {
    if (left == R) tile(t, m, std::integral_constant<int, R>());
    else tail_rows<R - 1>(tile, t, m, left);
  }
}

template <int Rows, typename Tile>
static void for_each_tile(int64_t M, int64_t N, const Tile& tile) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N / NR; ++t) {
    int64_t m = 0;
    for (; m + Rows <= M; m += Rows) tile(t, m, std::integral_constant<int, Rows>());
    tail_rows<Rows - 1>(tile, t, m, M - m);
  }
}

// g = silu(g) * u over V vectors of floats, in place: the SiLU-and-multiply of the fused gate_up loops below (the
// silu of cpp_vector.h, as elementwise.cpp's pagoda_silu_mul runs it: the same bits).
template <int V>
static inline void silu_mul_in_place(float* g, const float* u) {
  vf x[V];
  for (int v = 0; v < V; ++v) std::memcpy(&x[v], g + v * L, sizeof(vf));
  silu<V>(x);
  for (int v = 0; v < V; ++v) {
    vf up;
    std::memcpy(&up, u + v * L, sizeof(vf));
    const vf out = x[v] * up;
    std::memcpy(g + v * L, &out, sizeof(vf));
  }
}

// The Llama MLP's gate_up projection fused with its SiLU-and-multiply: y (M, N / 2) = silu(gate) * up, where the
// weights' first N / 2 output columns are the gate's and the last N / 2 the up's (N a multiple of 2 NR). Threads
// split the gate's tiles; each computes a group of rows against gate tile t and up tile t + N / (2 NR) into two
// small buffers (in L1) and writes their SiLU-and-multiply, so the (M, N) projection never goes to memory, nor is
// read back by a separate pass: 1.06-1.07x at 512-2,048 rows; at decode sizes, where the two weight streams it
// alternates between are what counts, no faster (pagoda/layers/q4_linear.py, SILU_MUL_FUSED_MIN_ROWS).
// tile(t, m, rows, out, stride) computes rows [m, m + rows) of tile t into out.
template <int Rows, typename Tile>
static void for_each_tile_pair_silu_mul(int64_t M, int64_t N, float* y, const Tile& tile) {
  const int64_t half = N / NR / 2, ys = N / 2;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < half; ++t) {
    alignas(64) float g[Rows * NR], u[Rows * NR];
    const auto pair = [&](int64_t, int64_t m, auto rows) {
      constexpr int R = decltype(rows)::value;
      tile(t, m, rows, g, NR);
      tile(t + half, m, rows, u, NR);
      constexpr int V = R * NR / L;  // vectors of the R rows' 16 columns
      silu_mul_in_place<V>(g, u);
      for (int v = 0; v < V; ++v) std::memcpy(y + (m + v * L / NR) * ys + t * NR + (v * L) % NR, g + v * L, sizeof(vf));
    };
    int64_t m = 0;
    for (; m + Rows <= M; m += Rows) pair(t, m, std::integral_constant<int, Rows>());
    tail_rows<Rows - 1>(pair, t, m, M - m);
  }
}

// A layer's tiles (for_each_tile, y (M, N)) or, silu_mul, its gate and up tiles in pairs (y (M, N / 2)).
// tile(t, m, rows, out, stride) computes rows [m, m + rows) of tile t into out.
template <int Rows, typename Tile>
static void for_each_tile_or_pair(int64_t M, int64_t N, float* y, bool silu_mul, const Tile& tile) {
  if (silu_mul) {
    for_each_tile_pair_silu_mul<Rows>(M, N, y, tile);
  } else {
    for_each_tile<Rows>(M, N, [&](int64_t t, int64_t m, auto rows) { tile(t, m, rows, y + m * N + t * NR, N); });
  }
}

// Rows (M, K) rounded by quantize: xq, dx, sx and, where asked, the blocks' sums of xq (else xsum is null).
struct Rounded {
  int8_t* xq;
  float* dx;
  float* sx;
  int32_t* xsum;
};

// The buffers of a Rounded, kept between calls by their thread_local owners (the kernels' threads read them through
// these addresses).
struct RoundedBuffers {
  LineAlignedBuffer<int8_t> xq;
  LineAlignedBuffer<float> scales;
  LineAlignedBuffer<int32_t> xsum;

  Rounded reserve(int64_t M, int64_t K, bool sums) {
    const int64_t blocks = M * (K / QK);
    float* s = scales.reserve(2 * blocks);
    return {xq.reserve(M * K), s, s + blocks, sums ? xsum.reserve(blocks) : nullptr};
  }
};

// x (M, K) rounded by quantize into the calling thread's scratch.
static Rounded round_into_scratch(const float* x, int64_t M, int64_t K, bool sums = false) {
  thread_local RoundedBuffers buffers;
  const Rounded a = buffers.reserve(M, K, sums);
  quantize(x, a.xq, a.dx, a.sx, a.xsum, M, K);
  return a;
}

// The gate_up projection fused with its SiLU-and-multiply, as for_each_tile_pair_silu_mul, but its output rounded for
// the down projection as it is computed: into h (M, N / 2) as round_into_scratch would round that output (the same
// quantize_block on the same float32 values: the same bits), so the (M, N / 2) float32 rows are neither written nor
// read back. Threads split the output's blocks of QK columns (gate tiles 2j and 2j + 1 with their up tiles).
template <int Rows, typename Tile>
static void for_each_block_silu_mul_rounded(int64_t M, int64_t N, const Rounded& h, const Tile& tile) {
  const int64_t half = N / NR / 2, I = N / 2, nb = I / QK;
  static_assert(QK == 2 * NR, "a block of the intermediate is two tiles' columns");
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < nb; ++j) {
    alignas(64) float g[Rows * QK], u[Rows * QK];
    const auto block = [&](int64_t, int64_t m, auto rows) {
      constexpr int R = decltype(rows)::value;
      for (int64_t c = 0; c < 2; ++c) {
        tile(2 * j + c, m, rows, g + c * NR, QK);
        tile(2 * j + c + half, m, rows, u + c * NR, QK);
      }
      silu_mul_in_place<R * QK / L>(g, u);  // the R rows' block
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m + r) * nb + j;  // the block's index in h's scales
        quantize_block(g + r * QK, h.xq + i * QK, h.dx + i, h.sx + i, h.xsum ? h.xsum + i : nullptr);
      }
    };
    int64_t m = 0;
    for (; m + Rows <= M; m += Rows) block(j, m, std::integral_constant<int, Rows>());
    tail_rows<Rows - 1>(block, j, m, M - m);
  }
}

// RMSNorm with its residual add, ahead of a linear (pagoda_norm_linear, pagoda_norm_mlp): as elementwise.cpp's
// pagoda_add_rms_norm computes it for a float32 model, h = residual + x stored to residual (h = x where residual is
// null) and the normalized values weight[i] * (h[i] * inv), inv from the same rms_inverse (cpp_vector.h): the same
// bits as that call's output.
struct Norm {
  float* residual;       // (M, K), updated in place; or null
  const float* weight;   // (K)
  float eps;
};

// Row r's h (residual's row, or x's), after the residual add; inv: 1 / rms(h).
static inline const float* norm_row(const Norm& norm, const float* x, int64_t r, int64_t K, float* inv) {
  const float* h = x + r * K;
  const auto at = [](const float* p) {
    vf v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  };
  if (norm.residual) {  // in vectors: GCC kept the scalar loop scalar (res and h may overlap, as far as it knows)
    float* res = norm.residual + r * K;
    const int64_t vec_end = K - K % L;
    for (int64_t i = 0; i < vec_end; i += L) {
      const vf v = at(res + i) + at(h + i);
      std::memcpy(res + i, &v, sizeof(v));
    }
    for (int64_t i = vec_end; i < K; ++i) res[i] = res[i] + h[i];
    h = res;
  }
  *inv = rms_inverse(K, norm.eps, [&](int64_t i) { return at(h + i); }, [&](int64_t i) { return h[i]; });
  return h;
}

#ifdef PAGODA_Q4_AMX
// Q4_1 and Q8_0 on AMX tiles in bfloat16. The int8 arithmetic above needs each block's 16 x 16 integer sums taken
// out of the tiles and scaled apart (d and m change every 32 weights along K), and on the Xeon that bound `tdpbsud`
// to 1.2x the VNNI tile (BENCHMARKS.md). Here the weights are widened instead, d * q + m rounded to bfloat16, so a
// tile's dot products run along all of K without leaving the tiles: `tdpbf16ps` does 16 x 16 x 32 multiply-adds
// into float32 sums. The rows are rounded to bfloat16 (a relative error up to 2^-9 a value, where int8 blocks have
// up to 1/254 of the block's largest |x|), the weights too (2^-9 of each), and the sums are float32.
//
// A call: x rounded to bfloat16 once (rows padded with zeros to a multiple of 32); each thread takes pairs of
// 16-column tiles (a gate_up projection fused with its SiLU-and-multiply pairs gate tile t with up tile t + N / 32),
// a chunk of pairs at a time, widens their weights into its buffer in the tiles' B layout (per tile and block, 16
// rows of 16 columns' (k, k + 1) pairs: 1 KiB), and runs every 32 rows of x past them: two A tiles (16 rows x 32
// k), two B, four float32 sums 16 x 16. The threads split the pairs between them, or from ROW_SPLIT_MIN_ROWS rows
// the rows (every thread then takes every pair).
namespace q4amx {
// The fewest rows of a call that take the tiles (which compute rows in passes of 32, and widen each call's weights).
// On the Xeon, against the VNNI kernel: Q4_1 0.86-0.99x at 16 rows, 1.01-1.20x at 20, 1.17-1.36x at 24 and 1.33-1.56x
// at 28; Q8_0 (the lm_head's 49,152 outputs and 960) 0.84-0.95x at 16, 1.07-1.10x at 20 (BENCHMARKS.md, "Weight tiles
// past L1"; 32 until the tiles' loads and widening got faster).
constexpr int64_t MIN_ROWS = 20;
constexpr int64_t MR = 32;        // rows a pass: two A tiles
constexpr int64_t CHUNK = 8;      // pairs of tiles widened at a time (256 columns: 288-768 KiB of bfloat16)
constexpr int64_t B_ELEMS = 16 * 32;  // bfloat16 values of one tile's block (A or B)
constexpr int64_t PREFETCH = 2;        // blocks ahead that a pass prefetches its A tiles' lines
// Calls of this many rows (padded to MR) or more split their rows between the threads, each running its rows past
// every pair of tiles (and so widening every weight itself); fewer split the pairs, every thread running all rows.
// Split by pairs, a thread reads rows that the other rounded (or, in an MLP's down pass, whose columns the other's
// gate_up pass wrote), fresh in the other core's cache; split by rows, each reads only what it wrote itself. On the
// Xeon, against the split by pairs (same bits): q/k/v 1.05-1.15x at 320-2,048 rows, o_proj 1.08-1.20x, the MLP
// 0.96x at 320, 1.00x at 384, 1.02-1.10x at 448-2,048; at 64-256 rows widening every weight twice costs more (the
// MLP 0.76-0.96x). Defined otherwise by tests (q4_linear.q4_library's row_split_min_rows) to compare the two.
#ifndef PAGODA_ROW_SPLIT_MIN_ROWS
#define PAGODA_ROW_SPLIT_MIN_ROWS 384
#endif
constexpr int64_t ROW_SPLIT_MIN_ROWS = PAGODA_ROW_SPLIT_MIN_ROWS;

// Whether the OS lets this process use AMX tile data; asked once, when the library loads.
static const bool granted = amx_granted();

// Two float32 vectors (values of k and k + 1 for 16 columns) as bfloat16 pairs, k in each lane's low half.
static inline __m512i bf16_pairs(__m512 lo, __m512 hi) {
  // both rounded by one instruction (lo's 16 values, then hi's), then interleaved by one word permute: 2
  // instructions where widening each to 32 bits, shifting hi's and or-ing took 6 (the same bits; `q4amx` calls of
  // 32-128 rows, where widening weighs most, 1.00-1.16x, BENCHMARKS.md)
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// One Q4_1 record (16 columns, 32 k) widened to bfloat16 in the B layout: row j holds (k = 2j, 2j + 1) of each
// column. The record's row p holds k = 4p + i in its bytes' low nibbles and 16 + 4p + i in their high ones.
static void widen(const uint8_t* rec, uint16_t* out) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + TILE_BYTES)));
  const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + TILE_BYTES + 2 * NR)));
  // q as float32 by a lane permute of 0 .. 15 (`vpermps` reads only an index's low 4 bits, so the nibble needs no
  // mask): 3 vector instructions a value vector where shifting, masking and converting took 4, plus the halves'
  // masks (the same bits; `q4amx` calls of 32-128 rows 1.03-1.18x, BENCHMARKS.md)
  const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int p = 0; p < 4; ++p) {
    const __m512i v = _mm512_loadu_si512(rec + p * 64);
    for (int half = 0; half < 2; ++half) {
      __m512 f[4];
      for (int i = 0; i < 4; ++i)
        f[i] = _mm512_fmadd_ps(d, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8 * i + 4 * half), iota), m);
      const int64_t j = half * 8 + 2 * p;  // k = 2j = 16 half + 4p
      _mm512_storeu_si512(out + j * 32, bf16_pairs(f[0], f[1]));
      _mm512_storeu_si512(out + (j + 1) * 32, bf16_pairs(f[2], f[3]));
    }
  }
}

// The same for a Q8_0 record (16 columns, 32 k): its row g holds k = 4g + i, signed bytes, then 16 d.
static void widen_q8(const uint8_t* rec, uint16_t* out) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + TILE_BYTES_Q8)));
  for (int g = 0; g < 8; ++g) {
    const __m512i v = _mm512_loadu_si512(rec + g * 64);
    __m512 f[4];
    for (int i = 0; i < 4; ++i)  // byte i of each lane, sign-extended
      f[i] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * i), 24)));
    _mm512_storeu_si512(out + 2 * g * 32, bf16_pairs(f[0], f[1]));
    _mm512_storeu_si512(out + (2 * g + 1) * 32, bf16_pairs(f[2], f[3]));
  }
}

// Whether this call takes the tiles.
static inline bool takes(int64_t M) { return granted && M >= MIN_ROWS; }

// Rows padded to a multiple of MR, and the offset (in bfloat16 values) of row r's first value in the A tiles' order:
// per 16 rows and block of 32 k, the tile's 16 rows of 32 values (1 KiB, one contiguous load).
static inline int64_t padded_rows(int64_t M) { return (M + MR - 1) / MR * MR; }
static inline int64_t a_row(int64_t r, int64_t nb) { return (r / 16 * nb * 16 + r % 16) * QK; }

// The layer (q4_linear's arguments, or q8_linear's with widen_q8 and RECORD_Q8) on the tiles.
// x_ready: x already in bfloat16 in the A tiles' order (padded_rows(M) rows; x is then not read). y_next: with
// silu_mul, the output goes there instead of y, in bfloat16 in the A tiles' order for a next layer of K = N / 2 (its
// padding rows zero): the values that layer would round from y, so the same bits as through y (see mlp).
// norm: x is the norm's input, and the rows rounded are its output (Norm; the same bits as rounding that output).
template <void (*Widen)(const uint8_t*, uint16_t*), int64_t Record>
static void linear(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                   bool silu_mul, const uint16_t* x_ready = nullptr, uint16_t* y_next = nullptr,
                   const Norm* norm = nullptr) {
  const int64_t nb = K / QK, mp = padded_rows(M);
  thread_local LineAlignedBuffer<uint16_t> xs;  // x in bfloat16, mp rows (the calling thread's, kept between calls)
  uint16_t* const xw = x_ready ? nullptr : xs.reserve(mp * K);  // where x is rounded to
  const uint16_t* const xb = x_ready ? x_ready : xw;
  const int64_t tiles = N / NR, pairs = silu_mul ? tiles / 2 : (tiles + 1) / 2, yn = silu_mul ? N / 2 : N;
  const int64_t nb_next = yn / QK;
  const bool by_rows = mp >= ROW_SPLIT_MIN_ROWS;  // each thread's share: its rows (m0 .. m1) or its pairs (p0 .. p1)
#pragma omp parallel
  {
    const int nt = omp_get_num_threads(), id = omp_get_thread_num();
    // [lo, hi) of n items in units of `unit`, split between the threads as `omp for schedule(static)` would
    const auto share = [&](int64_t n, int64_t unit, int64_t* lo, int64_t* hi) {
      const int64_t units = n / unit, per = units / nt, extra = units % nt;
      *lo = (id * per + std::min<int64_t>(id, extra)) * unit;
      *hi = *lo + (per + (id < extra ? 1 : 0)) * unit;
    };
    int64_t m0 = 0, m1 = mp, p0 = 0, p1 = pairs;
    if (by_rows) {
      share(mp, MR, &m0, &m1);
    } else {
      share(pairs, 1, &p0, &p1);
    }
    // Row r of x rounded to bfloat16 (with the norm applied where given) into its place in xw
    const auto round_row = [&](int64_t r) {
      uint16_t* o = xw + a_row(r, nb);  // row r of its group's first tile
      const float* xr = r < M ? x + r * K : nullptr;  // padding rows (r >= M) read nothing
      __m512 scale = _mm512_set1_ps(1.0f);
      if (norm && r < M) {
        float inv;
        xr = norm_row(*norm, x, r, K, &inv);
        scale = _mm512_set1_ps(inv);
      }
      for (int64_t b = 0; b < nb; ++b) {
        for (int64_t h = 0; h < QK; h += 16) {
          __m256i v = _mm256_setzero_si256();
          if (r < M) {
            __m512 e = _mm512_loadu_ps(xr + b * QK + h);
            if (norm) e = _mm512_mul_ps(_mm512_loadu_ps(norm->weight + b * QK + h), _mm512_mul_ps(e, scale));
            v = (__m256i)_mm512_cvtneps_pbh(e);
          }
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + b * 16 * QK + h), v);
        }
      }
    };
    if (by_rows) {  // each thread rounds the rows it reads: no barrier
      for (int64_t r = m0; r < (x_ready ? m0 : m1); ++r) round_row(r);
    } else {
#pragma omp for schedule(static)
      for (int64_t r = 0; r < (x_ready ? 0 : mp); ++r) round_row(r);
    }
    const AmxTiles tiles_in_use;  // all eight 16 x 64 bytes (cpp_vector.h), the thread's previous ones put back after
    thread_local LineAlignedBuffer<uint16_t> wbuf;  // this thread's chunk of widened tiles, kept between calls
    uint16_t* wb = wbuf.reserve(CHUNK * 2 * nb * B_ELEMS);
    alignas(64) float c[MR * 32];                         // a pass's sums: 32 rows of the pair's 32 columns
    for (int64_t c0 = p0; c0 < p1 && m0 < m1; c0 += CHUNK) {
      const int64_t c1 = std::min(p1, c0 + CHUNK);
      // the chunk's tiles: pair q's first tile and second (absent where N has an odd number of tiles)
      const auto tile_of = [&](int64_t q, int side) { return silu_mul ? q + side * pairs : 2 * q + side; };
      for (int64_t q = c0; q < c1; ++q)
        for (int side = 0; side < 2; ++side) {
          const int64_t t = tile_of(q, side);
          if (t >= tiles) continue;
          for (int64_t b = 0; b < nb; ++b)
            Widen(w + (t * nb + b) * Record, wb + (((q - c0) * 2 + side) * nb + b) * B_ELEMS);
        }
      for (int64_t r0 = m0; r0 < m1; r0 += MR) {
        const uint16_t* a = xb + r0 * K;  // rows r0 .. r0 + 15, then r0 + 16 .. r0 + 31 (nb * 16 * QK further)
        for (int64_t q = c0; q < c1; ++q) {
          const uint16_t* b0 = wb + ((q - c0) * 2) * nb * B_ELEMS;
          const uint16_t* b1 = b0 + nb * B_ELEMS;
          const bool second = tile_of(q, 1) < tiles;
          _tile_zero(4);
          _tile_zero(5);
          _tile_zero(6);
          _tile_zero(7);
          for (int64_t b = 0; b < nb; ++b) {
            // A's lines prefetched into L1 (the hardware prefetcher alone left the tiles waiting on L2, BENCHMARKS.md);
            // B's loaded with the streaming hint and not prefetched, so that they pass through without evicting A:
            // a pass's A (32 rows: 36 KiB at K = 576) is read again by the chunk's next pairs, where its B (as much)
            // is read once a pass from L2. 1.18-1.40x at 128-2,048 rows for K = 576, no change at 1,536, same bits.
            if (b + PREFETCH < nb) {
              for (int64_t l = 0; l < 16; ++l) {
                _mm_prefetch(reinterpret_cast<const char*>(a + (b + PREFETCH) * B_ELEMS + l * 32), _MM_HINT_T0);
                _mm_prefetch(reinterpret_cast<const char*>(a + (nb + b + PREFETCH) * B_ELEMS + l * 32), _MM_HINT_T0);
              }
            }
            _tile_loadd(0, a + b * B_ELEMS, 64);
            _tile_loadd(1, a + (nb + b) * B_ELEMS, 64);
            _tile_stream_loadd(2, b0 + b * B_ELEMS, 64);
            _tile_dpbf16ps(4, 0, 2);
            _tile_dpbf16ps(6, 1, 2);
            if (second) {
              _tile_stream_loadd(3, b1 + b * B_ELEMS, 64);
              _tile_dpbf16ps(5, 0, 3);
              _tile_dpbf16ps(7, 1, 3);
            }
          }
          _tile_stored(4, c, 128);
          _tile_stored(5, c + 16, 128);
          _tile_stored(6, c + 16 * 32, 128);
          _tile_stored(7, c + 16 * 32 + 16, 128);
          const int64_t t0 = tile_of(q, 0), t1 = tile_of(q, 1);
          const __m512 bias0 = bias ? _mm512_loadu_ps(bias + t0 * NR) : _mm512_setzero_ps();
          const __m512 bias1 = bias && second ? _mm512_loadu_ps(bias + t1 * NR) : _mm512_setzero_ps();
          const int64_t rows = std::min<int64_t>(MR, M - r0);
          for (int64_t r = 0; r < rows; ++r) {
            const __m512 g = _mm512_add_ps(_mm512_load_ps(c + r * 32), bias0);
            const __m512 u = _mm512_add_ps(_mm512_load_ps(c + r * 32 + 16), bias1);
            if (silu_mul) {
              vf xv[1];
              std::memcpy(&xv[0], &g, sizeof(vf));
              silu<1>(xv);
              vf up;
              std::memcpy(&up, &u, sizeof(vf));
              const vf out = xv[0] * up;
              if (y_next) {  // columns t0 * NR .. + 15 of the next layer's row: half of its block t0 / 2
                __m512 o;
                std::memcpy(&o, &out, sizeof(vf));
                _mm256_store_si256(reinterpret_cast<__m256i*>(y_next + a_row(r0 + r, nb_next) + t0 / 2 * 16 * QK +
                                                              t0 % 2 * NR),
                                   (__m256i)_mm512_cvtneps_pbh(o));
              } else {
                std::memcpy(y + (r0 + r) * yn + t0 * NR, &out, sizeof(vf));
              }
            } else {
              float* yr = y + (r0 + r) * yn;
              _mm512_storeu_ps(yr + t0 * NR, g);
              if (second) _mm512_storeu_ps(yr + t1 * NR, u);
            }
          }
          for (int64_t r = rows; y_next && r < MR; ++r)  // padding rows: zeros, as the rounding of x writes them
            _mm256_store_si256(reinterpret_cast<__m256i*>(y_next + a_row(r0 + r, nb_next) + t0 / 2 * 16 * QK +
                                                          t0 % 2 * NR),
                               _mm256_setzero_si256());
        }
      }
    }
  }
}

// A gated MLP's two projections in one call: y = (silu(x w_gate^T) * (x w_up^T)) w_down^T, x (M, H), w_gate_up the
// gate_up layer's records (2I outputs), w_down the down layer's (I -> H), y (M, H). The gate_up pass writes its
// output straight into the down pass's bfloat16 rows in the tiles' order, where the two calls write it as float32
// (M x I: 12.6 MB at 2,048 rows of the default model), read it back and round it: the same bits, since the values
// rounded are the same float32 ones.
// norm: ahead of the gate_up pass, as linear's.
template <void (*Widen)(const uint8_t*, uint16_t*), int64_t Record>
static void mlp(const float* x, const uint8_t* w_gate_up, const uint8_t* w_down, float* y, int64_t M, int64_t H,
                int64_t I, const Norm* norm = nullptr) {
  thread_local LineAlignedBuffer<uint16_t> hs;  // the gate_up pass's output, padded_rows(M) rows of I
  uint16_t* h = hs.reserve(padded_rows(M) * I);
  linear<Widen, Record>(x, w_gate_up, nullptr, nullptr, M, 2 * I, H, true, nullptr, h, norm);
  linear<Widen, Record>(nullptr, w_down, nullptr, y, M, H, I, false, h);
}
}  // namespace q4amx
#endif

// 1 if this library's Q4_1 and Q8_0 layers take AMX tiles in bfloat16 for steps of q4amx::MIN_ROWS rows or more (a
// CPU with AMX, a compiler targeting it, the OS granting the process its tile data), else 0.
extern "C" int pagoda_q4_amx() {
#ifdef PAGODA_Q4_AMX
  return q4amx::granted ? 1 : 0;
#else
  return 0;
#endif
}

// The fewest rows of a call that take the AMX tiles where pagoda_q4_amx() is 1.
extern "C" int64_t pagoda_q4_amx_min_rows() {
#ifdef PAGODA_Q4_AMX
  return q4amx::MIN_ROWS;
#else
  return 0;
#endif
}

// The tiles' calls over rows already rounded (a), for for_each_tile_or_pair and for_each_block_silu_mul_rounded:
// tile(t, m, rows, out, stride) computes rows [m, m + rows) of tile t of the layer (w, bias, K) into out. Q8_0's
// VNNI tile takes the blocks' sums of xq too (Q8_SUMS: a must have them).
#ifdef PAGODA_Q4_VNNI
constexpr bool Q8_SUMS = true;
#else
constexpr bool Q8_SUMS = false;
#endif

template <bool Q8>
static auto tiles_of(const Rounded& a, const uint8_t* w, const float* bias, int64_t K) {
  const int64_t nb = K / QK;
  return [=](int64_t t, int64_t m, auto rows, float* out, int64_t stride) {
    constexpr int R = decltype(rows)::value;
    const float* b = bias ? bias + t * NR : nullptr;
    if constexpr (!Q8) {
      tile_rows<R>(a.xq + m * K, a.dx + m * nb, a.sx + m * nb, K, w + t * nb * RECORD_Q4, b, out, stride, m == 0);
    } else if constexpr (Q8_SUMS) {
      tile_rows_q8<R>(a.xq + m * K, a.dx + m * nb, a.xsum + m * nb, K, w + t * nb * RECORD_Q8, b, out, stride, m == 0);
    } else {
      tile_rows_q8<R>(a.xq + m * K, a.dx + m * nb, K, w + t * nb * RECORD_Q8, b, out, stride, m == 0);
    }
  };
}

// A Q4_1 (Q8 false) or Q8_0 layer over rows already rounded.
template <bool Q8>
static void packed_tiles(const Rounded& a, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N,
                         int64_t K, bool silu_mul) {
  for_each_tile_or_pair<ROWS_TILE>(M, N, y, silu_mul, tiles_of<Q8>(a, w, bias, K));
}

// A Q4_1 layer in one call: x (M, K) float32, w (N / NR, K / QK, RECORD_Q4) bytes, bias (N) float32 or null, y
// (M, N) float32; N a multiple of NR, K of QK. One call a layer, not one to round and one to multiply with the
// rounded rows in tensors: 1.7-2.1x faster at 1 row (BENCHMARKS.md). The GEMV's signature (gemv.cpp): the
// one-call decode forward (pagoda/model/one_stream.cpp) calls its linears through one function pointer.
// silu_mul: fused with the SiLU-and-multiply of the output's halves, y (M, N / 2) (for_each_tile_pair_silu_mul).
static void q4_linear(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                      bool silu_mul) {
#ifdef PAGODA_Q4_AMX
  if (q4amx::takes(M)) {
    q4amx::linear<q4amx::widen, RECORD_Q4>(x, w, bias, y, M, N, K, silu_mul);
    return;
  }
#endif
  packed_tiles<false>(round_into_scratch(x, M, K), w, bias, y, M, N, K, silu_mul);
}

extern "C" void pagoda_q4_linear(const void* x, const void* w, const void* bias, void* y, int64_t M, int64_t N,
                                 int64_t K) {
  q4_linear(static_cast<const float*>(x), static_cast<const uint8_t*>(w), static_cast<const float*>(bias),
            static_cast<float*>(y), M, N, K, false);
}

// silu(x w_gate^T + b_gate) * (x w_up^T + b_up): the same float32 bits as pagoda_q4_linear and then pagoda_silu_mul
// (elementwise.cpp, which runs the same silu from cpp_vector.h).
extern "C" void pagoda_q4_linear_silu_mul(const void* x, const void* w, const void* bias, void* y, int64_t M,
                                          int64_t N, int64_t K) {
  q4_linear(static_cast<const float*>(x), static_cast<const uint8_t*>(w), static_cast<const float*>(bias),
            static_cast<float*>(y), M, N, K, true);
}

// The Q8_0 layer, as pagoda_q4_linear: w (N / NR, K / QK, RECORD_Q8) bytes; silu_mul: fused with the
// SiLU-and-multiply of its output's halves, as pagoda_q4_linear_silu_mul.
static void q8_linear(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                      bool silu_mul) {
#ifdef PAGODA_Q4_AMX
  if (q4amx::takes(M)) {
    q4amx::linear<q4amx::widen_q8, RECORD_Q8>(x, w, bias, y, M, N, K, silu_mul);
    return;
  }
#endif
  packed_tiles<true>(round_into_scratch(x, M, K, Q8_SUMS), w, bias, y, M, N, K, silu_mul);
}

extern "C" void pagoda_q8_linear(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N,
                                 int64_t K) {
  q8_linear(x, w, bias, y, M, N, K, false);
}

extern "C" void pagoda_q8_linear_silu_mul(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M,
                                          int64_t N, int64_t K) {
  q8_linear(x, w, bias, y, M, N, K, true);
}

// A gated MLP without biases over rows already rounded (x, (M, H)): the gate_up pass rounds its SiLU-and-multiply
// output for the down pass as it computes it (for_each_block_silu_mul_rounded), so the (M, I) intermediate goes to
// the down pass in int8, not as float32 rows that the down pass reads back to round: the same bits as
// pagoda_q4_linear_silu_mul and then pagoda_q4_linear (or q8's).
template <bool Q8>
static void packed_mlp_tiles(const Rounded& x, const uint8_t* w_gate_up, const uint8_t* w_down, float* y, int64_t M,
                             int64_t H, int64_t I) {
  thread_local RoundedBuffers hs;  // the intermediate, M x I, rounded
  const Rounded h = hs.reserve(M, I, Q8 && Q8_SUMS);
  for_each_block_silu_mul_rounded<ROWS_TILE>(M, 2 * I, h, tiles_of<Q8>(x, w_gate_up, nullptr, H));
  packed_tiles<Q8>(h, w_down, nullptr, y, M, H, I, false);
}

// A gated MLP (no biases) in one call: y (M, H) = (silu(x w_gate^T) * (x w_up^T)) w_down^T, x (M, H) float32,
// w_gate_up and w_down the two layers' records (both Q4_1 when q8 is 0, both Q8_0 when 1), I the intermediate size.
// The same float32 bits as pagoda_q4_linear_silu_mul and then pagoda_q4_linear (or q8's): where the tiles take
// the step the intermediate stays in bfloat16 (q4amx::mlp); elsewhere it goes to the down pass rounded to int8
// (packed_mlp_tiles).
extern "C" void pagoda_packed_mlp(const float* x, const uint8_t* w_gate_up, const uint8_t* w_down, float* y,
                                  int64_t M, int64_t H, int64_t I, int64_t q8) {
#ifdef PAGODA_Q4_AMX
  if (q4amx::takes(M)) {
    if (q8)
      q4amx::mlp<q4amx::widen_q8, RECORD_Q8>(x, w_gate_up, w_down, y, M, H, I);
    else
      q4amx::mlp<q4amx::widen, RECORD_Q4>(x, w_gate_up, w_down, y, M, H, I);
    return;
  }
#endif
  const Rounded a = round_into_scratch(x, M, H, q8 && Q8_SUMS);
  (q8 ? packed_mlp_tiles<true> : packed_mlp_tiles<false>)(a, w_gate_up, w_down, y, M, H, I);
}

// weight * rms_norm(h) of x (M, K) float32, h = residual + x with residual (M, K) updated in place to h (or h = x
// where residual is null), rounded by quantize_block as it is computed into the calling thread's scratch: the same
// bits as round_into_scratch of pagoda_add_rms_norm's float32 output, without writing those rows and reading them
// back (the paths that do not take the AMX tiles).
static Rounded round_normed_into_scratch(const float* x, const Norm& norm, int64_t M, int64_t K, bool sums) {
  thread_local RoundedBuffers buffers;
  const Rounded a = buffers.reserve(M, K, sums);
  const int64_t nb = K / QK;
#pragma omp parallel if (M * nb >= 512)  // quantize's threshold
  {
    thread_local LineAlignedBuffer<float> row;  // one normalized row, in L1
    float* o = row.reserve(K);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < M; ++r) {
      float inv;
      const float* h = norm_row(norm, x, r, K, &inv);
      for (int64_t i = 0; i < K; i += L) {  // K: a multiple of QK, so of L
        vf w, v;
        std::memcpy(&w, norm.weight + i, sizeof(vf));
        std::memcpy(&v, h + i, sizeof(vf));
        v = w * (v * inv);
        std::memcpy(o + i, &v, sizeof(vf));
      }
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t i = r * nb + b;
        quantize_block(o + b * QK, a.xq + i * QK, a.dx + i, a.sx + i, sums ? a.xsum + i : nullptr);
      }
    }
  }
  return a;
}

// RMSNorm with its residual add (pagoda_add_rms_norm's, float32) and the linear after it in one call: y = the
// Q4_1 (q8 0) or Q8_0 (q8 1) layer of weight * rms_norm(h), h = residual + x, residual (M, K) updated in place to h
// (null: h = x); norm_weight (K), eps the norm's; w, bias, y, M, N, K as pagoda_q4_linear's. The same float32 bits
// as the two calls. Where the AMX tiles take the step the norm's pass writes its output straight into the tiles'
// bfloat16 rows, elsewhere into the int8 rows the tiles read (round_normed_into_scratch): either way the float32
// rows are not written and read back.
extern "C" void pagoda_norm_linear(const float* x, float* residual, const float* norm_weight, float eps,
                                   const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                                   int64_t q8) {
  const Norm norm{residual, norm_weight, eps};
#ifdef PAGODA_Q4_AMX
  if (q4amx::takes(M)) {
    if (q8)
      q4amx::linear<q4amx::widen_q8, RECORD_Q8>(x, w, bias, y, M, N, K, false, nullptr, nullptr, &norm);
    else
      q4amx::linear<q4amx::widen, RECORD_Q4>(x, w, bias, y, M, N, K, false, nullptr, nullptr, &norm);
    return;
  }
#endif
  const Rounded a = round_normed_into_scratch(x, norm, M, K, q8 && Q8_SUMS);
  (q8 ? packed_tiles<true> : packed_tiles<false>)(a, w, bias, y, M, N, K, false);
}

// The same ahead of a gated MLP: y (M, H) = pagoda_packed_mlp of weight * rms_norm(h), h = residual + x (M, H).
extern "C" void pagoda_norm_mlp(const float* x, float* residual, const float* norm_weight, float eps,
                                const uint8_t* w_gate_up, const uint8_t* w_down, float* y, int64_t M, int64_t H,
                                int64_t I, int64_t q8) {
  const Norm norm{residual, norm_weight, eps};
#ifdef PAGODA_Q4_AMX
  if (q4amx::takes(M)) {
    if (q8)
      q4amx::mlp<q4amx::widen_q8, RECORD_Q8>(x, w_gate_up, w_down, y, M, H, I, &norm);
    else
      q4amx::mlp<q4amx::widen, RECORD_Q4>(x, w_gate_up, w_down, y, M, H, I, &norm);
    return;
  }
#endif
  const Rounded a = round_normed_into_scratch(x, norm, M, H, q8 && Q8_SUMS);
  (q8 ? packed_mlp_tiles<true> : packed_mlp_tiles<false>)(a, w_gate_up, w_down, y, M, H, I);
}
