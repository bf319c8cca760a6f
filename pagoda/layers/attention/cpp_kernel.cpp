// Paged attention for CPUs: decodes (one query token per sequence) and prompt chunks (consecutive queries of
// one sequence, causal) against their context in the paged cache.
//
// Compiled at start-up by pagoda/layers/attention/cpp.py through inductor's C++ code cache (the compiler,
// ISA flags, OpenMP runtime and on-disk cache torch.compile uses for its own kernels), after
// pagoda/layers/cpp_vector.h (vector types, 16-bit loads, exp2_neg). The cache layout, head shapes and
// storage format are compile-time constants, #defined ahead of both:
//   PAGODA_HKV, PAGODA_G (query heads per KV head), PAGODA_D (head_dim), PAGODA_BS (block_size),
//   PAGODA_ELEM: 0 float32, 1 bfloat16, 2 float16, 3 int8, 4 fp8 (e4m3),
//   PAGODA_SCALES: 0 none, 1 a float16 scale per (token, KV head) (stored (num_blocks, HKV, BS), the block's tokens
//   innermost as in K), 2 per (block, KV head);
//   PAGODA_PREFETCH_AHEAD: 1 to prefetch K and V one block ahead of the reads, 2 a step ahead, 0 not to (Prefetcher);
//   PAGODA_PORTABLE (optional): no AVX-512 intrinsics even where the compiler targets AVX-512 (tests use
//   it to check the code other CPUs run).
//
// Why a kernel of our own: decode attention reads every context token's K and V once per layer and
// does ~2 FLOPs per byte, so it should run at memory bandwidth. SDPA first gathers the blocks into a
// contiguous copy (three passes over the context); inductor's kernel for the same plain-torch code
// reached ~6 GB/s. Here each work item is (sequence, span of blocks): it walks its blocks in table
// order, reads each block once, in place (K stored with the block's tokens innermost, see attend_span),
// converts elements to float32 in registers, and keeps a running (online) softmax per query head, so
// nothing is written but the output. Spans of one sequence are merged at the end. Measured in
// BENCHMARKS.md ("The C++ decode kernel"). Prompt chunks run the same loop (attend_span) with a few query
// rows per work item sharing each load (pagoda_paged_prefill).

#include <omp.h>

#include <vector>

constexpr int64_t HKV = PAGODA_HKV, G = PAGODA_G, HQ = HKV * G, D = PAGODA_D, BS = PAGODA_BS;

static_assert(BS % L == 0 && D % L == 0, "the kernel takes block_size and head_dim in multiples of 16");
constexpr int64_t NT = BS / L, ND = D / L;
// Independent accumulator chains for a decode's scores: with only G * NT of them (3 for the default model), each
// fused multiply-add waits for the one before; DS partial sums over interleaved d give 8-12 chains. With the
// one-instruction bfloat16 load (cpp_vector.h): bfloat16 decodes 1.09-1.11x faster, int8 1.07x, float32
// unchanged (`bench.decode_attention --versus-rev`, BENCHMARKS.md).
constexpr int64_t splits(int64_t chains) { return chains >= 8 ? 1 : chains >= 4 ? 2 : 4; }
constexpr int64_t DS = splits(G * NT);  // a decode's; R query rows have R * G * NT chains (attend_span)

#if defined(__AVX512F__)
constexpr int64_t VECTOR_REGISTERS = 32;
#else
constexpr int64_t VECTOR_REGISTERS = 16;
#endif
// Output vectors the V loop keeps in registers: three quarters of them (24 of AVX-512's 32, 12 of AVX2's 16).
constexpr int64_t ACC_REGISTERS = VECTOR_REGISTERS * 3 / 4;
// The V loop adds each token's V row into the outputs of RG query vectors (RG * ND vectors). Where they do not
// fit in ACC_REGISTERS (AVX2: 3 x 8 for the default model), it takes VC of each row's ND vectors per pass over
// the step's tokens: GCC had kept the 24 accumulators in memory, a load and a store per multiply-add, and the
// stores bound the loop. The largest divisor of ND that fits, at least 1.
constexpr int64_t out_vectors(int64_t rg) {
  int64_t vc = ND;
  while (vc > 1 && (rg * vc > ACC_REGISTERS || ND % vc != 0)) --vc;
  return vc;
}

// An int8 cache's scores by integer dot products (AVX-512 VNNI, and VBMI's byte permute), not float32 ones: see
// Int8Queries. Elsewhere (AVX2, the portable build, head_dim past 256) int8 elements are converted to float32 like
// the others.
#if PAGODA_ELEM == 3 && PAGODA_D <= 256 && defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && \
    !defined(PAGODA_PORTABLE)
#define PAGODA_INT8_DOT 1
#else
#define PAGODA_INT8_DOT 0
#endif
// Whether this build takes an int8 cache's scores by integer dot products (its outputs then differ from float32
// arithmetic's by the queries' rounding, Int8Queries).
extern "C" int pagoda_int8_dot() { return PAGODA_INT8_DOT; }
// And its weighted sum of V rows by integer dot products too (int8_values), where head_dim is a multiple of 32 and
// a step at most 256 tokens (its sums in int32).
#define PAGODA_INT8_V (PAGODA_INT8_DOT && PAGODA_D % 32 == 0 && PAGODA_BS <= 256)
// Steps of a block's K loop for one KV head: 4 of head_dim a step with integer dot products, DS otherwise.
constexpr int64_t K_STEPS = PAGODA_INT8_DOT ? D / 4 : D / DS;

// L consecutive cache elements as float32.
#if PAGODA_ELEM == 0
using elem_t = float;
static inline vf load16(const elem_t* p, const float*) {
  vf r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
#elif PAGODA_ELEM == 1
using elem_t = uint16_t;  // bfloat16: the high half of a float32
static inline vf load16(const elem_t* p, const float*) { return load_bf16(p); }
#elif PAGODA_ELEM == 2
using elem_t = _Float16;
static inline vf load16(const elem_t* p, const float*) { return load_f16(p); }
#elif PAGODA_ELEM == 3
using elem_t = int8_t;
typedef int8_t vi8 __attribute__((vector_size(L)));
static inline vf load16(const elem_t* p, const float*) {
#if defined(__AVX512F__) && !defined(PAGODA_PORTABLE)
  // GCC 12 turns the generic conversion below into scalar code, lane by lane (int8 caches ran slower than
  // float32 ones); AVX-512 converts 16 lanes in two instructions, AVX2 8 (2.6x faster on an AVX2 CPU).
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__) && !defined(PAGODA_PORTABLE)
  return vf(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  vi8 x;
  std::memcpy(&x, p, sizeof(x));
  return __builtin_convertvector(x, vf);
#endif
}
#elif PAGODA_ELEM == 4
using elem_t = uint8_t;  // fp8 (e4m3fn)
static inline vf load16(const elem_t* p, const float* table) {
#if defined(__AVX512F__) && !defined(PAGODA_PORTABLE)
  // Bit arithmetic: the sign to bit 31, exponent and mantissa to float32's top exponent and mantissa bits,
  // then a multiply by 2^120 rebiases the exponent (7 -> 127) and scales e4m3's subnormals, which land on
  // float32 subnormals, exactly. NaN (never stored: writes clamp to +-448) is not decoded.
  const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x80)), 24),
                                       _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x7f)), 20));
  return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
#elif defined(__AVX2__) && !defined(PAGODA_PORTABLE)
  const __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x80)), 24),
                                       _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7f)), 20));
  return vf(_mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f)));
#else
  vf r;  // through a table of its 256 values
  for (int64_t i = 0; i < L; ++i) r[i] = table[p[i]];
  return r;
#endif
}
#endif

// Ask for K and V before the loops read them (PAGODA_PREFETCH_AHEAD 1; 0: never). A block's K and V are each one
// contiguous run (HKV * D * BS elements), but consecutive blocks of a sequence lie anywhere in the cache, so the
// hardware prefetcher, which follows addresses within a page, cannot fetch the next ones while these are
// computed; and the loops, which load each line several times from L1 (a memory operand per multiply-add), keep
// too few of their own misses in flight to hide L3's latency, let alone memory's. So each step of CB blocks
// (below) prefetches, in this order, its other blocks' K, (a span's first step) its own V, the next step's V and the
// next step's first K: K one block ahead of the reads, whatever the span's length, and V a step ahead. A step's V is
// read after all its K and the softmax, in a pass per KV head that takes 128 of each token's 384 bytes (the default
// model's), and one block ahead its lines had not come by then: on the Xeon, 128 sequences' decode attention over
// 30 layers' float16 caches (4 KiB pages) with V a step ahead 1.06-1.07x as fast as with V a block ahead, float32
// 1.05x, bfloat16 1.035x, one sequence 0.95-1.03x; timed alone, V's loop a step ahead 1.20x, K's 0.98x (ad hoc,
// BENCHMARKS.md, "Each thread its own rows"). A span's first K is not prefetched. At the
// start of a step one line of each 4 KB page of those runs is asked for, so that the page walks (every block is a
// new page) overlap. The rest is spread over the step's work, PREFETCH_PER_STEP at each step of its K and V loops:
// in one burst at the start of a block, the prefetches waited for the core's few line-fill buffers and held up
// the block's own loads; two more a step were 0.81-0.92x as fast. They fetch into L2 (prefetcht1; into L1 was the
// same). Against prefetching the next step's blocks only (which a span of one step, 300 tokens cut into 7 spans,
// never did): one sequence of 300-2,400 tokens over 30 layers' caches 1.17-1.26x faster, 128 sequences 1.15-1.24x,
// one sequence whose cache is in L2 0.94-0.95x (`bench.decode_attention --layers 30 --versus-rev`, BENCHMARKS.md).
// The scales (float16, a few bytes a block) are left to the hardware.
//
// PAGODA_PREFETCH_AHEAD 2: a step ahead instead, for caches whose steps take too little time for a block's lead to
// cover memory's latency (int8 with integer dot products: a block's K loop is ~16 instructions a KV head): each
// step prefetches the next step's K and V blocks, all of them, and the first step of a span its own as well.
static_assert(PAGODA_PREFETCH_AHEAD >= 0 && PAGODA_PREFETCH_AHEAD <= 2, "prefetching is off (0), a block (1) or a "
              "step (2) ahead");
