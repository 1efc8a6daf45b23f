// A Llama-family decoder's layers over a ragged batch in one call: per layer an RMSNorm, the q/k/v
// product, rotary, each segment's K/V written into its cache and attended there, the o product, an
// RMSNorm, the gate/up product, SiLU, the down product, with the residual adds. The products and the
// attention are the library's own (int4_dot.cpp, attention.cpp); between them everything is per row
// and per element, so a row's values still do not depend on the rows beside it. What it saves is the
// per-layer Python and the dozen small tensor ops a layer otherwise costs (most of a one-token step of
// a small model once the weights are 4-bit).
//
// The structs mirror specserve/runtime/fused_layers.py (ctypes); the Python side owns every buffer.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

extern "C" int specserve_dot_mm(const float* x, int64_t rows, int64_t width, int64_t bits, int64_t group,
                                int64_t kind, const uint8_t* codes, const void* scales, const void* biases,
                                const void* supers, int64_t outputs, float* y);
extern "C" void specserve_attend(const float* q, int64_t rows, int64_t heads, int64_t d, int64_t q_row,
                                 int64_t q_head, const float* keys, const float* values, int64_t kv_heads,
                                 int64_t length, int64_t kv_head, int64_t kv_pos, const uint8_t* visible,
                                 float scale, float* out);

extern "C" void specserve_exp_shifted(float* values, int64_t count, float shift);

extern "C" {

struct SpecserveProduct {
  const uint8_t* codes;   // int4_dot.cpp's layouts: 4 bits (of the widened weight), 6 or 8
  const void* scales;
  const void* biases;     // 4 bits, float or fp16 scales: per-group biases (zero - 8 * scale); else null
  const void* supers;     // block scales: the superblocks' factors (float32 or fp16); else null
  const float* bias;      // [out_features] added to the output, or null
  int64_t outputs;        // the layout's outputs (a multiple of 16)
  int64_t out_features;   // the real ones
  int64_t in_features;    // before widening
  int64_t parts;          // the input repeated once per part
  int64_t group;          // 32, or 16 (4 bits: each group padded with 16 zero inputs)
  int64_t bits;           // 4, 6 or 8
  int64_t kind;           // the scales' layout: 0 float per group, 1 block (int8 per group, float per 256),
                          // 2 fp16 per group
};

// Projections of one input: one product whose outputs are theirs side by side, or one product each
// (where their formats differ: a Q6_K v beside Q4_K q and k).
struct SpecserveProducts {
  SpecserveProduct part[3];
  int64_t count;
};

struct SpecserveLayer {
  SpecserveProducts qkv, gate_up;
  SpecserveProduct o, down;
  const float* input_norm;      // [hidden]
  const float* post_norm;       // [hidden]
  float input_eps, post_eps;
};

struct SpecserveSegment {
  int64_t lo, hi;               // its rows in the batch
  int64_t start;                // its cache's length before this forward: its K/V land at start + i
  const uint8_t* visible;       // [hi - lo, start + hi - lo], 1 = attended; null = every position
};

struct SpecserveForward {
  float* hidden;                // [rows, hidden_size], updated in place
  int64_t rows, hidden_size, heads, kv_heads, head_dim, intermediate;
  float scale;                  // attention's
  const float* cos;             // [rows, head_dim]
  const float* sin_signed;      // [rows, head_dim]: sin with its first half negated (rotate_half's sign)
  int64_t segments;
  const SpecserveSegment* segment;
  float* const* keys;           // [layers * segments]: layer l, segment s at l * segments + s
  float* const* values;
  const int64_t* kv_head_stride;  // [layers * segments]
  const int64_t* kv_pos_stride;
  float* const* layer_outputs;  // [layers]: where a layer's output is copied, or null
};

}  // extern "C"

