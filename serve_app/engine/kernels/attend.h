// One query's attention over a run of cached keys, defined once (``layer_ops.cpp``) for every op
// that attends, so that they give the same bits: the scores of the visible keys, their maximum,
// exp, the sum of exps in key order, the values weighted in key order, divided by the sum.
#pragma once

#include <cstdint>

namespace specserve {

// q [dim]; key j at keys + j * key_stride, value j at values + j * value_stride (j < width);
// seen[j] false skips key j (nullptr: every key is seen); scores [width] and acc [dim] are scratch;
// out [dim] receives the result.
void attend_query(const float* q, const float* keys, int64_t key_stride, const float* values, int64_t value_stride,
                  int64_t width, const bool* seen, float scale, int64_t dim, float* scores, float* acc, float* out);

}  // namespace specserve
