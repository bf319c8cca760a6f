// The forward pass's elementwise steps, each one pass over its tensors: residual add with RMSNorm, rotary
// embedding (in place), SiLU-and-multiply. In eager torch each is 4-9 ops, each a pass over memory and a
// dispatch; together a third of a bfloat16 prompt step (BENCHMARKS.md, "Fused elementwise ops").
//
// Compiled at start-up by pagoda/layers/elementwise.py (through pagoda/layers/cpp_build.py) for the model dtype,
// #defined ahead: PAGODA_ELEM: 0 float32, 1 bfloat16, 2 float16; PAGODA_PORTABLE (optional): no AVX-512
// intrinsics even where the compiler targets AVX-512 (tests check the code other CPUs run).
//
// Numerics follow the torch code they replace (pagoda/layers/layernorm.py, rotary.py, the Llama MLP), op by
// op: arithmetic in float32, each torch op's result rounded to the model dtype where torch rounds it (rnd),
// and no fused multiply-adds (inductor compiles with -ffp-contract=off) except the explicit ones (madd) of
// SiLU's exp polynomial and reciprocal. Rotary and the residual add are then bit-identical to torch's;
// RMSNorm's sum of squares is added in another order, and SiLU's exp is a polynomial (exp2_neg) where
// torch calls Sleef: both within float32 rounding of torch.

// to_f / from_f: one element to and from float32; load / store: 16 of them, as one vector (GCC turns
// lane-by-lane code into scalar instructions, so every loop below works on whole vectors, with a scalar
// tail). from_f and store round to nearest even, as torch does.
#if PAGODA_ELEM == 0
using elem_t = float;
static inline float to_f(elem_t x) { return x; }
static inline elem_t from_f(float x) { return x; }
static inline vf load(const elem_t* p) {
  vf r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
static inline void store(elem_t* p, vf x) { std::memcpy(p, &x, sizeof(x)); }
static inline vf rnd(vf x) { return x; }
#elif PAGODA_ELEM == 1
using elem_t = uint16_t;  // bfloat16: the high half of a float32
static inline float to_f(elem_t x) { return bf16_to_f(x); }
static inline elem_t from_f(float f) { return f_to_bf16(f); }
static inline vf load(const elem_t* p) { return load_bf16(p); }
static inline vu32 round_bits(vf x) {  // float32 bits rounded to bfloat16's top half, low half zero
  vu32 u;
  std::memcpy(&u, &x, sizeof(u));
  const vu32 nan = vu32{} + 0x7fc00000u;
  return x != x ? nan : (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
}
static inline void store(elem_t* p, vf x) {
  const vu16 h = __builtin_convertvector(round_bits(x) >> 16, vu16);
  std::memcpy(p, &h, sizeof(h));
}
static inline vf rnd(vf x) {
  const vu32 u = round_bits(x);
  vf r;
  std::memcpy(&r, &u, sizeof(r));
  return r;
}
#elif PAGODA_ELEM == 2
using elem_t = _Float16;
static inline float to_f(elem_t x) { return float(x); }
static inline elem_t from_f(float x) { return elem_t(x); }
static inline vf load(const elem_t* p) { return load_f16(p); }
static inline void store(elem_t* p, vf x) {
  const vf16 h = __builtin_convertvector(x, vf16);
  std::memcpy(p, &h, sizeof(h));
}
static inline vf rnd(vf x) { return __builtin_convertvector(__builtin_convertvector(x, vf16), vf); }
#endif

// x rounded to the model dtype, as float32: where torch stores an op's result.
static inline float rnd(float x) { return to_f(from_f(x)); }

// Rows worth a parallel region: below this many elements OpenMP's fork costs more than it saves.
constexpr int64_t PARALLEL_MIN = 1 << 15;

// out = weight * rms_norm(h), h = residual + x (residual updated in place to h) or, with residual null,
// h = x. x (rows, dim) with row stride xs; residual and out (rows, dim) contiguous; weight (dim).
// As RMSNorm.forward: h in float32, h * rsqrt(mean(h^2) + eps) rounded to the dtype, then times weight.
static inline void norm_row(const elem_t* h, const elem_t* weight, elem_t* o, int64_t dim, float eps) {
  const int64_t vec_end = dim - dim % L;
  const float inv = rms_inverse(
      dim, eps, [&](int64_t i) { return load(h + i); }, [&](int64_t i) { return to_f(h[i]); });
  for (int64_t i = 0; i < vec_end; i += L) store(o + i, load(weight + i) * rnd(load(h + i) * inv));
  for (int64_t i = vec_end; i < dim; ++i) o[i] = from_f(to_f(weight[i]) * rnd(to_f(h[i]) * inv));
}

extern "C" void pagoda_add_rms_norm(const elem_t* x, int64_t xs, elem_t* residual, const elem_t* weight, elem_t* out,
                                    int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN)
  for (int64_t r = 0; r < rows; ++r) {
    const elem_t* h = x + r * xs;
    if (residual != nullptr) {
      const int64_t vec_end = dim - dim % L;
      elem_t* res = residual + r * dim;
      for (int64_t i = 0; i < vec_end; i += L) store(res + i, load(res + i) + load(h + i));
      for (int64_t i = vec_end; i < dim; ++i) res[i] = from_f(to_f(res[i]) + to_f(h[i]));
      h = res;
    }
    norm_row(h, weight, out + r * dim, dim, eps);
  }
}

// Qwen3's per-head q and k norms: each of T tokens' heads rows of dim (x + t * xs + h * dim) normalized as
// pagoda_add_rms_norm normalizes a row (no residual), into out + t * os + h * dim: in place where out is x.
extern "C" void pagoda_head_rms_norm(const elem_t* x, int64_t xs, int64_t heads, const elem_t* weight, elem_t* out,
                                     int64_t os, int64_t T, int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (T * heads * dim >= PARALLEL_MIN)
  for (int64_t r = 0; r < T * heads; ++r) {
    const int64_t t = r / heads, h = r % heads;
    norm_row(x + t * xs + h * dim, weight, out + t * os + h * dim, dim, eps);
  }
}

// Rotate-half rotary embedding in place on q (T, hq, d) and k (T, hk, d), heads d apart, tokens qs and ks
// apart; cos and sin (T, d) contiguous. As apply_rotary: x * cos + rotate_half(x) * sin, each product
// and the sum rounded to the dtype.
static inline void rotate(elem_t* x, const elem_t* c, const elem_t* s, int64_t half) {
  const int64_t vec_end = half - half % L;
  for (int64_t i = 0; i < vec_end; i += L) {
    const vf a = load(x + i), b = load(x + i + half);
    const vf lo = rnd(a * load(c + i)) + rnd(-b * load(s + i));
    const vf hi = rnd(b * load(c + i + half)) + rnd(a * load(s + i + half));
    store(x + i, lo);
    store(x + i + half, hi);
  }
  for (int64_t i = vec_end; i < half; ++i) {
    const float a = to_f(x[i]), b = to_f(x[i + half]);
    const float lo = rnd(a * to_f(c[i])) + rnd(-b * to_f(s[i]));
    const float hi = rnd(b * to_f(c[i + half])) + rnd(a * to_f(s[i + half]));
    x[i] = from_f(lo);
    x[i + half] = from_f(hi);
  }
}

extern "C" void pagoda_rotary(elem_t* q, int64_t qs, int64_t hq, elem_t* k, int64_t ks, int64_t hk, const elem_t* cos,
                              const elem_t* sin, int64_t T, int64_t d) {
#pragma omp parallel for schedule(static) if (T * (hq + hk) * d >= PARALLEL_MIN)
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < hq; ++h) rotate(q + t * qs + h * d, cos + t * d, sin + t * d, d / 2);
    for (int64_t h = 0; h < hk; ++h) rotate(k + t * ks + h * d, cos + t * d, sin + t * d, d / 2);
  }
}