constexpr int64_t PREFETCH_AHEAD = PAGODA_PREFETCH_AHEAD;
// Blocks whose scores go through one online-softmax update, 64 tokens' worth: the update (maxima and sums folded
// across lanes, the corrections' exponentials, the outputs' rescale; attend_span) is paid per step rather than
// per block. Four blocks of 16 against one, when the update was a chain of dependent instructions per query head:
// bfloat16 decode attention 1.07x faster with the caches in memory, 1.15x with one layer's in L3; two blocks gave
// 1.04x and 1.09x (`bench.decode_attention --layers 30 / 1 --versus-rev`, BENCHMARKS.md).
constexpr int64_t CB = BS >= 64 ? 1 : 64 / BS;
// A batch of at least DECODE_BATCH_MIN decodes a thread takes steps of one block instead: each block's V pass then
// follows its K pass, and the prefetcher asks for the next block's K and V during each block's work; the softmax
// update runs four times as often, which costs little since it takes nine heads at a time. Against steps of 4
// blocks (ad hoc harness: the kernel alternated in one process over 30 layers' caches, consecutive blocks, Zen 4):
// 128 sequences float32 1.06x, float16 1.04-1.12x, bfloat16 1.21x, int8 1.03-1.16x; 64 float16 1.05x, int8 1.04x;
// 32 1.10x and 1.05x; but 16 int8 0.93x and, timed against the previous revision, 4-16 sequences 0.84-1.00x
// (BENCHMARKS.md, "Where float32's decode steps lose their time"). Fewer sequences, and prompt tiles, keep CB.
constexpr int64_t DECODE_BATCH_MIN = 16;
constexpr int64_t LINES = HKV * D * BS * int64_t(sizeof(elem_t)) / 64;  // of one block's K (or V)
constexpr int64_t PREFETCH_STEPS = HKV * K_STEPS + HKV * BS;          // of one block's K and V loops
constexpr int64_t PREFETCH_PER_STEP = (2 * LINES + PREFETCH_STEPS - 1) / PREFETCH_STEPS;
// Prefetches a step's runs (above), PREFETCH_PER_STEP lines at each step(). Each block's K and V are one run of
// LINES lines each: step() walks a pointer through the runs, a compare and an add per line (an index into the
// runs cost a multiply and a dozen more instructions per line, as many as the vector work of a K step).
struct Prefetcher {
  const char* run[4 * CB] = {};  // in the order they are asked for
  int64_t runs = 0, next = 0;     // runs, and the next one to start
  const char* line = nullptr;     // the next line, in [line, end) of the current run
  const char* end = nullptr;
  // The step's n blocks, followed by the next step's next (0 at the span's end); first: the span's first step.
  void start(const elem_t* kc, const elem_t* vc, const int64_t* blocks, int64_t n, int64_t next_n, bool first) {
    runs = 0;
    const auto k_run = [&](int64_t c) { run[runs++] = reinterpret_cast<const char*>(kc + blocks[c] * HKV * D * BS); };
    const auto v_run = [&](int64_t c) { run[runs++] = reinterpret_cast<const char*>(vc + blocks[c] * BS * HKV * D); };
    if (PREFETCH_AHEAD == 1) {
      for (int64_t c = 1; c < n; ++c) k_run(c);
      if (first) {
        for (int64_t c = 0; c < n; ++c) v_run(c);
      }
      for (int64_t c = n; c < n + next_n; ++c) v_run(c);
      if (next_n > 0) k_run(n);
    } else if (first) {
      for (int64_t c = 1; c < n; ++c) k_run(c);
      for (int64_t c = 0; c < n; ++c) v_run(c);
    }
    if (PREFETCH_AHEAD == 2) {
      for (int64_t c = n; c < n + next_n; ++c) k_run(c);
      for (int64_t c = n; c < n + next_n; ++c) v_run(c);
    }
    for (int64_t r = 0; r < runs; ++r) {
      for (int64_t b = 0; b < LINES * 64; b += 4096) __builtin_prefetch(run[r] + b, 0, 2);
    }
    next = 0;
    line = end = nullptr;
  }
  inline void step() {
    if constexpr (PREFETCH_AHEAD == 0) return;
#pragma GCC unroll 4
    for (int64_t i = 0; i < PREFETCH_PER_STEP; ++i, line += 64) {
      if (line == end) {
        if (next == runs) return;
        line = run[next++];
        end = line + LINES * 64;
      }
      __builtin_prefetch(line, 0, 2);
    }
  }
  void finish() {  // what the steps left (the step had fewer blocks or tokens than the next)
    if constexpr (PREFETCH_AHEAD == 0) return;
    while (line != end || next < runs) step();
  }
};

#if PAGODA_INT8_DOT
// Scores over an int8 cache with vpdpbusd, which multiplies 64 unsigned bytes by 64 signed ones and adds each four
// products into a 32-bit lane: 64 multiply-adds an instruction against a float32 FMA's 16, and no conversion of K
// to float32 (two instructions per 16 elements before the FMAs). The queries go to 16-bit fixed point, one scale
// per query vector (its largest magnitude over 32767): qi = round(q / scale), so q is rounded by about 2^-16 of
// its vector's largest magnitude (float16's own rounding is 2^-11 of each value), and the score is exact in
// integers from there: qi = 256 hi + lo with lo = qi & 255 and hi in [-128, 127], biased by 128 to an unsigned byte;
// then q . k = 256 (hi' . k - 128 sum(k)) + lo . k, three dot products a query vector shares with the other
// vectors of its KV head (sum(k) by dot products with ones). All of them fit in int32 for head_dim up to 256.
template <int64_t R>
struct Int8Queries {
  alignas(64) uint32_t hi[R * HQ][D / 4], lo[R * HQ][D / 4];  // 4 consecutive elements' bytes a word
  float scale[R * HQ];
  // q (R, HQ, D). 16 elements at a time: qi = round(x x 32767 / amax) (a multiply, not a division by the scale: a
  // tile's 1,152 scalar divisions were ~10% of a 512-token prompt's attention), then its low byte and its high one,
  // floor(qi / 256) + 128, packed 4 elements a word.
  explicit Int8Queries(const float* q) {
    for (int64_t v = 0; v < R * HQ; ++v) {
      const float* x = q + v * D;
      vf vmax = {};
      for (int64_t i = 0; i < D; i += L) {
        vf y;
        std::memcpy(&y, x + i, sizeof(y));
        y = y < 0.0f ? -y : y;
        vmax = vmax > y ? vmax : y;
      }
      const float amax = fold_max(vmax);
      scale[v] = amax > 0.0f ? amax / 32767.0f : 1.0f;
      const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
      for (int64_t i = 0; i < D; i += 16) {
        const __m512i rounded = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), inv));
        const __m512i qi = _mm512_min_epi32(_mm512_max_epi32(rounded, _mm512_set1_epi32(-32767)),
                                            _mm512_set1_epi32(32767));
        const __m512i low = _mm512_and_si512(qi, _mm512_set1_epi32(255));
        const __m512i high = _mm512_add_epi32(_mm512_srai_epi32(qi, 8), _mm512_set1_epi32(128));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(&lo[v][i / 4]), _mm512_cvtepi32_epi8(low));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(&hi[v][i / 4]), _mm512_cvtepi32_epi8(high));
      }
    }
  }
};

// The scores of one block's NT token vectors for the RG query vectors of KV head h (query vector rg is row rg / G,
// head h * G + rg % G), K's scale not applied: out[rg][t]. K is stored (D, BS) per head, tokens innermost; a step
// takes 4 rows of d and permutes each 16 tokens' 4 bytes together, as vpdpbusd reduces them.
template <int64_t R, typename Step>
static inline void int8_scores(const Int8Queries<R>& qq, const int8_t* kb, int64_t h, vf (&out)[R * G][NT],
                               Step&& step) {
  constexpr int64_t RG = R * G;
  alignas(64) static constexpr uint8_t transpose[64] = {
      0, 16, 32, 48, 1, 17, 33, 49, 2,  18, 34, 50, 3,  19, 35, 51, 4,  20, 36, 52, 5,  21, 37, 53,
      6, 22, 38, 54, 7, 23, 39, 55, 8,  24, 40, 56, 9,  25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59,
      12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};
  const __m512i perm = _mm512_load_si512(transpose);
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i sum[NT], ah[RG][NT], al[RG][NT];
  for (int64_t t = 0; t < NT; ++t) {
    sum[t] = _mm512_setzero_si512();
    for (int64_t rg = 0; rg < RG; ++rg) ah[rg][t] = al[rg][t] = _mm512_setzero_si512();
  }
  for (int64_t d4 = 0; d4 < D / 4; ++d4) {
    step();
#pragma GCC unroll 16
    for (int64_t t = 0; t < NT; ++t) {
      __m512i kv;
      if constexpr (BS == 16) {
        kv = _mm512_loadu_si512(kb + d4 * 64);
      } else {
        kv = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kb + (d4 * 4) * BS + t * L)));
        for (int64_t j = 1; j < 4; ++j) {
          const __m128i part = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kb + (d4 * 4 + j) * BS + t * L));
          kv = _mm512_inserti32x4(kv, part, int(j));
        }
      }
      kv = _mm512_permutexvar_epi8(perm, kv);
      sum[t] = _mm512_dpbusd_epi32(sum[t], ones, kv);
