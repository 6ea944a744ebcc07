// Fused CPU kernels for the rollout forward (rhymerl/model/native.py builds and loads this file).
//
// Why: decoding a small model on a CPU is bound by per-op overhead as much as by arithmetic. A decoder
// layer in eager PyTorch is ~30 small kernels and as many Python calls; here it is two calls around the
// attention: `pre_attn` (residual add, RMSNorm, qkv matmul, q/k norm, rope, K/V cache write) and
// `post_attn` (o_proj, residual add, RMSNorm, gate/up matmul, SiLU x up, down matmul). When a step's
// attention is one call per layer (every decode row and draft tree of the step in one group, the
// usual step), `forward_layers` runs the whole stack, attention included, without returning to Python.
// The matmuls stay oneDNN's (prepacked weights). On AVX-512 CPUs, the attention of decode rows, draft trees
// and short chains is `tree_attention`'s, which reads each slot to its own length: SDPA pads every slot to
// the step's longest context and largest tree behind a mask, and for a few queries costs more in set-up
// than in arithmetic. Longer prefill chunks, and every step elsewhere, go through SDPA's CPU flash kernel.
// The sampler's plain case is here too (`sample_rows`).
//
// Arithmetic follows rhymerl/model/decoder.py, rounding to the tensor dtype wherever the eager code
// produces a tensor of that dtype, so bf16 results agree with the eager path up to the summation order of
// the RMSNorm mean and the exp of SiLU (tests compare the two).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using at::Tensor;

// y = W x + b with the weight prepacked by oneDNN (mkldnn::_reorder_linear_weight), or a plain weight.
Tensor linear(const Tensor& x, const Tensor& w, const std::optional<Tensor>& b, bool packed) {
  if (!packed) return at::linear(x, w, b);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&, c10::string_view,
                                     c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  return op.call(x, w, b, "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
}

// Rows worth a thread each: below this, OpenMP's fork costs more than the loop.
constexpr int64_t kGrain = 16;

// float <-> T in a form the compiler vectorises: c10's bf16 rounding branches on NaN, which kept every loop
// that rounds to bf16 scalar. Same results: bf16 is the top half of an fp32, rounded to nearest even, and
// NaN becomes the canonical 0x7FC0.
inline float widen(float v) { return v; }
inline float widen(double v) { return static_cast<float>(v); }
inline float widen(c10::BFloat16 v) { return __builtin_bit_cast(float, static_cast<uint32_t>(v.x) << 16); }
template <typename T>
inline T narrow(float f) { return static_cast<T>(f); }
template <>
inline c10::BFloat16 narrow<c10::BFloat16>(float f) {
  const uint32_t u = __builtin_bit_cast(uint32_t, f);
  const uint16_t rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return c10::BFloat16(f != f ? uint16_t(0x7FC0) : rounded, c10::BFloat16::from_bits());
}
// f rounded to T and back (where the eager code produces a tensor of dtype T).
template <typename T>
inline float round_to(float f) { return widen(narrow<T>(f)); }

// Sum of squares of n floats, in 16 lanes so that the loop vectorises.
inline float sum_squares(const float* v, int64_t n) {
  float lanes[16] = {};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int u = 0; u < 16; ++u) lanes[u] += v[j + u] * v[j + u];
  float ss = 0.f;
  for (; j < n; ++j) ss += v[j] * v[j];
  for (int u = 0; u < 16; ++u) ss += lanes[u];
  return ss;
}

// s = x + r (rounded to T, as the eager residual add is), y = rmsnorm(s) * w; r may be null (s = x).
template <typename T>
void add_rms_norm_rows(const T* x, const T* r, T* s, T* y, const T* w, int64_t n, int64_t d, float eps) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> v(d);
    for (int64_t i = begin; i < end; ++i) {
      const T* xi = x + i * d;
      const T* ri = r ? r + i * d : nullptr;
      T* si = s + i * d;
      T* yi = y + i * d;
      if (ri) {
        for (int64_t j = 0; j < d; ++j) v[j] = round_to<T>(widen(xi[j]) + widen(ri[j]));
      } else {
        for (int64_t j = 0; j < d; ++j) v[j] = widen(xi[j]);
      }
      for (int64_t j = 0; j < d; ++j) si[j] = narrow<T>(v[j]);
      const float inv = 1.f / std::sqrt(sum_squares(v.data(), d) / static_cast<float>(d) + eps);
      for (int64_t j = 0; j < d; ++j) yi[j] = narrow<T>(round_to<T>(v[j] * inv) * widen(w[j]));
    }
  });
}

