// radixkv's CPU kernels: paged attention that reads K/V in place from the pool (decode and prefill),
// and the fused elementwise steps of a Llama layer (RMSNorm, RoPE + KV store, SwiGLU).
//
// Decode: each request's single query row attends to its K/V through its slot list (no gather into a
// padded batch, no padding).
//
// Shapes (all contiguous):
//   q:          [B, H, D]        float32 / bfloat16 / float16
//   k_pool:     [S, Hkv, D]      same dtype as q
//   v_pool:     [S, Hkv, D]
//   kv_indices: [nnz]  int64     slots of request b are kv_indices[kv_indptr[b] : kv_indptr[b + 1]]
//   kv_indptr:  [B + 1] int64
//   out:        [B, H, D]        same dtype as q
// Query head h reads KV head h / (H / Hkv); each K and V row is read once for the whole query group
// (for groups of up to 3 query heads on the AVX2 path, which takes larger groups 3 heads at a time).
// Scores, softmax and the weighted sum of V are float32.
// Any dtype with a head_dim that is a multiple of 8 takes the float32 AVX2 path where the compiler
// targets AVX2 with FMA and F16C, AVX-512 CPUs included: there it beats a BF16 dot-product AVX-512
// kernel (it splits a long context across the threads), so there is none. Every other
// case (a head_dim that is not a multiple of 8, float64, a CPU without AVX2) takes the portable loops.
// Prefill has an AVX-512 BF16 path (bfloat16, head_dim 64 or 128) besides the AVX2 one.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <type_traits>
#include <limits>
#include <memory>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define RADIXKV_AVX512_BF16 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RADIXKV_AVX2 1
#endif
#if defined(RADIXKV_AVX512_BF16) || defined(RADIXKV_AVX2)
#include <immintrin.h>
#endif

namespace {

// n floats, left uninitialized: for serial scratch that is written whole before it is read, where a
// std::vector would zero it first (batch-8 decode attention's parts: 110 KB a layer).
inline std::unique_ptr<float[]> scratch_floats(int64_t n) { return std::unique_ptr<float[]>(new float[n]); }

// Grows a scratch buffer to at least n elements; it never shrinks, so a reused one stops faulting pages in.
template <typename V>
inline void grow(V& buf, size_t n) {
  if (buf.size() < n) buf.resize(n);
}

// ---- portable path ---------------------------------------------------------------------------

template <typename T>
void decode_portable(const T* q, const T* k, const T* v, const int64_t* idx, const int64_t* indptr, T* out,
                     int64_t batch, int64_t heads, int64_t kv_heads, int64_t d, float scale) {
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), acc(group * d), row(d), scores, mx(group), sum(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      const int64_t start = indptr[b], len = indptr[b + 1] - start;
      const T* qb = q + (b * heads + h * group) * d;  // the group's query rows are consecutive
      for (int64_t i = 0; i < group * d; ++i) qf[i] = static_cast<float>(qb[i]) * scale;
      scores.assign(group * len, 0.f);
      std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
      std::fill(sum.begin(), sum.end(), 0.f);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {  // scores[g, t] = q[g] . k[t]
        const T* kr = k + (idx[start + t] * kv_heads + h) * d;
        for (int64_t i = 0; i < d; ++i) row[i] = static_cast<float>(kr[i]);
        for (int64_t g = 0; g < group; ++g) {
          float s = 0.f;
          for (int64_t i = 0; i < d; ++i) s += qf[g * d + i] * row[i];
          scores[g * len + t] = s;
          mx[g] = std::max(mx[g], s);
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t t = 0; t < len; ++t) {
          scores[g * len + t] = std::exp(scores[g * len + t] - mx[g]);
          sum[g] += scores[g * len + t];
        }
      for (int64_t t = 0; t < len; ++t) {  // acc[g] += p[g, t] * v[t]
        const T* vr = v + (idx[start + t] * kv_heads + h) * d;
        for (int64_t i = 0; i < d; ++i) row[i] = static_cast<float>(vr[i]);
        for (int64_t g = 0; g < group; ++g)
          for (int64_t i = 0; i < d; ++i) acc[g * d + i] += scores[g * len + t] * row[i];
      }
      T* ob = out + (b * heads + h * group) * d;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < d; ++i) ob[g * d + i] = static_cast<T>(acc[g * d + i] / sum[g]);
    }
  });
}

// ---- AVX-512 bfloat16 path -------------------------------------------------------------------

#ifdef RADIXKV_AVX512_BF16
// exp(x) for x <= 0: 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2; relative error about 2e-7.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Prefill chunks (any number of query rows per request, causal after the request's cached prefix):
// query i of request r sees KV positions 0 .. prefix_r + i, prefix_r = kv_len_r - q_len_r.
// K and V of each (request, KV head) are first repacked into BF16 pairs, so that both products are
// plain dot-product instructions with no horizontal sums:
//   kt[tile][c][j] = (k[16 tile + j][2c], k[16 tile + j][2c + 1])   scores of 16 tokens per row
//   vp[m][e]       = (v[2m][e], v[2m + 1][e])                         output dims 16 at a time
// then each task (request, KV head, block of kQueryBlock queries) computes its rows' scores, an exact
// float32 softmax, and P.V with P rounded to bfloat16 (as the reference's bmm in bfloat16 does).
constexpr int64_t kQueryBlock = 16;

inline uint32_t pair_of(const uint16_t* a, const uint16_t* b) {
  return static_cast<uint32_t>(*a) | (static_cast<uint32_t>(*b) << 16);
}

// r[j] = row j of a 16 x 16 matrix of 32-bit words -> r[c] = its column c.
inline void transpose16x16(__m512i (&r)[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {  // within each 128-bit lane: pairs of rows interleaved, then fours
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // b[4i + q], lane L: column 4L + q of rows 4i .. 4i + 3
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int q = 0; q < 4; ++q) {  // column 4L + q: lane L of b[q], b[4 + q], b[8 + q], b[12 + q]
    const __m512i x = _mm512_shuffle_i32x4(b[q], b[4 + q], 0x44), y = _mm512_shuffle_i32x4(b[q], b[4 + q], 0xEE);
    const __m512i z = _mm512_shuffle_i32x4(b[8 + q], b[12 + q], 0x44), w = _mm512_shuffle_i32x4(b[8 + q], b[12 + q], 0xEE);
    r[q] = _mm512_shuffle_i32x4(x, z, 0x88);
    r[4 + q] = _mm512_shuffle_i32x4(x, z, 0xDD);
    r[8 + q] = _mm512_shuffle_i32x4(y, w, 0x88);
    r[12 + q] = _mm512_shuffle_i32x4(y, w, 0xDD);
  }
}

// K and V of KV head h for tokens slots[0:len) in the layouts above (d a multiple of 32). Whole tiles of 16
// tokens go 16 x 16 words at a time through a register transpose and V pairs 32 dimensions at a time through
// a word interleave; the last, partial tile and an odd last token go element by element (element by
// element throughout, packing would be a large share of a prefill step's attention).
void pack_kv(const uint16_t* k, const uint16_t* v, const int64_t* slots, int64_t len, int64_t h, int64_t row_stride,
             int64_t d, uint32_t* kt, uint32_t* vp) {
  const int64_t tiles = (len + 15) / 16, half = d / 2, full = len / 16;
  for (int64_t tile = 0; tile < full; ++tile) {
    uint32_t* dst = kt + tile * 16 * half;
    for (int64_t c0 = 0; c0 < half; c0 += 16) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j)
        r[j] = _mm512_loadu_si512(k + slots[tile * 16 + j] * row_stride + h * d + 2 * c0);
      transpose16x16(r);
      for (int c = 0; c < 16; ++c) _mm512_storeu_si512(dst + (c0 + c) * 16, r[c]);
    }
  }
  if (full < tiles) {
    uint32_t* dst = kt + full * 16 * half;
    std::fill(dst, dst + 16 * half, 0u);
    for (int64_t t = full * 16; t < len; ++t) {
      const uint16_t* kr = k + slots[t] * row_stride + h * d;
      for (int64_t c = 0; c < half; ++c) dst[c * 16 + t % 16] = pair_of(kr + 2 * c, kr + 2 * c + 1);
    }
  }
  alignas(64) int16_t lo_idx[32], hi_idx[32];  // words (a[e], b[e]) for e = 0..15, then 16..31
  for (int i = 0; i < 16; ++i) {
    lo_idx[2 * i] = static_cast<int16_t>(i), lo_idx[2 * i + 1] = static_cast<int16_t>(32 + i);
    hi_idx[2 * i] = static_cast<int16_t>(16 + i), hi_idx[2 * i + 1] = static_cast<int16_t>(48 + i);
  }
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int64_t m = 0; m < len / 2; ++m) {
    const uint16_t* v0 = v + slots[2 * m] * row_stride + h * d;
    const uint16_t* v1 = v + slots[2 * m + 1] * row_stride + h * d;
    for (int64_t e = 0; e < d; e += 32) {
      const __m512i a = _mm512_loadu_si512(v0 + e), b = _mm512_loadu_si512(v1 + e);
      _mm512_storeu_si512(vp + m * d + e, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(vp + m * d + e + 16, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
  if (len % 2 == 1) {
    const int64_t m = len / 2;
    const uint16_t* v0 = v + slots[2 * m] * row_stride + h * d;
    for (int64_t e = 0; e < d; ++e) vp[m * d + e] = static_cast<uint32_t>(v0[e]);
  }
}

// Scores of 4 query rows (qr: their BF16 pairs) against NT consecutive tiles of 16 packed tokens (kp: the
// first tile, tiles 16 * half pairs apart), scaled, into rows ld apart of dst (the first nr rows). Each
// score sums even pairs in one accumulator and odd ones in another, added at the end; NT tiles share each
// query broadcast, so a step loads 2 NT + 8 vectors for 8 NT dot products (with one tile 10 for 8).
template <int64_t half, int NT>
inline void score_tiles(const uint32_t* const* qr, const uint32_t* kp, int64_t nr, float scale, float* dst,
                        int64_t ld) {
  __m512 a[4][NT][2];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) a[j][t][0] = a[j][t][1] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t c = 0; c < half; c += 2) {
    __m512bh k0[NT], k1[NT];
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      k0[t] = (__m512bh)_mm512_loadu_si512(kp + t * 16 * half + c * 16);
      k1[t] = (__m512bh)_mm512_loadu_si512(kp + t * 16 * half + (c + 1) * 16);
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512bh q0 = (__m512bh)_mm512_set1_epi32(qr[j][c]), q1 = (__m512bh)_mm512_set1_epi32(qr[j][c + 1]);
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) {
        a[j][t][0] = _mm512_dpbf16_ps(a[j][t][0], q0, k0[t]);
        a[j][t][1] = _mm512_dpbf16_ps(a[j][t][1], q1, k1[t]);
      }
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t)
      if (j < nr) _mm512_storeu_ps(dst + j * ld + t * 16, _mm512_mul_ps(_mm512_add_ps(a[j][t][0], a[j][t][1]), s));
}

