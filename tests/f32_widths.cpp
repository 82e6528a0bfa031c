// Checks the f32 kernel's core as built for one vector width (the flags the test compiles it with): for 1..16 rows,
// streamed or blocked, at any prefetch distance, every row bitwise the same as in a call of 16 rows, and within float
// error of a double-precision product. Prints "ok <checks>, <lanes> lanes" or the first failure; exit 1 on one.
#define RETROSPEC_F32_CORE_ONLY
#include "f32.cpp"  // the kernel (its folder on the include path), without PyTorch

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

int main() {
  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  int checks = 0;
  for (const auto& nk : {std::pair<int64_t, int64_t>{80, 48}, {37, 50}, {300, 23}, {64, 576}, {9, 13}}) {
    const int64_t N = nk.first, K = nk.second, most = 16;
    std::vector<float> w(N * K), x(most * K), all(most * N), y(most * N);
    for (auto& v : w) v = normal(rng);
    for (auto& v : x) v = normal(rng);
    streamed = 0, prefetch = 0;
    rows_range(x.data(), most, K, w.data(), all.data(), N, 0, N);
    for (int64_t r = 0; r < most; ++r)
      for (int64_t n = 0; n < N; ++n) {
        double ref = 0;
        for (int64_t k = 0; k < K; ++k) ref += double(x[r * K + k]) * w[n * K + k];
        if (std::fabs(ref - all[r * N + n]) > 1e-4 + 1e-5 * std::fabs(ref)) {
          std::printf("FAIL not the product: N %lld, K %lld\n", (long long)N, (long long)K);
          return 1;
        }
      }
    for (int64_t rows = 1; rows <= most; ++rows)
      for (const auto& sp : {std::pair<int64_t, int64_t>{0, 0}, {kRows, 0}, {0, 64}, {kRows, 4096}, {0, 1 << 15}}) {
        streamed = sp.first, prefetch = sp.second;
        rows_range(x.data(), rows, K, w.data(), y.data(), N, 0, N);
        if (std::memcmp(y.data(), all.data(), rows * N * sizeof(float))) {
          std::printf("FAIL rows not bitwise: N %lld, K %lld, rows %lld\n", (long long)N, (long long)K,
                      (long long)rows);
          return 1;
        }
        ++checks;
      }
  }
  std::printf("ok %d calls, %lld lanes\n", checks, (long long)kW);
  return 0;
}
