// draftsmith::bf16_linear(x [.., K] bf16, blocked [N16/16, K2/2, 16, 2] bf16, bias? [N] fp32, N, fp32_out) -> [.., N]
//
// A linear layer at decoding's few rows (M <= 16) as a streamed matrix-vector product over a weight laid out for
// AVX-512 BF16 (models/core/gemv.py ``block``): each 64-byte vector holds 16 output rows x 2 input columns, so
// vdpbf16ps against a broadcast pair of x accumulates 16 outputs in one register: no horizontal sums, and the
// weight is read once, as one contiguous stream per block of 16 rows. vdpbf16ps multiplies bf16 pairs exactly and
// sums in fp32, so the fp32 output equals an fp32 GEMM over the same bf16 values up to the order of the sums.
// Compiled and called only on a CPU with avx512_bf16 (models/core/gemv.py decides and measures).
#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

namespace {

// out[m, n0:n0+16] for the M x rows, over one block of 16 weight rows (K2 = input columns rounded up to even)
template <int64_t MT>
inline void block_rows(const int32_t* x, int64_t M, int64_t K2, const __m512i* w, float* acc_out) {
  // x is read as int32 pairs of bf16: x[m * K2/2 + kk] holds columns 2kk, 2kk+1
  const int64_t pairs = K2 / 2;
  if (MT == 1) {  // one row: four independent sums hide vdpbf16ps's latency
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t kk = 0;
    for (; kk + 4 <= pairs; kk += 4) {
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + kk), (__m512bh)_mm512_set1_epi32(x[kk]));
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + kk + 1), (__m512bh)_mm512_set1_epi32(x[kk + 1]));
      a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(w + kk + 2), (__m512bh)_mm512_set1_epi32(x[kk + 2]));
      a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(w + kk + 3), (__m512bh)_mm512_set1_epi32(x[kk + 3]));
    }
    for (; kk < pairs; ++kk)
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + kk), (__m512bh)_mm512_set1_epi32(x[kk]));
    _mm512_storeu_ps(acc_out, _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    return;
  }
  __m512 acc[MT];
  for (int64_t m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < pairs; ++kk) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + kk);
    for (int64_t m = 0; m < MT; ++m)
      acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_set1_epi32(x[m * pairs + kk]));
  }
  for (int64_t m = 0; m < MT; ++m) _mm512_storeu_ps(acc_out + 16 * m, acc[m]);
}

// No software prefetch: the stream is sequential and the hardware's prefetcher follows it; prefetching into L1
// 1 KiB ahead halved the rate (head-sized weight, one thread, Zen 5), into L2 64 vectors ahead changed nothing.

// one block of 16 weight rows against x rows m0..m0+mt-1 (mt <= 8: the accumulators stay in registers)
inline void block_tile(const int32_t* x, int64_t mt, int64_t K2, const __m512i* w, float* acc) {
  switch (mt) {
    case 1: return block_rows<1>(x, 1, K2, w, acc);
    case 2: return block_rows<2>(x, 2, K2, w, acc);
    case 3: return block_rows<3>(x, 3, K2, w, acc);
    case 4: return block_rows<4>(x, 4, K2, w, acc);
    case 5: return block_rows<5>(x, 5, K2, w, acc);
    case 6: return block_rows<6>(x, 6, K2, w, acc);
    case 7: return block_rows<7>(x, 7, K2, w, acc);
    default: return block_rows<8>(x, 8, K2, w, acc);
  }
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& blocked, const c10::optional<at::Tensor>& bias,
                       int64_t N, bool fp32_out) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && blocked.scalar_type() == at::kBFloat16,
              "bf16_linear: x and the blocked weight must be bfloat16");
  TORCH_CHECK(blocked.dim() == 4 && blocked.size(2) == 16 && blocked.size(3) == 2 && blocked.is_contiguous(),
              "bf16_linear: the weight must be blocked [N/16, K/2, 16, 2] (models/core/gemv.py block)");
  const int64_t blocks = blocked.size(0), K2 = 2 * blocked.size(1), K = x.size(-1);
  TORCH_CHECK(K == K2 || K + 1 == K2, "bf16_linear: x has ", K, " columns, the weight ", K2);
  TORCH_CHECK(N <= 16 * blocks && N > 16 * (blocks - 1), "bf16_linear: N=", N, " for ", blocks, " blocks");
  at::Tensor xc = x.reshape({-1, K});
  if (K2 != K) xc = at::constant_pad_nd(xc, {0, 1});
  xc = xc.contiguous();
  const int64_t M = xc.size(0);
  at::Tensor b32;
  if (bias.has_value() && bias->defined()) b32 = bias->to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, x.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
  const int32_t* xp = reinterpret_cast<const int32_t*>(xc.data_ptr<at::BFloat16>());
  const __m512i* wp = reinterpret_cast<const __m512i*>(blocked.data_ptr<at::BFloat16>());
  const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
  const int64_t pairs = K2 / 2;
  float* of = fp32_out ? out.data_ptr<float>() : nullptr;
  at::BFloat16* ob = fp32_out ? nullptr : out.data_ptr<at::BFloat16>();
  // a grain of 16 blocks (256 rows): a small layer stays on one thread, where waking another costs more
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    alignas(64) float acc[8 * 16];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = 16 * b, nn = std::min<int64_t>(16, N - n0);
      const __mmask16 mask = (__mmask16)((1u << nn) - 1);
      const __m512 bv = bp ? _mm512_maskz_loadu_ps(mask, bp + n0) : _mm512_setzero_ps();
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int64_t mt = std::min<int64_t>(8, M - m0);
        block_tile(xp + m0 * pairs, mt, K2, wp + b * pairs, acc);
        for (int64_t m = 0; m < mt; ++m) {
          const __m512 v = _mm512_add_ps(_mm512_load_ps(acc + 16 * m), bv);
          if (of) _mm512_mask_storeu_ps(of + (m0 + m) * N + n0, mask, v);
          else _mm256_mask_storeu_epi16(ob + (m0 + m) * N + n0, mask, (__m256i)_mm512_cvtneps_pbh(v));
        }
      }
    }
  });
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(N);
  return out.view(shape);
}

}  // namespace

// the schema is defined in Python (models/core/gemv.py), so that tracing knows the op before this library is built
TORCH_LIBRARY_IMPL(draftsmith, CPU, m) { m.impl("bf16_linear", &bf16_linear); }