// One head of q or k: optional per-head RMSNorm (Qwen3), then rotate-half rope with `cos` and the signed
// `sin` of decoder.rope_tables: out = round(round(x * cos) + rotate_half(x) * sin).
template <typename T>
inline void rope_head(const T* x, T* out, const T* cos, const T* sin, const T* norm_w, int64_t d, float eps, float* tmp) {
  for (int64_t j = 0; j < d; ++j) tmp[j] = widen(x[j]);
  if (norm_w) {
    const float inv = 1.f / std::sqrt(sum_squares(tmp, d) / static_cast<float>(d) + eps);
    for (int64_t j = 0; j < d; ++j) tmp[j] = round_to<T>(round_to<T>(tmp[j] * inv) * widen(norm_w[j]));
  }
  const int64_t half = d / 2;
  for (int64_t j = 0; j < half; ++j)
    out[j] = narrow<T>(round_to<T>(tmp[j] * widen(cos[j])) + tmp[j + half] * widen(sin[j]));
  for (int64_t j = half; j < d; ++j)
    out[j] = narrow<T>(round_to<T>(tmp[j] * widen(cos[j])) + tmp[j - half] * widen(sin[j]));
}

template <typename T>
void rope_and_write(const Tensor& qkv, Tensor& q, Tensor& cache, const Tensor& cos, const Tensor& sin,
                    const std::optional<Tensor>& q_norm, const std::optional<Tensor>& k_norm,
                    const Tensor& slot_of, const Tensor& write_pos, int64_t h, int64_t kv, float eps) {
  const int64_t n = qkv.size(0), d = q.size(2);
  const T* src = qkv.const_data_ptr<T>();
  T* qd = q.mutable_data_ptr<T>();
  T* cd = cache.mutable_data_ptr<T>();
  const T* cd_cos = cos.const_data_ptr<T>();
  const T* cd_sin = sin.const_data_ptr<T>();
  const T* qn = q_norm ? q_norm->const_data_ptr<T>() : nullptr;
  const T* kn = k_norm ? k_norm->const_data_ptr<T>() : nullptr;
  const int64_t* slots = slot_of.const_data_ptr<int64_t>();
  const int64_t* pos = write_pos.const_data_ptr<int64_t>();
  // cache: [slots, 2KV, capacity, D], contiguous
  const int64_t s_head = cache.stride(1), s_slot = cache.stride(0);
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(d);
    for (int64_t i = begin; i < end; ++i) {
      const T* row = src + i * (h + 2 * kv) * d;
      const T* c = cd_cos + i * d;
      const T* s = cd_sin + i * d;
      T* base = cd + slots[i] * s_slot + pos[i] * d;
      for (int64_t j = 0; j < h; ++j) rope_head(row + j * d, qd + (i * h + j) * d, c, s, qn, d, eps, tmp.data());
      for (int64_t j = 0; j < kv; ++j) {
        rope_head(row + (h + j) * d, base + j * s_head, c, s, kn, d, eps, tmp.data());
        std::copy(row + (h + kv + j) * d, row + (h + kv + j + 1) * d, base + (kv + j) * s_head);
      }
    }
  });
}

// exp in a form the compiler vectorises (std::exp is a library call per element, which made SiLU the
// costliest part of post_attn): x = n ln2 + r with |r| <= ln2/2, a degree-6 polynomial for e^r, and 2^n
// built in the exponent bits. Within a few ulp of expf on [-87, 88], the range it clamps to.
inline float exp_approx(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest (1.5 * 2^23)
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln2 in two parts, so r is exact enough
  float p = 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  return p * __builtin_bit_cast(float, bits);
}

