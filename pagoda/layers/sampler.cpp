// The sampler's rows without bias, penalty or min_tokens block in passes over their logits: greedy rows, random
// rows with a temperature, and random rows with top-k, top-p or min-p filters (pagoda/layers/sampler.py picks them;
// every other row runs its torch code). In torch a plain random row is 8-9 ops, each a pass over (rows x vocab)
// float32 logits: divide by the temperature, max, subtract, exp, the chunk sums of the inverse-CDF search, and a
// logsumexp for the chosen token's logprob (BENCHMARKS.md, "A fused pass for the sampler's plain rows"); a filtered
// row adds a top-k of 64 (and of 1,024 where the nucleus is not among 64), a sort of them and a scatter back.
//
// Compiled at start-up by pagoda/layers/sampler.py (through pagoda/layers/cpp_build.py), after
// cpp_vector.h; PAGODA_CHUNK (the inverse-CDF search's chunk of vocabulary entries) is #defined ahead.
//
// Per row, the same arithmetic as the torch path, with its own rounding: weights exp((x - max) / T) from
// exp2_neg (torch calls Sleef), sums in float32 added in float64 (float32 in torch's filters), then the first token
// whose cumulative weight exceeds u * total. A token of weight 0 is never chosen. So a draw can pick the
// neighbouring token where it falls within float32 rounding of a boundary between two tokens, and a filter can keep
// or drop a token that lies within rounding of its threshold, but a row's token depends only on its own logits and
// draw: a row always takes this path or always the torch one, whatever else is in the batch.

#include <vector>

constexpr int64_t CHUNK = PAGODA_CHUNK;
static_assert(CHUNK % L == 0, "a chunk is whole vectors");
constexpr float LOG2E = 1.4426950408889634f;

static inline vf load_f32(const float* p) {
  vf r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}

// exp(y) for y <= 0 from exp2_neg, exactly 0 where y is below float32's normal range (exp2_neg stops at
// 2^-126 there; a -inf logit must have probability 0).
static inline vf exp_neg(vf y) {
  const vf t = y * LOG2E;
  return t < -126.0f ? vf{} : exp2_neg(t);
}
static inline float exp_neg(float y) { return y * LOG2E < -126.0f ? 0.0f : exp2_neg(y * LOG2E); }

// The largest of a row's V logits: whole vectors, then a scalar tail.
static inline float row_max(const float* x, int64_t V) {
  vf vmax = vf{} - std::numeric_limits<float>::infinity();
  int64_t i = 0;
  for (; i + L <= V; i += L) {
    const vf v = load_f32(x + i);
    vmax = v > vmax ? v : vmax;
  }
  float m = hmax(vmax);
  for (; i < V; ++i) m = std::max(m, x[i]);
  return m;
}

// Sum of exp((x[i] - m) * inv_t) over [lo, hi): whole vectors, then a scalar tail.
static inline float weight_sum(const float* x, int64_t lo, int64_t hi, float m, float inv_t) {
  vf acc = {};
  int64_t i = lo;
  for (; i + L <= hi; i += L) acc += exp_neg((load_f32(x + i) - m) * inv_t);
  float s = hsum(acc);
  for (; i < hi; ++i) s += exp_neg((x[i] - m) * inv_t);
  return s;
}

// The filtered rows' search (top-k, top-p, min-p; pagoda_sample below). A row's candidates are the tokens whose
// scaled logit y = (x - max) / t lies within LEVEL[j] of the top (y >= -LEVEL[j]), for the first level j known to
// hold every token the filters keep, else every token: one pass counts each level's tokens, sums their weights and
// takes the largest weight left outside; a second gathers the level's tokens, which are then sorted (logit
// descending, ties by id, the torch path's stable sort) and walked. A level is a whole prefix of that order, since y
// only grows with x. A trained model's nucleus mostly lies within a few nats of the top, so the sort is of tens of
// tokens, not of the 49,152 the torch path sorts (or takes 64 and 1,024 best of).
constexpr int LEVELS = 4;
constexpr float LEVEL[LEVELS] = {2.0f, 5.0f, 10.0f, 20.0f};

struct Candidate {
  float x, w;  // the logit and its weight exp(y)
  int32_t id;
};

struct Levels {
  double total = 0.0;                // every token's weight: the softmax's sum when top-k is off
  double mass[LEVELS] = {};          // the weight of each level's tokens
  int64_t count[LEVELS] = {};        // how many tokens each level holds
  float left_max[LEVELS] = {};       // the largest weight of a token outside each level
};

static inline bool any_lane(vi32 mask) {
#if defined(__AVX512F__) && !defined(PAGODA_PORTABLE)
  __m512i m;
  std::memcpy(&m, &mask, sizeof(m));
  return _mm512_test_epi32_mask(m, m) != 0;
#else
  for (int64_t l = 0; l < L; ++l) {
    if (mask[l]) return true;
  }
  return false;
#endif
}

