// Products of float32 rows with a GGUF file's weights, one pass over the weights for all rows: 4-bit
// codes in groups of 32 (Q4_0, Q4_1, Q4_K), 6-bit codes in groups of 16 or 32 (Q6_K, Q5_0) and 8-bit
// codes in groups of 16 or 32 (Q8_0, and any signed weight beyond 6 bits).
//
// A weight is w[n, k] = code * scale[n, g] + bias[n, g] over its groups g of inputs:
// - 4 bits: code 0..15; bias = zero - 8 * scale (the file's `(code - 8) * scale + zero`);
// - 6 bits: code = q + 32 for the file's signed q in -32..31, bias = -32 * scale (exact: a power of two);
// - 8 bits: code = q + 128 for the file's signed q, bias = -128 * scale (exact).
// A row is quantized per group of 32 inputs: d = amax / 127, q = nearbyint(x * 127 / amax), and per
// weight group e = d * sum(q). Then, per output lane, over the groups in order:
//   acc = fma(d, scale * dot, acc);  acc = fma(e, bias, acc);   dot = sum_k code[n, k] * q[k] (integers).
//
// Every integer sum is exact, so any order or vector width gives the same value; the float terms of a
// row are formed lane by lane and added over the groups in order. A row's output therefore does not
// depend on how many rows share the call, nor on which path below computes it (the AVX512-VNNI, the
// AVX2 and the portable paths give the same bits): a tree's rows equal the same tokens decoded one at a
// time.
// Build with -ffp-contract=off: the compiler must not fuse the product `scale * dot` into the add that
// follows on one path and not on the other.
//
// Layouts (runtime/cpu_kernels.py packs them), in tiles of 16 outputs:
// - codes, 4 bits: per tile and group of 32, 4 chunks of 64 bytes; byte 4i+j of chunk c holds output i's
//   codes at inputs 8c+j (low nibble) and 8c+4+j (high nibble).
// - codes, 8 bits: per tile and group of G (16 or 32), G / 4 chunks of 64 bytes; byte 4i+j of chunk c
//   holds output i's code at input 4c+j.
// - codes, 6 bits: per tile and group of G (16 or 32), the codes' low 4 bits as the 4-bit layout lays
//   out codes (G / 8 chunks: chunk c's byte 4i+j holds output i's inputs 8c+j and 8c+4+j), then their
//   high 2 bits in G / 16 chunks: bits 2v..2v+1 of byte 4i+j of chunk h belong to output i's input
//   4(4h+v)+j. Q6_K's codes stream at 0.75 bytes a weight instead of 1 (with its factors 0.81; the
//   file's blocks: 0.82).
// - scales, kind kFloat: float32 [tiles][groups][16], and (4 bits) biases in the same layout.
// - scales, kind kHalf: the same in fp16, where every value is one (the files' Q4_0 / Q4_1 / Q8_0 / Q5_0
//   scales are, and so are their biases as a rule): the same values in half the bytes, so the same bits.
// - scales, kind kBlock (the K-quants, as the file holds them: a float per superblock of 256 inputs
//   times a small integer per group): int8 [tiles][groups][F][16] with supers float32
//   [tiles][superblocks][F][16], or (kind kBlockHalf) the same in fp16 where every one is an fp16 value,
//   as the file's are; F = 2 for 4 bits (scale = d * sc, bias = -dmin * m) and 1 for 6 and 8 bits
//   (scale = d * sc). Each product is exact in float32 (an fp16 times an integer of at most 8 bits),
//   so every path forms the same scale, and the weights stream at about the file's own bytes.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define SPECSERVE_VNNI 1
#define SPECSERVE_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SPECSERVE_VNNI 0
#define SPECSERVE_AVX2 1
#else
#define SPECSERVE_VNNI 0
#define SPECSERVE_AVX2 0
#endif