// act = round(round(silu(gate)) * up) for gate_up = [gate | up], rounding where F.silu(gate) * up does.
template <typename T>
void silu_mul_rows(const T* gu, T* act, int64_t n, int64_t inter) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* g = gu + i * 2 * inter;
      const T* u = g + inter;
      T* o = act + i * inter;
      for (int64_t j = 0; j < inter; ++j) {
        const float x = widen(g[j]);
        o[j] = narrow<T>(round_to<T>(x / (1.f + exp_approx(-x))) * widen(u[j]));
      }
    }
  });
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define RHYMERL_TREE_ATTENTION 1
#include <immintrin.h>
// Tree attention (below) is written for AVX-512; elsewhere every step's attention is SDPA's.

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
  std::vector<int64_t> runs;  // token index where each run of one slot starts, then n
  for (int64_t i = 0; i < n; ++i)
    if (i == 0 || slots[i] != slots[i - 1] || base[i] != base[i - 1]) runs.push_back(i);
  runs.push_back(n);
  const int64_t num_runs = static_cast<int64_t>(runs.size()) - 1, items = num_runs * kv;
  // Items in one list per thread of about equal cost (queries x keys), since slots differ in length.
  std::vector<double> cost(items + 1, 0.0);
  for (int64_t it = 0; it < items; ++it) {
    const int64_t r = it % num_runs, m = runs[r + 1] - runs[r];
    cost[it + 1] = cost[it] + static_cast<double>(m) * static_cast<double>(base[runs[r]] + m);
  }
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    std::vector<__m512> qv;
    std::vector<float> scores;
    alignas(64) __m512 block[16][NV];
    for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
      const int64_t first = std::lower_bound(cost.begin(), cost.end(), cost[items] * chunk / chunks) - cost.begin();
      const int64_t last = chunk + 1 == chunks ? items
          : std::lower_bound(cost.begin(), cost.end(), cost[items] * (chunk + 1) / chunks) - cost.begin();
      for (int64_t it = first; it < last; ++it) {
        const int64_t r = it % num_runs, j = it / num_runs, i0 = runs[r], m = runs[r + 1] - i0;
        const int64_t prefix = base[i0], nq = m * g, stride = (prefix + 15) / 16 * 16 + 64;
        const T* keys = cache + slots[i0] * s_slot + j * s_head;
        const T* values = cache + slots[i0] * s_slot + (kv + j) * s_head;
        qv.resize(nq * NV);
        for (int64_t t = 0; t < m; ++t)  // query (t, gi) is head j * g + gi of token i0 + t
          for (int64_t e = 0; e < g * NW; ++e)
            widen32(q + ((i0 + t) * h + j * g) * D + 32 * e, qv[(t * g) * NV + 2 * e], qv[(t * g) * NV + 2 * e + 1]);
        scores.resize(nq * stride);
        // 16 dot products of every query qs..qe with the rows in `block`, scaled, stored at column `col`
        auto score_block = [&](int64_t qs, int64_t qe, int64_t col) {
          for (int64_t qi = qs; qi < qe; ++qi) {
            const __m512* qq = qv.data() + qi * NV;
            __m512 dots[16];
            for (int k = 0; k < 16; ++k) {
              dots[k] = _mm512_mul_ps(qq[0], block[k][0]);
              for (int c = 1; c < NV; ++c) dots[k] = _mm512_fmadd_ps(qq[c], block[k][c], dots[k]);
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
        for (int64_t qi = 0; qi < nq; ++qi) {  // 2. softmax, in 16 lanes (a scalar running sum kept it unvectorised)
          float* sq = scores.data() + qi * stride;
          const int64_t len = prefix + na[qi / g];
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
          inv_sum[qi] = 1.f / sum;
        }
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
#endif

void check_cpu(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "rhymerl native kernels: ", name,
              " must be a contiguous CPU tensor");
}

// Whether tree_attention runs for heads of size d in this dtype (else it returns None: use SDPA).
bool tree_attention_supports(int64_t d, at::ScalarType dtype) {
#ifdef RHYMERL_TREE_ATTENTION
  return (d == 64 || d == 128) && (dtype == at::kFloat || dtype == at::kBFloat16);
#else
  return false;
#endif
}

// q [N, H, D] -> [N, H, D], or None where the kernel does not take the head size, dtype or CPU. Token i
// attends to keys [0, base[i]) of slot slot_of[i] in cache [slots, 2KV, capacity, D] and to keys
// base[i] + j for the set bits j of anc[i] (its ancestors in the step's tree and itself; this step's keys
// and values already written). A slot's tokens are consecutive and share base.
std::optional<Tensor> tree_attention(const Tensor& q, const Tensor& cache, const Tensor& slot_of, const Tensor& base,
                                     const Tensor& anc) {
  check_cpu(q, "q");
  check_cpu(cache, "cache");
  const int64_t n = q.size(0), h = q.size(1), d = q.size(2), kv = cache.size(1) / 2;
  if (!tree_attention_supports(d, q.scalar_type()) || cache.scalar_type() != q.scalar_type()) return std::nullopt;
  TORCH_CHECK(h % kv == 0 && h / kv <= 64 && cache.size(-1) == d, "rhymerl native kernels: tree_attention needs "
              "H a multiple of KV (at most 64 times) and the cache's head size");
  for (const Tensor* t : {&slot_of, &base, &anc})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->numel() == n && t->is_contiguous(),
                "rhymerl native kernels: slot_of, base and anc must be contiguous int64 [N]");
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
  if (q.scalar_type() == at::kFloat) run_type(float{});
  else run_type(c10::BFloat16{});
#endif
  return out;
}

// ---- the sampler's plain case (engine/sampler.py: `sample` without top-k/top-p, which this mirrors) ----

// sampler.keyed_uniforms for one (key, column): splitmix64 of key + (column + 1) * golden, in uint64.
inline double keyed_uniform(uint64_t key, uint64_t column) {
  uint64_t x = key + (column + 1) * 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x = x ^ (x >> 31);
  return (static_cast<double>(x >> 11) + 0.5) * (1.0 / 9007199254740992.0);  // (x >> 11 + 0.5) / 2^53
}
inline double gumbel(uint64_t key, uint64_t column) { return -std::log(-std::log(keyed_uniform(key, column))); }

constexpr int64_t kBlock = 256;  // sampler.BLOCK
constexpr uint64_t kTokenSalt = uint64_t(1) << 40;  // sampler._TOKEN_SALT

// 16 floats as one SIMD value (a GCC/Clang vector extension, lowered to whatever the CPU has), for the
// row-long max and sums below, which the compiler does not vectorise from scalar code.
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline f32x16 load16(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

// One row of logits [V] -> (token, log-prob): the two-level keyed Gumbel-max of engine/sampler.py. Block
// masses are sums of p_c = exp(max(z_c - max z, -80)) for z = logits / T; the chosen block's p_c are
// recomputed rather than stored, so the row is read twice (max, then masses) plus one block.
template <typename T>  // float or bf16 logits, widened exactly
std::pair<int64_t, float> sample_row(const T* x, int64_t v, uint64_t key, float inv_t, float* mass) {
  float top = widen(x[0]);
  int64_t c = 0;
  if (v >= 16) {
    f32x16 tops = load16(x);
    for (; c + 16 <= v; c += 16) {
      const f32x16 y = load16(x + c);
      tops = y > tops ? y : tops;
    }
    for (int u = 0; u < 16; ++u) top = tops[u] > top ? tops[u] : top;
  }
  for (; c < v; ++c) top = widen(x[c]) > top ? widen(x[c]) : top;
  const float shift = top * -inv_t;  // z_c - max z = shift + inv_t * x_c: 0 at the maximum
  alignas(64) float p[kBlock];
  auto block_probs = [&](int64_t b) {  // p_c of block b into p; returns its length
    const int64_t lo = b * kBlock, n = std::min(v - lo, kBlock);
    for (int64_t i = 0; i < n; ++i) {
      const float z = shift + inv_t * widen(x[lo + i]);
      p[i] = z < -80.f ? -80.f : z;  // out of denormals, as in sampler.py
    }
    for (int64_t i = 0; i < n; ++i) p[i] = exp_approx(p[i]);
    return n;
  };
  const int64_t nb = (v + kBlock - 1) / kBlock;
  float total = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t n = block_probs(b);
    f32x16 lanes = {};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) lanes += load16(p + i);
    float m = 0.f;
    for (int u = 0; u < 16; ++u) m += lanes[u];
    for (; i < n; ++i) m += p[i];
    mass[b] = m;
    total += m;
  }
  int64_t chosen = 0;
  double best = -std::numeric_limits<double>::infinity();
  for (int64_t b = 0; b < nb; ++b) {  // level 1: a block, by its mass
    const double score = std::log(static_cast<double>(mass[b])) + gumbel(key, b);
    if (score > best) best = score, chosen = b;
  }
  const int64_t n = block_probs(chosen);
  int64_t token = chosen * kBlock;
  best = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < n; ++i) {  // level 2: a column of it
    const int64_t col = chosen * kBlock + i;
    const double score = std::log(static_cast<double>(p[i])) + gumbel(key, col + kTokenSalt);
    if (score > best) best = score, token = col;
  }
  return {token, (shift + inv_t * widen(x[token])) - std::log(total)};
}