template <int64_t d>  // head_dim at compile time: the loops unroll and the accumulators stay in registers
void prefill_bf16_avx512(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int64_t* kv_idx,
                         const int64_t* kv_indptr, const int64_t* qo_indptr, uint16_t* out, int64_t reqs,
                         int64_t heads, int64_t kv_heads, float scale) {
  constexpr int64_t half = d / 2, vecs = d / 16;
  const int64_t group = heads / kv_heads, row_stride = kv_heads * d;
  std::vector<int64_t> kt_off(reqs * kv_heads + 1, 0), vp_off(reqs * kv_heads + 1, 0);
  for (int64_t r = 0; r < reqs; ++r)
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t len = kv_indptr[r + 1] - kv_indptr[r], i = r * kv_heads + h;
      kt_off[i + 1] = kt_off[i] + (len + 15) / 16 * 16 * half;
      vp_off[i + 1] = vp_off[i] + (len + 1) / 2 * d;
    }
  // The packed K/V and each worker's scores are kept between calls (per calling thread, grown, never freed):
  // allocated afresh, a step's 30 calls faulted in some 7 MB of pages each.
  // The workers use the pointers: inside their lambdas the names would be each worker's own thread_locals.
  static thread_local std::vector<uint32_t> kt_buf, vp_buf;
  grow(kt_buf, kt_off.back());
  grow(vp_buf, vp_off.back());
  uint32_t* const kt = kt_buf.data();
  uint32_t* const vp = vp_buf.data();
  at::parallel_for(0, reqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / kv_heads, h = i % kv_heads;
      pack_kv(k, v, kv_idx + kv_indptr[r], kv_indptr[r + 1] - kv_indptr[r], h, row_stride, d, kt + kt_off[i],
              vp + vp_off[i]);
    }
  });
  struct Task { int64_t r, h, i0, i1; };
  std::vector<Task> tasks;
  for (int64_t r = 0; r < reqs; ++r)
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t i0 = 0; i0 < qo_indptr[r + 1] - qo_indptr[r]; i0 += kQueryBlock)
        tasks.push_back({r, h, i0, std::min(i0 + kQueryBlock, qo_indptr[r + 1] - qo_indptr[r])});
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    static thread_local std::vector<float> sbuf;
    static thread_local std::vector<uint32_t> pbuf;
    static thread_local std::vector<int64_t> count;
    for (int64_t ti = begin; ti < end; ++ti) {
      const Task& tk = tasks[ti];
      const int64_t len = kv_indptr[tk.r + 1] - kv_indptr[tk.r], qlen = qo_indptr[tk.r + 1] - qo_indptr[tk.r];
      const int64_t prefix = len - qlen, rows = (tk.i1 - tk.i0) * group;
      const int64_t visible_max = prefix + tk.i1;  // tokens the block's last query sees
      const int64_t tiles = (visible_max + 15) / 16, pairs = (visible_max + 1) / 2;
      const uint32_t* ktp = kt + kt_off[tk.r * kv_heads + tk.h];
      const uint32_t* vpp = vp + vp_off[tk.r * kv_heads + tk.h];
      grow(sbuf, rows * tiles * 16 + 32);  // no clearing: every value read is written first (or masked)
      grow(pbuf, rows * pairs + 1);
      grow(count, rows);
      auto qrow = [&](int64_t row) {  // query row -> its bf16 pairs
        const int64_t i = tk.i0 + row / group, g = row % group;
        return reinterpret_cast<const uint32_t*>(q + ((qo_indptr[tk.r] + i) * heads + tk.h * group + g) * d);
      };
      for (int64_t row = 0; row < rows; ++row) count[row] = prefix + tk.i0 + row / group + 1;
      // scores, four rows at a time against NT tiles of 16 tokens (two accumulators each, alternate pairs)
      for (int64_t row0 = 0; row0 < rows; row0 += 4) {
        const int64_t nr = std::min<int64_t>(4, rows - row0);
        const uint32_t* qr[4];
        for (int64_t j = 0; j < 4; ++j) qr[j] = qrow(row0 + std::min(j, nr - 1));
        const int64_t row_tiles = (count[row0 + nr - 1] + 15) / 16;
        float* srow = sbuf.data() + row0 * tiles * 16;  // row0's scores; each row tiles * 16 apart
        int64_t tile = 0;
        for (; tile + 3 <= row_tiles; tile += 3)
          score_tiles<half, 3>(qr, ktp + tile * 16 * half, nr, scale, srow + tile * 16, tiles * 16);
        for (; tile < row_tiles; ++tile)
          score_tiles<half, 1>(qr, ktp + tile * 16 * half, nr, scale, srow + tile * 16, tiles * 16);
      }
      // exact softmax per row over its visible tokens; P as bf16 pairs, unnormalized
      std::vector<float> inv_sum(rows);
      for (int64_t row = 0; row < rows; ++row) {
        float* sr = sbuf.data() + row * tiles * 16;
        const int64_t n = count[row];
        __m512 vm = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        int64_t t = 0;
        for (; t + 16 <= n; t += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(sr + t));
        float m = _mm512_reduce_max_ps(vm);
        for (int64_t u = t; u < n; ++u) m = std::max(m, sr[u]);
        const __m512 mv = _mm512_set1_ps(m);
        __m512 total = _mm512_setzero_ps();
        for (t = 0; t < n; t += 16) {
          const __mmask16 mask = n - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t)) - 1);
          const __m512 p = _mm512_maskz_mov_ps(mask, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sr + t), mv)));
          total = _mm512_add_ps(total, p);
          _mm512_storeu_ps(sr + t, p);  // zeros past the visible tokens
        }
        inv_sum[row] = 1.f / _mm512_reduce_add_ps(total);
        uint32_t* pr = pbuf.data() + row * pairs;
        const int64_t row_pairs = (n + 1) / 2;
        for (t = 0; t < row_pairs; t += 16) {  // 32 probabilities -> 16 bf16 pairs (zero past n: stored above)
          const __m512 lo = _mm512_loadu_ps(sr + 2 * t), hi = _mm512_loadu_ps(sr + 2 * t + 16);
          const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
          const __mmask16 mask = row_pairs - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (row_pairs - t)) - 1);
          _mm512_mask_storeu_epi32(pr + t, mask, both);
        }
        std::fill(pr + row_pairs, pr + pairs, 0u);  // a block's P.V runs to its longest row's last pair
      }
      // P.V, four rows at a time (sixteen accumulators at head_dim 64, to hide the instruction's latency)
      for (int64_t row0 = 0; row0 < rows; row0 += 4) {
        const int64_t nr = std::min<int64_t>(4, rows - row0);
        const uint32_t* p[4];
        for (int64_t j = 0; j < 4; ++j) p[j] = pbuf.data() + (row0 + std::min(j, nr - 1)) * pairs;
        const int64_t row_pairs = (count[row0 + nr - 1] + 1) / 2;
        __m512 a[4][vecs];
#pragma GCC unroll 8
        for (int64_t c = 0; c < vecs; ++c) a[0][c] = a[1][c] = a[2][c] = a[3][c] = _mm512_setzero_ps();
        for (int64_t m = 0; m < row_pairs; ++m) {
          __m512bh w[4];
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j) w[j] = (__m512bh)_mm512_set1_epi32(p[j][m]);
#pragma GCC unroll 8
          for (int64_t c = 0; c < vecs; ++c) {
            const __m512bh vv = (__m512bh)_mm512_loadu_si512(vpp + m * d + c * 16);
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) a[j][c] = _mm512_dpbf16_ps(a[j][c], w[j], vv);
          }
        }
        // Only constant indices into a (a runtime choice between rows' arrays kept them on the stack, stored
        // every iteration of the loop above): spill the sums once, then round each row.
        alignas(64) float sums[4][d];
#pragma GCC unroll 8
        for (int64_t c = 0; c < vecs; ++c)
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j) _mm512_store_ps(sums[j] + c * 16, a[j][c]);
        for (int64_t j = 0; j < nr; ++j) {
          const int64_t row = row0 + j, i = tk.i0 + row / group, g = row % group;
          uint16_t* o = out + ((qo_indptr[tk.r] + i) * heads + tk.h * group + g) * d;
          const __m512 s = _mm512_set1_ps(inv_sum[row]);
          for (int64_t c = 0; c < vecs; c += 2) {
            const __m512 lo = _mm512_mul_ps(_mm512_load_ps(sums[j] + c * 16), s);
            const __m512 hi = _mm512_mul_ps(_mm512_load_ps(sums[j] + c * 16 + 16), s);
            _mm512_storeu_si512(o + c * 16, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
          }
        }
      }
    }
  });
}
#endif

// ---- AVX2 path: float32 arithmetic on any storage dtype ---------------------------------------
// For CPUs without 16-bit dot-product instructions: K/V rows are widened to float32 as they are read
// (bfloat16 by a shift, float16 by F16C) and every product is a float32 FMA. Scores, softmax and the
// weighted sum of V stay float32 until the output is rounded once to the storage dtype.

#ifdef RADIXKV_AVX2
// Loops over small arrays of vector registers (accumulators, a tile's vectors) are unrolled at the
// source: unrolled late, GCC keeps such an array in registers but still stores every element to the
// stack on each iteration, which made the FMA loops store-bound.
#define RADIXKV_UNROLL _Pragma("GCC unroll 16")
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

// exp(x) for x <= 88 (lanes below -87 give about 1e-38, callers mask what must be exactly 0): 2^n * p(r)
// with x = n ln2 + r, |r| <= ln2 / 2; relative error about 2e-7.
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Lanes t0 + j < n of a vector of 8 positions starting at t0.
inline __m256 lanes_below(int64_t t0, int64_t n) {
  const __m256i pos = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(t0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), pos));
}

// p[0:n] = exp(s[0:n] - max) in place, zeros in [n, padded); returns 1 / sum and, if asked, max.
// padded % 8 == 0, >= n.
inline float softmax_row(float* s, int64_t n, int64_t padded, float* max_out = nullptr) {
  __m256 vm = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + t));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vm);
  float m = lanes[0];
  for (int j = 1; j < 8; ++j) m = std::max(m, lanes[j]);
  for (; t < n; ++t) m = std::max(m, s[t]);
  if (max_out != nullptr) *max_out = m;
  const __m256 mv = _mm256_set1_ps(m);
  __m256 total = _mm256_setzero_ps();
  for (t = 0; t < padded; t += 8) {
    const __m256 p = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv)), lanes_below(t, n));
    total = _mm256_add_ps(total, p);
    _mm256_storeu_ps(s + t, p);
  }
  _mm256_store_ps(lanes, total);
  float sum = 0.f;
  for (int j = 0; j < 8; ++j) sum += lanes[j];
  return 1.f / sum;
}

// acc[r][c] += sum_{t < n} p[r][t] * row(t)[8c .. 8c + 8): the P.V loop that prefill (float32 rows) and
// decode (16-bit rows straight from the pool) share; row(t) returns a pointer that load8 reads. Each step
// holds the fewer of its R weights and C vectors in registers and streams the other, so R * C accumulators
// + min(R, C) + 1 fit the 16 registers (decode's 3 x 4 holding all 4 vectors would need 17, and would keep
// an accumulator on the stack). Either order sums each accumulator over t alike: the same bits.
template <int R, int C, typename Row>
inline void pv_accumulate(const float* const* p, int64_t n, Row row, __m256 (&acc)[R][C]) {
  for (int64_t t = 0; t < n; ++t) {
    const auto* vr = row(t);
    if constexpr (R < C) {
      __m256 w[R];
      RADIXKV_UNROLL
      for (int j = 0; j < R; ++j) w[j] = _mm256_broadcast_ss(p[j] + t);
      RADIXKV_UNROLL
      for (int c = 0; c < C; ++c) {
        const __m256 vv = load8(vr + 8 * c);
        RADIXKV_UNROLL
        for (int j = 0; j < R; ++j) acc[j][c] = _mm256_fmadd_ps(w[j], vv, acc[j][c]);
      }
    } else {
      __m256 vv[C];
      RADIXKV_UNROLL
      for (int c = 0; c < C; ++c) vv[c] = load8(vr + 8 * c);
      RADIXKV_UNROLL
      for (int j = 0; j < R; ++j) {
        const __m256 w = _mm256_broadcast_ss(p[j] + t);
        RADIXKV_UNROLL
        for (int c = 0; c < C; ++c) acc[j][c] = _mm256_fmadd_ps(w, vv[c], acc[j][c]);
      }
    }
  }
}

