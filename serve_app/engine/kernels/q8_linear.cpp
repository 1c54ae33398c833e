// Products on int8 weights with int8 activations, exact in the rows: the Q8 weight format.
//
// Weights: int8 [N, K] with one fp16 scale per block of 32 along K (K a multiple of 32), as
// llama.cpp's Q8_0. Activations: quantized here, per row and per block of 32, to int8 with a
// float scale max|x| / 127 (llama.cpp's Q8 activations). Output element (m, n):
//
//     sum over blocks b, in order, of  scale_w[n, b] * scale_x[m, b] * (int32 sum of w * x in b)
//
// The integer sums are exact; the float steps run in the same order for every (m, n) whatever
// the number of rows or threads, so a row's result never depends on the other rows (the engine's
// exactness needs that). AVX2: each block is one _mm256_maddubs_epi16 (|w| x sign(w) * x, both in
// [-127, 127], so the pair sums cannot saturate) and one _mm256_madd_epi16; the eight int32 lanes
// go to float and into two sets of eight float accumulators (even and odd blocks), summed in a
// fixed order at the end. Without AVX2 a scalar loop computes the same lanes in the same order.
// Threads split the output features, never a dot product; a weight row is read from memory once
// and then from L1 for each group of activation rows.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"

namespace {

using specserve::half_to_float;
using specserve::Isa;
constexpr int64_t kBlock = 32;

// Per row and block: q = round(x / s) in [-127, 127], s = max|x| / 127 (0 for an all-zero block).
void quantize_rows(const float* x, int64_t rows, int64_t k, int8_t* q, float* scales) {
  const int64_t blocks = k / kBlock;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < blocks; ++b) {
        const float* xb = x + m * k + b * kBlock;
        float amax = 0.f;
        for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
        const float s = amax / 127.f;
        const float inv = s > 0.f ? 1.f / s : 0.f;
        int8_t* qb = q + m * k + b * kBlock;
        for (int64_t i = 0; i < kBlock; ++i) qb[i] = static_cast<int8_t>(std::nearbyint(xb[i] * inv));
        scales[m * blocks + b] = s;
      }
    }
  });
}

#if SPECSERVE_AVX2
using specserve::lanes_sum;

inline __m256 block_dot(__m256i w, __m256i x) {  // 8 int32 partial sums of one block, as floats
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
}
#endif

constexpr int64_t kGroup = 4;  // activation rows sharing each load of a weight block

#if SPECSERVE_AVX2
inline __m256i load32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// One weight row against G activation rows. Blocks go alternately into two accumulators per row
// (even blocks, odd blocks: more independent work per cycle), the float order fixed per (m, n).
template <int G>
void dot_group_avx2(const int8_t* w, const uint16_t* ws, const int8_t* x, const float* sx, int64_t k,
                    float* out, int64_t out_stride) {
  const int64_t blocks = k / kBlock;
  __m256 acc[G][2];
  for (int r = 0; r < G; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 4 <= blocks; b += 4) {
    _mm_prefetch(reinterpret_cast<const char*>(w + (b + 16) * kBlock), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + (b + 18) * kBlock), _MM_HINT_T0);
    const __m128 sw = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ws + b)));
    __m256i wv[4], aw[4];
    for (int j = 0; j < 4; ++j) {
      wv[j] = load32(w + (b + j) * kBlock);
      aw[j] = _mm256_sign_epi8(wv[j], wv[j]);  // |w|, shared by the rows
    }
#pragma GCC unroll 4
    for (int r = 0; r < G; ++r) {
      const __m128 sc = _mm_mul_ps(sw, _mm_loadu_ps(sx + r * blocks + b));
      const float scale[4] = {_mm_cvtss_f32(sc), _mm_cvtss_f32(_mm_shuffle_ps(sc, sc, 1)),
                              _mm_cvtss_f32(_mm_shuffle_ps(sc, sc, 2)), _mm_cvtss_f32(_mm_shuffle_ps(sc, sc, 3))};
      for (int j = 0; j < 4; ++j) {
        const __m256i xv = load32(x + r * k + (b + j) * kBlock);
        const __m256i p16 = _mm256_maddubs_epi16(aw[j], _mm256_sign_epi8(xv, wv[j]));
        const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
        acc[r][j & 1] = _mm256_fmadd_ps(p, _mm256_set1_ps(scale[j]), acc[r][j & 1]);
      }
    }
  }
  for (; b < blocks; ++b) {  // the tail (blocks not a multiple of 4) into the even accumulator
    const __m256i wv = load32(w + b * kBlock);
    const float swb = half_to_float(ws[b]);
    for (int r = 0; r < G; ++r) {
      const __m256 p = block_dot(wv, load32(x + r * k + b * kBlock));
      acc[r][0] = _mm256_fmadd_ps(p, _mm256_set1_ps(swb * sx[r * blocks + b]), acc[r][0]);
    }
  }
  for (int r = 0; r < G; ++r) out[r * out_stride] = lanes_sum(_mm256_add_ps(acc[r][0], acc[r][1]));
}
#endif

