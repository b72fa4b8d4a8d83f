// The small-batch linear: y = x @ W.T (+ b) for a few rows of x, reading W once.
//
// At decoding's batch sizes a product's time is the time to read its weight. This kernel
// streams each weight row once from memory and multiplies it into every row of x while it sits
// in registers (or, for later groups of rows, in L1): a tile of R weight rows against G
// rows of x keeps R x G dot products in R x G vector accumulators, and a block of R weight rows
// meets the rows of x G at a time. Threads split the weight's rows (at::parallel_for), so each
// reads its own slab once.
//
// Three paths, chosen at run time by what the CPU has, each compiled for its own instructions
// (target attributes), so one build runs on any x86-64:
//   avx512  fp32: 16-lane FMA; bf16: _mm512_dpbf16_ps on pairs of bf16 (AVX512-BF16), fp32 sums
//   avx2    fp32: 8-lane FMA; bf16: widened to fp32 (a shift), then FMA
//   scalar  plain loops, for any CPU (and any other architecture)
// Every path sums in fp32 and rounds the result once to the output's dtype.
//
// int8 weights (one fp32 scale per output row, as chapter 13 stores them) take the same tiles:
// each 16 (or 8) int8 weights are widened to fp32 in registers and multiplied into fp32 rows of
// x; a row's sums are scaled once at the end. The weight is read as int8, a quarter of fp32's
// bytes, so at few rows the product is four times shorter than fp32's.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MINILLM_X86 1
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))
#define AVX2 __attribute__((target("avx2,fma")))
#endif

// Loops over a tile's R x G accumulators are unrolled before the compiler decides where the
// accumulators live: left as loops, GCC keeps them in a stack array and stores all of them on
// every step of k (16 stores of 64 bytes per 16 FMAs), which made the tile several times slower.
#define UNROLL _Pragma("GCC unroll 16")

namespace {

using bf16 = c10::BFloat16;

inline float to_float(float v) { return v; }
inline float to_float(bf16 v) { return static_cast<float>(v); }
inline float to_float(int8_t v) { return static_cast<float>(v); }
inline void store(float* p, float v) { *p = v; }
inline void store(bf16* p, float v) { *p = bf16(v); }  // round to nearest even

// Every tile has the same arguments: R weight rows from `w` (ld_w apart), G rows of x from `x`
// (K apart), R outputs per row of x into `y` (ld_y apart), each row's sums times `scale` (R
// values; int8 weights) and plus `bias` (R values) where these are not null. W is the weights'
// element type, T the activations' (float for int8 weights).
#define TILE_ARGS const W *w, int64_t ld_w, const T *x, int64_t K, const float *scale, const T *bias, T *y, int64_t ld_y
#define TILE_PASS w, ld_w, x, K, scale, bias, y, ld_y
// `ahead`: where the next block of weight rows starts, prefetched while this one is read (or null)

template <int RR, int GG, typename T>
inline void finish(const float (&sums)[RR][GG], const float* scale, const T* bias, T* y, int64_t ld_y) {
  UNROLL for (int r = 0; r < RR; ++r) {
    const float s = scale ? scale[r] : 1.0f, b = bias ? to_float(bias[r]) : 0.0f;
    UNROLL for (int g = 0; g < GG; ++g) store(y + g * ld_y + r, sums[r][g] * s + b);
  }
}

struct Scalar {
  static constexpr int R = 4, G = 4;
  template <int RR, int GG, typename W, typename T>
  static void tile(TILE_ARGS, const W*) {
    float sums[RR][GG] = {};
    for (int64_t k = 0; k < K; ++k)
      UNROLL for (int r = 0; r < RR; ++r)
        UNROLL for (int g = 0; g < GG; ++g) sums[r][g] += to_float(w[r * ld_w + k]) * to_float(x[g * K + k]);
    finish<RR, GG>(sums, scale, bias, y, ld_y);
  }
};

#ifdef MINILLM_X86

// Tiles of R weight rows by G rows of x, shaped by the row count (see `run`): R x G accumulators,
// R weight vectors and a row of x fit the 32 registers up to 6 x 4 and 3 x 8. Each load of x
// feeds R FMAs, each load of a weight G more; the larger the tile, the fewer loads and
// horizontal sums per FMA, and the fewer passes over a block (each pass but the first reads it
// from L1, while the memory stream waits).
struct Avx512 {