namespace {

constexpr int64_t kGroup = 32;     // inputs per quantized group of a row
constexpr int64_t kTile = 16;      // outputs per tile
constexpr int64_t kSuper = 256;    // inputs per superblock of the kBlock scales
constexpr int kRowBlock = 8;       // rows whose sums stay in registers over a tile
// A signed format's code offset: code = q + offset, folded into the bias as -offset * scale.
template <int Bits>
constexpr float kOffset = Bits == 6 ? 32.0f : 128.0f;
// Bytes ahead of the weights being read that the vector loops ask the memory for: with several rows a
// tile's arithmetic hides the hardware prefetcher's latency poorly (measured: 8 rows of a 4-bit product
// out of cache 0.65-0.7x the time without it, one row unchanged).
constexpr int64_t kPrefetch = 2048;

enum ScaleKind { kFloat = 0, kBlock = 1, kHalf = 2, kBlockHalf = 3 };

template <int SK>
constexpr bool kBlocked = SK == kBlock || SK == kBlockHalf;

// One tile's scales, as its kind lays them out (see above).
struct TileScales {
  const void* scales;
  const void* biases;   // 4 bits, kFloat (float) or kHalf (fp16)
  const void* supers;  // kBlock (float32) or kBlockHalf (fp16)
};

// An fp16 value as float32, exactly (bits, for any CPU): normal, subnormal, zero, infinity or NaN.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exponent = 113;
    while ((mantissa & 0x400) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
  }
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// Factors per group in the kBlock layout: (sc, m) for 4 bits, sc for 6 and 8.
template <int Bits>
constexpr int64_t kFactors = Bits == 4 ? 2 : 1;

// Group g's 16 scales and biases, lane by lane (the portable path; the VNNI path forms the same values).
template <int Bits, int SK, int G>
inline void group_scales(const TileScales& t, int64_t g, float* scale, float* bias) {
  constexpr int64_t f = kFactors<Bits>;
  if constexpr (SK == kFloat) {
    const float* s = static_cast<const float*>(t.scales) + g * kTile;
    for (int64_t i = 0; i < kTile; ++i) {
      scale[i] = s[i];
      bias[i] = Bits == 4 ? static_cast<const float*>(t.biases)[g * kTile + i] : s[i] * -kOffset<Bits>;
    }
  } else if constexpr (SK == kHalf) {
    const uint16_t* s = static_cast<const uint16_t*>(t.scales) + g * kTile;
    for (int64_t i = 0; i < kTile; ++i) {
      scale[i] = half_to_float(s[i]);
      bias[i] = Bits == 4 ? half_to_float(static_cast<const uint16_t*>(t.biases)[g * kTile + i]) : scale[i] * -kOffset<Bits>;
    }
  } else {
    const int8_t* factor = static_cast<const int8_t*>(t.scales) + g * f * kTile;
    const int64_t at = (g / (kSuper / G)) * f * kTile;
    const auto super = [&](int64_t i) {
      if constexpr (SK == kBlockHalf) return half_to_float(static_cast<const uint16_t*>(t.supers)[at + i]);
      return static_cast<const float*>(t.supers)[at + i];
    };
    for (int64_t i = 0; i < kTile; ++i) {
      scale[i] = super(i) * static_cast<float>(factor[i]);
      bias[i] = Bits == 4 ? super(kTile + i) * static_cast<float>(factor[kTile + i]) : scale[i] * -kOffset<Bits>;
    }
  }
}

// One row's quantization: q [W] int8, per group of 32 the scale d, and per group of `egroup` (the
// weight's group: 16 or 32) the integer sum(q) over it, s, and e = d * s.
void quantize_row(const float* x, int64_t width, int64_t egroup, int8_t* q, float* d, float* e, int32_t* s) {
  for (int64_t g = 0; g < width / kGroup; ++g) {
    const float* xs = x + g * kGroup;
    float amax = 0.0f;
    for (int64_t k = 0; k < kGroup; ++k) amax = std::max(amax, std::fabs(xs[k]));
    const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int64_t k = 0; k < kGroup; ++k) {
      float r = std::nearbyint(xs[k] * inverse);
      r = std::min(127.0f, std::max(-127.0f, r));
      q[g * kGroup + k] = static_cast<int8_t>(r);
    }
    d[g] = amax / 127.0f;
  }
  for (int64_t g = 0; g < width / egroup; ++g) {
    int32_t sum = 0;
    for (int64_t k = 0; k < egroup; ++k) sum += q[g * egroup + k];
    s[g] = sum;
    e[g] = d[g * egroup / kGroup] * static_cast<float>(sum);
  }
}

