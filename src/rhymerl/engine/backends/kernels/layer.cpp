// The decoder layer's fused kernels for the rollout forward (rhymerl/engine/backends/native.py builds this directory).
//
// Why: decoding a small model on a CPU is bound by per-op overhead as much as by arithmetic. A decoder
// layer in eager PyTorch is ~30 small kernels and as many Python calls; here it is two calls around the
// attention: `pre_attn` (residual add, RMSNorm, qkv matmul, q/k norm, rope, K/V cache write) and
// `post_attn` (o_proj, residual add, RMSNorm, gate/up matmul, SiLU x up, down matmul). When a step's
// attention is one call per layer (every decode row and draft tree of the step in one group, the
// usual step), `forward_layers` runs the whole stack, attention included, without returning to Python.
// The matmuls are tile_linear.cpp's on CPUs with AMX tiles, else oneDNN's (prepacked weights). The attention
// of decode rows, draft trees and short chains is tree_attention.cpp's where it takes the dtype (fp32
// everywhere, bf16 on AVX-512 CPUs), which reads each slot to its own length: SDPA pads every slot to the
// step's longest context and largest tree behind a mask, and for a few queries costs more in set-up than in
// arithmetic. Longer prefill chunks, and bf16 steps on other CPUs, go through SDPA's CPU flash kernel.
//
// Arithmetic follows rhymerl/model/decoder.py, rounding to the tensor dtype wherever the eager code
// produces a tensor of that dtype, so bf16 results agree with the eager path up to the summation order of
// the RMSNorm mean and the exp of SiLU (tests compare the two).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "common.h"

namespace rhymerl_native {

// y = W x + b with the weight as `layout` says: kPlain, kOneDnn (prepacked by mkldnn::_reorder_linear_weight)
// or kTiles (pack_tiles, tile_linear.cpp).
Tensor linear(const Tensor& x, const Tensor& w, const std::optional<Tensor>& b, int64_t layout) {
  TORCH_CHECK(layout == kPlain || layout == kOneDnn || layout == kTiles, "linear: unknown weight layout ", layout);
  if (layout == kPlain) return at::linear(x, w, b);
  if (layout == kTiles) return tile_linear(x, w, b);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&, c10::string_view,
                                     c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  return op.call(x, w, b, "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
}

namespace {

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
                                    const Tensor& qkv_w, const std::optional<Tensor>& qkv_b, int64_t layout,
                                    const std::optional<Tensor>& q_norm, const std::optional<Tensor>& k_norm,
                                    const Tensor& cos, const Tensor& sin, Tensor cache, const Tensor& slot_of,
                                    const Tensor& write_pos, int64_t h, int64_t kv, double eps) {
  check_cpu(cache, "cache");
  check_cpu(cos, "cos");
  check_cpu(sin, "sin");
  TORCH_CHECK(slot_of.scalar_type() == at::kLong && write_pos.scalar_type() == at::kLong,
              "rhymerl native kernels: slot_of and write_pos must be int64");
  auto [s, y] = add_rms_norm(x, r, norm_w, eps);
  Tensor qkv = linear(y, qkv_w, qkv_b, layout).contiguous();
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
                                     const Tensor& gate_up_w, const Tensor& down_w, int64_t layout, double eps) {
  Tensor o = linear(attn, o_w, std::nullopt, layout).contiguous();
  auto [s2, y] = add_rms_norm(s, o, norm_w, eps);
  Tensor gu = linear(y, gate_up_w, std::nullopt, layout).contiguous();
  const int64_t inter = gu.size(1) / 2, n = gu.size(0);
  Tensor act = at::empty({n, inter}, gu.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gu.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(gu.const_data_ptr<scalar_t>(), act.mutable_data_ptr<scalar_t>(), n, inter);
  });
  return {s2, linear(act, down_w, std::nullopt, layout)};
}

// Attention of a step whose tokens form one slot group (engine/backends/eager.py: _Group and
// CachedAttention._group/_sdpa, which this mirrors op for op). With `tree_base` (every slot of the group
// feeds at most 64 tokens and tree_attention takes the shape): tree_attention. Else SDPA over the cache rows
// of the group's slots (a slice [lo, hi) when `rows` is None, else a gather), keys [0, l), an additive
// mask. Queries are a view when every row has one token (`dense_rows` None), else scattered into a dense
// [b, H, t, D] layout. fold > 1: the G query heads of a KV head are folded into the query axis.
Tensor group_attention(const Tensor& q, const Tensor& cache, const Tensor& slot_of,
                       const std::optional<Tensor>& tree_base, const std::optional<Tensor>& tree_anc,
                       const std::optional<Tensor>& rows, int64_t lo, int64_t hi, int64_t l,
                       const std::optional<Tensor>& mask, int64_t fold, const std::optional<Tensor>& dense_rows,
                       const std::optional<Tensor>& dense_cols, int64_t b, int64_t t,
                       const std::optional<Tensor>& tiles, const std::optional<Tensor>& tile_blocks) {
  using at::indexing::Slice;
  if (tree_base) {
    auto out = tree_attention(q, cache, slot_of, *tree_base, *tree_anc, tiles, tile_blocks);
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
// pre_attn/post_attn do: the residual stream and the last MLP output, not yet added. tiles, tile_blocks:
// the tree attention's tile cache of every layer (engine/backends/tile_cache.py), where it keeps one.
std::tuple<Tensor, Tensor> forward_layers(
    Tensor x, const c10::List<std::optional<Tensor>>& weights, int64_t layout, const Tensor& cos, const Tensor& sin,
    const Tensor& cache, const Tensor& slot_of, const Tensor& write_pos, int64_t h, int64_t kv, double eps,
    const std::optional<Tensor>& tree_base, const std::optional<Tensor>& tree_anc, const std::optional<Tensor>& rows,
    int64_t lo, int64_t hi, int64_t l, const std::optional<Tensor>& mask, int64_t fold,
    const std::optional<Tensor>& dense_rows, const std::optional<Tensor>& dense_cols, int64_t b, int64_t t,
    at::TensorList share_dst, at::TensorList share_src, at::IntArrayRef share_len, const std::optional<Tensor>& tiles,
    const std::optional<Tensor>& tile_blocks) {
  constexpr int64_t kPerLayer = 9;
  const int64_t layers = cache.size(0);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kPerLayer,
              "rhymerl native kernels: forward_layers needs ", kPerLayer, " weights per layer");
  std::optional<Tensor> r;
  for (int64_t i = 0; i < layers; ++i) {
    auto w = [&](int64_t j) -> std::optional<Tensor> { return weights.get(i * kPerLayer + j); };
    Tensor layer_cache = cache.select(0, i);
    auto [s, q] = pre_attn(x, r, *w(0), *w(1), w(2), layout, w(3), w(4), cos, sin, layer_cache, slot_of, write_pos,
                           h, kv, eps);
    for (size_t j = 0; j < share_dst.size(); ++j) {
      Tensor prefix = layer_cache.narrow(2, 0, share_len[j]);
      prefix.index_copy_(0, share_dst[j], prefix.index_select(0, share_src[j]));
    }
    std::optional<Tensor> layer_tiles, layer_blocks;
    if (tiles) {
      layer_tiles = tiles->select(0, i);
      layer_blocks = tile_blocks->select(0, i);
    }
    Tensor out = group_attention(q, layer_cache, slot_of, tree_base, tree_anc, rows, lo, hi, l, mask, fold,
                                 dense_rows, dense_cols, b, t, layer_tiles, layer_blocks);
    std::tie(x, r) = post_attn(out.reshape({out.size(0), -1}), s, *w(5), *w(6), *w(7), *w(8), layout, eps);
  }
  return {x, *r};
}

}  // namespace
}  // namespace rhymerl_native

