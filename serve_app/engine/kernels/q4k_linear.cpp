// Products on the GGUF's Q4_K blocks as they are, with int8 activations: the gguf weight format.
//
// Weights: llama.cpp's Q4_K, its 6-bit scales unpacked at load. Super-blocks of 256 inputs carry an
// fp16 scale d and min dmin; their eight blocks of 32 carry integer scales sc[b] and mins m[b] in
// 0..63, and every input a 4-bit q in 0..15:
//
//     w[i] = d * sc[b] * q[i] - dmin * m[b]
//
// The 4-bit values keep the file's order: per 64 inputs 32 bytes, whose low nibbles are inputs
// 0..31 and high nibbles inputs 32..63. Activations are quantized here per row and super-block
// (llama.cpp's Q8_K): xq = round(x / s), s = max|x| / 127, keeping each block's integer sum. Then
// a super-block contributes
//
//     s * d * (sum_b sc[b] * sum_{i in b} q[i] xq[i])  -  s * dmin * (sum_b m[b] * sum_{i in b} xq[i])
//
// where both parenthesized sums are exact integers (|.| < 2^24, so exact as floats too). The float
// steps run in one order for every (row, output), whatever the number of rows or threads:
// eight lanes acc += float(integer lanes) * (d * s), four lanes mins += float(min lanes) * (dmin * s)
// (the min sum as _mm_madd_epi16 pairs it), and the result lanes_sum(acc) - ((m0 + m2) + (m1 + m3)).
// So a row's result never depends on the other rows (exactness).
// AVX2: a 32-byte load gives two blocks (mask, shift), each one _mm256_maddubs_epi16 (q <= 15,
// |xq| <= 127: pair sums fit in int16) and one _mm256_madd_epi16 by the block's scale. Without
// AVX2 a scalar loop forms the same integer lanes and the same float steps.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"
#include "q4k_avx512.h"
#include "q4k_blocks.h"

namespace {

using specserve::half_to_float;
using specserve::Isa;
using namespace specserve::q4k;

// Where block b (0..7) of a super-block goes in the activations: in order, or for the AVX-512 code
// interleaved per 128 inputs as blocks 0 2 1 3 (its 64-byte weight loads hold blocks 0 and 2 in the
// low nibbles and 1 and 3 in the high ones).
inline int64_t block_slot(int64_t b, bool interleave) {
  constexpr int64_t kInterleaved[4] = {0, 2, 1, 3};
  return interleave ? (b & ~int64_t{3}) + kInterleaved[b & 3] : b;
}

void quantize_rows(const float* x, int64_t rows, int64_t k, bool interleave, int8_t* q, float* scales,
                   int16_t* bsums) {
  const int64_t supers = k / kSuper;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t s = 0; s < supers; ++s) {
        const float* xs = x + m * k + s * kSuper;
        float amax = 0.f;
        for (int64_t i = 0; i < kSuper; ++i) amax = std::max(amax, std::fabs(xs[i]));
        const float scale = amax / 127.f;
        const float inv = scale > 0.f ? 1.f / scale : 0.f;
        int8_t* qs = q + m * k + s * kSuper;
        for (int64_t b = 0; b < kBlocks; ++b) {
          int sum = 0;
          int8_t* qb = qs + block_slot(b, interleave) * kBlock;
          for (int64_t i = 0; i < kBlock; ++i) {
            const float v = std::clamp(std::nearbyint(xs[b * kBlock + i] * inv), -127.f, 127.f);
            qb[i] = static_cast<int8_t>(v);
            sum += static_cast<int>(v);
          }
          bsums[(m * supers + s) * kBlocks + b] = static_cast<int16_t>(sum);
        }
        scales[m * supers + s] = scale;
      }
    }
  });
}

// The min term of one super-block as four exact int32 lanes: lane i = m[2i] bsum[2i] + m[2i+1] bsum[2i+1]
// (as _mm_madd_epi16 forms them; |.| <= 2 * 63 * 4064).
inline void min_lanes(const uint8_t* mn, const int16_t* bsum, int32_t lanes[4]) {
  for (int i = 0; i < 4; ++i)
    lanes[i] = static_cast<int32_t>(mn[2 * i]) * bsum[2 * i] + static_cast<int32_t>(mn[2 * i + 1]) * bsum[2 * i + 1];
}


#if SPECSERVE_AVX2
inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Shuffle masks that broadcast 16-bit element b of a 128-bit lane to all eight of its elements.
alignas(32) const uint8_t kBroadcast16[8][32] = {
#define SPECSERVE_B(b) {2*b, 2*b+1, 2*b, 2*b+1, 2*b, 2*b+1, 2*b, 2*b+1, 2*b, 2*b+1, 2*b, 2*b+1, 2*b, 2*b+1, \
                        2*b, 2*b+1, 2*b, 2*b+1, 2*b, 2*b+1, 2*b, 2*b+1, 2*b, 2*b+1, 2*b, 2*b+1, 2*b, 2*b+1, \
                        2*b, 2*b+1, 2*b, 2*b+1}
    SPECSERVE_B(0), SPECSERVE_B(1), SPECSERVE_B(2), SPECSERVE_B(3),
    SPECSERVE_B(4), SPECSERVE_B(5), SPECSERVE_B(6), SPECSERVE_B(7),