#pragma GCC unroll 16
      for (int64_t rg = 0; rg < RG; ++rg) {
        const int64_t v = (rg / G) * HQ + h * G + rg % G;
        ah[rg][t] = _mm512_dpbusd_epi32(ah[rg][t], _mm512_set1_epi32(int32_t(qq.hi[v][d4])), kv);
        al[rg][t] = _mm512_dpbusd_epi32(al[rg][t], _mm512_set1_epi32(int32_t(qq.lo[v][d4])), kv);
      }
    }
  }
  for (int64_t t = 0; t < NT; ++t) {
    const __m512i bias = _mm512_slli_epi32(sum[t], 7);
    for (int64_t rg = 0; rg < RG; ++rg) {
      const __m512i si = _mm512_add_epi32(_mm512_slli_epi32(_mm512_sub_epi32(ah[rg][t], bias), 8), al[rg][t]);
      const __m512 sf = _mm512_mul_ps(_mm512_cvtepi32_ps(si),
                                      _mm512_set1_ps(qq.scale[(rg / G) * HQ + h * G + rg % G]));
      std::memcpy(&out[rg][t], &sf, sizeof(vf));
    }
  }
}

#if PAGODA_INT8_V
// The largest divisor of head_dim / 32 whose 2 x rg x chunks sums fit in 16 registers, at least 1.
constexpr int64_t int8_value_chunks(int64_t rg) {
  int64_t vp = D / 32;
  while (vp > 1 && (2 * rg * vp > 16 || (D / 32) % vp != 0)) --vp;
  return vp;
}

// Adds one step's weighted V rows of KV head h to the outputs of its RG query vectors (acc, float32, rescaled here
// by the step's softmax correction, corr per (row, query head)) with vpdpwssd, which multiplies 32 pairs of int16
// and adds each pair's two products into a 32-bit lane: two tokens a lane, 16 head_dim elements a vector. A query
// vector's weights (softmax weight x the token's V scale, all >= 0) go to 15-bit fixed point against the step's
// largest, rounded by about 2^-16 of it; V's int8 rows are widened to int16 and interleaved token by token (in-lane
// unpacks, which leave head_dim in a permuted order, put back once a step). Against float32 FMAs (two conversion
// instructions and G multiply-adds per 16 elements and token): per 32 elements and two tokens, two widenings, two
// unpacks and 2 G dot products. Each step's sums stay in int32: 256 tokens x 32767 x 127 < 2^31.
// s: the step's softmax weights per (row, query head); blocks: the step's nb blocks; ntok: their tokens; step():
// the prefetcher's pace (once a token).
template <int64_t R, typename Step>
static inline void int8_values(const float (*s)[CB * BS], const int8_t* v, const _Float16* vscale,
                               const int64_t* blocks, int64_t nb, int64_t ntok, int64_t h, float* acc,
                               const float* corr, Step&& step) {
  constexpr int64_t RG = R * G;
  alignas(64) uint32_t pairs[RG][CB * BS / 2];  // a query vector's weights, two tokens' int16 a word
  float wscale[RG];
  vf sc[CB * NT];  // the step's V scales of head h, shared by its RG query vectors
  for (int64_t c = 0; c < nb; ++c) {
    for (int64_t t = 0; t < NT; ++t) {
#if PAGODA_SCALES == 1
      sc[c * NT + t] = load_f16(vscale + (blocks[c] * HKV + h) * BS + t * L);
#else
      static_assert(PAGODA_SCALES == 2, "int8 caches have scales");
      sc[c * NT + t] = vf{} + float(vscale[blocks[c] * HKV + h]);
#endif
    }
  }
  for (int64_t rg = 0; rg < RG; ++rg) {
    const float* p = s[(rg / G) * HQ + h * G + rg % G];
    alignas(64) float w[CB * BS];
    vf vmax = {};
    for (int64_t i = 0; i < nb * NT; ++i) {
      vf x;
      std::memcpy(&x, p + i * L, sizeof(x));
      x *= sc[i];
      std::memcpy(w + i * L, &x, sizeof(x));
      vmax = vmax > x ? vmax : x;
    }
    const float wmax = fold_max(vmax);
    wscale[rg] = wmax / 32767.0f;
    const __m512 inv = _mm512_set1_ps(wmax > 0.0f ? 32767.0f / wmax : 0.0f);
    for (int64_t i = 0; i < nb * BS; i += 16) {
      const __m512 x = _mm512_min_ps(_mm512_mul_ps(_mm512_load_ps(w + i), inv), _mm512_set1_ps(32767.0f));
      _mm256_store_si256(reinterpret_cast<__m256i*>(&pairs[rg][i / 2]), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(x)));
    }
  }
  // back to head_dim order: of 32 elements, the first 16 are lanes 0-3 of lo, 0-3 of hi, 4-7 of lo, 4-7 of hi
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  // VP of the D / 32 chunks a pass over the step's tokens: 2 x RG x VP sums in registers (12 for a decode's 3 query
  // vectors and both chunks of head_dim 64; a prompt's 6 take one chunk a pass, where 24 had spilled to the stack)
  constexpr int64_t VP = int8_value_chunks(RG);
  for (int64_t i0 = 0; i0 < D / 32; i0 += VP) {
    __m512i sums[RG][2 * VP];
    for (int64_t rg = 0; rg < RG; ++rg) {
      for (int64_t i = 0; i < 2 * VP; ++i) sums[rg][i] = _mm512_setzero_si512();
    }
    for (int64_t c = 0; c < nb; ++c) {
      const int64_t nt = std::min<int64_t>(BS, ntok - c * BS);  // a pair's second token may be past it: weight 0
      for (int64_t t = 0; t < nt; t += 2) {
        if (i0 == 0) {  // paced by the tokens, as if in one pass
          step();
          step();
        }
        const int8_t* r0 = v + ((blocks[c] * BS + t) * HKV + h) * D + i0 * 32;
        const int8_t* r1 = r0 + HKV * D;  // the next token's row
#pragma GCC unroll 8
        for (int64_t i = 0; i < VP; ++i) {  // 32 elements: lanes of d = 32 i + 8 (lane / 4) + lane % 4 (hi: +4)
          const __m512i a = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + i * 32)));
          const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + i * 32)));
          const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
#pragma GCC unroll 16
          for (int64_t rg = 0; rg < RG; ++rg) {
            const __m512i wp = _mm512_set1_epi32(int32_t(pairs[rg][(c * BS + t) / 2]));
            sums[rg][2 * i] = _mm512_dpwssd_epi32(sums[rg][2 * i], lo, wp);
            sums[rg][2 * i + 1] = _mm512_dpwssd_epi32(sums[rg][2 * i + 1], hi, wp);
          }
        }
      }
    }
    for (int64_t rg = 0; rg < RG; ++rg) {
      float* out = acc + ((rg / G) * HQ + h * G + rg % G) * D + i0 * 32;
      const __m512 ws = _mm512_set1_ps(wscale[rg]);
      const __m512 cr = _mm512_set1_ps(corr[(rg / G) * HQ + h * G + rg % G]);
      for (int64_t i = 0; i < VP; ++i) {
        const __m512i y0 = _mm512_permutex2var_epi32(sums[rg][2 * i], first, sums[rg][2 * i + 1]);
        const __m512i y1 = _mm512_permutex2var_epi32(sums[rg][2 * i], second, sums[rg][2 * i + 1]);
        float* o = out + i * 32;
        const __m512 o0 = _mm512_mul_ps(_mm512_loadu_ps(o), cr), o1 = _mm512_mul_ps(_mm512_loadu_ps(o + 16), cr);
        _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(y0), ws, o0));
        _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(y1), ws, o1));
      }
    }
  }
}
#endif
#endif

