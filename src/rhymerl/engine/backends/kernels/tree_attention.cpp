// Attention of a forward's small steps (decode rows, draft trees, chains of at most 64 tokens per slot)
// without padding or mask: on AVX-512 CPUs in fp32 and bf16; elsewhere in fp32 by a portable version
// (`tree_attention_rows_portable`), and in bf16 `tree_attention_supports` is false and every step's
// attention is SDPA's (engine/backends/cpu_attention.py decides which groups it gets). In bf16 on CPUs with AMX the
// products run on tiles (`tree_attention_tiles`), reading each slot's keys and values from a tile cache
// that the engine keeps beside the KV cache (engine/backends/tile_cache.py); else in fp32 AVX-512 arithmetic.
#include <torch/library.h>

#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define RHYMERL_TREE_ATTENTION 1
#include <immintrin.h>
#endif

namespace rhymerl_native {
namespace {

#ifdef RHYMERL_TREE_ATTENTION

// 32 elements of a row -> two fp32 vectors. bf16 is the top half of an fp32, so interleaving each value
// under 16 zero bits widens it; the interleave works per 128-bit lane, which permutes the order (`lo`
// holds elements 8L..8L+3 of lane L, `hi` 8L+4..8L+7). Dot products and weighted sums do not care, as
// long as every operand is permuted alike; `widened_index` undoes it for the output. fp32: plain loads.
inline void widen32(const float* p, __m512& lo, __m512& hi) {
  lo = _mm512_loadu_ps(p);
  hi = _mm512_loadu_ps(p + 16);
}
inline void widen32(const c10::BFloat16* p, __m512& lo, __m512& hi) {
  const __m512i x = _mm512_loadu_si512(p), zero = _mm512_setzero_si512();
  lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, x));
  hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, x));
}
// A vector as a class type, so that std::vector keeps its 64-byte alignment (a bare __m512 template
// argument loses its alignment attribute).
struct alignas(64) Vec {
  __m512 v;
};

// Element of the row that lane m of vector v (0 = lo, 1 = hi) of widen32 holds.
template <typename T>
constexpr int widened_index(int v, int m) {
  return std::is_same_v<T, float> ? 16 * v + m : 8 * (m / 4) + 4 * v + m % 4;
}

// a[0..15] -> one vector whose lane i is the sum of a[i]'s 16 lanes: a transpose-and-add tree (45
// instructions for 16 dot products, against ~8 each for a horizontal sum apiece).
inline __m512 sum16x16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a2i: 0+2, a2i+1: 0+2, a2i: 1+3, a2i+1: 1+3]
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: that lane's sums of a4i .. a4i+3
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  auto fold = [](__m512 x, __m512 y) {  // lanes [x0+x1, x2+x3, y0+y1, y2+y3] (128-bit lanes)
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  return fold(fold(c[0], c[1]), fold(c[2], c[3]));
}

// sq[0, len) -> exp(sq - max) in place; returns 1 / their sum. In 16 lanes by k mod 16 (a scalar running sum
// kept it unvectorised), so the result depends only on the row's values in order.
inline float softmax_row(float* sq, int64_t len) {
  __m512 top16 = _mm512_set1_ps(sq[0]);
  int64_t k = 0;
  for (; k + 16 <= len; k += 16) top16 = _mm512_max_ps(top16, _mm512_loadu_ps(sq + k));
  float top = _mm512_reduce_max_ps(top16);
  for (; k < len; ++k) top = sq[k] > top ? sq[k] : top;
  for (k = 0; k < len; ++k) sq[k] = exp_approx(sq[k] - top);
  __m512 sum16 = _mm512_setzero_ps();
  for (k = 0; k + 16 <= len; k += 16) sum16 = _mm512_add_ps(sum16, _mm512_loadu_ps(sq + k));
  float sum = _mm512_reduce_add_ps(sum16);
  for (; k < len; ++k) sum += sq[k];
  return 1.f / sum;
}

#endif  // RHYMERL_TREE_ATTENTION

// Token index where each run of consecutive tokens of one slot (same slot, same base) starts, then n.
std::vector<int64_t> slot_runs(const int64_t* slots, const int64_t* base, int64_t n) {
  std::vector<int64_t> runs;
  for (int64_t i = 0; i < n; ++i)
    if (i == 0 || slots[i] != slots[i - 1] || base[i] != base[i - 1]) runs.push_back(i);
  runs.push_back(n);
  for (size_t r = 0; r + 1 < runs.size(); ++r)  // a token's ancestors are bits of one int64
    TORCH_CHECK(runs[r + 1] - runs[r] <= 64, "rhymerl native kernels: tree_attention takes at most 64 consecutive "
                "tokens of one slot, got ", runs[r + 1] - runs[r]);
  return runs;
}