// acc[r][0:8C] += sum_{t0 <= t < t1} p[r][t] * v[t][0:8C] for R rows; v rows float32 with stride vs, acc
// float32 rows in memory. A tile's partial sums are stored and reloaded exactly, so tiling the tokens keeps
// the summation order (and the bits) of one pass over them.
template <int R, int C>
inline void pv_tile(const float* const* p, const float* v, int64_t vs, int64_t t0, int64_t t1, float* const* acc) {
  __m256 a[R][C];
  RADIXKV_UNROLL
  for (int j = 0; j < R; ++j)
    RADIXKV_UNROLL
    for (int c = 0; c < C; ++c) a[j][c] = _mm256_loadu_ps(acc[j] + 8 * c);
  const float* pt[R];
  RADIXKV_UNROLL
  for (int j = 0; j < R; ++j) pt[j] = p[j] + t0;
  pv_accumulate<R, C>(pt, t1 - t0, [&](int64_t t) { return v + (t0 + t) * vs; }, a);
  RADIXKV_UNROLL
  for (int j = 0; j < R; ++j)
    RADIXKV_UNROLL
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc[j] + 8 * c, a[j][c]);
}

template <typename T>
void widen_row(const T* src, float* dst, int64_t d) {
  for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
}

using PrefetchHint = decltype(_MM_HINT_T0);  // an enum in GCC's headers, an int in Clang's

template <PrefetchHint Hint = _MM_HINT_T0, typename T>
inline void prefetch_row(const T* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + b, Hint);
}

// Decode prefetches whole K rows, and each P.V pass its slice of the V rows, this many tokens ahead: slots
// need not be consecutive, so the hardware prefetcher cannot guess them, and without it the kernel waits on
// memory most of the time. These distances were the fastest of those tried (docs/experiments.md).
constexpr int64_t kDecodePrefetchK = 16, kDecodePrefetchV = 32;
// On AVX-512 CPUs the score pass also pulls whole V rows into L2 (hint T1), this many tokens ahead, so that
// the P.V passes' slices come from L2. On the AVX2-only CPUs tried (Zen 3) the same prefetch made decode
// slower, so it stays off there (docs/experiments.md).
#ifdef __AVX512F__
constexpr int64_t kDecodePrefetchVInScores = 32;
#else
constexpr int64_t kDecodePrefetchVInScores = 0;
#endif
constexpr int64_t kDecodePart = 256;   // most tokens per task: a long context splits across threads (flash-decoding)

// Tasks for a context of len tokens: enough of at most kDecodePart tokens, rounded up to a multiple of the
// threads (at most len, so none is empty), in sizes within one token of each other, so that a lone request
// keeps every thread busy: cut at kDecodePart instead, 1,025 tokens would make parts of 256 x 4 and 1, and
// at batch 1 one of two threads would take three of the five. At larger batches the requests' parts share
// the threads out anyway. The split depends on len alone, so a request gets the same output alone or in
// any batch.
inline int64_t decode_parts(int64_t len, int64_t threads) {
  const int64_t parts = std::max<int64_t>(1, (len + kDecodePart - 1) / kDecodePart);
  return std::min(std::max<int64_t>(len, 1), (parts + threads - 1) / threads * threads);
}

// Scores of HB query heads (rows qf[0..HB) of one KV head's group, float32, scaled) against 4 tokens
// (pool rows slot4[0..4) of k, which points at this KV head's slice of row 0): up to 12 dot products
// accumulate at once, each K vector widened once, in a register, for every head of the block, and each
// q vector loaded once per 8 dimensions. The loop is bound by loads, so q stays in registers (7 loads per
// 12 FMAs) rather than folded into every FMA (16 loads).
// s[h][0..4): head h's scores.
template <typename T, int HB>
inline void scores_4tok(const float* qf, int64_t d, const T* k, int64_t row, const int64_t* slot4, float* const* s) {
  const T* kr[4];
  RADIXKV_UNROLL
  for (int j = 0; j < 4; ++j) kr[j] = k + slot4[j] * row;
  __m256 a[HB][4];
  RADIXKV_UNROLL
  for (int h = 0; h < HB; ++h)
    RADIXKV_UNROLL
    for (int j = 0; j < 4; ++j) a[h][j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; c += 8) {
    __m256 qv[HB];
    RADIXKV_UNROLL
    for (int h = 0; h < HB; ++h) {
      qv[h] = _mm256_loadu_ps(qf + h * d + c);
      asm("" : "+x"(qv[h]));  // keeps q in a register: GCC otherwise folds its load into each of the 4 FMAs
    }
    RADIXKV_UNROLL
    for (int j = 0; j < 4; ++j) {
      const __m256 kv = load8(kr[j] + c);
      RADIXKV_UNROLL
      for (int h = 0; h < HB; ++h) a[h][j] = _mm256_fmadd_ps(qv[h], kv, a[h][j]);
    }
  }
  RADIXKV_UNROLL
  for (int h = 0; h < HB; ++h) {  // four horizontal sums as one 128-bit vector
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[h][0], a[h][1]), _mm256_hadd_ps(a[h][2], a[h][3]));
    _mm_storeu_ps(s[h], _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
  }
}

// acc[h][0:8C] = sum_t p[h][t] * v_t[0:8C] for HB query heads of one KV head, over the part's n tokens;
// v points at this KV head's first vector of the chunk in pool row 0 (rows slots[t] * row).
template <typename T, int HB, int C>
inline void pv_pass(const float* const* p, const T* v, int64_t row, const int64_t* slots, int64_t n, float* const* acc) {
  __m256 o[HB][C];
  RADIXKV_UNROLL
  for (int h = 0; h < HB; ++h)
    RADIXKV_UNROLL
    for (int c = 0; c < C; ++c) o[h][c] = _mm256_setzero_ps();
  pv_accumulate<HB, C>(p, n, [&](int64_t t) {
    if (t + kDecodePrefetchV < n) prefetch_row(v + slots[t + kDecodePrefetchV] * row, 8 * C * sizeof(T));
    return v + slots[t] * row;
  }, o);
  RADIXKV_UNROLL
  for (int h = 0; h < HB; ++h)
    RADIXKV_UNROLL
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc[h] + 8 * c, o[h][c]);
}

template <typename T, int HB>
void pv_heads(const float* const* p, const T* v, int64_t row, const int64_t* slots, int64_t n, int64_t d,
              float* const* acc) {
  for (int64_t c0 = 0; c0 < d; c0 += 32) {  // one 32-wide chunk of head_dim per pass: 12 accumulators at most
    float* o[HB];
    RADIXKV_UNROLL
    for (int h = 0; h < HB; ++h) o[h] = acc[h] + c0;
    switch (std::min<int64_t>(4, (d - c0) / 8)) {
      case 4: pv_pass<T, HB, 4>(p, v + c0, row, slots, n, o); break;
      case 3: pv_pass<T, HB, 3>(p, v + c0, row, slots, n, o); break;
      case 2: pv_pass<T, HB, 2>(p, v + c0, row, slots, n, o); break;
      default: pv_pass<T, HB, 1>(p, v + c0, row, slots, n, o); break;
    }
  }
}

// Rows of base, stride apart, of query heads qh .. qh + 2 (clamped to the last head: a block of fewer
// than 3 heads never touches the rows past its own).
inline std::array<float*, 3> head_rows(float* base, int64_t qh, int64_t heads, int64_t stride) {
  return {base + qh * stride, base + std::min(qh + 1, heads - 1) * stride, base + std::min(qh + 2, heads - 1) * stride};
}

// Attention of one query row per head over tokens slots[0:n) of one request, all heads: for each
// query head qh, m[qh] = its largest score, l[qh] = sum_t exp(s_t - m), acc[qh] = sum_t exp(s_t - m) v_t
// (unnormalized, so parts of one request merge exactly). qf: [H, D] float32, already scaled.
// Scores go 4 tokens at a time through every KV head (in blocks of up to 3 of its query heads), so each
// K row is read whole, once, while it is in L1 (going KV head by KV head over all tokens instead would read
// a third of every row per pass from memory). P.V goes KV head by KV head (its accumulators fill the
// registers); its rows come from L2 after the first pass. Both read the pool straight, widening 16-bit
// vectors in registers.
template <typename T>
void decode_part_avx2(const float* qf, const T* k, const T* v, const int64_t* slots, int64_t n, int64_t heads,
                      int64_t kv_heads, int64_t d, float* m, float* l, float* acc, std::vector<float>& scores) {
  const int64_t group = heads / kv_heads, row = kv_heads * d, padded = (n + 7) / 8 * 8;
  scores.resize(heads * padded);
  for (int64_t t0 = 0; t0 < padded; t0 += 4) {
    int64_t slot4[4];
    for (int j = 0; j < 4; ++j) {
      if (t0 + j + kDecodePrefetchK < n) prefetch_row(k + slots[t0 + j + kDecodePrefetchK] * row, row * sizeof(T));
      if (kDecodePrefetchVInScores > 0 && t0 + j + kDecodePrefetchVInScores < n)
        prefetch_row<_MM_HINT_T1>(v + slots[t0 + j + kDecodePrefetchVInScores] * row, row * sizeof(T));
      slot4[j] = slots[std::min(t0 + j, n - 1)];  // past the end: a repeat, masked in the softmax
    }
    for (int64_t qh = 0; qh < heads;) {  // blocks of up to 3 query heads that share a KV head
      const int64_t kh = qh / group, hb = std::min<int64_t>(3, (kh + 1) * group - qh);
      const auto s = head_rows(scores.data(), qh, heads, padded);
      float* st[3] = {s[0] + t0, s[1] + t0, s[2] + t0};
      if (hb == 3) scores_4tok<T, 3>(qf + qh * d, d, k + kh * d, row, slot4, st);
      else if (hb == 2) scores_4tok<T, 2>(qf + qh * d, d, k + kh * d, row, slot4, st);
      else scores_4tok<T, 1>(qf + qh * d, d, k + kh * d, row, slot4, st);
      qh += hb;
    }
  }
  for (int64_t qh = 0; qh < heads; ++qh) l[qh] = 1.f / softmax_row(scores.data() + qh * padded, n, padded, m + qh);
  for (int64_t qh = 0; qh < heads;) {
    const int64_t kh = qh / group, hb = std::min<int64_t>(3, (kh + 1) * group - qh);
    const auto p = head_rows(scores.data(), qh, heads, padded);
    const auto o = head_rows(acc, qh, heads, d);
    if (hb == 3) pv_heads<T, 3>(p.data(), v + kh * d, row, slots, n, d, o.data());
    else if (hb == 2) pv_heads<T, 2>(p.data(), v + kh * d, row, slots, n, d, o.data());
    else pv_heads<T, 1>(p.data(), v + kh * d, row, slots, n, d, o.data());
    qh += hb;
  }
}

