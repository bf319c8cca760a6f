// Loops for `python -m pagoda.bench.q4_linear --layers N` (pagoda/bench/q4_linear.py): one stream's linear
// calls made from C++ as the one-call decode forward (pagoda/model/one_stream.cpp) makes them, with no Python
// between calls (a Python loop adds a ctypes call and its argument conversions to each of a step's 120), and
// the same bytes read the way the kernel's threads split them, with no arithmetic: what the calls would cost if
// the kernel were free. Each returns its own wall time in seconds. Compiled by load_library after cpp_vector.h.

using linear_fn = void (*)(const void* x, const void* w, const void* bias, void* y, int64_t M, int64_t N, int64_t K);

// fn(x, ws[i], null, y, 1, ns[i], ks[i]) for i in [0, count): one row through each layer in turn.
extern "C" double pagoda_bench_linear_calls(void* fn, const void* x, void* const* ws, const int64_t* ns,
                                            const int64_t* ks, int64_t count, void* y) {
  const auto linear = reinterpret_cast<linear_fn>(fn);
  const double start = seconds_now();
  for (int64_t i = 0; i < count; ++i) linear(x, ws[i], nullptr, y, 1, ns[i], ks[i]);
  return seconds_now() - start;
}

typedef int64_t v64 __attribute__((vector_size(64)));

// For each layer i, its tiles[i] tiles of tile_bytes[i] bytes (a multiple of 64) from ws[i], split between the
// threads as the kernels split them (an OpenMP static schedule over the tiles: each thread one contiguous run),
// each thread reading its run once in 64-byte loads.
extern "C" double pagoda_bench_split_read(void* const* ws, const int64_t* tiles, const int64_t* tile_bytes,
                                          int64_t count) {
  static volatile int64_t sink;
  const double start = seconds_now();
  for (int64_t i = 0; i < count; ++i) {
    const char* base = static_cast<const char*>(ws[i]);
    const int64_t step = tile_bytes[i];
#pragma omp parallel
    {
      v64 acc = {};
#pragma omp for schedule(static) nowait  // one barrier a layer, the kernel's
      for (int64_t t = 0; t < tiles[i]; ++t) {
        for (int64_t b = 0; b < step; b += 64) {
          v64 v;
          std::memcpy(&v, base + t * step + b, sizeof(v));
          acc ^= v;
        }
      }
      int64_t s = 0;
      for (int j = 0; j < 8; ++j) s ^= acc[j];
      sink = s;
    }
  }
  return seconds_now() - start;
}