// logits [N, V] fp32 or bf16, rows [R] int64 (the rows to sample), keys [R] int64 (sampling_params.draw_key),
// inv_t = 1 / temperature -> (tokens [R] int64, log-probs [R] fp32): sampler.sample for temperature > 0
// without top-k/top-p. Reading the rows in place spares the engine a widened copy of the logits.
std::tuple<Tensor, Tensor> sample_rows(const Tensor& logits, const Tensor& rows, const Tensor& keys, double inv_t) {
  check_cpu(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "rhymerl native kernels: sample_rows takes fp32 or bf16 logits [N, V]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && keys.scalar_type() == at::kLong && rows.numel() == keys.numel() &&
              rows.is_contiguous() && keys.is_contiguous(), "rhymerl native kernels: sample_rows needs int64 rows "
              "and one int64 key per row");
  const int64_t r = rows.numel(), v = logits.size(1), n = logits.size(0);
  Tensor tokens = at::empty({r}, keys.options()), logprobs = at::empty({r}, logits.options().dtype(at::kFloat));
  const int64_t* row = rows.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < r; ++i)
    TORCH_CHECK(0 <= row[i] && row[i] < n, "rhymerl native kernels: sample_rows row ", row[i], " outside [0, ", n, ")");
  const int64_t* k = keys.const_data_ptr<int64_t>();
  int64_t* t = tokens.mutable_data_ptr<int64_t>();
  float* lp = logprobs.mutable_data_ptr<float>();
  auto run = [&](const auto* x) {
    at::parallel_for(0, r, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> mass((v + kBlock - 1) / kBlock);
      for (int64_t i = begin; i < end; ++i)
        std::tie(t[i], lp[i]) = sample_row(x + row[i] * v, v, static_cast<uint64_t>(k[i]), static_cast<float>(inv_t),
                                           mass.data());
    });
  };
  if (logits.scalar_type() == at::kFloat) run(logits.const_data_ptr<float>());
  else run(logits.const_data_ptr<c10::BFloat16>());
  return {tokens, logprobs};
}