// q_row: elements from one request's q [H, D] to the next's (H * D when q is contiguous; DecodeStack reads q
// in place from the fused qkv output).
template <typename T>
void decode_avx2(const T* q, int64_t q_row, const T* k, const T* v, const int64_t* idx, const int64_t* indptr,
                 T* out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t d, float scale) {
  std::vector<int64_t> first(batch + 1, 0);  // tasks of request b: first[b] .. first[b + 1]
  const int64_t threads = at::get_num_threads();
  for (int64_t b = 0; b < batch; ++b) first[b + 1] = first[b] + decode_parts(indptr[b + 1] - indptr[b], threads);
  const int64_t tasks = first[batch], hd = heads * d;
  const auto m = scratch_floats(tasks * heads), l = scratch_floats(tasks * heads), acc = scratch_floats(tasks * hd),
             qf = scratch_floats(batch * hd);
  for (int64_t b = 0; b < batch; ++b)  // once, not per part
    for (int64_t i = 0; i < hd; ++i) qf[b * hd + i] = static_cast<float>(q[b * q_row + i]) * scale;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = std::upper_bound(first.begin(), first.end(), task) - first.begin() - 1;
      const int64_t len = indptr[b + 1] - indptr[b], parts = first[b + 1] - first[b], p = task - first[b];
      const int64_t t0 = p * len / parts, n = (p + 1) * len / parts - t0;
      if (n > 0) {
        decode_part_avx2(qf.get() + b * hd, k, v, idx + indptr[b] + t0, n, heads, kv_heads, d, m.get() + task * heads,
                         l.get() + task * heads, acc.get() + task * hd, scores);
      } else {  // no tokens: a part that adds nothing
        std::fill(m.get() + task * heads, m.get() + (task + 1) * heads, 0.f);
        std::fill(l.get() + task * heads, l.get() + (task + 1) * heads, 0.f);
        std::fill(acc.get() + task * hd, acc.get() + (task + 1) * hd, 0.f);
      }
    }
  });
  // Merge each request's parts: rescale to the largest max. Request by request across the threads, so
  // that no thread waits while another makes every merge's std::exp calls.
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> o(d);
    for (int64_t b = begin; b < end; ++b)
      for (int64_t qh = 0; qh < heads; ++qh) {
        float mx = -std::numeric_limits<float>::infinity(), total = 0.f;
        for (int64_t t = first[b]; t < first[b + 1]; ++t) mx = std::max(mx, m[t * heads + qh]);
        std::fill(o.begin(), o.end(), 0.f);
        for (int64_t t = first[b]; t < first[b + 1]; ++t) {
          const float w = std::exp(m[t * heads + qh] - mx);
          total += w * l[t * heads + qh];
          for (int64_t c = 0; c < d; ++c) o[c] += w * acc[t * hd + qh * d + c];
        }
        for (int64_t c = 0; c < d; ++c) out[b * hd + qh * d + c] = static_cast<T>(total > 0.f ? o[c] / total : 0.f);
      }
  });
}

// dst[j][0:8V] = q_j . k_t for R query rows and the 8V tokens of V kt tiles (k0: [d][8], then the next
// tiles); only rows j < nr are stored. Each step loads V K vectors and broadcasts R query values; every
// index is a constant after unrolling, so the R x V accumulators stay in registers.
template <int R, int V>
inline void scores_block(const float* const* qr, const float* k0, int64_t d, float* const* dst, int64_t nr) {
  __m256 a[R][V];
  RADIXKV_UNROLL
  for (int j = 0; j < R; ++j)
    RADIXKV_UNROLL
    for (int i = 0; i < V; ++i) a[j][i] = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; ++c) {
    __m256 x[V];
    RADIXKV_UNROLL
    for (int i = 0; i < V; ++i) x[i] = _mm256_loadu_ps(k0 + i * 8 * d + c * 8);
    RADIXKV_UNROLL
    for (int j = 0; j < R; ++j) {
      const __m256 w = _mm256_broadcast_ss(qr[j] + c);
      RADIXKV_UNROLL
      for (int i = 0; i < V; ++i) a[j][i] = _mm256_fmadd_ps(w, x[i], a[j][i]);
    }
  }
  RADIXKV_UNROLL
  for (int j = 0; j < R; ++j)
    if (j < nr)
      RADIXKV_UNROLL
      for (int i = 0; i < V; ++i) _mm256_storeu_ps(dst[j] + 8 * i, a[j][i]);
}

// Prefill chunks, causal after each request's cached prefix (the AVX-512 kernel's contract, any dtype):
// K of each (request, KV head) is widened into tiles of 8 tokens, kt[tile][i][j] = k[8 tile + j][i],
// so a query row's scores of 8 tokens are one broadcast-FMA per dimension; V into float32 rows.
// Each task (request, KV head, block of queries) computes scores 6 rows x 16 tokens at a time, an exact
// float32 softmax per row, and P.V 6 rows x 16 dimensions at a time: 12 accumulators, and per step 2
// vector loads and 6 broadcasts (which cost a load, not a shuffle, on AVX2 CPUs such as Zen 3): the block
// shape that kept the FMA units busiest of those tried. Both passes go a tile of tokens at a time
// (its K or V in L1) through every row block, so a request's K and V stream from memory once per task.
constexpr int64_t kQueryBlockAvx2 = 16;
constexpr int64_t kRowBlockAvx2 = 6;   // query rows per register block
constexpr int64_t kScoreTokens = 16;   // tokens per score block: spans are padded to a multiple

// Tokens per tile: 16 KB of float32 K or V, a multiple of 32 tokens.
inline int64_t prefill_tile(int64_t d) { return std::max<int64_t>(32, 4096 / d / 32 * 32); }

// The first 64-byte boundary at or after p (buffers are allocated 16 floats longer): 32-byte loads from
// rows that start on one never straddle two cache lines.
inline float* align64(float* p) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~static_cast<uintptr_t>(63));
}

// r[i] = (r[0][i], ..., r[7][i]): an 8 x 8 float block transposed in registers.
inline void transpose8(__m256 (&r)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// KV head h of tokens slots[0:len), widened: kt in tiles of 8 tokens, kt[tile][c][j] = k[8 tile + j][c],
// zero-padded to a multiple of kScoreTokens tokens; vf[t][c] = v[t][c]. d % 8 == 0.
template <typename T>
void pack_prefill_kv(const T* k, const T* v, const int64_t* slots, int64_t len, int64_t h, int64_t row_stride,
                     int64_t d, float* kt, float* vf) {
  const int64_t tiles = (len + 7) / 8;
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const T* src[8];
    const int64_t n = std::min<int64_t>(8, len - 8 * tile);
    for (int64_t j = 0; j < n; ++j) src[j] = k + slots[8 * tile + j] * row_stride + h * d;
    for (int64_t c = 0; c < d; c += 8) {
      __m256 r[8];
      for (int64_t j = 0; j < 8; ++j) r[j] = j < n ? load8(src[j] + c) : _mm256_setzero_ps();
      transpose8(r);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(kt + tile * 8 * d + (c + i) * 8, r[i]);
    }
  }
  std::fill(kt + tiles * 8 * d, kt + round_up(len, kScoreTokens) * d, 0.f);
  for (int64_t t = 0; t < len; ++t) widen_row(v + slots[t] * row_stride + h * d, vf + t * d, d);
}

// A prefill thread's scratch: the packed K and V of one (request, KV head), and one task's query rows
// (qf, count), scores and probabilities (sbuf, rows x width), unnormalized outputs (obuf) and 1 / sums.
struct PrefillRows {
  std::vector<float> kv, qf, sbuf, obuf, inv;
  std::vector<int64_t> count, span;  // span[b]: tokens row block b scores, padded to kScoreTokens
};

// One task's attention: rows (query i0 + row / group, head h * group + row % group) of a request, ordered
// by how many tokens they see (w.count[row]), against ktp / vp, its packed K and V for one KV head.
// sb: rows x width scores (w.sbuf's, aligned). Leaves each row's unnormalized output in ob (rows x d)
// and 1 / its softmax sum in w.inv.
inline void prefill_rows(PrefillRows& w, int64_t rows, int64_t width, const float* ktp, const float* vp, int64_t d,
                         float* sb, float* ob) {
  constexpr int64_t RB = kRowBlockAvx2, ST = kScoreTokens;
  const int64_t blocks = (rows + RB - 1) / RB, tile = prefill_tile(d);
  auto block_rows = [&](int64_t b, auto* base, int64_t stride, auto* ptrs) {  // clamped: a short block repeats its last row
    for (int64_t j = 0; j < RB; ++j) ptrs[j] = base + std::min(b * RB + j, rows - 1) * stride;
    return std::min(RB, rows - b * RB);
  };
  auto last_count = [&](int64_t b) { return w.count[std::min(b * RB + RB - 1, rows - 1)]; };
  w.span.resize(blocks);
  for (int64_t b = 0; b < blocks; ++b) w.span[b] = round_up(last_count(b), ST);
  for (int64_t t0 = 0; t0 < w.span[blocks - 1]; t0 += tile)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* qr[RB];
      float* dst[RB];
      const int64_t nr = block_rows(b, static_cast<const float*>(w.qf.data()), d, qr);
      block_rows(b, sb, width, dst);
      for (int64_t t = t0; t < std::min(t0 + tile, w.span[b]); t += ST) {
        float* dt[RB];
        for (int64_t j = 0; j < RB; ++j) dt[j] = dst[j] + t;
        scores_block<RB, ST / 8>(qr, ktp + t * d, d, dt, nr);
      }
    }
  for (int64_t row = 0; row < rows; ++row)  // zeros from each row's last visible token to its block's span
    w.inv[row] = softmax_row(sb + row * width, w.count[row], w.span[row / RB]);
  std::fill(ob, ob + rows * d, 0.f);
  for (int64_t t0 = 0; t0 < last_count(blocks - 1); t0 += tile)
    for (int64_t b = 0; b < blocks; ++b) {  // a block's P.V runs to its last row's count (the others' p are 0)
      const int64_t t1 = std::min(t0 + tile, last_count(b));
      if (t0 >= t1) continue;
      const float* p[RB];
      float* o[RB];
      block_rows(b, static_cast<const float*>(sb), width, p);
      block_rows(b, ob, d, o);
      for (int64_t c0 = 0; c0 < d; c0 += 16) {
        float* oc[RB];
        for (int64_t j = 0; j < RB; ++j) oc[j] = o[j] + c0;
        if (d - c0 >= 16) pv_tile<RB, 2>(p, vp + c0, d, t0, t1, oc);
        else pv_tile<RB, 1>(p, vp + c0, d, t0, t1, oc);
      }
    }
}

template <typename T>
void prefill_avx2(const T* q, const T* k, const T* v, const int64_t* kv_idx, const int64_t* kv_indptr,
                  const int64_t* qo_indptr, T* out, int64_t reqs, int64_t heads, int64_t kv_heads, int64_t d,
                  float scale) {
  const int64_t group = heads / kv_heads, row_stride = kv_heads * d;
  struct Task { int64_t r, h, i0, i1; };
  std::vector<Task> tasks;  // a request's KV heads and query blocks in order: a thread packs each (r, h) once
  for (int64_t r = 0; r < reqs; ++r)
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t i0 = 0; i0 < qo_indptr[r + 1] - qo_indptr[r]; i0 += kQueryBlockAvx2)
        tasks.push_back({r, h, i0, std::min(i0 + kQueryBlockAvx2, qo_indptr[r + 1] - qo_indptr[r])});
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    // Kept between calls (it grows to the largest request seen): fresh buffers of a few MB cost more in
    // page faults than the packing itself.
    static thread_local PrefillRows w;
    int64_t packed = -1;  // the (request, KV head) whose K and V w.kv holds
    for (int64_t ti = begin; ti < end; ++ti) {
      const Task& tk = tasks[ti];
      const int64_t len = kv_indptr[tk.r + 1] - kv_indptr[tk.r], qlen = qo_indptr[tk.r + 1] - qo_indptr[tk.r];
      const int64_t prefix = len - qlen, rows = (tk.i1 - tk.i0) * group, padded = round_up(len, kScoreTokens);
      grow(w.kv, 2 * padded * d + 16);  // + 16: room to align (align64); it only grows for a new (r, h)
      float* kt = align64(w.kv.data());  // this (request, KV head)'s K, then its V
      if (tk.r * kv_heads + tk.h != packed) {
        pack_prefill_kv(k, v, kv_idx + kv_indptr[tk.r], len, tk.h, row_stride, d, kt, kt + padded * d);
        packed = tk.r * kv_heads + tk.h;
      }
      const int64_t width = round_up(prefix + tk.i1, kScoreTokens);  // tokens the last query sees, padded
      w.qf.resize(rows * d);
      grow(w.sbuf, rows * width + 16);
      grow(w.obuf, rows * d + 16);
      float* ob = align64(w.obuf.data());
      w.inv.resize(rows);
      w.count.resize(rows);
      for (int64_t row = 0; row < rows; ++row) {  // row = local query * group + g: rows ordered by visibility
        const int64_t i = tk.i0 + row / group, g = row % group;
        const T* src = q + ((qo_indptr[tk.r] + i) * heads + tk.h * group + g) * d;
        for (int64_t c = 0; c < d; ++c) w.qf[row * d + c] = static_cast<float>(src[c]) * scale;
        w.count[row] = prefix + i + 1;
      }
      prefill_rows(w, rows, width, kt, kt + padded * d, d, align64(w.sbuf.data()), ob);
      for (int64_t row = 0; row < rows; ++row) {
        const int64_t i = tk.i0 + row / group, g = row % group;
        T* dst = out + ((qo_indptr[tk.r] + i) * heads + tk.h * group + g) * d;
        for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<T>(ob[row * d + c] * w.inv[row]);
      }
    }
  });
}
#endif