// Attend one span of blocks [j0, j1) of one sequence with R query rows (R = 1: a decode; more: consecutive
// positions of a prompt), row r seeing the first lens[r] tokens of the context: running max m, sum l and
// unnormalized output acc for each (row, query head), row-major. q (R, HQ, D) is pre-scaled by
// softmax_scale * log2(e), so scores are in log2 units.
//
// K blocks are stored transposed, (HKV, D, BS) per block, the block's tokens innermost: the scores of
// the BS tokens of a block are BS lanes of one vector, accumulated over d with the R * G query vectors of a
// KV head sharing each load (no horizontal sums). V blocks are (BS, HKV, D): each query vector's output
// (D lanes) stays in registers while the block's tokens are added in. Scales multiply the scores (K)
// and the softmax weights (V), never the elements. Blocks are taken cb at a time (CB, or one: DECODE_BATCH_MIN).
template <int64_t R>
static void attend_span(const float* q, const elem_t* k, const elem_t* v, const uint16_t* ks, const uint16_t* vs,
                        const float* table, const int64_t* blocks, int64_t j0, int64_t j1, const int64_t* lens,
                        float* m, float* l, float* acc, int64_t cb = CB) {
  constexpr int64_t RG = R * G;  // query vectors per KV head
  constexpr int64_t DSR = splits(RG * NT);  // DS for R rows
  // Output vectors per V pass. A decode's (R = 1) V rows come from memory and its loop waits for them: in passes it
  // ran 0.95-0.98x as fast (AVX2, `bench.decode_attention --versus-rev`), so it keeps one.
  constexpr int64_t VC = R == 1 ? ND : out_vectors(RG);
  // A prompt's tiles reread the same blocks, which stay in L2: only decodes prefetch.
  constexpr bool prefetch = R == 1 && PREFETCH_AHEAD > 0;
  alignas(64) float s[R * HQ][CB * BS];  // the step's scores, then its softmax weights
  for (int64_t h = 0; h < R * HQ; ++h) {
    m[h] = -std::numeric_limits<float>::infinity();
    l[h] = 0.0f;
    for (int64_t d = 0; d < D; ++d) acc[h * D + d] = 0.0f;
  }
  int64_t len = 0;  // the longest row's
  for (int64_t r = 0; r < R; ++r) len = std::max(len, lens[r]);
  [[maybe_unused]] const _Float16* kscale = reinterpret_cast<const _Float16*>(ks);
  [[maybe_unused]] const _Float16* vscale = reinterpret_cast<const _Float16*>(vs);
  vi32 lane;
  for (int64_t i = 0; i < L; ++i) lane[i] = int32_t(i);
#if PAGODA_INT8_DOT
  const Int8Queries<R> qq(q);
#endif
  for (int64_t j = j0; j < j1; j += cb) {  // cb <= CB blocks a step
    const int64_t nb = std::min<int64_t>(cb, j1 - j);  // blocks in this step
    const int64_t ntok = std::min<int64_t>(nb * BS, len - j * BS);  // their tokens (the last may be partial)
    Prefetcher pf;
    if (prefetch) pf.start(k, v, blocks + j, nb, std::min<int64_t>(cb, j1 - j - nb), j == j0);
    for (int64_t c = 0; c < nb; ++c) {
      const int64_t block = blocks[j + c];
      for (int64_t h = 0; h < HKV; ++h) {
        const elem_t* kb = k + (block * HKV + h) * D * BS;
        vf sp[DSR][RG][NT] = {};
#if PAGODA_INT8_DOT
        int8_scores<R>(qq, kb, h, sp[0], [&] {
          if constexpr (prefetch) pf.step();
        });
#else
        for (int64_t d0 = 0; d0 < D; d0 += DSR) {
          if constexpr (prefetch) pf.step();
#pragma GCC unroll 16
          for (int64_t e = 0; e < DSR; ++e) {
            const int64_t d = d0 + e;
            vf kd[NT];
#pragma GCC unroll 16
            for (int64_t t = 0; t < NT; ++t) kd[t] = load16(kb + d * BS + t * L, table);
#pragma GCC unroll 16
            for (int64_t rg = 0; rg < RG; ++rg) {
              const float qv = q[((rg / G) * HQ + h * G + rg % G) * D + d];
#pragma GCC unroll 16
              for (int64_t t = 0; t < NT; ++t) sp[e][rg][t] += qv * kd[t];
            }
          }
        }
#endif
#pragma GCC unroll 16
        for (int64_t rg = 0; rg < RG; ++rg) {
#pragma GCC unroll 16
          for (int64_t t = 0; t < NT; ++t) {
            vf sg = sp[0][rg][t];
#pragma GCC unroll 16
            for (int64_t e = 1; e < (PAGODA_INT8_DOT ? 1 : DSR); ++e) sg += sp[e][rg][t];
#if PAGODA_SCALES == 1
            sg *= load_f16(kscale + (block * HKV + h) * BS + t * L);  // stored (blocks, HKV, BS), like K
#elif PAGODA_SCALES == 2
            sg *= float(kscale[block * HKV + h]);
#endif
            std::memcpy(&s[(rg / G) * HQ + h * G + rg % G][c * BS + t * L], &sg, sizeof(vf));
          }
        }
      }
    }
    const int64_t nv = nb * NT;  // score vectors of the step
    // The online softmax, L query heads at a time: each head's masked maximum by lane, the L heads' maxima folded
    // together (fold_each), their corrections in one 2^x, then each head's weights and sums by lane, folded
    // together again. The corrections rescale the outputs where the V pass loads them (corr), not in a pass of
    // their own. One head after the other (a fold of its maximum, a scalar 2^x, a fold of its sum, a rescale
    // skipped where the maximum had not moved), this part cost 25% (float16 cache) to 34% (int8) of the kernel
    // with the cache in L3; so, 128 sequences of 288-480 tokens: float16 1.21x faster in L3, 1.09x from memory;
    // int8 1.28x, 1.15x; float32 1.12x, 1.05x (BENCHMARKS.md). Its outputs are the same bits.
    float corr[R * HQ];  // each (row, query head)'s correction, applied in the V pass
    const vf neg_inf = vf{} - std::numeric_limits<float>::infinity();
    for (int64_t g0 = 0; g0 < R * HQ; g0 += L) {
      const int64_t ng = std::min<int64_t>(L, R * HQ - g0);
      // each row's tokens in the step: fewer than ntok for the shorter rows, none where a row ends before it
      int64_t rtok[L];
      vf part[L];  // each head's maxima by lane, then its sums
      for (int64_t k = 0; k < L; ++k) part[k] = neg_inf;
      for (int64_t k = 0; k < ng; ++k) {
        rtok[k] = std::min<int64_t>(ntok, lens[(g0 + k) / HQ] - j * BS);
        for (int64_t c = 0; c < nv; ++c) {
          vf x;
          std::memcpy(&x, &s[g0 + k][c * L], sizeof(x));
          if (rtok[k] < nv * L) x = lane + int32_t(c * L) < int32_t(rtok[k]) ? x : neg_inf;
          part[k] = part[k] > x ? part[k] : x;
        }
      }
      vf mo = neg_inf;
      for (int64_t k = 0; k < ng; ++k) mo[k] = m[g0 + k];
      const vf top = fold_each(part, [](vf a, vf b) { return a > b ? a : b; });
      const vf mx = mo > top ? mo : top;
      // 0 where there was no maximum before (and in unused lanes, where -inf - -inf is NaN)
      const vf correction = mo == neg_inf ? vf{} : exp2_neg(mo - mx);
      for (int64_t k = 0; k < L; ++k) part[k] = vf{};
      for (int64_t k = 0; k < ng; ++k) {
        const vf mk = vf{} + mx[k];
        for (int64_t c = 0; c < nv; ++c) {
          vf p;
          std::memcpy(&p, &s[g0 + k][c * L], sizeof(p));
          p = exp2_neg(p - mk);
          if (rtok[k] < nv * L) p = lane + int32_t(c * L) < int32_t(rtok[k]) ? p : vf{};
          part[k] += p;
          std::memcpy(&s[g0 + k][c * L], &p, sizeof(p));
        }
      }
      const vf sums = fold_each(part, [](vf a, vf b) { return a + b; });
      for (int64_t k = 0; k < ng; ++k) {
        const int64_t rh = g0 + k;
        m[rh] = mx[k];
        l[rh] = l[rh] * correction[k] + sums[k];
        corr[rh] = correction[k];
      }
    }
    for (int64_t h = 0; h < HKV; ++h) {
#if PAGODA_INT8_V
      int8_values<R>(s, v, vscale, blocks + j, nb, ntok, h, acc, corr, [&] {
        if constexpr (prefetch) pf.step();
      });
#else
      // VC of the D / L output vectors at a time (all of them where they fit in registers). The outputs go to and
      // from registers a vector at a time: copied as one array (a memcpy of VC vectors), GCC moved them through
      // the stack in 16-byte halves, and each 32-byte load of a half-written vector waited for its stores (no
      // forwarding of two stores into one load); in vectors, prompts of 64-1,024 tokens 1.08-1.11x faster (AVX2,
      // float16 cache, ad hoc A/B of the two kernels alternated in one process; BENCHMARKS.md), decodes unchanged.
      for (int64_t i0 = 0; i0 < ND; i0 += VC) {
        vf a[RG][VC];
#pragma GCC unroll 16
        for (int64_t rg = 0; rg < RG; ++rg) {
#pragma GCC unroll 16
          for (int64_t i = 0; i < VC; ++i) {
            std::memcpy(&a[rg][i], acc + ((rg / G) * HQ + h * G + rg % G) * D + (i0 + i) * L, sizeof(vf));
            a[rg][i] *= corr[(rg / G) * HQ + h * G + rg % G];
          }
        }
        for (int64_t c = 0; c < nb; ++c) {
          const int64_t block = blocks[j + c];
          const int64_t nt = std::min<int64_t>(BS, ntok - c * BS);
          for (int64_t t = 0; t < nt; ++t) {
            if constexpr (prefetch) {
              if (i0 == 0) pf.step();  // paced by the tokens, as if in one pass
            }
            const elem_t* vr = v + ((block * BS + t) * HKV + h) * D + i0 * L;
#if PAGODA_SCALES == 1
            const float sc = float(vscale[(block * HKV + h) * BS + t]);
#elif PAGODA_SCALES == 2
            const float sc = float(vscale[block * HKV + h]);
#else
            const float sc = 1.0f;
#endif
            vf vd[VC];
#pragma GCC unroll 16
            for (int64_t i = 0; i < VC; ++i) vd[i] = load16(vr + i * L, table);
#pragma GCC unroll 16
            for (int64_t rg = 0; rg < RG; ++rg) {
              const float w = s[(rg / G) * HQ + h * G + rg % G][c * BS + t] * sc;
#pragma GCC unroll 16
              for (int64_t i = 0; i < VC; ++i) a[rg][i] += w * vd[i];
            }
          }
        }
#pragma GCC unroll 16
        for (int64_t rg = 0; rg < RG; ++rg) {
#pragma GCC unroll 16
          for (int64_t i = 0; i < VC; ++i) {
            std::memcpy(acc + ((rg / G) * HQ + h * G + rg % G) * D + (i0 + i) * L, &a[rg][i], sizeof(vf));
          }
        }
      }
#endif
    }
    if constexpr (prefetch) pf.finish();
  }
}

// q (B, HQ, D) float32; k cache (num_blocks, HKV, D, BS), v cache (num_blocks, BS, HKV, D); scales as described
// above or null; table: fp8 decoding table or null; block_tables (B, W) int64; seq_lens (B,) int64 (each >= 1);
// out (B, HQ, D) float32. Sequences are cut into spans of span_blocks blocks (the caller picks it so that there are
// enough work items for the threads); work (B, ceil(W / span_blocks), HQ, D + 2) float32 holds spans'
// partial results. qscale = softmax scale. q's rows are q_stride floats apart (HQ * D, or a view into the fused
// q/k/v projection's output, read in place instead of copied out first).
extern "C" void pagoda_paged_decode_rows(const float* q_in, int64_t q_stride, const elem_t* k, const elem_t* v,
                                         const uint16_t* ks, const uint16_t* vs, const float* table,
                                         const int64_t* block_tables, const int64_t* seq_lens, float* out, float* work,
                                         int64_t B, int64_t W, int64_t span_blocks, float qscale) {
  const int64_t spans = (W + span_blocks - 1) / span_blocks;
  const float log2e = 1.4426950408889634f;
  constexpr int64_t PART = HQ * (D + 2);  // one span's m, l and acc
  const int64_t step = B >= DECODE_BATCH_MIN * omp_get_max_threads() ? 1 : CB;  // blocks a step (DECODE_BATCH_MIN)
#pragma omp parallel
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < B * spans; ++item) {
      const int64_t b = item / spans, p = item % spans;
      const int64_t len = seq_lens[b];
      const int64_t nblocks = (len + BS - 1) / BS;
      const int64_t j0 = p * span_blocks, j1 = std::min(nblocks, j0 + span_blocks);
      if (j0 >= j1) continue;
      alignas(64) float q[HQ * D];
      for (int64_t i = 0; i < HQ * D; ++i) q[i] = q_in[b * q_stride + i] * (qscale * log2e);
      float* part = work + item * PART;
      attend_span<1>(q, k, v, ks, vs, table, block_tables + b * W, j0, j1, &len, part, part + HQ, part + 2 * HQ,
                     step);
    }
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      const int64_t nspans = ((seq_lens[b] + BS - 1) / BS + span_blocks - 1) / span_blocks;
      const float* parts = work + b * spans * PART;
      for (int64_t h = 0; h < HQ; ++h) {
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < nspans; ++p) mx = std::max(mx, parts[p * PART + h]);
        float total = 0.0f;
        float* o = out + (b * HQ + h) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
        for (int64_t p = 0; p < nspans; ++p) {
          const float* part = parts + p * PART;
          const float w = exp2_neg(part[h] - mx);
          total += w * part[HQ + h];
          const float* a = part + 2 * HQ + h * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
        }
        const float inv = 1.0f / total;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
    }
  }
}