// (s, y): s = x + r (or x when r is None), y = rmsnorm(s) * w. x, r: [N, D].
std::tuple<Tensor, Tensor> add_rms_norm(const Tensor& x, const std::optional<Tensor>& r, const Tensor& w, double eps) {
  check_cpu(x, "x");
  if (r) check_cpu(*r, "r");
  Tensor s = r ? at::empty_like(x) : x;
  Tensor y = at::empty_like(x);
  const int64_t d = x.size(-1), n = x.numel() / d;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_rows<scalar_t>(x.const_data_ptr<scalar_t>(), r ? r->const_data_ptr<scalar_t>() : nullptr,
                                s.mutable_data_ptr<scalar_t>(), y.mutable_data_ptr<scalar_t>(),
                                w.const_data_ptr<scalar_t>(), n, d, static_cast<float>(eps));
  });
  return {s, y};
}

// Everything of a decoder layer before attention. x: [N, hidden] residual stream, r: the previous layer's
// MLP output (None for the first layer). Writes the new keys/values into cache [slots, 2KV, capacity, D]
// at (slot_of[i], write_pos[i]) and returns (s = x + r, q [N, H, D]).
std::tuple<Tensor, Tensor> pre_attn(const Tensor& x, const std::optional<Tensor>& r, const Tensor& norm_w,
                                    const Tensor& qkv_w, const std::optional<Tensor>& qkv_b, bool packed,
                                    const std::optional<Tensor>& q_norm, const std::optional<Tensor>& k_norm,
                                    const Tensor& cos, const Tensor& sin, Tensor cache, const Tensor& slot_of,
                                    const Tensor& write_pos, int64_t h, int64_t kv, double eps) {
  check_cpu(cache, "cache");
  check_cpu(cos, "cos");
  check_cpu(sin, "sin");
  TORCH_CHECK(slot_of.scalar_type() == at::kLong && write_pos.scalar_type() == at::kLong,
              "rhymerl native kernels: slot_of and write_pos must be int64");
  auto [s, y] = add_rms_norm(x, r, norm_w, eps);
  Tensor qkv = linear(y, qkv_w, qkv_b, packed).contiguous();
  const int64_t d = cache.size(-1);
  TORCH_CHECK(qkv.size(1) == (h + 2 * kv) * d, "rhymerl native kernels: qkv width ", qkv.size(1), " != (H + 2KV) * D");
  Tensor q = at::empty({x.size(0), h, d}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rope_and_write", [&] {
    rope_and_write<scalar_t>(qkv, q, cache, cos, sin, q_norm, k_norm, slot_of, write_pos, h, kv, static_cast<float>(eps));
  });
  return {s, q};
}

