// ReadKV's decode reads on the CPU: progressive codes held as bit planes (kvbench.quant.bitplanes),
// read prefix by prefix, and the budgeted prefix allocation (kvbench.quant.progressive).
//
// A B-bit code q read at prefix p reconstructs at the centre of its bin,
//   x_p = z + s (u + o_p),   u = q with its low B - p bits cleared,   o_p = 2^(B-p) / 2 - 1/2,
// and u is the sum over the planes j < p of bit (B-1-j) of q times 2^(B-1-j). So a kernel reads
// plane j of an entry only where some query row sharing the kv head reads more than j bits, and
// never touches the other planes' bytes:
//
//   plane_key_scores: out[m, t] = scaling * sum_c q[m, c] x_p[m, c](t), p = prefix[m, c] per channel,
//     planes packed along tokens (a byte holds one channel's bit of 8 tokens; the 8 tokens are the 8
//     lanes of one vector), per-channel scale/zero over groups of G tokens;
//   plane_value_mix: out[m, d] = sum_t a[m, t] x_p[m, t](d), p = prefix[m, t] per token, planes
//     packed along channels, per-token scale/zero over groups of G channels;
//   allocate_prefix: the budget's largest refinement gains w_i 2^-j per row (ties to the lowest
//     (item, bit) index), in O(N) per row instead of a top-k over N * B gains.
//
// The plain-torch references are kvbench.methods.readkv.blockwise_query_adaptive_attention and
// kvbench.quant.progressive.allocate_prefix_bits (tests/kernels/test_plane_kernels.py).

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVB_AVX2 1
#endif

namespace {

// Tokens per task of the key scores (a multiple of every group size up to 256) and of the mix.
constexpr int64_t kPlaneChunk = 256;
constexpr int kMaxRows = 8;

// Lane i of entry b: bit i of byte b, as float (keys) and as int32 (values).
struct BitLanes {
  alignas(32) float f[256][8];
  alignas(32) int32_t i[256][8];
  BitLanes() {
    for (int b = 0; b < 256; ++b)
      for (int l = 0; l < 8; ++l) {
        f[b][l] = static_cast<float>((b >> l) & 1);
        i[b][l] = (b >> l) & 1;
      }
  }
};

const BitLanes& bit_lanes() {
  static const BitLanes lanes;
  return lanes;
}

// One float of a 4-d parameter tensor (fp16, bf16 or fp32) read through its strides.
struct ParamView {
  const char* data;
  at::ScalarType type;
  int64_t item, sb, sh, sr, sc;
  explicit ParamView(const at::Tensor& x)
      : data(static_cast<const char*>(x.data_ptr())),
        type(x.scalar_type()),
        item(x.element_size()),
        sb(x.stride(0)),
        sh(x.stride(1)),
        sr(x.stride(2)),
        sc(x.stride(3)) {
    TORCH_CHECK(type == at::kHalf || type == at::kBFloat16 || type == at::kFloat,
                "scale/zero must be float16, bfloat16 or float32");
  }
  float at(int64_t b, int64_t h, int64_t r, int64_t c) const {
    const char* p = data + (b * sb + h * sh + r * sr + c * sc) * item;
    if (type == at::kFloat) return *reinterpret_cast<const float*>(p);
    const uint16_t bits = *reinterpret_cast<const uint16_t*>(p);
    if (type == at::kHalf) return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
    uint32_t w = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &w, 4);
    return f;
  }
};

struct PlaneView {
  const uint8_t* data;
  int64_t sb, sh, sr;
  explicit PlaneView(const at::Tensor& x)
      : data(x.data_ptr<uint8_t>()), sb(x.stride(0)), sh(x.stride(1)), sr(x.stride(2)) {
    TORCH_CHECK(x.scalar_type() == at::kByte && x.stride(3) == 1, "planes must be uint8 with unit channel stride");
  }
  const uint8_t* row(int64_t b, int64_t h, int64_t r) const { return data + b * sb + h * sh + r * sr; }
};

// v, hidden from the optimiser, so that no multiply-add is fused across it (torch rounds the
// square before the sum).
inline float opaque(float v) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("" : "+x"(v));
#else
  volatile float w = v;
  v = w;
#endif
  return v;
}

