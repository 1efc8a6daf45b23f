// Attention of a few query rows over a cache, each row on its own: a row's output does not depend on the
// rows beside it (a tree's nodes equal the same tokens decoded one at a time, bit for bit).
//
// For one query row and head, over the visible positions j in increasing order:
//   s_j = scale * dot(q, k_j),  p_j = exp(s_j - max_j s_j),  out = (sum_j p_j v_j) / (sum_j p_j).
// The positions a row sees are gathered first, so a tree node's sums run over its prefix and its ancestors
// in the order the same tokens decoded one by one would have, at the same indices of the gathered list:
// the same operations on the same values, split alike between vector and scalar code. dot() adds 16
// partial sums lane by lane, then halves them in a fixed order; exp is a polynomial of plain operations
// (no library call, which could differ between its vector and scalar forms). Build with
// -ffp-contract=off, no -ffast-math: nothing is reordered.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include <omp.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kReaderBlock = 64;  // query vectors attended together over one key/value head

#if defined(__AVX512F__)
inline float dot(const float* a, const float* b, int64_t d) {
  if (d == 64) {  // the common head size: four independent products, added pairwise
    const __m512 p0 = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
    const __m512 p1 = _mm512_mul_ps(_mm512_loadu_ps(a + 16), _mm512_loadu_ps(b + 16));
    const __m512 p2 = _mm512_mul_ps(_mm512_loadu_ps(a + 32), _mm512_loadu_ps(b + 32));
    const __m512 p3 = _mm512_mul_ps(_mm512_loadu_ps(a + 48), _mm512_loadu_ps(b + 48));
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(p0, p1), _mm512_add_ps(p2, p3)));
  }
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < d; t += 16) {
    const __mmask16 lanes = d - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (d - t)) - 1);
    sum = _mm512_add_ps(sum, _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, a + t), _mm512_maskz_loadu_ps(lanes, b + t)));
  }
  return _mm512_reduce_add_ps(sum);
}
#else
inline float dot(const float* a, const float* b, int64_t d) {
  float lanes[kLanes] = {};
  int64_t t = 0;
  for (; t + kLanes <= d; t += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += a[t + l] * b[t + l];
  }
  for (int64_t l = 0; t + l < d; ++l) lanes[l] += a[t + l] * b[t + l];
  for (int64_t width = kLanes / 2; width >= 1; width /= 2) {
    for (int64_t l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0];
}
#endif

// exp(x) within about 2 ulp for x in [-87, 88] (clamped there): x = n ln2 + r with |r| <= ln2 / 2 (ln2
// in two parts, Cody and Waite), exp(r) by its Taylor series to r^6 (the next term is below 1.3e-7
// relative), times 2^n.
inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);  // exp(-87) ~ 1.6e-38 is still normal; exp(88) < FLT_MAX
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX512F__)
// The same formula as exp_clamped, 16 lanes at a time; the last lanes masked, computed alike.
inline __m512 exp_clamped16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693145751953125f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(1.428606765330187045e-06f)));
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  const float coefficients[6] = {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
  for (float c : coefficients) p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(c));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

void exp_shifted(float* values, int64_t count, float top) {
  const __m512 shift = _mm512_set1_ps(top);
  for (int64_t u = 0; u < count; u += 16) {
    const __mmask16 lanes = count - u >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (count - u)) - 1);
    const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, values + u), shift);
    _mm512_mask_storeu_ps(values + u, lanes, exp_clamped16(x));
  }
}
#else
void exp_shifted(float* values, int64_t count, float top) {
  for (int64_t u = 0; u < count; ++u) values[u] = exp_clamped(values[u] - top);
}
#endif

}  // namespace