  AVX512 static __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
  AVX512 static __m512 load16(const int8_t* p, __mmask16 m) {  // 16 int8s, widened to 16 floats
    const __m128i raw = m == 0xFFFF ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)) : _mm_maskz_loadu_epi8(m, p);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
  }

  // fp32 weights, or int8 ones widened as they are read: x is fp32 either way
  template <int RR, int GG, typename W>
  AVX512 static void tile(const W* w, int64_t ld_w, const float* x, int64_t K, const float* scale, const float* bias,
                          float* y, int64_t ld_y, const W* ahead) {
    __m512 acc[RR][GG];
    UNROLL for (int r = 0; r < RR; ++r)
      UNROLL for (int g = 0; g < GG; ++g) acc[r][g] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 m = K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
      __m512 wv[RR];
      UNROLL for (int r = 0; r < RR; ++r) wv[r] = load16(w + r * ld_w + k, m);
      if (ahead) UNROLL for (int r = 0; r < RR; ++r) _mm_prefetch(reinterpret_cast<const char*>(ahead + r * ld_w + k), _MM_HINT_T0);
      UNROLL for (int g = 0; g < GG; ++g) {
        const __m512 xv = _mm512_maskz_loadu_ps(m, x + g * K + k);
        UNROLL for (int r = 0; r < RR; ++r) acc[r][g] = _mm512_fmadd_ps(wv[r], xv, acc[r][g]);
      }
    }
    float sums[RR][GG];
    UNROLL for (int r = 0; r < RR; ++r)
      UNROLL for (int g = 0; g < GG; ++g) sums[r][g] = _mm512_reduce_add_ps(acc[r][g]);
    finish<RR, GG>(sums, scale, bias, y, ld_y);
  }

  // bf16: one instruction multiplies 16 pairs of neighbours along k and adds both products to
  // 16 fp32 sums, so weights and activations stay as stored: no repacking, 32 values a step.
  template <int RR, int GG>
  AVX512 static void tile(const bf16* w, int64_t ld_w, const bf16* x, int64_t K, const float* scale, const bf16* bias,
                          bf16* y, int64_t ld_y, const bf16* ahead) {
    __m512 acc[RR][GG];
    UNROLL for (int r = 0; r < RR; ++r)
      UNROLL for (int g = 0; g < GG; ++g) acc[r][g] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      const __mmask32 m = K - k >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << (K - k)) - 1);
      __m512i wv[RR];
      UNROLL for (int r = 0; r < RR; ++r) wv[r] = _mm512_maskz_loadu_epi16(m, w + r * ld_w + k);
      if (ahead) UNROLL for (int r = 0; r < RR; ++r) _mm_prefetch(reinterpret_cast<const char*>(ahead + r * ld_w + k), _MM_HINT_T0);
      UNROLL for (int g = 0; g < GG; ++g) {
        const __m512i xv = _mm512_maskz_loadu_epi16(m, x + g * K + k);
        UNROLL for (int r = 0; r < RR; ++r) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], (__m512bh)wv[r], (__m512bh)xv);
      }
    }
    float sums[RR][GG];
    UNROLL for (int r = 0; r < RR; ++r)
      UNROLL for (int g = 0; g < GG; ++g) sums[r][g] = _mm512_reduce_add_ps(acc[r][g]);
    finish<RR, GG>(sums, scale, bias, y, ld_y);
  }
};

AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
AVX2 inline __m256 load8(const bf16* p) {  // bf16 is fp32's top half: widen and shift
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
AVX2 inline __m256 load8(const int8_t* p) {  // 8 int8s, widened to 8 floats
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// 4 x 2 tiles: 8 accumulators, 4 weight vectors and a row of x in 13 of the 16 registers.
// The last K % 8 columns are summed one by one.
struct Avx2 {
  static constexpr int R = 4, G = 2;

  template <int RR, int GG, typename W, typename T>
  AVX2 static void tile(TILE_ARGS, const W*) {
    __m256 acc[RR][GG];
    UNROLL for (int r = 0; r < RR; ++r)
      UNROLL for (int g = 0; g < GG; ++g) acc[r][g] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      __m256 wv[RR];
      UNROLL for (int r = 0; r < RR; ++r) wv[r] = load8(w + r * ld_w + k);
      UNROLL for (int g = 0; g < GG; ++g) {
        const __m256 xv = load8(x + g * K + k);
        UNROLL for (int r = 0; r < RR; ++r) acc[r][g] = _mm256_fmadd_ps(wv[r], xv, acc[r][g]);
      }
    }
    float sums[RR][GG];
    UNROLL for (int r = 0; r < RR; ++r)
      UNROLL for (int g = 0; g < GG; ++g) {
        sums[r][g] = hsum(acc[r][g]);
        for (int64_t t = k; t < K; ++t) sums[r][g] += to_float(w[r * ld_w + t]) * to_float(x[g * K + t]);
      }
    finish<RR, GG>(sums, scale, bias, y, ld_y);
  }
};

#endif  // MINILLM_X86

// tile<RR, gg> for a run-time gg in 1..GG (the last group of rows of x may be short).
template <class Path, int RR, int GG, typename W, typename T>
inline void tile_rows(int gg, TILE_ARGS, const W* ahead) {
  if constexpr (GG > 0) {
    if (gg == GG) return Path::template tile<RR, GG>(TILE_PASS, ahead);
    tile_rows<Path, RR, GG - 1>(gg, TILE_PASS, ahead);
  }
}

// Weight rows [begin, end) against all M rows of x: a block of R weight rows at a time, met by
// the rows of x G at a time. Only the first group reads the block from memory, and asks for the
// next block while it does (a software prefetch: without it, the memory stream stalled while the
// later groups worked from L1, and 8 rows of the LM head took twice as long as 4); the others
// find it in L1 (R rows of K values: 32 KiB at K = 2,048 in fp32).
template <class Path, int R, int G, typename W, typename T>
void rows(int64_t begin, int64_t end, int64_t M, TILE_ARGS) {
  for (int64_t j = begin; j < end; j += R) {
    const int rr = static_cast<int>(std::min<int64_t>(R, end - j));
    for (int64_t g0 = 0; g0 < M; g0 += G) {
      const int gg = static_cast<int>(std::min<int64_t>(G, M - g0));
      const T* b = bias ? bias + j : nullptr;
      const float* s = scale ? scale + j : nullptr;
      const W* wj = w + j * ld_w;
      const T* xg = x + g0 * K;
      T* yg = y + g0 * ld_y + j;
      const W* ahead = g0 == 0 && j + 2 * R <= end ? wj + R * ld_w : nullptr;
      if (rr == R)
        tile_rows<Path, R, G>(gg, wj, ld_w, xg, K, s, b, yg, ld_y, ahead);
      else  // the last block of a weight whose rows are not a multiple of R: one row at a time
        for (int r = 0; r < rr; ++r)
          tile_rows<Path, 1, G>(gg, wj + r * ld_w, ld_w, xg, K, s ? s + r : s, b ? b + r : b, yg + r, ld_y,
                                static_cast<const W*>(nullptr));
    }
  }
}

// Threads take equal runs of R-row blocks; a run is at least ~64 KiB of weight (below that, the
// fork costs more than a second thread saves).
template <class Path, int R, int G, typename W, typename T>
void product(int64_t N, int64_t M, TILE_ARGS) {
  const int64_t blocks = (N + R - 1) / R;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (R * std::max<int64_t>(K, 1) * int64_t(sizeof(W))));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    rows<Path, R, G, W, T>(b0 * R, std::min(b1 * R, N), M, w, ld_w, x, K, scale, bias, y, ld_y);
  });
}

bool has(const char* feature) {
#ifdef MINILLM_X86
  __builtin_cpu_init();
  if (std::string(feature) == "avx512") return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  if (std::string(feature) == "avx512bf16")
    return has("avx512") && __builtin_cpu_supports("avx512bf16");
  if (std::string(feature) == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return std::string(feature) == "scalar";
}

// The paths this CPU runs for weights of `dtype`, fastest first.
std::vector<std::string> paths(c10::ScalarType dtype) {
  std::vector<std::string> out;
  if (has(dtype == at::kBFloat16 ? "avx512bf16" : "avx512")) out.push_back("avx512");
  if (has("avx2")) out.push_back("avx2");
  out.push_back("scalar");
  return out;
}

std::vector<std::string> small_linear_paths(c10::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kChar,
              "small_linear: float32, bfloat16 or int8, not ", dtype);
  return paths(dtype);
}

template <typename W, typename T>
void run(const std::string& path, int64_t N, int64_t M, TILE_ARGS) {
#ifdef MINILLM_X86
  if (path == "avx512") {  // the shapes timed fastest on AVX-512 for each row count, fp32 and bf16 alike
    if (M == 1) return product<Avx512, 4, 1, W, T>(N, M, TILE_PASS);
    if (M <= 2 || M > 4) return product<Avx512, 3, 8, W, T>(N, M, TILE_PASS);
    return product<Avx512, 6, 4, W, T>(N, M, TILE_PASS);
  }
  if (path == "avx2") return product<Avx2, Avx2::R, Avx2::G, W, T>(N, M, TILE_PASS);
#endif
  product<Scalar, Scalar::R, Scalar::G, W, T>(N, M, TILE_PASS);
}

// The path named `path` ("" is the fastest this CPU runs for `dtype` weights), checked.
std::string chosen_path(c10::string_view path, c10::ScalarType dtype) {
  const auto runs = paths(dtype);
  const std::string chosen = path.empty() ? runs.front() : std::string(path);
  TORCH_CHECK(std::find(runs.begin(), runs.end(), chosen) != runs.end(), "small_linear: this CPU cannot run path '",
              chosen, "' for ", dtype);
  return chosen;
}

