// A decode step's weight products on the CPU, on Intel AMX tiles, as an XLA FFI
// handler: y = x w[layer]^T for a few rows x (the batch's tokens) and one layer of
// stacked weights, read in place.
//
// A decode step reads every weight once for a handful of rows, so its products
// are bound by memory. Inside the model's layer loop XLA:CPU copies each layer's
// weights out of the stacked array before its dot (a dynamic slice), and its
// small-row products stream the weights slowly; this reads the layer where it
// lies, stored [out, in], 16 output rows per tile streaming along the input
// (2.4-2.9x XLA's loop here: benchmarks/weight_products.py).
//
// y^T = w x^T on tiles: A = 16 weight rows x 32 inputs (as stored: bf16 pairs along
// the input), B = x^T packed once per call as 16 input pairs x M rows, C = 16
// outputs x M rows in float32. Each output is its own dot product over the input
// in one order, whatever M is, so a row's result never depends on the others.
//
// Same function as cpu_kernels/reference.py's `matmul`.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"

namespace ffi = xla::ffi;

namespace {

using namespace hisparse_cpu;  // NOLINT

constexpr int64_t kMaxRows = 16;   // x's rows: the columns of a tile
constexpr int64_t kUnitRows = 64;  // output features per work unit: four C tiles

// x [M, K] bf16, w [L, N, K] bf16, layer s32[] -> y [M, N] f32: y = x w[layer]^T.
ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                      ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
#if !HISPARSE_AMX
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "hisparse matmul: built for a CPU without AMX-BF16");
#else
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3)
    return ffi::Error::InvalidArgument("hisparse matmul: x [M, K] and w [L, N, K]");
  const int64_t M = xd[0], K = xd[1], L = wd[0], N = wd[1];
  if (wd[2] != K || M < 1 || M > kMaxRows || K % 32 || N % 16)
    return ffi::Error::InvalidArgument(
        "hisparse matmul: shapes (1 <= M <= 16, K % 32 == 0, N % 16 == 0)");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("hisparse matmul: layer out of range");
  if (!AmxReady())
    return ffi::Error(ffi::ErrorCode::kUnavailable,
                      "hisparse matmul: the kernel refused AMX's tile state");
  const uint16_t* wl = reinterpret_cast<const uint16_t*>(w.typed_data()) + l * N * K;
  float* out = y->typed_data();
  // x^T as B tiles [K / 32][16 input pairs][M] of (x[m][2j], x[m][2j+1])
  const int64_t chunks = K / 32;
  std::vector<uint32_t> xt(chunks * 16 * M);
  const uint32_t* xpairs = reinterpret_cast<const uint32_t*>(x.typed_data());
  for (int64_t j = 0; j < K / 2; ++j)
    for (int64_t m = 0; m < M; ++m) xt[j * M + m] = xpairs[m * (K / 2) + j];
  const int64_t units = (N + kUnitRows - 1) / kUnitRows;
  ParallelFor(pool, units, [&](int64_t u) {
    const int64_t n0 = u * kUnitRows, tiles = std::min<int64_t>(4, (N - n0) / 16);
    TileConfig cfg;  // 0-3: C (16 outputs x M), 4: A (16 weight rows x 32 inputs), 7: B
    for (int t : {0, 1, 2, 3, 7}) cfg.colsb[t] = static_cast<uint16_t>(M * 4);
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t* a = wl + n0 * K;
    const int64_t stride = K * 2;
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(7, xt.data() + c * 16 * M, M * 4);
      _tile_loadd(4, a + c * 32, stride);
      _tile_dpbf16ps(0, 4, 7);
      if (tiles > 1) {
        _tile_loadd(4, a + 16 * K + c * 32, stride);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (tiles > 2) {
        _tile_loadd(4, a + 32 * K + c * 32, stride);
        _tile_dpbf16ps(2, 4, 7);
      }
      if (tiles > 3) {
        _tile_loadd(4, a + 48 * K + c * 32, stride);
        _tile_dpbf16ps(3, 4, 7);
      }
    }
    alignas(64) float acc[4][16][kMaxRows];
    _tile_stored(0, acc[0], sizeof(acc[0][0]));
    _tile_stored(1, acc[1], sizeof(acc[0][0]));
    _tile_stored(2, acc[2], sizeof(acc[0][0]));
    _tile_stored(3, acc[3], sizeof(acc[0][0]));
    _tile_release();
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t r = 0; r < 16; ++r)
        for (int64_t m = 0; m < M; ++m) out[m * N + n0 + t * 16 + r] = acc[t][r][m];
  });
  return ffi::Error::Success();
#endif
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
