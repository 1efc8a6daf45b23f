// Products of float32 rows with a GGUF file's weights, one pass over the weights for all rows: 4-bit
// codes in groups of 32 (Q4_0, Q4_1, Q4_K) and 8-bit codes in groups of 16 or 32 (Q8_0, Q5_0, Q6_K;
// `specserve_int8_dot_mm` below).
//
// A weight is w[n, k] = (code - 8) * scale[n, g] + zero[n, g] = code * scale + bias, bias = zero - 8 * scale
// (g = k / 32). A row is quantized per group of 32 inputs: d = amax / 127, q = nearbyint(x * 127 / amax),
// e = d * sum(q). Then, per output lane, over the groups in order:
//   acc = fma(d, scale * dot, acc);  acc = fma(e, bias, acc);   dot = sum_k code[n, k] * q[k] (integers).
//
// Every integer sum is exact, so any order or vector width gives the same value; the float terms of a
// row are formed lane by lane and added over the groups in order. A row's output therefore does not
// depend on how many rows share the call, nor on which path below computes it (the AVX512-VNNI path and
// the portable one give the same bits): a tree's rows equal the same tokens decoded one at a time.
// Build with -ffp-contract=off: the compiler must not fuse the product `scale * dot` into the add that
// follows on one path and not on the other.
//
// Weight layout (specserve/runtime/int4_dot.py packs it): tiles of 16 outputs; per tile and group,
// 4 chunks of 64 bytes; byte 4i+j of chunk c holds the codes of output i at inputs 8c+j (low nibble)
// and 8c+4+j (high nibble). Scales and biases: [tiles][groups][16] float32.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define SPECSERVE_VNNI 1
#else
#define SPECSERVE_VNNI 0
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kTile = 16;
constexpr int64_t kTileBytes = kTile * kGroup / 2;  // 256 bytes of codes per tile and group
// Bytes ahead of the weights being read that the VNNI loops ask the memory for: with several rows a
// tile's arithmetic hides the hardware prefetcher's latency poorly (measured: 8 rows of a 4-bit product
// out of cache 0.65-0.7x the time without it, one row unchanged).
constexpr int64_t kPrefetch = 2048;
constexpr int kRowBlock = 8;                        // rows whose sums stay in registers over a tile

// One row's quantization: q [W] int8, per group of 32 the scale d, and per group of `egroup` (the
// weight's group: 16 or 32) e = d * sum(q) over it.
void quantize_row(const float* x, int64_t width, int64_t egroup, int8_t* q, float* d, float* e) {
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
    e[g] = d[g * egroup / kGroup] * static_cast<float>(sum);
  }
}

// Every row of x quantized (in parallel when there are enough of them to pay for it).
void quantize_rows(const float* x, int64_t rows, int64_t width, int64_t egroup, std::vector<int8_t>& q,
                   std::vector<float>& d, std::vector<float>& e) {
  const int64_t groups = width / kGroup, egroups = width / egroup;
  q.resize(static_cast<size_t>(rows * width));
  d.resize(static_cast<size_t>(rows * groups));
  e.resize(static_cast<size_t>(rows * egroups));
#pragma omp parallel for schedule(static) if (rows * width > 65536)  // a parallel region costs more than a few rows
  for (int64_t m = 0; m < rows; ++m) {
    quantize_row(x + m * width, width, egroup, q.data() + m * width, d.data() + m * groups, e.data() + m * egroups);
  }
}

