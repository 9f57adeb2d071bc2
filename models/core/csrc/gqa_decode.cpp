// draftsmith::gqa_decode(q [B, H, Q, D], k [B, KV, C, D], v [B, KV, C, D] bf16, mask [Bm, Q, C] bool or fp32
// additive, scale) -> [B, Q, H, D] bf16: softmax(q k^T * scale + mask) v for decoding's few query rows.
//
// Decoding attention is a few dot products per cached token, yet torch's bf16 batched matmul costs ~30 us a call in
// fixed overhead (SmolLM2: 2 calls x 30 layers a step, ~3 ms of ~20), and a static cache's matmuls run over every
// column of its capacity, filled or not. Here each query row stops at the last column its mask lets it see, and one
// call does both products and the softmax. Each KV head's rows of k and v are read once for its whole group of
// query heads and rows (grouped-query attention without repeat_kv). Products are exact bf16 x bf16 (vdpbf16ps),
// sums, softmax and the weighted sum of v in fp32, one bf16 rounding at the end. Scores take 16 columns at a time: each
// block of keys is transposed once into pairs of the head dim, then every query row's pairs are broadcast against it
// (a verify's 5-16 rows at the cost of few more than one's).
// A row whose mask hides every column averages v over all columns, as a softmax of equal (lowest) scores does.
#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

// an additive mask entry at or below this hides its column (a float32 or bfloat16 "lowest", or -inf)
constexpr float HIDDEN = -1e38f;
constexpr int64_t ROWS = 4;  // query rows whose weighted sums of v are accumulated together, in registers

inline __mmask16 tail16(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

// e^x for x <= 0 (a softmax's shifted scores), 16 at a time: 2^(x log2 e) as 2^n (vscalefps) times a degree-6
// polynomial for 2^f on [-1/2, 1/2] (relative error ~2e-7, fp32's rounding); x below -100 (and -inf) gives 0 exactly
inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-100.f), _CMP_GT_OQ);
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.f)), _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));  // e^f = 2^(t-n)
  __m512 y = _mm512_set1_ps(1.f / 720);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f / 120));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f / 24));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f / 6));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.5f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(live, y, n);
}

// one row's softmax numerators in place over columns [0, n), zeros over [n, width); returns their sum
inline float softmax_row(float* sr, int64_t n, int64_t width) {
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t c = 0; c < n; c += 16) mx = _mm512_mask_max_ps(mx, tail16(n - c), mx, _mm512_loadu_ps(sr + c));
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 m = tail16(n - c);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sr + c), top));
    _mm512_mask_storeu_ps(sr + c, m, e);
    sum = _mm512_mask_add_ps(sum, m, sum, e);
  }
  for (int64_t c = n; c < width; ++c) sr[c] = 0.f;
  return _mm512_reduce_add_ps(sum);
}

// 16 columns' keys [c0, c0 + 16) transposed to pairs: kt[p] holds dword p (head-dim elements 2p, 2p + 1) of each
// column, so one vdpbf16ps against a broadcast pair of q adds that pair's products to 16 columns' scores at once
inline void keys_transposed(const at::BFloat16* k0, int64_t ks2, int64_t P, __mmask16 live, __m512i* kt) {
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(static_cast<int>(ks2 / 2)));
  const int* base = reinterpret_cast<const int*>(k0);
  for (int64_t p = 0; p < P; ++p)
    kt[p] = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, idx, base + p, 4);
}

// q (P dwords) against the transposed block: 16 columns' scores, four chains of vdpbf16ps to hide its latency
inline __m512 scores16(const int32_t* q, const __m512i* kt, int64_t P) {
  __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t p = 0;
  for (; p + 4 <= P; p += 4)
    for (int64_t u = 0; u < 4; ++u)
      a[u] = _mm512_dpbf16_ps(a[u], (__m512bh)kt[p + u], (__m512bh)_mm512_set1_epi32(q[p + u]));
  for (; p < P; ++p) a[0] = _mm512_dpbf16_ps(a[0], (__m512bh)kt[p], (__m512bh)_mm512_set1_epi32(q[p]));
  return _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
}