#undef SPECSERVE_B
};

// One weight row against G activation rows; the 4-bit unpacking and the scales are shared by the rows.
template <int G>
void dot_group_avx2(const Q4K& w, const Rows& x, int64_t k, float* out, int64_t out_stride) {
  const int64_t supers = k / kSuper;
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[G];
  __m128 mins[G];
  for (int r = 0; r < G; ++r) {
    acc[r] = _mm256_setzero_ps();
    mins[r] = _mm_setzero_ps();
  }
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* q = w.qs + s * kSuperBytes;
    _mm_prefetch(reinterpret_cast<const char*>(q + 4 * kSuperBytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(q + 4 * kSuperBytes + 64), _MM_HINT_T0);
    // the eight block scales as int16, in both 128-bit lanes
    const __m256i sc16 = _mm256_broadcastsi128_si256(
        _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.sc + s * kBlocks))));
    const __m128i mn16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.mn + s * kBlocks)));
    __m256i isum[G];
    for (int r = 0; r < G; ++r) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256i bytes = load32(q + 32 * j);
      const __m256i lo = _mm256_and_si256(bytes, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
      const __m256i sc_lo = _mm256_shuffle_epi8(sc16, load32(kBroadcast16[2 * j]));
      const __m256i sc_hi = _mm256_shuffle_epi8(sc16, load32(kBroadcast16[2 * j + 1]));
#pragma GCC unroll 4
      for (int r = 0; r < G; ++r) {
        const int8_t* xr = x.q + r * k + s * kSuper + 64 * j;
        const __m256i p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load32(xr)), sc_lo);
        const __m256i p_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load32(xr + 32)), sc_hi);
        isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(p_lo, p_hi));
      }
    }
    const float d = half_to_float(w.d[s]), dmin = half_to_float(w.dmin[s]);
#pragma GCC unroll 4
    for (int r = 0; r < G; ++r) {
      const float xs = x.scale[r * supers + s];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(d * xs), acc[r]);
      const __m128i bsum = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x.bsum + (r * supers + s) * kBlocks));
      const __m128 msum = _mm_cvtepi32_ps(_mm_madd_epi16(mn16, bsum));
      mins[r] = _mm_fmadd_ps(msum, _mm_set1_ps(dmin * xs), mins[r]);
    }
  }
  for (int r = 0; r < G; ++r) {
    alignas(16) float m[4];
    _mm_store_ps(m, mins[r]);
    out[r * out_stride] = specserve::lanes_sum(acc[r]) - mins_sum4(m);
  }
}
#endif


// The same numbers without AVX2: lane L of a block holds its bytes 4L..4L+3, as madd forms them.
void dot_row_scalar(const Q4K& w, const Rows& x, int64_t k, float* out) {
  const int64_t supers = k / kSuper;
  float acc[8] = {};
  float mins[4] = {};
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* q = w.qs + s * kSuperBytes;
    int32_t isum[8] = {};
    for (int j = 0; j < 4; ++j) {
      for (int half = 0; half < 2; ++half) {
        const int32_t scale = w.sc[s * kBlocks + 2 * j + half];
        const int8_t* xb = x.q + s * kSuper + 64 * j + 32 * half;
        for (int lane = 0; lane < 8; ++lane) {
          int32_t t = 0;
          for (int e = 0; e < 4; ++e) {
            const uint8_t byte = q[32 * j + 4 * lane + e];
            t += static_cast<int32_t>(half ? byte >> 4 : byte & 0x0F) * xb[4 * lane + e];
          }
          isum[lane] += t * scale;
        }
      }
    }
    const float xs = x.scale[s];
    const float step = half_to_float(w.d[s]) * xs;
    for (int lane = 0; lane < 8; ++lane) acc[lane] = std::fma(static_cast<float>(isum[lane]), step, acc[lane]);
    int32_t msum[4];
    min_lanes(w.mn + s * kBlocks, x.bsum + s * kBlocks, msum);
    const float min_step = half_to_float(w.dmin[s]) * xs;
    for (int i = 0; i < 4; ++i) mins[i] = std::fma(static_cast<float>(msum[i]), min_step, mins[i]);
  }
  *out = specserve::lanes_sum8(acc) - mins_sum4(mins);
}

constexpr int64_t kGroup = 4;  // activation rows sharing each unpacked weight block

template <int G>
void dot_group(Isa isa, const Q4K& w, const Rows& x, int64_t k, float* out, int64_t out_stride) {
#if SPECSERVE_AVX512
  if (isa == Isa::kAvx512) return dot_group_avx512<G>(w, x, k, out, out_stride);
#endif
#if SPECSERVE_AVX2
  if (isa == Isa::kAvx2) return dot_group_avx2<G>(w, x, k, out, out_stride);
#endif
  const int64_t supers = k / kSuper, blocks = k / kBlock;
  for (int64_t r = 0; r < G; ++r) {
    const Rows one{x.q + r * k, x.scale + r * supers, x.bsum + r * blocks};
    dot_row_scalar(w, one, k, out + r * out_stride);
  }
}