// body(first, last) on each thread for its share of the work items (item it: run it % runs, KV head
// it / runs), in one list per thread of about equal cost (queries x keys), since slots differ in length.
template <typename Body>
void for_items(const std::vector<int64_t>& runs, const int64_t* base, int64_t kv, const Body& body) {
  const int64_t num_runs = static_cast<int64_t>(runs.size()) - 1, items = num_runs * kv;
  std::vector<double> cost(items + 1, 0.0);
  for (int64_t it = 0; it < items; ++it) {
    const int64_t r = it % num_runs, m = runs[r + 1] - runs[r];
    cost[it + 1] = cost[it] + static_cast<double>(m) * static_cast<double>(base[runs[r]] + m);
  }
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
      const int64_t first = std::lower_bound(cost.begin(), cost.end(), cost[items] * chunk / chunks) - cost.begin();
      const int64_t last = chunk + 1 == chunks ? items
          : std::lower_bound(cost.begin(), cost.end(), cost[items] * (chunk + 1) / chunks) - cost.begin();
      body(first, last);
    }
  });
}

#ifdef RHYMERL_TREE_ATTENTION

// Attention of the small steps of a forward: decode rows, draft trees and short chains (at most 64 tokens
// per slot). Token i of slot slots[i] attends to the slot's committed prefix, keys [0, base[i]), and to its
// tree ancestors and itself, keys base[i] + j for each set bit j of anc[i] (a decode row: base = its
// position, anc = 1). Each slot is read up to its own length, with no mask and no padding.
//
// A work item is a run of consecutive tokens of one slot and one KV head; its queries (tokens x the G query
// heads of the KV head) share the prefix. fp32 throughout:
//  1. scores, 16 keys at a time: a block of keys is widened once and used by every query; each query's 16
//     dot products are summed by one transpose-and-add tree. Then each token's ancestors, as blocks of their
//     own.
//  2. softmax of each query's scores (prefix, then ancestors, in position order);
//  3. the softmax-weighted sum of the values, 16 / (D / 16) queries per pass so that their accumulators
//     stay in registers; rounded to T at the end.
// A query's arithmetic depends only on its own keys in position order, so a token verified in a tree and
// the same token decoded later over the same keys get the same bits.
template <typename T, int NW>  // NW: 32-element units per head (D = 32 * NW)
void tree_attention_rows(const T* q, const T* cache, T* out, const int64_t* slots, const int64_t* base,
                         const int64_t* anc, int64_t n, int64_t h, int64_t kv, int64_t s_slot, int64_t s_head,
                         float scale) {
  constexpr int D = 32 * NW, NV = 2 * NW, GC = 16 / NV;  // head size, vectors per head, queries per value pass
  const int64_t g = h / kv;
  const std::vector<int64_t> runs = slot_runs(slots, base, n);
  const int64_t num_runs = static_cast<int64_t>(runs.size()) - 1;
  for_items(runs, base, kv, [&](int64_t first, int64_t last) {
    std::vector<Vec> qv;  // the item's queries, widened
    std::vector<float> scores;
    alignas(64) __m512 block[16][NV];
    {
      for (int64_t it = first; it < last; ++it) {
        const int64_t r = it % num_runs, j = it / num_runs, i0 = runs[r], m = runs[r + 1] - i0;
        const int64_t prefix = base[i0], nq = m * g, stride = (prefix + 15) / 16 * 16 + 64;
        const T* keys = cache + slots[i0] * s_slot + j * s_head;
        const T* values = cache + slots[i0] * s_slot + (kv + j) * s_head;
        qv.resize(nq * NV);
        for (int64_t t = 0; t < m; ++t)  // query (t, gi) is head j * g + gi of token i0 + t
          for (int64_t e = 0; e < g * NW; ++e)
            widen32(q + ((i0 + t) * h + j * g) * D + 32 * e, qv[(t * g) * NV + 2 * e].v, qv[(t * g) * NV + 2 * e + 1].v);
        scores.resize(nq * stride);
        // 16 dot products of every query qs..qe with the rows in `block`, scaled, stored at column `col`
        auto score_block = [&](int64_t qs, int64_t qe, int64_t col) {
          for (int64_t qi = qs; qi < qe; ++qi) {
            const Vec* qq = qv.data() + qi * NV;
            __m512 dots[16];
            for (int k = 0; k < 16; ++k) {
              dots[k] = _mm512_mul_ps(qq[0].v, block[k][0]);
              for (int c = 1; c < NV; ++c) dots[k] = _mm512_fmadd_ps(qq[c].v, block[k][c], dots[k]);
            }
            _mm512_storeu_ps(scores.data() + qi * stride + col, _mm512_mul_ps(sum16x16(dots), _mm512_set1_ps(scale)));
          }
        };
        auto load_block = [&](auto row_of, int64_t count) {  // rows row_of(0..count-1) of the keys, zero-padded
          for (int64_t k = 0; k < 16; ++k)
            for (int w = 0; w < NW; ++w) {
              if (k < count) widen32(keys + row_of(k) * D + 32 * w, block[k][2 * w], block[k][2 * w + 1]);
              else block[k][2 * w] = block[k][2 * w + 1] = _mm512_setzero_ps();
            }
        };
        for (int64_t t0 = 0; t0 < prefix; t0 += 16) {  // 1. scores: the shared prefix ...
          load_block([&](int64_t k) { return t0 + k; }, std::min<int64_t>(16, prefix - t0));
          score_block(0, nq, t0);
        }
        int64_t na[64], pos[64][64];  // ... then each token's ancestors (positions in order)
        for (int64_t t = 0; t < m; ++t) {
          na[t] = 0;
          for (uint64_t bits = static_cast<uint64_t>(anc[i0 + t]); bits; bits &= bits - 1)
            pos[t][na[t]++] = prefix + __builtin_ctzll(bits);
          for (int64_t k0 = 0; k0 < na[t]; k0 += 16) {
            load_block([&](int64_t k) { return pos[t][k0 + k]; }, std::min<int64_t>(16, na[t] - k0));
            score_block(t * g, (t + 1) * g, prefix + k0);
          }
        }
        float inv_sum[64 * 64];
        for (int64_t qi = 0; qi < nq; ++qi)  // 2. softmax
          inv_sum[qi] = softmax_row(scores.data() + qi * stride, prefix + na[qi / g]);
        for (int64_t q0 = 0; q0 < nq; q0 += GC) {  // 3. values
          const int64_t qc = std::min<int64_t>(GC, nq - q0);
          __m512 acc[GC][NV];
          for (int a = 0; a < GC; ++a)
            for (int c = 0; c < NV; ++c) acc[a][c] = _mm512_setzero_ps();
          auto add_row = [&](int a, int64_t row, float weight) {
            __m512 v[NV];
            for (int w = 0; w < NW; ++w) widen32(values + row * D + 32 * w, v[2 * w], v[2 * w + 1]);
            const __m512 p = _mm512_set1_ps(weight);
            for (int c = 0; c < NV; ++c) acc[a][c] = _mm512_fmadd_ps(p, v[c], acc[a][c]);
          };
          for (int64_t k = 0; k < prefix; ++k) {
            __m512 v[NV];
            for (int w = 0; w < NW; ++w) widen32(values + k * D + 32 * w, v[2 * w], v[2 * w + 1]);
            for (int a = 0; a < GC; ++a) {
              if (a >= qc) break;
              const __m512 p = _mm512_set1_ps(scores[(q0 + a) * stride + k]);
              for (int c = 0; c < NV; ++c) acc[a][c] = _mm512_fmadd_ps(p, v[c], acc[a][c]);
            }
          }
          for (int a = 0; a < qc; ++a) {
            const int64_t qi = q0 + a, t = qi / g;
            for (int64_t k = 0; k < na[t]; ++k) add_row(a, pos[t][k], scores[qi * stride + prefix + k]);
            alignas(64) float lanes[D];
            for (int c = 0; c < NV; ++c) _mm512_store_ps(lanes + 16 * c, _mm512_mul_ps(acc[a][c], _mm512_set1_ps(inv_sum[qi])));
            T* o = out + ((i0 + t) * h + j * g + qi % g) * D;
            for (int c = 0; c < NV; ++c)
              for (int u = 0; u < 16; ++u) o[32 * (c / 2) + widened_index<T>(c % 2, u)] = static_cast<T>(lanes[16 * c + u]);
          }
        }
      }
    }
  });
}

