// Attention of a few query rows over a layer's key/value cache, each row's result bitwise independent of the other
// rows and of the keys it does not see: the decode step's and the verification's attention.
//
//   qkv  [T, heads + 2 kv_heads, d]  (the rows' query heads first; the key / value heads after them are not read)
//   kbuf, vbuf [1, kv_heads, C, d]   (the cache's buffers; the first L positions are read)
//   bias [T, L]                      (0 where row t sees key j, -inf where it does not; other values are added)
//   -> [T, heads * d]:  softmax(q k^T * scaling + bias) v, per row and head (query head h reads kv head h / group)
//
// Why hand-written: PyTorch's CPU attention (and a compiled one) splits the keys into vector lanes or blocks by
// position, so a row's sums change with where masked keys sit and how many rows share the call: a draft tree's rows
// (whose visible keys are not a prefix) and a k-token verification would not be bitwise the one-token steps along
// their paths. Here, per row and head, with keys in cache order:
//   s_j = (q . k_j, 16 lanes then a fixed sum) * scaling + bias_j      for the keys the row sees (skipped otherwise)
//   m = max s_j;  e_j = exp(s_j - m) (one vectorized exp for every key);  den = sum of e_j, one after another;
//   out = (sum of e_j v_j, in order) / den
// A key a row does not see adds nothing anywhere, so its result depends only on the keys it sees, in their order:
// the same bits as a one-row call over exactly those keys (a tree's row = the step along its path). Threads split
// the (key / value head, row, query head) units, key / value head first; nothing is reduced across them. A thread
// walks its units of one key / value head together, a block of keys at a time, so every row and every query head
// of the group reads that block once from memory: over a long cache a k-row verification reads the cache about as
// often as a one-token step (one pass per row and head read it k x heads / kv_heads times), and the query heads of
// one row share each key's and each value's loads.
// Over a long cache each block's keys (and values) are prefetched into L2 ``ahead`` keys before they are read, at a
// distance the caller sets (``set_prefetch``; 0: none): one stream a thread, which the hardware prefetcher alone left
// at about two thirds of the rate the weights' matmuls read memory at. A prefetch changes no arithmetic.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int kLanes = 16;
std::atomic<int64_t> prefetch_keys{64};  // keys ahead of its reads a call prefetches keys and values (0: none)

// The cache lines of [p, p + bytes) into L2 (a hint: never faults, changes nothing computed).
inline void prefetch_l2(const float* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b, 0, 2);
}
typedef float vf __attribute__((vector_size(64)));  // 16 floats: the compiler maps it to the CPU's vectors
typedef int vi __attribute__((vector_size(64)));

#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, vi{__VA_ARGS__})
#endif

inline vf load(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline vf splat(float x) { return vf{} + x; }

// One key's score lanes -> their sum, by the fixed tree acc[l] += acc[l + w] for w = 8, 4, 2, 1.
inline float dot(const float* a, const float* b, int64_t d) {
  float acc[kLanes] = {0};  // lane l: inputs l, l + 16, l + 32, ... in order
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] = acc[l] + a[i + l] * b[i + l];
  for (int64_t l = 0; i + l < d; ++l) acc[l] = acc[l] + a[i + l] * b[i + l];
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] = acc[l] + acc[l + w];
  return acc[0];
}