// Query rows per work item of a prompt, which share each load of K and V. Where a row's G * ND output vectors fit
// in ACC_REGISTERS, as many rows as fit whole (AVX-512: 2 for the default model); otherwise as many as fit two of
// each row's vectors per pass (out_vectors; AVX2: 2 rows of 3 heads, whose K loop then has 12 accumulators).
constexpr int64_t PREFILL_ROWS = std::max<int64_t>(
    1, std::min<int64_t>(8, G * ND <= ACC_REGISTERS ? ACC_REGISTERS / (G * ND) : ACC_REGISTERS / (G * 2)));

// Causal attention for n consecutive queries of one sequence (a prompt or a chunk of one), the last at
// position seq_len - 1, over its context in the paged cache (this chunk's K and V already written there):
// query i sees the first seq_len - n + i + 1 tokens. One work item: the tile of PREFILL_ROWS rows from r0. q's row i
// at q_in + i * q_stride (float32); block_table (>= ceil(seq_len / BS),) int64; out (n, HQ, D) float32; qscale =
// softmax scale.
static void prefill_tile(const float* q_in, int64_t q_stride, const elem_t* k, const elem_t* v, const uint16_t* ks,
                         const uint16_t* vs, const float* table, const int64_t* block_table, int64_t n,
                         int64_t seq_len, int64_t r0, float* out, float qscale) {
  constexpr int64_t R = PREFILL_ROWS;
  const float log2e = 1.4426950408889634f;
  const int64_t rows = std::min(R, n - r0);  // the last tile's rows past n repeat its last row, unwritten
  alignas(64) float q[R * HQ * D];
  int64_t lens[R];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t row = r0 + std::min(r, rows - 1);
    lens[r] = seq_len - n + row + 1;
    for (int64_t i = 0; i < HQ * D; ++i) q[r * HQ * D + i] = q_in[row * q_stride + i] * (qscale * log2e);
  }
  float m[R * HQ], l[R * HQ];
  alignas(64) float acc[R * HQ * D];
  const int64_t blocks = (lens[rows - 1] + BS - 1) / BS;
  attend_span<R>(q, k, v, ks, vs, table, block_table, 0, blocks, lens, m, l, acc);
  for (int64_t rh = 0; rh < rows * HQ; ++rh) {
    const float inv = 1.0f / l[rh];
    float* o = out + r0 * HQ * D + rh * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] = acc[rh * D + d] * inv;
  }
}

// One chunk's tiles (prefill_tile), the longest first (the dynamic schedule then balances the short ones); q
// (n, HQ, D) contiguous.
extern "C" void pagoda_paged_prefill(const float* q_in, const elem_t* k, const elem_t* v, const uint16_t* ks,
                                     const uint16_t* vs, const float* table, const int64_t* block_table, int64_t n,
                                     int64_t seq_len, float* out, float qscale) {
  constexpr int64_t R = PREFILL_ROWS;
  const int64_t tiles = (n + R - 1) / R;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t it = 0; it < tiles; ++it) {
    prefill_tile(q_in, HQ * D, k, v, ks, vs, table, block_table, n, seq_len, (tiles - 1 - it) * R, out, qscale);
  }
}

// A step's S prompt chunks in one parallel region, each chunk's tiles exactly as pagoda_paged_prefill runs them
// (the same bits): chunk s has the counts[s] query rows from starts[s] of q and out (the step's rows; q's q_stride
// elements apart, a view into the q/k/v projection's rows, read in place), the context length seq_lens[s] and its
// block table at tables + table_starts[s]. The tiles of all chunks go longest context first, so that no call's last
// tiles are left to one thread and no Python runs between chunks (the same arguments as
// pagoda_paged_prefill_bf16_chunks).
extern "C" void pagoda_paged_prefill_chunks(const float* q_in, int64_t q_stride, const elem_t* k, const elem_t* v,
                                            const uint16_t* ks, const uint16_t* vs, const float* table,
                                            const int64_t* tables, const int64_t* table_starts, const int64_t* starts,
                                            const int64_t* counts, const int64_t* seq_lens, int64_t S, float* out,
                                            float qscale) {
  constexpr int64_t R = PREFILL_ROWS;
  struct Tile {
    int64_t work, s, r0;  // work: the context length of the tile's last row
  };
  std::vector<Tile> items;
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t r0 = 0; r0 < counts[s]; r0 += R) {
      items.push_back(Tile{seq_lens[s] - counts[s] + std::min(r0 + R, counts[s]), s, r0});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Tile& a, const Tile& b) { return a.work > b.work; });
  const int64_t num = static_cast<int64_t>(items.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < num; ++i) {
    const Tile& t = items[i];
    const int64_t s = t.s;
    prefill_tile(q_in + starts[s] * q_stride, q_stride, k, v, ks, vs, table, tables + table_starts[s], counts[s],
                 seq_lens[s], t.r0, out + starts[s] * HQ * D, qscale);
  }
}

#if (((PAGODA_ELEM == 1 || PAGODA_ELEM == 2) && PAGODA_SCALES == 0) || (PAGODA_ELEM == 3 && PAGODA_SCALES == 1)) && \
    PAGODA_D % 32 == 0 && PAGODA_BS % 16 == 0 && defined(__AVX512F__) && defined(__AVX512BF16__) && \
    !defined(PAGODA_PORTABLE)
// Prompt attention in bfloat16 arithmetic on AMX tiles, for bfloat16 queries over a bfloat16 cache (or a float16 or
// int8 one, below): the float32 loop above does ~16 multiply-adds per instruction, the tiles' dot products
// 16 x 16 x 32 each. Flash attention: a work item is 16 consecutive query rows of the G query heads of one KV head,
// which share each step's K and V (in L1); for each step of 64 keys and each head:
//   scores (16 x 64 float32, four tiles) = q (16 x D) . K^T, each tile summed over D in steps of 32;
//   an online softmax per row in vector code (scale, causal mask, running max and sum, 2^x to degree 4);
//   the weights rounded to bfloat16 (as SDPA's flash kernel rounds them), then out (16 x D) += weights . V,
//   64 columns of D at a time, into float32 accumulators rescaled by the softmax's correction.
// The tiles' B operand wants pairs of consecutive reduction indices side by side ("VNNI"): K as (D / 2, key,
// 2), V as (key / 2, D, 2). A first pass copies the chunk's context out of the paged cache into that layout,
// once per call (a few hundred KB), and every tile of queries reads it there. An int8 cache (a float16 scale per
// token and KV head) is widened in that pass to bfloat16, exactly (|q| <= 127 fits its 8 bits), and the scales
// are applied in float32: K's to the scores, V's to the softmax weights before they are rounded to bfloat16. Its
// queries come rounded to bfloat16 (float32 models' too). On the Xeon 2.5x the loop kernel's speed over an int8
// cache at 512 fresh tokens, 1.5x at 128 (BENCHMARKS.md). A float16 cache's values are rounded to bfloat16 in the
// packing pass (the Python side sends it here only when asked: CppAttentionBackend.bf16_prompts): 3.3x the loop
// at 512 tokens, 1.7x at 128.
// Tiles 0-3: scores, then 64 columns of out; 4 and 6: q's halves of 32 columns, then the weights (A operands);
// 5 and 7: K or V (B), alternated. All are 16 rows of 64 bytes (AmxTiles, cpp_vector.h).
//
// Where the compiler targets AVX-512 BF16 but not AMX (Zen 4), the same kernel runs the tiles' products in vector
// instructions (PAGODA_AMX_TILES 0): vdpbf16ps adds two bfloat16 products into each of 16 float32 lanes, twice the
// multiply-adds of a float32 FMA, on the same packed layout, the same softmax and the same roundings. On the Zen 4
// machine, 1.57-1.81x the loop kernel's speed over a float16 cache on 512-2,048 fresh tokens, 1.17x at 128, 1.08x
// for 16 queries after 512 tokens; at 2,048 tokens ~350 GFLOP/s, about the dot products' peak there (BENCHMARKS.md,
// "Prompt attention in bfloat16 dot products"). PAGODA_NO_AMX builds it so on an AMX machine.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && !defined(PAGODA_NO_AMX)
#define PAGODA_AMX_TILES 1
#else
#define PAGODA_AMX_TILES 0
#endif
namespace tiles {
constexpr int64_t KC = 64;  // keys per step

static inline __m512 vf_to_m512(vf x) {
  __m512 r;
  std::memcpy(&r, &x, sizeof(r));
  return r;
}

// 16 consecutive cache elements as bfloat16: a bfloat16 cache's as they are, an int8 cache's values exactly, a
// float16 cache's rounded to nearest even.
static inline __m256i bf16x16(const elem_t* p) {
#if PAGODA_ELEM == 1
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
#else
  return (__m256i)_mm512_cvtneps_pbh(vf_to_m512(load16(p, nullptr)));
#endif
}

#if !PAGODA_AMX_TILES
// A tile product in vector instructions: for p < pairs, row r's pair of bfloat16 values at x + r * x_stride + 2p is
// broadcast, and vdpbf16ps adds its products with B's vectors at b + p * b_stride + i * 2L (16 lanes of a pair each)
// into a[r][i]. Each B load is shared by the RB rows.
template <int64_t RB, int64_t NB>
static inline void dot_pairs(__m512 (&a)[RB][NB], const uint16_t* x, int64_t x_stride, const uint16_t* b,
                             int64_t b_stride, int64_t pairs) {
#pragma GCC unroll 4
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh bv[NB];
    for (int64_t i = 0; i < NB; ++i) bv[i] = (__m512bh)_mm512_loadu_si512(b + p * b_stride + i * 2 * L);
    for (int64_t r = 0; r < RB; ++r) {
      uint32_t pair;
      std::memcpy(&pair, x + r * x_stride + 2 * p, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(int32_t(pair));
      for (int64_t i = 0; i < NB; ++i) a[r][i] = _mm512_dpbf16_ps(a[r][i], xv, bv[i]);
    }
  }
}
#endif
}  // namespace tiles

