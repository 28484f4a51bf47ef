// A float32 linear layer for the few rows of decoding, on x86-64 with AVX2 and FMA, or AVX-512 where the
// build targets it (see hf_bpd/cpu/streamed_linear.py for why). The weight [N, K] is packed once into
// panels of kPanel output columns (one vector register of floats: 8 on AVX2, 16 on AVX-512),
// [ceil(N / kPanel), K, kPanel], so a panel is one contiguous run of memory read front to back. A pass
// reads P adjacent panels for a group of up to kMaxRowGroup rows: one accumulator per row and panel, one
// FMA per row, panel and input index, and the lines 2 KB ahead requested before they are needed,
// so streaming the weight from memory overlaps the arithmetic. P is larger for fewer rows: an FMA waits for
// the previous one on its accumulator, so one row on one panel would leave the FMA units idle most of the
// time; enough independent accumulators keep them busy and reuse each broadcast input across P panels.
// Every output is one FMA chain along the input in order, whatever the row count, P or instruction set:
// a row gives the same result alone or in a batch, on AVX2 or AVX-512.
//
// A weight a compact copy holds exactly is packed as that copy instead: int8 values with one scale per kBlock
// weights of a row (a weight dequantised from GGUF's Q8_0 or Q5_0: `pack_int8_exact`), a quarter of the
// bytes, or per kSubBlock (from Q6_K, whose scales change every 16 weights), or 4-bit values with a scale and
// an offset per kBlock (from GGUF's Q4_1 or Q4_K: `pack_4bit_exact`), under a sixth. Its values are
// multiplied out as they are loaded, exactly, so the FMA chains, and the outputs, are the float32 panels'.
//
// Built with OpenMP (-fopenmp): at::parallel_for's OpenMP backend is inline in ATen's headers, so without
// it the pragma is dropped and every call runs on one thread.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

namespace {

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t kPanel = 16;
constexpr int64_t kMaxRowGroup = 16;  // rows per pass: up to 28 of the 32 registers hold accumulators
// panels per pass for R rows: P * R accumulators, P weights and a broadcast within 32 registers, and at
// least 8 independent FMA chains where the registers allow
constexpr int kPanelsFor[kMaxRowGroup + 1] = {0, 8, 6, 4, 4, 4, 4, 3, 3, 2, 2, 2, 2, 2, 2, 1, 1};
constexpr int kMostPanels = 8;
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec load(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
// 16 columns' 4-bit values from 8 bytes: byte j holds column j in its low half and column j + 8 in its high one
inline Vec load_nibbles(const uint8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(low, high)));
}
inline Vec broadcast(const float* p) { return _mm512_set1_ps(*p); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void store(float* y, Vec v, int64_t columns) {
  _mm512_mask_storeu_ps(y, columns == kPanel ? __mmask16(0xFFFF) : __mmask16((1u << columns) - 1), v);
}
constexpr const char* kInstructions = "avx512";
#else
using Vec = __m256;
constexpr int64_t kPanel = 8;
constexpr int64_t kMaxRowGroup = 12;  // 12 accumulators + weight + broadcast within AVX2's 16 registers
// panels per pass for R rows: P * R accumulators, P weights and a broadcast within 16 registers, and at
// least 6 independent FMA chains where the registers allow
constexpr int kPanelsFor[kMaxRowGroup + 1] = {0, 6, 4, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1};
constexpr int kMostPanels = 6;
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
// 8 columns' 4-bit values from 4 bytes: byte j holds column j in its low half and column j + 4 in its high one
inline Vec load_nibbles(const uint8_t* p) {
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
  const __m128i bytes = _mm_cvtsi32_si128(word);
  const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpacklo_epi32(low, high)));
}
inline Vec broadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void store(float* y, Vec v, int64_t columns) {
  if (columns == kPanel) {
    _mm256_storeu_ps(y, v);
  } else {
    alignas(32) float tail[kPanel];
    _mm256_store_ps(tail, v);
    std::copy(tail, tail + columns, y);
  }
}
constexpr const char* kInstructions = "avx2";
#endif

