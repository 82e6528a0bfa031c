// f32 matmul for a few rows: y = x w^T with x [M, K] and w [N, K] (an nn.Linear weight, as it is: no copy, no
// repacking), float32, AVX-512 or AVX2 with FMA, for the M = 1..64 rows of a decode step or a verification.
//
// Why hand-written: float32 BLAS picks its blocking and reduction order by the number of rows (gemv for one row, a
// blocked gemm for several), so a row's result changes with how many rows share the call, and a k-token verification
// is then not bitwise k one-token steps; and PyTorch's small-M float32 paths stay well above the memory floor on
// some CPUs. Here every output is one dot product computed the same way whatever M is: per row r and output n,
//   acc = 0; for each block of kW inputs k (in order): acc = fma(x[r, k..k+kW-1], w[n, k..k+kW-1], acc)
//   y[r, n] = the kW lanes of acc summed (a fixed tree)       (kW: 16 with AVX-512, 8 with AVX2)
// (the last block masked where K is not a multiple of kW), so each row's result is bitwise independent of the
// others (row invariance). Two loop orders compute these same bits: for a few rows, output after output, each
// weight row read once as one sequential stream; for more rows, blocks of (up to kRows rows x 4 outputs)
// accumulators (one weight load serves every row of the block, one input load every output; independent chains hide
// the FMA latency; the block's 4 weight rows are read from cache again for each further kRows rows). The blocked order
// prefetches the weights it will read ``prefetch`` bytes ahead into L2, each block of outputs the lines that far past
// its start, spread over its row blocks: without it, a call of 3..16 rows computed and waited on memory in turn
// (1.4-2x the time of the same call with it, on a 2-core AMD EPYC), and with the whole block's prefetches issued
// by its first row block, memory idled while the later ones computed (16 rows: 33 -> 30.5 ms for SmolLM2-135M's
// linears on a 2-core Intel Xeon); the streamed one leaves its one stream to the hardware prefetcher (a prefetch
// per load cost a one-row call 2-4 % on the AMD EPYC). Which row counts stream and how far ahead to prefetch are
// the caller's choice (``set_streamed``, ``set_prefetch``: measured by ``fastpath.plan``); they change the speed,
// never a bit. Threads split the outputs. Over ``kMaxRows``
// rows (a prompt) it calls at::matmul (compute-bound there; its rows are not this kernel's bits).
#ifndef RETROSPEC_F32_CORE_ONLY  // defined by the test that builds the core alone for each vector width
#include <torch/extension.h>
#include <ATen/Parallel.h>
#endif
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace {

constexpr int64_t kMaxRows = 64, kChunk = 32;  // rows handled here; outputs per unit of parallel work

// The vector: 16 floats with AVX-512 (blocks of 4 rows x 4 outputs: 16 of the 32 registers accumulate), else 8
// with AVX2 and FMA (2 rows x 4 outputs: 8 of the 16); kW inputs of a row per multiply-add, the last K % kW
// loaded with zeros past K; ``vsum``: the kW lanes summed by the tree s[l] += s[l + w], w = kW / 2, ..., 2, 1.
#if defined(__AVX512F__)
typedef __m512 V;
constexpr int64_t kW = 16, kRows = 4, kOuts = 4;  // lanes; a block's rows and outputs (kRows: the most that stream)
inline V vzero() { return _mm512_setzero_ps(); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline V vload_first(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(__mmask16((1u << n) - 1), p); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(V v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 V;
constexpr int64_t kW = 8, kRows = 2, kOuts = 4;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline V vload_first(const float* p, int64_t n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), lane));
}
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(V v) {
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}
#else
#error "the f32 kernel is built with AVX-512 or with AVX2 and FMA (kernels.f32 passes the flags)"
#endif
std::atomic<int64_t> streamed{2};  // calls of at most this many rows run output after output (see the header)
std::atomic<int64_t> prefetch{16 << 10};  // bytes ahead of its loads a blocked call prefetches (0: none)

// rows [0, R) x outputs [0, NO): y[r, j] = x[r] . w[j] (the header's arithmetic), prefetching (kPrefetch) the cache
// lines [pf, pf_end) into L2, ``per_step`` of them per kW inputs, in order
template <int R, int NO, bool kPrefetch>
void block(const float* x, int64_t K, const float* w, float* y, int64_t ldy, const char* pf, const char* pf_end,
           int per_step) {
  V acc[R][NO];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NO; ++j) acc[r][j] = vzero();
  const int64_t full = K / kW * kW;
  for (int64_t k = 0; k < full; k += kW) {
    V wv[NO];
    if constexpr (kPrefetch)
      for (int p = 0; p < per_step && pf < pf_end; ++p, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
#pragma GCC unroll 4
    for (int j = 0; j < NO; ++j) wv[j] = vload(w + j * K + k);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const V xv = vload(x + r * K + k);
#pragma GCC unroll 4
      for (int j = 0; j < NO; ++j) acc[r][j] = vfma(xv, wv[j], acc[r][j]);
    }
  }
  if (full < K) {  // the last, partial block: masked loads (zeros beyond K)
    V wv[NO];
    for (int j = 0; j < NO; ++j) wv[j] = vload_first(w + j * K + full, K - full);
    for (int r = 0; r < R; ++r) {
      const V xv = vload_first(x + r * K + full, K - full);
      for (int j = 0; j < NO; ++j) acc[r][j] = vfma(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NO; ++j) y[r * ldy + j] = vsum(acc[r][j]);
}

// rows [0, R) (R = 1..kRows) x outputs [0, NO) of a call
template <int NO, bool kPrefetch>
void rows_block(int64_t R, const float* x, int64_t K, const float* w, float* y, int64_t ldy, const char* pf = nullptr,
                const char* pf_end = nullptr, int per_step = 0) {
  switch (R) {
    case 4: block<kRows < 4 ? kRows : 4, NO, kPrefetch>(x, K, w, y, ldy, pf, pf_end, per_step); break;
    case 3: block<kRows < 3 ? kRows : 3, NO, kPrefetch>(x, K, w, y, ldy, pf, pf_end, per_step); break;
    case 2: block<2, NO, kPrefetch>(x, K, w, y, ldy, pf, pf_end, per_step); break;
    default: block<1, NO, kPrefetch>(x, K, w, y, ldy, pf, pf_end, per_step); break;
  }
}

// every row x outputs [n0, n1) of M rows, per block of kOuts outputs, rows by kRows (then the rest); outputs past
// the last full block one at a time. Prefetching (kPrefetch), a block's weights (kOuts rows of K) are prefetched
// ``ahead`` bytes before it is read: the block being read prefetches the lines that far past it, spread over all of
// its row blocks (each its share, a few lines per kW inputs), so memory keeps streaming while the later row blocks
// compute from cache (from the first row block alone, memory would idle while the others compute: with 16 rows,
// three quarters of the time).
template <bool kPrefetch>
void blocked_range(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N, int64_t n0,
                   int64_t n1, int64_t ahead) {
  const int64_t row_blocks = (M + kRows - 1) / kRows, bytes = kOuts * K * int64_t(sizeof(float));
  const int64_t share = (bytes / 64 + row_blocks - 1) / row_blocks * 64;  // bytes a row block prefetches
  const int per_step = int((share / 64 + K / kW - 1) / std::max<int64_t>(1, K / kW));  // lines per kW inputs
  int64_t n = n0;
  for (; n + kOuts <= n1; n += kOuts) {
    const char* pf = reinterpret_cast<const char*>(w + n * K) + ahead;
    for (int64_t r = 0, b = 0; r < M; r += kRows, ++b)
      rows_block<kOuts, kPrefetch>(std::min(kRows, M - r), x + r * K, K, w + n * K, y + r * N + n, N,
                                   pf + b * share, pf + std::min(bytes, (b + 1) * share), per_step);
  }
  for (; n < n1; ++n)
    for (int64_t r = 0; r < M; r += kRows)
      rows_block<1, false>(std::min(kRows, M - r), x + r * K, K, w + n * K, y + r * N + n, N);
}

// every row x outputs [n0, n1): output after output where the caller chose it for M rows (at most kRows), one stream
// left to the hardware prefetcher; else blocked, prefetching ``prefetch`` bytes ahead where that is set
void rows_range(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N, int64_t n0, int64_t n1) {
  if (M <= std::min(kRows, streamed.load(std::memory_order_relaxed))) {
    for (int64_t n = n0; n < n1; ++n) rows_block<1, false>(M, x, K, w + n * K, y + n, N);
    return;
  }
  const int64_t ahead = prefetch.load(std::memory_order_relaxed);
  if (ahead) return blocked_range<true>(x, M, K, w, y, N, n0, n1, ahead);
  blocked_range<false>(x, M, K, w, y, N, n0, n1, 0);
}

}  // namespace

#ifndef RETROSPEC_F32_CORE_ONLY

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

// calls of at most ``rows`` rows (0..kRows) run output after output from now on; returns the previous setting
int64_t set_streamed(int64_t rows) { return streamed.exchange(std::max<int64_t>(0, std::min(kRows, rows))); }

// calls in the blocked order prefetch the weights ``bytes`` ahead of their loads from now on (0: no prefetching);
// returns the previous setting
int64_t set_prefetch(int64_t bytes) {
  return prefetch.exchange(std::max<int64_t>(0, std::min<int64_t>(1 << 20, bytes)));
}

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
  m.def("set_streamed", &set_streamed, "calls of at most this many rows (0..most_streamed()) stream one by one");
  m.def("most_streamed", []() { return kRows; }, "the most rows a call can stream (4 with AVX-512, 2 with AVX2)");
  m.def("set_prefetch", &set_prefetch, "blocked calls prefetch weights this many bytes ahead of their loads (0: none)");
}
#endif