inline float centre_offset(int64_t bits, int64_t p) {
  return 0.5f * static_cast<float>(int64_t(1) << (bits - p)) - 0.5f;
}

// One group of G key tokens (G / 8 octets), N query rows: out[r, t] = scaling (A_r + sum over the
// read (plane, channel) pairs of W[pair, r] * bit), A_r the zero and centre terms.
template <int N>
void key_octets(const uint8_t* const* octet_rows, int64_t octets, const int32_t* pairs, int64_t npairs,
                const float* W, const float* A, float scaling, float* out, int64_t out_stride) {
  const BitLanes& lanes = bit_lanes();
  for (int64_t o = 0; o < octets; ++o) {
    const uint8_t* row = octet_rows[o];
#ifdef KVB_AVX2
    __m256 acc[N];
    for (int r = 0; r < N; ++r) acc[r] = _mm256_set1_ps(A[r]);
    for (int64_t k = 0; k < npairs; ++k) {
      const __m256 bit = _mm256_load_ps(lanes.f[row[pairs[k]]]);
      const float* w = W + k * N;
      for (int r = 0; r < N; ++r) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(w[r]), bit, acc[r]);
    }
    const __m256 sc = _mm256_set1_ps(scaling);
    for (int r = 0; r < N; ++r) _mm256_storeu_ps(out + r * out_stride + 8 * o, _mm256_mul_ps(acc[r], sc));
#else
    float acc[N][8];
    for (int r = 0; r < N; ++r)
      for (int l = 0; l < 8; ++l) acc[r][l] = A[r];
    for (int64_t k = 0; k < npairs; ++k) {
      const float* bit = lanes.f[row[pairs[k]]];
      const float* w = W + k * N;
      for (int r = 0; r < N; ++r)
        for (int l = 0; l < 8; ++l) acc[r][l] += w[r] * bit[l];
    }
    for (int r = 0; r < N; ++r)
      for (int l = 0; l < 8; ++l) out[r * out_stride + 8 * o + l] = acc[r][l] * scaling;
#endif
  }
}

using KeyOctets = void (*)(const uint8_t* const*, int64_t, const int32_t*, int64_t, const float*, const float*,
                           float, float*, int64_t);

KeyOctets key_octets_for(int n) {
  switch (n) {
    case 1: return key_octets<1>;
    case 2: return key_octets<2>;
    case 3: return key_octets<3>;
    case 4: return key_octets<4>;
    case 5: return key_octets<5>;
    case 6: return key_octets<6>;
    case 7: return key_octets<7>;
    default: return key_octets<8>;
  }
}

void check_4d(const at::Tensor& x, const char* name, int64_t B, int64_t H) {
  TORCH_CHECK(x.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(x.dim() == 4 && x.size(0) == B && x.size(1) == H, name, " must be [B, H_kv, ., .]");
}

}  // namespace