#if SPECSERVE_VNNI
// The same quantization, 32 inputs at a time (the scalar loop's maximum is a serial chain of 32 scalar
// compares a group, run on one thread before the parallel tiles): the maximum, the products, the
// rounding (to nearest even, as nearbyint in the default mode), the clamp and the integer sums are the
// scalar loop's operations, so the bits are its bits for any finite row.
void quantize_row_vector(const float* x, int64_t width, int64_t egroup, int8_t* q, float* d, float* e, int32_t* s) {
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  const __m512 top = _mm512_set1_ps(127.0f), bottom = _mm512_set1_ps(-127.0f);
  for (int64_t g = 0; g < width / kGroup; ++g) {
    const __m512 x0 = _mm512_loadu_ps(x + g * kGroup), x1 = _mm512_loadu_ps(x + g * kGroup + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(x0, magnitude), _mm512_and_ps(x1, magnitude)));
    const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    const auto codes = [&](__m512 v) {
      const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v, inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      return _mm512_cvtps_epi32(_mm512_min_ps(top, _mm512_max_ps(bottom, r)));
    };
    const __m512i q0 = codes(x0), q1 = codes(x1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * kGroup), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * kGroup + 16), _mm512_cvtepi32_epi8(q1));
    d[g] = amax / 127.0f;
    if (egroup == kGroup) {
      s[g] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
      e[g] = d[g] * static_cast<float>(s[g]);
    } else {
      s[2 * g] = _mm512_reduce_add_epi32(q0);
      s[2 * g + 1] = _mm512_reduce_add_epi32(q1);
      e[2 * g] = d[g] * static_cast<float>(s[2 * g]);
      e[2 * g + 1] = d[g] * static_cast<float>(s[2 * g + 1]);
    }
  }
}
#elif SPECSERVE_AVX2
// The same quantization in 256-bit vectors (as the AVX-512 one above: the scalar loop's operations).
inline float max_of(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int32_t sum_of(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

void quantize_row_vector(const float* x, int64_t width, int64_t egroup, int8_t* q, float* d, float* e, int32_t* s) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 top = _mm256_set1_ps(127.0f), bottom = _mm256_set1_ps(-127.0f);
  // packs_epi32 then packs_epi16 interleave 128-bit lanes: 4-byte pieces back in order
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t g = 0; g < width / kGroup; ++g) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + g * kGroup + 8 * i);
    const __m256 m01 = _mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude));
    const __m256 m23 = _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude));
    const float amax = max_of(_mm256_max_ps(m01, m23));
    const __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i c[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      c[i] = _mm256_cvtps_epi32(_mm256_min_ps(top, _mm256_max_ps(bottom, r)));
    }
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + g * kGroup), _mm256_permutevar8x32_epi32(bytes, order));
    d[g] = amax / 127.0f;
    const __m256i first = _mm256_add_epi32(c[0], c[1]), second = _mm256_add_epi32(c[2], c[3]);
    if (egroup == kGroup) {
      s[g] = sum_of(_mm256_add_epi32(first, second));
      e[g] = d[g] * static_cast<float>(s[g]);
    } else {
      s[2 * g] = sum_of(first);
      s[2 * g + 1] = sum_of(second);
      e[2 * g] = d[g] * static_cast<float>(s[2 * g]);
      e[2 * g + 1] = d[g] * static_cast<float>(s[2 * g + 1]);
    }
  }
}
#endif

// An allocator whose vectors leave new values uninitialized: the quantized rows are written whole before
// they are read, so zero-filling them first was a pass over the rows that every product paid.
template <class T>
struct Uninitialized : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = Uninitialized<U>;
  };
  Uninitialized() = default;
  template <class U>
  Uninitialized(const Uninitialized<U>&) {}
  template <class U>
  void construct(U*) {}  // default-initialized: for these types, left as it is
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
template <class T>
using Buffer = std::vector<T, Uninitialized<T>>;

// Rows quantized: q int8 [rows, W], d per group of 32, and per weight group e and s (quantize_row; the
// integer sums s are what the AVX2 path's 8-bit products add back: its comment below).
struct Rows {
  Buffer<int8_t> q;
  Buffer<float> d, e;
  Buffer<int32_t> s;
};

// Every row of x quantized (in parallel when there are enough of them to pay for it).
void quantize_rows(const float* x, int64_t rows, int64_t width, int64_t egroup, Rows& out) {
  const int64_t groups = width / kGroup, egroups = width / egroup;
  out.q.resize(static_cast<size_t>(rows * width));
  out.d.resize(static_cast<size_t>(rows * groups));
  out.e.resize(static_cast<size_t>(rows * egroups));
  out.s.resize(static_cast<size_t>(rows * egroups));
#pragma omp parallel for schedule(static) if (rows * width > 65536)  // a parallel region costs more than a few rows
  for (int64_t m = 0; m < rows; ++m) {
#if SPECSERVE_VNNI || SPECSERVE_AVX2
    const auto quantize = quantize_row_vector;
#else
    const auto quantize = quantize_row;
#endif
    quantize(x + m * width, width, egroup, out.q.data() + m * width, out.d.data() + m * groups,
             out.e.data() + m * egroups, out.s.data() + m * egroups);
  }
}