#ifdef RHYMERL_TILES
using BF16 = c10::BFloat16;

// 16 rows of 16 dwords, transposed in place: lane j of row i <-> lane i of row j.
__attribute__((target("avx512f"))) inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // pairs of dwords
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // quads
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes, rows 4 apart
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {  // 128-bit lanes, rows 8 apart
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// Keys rows[0..15] (nullptr: a zero key), dims [32c, 32c + 32) -> the B tile of QK^T: row r holds dims
// 2r, 2r + 1 of each of the 16 keys (a dword transpose).
__attribute__((target("avx512f"))) inline void key_tile(const BF16* const* rows, int c, BF16* dst) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = rows[i] ? _mm512_loadu_si512(rows[i] + 32 * c) : _mm512_setzero_si512();
  transpose16(r);
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + 32 * i, r[i]);
}

// Values rows[0..31] (nullptr: zero), dims [16f, 16f + 16) -> the B tile of PV: row r holds, per dim, the
// values of keys 2r and 2r + 1.
__attribute__((target("avx512f"))) inline void value_tile(const BF16* const* rows, int f, BF16* dst) {
  const __m512i zero = _mm512_setzero_si512();
  for (int r = 0; r < 16; ++r) {
    const BF16 *a = rows[2 * r], *b = rows[2 * r + 1];
    const __m512i lo = a ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 16 * f))) : zero;
    const __m512i hi = b ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 * f))) : zero;
    _mm512_storeu_si512(dst + 32 * r, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
  }
}