// ---- small-batch linear layers (decode) with 16-bit weights on AVX2 CPUs ---------------------
// y[M, N] = x[M, K] @ W[N, K]^T (+ bias) from wt [N / 8, K, 8], W repacked once into tiles of 8 output
// features (same dtype as x): each tile streams once per 8 rows of x, widened to float32, against
// broadcast x values; float32 FMAs; y rounded once. Where the CPU has no 16-bit matrix instructions,
// oneDNN and MKL emulate 16-bit GEMMs several times slower than float32 ones, and a float32 copy of
// the weights doubles what a decode step streams from memory; this reads the 16-bit weights as they are.

#ifdef RADIXKV_AVX2
inline void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
inline void store8(c10::Half* p, __m256 x) {
  _mm_storeu_si128((__m128i*)p, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store8(c10::BFloat16* p, __m256 x) {  // round to nearest even, as c10::BFloat16 does (NaN stays NaN)
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(packed));
}

// y rows m = bias + acc[m][0] + ... + acc[m][U - 1], in that order, rounded once to T.
template <typename T, int MB, int U>
inline void store_sums(const __m256 (&acc)[MB][U], const float* bias, T* y, int64_t ldy) {
  const __m256 b = bias != nullptr ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  RADIXKV_UNROLL
  for (int m = 0; m < MB; ++m) {
    __m256 sum = b;
    RADIXKV_UNROLL
    for (int u = 0; u < U; ++u) sum = _mm256_add_ps(sum, acc[m][u]);
    store8(y + m * ldy, sum);
  }
}

// How far ahead in a tile's stream linear_tile prefetches the weights (into L2), in bytes. The hardware
// prefetchers alone left the FMA loop waiting on memory; any distance of 1-4 KiB does as well.
constexpr int64_t kWeightPrefetch = 2048;

// Rows per block of x: linear_group multiplies whole blocks, linear_tile the last, shorter one.
constexpr int kRowBlock = 4;

// Independent partial sums per output for a block of mb rows (fewer rows leave FMA latency to hide); a
// whole block sums in one chain, as linear_group does. linear_tile and coded_tile both take it, so the
// codes give small_linear's bits.
constexpr int partial_sums(int mb) { return mb >= kRowBlock ? 1 : (mb >= 2 ? 4 : 8); }

// MB rows of x against one tile. x is the row block interleaved, x[i * MB + m] = row m's element i, so each
// step's MB broadcasts read one run of MB floats, not MB streams k floats apart (as row-major rows would be).
// U = partial_sums(MB) independent sums per row hide FMA latency.
template <typename T, int MB>
inline void linear_tile(const float* x, const T* tile, int64_t k, const float* bias, T* y, int64_t ldy) {
  constexpr int U = partial_sums(MB);
  constexpr int kLine = 64 / (8 * int(sizeof(T)));  // steps of i per cache line of the tile
  constexpr int S = U > kLine ? U : kLine;          // steps per iteration: whole lines and whole U
  __m256 acc[MB][U];
  RADIXKV_UNROLL
  for (int m = 0; m < MB; ++m)
    RADIXKV_UNROLL
    for (int u = 0; u < U; ++u) acc[m][u] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + S <= k; i += S) {
    RADIXKV_UNROLL
    for (int l = 0; l < S / kLine; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(tile + (i + l * kLine) * 8) + kWeightPrefetch, _MM_HINT_T1);
    RADIXKV_UNROLL
    for (int u = 0; u < S; ++u) {
      const __m256 w = load8(tile + (i + u) * 8);
      RADIXKV_UNROLL
      for (int m = 0; m < MB; ++m)
        acc[m][u % U] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + (i + u) * MB + m), w, acc[m][u % U]);
    }
  }
  for (; i < k; ++i) {
    const __m256 w = load8(tile + i * 8);
    RADIXKV_UNROLL
    for (int m = 0; m < MB; ++m) acc[m][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + i * MB + m), w, acc[m][0]);
  }
  store_sums<T, MB, U>(acc, bias, y, ldy);
}

// Prefetches (into L2) the weights that the next group of tiles will read, a few lines every 8 steps of
// i spread over every pass of this group, so the next group's stream from DRAM runs while this one's
// passes multiply from cache; without it the second row block's pass drew nothing from memory.
class GroupPrefetch {
 public:
  GroupPrefetch(const void* next, int64_t bytes, int64_t steps)
      : next_(static_cast<const char*>(next)), lines_(next ? (bytes + 63) / 64 : 0), steps_(steps) {}
  void every8() {  // called once per 8 steps: lines_ * 8 / steps_ lines on average, no division in the loop
    credit_ += lines_ * 8;
    for (; credit_ >= steps_ && done_ < lines_; credit_ -= steps_) _mm_prefetch(next_ + 64 * done_++, _MM_HINT_T1);
  }

 private:
  const char* next_;
  int64_t lines_, steps_, done_ = 0, credit_ = 0;
};

// kRowBlock rows of x (interleaved, as linear_tile reads them) against NC consecutive tiles (k * 8 apart):
// 4 x NC accumulators, each output summed in one chain. With NC = 3, twelve chains hide the FMA latency
// that eight (one 8-row block against one tile, the same bits: each output is one chain in both) do not,
// which brings a decode step's linears close to the CPU's FMA peak with weights in cache and to the
// memory bandwidth from DRAM.
// Not inlined: inlined into small_linear's loop over groups, GCC kept store8's rounding constants in two
// vector registers across the k loop and spilled two accumulators to the stack instead.
template <typename T, int NC>
__attribute__((noinline)) void linear_group(const float* x, const T* tiles, int64_t k, const float* bias, T* y,
                                            int64_t ldy, GroupPrefetch& pf) {
  __m256 acc[kRowBlock][NC];
  RADIXKV_UNROLL
  for (int m = 0; m < kRowBlock; ++m)
    RADIXKV_UNROLL
    for (int c = 0; c < NC; ++c) acc[m][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {  // not unrolled: unrolled, GCC spilled accumulators to the stack
    if ((i & 7) == 0) pf.every8();
    __m256 w[NC];
    RADIXKV_UNROLL
    for (int c = 0; c < NC; ++c) w[c] = load8(tiles + (c * k + i) * 8);
    RADIXKV_UNROLL
    for (int m = 0; m < kRowBlock; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + i * kRowBlock + m);
      RADIXKV_UNROLL
      for (int c = 0; c < NC; ++c) acc[m][c] = _mm256_fmadd_ps(xb, w[c], acc[m][c]);
    }
  }
  RADIXKV_UNROLL
  for (int c = 0; c < NC; ++c) {
    __m256 col[kRowBlock][1];
    RADIXKV_UNROLL
    for (int m = 0; m < kRowBlock; ++m) col[m][0] = acc[m][c];
    store_sums<T, kRowBlock, 1>(col, bias != nullptr ? bias + 8 * c : nullptr, y + 8 * c, ldy);
  }
}

#ifdef RADIXKV_AVX512_BF16
// The word order that turns four k-rows of one tile (32 bfloat16, k-row r's output o at r * 8 + o) into 16
// BF16 pairs: lane 2o + h holds (w[2h][o], w[2h + 1][o]), two k of output o, so that a 64-bit broadcast of
// x's four values there, (x0, x1) in even lanes and (x2, x3) in odd ones, lines up with them.
inline __m512i quad_pairs_index() {
  alignas(64) int16_t idx[32];
  for (int lane = 0; lane < 16; ++lane) {
    const int o = lane / 2, h = lane % 2;
    idx[2 * lane] = static_cast<int16_t>(2 * h * 8 + o);
    idx[2 * lane + 1] = static_cast<int16_t>((2 * h + 1) * 8 + o);
  }
  return _mm512_load_si512(idx);
}

// linear_group for bfloat16 on CPUs with AVX-512 BF16: the same block of kRowBlock rows (x row-major, ldx
// apart) against NC tiles, four k at a time in BF16 dot products (VDPBF16PS: two exact products added into
// a float32 lane per instruction), the weights' words reordered in registers so the tiles keep their layout.
// Each output sums k = 0, 1 (mod 4) in one lane and k = 2, 3 in the next, added at the end: other bits
// than the FMA chain, the same for a block alone as inside a batch. A VDPBF16PS retires four times the
// flops of a float32 FMA on such CPUs (Zen 4), where an FMA version of this loop is bound by FMA throughput.
template <int NC>
__attribute__((noinline)) void linear_group_bf16(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* tiles,
                                                 int64_t k, const float* bias, c10::BFloat16* y, int64_t ldy,
                                                 GroupPrefetch& pf) {
  const __m512i perm = quad_pairs_index();
  __m512 acc[kRowBlock][NC];
  RADIXKV_UNROLL
  for (int m = 0; m < kRowBlock; ++m)
    RADIXKV_UNROLL
    for (int c = 0; c < NC; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 4) {
    if ((i & 7) == 0) pf.every8();
    __m512bh w[NC];
    RADIXKV_UNROLL
    for (int c = 0; c < NC; ++c)
      w[c] = (__m512bh)_mm512_permutexvar_epi16(perm, _mm512_loadu_si512(tiles + (c * k + i) * 8));
    RADIXKV_UNROLL
    for (int m = 0; m < kRowBlock; ++m) {
      const __m512bh xb = (__m512bh)_mm512_broadcastq_epi64(_mm_loadl_epi64((const __m128i*)(x + m * ldx + i)));
      RADIXKV_UNROLL
      for (int c = 0; c < NC; ++c) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], xb, w[c]);
    }
  }
  const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
  RADIXKV_UNROLL
  for (int c = 0; c < NC; ++c) {
    __m256 col[kRowBlock][1];
    RADIXKV_UNROLL
    for (int m = 0; m < kRowBlock; ++m) {  // lane 2o + its neighbour: output o; then the 8 outputs in order
      const __m512 sums = _mm512_add_ps(acc[m][c], _mm512_permute_ps(acc[m][c], 0xB1));
      col[m][0] = _mm512_castps512_ps256(_mm512_permutexvar_ps(evens, sums));
    }
    store_sums<c10::BFloat16, kRowBlock, 1>(col, bias != nullptr ? bias + 8 * c : nullptr, y + 8 * c, ldy);
  }
}
#endif

// f(m0, std::integral_constant<int, MB>) for each block of at most kRowBlock of rows rows starting at row
// m0, so the tile kernels get their row count as a template argument.
template <typename F>
inline void for_row_blocks(int64_t rows, F&& f) {
  for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock) {
    switch (std::min<int64_t>(kRowBlock, rows - m0)) {
      case 4: f(m0, std::integral_constant<int, 4>{}); break;
      case 3: f(m0, std::integral_constant<int, 3>{}); break;
      case 2: f(m0, std::integral_constant<int, 2>{}); break;
      default: f(m0, std::integral_constant<int, 1>{}); break;
    }
  }
}

