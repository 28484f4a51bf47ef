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
// Built with OpenMP (-fopenmp): at::parallel_for's OpenMP backend is inline in ATen's headers, so without
// it the pragma is dropped and every call runs on one thread.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
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

constexpr int64_t kLine = 64;                                      // bytes per cache line
constexpr int64_t kStepsPerLine = kLine / (kPanel * sizeof(float));  // input indices per line of a panel
constexpr int64_t kPrefetchSteps = 2048 / (kPanel * sizeof(float));  // 2 KB ahead of the current index

template <int R, int P>
void panels_rows(const float* __restrict x, int64_t K, const float* __restrict panel, float* __restrict y,
                 int64_t ldy, int64_t last_columns) {
  Vec acc[P][R];
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[p][r] = zero();
  const int64_t stride = K * kPanel;  // from one panel to the next
  for (int64_t k = 0; k < K; ++k) {
    if (k % kStepsPerLine == 0) {  // one line per panel
#pragma GCC unroll 16
      for (int p = 0; p < P; ++p)
        _mm_prefetch(reinterpret_cast<const char*>(panel + p * stride + (k + kPrefetchSteps) * kPanel), _MM_HINT_T0);
    }
    Vec w[P];
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) w[p] = load(panel + p * stride + k * kPanel);
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
using PanelsRows = void (*)(const float*, int64_t, const float*, float*, int64_t, int64_t);
using ByPanels = std::array<PanelsRows, kMostPanels + 1>;
template <int R, int... Ps>
constexpr ByPanels by_panels(std::integer_sequence<int, Ps...>) {
  return {nullptr, panels_rows<R, Ps + 1>...};
}
template <int... Rs>
constexpr std::array<ByPanels, kMaxRowGroup + 1> by_rows_panels(std::integer_sequence<int, Rs...>) {
  return {ByPanels{}, by_panels<Rs + 1>(std::make_integer_sequence<int, kPanelsFor[Rs + 1]>{})...};
}
constexpr auto kByRowsPanels = by_rows_panels(std::make_integer_sequence<int, kMaxRowGroup>{});

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
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
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
          kByRowsPanels[rows][n](xp + start * K, K, wp + p * K * kPanel, yp + start * N + p * kPanel, N, last_columns);
          p += n;
        }
        start = stop;
      }
    }
  });
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
  m.def("build_info", &build_info, "panel width, instruction set and OpenMP of this build");
}