// Per group, for each output lane:  acc = fma(d, scale * dot, acc);  acc = fma(e, bias, acc)
// with bias = zero - 8 * scale (the code's offset folded into the zero), on both paths alike.
#if SPECSERVE_VNNI
template <int R>
void tile_rows(const uint8_t* codes, const float* scales, const float* biases, int64_t groups,
               const int8_t* q, const float* d, const float* e, int64_t width, float* y, int64_t y_stride) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* chunk = codes + g * kTileBytes;
    for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(chunk + kPrefetch + 64 * j), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(scales + g * kTile + kPrefetch / 4), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(biases + g * kTile + kPrefetch / 4), _MM_HINT_T0);
    __m512i c[8];
    for (int j = 0; j < 4; ++j) {
      const __m512i packed = _mm512_loadu_si512(chunk + 64 * j);
      c[2 * j] = _mm512_and_si512(packed, low);
      c[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
    }
    const __m512 scale = _mm512_loadu_ps(scales + g * kTile);
    const __m512 bias = _mm512_loadu_ps(biases + g * kTile);
    for (int r = 0; r < R; ++r) {
      const int32_t* words = reinterpret_cast<const int32_t*>(q + r * width + g * kGroup);
      __m512i dot = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) dot = _mm512_dpbusd_epi32(dot, c[j], _mm512_set1_epi32(words[j]));
      const __m512 scaled = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(dot));
      const int64_t at = r * (width / kGroup) + g;
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d[at]), scaled, acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(e[at]), bias, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * y_stride, acc[r]);
}
#else
template <int R>
void tile_rows(const uint8_t* codes, const float* scales, const float* biases, int64_t groups,
               const int8_t* q, const float* d, const float* e, int64_t width, float* y, int64_t y_stride) {
  float acc[R][kTile] = {};
  uint8_t c[8][64];  // c[2j] = low nibbles of chunk j (inputs 8j..8j+3), c[2j+1] = high (8j+4..8j+7)
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* chunk = codes + g * kTileBytes;
    for (int j = 0; j < 4; ++j) {
      for (int b = 0; b < 64; ++b) {
        c[2 * j][b] = chunk[64 * j + b] & 0x0F;
        c[2 * j + 1][b] = chunk[64 * j + b] >> 4;
      }
    }
    const float* scale = scales + g * kTile;
    const float* bias = biases + g * kTile;
    for (int r = 0; r < R; ++r) {
      const int8_t* qs = q + r * width + g * kGroup;
      int32_t dot[kTile] = {0};
      for (int j = 0; j < 8; ++j) {
        for (int64_t i = 0; i < kTile; ++i) {
          for (int b = 0; b < 4; ++b) {
            dot[i] += static_cast<int32_t>(c[j][4 * i + b]) * static_cast<int32_t>(qs[4 * j + b]);
          }
        }
      }
      const int64_t at = r * (width / kGroup) + g;
      for (int64_t i = 0; i < kTile; ++i) {
        const float scaled = scale[i] * static_cast<float>(dot[i]);
        acc[r][i] = std::fma(d[at], scaled, acc[r][i]);
        acc[r][i] = std::fma(e[at], bias[i], acc[r][i]);
      }
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(y + r * y_stride, acc[r], sizeof(acc[r]));
}
#endif

// 8-bit weights: w[n, k] = (code - 128) * scale[n, g] with code = q + 128 for the file's signed q
// (Q8_0, Q5_0, Q6_K), groups of G = 16 or 32 inputs. Per group and output lane, as above with
// bias = -128 * scale (exact: a power of two):  acc = fma(d, scale * dot, acc);  acc = fma(e, bias, acc).
// Layout: tiles of 16 outputs; per tile and group, G / 4 chunks of 64 bytes; byte 4i+j of chunk c holds
// output i's code at input 4c+j of the group. Scales: [tiles][groups][16] float32.
constexpr float kOffset = 128.0f;

#if SPECSERVE_VNNI
template <int G, int R>
void tile_rows8(const uint8_t* codes, const float* scales, int64_t groups, const int8_t* q, const float* d,
                const float* e, int64_t width, float* y, int64_t y_stride) {
  constexpr int kChunks = G / 4;
  const __m512 minus_offset = _mm512_set1_ps(-kOffset);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* chunk = codes + g * kTile * G;
    for (int j = 0; j < kChunks; ++j) _mm_prefetch(reinterpret_cast<const char*>(chunk + kPrefetch + 64 * j), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(scales + g * kTile + kPrefetch / 4), _MM_HINT_T0);
    __m512i c[kChunks];
    for (int j = 0; j < kChunks; ++j) c[j] = _mm512_loadu_si512(chunk + 64 * j);
    const __m512 scale = _mm512_loadu_ps(scales + g * kTile);
    const __m512 bias = _mm512_mul_ps(scale, minus_offset);
    for (int r = 0; r < R; ++r) {
      const int32_t* words = reinterpret_cast<const int32_t*>(q + r * width + g * G);
      __m512i dot = _mm512_setzero_si512();
      for (int j = 0; j < kChunks; ++j) dot = _mm512_dpbusd_epi32(dot, c[j], _mm512_set1_epi32(words[j]));
      const __m512 scaled = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(dot));
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d[r * (width / kGroup) + g * G / kGroup]), scaled, acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(e[r * (width / G) + g]), bias, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * y_stride, acc[r]);
}
#else
template <int G, int R>
void tile_rows8(const uint8_t* codes, const float* scales, int64_t groups, const int8_t* q, const float* d,
                const float* e, int64_t width, float* y, int64_t y_stride) {
  float acc[R][kTile] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* chunk = codes + g * kTile * G;
    const float* scale = scales + g * kTile;
    for (int r = 0; r < R; ++r) {
      const int8_t* qs = q + r * width + g * G;
      int32_t dot[kTile] = {0};
      for (int j = 0; j < G / 4; ++j) {
        for (int64_t i = 0; i < kTile; ++i) {
          for (int b = 0; b < 4; ++b) {
            dot[i] += static_cast<int32_t>(chunk[64 * j + 4 * i + b]) * static_cast<int32_t>(qs[4 * j + b]);
          }
        }
      }
      const float dr = d[r * (width / kGroup) + g * G / kGroup], er = e[r * (width / G) + g];
      for (int64_t i = 0; i < kTile; ++i) {
        const float scaled = scale[i] * static_cast<float>(dot[i]);
        acc[r][i] = std::fma(dr, scaled, acc[r][i]);
        acc[r][i] = std::fma(er, scale[i] * -kOffset, acc[r][i]);
      }
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(y + r * y_stride, acc[r], sizeof(acc[r]));
}
#endif

using TileRows8 = void (*)(const uint8_t*, const float*, int64_t, const int8_t*, const float*, const float*,
                           int64_t, float*, int64_t);
template <int G>
constexpr TileRows8 kTileRows8[kRowBlock] = {tile_rows8<G, 1>, tile_rows8<G, 2>, tile_rows8<G, 3>,
                                             tile_rows8<G, 4>, tile_rows8<G, 5>, tile_rows8<G, 6>,
                                             tile_rows8<G, 7>, tile_rows8<G, 8>};

using TileRows = void (*)(const uint8_t*, const float*, const float*, int64_t, const int8_t*, const float*,
                          const float*, int64_t, float*, int64_t);
constexpr TileRows kTileRows[kRowBlock] = {tile_rows<1>, tile_rows<2>, tile_rows<3>, tile_rows<4>,
                                           tile_rows<5>, tile_rows<6>, tile_rows<7>, tile_rows<8>};

}  // namespace