namespace {

constexpr int64_t kSiluPiece = 2048;  // SiLU's elements a task (a multiple of exp_shifted's 16 lanes)

void rms_norm(const float* x, const float* weight, float eps, int64_t rows, int64_t size, float* out) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* row = x + i * size;
    float lanes[16] = {};
    int64_t t = 0;
    for (; t + 16 <= size; t += 16) {
      for (int l = 0; l < 16; ++l) lanes[l] += row[t + l] * row[t + l];
    }
    for (int l = 0; t + l < size; ++l) lanes[l] += row[t + l] * row[t + l];
    for (int width = 8; width >= 1; width /= 2) {
      for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
    }
    const float inverse = 1.0f / std::sqrt(lanes[0] / static_cast<float>(size) + eps);
    for (int64_t k = 0; k < size; ++k) out[i * size + k] = weight[k] * (row[k] * inverse);
  }
}

// A buffer of at least n values. It never shrinks: a vector grown back after shrinking fills the new
// part with zeros, and the layers' buffers change size several times a layer (a profile of an 8-row
// forward found 3% of its samples in those fills).
float* at_least(std::vector<float>& buffer, int64_t n) {
  if (buffer.size() < static_cast<size_t>(n)) buffer.resize(static_cast<size_t>(n));
  return buffer.data();
}

// x [rows, in_features] -> y [rows, outputs] (the first out_features meaningful), bias added.
void product(const SpecserveProduct& p, const float* x, int64_t rows, std::vector<float>& wide, float* y) {
  const float* input = x;
  int64_t width = p.in_features;
  if (p.bits == 4 && (p.parts != 1 || p.group != 32)) {  // 4-bit parts over groups of 32: widen the input
    const int64_t groups = p.in_features / p.group;
    width = p.parts * groups * 32;
    wide.assign(static_cast<size_t>(rows * width), 0.0f);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t part = 0; part < p.parts; ++part) {
        for (int64_t g = 0; g < groups; ++g) {
          std::memcpy(&wide[i * width + (part * groups + g) * 32], x + i * p.in_features + g * p.group,
                      p.group * sizeof(float));
        }
      }
    }
    input = wide.data();
  }
  const int64_t group = p.bits == 4 ? 32 : p.group;
  specserve_dot_mm(input, rows, width, p.bits, group, p.kind, p.codes, p.scales, p.biases, p.supers, p.outputs, y);
  if (p.bias != nullptr) {
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t n = 0; n < p.out_features; ++n) y[i * p.outputs + n] += p.bias[n];
    }
  }
}

// The row stride of `products`' output: the one product's, or their real outputs side by side.
int64_t stride_of(const SpecserveProducts& ps) {
  if (ps.count == 1) return ps.part[0].outputs;
  int64_t stride = 0;
  for (int64_t j = 0; j < ps.count; ++j) stride += ps.part[j].out_features;
  return stride;
}

// x [rows, in] -> y [rows, stride_of(ps)]: each projection's outputs after the ones before it.
void products(const SpecserveProducts& ps, const float* x, int64_t rows, std::vector<float>& wide,
              std::vector<float>& apart, float* y) {
  if (ps.count == 1) {
    product(ps.part[0], x, rows, wide, y);
    return;
  }
  const int64_t stride = stride_of(ps);
  int64_t column = 0;
  for (int64_t j = 0; j < ps.count; ++j) {
    const SpecserveProduct& p = ps.part[j];
    float* part = at_least(apart, rows * p.outputs);
    product(p, x, rows, wide, part);
    for (int64_t i = 0; i < rows; ++i) {
      std::memcpy(y + i * stride + column, part + i * p.outputs, p.out_features * sizeof(float));
    }
    column += p.out_features;
  }
}

// x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1): the sign sits in sin_signed.
void rotate(float* head, const float* cos, const float* sin_signed, int64_t d, float* swapped) {
  const int64_t half = d / 2;
  for (int64_t t = 0; t < d; ++t) swapped[t] = head[t < half ? t + half : t - half];
  for (int64_t t = 0; t < d; ++t) head[t] = head[t] * cos[t] + swapped[t] * sin_signed[t];
}

}  // namespace

