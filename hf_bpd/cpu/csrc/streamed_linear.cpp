// A float32 linear layer for the few rows of decoding, on x86-64 with AVX2 and FMA (see
// hf_bpd/streamed_linear.py for why). The weight [N, K] is packed once into panels of 8 output columns,
// [ceil(N / 8), K, 8], so a panel is one contiguous run of memory read front to back. A pass reads P
// adjacent panels for a group of up to 12 rows: one 8-wide accumulator per row and panel, one FMA per row,
// panel and input index, and the lines PREFETCH_STEPS input indices ahead requested before they are
// needed, so streaming the weight from memory overlaps the arithmetic. P is larger for fewer rows: an FMA
// waits for the previous one on its accumulator, so one row on one panel would leave the FMA units idle
// most of the time; enough independent accumulators keep them busy and reuse each broadcast input across
// P panels. Every output is still one FMA chain along the input in order, whatever the row count or P: a
// row gives the same result alone or in a batch.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>

namespace {

constexpr int64_t kPanel = 8;           // output columns per panel: one AVX2 register of floats
constexpr int64_t kMaxRowGroup = 12;    // rows per pass over a panel: 12 accumulators + weight + broadcast
constexpr int64_t kPrefetchSteps = 64;  // input indices ahead (64 x 32 bytes: 2 KB) of the current one

template <int R, int P>
void panels_rows(const float* __restrict x, int64_t K, const float* __restrict panel, float* __restrict y,
                 int64_t ldy, int64_t last_columns) {
  __m256 acc[P][R];
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[p][r] = _mm256_setzero_ps();
  const int64_t stride = K * kPanel;  // from one panel to the next
  for (int64_t k = 0; k < K; ++k) {
    if ((k & 1) == 0) {  // one 64-byte line per panel every two input indices
#pragma GCC unroll 16
      for (int p = 0; p < P; ++p)
        _mm_prefetch(reinterpret_cast<const char*>(panel + p * stride + (k + kPrefetchSteps) * kPanel), _MM_HINT_T0);
    }
    __m256 w[P];
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) w[p] = _mm256_loadu_ps(panel + p * stride + k * kPanel);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + r * K + k);
#pragma GCC unroll 16
      for (int p = 0; p < P; ++p) acc[p][r] = _mm256_fmadd_ps(b, w[p], acc[p][r]);
    }
  }
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p) {
    const int64_t columns = p == P - 1 ? last_columns : kPanel;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      if (columns == kPanel) {
        _mm256_storeu_ps(y + r * ldy + p * kPanel, acc[p][r]);
      } else {
        alignas(32) float tail[kPanel];
        _mm256_store_ps(tail, acc[p][r]);
        std::copy(tail, tail + columns, y + r * ldy + p * kPanel);
      }
    }
  }
}

// panels per pass for R rows: P * R accumulators, P weights and a broadcast within AVX2's 16 registers,
// and at least 6 independent FMA chains where the registers allow
constexpr int kPanelsFor[kMaxRowGroup + 1] = {0, 6, 4, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1};
constexpr int kMostPanels = 6;

using PanelsRows = void (*)(const float*, int64_t, const float*, float*, int64_t, int64_t);
#define HF_BPD_PANELS(R) \
  { nullptr, panels_rows<R, 1>, panels_rows<R, 2>, panels_rows<R, 3>, panels_rows<R, 4>, panels_rows<R, 5>, panels_rows<R, 6> }
// [rows][panels]: a pass over fewer panels than kPanelsFor[rows] at a weight's last panels
constexpr PanelsRows kByRowsPanels[kMaxRowGroup + 1][kMostPanels + 1] = {
    {nullptr},         HF_BPD_PANELS(1),  HF_BPD_PANELS(2),  HF_BPD_PANELS(3), HF_BPD_PANELS(4),
    HF_BPD_PANELS(5),  HF_BPD_PANELS(6),  HF_BPD_PANELS(7),  HF_BPD_PANELS(8), HF_BPD_PANELS(9),
    HF_BPD_PANELS(10), HF_BPD_PANELS(11), HF_BPD_PANELS(12)};
#undef HF_BPD_PANELS

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
  // rows split into equal groups of at most kMaxRowGroup (16 rows: 8 + 8, not 12 + 4); the panels into
  // chunks of the most panels a group's pass takes, one thread's unit of work
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "weight [N, K] -> panels [ceil(N / 8), K, 8]");
  m.def("linear", &linear, "rows [M, K], panels, N -> rows @ weight.T [M, N]");
}