using namespace rhymerl_native;

// Registered for every dispatch key (a catch-all kernel): the prepacked oneDNN weights are MkldnnCPU
// tensors, and the kernels are called under inference mode only, so no autograd formula is needed. The
// other files add their ops to this library (TORCH_LIBRARY_FRAGMENT).
TORCH_LIBRARY(rhymerl_native, m) {
  m.def("linear(Tensor x, Tensor w, Tensor? b, int layout) -> Tensor", &rhymerl_native::linear);
  m.def("add_rms_norm(Tensor x, Tensor? r, Tensor w, float eps) -> (Tensor, Tensor)", &add_rms_norm);
  m.def(
      "pre_attn(Tensor x, Tensor? r, Tensor norm_w, Tensor qkv_w, Tensor? qkv_b, int layout, Tensor? q_norm, "
      "Tensor? k_norm, Tensor cos, Tensor sin, Tensor(a!) cache, Tensor slot_of, Tensor write_pos, int h, int kv, "
      "float eps) -> (Tensor, Tensor)",
      &pre_attn);
  m.def(
      "post_attn(Tensor attn, Tensor s, Tensor o_w, Tensor norm_w, Tensor gate_up_w, Tensor down_w, int layout, "
      "float eps) -> (Tensor, Tensor)",
      &post_attn);
  m.def(
      "forward_layers(Tensor x, Tensor?[] weights, int layout, Tensor cos, Tensor sin, Tensor(a!) cache, "
      "Tensor slot_of, Tensor write_pos, int h, int kv, float eps, Tensor? tree_base, Tensor? tree_anc, Tensor? rows, "
      "int lo, int hi, int l, Tensor? mask, "
      "int fold, Tensor? dense_rows, Tensor? dense_cols, int b, int t, Tensor[] share_dst, Tensor[] share_src, "
      "int[] share_len, Tensor(b!)? tiles=None, Tensor(c!)? tile_blocks=None) -> (Tensor, Tensor)",
      &forward_layers);
}
