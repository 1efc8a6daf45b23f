// Attention of a few query rows over a cache, each row on its own: a row's output does not depend on the
// rows beside it (a tree's nodes equal the same tokens decoded one at a time, bit for bit).
//
// For one query row and head, over the visible positions j in increasing order:
//   s_j = scale * dot(q, k_j),  p_j = exp(s_j - max_j s_j),  out = (sum_j p_j v_j) / (sum_j p_j).
// Every term a row sums depends only on that row's query and the positions it sees, and is added in the
// order the same tokens decoded one by one would add it:
// - a score depends on one query and one key, nothing else;
// - the softmax's maximum and sum run over the row's visible scores gathered into a list, so a tree
//   node's prefix and ancestors sit at the indices its path decoded alone gives them;
// - the weighted sum of values runs over the positions in order; a position the row does not see adds
//   a weight of exactly 0, which leaves every partial sum as it was (they start at +0 and stay >= 0 or
//   nonzero, so not even a zero's sign changes).
// The AVX-512 loops hold a block of 16 positions' partial products and sum their lanes in one fixed tree,
// and weigh the values with a few rows' sums in registers; the AVX2 loops do the same in blocks of 8;
// other CPUs run portable loops (the three paths' last bits may differ, as two hosts' may). exp is a
// polynomial of plain operations (no library call, which could differ between its vector and scalar
// forms). Built with -ffp-contract=off, no -ffast-math: nothing is reordered; the fused multiply-adds
// are written out where they are meant.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include <omp.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
// The blocked loops below also take byte masks and 128-bit masked loads (AVX512BW, AVX512VL).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SPECSERVE_ATTEND_AVX512 1
#else
#define SPECSERVE_ATTEND_AVX512 0
#endif
#if !SPECSERVE_ATTEND_AVX512 && defined(__AVX2__) && defined(__FMA__)
#define SPECSERVE_ATTEND_AVX2 1
#else
#define SPECSERVE_ATTEND_AVX2 0
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
#elif defined(__AVX2__) && defined(__FMA__)
// The same formula as exp_clamped, 8 lanes at a time (the same operations: the same bits).
inline __m256 exp_clamped8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(
      _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693145751953125f))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(1.428606765330187045e-06f)));
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  const float coefficients[6] = {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
  for (float c : coefficients) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

void exp_shifted(float* values, int64_t count, float top) {
  const __m256 shift = _mm256_set1_ps(top);
  int64_t u = 0;
  for (; u + 8 <= count; u += 8) {
    _mm256_storeu_ps(values + u, exp_clamped8(_mm256_sub_ps(_mm256_loadu_ps(values + u), shift)));
  }
  for (; u < count; ++u) values[u] = exp_clamped(values[u] - top);
}
#else
void exp_shifted(float* values, int64_t count, float top) {
  for (int64_t u = 0; u < count; ++u) values[u] = exp_clamped(values[u] - top);
}
#endif

// One task: the readers [first, last) of one key/value head, a reader being a (row, query head of the
// group) pair; each writes its own output vector.
struct Task {
  const float* q;
  int64_t q_row, q_head, group, heads, d;
  const float* k;
  const float* v;
  int64_t length, kv_pos;
  const uint8_t* visible;  // [rows, length] or null
  float scale;
  int64_t kv, first, last;
  float* out;

  const float* query(int64_t r) const { return q + (r / group) * q_row + (kv * group + r % group) * q_head; }
  bool sees(int64_t r, int64_t j) const { return visible == nullptr || visible[(r / group) * length + j]; }
  float* output(int64_t r) const { return out + ((r / group) * heads + kv * group + r % group) * d; }
};

// Any head size, any CPU: one dot product per reader and position.
void attend_portable(const Task& t) {
  const int64_t count_readers = t.last - t.first, length = t.length, d = t.d;
  std::vector<float> weights(static_cast<size_t>(count_readers * length));  // [reader][its u-th position]
  std::vector<int64_t> count(static_cast<size_t>(count_readers), 0);
  std::vector<float> acc(static_cast<size_t>(count_readers * d), 0.0f);
  std::vector<float> total(static_cast<size_t>(count_readers), 0.0f);
  for (int64_t j = 0; j < length; ++j) {
    const float* kj = t.k + j * t.kv_pos;
    for (int64_t r = t.first; r < t.last; ++r) {
      const int64_t b = r - t.first;
      if (t.sees(r, j)) weights[b * length + count[b]++] = t.scale * dot(t.query(r), kj, d);
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
    const float* __restrict vj = t.v + j * t.kv_pos;
    for (int64_t r = t.first; r < t.last; ++r) {
      const int64_t b = r - t.first;
      if (!t.sees(r, j)) continue;
      const float p = weights[b * length + count[b]++];
      float* __restrict a = acc.data() + b * d;
      for (int64_t i = 0; i < d; ++i) a[i] += p * vj[i];
    }
  }
  for (int64_t r = t.first; r < t.last; ++r) {
    const int64_t b = r - t.first;
    float* o = t.output(r);
    for (int64_t i = 0; i < d; ++i) o[i] = acc[b * d + i] / total[b];
  }
}

#if SPECSERVE_ATTEND_AVX512
// Sixteen vectors -> one vector whose lane i is the sum of s[i]'s lanes, by one fixed tree of adds (pairs
// of lanes within 128 bits, then 128-bit blocks), whatever the vectors beside s[i].
inline __m512 sum_lanes16(const __m512* s) {
  __m512 t[8], u[4], v[2];
  for (int i = 0; i < 8; ++i) {
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(s[2 * i], s[2 * i + 1]), _mm512_unpackhi_ps(s[2 * i], s[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i) {
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88), _mm512_shuffle_f32x4(v[0], v[1], 0xDD));
}

inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

// Which of positions j0.. (n of them) row `row` sees, one bit each.
inline __mmask16 seen(const Task& t, int64_t r, int64_t j0, int64_t n) {
  if (t.visible == nullptr) return first_lanes(n);
  // a masked load of the row's bytes (a copy through the stack stalled on store forwarding)
  const __m128i bytes = _mm_maskz_loadu_epi8(first_lanes(n), t.visible + (r / t.group) * t.length + j0);
  return _mm_test_epi8_mask(bytes, bytes);
}

// Readers b0..b0+R-1's outputs: their weights p [R][stride] times the values in position order, over
// their totals. Positions from the last of their ends on are weighed 0 by all of them, and skipped.
template <int NV, int R>
inline void weigh_values(const Task& t, int64_t b0, const float* scores, int64_t stride, const float* total,
                         const int64_t* ends) {
  __m512 acc[R][NV];
  for (int c = 0; c < R; ++c)
    for (int i = 0; i < NV; ++i) acc[c][i] = _mm512_setzero_ps();
  const float* p = scores + b0 * stride;
  const int64_t end = *std::max_element(ends + b0, ends + b0 + R);
  for (int64_t j = 0; j < end; ++j) {
    const float* vj = t.v + j * t.kv_pos;
    __m512 values[NV];
    for (int i = 0; i < NV; ++i) values[i] = _mm512_loadu_ps(vj + 16 * i);
    for (int c = 0; c < R; ++c) {
      const __m512 weight = _mm512_set1_ps(p[c * stride + j]);
      for (int i = 0; i < NV; ++i) acc[c][i] = _mm512_fmadd_ps(weight, values[i], acc[c][i]);
    }
  }
  for (int c = 0; c < R; ++c) {
    float* o = t.output(t.first + b0 + c);
    const __m512 divisor = _mm512_set1_ps(total[b0 + c]);
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(o + 16 * i, _mm512_div_ps(acc[c][i], divisor));
  }
}

// The last `count` (< R + 1) readers from b0, together.
template <int NV, int R>
inline void weigh_last(const Task& t, int64_t b0, int64_t count, const float* scores, int64_t stride,
                       const float* total, const int64_t* ends) {
  if constexpr (R > 0) {
    if (count == R) return weigh_values<NV, R>(t, b0, scores, stride, total, ends);
    weigh_last<NV, R - 1>(t, b0, count, scores, stride, total, ends);
  }
}

// Head size 16 * NV, up to C readers' sums of values in registers at once.
template <int NV, int C>
void attend_avx512(const Task& t) {
  const int64_t readers = t.last - t.first, length = t.length, stride = (length + 15) / 16 * 16;
  std::vector<float> scores(static_cast<size_t>(readers * stride));  // [reader][position], then weights
  std::vector<float> gathered(t.visible == nullptr ? 0 : static_cast<size_t>(stride));
  // Where each reader's visible positions end: a prefill's rows see a causal triangle, and past its end
  // a row's scores are not read and its weights are 0 (skipping them leaves every sum as it was).
  std::vector<int64_t> ends(static_cast<size_t>(readers), length);
  if (t.visible != nullptr) {
    for (int64_t b = 0; b < readers; ++b) {
      const uint8_t* row = t.visible + ((t.first + b) / t.group) * length;
      while (ends[b] > 0 && row[ends[b] - 1] == 0) --ends[b];
    }
  }
  // 1. scores: the partial products of 16 positions, then their lanes summed together
  __m512 partial[16];
  for (int64_t j0 = 0; j0 < length; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, length - j0);
    for (int64_t b = 0; b < readers; ++b) {
      if (j0 >= ends[b]) continue;
      const float* q = t.query(t.first + b);
      __m512 qv[NV];
      for (int i = 0; i < NV; ++i) qv[i] = _mm512_loadu_ps(q + 16 * i);
      for (int64_t jj = 0; jj < 16; ++jj) {
        if (jj >= n) {
          partial[jj] = _mm512_setzero_ps();
          continue;
        }
        const float* k = t.k + (j0 + jj) * t.kv_pos;
        __m512 s = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
        for (int i = 1; i < NV; ++i) s = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(k + 16 * i), s);
        partial[jj] = s;
      }
      const __m512 sums = _mm512_mul_ps(sum_lanes16(partial), _mm512_set1_ps(t.scale));
      _mm512_mask_storeu_ps(scores.data() + b * stride + j0, first_lanes(n), sums);
    }
  }
  // 2. each reader's softmax over the scores it sees, gathered in order; back in place, 0 where unseen
  std::vector<float> total(static_cast<size_t>(readers));
  for (int64_t b = 0; b < readers; ++b) {
    float* row = scores.data() + b * stride;
    float* w = row;
    int64_t count = length;
    if (t.visible != nullptr) {
      w = gathered.data();
      count = 0;
      for (int64_t j0 = 0; j0 < ends[b]; j0 += 16) {
        const __mmask16 mask = seen(t, t.first + b, j0, std::min<int64_t>(16, length - j0));
        // compressed in a register, then stored: a compressing store to memory is microcoded on some
        // CPUs (Zen 4: most of this kernel's time)
        const int seen_count = __builtin_popcount(mask);
        _mm512_mask_storeu_ps(w + count, first_lanes(seen_count), _mm512_maskz_compress_ps(mask, _mm512_loadu_ps(row + j0)));
        count += seen_count;
      }
    }
    __m512 top = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    for (int64_t u = 0; u < count; u += 16) {
      top = _mm512_mask_max_ps(top, first_lanes(count - u), top, _mm512_loadu_ps(w + u));
    }
    exp_shifted(w, count, _mm512_reduce_max_ps(top));
    for (int64_t u = 0; u < count; u += 16) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(first_lanes(count - u), w + u));
    total[b] = _mm512_reduce_add_ps(sum);
    if (t.visible != nullptr) {
      int64_t u = 0;
      for (int64_t j0 = 0; j0 < length; j0 += 16) {
        const __mmask16 mask = seen(t, t.first + b, j0, std::min<int64_t>(16, length - j0));
        const int seen_count = __builtin_popcount(mask);
        _mm512_storeu_ps(row + j0, _mm512_maskz_expand_ps(mask, _mm512_maskz_loadu_ps(first_lanes(seen_count), w + u)));
        u += seen_count;
      }
    }
  }
  // 3. the values, weighed in position order, C readers at a time (a count known at compile time, so
  //    their sums stay in registers)
  int64_t b0 = 0;
  for (; b0 + C <= readers; b0 += C) weigh_values<NV, C>(t, b0, scores.data(), stride, total.data(), ends.data());
  weigh_last<NV, C - 1>(t, b0, readers - b0, scores.data(), stride, total.data(), ends.data());
}
#endif