// Vectors per step of the SiLU loop (exp2_neg_n).
constexpr int64_t SILU_VECTORS = 4;

// out (rows, n) contiguous = silu(gate) * up; gate and up (rows, n) with row stride in_stride (both halves
// of one gate_up projection, or two tensors of the same strides). As F.silu(gate) * up: silu(g) =
// g * sigmoid(g) rounded to the dtype, then the product rounded. sigmoid through e = exp(-|g|) <= 1
// (silu in cpp_vector.h).
extern "C" void pagoda_silu_mul(const elem_t* gate, const elem_t* up, int64_t in_stride, elem_t* out, int64_t rows,
                                int64_t n) {
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_MIN)
  for (int64_t r = 0; r < rows; ++r) {
    const elem_t* g = gate + r * in_stride;
    const elem_t* u = up + r * in_stride;
    elem_t* o = out + r * n;
    const int64_t vec_end = n - n % L;
    int64_t i = 0;
    for (; i + SILU_VECTORS * L <= vec_end; i += SILU_VECTORS * L) {
      vf x[SILU_VECTORS];
#pragma GCC unroll 16
      for (int64_t k = 0; k < SILU_VECTORS; ++k) x[k] = load(g + i + k * L);
      silu<SILU_VECTORS>(x);
#pragma GCC unroll 16
      for (int64_t k = 0; k < SILU_VECTORS; ++k) store(o + i + k * L, rnd(x[k]) * load(u + i + k * L));
    }
    for (; i < vec_end; i += L) {
      vf x = load(g + i);
      silu<1>(&x);
      store(o + i, rnd(x) * load(u + i));
    }
    for (; i < n; ++i) {
      vf x = vf{} + to_f(g[i]);
      silu<1>(&x);
      o[i] = from_f(rnd(x[0]) * to_f(u[i]));
    }
  }
}