// Tile C += A B for the 16 x 32 bf16 A at a (row stride lda bytes) and the packed B tile at b, through
// tiles 4 and 6. A macro: GCC's tile intrinsics paste the tile number into the instruction's text.
#define RHYMERL_TILE_DP(C, a, lda, b) \
  do {                                \
    _tile_loadd(4, (a), (lda));       \
    _tile_loadd(6, (b), 64);          \
    _tile_dpbf16ps(C, 4, 6);          \
  } while (0)

// The bf16 kernel on AMX tiles (where tile_linear_supported(), for at most 16 query heads per KV head):
// the same work items, keys and softmax as tree_attention_rows, with QK^T and PV as tile products. Each
// query's keys are its logical sequence: the prefix [0, base), then its ancestors in order (their scores
// and values gathered next to the prefix), in blocks of 32 counted from key 0. A block wholly inside the
// prefix is shared by the item's queries (one product for all of them); the others are each token's own.
// Every tile row's result depends only on that row and the block, and the PV accumulators carry from
// block to block in order, so a token verified in a tree and the same token decoded later (whose blocks
// are all prefix) get the same bits. The probabilities enter PV as bf16 (as in SDPA's bf16 kernels),
// their sum in fp32.
template <int NW>
__attribute__((target("amx-tile,amx-bf16,avx512f"))) void tree_attention_tiles(
    const BF16* q, const BF16* cache, BF16* out, const int64_t* slots, const int64_t* base, const int64_t* anc,
    int64_t n, int64_t h, int64_t kv, int64_t s_slot, int64_t s_head, float scale, BF16* tile_cache,
    int64_t* tile_blocks, int64_t num_blocks) {
  constexpr int D = 32 * NW, DT = D / 16;  // head size, 16-dim output tiles per head
  constexpr int64_t kBlock = (2 * NW + DT) * 512;  // a block's K^T tiles, then its V tiles
  const int64_t g = h / kv;
  const std::vector<int64_t> runs = slot_runs(slots, base, n);
  const int64_t num_runs = static_cast<int64_t>(runs.size()) - 1;
  for_items(runs, base, kv, [&](int64_t first, int64_t last) {
    configure_tiles();
    std::vector<BF16> qp, pb, local;  // queries [rows x D]; probabilities [rows x stride]; shared blocks' tiles
    std::vector<float> scores, acc;     // [rows x stride]; PV accumulators [rows x D]
    alignas(64) BF16 kt[2 * NW][512];   // a token's own block's K^T tiles: dims 32c.., keys 16 half..
    alignas(64) BF16 vt[3 * DT][512];   // a token's own V tiles (at most 3 blocks: 31 prefix keys + 64)
    alignas(64) float ct[4][256];
    const BF16* rows[32];
    for (int64_t it = first; it < last; ++it) {
      const int64_t r = it % num_runs, j = it / num_runs, i0 = runs[r], m = runs[r + 1] - i0;
      const int64_t prefix = base[i0], nq = m * g, nq16 = (nq + 15) / 16 * 16, shared = prefix / 32;
      const BF16* keys = cache + slots[i0] * s_slot + j * s_head;
      const BF16* values = cache + slots[i0] * s_slot + (kv + j) * s_head;
      int64_t na[64], pos[64][64], len_max = prefix;  // each token's ancestors (positions in order)
      for (int64_t t = 0; t < m; ++t) {
        na[t] = 0;
        for (uint64_t bits = static_cast<uint64_t>(anc[i0 + t]); bits; bits &= bits - 1)
          pos[t][na[t]++] = prefix + __builtin_ctzll(bits);
        len_max = std::max(len_max, prefix + na[t]);
      }
      // key k of token t's logical sequence, or nullptr past its end
      auto key_row = [&](const BF16* kv_rows, int64_t t, int64_t k) -> const BF16* {
        if (k < prefix) return kv_rows + k * D;
        return k < prefix + na[t] ? kv_rows + pos[t][k - prefix] * D : nullptr;
      };
      const int64_t stride = (len_max + 31) / 32 * 32, rows_alloc = nq16 + 16;  // +16: a token's 16-row loads
      qp.assign(rows_alloc * D, BF16(0.f));
      for (int64_t t = 0; t < m; ++t)  // query t * g + gi is head j * g + gi of token i0 + t
        std::memcpy(qp.data() + t * g * D, q + ((i0 + t) * h + j * g) * D, g * D * sizeof(BF16));
      scores.resize(rows_alloc * stride);
      // The shared blocks' tiles: kept in the slot's tile cache when there is one (filled up to the
      // blocks that this step's prefix completes), else made for this call.
      BF16* tiles;
      int64_t ready = 0;
      if (tile_cache != nullptr) {
        TORCH_CHECK(shared <= num_blocks, "rhymerl native kernels: tree_attention's tile cache holds ", num_blocks,
                    " blocks, slot ", slots[i0], " needs ", shared);
        tiles = tile_cache + (slots[i0] * kv + j) * num_blocks * kBlock;
        ready = std::min(tile_blocks[slots[i0] * kv + j], shared);
      } else {
        local.resize(std::max<int64_t>(shared, 1) * kBlock);
        tiles = local.data();
      }
      for (int64_t b = ready; b < shared; ++b) {
        BF16* tb = tiles + b * kBlock;
        for (int k = 0; k < 32; ++k) rows[k] = keys + (32 * b + k) * D;
        for (int c = 0; c < NW; ++c)
          for (int half = 0; half < 2; ++half) key_tile(rows + 16 * half, c, tb + (2 * c + half) * 512);
        for (int k = 0; k < 32; ++k) rows[k] = values + (32 * b + k) * D;
        for (int f = 0; f < DT; ++f) value_tile(rows, f, tb + (2 * NW + f) * 512);
      }
      if (tile_cache != nullptr) tile_blocks[slots[i0] * kv + j] = std::max(ready, shared);
      // 1. scores, scaled. Shared blocks: every query at once ...
      for (int64_t b = 0; b < shared; ++b) {
        const BF16* tb = tiles + b * kBlock;
        for (int64_t q0 = 0; q0 < nq16; q0 += 16) {
          _tile_zero(0);
          _tile_zero(1);
          for (int c = 0; c < NW; ++c) {
            RHYMERL_TILE_DP(0, qp.data() + q0 * D + 32 * c, D * 2, tb + 2 * c * 512);
            RHYMERL_TILE_DP(1, qp.data() + q0 * D + 32 * c, D * 2, tb + (2 * c + 1) * 512);
          }
          _tile_stored(0, ct[0], 64);
          _tile_stored(1, ct[1], 64);
          for (int64_t a = 0; a < 16; ++a)
            for (int half = 0; half < 2; ++half)
              _mm512_storeu_ps(scores.data() + (q0 + a) * stride + 32 * b + 16 * half,
                               _mm512_mul_ps(_mm512_load_ps(ct[half] + 16 * a), _mm512_set1_ps(scale)));
        }
      }
      // ... then each token's own blocks, for its g queries
      for (int64_t t = 0; t < m; ++t)
        for (int64_t b = shared; 32 * b < prefix + na[t]; ++b) {
          for (int k = 0; k < 32; ++k) rows[k] = key_row(keys, t, 32 * b + k);
          for (int c = 0; c < NW; ++c)
            for (int half = 0; half < 2; ++half) key_tile(rows + 16 * half, c, kt[2 * c + half]);
          _tile_zero(0);
          _tile_zero(1);
          for (int c = 0; c < NW; ++c) {
            RHYMERL_TILE_DP(0, qp.data() + t * g * D + 32 * c, D * 2, kt[2 * c]);
            RHYMERL_TILE_DP(1, qp.data() + t * g * D + 32 * c, D * 2, kt[2 * c + 1]);
          }
          _tile_stored(0, ct[0], 64);
          _tile_stored(1, ct[1], 64);
          for (int64_t a = 0; a < g; ++a)
            for (int half = 0; half < 2; ++half)
              _mm512_storeu_ps(scores.data() + (t * g + a) * stride + 32 * b + 16 * half,
                               _mm512_mul_ps(_mm512_load_ps(ct[half] + 16 * a), _mm512_set1_ps(scale)));
        }
      // 2. softmax per query; the probabilities as bf16, zero past the query's end to its block's end
      float inv_sum[64 * 64];
      pb.assign(rows_alloc * stride, BF16(0.f));
      for (int64_t qi = 0; qi < nq; ++qi) {
        const int64_t len = prefix + na[qi / g];
        float* sq = scores.data() + qi * stride;
        inv_sum[qi] = softmax_row(sq, len);
        BF16* pq = pb.data() + qi * stride;
        for (int64_t k = 0; k < len; ++k) pq[k] = narrow<BF16>(sq[k]);
      }
      // 3. PV. Shared blocks: every query at once ...
      acc.assign(rows_alloc * D, 0.f);
      for (int64_t q0 = 0; q0 < nq16 && shared > 0; q0 += 16)
        for (int f0 = 0; f0 < DT; f0 += 4) {  // 4 accumulator tiles: 64 dims at a time
          _tile_zero(0);  // tile numbers are immediates: no loops over them
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t b = 0; b < shared; ++b) {
            _tile_loadd(4, pb.data() + q0 * stride + 32 * b, stride * 2);
            const BF16* vb = tiles + b * kBlock + (2 * NW + f0) * 512;
            _tile_loadd(6, vb, 64); _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(6, vb + 512, 64); _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(6, vb + 1024, 64); _tile_dpbf16ps(2, 4, 6);
            _tile_loadd(6, vb + 1536, 64); _tile_dpbf16ps(3, 4, 6);
          }
          float* ab = acc.data() + q0 * D + 16 * f0;
          _tile_stored(0, ab, D * 4);
          _tile_stored(1, ab + 16, D * 4);
          _tile_stored(2, ab + 32, D * 4);
          _tile_stored(3, ab + 48, D * 4);
        }
      // ... then each token's own blocks, continuing its g queries' accumulators
      for (int64_t t = 0; t < m; ++t) {
        const int64_t len = prefix + na[t], own = (len + 31) / 32 - shared;
        if (own <= 0) continue;
        for (int64_t b = 0; b < own; ++b) {
          for (int k = 0; k < 32; ++k) rows[k] = key_row(values, t, 32 * (shared + b) + k);
          for (int f = 0; f < DT; ++f) value_tile(rows, f, vt[b * DT + f]);
        }
        for (int f0 = 0; f0 < DT; f0 += 4) {
          float* ab = acc.data() + t * g * D + 16 * f0;
          _tile_loadd(0, ab, D * 4);
          _tile_loadd(1, ab + 16, D * 4);
          _tile_loadd(2, ab + 32, D * 4);
          _tile_loadd(3, ab + 48, D * 4);
          for (int64_t b = 0; b < own; ++b) {
            _tile_loadd(4, pb.data() + t * g * stride + 32 * (shared + b), stride * 2);
            _tile_loadd(6, vt[b * DT + f0], 64); _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(6, vt[b * DT + f0 + 1], 64); _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(6, vt[b * DT + f0 + 2], 64); _tile_dpbf16ps(2, 4, 6);
            _tile_loadd(6, vt[b * DT + f0 + 3], 64); _tile_dpbf16ps(3, 4, 6);
          }
          _tile_stored(0, ct[0], 64);
          _tile_stored(1, ct[1], 64);
          _tile_stored(2, ct[2], 64);
          _tile_stored(3, ct[3], 64);
          for (int f = 0; f < 4; ++f)  // only this token's rows go back: the tile's others are other tokens'
            for (int64_t a = 0; a < g; ++a) std::memcpy(ab + a * D + 16 * f, ct[f] + 16 * a, 64);
        }
      }
      // 4. out = acc / sum, rounded once
      for (int64_t qi = 0; qi < nq; ++qi) {
        BF16* o = out + ((i0 + qi / g) * h + j * g + qi % g) * D;
        const float* a = acc.data() + qi * D;
        for (int d = 0; d < D; ++d) o[d] = narrow<BF16>(a[d] * inv_sum[qi]);
      }
    }
    release_tiles();
  });
}
#undef RHYMERL_TILE_DP
#endif  // RHYMERL_TILES
#else  // RHYMERL_TREE_ATTENTION

