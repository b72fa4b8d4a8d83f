// Attention for a decode step over the paged KV pool, in one call per layer.
//
// Each row of the batch has one new token: its key and value go into the pool at the row's
// slot, then its query attends over the row's first `lengths[b]` positions, found block by
// block through its table. The work is small (a few thousand multiply-adds per head), so what
// a decode step pays for attention on a CPU is mostly the operators around it: a gather of
// every row's blocks into one tensor, a mask, a fused attention call, each dispatched from
// Python. Here it is one operator that reads the keys and values where they lie, and that a
// compiled step calls directly. Threads split the (row, head) pairs; sums are fp32 for fp32
// and bf16 pools alike.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using bf16 = c10::BFloat16;

inline float as_float(float v) { return v; }
inline float as_float(bf16 v) { return static_cast<float>(v); }

// The two loops over a head's D numbers, compiled once per instruction set and picked when the
// library loads (GCC's function multiversioning), so one build runs on any x86-64 and uses
// AVX-512 where it is there. `omp simd` lets the compiler reorder the sum into vector lanes.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

CLONES float dot(const float* q, const float* k, int64_t d) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += q[i] * k[i];
  return s;
}

CLONES float dot(const float* q, const bf16* k, int64_t d) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += q[i] * as_float(k[i]);
  return s;
}

CLONES void add_scaled(float* sums, float p, const float* v, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) sums[i] += p * v[i];
}

CLONES void add_scaled(float* sums, float p, const bf16* v, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) sums[i] += p * as_float(v[i]);
}

// q: [B, H, D] rows (contiguous); k, v: the rows' new keys and values, written at `slots` first
// (or null: already in the pool); k_layer, v_layer: one layer of the pool, [slots, H, D].
template <typename T>
void attend(const T* q, const T* k, const T* v, T* k_layer, T* v_layer, const int64_t* slots, const int64_t* tables,
            int64_t width, const int64_t* lengths, int64_t B, int64_t H, int64_t D, int64_t block_size, T* out) {
  if (k != nullptr)  // the new tokens first: each row attends to its own
    for (int64_t b = 0; b < B; ++b) {
      std::copy(k + b * H * D, k + (b + 1) * H * D, k_layer + slots[b] * H * D);
      std::copy(v + b * H * D, v + (b + 1) * H * D, v_layer + slots[b] * H * D);
    }
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(D), sums(D), scores;
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H, n = lengths[b];
      const auto slot = [&](int64_t t) { return tables[b * width + t / block_size] * block_size + t % block_size; };
      for (int64_t i = 0; i < D; ++i) query[i] = as_float(q[bh * D + i]) * scale;
      scores.resize(n);
      float top = -INFINITY;
      for (int64_t t = 0; t < n; ++t) {
        scores[t] = dot(query.data(), k_layer + (slot(t) * H + h) * D, D);
        top = std::max(top, scores[t]);
      }
      float total = 0.0f;
      std::fill(sums.begin(), sums.end(), 0.0f);
      for (int64_t t = 0; t < n; ++t) {
        const float p = std::exp(scores[t] - top);
        total += p;
        add_scaled(sums.data(), p, v_layer + (slot(t) * H + h) * D, D);
      }
      for (int64_t i = 0; i < D; ++i) out[bh * D + i] = T(sums[i] / total);
    }
  });
}

template <typename T>
const T* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

// q: [B, H, D] (any strides), one query per row; k_pool, v_pool: [layers, blocks, block_size, H,
// D], contiguous; tables [B, W] block ids; lengths [B], each row's positions, the new one
// included. k and v ([B, H, D]), if given, are written at `slots` [B] before anything is read.
// Returns [B, H, D], contiguous.
at::Tensor decode_attention(const at::Tensor& q, at::Tensor& k_pool, at::Tensor& v_pool, int64_t layer,
                            const at::Tensor& tables, const at::Tensor& lengths, const std::optional<at::Tensor>& k,
                            const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& slots) {
  TORCH_CHECK(q.dim() == 3, "decode_attention: q must be [rows, heads, head_dim]");
  TORCH_CHECK(k_pool.dim() == 5 && k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.sizes() == v_pool.sizes(),
              "decode_attention: the pools must be contiguous [layers, blocks, block_size, heads, head_dim]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), block_size = k_pool.size(2);
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "decode_attention: float32 or bfloat16, not ", dtype);
  TORCH_CHECK(k_pool.size(3) == H && k_pool.size(4) == D && k_pool.scalar_type() == dtype &&
                  v_pool.scalar_type() == dtype, "decode_attention: the pools' heads, head_dim or dtype are not q's");
  TORCH_CHECK(0 <= layer && layer < k_pool.size(0), "decode_attention: no layer ", layer);
  TORCH_CHECK(lengths.numel() == B && tables.dim() == 2 && tables.size(0) == B,
              "decode_attention: lengths and tables need one row per query");
  const bool write = k.has_value() && k->defined();
  TORCH_CHECK(write == (v.has_value() && v->defined()) && write == (slots.has_value() && slots->defined()),
              "decode_attention: k, v and slots come together or not at all");
  at::Tensor kr, vr, sl;
  if (write) {
    TORCH_CHECK(k->sizes() == q.sizes() && v->sizes() == q.sizes() && k->scalar_type() == dtype &&
                    v->scalar_type() == dtype && slots->numel() == B,
                "decode_attention: k and v must be q's shape and dtype, with one slot per row");
    kr = k->contiguous(), vr = v->contiguous(), sl = slots->to(at::kLong).contiguous();
  }
  const at::Tensor qr = q.contiguous(), tb = tables.to(at::kLong).contiguous(), ln = lengths.to(at::kLong).contiguous();
  at::Tensor out = at::empty({B, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t per_layer = k_pool.size(1) * block_size * H * D;
  const auto run = [&](auto zero) {  // zero: a value of the element type
    using T = decltype(zero);
    attend<T>(qr.data_ptr<T>(), data_or_null<T>(kr), data_or_null<T>(vr), k_pool.data_ptr<T>() + layer * per_layer,
              v_pool.data_ptr<T>() + layer * per_layer, write ? sl.data_ptr<int64_t>() : nullptr,
              tb.data_ptr<int64_t>(), tb.size(1), ln.data_ptr<int64_t>(), B, H, D, block_size, out.data_ptr<T>());
  };
  if (dtype == at::kFloat)
    run(float{});
  else
    run(bf16{});
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minillm, m) {
  m.def("decode_attention(Tensor q, Tensor(a!) k_pool, Tensor(b!) v_pool, int layer, Tensor tables, "
        "Tensor lengths, Tensor? k=None, Tensor? v=None, Tensor? slots=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(minillm, CPU, m) { m.impl("decode_attention", &decode_attention); }