// query [B, H, M, D] float32, planes uint8 [B, H, T / 8, bits * D], scale / zero [B, H, T / G, D],
// prefix int64 [B, H, M, D] -> scaled logits float32 [B, H, M, T].
at::Tensor plane_key_scores(const at::Tensor& query, const at::Tensor& planes, const at::Tensor& scale,
                            const at::Tensor& zero, const at::Tensor& prefix, int64_t bits, int64_t group,
                            double scaling) {
  const int64_t B = query.size(0), H = query.size(1), M = query.size(2), D = query.size(3);
  check_4d(planes, "planes", B, H);
  check_4d(scale, "scale", B, H);
  check_4d(zero, "zero", B, H);
  TORCH_CHECK(group % 8 == 0 && kPlaneChunk % group == 0, "group must be a multiple of 8 dividing 256");
  TORCH_CHECK(planes.size(3) == bits * D, "planes must hold bits * D bytes per octet");
  const int64_t T = planes.size(2) * 8;
  TORCH_CHECK(T % group == 0 && scale.size(2) == T / group, "keys must be whole groups of tokens");
  auto q = query.to(at::kFloat).contiguous();
  auto pre = prefix.to(at::kLong).contiguous();
  auto out = at::empty({B, H, M, T}, query.options().dtype(at::kFloat));
  const PlaneView pv(planes);
  const ParamView sv(scale), zv(zero);
  const float* qp = q.data_ptr<float>();
  const int64_t* pp = pre.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t chunks = (T + kPlaneChunk - 1) / kPlaneChunk;
  const float fscale = static_cast<float>(scaling);
  at::parallel_for(0, B * H * chunks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<int32_t> pairs;
    std::vector<float> qw, W, A(kMaxRows), off, s(D), z(D);
    std::vector<const uint8_t*> rows(group / 8);
    int64_t bound = -1;
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t bh = w / chunks, c = w % chunks, b = bh / H, h = bh % H;
      const float* qb = qp + bh * M * D;
      const int64_t* pb = pp + bh * M * D;
      if (bh != bound) {
        // the (plane, channel) pairs some row reads, and each row's weight on them
        bound = bh;
        pairs.clear();
        qw.clear();
        off.assign(M * D, 0.f);
        for (int64_t m = 0; m < M; ++m)
          for (int64_t d = 0; d < D; ++d) off[m * D + d] = centre_offset(bits, pb[m * D + d]);
        for (int64_t d = 0; d < D; ++d) {
          int64_t need = 0;
          for (int64_t m = 0; m < M; ++m) need = std::max(need, pb[m * D + d]);
          for (int64_t j = 0; j < need; ++j) {
            pairs.push_back(static_cast<int32_t>(j * D + d));
            const float weight = static_cast<float>(int64_t(1) << (bits - 1 - j));
            for (int64_t m = 0; m < M; ++m) qw.push_back(pb[m * D + d] > j ? qb[m * D + d] * weight : 0.f);
          }
        }
        W.resize(qw.size());
      }
      const int64_t npairs = static_cast<int64_t>(pairs.size());
      const int64_t t1 = std::min(T, (c + 1) * kPlaneChunk);
      for (int64_t t0 = c * kPlaneChunk; t0 < t1; t0 += group) {
        const int64_t g = t0 / group;
        for (int64_t d = 0; d < D; ++d) {
          s[d] = sv.at(b, h, g, d);
          z[d] = zv.at(b, h, g, d);
        }
        for (int64_t o = 0; o < group / 8; ++o) rows[o] = pv.row(b, h, t0 / 8 + o);
        for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
          const int n = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
          for (int r = 0; r < n; ++r) {
            const float* qm = qb + (m0 + r) * D;
            const float* om = off.data() + (m0 + r) * D;
            float a = 0.f;
            for (int64_t d = 0; d < D; ++d) a += qm[d] * (z[d] + om[d] * s[d]);
            A[r] = a;
          }
          // W[pair, r] = qw[pair, m0 + r] * s[channel of pair], rows m0.. packed n to a pair
          for (int64_t k = 0; k < npairs; ++k) {
            const float sd = s[pairs[k] % D];
            for (int r = 0; r < n; ++r) W[k * n + r] = qw[k * M + m0 + r] * sd;
          }
          key_octets_for(n)(rows.data(), group / 8, pairs.data(), npairs, W.data(), A.data(), fscale,
                            op + (bh * M + m0) * T + t0, T);
        }
      }
    }
  });
  return out;
}