// The rows' quantization laid out for the tiles: rows in blocks of kRowBlock (the last block shorter) and,
// within a block of R rows, each weight group's rows side by side: row r's G codes of group g at
// block + (g * R + r) * G, its d of group k (of 32 inputs) at k * R + r, its e and s of group g at g * R + r.
// A group's R rows are then one pointer plus offsets fixed at compile time; kept a row apart, the 8-row
// kernel spilled its row pointers to vector registers and back every group (measured: a tree of 8 rows
// 1-8% faster laid out this way, the same bits). One row's layout is this one already, and is not copied.
void interleave_rows(int64_t rows, int64_t width, int64_t G, const Rows& by_row, Rows& out) {
  const int64_t groups = width / kGroup, egroups = width / G;
  out.q.resize(by_row.q.size());
  out.d.resize(by_row.d.size());
  out.e.resize(by_row.e.size());
  out.s.resize(by_row.s.size());
  for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock) {
    const int64_t R = std::min<int64_t>(kRowBlock, rows - m0);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      for (int64_t g = 0; g < egroups; ++g) {
        std::memcpy(out.q.data() + m0 * width + (g * R + r) * G, by_row.q.data() + m * width + g * G, G);
        out.e[m0 * egroups + g * R + r] = by_row.e[m * egroups + g];
        out.s[m0 * egroups + g * R + r] = by_row.s[m * egroups + g];
      }
      for (int64_t k = 0; k < groups; ++k) out.d[m0 * groups + k * R + r] = by_row.d[m * groups + k];
    }
  }
}

// R rows (q, d, e: their quantization, laid out as interleave_rows does) times one tile of a weight with
// `groups` groups of G inputs.
#if SPECSERVE_VNNI
template <int Bits, int SK, int G>
inline void group_scales(const TileScales& t, int64_t g, __m512* scale, __m512* bias) {
  constexpr int64_t f = kFactors<Bits>;
  if constexpr (SK == kFloat) {
    *scale = _mm512_loadu_ps(static_cast<const float*>(t.scales) + g * kTile);
    *bias = Bits == 4 ? _mm512_loadu_ps(static_cast<const float*>(t.biases) + g * kTile)
                      : _mm512_mul_ps(*scale, _mm512_set1_ps(-kOffset<Bits>));
  } else if constexpr (SK == kHalf) {
    const auto as_float = [](const void* p, int64_t at) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + at)));
    };
    *scale = as_float(t.scales, g * kTile);
    *bias = Bits == 4 ? as_float(t.biases, g * kTile) : _mm512_mul_ps(*scale, _mm512_set1_ps(-kOffset<Bits>));
  } else {
    const int8_t* factor = static_cast<const int8_t*>(t.scales) + g * f * kTile;
    const int64_t at = (g / (kSuper / G)) * f * kTile;
    const auto super = [&](int64_t i) {
      if constexpr (SK == kBlockHalf) {
        const uint16_t* p = static_cast<const uint16_t*>(t.supers) + at + i;
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      }
      return _mm512_loadu_ps(static_cast<const float*>(t.supers) + at + i);
    };
    const auto as_float = [](const int8_t* p) {
      return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    };
    *scale = _mm512_mul_ps(super(0), as_float(factor));
    *bias = Bits == 4 ? _mm512_mul_ps(super(kTile), as_float(factor + kTile))
                      : _mm512_mul_ps(*scale, _mm512_set1_ps(-kOffset<Bits>));
  }
}

