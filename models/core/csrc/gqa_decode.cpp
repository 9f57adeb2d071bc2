// draftsmith::gqa_decode(q [B, H, Q, D], k [B, KV, C, D], v [B, KV, C, D] bf16, mask [Bm, Q, C] bool or fp32
// additive, scale) -> [B, Q, H, D] bf16: softmax(q k^T * scale + mask) v for decoding's few query rows.
//
// Decoding attention is a few dot products per cached token, yet torch's bf16 batched matmul costs ~30 us a call in
// fixed overhead (SmolLM2: 2 calls x 30 layers a step, ~3 ms of ~20), and a static cache's matmuls run over every
// column of its capacity, filled or not. Here each query row stops at the last column its mask lets it see, and one
// call does both products and the softmax. Each KV head's rows of k and v are read once for its whole group of
// query heads and rows (grouped-query attention without repeat_kv). Products are exact bf16 x bf16 (vdpbf16ps),
// sums, softmax and the weighted sum of v in fp32, one bf16 rounding at the end.
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

inline __mmask32 tail32(int64_t left) { return left >= 32 ? 0xFFFFFFFFu : (__mmask32)((1ull << left) - 1); }
inline __mmask16 tail16(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

inline float dot_bf16(const at::BFloat16* a, const at::BFloat16* b, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 32) {
    const __mmask32 m = tail32(d - i);
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(m, a + i),
                           (__m512bh)_mm512_maskz_loadu_epi16(m, b + i));
  }
  return _mm512_reduce_add_ps(acc);
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
      // scores: row r = (query head g, query row i), each k row read once for all R rows
      for (int64_t c = 0; c < width; ++c) {
        const at::BFloat16* kr = kb + c * ks2;
        for (int64_t g = 0; g < G; ++g)
          for (int64_t i = 0; i < Q; ++i) {
            const int64_t r = g * Q + i, n = seen[i];
            float x;
            if (n < 0) x = 0.f;
            else if (c >= n || hidden(i, c)) x = -std::numeric_limits<float>::infinity();
            else {
              const at::BFloat16* qr = qp + b * qs0 + (kh * G + g) * qs1 + i * qs2;
              x = dot_bf16(qr, kr, D) * sc;
              if (additive) x += mf[(bm * Q + i) * C + c];
            }
            s[r * C + c] = x;
          }
      }
      // softmax per row over its own columns; every column up to the widest row's becomes a weight (0: hidden)
      std::vector<float> total(R);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t n = std::abs(seen[r % Q]);
        float* sr = s.data() + r * C;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < n; ++c) mx = std::max(mx, sr[c]);
        float sum = 0.f;
        for (int64_t c = 0; c < n; ++c) {
          const float e = std::exp(sr[c] - mx);
          sr[c] = e;
          sum += e;
        }
        for (int64_t c = n; c < width; ++c) sr[c] = 0.f;
        total[r] = sum;
      }
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