// CPUs without AVX-512 (AVX2 x86, Arm): the same work items in portable vector code, fp32 only (dtype=auto is
// fp32 where bf16 is not native). Without it the small steps' attention is SDPA over one group padded to the
// largest tree, which on a 2-core AVX2 CPU made a drafting step cost more than the start-up cost grid (measured
// with uniform chains) predicted (docs/notebook/2026-11-22.md, bench spec at 733015d and 7f5499d). One query at
// a time: its scores over the prefix and its ancestors, their softmax, the weighted sum of the values, each in
// a fixed order (8 lanes by key index), so a query's bits depend only on its own keys and a token verified in
// a tree gets the bits it gets decoded alone.
typedef float V8 __attribute__((vector_size(32)));

inline V8 load8(const float* p) {
  V8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float sum8(V8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

template <int D>
void tree_attention_rows_portable(const float* q, const float* cache, float* out, const int64_t* slots,
                                  const int64_t* base, const int64_t* anc, int64_t n, int64_t h, int64_t kv,
                                  int64_t s_slot, int64_t s_head, float scale) {
  constexpr int NV = D / 8;
  const int64_t g = h / kv;
  const std::vector<int64_t> runs = slot_runs(slots, base, n);
  const int64_t num_runs = static_cast<int64_t>(runs.size()) - 1;
  for_items(runs, base, kv, [&](int64_t first, int64_t last) {
    std::vector<float> sc;
    for (int64_t it = first; it < last; ++it) {
      const int64_t r = it % num_runs, j = it / num_runs, i0 = runs[r], m = runs[r + 1] - i0, prefix = base[i0];
      const float* keys = cache + slots[i0] * s_slot + j * s_head;
      const float* values = cache + slots[i0] * s_slot + (kv + j) * s_head;
      for (int64_t t = 0; t < m; ++t) {
        int64_t pos[64], na = 0;  // the token's keys past the prefix: its ancestors and itself, in order
        for (uint64_t bits = static_cast<uint64_t>(anc[i0 + t]); bits; bits &= bits - 1)
          pos[na++] = prefix + __builtin_ctzll(bits);
        const int64_t len = prefix + na;
        sc.resize(len);
        auto row = [&](int64_t k) { return k < prefix ? k : pos[k - prefix]; };  // key index -> cache row
        for (int64_t gi = 0; gi < g; ++gi) {
          const int64_t head = (i0 + t) * h + j * g + gi;
          V8 qv[NV];
          for (int c = 0; c < NV; ++c) qv[c] = load8(q + head * D + 8 * c);
          float top = -std::numeric_limits<float>::infinity();
          for (int64_t k = 0; k < len; ++k) {  // scores
            const float* key = keys + row(k) * D;
            V8 acc = qv[0] * load8(key);
            for (int c = 1; c < NV; ++c) acc += qv[c] * load8(key + 8 * c);
            sc[k] = sum8(acc) * scale;
            top = sc[k] > top ? sc[k] : top;
          }
          for (int64_t k = 0; k < len; ++k) sc[k] = exp_approx(sc[k] - top);  // softmax
          V8 sum = {};
          int64_t k = 0;
          for (; k + 8 <= len; k += 8) sum += load8(sc.data() + k);
          float total = sum8(sum);
          for (; k < len; ++k) total += sc[k];
          V8 acc[NV] = {};
          for (k = 0; k < len; ++k) {  // values
            const float* value = values + row(k) * D;
            const V8 p = V8{} + sc[k];
            for (int c = 0; c < NV; ++c) acc[c] += p * load8(value + 8 * c);
          }
          const V8 inv = V8{} + 1.f / total;
          for (int c = 0; c < NV; ++c) {
            const V8 o = acc[c] * inv;
            std::memcpy(out + head * D + 8 * c, &o, sizeof o);
          }
        }
      }
    }
  });
}
#endif  // RHYMERL_TREE_ATTENTION

}  // namespace

// Whether tree_attention runs for heads of size d in this dtype (else it returns None: use SDPA).
bool tree_attention_supports(int64_t d, at::ScalarType dtype) {
#ifdef RHYMERL_TREE_ATTENTION
  return (d == 64 || d == 128) && (dtype == at::kFloat || dtype == at::kBFloat16);
#else
  return (d == 64 || d == 128) && dtype == at::kFloat;  // the portable kernel
#endif
}

// Elements per (slot, KV head, 32-position block) of the tile cache that tree_attention keeps where it runs
// on AMX tiles (bf16 on CPUs with AMX): the block's keys and values, rearranged. 0 elsewhere (no cache).
int64_t tree_attention_block_elems(int64_t d, at::ScalarType dtype) {
#if defined(RHYMERL_TREE_ATTENTION) && defined(RHYMERL_TILES)
  if (tree_attention_supports(d, dtype) && dtype == at::kBFloat16 && tile_linear_supported()) return 2 * 32 * d;
#endif
  return 0;
}

// q [N, H, D] -> [N, H, D], or None where the kernel does not take the head size, dtype or CPU. Token i
// attends to keys [0, base[i]) of slot slot_of[i] in cache [slots, 2KV, capacity, D] and to keys
// base[i] + j for the set bits j of anc[i] (its ancestors in the step's tree and itself; this step's keys
// and values already written). A slot's tokens are consecutive and share base.
std::optional<Tensor> tree_attention(const Tensor& q, const Tensor& cache, const Tensor& slot_of, const Tensor& base,
                                     const Tensor& anc, const std::optional<Tensor>& tiles,
                                     const std::optional<Tensor>& tile_blocks) {
  check_cpu(q, "q");
  check_cpu(cache, "cache");
  const int64_t n = q.size(0), h = q.size(1), d = q.size(2), kv = cache.size(1) / 2;
  if (!tree_attention_supports(d, q.scalar_type()) || cache.scalar_type() != q.scalar_type()) return std::nullopt;
  TORCH_CHECK(h % kv == 0 && h / kv <= 64 && cache.size(-1) == d, "rhymerl native kernels: tree_attention needs "
              "H a multiple of KV (at most 64 times) and the cache's head size");
  for (const Tensor* t : {&slot_of, &base, &anc})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->numel() == n && t->is_contiguous(),
                "rhymerl native kernels: slot_of, base and anc must be contiguous int64 [N]");
  const int64_t* slots = slot_of.const_data_ptr<int64_t>();
  const int64_t* bases = base.const_data_ptr<int64_t>();
  const int64_t* bits = anc.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {  // every key read lies in the cache
    const uint64_t a = static_cast<uint64_t>(bits[i]);
    TORCH_CHECK(0 <= slots[i] && slots[i] < cache.size(0) && bases[i] >= 0 && a != 0 &&
                    bases[i] + 64 - __builtin_clzll(a) <= cache.size(2),
                "rhymerl native kernels: tree_attention token ", i, " reads outside the cache (slot ", slots[i],
                ", base ", bases[i], ")");
  }
  Tensor out = at::empty_like(q);
#ifdef RHYMERL_TREE_ATTENTION
  auto run = [&](auto type, auto nw) {
    using T = decltype(type);
    tree_attention_rows<T, decltype(nw)::value>(
        q.const_data_ptr<T>(), cache.const_data_ptr<T>(), out.mutable_data_ptr<T>(), slot_of.const_data_ptr<int64_t>(),
        base.const_data_ptr<int64_t>(), anc.const_data_ptr<int64_t>(), n, h, kv, cache.stride(0), cache.stride(1),
        static_cast<float>(1.0 / std::sqrt(static_cast<double>(d))));
  };
  auto run_type = [&](auto type) {
    if (d == 64) run(type, std::integral_constant<int, 2>{});
    else run(type, std::integral_constant<int, 4>{});
  };
#ifdef RHYMERL_TILES
  // A token's query heads of one KV head must fit one tile's 16 rows (h / kv <= 16; else AVX-512, for
  // decoding and verification alike, so both still round alike).
  if (tree_attention_block_elems(d, q.scalar_type()) > 0 && h / kv <= 16) {
    BF16* tile_cache = nullptr;
    int64_t* blocks = nullptr;
    int64_t num_blocks = 0;
    if (tiles) {
      TORCH_CHECK(tile_blocks && tiles->dim() == 4 && tiles->size(0) == cache.size(0) && tiles->size(1) == kv &&
                      tiles->size(3) == tree_attention_block_elems(d, q.scalar_type()) &&
                      tiles->scalar_type() == at::kBFloat16 && tiles->is_contiguous() &&
                      tile_blocks->scalar_type() == at::kLong && tile_blocks->is_contiguous() &&
                      tile_blocks->numel() == cache.size(0) * kv,
                  "rhymerl native kernels: tree_attention's tile cache must be [slots, KV, blocks, "
                  "tree_attention_block_elems] bf16 with tile_blocks [slots, KV] int64");
      tile_cache = tiles->mutable_data_ptr<BF16>();
      blocks = tile_blocks->mutable_data_ptr<int64_t>();
      num_blocks = tiles->size(2);
    }
    auto run_tiles = [&](auto nw) {
      tree_attention_tiles<decltype(nw)::value>(
          q.const_data_ptr<BF16>(), cache.const_data_ptr<BF16>(), out.mutable_data_ptr<BF16>(),
          slot_of.const_data_ptr<int64_t>(), base.const_data_ptr<int64_t>(), anc.const_data_ptr<int64_t>(), n, h, kv,
          cache.stride(0), cache.stride(1), static_cast<float>(1.0 / std::sqrt(static_cast<double>(d))), tile_cache,
          blocks, num_blocks);
    };
    if (d == 64) run_tiles(std::integral_constant<int, 2>{});
    else run_tiles(std::integral_constant<int, 4>{});
    return out;
  }
#endif
  if (q.scalar_type() == at::kFloat) run_type(float{});
  else run_type(c10::BFloat16{});
#else
  auto run_portable = [&](auto dim) {
    tree_attention_rows_portable<decltype(dim)::value>(
        q.const_data_ptr<float>(), cache.const_data_ptr<float>(), out.mutable_data_ptr<float>(),
        slot_of.const_data_ptr<int64_t>(), base.const_data_ptr<int64_t>(), anc.const_data_ptr<int64_t>(), n, h, kv,
        cache.stride(0), cache.stride(1), static_cast<float>(1.0 / std::sqrt(static_cast<double>(d))));
  };
  if (d == 64) run_portable(std::integral_constant<int, 64>{});
  else run_portable(std::integral_constant<int, 128>{});
#endif
  return out;
}

}  // namespace rhymerl_native

TORCH_LIBRARY_FRAGMENT(rhymerl_native, m) {
  m.def("tree_attention_supports(int head_dim, ScalarType dtype) -> bool", &rhymerl_native::tree_attention_supports);
  m.def("tree_attention_block_elems(int head_dim, ScalarType dtype) -> int", &rhymerl_native::tree_attention_block_elems);
  m.def("tree_attention(Tensor q, Tensor cache, Tensor slot_of, Tensor base, Tensor anc, Tensor(a!)? tiles=None, "
        "Tensor(b!)? tile_blocks=None) -> Tensor?",
        &rhymerl_native::tree_attention);
}