#if PAGODA_AMX_TILES
// 0 once the OS lets this process use AMX tile data (Linux asks each process to request it), else -1. Only in
// builds whose kernel runs on the tiles.
extern "C" int pagoda_amx_init() {
  return amx_granted() ? 0 : -1;
}
#endif

namespace tiles {
// One prompt chunk of a call: n queries, the first at row q0 of the call's q and out, the last at position
// seq_len - 1 of its sequence; its block table; where its context goes packed (kp, vp: K as (HKV, D / 2, lp, 2),
// rows ks apart, V as (HKV, lp / 2, D, 2)) and, for an int8 cache, its scales per (KV head, key) as float32 (ksp,
// vsp; zeros past seq_len).
struct Chunk {
  int64_t q0, n, seq_len;
  const int64_t* block_table;
  int64_t lp, ks, groups, tiles;  // keys padded to whole steps, K's row stride, groups of 16 keys, tiles of 16 queries
  uint16_t* kp;
  uint16_t* vp;
  float* ksp;
  float* vsp;
};

// bfloat16 values of work a chunk of seq_len keys takes: its K and V packed (the Python side allocates as much)
static inline int64_t packed_elems(int64_t seq_len) {
  const int64_t lp = (seq_len + KC - 1) / KC * KC;
  return 2 * HKV * (lp + 8) * D;
}
}  // namespace tiles

// Prompt attention on the tiles for S chunks (of one or more sequences) in one parallel region: first every chunk's
// context is packed, then the tiles of 16 queries of all chunks are attended, the longest first (the dynamic
// schedule then balances the short ones; a call per chunk left each call's last items to one thread). q rows q_stride
// elements apart, float32 (q_f32) or bfloat16; out (rows, HQ, D) float32, the chunks' rows where their queries are.
static void prefill_bf16(const void* q_in, int64_t q_stride, bool q_f32, const elem_t* k, const elem_t* v,
                         const _Float16* kscale, const _Float16* vscale, tiles::Chunk* chunks, int64_t S, float* out,
                         uint16_t* work, float qscale) {
  using namespace tiles;
  [[maybe_unused]] const bool scaled = kscale != nullptr;
  // Lay the chunks' packed contexts and scales out, and list the work items of both passes
  int64_t scale_elems = 0;
  for (int64_t s = 0; s < S; ++s) {
    Chunk& c = chunks[s];
    c.lp = (c.seq_len + KC - 1) / KC * KC;
    // K's rows are padded by a line: at a power-of-two stride, a tile's 16 rows fall into 2 of L1's 64 sets
    c.ks = c.lp * 2 + 32;
    c.kp = work;
    c.vp = work + HKV * D / 2 * c.ks;
    work += packed_elems(c.seq_len);
    c.groups = c.lp / 16;
    c.tiles = (c.n + 15) / 16;
    scale_elems += 2 * HKV * c.lp;
  }
  std::vector<float> key_scales(kscale ? scale_elems : 0);
  std::vector<int64_t> pack_items(S + 1, 0);  // chunk s's packing items are pack_items[s] .. pack_items[s + 1] - 1
  struct Tile {
    int64_t last, s, tile, h;  // the context length of its last row (its cost), the chunk, the tile, the KV head
  };
  std::vector<Tile> tile_items;
  for (int64_t s = 0, at = 0; s < S; ++s) {
    Chunk& c = chunks[s];
    if (kscale) {
      c.ksp = key_scales.data() + at;
      c.vsp = c.ksp + HKV * c.lp;
      at += 2 * HKV * c.lp;
    } else {
      c.ksp = c.vsp = nullptr;
    }
    pack_items[s + 1] = pack_items[s] + HKV * c.groups;
    for (int64_t t = c.tiles - 1; t >= 0; --t) {
      for (int64_t h = 0; h < HKV; ++h)
        tile_items.push_back({c.seq_len - c.n + std::min(16 * t + 16, c.n), s, t, h});
    }
  }
  std::stable_sort(tile_items.begin(), tile_items.end(), [](const Tile& a, const Tile& b) { return a.last > b.last; });
  const int64_t n_tiles = int64_t(tile_items.size());
  const float log2e = 1.4426950408889634f;
#pragma omp parallel
  {
    // Pack: per (KV head, 16 keys), interleaving K's rows d, d + 1 and V's rows t, t + 1. Past seq_len: zeros.
#pragma omp for schedule(static)
    for (int64_t item = 0; item < pack_items[S]; ++item) {
      const int64_t s = std::upper_bound(pack_items.begin(), pack_items.end(), item) - pack_items.begin() - 1;
      const Chunk& ch = chunks[s];
      const int64_t seq_len = ch.seq_len, lp = ch.lp, ks = ch.ks, local = item - pack_items[s];
      uint16_t* const kp = ch.kp;
      uint16_t* const vp = ch.vp;
      float* const ksp = ch.ksp;
      float* const vsp = ch.vsp;
      const int64_t h = local / ch.groups, t0 = (local % ch.groups) * 16;
      const int64_t block = t0 < seq_len ? ch.block_table[t0 / BS] : -1, off = t0 % BS;
      if (kscale) {  // the 16 keys' scales, stored (blocks, HKV, BS) like K
        for (int64_t t = 0; t < 16; ++t) {
          const bool in = t0 + t < seq_len;
          ksp[h * lp + t0 + t] = in ? float(kscale[(block * HKV + h) * BS + off + t]) : 0.0f;
          vsp[h * lp + t0 + t] = in ? float(vscale[(block * HKV + h) * BS + off + t]) : 0.0f;
        }
      }
      for (int64_t d = 0; d < D; d += 2) {
        __m512i pair = _mm512_setzero_si512();
        if (block >= 0) {
          const elem_t* row = k + ((block * HKV + h) * D + d) * BS + off;
          const __m256i a = bf16x16(row);
          const __m256i b = bf16x16(row + BS);
          const __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);
          pair = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(lo, hi, 0x20)),
                                    _mm256_permute2x128_si256(lo, hi, 0x31), 1);
        }
        _mm512_storeu_si512(kp + (h * D / 2 + d / 2) * ks + t0 * 2, pair);
      }
      for (int64_t t = 0; t < 16; t += 2) {
        for (int64_t d = 0; d < D; d += 16) {
          __m512i pair = _mm512_setzero_si512();
          if (t0 + t < seq_len) {  // a zero weight times whatever a slot past the context holds could be NaN
            const elem_t* row = v + ((block * BS + off + t) * HKV + h) * D + d;
            const __m256i a = bf16x16(row);
            const __m256i b = t0 + t + 1 < seq_len ? bf16x16(row + HKV * D) : _mm256_setzero_si256();
            const __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);
            pair = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(lo, hi, 0x20)),
                                      _mm256_permute2x128_si256(lo, hi, 0x31), 1);
          }
          _mm512_storeu_si512(vp + ((h * lp / 2 + (t0 + t) / 2) * D + d) * 2, pair);
        }
      }
    }
    // The implicit barrier above: every tile below reads the whole packed context of its chunk.
#if PAGODA_AMX_TILES
    const AmxTiles tiles_in_use;
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < n_tiles; ++item) {
      // A tile of 16 query rows for the G query heads of KV head h, which share each step's K and V (in L1)
      const Tile& it = tile_items[item];
      const Chunk& ch = chunks[it.s];
      const int64_t n = ch.n, seq_len = ch.seq_len, lp = ch.lp, ks = ch.ks, h = it.h;
      const uint16_t* const kp = ch.kp;
      const uint16_t* const vp = ch.vp;
      [[maybe_unused]] const float* const ksp = ch.ksp;
      [[maybe_unused]] const float* const vsp = ch.vsp;
      const int64_t r0 = it.tile * 16, rows = std::min<int64_t>(16, n - r0);
      const int64_t q0 = ch.q0 + r0;  // the tile's first row of q and out
      // the tile's q rows of each head in bfloat16, zero-padded past n: float32 ones rounded here, where a torch
      // conversion had been a pass of its own over the chunk (1.6% of a q4_1 prompt run's `perf` samples)
      alignas(64) uint16_t qb[G][16 * D];
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t r = 0; r < 16; ++r) {
          uint16_t* dst = qb[g] + r * D;
          const int64_t at = (q0 + r) * q_stride + (h * G + g) * D;
          if (r >= rows) {
            std::memset(dst, 0, D * sizeof(uint16_t));
          } else if (q_f32) {
            for (int64_t d = 0; d < D; d += 16) {
              const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(static_cast<const float*>(q_in) + at + d));
              std::memcpy(dst + d, &b, sizeof(b));
            }
          } else {
            std::memcpy(dst, static_cast<const uint16_t*>(q_in) + at, D * sizeof(uint16_t));
          }
        }
      }
      alignas(64) float acc[G][16 * D] = {};
      alignas(64) float sc[16 * KC];
      alignas(64) uint16_t pw[G][16 * KC];
#if PAGODA_AMX_TILES
      alignas(64) float ob[16 * KC];  // 16 rows of up to 64 columns of out
