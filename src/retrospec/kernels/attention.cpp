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
//   s_j = (q . k_j, kLanes lanes then a fixed sum) * scaling + bias_j  for the keys the row sees (skipped otherwise)
//     (kLanes: the CPU's vector, 16 floats with AVX-512, 8 with AVX2, else 4; the products summed by fused
//     multiply-adds in the AVX-512 and AVX2 builds, in every path: a build's arithmetic is fixed by its width)
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
// distance the caller sets (``set_prefetch``; 0: none), by the first units that read the block: one stream a thread,
// which the hardware prefetcher alone left at about two thirds of the rate the weights' matmuls read memory at. A
// prefetch changes no arithmetic.
#ifndef RETROSPEC_ATTENTION_CORE_ONLY  // defined by the test that builds the core alone for each vector width
#include <torch/extension.h>
#include <ATen/Parallel.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

#define INLINE __attribute__((always_inline)) inline  // every helper: its vectors stay in registers

// The vector: the CPU's own width, so the compiler never splits one (a split vector went through memory: several
// times slower); kScoreHeads / kWeighVecs: how many query heads ``scores`` and feature vectors ``weigh`` keep in
// registers at once (AVX-512 has 32 vector registers, the others 16).
#if defined(__AVX512F__)
#define RS_LANES 16
constexpr int kScoreHeads = 3, kWeighVecs = 4;
#elif defined(__AVX2__) && defined(__FMA__)
#define RS_LANES 8
constexpr int kScoreHeads = 1, kWeighVecs = 2;
#else
#define RS_LANES 4
constexpr int kScoreHeads = 2, kWeighVecs = 2;
#endif
constexpr int kLanes = RS_LANES;
std::atomic<int64_t> prefetch_keys{64};  // keys ahead of its reads a call prefetches keys and values (0: none)

// The cache lines of [p, p + bytes) into L2 (a hint: never faults, changes nothing computed).
INLINE void prefetch_l2(const float* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b, 0, 2);
}
typedef float vf __attribute__((vector_size(4 * RS_LANES)));
typedef int vi __attribute__((vector_size(4 * RS_LANES)));

#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, vi{__VA_ARGS__})
#endif