// x [rows, k] in float32, each block of kRowBlock rows interleaved (linear_tile's layout; the last block
// may be shorter). Whole blocks go 8 columns at a time, a 4 x 8 transpose in registers: this runs on one
// thread while the others wait, once per linear layer, so element by element it would be a visible share
// of a batch-8 step's linears.
template <typename T>
std::unique_ptr<float[]> interleave_rows(const T* x, int64_t rows, int64_t k) {
  static_assert(kRowBlock == 4, "the transpose below interleaves 4 rows");
  auto xf = scratch_floats(rows * k);
  for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock) {
    const int64_t mb = std::min<int64_t>(kRowBlock, rows - m0);
    const T* r = x + m0 * k;
    float* dst = xf.get() + m0 * k;
    if (mb < 4 || k % 8 != 0) {
      for (int64_t m = 0; m < mb; ++m)
        for (int64_t i = 0; i < k; ++i) dst[i * mb + m] = static_cast<float>(r[m * k + i]);
      continue;
    }
    for (int64_t i = 0; i < k; i += 8) {
      const __m256 a = load8(r + i), b = load8(r + k + i), c = load8(r + 2 * k + i), d = load8(r + 3 * k + i);
      auto pairs = [](__m256 lo, __m256 hi, bool high) {  // (lo_j, hi_j) for j = 0, 1 | 4, 5 (or 2, 3 | 6, 7)
        return _mm256_castps_pd(high ? _mm256_unpackhi_ps(lo, hi) : _mm256_unpacklo_ps(lo, hi));
      };
      const __m256d ab0 = pairs(a, b, false), ab1 = pairs(a, b, true), cd0 = pairs(c, d, false), cd1 = pairs(c, d, true);
      const __m256 q0 = _mm256_castpd_ps(_mm256_unpacklo_pd(ab0, cd0));  // column 0 | column 4, rows a..d
      const __m256 q1 = _mm256_castpd_ps(_mm256_unpackhi_pd(ab0, cd0));  // 1 | 5
      const __m256 q2 = _mm256_castpd_ps(_mm256_unpacklo_pd(ab1, cd1));  // 2 | 6
      const __m256 q3 = _mm256_castpd_ps(_mm256_unpackhi_pd(ab1, cd1));  // 3 | 7
      float* o = dst + i * 4;
      _mm256_storeu_ps(o, _mm256_permute2f128_ps(q0, q1, 0x20));
      _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(q2, q3, 0x20));
      _mm256_storeu_ps(o + 16, _mm256_permute2f128_ps(q0, q1, 0x31));
      _mm256_storeu_ps(o + 24, _mm256_permute2f128_ps(q2, q3, 0x31));
    }
  }
  return xf;
}

// y = x W^T + bias. Fewer rows than a block: tile by tile (linear_tile). Otherwise in groups of up to 3
// tiles (24 outputs): each whole block of kRowBlock rows in one linear_group pass (the group's weights
// come from DRAM in the first, from L1/L2 after), the last, shorter block tile by tile.
// On AVX-512 BF16 CPUs the whole blocks of bfloat16 rows (with k % 4 == 0) go through linear_group_bf16,
// which reads x as it is; only the rows past them are widened and interleaved for the FMA tiles.
template <typename T>
void small_linear_avx2(const T* x, const T* wt, const float* bias, T* y, int64_t rows, int64_t k, int64_t n) {
  const int64_t tiles = n / 8, blocks = rows / kRowBlock;
#ifdef RADIXKV_AVX512_BF16
  const bool dot_blocks = std::is_same_v<T, c10::BFloat16> && k % 4 == 0;
#else
  const bool dot_blocks = false;
#endif
  const int64_t first = dot_blocks ? blocks * kRowBlock : 0;  // the first row xf holds
  const auto xf = interleave_rows(x + first * k, rows - first, k);
  auto tile_rows = [&](int64_t t, int64_t m0) {  // rows m0.. (fewer than a block) against tile t
    const float* b = bias != nullptr ? bias + t * 8 : nullptr;
    for_row_blocks(rows - m0, [&](int64_t, auto mb) {
      linear_tile<T, decltype(mb)::value>(xf.get() + (m0 - first) * k, wt + t * k * 8, k, b, y + m0 * n + t * 8, n);
    });
  };
  if (blocks == 0) {
    at::parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) tile_rows(t, 0);
    });
    return;
  }
  constexpr int64_t kGroup = 3;
  at::parallel_for(0, (tiles + kGroup - 1) / kGroup, 2, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t t0 = g * kGroup, nc = std::min(kGroup, tiles - t0);
      const T* group = wt + t0 * k * 8;
      const int64_t next = g + 1 < end ? std::min(kGroup, tiles - t0 - kGroup) : 0;  // tiles of the next group
      GroupPrefetch pf(next > 0 ? group + nc * k * 8 : nullptr, next * k * 8 * sizeof(T), blocks * k);
      const float* b = bias != nullptr ? bias + t0 * 8 : nullptr;
      for (int64_t blk = 0; blk < blocks; ++blk) {
        T* yb = y + blk * kRowBlock * n + t0 * 8;
#ifdef RADIXKV_AVX512_BF16
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (dot_blocks) {
            const T* xr = x + blk * kRowBlock * k;
            if (nc == 3) linear_group_bf16<3>(xr, k, group, k, b, yb, n, pf);
            else if (nc == 2) linear_group_bf16<2>(xr, k, group, k, b, yb, n, pf);
            else linear_group_bf16<1>(xr, k, group, k, b, yb, n, pf);
            continue;
          }
        }
#endif
        const float* xb = xf.get() + blk * kRowBlock * k;  // first is 0 here
        if (nc == 3) linear_group<T, 3>(xb, group, k, b, yb, n, pf);
        else if (nc == 2) linear_group<T, 2>(xb, group, k, b, yb, n, pf);
        else linear_group<T, 1>(xb, group, k, b, yb, n, pf);
      }
      if (rows > blocks * kRowBlock)
        for (int64_t c = 0; c < nc; ++c) tile_rows(t0 + c, blocks * kRowBlock);
    }
  });
}

// ---- decode-sized linear layers from 4-bit affine codes (weights dequantized from GGUF Q4_1) ---------
// A GGUF Q4_1 weight is d * q + m for a 4-bit code q and a float16 scale d and offset m per 32 inputs of
// an output row; the loader computes that in float32 and rounds it to the model's dtype T. So 0.625
// bytes describe each 16-bit weight exactly (``radixkv.cpu.coded`` checks every one when it builds the
// codes), and a decode step at batch 1, which streams every weight once and waits on memory, reads a
// third of the bytes. coded_tile rebuilds each weight in a register the way the loader built it (d * q
// is exact in float32, 11 by 4 significant bits, so a contracted multiply-add cannot change the sum) and
// multiplies it exactly as linear_tile multiplies the stored T, in the same order: the outputs are
// small_linear's, bit for bit. Rebuilding costs about six vector operations per eight weights, so at
// more than a couple of rows, where linear_tile runs out of FMA throughput rather than memory, the
// 16-bit tiles are faster.
//
// Layout for one tile of 8 output rows: codes [k / 2, 8] uint8 (byte [p, c] holds row c's codes for
// inputs 2p, low nibble, and 2p + 1, high nibble); scale, offset [k / 32, 8] float16 (row c's d and m
// for inputs 32b .. 32b + 31).

// v rounded to T's precision (to nearest, ties to even), kept in float32. For bfloat16: with e = 2^exponent(v)
// and c = 1.5 * 2^16 * e, v + c lies in c's binade, whose spacing 2^-7 e is bfloat16's at v, so the add
// rounds v as bfloat16 would and subtracting c is exact (e * 1.5 * 2^16 is exact, so both fused forms
// round once). Three operations where the integer round-to-nearest-even takes five: coded_tile is bound by
// vector ALU throughput, not memory. Finite, normal v only: Q4Rows verifies every weight.
inline __m256 as_stored(__m256 v, const c10::BFloat16*) {
  const __m256 e = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7f800000)));
  const __m256 k = _mm256_set1_ps(98304.f);  // 1.5 * 2^16
  return _mm256_fnmadd_ps(e, k, _mm256_fmadd_ps(e, k, v));
}
inline __m256 as_stored(__m256 v, const c10::Half*) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// How far ahead coded_tile prefetches its codes (into L2), in bytes.
constexpr int64_t kCodePrefetch = 1024;

template <typename T, int MB>
inline void coded_tile(const float* x, const uint8_t* codes, const c10::Half* scale, const c10::Half* offset,
                       int64_t k, const float* bias, T* y, int64_t ldy) {
  constexpr int U = partial_sums(MB);  // linear_tile's, for its bits
  const __m256i low = _mm256_set1_epi32(0xf);
  __m256 acc[MB][U];
  RADIXKV_UNROLL
  for (int m = 0; m < MB; ++m)
    RADIXKV_UNROLL
    for (int u = 0; u < U; ++u) acc[m][u] = _mm256_setzero_ps();
  for (int64_t b = 0; b < k / 32; ++b) {
    const uint8_t* cb = codes + b * 128;  // 16 pairs of inputs x 8 rows
    _mm_prefetch(reinterpret_cast<const char*>(cb) + kCodePrefetch, _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(cb) + kCodePrefetch + 64, _MM_HINT_T1);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + b * 8)));
    const __m256 off = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(offset + b * 8)));
    RADIXKV_UNROLL
    for (int p = 0; p < 16; ++p) {
      const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cb + p * 8)));
      const __m256i qs[2] = {_mm256_and_si256(q, low), _mm256_srli_epi32(q, 4)};
      RADIXKV_UNROLL
      for (int h = 0; h < 2; ++h) {
        const int64_t i = b * 32 + 2 * p + h;
        const __m256 w = as_stored(_mm256_fmadd_ps(d, _mm256_cvtepi32_ps(qs[h]), off), y);  // d * q exact
        RADIXKV_UNROLL
        for (int m = 0; m < MB; ++m)
          acc[m][(2 * p + h) % U] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + i * MB + m), w, acc[m][(2 * p + h) % U]);
      }
    }
  }
  store_sums<T, MB, U>(acc, bias, y, ldy);
}

template <typename T>
void coded_linear_avx2(const T* x, const uint8_t* codes, const c10::Half* scale, const c10::Half* offset,
                       const float* bias, T* y, int64_t rows, int64_t k, int64_t n) {
  const auto xf = interleave_rows(x, rows, k);
  at::parallel_for(0, n / 8, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* c = codes + t * k * 4;
      const c10::Half* s = scale + t * (k / 32) * 8;
      const c10::Half* o = offset + t * (k / 32) * 8;
      const float* b = bias != nullptr ? bias + t * 8 : nullptr;
      for_row_blocks(rows, [&](int64_t m0, auto mb) {
        coded_tile<T, decltype(mb)::value>(xf.get() + m0 * k, c, s, o, k, b, y + m0 * n + t * 8, n);
      });
    }
  });
}
#endif

// ---- fused elementwise ops, rounding like PyTorch's eager ops in the same dtype ----------------
// Each op computes in float32 and rounds to T wherever the eager sequence it replaces rounds, so
// float32 results equal the eager ones up to summation order, and 16-bit ones up to that and one
// rounding step.

template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }

// out = w * to_T(x * rsqrt(mean(x^2) + eps)); with a residual: residual = to_T(residual + x) first,
// and the normalized value is the new residual's. x, residual, out: [n, hidden]; w: [hidden].
template <typename T>
void rms_norm_kernel(const T* x, T* residual, const T* w, T* out, int64_t n, int64_t hidden, float eps) {
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(hidden);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * hidden;
      float ss = 0.f;
      if (residual != nullptr) {
        T* rr = residual + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) {
          rr[i] = round_to<T>(static_cast<float>(rr[i]) + static_cast<float>(xr[i]));
          h[i] = static_cast<float>(rr[i]);
        }
      } else {
        for (int64_t i = 0; i < hidden; ++i) h[i] = static_cast<float>(xr[i]);
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < hidden; ++i) ss += h[i] * h[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + eps);
      T* o = out + r * hidden;
      for (int64_t i = 0; i < hidden; ++i)
        o[i] = round_to<T>(static_cast<float>(w[i]) * static_cast<float>(round_to<T>(h[i] * inv)));
    }
  });
}