#if SPECSERVE_AVX512
// The AVX-512 VNNI form of dot_group_avx2, bit for bit: a 64-byte load holds blocks b and b + 1,
// whose float accumulators are the low and high 256 bits of one register (the AVX2 code's even and
// odd accumulators, in the same order). VNNI multiplies unsigned by signed bytes, so the activations
// come offset by 128 (xu = x + 128, 1..255): _mm512_dpbusd_epi32(xu, w) - _mm512_dpbusd_epi32(128, w)
// is each lane's exact sum of w * x over its four inputs, the correction shared by the rows.
template <int G>
SPECSERVE_AVX512_FN void dot_group_avx512(const int8_t* w, const uint16_t* ws, const uint8_t* xu, const float* sx, int64_t k,
                      float* out, int64_t out_stride) {
  const int64_t blocks = k / kBlock;
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i pair01 = _mm512_inserti64x4(_mm512_set1_epi32(0), _mm256_set1_epi32(1), 1);
  const __m512i pair23 = _mm512_inserti64x4(_mm512_set1_epi32(2), _mm256_set1_epi32(3), 1);
  __m512 acc[G];
  for (int r = 0; r < G; ++r) acc[r] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 4 <= blocks; b += 4) {
    // 64 blocks (2 KB) ahead, as the Q4_K kernel
    _mm_prefetch(reinterpret_cast<const char*>(w + (b + 64) * kBlock), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + (b + 66) * kBlock), _MM_HINT_T0);
    const __m128 sw = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ws + b)));
    const __m512i w01 = _mm512_loadu_si512(w + b * kBlock), w23 = _mm512_loadu_si512(w + (b + 2) * kBlock);
    // the correction as the sums' starting value: dpbusd(-128 sum w, xu, w) = sum w x
    const __m512i c01 = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, w01));
    const __m512i c23 = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, w23));
#pragma GCC unroll 8
    for (int r = 0; r < G; ++r) {
      const __m512 sc = _mm512_castps128_ps512(_mm_mul_ps(sw, _mm_loadu_ps(sx + r * blocks + b)));
      const uint8_t* xr = xu + r * k + b * kBlock;
      const __m512i p01 = _mm512_dpbusd_epi32(c01, _mm512_loadu_si512(xr), w01);
      const __m512i p23 = _mm512_dpbusd_epi32(c23, _mm512_loadu_si512(xr + 64), w23);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p01), _mm512_permutexvar_ps(pair01, sc), acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p23), _mm512_permutexvar_ps(pair23, sc), acc[r]);
    }
  }
  for (int r = 0; r < G; ++r) {
    __m256 even = _mm512_castps512_ps256(acc[r]);
    const __m256 odd = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1));
    for (int64_t t = b; t < blocks; ++t) {  // the tail into the even accumulator, as dot_group_avx2
      const __m256i wv = load32(w + t * kBlock);
      const __m256i xv = _mm256_xor_si256(load32(reinterpret_cast<const int8_t*>(xu) + r * k + t * kBlock),
                                          _mm256_set1_epi8(static_cast<char>(0x80)));
      const float scale = half_to_float(ws[t]) * sx[r * blocks + t];
      even = _mm256_fmadd_ps(block_dot(wv, xv), _mm256_set1_ps(scale), even);
    }
    out[r * out_stride] = lanes_sum(_mm256_add_ps(even, odd));
  }
}
#endif