extern "C" {

// values[u] = exp(values[u] - shift) for u < count (the layers' SiLU reads it with shift 0).
void specserve_exp_shifted(float* values, int64_t count, float shift) { exp_shifted(values, count, shift); }

// q [rows, heads, d] at (q_row, q_head) strides -> out [rows, heads, d] contiguous. keys and values
// [kv_heads, length, d] at (kv_head, kv_pos) strides, the last axis contiguous. visible [rows, length]
// (1 = attended) or null for all. Query head h reads key/value head h / (heads / kv_heads). The query
// heads of one key/value head, for every row, share each key and value read.
void specserve_attend(const float* q, int64_t rows, int64_t heads, int64_t d, int64_t q_row, int64_t q_head,
                      const float* keys, const float* values, int64_t kv_heads, int64_t length, int64_t kv_head,
                      int64_t kv_pos, const uint8_t* visible, float scale, float* out) {
  const int64_t group = heads / kv_heads;
  const int64_t readers = rows * group;  // query vectors per key/value head: (row, head in the group)
  // Readers in blocks, so a long prompt's scores stay small: [block][length] floats per task. With
  // several rows, each head's readers are split so the tasks divide evenly among the threads (a small
  // model has 3 key/value heads: one task per head left a core idle a third of the time); a block
  // re-reads its head's keys and values, which one row cannot afford (measured 1.1x slower) and a tree's
  // rows can (0.95x).
  const int64_t threads = std::max(1, omp_get_max_threads());
  const int64_t splits = rows >= 4 ? threads / std::gcd(kv_heads, threads) : 1;
  const int64_t even = (readers + splits - 1) / splits;
  const int64_t block = std::min<int64_t>(std::max<int64_t>(group, (kReaderBlock / group) * group), even);
  const int64_t blocks = (readers + block - 1) / block;
#pragma omp parallel for schedule(static) if (kv_heads * blocks > 1 && rows * heads * length * d > 32768)
  for (int64_t task = 0; task < kv_heads * blocks; ++task) {
    const int64_t kv = task / blocks, first = (task % blocks) * block;
    const int64_t last = std::min(readers, first + block), count_readers = last - first;
    const float* k = keys + kv * kv_head;
    const float* v = values + kv * kv_head;
    std::vector<float> weights(static_cast<size_t>(count_readers * length));  // [reader][its u-th position]
    std::vector<int64_t> count(static_cast<size_t>(count_readers), 0);
    std::vector<float> acc(static_cast<size_t>(count_readers * d), 0.0f);
    std::vector<float> total(static_cast<size_t>(count_readers), 0.0f);
    auto query = [&](int64_t r) { return q + (r / group) * q_row + (kv * group + r % group) * q_head; };
    auto sees = [&](int64_t r, int64_t j) { return visible == nullptr || visible[(r / group) * length + j]; };
    for (int64_t j = 0; j < length; ++j) {
      const float* kj = k + j * kv_pos;
      for (int64_t r = first; r < last; ++r) {
        const int64_t b = r - first;
        if (sees(r, j)) weights[b * length + count[b]++] = scale * dot(query(r), kj, d);
      }
    }
    for (int64_t b = 0; b < count_readers; ++b) {
      float* w = weights.data() + b * length;
      float top = -INFINITY;
      for (int64_t u = 0; u < count[b]; ++u) top = std::max(top, w[u]);
      exp_shifted(w, count[b], top);
      for (int64_t u = 0; u < count[b]; ++u) total[b] += w[u];
    }
    std::fill(count.begin(), count.end(), 0);
    for (int64_t j = 0; j < length; ++j) {
      const float* __restrict vj = v + j * kv_pos;
      for (int64_t r = first; r < last; ++r) {
        const int64_t b = r - first;
        if (!sees(r, j)) continue;
        const float p = weights[b * length + count[b]++];
        float* __restrict a = acc.data() + b * d;
        for (int64_t t = 0; t < d; ++t) a[t] += p * vj[t];
      }
    }
    for (int64_t r = first; r < last; ++r) {
      const int64_t b = r - first;
      float* o = out + ((r / group) * heads + kv * group + r % group) * d;
      for (int64_t t = 0; t < d; ++t) o[t] = acc[b * d + t] / total[b];
    }
  }
}

}  // extern "C"
