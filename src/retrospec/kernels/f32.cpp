// f32 matmul for a few rows: y = x w^T with x [M, K] and w [N, K] (an nn.Linear weight, as it is: no copy, no
// repacking), float32, AVX-512, for the M = 1..64 rows of a decode step or a verification.
//
// Why hand-written: float32 BLAS picks its blocking and reduction order by the number of rows (gemv for one row, a
// blocked gemm for several), so a row's result changes with how many rows share the call, and a k-token verification
// is then not bitwise k one-token steps; and PyTorch's small-M float32 paths stay well above the memory floor on
// some CPUs. Here every output is one dot product computed the same way whatever M is: per row r and output n,
//   acc = 0; for each block of 16 inputs k (in order): acc = fma(x[r, k..k+15], w[n, k..k+15], acc)
//   y[r, n] = the 16 lanes of acc summed (a fixed tree)
// (the last block masked where K is not a multiple of 16), so each row's result is bitwise independent of the
// others (row invariance). Two loop orders compute these same bits: for a few rows, output after output, each
// weight row read once as one sequential stream (what the hardware prefetcher follows best); for more rows, blocks
// of (rows x outputs) accumulators (one weight load serves every row of the block; independent chains hide the FMA
// latency). Which row counts stream is the caller's choice (``set_streamed``: measured by ``fastpath.plan``); it
// changes the speed, never a bit. Threads split the outputs. Over ``kMaxRows`` rows (a prompt) it calls
// at::matmul (compute-bound there; its rows are not this kernel's bits).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace {

constexpr int64_t kMaxRows = 64, kChunk = 32, kOuts = 8;  // rows handled here; outputs per parallel work, per unit
std::atomic<int64_t> streamed{2};  // calls of at most this many rows run output after output (see the header)

template <int R, int NO, bool kPrefetch = true>
void block(const float* x, int64_t K, const float* w, float* y, int64_t ldy, int64_t outs) {
  __m512 acc[R][NO];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NO; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t full = K / 16 * 16;
  for (int64_t k = 0; k < full; k += 16) {
    __m512 wv[NO];
#pragma GCC unroll 8
    for (int j = 0; j < NO; ++j) {
      // fetch the same inputs of the outputs kOuts ahead (the next unit's weights, while this one computes)
      if constexpr (kPrefetch) _mm_prefetch(reinterpret_cast<const char*>(w + (kOuts + j) * K + k), _MM_HINT_T0);
      wv[j] = _mm512_loadu_ps(w + j * K + k);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * K + k);
#pragma GCC unroll 8
      for (int j = 0; j < NO; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  if (full < K) {  // the last, partial block: masked loads (zeros beyond K)
    const __mmask16 m = static_cast<__mmask16>((1u << (K - full)) - 1);
    __m512 wv[NO];
    for (int j = 0; j < NO; ++j) wv[j] = _mm512_maskz_loadu_ps(m, w + j * K + full);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + r * K + full);
      for (int j = 0; j < NO; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NO && j < outs; ++j) y[r * ldy + j] = _mm512_reduce_add_ps(acc[r][j]);
}

// rows [0, R) x kOuts outputs: one block of 8 accumulator chains per row for up to 2 rows, two blocks of 4 above
template <int R>
void unit(const float* x, int64_t K, const float* w, float* y, int64_t ldy) {
  if constexpr (R <= 2) {
    block<R, kOuts>(x, K, w, y, ldy, kOuts);
  } else {
    block<R, kOuts / 2>(x, K, w, y, ldy, kOuts / 2);
    block<R, kOuts / 2>(x, K, w + kOuts / 2 * K, y + kOuts / 2, ldy, kOuts / 2);
  }
}

// every row x outputs [n0, n1) of a call of at most 4 rows, output after output: one weight row, one stream
void streamed_range(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N, int64_t n0,
                    int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    switch (M) {
      case 4: block<4, 1, false>(x, K, w + n * K, y + n, N, 1); break;
      case 3: block<3, 1, false>(x, K, w + n * K, y + n, N, 1); break;
      case 2: block<2, 1, false>(x, K, w + n * K, y + n, N, 1); break;
      default: block<1, 1, false>(x, K, w + n * K, y + n, N, 1); break;
    }
  }
}

// every row x outputs [n0, n1): streamed (above) where the caller chose it for M rows; else per unit of kOuts
// outputs (read from memory once, then from L1), rows by 4, then the rest; outputs past the last full unit one at a
// time
void rows_range(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N, int64_t n0, int64_t n1) {
  if (M <= std::min<int64_t>(4, streamed.load(std::memory_order_relaxed)))
    return streamed_range(x, M, K, w, y, N, n0, n1);
  int64_t n = n0;
  for (; n + kOuts <= n1; n += kOuts) {
    int64_t r = 0;
    for (; r + 4 <= M; r += 4) unit<4>(x + r * K, K, w + n * K, y + r * N + n, N);
    switch (M - r) {
      case 3: unit<3>(x + r * K, K, w + n * K, y + r * N + n, N); break;
      case 2: unit<2>(x + r * K, K, w + n * K, y + r * N + n, N); break;
      case 1: unit<1>(x + r * K, K, w + n * K, y + r * N + n, N); break;
      default: break;
    }
  }
  for (; n < n1; ++n) {
    int64_t r = 0;
    for (; r + 4 <= M; r += 4) block<4, 1>(x + r * K, K, w + n * K, y + r * N + n, N, 1);
    for (; r < M; ++r) block<1, 1>(x + r * K, K, w + n * K, y + r * N + n, N, 1);
  }
}

}  // namespace