// weights [B, H, M, T] float32 (any strides), planes uint8 [B, H, T, bits * ceil(D / 8)],
// scale / zero [B, H, T, D / G], prefix int64 [B, H, M, T] -> float32 [B, H, M, D].
at::Tensor plane_value_mix(const at::Tensor& weights, const at::Tensor& planes, const at::Tensor& scale,
                           const at::Tensor& zero, const at::Tensor& prefix, int64_t bits, int64_t group,
                           int64_t head_dim) {
  const int64_t B = weights.size(0), H = weights.size(1), M = weights.size(2), T = weights.size(3);
  const int64_t D = head_dim, D8 = (D + 7) / 8;
  check_4d(planes, "planes", B, H);
  check_4d(scale, "scale", B, H);
  check_4d(zero, "zero", B, H);
  TORCH_CHECK(planes.size(2) == T && planes.size(3) == bits * D8, "planes must be [B, H, T, bits * ceil(D / 8)]");
  TORCH_CHECK(group % 8 == 0 && D % group == 0 && scale.size(3) == D / group,
              "values need groups of a multiple of 8 channels dividing head_dim");
  auto p = weights.to(at::kFloat).contiguous();
  auto pre = prefix.to(at::kLong).contiguous();
  const int64_t chunks = std::max<int64_t>(1, (T + kPlaneChunk - 1) / kPlaneChunk);
  const int64_t G8 = group / 8, NG = D / group;
  // per task: M rows of D8 octets (8 lanes each) plus the M x NG zero/centre sums
  auto partial = at::zeros({B * H, chunks, M, D}, weights.options().dtype(at::kFloat));
  const PlaneView pv(planes);
  const ParamView sv(scale), zv(zero);
  const float* wp = p.data_ptr<float>();
  const int64_t* pp = pre.data_ptr<int64_t>();
  float* part = partial.data_ptr<float>();
  at::parallel_for(0, B * H * chunks, 1, [&](int64_t lo, int64_t hi) {
    const BitLanes& lanes = bit_lanes();
    std::vector<float> acc(M * D8 * 8), base(M * NG), s(NG), z(NG), coef(M);
    std::vector<int32_t> mask(M);
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t bh = w / chunks, c = w % chunks, b = bh / H, h = bh % H;
      const float* wb = wp + bh * M * T;
      const int64_t* pb = pp + bh * M * T;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(base.begin(), base.end(), 0.f);
      const int64_t t1 = std::min(T, (c + 1) * kPlaneChunk);
      for (int64_t t = c * kPlaneChunk; t < t1; ++t) {
        int64_t need = 0;
        for (int64_t m = 0; m < M; ++m) need = std::max(need, pb[m * T + t]);
        for (int64_t g = 0; g < NG; ++g) {
          s[g] = sv.at(b, h, t, g);
          z[g] = zv.at(b, h, t, g);
        }
        for (int64_t m = 0; m < M; ++m) {
          const float a = wb[m * T + t];
          const int64_t pm = pb[m * T + t];
          const float o = centre_offset(bits, pm);
          for (int64_t g = 0; g < NG; ++g) base[m * NG + g] += a * (z[g] + s[g] * o);
          // the row's code: the top pm of the `need` assembled bits
          mask[m] = pm == 0 ? 0 : static_cast<int32_t>(((1u << pm) - 1) << (bits - pm));
        }
        if (need == 0) continue;
        const uint8_t* row = pv.row(b, h, t);
        for (int64_t g = 0; g < NG; ++g) {
          for (int64_t m = 0; m < M; ++m) coef[m] = wb[m * T + t] * s[g];
          for (int64_t k = g * G8; k < (g + 1) * G8; ++k) {
#ifdef KVB_AVX2
            __m256i u = _mm256_setzero_si256();
            for (int64_t j = 0; j < need; ++j) {
              const __m256i bit = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes.i[row[j * D8 + k]]));
              u = _mm256_or_si256(u, _mm256_sll_epi32(bit, _mm_cvtsi32_si128(static_cast<int>(bits - 1 - j))));
            }
            for (int64_t m = 0; m < M; ++m) {
              const __m256 code = _mm256_cvtepi32_ps(_mm256_and_si256(u, _mm256_set1_epi32(mask[m])));
              float* am = acc.data() + (m * D8 + k) * 8;
              _mm256_storeu_ps(am, _mm256_fmadd_ps(_mm256_set1_ps(coef[m]), code, _mm256_loadu_ps(am)));
            }
#else
            int32_t u[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int64_t j = 0; j < need; ++j) {
              const int32_t* bit = lanes.i[row[j * D8 + k]];
              for (int l = 0; l < 8; ++l) u[l] |= bit[l] << (bits - 1 - j);
            }
            for (int64_t m = 0; m < M; ++m) {
              float* am = acc.data() + (m * D8 + k) * 8;
              for (int l = 0; l < 8; ++l) am[l] += coef[m] * static_cast<float>(u[l] & mask[m]);
            }
#endif
          }
        }
      }
      float* out = part + w * M * D;
      for (int64_t m = 0; m < M; ++m)
        for (int64_t d = 0; d < D; ++d) out[m * D + d] = acc[(m * D8) * 8 + d] + base[m * NG + d / group];
    }
  });
  return partial.sum(1).view({B, H, M, D});
}