constexpr int64_t kLine = 64;  // bytes per cache line

// int8 and 4-bit weights carry their parameters per kBlock input indices of a column (GGUF's Q8_0, Q5_0 and
// Q4_1 blocks, and Q4_K's sub-blocks: a weight dequantised from any of them is then held exactly); an int8
// copy may carry them per kSubBlock instead (Q6_K's sub-blocks)
constexpr int64_t kBlock = 32;
constexpr int64_t kSubBlock = 16;

// The packed weight's formats, by the type of its elements: float panels [K, kPanel]; int8 panels [K, kPanel]
// followed by their blocks' scales [ceil(K / B), kPanel] (float; B kBlock or kSubBlock); 4-bit panels
// [K, kPanel / 2] (bytes, two columns each: `load_nibbles`) followed by their blocks' scales and then offsets,
// each [K / kBlock, kPanel] (float), a weight being scale * value + offset (Q4_1's and Q4_K's dequantisation,
// exact in one FMA)
struct Nibbles {
  uint8_t byte;
};
template <typename T>
constexpr int64_t kStep = std::is_same_v<T, Nibbles> ? kPanel / 2 : kPanel;  // elements per input index
template <typename T>
constexpr int64_t kStepsPerLine = kLine / (kStep<T> * sizeof(T));  // input indices per line of a panel
template <typename T>
constexpr int64_t kPrefetchSteps = 2048 / (kStep<T> * sizeof(T));  // 2 KB ahead of the current index

// T elements from one panel to the next, for parameters per B input indices
template <typename T, int64_t B = kBlock>
constexpr int64_t panel_stride(int64_t K) {
  const int64_t blocks = (K + B - 1) / B, floats = int64_t(sizeof(float)) / int64_t(sizeof(T));
  if constexpr (std::is_same_v<T, float>) {
    return K * kPanel;
  } else if constexpr (std::is_same_v<T, int8_t>) {
    return K * kPanel + blocks * kPanel * floats;
  } else {
    return K * kStep<T> + 2 * blocks * kPanel * floats;
  }
}

// T: the packed weight's format (`panel_stride`). An int8 or 4-bit weight is multiplied out as it is loaded,
// so the FMA chain is the float kernel's on the dequantised weight, bit for bit where those products are
// exact, as `pack_int8_exact` and `pack_4bit_exact` make them; B: the input indices per block of parameters
template <typename T, int64_t B, int R, int P>
void panels_rows(const float* __restrict x, int64_t K, const T* __restrict panel, float* __restrict y,
                 int64_t ldy, int64_t last_columns) {
  Vec acc[P][R];
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[p][r] = zero();
  const int64_t stride = panel_stride<T, B>(K);
  const int64_t blocks = (K + B - 1) / B;
  [[maybe_unused]] Vec scale[P], offset[P];
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (!std::is_same_v<T, float>) {
      if (k % B == 0) {
#pragma GCC unroll 16
        for (int p = 0; p < P; ++p) {
          const float* parameters = reinterpret_cast<const float*>(panel + p * stride + K * kStep<T>);
          scale[p] = load(parameters + k / B * kPanel);
          if constexpr (std::is_same_v<T, Nibbles>) offset[p] = load(parameters + (blocks + k / B) * kPanel);
        }
      }
    }
    if (k % kStepsPerLine<T> == 0) {  // one line per panel
#pragma GCC unroll 16
      for (int p = 0; p < P; ++p)
        _mm_prefetch(reinterpret_cast<const char*>(panel + p * stride + (k + kPrefetchSteps<T>) * kStep<T>),
                     _MM_HINT_T0);
    }
    Vec w[P];
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
      if constexpr (std::is_same_v<T, Nibbles>) {
        w[p] = fma(load_nibbles(&panel[p * stride + k * kStep<T>].byte), scale[p], offset[p]);
      } else {
        w[p] = load(panel + p * stride + k * kPanel);
        if constexpr (std::is_same_v<T, int8_t>) w[p] = mul(w[p], scale[p]);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const Vec b = broadcast(x + r * K + k);
#pragma GCC unroll 16
      for (int p = 0; p < P; ++p) acc[p][r] = fma(b, w[p], acc[p][r]);
    }
  }
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p) {
    const int64_t columns = p == P - 1 ? last_columns : kPanel;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) store(y + r * ldy + p * kPanel, acc[p][r], columns);
  }
}