#endif
      alignas(64) float m[G][16];  // running maxima, rows of one vector
      alignas(64) float l[G][16];   // running sums, the same
      alignas(64) float cr[G][16];  // the step's corrections of acc (softmax), applied with its sums (weigh)
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t r = 0; r < 16; ++r) m[g][r] = -std::numeric_limits<float>::infinity(), l[g][r] = 0.0f;
      }
      const int64_t first = seq_len - n + r0 + 1;      // the tile's first row's context length
      const int64_t last = first + rows - 1;          // and its last row's
      // Scores of keys kc .. kc + KC - 1 for query head g into sc. Tiles have no renaming: a load into a tile
      // that a dot product still reads waits for it, and a dot product into the tile the previous one wrote
      // waits for its result; so loads alternate between tiles 5 and 7, q's halves of 32 between 4 and 6,
      // and consecutive dot products go to different accumulators.
#if PAGODA_AMX_TILES
      auto scores = [&](int64_t kc, int64_t g) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
// q's 32 columns from d into tile Q, then the four scores tiles += them . K's rows for those columns. A macro:
// the tile intrinsics take tile numbers as literals.
#define PAGODA_SCORES_32(Q, d)                                         \
  {                                                                    \
    const uint16_t* kb = kp + (h * D / 2 + (d) / 2) * ks + kc * 2;     \
    _tile_loadd(Q, qb[g] + (d), D * 2);                                \
    _tile_loadd(5, kb, ks * 2);                                        \
    _tile_dpbf16ps(0, Q, 5);                                           \
    _tile_loadd(7, kb + 32, ks * 2);                                   \
    _tile_dpbf16ps(1, Q, 7);                                           \
    _tile_loadd(5, kb + 64, ks * 2);                                   \
    _tile_dpbf16ps(2, Q, 5);                                           \
    _tile_loadd(7, kb + 96, ks * 2);                                   \
    _tile_dpbf16ps(3, Q, 7);                                           \
  }
        for (int64_t d = 0; d < D; d += 64) {
          PAGODA_SCORES_32(4, d)
          if (d + 32 < D) PAGODA_SCORES_32(6, d + 32)
        }
#undef PAGODA_SCORES_32
        _tile_stored(0, sc, KC * 4);
        _tile_stored(1, sc + 16, KC * 4);
        _tile_stored(2, sc + 32, KC * 4);
        _tile_stored(3, sc + 48, KC * 4);
      };
#else
      // Scores in vector instructions: vdpbf16ps adds two products of bfloat16 pairs into each float32 lane; the
      // lanes are 16 keys (K's pairs of rows d, d + 1 side by side, as the tiles take them), each query row's pair
      // broadcast. Four rows by the step's four vectors of keys at a time: 16 accumulators, each K load shared by
      // four rows, K's 8 KB of the step reread from L1 by each group of rows. KV vectors of keys: on the causal
      // diagonal, the step's vectors past the tile's last row's keys are masked for every row, and are not computed
      // (their scores are set to 0, which the softmax masks).
      auto scores_of = [&]<int64_t KV>(int64_t kc, int64_t g) {
        constexpr int64_t RB = 4;       // rows at a time
        const uint16_t* kb = kp + h * D / 2 * ks + kc * 2;
        for (int64_t r0 = 0; r0 < 16; r0 += RB) {
          __m512 a[RB][KV];
          for (int64_t r = 0; r < RB; ++r) {
            for (int64_t c = 0; c < KV; ++c) a[r][c] = _mm512_setzero_ps();
          }
          dot_pairs(a, qb[g] + r0 * D, D, kb, ks, D / 2);
          for (int64_t r = 0; r < RB; ++r) {
            for (int64_t c = 0; c < KV; ++c) _mm512_store_ps(sc + (r0 + r) * KC + c * L, a[r][c]);
            for (int64_t c = KV; c < KC / L; ++c) _mm512_store_ps(sc + (r0 + r) * KC + c * L, _mm512_setzero_ps());
          }
        }
      };
      static_assert(KC / L == 4, "the steps below take 1 to 4 vectors of keys");
      auto scores = [&](int64_t kc, int64_t g) {
        const int64_t keys = std::min<int64_t>(KC, last - kc);  // that some row of the tile sees
        if (keys > 3 * L) {
          scores_of.template operator()<4>(kc, g);
        } else if (keys > 2 * L) {
          scores_of.template operator()<3>(kc, g);
        } else if (keys > L) {
          scores_of.template operator()<2>(kc, g);
        } else {
          scores_of.template operator()<1>(kc, g);
        }
      };
#endif
      // The online softmax over sc for query head g: weights (bfloat16) into pw[g], l[g] updated, the corrections of
      // acc[g] into cr[g] (weigh applies them in its pass over acc).
      auto softmax = [&](int64_t kc, int64_t g) {
        const float scale = qscale * log2e;  // scores to log2 units
#if PAGODA_ELEM == 3
        if (scaled) {  // the keys' scales
          for (int64_t r = 0; r < 16; ++r) {
#pragma omp simd
            for (int64_t c = 0; c < KC; ++c) sc[r * KC + c] *= ksp[h * lp + kc + c];
          }
        }
#endif
        // Each row's maximum (masked), then the 16 rows' new running maxima and corrections as one vector
        vf rmax[16];  // by lanes, folded together (fold_each: lane r is row r's)
        for (int64_t r = 0; r < 16; ++r) {
          const int64_t len = std::min(first + r, last) - kc;  // this row's keys in the step (rows past n: the last's)
          vf vmax = vf{} - std::numeric_limits<float>::infinity();
          for (int64_t c = 0; c < KC / L; ++c) {
            vf x;
            std::memcpy(&x, sc + r * KC + c * L, sizeof(vf));
            vi32 lane;
            for (int64_t i = 0; i < L; ++i) lane[i] = int32_t(c * L + i);
            if (len < KC) x = lane < int32_t(len) ? x : vf{} - std::numeric_limits<float>::infinity();
            vmax = vmax > x ? vmax : x;
          }
          rmax[r] = vmax;
        }
        vf mold;
        std::memcpy(&mold, m[g], sizeof(vf));
        vf mnew = fold_each(rmax, [](vf a, vf b) { return a > b ? a : b; }) * scale;
        mnew = mold > mnew ? mold : mnew;  // finite: every row has a key in the first step
        const vf corr = exp2_neg(mold - mnew);  // ~0 where mold is -inf (the first step), when l and acc are 0
        std::memcpy(m[g], &mnew, sizeof(vf));
        std::memcpy(cr[g], &corr, sizeof(vf));
        vf vsum[16];  // each row's weights by lanes, folded together as the maxima
        for (int64_t r = 0; r < 16; ++r) {
          const int64_t len = std::min(first + r, last) - kc;
          const vf shift = vf{} - mnew[r];
          vsum[r] = vf{};
          for (int64_t c = 0; c < KC / L; ++c) {
            vf x;
            std::memcpy(&x, sc + r * KC + c * L, sizeof(vf));
            vi32 lane;
            for (int64_t i = 0; i < L; ++i) lane[i] = int32_t(c * L + i);
            vf w = exp2_neg<4>(madd(x, vf{} + scale, shift));  // the weights are rounded to 8 bits
            if (len < KC) w = lane < int32_t(len) ? w : vf{};
            vf wv = w;  // times the values' scales (an int8 cache's), before the rounding
#if PAGODA_ELEM == 3
            if (scaled) {
              vf vs;
              std::memcpy(&vs, vsp + h * lp + kc + c * L, sizeof(vf));
              wv *= vs;
            }
#endif
            const __m256bh wb = _mm512_cvtneps_pbh(vf_to_m512(wv));
            std::memcpy(pw[g] + r * KC + c * L, &wb, sizeof(wb));
            vsum[r] += w;
          }
        }
        vf lv;
        std::memcpy(&lv, l[g], sizeof(vf));
        lv = lv * corr + fold_each(vsum, [](vf a, vf b) { return a + b; });
        std::memcpy(l[g], &lv, sizeof(vf));
      };
#if PAGODA_AMX_TILES
      // acc[g] += pw[g] . V for keys kc .. kc + KC - 1, out's columns 64 at a time in tiles 0-3 (D is a multiple
      // of 32: the last group may have two).
      auto weigh = [&](int64_t kc, int64_t g) {
        const uint16_t* vb = vp + (h * lp / 2 + kc / 2) * D * 2;
        _tile_loadd(4, pw[g], KC * 2);  // weights of keys kc .. kc + 31
        _tile_loadd(6, pw[g] + 32, KC * 2);  // and kc + 32 .. kc + 63
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
          const bool four = d0 + 64 <= D;
          const uint16_t* v0 = vb + d0 * 2;  // key pairs 0-15 of the step, columns d0 ..
          const uint16_t* v1 = v0 + 16 * D * 2;  // key pairs 16-31
          _tile_zero(0);
          _tile_zero(1);
          _tile_loadd(5, v0, D * 4);
          _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(7, v0 + 32, D * 4);
          _tile_dpbf16ps(1, 4, 7);
          if (four) {
            _tile_zero(2);
            _tile_zero(3);
            _tile_loadd(5, v0 + 64, D * 4);
            _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(7, v0 + 96, D * 4);
            _tile_dpbf16ps(3, 4, 7);
          }
          _tile_loadd(5, v1, D * 4);
          _tile_dpbf16ps(0, 6, 5);
          _tile_loadd(7, v1 + 32, D * 4);
          _tile_dpbf16ps(1, 6, 7);
          _tile_stored(0, ob, KC * 4);
          _tile_stored(1, ob + 16, KC * 4);
          if (four) {
            _tile_loadd(5, v1 + 64, D * 4);
            _tile_dpbf16ps(2, 6, 5);
            _tile_loadd(7, v1 + 96, D * 4);
            _tile_dpbf16ps(3, 6, 7);
            _tile_stored(2, ob + 32, KC * 4);
            _tile_stored(3, ob + 48, KC * 4);
          }
          const int64_t nc = four ? 64 : 32;
          for (int64_t r = 0; r < 16; ++r) {  // the step's correction and its sums in one pass over acc
            const float c = cr[g][r];
#pragma omp simd
            for (int64_t i = 0; i < nc; ++i) acc[g][r * D + d0 + i] = acc[g][r * D + d0 + i] * c + ob[r * KC + i];
          }
        }
      };