void dot_rows(Isa isa, const Q4K& w, const Rows& x, int64_t rows, int64_t k, float* out, int64_t out_stride) {
  const int64_t supers = k / kSuper, blocks = k / kBlock;
  // AVX-512 has the registers for eight rows at a time (fewer unpackings per row in a prefill)
  const int64_t group_rows = isa == Isa::kAvx512 ? 2 * kGroup : kGroup;
  for (int64_t m = 0; m < rows; m += group_rows) {
    const Rows group{x.q + m * k, x.scale + m * supers, x.bsum + m * blocks};
    float* o = out + m * out_stride;
    switch (std::min(group_rows, rows - m)) {
      case 8: dot_group<8>(isa, w, group, k, o, out_stride); break;
      case 7: dot_group<7>(isa, w, group, k, o, out_stride); break;
      case 6: dot_group<6>(isa, w, group, k, o, out_stride); break;
      case 5: dot_group<5>(isa, w, group, k, o, out_stride); break;
      case 4: dot_group<4>(isa, w, group, k, o, out_stride); break;
      case 3: dot_group<3>(isa, w, group, k, o, out_stride); break;
      case 2: dot_group<2>(isa, w, group, k, o, out_stride); break;
      default: dot_group<1>(isa, w, group, k, o, out_stride); break;
    }
  }
}

}  // namespace

// x [M, K] (float32 or bf16); qs uint8 [N, K / 2]; d, dmin fp16-as-int16 [N, K / 256];
// scales, mins uint8 [N, K / 32] -> [M, N] float32.
torch::Tensor q4k_linear(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                         const torch::Tensor& dmin, const torch::Tensor& scales, const torch::Tensor& mins) {
  TORCH_CHECK(x.dim() == 2 && qs.dim() == 2, "q4k_linear: 2-d tensors expected");
  const int64_t rows = x.size(0), k = x.size(1), n = qs.size(0);
  TORCH_CHECK(k % kSuper == 0, "q4k_linear: K must be a multiple of 256, got ", k);
  TORCH_CHECK(qs.scalar_type() == torch::kUInt8 && qs.size(1) == k / 2, "q4k_linear: qs must be uint8 [N, K / 2]");
  for (const auto* t : {&d, &dmin})
    TORCH_CHECK(t->scalar_type() == torch::kInt16 && t->size(0) == n && t->size(1) == k / kSuper,
                "q4k_linear: d and dmin must be fp16 bits as int16 [N, K / 256]");
  for (const auto* t : {&scales, &mins})
    TORCH_CHECK(t->scalar_type() == torch::kUInt8 && t->size(0) == n && t->size(1) == k / kBlock,
                "q4k_linear: scales and mins must be uint8 [N, K / 32]");
  auto xf = x.to(torch::kFloat32).contiguous();
  auto qc = qs.contiguous(), dc = d.contiguous(), mc = dmin.contiguous();
  auto sc = scales.contiguous(), mn = mins.contiguous();
  std::vector<int8_t> xq(rows * k);
  std::vector<float> xs(rows * (k / kSuper));
  std::vector<int16_t> bsums(rows * (k / kBlock));
  const Isa isa = specserve::isa();
  quantize_rows(xf.data_ptr<float>(), rows, k, isa == Isa::kAvx512, xq.data(), xs.data(), bsums.data());
  const Rows activations{xq.data(), xs.data(), bsums.data()};
  auto out = torch::empty({rows, n}, torch::kFloat32);
  float* o = out.data_ptr<float>();
  const auto* dp = reinterpret_cast<const uint16_t*>(dc.data_ptr<int16_t>());
  const auto* mp = reinterpret_cast<const uint16_t*>(mc.data_ptr<int16_t>());
  // data_ptr<T>() checks the dtype on every call: taken once here (inside the loop it cost ~100 us
  // per product of 9728 outputs, a third of the product's time).
  const uint8_t* qp = qc.data_ptr<uint8_t>();
  const uint8_t* scp = sc.data_ptr<uint8_t>();
  const uint8_t* mnp = mn.data_ptr<uint8_t>();
  const auto weight_row = [&](int64_t j) {
    return Q4K{qp + j * (k / 2), dp + j * (k / kSuper), mp + j * (k / kSuper), scp + j * (k / kBlock),
               mnp + j * (k / kBlock)};
  };
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    int64_t j = begin;
#if SPECSERVE_AVX512
    if (rows == 1 && isa == Isa::kAvx512) {  // decode: two outputs per pass (independent chains)
      for (; j + 1 < end; j += 2) {
        const Q4K pair[2] = {weight_row(j), weight_row(j + 1)};
        dot_outputs_avx512<2>(pair, activations, k, o + j);
      }
    }
#endif
    for (; j < end; ++j) dot_rows(isa, weight_row(j), activations, rows, k, o + j, n);
  });
  return out;
}