#if SPECSERVE_ATTEND_AVX2
// Eight vectors -> one vector whose lane i is the sum of s[i]'s lanes, by one fixed tree of adds (pairs,
// then pairs of pairs within 128 bits, then the two halves), whatever the vectors beside s[i].
inline __m256 sum_lanes8(const __m256* s) {
  const __m256 g0 = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
  const __m256 g1 = _mm256_hadd_ps(_mm256_hadd_ps(s[4], s[5]), _mm256_hadd_ps(s[6], s[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31));
}

inline float sum_of(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Head size 8 * NV: attend_avx512's three steps in 8 lanes. A reader's 8 * NV sums of values do not fit
// AVX2's 16 registers beside anything else for NV > 8, so the values are weighed 64 outputs at a time
// (each output's sum still runs over the positions in order).
template <int NV>
void attend_avx2(const Task& t) {
  const int64_t readers = t.last - t.first, length = t.length, stride = (length + 7) / 8 * 8;
  std::vector<float> scores(static_cast<size_t>(readers * stride));  // [reader][position], then weights
  std::vector<int64_t> ends(static_cast<size_t>(readers), length);  // as in attend_avx512
  if (t.visible != nullptr) {
    for (int64_t b = 0; b < readers; ++b) {
      const uint8_t* row = t.visible + ((t.first + b) / t.group) * length;
      while (ends[b] > 0 && row[ends[b] - 1] == 0) --ends[b];
    }
  }
  // 1. scores: the partial products of 8 positions, then their lanes summed together (a block's lanes
  //    past the end are 0 and land in the row's padding)
  __m256 partial[8];
  for (int64_t j0 = 0; j0 < length; j0 += 8) {
    const int64_t n = std::min<int64_t>(8, length - j0);
    for (int64_t b = 0; b < readers; ++b) {
      if (j0 >= ends[b]) continue;
      const float* q = t.query(t.first + b);
      for (int64_t jj = 0; jj < 8; ++jj) {
        if (jj >= n) {
          partial[jj] = _mm256_setzero_ps();
          continue;
        }
        const float* k = t.k + (j0 + jj) * t.kv_pos;
        __m256 s = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
        for (int i = 1; i < NV; ++i) s = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * i), _mm256_loadu_ps(k + 8 * i), s);
        partial[jj] = s;
      }
      _mm256_storeu_ps(scores.data() + b * stride + j0, _mm256_mul_ps(sum_lanes8(partial), _mm256_set1_ps(t.scale)));
    }
  }
  // 2. each reader's softmax over the scores it sees, in place: the maximum over them (the same in any
  //    order), exp of each score up to the reader's end (each value's bits do not depend on its place,
  //    and a score it does not see is made 0 after), and their sum in 8 lanes, the k-th score seen
  //    added to lane k % 8 in order: the lanes' sums of the seen scores gathered into a list and added
  //    8 at a time, as a one-by-one decode adds them, without gathering them.
  std::vector<float> total(static_cast<size_t>(readers));
  const __m256 lowest = _mm256_set1_ps(-INFINITY);
  for (int64_t b = 0; b < readers; ++b) {
    float* row = scores.data() + b * stride;
    const int64_t end = ends[b];
    const uint8_t* seen = t.visible == nullptr ? nullptr : t.visible + ((t.first + b) / t.group) * length;
    __m256 top8 = lowest;
    int64_t j = 0;
    for (; j + 8 <= end; j += 8) {
      __m256 block = _mm256_loadu_ps(row + j);
      if (seen != nullptr) {
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(seen + j)));
        const __m256 shown = _mm256_castsi256_ps(_mm256_cmpgt_epi32(bytes, _mm256_setzero_si256()));
        block = _mm256_blendv_ps(lowest, block, shown);
      }
      top8 = _mm256_max_ps(top8, block);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, top8);
    float top = *std::max_element(lanes, lanes + 8);
    for (; j < end; ++j) {
      if (seen == nullptr || seen[j]) top = std::max(top, row[j]);
    }
    exp_shifted(row, end, top);
    __m256 sum = _mm256_setzero_ps();
    int64_t u = 0;
    for (; seen == nullptr && u + 8 <= end; u += 8) sum = _mm256_add_ps(sum, _mm256_loadu_ps(row + u));
    _mm256_storeu_ps(lanes, sum);
    for (int64_t k = u; u < end; ++u) {
      if (seen == nullptr || seen[u]) {
        lanes[k++ & 7] += row[u];
      } else {
        row[u] = 0.0f;
      }
    }
    total[b] = sum_of(_mm256_loadu_ps(lanes));
  }
  // 3. the values, weighed in position order, one reader's 64 outputs at a time in registers
  constexpr int kPart = NV < 8 ? NV : 8;
  for (int64_t b = 0; b < readers; ++b) {
    const float* p = scores.data() + b * stride;
    float* o = t.output(t.first + b);
    const __m256 divisor = _mm256_set1_ps(total[b]);
    for (int part = 0; part < NV; part += kPart) {
      __m256 acc[kPart];
      for (int i = 0; i < kPart; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t j = 0; j < ends[b]; ++j) {
        const float* vj = t.v + j * t.kv_pos + 8 * part;
        const __m256 weight = _mm256_set1_ps(p[j]);
        for (int i = 0; i < kPart; ++i) acc[i] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(vj + 8 * i), acc[i]);
      }
      for (int i = 0; i < kPart; ++i) _mm256_storeu_ps(o + 8 * (part + i), _mm256_div_ps(acc[i], divisor));
    }
  }
}
#endif

