// Shared by the fused CPU kernels (rhymerl/engine/backends/native.py builds every .cpp of this directory into one
// library, `torch.ops.rhymerl_native`): bf16 <-> fp32 conversions and an exp that the compiler vectorises,
// input checks, and the functions one file calls in another.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

// AMX tiles (tile_linear.cpp, tree_attention.cpp): Linux on x86-64. Their intrinsics under a target
// attribute need GCC >= 11 or clang >= 12; older compilers build without tiles.
#if defined(__linux__) && defined(__x86_64__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define RHYMERL_TILES 1
#endif

namespace rhymerl_native {

using at::Tensor;

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

inline void check_cpu(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "rhymerl native kernels: ", name,
              " must be a contiguous CPU tensor");
}

// layer.cpp: y = x W^T + b, the weight in one of these layouts (backends/cpu_weights.py says which).
constexpr int64_t kPlain = 0, kOneDnn = 1, kTiles = 2;
Tensor linear(const Tensor& x, const Tensor& w, const std::optional<Tensor>& b, int64_t layout);

// tile_linear.cpp
bool tile_linear_supported();  // the CPU has AMX-BF16 and this process may use the tiles
#ifdef RHYMERL_TILES
void configure_tiles();  // per thread, before its tile instructions: 8 tiles of 16 rows x 64 bytes
void release_tiles();
#endif
Tensor pack_tiles(const Tensor& w);
Tensor tile_linear(const Tensor& x, const Tensor& tiles, const std::optional<Tensor>& bias);

// tree_attention.cpp
bool tree_attention_supports(int64_t d, at::ScalarType dtype);
int64_t tree_attention_block_elems(int64_t d, at::ScalarType dtype);
std::optional<Tensor> tree_attention(const Tensor& q, const Tensor& cache, const Tensor& slot_of, const Tensor& base,
                                     const Tensor& anc, const std::optional<Tensor>& tiles,
                                     const std::optional<Tensor>& tile_blocks);

}  // namespace rhymerl_native