namespace {

inline uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

// Prefix lengths of one row of N items (see allocate_prefix).
void allocate_row(const float* w, int64_t N, int64_t bits, int64_t k, int64_t* out, std::vector<float>& step,
                  std::vector<float>& cand, std::vector<uint8_t>& gt, std::vector<uint8_t>& eq) {
  if (k <= 0) {
    std::fill_n(out, N, 0);
    return;
  }
  if (k >= N * bits) {
    std::fill_n(out, N, bits);
    return;
  }
  // 1. how many gains fall in each binade (the float's exponent field); a normal gain w 2^-j sits
  // j binades below w, so an item whose w is at least `bits` binades above the subnormals adds to
  // `bits` consecutive bins in one step (a prefix sum below), every other item gain by gain
  int64_t hist[257] = {0};
  int64_t starts[257] = {0};
  for (int64_t i = 0; i < N; ++i) {
    const int64_t e = (float_bits(w[i]) >> 23) & 0xFF;
    if (e >= bits) {
      starts[e] += 1;  // bins e - bits + 1 .. e
      starts[e - bits] -= 1;
    } else {
      for (int64_t j = 0; j < bits; ++j) hist[(float_bits(w[i] * step[j]) >> 23) & 0xFF] += 1;
    }
  }
  int64_t running = 0;
  for (int64_t e = 255; e >= 0; --e) {
    running += starts[e];
    hist[e] += running;
  }
  // 2. the binade of the k-th largest gain, and its rank among that binade's gains
  int64_t above = 0, E = 255;
  for (; E > 0 && above + hist[E] < k; --E) above += hist[E];
  const int64_t rank = k - above;  // 1-based, <= hist[E]
  cand.clear();
  for (int64_t i = 0; i < N; ++i) {
    const int64_t e = (float_bits(w[i]) >> 23) & 0xFF;
    if (e >= bits) {
      const int64_t j = e - E;
      if (j >= 0 && j < bits) cand.push_back(w[i] * step[j]);
    } else {
      for (int64_t j = 0; j < bits; ++j) {
        const float g = w[i] * step[j];
        if (static_cast<int64_t>((float_bits(g) >> 23) & 0xFF) == E) cand.push_back(g);
      }
    }
  }
  // the rank-th largest candidate: one more histogram, on the next 8 bits (the top of the
  // mantissa), narrows the candidates to one sub-bin before the exact selection
  int64_t sub[256] = {0};
  for (float g : cand) sub[(float_bits(g) >> 15) & 0xFF] += 1;
  int64_t S = 255, above_sub = 0;
  for (; S > 0 && above_sub + sub[S] < rank; --S) above_sub += sub[S];
  const auto outside = std::remove_if(cand.begin(), cand.end(), [S](float g) {
    return static_cast<int64_t>((float_bits(g) >> 15) & 0xFF) != S;
  });
  cand.erase(outside, cand.end());
  const int64_t r2 = rank - above_sub;
  std::nth_element(cand.begin(), cand.begin() + (r2 - 1), cand.end(), std::greater<float>());
  const float tau = cand[r2 - 1];
  // 3. every gain above tau, then the ties at tau from the lowest item up. For an item at least
  // `bits` binades above the subnormals, w 2^-j > tau exactly when w > tau 2^j (both products
  // exact), so its counts need no multiplication
  float thr[8];
  for (int64_t j = 0; j < bits; ++j) thr[j] = tau / step[j];
  int64_t taken = 0;
  for (int64_t i = 0; i < N; ++i) {
    int64_t n_gt = 0, n_eq = 0;
    const float x = w[i];
    if (static_cast<int64_t>((float_bits(x) >> 23) & 0xFF) >= bits && std::isfinite(thr[bits - 1])) {
      for (int64_t j = 0; j < bits; ++j) {
        n_gt += x > thr[j];
        n_eq += x == thr[j];
      }
    } else {
      for (int64_t j = 0; j < bits; ++j) {
        const float g = x * step[j];
        n_gt += g > tau;
        n_eq += g == tau;
      }
    }
    gt[i] = static_cast<uint8_t>(n_gt);
    eq[i] = static_cast<uint8_t>(n_eq);
    taken += n_gt;
  }
  int64_t ties = k - taken;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t extra = std::min<int64_t>(ties, eq[i]);
    ties -= extra;
    out[i] = gt[i] + extra;
  }
}

}  // namespace