template <int Bits, int SK, int G, int R>
void tile_rows(const uint8_t* codes, const TileScales& t, int64_t groups, const int8_t* q, const float* d,
               const float* e, [[maybe_unused]] const int32_t* s, float* y, int64_t y_stride) {
  constexpr int kChunks = G / 4;                     // 64-byte code vectors per group (after unpacking)
  constexpr int64_t kGroupBytes = kTile * G * Bits / 8;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* chunk = codes + g * kGroupBytes;
    for (int64_t j = 0; j < kGroupBytes; j += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(chunk + kPrefetch + j), _MM_HINT_T0);
    }
    __m512i c[kChunks];
    if constexpr (Bits == 4 || Bits == 6) {
      for (int j = 0; j < kChunks / 2; ++j) {
        const __m512i packed = _mm512_loadu_si512(chunk + 64 * j);
        c[2 * j] = _mm512_and_si512(packed, low);
        c[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
      }
    }
    if constexpr (Bits == 6) {
      // each code's high 2 bits to bits 4..5 and or-ed in (0xF8: a | (b & c)); the 16-bit shifts move
      // bits across a byte's edge only into the bits the mask drops
      const __m512i top = _mm512_set1_epi8(0x30);
      for (int h = 0; h < kChunks / 4; ++h) {
        const __m512i high = _mm512_loadu_si512(chunk + 64 * (kChunks / 2) + 64 * h);
        c[4 * h] = _mm512_ternarylogic_epi32(c[4 * h], _mm512_slli_epi16(high, 4), top, 0xF8);
        c[4 * h + 1] = _mm512_ternarylogic_epi32(c[4 * h + 1], _mm512_slli_epi16(high, 2), top, 0xF8);
        c[4 * h + 2] = _mm512_ternarylogic_epi32(c[4 * h + 2], high, top, 0xF8);
        c[4 * h + 3] = _mm512_ternarylogic_epi32(c[4 * h + 3], _mm512_srli_epi16(high, 2), top, 0xF8);
      }
    } else if constexpr (Bits == 8) {
      for (int j = 0; j < kChunks; ++j) c[j] = _mm512_loadu_si512(chunk + 64 * j);
    }
    __m512 scale, bias;
    group_scales<Bits, SK, G>(t, g, &scale, &bias);
    // unrolled, so the R rows' chains of products run side by side and their sums stay in registers (a
    // loop kept each row's sum in memory and ran one row's chain of dependent products at a time)
    const int8_t* qg = q + g * R * G;
    const float* dg = d + (g * G / kGroup) * R;
    const float* eg = e + g * R;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const int32_t* words = reinterpret_cast<const int32_t*>(qg + r * G);
      // two chains of products, added: integer sums, exact in any order
      __m512i dot0 = _mm512_setzero_si512(), dot1 = _mm512_setzero_si512();
      for (int j = 0; j < kChunks; j += 2) {
        dot0 = _mm512_dpbusd_epi32(dot0, c[j], _mm512_set1_epi32(words[j]));
        dot1 = _mm512_dpbusd_epi32(dot1, c[j + 1], _mm512_set1_epi32(words[j + 1]));
      }
      const __m512 scaled = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_add_epi32(dot0, dot1)));
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(dg[r]), scaled, acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(eg[r]), bias, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * y_stride, acc[r]);
}
#elif SPECSERVE_AVX2
// AVX2 has no 4-way byte product into 32 bits (VNNI): vpmaddubsw multiplies unsigned codes by the row's
// signed bytes and adds pairs into 16 bits, saturating, so no 16-bit sum may exceed 32767:
// - 4 bits: a pair at most 2 * 15 * 127 = 3810, a group's 8 chunks 30480;
// - 6 bits: a pair at most 2 * 63 * 127 = 16002, so two chunks' pairs (32004) are added before
//   vpmaddwd takes them into 32 bits (one product per code: split in two parts, as 8-bit codes are,
//   each took two, and 8 rows of the 1.5B model's Q6_K tensors 1.3x the time, 2 to 4 rows 1.1x);
// - 8 bits: the code less 128 (the file's signed q) in one product, as |q| times the row's byte with
//   q's sign (vpsignb): a pair at most 2 * 128 * 127 = 32512, taken into 32 bits at once; then
//   dot = that sum + 128 * sum(row) over the group, the row's integer sum from its quantization. (Each
//   code split into two 4-bit parts took two products: the default model's Q8_0 head 1.09x the time
//   for one row, 1.16-1.23x for 8.)
// dot = the VNNI path's integers, exactly.
// The 16 outputs of a tile run as two halves of 8 (a 256-bit vector's 32 bytes are 8 outputs' 4
// inputs), so that the R rows' sums and a half's codes fit AVX2's 16 registers.

// Group g's scales and biases for the outputs 8 * half.. of a tile: the portable group_scales' values
// (an fp16 value converted exactly, an exact product of a super and an integer factor), 8 at a time.
template <int Bits, int SK, int G>
inline void half_scales(const TileScales& t, int64_t g, int half, __m256* scale, __m256* bias) {
  constexpr int64_t f = kFactors<Bits>;
  const int64_t lane = g * kTile + 8 * half;
  const auto from_half = [](const void* p, int64_t at) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + at)));
  };
  if constexpr (SK == kFloat) {
    *scale = _mm256_loadu_ps(static_cast<const float*>(t.scales) + lane);
    *bias = Bits == 4 ? _mm256_loadu_ps(static_cast<const float*>(t.biases) + lane)
                      : _mm256_mul_ps(*scale, _mm256_set1_ps(-kOffset<Bits>));
  } else if constexpr (SK == kHalf) {
    *scale = from_half(t.scales, lane);
    *bias = Bits == 4 ? from_half(t.biases, lane) : _mm256_mul_ps(*scale, _mm256_set1_ps(-kOffset<Bits>));
  } else {
    const int8_t* factor = static_cast<const int8_t*>(t.scales) + g * f * kTile + 8 * half;
    const int64_t at = (g / (kSuper / G)) * f * kTile + 8 * half;
    const auto super = [&](int64_t i) {
      if constexpr (SK == kBlockHalf) return from_half(t.supers, at + i);
      return _mm256_loadu_ps(static_cast<const float*>(t.supers) + at + i);
    };
    const auto as_float = [](const int8_t* p) {
      return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    };
    *scale = _mm256_mul_ps(super(0), as_float(factor));
    *bias = Bits == 4 ? _mm256_mul_ps(super(kTile), as_float(factor + kTile))
                      : _mm256_mul_ps(*scale, _mm256_set1_ps(-kOffset<Bits>));
  }
}