extern "C" {

// 1 when this build took the AVX512-VNNI path, 0 for the portable one.
int specserve_int4_dot_vnni() { return SPECSERVE_VNNI; }

// x [rows, width] float32 -> y [rows, outputs] float32; outputs a multiple of 16, width of 32.
// biases = zero - 8 * scale per output and group, in the scales' layout.
void specserve_int4_dot_mm(const float* x, int64_t rows, int64_t width, const uint8_t* codes,
                           const float* scales, const float* biases, int64_t outputs, float* y) {
  const int64_t groups = width / kGroup;
  const int64_t tiles = outputs / kTile;
  std::vector<int8_t> q;
  std::vector<float> d, e;
  quantize_rows(x, rows, width, kGroup, q, d, e);
#pragma omp parallel for schedule(static)
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const uint8_t* tile_codes = codes + tile * groups * kTileBytes;
    const float* tile_scales = scales + tile * groups * kTile;
    const float* tile_biases = biases + tile * groups * kTile;
    for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock) {
      const int64_t block = std::min<int64_t>(kRowBlock, rows - m0);
      kTileRows[block - 1](tile_codes, tile_scales, tile_biases, groups, q.data() + m0 * width,
                           d.data() + m0 * groups, e.data() + m0 * groups, width, y + m0 * outputs + tile * kTile,
                           outputs);
    }
  }
}

// x [rows, width] float32 -> y [rows, outputs] float32 on 8-bit weights in groups of `group` (16 or 32);
// outputs a multiple of 16, width of 32.
void specserve_int8_dot_mm(const float* x, int64_t rows, int64_t width, const uint8_t* codes,
                           const float* scales, int64_t group, int64_t outputs, float* y) {
  const int64_t groups = width / group;
  const int64_t tiles = outputs / kTile;
  std::vector<int8_t> q;
  std::vector<float> d, e;
  quantize_rows(x, rows, width, group, q, d, e);
  const TileRows8* kernels = group == 16 ? kTileRows8<16> : kTileRows8<32>;
#pragma omp parallel for schedule(static)
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const uint8_t* tile_codes = codes + tile * groups * kTile * group;
    const float* tile_scales = scales + tile * groups * kTile;
    for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock) {
      const int64_t block = std::min<int64_t>(kRowBlock, rows - m0);
      kernels[block - 1](tile_codes, tile_scales, groups, q.data() + m0 * width, d.data() + m0 * (width / kGroup),
                         e.data() + m0 * groups, width, y + m0 * outputs + tile * kTile, outputs);
    }
  }
}

}  // extern "C"
