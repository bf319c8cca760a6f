// A decode step of B sequences of a bfloat16 or float32 Llama-family model, every layer in one call from Python
// (pagoda/model/one_stream.py says which steps: B up to 4 where the linears take the GEMV, any B where they all
// run one packed Q4_1 or Q8_0 kernel).
//
// With one token in the step, the forward pass is ~10 small kernels a layer around four GEMVs, and in eager
// PyTorch each costs a Python call, a module dispatch and a ctypes call: ~10 ms of a ~22 ms step, while the
// GEMVs stream the weights in ~12 ms. With B rows the kernels are longer but the Python is the same, and while
// the main thread runs it the other OpenMP threads wait. This loop makes the same calls from C++: it is handed
// the addresses of the kernels the eager path uses (the fused elementwise ops, the GEMV or packed linear, the
// paged-cache write and decode attention, each compiled on its own), the layers' weights and caches, and
// scratch buffers, and runs them in the eager path's order with the same arguments, so its output is the eager
// forward's, bit for bit (tests/model/test_one_stream.py). Built and driven by pagoda/model/one_stream.py,
// after cpp_vector.h, with PAGODA_ELEM #defined: 0 float32, 1 bfloat16 (the model's dtype: weights and
// activations).

#include <cstdint>

#if PAGODA_ELEM == 0
using elem_t = float;
#else
using elem_t = uint16_t;  // bfloat16
#endif

using gemv_fn = void (*)(const void* x, const void* w, const void* bias, void* y, int64_t M, int64_t N, int64_t K);
using norm_fn = void (*)(const void* x, int64_t xs, void* residual, const void* weight, void* out, int64_t rows,
                         int64_t dim, float eps);
using head_norm_fn = void (*)(const void* x, int64_t xs, int64_t heads, const void* weight, void* out, int64_t os,
                              int64_t T, int64_t dim, float eps);
using rotary_fn = void (*)(void* q, int64_t qs, int64_t hq, void* k, int64_t ks, int64_t hk, const void* cos,
                           const void* sin, int64_t T, int64_t d);
using silu_mul_fn = void (*)(const void* gate, const void* up, int64_t in_stride, void* out, int64_t rows, int64_t n);
// the cache write the eager path makes: rows of the cache's dtype copied, or float32 ones rounded to a 16-bit cache's
// or quantized to an int8 one's (with its scales ks, vs; null for caches without them)
using write_kv_fn = void (*)(void* k, void* v, void* ks, void* vs, const void* k_new, const void* v_new, int64_t stride,
                             const int64_t* slots, int64_t T);
using mlp_fn = void (*)(const void* x, const void* w_gate_up, const void* w_down, void* y, int64_t M, int64_t H,
                        int64_t I, int64_t q8);
// a packed model's RMSNorm with the linear or the MLP after it in one call (pagoda_norm_linear, pagoda_norm_mlp)
using norm_linear_fn = void (*)(const void* x, void* residual, const void* norm_weight, float eps, const void* w,
                                const void* bias, void* y, int64_t M, int64_t N, int64_t K, int64_t q8);
using norm_mlp_fn = void (*)(const void* x, void* residual, const void* norm_weight, float eps, const void* w_gate_up,
                             const void* w_down, void* y, int64_t M, int64_t H, int64_t I, int64_t q8);
using decode_fn = void (*)(const float* q, int64_t q_stride, const void* k, const void* v, const void* ks,
                           const void* vs, const float* table, const int64_t* block_tables, const int64_t* seq_lens,
                           float* out, float* work, int64_t B, int64_t W, int64_t span_blocks, float qscale);

