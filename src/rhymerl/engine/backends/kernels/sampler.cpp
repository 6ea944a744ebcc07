// The sampler's plain case (engine/sampler.py: `sample` without top-k/top-p, which this mirrors): one pass
// over each row for its maximum, one for its block masses, then one block, with the same keyed two-level
// Gumbel-max draws.
#include <torch/library.h>

#include "common.h"

namespace rhymerl_native {
namespace {

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

}  // namespace

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

}  // namespace rhymerl_native

TORCH_LIBRARY_FRAGMENT(rhymerl_native, m) {
  m.def("sample_rows(Tensor logits, Tensor rows, Tensor keys, float inv_t) -> (Tensor, Tensor)",
        &rhymerl_native::sample_rows);
}