// RoPE on the q and k heads of qkv [n, (H + 2 Hkv) D] in place, then k and v stored at slots[n] of the
// pools [S, Hkv, D]. cos, sin: [n, D]. x' = x * cos + rotate_half(x) * sin, three roundings as eager.
template <typename T>
void rope_store_kernel(T* qkv, const T* cos, const T* sin, T* k_pool, T* v_pool, const int64_t* slots, int64_t n,
                       int64_t heads, int64_t kv_heads, int64_t d) {
  const int64_t width = (heads + 2 * kv_heads) * d, half = d / 2;
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> x(d);
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * d;
      const T* s = sin + t * d;
      for (int64_t hh = 0; hh < heads + kv_heads; ++hh) {
        T* row = qkv + t * width + hh * d;
        for (int64_t i = 0; i < d; ++i) x[i] = static_cast<float>(row[i]);
        for (int64_t i = 0; i < d; ++i) {
          const float rot = i < half ? -x[i + half] : x[i - half];
          const float a = static_cast<float>(round_to<T>(x[i] * static_cast<float>(c[i])));
          const float b = static_cast<float>(round_to<T>(rot * static_cast<float>(s[i])));
          row[i] = round_to<T>(a + b);
        }
      }
      const T* k = qkv + t * width + heads * d;
      const T* v = k + kv_heads * d;
      std::copy(k, k + kv_heads * d, k_pool + slots[t] * kv_heads * d);
      std::copy(v, v + kv_heads * d, v_pool + slots[t] * kv_heads * d);
    }
  });
}

// out = to_T(silu(gate)) * up with gate_up [n, 2I] (gate columns first); out: [n, I].
template <typename T>
void silu_mul_kernel(const T* gate_up, T* out, int64_t n, int64_t inter) {
#ifdef RADIXKV_AVX2
  if constexpr (!std::is_same_v<T, double>) {
    if (inter % 8 == 0) {  // 8 at a time; exp256 (2e-7 relative) in place of std::exp, the same roundings
      at::parallel_for(0, n * inter / 8, 512, [&](int64_t begin, int64_t end) {
        for (int64_t e = begin; e < end; ++e) {
          const int64_t r = e * 8 / inter, i = e * 8 % inter;
          const T* gate = gate_up + r * 2 * inter + i;
          const __m256 g = load8(gate);
          const __m256 ex = exp256(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), _mm256_set1_ps(88.f)));
          T silu[8];
          store8(silu, _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), ex)));
          store8(out + e * 8, _mm256_mul_ps(load8(silu), load8(gate + inter)));
        }
      });
      return;
    }
  }
#endif
  at::parallel_for(0, n * inter, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      const int64_t r = e / inter, i = e % inter;
      const float g = static_cast<float>(gate_up[r * 2 * inter + i]);
      const float silu = static_cast<float>(round_to<T>(g / (1.f + std::exp(-g))));
      out[e] = round_to<T>(silu * static_cast<float>(gate_up[r * 2 * inter + inter + i]));
    }
  });
}

}  // namespace

bool has_avx512_bf16() {
#ifdef RADIXKV_AVX512_BF16
  return true;
#else
  return false;
#endif
}

// The KV CSR metadata of `reqs` requests can be read as it is: kv_indptr within kv_indices and not
// decreasing, every slot inside the pool (a clear error instead of a read past the pool).
void check_kv_csr(const torch::Tensor& idx, const int64_t* ip, int64_t reqs, int64_t pool_slots) {
  TORCH_CHECK(ip[0] >= 0 && ip[reqs] <= idx.numel(), "kv_indptr must index into kv_indices");
  for (int64_t r = 0; r < reqs; ++r) TORCH_CHECK(ip[r + 1] >= ip[r], "kv_indptr must not decrease");
  const int64_t* ix = idx.data_ptr<int64_t>();
  int64_t lo = 0, hi = 0;  // one pass (vectorized min / max), not a branch per slot
  for (int64_t i = ip[0]; i < ip[reqs]; ++i) {
    lo = std::min(lo, ix[i]);
    hi = std::max(hi, ix[i]);
  }
  TORCH_CHECK(lo >= 0 && (ip[reqs] == ip[0] || hi < pool_slots), "kv_indices must be slots of the pool");
}

// check_slots = false skips the O(nnz) pass of check_kv_csr, for a caller that has made it already
// for these indices and a pool of this size (DecodeStack: one pass per step instead of one per layer).
// q_in may be any [B, H, D] view whose requests' [H, D] blocks are contiguous (DecodeStack passes the q
// columns of its qkv output): the AVX2 path reads it in place, the others from a contiguous copy.
torch::Tensor paged_decode_impl(const torch::Tensor& q_in, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                                const torch::Tensor& kv_indices, const torch::Tensor& kv_indptr, double scale,
                                bool check_slots) {
  TORCH_CHECK(q_in.dim() == 3 && k_pool.dim() == 3 && v_pool.sizes() == k_pool.sizes(),
              "q [B, H, D], pools [S, Hkv, D]");
  TORCH_CHECK(q_in.device().is_cpu() && k_pool.device().is_cpu(), "paged_decode runs on the CPU");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "the pools must be contiguous");
  const bool rows_dense = q_in.stride(2) == 1 && q_in.stride(1) == q_in.size(2);
  const auto q = rows_dense ? q_in : q_in.contiguous();
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && v_pool.scalar_type() == k_pool.scalar_type(),
              "q and the pools must share a dtype");
  TORCH_CHECK(kv_indices.scalar_type() == at::kLong && kv_indptr.scalar_type() == at::kLong, "indices are int64");
  TORCH_CHECK(q.size(2) == k_pool.size(2) && q.size(1) % k_pool.size(1) == 0, "head counts or head_dim differ");
  TORCH_CHECK(kv_indptr.numel() == q.size(0) + 1, "kv_indptr must have B + 1 entries");
  auto idx = kv_indices.contiguous();
  auto indptr = kv_indptr.contiguous();
  auto out = torch::empty(q.sizes(), q.options());
  const int64_t batch = q.size(0), heads = q.size(1), kv_heads = k_pool.size(1), d = q.size(2);
  if (check_slots) check_kv_csr(idx, indptr.data_ptr<int64_t>(), batch, k_pool.size(0));
#ifdef RADIXKV_AVX2
  if (d % 8 == 0 && q.scalar_type() != at::kDouble) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
      if constexpr (!std::is_same_v<scalar_t, double>) {
        decode_avx2<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), k_pool.data_ptr<scalar_t>(),
                              v_pool.data_ptr<scalar_t>(), idx.data_ptr<int64_t>(), indptr.data_ptr<int64_t>(),
                              out.data_ptr<scalar_t>(), batch, heads, kv_heads, d, static_cast<float>(scale));
      }
    });
    return out;
  }
#endif
  const auto qc = q.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_portable<scalar_t>(qc.data_ptr<scalar_t>(), k_pool.data_ptr<scalar_t>(), v_pool.data_ptr<scalar_t>(),
                              idx.data_ptr<int64_t>(), indptr.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), batch,
                              heads, kv_heads, d, static_cast<float>(scale));
  });
  return out;
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor kv_indices,
                           torch::Tensor kv_indptr, double scale) {
  return paged_decode_impl(q, k_pool, v_pool, kv_indices, kv_indptr, scale, true);
}

// Whether paged_prefill has a path for this storage dtype and head_dim on the CPU it was compiled for:
// AVX-512 BF16 takes bfloat16 with head_dim 64 or 128; AVX2 (with FMA, F16C) any of the three dtypes
// with a head_dim that is a multiple of 8.
bool prefill_supported(const std::string& dtype, int64_t head_dim) {
  bool ok = false;
#ifdef RADIXKV_AVX512_BF16
  ok = ok || (dtype == "bfloat16" && (head_dim == 64 || head_dim == 128));
#endif
#ifdef RADIXKV_AVX2
  ok = ok || ((dtype == "float32" || dtype == "bfloat16" || dtype == "float16") && head_dim % 8 == 0);
#endif
  return ok;
}

torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor kv_indices,
                            torch::Tensor kv_indptr, torch::Tensor qo_indptr, double scale) {
  const std::string dtype = q.scalar_type() == at::kBFloat16 ? "bfloat16"
                            : q.scalar_type() == at::kHalf   ? "float16"
                            : q.scalar_type() == at::kFloat  ? "float32"
                                                             : "other";
  TORCH_CHECK(prefill_supported(dtype, q.size(-1)),
              "paged_prefill has no path for ", dtype, " with head_dim ", q.size(-1), " on this CPU (see prefill_supported)");
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.sizes() == k_pool.sizes(), "q [N, H, D], pools [S, Hkv, D]");
  TORCH_CHECK(q.device().is_cpu() && k_pool.device().is_cpu(), "paged_prefill runs on the CPU");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(k_pool.scalar_type() == q.scalar_type() && v_pool.scalar_type() == q.scalar_type(),
              "q and the pools must share a dtype");
  TORCH_CHECK(kv_indices.scalar_type() == at::kLong && kv_indptr.scalar_type() == at::kLong &&
              qo_indptr.scalar_type() == at::kLong, "indices are int64");
  const int64_t heads = q.size(1), kv_heads = k_pool.size(1), d = q.size(2), reqs = qo_indptr.numel() - 1;
  TORCH_CHECK(d == k_pool.size(2) && heads % kv_heads == 0, "head counts or head_dim differ");
  TORCH_CHECK(reqs >= 0 && kv_indptr.numel() == reqs + 1, "kv_indptr and qo_indptr must have the same length");
  auto idx = kv_indices.contiguous();
  auto kv_ptr = kv_indptr.contiguous();
  auto qo_ptr = qo_indptr.contiguous();
  const int64_t* kvp = kv_ptr.data_ptr<int64_t>();
  const int64_t* qop = qo_ptr.data_ptr<int64_t>();
  TORCH_CHECK(qop[0] == 0 && qop[reqs] == q.size(0), "qo_indptr must run from 0 to the number of query rows");
  check_kv_csr(idx, kvp, reqs, k_pool.size(0));
  for (int64_t r = 0; r < reqs; ++r) {
    TORCH_CHECK(qop[r + 1] >= qop[r], "qo_indptr must not decrease");
    TORCH_CHECK(kvp[r + 1] - kvp[r] >= qop[r + 1] - qop[r], "a request has more query rows than KV positions");
  }
  auto out = torch::empty_like(q);
#ifdef RADIXKV_AVX512_BF16
  if (dtype == "bfloat16" && (d == 64 || d == 128)) {
    auto ptr = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
    auto run = [&](auto kernel) {
      kernel(ptr(q), ptr(k_pool), ptr(v_pool), idx.data_ptr<int64_t>(), kv_ptr.data_ptr<int64_t>(),
             qo_ptr.data_ptr<int64_t>(), ptr(out), reqs, heads, kv_heads, static_cast<float>(scale));
    };
    if (d == 64) run(prefill_bf16_avx512<64>);
    else run(prefill_bf16_avx512<128>);
    return out;
  }
#endif
#ifdef RADIXKV_AVX2
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      prefill_avx2<scalar_t>(q.data_ptr<scalar_t>(), k_pool.data_ptr<scalar_t>(), v_pool.data_ptr<scalar_t>(),
                             idx.data_ptr<int64_t>(), kv_ptr.data_ptr<int64_t>(), qo_ptr.data_ptr<int64_t>(),
                             out.data_ptr<scalar_t>(), reqs, heads, kv_heads, d, static_cast<float>(scale));
    }
  });