// Everything of a decoder layer after attention. attn: [N, H*D], s: the residual stream. Returns
// (s + o_proj(attn), mlp output); the next layer's pre_attn (or the final norm) adds the two.
std::tuple<Tensor, Tensor> post_attn(const Tensor& attn, const Tensor& s, const Tensor& o_w, const Tensor& norm_w,
                                     const Tensor& gate_up_w, const Tensor& down_w, bool packed, double eps) {
  Tensor o = linear(attn, o_w, std::nullopt, packed).contiguous();
  auto [s2, y] = add_rms_norm(s, o, norm_w, eps);
  Tensor gu = linear(y, gate_up_w, std::nullopt, packed).contiguous();
  const int64_t inter = gu.size(1) / 2, n = gu.size(0);
  Tensor act = at::empty({n, inter}, gu.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gu.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(gu.const_data_ptr<scalar_t>(), act.mutable_data_ptr<scalar_t>(), n, inter);
  });
  return {s2, linear(act, down_w, std::nullopt, packed)};
}

// Attention of a step whose tokens form one slot group (engine/model_runner.py: _Group and
// CachedAttention._group/_sdpa, which this mirrors op for op). With `tree_base` (every slot of the group
// feeds at most 64 tokens and tree_attention takes the shape): tree_attention. Else SDPA over the cache rows
// of the group's slots (a slice [lo, hi) when `rows` is None, else a gather), keys [0, l), an additive
// mask. Queries are a view when every row has one token (`dense_rows` None), else scattered into a dense
// [b, H, t, D] layout. fold > 1: the G query heads of a KV head are folded into the query axis.
Tensor group_attention(const Tensor& q, const Tensor& cache, const Tensor& slot_of,
                       const std::optional<Tensor>& tree_base, const std::optional<Tensor>& tree_anc,
                       const std::optional<Tensor>& rows, int64_t lo, int64_t hi, int64_t l,
                       const std::optional<Tensor>& mask, int64_t fold, const std::optional<Tensor>& dense_rows,
                       const std::optional<Tensor>& dense_cols, int64_t b, int64_t t) {
  using at::indexing::Slice;
  if (tree_base) {
    auto out = tree_attention(q, cache, slot_of, *tree_base, *tree_anc);
    TORCH_CHECK(out, "rhymerl native kernels: tree attention was asked for a shape it does not take");
    return *out;
  }
  const int64_t h = q.size(1), d = q.size(2), kv = cache.size(1) / 2;
  Tensor keys = cache.narrow(2, 0, l);
  keys = rows ? keys.index_select(0, *rows) : keys.slice(0, lo, hi);  // [b, 2KV, L, D]
  Tensor k = keys.narrow(1, 0, kv), v = keys.narrow(1, kv, kv);
  Tensor qd;
  if (dense_rows) {
    qd = at::zeros({b, h, t, d}, q.options());
    qd.index_put_({*dense_rows, Slice(), *dense_cols}, q);
  } else {
    qd = q.view({b, 1, h, d}).transpose(1, 2);
  }
  Tensor out = fold > 1
      ? at::scaled_dot_product_attention(qd.reshape({b, kv, fold * t, d}), k, v, mask).view({b, h, t, d})
      : at::scaled_dot_product_attention(qd, k, v, mask, 0.0, false, std::nullopt, h != kv);
  if (dense_rows) return out.index({*dense_rows, Slice(), *dense_cols});  // [N, H, D]
  return out.transpose(1, 2).reshape({b, h, d});
}