inline __m512 load_bf16_as_fp32(const at::BFloat16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

at::Tensor gqa_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                      double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
              v.scalar_type() == at::kBFloat16, "gqa_decode: q, k and v must be bfloat16");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes(), "gqa_decode: q [B,H,Q,D], k = v [B,KV,C,D]");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "gqa_decode: the head dim must be dense");
  TORCH_CHECK(q.size(3) % 2 == 0 && k.stride(2) % 2 == 0 && q.stride(2) % 2 == 0 && q.stride(1) % 2 == 0 &&
              q.stride(0) % 2 == 0, "gqa_decode: the head dim and the strides must be even (pairs of bf16)");
  const int64_t B = q.size(0), H = q.size(1), Q = q.size(2), D = q.size(3), KV = k.size(1), C = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && KV > 0 && H % KV == 0, "gqa_decode: shapes do not match");
  TORCH_CHECK(mask.dim() == 3 && (mask.size(0) == 1 || mask.size(0) == B) && mask.size(1) == Q &&
              mask.size(2) == C && mask.is_contiguous(), "gqa_decode: mask must be [1 or B, Q, C], contiguous");
  const bool additive = mask.scalar_type() == at::kFloat;
  TORCH_CHECK(additive || mask.scalar_type() == at::kBool, "gqa_decode: mask must be bool or float32");
  const int64_t G = H / KV, R = G * Q;  // the rows one KV head serves: its G query heads x Q query rows
  at::Tensor out = at::empty({B, Q, H, D}, q.options());
  const auto* qp = q.data_ptr<at::BFloat16>();
  const auto* kp = k.data_ptr<at::BFloat16>();
  const auto* vp = v.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  const bool* mb = additive ? nullptr : mask.data_ptr<bool>();
  const float* mf = additive ? mask.data_ptr<float>() : nullptr;
  const float sc = static_cast<float>(scale);
  // strides read once: Tensor::stride(d) is an out-of-line call, too slow for the loops over columns
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2), ks0 = k.stride(0), ks1 = k.stride(1),
                ks2 = k.stride(2), vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2), Bm = mask.size(0);

  at::parallel_for(0, B * KV, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s(R * C), acc(R * D), zeros(C, 0.f);
    std::vector<__m512i> kt((D + 1) / 2);
    std::vector<int64_t> seen(Q);  // per query row: columns [0, seen) hold every one it attends to
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / KV, kh = t % KV, bm = Bm == 1 ? 0 : b;
      auto hidden = [&](int64_t i, int64_t c) {
        const int64_t at = (bm * Q + i) * C + c;
        return additive ? mf[at] <= HIDDEN : !mb[at];
      };
      int64_t width = 0;
      for (int64_t i = 0; i < Q; ++i) {
        int64_t c = C;
        while (c > 0 && hidden(i, c - 1)) --c;
        seen[i] = c == 0 ? -C : c;  // negative: every column hidden, the row averages all C
        width = std::max<int64_t>(width, c == 0 ? C : c);
      }
      const at::BFloat16* kb = kp + b * ks0 + kh * ks1;  // this KV head's keys and values
      const at::BFloat16* vb = vp + b * vs0 + kh * vs1;
      // scores: row r = (query head g, query row i), 16 columns at a time, each block of keys transposed once for
      // all R rows
      {
        const int64_t P = D / 2;
        for (int64_t c0 = 0; c0 < width; c0 += 16) {
          const __mmask16 live = tail16(width - c0);
          keys_transposed(kb + c0 * ks2, ks2, P, live, kt.data());
          for (int64_t i = 0; i < Q; ++i) {
            const int64_t n = seen[i];
            __mmask16 vis = n < 0 ? (__mmask16)0 : (__mmask16)(live & tail16(std::max<int64_t>(n - c0, 0)));
            const int64_t at = (bm * Q + i) * C + c0;
            __m512 add = _mm512_setzero_ps();
            if (additive) {
              add = _mm512_maskz_loadu_ps(vis, mf + at);
              vis &= _mm512_cmp_ps_mask(add, _mm512_set1_ps(HIDDEN), _CMP_GT_OQ);
            } else {
              const __m128i bytes = _mm_maskz_loadu_epi8(vis, mb + at);
              vis &= _mm_test_epi8_mask(bytes, bytes);
            }
            for (int64_t g = 0; g < G; ++g) {
              const int64_t r = g * Q + i;
              __m512 x = _mm512_setzero_ps();  // a row that sees nothing: equal scores, it averages
              if (n >= 0) {
                const auto* qr = reinterpret_cast<const int32_t*>(qp + b * qs0 + (kh * G + g) * qs1 + i * qs2);
                x = _mm512_mask_blend_ps(vis, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                         _mm512_fmadd_ps(scores16(qr, kt.data(), P), _mm512_set1_ps(sc), add));
              }
              _mm512_mask_storeu_ps(s.data() + r * C + c0, live, x);
            }
          }
        }
      }
      // softmax per row over its own columns; every column up to the widest row's becomes a weight (0: hidden)
      std::vector<float> total(R);
      for (int64_t r = 0; r < R; ++r) total[r] = softmax_row(s.data() + r * C, std::abs(seen[r % Q]), width);
      // the weighted sum of v, by slices of 64 columns of D: ROWS rows x 4 vectors of accumulators stay in registers
      // over all the cache columns (an accumulator in memory costs a masked store and reload per column, and store
      // forwarding fails on masked accesses), and each v row's slice is 128 contiguous bytes, read once for ROWS rows
      for (int64_t r0 = 0; r0 < R; r0 += ROWS) {
        const int64_t nr = std::min<int64_t>(ROWS, R - r0);
        const float* pr[ROWS];
        for (int64_t j = 0; j < ROWS; ++j) pr[j] = j < nr ? s.data() + (r0 + j) * C : zeros.data();
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
          __mmask16 m[4];
          for (int64_t u = 0; u < 4; ++u) m[u] = d0 + 16 * u < D ? tail16(D - d0 - 16 * u) : (__mmask16)0;
          __m512 a[ROWS][4];
          for (int64_t j = 0; j < ROWS; ++j)
            for (int64_t u = 0; u < 4; ++u) a[j][u] = _mm512_setzero_ps();
          for (int64_t c = 0; c < width; ++c) {
            __m512 vv[4];
            for (int64_t u = 0; u < 4; ++u) vv[u] = load_bf16_as_fp32(vb + c * vs2 + d0 + 16 * u, m[u]);
            for (int64_t j = 0; j < ROWS; ++j) {
              const __m512 p = _mm512_set1_ps(pr[j][c]);
              for (int64_t u = 0; u < 4; ++u) a[j][u] = _mm512_fmadd_ps(p, vv[u], a[j][u]);
            }
          }
          for (int64_t j = 0; j < nr; ++j)
            for (int64_t u = 0; u < 4; ++u)
              if (m[u]) _mm512_mask_storeu_ps(acc.data() + (r0 + j) * D + d0 + 16 * u, m[u], a[j][u]);
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        const int64_t g = r / Q, i = r % Q;
        const __m512 inv = _mm512_set1_ps(1.f / total[r]);
        at::BFloat16* o = op + ((b * Q + i) * H + kh * G + g) * D;
        for (int64_t d = 0; d < D; d += 16) {
          const __mmask16 m = tail16(D - d);
          const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, acc.data() + r * D + d), inv);
          _mm256_mask_storeu_epi16(o + d, m, (__m256i)_mm512_cvtneps_pbh(x));
        }
      }
    }
  });
  return out;
}

}  // namespace

// the schema is defined in Python (models/core/attention.py), so that tracing knows the op before it is built
TORCH_LIBRARY_IMPL(draftsmith, CPU, m) { m.impl("gqa_decode", &gqa_decode); }
