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

// NB blocks of 16 weight rows (each a contiguous stream of `pairs` vectors) against MT x rows: acc_out[(nb*MT+m)*16..]
// Each broadcast pair of x serves NB weight vectors and each weight vector MT rows, so loads stay under the
// dot products' rate and a verify's few rows cost little more than one (all accumulators in the 32 registers).
template <int64_t MT, int64_t NB>
inline void blocks_rows(const int32_t* x, int64_t pairs, const __m512i* w, float* acc_out) {
  __m512 acc[NB][MT];
  for (int64_t nb = 0; nb < NB; ++nb)
    for (int64_t m = 0; m < MT; ++m) acc[nb][m] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < pairs; ++kk) {
    __m512bh xb[MT];
    for (int64_t m = 0; m < MT; ++m) xb[m] = (__m512bh)_mm512_set1_epi32(x[m * pairs + kk]);
    for (int64_t nb = 0; nb < NB; ++nb) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + nb * pairs + kk);
      for (int64_t m = 0; m < MT; ++m) acc[nb][m] = _mm512_dpbf16_ps(acc[nb][m], wv, xb[m]);
    }
  }
  for (int64_t nb = 0; nb < NB; ++nb)
    for (int64_t m = 0; m < MT; ++m) _mm512_storeu_ps(acc_out + (nb * MT + m) * 16, acc[nb][m]);
}

// No software prefetch: the streams are sequential and the hardware's prefetcher follows them; prefetching into L1
// 1 KiB ahead halved the rate (head-sized weight, one thread, Zen 5), into L2 64 vectors ahead changed nothing.
// One stream per block, not per group: interleaving 8 blocks pair by pair (one 512-byte stream) was no faster at one
// row and half as fast at four, where a group is read in two strided passes (both layouts in one process, Zen 5).

// blocks in flight for MT rows: NB * MT accumulators + MT broadcasts within 32 registers (one row: 8 independent
// sums to hide vdpbf16ps's latency)
constexpr int64_t nb_for(int64_t mt) { return mt == 1 ? 8 : mt <= 5 ? 4 : mt <= 7 ? 3 : 2; }

template <int64_t MT>
inline int64_t tile(const int32_t* x, int64_t pairs, const __m512i* w, int64_t left, float* acc) {
  // as many blocks as fit (nb_for(MT), else one); returns how many were done
  if (left >= nb_for(MT)) {
    blocks_rows<MT, nb_for(MT)>(x, pairs, w, acc);
    return nb_for(MT);
  }
  blocks_rows<MT, 1>(x, pairs, w, acc);
  return 1;
}

inline int64_t block_tile(const int32_t* x, int64_t mt, int64_t pairs, const __m512i* w, int64_t left, float* acc) {
  switch (mt) {
    case 1: return tile<1>(x, pairs, w, left, acc);
    case 2: return tile<2>(x, pairs, w, left, acc);
    case 3: return tile<3>(x, pairs, w, left, acc);
    case 4: return tile<4>(x, pairs, w, left, acc);
    case 5: return tile<5>(x, pairs, w, left, acc);
    case 6: return tile<6>(x, pairs, w, left, acc);
    case 7: return tile<7>(x, pairs, w, left, acc);
    default: return tile<8>(x, pairs, w, left, acc);
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
  // rows as a flat [M, K2] buffer; a contiguous x of even K is read in place (no reshape: ~1 us a call)
  at::Tensor xc = x.is_contiguous() ? x : x.contiguous();
  if (K2 != K) xc = at::constant_pad_nd(xc.reshape({-1, K}), {0, 1});
  const int64_t M = K > 0 ? x.numel() / K : 0;
  at::Tensor b32;
  if (bias.has_value() && bias->defined()) b32 = bias->to(at::kFloat).contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(N);
  at::Tensor out = at::empty(shape, x.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
  const int32_t* xp = reinterpret_cast<const int32_t*>(xc.data_ptr<at::BFloat16>());
  const __m512i* wp = reinterpret_cast<const __m512i*>(blocked.data_ptr<at::BFloat16>());
  const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
  const int64_t pairs = K2 / 2;
  float* of = fp32_out ? out.data_ptr<float>() : nullptr;
  at::BFloat16* ob = fp32_out ? nullptr : out.data_ptr<at::BFloat16>();
  // a grain of 16 blocks (256 rows): a small layer stays on one thread, where waking another costs more
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    alignas(64) float acc[24 * 16];  // nb_for(mt) * mt vectors, at most 21 (3 x 7)
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const int64_t mt = std::min<int64_t>(8, M - m0);
      for (int64_t b = b0; b < b1;) {
        const int64_t done = block_tile(xp + m0 * pairs, mt, pairs, wp + b * pairs, b1 - b, acc);
        for (int64_t nb = 0; nb < done; ++nb) {
          const int64_t n0 = 16 * (b + nb), nn = std::min<int64_t>(16, N - n0);
          const __mmask16 mask = (__mmask16)((1u << nn) - 1);
          const __m512 bv = bp ? _mm512_maskz_loadu_ps(mask, bp + n0) : _mm512_setzero_ps();
          for (int64_t m = 0; m < mt; ++m) {
            const __m512 v = _mm512_add_ps(_mm512_load_ps(acc + (nb * mt + m) * 16), bv);
            if (of) _mm512_mask_storeu_ps(of + (m0 + m) * N + n0, mask, v);
            else _mm256_mask_storeu_epi16(ob + (m0 + m) * N + n0, mask, (__m256i)_mm512_cvtneps_pbh(v));
          }
        }
        b += done;
      }
    }
  });
  return out;
}

}  // namespace

// the schema is defined in Python (models/core/gemv.py), so that tracing knows the op before this library is built
TORCH_LIBRARY_IMPL(draftsmith, CPU, m) { m.impl("bf16_linear", &bf16_linear); }