// fns: gemv, add_rms_norm, rotary, silu_mul, write_kv (the cache layout's pagoda_write_kv_rows or _f32),
// paged_decode_rows, the lm_head's linear (the GEMV, or a quantized model's Q8_0 kernel, whose signature is the
// GEMV's), a packed model's MLP in one call (pagoda_packed_mlp, q4_gemm.cpp) or null, and its norms in one call with
// the linear after them and with the MLP (pagoda_norm_linear, pagoda_norm_mlp; the same bits) or null (a float32
// model's: the qkv and gate_up projections take the first, the MLP's call where it is taken the second), and the
// per-head norm (pagoda_head_rms_norm).
// layers: per layer LAYER_PTRS addresses, in this order: input norm weight, qkv weight, qkv bias (or null),
// o weight, o bias (or null), post-attention norm weight, gate_up weight, down weight, K cache, V cache, K scales, V
// scales (null for caches without them), the q and k norms' weights (Qwen3's, applied to each head in place before
// the rotary embedding; null for models without them).
// dims: hidden, q heads, KV heads, head_dim, intermediate, 1 where a bfloat16 model's K and V rows go to the cache
// write as float32 (an int8 cache's write quantizes float32 rows; the eager path converts them too) else 0, the fewest
// rows that take the MLP in one call (0: never), that call's q8 argument, how embed holds its rows (embed_row's
// layout) and, for tiles, the columns a panel.
// bufs, each for B rows: residual (hidden), h (hidden), qkv, q as float32 (or K and V for that write: max(q, 2 x KV)
// heads x head_dim a row), attention out as float32, attention out, o (hidden), gate_up, act (intermediate), x
// (hidden), all of elem_t except the two float32 ones (unused for a float32 model, whose q and output the kernel
// takes as they are), the decode kernel's work (B x spans x q heads x (head_dim + 2) floats), and cos and sin (head_dim
// each) of the rows' positions. ids, positions, slots, seq_lens: (B,); block_tables (B, W); cos_table,
// sin_table: the rotary tables, rows rotary_stride elements apart. out: the final norm's output (B, hidden).
// lm_w, logits, V: the lm_head's weight (plain or packed), and where its B x V outputs go (the lm_head's output
// dtype); logits null: no lm_head. ts: null, or OP_COUNT doubles to which each kind of call adds its wall time, in
// this order: norm, qkv_proj (with the norm where the two are one call), rotary (with gathering the rows' cos and
// sin), write_kv, attention (with the bfloat16 model's conversions of q and of the output), o_proj, gate_up_proj (the
// whole MLP where it is one call, with the norm where that is in it), silu_mul, down_proj, lm_head (`--profile`
// reports them; two clock reads a call, ~20 us a step).
// Returns 0, or 1 without computing anything where a position is past the rotary tables' max_positions rows (the
// eager forward then raises its index error).
constexpr int64_t LAYER_PTRS = 14;
enum OneStreamOp {
  OP_NORM, OP_QKV, OP_ROTARY, OP_WRITE_KV, OP_ATTENTION, OP_O, OP_GATE_UP, OP_SILU_MUL, OP_DOWN, OP_LM_HEAD, OP_COUNT
};

// Runs call, adding its wall time to op_seconds[op] when op_seconds is not null.
template <typename Call>
static inline void timed(double* op_seconds, OneStreamOp op, Call&& call) {
  if (op_seconds == nullptr) {
    call();
    return;
  }
  const double start = seconds_now();
  call();
  op_seconds[op] += seconds_now() - start;
}

// Token n's embedding into dst (H elements), by layout (pagoda/layers/tied_embedding.py's ROWS, TILES, Q8_0): a
// row of embed (vocab, H); or column n of a tied lm_head's tiles that the embedding reads (linear.py's pack_tiles:
// panels of `panel` columns, each column G consecutive k together, G = 1 in float32, 2 in bfloat16); or, in float32,
// column n of its Q8_0 records (q4_linear.py's pack_q8_0: per 16 columns and block of 32 k, 512 bytes of q as
// (g 8, h 2, c 8, i 4) for column 8 h + c and k 4 g + i, then the 16 columns' d as float16), as d * q.
static inline void embed_row(const void* embed, int64_t layout, int64_t panel, int64_t n, int64_t H, elem_t* dst) {
  const auto* rows = static_cast<const elem_t*>(embed);
  if (layout == 0) {
    std::memcpy(dst, rows + n * H, H * sizeof(elem_t));
  } else if (layout == 1) {
    constexpr int64_t G = sizeof(float) / sizeof(elem_t);
    const elem_t* column = rows + n / panel * ((H + G - 1) / G * G * panel) + n % panel * G;
    for (int64_t k = 0; k < H; ++k) dst[k] = column[k / G * G * panel + k % G];
  } else if constexpr (PAGODA_ELEM == 0) {
    constexpr int64_t NR = 16, QK = 32, RECORD = NR * QK + 2 * NR;
    const int64_t nb = H / QK, c = n % NR;
    const auto* tile = static_cast<const uint8_t*>(embed) + n / NR * nb * RECORD;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* rec = tile + b * RECORD;
      _Float16 d;
      std::memcpy(&d, rec + NR * QK + 2 * c, sizeof(d));
      const auto* q = reinterpret_cast<const int8_t*>(rec) + c / 8 * 32 + c % 8 * 4;
      for (int64_t g = 0; g < 8; ++g) {
        for (int64_t i = 0; i < 4; ++i) dst[b * QK + 4 * g + i] = float(d) * float(q[g * 64 + i]);
      }
    }
  }
}