// [rows][panels]: the pass for that many rows over that many panels (fewer than kPanelsFor[rows] at a
// weight's last panels); nullptr where no pass takes it
template <typename T>
using PanelsRows = void (*)(const float*, int64_t, const T*, float*, int64_t, int64_t);
template <typename T>
using ByPanels = std::array<PanelsRows<T>, kMostPanels + 1>;
template <typename T, int64_t B, int R, int... Ps>
constexpr ByPanels<T> by_panels(std::integer_sequence<int, Ps...>) {
  return {nullptr, panels_rows<T, B, R, Ps + 1>...};
}
template <typename T, int64_t B, int... Rs>
constexpr std::array<ByPanels<T>, kMaxRowGroup + 1> by_rows_panels(std::integer_sequence<int, Rs...>) {
  return {ByPanels<T>{}, by_panels<T, B, Rs + 1>(std::make_integer_sequence<int, kPanelsFor[Rs + 1]>{})...};
}
template <typename T, int64_t B>
constexpr auto kByRowsPanels = by_rows_panels<T, B>(std::make_integer_sequence<int, kMaxRowGroup>{});

// rows [M, K] times the `panels` of a weight of N columns (float panels from `pack`, int8 ones from
// `pack_int8_exact`, 4-bit ones from `pack_4bit_exact`; B their input indices per block), into y [M, N]
template <typename T, int64_t B = kBlock>
void run_panels(const float* xp, int64_t M, int64_t K, const T* wp, int64_t panels, int64_t N, float* yp) {
  const int64_t stride = panel_stride<T, B>(K);
  // rows split into equal groups of at most kMaxRowGroup (16 rows on AVX2: 8 + 8, not 12 + 4); the panels
  // into chunks of the most panels a group's pass takes, one thread's unit of work
  const int64_t groups = (M + kMaxRowGroup - 1) / kMaxRowGroup;
  const int64_t chunk = kPanelsFor[M / groups];  // the smallest group's (most panels per pass)
  const int64_t chunks = (panels + chunk - 1) / chunk;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t first = c * chunk, end = std::min(panels, first + chunk);
      for (int64_t g = 0, start = 0; g < groups; ++g) {
        const int64_t stop = M * (g + 1) / groups, rows = stop - start;
        for (int64_t p = first; p < end;) {
          const int64_t n = std::min<int64_t>(kPanelsFor[rows], end - p);
          const int64_t last_columns = std::min(kPanel, N - (p + n - 1) * kPanel);
          kByRowsPanels<T, B>[rows][n](xp + start * K, K, wp + p * stride, yp + start * N + p * kPanel, N,
                                       last_columns);
          p += n;
        }
        start = stop;
      }
    }
  });
}

}  // namespace

torch::Tensor pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32 && weight.device().is_cpu(),
              "streamed_linear.pack takes a 2D float32 CPU weight");
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  auto out = torch::zeros({panels, K, kPanel}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kPanel + j] = src[(p * kPanel + j) * K + k];
  });
  return out;
}

torch::Tensor linear(const torch::Tensor& input, const torch::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(input.dim() == 2 && input.scalar_type() == torch::kFloat32 && input.device().is_cpu(),
              "streamed_linear.linear takes 2D float32 CPU rows");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.size(1) == input.size(1) &&
                  packed.size(0) == (out_features + kPanel - 1) / kPanel && packed.is_contiguous(),
              "streamed_linear.linear: the packed weight does not match the input or out_features");
  const auto x = input.contiguous();
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0), N = out_features;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  run_panels(x.data_ptr<float>(), M, K, packed.data_ptr<float>(), panels, N, y.data_ptr<float>());
  return y;
}