extern "C" void specserve_forward_layers(const SpecserveLayer* layers, int64_t count, const SpecserveForward* f) {
  const int64_t rows = f->rows, size = f->hidden_size, d = f->head_dim;
  const int64_t q_width = f->heads * d, kv_width = f->kv_heads * d;
  std::vector<float> x(static_cast<size_t>(rows * std::max(size, f->intermediate)));
  std::vector<float> wide, apart, swapped(static_cast<size_t>(d));
  std::vector<float> attended(static_cast<size_t>(rows * q_width));
  std::vector<float> out;
  for (int64_t l = 0; l < count; ++l) {
    const SpecserveLayer& layer = layers[l];
    rms_norm(f->hidden, layer.input_norm, layer.input_eps, rows, size, x.data());
    const int64_t stride = stride_of(layer.qkv);  // q, k, v side by side in each row
    at_least(out, rows * stride);
    products(layer.qkv, x.data(), rows, wide, apart, out.data());
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t h = 0; h < f->heads + f->kv_heads; ++h) {
        rotate(&out[i * stride + h * d], f->cos + i * d, f->sin_signed + i * d, d, swapped.data());
      }
    }
    for (int64_t s = 0; s < f->segments; ++s) {
      const SpecserveSegment& seg = f->segment[s];
      const int64_t at = l * f->segments + s;
      float* keys = f->keys[at];
      float* values = f->values[at];
      const int64_t head_stride = f->kv_head_stride[at], pos_stride = f->kv_pos_stride[at];
      for (int64_t i = seg.lo; i < seg.hi; ++i) {
        const int64_t position = seg.start + (i - seg.lo);
        for (int64_t h = 0; h < f->kv_heads; ++h) {
          std::memcpy(keys + h * head_stride + position * pos_stride, &out[i * stride + q_width + h * d],
                      d * sizeof(float));
          std::memcpy(values + h * head_stride + position * pos_stride,
                      &out[i * stride + q_width + kv_width + h * d], d * sizeof(float));
        }
      }
      const int64_t n = seg.hi - seg.lo;
      specserve_attend(&out[seg.lo * stride], n, f->heads, d, stride, d, keys, values, f->kv_heads, seg.start + n,
                       head_stride, pos_stride, seg.visible, f->scale, &attended[seg.lo * q_width]);
    }
    at_least(out, rows * layer.o.outputs);
    product(layer.o, attended.data(), rows, wide, out.data());
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t k = 0; k < size; ++k) f->hidden[i * size + k] += out[i * layer.o.outputs + k];
    }
    rms_norm(f->hidden, layer.post_norm, layer.post_eps, rows, size, x.data());
    const int64_t gate_up_stride = stride_of(layer.gate_up);
    at_least(out, rows * gate_up_stride);
    products(layer.gate_up, x.data(), rows, wide, apart, out.data());
    const int64_t inner = f->intermediate;
    // SiLU(gate) * up = gate / (1 + exp(-gate)) * up, element by element (exp_shifted computes every lane
    // alike), so its pieces may go to the threads: run by one, a tree's or a prompt's rows were a serial
    // pass the other thread waited out (docs/benchmarks.md, "Where a tree's rows go").
    const int64_t pieces = (inner + kSiluPiece - 1) / kSiluPiece;
#pragma omp parallel for schedule(static) if (rows * inner >= 2 * kSiluPiece)
    for (int64_t task = 0; task < rows * pieces; ++task) {
      const int64_t i = task / pieces, lo = (task % pieces) * kSiluPiece, n = std::min(kSiluPiece, inner - lo);
      const float* gate = &out[i * gate_up_stride + lo];
      const float* up = gate + inner;
      float* act = &x[i * inner + lo];
      for (int64_t k = 0; k < n; ++k) act[k] = -gate[k];
      specserve_exp_shifted(act, n, 0.0f);
      for (int64_t k = 0; k < n; ++k) act[k] = (gate[k] / (1.0f + act[k])) * up[k];
    }
    at_least(out, rows * layer.down.outputs);
    product(layer.down, x.data(), rows, wide, out.data());
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t k = 0; k < size; ++k) f->hidden[i * size + k] += out[i * layer.down.outputs + k];
    }
    if (f->layer_outputs != nullptr && f->layer_outputs[l] != nullptr) {
      std::memcpy(f->layer_outputs[l], f->hidden, rows * size * sizeof(float));
    }
  }
}