void attend_task(const Task& t) {
#if SPECSERVE_ATTEND_AVX512
  if (t.d == 64) return attend_avx512<4, 6>(t);  // 6 readers' sums: 24 of the 32 vector registers
  if (t.d == 128) return attend_avx512<8, 2>(t);
#elif SPECSERVE_ATTEND_AVX2
  if (t.d == 64) return attend_avx2<8>(t);
  if (t.d == 128) return attend_avx2<16>(t);
#endif
  attend_portable(t);
}

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
  // re-reads its head's keys and values, which one row cannot afford (measured 1.02x slower over a
  // 900-position cache) and two or three rows can (0.95x, 0.89x there).
  const int64_t threads = std::max(1, omp_get_max_threads());
  const int64_t splits = rows >= 2 ? threads / std::gcd(kv_heads, threads) : 1;
  const int64_t even = (readers + splits - 1) / splits;
  const int64_t block = std::min<int64_t>(std::max<int64_t>(group, (kReaderBlock / group) * group), even);
  const int64_t blocks = (readers + block - 1) / block;
#pragma omp parallel for schedule(static) if (kv_heads * blocks > 1 && rows * heads * length * d > 32768)
  for (int64_t task = 0; task < kv_heads * blocks; ++task) {
    const int64_t kv = task / blocks, first = (task % blocks) * block;
    attend_task(Task{q, q_row, q_head, group, heads, d, keys + kv * kv_head, values + kv * kv_head, length,
                     kv_pos, visible, scale, kv, first, std::min(readers, first + block), out});
  }
}

}  // extern "C"