// The weight [N, K] as int8 values with one float scale per `block` (kBlock or kSubBlock) of a row's K
// (`panel_stride`), where that holds it exactly: each block's scale its largest magnitude over a count of
// scales, and every weight that scale times an int8 (a weight dequantised from GGUF's Q8_0, Q5_0 or, per
// kSubBlock, Q6_K: `d * q` with d a float16 or float16 times int8 scale, products exact in float32).
// Else an empty tensor: the first block that does not come back exactly stops the search.
// what a block's largest magnitude is divided by for the scale tried, in turn: Q8_0's 127, Q5_0's 16, every
// smaller count of scales (a block whose values a search quantised to fewer levels), then Q6_K's 32 and the
// counts below it (its sub-block scales are rounded to int8, so a sub-block's largest value may fall short)
constexpr float kInt8Divisors[] = {127, 16, 15, 14, 13, 12, 11, 10, 9,  8,  7,  6,  5,  4,  3,  2, 1,
                                   32,  31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17};

namespace {

template <int64_t B>
torch::Tensor pack_int8_blocks(const torch::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel,
                stride = panel_stride<int8_t, B>(K);
  auto out = torch::zeros({panels, stride}, w.options().dtype(torch::kInt8));
  const float* src = w.data_ptr<float>();
  int8_t* dst = out.data_ptr<int8_t>();
  std::atomic<bool> exact{true};
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1 && exact.load(std::memory_order_relaxed); ++p) {
      float* panel_scales = reinterpret_cast<float*>(dst + p * stride + K * kPanel);
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j) {
        const float* row = src + (p * kPanel + j) * K;
        for (int64_t b = 0; b * B < K; ++b) {
          const int64_t end = std::min(K, (b + 1) * B);
          float largest = 0.0f;
          for (int64_t k = b * B; k < end; ++k) largest = std::max(largest, std::fabs(row[k]));
          // the block's largest magnitude is that many scales: Q8_0's quantiser maps it to 127, Q5_0's
          // to 16 (its values q - 16, q of 5 bits), Q6_K's to 32 (q - 32, q of 6 bits), other searches to fewer
          bool held = false;
          for (const float divisor : kInt8Divisors) {
            const float scale = largest > 0.0f ? largest / divisor : 1.0f;
            held = true;
            for (int64_t k = b * B; k < end && held; ++k) {
              const float q = std::nearbyint(row[k] / scale);
              held = std::fabs(q) <= 127.0f && q * scale == row[k];
              dst[p * stride + k * kPanel + j] = static_cast<int8_t>(q);
            }
            if (held) {
              panel_scales[b * kPanel + j] = scale;
              break;
            }
          }
          if (!held) {
            exact.store(false, std::memory_order_relaxed);
            return;
          }
        }
      }
    }
  });
  return exact.load() ? out : torch::empty({0}, out.options());
}

}  // namespace

torch::Tensor pack_int8_exact(const torch::Tensor& weight, int64_t block) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32 && weight.device().is_cpu(),
              "streamed_linear.pack_int8_exact takes a 2D float32 CPU weight");
  TORCH_CHECK(block == kBlock || block == kSubBlock, "streamed_linear.pack_int8_exact: block is 32 or 16");
  const auto w = weight.contiguous();
  return block == kBlock ? pack_int8_blocks<kBlock>(w) : pack_int8_blocks<kSubBlock>(w);
}