// The whole layer stack for a step whose attention is one group (every decode row and draft tree of the
// step, the usual case), so that no Python runs between layers. weights: per layer, in this order,
// input norm, qkv, qkv bias, q norm, k norm, o_proj, post-attention norm, gate/up, down (None where the
// architecture has none). cache: [layers, slots, 2KV, capacity, D]. shares: prefix copies (destination
// slots, source slots, length), done in each layer after its keys/values are written. Returns (x, r) as
// pre_attn/post_attn do: the residual stream and the last MLP output, not yet added.
std::tuple<Tensor, Tensor> forward_layers(
    Tensor x, const c10::List<std::optional<Tensor>>& weights, bool packed, const Tensor& cos, const Tensor& sin,
    const Tensor& cache, const Tensor& slot_of, const Tensor& write_pos, int64_t h, int64_t kv, double eps,
    const std::optional<Tensor>& tree_base, const std::optional<Tensor>& tree_anc, const std::optional<Tensor>& rows,
    int64_t lo, int64_t hi, int64_t l, const std::optional<Tensor>& mask, int64_t fold,
    const std::optional<Tensor>& dense_rows, const std::optional<Tensor>& dense_cols, int64_t b, int64_t t,
    at::TensorList share_dst, at::TensorList share_src, at::IntArrayRef share_len) {
  constexpr int64_t kPerLayer = 9;
  const int64_t layers = cache.size(0);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kPerLayer,
              "rhymerl native kernels: forward_layers needs ", kPerLayer, " weights per layer");
  std::optional<Tensor> r;
  for (int64_t i = 0; i < layers; ++i) {
    auto w = [&](int64_t j) -> std::optional<Tensor> { return weights.get(i * kPerLayer + j); };
    Tensor layer_cache = cache.select(0, i);
    auto [s, q] = pre_attn(x, r, *w(0), *w(1), w(2), packed, w(3), w(4), cos, sin, layer_cache, slot_of, write_pos,
                           h, kv, eps);
    for (size_t j = 0; j < share_dst.size(); ++j) {
      Tensor prefix = layer_cache.narrow(2, 0, share_len[j]);
      prefix.index_copy_(0, share_dst[j], prefix.index_select(0, share_src[j]));
    }
    Tensor out = group_attention(q, layer_cache, slot_of, tree_base, tree_anc, rows, lo, hi, l, mask, fold,
                                 dense_rows, dense_cols, b, t);
    std::tie(x, r) = post_attn(out.reshape({out.size(0), -1}), s, *w(5), *w(6), *w(7), *w(8), packed, eps);
  }
  return {x, *r};
}

}  // namespace

// Registered for every dispatch key (a catch-all kernel): the prepacked oneDNN weights are MkldnnCPU
// tensors, and the kernels are called under inference mode only, so no autograd formula is needed.
TORCH_LIBRARY(rhymerl_native, m) {
  m.def("add_rms_norm(Tensor x, Tensor? r, Tensor w, float eps) -> (Tensor, Tensor)", &add_rms_norm);
  m.def("sample_rows(Tensor logits, Tensor rows, Tensor keys, float inv_t) -> (Tensor, Tensor)", &sample_rows);
  m.def("tree_attention_supports(int head_dim, ScalarType dtype) -> bool", &tree_attention_supports);
  m.def("tree_attention(Tensor q, Tensor cache, Tensor slot_of, Tensor base, Tensor anc) -> Tensor?", &tree_attention);
  m.def(
      "pre_attn(Tensor x, Tensor? r, Tensor norm_w, Tensor qkv_w, Tensor? qkv_b, bool packed, Tensor? q_norm, "
      "Tensor? k_norm, Tensor cos, Tensor sin, Tensor(a!) cache, Tensor slot_of, Tensor write_pos, int h, int kv, "
      "float eps) -> (Tensor, Tensor)",
      &pre_attn);
  m.def(
      "post_attn(Tensor attn, Tensor s, Tensor o_w, Tensor norm_w, Tensor gate_up_w, Tensor down_w, bool packed, "
      "float eps) -> (Tensor, Tensor)",
      &post_attn);
  m.def(
      "forward_layers(Tensor x, Tensor?[] weights, bool packed, Tensor cos, Tensor sin, Tensor(a!) cache, "
      "Tensor slot_of, Tensor write_pos, int h, int kv, float eps, Tensor? tree_base, Tensor? tree_anc, Tensor? rows, "
      "int lo, int hi, int l, Tensor? mask, "
      "int fold, Tensor? dense_rows, Tensor? dense_cols, int b, int t, Tensor[] share_dst, Tensor[] share_src, "
      "int[] share_len) -> (Tensor, Tensor)",
      &forward_layers);
}
