// What the kernels share: the instruction-set switch, fp16 scales, and a fixed-order lane sum.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SPECSERVE_AVX2 1
#else
#define SPECSERVE_AVX2 0
#endif

// AVX-512 (F, BW, VL) with VNNI, and AMX-INT8: compiled beside the AVX2 code as functions with their
// own target attribute and chosen at run time (an image built with these kernels still runs on AVX2
// hosts).
#if SPECSERVE_AVX2 && defined(__GNUC__) && defined(__x86_64__)
#define SPECSERVE_AVX512 1
#define SPECSERVE_AVX512_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define SPECSERVE_AMX_FN \
  __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#else
#define SPECSERVE_AVX512 0
#endif

namespace specserve {

// Which vector code the products run. Every path forms the same exact integer sums and the same
// float steps, so they agree bit for bit; the choice is the best the CPU has unless force_isa (tests,
// benchmarks) narrowed it. kAmx: AVX-512 VNNI, with AMX-INT8 tiles for products of several rows.
enum class Isa { kScalar, kAvx2, kAvx512, kAmx };
Isa isa();
const char* active_isa();          // "amx", "avx512" (AVX-512 VNNI), "avx2" or "scalar"
void force_isa(const char* name);  // "auto", "amx", "avx512", "avx2" or "scalar"; throws if unavailable

// From how many rows in a pass the Q8 product prefetches its tiles ahead in software (0: never). It
// changes no number, only the speed. On Intel Xeons (Sapphire Rapids) prefetching was 5-12% faster
// at 1-5 rows: from 1 row. On an AMD EPYC (AVX-512, twentieth session) it made passes of 1-3 rows
// 1.1-1.35x slower (the hardware prefetcher follows the ascending stream on its own) and passes of 4
// rows 1.2-1.25x faster (their dot products leave the stream behind): from 4 rows there.
// set_tile_prefetch overrides the default (benchmarks; -1 restores it).
int64_t tile_prefetch_rows();
void set_tile_prefetch(int64_t rows);

// The outputs of one group of a tiled product: ``count`` features (16, fewer in the last group) at
// ``out`` + o, rows ``stride`` apart.
struct GroupOut {
  float* out;
  int64_t stride;
  int count;
};

inline float half_to_float(uint16_t h) {
#if SPECSERVE_AVX2
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// The sum of eight float lanes in the order the vector code uses: (0+4) (1+5) (2+6) (3+7), then
// ((a + c) + (b + d)). The scalar fallbacks call this on their own lanes, so both agree bit for bit.
inline float lanes_sum8(const float* l) {
  const float a = l[0] + l[4], b = l[1] + l[5], c = l[2] + l[6], d = l[3] + l[7];
  return (a + c) + (b + d);
}

#if SPECSERVE_AVX2
inline float lanes_sum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);                // a b c d
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));        // a+c b+d
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55)); // (a+c)+(b+d)
  return _mm_cvtss_f32(s);
}
#endif

// work(begin, end) over [0, n) in chunks of ``chunk``, taken by torch's threads from one counter.
// A static split would make every product wait for its slowest thread: a worker woken late from
// its sleep between products (in a VM, tens to hundreds of microseconds) held up a 17920 x 1536
// product by 0.3 ms of its 0.65; with chunks the thread that is there takes more of them. Each
// chunk is contiguous, so each thread still reads long ascending runs.
// ``chunk`` is the most a chunk takes: a product of few groups (a 1536-output matrix holds 96 groups
// of 16) is cut into at least kChunksPerThread chunks a thread, so that no thread is left with a
// whole extra chunk at the end (3 chunks of 32 over 2 threads made one thread do two thirds).
constexpr int64_t kChunksPerThread = 8;

template <typename F>
void parallel_chunks(int64_t n, int64_t chunk, const F& work) {
  const int64_t workers = at::get_num_threads();
  chunk = std::max<int64_t>(1, std::min(chunk, n / (kChunksPerThread * std::max<int64_t>(1, workers))));
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t threads = std::min<int64_t>(workers, chunks);
  if (threads <= 1) return work(int64_t{0}, n);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1))
      work(c * chunk, std::min(n, (c + 1) * chunk));
  });
}

}  // namespace specserve
