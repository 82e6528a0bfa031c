// w4a8 matmul: 4-bit weights (groups of 32 inputs, a bfloat16 scale and zero each: w = (q - 8) * scale + zero) times
// activations quantized to int8 per row and group of 32 (symmetric: step = largest magnitude / 127), multiplied with
// AVX-512 VNNI integer dot products (vpdpbusd: 64 unsigned-by-signed byte products per instruction).
//
// Why hand-written: PyTorch's CPU 4-bit kernel (aten::_weight_int4pack_mm_for_cpu) converts every weight to float
// and multiplies in float, per block of 4 rows, so a 5-row call costs 2-3x a one-row call; its dynamic 4-bit op
// (_dyn_quant_matmul_4bit) is fast on Arm only. Integer dot products read each weight byte once for up to 8 rows.
//
// Per row r, output n, group g:  I = sum_k q[n,k] * a[r,k]  (int32, exact), Q = sum_k a[r,k],
//   y[r,n] += scale[n,g] * step[r,g] * (I - 8 Q)  +  zero[n,g] * (step[r,g] * Q)
// in float32, groups in order, the same instructions for a row whatever the number of rows in the call: each row's
// result is bitwise independent of the others (row invariance).
//
// Weight layout, per tile of 16 outputs: [groups][4 chunks][64 bytes]; chunk c, byte 4j + i holds
// q[n0 + j, 32 g + 8 c + i] in its low nibble and q[n0 + j, 32 g + 8 c + 4 + i] in its high nibble, so one
// 64-byte load gives two vpdpbusd operands (16 outputs x 4 inputs each). Scales: [tiles][groups][2][16] bfloat16
// (scale row, zero row).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kTile = 16, kGroup = 32, kRows = 8, kPrefetch = 2048;  // bytes of weights fetched ahead

inline __m512 bf16_to_f32(const uint16_t* p) {  // 16 bfloat16 -> 16 float32 (exact)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <int R>
void tile_rows(const int8_t* a, int64_t K, const float* step, const int32_t* qsum, const float* stepq, int64_t groups,
               const uint8_t* w, const uint16_t* sz, float* y, int64_t ldy) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 out[R];
  for (int r = 0; r < R; ++r) out[r] = _mm512_setzero_ps();
  // independent integer accumulators per row (summed at the group's end: integer sums, so in any order), enough
  // chains in flight to hide vpdpbusd's latency when few rows share the call
  constexpr int kChains = R >= 4 ? 2 : (R >= 2 ? 4 : 8);
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[R][kChains];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < kChains; ++j) acc[r][j] = _mm512_setzero_si512();
    const uint8_t* wg = w + g * 256;
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      // a thread's tiles lie one after another: fetch ahead across tile ends, as a one-row call streams the weights
      _mm_prefetch(reinterpret_cast<const char*>(wg + kPrefetch + c * 64), _MM_HINT_T0);
      const __m512i b = _mm512_loadu_si512(reinterpret_cast<const void*>(wg + c * 64));
      const __m512i lo = _mm512_and_si512(b, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
      const int jl = (2 * c) % kChains, jh = (2 * c + 1) % kChains;
      for (int r = 0; r < R; ++r) {
        int32_t a0, a1;
        std::memcpy(&a0, a + r * K + g * kGroup + c * 8, 4);
        std::memcpy(&a1, a + r * K + g * kGroup + c * 8 + 4, 4);
        acc[r][jl] = _mm512_dpbusd_epi32(acc[r][jl], lo, _mm512_set1_epi32(a0));
        acc[r][jh] = _mm512_dpbusd_epi32(acc[r][jh], hi, _mm512_set1_epi32(a1));
      }
    }
    const __m512 scale = bf16_to_f32(sz + g * 2 * kTile), zero = bf16_to_f32(sz + g * 2 * kTile + kTile);
    for (int r = 0; r < R; ++r) {
      const int64_t i = r * groups + g;
      __m512i sum = acc[r][0];
      for (int j = 1; j < kChains; ++j) sum = _mm512_add_epi32(sum, acc[r][j]);
      const __m512i centred = _mm512_sub_epi32(sum, _mm512_set1_epi32(8 * qsum[i]));
      out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), _mm512_mul_ps(scale, _mm512_set1_ps(step[i])), out[r]);
      out[r] = _mm512_fmadd_ps(zero, _mm512_set1_ps(stepq[i]), out[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, out[r]);
}