// The block of an int8 copy by its size: per kBlock and per kSubBlock the parameters take different room,
// except where K is one block of either, and then both read the same
torch::Tensor linear_int8(const torch::Tensor& input, const torch::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(input.dim() == 2 && input.scalar_type() == torch::kFloat32 && input.device().is_cpu(),
              "streamed_linear.linear_int8 takes 2D float32 CPU rows");
  const int64_t K = input.size(1), panels = (out_features + kPanel - 1) / kPanel;
  const bool per_block = packed.dim() == 2 && packed.size(1) == panel_stride<int8_t, kBlock>(K);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == torch::kInt8 && packed.size(0) == panels &&
                  (per_block || packed.size(1) == panel_stride<int8_t, kSubBlock>(K)) && packed.is_contiguous(),
              "streamed_linear.linear_int8: the packed weight does not match the input or out_features");
  const auto x = input.contiguous();
  auto y = torch::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return y;
  if (per_block)
    run_panels<int8_t, kBlock>(x.data_ptr<float>(), x.size(0), K, packed.data_ptr<int8_t>(), panels, out_features,
                               y.data_ptr<float>());
  else
    run_panels<int8_t, kSubBlock>(x.data_ptr<float>(), x.size(0), K, packed.data_ptr<int8_t>(), panels,
                                  out_features, y.data_ptr<float>());
  return y;
}

namespace {

// One block of a row (kBlock weights) as 4-bit values q with fma(q, scale, offset) giving back each weight
// exactly; false where the search finds none. gguf's dequantisation of Q4_1 (`d * q + m`) and Q4_K
// (`(d * sc) * q - dmin * m`) multiplies exactly and rounds once, as one FMA does. The offset is the block's
// smallest weight (its value 0; where a block has no 0, the offset plus that many scales is usually exact
// too). The scale is its range over the largest value, 15 or fewer: the float nearest that quotient or a
// few ulps from it, since the largest weight was rounded.
constexpr int kScaleUlps = 8;  // how far from the nearest float to the quotient a scale is looked for

bool recover_4bit(const float* w, float* scale, float* offset, uint8_t* q) {
  const auto [low_it, high_it] = std::minmax_element(w, w + kBlock);
  const float low = *low_it, high = *high_it;
  *offset = low;
  if (high == low) {
    *scale = 0.0f;
    std::fill(q, q + kBlock, uint8_t(0));
    return std::isfinite(low);
  }
  for (int largest = 15; largest >= 1; --largest) {
    const float nearest = static_cast<float>((double(high) - double(low)) / largest);
    for (int step = 0; step <= 2 * kScaleUlps; ++step) {  // 0, -1, +1, -2, +2, ... ulps
      const int ulps = step % 2 ? -(step + 1) / 2 : step / 2;
      float candidate = nearest;
      for (int u = 0; u < std::abs(ulps); ++u)
        candidate = std::nextafter(candidate, ulps < 0 ? 0.0f : std::numeric_limits<float>::infinity());
      if (!(candidate > 0.0f && std::isfinite(candidate))) continue;
      bool held = true;
      for (int64_t k = 0; k < kBlock && held; ++k) {
        const double value = std::clamp(std::nearbyint((double(w[k]) - low) / candidate), 0.0, 15.0);
        q[k] = static_cast<uint8_t>(value);
        held = std::fma(static_cast<float>(value), candidate, low) == w[k];
      }
      if (held) {
        *scale = candidate;
        return true;
      }
    }
  }
  return false;
}

}  // namespace