// One group's codes for half a tile, times R rows, added to the rows' sums of those 8 outputs.
template <int Bits, int SK, int G, int R>
inline void half_group(const uint8_t* codes, const TileScales& t, int64_t g, int half, const int8_t* q,
                       const float* d, const float* e, const int32_t* s, __m256* acc) {
  constexpr int kChunks = G / 4;  // 4 inputs of 16 outputs (64 bytes) per chunk, after unpacking
  constexpr int64_t kGroupBytes = kTile * G * Bits / 8;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const uint8_t* chunk = codes + g * kGroupBytes + 32 * half;
  if (half == 0) {  // as the VNNI loops: the memory asked for ahead of the tile's arithmetic
    for (int64_t j = 0; j < kGroupBytes; j += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(chunk + kPrefetch + j), _MM_HINT_T0);
    }
  }
  // 4 and 6 bits: the codes; 8 bits: their magnitudes |q| and the signed q apart
  __m256i lo[kChunks], signs[Bits == 8 ? kChunks : 1];
  if constexpr (Bits == 4 || Bits == 6) {
    for (int j = 0; j < kChunks / 2; ++j) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 64 * j));
      lo[2 * j] = _mm256_and_si256(packed, low);
      lo[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
    }
  }
  if constexpr (Bits == 6) {
    // each code's high 2 bits to bits 4..5 and or-ed in, as the VNNI loops do (the 16-bit shifts move
    // bits across a byte's edge only into the bits the mask drops)
    const __m256i top = _mm256_set1_epi8(0x30);
    for (int h = 0; h < kChunks / 4; ++h) {
      const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 64 * (kChunks / 2) + 64 * h));
      lo[4 * h] = _mm256_or_si256(lo[4 * h], _mm256_and_si256(_mm256_slli_epi16(high, 4), top));
      lo[4 * h + 1] = _mm256_or_si256(lo[4 * h + 1], _mm256_and_si256(_mm256_slli_epi16(high, 2), top));
      lo[4 * h + 2] = _mm256_or_si256(lo[4 * h + 2], _mm256_and_si256(high, top));
      lo[4 * h + 3] = _mm256_or_si256(lo[4 * h + 3], _mm256_and_si256(_mm256_srli_epi16(high, 2), top));
    }
  } else if constexpr (Bits == 8) {
    const __m256i offset = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int j = 0; j < kChunks; ++j) {
      signs[j] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 64 * j)), offset);
      lo[j] = _mm256_sign_epi8(signs[j], signs[j]);  // -128 gives 0x80: 128 as the unsigned operand
    }
  }
  __m256 scale, bias;
  half_scales<Bits, SK, G>(t, g, half, &scale, &bias);
  const int8_t* qg = q + g * R * G;
  const float* dg = d + (g * G / kGroup) * R;
  const float* eg = e + g * R;
  const int32_t* sg = s + g * R;
  const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const int32_t* words = reinterpret_cast<const int32_t*>(qg + r * G);
    __m256i dot;
    if constexpr (Bits == 8) {
      dot = _mm256_set1_epi32(128 * sg[r]);
      for (int j = 0; j < kChunks; ++j) {
        const __m256i w = _mm256_sign_epi8(_mm256_set1_epi32(words[j]), signs[j]);
        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(lo[j], w), ones));
      }
    } else if constexpr (Bits == 6) {
      dot = _mm256_setzero_si256();
      for (int j = 0; j < kChunks; j += 2) {
        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo[j], _mm256_set1_epi32(words[j])),
                                               _mm256_maddubs_epi16(lo[j + 1], _mm256_set1_epi32(words[j + 1])));
        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, ones));
      }
    } else {
      __m256i sum = _mm256_setzero_si256();
      for (int j = 0; j < kChunks; ++j) sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(lo[j], _mm256_set1_epi32(words[j])));
      dot = _mm256_madd_epi16(sum, ones);
    }
    const __m256 scaled = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(dot));
    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dg[r]), scaled, acc[r]);
    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(eg[r]), bias, acc[r]);
  }
}

// A few rows take both halves of each group in turn (their 2 R sums fit the registers, and the codes are
// read once); more rows take one half of the tile over all its groups, then the other.
constexpr int kBothHalvesRows = 2;

