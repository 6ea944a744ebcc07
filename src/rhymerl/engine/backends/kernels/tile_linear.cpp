// bf16 matmuls on AMX tiles (Intel CPUs since Sapphire Rapids): y = x W^T (+ b), with W prepacked once
// into the tile layout (`pack_tiles`).
//
// Why not oneDNN's: at the row counts of rollout (1 to a few hundred tokens a step), its prepacked bf16
// matmul was slower than this one, both in memory-bound decode steps and in verification steps that add
// arithmetic. This one streams each weight tile from memory once per call and reuses it from cache for
// every 32 rows (docs/notebook/2026-11-22.md: `bench engine` at 8e9d563 and `bench spec` at d737761, before and after).
//
// Arithmetic: each output element is the fp32 sum over K in blocks of 32 (one TDPBF16PS per block, in K
// order), plus the bias in fp32, rounded once to bf16. A row's result depends only on that row, not on how
// many rows the call has, so a token verified in a draft tree and the same token decoded get the same
// bits from every matmul. With oneDNN they did not: `bench spec`'s bf16 identity rose from 0.27 to 1.0.
#include <torch/library.h>

#include "common.h"

#ifdef RHYMERL_TILES
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace rhymerl_native {
namespace {

constexpr int64_t kTileN = 16;  // output columns per tile (a B tile's 16 columns of fp32 pairs)
constexpr int64_t kTileK = 32;  // bf16 products per TDPBF16PS row (64 bytes)
constexpr int64_t kTileM = 16;  // rows per A tile
constexpr int64_t kRowBytes = kTileK * 2;            // one tile row: 32 bf16
constexpr int64_t kTileBytes = kTileM * kRowBytes;  // one packed weight tile

#ifdef RHYMERL_TILES

// The CPU has AMX-TILE and AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22), and Linux lets this process use
// the tile registers (they are off until asked for: ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA).
bool tiles_usable() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22))) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};


// fp32 accumulator tile (+ bias) -> bf16 rows [m0, min(m0 + 16, M)) of columns [n0, n0 + 16) of `out`.
inline void store_tile(const float* acc, const float* bias, c10::BFloat16* out, int64_t ldo, int64_t m0, int64_t m,
                       int64_t n0) {
  for (int64_t r = 0; r < kTileM && m0 + r < m; ++r) {
    c10::BFloat16* o = out + (m0 + r) * ldo + n0;
    for (int j = 0; j < kTileN; ++j) o[j] = narrow<c10::BFloat16>(acc[r * kTileN + j] + (bias ? bias[n0 + j] : 0.f));
  }
}

// MB x NB accumulator tiles (MB, NB in {1, 2}): rows [m0, m0 + 16 MB) of x against column blocks nb, nb+1.
// Each weight tile is loaded once per MB row blocks; K runs in order, one TDPBF16PS per 32 products.
template <int MB, int NB>
__attribute__((target("amx-tile,amx-bf16"))) void tile_block(const char* x, int64_t ldx, const char* w, int64_t kb,
                                                             float (*acc)[256]) {
  _tile_zero(0);
  if (NB == 2) _tile_zero(1);
  if (MB == 2) _tile_zero(2);
  if (MB == 2 && NB == 2) _tile_zero(3);
  const char* w1 = w + kb * kTileBytes;
  for (int64_t k = 0; k < kb; ++k) {
    _tile_loadd(4, x + k * kRowBytes, ldx);
    _tile_loadd(6, w + k * kTileBytes, kRowBytes);
    _tile_dpbf16ps(0, 4, 6);
    if (NB == 2) {
      _tile_loadd(7, w1 + k * kTileBytes, kRowBytes);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (MB == 2) {
      _tile_loadd(5, x + 16 * ldx + k * kRowBytes, ldx);
      _tile_dpbf16ps(2, 5, 6);
      if (NB == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, acc[0], kRowBytes);
  if (NB == 2) _tile_stored(1, acc[1], kRowBytes);
  if (MB == 2) _tile_stored(2, acc[NB], kRowBytes);  // acc[row block * NB + column block]
  if (MB == 2 && NB == 2) _tile_stored(3, acc[3], kRowBytes);
}

// Column block nb (and nb + 1 when NB == 2) for every row of x, two row blocks at a time: the weight tiles
// come from memory in the first pass and from cache in the others.
template <int NB>
void column_blocks(const char* x, int64_t ldx, int64_t m, const char* w, int64_t kb, const float* bias,
                   c10::BFloat16* out, int64_t n, int64_t nb) {
  alignas(64) float acc[4][256];
  const int64_t mb = (m + kTileM - 1) / kTileM;
  int64_t i = 0;
  for (; i + 2 <= mb; i += 2) {
    tile_block<2, NB>(x + i * kTileM * ldx, ldx, w, kb, acc);
    for (int t = 0; t < 2 * NB; ++t)
      store_tile(acc[t], bias, out, n, (i + t / NB) * kTileM, m, (nb + t % NB) * kTileN);
  }
  if (i < mb) {
    tile_block<1, NB>(x + i * kTileM * ldx, ldx, w, kb, acc);
    for (int t = 0; t < NB; ++t) store_tile(acc[t], bias, out, n, i * kTileM, m, (nb + t) * kTileN);
  }
}

#endif  // RHYMERL_TILES

}  // namespace

#ifdef RHYMERL_TILES
// Every tile 16 rows of 64 bytes. Here: 0-3 fp32 accumulators (16 x 16), 4-5 x rows (16 x 32 bf16), 6-7
// weight tiles (16 pairs x 16); tree_attention.cpp uses the same shapes.
__attribute__((target("amx-tile"))) void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = kRowBytes;
    cfg.rows[t] = 16;
  }
  // GCC does not see that LDTILECFG reads cfg and dropped the stores above when this was not inlined
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }
#endif