// x [..., K] as rows [M, K] with adjacent columns, in `dtype`, and the output's shape
std::pair<at::Tensor, std::vector<int64_t>> as_rows(const at::Tensor& x, int64_t K, int64_t N, c10::ScalarType dtype) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "small_linear: x's last dimension must be ", K);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return {x.reshape({-1, K}).to(dtype).contiguous(), shape};
}

// `bias` ([N] of `dtype`, made contiguous), or an undefined tensor for none
at::Tensor checked_bias(const std::optional<at::Tensor>& bias, int64_t N, c10::ScalarType dtype) {
  if (!bias.has_value() || !bias->defined()) return {};
  TORCH_CHECK(bias->numel() == N, "small_linear: bias must have ", N, " values");
  return bias->to(dtype).contiguous();
}

template <typename T>
const T* data_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr<T>() : nullptr; }

// y = x @ weight.T + bias for x [..., K], weight [N, K] (rows may be apart, columns adjacent),
// bias [N] or none, all of one dtype (float32 or bfloat16). `path` picks a path by name ("" is
// the fastest this CPU runs): the tests run each one on the same numbers.
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        c10::string_view path) {
  TORCH_CHECK(weight.dim() == 2 && weight.stride(1) == 1, "small_linear: weight must be [out, in] with adjacent columns");
  const int64_t N = weight.size(0), K = weight.size(1);
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "small_linear: float32 or bfloat16 weights, not ", dtype);
  TORCH_CHECK(x.scalar_type() == dtype, "small_linear: x is ", x.scalar_type(), ", weight is ", dtype);
  TORCH_CHECK(!bias.has_value() || !bias->defined() || bias->scalar_type() == dtype, "small_linear: bias must be ", dtype);
  const std::string chosen = chosen_path(path, dtype);
  const auto [rows, shape] = as_rows(x, K, N, dtype);
  const at::Tensor b = checked_bias(bias, N, dtype);
  const int64_t M = rows.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M > 0 && N > 0) {
    if (dtype == at::kFloat)
      run<float, float>(chosen, N, M, weight.data_ptr<float>(), weight.stride(0), rows.data_ptr<float>(), K, nullptr,
                        data_or_null<float>(b), y.data_ptr<float>(), N);
    else
      run<bf16, bf16>(chosen, N, M, weight.data_ptr<bf16>(), weight.stride(0), rows.data_ptr<bf16>(), K, nullptr,
                      data_or_null<bf16>(b), y.data_ptr<bf16>(), N);
  }
  return y.view(shape);
}

// The same product by int8 weights [N, K] with one scale per row (`scale` [N], any float dtype):
// x @ (weight * scale[:, None]).T + bias, x and bias float32 or bfloat16, summed in fp32 and
// returned in x's dtype.
at::Tensor small_linear_int8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                             const std::optional<at::Tensor>& bias, c10::string_view path) {
  TORCH_CHECK(weight.dim() == 2 && weight.stride(1) == 1 && weight.scalar_type() == at::kChar,
              "small_linear_int8: weight must be int8 [out, in] with adjacent columns");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "small_linear_int8: x must be float32 or bfloat16, not ", x.scalar_type());
  TORCH_CHECK(scale.numel() == N, "small_linear_int8: scale must have ", N, " values");
  const std::string chosen = chosen_path(path, at::kChar);
  const auto [rows, shape] = as_rows(x, K, N, at::kFloat);
  const at::Tensor b = checked_bias(bias, N, at::kFloat), s = scale.to(at::kFloat).contiguous();
  const int64_t M = rows.size(0);
  at::Tensor y = at::empty({M, N}, rows.options());
  if (M > 0 && N > 0)
    run<int8_t, float>(chosen, N, M, weight.data_ptr<int8_t>(), weight.stride(0), rows.data_ptr<float>(), K,
                       s.data_ptr<float>(), data_or_null<float>(b), y.data_ptr<float>(), N);
  return y.to(x.scalar_type()).view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minillm, m) {
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias=None, str path='') -> Tensor");
  m.def("small_linear_int8(Tensor x, Tensor weight, Tensor scale, Tensor? bias=None, str path='') -> Tensor");
  m.def("small_linear_paths(ScalarType dtype) -> str[]", &small_linear_paths);
}

TORCH_LIBRARY_IMPL(minillm, CPU, m) {
  m.impl("small_linear", &small_linear);
  m.impl("small_linear_int8", &small_linear_int8);
}