// The weight [N, K] as 4-bit values with a scale and an offset per kBlock of a row, each weight
// fma(value, scale, offset) of its block exactly (a weight dequantised from GGUF's Q4_1 or Q4_K:
// `recover_4bit`), packed into panels of kPanel columns (`panel_stride<Nibbles>`); an empty tensor where
// a block holds no such copy (the search stops at the first). K must hold whole blocks.
torch::Tensor pack_4bit_exact(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32 && weight.device().is_cpu(),
              "streamed_linear.pack_4bit_exact takes a 2D float32 CPU weight");
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), blocks = K / kBlock;
  const auto empty = torch::empty({0}, w.options().dtype(torch::kUInt8));
  if (K % kBlock != 0 || K == 0) return empty;
  auto values = torch::empty({N, K}, empty.options());
  auto scales = torch::empty({N, blocks}, w.options());
  auto offsets = torch::empty({N, blocks}, w.options());
  const float* src = w.data_ptr<float>();
  uint8_t* q = values.data_ptr<uint8_t>();
  float* scale = scales.data_ptr<float>();
  float* offset = offsets.data_ptr<float>();
  std::atomic<bool> exact{true};
  at::parallel_for(0, N, 1, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1 && exact.load(std::memory_order_relaxed); ++n)
      for (int64_t b = 0; b < blocks; ++b)
        if (!recover_4bit(src + n * K + b * kBlock, scale + n * blocks + b, offset + n * blocks + b,
                          q + n * K + b * kBlock)) {
          exact.store(false, std::memory_order_relaxed);
          return;
        }
  });
  if (!exact.load()) return empty;
  const uint8_t* src_values = values.data_ptr<uint8_t>();
  const int64_t panels = (N + kPanel - 1) / kPanel, stride = panel_stride<Nibbles>(K), half = kPanel / 2;
  auto out = torch::zeros({panels, stride}, values.options());
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      uint8_t* panel = dst + p * stride;
      float* parameters = reinterpret_cast<float*>(panel + K * half);
      for (int64_t j = 0; j < kPanel; ++j) {
        const int64_t n = p * kPanel + j;
        for (int64_t b = 0; b < blocks; ++b) {
          parameters[b * kPanel + j] = n < N ? scale[n * blocks + b] : 0.0f;
          parameters[(blocks + b) * kPanel + j] = n < N ? offset[n * blocks + b] : 0.0f;
        }
        if (n >= N) continue;
        const int shift = j < half ? 0 : 4;
        for (int64_t k = 0; k < K; ++k) panel[k * half + j % half] |= uint8_t(src_values[n * K + k] << shift);
      }
    }
  });
  return out;
}

torch::Tensor linear_4bit(const torch::Tensor& input, const torch::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(input.dim() == 2 && input.scalar_type() == torch::kFloat32 && input.device().is_cpu(),
              "streamed_linear.linear_4bit takes 2D float32 CPU rows");
  const int64_t K = input.size(1), panels = (out_features + kPanel - 1) / kPanel;
  TORCH_CHECK(K % kBlock == 0 && packed.dim() == 2 && packed.scalar_type() == torch::kUInt8 &&
                  packed.size(0) == panels && packed.size(1) == panel_stride<Nibbles>(K) && packed.is_contiguous(),
              "streamed_linear.linear_4bit: the packed weight does not match the input or out_features");
  const auto x = input.contiguous();
  auto y = torch::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return y;
  run_panels(x.data_ptr<float>(), x.size(0), K, reinterpret_cast<const Nibbles*>(packed.data_ptr<uint8_t>()), panels,
             out_features, y.data_ptr<float>());
  return y;
}

// how the build came out: its panel width, instruction set and whether OpenMP spreads a call over threads
pybind11::dict build_info() {
  pybind11::dict info;
  info["panel"] = kPanel;
  info["instructions"] = kInstructions;
#if defined(_OPENMP)
  info["openmp"] = true;
#else
  info["openmp"] = false;
#endif
  return info;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "weight [N, K] -> panels [ceil(N / kPanel), K, kPanel]");
  m.def("linear", &linear, "rows [M, K], panels, N -> rows @ weight.T [M, N]");
  m.def("pack_int8_exact", &pack_int8_exact,
        "weight [N, K], block (32 or 16) -> int8 panels with a scale per block where exact, else empty",
        pybind11::arg("weight"), pybind11::arg("block") = kBlock);
  m.def("linear_int8", &linear_int8, "rows [M, K], int8 panels, N -> rows @ weight.T [M, N]");
  m.def("pack_4bit_exact", &pack_4bit_exact,
        "weight [N, K] -> 4-bit panels with block scales and offsets where exact, else empty");
  m.def("linear_4bit", &linear_4bit, "rows [M, K], 4-bit panels, N -> rows @ weight.T [M, N]");
  m.def("build_info", &build_info, "panel width, instruction set and OpenMP of this build");
}