#else
      // acc[g] = acc[g] * the step's corrections + pw[g] . V in vector instructions: the lanes are 16 of out's
      // columns (V's pairs of keys side by side), each row's pair of weights broadcast; RB rows by all of D at
      // a time, the accumulators loaded from acc and rescaled first. Only the pairs of keys that some row sees.
      auto weigh = [&](int64_t kc, int64_t g) {
        constexpr int64_t NV = D / L;  // vectors of columns
        constexpr int64_t RB = NV >= 16 ? 1 : 16 / NV;  // rows at a time: 16 accumulators
        const uint16_t* vb = vp + (h * lp / 2 + kc / 2) * D * 2;
        const int64_t pairs = (std::min<int64_t>(KC, last - kc) + 1) / 2;
        for (int64_t r0 = 0; r0 < 16; r0 += RB) {
          __m512 a[RB][NV];
          for (int64_t r = 0; r < RB; ++r) {
            const __m512 c = _mm512_set1_ps(cr[g][r0 + r]);
            for (int64_t i = 0; i < NV; ++i) a[r][i] = _mm512_mul_ps(_mm512_load_ps(acc[g] + (r0 + r) * D + i * L), c);
          }
          dot_pairs(a, pw[g] + r0 * KC, KC, vb, 2 * D, pairs);
          for (int64_t r = 0; r < RB; ++r) {
            for (int64_t i = 0; i < NV; ++i) _mm512_store_ps(acc[g] + (r0 + r) * D + i * L, a[r][i]);
          }
        }
      };
#endif
      // Each step: all G heads' scores and softmaxes, then their weighted sums of V. A tile load of weights
      // right after the vector stores that wrote them waits for the stores to reach L1 (~14% of the kernel's
      // `perf` samples when each head's weights were loaded at once); by then only the last head's may wait.
      for (int64_t kc = 0; kc < last; kc += KC) {
        for (int64_t g = 0; g < G; ++g) {
          scores(kc, g);
          softmax(kc, g);
        }
        for (int64_t g = 0; g < G; ++g) weigh(kc, g);
      }
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t r = 0; r < rows; ++r) {
          const float inv = 1.0f / l[g][r];
          float* o = out + ((q0 + r) * HQ + h * G + g) * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] = acc[g][r * D + d] * inv;
        }
      }
    }
  }
}

// As pagoda_paged_prefill, for a bfloat16, float16 or int8 cache: q (n, HQ, D), its token rows q_stride elements
// apart, float32 (q_f32 1: rounded to bfloat16 here, to nearest even) or bfloat16 (0); work holds the packed K and V,
// tiles::packed_elems(seq_len) bfloat16 (_bf16_work_elems); kscale and vscale an int8 cache's scales (else null).
extern "C" void pagoda_paged_prefill_bf16(const void* q_in, int64_t q_stride, int64_t q_f32, const elem_t* k,
                                          const elem_t* v, const void* kscale, const void* vscale,
                                          const int64_t* block_table, int64_t n, int64_t seq_len, float* out,
                                          uint16_t* work, float qscale) {
  tiles::Chunk chunk{0, n, seq_len, block_table};
  prefill_bf16(q_in, q_stride, q_f32 != 0, k, v, static_cast<const _Float16*>(kscale),
               static_cast<const _Float16*>(vscale), &chunk, 1, out, work, qscale);
}

// The same for a step's S prompt chunks in one call: chunk s has the counts[s] query rows from starts[s] of q and out
// (the step's rows, q_stride elements apart in q), the context length seq_lens[s] and its block table at tables +
// table_starts[s]; work holds the sum of each chunk's packed K and V, as pagoda_paged_prefill_bf16's.
extern "C" void pagoda_paged_prefill_bf16_chunks(const void* q_in, int64_t q_stride, int64_t q_f32,
                                                 const elem_t* k, const elem_t* v, const void* kscale,
                                                 const void* vscale, const int64_t* tables, const int64_t* table_starts,
                                                 const int64_t* starts, const int64_t* counts, const int64_t* seq_lens,
                                                 int64_t S, float* out, uint16_t* work, float qscale) {
  std::vector<tiles::Chunk> chunks(S);
  for (int64_t s = 0; s < S; ++s) chunks[s] = tiles::Chunk{starts[s], counts[s], seq_lens[s], tables + table_starts[s]};
  prefill_bf16(q_in, q_stride, q_f32 != 0, k, v, static_cast<const _Float16*>(kscale),
               static_cast<const _Float16*>(vscale), chunks.data(), S, out, work, qscale);
}
#endif

// Write T new tokens' K and V (T, HKV, D) to their slots (block * BS + offset): token t's values at k_new + t *
// stride and v_new + t * stride, each one run of HKV * D (views into the fused q/k/v projection's rows are read in
// place; copying them out first cost two torch calls a layer, ~10 us each at 128 rows). V rows go in whole; K
// elements go to the tokens-innermost layout, stride BS apart. In is elem_t (values already in the storage dtype) or
// float (a float32 model's, rounded here to a 16-bit cache's dtype to nearest even, as torch's `.to` rounds, or
// quantized to an int8 cache with a scale per (token, KV head)). ks, vs: the scales, or null for caches without
// them. fp8 caches and per-block scales are written by torch code (pagoda/layers/kv_quant.py).
static inline elem_t to_elem(elem_t x) { return x; }
#if PAGODA_ELEM == 1
static inline elem_t to_elem(float x) { return f_to_bf16(x); }
#elif PAGODA_ELEM == 2
static inline elem_t to_elem(float x) { return elem_t(x); }  // the conversion rounds to nearest even
#endif

// n values to elem_t: float16 by `vcvtps2ph` 16 or 8 at a time (the compiler left the loop of `_Float16(x)` scalar,
// `vcvtss2sh` a value), which rounds to nearest even as that conversion does; otherwise element by element.
template <typename In>
static inline void to_elems(const In* in, elem_t* out, int64_t n) {
  if constexpr (std::is_same_v<In, elem_t>) {
    std::memcpy(out, in, n * sizeof(elem_t));
  } else {
    int64_t i = 0;
#if PAGODA_ELEM == 2 && defined(__AVX512F__) && !defined(PAGODA_PORTABLE)
    for (; i + 16 <= n; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                          _mm512_cvtps_ph(_mm512_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif PAGODA_ELEM == 2 && defined(__F16C__) && !defined(PAGODA_PORTABLE)
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < n; ++i) out[i] = to_elem(in[i]);
  }
}

template <typename In>
static void write_rows(elem_t* k, elem_t* v, const In* k_new, const In* v_new, int64_t stride, const int64_t* slots,
                       int64_t T) {
#pragma omp parallel for schedule(static) if (T >= 64)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t block = slots[t] / BS, offset = slots[t] % BS;
    const In* kr = k_new + t * stride;
    const In* vr = v_new + t * stride;
    elem_t* kb = k + block * HKV * D * BS + offset;
    elem_t* vb = v + (block * BS + offset) * HKV * D;
    // K's row converted whole into a local copy, then spread; V's straight into the cache (each value converted and
    // stored on its own, these were 2.1% of a q4_1 run's samples)
    alignas(64) elem_t kc[HKV * D];
    to_elems(kr, kc, HKV * D);
    for (int64_t i = 0; i < HKV * D; ++i) kb[i * BS] = kc[i];
    to_elems(vr, vb, HKV * D);
  }
}

extern "C" void pagoda_write_kv_rows(elem_t* k, elem_t* v, uint16_t*, uint16_t*, const elem_t* k_new,
                                     const elem_t* v_new, int64_t stride, const int64_t* slots, int64_t T) {
  write_rows(k, v, k_new, v_new, stride, slots, T);
}

#if PAGODA_ELEM == 1 || PAGODA_ELEM == 2
extern "C" void pagoda_write_kv_f32(elem_t* k, elem_t* v, uint16_t*, uint16_t*, const float* k_new,
                                    const float* v_new, int64_t stride, const int64_t* slots, int64_t T) {
  write_rows(k, v, k_new, v_new, stride, slots, T);
}
#elif PAGODA_ELEM == 3 && PAGODA_SCALES == 1
// One (token, KV head) row of D values quantized as kv_quant.quantize_rows does it, to the same bits: the scale is
// absmax / 127 in float32, clamped to [2^-24, 65504] and rounded to float16; each value x / scale (the float16
// scale as float32, a true division), clamped to +-127, rounded to nearest even. Writes the D codes `step` apart.
static inline _Float16 quantize_row(const float* x, int8_t* out, int64_t step) {
  float amax = 0.0f;
  for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(x[i]));
  const _Float16 scale = _Float16(std::min(std::max(amax / 127.0f, 0x1p-24f), 65504.0f));
  const float s = float(scale);
  for (int64_t i = 0; i < D; ++i) {
    const float y = std::min(std::max(x[i] / s, -127.0f), 127.0f);
    out[i * step] = int8_t(std::nearbyint(y));
  }
  return scale;
}

extern "C" void pagoda_write_kv_f32(elem_t* k, elem_t* v, uint16_t* ks, uint16_t* vs, const float* k_new,
                                    const float* v_new, int64_t stride, const int64_t* slots, int64_t T) {
  _Float16* kscale = reinterpret_cast<_Float16*>(ks);
  _Float16* vscale = reinterpret_cast<_Float16*>(vs);
#pragma omp parallel for schedule(static) if (T >= 64)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t block = slots[t] / BS, offset = slots[t] % BS;
    for (int64_t h = 0; h < HKV; ++h) {
      kscale[(block * HKV + h) * BS + offset] =
          quantize_row(k_new + t * stride + h * D, k + (block * HKV + h) * D * BS + offset, BS);
      vscale[(block * HKV + h) * BS + offset] =
          quantize_row(v_new + t * stride + h * D, v + ((block * BS + offset) * HKV + h) * D, 1);
    }
  }
}
#endif