template <int Bits, int SK, int G, int R>
void tile_rows(const uint8_t* codes, const TileScales& t, int64_t groups, const int8_t* q, const float* d,
               const float* e, const int32_t* s, float* y, int64_t y_stride) {
  if constexpr (R <= kBothHalvesRows) {
    __m256 acc[2][R];
    for (int half = 0; half < 2; ++half)
      for (int r = 0; r < R; ++r) acc[half][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      for (int half = 0; half < 2; ++half) half_group<Bits, SK, G, R>(codes, t, g, half, q, d, e, s, acc[half]);
    }
    for (int half = 0; half < 2; ++half)
      for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * y_stride + 8 * half, acc[half][r]);
  } else {
    for (int half = 0; half < 2; ++half) {
      __m256 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) half_group<Bits, SK, G, R>(codes, t, g, half, q, d, e, s, acc);
      for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * y_stride + 8 * half, acc[r]);
    }
  }
}
#else
template <int Bits, int SK, int G, int R>
void tile_rows(const uint8_t* codes, const TileScales& t, int64_t groups, const int8_t* q, const float* d,
               const float* e, [[maybe_unused]] const int32_t* s, float* y, int64_t y_stride) {
  constexpr int64_t kGroupBytes = kTile * G * Bits / 8;
  float acc[R][kTile] = {};
  uint8_t c[G / 4][64];  // 4 and 6 bits: c[2j] = low nibbles of chunk j (inputs 8j..8j+3), c[2j+1] = high
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* chunk = codes + g * kGroupBytes;
    for (int j = 0; j < G / 4; ++j) {
      for (int b = 0; b < 64; ++b) {
        if constexpr (Bits == 4) {
          c[j][b] = j % 2 == 0 ? chunk[64 * (j / 2) + b] & 0x0F : chunk[64 * (j / 2) + b] >> 4;
        } else if constexpr (Bits == 6) {
          const uint8_t nibbles = chunk[64 * (j / 2) + b], high = chunk[64 * (G / 8) + 64 * (j / 4) + b];
          c[j][b] = static_cast<uint8_t>((j % 2 == 0 ? nibbles & 0x0F : nibbles >> 4) |
                                         (((high >> (2 * (j % 4))) & 0x03) << 4));
        } else {
          c[j][b] = chunk[64 * j + b];
        }
      }
    }
    float scale[kTile], bias[kTile];
    group_scales<Bits, SK, G>(t, g, scale, bias);
    for (int r = 0; r < R; ++r) {
      const int8_t* qs = q + (g * R + r) * G;
      int32_t dot[kTile] = {0};
      for (int j = 0; j < G / 4; ++j) {
        for (int64_t i = 0; i < kTile; ++i) {
          for (int b = 0; b < 4; ++b) {
            dot[i] += static_cast<int32_t>(c[j][4 * i + b]) * static_cast<int32_t>(qs[4 * j + b]);
          }
        }
      }
      const float dr = d[(g * G / kGroup) * R + r], er = e[g * R + r];
      for (int64_t i = 0; i < kTile; ++i) {
        const float scaled = scale[i] * static_cast<float>(dot[i]);
        acc[r][i] = std::fma(dr, scaled, acc[r][i]);
        acc[r][i] = std::fma(er, bias[i], acc[r][i]);
      }
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(y + r * y_stride, acc[r], sizeof(acc[r]));
}
#endif

// x [rows, width] -> y [rows, outputs] for one layout: tiles in parallel, rows in blocks of 8.
template <int Bits, int SK, int G>
void product(const float* x, int64_t rows, int64_t width, const uint8_t* codes, const void* scales,
             const void* biases, const void* supers, int64_t outputs, float* y) {
  using TileRows = void (*)(const uint8_t*, const TileScales&, int64_t, const int8_t*, const float*,
                            const float*, const int32_t*, float*, int64_t);
  static constexpr TileRows kernels[kRowBlock] = {
      tile_rows<Bits, SK, G, 1>, tile_rows<Bits, SK, G, 2>, tile_rows<Bits, SK, G, 3>,
      tile_rows<Bits, SK, G, 4>, tile_rows<Bits, SK, G, 5>, tile_rows<Bits, SK, G, 6>,
      tile_rows<Bits, SK, G, 7>, tile_rows<Bits, SK, G, 8>};
  const int64_t groups = width / G;
  const int64_t tiles = outputs / kTile;
  constexpr int64_t f = kFactors<Bits>;
  // per tile: bytes of codes, of scales, of biases and of supers
  const int64_t code_bytes = groups * kTile * G * Bits / 8;
  const int64_t scale_bytes = groups * kTile * (SK == kFloat ? 4 : SK == kHalf ? 2 : f);
  const int64_t bias_bytes = Bits == 4 && !kBlocked<SK> ? scale_bytes : 0;
  const int64_t super_bytes = kBlocked<SK> ? (width / kSuper) * f * kTile * (SK == kBlockHalf ? 2 : 4) : 0;
  Rows by_row, blocked;
  quantize_rows(x, rows, width, G, by_row);
  if (rows > 1) interleave_rows(rows, width, G, by_row, blocked);
  const Rows& quantized = rows > 1 ? blocked : by_row;
#pragma omp parallel for schedule(static)
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const TileScales t{static_cast<const uint8_t*>(scales) + tile * scale_bytes,
                       biases == nullptr ? nullptr : static_cast<const uint8_t*>(biases) + tile * bias_bytes,
                       supers == nullptr ? nullptr : static_cast<const uint8_t*>(supers) + tile * super_bytes};
    for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock) {
      const int64_t block = std::min<int64_t>(kRowBlock, rows - m0);
      kernels[block - 1](codes + tile * code_bytes, t, groups, quantized.q.data() + m0 * width,
                         quantized.d.data() + m0 * (width / kGroup), quantized.e.data() + m0 * groups,
                         quantized.s.data() + m0 * groups, y + m0 * outputs + tile * kTile, outputs);
    }
  }
}

}  // namespace

