// Checks the attention kernel's core as built for one vector width (the flags the test compiles it with): every row of
// a chain and of a tree bitwise the one-row computation over exactly the keys it sees, gathered in order, and every
// result within float error of a double-precision softmax. Prints "ok <checks>" or the first failure; exit 1 on one.
#define RETROSPEC_ATTENTION_CORE_ONLY
#include "attention.cpp"  // the kernel (its folder on the include path), without PyTorch

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <random>

namespace {

std::mt19937 rng(0);

std::vector<float> randn(size_t n) {
  std::normal_distribution<float> normal;
  std::vector<float> x(n);
  for (auto& v : x) v = normal(rng);
  return x;
}

// P query vectors (q[i]: d floats) over L keys, ``heads`` consecutive ones per row of biases [P / heads, L] (0
// seen, -inf not; a row's heads share its bias, as the query heads of one row do: they are walked together) ->
// [P, d] through ``pairs``
std::vector<float> run(const std::vector<const float*>& q, const float* k, const float* v,
                       const std::vector<float>& bias, int64_t L, int64_t d, float scaling, int64_t heads = 1) {
  const int64_t P = q.size(), stride = (L + kLanes - 1) / kLanes * kLanes + kLanes;
  std::vector<float> out(P * d), s(P * stride);
  std::vector<const float*> b(P);
  std::vector<float*> o(P);
  for (int64_t i = 0; i < P; ++i) b[i] = bias.data() + i / heads * L, o[i] = out.data() + i * d;
  pairs(q.data(), k, v, b.data(), o.data(), P, L, d, scaling, s.data(), stride, 64);
  return out;
}

int fail(const char* what, int64_t d, int64_t L, int64_t row) {
  std::printf("FAIL %s: d %lld, keys %lld, row %lld\n", what, (long long)d, (long long)L, (long long)row);
  return 1;
}

}  // namespace

int main() {
  const float hidden = -std::numeric_limits<float>::infinity(), scaling = 0.3f;
  int checks = 0;
  const int64_t H = 3;  // query heads per row
  for (int64_t d : {64, 24, 20, 7}) {
    for (int64_t L : {1, 5, 37, 130, 300}) {
      const int64_t P = L < 12 ? L : 12;
      auto k = randn(L * d), v = randn(L * d), qs = randn(P * H * d);
      std::vector<const float*> q(P * H);
      for (int64_t i = 0; i < P * H; ++i) q[i] = qs.data() + i * d;
      std::vector<float> bias(P * L, 0.f);  // rows: a chain, then every third row a tree's (keys past half hidden)
      std::uniform_real_distribution<float> u;
      for (int64_t i = 0; i < P; ++i)
        for (int64_t j = 0; j < L; ++j)
          if (j > L - P + i || (i % 3 == 2 && j >= L / 2 && u(rng) < 0.4f)) bias[i * L + j] = hidden;
      const auto out = run(q, k.data(), v.data(), bias, L, d, scaling, H);
      for (int64_t u = 0; u < P * H; ++u) {
        const int64_t i = u / H;  // the unit's row
        std::vector<float> kg, vg;  // the keys row i sees, in order
        std::vector<double> sc;
        for (int64_t j = 0; j < L; ++j)
          if (bias[i * L + j] != hidden) {
            kg.insert(kg.end(), k.begin() + j * d, k.begin() + (j + 1) * d);
            vg.insert(vg.end(), v.begin() + j * d, v.begin() + (j + 1) * d);
          }
        const int64_t seen = kg.size() / d;
        const auto one = run({q[u]}, kg.data(), vg.data(), std::vector<float>(seen, 0.f), seen, d, scaling);
        for (int64_t c = 0; c < d; ++c)
          if (std::memcmp(&one[c], &out[u * d + c], sizeof(float))) return fail("row not bitwise its own", d, L, u);
        double m = -1e300, den = 0;
        for (int64_t j = 0; j < seen; ++j) {
          double x = 0;
          for (int64_t c = 0; c < d; ++c) x += double(q[u][c]) * kg[j * d + c];
          sc.push_back(x * scaling);
          m = std::max(m, sc.back());
        }
        for (auto& x : sc) den += (x = std::exp(x - m));
        for (int64_t c = 0; c < d; ++c) {
          double ref = 0;
          for (int64_t j = 0; j < seen; ++j) ref += sc[j] * vg[j * d + c];
          ref /= den;
          if (std::fabs(ref - out[u * d + c]) > 1e-5 + 1e-5 * std::fabs(ref)) return fail("not attention", d, L, u);
        }
        ++checks;
      }
    }
  }
  std::printf("ok %d units, %d lanes\n", checks, kLanes);
  return 0;
}