bool tile_linear_supported() {
#ifdef RHYMERL_TILES
  return tiles_usable();
#else
  return false;
#endif
}

// [N, K] bf16 weight -> [N/16, ceil(K/32), 16, 32] tiles: tile (j, k) row r holds, for the 16 output columns
// c of block j, the pair W[16 j + c][32 k + 2 r], W[16 j + c][32 k + 2 r + 1] (zero past K), the layout
// TDPBF16PS multiplies a row block of x by.
Tensor pack_tiles(const Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16,
              "pack_tiles: the weight must be a 2-D bf16 tensor, got ", w.sizes(), " ", w.scalar_type());
  const int64_t n = w.size(0), k = w.size(1), kb = (k + kTileK - 1) / kTileK;
  TORCH_CHECK(n % kTileN == 0, "pack_tiles: out_features must be a multiple of ", kTileN, ", got ", n);
  const Tensor src = w.contiguous();
  Tensor out = at::zeros({n / kTileN, kb, kTileM, kTileK}, w.options());
  const auto* s = src.data_ptr<c10::BFloat16>();
  auto* d = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, n / kTileN, 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t c = 0; c < kTileN; ++c)
        for (int64_t e = 0; e < k; ++e) {
          const int64_t blk = e / kTileK, pair = (e % kTileK) / 2;
          d[((j * kb + blk) * kTileM + pair) * kTileK + 2 * c + e % 2] = s[(j * kTileN + c) * k + e];
        }
  });
  return out;
}

// x [M, K] bf16 times the tiles of a [N, K] weight (+ bias [N]) -> [M, N] bf16.
Tensor tile_linear(const Tensor& x, const Tensor& tiles, const std::optional<Tensor>& bias) {
  TORCH_CHECK(tile_linear_supported(), "tile_linear: this CPU or OS offers no AMX-BF16 tiles");
  TORCH_CHECK(tiles.dim() == 4 && tiles.size(2) == kTileM && tiles.size(3) == kTileK &&
                  tiles.scalar_type() == at::kBFloat16 && tiles.is_contiguous(),
              "tile_linear: tiles must come from pack_tiles, got ", tiles.sizes());
  const int64_t nb = tiles.size(0), kb = tiles.size(1), n = nb * kTileN;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) > (kb - 1) * kTileK &&
                  x.size(1) <= kb * kTileK,
              "tile_linear: x must be [M, K] bf16 with K matching the packed weight (", kb, " blocks of ", kTileK,
              "), got ", x.sizes(), " ", x.scalar_type());
  const int64_t m = x.size(0), k = x.size(1);
  Tensor b;
  if (bias) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == n, "tile_linear: bias must have ", n, " elements, got ", b.numel());
  }
  Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
#ifdef RHYMERL_TILES
  // Row blocks are read 16 rows x 64 bytes at a time: pad x to whole blocks (zeros add nothing).
  Tensor xp = x;
  const int64_t mp = (m + kTileM - 1) / kTileM * kTileM;
  if (mp != m || k != kb * kTileK || !x.is_contiguous()) {
    xp = at::zeros({mp, kb * kTileK}, x.options());
    xp.narrow(0, 0, m).narrow(1, 0, k).copy_(x);
  }
  const char* xd = static_cast<const char*>(xp.data_ptr());
  const char* wd = static_cast<const char*>(tiles.data_ptr());
  const float* bd = bias ? b.data_ptr<float>() : nullptr;
  auto* od = out.data_ptr<c10::BFloat16>();
  const int64_t ldx = kb * kRowBytes, block_bytes = kb * kTileBytes;
  // Threads split the column blocks, in pairs: each streams its share of the weight once.
  at::parallel_for(0, (nb + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
    configure_tiles();
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t j = 2 * p;
      if (j + 1 < nb)
        column_blocks<2>(xd, ldx, m, wd + j * block_bytes, kb, bd, od, n, j);
      else
        column_blocks<1>(xd, ldx, m, wd + j * block_bytes, kb, bd, od, n, j);
    }
    release_tiles();
  });
#endif
  return out;
}

}  // namespace rhymerl_native

TORCH_LIBRARY_FRAGMENT(rhymerl_native, m) {
  m.def("tile_linear_supported() -> bool", &rhymerl_native::tile_linear_supported);
  m.def("pack_tiles(Tensor w) -> Tensor", &rhymerl_native::pack_tiles);
  m.def("tile_linear(Tensor x, Tensor tiles, Tensor? bias) -> Tensor", &rhymerl_native::tile_linear);
}