#endif
  return out;
}

torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.dim() == 1 && weight.size(0) == x.size(1),
              "rms_norm: x [n, hidden] contiguous, weight [hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous(), "rms_norm: weight dtype");
  if (residual) TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                            residual->scalar_type() == x.scalar_type(), "rms_norm: residual like x");
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), residual ? residual->data_ptr<scalar_t>() : nullptr,
                              weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0), x.size(1),
                              static_cast<float>(eps));
  });
  return out;
}

void rope_store(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_pool, torch::Tensor v_pool,
                torch::Tensor slots, int64_t heads, int64_t kv_heads) {
  const int64_t n = qkv.size(0), d = k_pool.size(2);
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (heads + 2 * kv_heads) * d,
              "rope_store: qkv [n, (H + 2 Hkv) D] contiguous");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.numel() == n * d && cos.is_contiguous() && sin.is_contiguous(),
              "rope_store: cos, sin [n, D]");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.size(1) == kv_heads &&
              v_pool.sizes() == k_pool.sizes(), "rope_store: pools [S, Hkv, D]");
  TORCH_CHECK(qkv.scalar_type() == k_pool.scalar_type() && cos.scalar_type() == qkv.scalar_type() &&
              v_pool.scalar_type() == k_pool.scalar_type(), "rope_store: one dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == n && slots.is_contiguous(), "rope_store: slots");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_store", [&] {
    rope_store_kernel<scalar_t>(qkv.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                                k_pool.data_ptr<scalar_t>(), v_pool.data_ptr<scalar_t>(), slots.data_ptr<int64_t>(), n,
                                heads, kv_heads, d);
  });
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0, "silu_mul: [n, 2I]");
  auto out = torch::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_kernel<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gate_up.size(0),
                              gate_up.size(1) / 2);
  });
  return out;
}

bool has_avx2() {
#ifdef RADIXKV_AVX2
  return true;
#else
  return false;
#endif
}

// x [M, K] and wt [N / 8, K, 8] in one 16-bit dtype (or float32), bias [N] float32 or none -> y [M, N].
torch::Tensor small_linear(torch::Tensor x, torch::Tensor wt, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(has_avx2(), "small_linear needs a CPU with AVX2, FMA and F16C (compiled for this machine)");
  TORCH_CHECK(x.dim() == 2 && wt.dim() == 3 && wt.size(2) == 8 && wt.size(1) == x.size(1),
              "small_linear: x [M, K], wt [N / 8, K, 8]");
  TORCH_CHECK(x.scalar_type() == wt.scalar_type() && wt.is_contiguous(), "small_linear: x and wt share a dtype");
  const int64_t n = wt.size(0) * 8;
  if (bias) TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous(),
                        "small_linear: bias [N] float32");
  auto xc = x.contiguous();
  auto y = torch::empty({x.size(0), n}, x.options());
#ifdef RADIXKV_AVX2
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "small_linear", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      small_linear_avx2<scalar_t>(xc.data_ptr<scalar_t>(), wt.data_ptr<scalar_t>(),
                                  bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<scalar_t>(), x.size(0),
                                  x.size(1), n);
    }
  });
#endif
  return y;
}

torch::Tensor coded_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scale, torch::Tensor offset,
                           c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(has_avx2(), "coded_linear needs a CPU with AVX2, FMA and F16C (compiled for this machine)");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0, "coded_linear: x [M, K] with K a multiple of 32");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, "coded_linear: x is 16-bit");
  const int64_t k = x.size(1);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.size(1) == k / 2 && codes.size(2) == 8 &&
              codes.is_contiguous(), "coded_linear: codes [N / 8, K / 2, 8] uint8");
  const int64_t n = codes.size(0) * 8;
  for (const auto* t : {&scale, &offset})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->dim() == 3 && t->size(0) == n / 8 && t->size(1) == k / 32 &&
                t->size(2) == 8 && t->is_contiguous(), "coded_linear: scale, offset [N / 8, K / 32, 8] float16");
  if (bias) TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous(),
                        "coded_linear: bias [N] float32");
  auto xc = x.contiguous();
  auto y = torch::empty({x.size(0), n}, x.options());
#ifdef RADIXKV_AVX2
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "coded_linear", [&] {
    coded_linear_avx2<scalar_t>(xc.data_ptr<scalar_t>(), codes.data_ptr<uint8_t>(), scale.data_ptr<c10::Half>(),
                                offset.data_ptr<c10::Half>(), bias ? bias->data_ptr<float>() : nullptr,
                                y.data_ptr<scalar_t>(), x.size(0), k, n);
  });
#endif
  return y;
}

// ---- every layer of a pure-decode step in one call -------------------------------------------------
// The Python layer loop (radixkv/cpu/fused.py's FusedLlama with small_linear weights) makes about eleven
// calls a layer, each paying Python, pybind and module overhead, a large share of a batch-1 step.
// DecodeStack makes the same kernel calls in the same order from C++, the residual adds fused
// into the following RMSNorm (which rounds the sum where the eager add does), so its output is
// bit-identical to the loop's: a CPU's counterpart of replaying a CUDA graph for decode.

// One linear layer as DecodeStack multiplies it: small_linear tiles [out / 8, in, 8] in the model's dtype and
// a float32 bias [out] or none; where the weights came from a Q4_1 file, also their coded_linear codes,
// which serve batches of at most coded_rows rows (beyond that the 16-bit tiles are faster).
struct TiledLinear {
  torch::Tensor tiles;
  c10::optional<torch::Tensor> bias, codes, scale, offset;
  int64_t coded_rows = 0;

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (codes && x.size(0) <= coded_rows) return coded_linear(x, *codes, *scale, *offset, bias);
    return small_linear(x, tiles, bias);
  }
};

struct DecodeLayer {
  torch::Tensor input_norm, post_norm;   // [hidden], the model's dtype
  TiledLinear qkv, o, gate_up, down;
  torch::Tensor k_pool, v_pool;          // this layer's [S, Hkv, D]
};

class DecodeStack {
 public:
  DecodeStack(std::vector<DecodeLayer> layers, int64_t heads, int64_t kv_heads, double eps, double scale)
      : layers_(std::move(layers)), heads_(heads), kv_heads_(kv_heads), eps_(eps), scale_(scale) {
    TORCH_CHECK(has_avx2(), "DecodeStack needs the AVX2 small_linear kernel (compiled for this machine)");
    TORCH_CHECK(!layers_.empty() && heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "DecodeStack: shapes");
    for (const DecodeLayer& L : layers_)
      TORCH_CHECK(L.k_pool.sizes() == layers_[0].k_pool.sizes() && L.v_pool.sizes() == L.k_pool.sizes(),
                  "DecodeStack: every layer's pools have one shape");
  }

  // x [B, hidden] (the embedded tokens, one per request); cos, sin [B, D]; slots [B] int64 (where each
  // token's K/V goes); kv_indices, kv_indptr: the decodes' CSR over the pool, new tokens included.
  // Returns the last layer's output [B, hidden] (before the final norm).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& slots, const torch::Tensor& kv_indices,
                        const torch::Tensor& kv_indptr) const {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == layers_[0].k_pool.scalar_type(), "DecodeStack: x [B, hidden]");
    const int64_t n = x.size(0), d = layers_[0].k_pool.size(2);
    TORCH_CHECK(kv_indices.scalar_type() == at::kLong && kv_indptr.scalar_type() == at::kLong &&
                kv_indptr.numel() == n + 1, "DecodeStack: kv_indices, kv_indptr [B + 1] int64");
    const auto idx = kv_indices.contiguous(), indptr = kv_indptr.contiguous();
    check_kv_csr(idx, indptr.data_ptr<int64_t>(), n, layers_[0].k_pool.size(0));  // once: every layer's pool is alike
    auto h = x.contiguous().clone();  // the residual stream, updated in place by rms_norm
    torch::Tensor delta;              // the previous sublayer's output, added into h by the next norm
    for (const DecodeLayer& L : layers_) {
      auto a = delta.defined() ? rms_norm(delta, h, L.input_norm, eps_) : rms_norm(h, c10::nullopt, L.input_norm, eps_);
      auto qkv = L.qkv(a);  // [B, (H + 2 Hkv) D]
      rope_store(qkv, cos, sin, L.k_pool, L.v_pool, slots, heads_, kv_heads_);
      auto q = qkv.narrow(1, 0, heads_ * d).view({n, heads_, d});  // read in place, rows (H + 2 Hkv) D apart
      auto o = paged_decode_impl(q, L.k_pool, L.v_pool, idx, indptr, scale_, false);  // [B, H, D]
      auto m = rms_norm(L.o(o.view({n, heads_ * d})), h, L.post_norm, eps_);
      delta = L.down(silu_mul(L.gate_up(m)));
    }
    return h.add_(delta);
  }

 private:
  std::vector<DecodeLayer> layers_;
  int64_t heads_, kv_heads_;
  double eps_, scale_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_linear", &small_linear, "Small-batch linear layer from 8-column weight tiles (AVX2)");
  m.def("coded_linear", &coded_linear, "small_linear from 4-bit affine codes of the same weights (AVX2)");
  m.def("has_avx2", &has_avx2, "Whether the AVX2 (FMA, F16C) paths were compiled in");
  m.def("paged_decode", &paged_decode, "Paged decode attention on the CPU (see the file's header)");
  m.def("paged_prefill", &paged_prefill, "Paged causal prefill attention (see prefill_supported)");
  m.def("prefill_supported", &prefill_supported, "Whether paged_prefill takes this dtype name and head_dim here");
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally after adding x into residual in place");
  m.def("rope_store", &rope_store, "RoPE on qkv's q and k heads in place, k and v stored in the pools");
  m.def("silu_mul", &silu_mul, "SwiGLU's silu(gate) * up");
  m.def("has_avx512_bf16", &has_avx512_bf16, "Whether the bfloat16 AVX-512 path was compiled in");
  using T = torch::Tensor;
  using OptT = c10::optional<torch::Tensor>;
  py::class_<TiledLinear>(m, "TiledLinear", py::module_local(), "One linear layer's weights for DecodeStack")
      .def(py::init([](T tiles, OptT bias, OptT codes, OptT scale, OptT offset, int64_t coded_rows) {
             TORCH_CHECK(codes.has_value() == scale.has_value() && codes.has_value() == offset.has_value(),
                         "TiledLinear: codes, scale and offset go together");
             return TiledLinear{tiles, bias, codes, scale, offset, coded_rows};
           }),
           py::arg("tiles"), py::arg("bias") = py::none(), py::arg("codes") = py::none(),
           py::arg("scale") = py::none(), py::arg("offset") = py::none(), py::arg("coded_rows") = 0);
  py::class_<DecodeLayer>(m, "DecodeLayer", py::module_local(), "One layer's weights and KV pools for DecodeStack")
      .def(py::init([](T input_norm, T post_norm, TiledLinear qkv, TiledLinear o, TiledLinear gate_up,
                       TiledLinear down, T k_pool, T v_pool) {
             return DecodeLayer{input_norm, post_norm, qkv, o, gate_up, down, k_pool, v_pool};
           }),
           py::arg("input_norm"), py::arg("post_norm"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"),
           py::arg("down"), py::arg("k_pool"), py::arg("v_pool"));
  py::class_<DecodeStack>(m, "DecodeStack", py::module_local(),
                          "Every layer of a pure-decode step in one call (see the source)")
      .def(py::init<std::vector<DecodeLayer>, int64_t, int64_t, double, double>(), py::arg("layers"),
           py::arg("heads"), py::arg("kv_heads"), py::arg("eps"), py::arg("scale"))
      .def("forward", &DecodeStack::forward, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("slots"),
           py::arg("kv_indices"), py::arg("kv_indptr"));
}