// Prefix lengths p [..., N] (int64, 0..bits) for non-negative item weights [..., N]: the
// min(budget, N * bits) largest gains w_i 2^-j (j < bits) of each row, counted per item, ties at
// the threshold going to the lowest item. The gains are kvbench.quant.progressive's float32
// products, compared exactly, so without ties this is the reference's allocation.
at::Tensor allocate_prefix(const at::Tensor& weights, int64_t bits, int64_t budget) {
  TORCH_CHECK(weights.device().is_cpu(), "weights must be on the CPU");
  TORCH_CHECK(bits >= 1 && bits <= 8, "bits must be in 1..8");
  auto w = weights.to(at::kFloat).contiguous();
  const int64_t N = w.size(-1), R = N ? w.numel() / N : 0;
  auto out = at::empty(w.sizes(), w.options().dtype(at::kLong));
  if (R == 0) return out;
  std::atomic<bool> negative{false};
  const float* wp = w.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> step(bits), cand;
    for (int64_t j = 0; j < bits; ++j) step[j] = static_cast<float>(1.0 / static_cast<double>(int64_t(1) << j));
    std::vector<uint8_t> gt(N), eq(N);
    for (int64_t r = lo; r < hi; ++r) {
      const float* row = wp + r * N;
      if (std::any_of(row, row + N, [](float x) { return !(x >= 0.f); })) {
        negative = true;  // a NaN too: the binade walk orders non-negative floats only
        continue;
      }
      allocate_row(row, N, bits, budget, op + r * N, step, cand, gt, eq);
    }
  });
  TORCH_CHECK(!negative, "allocation weights must be >= 0 (and not NaN)");
  return out;
}

// sqrt(mean(float(scale)^2)) over the channel groups of each token (dim -1: values' rho, [B, H, T])
// or over the token groups of each channel (dim -2: keys' sigma, [B, H, D]): the allocation
// weights' statistics, in one pass over the fp16 parameters.
at::Tensor plane_rms(const at::Tensor& scale, int64_t dim) {
  TORCH_CHECK(scale.dim() == 4 && scale.device().is_cpu(), "scale must be a 4-d CPU tensor");
  TORCH_CHECK(dim == -1 || dim == -2, "dim must be -1 or -2");
  const int64_t B = scale.size(0), H = scale.size(1), R = scale.size(2), C = scale.size(3);
  const ParamView sv(scale);
  const int64_t n = dim == -1 ? C : R, items = dim == -1 ? R : C;
  auto out = at::empty({B, H, items}, scale.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  // torch's mean, summed in order; its vectorised square root differs from std::sqrt by an ulp at
  // times, so these statistics (and through them a near-tied allocation) match the reference to
  // float rounding, not bit for bit
  at::parallel_for(0, B * H, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> acc(items);
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      std::fill(acc.begin(), acc.end(), 0.f);
      if (dim == -1) {
        for (int64_t r = 0; r < R; ++r)
          for (int64_t c = 0; c < C; ++c) {
            const float x = sv.at(b, h, r, c);
            acc[r] += opaque(x * x);
          }
      } else {
        for (int64_t r = 0; r < R; ++r)
          for (int64_t c = 0; c < C; ++c) {
            const float x = sv.at(b, h, r, c);
            acc[c] += opaque(x * x);
          }
      }
      for (int64_t i = 0; i < items; ++i) op[bh * items + i] = std::sqrt(acc[i] / static_cast<float>(n));
    }
  });
  return out;
}

void register_plane_kernels(pybind11::module& m) {
  m.def("plane_rms", &plane_rms, "ReadKV: root-mean-square scale per token (dim -1) or channel (dim -2)");
  m.def("plane_key_scores", &plane_key_scores, "ReadKV: query . prefix-read key planes -> scaled logits");
  m.def("plane_value_mix", &plane_value_mix, "ReadKV: weights x prefix-read value planes");
  m.def("allocate_prefix", &allocate_prefix, "ReadKV: budgeted prefix lengths (largest refinement gains)");
}