// One pass over a row: every weight, and each level's count, weight and largest weight left out. Chunk sums in
// float32, added in float64 (as the plain rows' sums).
static Levels level_sums(const float* x, int64_t V, float m, float inv_t) {
  Levels s;
  for (int64_t lo = 0; lo < V; lo += CHUNK) {
    const int64_t hi = std::min(V, lo + CHUNK);
    vf total = {}, mass[LEVELS] = {}, left[LEVELS] = {};
    vi32 count[LEVELS] = {};
    int64_t i = lo;
    for (; i + L <= hi; i += L) {
      const vf y = (load_f32(x + i) - m) * inv_t;
      const vf w = exp_neg(y);
      total += w;
      for (int j = 0; j < LEVELS; ++j) {
        const vi32 in = y >= -LEVEL[j];
        mass[j] += in ? w : vf{};
        count[j] -= in;  // true is -1
        left[j] = in ? left[j] : (w > left[j] ? w : left[j]);
      }
    }
    s.total += hsum(total);
    for (int j = 0; j < LEVELS; ++j) {
      s.mass[j] += hsum(mass[j]);
      for (int64_t l = 0; l < L; ++l) s.count[j] += count[j][l];
      s.left_max[j] = std::max(s.left_max[j], hmax(left[j]));
    }
    for (; i < hi; ++i) {  // the tail: the same arithmetic one value at a time
      const float y = (x[i] - m) * inv_t, w = exp_neg(y);
      s.total += w;
      for (int j = 0; j < LEVELS; ++j) {
        if (y >= -LEVEL[j]) {
          s.mass[j] += w;
          ++s.count[j];
        } else {
          s.left_max[j] = std::max(s.left_max[j], w);
        }
      }
    }
  }
  return s;
}

// The tokens with y >= lowest (every token but NaN for lowest = -inf), in id order, into g.
static void gather(const float* x, int64_t V, float m, float inv_t, float lowest, std::vector<Candidate>& g) {
  g.clear();
  int64_t i = 0;
  for (; i + L <= V; i += L) {
    const vf y = (load_f32(x + i) - m) * inv_t;
    const vi32 in = y >= lowest;
    if (!any_lane(in)) continue;
    const vf w = exp_neg(y);
    for (int64_t l = 0; l < L; ++l) {
      if (in[l]) g.push_back({x[i + l], w[l], int32_t(i + l)});
    }
  }
  for (; i < V; ++i) {
    const float y = (x[i] - m) * inv_t;
    if (y >= lowest) g.push_back({x[i], exp_neg(y), int32_t(i)});
  }
}

// A filtered random row (t > 0): the token its filters and its draw u give, -1 where no token has weight
// (a broken row; the caller takes the first maximum). k: top-k (V for none); p: top-p (1 for none); mp: min-p
// (0 for none). Same semantics as the torch path (pagoda/layers/sampler.py): top-k keeps the first k of the stable
// order; top-p then keeps each token whose better-ranked tokens hold less than p of the top-k distribution's mass;
// min-p then drops tokens whose weight is below mp times the top token's; the kept tokens are searched in id order
// for the first whose cumulative weight exceeds u times theirs. Sums in float64 here, float32 there: a token whose
// mass before it lies within rounding of p may be kept by one and not the other.
static int64_t sample_filtered(const float* row, int64_t V, float m, float t, int64_t k, float p, float mp, double u,
                               std::vector<Candidate>& g) {
  const float inv_t = 1.0f / t;
  const Levels s = level_sums(row, V, m, inv_t);
  const float top_weight = exp_neg(0.0f);
  for (int level = 0; level <= LEVELS; ++level) {
    if (level < LEVELS) {
      const bool holds = k < V ? s.count[level] >= k
                         : p < 1.0f ? s.mass[level] >= double(p) * s.total
                                    : s.left_max[level] < mp * top_weight;
      if (!holds) continue;
    }
    gather(row, V, m, inv_t, level < LEVELS ? -LEVEL[level] : -std::numeric_limits<float>::infinity(), g);
    std::sort(g.begin(), g.end(),
              [](const Candidate& a, const Candidate& b) { return a.x > b.x || (a.x == b.x && a.id < b.id); });
    int64_t cut = std::min<int64_t>(k, int64_t(g.size()));
    double mass = s.total;
    if (k < V) {
      mass = 0.0;
      for (int64_t r = 0; r < cut; ++r) mass += g[r].w;
    }
    if (p < 1.0f) {
      const double nucleus = double(p) * mass;
      double before = 0.0;
      int64_t r = 0;
      for (; r < cut && before < nucleus; ++r) before += g[r].w;
      // every candidate kept and still short of the nucleus: the tokens past them may belong to it
      if (r == cut && before < nucleus && k >= V && level < LEVELS) continue;
      cut = r;
    }
    if (cut == 0) return -1;
    const float lowest = mp * g[0].w;  // min-p: the top token is g[0]
    int64_t n = 0;
    for (int64_t r = 0; r < cut; ++r) {
      if (g[r].w >= lowest && g[r].w > 0.0f) g[n++] = g[r];
    }
    std::sort(g.begin(), g.begin() + n, [](const Candidate& a, const Candidate& b) { return a.id < b.id; });
    double total = 0.0;
    for (int64_t r = 0; r < n; ++r) total += g[r].w;
    const double target = u * total;
    double acc = 0.0;
    for (int64_t r = 0; r < n; ++r) {
      acc += g[r].w;
      if (acc > target) return g[r].id;
    }
    return n > 0 ? g[n - 1].id : -1;
  }
  return -1;  // not reached: the last level holds every token
}

