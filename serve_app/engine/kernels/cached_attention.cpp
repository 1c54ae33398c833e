// A decode or verify step's attention in one call, from the fused q/k/v product to the output
// projection's input: rotary embedding of the queries and keys, the new keys and values written into
// the KV cache, and each query's attention over its slot's cached rows. In torch this is ~40 small
// ops per layer (splits, views, transposes, two rotations of five ops each, two cache writes, the
// cache reads, an index_select copy of every row's cache when a batch has several rows); on 2 cores
// each costs a few microseconds.
//
// The numbers are those of the torch form, bit for bit: the rotation is x * cos + rotate(x) * sin,
// each product and the sum rounded to float32 on its own (never fused into an fma: see
// kNoContract), and each query attends through specserve::attend_query, the one definition
// small_attention also runs. A query's result depends on its row alone, so the op is exact in the
// rows by construction, like small_attention.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attend.h"

// torch multiplies and adds in separate rounded steps; a compiler allowed to contract a * b + c * d
// into an fma would round once less and part from it.
#define kNoContract __attribute__((optimize("fp-contract=off")))

namespace {

// out[d] = x[d] * cos[d] + r[d] * sin[d], r = (-x[D/2 ..], x[.. D/2]): the pairs (d, d + D/2) rotate.
kNoContract void rotate(const float* x, const float* cos, const float* sin, int64_t dim, float* out) {
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < half; ++d) {
    const float a = x[d] * cos[d];
    const float b = -x[d + half] * sin[d];
    out[d] = a + b;
  }
  for (int64_t d = half; d < dim; ++d) {
    const float a = x[d] * cos[d];
    const float b = x[d - half] * sin[d];
    out[d] = a + b;
  }
}

}  // namespace

// qkv [B, T, (H + 2 H_kv) D] float32: each token's queries, keys, values (heads in order); cos, sin
// [B, T, D] at each token's position; k_cache, v_cache [slots, H_kv, L, D] (one layer's); row b's
// tokens go to cache rows starts[b] + t of slot slots[b]; visible [B, T, >= width] bool or empty
// (every query sees cache rows 0 .. width - 1). Returns the attention output [B, T, H D].
torch::Tensor cached_attention(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                               torch::Tensor& k_cache, torch::Tensor& v_cache, const std::vector<int64_t>& slots,
                               const std::vector<int64_t>& starts, const torch::Tensor& visible, int64_t width,
                               int64_t heads, double scale) {
  TORCH_CHECK(qkv.scalar_type() == torch::kFloat32 && cos.scalar_type() == torch::kFloat32 &&
                  sin.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32 &&
                  v_cache.scalar_type() == torch::kFloat32,
              "cached_attention: float32 tensors expected");
  TORCH_CHECK(qkv.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "cached_attention: qkv [B, T, F] and caches [slots, H_kv, L, D] expected");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "cached_attention: caches must be contiguous");
  const int64_t bsz = qkv.size(0), steps = qkv.size(1);
  const int64_t kv_heads = k_cache.size(1), max_len = k_cache.size(2), dim = k_cache.size(3);
  TORCH_CHECK(heads > 0 && heads % kv_heads == 0 && qkv.size(2) == (heads + 2 * kv_heads) * dim,
              "cached_attention: qkv holds ", qkv.size(2), " features, not (", heads, " + 2 x ", kv_heads,
              ") x ", dim);
  TORCH_CHECK(dim % 2 == 0 && cos.dim() == 3 && cos.size(0) == bsz && cos.size(1) == steps && cos.size(2) == dim &&
                  sin.sizes() == cos.sizes(),
              "cached_attention: cos and sin must be [B, T, D]");
  TORCH_CHECK(static_cast<int64_t>(slots.size()) == bsz && static_cast<int64_t>(starts.size()) == bsz,
              "cached_attention: one slot and one start per row");
  for (int64_t b = 0; b < bsz; ++b)
    TORCH_CHECK(slots[b] >= 0 && slots[b] < k_cache.size(0) && starts[b] >= 0 && starts[b] + steps <= max_len &&
                    starts[b] + steps <= width,
                "cached_attention: row ", b, " (slot ", slots[b], ", start ", starts[b], ") does not fit the cache");
  TORCH_CHECK(width <= max_len, "cached_attention: width ", width, " exceeds the cache's ", max_len, " rows");
  const bool masked = visible.numel() > 0;
  if (masked)
    TORCH_CHECK(visible.scalar_type() == torch::kBool && visible.dim() == 3 && visible.size(0) == bsz &&
                    visible.size(1) == steps && visible.size(2) >= width,
                "cached_attention: visible must be bool [B, T, >= width]");
  auto x = qkv.contiguous();
  auto cs = cos.contiguous();
  auto sn = sin.contiguous();
  auto vis = masked ? visible.contiguous() : visible;
  const int64_t features = x.size(2), group = heads / kv_heads;
  const float* xp = x.data_ptr<float>();
  const float* cp = cs.data_ptr<float>();
  const float* sp = sn.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const bool* mp = masked ? vis.data_ptr<bool>() : nullptr;
  const int64_t vis_width = masked ? vis.size(2) : 0;
  // cache row i of KV head g in slot s
  const auto row = [&](float* cache, int64_t s, int64_t g, int64_t i) {
    return cache + ((s * kv_heads + g) * max_len + i) * dim;
  };

  // The new keys (rotated) and values first: every query of the step may attend to them.
  for (int64_t b = 0; b < bsz; ++b)
    for (int64_t t = 0; t < steps; ++t) {
      const float* token = xp + (b * steps + t) * features;
      const float* c = cp + (b * steps + t) * dim;
      const float* sn_t = sp + (b * steps + t) * dim;
      for (int64_t g = 0; g < kv_heads; ++g) {
        rotate(token + (heads + g) * dim, c, sn_t, dim, row(kc, slots[b], g, starts[b] + t));
        std::copy_n(token + (heads + kv_heads + g) * dim, dim, row(vc, slots[b], g, starts[b] + t));
      }
    }

  auto out = torch::empty({bsz, steps, heads * dim}, x.options());
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  // one unit = one (row, query head): its T queries; small problems stay on the calling thread
  const int64_t work = steps * width * dim * 2;
  at::parallel_for(0, bsz * heads, std::max<int64_t>(1, 262144 / std::max<int64_t>(1, work)),
                   [&](int64_t begin, int64_t end) {
    std::vector<float> scores(width), acc(dim), query(dim);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b = unit / heads, h = unit % heads, g = h / group;
      const float* keys = row(kc, slots[b], g, 0);
      const float* values = row(vc, slots[b], g, 0);
      for (int64_t t = 0; t < steps; ++t) {
        const int64_t i = b * steps + t;
        rotate(xp + i * features + h * dim, cp + i * dim, sp + i * dim, dim, query.data());
        const bool* seen = masked ? mp + i * vis_width : nullptr;
        specserve::attend_query(query.data(), keys, dim, values, dim, width, seen, s, dim, scores.data(),
                                acc.data(), op + (i * heads + h) * dim);
      }
    }
  });
  return out;
}