extern "C" int pagoda_one_stream_forward(void* const* fns, void* const* layers, int64_t num_layers,
                                         const int64_t* dims, float eps, float scale, void* const* bufs, int64_t B,
                                         const int64_t* ids, const void* embed, const void* final_norm,
                                         const elem_t* cos_table, const elem_t* sin_table, int64_t rotary_stride,
                                         int64_t max_positions, const int64_t* positions, const int64_t* slots,
                                         const int64_t* block_tables, const int64_t* seq_lens, int64_t W,
                                         int64_t span_blocks, void* out, const void* lm_w, void* logits, int64_t V,
                                         double* ts) {
  for (int64_t b = 0; b < B; ++b) {
    if (positions[b] < 0 || positions[b] >= max_positions) return 1;
  }
  const auto gemv = reinterpret_cast<gemv_fn>(fns[0]);
  const auto norm = reinterpret_cast<norm_fn>(fns[1]);
  const auto rotary = reinterpret_cast<rotary_fn>(fns[2]);
  const auto silu_mul = reinterpret_cast<silu_mul_fn>(fns[3]);
  const auto write_kv = reinterpret_cast<write_kv_fn>(fns[4]);
  const auto decode = reinterpret_cast<decode_fn>(fns[5]);
  const auto lm_head = reinterpret_cast<gemv_fn>(fns[6]);
  const auto mlp = reinterpret_cast<mlp_fn>(fns[7]);
  const int64_t H = dims[0], HQ = dims[1], HKV = dims[2], D = dims[3], I = dims[4];
  const bool mlp_call = mlp != nullptr && dims[6] > 0 && B >= dims[6];
  const auto norm_linear = reinterpret_cast<norm_linear_fn>(fns[8]);
  const auto norm_mlp = reinterpret_cast<norm_mlp_fn>(fns[9]);
  const auto head_norm = reinterpret_cast<head_norm_fn>(fns[10]);
  // a packed model's norms in one call with the linear after them (the qkv projection, the gate_up projection or
  // the MLP where that is one call): the same bits as the norm's call and then the linear's
  const bool norm_calls = PAGODA_ELEM == 0 && norm_linear != nullptr && norm_mlp != nullptr;
  [[maybe_unused]] const bool kv_as_f32 = dims[5] != 0;
  const int64_t QS = HQ * D, KVS = HKV * D, QKV = QS + 2 * KVS;
  auto* residual = static_cast<elem_t*>(bufs[0]);
  void* h = bufs[1];
  auto* qkv = static_cast<elem_t*>(bufs[2]);
  [[maybe_unused]] auto* qf = static_cast<float*>(bufs[3]);
  [[maybe_unused]] auto* attn_f = static_cast<float*>(bufs[4]);
  auto* attn = static_cast<elem_t*>(bufs[5]);
  void* o = bufs[6];
  auto* gate_up = static_cast<elem_t*>(bufs[7]);
  void* act = bufs[8];
  void* x = bufs[9];
  auto* work = static_cast<float*>(bufs[10]);
  auto* cos = static_cast<elem_t*>(bufs[11]);
  auto* sin = static_cast<elem_t*>(bufs[12]);

  for (int64_t b = 0; b < B; ++b) embed_row(embed, dims[8], dims[9], ids[b], H, residual + b * H);  // residual
  timed(ts, OP_ROTARY, [&] {  // the rows' cos and sin, as the eager forward indexes them once a step
    for (int64_t b = 0; b < B; ++b) {
      std::memcpy(cos + b * D, cos_table + positions[b] * rotary_stride, D * sizeof(elem_t));
      std::memcpy(sin + b * D, sin_table + positions[b] * rotary_stride, D * sizeof(elem_t));
    }
  });
  for (int64_t l = 0; l < num_layers; ++l) {
    void* const* p = layers + l * LAYER_PTRS;
    if (norm_calls) {  // the norm and the projection: h = residual (+= x), the norm's output never written
      const void* in = l == 0 ? residual : x;
      void* res = l == 0 ? nullptr : residual;
      timed(ts, OP_QKV, [&] { norm_linear(in, res, p[0], eps, p[1], p[2], qkv, B, QKV, H, dims[7]); });
    } else {
      timed(ts, OP_NORM, [&] {
        if (l == 0) {
          norm(residual, H, nullptr, p[0], h, B, H, eps);
        } else {
          norm(x, H, residual, p[0], h, B, H, eps);  // residual += x (the previous MLP's output)
        }
      });
      timed(ts, OP_QKV, [&] { gemv(h, p[1], p[2], qkv, B, QKV, H); });
    }
    if (p[12] != nullptr) {  // Qwen3's q and k norms, each head in place
      timed(ts, OP_NORM, [&] {
        head_norm(qkv, QKV, HQ, p[12], qkv, QKV, B, D, eps);
        head_norm(qkv + QS, QKV, HKV, p[13], qkv + QS, QKV, B, D, eps);
      });
    }
    timed(ts, OP_ROTARY, [&] { rotary(qkv, QKV, HQ, qkv + QS, QKV, HKV, cos, sin, B, D); });
    timed(ts, OP_WRITE_KV, [&] {
#if PAGODA_ELEM == 1
      if (kv_as_f32) {  // the rows' K and V as float32, k and v 2 x KVS apart (exact: bfloat16 widens)
        for (int64_t b = 0; b < B; ++b) {
          for (int64_t i = 0; i < 2 * KVS; ++i) qf[b * 2 * KVS + i] = bf16_to_f(qkv[b * QKV + QS + i]);
        }
        write_kv(p[8], p[9], p[10], p[11], qf, qf + KVS, 2 * KVS, slots, B);
        return;
      }
#endif
      write_kv(p[8], p[9], p[10], p[11], qkv + QS, qkv + QS + KVS, QKV, slots, B);
    });
    timed(ts, OP_ATTENTION, [&] {
#if PAGODA_ELEM == 0
      decode(qkv, QKV, p[8], p[9], p[10], p[11], nullptr, block_tables, seq_lens, static_cast<float*>(attn), work,
             B, W, span_blocks, scale);
#else
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t i = 0; i < QS; ++i) qf[b * QS + i] = bf16_to_f(qkv[b * QKV + i]);
      }
      decode(qf, QS, p[8], p[9], p[10], p[11], nullptr, block_tables, seq_lens, attn_f, work, B, W, span_blocks,
             scale);
      for (int64_t i = 0; i < B * QS; ++i) attn[i] = f_to_bf16(attn_f[i]);
#endif
    });
    timed(ts, OP_O, [&] { gemv(attn, p[3], p[4], o, B, H, QS); });
    if (norm_calls && mlp_call) {
      timed(ts, OP_GATE_UP, [&] { norm_mlp(o, residual, p[5], eps, p[6], p[7], x, B, H, I, dims[7]); });
      continue;
    }
    if (norm_calls) {
      timed(ts, OP_GATE_UP, [&] { norm_linear(o, residual, p[5], eps, p[6], nullptr, gate_up, B, 2 * I, H, dims[7]); });
    } else {
      timed(ts, OP_NORM, [&] { norm(o, H, residual, p[5], h, B, H, eps); });
      if (mlp_call) {  // the same bits as the three calls below
        timed(ts, OP_GATE_UP, [&] { mlp(h, p[6], p[7], x, B, H, I, dims[7]); });
        continue;
      }
      timed(ts, OP_GATE_UP, [&] { gemv(h, p[6], nullptr, gate_up, B, 2 * I, H); });
    }
    timed(ts, OP_SILU_MUL, [&] { silu_mul(gate_up, gate_up + I, 2 * I, act, B, I); });
    timed(ts, OP_DOWN, [&] { gemv(act, p[7], nullptr, x, B, H, I); });
  }
  timed(ts, OP_NORM, [&] { norm(x, H, residual, final_norm, out, B, H, eps); });
  if (logits != nullptr) timed(ts, OP_LM_HEAD, [&] { lm_head(out, lm_w, nullptr, logits, B, V, H); });
  return 0;
}
