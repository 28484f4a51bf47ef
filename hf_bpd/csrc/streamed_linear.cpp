// A float32 linear layer for the few rows of decoding, on x86-64 with AVX2 and FMA (see
// hf_bpd/streamed_linear.py for why). The weight [N, K] is packed once into panels of 8 output columns,
// [ceil(N / 8), K, 8], so a panel is one contiguous run of memory read front to back. Each panel is read
// once per group of up to 12 rows: one 8-wide accumulator per row, one FMA per row and input index, and
// the lines PREFETCH_STEPS input indices ahead requested before they are needed, so streaming the weight
// from memory overlaps the arithmetic. Every output is one FMA chain along the input in order, whatever
// the row count: a row gives the same result alone or in a batch.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>

namespace {

constexpr int64_t kPanel = 8;           // output columns per panel: one AVX2 register of floats
constexpr int64_t kMaxRowGroup = 12;    // rows per pass over a panel: 12 accumulators + weight + broadcast
constexpr int64_t kPrefetchSteps = 64;  // input indices ahead (64 x 32 bytes: 2 KB) of the current one

template <int R>
void panel_rows(const float* __restrict x, int64_t K, const float* __restrict panel, float* __restrict y,
                int64_t ldy, int64_t columns) {
  __m256 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if ((k & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetchSteps) * kPanel), _MM_HINT_T0);
    const __m256 w = _mm256_loadu_ps(panel + k * kPanel);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * K + k), w, acc[r]);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    if (columns == kPanel) {
      _mm256_storeu_ps(y + r * ldy, acc[r]);
    } else {
      alignas(32) float tail[kPanel];
      _mm256_store_ps(tail, acc[r]);
      std::copy(tail, tail + columns, y + r * ldy);
    }
  }
}

using PanelRows = void (*)(const float*, int64_t, const float*, float*, int64_t, int64_t);
constexpr PanelRows kByRows[kMaxRowGroup + 1] = {
    nullptr,         panel_rows<1>, panel_rows<2>, panel_rows<3>,  panel_rows<4>,  panel_rows<5>, panel_rows<6>,
    panel_rows<7>,   panel_rows<8>, panel_rows<9>, panel_rows<10>, panel_rows<11>, panel_rows<12>};

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
  // rows split into equal groups of at most kMaxRowGroup (16 rows: 8 + 8, not 12 + 4)
  const int64_t groups = (M + kMaxRowGroup - 1) / kMaxRowGroup;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t columns = std::min(kPanel, N - p * kPanel);
      for (int64_t g = 0, start = 0; g < groups; ++g) {
        const int64_t stop = M * (g + 1) / groups;
        kByRows[stop - start](xp + start * K, K, wp + p * K * kPanel, yp + start * N + p * kPanel, N, columns);
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