// 8 keys' dots for G query heads at once, each key's bits ``dot``'s: every key vector is loaded once for the G
// heads; the same lanes (``kTail``: d not a multiple of 16, the last inputs lane by lane as ``dot`` adds them; without
// one the accumulators never leave the registers), then ``dot``'s tree as a transposed reduction; lanes 0..7 of out[g].
template <int G, bool kTail>
__attribute__((always_inline)) inline void dot8(const float* const* q, const float* k, int64_t d, vf* out) {
  vf acc[G][8];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 8; ++j) acc[g][j] = vf{};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    vf qv[G];
    for (int g = 0; g < G; ++g) qv[g] = load(q[g] + i);
    for (int j = 0; j < 8; ++j) {
      const vf kv = load(k + j * d + i);
      for (int g = 0; g < G; ++g) acc[g][j] = acc[g][j] + qv[g] * kv;
    }
  }
  if (kTail && i < d) {
    float part[kLanes];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 8; ++j) {
        __builtin_memcpy(part, &acc[g][j], sizeof(part));
        for (int64_t l = 0; i + l < d; ++l) part[l] = part[l] + q[g][i + l] * k[j * d + i + l];
        __builtin_memcpy(&acc[g][j], part, sizeof(part));
      }
  }
  for (int g = 0; g < G; ++g) {
    vf b[4], c[2];
    for (int m = 0; m < 4; ++m)  // lanes l + (l + 8): keys 2m | 2m + 1 in the halves
      b[m] = SHUFFLE(acc[g][2 * m], acc[g][2 * m + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
             SHUFFLE(acc[g][2 * m], acc[g][2 * m + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int m = 0; m < 2; ++m)  // + 4: keys 4m .. 4m + 3 in the quarters
      c[m] = SHUFFLE(b[2 * m], b[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
             SHUFFLE(b[2 * m], b[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const vf e = SHUFFLE(c[0], c[1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                 SHUFFLE(c[0], c[1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    out[g] = SHUFFLE(e, e, 0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14) +
             SHUFFLE(e, e, 1, 3, 5, 7, 9, 11, 13, 15, 1, 3, 5, 7, 9, 11, 13, 15);
  }
}

// exp(x) for x <= 0, 16 at a time (Cephes' expf: x = n ln 2 + r, a degree-7 polynomial in r, times 2^n); below
// -87 (under float's smallest normal) it is 0. Every value goes through here, so a key's e_j is the same wherever
// it sits.
inline vf vexp(vf x) {
  const vi under = x < splat(-87.0f);
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  vf t = x * splat(1.44269504088896341f) + splat(0.5f);
  vi n = __builtin_convertvector(t, vi);
  n = n - (__builtin_convertvector(n, vf) > t ? vi{} + 1 : vi{});  // floor
  const vf nf = __builtin_convertvector(n, vf);
  const vf r = x - nf * splat(0.693359375f) - nf * splat(-2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * (r * r) + r + splat(1.0f);
  vi bits = (n + 127) << 23;
  vf scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return under ? vf{} : p * scale;
}

// For G query heads reading one row's keys (one ``bias``): out[g][0 .. n) += sum over the seen keys j in [j0, j1),
// in order, of e[g][j] v_j[0 .. n): F vectors of 16 features in registers (loaded from and stored back to ``out``:
// exact), the last n - 16 F features lane by lane; each value vector is loaded once for the G heads. Called for
// consecutive key blocks from out = 0, a head's sums are those of one pass over every key (the same operations, the
// same order, whatever G).
template <int G, int F>
void weigh(const float* const* e, const float* v, const float* bias, int64_t j0, int64_t j1, int64_t d, int64_t n,
           float* const* out, int64_t i0, int64_t ahead) {
  const float hidden = -std::numeric_limits<float>::infinity();
  vf acc[G][F > 0 ? F : 1];
  float rest[G][kLanes];
  const int64_t tail = n - F * kLanes;
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < F; ++c) acc[g][c] = load(out[g] + i0 + c * kLanes);
    for (int64_t l = 0; l < tail; ++l) rest[g][l] = out[g][i0 + F * kLanes + l];
  }
  for (int64_t j = j0; j < j1; ++j) {
    if (ahead) prefetch_l2(v + (j + ahead) * d + i0, n * int64_t(sizeof(float)));
    if (bias[j] == hidden) continue;
    const float* vj = v + j * d + i0;
    for (int c = 0; c < F; ++c) {
      const vf vv = load(vj + c * kLanes);
      for (int g = 0; g < G; ++g) acc[g][c] = acc[g][c] + splat(e[g][j]) * vv;
    }
    for (int64_t l = 0; l < tail; ++l)
      for (int g = 0; g < G; ++g) rest[g][l] = rest[g][l] + e[g][j] * vj[F * kLanes + l];
  }
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < F; ++c) __builtin_memcpy(out[g] + i0 + c * kLanes, &acc[g][c], sizeof(vf));
    for (int64_t l = 0; l < tail; ++l) out[g][i0 + F * kLanes + l] = rest[g][l];
  }
}

template <int G>
void weigh_features(const float* const* e, const float* v, const float* bias, int64_t j0, int64_t j1, int64_t d,
                    float* const* out, int64_t ahead) {
  for (int64_t i0 = 0; i0 < d; i0 += 4 * kLanes) {  // 64 features at a time in registers, keys in order
    const int64_t n = d - i0 < 4 * kLanes ? d - i0 : 4 * kLanes;
    switch (n / kLanes) {
      case 4: weigh<G, 4>(e, v, bias, j0, j1, d, n, out, i0, ahead); break;
      case 3: weigh<G, 3>(e, v, bias, j0, j1, d, n, out, i0, ahead); break;
      case 2: weigh<G, 2>(e, v, bias, j0, j1, d, n, out, i0, ahead); break;
      case 1: weigh<G, 1>(e, v, bias, j0, j1, d, n, out, i0, ahead); break;
      default: weigh<G, 0>(e, v, bias, j0, j1, d, n, out, i0, ahead);
    }
  }
}

void weigh_heads(const float* const* e, int G, const float* v, const float* bias, int64_t j0, int64_t j1, int64_t d,
                 float* const* out, int64_t ahead) {
  switch (G) {
    case 4: weigh_features<4>(e, v, bias, j0, j1, d, out, ahead); break;
    case 3: weigh_features<3>(e, v, bias, j0, j1, d, out, ahead); break;
    case 2: weigh_features<2>(e, v, bias, j0, j1, d, out, ahead); break;
    default: weigh_features<1>(e, v, bias, j0, j1, d, out, ahead);
  }
}

constexpr int64_t kBlock = 64;  // keys per block (a multiple of kLanes): 16 KB of keys or values at d = 64, in L1
constexpr int64_t kPass = 48;  // units of one key / value head walked together at most (bounds the scratch)

// s[g][j] = q[g] . k_j * scaling + bias[j] for G heads of one row (one ``bias``) and keys [j0, j1) (multiples of 16),
// 8 keys at a time (``dot8``); mv[g]: the lane-wise max of the seen scores.
template <int G, bool kTail>
void scores_heads(const float* const* q, const float* k, const float* bias, int64_t j0, int64_t j1, int64_t d,
                  float scaling, float* const* s, vf* mv, int64_t ahead) {
  const float hidden = -std::numeric_limits<float>::infinity();
  for (int64_t j = j0; j < j1; j += kLanes) {
    vf lo[G], hi[G];
    if (ahead) prefetch_l2(k + (j + ahead) * d, kLanes * d * int64_t(sizeof(float)));
    dot8<G, kTail>(q, k + j * d, d, lo);
    dot8<G, kTail>(q, k + (j + 8) * d, d, hi);
    const vf b = load(bias + j);
    for (int g = 0; g < G; ++g) {
      const vf dots = SHUFFLE(lo[g], hi[g], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);  // keys j..j+15
      const vf sv = dots * splat(scaling) + b;
      __builtin_memcpy(s[g] + j, &sv, sizeof(sv));
      mv[g] = (b != splat(hidden) && sv > mv[g]) ? sv : mv[g];
    }
  }
}

// fn(j0, j1, i, G) for every block [j0, j1) of the first ``length`` keys and, within it, every run of G <= ``most``
// consecutive units i .. i + G - 1 of one row (one ``bias``): the units that can share each key's loads.
template <typename Fn>
void by_rows(const float* const* bias, int64_t P, int64_t length, int most, Fn fn) {
  for (int64_t j0 = 0; j0 < length; j0 += kBlock) {
    const int64_t j1 = j0 + kBlock < length ? j0 + kBlock : length;
    for (int64_t i = 0; i < P;) {
      int G = 1;
      while (G < most && i + G < P && bias[i + G] == bias[i]) ++G;
      fn(j0, j1, i, G);
      i += G;
    }
  }
}

// ``scores_heads`` for every pair over the first ``whole`` keys (a multiple of 16), by runs of up to 3 pairs of one
// row (3 heads x 8 keys of accumulators: 24 of the 32 vector registers)
template <bool kTail>
void scores(const float* const* q, const float* k, const float* const* bias, int64_t P, int64_t whole, int64_t d,
                 float scaling, float* s, int64_t stride, vf* mv, int64_t ahead) {
  std::vector<float*> si(P);
  for (int64_t i = 0; i < P; ++i) si[i] = s + i * stride;
  by_rows(bias, P, whole, 3, [&](int64_t j0, int64_t j1, int64_t i, int G) {
    switch (G) {
      case 3: scores_heads<3, kTail>(q + i, k, bias[i], j0, j1, d, scaling, si.data() + i, mv + i, ahead); break;
      case 2: scores_heads<2, kTail>(q + i, k, bias[i], j0, j1, d, scaling, si.data() + i, mv + i, ahead); break;
      default: scores_heads<1, kTail>(q + i, k, bias[i], j0, j1, d, scaling, si.data() + i, mv + i, ahead);
    }
  });
}

// Several (row, head) pairs over one key / value head: ``q[i]``, ``bias[i]`` [L], ``out[i]`` [d] per pair i < P; ``s``
// scratch [P, stride]. Each key block is read once for every pair (from memory once, then from the nearest cache),
// and each pair's arithmetic is the one-pair computation's, in the same order:
//   s_j = (q . k_j, 16 lanes then a fixed sum) * scaling + bias_j   (keys 16 at a time, the last L % 16 one by one)
//   m = max s_j;  e_j = exp(s_j - m) (one vectorized exp for every key);  den = sum of e_j, one after another;
//   out = (sum of e_j v_j, in key order, block after block) / den
void pairs(const float* const* q, const float* k, const float* v, const float* const* bias, float* const* out,
           int64_t P, int64_t length, int64_t d, float scaling, float* s, int64_t stride, int64_t ahead) {
  const float hidden = -std::numeric_limits<float>::infinity();
  const int64_t whole = length / kLanes * kLanes;  // keys scored 16 at a time
  std::vector<vf> mv(P, splat(hidden));  // the max in any order is the max
  if (d % kLanes == 0)
    scores<false>(q, k, bias, P, whole, d, scaling, s, stride, mv.data(), ahead);
  else
    scores<true>(q, k, bias, P, whole, d, scaling, s, stride, mv.data(), ahead);
  for (int64_t i = 0; i < P; ++i) {
    float* si = s + i * stride;
    const float* bi = bias[i];
    float m = hidden;
    for (int l = 0; l < kLanes; ++l) m = mv[i][l] > m ? mv[i][l] : m;
    for (int64_t j = whole; j < length; ++j) {
      si[j] = dot(q[i], k + j * d, d) * scaling + bi[j];
      if (bi[j] != hidden && si[j] > m) m = si[j];
    }
    for (int64_t j = length; j < stride; ++j) si[j] = 0.f;  // the padding lanes: computed below, never read
    for (int64_t j = 0; j < length; j += kLanes) {
      const vf e = vexp(load(si + j) - splat(m));
      vf b;
      if (j + kLanes <= length) {
        b = load(bi + j);
      } else {  // the last keys: lanes past L count as unseen
        float tail[kLanes];
        for (int l = 0; l < kLanes; ++l) tail[l] = j + l < length ? bi[j + l] : hidden;
        b = load(tail);
      }
      const vf kept = b != splat(hidden) ? e : vf{};  // a key the row does not see: 0 (NaN-free, as if skipped)
      __builtin_memcpy(si + j, &kept, sizeof(kept));
    }
    for (int64_t c = 0; c < d; ++c) out[i][c] = 0.f;
  }
  // den = sum of e_j in key order (the unseen add +0), for every pair at once: their chains of dependent additions
  // run side by side instead of one after another
  std::vector<float> den(P, 0.f);
  for (int64_t j = 0; j < length; ++j)
    for (int64_t i = 0; i < P; ++i) den[i] = den[i] + s[i * stride + j];
  // out = sum of e_j v_j, block after block, by up to 4 heads of one row at a time (they read the same keys);
  // then / den
  std::vector<const float*> e(P);
  for (int64_t i = 0; i < P; ++i) e[i] = s + i * stride;
  by_rows(bias, P, length, 4, [&](int64_t j0, int64_t j1, int64_t i, int G) {
    weigh_heads(e.data() + i, G, v, bias[i], j0, j1, d, out + i, ahead);
  });
  for (int64_t i = 0; i < P; ++i)
    for (int64_t c = 0; c < d; ++c) out[i][c] = out[i][c] / den[i];
}

}  // namespace

torch::Tensor attention(torch::Tensor qkv, torch::Tensor kbuf, torch::Tensor vbuf, torch::Tensor bias,
                        int64_t heads, double scaling) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.scalar_type() == torch::kFloat32, "attention: qkv must be [T, H, d] float32");
  TORCH_CHECK(kbuf.dim() == 4 && kbuf.size(0) == 1 && kbuf.sizes() == vbuf.sizes() &&
                  kbuf.scalar_type() == torch::kFloat32 && vbuf.scalar_type() == torch::kFloat32,
              "attention: kbuf / vbuf must be [1, kv_heads, C, d] float32");
  TORCH_CHECK(bias.dim() == 2 && bias.size(0) == qkv.size(0) && bias.size(1) <= kbuf.size(2) &&
                  bias.scalar_type() == torch::kFloat32, "attention: bias must be [T, L <= C] float32");
  const int64_t T = qkv.size(0), d = qkv.size(2), kvh = kbuf.size(1), C = kbuf.size(2), L = bias.size(1);
  TORCH_CHECK(kbuf.size(3) == d && heads % kvh == 0 && qkv.size(1) >= heads, "attention: head shapes disagree");
  qkv = qkv.contiguous();
  kbuf = kbuf.contiguous();
  vbuf = vbuf.contiguous();
  bias = bias.contiguous();
  auto out = torch::empty({T, heads * d}, qkv.options());
  const float* qp = qkv.data_ptr<float>();
  const float* kp = kbuf.data_ptr<float>();
  const float* vp = vbuf.data_ptr<float>();
  const float* bp = bias.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t stride_q = qkv.size(1) * d, group = heads / kvh;
  const float scale = static_cast<float>(scaling);
  const int64_t ahead = prefetch_keys.load(std::memory_order_relaxed);
  // units (kv head, row, head in its group), kv head first: a thread's units of one kv head share its key reads
  const int64_t per_kv = T * group;
  at::parallel_for(0, kvh * per_kv, 1, [&](int64_t a, int64_t b) {
    const int64_t stride = (L + kLanes - 1) / kLanes * kLanes + kLanes;
    thread_local std::vector<float> scratch;  // reused across calls: no page faults for a long cache's scores
    std::vector<const float*> qs, bs;
    std::vector<float*> os;
    for (int64_t lo = a; lo < b;) {
      // up to kPass units of one kv head per pass (their scores: kPass x L floats of scratch, whatever the rows)
      const int64_t g = lo / per_kv, end = (g + 1) * per_kv < b ? (g + 1) * per_kv : b;
      const int64_t hi = end - lo > kPass ? lo + kPass : end;
      qs.clear(), bs.clear(), os.clear();
      for (int64_t u = lo; u < hi; ++u) {
        const int64_t t = (u % per_kv) / group, h = g * group + u % group;
        qs.push_back(qp + t * stride_q + h * d);
        bs.push_back(bp + t * L);
        os.push_back(op + (t * heads + h) * d);
      }
      if (scratch.size() < static_cast<size_t>((hi - lo) * stride)) scratch.resize((hi - lo) * stride);
      pairs(qs.data(), kp + g * C * d, vp + g * C * d, bs.data(), os.data(), hi - lo, L, d, scale, scratch.data(),
            stride, ahead);
      lo = hi;
    }
  });
  return out;
}

// calls prefetch keys and values ``keys`` keys ahead of their reads from now on (0: none); returns the previous value
int64_t set_prefetch(int64_t keys) {
  return prefetch_keys.exchange(keys < 0 ? 0 : keys > 4096 ? 4096 : keys);
}

TORCH_LIBRARY_FRAGMENT(retrospec, m) {
  m.def("attention(Tensor qkv, Tensor kbuf, Tensor vbuf, Tensor bias, int heads, float scaling) -> Tensor");
}
TORCH_LIBRARY_IMPL(retrospec, CPU, m) { m.impl("attention", &attention); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attention", &attention, "rows' attention (see the header)");
  m.def("set_prefetch", &set_prefetch, "calls prefetch keys and values this many keys ahead of their reads (0: none)");
}