// x [M, K] float32, weights ws[i] [N_i, K] float32 -> [M, sum of N_i]: the products by each weight side by side,
// in one parallel region (a layer's q/k/v or gate/up in one call); each column's bits are those of a call with its
// weight alone
torch::Tensor f32_mm_cat(torch::Tensor x, std::vector<torch::Tensor> ws) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "f32_mm: x must be [M, K] float32");
  TORCH_CHECK(!ws.empty(), "f32_mm: no weights");
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<const float*> wp;
  std::vector<int64_t> first{0}, chunk{0};  // per weight: its first output column, its first unit of parallel work
  for (auto& w : ws) {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32 && w.size(1) == K,
                "f32_mm: weights must be [N, K] float32");
    w = w.contiguous();
    wp.push_back(w.data_ptr<float>());
    first.push_back(first.back() + w.size(0));
    chunk.push_back(chunk.back() + (w.size(0) + kChunk - 1) / kChunk);
  }
  if (M == 0) return torch::empty({0, first.back()}, x.options());  // nothing to compute (no rows to stream)
  if (M > kMaxRows) {
    std::vector<torch::Tensor> ys;
    for (auto& w : ws) ys.push_back(at::matmul(x, w.t()));
    return ys.size() == 1 ? ys[0] : at::cat(ys, 1);
  }
  const int64_t N = first.back();
  x = x.contiguous();
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, chunk.back(), 1, [&](int64_t c0, int64_t c1) {
    for (size_t i = 0; i < wp.size(); ++i) {
      const int64_t a = std::max(c0, chunk[i]), b = std::min(c1, chunk[i + 1]);
      if (a < b)
        rows_range(xp, M, K, wp[i], yp + first[i], N, (a - chunk[i]) * kChunk,
                   std::min(first[i + 1] - first[i], (b - chunk[i]) * kChunk));
    }
  });
  return y;
}

// x [M, K] float32, w [N, K] float32 -> [M, N] float32
torch::Tensor f32_mm(torch::Tensor x, torch::Tensor w) { return f32_mm_cat(x, {w}); }

// calls of at most ``rows`` rows (0..4) run output after output from now on; returns the previous setting
int64_t set_streamed(int64_t rows) { return streamed.exchange(std::max<int64_t>(0, std::min<int64_t>(4, rows))); }

TORCH_LIBRARY_FRAGMENT(retrospec, m) {
  m.def("f32_mm(Tensor x, Tensor w) -> Tensor");
  m.def("f32_mm_cat(Tensor x, Tensor[] ws) -> Tensor");
}
TORCH_LIBRARY_IMPL(retrospec, CPU, m) {
  m.impl("f32_mm", &f32_mm);
  m.impl("f32_mm_cat", &f32_mm_cat);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("f32_mm", &f32_mm, "f32 matmul for few rows (see the header)");
  m.def("f32_mm_cat", &f32_mm_cat, "f32 matmuls by several weights side by side (see f32_mm_cat)");
  m.def("set_streamed", &set_streamed, "calls of at most this many rows (0..4) stream output after output");
}
