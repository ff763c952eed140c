// What one AMX tile operation costs on this machine: back-to-back bf16 tile
// products (four independent accumulators), tile loads and stores from L1, and a
// 2 x 2 block of products fed by four loads (a GEMM's inner step). The AMX
// kernels' pace follows from these (cpu_kernels/causal_attention.cc's header).
// Run two at once under `taskset -c 0` and `taskset -c 1` to see whether the two
// CPUs share a tile unit (docs/results.md, "AMX prefill attention").
//
//   mkdir -p build && g++ -O2 -march=native -std=c++17 -Icpu_kernels \
//       -I$(.venv/bin/python -c "import jax; print(jax.ffi.include_dir())") \
//       benchmarks/amx_op_costs.cc -o build/amx_op_costs && build/amx_op_costs
#include <chrono>
#include <cstdio>

#include "common.h"

using namespace hisparse_cpu;  // NOLINT

alignas(64) static uint8_t buf[1 << 16];

template <class F>
double NsPerOp(int ops, F body) {
  const int n = 1000000;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) body(i);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
         (double(ops) * n) * 1e9;
}

int main() {
#if HISPARSE_AMX
  if (!AmxReady()) return std::puts("AMX tile state refused"), 1;
  const TileConfig cfg;
  _tile_loadconfig(&cfg);
  _tile_loadd(4, buf, 64);  // tile numbers must be constants
  _tile_loadd(5, buf, 64);
  _tile_loadd(6, buf, 64);
  _tile_loadd(7, buf, 64);
  for (int rep = 0; rep < 3; ++rep) {
    const double product = NsPerOp(4, [](int) {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    });
    const double load = NsPerOp(4, [](int) {
      _tile_loadd(4, buf, 64);
      _tile_loadd(5, buf + 1024, 64);
      _tile_loadd(6, buf + 2048, 64);
      _tile_loadd(7, buf + 3072, 64);
    });
    const double store = NsPerOp(1, [](int i) { _tile_stored(0, buf + 8192 + (i & 3) * 1024, 64); });
    const double block = NsPerOp(4, [](int i) {  // per product, its loads included
      uint8_t* b = buf + (i & 7) * 4096;
      _tile_loadd(4, b, 64);
      _tile_loadd(6, b + 1024, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(5, b + 2048, 64);
      _tile_dpbf16ps(1, 5, 6);
      _tile_loadd(7, b + 3072, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    });
    std::printf("{\"product_ns\": %.2f, \"load_ns\": %.2f, \"store_ns\": %.2f, "
                "\"product_in_2x2_block_ns\": %.2f}\n", product, load, store, block);
  }
  _tile_release();
  return 0;
#else
  return std::puts("built without AMX-BF16"), 1;
#endif
}