INLINE vf load(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

#if RS_LANES == 16  // a broadcast (vf{} + x would add: not x where x is -0)
INLINE vf splat(float x) { return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
#elif RS_LANES == 8
INLINE vf splat(float x) { return vf{x, x, x, x, x, x, x, x}; }
#else
INLINE vf splat(float x) { return vf{x, x, x, x}; }
#endif

// a * b + c rounded once where the build fuses multiply-adds (AVX-512, AVX2), in every path below (the vector lanes
// and the scalar tails alike), else rounded twice everywhere: either way a key's bits are the same on whichever path
// sums it.
// ``in_register``: a vector loaded once and kept in a register for the several multiply-adds that read it (the
// compiler would fold the load into each of them: one load per multiply-add, which bounded both loops).
#if defined(__AVX512F__)
INLINE vf fma(vf a, vf b, vf c) { return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
INLINE float fma1(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
INLINE void in_register(vf& x) { __asm__("" : "+v"(x)); }
#elif RS_LANES == 8
INLINE vf fma(vf a, vf b, vf c) { return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
INLINE float fma1(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
INLINE void in_register(vf& x) { __asm__("" : "+x"(x)); }
#else
INLINE vf fma(vf a, vf b, vf c) { return a * b + c; }  // built with -ffp-contract=off: never fused
INLINE float fma1(float a, float b, float c) { return a * b + c; }
INLINE void in_register(vf&) {}
#endif

// One key's score lanes -> their sum, by the fixed tree acc[l] += acc[l + w] for w = kLanes / 2, ..., 2, 1.
INLINE float dot(const float* a, const float* b, int64_t d) {
  float acc[kLanes] = {0};  // lane l: inputs l, l + kLanes, l + 2 kLanes, ... in order
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] = fma1(a[i + l], b[i + l], acc[l]);
  for (int64_t l = 0; i + l < d; ++l) acc[l] = fma1(a[i + l], b[i + l], acc[l]);
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] = acc[l] + acc[l + w];
  return acc[0];
}

// ``dot``'s lanes for N keys and G query heads at once (acc[g][j]: key j, head g): every key vector is loaded once
// for the G heads; ``kTail``: d not a multiple of kLanes, the last inputs lane by lane as ``dot`` adds them (without
// one the accumulators never leave the registers).
template <int G, int N, bool kTail>
INLINE void lanes(const float* const* q, const float* k, int64_t d, vf (*acc)[N]) {
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < N; ++j) acc[g][j] = vf{};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    vf qv[G];
    for (int g = 0; g < G; ++g) qv[g] = load(q[g] + i);
    for (int j = 0; j < N; ++j) {
      vf kv = load(k + j * d + i);
      in_register(kv);  // one load for the G heads
      for (int g = 0; g < G; ++g) acc[g][j] = fma(qv[g], kv, acc[g][j]);
    }
  }
  if (kTail && i < d) {
    float part[kLanes];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < N; ++j) {
        __builtin_memcpy(part, &acc[g][j], sizeof(part));
        for (int64_t l = 0; i + l < d; ++l) part[l] = fma1(q[g][i + l], k[j * d + i + l], part[l]);
        __builtin_memcpy(&acc[g][j], part, sizeof(part));
      }
  }
}

// ``dot``'s tree over the lanes of kKeys keys at once, as a transposed reduction: tree(a) lane j = key j's sum
// (lanes 0..7 with 16 lanes, every lane otherwise).
#if RS_LANES == 16
constexpr int kKeys = 8;
INLINE vf tree(const vf* a) {
  vf b[4], c[2];
  for (int m = 0; m < 4; ++m)  // lanes l + (l + 8): keys 2m | 2m + 1 in the halves
    b[m] = SHUFFLE(a[2 * m], a[2 * m + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUFFLE(a[2 * m], a[2 * m + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int m = 0; m < 2; ++m)  // + 4: keys 4m .. 4m + 3 in the quarters
    c[m] = SHUFFLE(b[2 * m], b[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           SHUFFLE(b[2 * m], b[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const vf e = SHUFFLE(c[0], c[1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               SHUFFLE(c[0], c[1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return SHUFFLE(e, e, 0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14) +
         SHUFFLE(e, e, 1, 3, 5, 7, 9, 11, 13, 15, 1, 3, 5, 7, 9, 11, 13, 15);
}
#elif RS_LANES == 8
constexpr int kKeys = 8;
INLINE vf tree(const vf* a) {
  vf b[4], c[2];
  for (int m = 0; m < 4; ++m)  // lanes l + (l + 4): keys 2m | 2m + 1 in the halves
    b[m] = SHUFFLE(a[2 * m], a[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           SHUFFLE(a[2 * m], a[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int m = 0; m < 2; ++m)  // + 2: keys 4m .. 4m + 3 in the quarters
    c[m] = SHUFFLE(b[2 * m], b[2 * m + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           SHUFFLE(b[2 * m], b[2 * m + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return SHUFFLE(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14) + SHUFFLE(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#else
constexpr int kKeys = 4;
INLINE vf tree(const vf* a) {
  vf b[2];
  for (int m = 0; m < 2; ++m)  // lanes l + (l + 2): keys 2m | 2m + 1 in the halves
    b[m] = SHUFFLE(a[2 * m], a[2 * m + 1], 0, 1, 4, 5) + SHUFFLE(a[2 * m], a[2 * m + 1], 2, 3, 6, 7);
  return SHUFFLE(b[0], b[1], 0, 2, 4, 6) + SHUFFLE(b[0], b[1], 1, 3, 5, 7);
}
#endif

// kLanes keys' dots for G query heads, each key's bits ``dot``'s: out[g] lane j = q[g] . k_j.
template <int G, bool kTail>
INLINE void dots(const float* const* q, const float* k, int64_t d, vf* out) {
  vf acc[G][kKeys];
  lanes<G, kKeys, kTail>(q, k, d, acc);
#if RS_LANES == 16
  vf hi[G][kKeys];
  lanes<G, kKeys, kTail>(q, k + kKeys * d, d, hi);
  for (int g = 0; g < G; ++g)  // keys 0..7 | 8..15
    out[g] = SHUFFLE(tree(acc[g]), tree(hi[g]), 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
#else
  for (int g = 0; g < G; ++g) out[g] = tree(acc[g]);
#endif
}

// exp(x) for x <= 0, kLanes at a time (Cephes' expf: x = n ln 2 + r, a degree-7 polynomial in r, times 2^n); below
// -87 (under float's smallest normal) it is 0. Every value goes through here, so a key's e_j is the same wherever
// it sits.
INLINE vf vexp(vf x) {
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
// in order, of e[g][j] v_j[0 .. n): F vectors of kLanes features in registers (loaded from and stored back to ``out``:
// exact), the last n - kLanes F features lane by lane; each value vector is loaded once for the G heads. Called for
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
  const float* ep[G];
  for (int g = 0; g < G; ++g) ep[g] = e[g];
  for (int64_t j = j0; j < j1; ++j) {
    if (ahead) prefetch_l2(v + (j + ahead) * d + i0, n * int64_t(sizeof(float)));
    if (bias[j] == hidden) continue;
    const float* vj = v + j * d + i0;
    vf ev[G];
    for (int g = 0; g < G; ++g) ev[g] = splat(ep[g][j]);
    for (int c = 0; c < F; ++c) {
      vf vv = load(vj + c * kLanes);
      in_register(vv);  // one load for the G heads
      for (int g = 0; g < G; ++g) acc[g][c] = fma(ev[g], vv, acc[g][c]);
    }
    for (int64_t l = 0; l < tail; ++l)
      for (int g = 0; g < G; ++g) rest[g][l] = fma1(ep[g][j], vj[F * kLanes + l], rest[g][l]);
  }
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < F; ++c) __builtin_memcpy(out[g] + i0 + c * kLanes, &acc[g][c], sizeof(vf));
    for (int64_t l = 0; l < tail; ++l) out[g][i0 + F * kLanes + l] = rest[g][l];
  }
}

template <int G>
void weigh_features(const float* const* e, const float* v, const float* bias, int64_t j0, int64_t j1, int64_t d,
                    float* const* out, int64_t ahead) {
  constexpr int64_t at_once = kWeighVecs * kLanes;  // features in registers (64 with AVX-512), keys in order
  for (int64_t i0 = 0; i0 < d; i0 += at_once) {
    const int64_t n = d - i0 < at_once ? d - i0 : at_once;
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

// s[g][j] = q[g] . k_j * scaling + bias[j] for G heads of one row (one ``bias``) and keys [j0, j1) (multiples of
// kLanes), kLanes at a time (``dots``); mv[g]: the lane-wise max of the seen scores.
template <int G, bool kTail>
void scores_heads(const float* const* q, const float* k, const float* bias, int64_t j0, int64_t j1, int64_t d,
                  float scaling, float* const* s, vf* mv, int64_t ahead) {
  const float hidden = -std::numeric_limits<float>::infinity();
  for (int64_t j = j0; j < j1; j += kLanes) {
    vf dj[G];  // keys j .. j + kLanes - 1
    if (ahead) prefetch_l2(k + (j + ahead) * d, kLanes * d * int64_t(sizeof(float)));
    dots<G, kTail>(q, k + j * d, d, dj);
    const vf b = load(bias + j);
    for (int g = 0; g < G; ++g) {
      const vf sv = dj[g] * splat(scaling) + b;
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

// ``scores_heads`` for every pair over the first ``whole`` keys (a multiple of kLanes), by runs of up to kScoreHeads
// pairs of one row (with AVX-512 3 heads x 8 keys of accumulators: 24 of the 32 vector registers)
template <bool kTail>
void scores(const float* const* q, const float* k, const float* const* bias, int64_t P, int64_t whole, int64_t d,
                 float scaling, float* s, int64_t stride, vf* mv, int64_t ahead) {
  std::vector<float*> si(P);
  for (int64_t i = 0; i < P; ++i) si[i] = s + i * stride;
  by_rows(bias, P, whole, kScoreHeads, [&](int64_t j0, int64_t j1, int64_t i, int G) {
    const int64_t first = i ? 0 : ahead;  // the block's first units prefetch for every unit after them
    switch (G) {
      case 3: scores_heads<3, kTail>(q + i, k, bias[i], j0, j1, d, scaling, si.data() + i, mv + i, first); break;
      case 2: scores_heads<2, kTail>(q + i, k, bias[i], j0, j1, d, scaling, si.data() + i, mv + i, first); break;
      default: scores_heads<1, kTail>(q + i, k, bias[i], j0, j1, d, scaling, si.data() + i, mv + i, first);
    }
  });
}

// Several (row, head) pairs over one key / value head: ``q[i]``, ``bias[i]`` [L], ``out[i]`` [d] per pair i < P; ``s``
// scratch [P, stride]. Each key block is read once for every pair (from memory once, then from the nearest cache),
// and each pair's arithmetic is the one-pair computation's, in the same order:
//   s_j = (q . k_j, kLanes lanes then a fixed sum) * scaling + bias_j   (kLanes keys at a time, the last one by one)
//   m = max s_j;  e_j = exp(s_j - m) (one vectorized exp for every key);  den = sum of e_j, one after another;
//   out = (sum of e_j v_j, in key order, block after block) / den
void pairs(const float* const* q, const float* k, const float* v, const float* const* bias, float* const* out,
           int64_t P, int64_t length, int64_t d, float scaling, float* s, int64_t stride, int64_t ahead) {
  const float hidden = -std::numeric_limits<float>::infinity();
  const int64_t whole = length / kLanes * kLanes;  // keys scored kLanes at a time
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
    weigh_heads(e.data() + i, G, v, bias[i], j0, j1, d, out + i, i ? 0 : ahead);  // the first prefetch for all
  });
  for (int64_t i = 0; i < P; ++i)
    for (int64_t c = 0; c < d; ++c) out[i][c] = out[i][c] / den[i];
}

}  // namespace

#ifndef RETROSPEC_ATTENTION_CORE_ONLY

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
#endif