// The same numbers without AVX2: each lane of each accumulator as the vector code has it.
void dot_row_scalar(const int8_t* w, const uint16_t* ws, const int8_t* x, const float* sx, int64_t k, float* out) {
  const int64_t blocks = k / kBlock;
  float acc[2][8] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const int parity = b < blocks - blocks % 4 ? static_cast<int>(b & 1) : 0;
    const float scale = half_to_float(ws[b]) * sx[b];
    for (int lane = 0; lane < 8; ++lane) {
      int32_t sum = 0;
      for (int j = 0; j < 4; ++j) {  // madd: a lane holds 4 consecutive products
        const int64_t c = b * kBlock + lane * 4 + j;
        sum += static_cast<int32_t>(w[c]) * static_cast<int32_t>(x[c]);
      }
      acc[parity][lane] = std::fma(static_cast<float>(sum), scale, acc[parity][lane]);
    }
  }
  float l[8];
  for (int i = 0; i < 8; ++i) l[i] = acc[0][i] + acc[1][i];
  *out = specserve::lanes_sum8(l);
}

// Activations as each path reads them: int8, or (AVX-512) offset by 128 into uint8.
template <int G>
void dot_group(Isa isa, const int8_t* w, const uint16_t* ws, const int8_t* x, const float* sx, int64_t k,
               float* out, int64_t out_stride) {
#if SPECSERVE_AVX512
  if (isa == Isa::kAvx512 || isa == Isa::kAmx)
    return dot_group_avx512<G>(w, ws, reinterpret_cast<const uint8_t*>(x), sx, k, out, out_stride);
#endif
#if SPECSERVE_AVX2
  if (isa == Isa::kAvx2) return dot_group_avx2<G>(w, ws, x, sx, k, out, out_stride);
#endif
  for (int64_t r = 0; r < G; ++r) dot_row_scalar(w, ws, x + r * k, sx + r * (k / kBlock), k, out + r * out_stride);
}

// out[m, 0] for every activation row m and one weight row, rows in groups of kGroup.
void dot_rows(Isa isa, const int8_t* w, const uint16_t* ws, const int8_t* xq, const float* xs, int64_t rows,
              int64_t k, float* out, int64_t out_stride) {
  const int64_t blocks = k / kBlock;
  for (int64_t m = 0; m < rows; m += kGroup) {
    const int8_t* x = xq + m * k;
    const float* sx = xs + m * blocks;
    float* o = out + m * out_stride;
    switch (std::min(kGroup, rows - m)) {
      case 4: dot_group<4>(isa, w, ws, x, sx, k, o, out_stride); break;
      case 3: dot_group<3>(isa, w, ws, x, sx, k, o, out_stride); break;
      case 2: dot_group<2>(isa, w, ws, x, sx, k, o, out_stride); break;
      default: dot_group<1>(isa, w, ws, x, sx, k, o, out_stride); break;
    }
  }
}

}  // namespace

// x [M, K] (float32 or bf16), weight int8 [N, K], scales fp16-as-int16 [N, K / 32] -> [M, N] float32.
torch::Tensor q8_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && scales.dim() == 2, "q8_linear: 2-d tensors expected");
  TORCH_CHECK(weight.scalar_type() == torch::kInt8, "q8_linear: weight must be int8");
  TORCH_CHECK(scales.scalar_type() == torch::kInt16, "q8_linear: scales must be fp16 bits as int16");
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k && k % kBlock == 0, "q8_linear: K must match and be a multiple of 32");
  TORCH_CHECK(scales.size(0) == n && scales.size(1) == k / kBlock, "q8_linear: scales must be [N, K / 32]");
  auto xf = x.to(torch::kFloat32).contiguous();
  auto w = weight.contiguous();
  auto ws = scales.contiguous();
  std::vector<int8_t> xq(rows * k);
  std::vector<float> xs(rows * (k / kBlock));
  quantize_rows(xf.data_ptr<float>(), rows, k, xq.data(), xs.data());
  const Isa isa = specserve::isa();
  if (isa == Isa::kAvx512 || isa == Isa::kAmx)  // x + 128 as uint8: flipping the sign bit
    for (auto& v : xq) v = static_cast<int8_t>(static_cast<uint8_t>(v) ^ 0x80);
  auto out = torch::empty({rows, n}, torch::kFloat32);
  float* o = out.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(ws.data_ptr<int16_t>());
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j)
      dot_rows(isa, wp + j * k, sp + j * (k / kBlock), xq.data(), xs.data(), rows, k, o + j, n);
  });
  return out;
}
