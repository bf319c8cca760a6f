// The sampler's rows in passes over their logits: greedy rows, random rows with a temperature, and random rows with
// top-k, top-p or min-p filters (pagoda/layers/sampler.py picks them), each processed first where it has a bias,
// penalties or a min_tokens block (in place, and put back after). In torch a plain random row is 8-9 ops, each a
// pass over (rows x vocab) float32 logits: divide by the temperature, max, subtract, exp, the chunk sums of the
// inverse-CDF search, and a logsumexp for the chosen token's logprob (BENCHMARKS.md, "A fused pass for the sampler's
// plain rows"); a filtered row adds a top-k of 64 (and of 1,024 where the nucleus is not among 64), a sort of them
// and a scatter back.
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

// The first token whose logit is the row's maximum m; 0 where none is (a row of NaN).
static inline int64_t first_max(const float* x, int64_t V, float m) {
  for (int64_t j = 0; j < V; ++j) {
    if (x[j] == m) return j;
  }
  return 0;
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
// hold every token the filters keep, else every token: one pass sums what decides each level (for top-k how many
// tokens it holds, for top-p their weight, for min-p alone the largest weight left outside); a second gathers the
// level's tokens (in id order). A level is a whole
// prefix of the torch path's order (logit descending, ties by id: its stable sort), since y only grows with x.
// Within the candidates, the last token the filters keep is found by selection (nth_element for top-k, a
// quickselect that sums the weights on each side for top-p), not by sorting them: on the default model at
// temperature 0.7 the nucleus of 0.9 held 2 to ~1,800 tokens and the level ~2,400 (random-token prompts, the
// benchmark's). The kept tokens are then those at or before it in that order (and, with min-p, heavy enough), drawn
// from in id order as the plain rows are.
constexpr int LEVELS = 8;
constexpr float LEVEL[LEVELS] = {1.5f, 3.0f, 4.5f, 6.0f, 8.0f, 11.0f, 15.0f, 24.0f};

struct Candidate {
  float x, w;  // the logit and its weight exp(y)
  int32_t id;
};

// What decides whether a level holds a row's kept tokens: for top-k, how many tokens it holds (COUNT); else for
// top-p, their weight (MASS); else (min-p alone) the largest weight of a token outside it (LEFT).
enum Need { COUNT, MASS, LEFT };

struct Levels {
  double total = 0.0;     // every token's weight: the softmax's sum when top-k is off
  double of[LEVELS] = {};  // each level's count, weight or largest weight left out
};

// The lanes of a comparison's mask that are set, as bits (lane l: bit l).
static inline uint32_t lane_bits(vi32 mask) {
#if defined(__AVX512F__) && !defined(PAGODA_PORTABLE)
  __m512i m;
  std::memcpy(&m, &mask, sizeof(m));
  return _mm512_movepi32_mask(m);
#elif defined(__AVX__) && !defined(PAGODA_PORTABLE)
  __m256 m;
  std::memcpy(&m, &mask, sizeof(m));
  return uint32_t(_mm256_movemask_ps(m));
#else
  uint32_t bits = 0;
  for (int64_t l = 0; l < L; ++l) bits |= mask[l] ? 1u << l : 0u;
  return bits;
#endif
}

// One pass over a row: every weight (chunk sums in float32 added in float64, as the plain rows' sums), and what
// decides each level (summed across the row in float32: it only picks the level).
template <Need NEED>
static Levels level_sums(const float* x, int64_t V, float m, float inv_t) {
  Levels s;
  vf of[LEVELS] = {};
  float tail[LEVELS] = {};
  for (int64_t lo = 0; lo < V; lo += CHUNK) {
    const int64_t hi = std::min(V, lo + CHUNK);
    vf total = {};
    int64_t i = lo;
    for (; i + L <= hi; i += L) {
      const vf y = (load_f32(x + i) - m) * inv_t;
      const vf w = exp_neg(y);
      total += w;
      for (int j = 0; j < LEVELS; ++j) {
        const auto in = y >= -LEVEL[j];
        if constexpr (NEED == COUNT) of[j] += in ? vf{} + 1.0f : vf{};
        if constexpr (NEED == MASS) of[j] += in ? w : vf{};
        if constexpr (NEED == LEFT) of[j] = in ? of[j] : (w > of[j] ? w : of[j]);
      }
    }
    s.total += hsum(total);
    for (; i < hi; ++i) {  // the tail: the same arithmetic one value at a time
      const float y = (x[i] - m) * inv_t, w = exp_neg(y);
      s.total += w;
      for (int j = 0; j < LEVELS; ++j) {
        const bool in = y >= -LEVEL[j];
        if constexpr (NEED == COUNT) tail[j] += in ? 1.0f : 0.0f;
        if constexpr (NEED == MASS) tail[j] += in ? w : 0.0f;
        if constexpr (NEED == LEFT) tail[j] = in ? tail[j] : std::max(tail[j], w);
      }
    }
  }
  for (int j = 0; j < LEVELS; ++j) s.of[j] = NEED == LEFT ? std::max(hmax(of[j]), tail[j]) : hsum(of[j]) + tail[j];
  return s;
}

// The tokens with y >= lowest (every token but NaN for lowest = -inf), in id order, into g.
static void gather(const float* x, int64_t V, float m, float inv_t, float lowest, std::vector<Candidate>& g) {
  g.clear();
  int64_t i = 0;
  for (; i + L <= V; i += L) {
    const vf y = (load_f32(x + i) - m) * inv_t;
    uint32_t in = lane_bits(y >= lowest);
    if (in == 0) continue;
    const vf w = exp_neg(y);
    for (; in != 0; in &= in - 1) {  // each set lane, lowest first
      const int l = __builtin_ctz(in);
      g.push_back({x[i + l], w[l], int32_t(i + l)});
    }
  }
  for (; i < V; ++i) {
    const float y = (x[i] - m) * inv_t;
    if (y >= lowest) g.push_back({x[i], exp_neg(y), int32_t(i)});
  }
}

// Whether candidate a comes before b in the torch path's order.
static inline bool before(const Candidate& a, const Candidate& b) { return a.x > b.x || (a.x == b.x && a.id < b.id); }

// Top-p's count among n candidates g, the best n tokens in no order: how many of them, best first, come before the
// first token whose better tokens weigh at least target (p times the mass). g is left with them first, the last of
// them the worst. A quickselect: each pass puts a pivot in its place, the better tokens before it, and keeps to the
// side where the count lies, knowing the weight of the side before; the last few candidates are sorted and walked.
// closed: false where every candidate is kept and their weight still falls short of target (the tokens past them
// may be kept too).
static int64_t nucleus(Candidate* g, int64_t n, double target, bool& closed) {
  double base = 0.0;  // the weight of g[0, lo)
  int64_t lo = 0, hi = n;  // the count lies in (lo, hi]: g[0, lo) kept, each better than g[lo, n)
  while (hi - lo > 16 && base < target) {
    std::swap(g[lo + (hi - lo) / 2], g[hi - 1]);
    const Candidate pivot = g[hi - 1];
    const int64_t mid = std::partition(g + lo, g + hi - 1, [&](const Candidate& c) { return before(c, pivot); }) - g;
    std::swap(g[mid], g[hi - 1]);
    double upper = 0.0;
    for (int64_t i = lo; i < mid; ++i) upper += g[i].w;
    if (base + upper >= target) {
      hi = mid;  // the pivot is dropped, or the count is mid
    } else {
      base += upper + g[mid].w;
      lo = mid + 1;
    }
  }
  if (base >= target) {
    closed = true;
    return lo;
  }
  std::sort(g + lo, g + hi, before);
  int64_t r = lo;
  for (; r < hi && base < target; ++r) base += g[r].w;
  closed = base >= target || hi < n;  // hi < n: the pivot at hi was dropped, by sums in another order
  return r;
}

// The tokens a filtered random row (t > 0) keeps: those of g (its candidates, in id order) at or before `last` in
// the stable order where top-k or top-p cut, and no lighter than `lightest` (min-p).
struct Kept {
  bool cut = false;
  Candidate last = {};
  float lightest = 0.0f;
  bool has(const Candidate& c) const { return c.w >= lightest && c.w > 0.0f && (!cut || !before(last, c)); }
};

// The tokens a filtered random row (t > 0) keeps, with its candidates in g; false where no token has weight (a broken
// row). k: top-k (V for none); p: top-p (1 for none); mp: min-p (0 for none). Same semantics as the torch path
// (pagoda/layers/sampler.py): top-k keeps the first k of the stable order; top-p then keeps each token whose
// better-ranked tokens hold less than p of the top-k distribution's mass; min-p then drops tokens whose weight is
// below mp times the top token's. Sums in float64 here, float32 there: a token whose mass before it lies within
// rounding of p may be kept by one and not the other. h: scratch.
static bool filtered_kept(const float* row, int64_t V, float m, float t, int64_t k, float p, float mp,
                          std::vector<Candidate>& g, std::vector<Candidate>& h, Kept& out) {
  const float inv_t = 1.0f / t;
  const Levels s = k < V ? level_sums<COUNT>(row, V, m, inv_t)
                   : p < 1.0f ? level_sums<MASS>(row, V, m, inv_t) : level_sums<LEFT>(row, V, m, inv_t);
  out.lightest = mp * exp_neg(0.0f);  // min-p: the top token's weight is exp(0)
  for (int level = 0; level <= LEVELS; ++level) {
    if (level < LEVELS) {
      const bool holds = k < V ? s.of[level] >= double(k)
                         : p < 1.0f ? s.of[level] >= double(p) * s.total : s.of[level] < out.lightest;
      if (!holds) continue;
    }
    gather(row, V, m, inv_t, level < LEVELS ? -LEVEL[level] : -std::numeric_limits<float>::infinity(), g);
    const int64_t n = int64_t(g.size());
    if (n == 0) return false;
    h.assign(g.begin(), g.end());  // g stays in id order for the draw
    int64_t kept = n;  // top-k's and top-p's count: h[0, kept) after them, h[kept - 1] the last, where they cut
    if (k < n) {
      std::nth_element(h.begin(), h.begin() + (k - 1), h.end(), before);
      kept = k;
      out.cut = true;
    }
    if (p < 1.0f) {
      double mass = s.total;
      if (k < V) {
        mass = 0.0;
        for (int64_t r = 0; r < kept; ++r) mass += h[r].w;
      }
      bool closed = true;
      kept = nucleus(h.data(), kept, double(p) * mass, closed);
      if (!closed && k >= V && level < LEVELS) continue;  // every candidate kept: the nucleus may reach past them
      out.cut = true;
    }
    if (kept == 0) return false;
    out.last = h[kept - 1];
    return true;
  }
  return false;  // not reached: the last level holds every token
}

// The kept token whose cumulative weight, in id order, first exceeds u times theirs, leaving out token `skip`; -1
// where none has weight.
static int64_t draw(const std::vector<Candidate>& g, const Kept& kept, double u, int64_t skip = -1) {
  double total = 0.0;
  for (const Candidate& c : g) {
    if (kept.has(c) && c.id != skip) total += c.w;
  }
  const double target = u * total;
  double acc = 0.0;
  int64_t chosen = -1;
  for (const Candidate& c : g) {
    if (kept.has(c) && c.id != skip) {
      chosen = c.id;
      acc += c.w;
      if (acc > target) break;
    }
  }
  return chosen;
}

// A filtered random row's token for draw u; -1 where no token has weight (the caller takes the first maximum).
static int64_t sample_filtered(const float* row, int64_t V, float m, float t, int64_t k, float p, float mp, double u,
                               std::vector<Candidate>& g, std::vector<Candidate>& h) {
  Kept kept;
  return filtered_kept(row, V, m, t, k, p, mp, g, h, kept) ? draw(g, kept, u) : -1;
}

// A plain random row's draw: cdf[c] the cumulative weight (at 1 / inv_t) of the row's chunks 0 .. c of CHUNK tokens,
// token `skip` left out of them (-1: none). The first token whose cumulative weight exceeds target, else the last
// with weight in the last chunk that adds any; -1 where no token has weight.
static int64_t search_chunks(const float* row, int64_t V, float m, float inv_t, const double* cdf, double target,
                             int64_t skip = -1) {
  const int64_t chunks = (V + CHUNK - 1) / CHUNK;
  int64_t c = 0;  // the first chunk whose cumulative weight exceeds the target, else the last step up
  while (c < chunks && !(cdf[c] > target)) ++c;
  if (c == chunks) {
    c = chunks - 1;
    while (c > 0 && cdf[c - 1] == cdf[c]) --c;
  }
  const int64_t lo = c * CHUNK, hi = std::min(V, lo + CHUNK);
  double acc = c > 0 ? cdf[c - 1] : 0.0;
  int64_t chosen = -1;
  for (int64_t j = lo; j < hi; ++j) {  // within it: the first entry past the target, else its last positive
    const float w = j == skip ? 0.0f : exp_neg((row[j] - m) * inv_t);
    if (w > 0.0f) chosen = j;
    acc += w;
    if (acc > target && w > 0.0f) break;
  }
  return chosen;
}

// The raw row's logsumexp (float64 across chunks) and, for t > 0 and cdf non-null, the cumulative weights at
// temperature t chunk by chunk into cdf (with t == 1, the same sums).
static double chunk_sums(const float* row, int64_t V, float m, float t, double* cdf) {
  double raw = 0.0, total = 0.0;
  for (int64_t c = 0, lo = 0; lo < V; ++c, lo += CHUNK) {
    const int64_t hi = std::min(V, lo + CHUNK);
    const double r = weight_sum(row, lo, hi, m, 1.0f);
    raw += r;
    if (cdf != nullptr) {
      total += t == 1.0f ? r : double(weight_sum(row, lo, hi, m, 1.0f / t));
      cdf[c] = total;
    }
  }
  return double(m) + std::log(raw);
}

// A row's logit processing, as pagoda/layers/sampler.py's _Processing gives it: biases (n_bias ids and values),
// blocked ids (a min_tokens block), the repetition penalty over the row's token ids (ids: n_prompt of the prompt,
// then n_outputs of its outputs), frequency and presence penalties over the outputs'; saved_ids / saved: room for
// every change (n_bias + n_blocked, n_prompt + n_outputs with a repetition penalty, n_outputs more with the others).
struct Processing {
  const int64_t* bias_ids;
  const float* bias;
  int64_t n_bias;
  const int64_t* blocked;
  int64_t n_blocked;
  const int32_t* ids;
  int64_t n_prompt;
  int64_t n_outputs;
  float repetition;
  float frequency;
  float presence;
  int64_t* saved_ids;
  float* saved;
};

// A row's logit processing (pagoda/layers/sampler.py's _process_rows for one row, in place, the same float32
// arithmetic): the biases added, the blocked ids set to -inf, the repetition penalty over the distinct ids of the
// prompt and the outputs (a positive logit divided by it, a negative one multiplied), then frequency * count +
// presence taken from each output id's logit. In torch that is ~15 small ops, ~100 us each in a step's Python after
// the weights' stream; here one call. Each entry's value before each change goes to p's saved_ids / saved
// (restore_row puts them back); returns how many.
extern "C" int64_t pagoda_process_row(float* x, int64_t V, const Processing* p) {
  static thread_local std::vector<int32_t> counts;  // one a token, all 0 between calls
  if (int64_t(counts.size()) < V) counts.assign(V, 0);
  int64_t n = 0;
  auto save = [&](int64_t t) {
    p->saved_ids[n] = t;
    p->saved[n++] = x[t];
  };
  for (int64_t i = 0; i < p->n_bias; ++i) {
    save(p->bias_ids[i]);
    x[p->bias_ids[i]] += p->bias[i];
  }
  for (int64_t i = 0; i < p->n_blocked; ++i) {
    save(p->blocked[i]);
    x[p->blocked[i]] = -std::numeric_limits<float>::infinity();
  }
  if (p->repetition != 1.0f) {
    const int64_t seen = p->n_prompt + p->n_outputs;
    for (int64_t i = 0; i < seen; ++i) {
      const int64_t t = p->ids[i];
      if (counts[t] != 0) continue;  // once an id
      counts[t] = 1;
      save(t);
      x[t] = x[t] > 0.0f ? x[t] / p->repetition : x[t] * p->repetition;
    }
    for (int64_t i = 0; i < seen; ++i) counts[p->ids[i]] = 0;
  }
  const int32_t* outputs = p->ids + p->n_prompt;
  if (p->frequency != 0.0f || p->presence != 0.0f) {
    for (int64_t i = 0; i < p->n_outputs; ++i) ++counts[outputs[i]];
    for (int64_t i = 0; i < p->n_outputs; ++i) {
      const int64_t t = outputs[i];
      if (counts[t] == 0) continue;  // taken already
      const float penalty = p->frequency * float(counts[t]) + p->presence;
      save(t);
      x[t] -= penalty;
      counts[t] = 0;
    }
  }
  return n;
}

// Undoes pagoda_process_row's n changes to x: the saved values put back, the last change first, so that each entry
// ends as it was before its first.
static void restore_row(float* x, const Processing* p, int64_t n) {
  for (int64_t i = n - 1; i >= 0; --i) x[p->saved_ids[i]] = p->saved[i];
}

// Where a row has processing: its logsumexp as given (the logprobs are of the logits before processing), then the
// row processed in place; returns the number of changes (for restore_row) and the logsumexp in lse.
static int64_t process(float* row, int64_t V, const Processing* p, double& lse) {
  lse = chunk_sums(row, V, row_max(row, V), 1.0f, nullptr);
  return pagoda_process_row(row, V, p);
}

// x: logits, row r at x + rows[r] * stride, V entries; temps (R,): 0 for greedy; top_k (R,), top_p (R,), min_p
// (R,): each random row's filters (V, 1 and 0 for none; the three may be null: no row has any); u (R,): each
// random row's uniform draw in [0, 1) (ignored for greedy rows); ids (R,) and logprobs (R,) out: the chosen token
// and its raw logprob (logit - logsumexp over the row, before the temperature). work: R * ceil(V / CHUNK) float64.
// processing: null (no row has any), or R pointers, row r's Processing or null: a row with one is processed in
// place first and put back after, its logprob that of the row as given.
extern "C" void pagoda_sample(float* x, const int64_t* rows, int64_t R, int64_t V, int64_t stride,
                              const float* temps, const int64_t* top_k, const float* top_p, const float* min_p,
                              const double* u, int64_t* ids, double* logprobs, double* work,
                              const Processing* const* processing) {
  const int64_t chunks = (V + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) {
    float* row = x + rows[r] * stride;
    const Processing* proc = processing != nullptr ? processing[r] : nullptr;
    double lse = 0.0;
    const int64_t changed = proc != nullptr ? process(row, V, proc, lse) : 0;
    const float m = row_max(row, V);
    const float t = temps[r];
    const bool filtered = t > 0.0f && top_k != nullptr && (top_k[r] < V || top_p[r] < 1.0f || min_p[r] > 0.0f);
    double* cdf = t > 0.0f && !filtered ? work + r * chunks : nullptr;
    // the logprob's logsumexp: the row's own, with the chunk sums of a plain random row's draw (a processed row's
    // was taken before its processing: its chunk sums here are only for the draw)
    if (proc == nullptr || cdf != nullptr) {
      const double own = chunk_sums(row, V, m, t, cdf);
      if (proc == nullptr) lse = own;
    }
    int64_t chosen = -1;
    if (filtered) {
      static thread_local std::vector<Candidate> candidates, selected;
      chosen = sample_filtered(row, V, m, t, top_k[r], top_p[r], min_p[r], u[r], candidates, selected);
    } else if (cdf != nullptr) {
      chosen = search_chunks(row, V, m, 1.0f / t, cdf, u[r] * cdf[chunks - 1]);
    }
    if (chosen < 0) chosen = first_max(row, V, m);  // greedy, or no token with weight (a row of NaN or -inf)
    if (proc != nullptr) restore_row(row, proc, changed);
    ids[r] = chosen;
    logprobs[r] = double(row[chosen]) - lse;
  }
}

// Speculative decoding's check of a random row's draft token d (Sampler.verify), with one draw u: d where u < p(d),
// p the row's distribution at temperature t > 0 and its filters (k, p, mp as pagoda_sample takes them), else the
// token drawn from p without d by u' = (u - p(d)) / (1 - p(d)), which given u >= p(d) is uniform in [0, 1): d with
// probability p(d), t != d with (1 - p(d)) p(t) / (1 - p(d)) = p(t). The same weights and sums as pagoda_sample.
// Returns the token and its raw logprob (logprob[0]); a broken row (no token with weight) gives its first maximum.
// proc: null, or the row's processing (as pagoda_sample's): x processed in place first and put back after.
extern "C" int64_t pagoda_check_draft(float* x, int64_t V, float t, int64_t k, float p, float mp, int64_t d,
                                      double u, double* logprob, const Processing* proc) {
  static thread_local std::vector<Candidate> candidates, selected;
  static thread_local std::vector<double> cdf;
  double lse = 0.0;  // the row's as given: a processed row's from before its processing
  const int64_t changed = proc != nullptr ? process(x, V, proc, lse) : 0;
  const float m = row_max(x, V);
  const int64_t chunks = (V + CHUNK - 1) / CHUNK;
  int64_t chosen = -1;
  if (k < V || p < 1.0f || mp > 0.0f) {
    if (proc == nullptr) lse = chunk_sums(x, V, m, t, nullptr);
    Kept kept;
    if (filtered_kept(x, V, m, t, k, p, mp, candidates, selected, kept)) {
      double total = 0.0, weight = 0.0;
      for (const Candidate& c : candidates) {
        if (kept.has(c)) {
          total += c.w;
          if (c.id == d) weight = c.w;
        }
      }
      const double p_d = weight / total;
      chosen = u < p_d ? d : draw(candidates, kept, (u - p_d) / (1.0 - p_d), d);
    }
  } else {
    cdf.resize(chunks);
    const double own = chunk_sums(x, V, m, t, cdf.data());
    if (proc == nullptr) lse = own;
    const float inv_t = 1.0f / t;
    const double weight = exp_neg((x[d] - m) * inv_t), p_d = weight / cdf[chunks - 1];
    if (u < p_d) {
      chosen = d;
    } else {
      for (int64_t c = d / CHUNK; c < chunks; ++c) cdf[c] -= weight;
      chosen = search_chunks(x, V, m, inv_t, cdf.data(), (u - p_d) / (1.0 - p_d) * cdf[chunks - 1], d);
    }
  }
  if (chosen < 0) chosen = first_max(x, V, m);  // d the only token with weight; or a broken row
  if (proc != nullptr) restore_row(x, proc, changed);
  *logprob = double(x[chosen]) - lse;
  return chosen;
}
