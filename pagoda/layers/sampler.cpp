// The sampler's plain rows in two passes over their logits: greedy rows, and random rows with a temperature
// and no filter, bias or penalty (pagoda/layers/sampler.py picks them; every other row runs its torch code).
// In torch the same work is 8-9 ops, each a pass over (rows x vocab) float32 logits: divide by the
// temperature, max, subtract, exp, the chunk sums of the inverse-CDF search, and a logsumexp for the chosen
// token's logprob (BENCHMARKS.md, "A fused pass for the sampler's plain rows").
//
// Compiled at start-up by pagoda/layers/sampler.py (through pagoda/layers/cpp_build.py), after
// cpp_vector.h; PAGODA_CHUNK (the inverse-CDF search's chunk of vocabulary entries) is #defined ahead.
//
// Per row, the same arithmetic as the torch path, with its own rounding: weights exp((x - max) / T) from
// exp2_neg (torch calls Sleef), chunk sums in float32 added across chunks in float64, then the first token
// whose cumulative weight exceeds u * total. A token of weight 0 is never chosen. So a draw can pick the
// neighbouring token where it falls within float32 rounding of a boundary between two tokens, but a row's
// token depends only on its own logits and draw: a row always takes this path or always the torch one,
// whatever else is in the batch.

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

// x: logits, row r at x + rows[r] * stride, V entries; temps (R,): 0 for greedy; u (R,): each random row's
// uniform draw in [0, 1) (ignored for greedy rows); ids (R,) and logprobs (R,) out: the chosen token and its
// raw logprob (logit - logsumexp over the row, before the temperature). work: R * ceil(V / CHUNK) float64.
extern "C" void pagoda_sample_plain(const float* x, const int64_t* rows, int64_t R, int64_t V, int64_t stride,
                                    const float* temps, const double* u, int64_t* ids, double* logprobs,
                                    double* work) {
  const int64_t chunks = (V + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) {
    const float* row = x + rows[r] * stride;
    const float m = row_max(row, V);
    // logsumexp of the raw row, in float64 across chunks; with T == 1, the chunk sums are also the weights'
    double* cdf = work + r * chunks;
    const float t = temps[r];
    double lse_sum = 0.0, total = 0.0;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t lo = c * CHUNK, hi = std::min(V, lo + CHUNK);
      const double raw = weight_sum(row, lo, hi, m, 1.0f);
      lse_sum += raw;
      if (t > 0.0f) {
        total += t == 1.0f ? raw : double(weight_sum(row, lo, hi, m, 1.0f / t));
        cdf[c] = total;
      }
    }
    const double lse = double(m) + std::log(lse_sum);
    int64_t chosen = -1;
    if (t > 0.0f) {
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