extern "C" {

// The path this build took: 2 AVX512-VNNI, 1 AVX2, 0 portable.
int specserve_dot_path() { return SPECSERVE_VNNI ? 2 : SPECSERVE_AVX2; }

// x [rows, width] float32 -> y [rows, outputs] float32 on a packed weight: `bits` 4, 6 or 8, `group`
// its inputs per group (4 bits: 32; 6 and 8 bits: 16 or 32), `kind` 0 (kFloat), 1 (kBlock; width a
// multiple of 256), 2 (kHalf) or 3 (kBlockHalf, as kBlock); outputs a multiple of 16, width of 32.
// Unused pointers may be null. Returns 0, or -1 for a combination no kernel takes.
int specserve_dot_mm(const float* x, int64_t rows, int64_t width, int64_t bits, int64_t group, int64_t kind,
                     const uint8_t* codes, const void* scales, const void* biases, const void* supers,
                     int64_t outputs, float* y) {
  const auto run = [&](auto kernel) { kernel(x, rows, width, codes, scales, biases, supers, outputs, y); };
  if (bits == 4 && group == 32 && kind == kFloat) return run(product<4, kFloat, 32>), 0;
  if (bits == 4 && group == 32 && kind == kBlock) return run(product<4, kBlock, 32>), 0;
  if (bits == 4 && group == 32 && kind == kBlockHalf) return run(product<4, kBlockHalf, 32>), 0;
  if (bits == 4 && group == 32 && kind == kHalf) return run(product<4, kHalf, 32>), 0;
  if (bits == 6 && group == 32 && kind == kFloat) return run(product<6, kFloat, 32>), 0;
  if (bits == 6 && group == 16 && kind == kFloat) return run(product<6, kFloat, 16>), 0;
  if (bits == 6 && group == 32 && kind == kHalf) return run(product<6, kHalf, 32>), 0;
  if (bits == 6 && group == 16 && kind == kHalf) return run(product<6, kHalf, 16>), 0;
  if (bits == 6 && group == 32 && kind == kBlock) return run(product<6, kBlock, 32>), 0;
  if (bits == 6 && group == 32 && kind == kBlockHalf) return run(product<6, kBlockHalf, 32>), 0;
  if (bits == 6 && group == 16 && kind == kBlock) return run(product<6, kBlock, 16>), 0;
  if (bits == 6 && group == 16 && kind == kBlockHalf) return run(product<6, kBlockHalf, 16>), 0;
  if (bits == 8 && group == 32 && kind == kFloat) return run(product<8, kFloat, 32>), 0;
  if (bits == 8 && group == 16 && kind == kFloat) return run(product<8, kFloat, 16>), 0;
  if (bits == 8 && group == 32 && kind == kHalf) return run(product<8, kHalf, 32>), 0;
  if (bits == 8 && group == 16 && kind == kHalf) return run(product<8, kHalf, 16>), 0;
  if (bits == 8 && group == 32 && kind == kBlock) return run(product<8, kBlock, 32>), 0;
  if (bits == 8 && group == 32 && kind == kBlockHalf) return run(product<8, kBlockHalf, 32>), 0;
  if (bits == 8 && group == 16 && kind == kBlock) return run(product<8, kBlock, 16>), 0;
  if (bits == 8 && group == 16 && kind == kBlockHalf) return run(product<8, kBlockHalf, 16>), 0;
  return -1;
}

}  // extern "C"