// 32 activations -> int8 on their group's step (largest magnitude / 127, round half to even; a group of zeros stays
// zero), that step, the sum of the integers and step * that sum. Vector division and rounding are IEEE-exact, so
// this equals the scalar loop bit for bit (and ``weight_only.quantize_group_rows``' rounding).
inline void quantize_group(const float* x, int8_t* out, float& step, int32_t& qsum, float& stepq) {
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float s = amax / 127.f;
  __m512i q0 = _mm512_setzero_si512(), q1 = _mm512_setzero_si512();
  if (s > 0.f) {
    const __m512 d = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
    constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    q0 = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(_mm512_div_ps(v0, d), kNearest))));
    q1 = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(_mm512_div_ps(v1, d), kNearest))));
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtsepi32_epi8(q1));
  const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  step = s;
  qsum = total;
  stepq = s * static_cast<float>(total);
}

using TileFn = void (*)(const int8_t*, int64_t, const float*, const int32_t*, const float*, int64_t, const uint8_t*,
                        const uint16_t*, float*, int64_t);
const TileFn kTileFns[] = {nullptr, tile_rows<1>, tile_rows<2>, tile_rows<3>, tile_rows<4>,
                           tile_rows<5>, tile_rows<6>, tile_rows<7>, tile_rows<8>};

}  // namespace

// x [M, K] float32, w [N / 16, K / 32, 256] uint8, sz [N / 16, K / 32, 2, 16] bfloat16 -> [M, N] float32
torch::Tensor w4a8_mm(torch::Tensor x, torch::Tensor w, torch::Tensor sz) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "w4a8_mm: x must be [M, K] float32");
  TORCH_CHECK(w.dim() == 3 && w.size(2) == 256 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(),
              "w4a8_mm: w must be contiguous [N / 16, K / 32, 256] uint8");
  TORCH_CHECK(sz.scalar_type() == torch::kBFloat16 && sz.is_contiguous(), "w4a8_mm: sz must be contiguous bfloat16");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), tiles = w.size(0), groups = w.size(1), N = tiles * kTile;
  TORCH_CHECK(K == groups * kGroup && sz.numel() == tiles * groups * 2 * kTile, "w4a8_mm: shapes do not match");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  std::vector<int8_t> a(M * K);
  std::vector<float> step(M * groups), stepq(M * groups);
  std::vector<int32_t> qsum(M * groups);
  at::parallel_for(0, M * groups, 256, [&](int64_t i0, int64_t i1) {  // one (row, group) per i; parallel in prefills
    for (int64_t i = i0; i < i1; ++i)
      quantize_group(xp + i * kGroup, a.data() + i * kGroup, step[i], qsum[i], stepq[i]);
  });
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t r0 = 0; r0 < M; r0 += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, M - r0), i = r0 * groups;
        kTileFns[rows](a.data() + r0 * K, K, step.data() + i, qsum.data() + i, stepq.data() + i, groups,
                       wp + t * groups * 256, sp + t * groups * 2 * kTile, yp + r0 * N + t * kTile, N);
      }
    }
  });
  return y;
}

// Also an operator (``torch.ops.retrospec.w4a8_mm``), so compiled programs can call it between their fused loops.
TORCH_LIBRARY_FRAGMENT(retrospec, m) { m.def("w4a8_mm(Tensor x, Tensor w, Tensor sz) -> Tensor"); }
TORCH_LIBRARY_IMPL(retrospec, CPU, m) { m.impl("w4a8_mm", &w4a8_mm); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("w4a8_mm", &w4a8_mm, "w4a8 matmul (see the file's header)"); }