// x: logits, row r at x + rows[r] * stride, V entries; temps (R,): 0 for greedy; top_k (R,), top_p (R,), min_p
// (R,): each random row's filters (V, 1 and 0 for none; the three may be null: no row has any); u (R,): each
// random row's uniform draw in [0, 1) (ignored for greedy rows); ids (R,) and logprobs (R,) out: the chosen token
// and its raw logprob (logit - logsumexp over the row, before the temperature). work: R * ceil(V / CHUNK) float64.
extern "C" void pagoda_sample(const float* x, const int64_t* rows, int64_t R, int64_t V, int64_t stride,
                              const float* temps, const int64_t* top_k, const float* top_p, const float* min_p,
                              const double* u, int64_t* ids, double* logprobs, double* work) {
  const int64_t chunks = (V + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) {
    const float* row = x + rows[r] * stride;
    const float m = row_max(row, V);
    const float t = temps[r];
    const bool filtered = t > 0.0f && top_k != nullptr && (top_k[r] < V || top_p[r] < 1.0f || min_p[r] > 0.0f);
    // logsumexp of the raw row, in float64 across chunks; with T == 1, the chunk sums are also a plain row's weights'
    double* cdf = work + r * chunks;
    double lse_sum = 0.0, total = 0.0;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t lo = c * CHUNK, hi = std::min(V, lo + CHUNK);
      const double raw = weight_sum(row, lo, hi, m, 1.0f);
      lse_sum += raw;
      if (t > 0.0f && !filtered) {
        total += t == 1.0f ? raw : double(weight_sum(row, lo, hi, m, 1.0f / t));
        cdf[c] = total;
      }
    }
    const double lse = double(m) + std::log(lse_sum);
    int64_t chosen = -1;
    if (filtered) {
      static thread_local std::vector<Candidate> candidates;
      chosen = sample_filtered(row, V, m, t, top_k[r], top_p[r], min_p[r], u[r], candidates);
    } else if (t > 0.0f) {
      const float inv_t = 1.0f / t;
      const double target = u[r] * total;
      int64_t c = 0;  // the first chunk whose cumulative weight exceeds the target, else the last step up
      while (c < chunks && !(cdf[c] > target)) ++c;
      if (c == chunks) {
        c = chunks - 1;
        while (c > 0 && cdf[c - 1] == cdf[c]) --c;
      }
      const int64_t lo = c * CHUNK, hi = std::min(V, lo + CHUNK);
      double acc = c > 0 ? cdf[c - 1] : 0.0;
      for (int64_t j = lo; j < hi; ++j) {  // within it: the first entry past the target, else its last positive
        const float w = exp_neg((row[j] - m) * inv_t);
        if (w > 0.0f) chosen = j;
        acc += w;
        if (acc > target && w > 0.0f) break;
      }
    }
    if (chosen < 0) {  // greedy, or no positive weight at all (a row of NaN or -inf): the first maximum
      chosen = 0;
      for (int64_t j = 0; j < V; ++j) {
        if (row[j] == m) {
          chosen = j;
          break;
        }
      }
    }
    ids[r] = chosen;
    logprobs[r] = double(row[chosen]) - lse;
  }
}

// Speculative decoding's check of a random row's draft token d (pagoda/layers/sampler.py's Sampler.verify): out[0] =
// p(d) at temperature t > 0, exp((x[d] - max) / t) over the sum of the row's weights (the pass above's weights and
// chunked float64 sum), and out[1] = the raw row's logsumexp, for the chosen token's logprob. One call in place of
// torch's softmax and logsumexp over the row (two ops, ~0.1 ms each in a step's Python after the weights' stream).
extern "C" void pagoda_token_prob(const float* x, int64_t V, float t, int64_t d, double* out) {
  const float m = row_max(x, V);
  const float inv_t = 1.0f / t;
  double raw = 0.0, total = 0.0;
  for (int64_t lo = 0; lo < V; lo += CHUNK) {
    const int64_t hi = std::min(V, lo + CHUNK);
    const double r = weight_sum(x, lo, hi, m, 1.0f);
    raw += r;
    total += t == 1.0f ? r : double(weight_sum(x, lo, hi, m, inv_t));
  }
  out[0] = double(exp_neg((x[d] - m) * inv_t)) / total;
  out[1] = double(m) + std::log(raw);
}
