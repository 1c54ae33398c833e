// A decoder layer's small float32 steps in one call each, where torch would run a dozen tiny ops
// (on 2 cores each costs a few microseconds, and a layer has ~70): RMS norm, and attention over the
// KV cache for the few queries of a decode or verification step.
//
// Both are exact in the rows by construction: a row's (a query's) result is computed from that row
// alone, in one fixed order, whatever the number of rows, of masked keys or of threads, so the
// engine needs no padding for them. Each is one loop nest the compiler vectorizes the same way for
// every CPU that runs this library.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attend.h"

namespace {

constexpr int kLanes = 16;  // partial sums per reduction, added in one fixed order at the end

inline float lanes_total(const float* l) {  // ((0+8) + (4+12)) + ((2+10) + (6+14)) + odd lanes alike
  float pairs[8];
  for (int i = 0; i < 8; ++i) pairs[i] = l[i] + l[i + 8];
  const float a = (pairs[0] + pairs[4]) + (pairs[2] + pairs[6]);
  const float b = (pairs[1] + pairs[5]) + (pairs[3] + pairs[7]);
  return a + b;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float l[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) l[j] += a[i + j] * b[i + j];
  for (int j = 0; i < n; ++i, ++j) l[j] += a[i] * b[i];
  return lanes_total(l);
}

// exp(x) for x <= 0 (softmax after taking the maximum): 2^k * p(r), x = k ln 2 + r, |r| <= ln2 / 2,
// p of degree 6 (relative error ~2e-7); no branches, so a loop of them vectorizes.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float k = std::nearbyint(x * 1.44269504f);
  const float r = (x - k * 0.693145752f) - k * 1.42860677e-6f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits;
  const float scale_k = 1.0f;
  std::memcpy(&bits, &scale_k, 4);
  bits += static_cast<int32_t>(k) << 23;
  float two_k;
  std::memcpy(&two_k, &bits, 4);
  return p * two_k;
}

}  // namespace

namespace specserve {

void attend_query(const float* q, const float* keys, int64_t key_stride, const float* values, int64_t value_stride,
                  int64_t width, const bool* seen, float scale, int64_t dim, float* scores, float* acc, float* out) {
  float top = -INFINITY;
  for (int64_t j = 0; j < width; ++j) {
    if (seen && !seen[j]) continue;
    scores[j] = dot(q, keys + j * key_stride, dim) * scale;
    top = std::max(top, scores[j]);
  }
  std::fill(acc, acc + dim, 0.0f);
  float total = 0.0f;
  for (int64_t j = 0; j < width; ++j) {
    if (seen && !seen[j]) continue;
    const float p = exp_nonpositive(scores[j] - top);
    total += p;
    const float* vj = values + j * value_stride;
    for (int64_t d = 0; d < dim; ++d) acc[d] += p * vj[d];
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  for (int64_t d = 0; d < dim; ++d) out[d] = acc[d] * inv;
}

}  // namespace specserve

// x [..., H] float32, weight [H] float32 -> weight * (x / sqrt(mean(x^2) + eps)), per row.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32,
              "rms_norm: float32 tensors expected");
  const int64_t h = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == h, "rms_norm: weight must be [", h, "]");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto out = torch::empty_like(xc);
  const int64_t rows = xc.numel() / h;
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / h), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * h;
      const float inv = 1.0f / std::sqrt(dot(row, row, h) / static_cast<float>(h) + e);
      float* o = op + r * h;
      for (int64_t i = 0; i < h; ++i) o[i] = wp[i] * (row[i] * inv);
    }
  });
  return out;
}

// Attention of few queries over the KV cache, grouped-query: q [B, H, T, D]; keys, values
// [B, H_kv, >= S, D] (any strides in the first three dims: cache views); visible [B, T, S] bool or
// an empty tensor (every query sees keys 0 .. S - 1); returns [B, T, H, D] contiguous (the layout
// the output projection reads). Query head h reads KV head h / (H / H_kv). Per query: scores of the
// visible keys, their maximum, exp, the sum of exps in key order, the values weighted in key order,
// divided by the sum.
torch::Tensor small_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                              const torch::Tensor& visible, int64_t width, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && keys.scalar_type() == torch::kFloat32 &&
                  values.scalar_type() == torch::kFloat32,
              "small_attention: float32 tensors expected");
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4, "small_attention: 4-d tensors expected");
  const int64_t bsz = q.size(0), heads = q.size(1), steps = q.size(2), dim = q.size(3);
  const int64_t kv_heads = keys.size(1), group = heads / kv_heads;
  TORCH_CHECK(heads % kv_heads == 0 && keys.size(3) == dim && values.size(3) == dim,
              "small_attention: heads or head size do not match");
  TORCH_CHECK(keys.size(2) >= width && values.size(2) >= width && keys.size(0) == bsz && values.size(0) == bsz,
              "small_attention: the keys and values must cover ", width, " positions of ", bsz, " rows");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, "small_attention: head vectors must be contiguous");
  const bool masked = visible.numel() > 0;
  if (masked)
    TORCH_CHECK(visible.scalar_type() == torch::kBool && visible.dim() == 3 && visible.size(0) == bsz &&
                    visible.size(1) == steps && visible.size(2) >= width,
                "small_attention: visible must be bool [B, T, >= S]");
  auto qc = q.contiguous();
  auto vis = masked ? visible.contiguous() : visible;
  auto out = torch::empty({bsz, steps, heads, dim}, q.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  const bool* mp = masked ? vis.data_ptr<bool>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), ks2 = keys.stride(2);
  const int64_t vs0 = values.stride(0), vs1 = values.stride(1), vs2 = values.stride(2);
  const int64_t vis_width = masked ? vis.size(2) : 0;
  const float s = static_cast<float>(scale);
  // one unit = one (row, query head): its T queries; small problems stay on the calling thread
  const int64_t work = steps * width * dim * 2;
  at::parallel_for(0, bsz * heads, std::max<int64_t>(1, 262144 / std::max<int64_t>(1, work)),
                   [&](int64_t begin, int64_t end) {
    std::vector<float> scores(width);
    std::vector<float> acc(dim);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b = unit / heads, h = unit % heads, kvh = h / group;
      const float* kb = kp + b * ks0 + kvh * ks1;
      const float* vb = vp + b * vs0 + kvh * vs1;
      for (int64_t t = 0; t < steps; ++t) {
        const float* qt = qp + ((b * heads + h) * steps + t) * dim;
        const bool* seen = masked ? mp + (b * steps + t) * vis_width : nullptr;
        specserve::attend_query(qt, kb, ks2, vb, vs2, width, seen, s, dim, scores.data(), acc.data(),
                                op + ((b * steps + t) * heads + h) * dim);
      }
    }
  });
  return out;
}
