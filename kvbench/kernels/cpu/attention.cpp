// Decode-attention reads of kvbench's stored formats on the CPU: one call over a whole stored part.
//
// Every kernel walks the tokens of one (batch, kv head) in chunks, turns each stored row into
// D float32 values in a small buffer that stays in L1 (upcast fp16 rows; unpack codes through a
// 256-entry byte table, then the affine or codebook map, then an optional RoPE rotation) and
// immediately uses it for all M query rows of that kv head (the GQA group times the new tokens),
// so every stored byte is read once and no dequantized copy of the part exists.
//
//   scores: out[b, h, m, t] = sum_d q[b, h, m, d] x[b, h, t, d]
//   mix:    out[b, h, m, d] = sum_t p[b, h, m, t] x[b, h, t, d]
//
// Both are written once (scores_over, mix_over) and instantiated per row decoder and per fold: the
// kind of scale/zero parameter and where it is applied (see "The two loop families" below).
//
// The layouts are kvbench.quant.packing's (chunks of c codes in m bytes, little endian, code i the
// i-th base-L digit; base-L words of 2..4 bytes are split into groups of k digits, L^k <= 256, by
// dividing by L^k, and each group read through the same 256-entry table) and the parameter tensors are read through their strides, so the views of
// kvbench's doubling buffers are read in place. The block sources' own scores/mix hold the plain-torch
// reference every kernel here is tested against (tests/kernels/test_cpu_kernels.py): kvbench/cache/fp.py,
// affine_source.py, codebook_source.py and source.py (RoPESource).

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVB_AVX2 1
#endif

namespace {

// The fold and tile code is inlined into the loop families whatever the inliner's budget: the kernels
// they replace had it in their own bodies, where the compiler vectorised and scheduled it as measured.
#define KVB_INLINE inline __attribute__((always_inline))

// Tokens per task: enough work to amortise a task, small enough to split 1K tokens over threads.
constexpr int64_t kChunk = 256;
// Tokens decoded before their dot products run: independent work for the FMA units.
constexpr int kSlots = 4;

inline float half_bits_to_float(uint16_t h) {
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

inline float bf16_bits_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// n values of a float tensor starting at `base`, `stride` elements apart, as float32.
void load_floats(const void* base, at::ScalarType type, int64_t stride, int64_t n, float* out) {
  if (type == at::kFloat) {
    const float* src = static_cast<const float*>(base);
    if (stride == 1) {
      std::memcpy(out, src, n * sizeof(float));
    } else {
      for (int64_t i = 0; i < n; ++i) out[i] = src[i * stride];
    }
    return;
  }
  const uint16_t* src = static_cast<const uint16_t*>(base);
  if (type == at::kHalf) {
    int64_t i = 0;
#ifdef KVB_AVX2
    if (stride == 1) {
      for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
      }
    }
#endif
    for (; i < n; ++i) out[i] = half_bits_to_float(src[i * stride]);
    return;
  }
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_bits_to_float(src[i * stride]);
}

#ifdef KVB_AVX2
// The sum of a's eight lanes: halves added, then two horizontal adds.
inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}
#endif

// out[m * out_stride] = q[m, :] . x for the M rows of q [M, D].
inline void dot_rows(const float* q, int64_t M, int64_t D, const float* x, float* out,
                     int64_t out_stride) {
  int64_t m = 0;
#ifdef KVB_AVX2
  if (D % 8 == 0) {
    // up to four independent FMA chains, one per query row, sharing every load of x
    for (; m + 4 <= M; m += 4) {
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      const float* q0 = q + m * D;
      for (int64_t d = 0; d < D; d += 8) {
        __m256 xv = _mm256_loadu_ps(x + d);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + d), xv, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + D + d), xv, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 2 * D + d), xv, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 3 * D + d), xv, a3);
      }
      __m256 acc[4] = {a0, a1, a2, a3};
      for (int j = 0; j < 4; ++j) {
        out[(m + j) * out_stride] = hsum(acc[j]);
      }
    }
    for (; m < M; ++m) {
      __m256 a = _mm256_setzero_ps();
      const float* qm = q + m * D;
      for (int64_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qm + d), _mm256_loadu_ps(x + d), a);
      out[m * out_stride] = hsum(a);
    }
    return;
  }
#endif
  for (; m < M; ++m) {
    const float* qm = q + m * D;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < D; ++d) s += qm[d] * x[d];
    out[m * out_stride] = s;
  }
}

#ifdef KVB_AVX2
// The four lane sums of a0..a3, in order, as one vector.
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  __m256 s01 = _mm256_hadd_ps(a0, a1);
  __m256 s23 = _mm256_hadd_ps(a2, a3);
  __m256 s = _mm256_hadd_ps(s01, s23);
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
#endif

// Four tokens at once: out[m * out_stride + j] = q[m, :] . x_j. Each query row keeps four
// independent FMA chains (one per token), which hides the FMA latency a single dot would expose,
// and one horizontal reduction serves four scores.
inline void dot_rows4(const float* q, int64_t M, int64_t D, const float* const* x, float* out,
                      int64_t out_stride) {
#ifdef KVB_AVX2
  if (D % 8 == 0) {
    for (int64_t m = 0; m < M; ++m) {
      const float* qm = q + m * D;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < D; d += 8) {
        __m256 qv = _mm256_loadu_ps(qm + d);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(x[0] + d), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(x[1] + d), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(x[2] + d), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(x[3] + d), a3);
      }
      _mm_storeu_ps(out + m * out_stride, hsum4(a0, a1, a2, a3));
    }
    return;
  }
#endif
  for (int j = 0; j < 4; ++j) dot_rows(q, M, D, x[j], out + j, out_stride);
}

// The weights a mix adds decoded rows with: w(m, g)[u] for query row m, channel group g (positions
// [g width, (g + 1) width) of a decoded row) and token u of the chunk, at base + (m groups + g) stride + u.
struct MixWeights {
  const float* base = nullptr;
  int64_t stride = 0, groups = 1, width = 0;
  bool vec = false;  // a group is whole 8-float vectors
};

// acc[m, group g] += sum_j w(m, g)[u + j] x_j for the M rows of acc [M, R] and the K decoded rows x_j
// (K = 1, or four: one load and store of the accumulator per four tokens). Groups: whether there may
// be more than one group.
template <int K, bool Groups>
KVB_INLINE void axpy_tile(const MixWeights& wt, int64_t u, int64_t M, int64_t R, const float* const* x, float* acc) {
  // locals, which the vector stores below cannot alias (memory they may)
  const float* const base = wt.base + u;
  const int64_t stride = wt.stride, groups = Groups ? wt.groups : 1, width = wt.width;
#ifdef KVB_AVX2
  if constexpr (K == 4) {
    if (wt.vec) {
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t gi = 0; gi < groups; ++gi) {
          const float* wg = base + (m * groups + gi) * stride;
          const __m256 w0 = _mm256_set1_ps(wg[0]), w1 = _mm256_set1_ps(wg[1]);
          const __m256 w2 = _mm256_set1_ps(wg[2]), w3 = _mm256_set1_ps(wg[3]);
          const int64_t off = gi * width;
          const float *x0 = x[0] + off, *x1 = x[1] + off, *x2 = x[2] + off, *x3 = x[3] + off;
          float* am = acc + m * R + off;
          for (int64_t d = 0; d < width; d += 8) {
            __m256 a = _mm256_loadu_ps(am + d);
            a = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + d), a);
            a = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x1 + d), a);
            a = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x2 + d), a);
            a = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x3 + d), a);
            _mm256_storeu_ps(am + d, a);
          }
        }
      }
      return;
    }
  }
#endif
  for (int64_t m = 0; m < M; ++m) {
    float* am = acc + m * R;
    for (int64_t gi = 0; gi < groups; ++gi) {
      const float* wg = base + (m * groups + gi) * stride;
      const int64_t d0 = gi * width, d1 = d0 + width;
      for (int j = 0; j < K; ++j) {
        const float wj = wg[j];
        const float* xj = x[j];
#pragma omp simd
        for (int64_t d = d0; d < d1; ++d) am[d] += wj * xj[d];
      }
    }
  }
}

// A 4-d tensor read through its strides, with broadcast (size-1) axes read at stride 0.
struct View4 {
  const char* data = nullptr;
  at::ScalarType type = at::kFloat;
  int64_t item = 4;
  int64_t sb = 0, sh = 0, st = 0, sd = 0;
  int64_t rows = 0, cols = 0;  // sizes of the token and channel axes

  View4() = default;
  explicit View4(const at::Tensor& x) {
    TORCH_CHECK(x.dim() == 4, "expected a 4-d tensor");
    data = static_cast<const char*>(x.data_ptr());
    type = x.scalar_type();
    item = x.element_size();
    sb = x.size(0) == 1 ? 0 : x.stride(0);
    sh = x.size(1) == 1 ? 0 : x.stride(1);
    st = x.size(2) == 1 ? 0 : x.stride(2);
    sd = x.size(3) == 1 ? 0 : x.stride(3);
    rows = x.size(2);
    cols = x.size(3);
  }
  const void* at(int64_t b, int64_t h, int64_t r, int64_t c) const {
    return data + (b * sb + h * sh + r * st + c * sd) * item;
  }
  bool valid() const { return data != nullptr; }
};

// A per-token or per-group parameter (scale or zero) expanded to D channels, reloaded only when
// the token moves to another parameter row (G tokens share a row for per-channel statistics).
struct Param {
  View4 view;
  int64_t tokens_per_row = 1;  // 0: one row for every token
  int64_t channels_per_value = 1;
  int64_t b = 0, h = 0, row = -1;
  std::vector<float> packed, full;

  Param(const View4& v, int64_t tokens_per_row_, int64_t head_dim)
      : view(v), tokens_per_row(tokens_per_row_) {
    if (view.valid()) {
      channels_per_value = head_dim / view.cols;
      packed.resize(view.cols);
      full.resize(head_dim);
    }
  }
  void bind(int64_t b_, int64_t h_) {
    b = b_;
    h = h_;
    row = -1;
  }
  const float* get(int64_t t) {
    const int64_t r = tokens_per_row == 0 ? 0 : t / tokens_per_row;
    if (r != row) {
      row = r;
      const int64_t n = view.cols;
      load_floats(view.at(b, h, r, 0), view.type, view.sd, n, packed.data());
      if (channels_per_value == 1) {
        std::copy(packed.begin(), packed.end(), full.begin());
      } else {
        for (int64_t j = 0; j < n; ++j)
          std::fill_n(full.begin() + j * channels_per_value, channels_per_value, packed[j]);
      }
    }
    return full.data();
  }
};

// Digits of a base-L word read through one 256-entry table: the largest k with L^k <= 256 (the codes
// of a byte in the one-byte layouts).
inline int64_t group_codes_of(int64_t levels) {
  int64_t k = 1, p = levels;
  while (p * levels <= 256) {
    p *= levels;
    ++k;
  }
  return k;
}

inline bool is_pow2(int64_t levels) { return (levels & (levels - 1)) == 0; }

// Compile-time copies of the layout rules (kvbench.quant.packing) for the kernels specialised to one
// level count: L^E, the digits per 256-entry group, and the tightest word of at most 4 bytes.
template <int L, int E>
constexpr uint64_t kPow = L * kPow<L, E - 1>;
template <int L>
constexpr uint64_t kPow<L, 0> = 1;

template <int L>
constexpr int kGroupCodes = [] {
  int k = 1;
  uint64_t p = L;
  while (p * L <= 256) p *= L, ++k;
  return k;
}();

struct ChunkShape {
  int codes, bytes;
};

template <int L>
constexpr ChunkShape kChunkShape = [] {
  ChunkShape best{0, 1};
  for (int m = 1; m <= 4; ++m) {
    int c = 0;
    uint64_t p = L;
    while (p <= (uint64_t{1} << (8 * m))) p *= L, ++c;
    if (c * best.bytes > best.codes * m) best = ChunkShape{c, m};
  }
  return best;
}();

// One stored row of codes -> D float32 values (table[code] * scale + zero, then RoPE).
struct CodeRows {
  View4 codes;
  int64_t levels, head_dim, chunk_codes, chunk_bytes, bits;
  // base-L words of several bytes: groups of group_codes digits, split off by dividing by group_base
  int64_t group_codes = 0, group_base = 0, groups = 0;
  const std::vector<float>* lut;    // [256 * group codes] byte/group -> table values
  const std::vector<float>* table;  // [levels] (multi-byte power-of-two chunks)
  Param scale, zero;
  // RoPE after the map: x'[d] = x[d] cos[p, d] + sign(d) x[d +- D/2] sin[p, d], p = offset + t
  const float* cos = nullptr;
  const float* sin = nullptr;
  int64_t rope_offset = 0;
  // four row buffers of each kind, one per token of a tile (kSlots rows in flight)
  std::vector<float> raw, out, turned;
  int64_t raw_stride = 0;
  int64_t b = 0, h = 0;

  CodeRows(const View4& codes_, int64_t levels_, int64_t head_dim_, int64_t chunk_codes_,
           int64_t chunk_bytes_, const std::vector<float>* lut_, const std::vector<float>* table_,
           const Param& scale_, const Param& zero_)
      : codes(codes_), levels(levels_), head_dim(head_dim_), chunk_codes(chunk_codes_),
        chunk_bytes(chunk_bytes_), lut(lut_), table(table_), scale(scale_), zero(zero_) {
    bits = is_pow2(levels) ? __builtin_ctzll(levels) : 0;
    if (bits == 0 && chunk_bytes > 1) {
      TORCH_CHECK(chunk_bytes <= 4, "base-L words are at most 4 bytes, got ", chunk_bytes);
      group_codes = group_codes_of(levels);
      group_base = 1;
      for (int64_t i = 0; i < group_codes; ++i) group_base *= levels;
      groups = (chunk_codes + group_codes - 1) / group_codes;
      const ChunkShape fixed = levels == 5    ? kChunkShape<5>
                               : levels == 7  ? kChunkShape<7>
                               : levels == 9  ? kChunkShape<9>
                               : levels == 10 ? kChunkShape<10>
                               : levels == 11 ? kChunkShape<11>
                                              : ChunkShape{int(chunk_codes), int(chunk_bytes)};
      TORCH_CHECK(fixed.codes == chunk_codes && fixed.bytes == chunk_bytes, "levels=", levels,
                  " packs ", fixed.codes, " codes in ", fixed.bytes, " bytes, not ", chunk_codes,
                  " in ", chunk_bytes);
    }
    const int64_t chunks = codes.cols / chunk_bytes;
    // + 8: the last group of a base-L word writes up to group_codes - 1 floats past its chunk
    raw_stride = std::max<int64_t>(chunks * chunk_codes, head_dim) + 8;
    raw.resize(kSlots * raw_stride);
    out.resize(kSlots * head_dim);
    turned.resize(kSlots * head_dim);
  }
  void bind(int64_t b_, int64_t h_) {
    b = b_;
    h = h_;
    scale.bind(b_, h_);
    zero.bind(b_, h_);
  }
  int64_t width() const { return head_dim; }

  template <int C>
  void unpack_bytes(const uint8_t* row, int64_t nbytes, float* dst) {
    const float* l = lut->data();
    for (int64_t j = 0; j < nbytes; ++j) std::memcpy(dst + j * C, l + row[j] * C, C * sizeof(float));
  }

  // Base-L words of M bytes: the word is split into groups of K digits by dividing by L^K (a plain
  // 32-bit division, measured faster here than digit-by-digit division, a double-precision
  // reciprocal or a 128-bit multiply-shift), and each group's K values copied from the table. Groups
  // are written in order, so the padding digits of a chunk's last group are overwritten by the next
  // chunk (or land in the row buffer's slack).
  template <int K, int M>
  void unpack_words(const uint8_t* row, int64_t chunks, float* dst) {
    const float* l = lut->data();
    const uint32_t base = static_cast<uint32_t>(group_base);
    const int64_t g = groups, c = chunk_codes;
    for (int64_t j = 0; j < chunks; ++j) {
      const uint8_t* b = row + j * M;
      uint32_t word = b[0];
      for (int k = 1; k < M; ++k) word |= static_cast<uint32_t>(b[k]) << (8 * k);
      float* d = dst + j * c;
      for (int64_t q = 0; q < g; ++q) {
        const uint32_t high = word / base;
        std::memcpy(d + q * K, l + (word - high * base) * K, K * sizeof(float));
        word = high;
      }
    }
  }

  // The same with every size a compile-time constant, so the division by L^K is a multiply and shift
  // and the group loop unrolls: the multi-byte level counts up to 16 (L = 5, 7, 9, 10, 11).
  template <int L>
  void unpack_words_fixed(const uint8_t* row, int64_t chunks, float* dst) {
    constexpr int K = kGroupCodes<L>, M = kChunkShape<L>.bytes, C = kChunkShape<L>.codes;
    constexpr int G = (C + K - 1) / K;
    constexpr uint32_t base = kPow<L, K>;
    const float* l = lut->data();
    for (int64_t j = 0; j < chunks; ++j) {
      const uint8_t* b = row + j * M;
      uint32_t word = b[0];
      for (int k = 1; k < M; ++k) word |= static_cast<uint32_t>(b[k]) << (8 * k);
      float* d = dst + j * C;
      for (int q = 0; q < G; ++q) {
        const uint32_t high = word / base;
        std::memcpy(d + q * K, l + (word - high * base) * K, K * sizeof(float));
        word = high;
      }
    }
  }

  template <int K>
  void unpack_words_k(const uint8_t* row, int64_t chunks, float* dst) {
    switch (chunk_bytes) {
      case 2: unpack_words<K, 2>(row, chunks, dst); break;
      case 3: unpack_words<K, 3>(row, chunks, dst); break;
      case 4: unpack_words<K, 4>(row, chunks, dst); break;
      default: TORCH_CHECK(false, "unsupported base-L word of ", chunk_bytes, " bytes");
    }
  }

  const float* operator()(int64_t t, int slot) {
    const uint8_t* row = static_cast<const uint8_t*>(codes.at(b, h, t, 0));
    float* dst = raw.data() + slot * raw_stride;
    const int64_t nbytes = codes.cols;
    if (chunk_bytes == 1) {
      switch (chunk_codes) {
        case 1: unpack_bytes<1>(row, nbytes, dst); break;
        case 2: unpack_bytes<2>(row, nbytes, dst); break;
        case 3: unpack_bytes<3>(row, nbytes, dst); break;
        case 4: unpack_bytes<4>(row, nbytes, dst); break;
        case 5: unpack_bytes<5>(row, nbytes, dst); break;
        case 8: unpack_bytes<8>(row, nbytes, dst); break;
        default: TORCH_CHECK(false, "unsupported chunk of ", chunk_codes, " codes per byte");
      }
    } else if (bits == 0) {
      const int64_t chunks = nbytes / chunk_bytes;
      switch (levels) {
        case 5: unpack_words_fixed<5>(row, chunks, dst); break;
        case 7: unpack_words_fixed<7>(row, chunks, dst); break;
        case 9: unpack_words_fixed<9>(row, chunks, dst); break;
        case 10: unpack_words_fixed<10>(row, chunks, dst); break;
        case 11: unpack_words_fixed<11>(row, chunks, dst); break;
        default:
      switch (group_codes) {
        case 1: unpack_words_k<1>(row, chunks, dst); break;
        case 2: unpack_words_k<2>(row, chunks, dst); break;
        case 3: unpack_words_k<3>(row, chunks, dst); break;
        case 5: unpack_words_k<5>(row, chunks, dst); break;
        default: TORCH_CHECK(false, "unsupported group of ", group_codes, " base-L digits");
      }
      }
    } else {
      // chunks of several bytes (L = 8, 32, 64, 128): a little-endian word of at most 7 bytes
      const int64_t chunks = nbytes / chunk_bytes;
      const uint64_t mask = static_cast<uint64_t>(levels - 1);
      const float* tab = table->data();
      for (int64_t j = 0; j < chunks; ++j) {
        uint64_t word = 0;
        for (int64_t k = 0; k < chunk_bytes; ++k)
          word |= static_cast<uint64_t>(row[j * chunk_bytes + k]) << (8 * k);
        for (int64_t i = 0; i < chunk_codes; ++i)
          dst[j * chunk_codes + i] = tab[(word >> (bits * i)) & mask];
      }
    }
    const int64_t D = head_dim;
    float* x = dst;
    float* o = out.data() + slot * D;
    if (scale.view.valid() && zero.view.valid()) {
      const float* s = scale.get(t);
      const float* z = zero.get(t);
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] = x[d] * s[d] + z[d];
      x = o;
    } else if (scale.view.valid()) {
      const float* s = scale.get(t);
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] = x[d] * s[d];
      x = o;
    } else if (zero.view.valid()) {
      const float* z = zero.get(t);
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] = x[d] + z[d];
      x = o;
    }
    if (cos != nullptr) {
      const int64_t half = D / 2;
      const float* c = cos + (rope_offset + t) * D;
      const float* s = sin + (rope_offset + t) * D;
      float* r = turned.data() + slot * D;
      for (int64_t d = 0; d < half; ++d) r[d] = x[d] * c[d] - x[d + half] * s[d];
      for (int64_t d = half; d < D; ++d) r[d] = x[d] * c[d] + x[d - half] * s[d];
      x = r;
    }
    return x;
  }
};

// Full-precision rows (fp16, bf16 or fp32) -> float32.
struct FloatRows {
  View4 data;
  int64_t head_dim;
  std::vector<float> out;
  int64_t b = 0, h = 0;

  FloatRows(const View4& data_, int64_t head_dim_) : data(data_), head_dim(head_dim_) {
    out.resize(kSlots * head_dim);
  }
  void bind(int64_t b_, int64_t h_) {
    b = b_;
    h = h_;
  }
  int64_t width() const { return head_dim; }
  const float* operator()(int64_t t, int slot) {
    if (data.type == at::kFloat && data.sd == 1) return static_cast<const float*>(data.at(b, h, t, 0));
    float* o = out.data() + slot * head_dim;
    load_floats(data.at(b, h, t, 0), data.type, data.sd, head_dim, o);
    return o;
  }
};

// Codes of b = 1, 2, 4 or 8 bits (8 / b per byte) unpacked by vector shifts, 8 bytes at a time:
// the 8 bytes are widened to 8 lanes and shift s keeps bits [b s, b s + b) of each, so output
// vector (j, s) holds, in lane l, code (8 j + l) (8 / b) + s. That order is a permutation of the
// row's channels within each 64 / b of them (:func:`shift_order`); the folded kernels apply it to
// the query or the accumulator once instead of shuffling every row, so a row costs a load, one
// widening and per 8 codes a shift, a mask and a conversion.
struct ShiftRows {
  View4 codes;
  int bits = 2;
  int64_t nbytes = 0, head_dim = 0;
  std::vector<float> out;
  int64_t b = 0, h = 0;

  // codebook values of the codes (up to 16 levels, looked up in registers), or null for the codes
  std::vector<float> table;

  ShiftRows(const View4& codes_, int bits_, int64_t head_dim_, const float* table_ = nullptr)
      : codes(codes_), bits(bits_), nbytes(head_dim_ * bits_ / 8), head_dim(head_dim_) {
    out.resize(kSlots * head_dim + 8);
    if (table_ != nullptr) {
      table.assign(16, 0.f);
      std::copy(table_, table_ + (1 << bits_), table.begin());
    }
  }
  void bind(int64_t b_, int64_t h_) {
    b = b_;
    h = h_;
  }
  const uint8_t* row(int64_t t) const { return static_cast<const uint8_t*>(codes.at(b, h, t, 0)); }
  int64_t width() const { return head_dim; }
#ifdef KVB_AVX2
  // codes -> their values: the codes themselves, or the table's entries (two 8-entry halves)
  template <bool LOOKUP>
  inline __m256 value(__m256i c, __m256 lo, __m256 hi) const {
    if constexpr (!LOOKUP) {
      return _mm256_cvtepi32_ps(c);
    } else {
      const __m256 a = _mm256_permutevar8x32_ps(lo, c);
      if (bits < 4) return a;
      const __m256 b = _mm256_permutevar8x32_ps(hi, c);
      return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_cmpgt_epi32(c, _mm256_set1_epi32(7))));
    }
  }
  template <int BITS, bool LOOKUP>
  void unpack(const uint8_t* row, float* dst) const {
    constexpr int per = 8 / BITS;
    const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
    __m256 lo = _mm256_setzero_ps(), hi = lo;
    if constexpr (LOOKUP) {
      lo = _mm256_loadu_ps(table.data());
      hi = _mm256_loadu_ps(table.data() + 8);
    }
    for (int64_t j = 0; j < nbytes; j += 8) {
      const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + j)));
      float* o = dst + j * per;
      if constexpr (BITS == 8) {
        _mm256_storeu_ps(o, _mm256_cvtepi32_ps(x));
      } else {
        for (int s = 0; s < per; ++s)
          _mm256_storeu_ps(o + 8 * s, value<LOOKUP>(_mm256_and_si256(_mm256_srli_epi32(x, BITS * s), mask), lo, hi));
      }
    }
  }
#endif
  const float* operator()(int64_t t, int slot) {
    const uint8_t* row = static_cast<const uint8_t*>(codes.at(b, h, t, 0));
    float* dst = out.data() + slot * head_dim;
#ifdef KVB_AVX2
    if (!table.empty()) {
      switch (bits) {
        case 1: unpack<1, true>(row, dst); break;
        case 2: unpack<2, true>(row, dst); break;
        default: unpack<4, true>(row, dst); break;
      }
      return dst;
    }
    switch (bits) {
      case 1: unpack<1, false>(row, dst); break;
      case 2: unpack<2, false>(row, dst); break;
      case 4: unpack<4, false>(row, dst); break;
      default: unpack<8, false>(row, dst); break;
    }
#endif
    return dst;
  }
};

// Whether the shift unpacking serves these codes: b in {1, 2, 4, 8} (one code never straddles a
// byte), whole 8-byte groups per row, and a vector unit to run it.
bool shift_unpackable(int64_t levels, int64_t head_dim, int64_t chunk_bytes) {
#ifdef KVB_AVX2
  if (chunk_bytes != 1 || (levels & (levels - 1)) != 0) return false;
  const int bits = __builtin_ctzll(levels);
  return (bits == 1 || bits == 2 || bits == 4 || bits == 8) && (head_dim * bits) % 64 == 0;
#else
  (void)levels;
  (void)head_dim;
  (void)chunk_bytes;
  return false;
#endif
}

// pos[d]: where channel d lands in a ShiftRows row (lane l of vector (j, s) holds channel
// (8 j + l) (8 / b) + s, and that vector starts at position 8 (j (8 / b) + s)).
std::vector<int64_t> shift_order(int bits, int64_t head_dim) {
  const int64_t per = 8 / bits;
  std::vector<int64_t> pos(head_dim);
  for (int64_t j = 0; j < head_dim / (8 * per); ++j)
    for (int64_t s = 0; s < per; ++s)
      for (int64_t l = 0; l < 8; ++l) pos[(8 * j + l) * per + s] = 8 * (j * per + s) + l;
  return pos;
}

#ifdef KVB_AVX2
// Shift-layout codes used where they are unpacked, with no row buffer: the folded affine kernels'
// inner loops for b = 1, 2, 4, 8 bits. Each performs, for every output element, the same multiply-adds
// in the same order as the buffered path (dot_rows4 / dot_rows, the four-token axpy), so the results
// are bit-identical to it; what goes is the store and reload of every unpacked row, which for a few
// query rows (a decode step's GQA group) costs as much as the dot products themselves.

// Vector s of the 8 bytes widened in x: bits [b s, b s + b) of each lane, as float.
template <int BITS>
inline __m256 shift_codes(__m256i x, int s, __m256i mask) {
  if (BITS == 8) return _mm256_cvtepi32_ps(x);
  const __m256i v = _mm256_srli_epi32(x, BITS * s);
  // the top digit of a byte needs no mask
  return _mm256_cvtepi32_ps(s == 8 / BITS - 1 ? v : _mm256_and_si256(v, mask));
}

inline __m256i widen8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// out[m * out_stride + u] = q[m, :] . codes(t0 + u) for u < n and MB query rows; q in shift order.
template <int BITS, int MB>
KVB_INLINE void shift_scores_block(const ShiftRows& rows, int64_t t0, int64_t n, const float* q, int64_t D, float* out,
                        int64_t out_stride) {
  constexpr int per = 8 / BITS;
  const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
  const int64_t spans = D * BITS / 64;
  int64_t u = 0;
  for (; u + 4 <= n; u += 4) {
    const uint8_t* r[4] = {rows.row(t0 + u), rows.row(t0 + u + 1), rows.row(t0 + u + 2), rows.row(t0 + u + 3)};
    __m256 acc[4][MB];
    for (int i = 0; i < 4; ++i)
      for (int m = 0; m < MB; ++m) acc[i][m] = _mm256_setzero_ps();
    for (int64_t j = 0; j < spans; ++j) {
      for (int s = 0; s < per; ++s) {
        const float* qk = q + 8 * (j * per + s);
        for (int i = 0; i < 4; ++i) {
          const __m256 v = shift_codes<BITS>(widen8(r[i] + 8 * j), s, mask);
          for (int m = 0; m < MB; ++m) acc[i][m] = _mm256_fmadd_ps(_mm256_loadu_ps(qk + m * D), v, acc[i][m]);
        }
      }
    }
    for (int m = 0; m < MB; ++m)
      _mm_storeu_ps(out + m * out_stride + u, hsum4(acc[0][m], acc[1][m], acc[2][m], acc[3][m]));
  }
  for (; u < n; ++u) {
    const uint8_t* r = rows.row(t0 + u);
    __m256 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t j = 0; j < spans; ++j)
      for (int s = 0; s < per; ++s) {
        const __m256 v = shift_codes<BITS>(widen8(r + 8 * j), s, mask);
        for (int m = 0; m < MB; ++m)
          acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(q + m * D + 8 * (j * per + s)), v, acc[m]);
      }
    for (int m = 0; m < MB; ++m) {
      out[m * out_stride + u] = hsum(acc[m]);
    }
  }
}

template <int BITS>
KVB_INLINE void shift_scores_rows(const ShiftRows& rows, int64_t t0, int64_t n, const float* q, int64_t M, int64_t D,
                       float* out, int64_t out_stride) {
  // query rows in blocks of up to four: dot_rows4 keeps one chain per (row, token), as here; six
  // rows go as two blocks of three (four tokens times four rows would not fit the registers)
  const int64_t step = M % 4 && M % 3 == 0 ? 3 : 4;
  for (int64_t m = 0; m < M; m += step) {
    const float* qm = q + m * D;
    float* om = out + m * out_stride;
    switch (std::min<int64_t>(step, M - m)) {
      case 1: shift_scores_block<BITS, 1>(rows, t0, n, qm, D, om, out_stride); break;
      case 2: shift_scores_block<BITS, 2>(rows, t0, n, qm, D, om, out_stride); break;
      case 3: shift_scores_block<BITS, 3>(rows, t0, n, qm, D, om, out_stride); break;
      default: shift_scores_block<BITS, 4>(rows, t0, n, qm, D, om, out_stride); break;
    }
  }
}

KVB_INLINE bool shift_scores(const ShiftRows& rows, int64_t t0, int64_t n, const float* q, int64_t M, int64_t D,
                         float* out, int64_t out_stride) {
  if (!rows.table.empty()) return false;
  switch (rows.bits) {
    case 1: shift_scores_rows<1>(rows, t0, n, q, M, D, out, out_stride); return true;
    case 2: shift_scores_rows<2>(rows, t0, n, q, M, D, out, out_stride); return true;
    case 4: shift_scores_rows<4>(rows, t0, n, q, M, D, out, out_stride); return true;
    case 8: shift_scores_rows<8>(rows, t0, n, q, M, D, out, out_stride); return true;
    default: return false;
  }
}

// acc[m, :] += sum_u w[m][g(span)][u] codes(t0 + u) for MB rows, in token order; acc and the codes in
// shift order; w(m, g) points at the weights of row m and channel group g for token t0. TWO: a span
// holds two channel groups (group = 32 / b codes); its lanes 0-3 are channels of the first (w) and
// lanes 4-7 of the second (w2), whatever the shift, so the weight vector holds one per half.
template <int BITS, int MB, int SB, bool TWO>
void shift_mix_span(const ShiftRows& rows, int64_t t0, int64_t n, const float* const* w, const float* const* w2,
                    int64_t j, int s0, float* const* acc) {
  const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
  constexpr int per = 8 / BITS;
  __m256 a[MB][SB];
  for (int m = 0; m < MB; ++m)
    for (int s = 0; s < SB; ++s) a[m][s] = _mm256_loadu_ps(acc[m] + 8 * (j * per + s0 + s));
  for (int64_t u = 0; u < n; ++u) {
    const __m256i x = widen8(rows.row(t0 + u) + 8 * j);
    for (int m = 0; m < MB; ++m) {
      __m256 wm;
      if constexpr (TWO)
        wm = _mm256_set_m128(_mm_set1_ps(w2[m][u]), _mm_set1_ps(w[m][u]));
      else
        wm = _mm256_set1_ps(w[m][u]);
      for (int s = 0; s < SB; ++s) a[m][s] = _mm256_fmadd_ps(wm, shift_codes<BITS>(x, s0 + s, mask), a[m][s]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int s = 0; s < SB; ++s) _mm256_storeu_ps(acc[m] + 8 * (j * per + s0 + s), a[m][s]);
}

template <int BITS, int MB, int SB>
void shift_mix_rows(const ShiftRows& rows, int64_t t0, int64_t n, const float* wsc, int64_t w_stride,
                    int64_t ng, int64_t group, int64_t D, float* acc) {
  constexpr int per = 8 / BITS;
  const int64_t spans = D * BITS / 64;
  const bool two = 2 * group == 64 / BITS;
  for (int64_t j = 0; j < spans; ++j) {
    const int64_t gi = j * (64 / BITS) / group;
    const float* w[MB];
    const float* w2[MB];
    float* am[MB];
    for (int m = 0; m < MB; ++m) {
      w[m] = wsc + (m * ng + gi) * w_stride;
      w2[m] = two ? w[m] + w_stride : w[m];
      am[m] = acc + m * D;
    }
    for (int s0 = 0; s0 < per; s0 += SB) {
      if (two)
        shift_mix_span<BITS, MB, SB, true>(rows, t0, n, w, w2, j, s0, am);
      else
        shift_mix_span<BITS, MB, SB, false>(rows, t0, n, w, w2, j, s0, am);
    }
  }
}

// Rows in blocks that keep twelve accumulators in registers: three rows of four code vectors, or,
// for four to six rows of codes with eight or more per byte, six rows of two (each code vector is
// then decoded once for all of them).
template <int BITS>
void shift_mix_bits(const ShiftRows& rows, int64_t t0, int64_t n, const float* wsc, int64_t w_stride, int64_t M,
                    int64_t ng, int64_t group, int64_t D, float* acc) {
  constexpr int per = 8 / BITS, SB = per < 4 ? per : 4;
  if constexpr (per >= 8) {
    if (M >= 4 && M <= 6) {
      switch (M) {
        case 4: shift_mix_rows<BITS, 4, 2>(rows, t0, n, wsc, w_stride, ng, group, D, acc); return;
        case 5: shift_mix_rows<BITS, 5, 2>(rows, t0, n, wsc, w_stride, ng, group, D, acc); return;
        default: shift_mix_rows<BITS, 6, 2>(rows, t0, n, wsc, w_stride, ng, group, D, acc); return;
      }
    }
  }
  for (int64_t m = 0; m < M; m += 3) {
    const float* wm = wsc + m * ng * w_stride;
    float* am = acc + m * D;
    switch (std::min<int64_t>(3, M - m)) {
      case 1: shift_mix_rows<BITS, 1, SB>(rows, t0, n, wm, w_stride, ng, group, D, am); break;
      case 2: shift_mix_rows<BITS, 2, SB>(rows, t0, n, wm, w_stride, ng, group, D, am); break;
      default: shift_mix_rows<BITS, 3, SB>(rows, t0, n, wm, w_stride, ng, group, D, am); break;
    }
  }
}

inline bool shift_mix(const ShiftRows& rows, int64_t t0, int64_t n, const float* wsc, int64_t w_stride, int64_t M,
                      int64_t ng, int64_t group, int64_t D, float* acc) {
  if (!rows.table.empty()) return false;
  switch (rows.bits) {
    case 1: shift_mix_bits<1>(rows, t0, n, wsc, w_stride, M, ng, group, D, acc); return true;
    case 2: shift_mix_bits<2>(rows, t0, n, wsc, w_stride, M, ng, group, D, acc); return true;
    case 4: shift_mix_bits<4>(rows, t0, n, wsc, w_stride, M, ng, group, D, acc); return true;
    case 8: shift_mix_bits<8>(rows, t0, n, wsc, w_stride, M, ng, group, D, acc); return true;
    default: return false;
  }
}
#endif

#ifdef KVB_AVX2
// Codes of a level count that is not a power of two (base-L chunks of one to three bytes, L <= 16,
// the chunk's value below 2^24) unpacked with vector arithmetic instead of a byte table: one lane per
// chunk, eight chunks at a time, the digits peeled off by d = v - L floor((v + 1/2) / L), exact in
// float for v below 2^22 / L. Three-byte words (L = 5: ten digits below 5^10) are first split into
// two halves by one division in double. The row comes out digit-major: block k of 8 chunks, digit i,
// lane j, at position (k C + i) 8 + j, holds channel (8 k + j) C + i (`digit_order`); positions past
// the last channel hold finite padding, which the kernels meet only with zero query entries or
// discard. A row's last block reads up to 31 bytes past it, so rows near the end of the code storage
// are first copied to a zero-padded buffer.
struct DigitRows {
  View4 codes;
  int64_t levels, head_dim, C, M, blocks, width_;
  int64_t low = 0;     // three-byte words: digits below the split, which is at L^low
  double split = 1;
  const uint8_t* end;  // one past the last readable byte of the code storage
  bool lookup;         // the table is not the codes themselves
  std::vector<float> table, out;
  std::vector<uint8_t> padded;
  int64_t b = 0, h = 0;

  DigitRows(const at::Tensor& codes_, int64_t levels_, int64_t head_dim_, int64_t chunk_codes, int64_t chunk_bytes,
            const float* table_)
      : codes(codes_), levels(levels_), head_dim(head_dim_), C(chunk_codes), M(chunk_bytes) {
    const int64_t chunks = (head_dim + C - 1) / C;
    blocks = (chunks + 7) / 8;
    width_ = blocks * C * 8;
    if (M == 3) {
      low = C / 2;
      for (int64_t i = 0; i < low; ++i) split *= static_cast<double>(levels);
    }
    const auto& storage = codes_.storage();
    end = static_cast<const uint8_t*>(storage.data()) + storage.nbytes();
    table.assign(16, 0.f);
    lookup = false;
    for (int64_t l = 0; l < levels; ++l) {
      table[l] = table_[l];
      lookup = lookup || table_[l] != static_cast<float>(l);
    }
    out.resize(kSlots * width_);
    padded.assign(codes.cols + 64, 0);
  }
  void bind(int64_t b_, int64_t h_) {
    b = b_;
    h = h_;
  }
  int64_t width() const { return width_; }

  inline __m256i words(const uint8_t* r) const {
    if (M == 1) return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r)));
    if (M == 2) return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r)));
    // bytes 0..11 to the low half, 12..23 to the high half, then 3 bytes per 32-bit lane
    const __m256i x = _mm256_permutevar8x32_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r)),
                                                  _mm256_setr_epi32(0, 1, 2, 3, 3, 4, 5, 6));
    const __m256i shuf = _mm256_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1,  //
                                          0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1);
    return _mm256_shuffle_epi8(x, shuf);
  }
  inline __m256 value(__m256 d, __m256 lo, __m256 hi) const {
    if (!lookup) return d;
    const __m256i c = _mm256_cvttps_epi32(d);
    const __m256 a = _mm256_permutevar8x32_ps(lo, c);
    if (levels <= 8) return a;
    const __m256 e = _mm256_permutevar8x32_ps(hi, c);
    return _mm256_blendv_ps(a, e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(c, _mm256_set1_epi32(7))));
  }
  // the n digits of v (lanes below 2^22 / L), digit i to dst + 8 i
  inline void digits(__m256 v, int64_t n, float* dst, __m256 lo, __m256 hi) const {
    // (v + 1/2) / L as one fused multiply-add: a single rounding, inside the same margin
    const __m256 L = _mm256_set1_ps(static_cast<float>(levels)), inv = _mm256_set1_ps(1.f / levels);
    const __m256 bias = _mm256_set1_ps(0.5f / levels);
    for (int64_t i = 0; i + 1 < n; ++i) {
      const __m256 q = _mm256_floor_ps(_mm256_fmadd_ps(v, inv, bias));
      _mm256_storeu_ps(dst + 8 * i, value(_mm256_fnmadd_ps(q, L, v), lo, hi));
      v = q;
    }
    _mm256_storeu_ps(dst + 8 * (n - 1), value(v, lo, hi));
  }
  const float* operator()(int64_t t, int slot) {
    const uint8_t* r = static_cast<const uint8_t*>(codes.at(b, h, t, 0));
    if (r + blocks * 8 * M + 8 > end) {
      std::memcpy(padded.data(), r, codes.cols);
      r = padded.data();
    }
    float* dst = out.data() + slot * width_;
    const __m256 lo = _mm256_loadu_ps(table.data()), hi = _mm256_loadu_ps(table.data() + 8);
    for (int64_t k = 0; k < blocks; ++k) {
      const __m256i w = words(r + k * 8 * M);
      float* o = dst + k * C * 8;
      if (M < 3) {
        digits(_mm256_cvtepi32_ps(w), C, o, lo, hi);
        continue;
      }
      // split each word at L^low into a high and a low part, both below 2^22 / L
      const __m256d s = _mm256_set1_pd(split), inv = _mm256_set1_pd(1.0 / split), half = _mm256_set1_pd(0.5);
      __m128 qh[2], ql[2];
      for (int part = 0; part < 2; ++part) {
        const __m256d x = _mm256_cvtepi32_pd(part == 0 ? _mm256_castsi256_si128(w) : _mm256_extracti128_si256(w, 1));
        const __m256d q = _mm256_floor_pd(_mm256_mul_pd(_mm256_add_pd(x, half), inv));
        qh[part] = _mm256_cvtpd_ps(q);
        ql[part] = _mm256_cvtpd_ps(_mm256_fnmadd_pd(q, s, x));
      }
      digits(_mm256_set_m128(ql[1], ql[0]), low, o, lo, hi);
      digits(_mm256_set_m128(qh[1], qh[0]), C - low, o + 8 * low, lo, hi);
    }
    return dst;
  }
};
#endif

// Whether DigitRows decodes this layout: every value it divides stays below 2^22 / L.
bool digit_rows_fit(int64_t levels, int64_t chunk_codes, int64_t chunk_bytes) {
#ifdef KVB_AVX2
  if (is_pow2(levels) || levels > 16 || chunk_bytes < 1 || chunk_bytes > 3) return false;
  const int64_t low = chunk_bytes == 3 ? chunk_codes / 2 : chunk_codes;
  double top = 1, part = 1;
  for (int64_t i = 0; i < chunk_codes; ++i) top *= static_cast<double>(levels);
  for (int64_t i = 0; i < std::max(low, chunk_codes - low); ++i) part *= static_cast<double>(levels);
  return top <= 16777216.0 && part * levels < 4194304.0;
#else
  (void)levels;
  (void)chunk_codes;
  (void)chunk_bytes;
  return false;
#endif
}

// pos[d]: where channel d lands in a DigitRows row
std::vector<int64_t> digit_order(int64_t chunk_codes, int64_t head_dim) {
  std::vector<int64_t> pos(head_dim);
  for (int64_t d = 0; d < head_dim; ++d) {
    const int64_t chunk = d / chunk_codes, i = d % chunk_codes;
    pos[d] = ((chunk / 8) * chunk_codes + i) * 8 + chunk % 8;
  }
  return pos;
}

at::Tensor check_rows(const at::Tensor& x, const char* name, int64_t B, int64_t H) {
  TORCH_CHECK(x.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(x.dim() == 4 && x.size(0) == B && x.size(1) == H, name, " must be [B, H_kv, ., .]");
  return x.to(at::kFloat).contiguous();
}

struct CodeTables {
  std::vector<float> lut, table;
};

CodeTables make_tables(const at::Tensor& table, int64_t levels, int64_t chunk_codes,
                       int64_t chunk_bytes) {
  auto tab = table.to(at::kFloat).contiguous();
  TORCH_CHECK(tab.numel() == levels, "table must hold one value per level");
  CodeTables t;
  t.table.assign(tab.data_ptr<float>(), tab.data_ptr<float>() + levels);
  if (chunk_bytes == 1 || !is_pow2(levels)) {
    // the k digits of every byte (one-byte chunks: k = chunk_codes) or digit group (base-L words)
    const int64_t k = chunk_bytes == 1 ? chunk_codes : group_codes_of(levels);
    t.lut.resize(256 * k);
    for (int64_t byte = 0; byte < 256; ++byte) {
      int64_t rest = byte;
      for (int64_t i = 0; i < k; ++i) {
        t.lut[byte * k + i] = t.table[rest % levels];
        rest /= levels;
      }
    }
  }
  return t;
}

struct CodeArgs {
  at::Tensor codes, table;
  c10::optional<at::Tensor> scale, zero;
  int64_t levels, head_dim, chunk_codes, chunk_bytes, scale_rows, zero_rows;
  c10::optional<at::Tensor> cos, sin;
  int64_t rope_offset;
};

// The generic code kernels' rows: codes through the table, then the scale and zero of any layout
// (Param), then RoPE, all applied to every decoded row.
template <class F>
at::Tensor with_code_rows(const CodeArgs& a, int64_t B, int64_t H, F&& body) {
  TORCH_CHECK(a.codes.scalar_type() == at::kByte && a.codes.dim() == 4, "codes must be uint8 4-d");
  TORCH_CHECK(a.codes.size(0) == B && a.codes.size(1) == H, "codes must be [B, H_kv, T, bytes]");
  TORCH_CHECK(a.codes.stride(3) == 1, "codes must be contiguous along their bytes");
  TORCH_CHECK(a.codes.size(3) % a.chunk_bytes == 0, "codes hold a whole number of chunks");
  CodeTables tables = make_tables(a.table, a.levels, a.chunk_codes, a.chunk_bytes);
  View4 sv = a.scale ? View4(*a.scale) : View4();
  View4 zv = a.zero ? View4(*a.zero) : View4();
  CodeRows rows(View4(a.codes), a.levels, a.head_dim, a.chunk_codes, a.chunk_bytes, &tables.lut,
                &tables.table, Param(sv, a.scale_rows, a.head_dim), Param(zv, a.zero_rows, a.head_dim));
  at::Tensor cos, sin;
  if (a.cos) {
    cos = a.cos->to(at::kFloat).contiguous();
    sin = a.sin->to(at::kFloat).contiguous();
    TORCH_CHECK(cos.size(0) >= a.rope_offset + a.codes.size(2), "the RoPE table is too short");
    rows.cos = cos.data_ptr<float>();
    rows.sin = sin.data_ptr<float>();
    rows.rope_offset = a.rope_offset;
  }
  return body(rows);
}

at::Tensor identity_table(int64_t levels) { return at::arange(levels, at::TensorOptions().dtype(at::kFloat)); }

std::vector<int64_t> identity_order(int64_t head_dim) {
  std::vector<int64_t> pos(head_dim);
  for (int64_t d = 0; d < head_dim; ++d) pos[d] = d;
  return pos;
}

// Which decoder reads the codes of a folded kernel (codes as their table values, no affine map: the
// fold applies the scale and zero to the small side, the query or the weights, instead of to every code).
enum class Decoder {
  kShift,   // ShiftRows: power-of-two codes in whole 8-byte spans
  kDigits,  // DigitRows: non-power-of-two codes in words of 1-3 bytes (vector unit only)
  kTable,   // CodeRows: any layout, through the byte and digit-group tables
};

// body(rows, pos) with the decoder `which` of `codes` and pos[d] the place of channel d in its rows.
// `lookup`: ShiftRows looks the table's values up in registers (else it yields the codes themselves,
// which its register kernels then read in place). `Digits`: whether the kernel instantiates DigitRows.
template <bool Digits, class F>
at::Tensor with_raw_rows(Decoder which, bool lookup, const at::Tensor& codes, const at::Tensor& table,
                         int64_t levels, int64_t head_dim, int64_t chunk_codes, int64_t chunk_bytes, F&& body) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 4 && codes.stride(3) == 1,
              "codes must be uint8 [B, H_kv, T, bytes], contiguous along the bytes");
  TORCH_CHECK(codes.size(3) % chunk_bytes == 0, "codes hold a whole number of chunks");
  const at::Tensor tab = table.to(at::kFloat).contiguous();
  TORCH_CHECK(tab.numel() == levels, "table must hold one value per level");
  if (which == Decoder::kShift) {
    const int bits = __builtin_ctzll(levels);
    return body(ShiftRows(View4(codes), bits, head_dim, lookup ? tab.data_ptr<float>() : nullptr),
                shift_order(bits, head_dim));
  }
#ifdef KVB_AVX2
  if constexpr (Digits) {
    if (which == Decoder::kDigits)
      return body(DigitRows(codes, levels, head_dim, chunk_codes, chunk_bytes, tab.data_ptr<float>()),
                  digit_order(chunk_codes, head_dim));
  }
#endif
  const CodeTables tables = make_tables(tab, levels, chunk_codes, chunk_bytes);
  return body(CodeRows(View4(codes), levels, head_dim, chunk_codes, chunk_bytes, &tables.lut, &tables.table,
                       Param(View4(), 0, head_dim), Param(View4(), 0, head_dim)),
              identity_order(head_dim));
}

// The two loop families, each written once. scores_over and mix_over cut the work into tasks of one
// (batch, kv head, kChunk tokens), decode the rows kSlots at a time with a row decoder (Rows: FloatRows,
// CodeRows, ShiftRows, DigitRows) and leave the parameter kind to a fold policy (Fold), which applies the
// scale and zero to the small side (the query or the weights) instead of to every decoded row:
//   PlainScores, PlainMix                none, or applied by the decoder (the generic code kernels)
//   ChannelGroupScores                   per-channel scale/zero shared by G tokens (KIVI's keys)
//   TokenGroupMix                        per-token scale/zero per group of G channels (KIVI's values)
//   TokenScalarScores, TokenScalarMix    one scale and zero per token (codebook norms and ranges)
// A task copies the fold and calls start(M, D, R) (M query rows of D channels, decoded rows of R >= D
// positions). Scores, per chunk: bind(b, h, query rows, new head), then segments [t, segment(t, t1)) of
// tokens that share one query() [M, R], each completed by finish. Mix, per chunk: weigh(...) fills
// weights() and returns the accumulator [M, R]; finish writes the chunk's partial sum [M, D]. kGroups:
// weights per channel group; kRegisterCodes: ShiftRows' codes go to the register kernels (shift_scores,
// shift_mix). Each fold does its kernel's operations in the same order as before the split.

// scores [B, H, M, T] of q [B, H, M, D] (float32, contiguous) over the T rows of `rows_proto`.
template <class Rows, class Fold>
at::Tensor scores_over(const at::Tensor& q, int64_t T, const Rows& rows_proto, const Fold& fold_proto) {
  const int64_t B = q.size(0), H = q.size(1), M = q.size(2), D = q.size(3);
  auto out = at::empty({B, H, M, T}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t chunks = (T + kChunk - 1) / kChunk;
  at::parallel_for(0, B * H * chunks, 1, [&](int64_t lo, int64_t hi) {
    Rows rows = rows_proto;
    Fold fold = fold_proto;
    // the decoder's row may be wider than D (DigitRows' padding): the fold's query is zero there
    const int64_t R = rows.width();
    fold.start(M, D, R);
    int64_t bound = -1;
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t bh = w / chunks, c = w % chunks, b = bh / H, h = bh % H;
      rows.bind(b, h);
      fold.bind(b, h, qp + bh * M * D, bh != bound);
      bound = bh;
      float* ob = op + bh * M * T;
      const int64_t t1 = std::min(T, (c + 1) * kChunk);
      for (int64_t t = c * kChunk; t < t1;) {
        const int64_t first = t, stop = fold.segment(t, t1);
        const float* qs = fold.query();
#ifdef KVB_AVX2
        if constexpr (std::is_same_v<Rows, ShiftRows> && Fold::kRegisterCodes) {
          if (shift_scores(rows, t, stop - t, qs, M, R, ob + t, T)) t = stop;
        }
#endif
        for (; t + kSlots <= stop; t += kSlots) {
          const float* x[kSlots] = {rows(t, 0), rows(t + 1, 1), rows(t + 2, 2), rows(t + 3, 3)};
          dot_rows4(qs, M, R, x, ob + t, T);
        }
        for (; t < stop; ++t) dot_rows(qs, M, R, rows(t, 0), ob + t, T);
        fold.finish(ob, T, first, stop);
      }
    }
  });
  return out;
}

// mix [B, H, M, D] of p [B, H, M, T] (float32, contiguous) over the T rows of `rows_proto`: partial
// sums per task, then their sum.
template <class Rows, class Fold>
at::Tensor mix_over(const at::Tensor& p, int64_t D, const Rows& rows_proto, const Fold& fold_proto) {
  const int64_t B = p.size(0), H = p.size(1), M = p.size(2), T = p.size(3);
  const int64_t chunks = std::max<int64_t>(1, (T + kChunk - 1) / kChunk);
  auto partial = at::zeros({B * H, chunks, M, D}, p.options());
  const float* pp = p.data_ptr<float>();
  float* part = partial.data_ptr<float>();
  at::parallel_for(0, B * H * chunks, 1, [&](int64_t lo, int64_t hi) {
    Rows rows = rows_proto;
    Fold fold = fold_proto;
    const int64_t R = rows.width();
    fold.start(M, D, R);
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t bh = w / chunks, c = w % chunks, b = bh / H, h = bh % H;
      const int64_t t0 = c * kChunk, t1 = std::min(T, (c + 1) * kChunk), n = t1 - t0;
      if (n <= 0) continue;
      rows.bind(b, h);
      float* out = part + w * M * D;
      float* acc = fold.weigh(pp + bh * M * T + t0, T, b, h, t0, n, out);
      const MixWeights wt = fold.weights();
      int64_t u = 0;
#ifdef KVB_AVX2
      if constexpr (std::is_same_v<Rows, ShiftRows> && Fold::kRegisterCodes) {
        if (wt.vec && shift_mix(rows, t0, n, wt.base, wt.stride, M, wt.groups, wt.width, D, acc)) u = n;
      }
#endif
      for (; u + kSlots <= n; u += kSlots) {
        const float* x[kSlots] = {rows(t0 + u, 0), rows(t0 + u + 1, 1), rows(t0 + u + 2, 2), rows(t0 + u + 3, 3)};
        axpy_tile<kSlots, Fold::kGroups>(wt, u, M, R, x, acc);
      }
      for (; u < n; ++u) {
        const float* x[1] = {rows(t0 + u, 0)};
        axpy_tile<1, Fold::kGroups>(wt, u, M, R, x, acc);
      }
      fold.finish(acc, out, M, D);
    }
  });
  return partial.sum(1).view({B, H, M, D});
}

// -- scores folds ------------------------------------------------------------------------------------

// The query as it is (R = D).
struct PlainScores {
  static constexpr bool kRegisterCodes = false;
  const float* q = nullptr;
  KVB_INLINE void start(int64_t, int64_t, int64_t) {}
  KVB_INLINE void bind(int64_t, int64_t, const float* qb, bool) { q = qb; }
  KVB_INLINE int64_t segment(int64_t, int64_t t1) const { return t1; }
  KVB_INLINE const float* query() const { return q; }
  KVB_INLINE void finish(float*, int64_t, int64_t, int64_t) const {}
};

// Per-channel affine keys (KIVI's): x[t, d] = c[t, d] s[t / G, d] + z[t / G, d], so
// q . x_t = (q * s_g) . c_t + q . z_g: the query is scaled once per group of G tokens (a segment is
// the chunk's tokens of one group) and the codes enter the dot product as they are.
struct ChannelGroupScores {
  static constexpr bool kRegisterCodes = true;
  View4 sv, zv;
  int64_t group = 1;
  const std::vector<int64_t>* pos = nullptr;  // pos[d]: where the decoder puts channel d
  int64_t M = 0, D = 0, R = 0, b = 0, h = 0, g = -1;
  const float* qb = nullptr;
  // the query in the decoder's channel order, the group's scale row in that order and the scaled
  // query; the zero term q . z_g is taken on the query in channel order
  std::vector<float> qperm, qs, qz, sr, srp, zr;

  ChannelGroupScores(const View4& sv_, const View4& zv_, int64_t group_, const std::vector<int64_t>& pos_)
      : sv(sv_), zv(zv_), group(group_), pos(&pos_) {}
  KVB_INLINE void start(int64_t M_, int64_t D_, int64_t R_) {
    M = M_, D = D_, R = R_;
    qperm.assign(M * R, 0.f);
    qs.assign(M * R, 0.f);
    qz.assign(M, 0.f);
    sr.assign(D, 0.f);
    srp.assign(R, 0.f);
    zr.assign(D, 0.f);
  }
  KVB_INLINE void bind(int64_t b_, int64_t h_, const float* q, bool new_head) {
    b = b_, h = h_, qb = q, g = -1;
    if (new_head)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t d = 0; d < D; ++d) qperm[m * R + (*pos)[d]] = qb[m * D + d];
  }
  KVB_INLINE int64_t segment(int64_t t, int64_t t1) {
    if (t / group != g) {
      g = t / group;
      load_floats(sv.at(b, h, g, 0), sv.type, sv.sd, D, sr.data());
      load_floats(zv.at(b, h, g, 0), zv.type, zv.sd, D, zr.data());
      for (int64_t d = 0; d < D; ++d) srp[(*pos)[d]] = sr[d];
      for (int64_t m = 0; m < M; ++m) {
        const float* qm = qb + m * D;
        const float* qpm = qperm.data() + m * R;
        float* qsm = qs.data() + m * R;
        float acc = 0.f;
#pragma omp simd
        for (int64_t d = 0; d < R; ++d) qsm[d] = qpm[d] * srp[d];
#pragma omp simd reduction(+ : acc)
        for (int64_t d = 0; d < D; ++d) acc += qm[d] * zr[d];
        qz[m] = acc;
      }
    }
    return std::min(t1, (g + 1) * group);
  }
  KVB_INLINE const float* query() const { return qs.data(); }
  // the zero term of the group's tokens in this chunk
  KVB_INLINE void finish(float* ob, int64_t T, int64_t first, int64_t stop) const {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t u = first; u < stop; ++u) ob[m * T + u] += qz[m];
  }
};

// The per-token parameter of token t (1 or 0 when absent).
struct TokenParam {
  View4 view;
  float fallback;
  TokenParam(const c10::optional<at::Tensor>& p, float fallback_) : fallback(fallback_) {
    if (p.has_value()) view = View4(*p);
  }
  float get(int64_t b, int64_t h, int64_t t) const {
    if (!view.valid()) return fallback;
    float v;
    load_floats(view.at(b, h, t, 0), view.type, 1, 1, &v);
    return v;
  }
};

// One scale and zero per token, either absent ([B, H_kv, T, 1]: TurboQuant's norms, KVQuant's per-token
// value ranges, per-token affine codes of one group), and the decoder's channel order: the codes are
// table values and x[t, d] = s_t table[c[t, d]] + z_t.
struct TokenScalars {
  static constexpr bool kRegisterCodes = false;  // their ShiftRows look a table up
  TokenParam sp, zp;
  const std::vector<int64_t>* pos;
  TokenScalars(const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& zero,
               const std::vector<int64_t>& pos_)
      : sp(scale, 1.f), zp(zero, 0.f), pos(&pos_) {}
};

// q . x_t = s_t (q . table[c_t]) + z_t sum(q).
struct TokenScalarScores : TokenScalars {
  using TokenScalars::TokenScalars;
  int64_t M = 0, D = 0, R = 0, b = 0, h = 0;
  std::vector<float> qperm, qsum;

  KVB_INLINE void start(int64_t M_, int64_t D_, int64_t R_) {
    M = M_, D = D_, R = R_;
    qperm.assign(M * R, 0.f);
    qsum.assign(M, 0.f);
  }
  KVB_INLINE void bind(int64_t b_, int64_t h_, const float* qb, bool new_head) {
    b = b_, h = h_;
    if (!new_head) return;
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) {
        qperm[m * R + (*pos)[d]] = qb[m * D + d];
        acc += qb[m * D + d];
      }
      qsum[m] = acc;
    }
  }
  KVB_INLINE int64_t segment(int64_t, int64_t t1) const { return t1; }
  KVB_INLINE const float* query() const { return qperm.data(); }
  KVB_INLINE void finish(float* ob, int64_t T, int64_t t0, int64_t t1) const {
    if (!sp.view.valid() && !zp.view.valid()) return;
    for (int64_t u = t0; u < t1; ++u) {
      const float s = sp.get(b, h, u), z = zp.get(b, h, u);
      for (int64_t m = 0; m < M; ++m) ob[m * T + u] = s * ob[m * T + u] + z * qsum[m];
    }
  }
};

// -- mix folds ---------------------------------------------------------------------------------------

// The weights as they are, the rows added straight into the output (R = D).
struct PlainMix {
  static constexpr bool kGroups = false, kRegisterCodes = false;
  MixWeights wt;
  KVB_INLINE void start(int64_t, int64_t, int64_t R) {
    wt.width = R;
    wt.vec = R % 8 == 0;
  }
  KVB_INLINE float* weigh(const float* pb, int64_t T, int64_t, int64_t, int64_t, int64_t, float* out) {
    wt.base = pb;
    wt.stride = T;
    return out;
  }
  KVB_INLINE const MixWeights& weights() const { return wt; }
  KVB_INLINE void finish(const float*, float*, int64_t, int64_t) const {}
};

// Per-token affine values (KIVI's): x[t, d] = c[t, d] s[t, d / G] + z[t, d / G], so
// sum_t p_t x_t = sum_t (p_t s_t,g) c_t + sum_t p_t z_t,g: the weights are scaled per token and
// channel group, and the zero term is one number per (row, group). The accumulator is kept in the
// row decoder's channel order (`pos`; a permutation within each group) and put back in order once
// per chunk.
struct TokenGroupMix {
  static constexpr bool kGroups = true, kRegisterCodes = true;
  View4 sv, zv;
  int64_t group = 1, ng = 1;
  const std::vector<int64_t>* pos = nullptr;
  int64_t M = 0, D = 0, R = 0;
  MixWeights wt;
  // the chunk's scales and zeros as float32 [kChunk, ng], then by group [ng, kChunk], the scaled
  // weights p_t s_t,g [M, ng, kChunk] and the accumulator
  std::vector<float> sc, zc, sg, zg, wsc, accp;

  TokenGroupMix(const View4& sv_, const View4& zv_, int64_t D_, int64_t group_, const std::vector<int64_t>& pos_,
                int64_t R_)
      : sv(sv_), zv(zv_), group(group_), ng(D_ / group_), pos(&pos_) {
    // a decoder row wider than D (DigitRows' padding) is permuted across the whole row, so it must
    // hold one group
    TORCH_CHECK(R_ == D_ || ng == 1, "a padded row order needs one channel group");
  }
  KVB_INLINE void start(int64_t M_, int64_t D_, int64_t R_) {
    M = M_, D = D_, R = R_;
    sc.assign(kChunk * ng, 0.f);
    zc.assign(kChunk * ng, 0.f);
    sg.assign(kChunk * ng, 0.f);
    zg.assign(kChunk * ng, 0.f);
    wsc.assign(M * kChunk * ng, 0.f);
    accp.assign(M * R, 0.f);
    wt = MixWeights{wsc.data(), kChunk, ng, R == D ? group : R, group % 8 == 0};
  }
  KVB_INLINE float* weigh(const float* pb, int64_t T, int64_t b, int64_t h, int64_t t0, int64_t n, float*) {
    float* acc = accp.data();
    std::fill(accp.begin(), accp.end(), 0.f);
    for (const auto& [view, dst] : {std::pair{&sv, sc.data()}, std::pair{&zv, zc.data()}}) {
      if (view->sd == 1 && view->st == ng) {
        // the chunk's rows are one run of n * ng values (the doubling buffers' layout)
        load_floats(view->at(b, h, t0, 0), view->type, 1, n * ng, dst);
      } else {
        for (int64_t u = 0; u < n; ++u) load_floats(view->at(b, h, t0 + u, 0), view->type, view->sd, ng, dst + u * ng);
      }
    }
    for (int64_t u = 0; u < n; ++u)
      for (int64_t gi = 0; gi < ng; ++gi) {
        sg[gi * kChunk + u] = sc[u * ng + gi];
        zg[gi * kChunk + u] = zc[u * ng + gi];
      }
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t gi = 0; gi < ng; ++gi) {
        // contiguous runs, and the zero term summed in vector lanes: one serial chain of n
        // multiply-adds per (row, group) would cost more than the codes' dot products
        const float* pm = pb + m * T;
        const float* sgi = sg.data() + gi * kChunk;
        const float* zgi = zg.data() + gi * kChunk;
        float* wg = wsc.data() + (m * ng + gi) * kChunk;
        float zsum = 0.f;
#pragma omp simd reduction(+ : zsum)
        for (int64_t u = 0; u < n; ++u) {
          wg[u] = pm[u] * sgi[u];
          zsum += pm[u] * zgi[u];
        }
        // the zero term at the positions of the group's channels (with one group: the whole
        // row, padding included)
        if (ng == 1) {
          for (int64_t d = 0; d < R; ++d) acc[m * R + d] += zsum;
        } else {
          for (int64_t d = gi * group; d < (gi + 1) * group; ++d) acc[m * R + (*pos)[d]] += zsum;
        }
      }
    }
    return acc;
  }
  KVB_INLINE const MixWeights& weights() const { return wt; }
  KVB_INLINE void finish(const float* acc, float* out, int64_t M_, int64_t D_) const {
    for (int64_t m = 0; m < M_; ++m)
      for (int64_t d = 0; d < D_; ++d) out[m * D_ + d] = acc[m * R + (*pos)[d]];
  }
};

// sum_t p_t x_t = sum_t (p_t s_t) table[c_t] + sum_t p_t z_t.
struct TokenScalarMix : TokenScalars {
  using TokenScalars::TokenScalars;
  static constexpr bool kGroups = false;
  int64_t M = 0, R = 0;
  MixWeights wt;
  // the weights scaled per token, ws[m * kChunk + u] = p[m, t0 + u] s_(t0 + u), the accumulator and
  // the zero term of each row
  std::vector<float> ws, accp, zsum;

  KVB_INLINE void start(int64_t M_, int64_t, int64_t R_) {
    M = M_, R = R_;
    ws.assign(M * kChunk, 0.f);
    accp.assign(M * R, 0.f);
    zsum.assign(M, 0.f);
    wt = MixWeights{ws.data(), kChunk, 1, R, R % 8 == 0};
  }
  KVB_INLINE float* weigh(const float* pb, int64_t T, int64_t b, int64_t h, int64_t t0, int64_t n, float*) {
    std::fill(accp.begin(), accp.end(), 0.f);
    std::fill(zsum.begin(), zsum.end(), 0.f);
    for (int64_t u = 0; u < n; ++u) {
      const float s = sp.get(b, h, t0 + u), z = zp.get(b, h, t0 + u);
      for (int64_t m = 0; m < M; ++m) {
        const float pm = pb[m * T + u];
        ws[m * kChunk + u] = pm * s;
        zsum[m] += pm * z;
      }
    }
    return accp.data();
  }
  KVB_INLINE const MixWeights& weights() const { return wt; }
  KVB_INLINE void finish(const float* acc, float* out, int64_t M_, int64_t D_) const {
    for (int64_t m = 0; m < M_; ++m)
      for (int64_t d = 0; d < D_; ++d) out[m * D_ + d] = acc[m * R + (*pos)[d]] + zsum[m];
  }
};

// Whether the parameters are absent or one number per token ([B, H_kv, T, 1]).
bool per_token_params(const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& zero, int64_t T) {
  for (const auto* p : {&scale, &zero})
    if (p->has_value() && ((*p)->dim() != 4 || (*p)->size(3) != 1 || (*p)->size(2) != T)) return false;
  return true;
}

// Whether codebook codes (with per-token parameters) go through ShiftRows, which looks up to 16 table
// values up in registers; other layouts and level counts use DigitRows (scores) or CodeRows.
bool codebook_shiftable(int64_t levels, int64_t head_dim, int64_t chunk_bytes) {
  return shift_unpackable(levels, head_dim, chunk_bytes) && levels <= 16;
}

}  // namespace

// -- the kernels: one loop family, one decoder and one fold each ----------------------------------------

at::Tensor fp_scores(const at::Tensor& query, const at::Tensor& keys) {
  const int64_t B = query.size(0), H = query.size(1), D = query.size(3);
  TORCH_CHECK(keys.size(3) == D && keys.stride(3) == 1, "keys must be [B, H_kv, T, D], D contiguous");
  auto q = check_rows(query, "query", B, H);
  return scores_over(q, keys.size(2), FloatRows(View4(keys), D), PlainScores{});
}

at::Tensor fp_mix(const at::Tensor& weights, const at::Tensor& values) {
  const int64_t B = weights.size(0), H = weights.size(1);
  TORCH_CHECK(values.size(2) == weights.size(3), "weights and values disagree on T");
  auto p = check_rows(weights, "weights", B, H);
  return mix_over(p, values.size(3), FloatRows(View4(values), values.size(3)), PlainMix{});
}

at::Tensor code_scores(const at::Tensor& query, const at::Tensor& codes, const at::Tensor& table,
                       const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& zero,
                       int64_t levels, int64_t head_dim, int64_t chunk_codes, int64_t chunk_bytes,
                       int64_t scale_rows, int64_t zero_rows, const c10::optional<at::Tensor>& cos,
                       const c10::optional<at::Tensor>& sin, int64_t rope_offset) {
  const int64_t B = query.size(0), H = query.size(1);
  TORCH_CHECK(query.size(3) == head_dim, "query must be [B, H_kv, M, head_dim]");
  auto q = check_rows(query, "query", B, H);
  CodeArgs a{codes, table, scale, zero, levels, head_dim, chunk_codes, chunk_bytes,
             scale_rows, zero_rows, cos, sin, rope_offset};
  return with_code_rows(a, B, H, [&](const CodeRows& rows) { return scores_over(q, codes.size(2), rows, PlainScores{}); });
}

at::Tensor code_mix(const at::Tensor& weights, const at::Tensor& codes, const at::Tensor& table,
                    const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& zero,
                    int64_t levels, int64_t head_dim, int64_t chunk_codes, int64_t chunk_bytes,
                    int64_t scale_rows, int64_t zero_rows) {
  const int64_t B = weights.size(0), H = weights.size(1);
  TORCH_CHECK(codes.size(2) == weights.size(3), "weights and codes disagree on T");
  auto p = check_rows(weights, "weights", B, H);
  CodeArgs a{codes, table, scale, zero, levels, head_dim, chunk_codes, chunk_bytes,
             scale_rows, zero_rows, c10::nullopt, c10::nullopt, 0};
  return with_code_rows(a, B, H, [&](const CodeRows& rows) { return mix_over(p, head_dim, rows, PlainMix{}); });
}

// Per-channel affine codes (KIVI's keys): scale and zero [B, H_kv, T / G, D].
at::Tensor affine_channel_scores(const at::Tensor& query, const at::Tensor& codes, const at::Tensor& scale,
                                 const at::Tensor& zero, int64_t levels, int64_t head_dim,
                                 int64_t chunk_codes, int64_t chunk_bytes, int64_t group) {
  const int64_t B = query.size(0), H = query.size(1), D = head_dim, T = codes.size(2);
  TORCH_CHECK(query.size(3) == D && group > 0, "query must be [B, H_kv, M, head_dim]");
  auto q = check_rows(query, "query", B, H);
  const View4 sv(scale), zv(zero);
  TORCH_CHECK(sv.cols == D && sv.rows * group >= T, "scale must be [B, H_kv, T / G, D]");
  const Decoder which = shift_unpackable(levels, D, chunk_bytes) ? Decoder::kShift : Decoder::kTable;
  return with_raw_rows<false>(which, false, codes, identity_table(levels), levels, D, chunk_codes, chunk_bytes,
                              [&](const auto& rows, const std::vector<int64_t>& pos) {
                                return scores_over(q, T, rows, ChannelGroupScores(sv, zv, group, pos));
                              });
}

// Per-token affine codes (KIVI's values): scale and zero [B, H_kv, T, D / G].
at::Tensor affine_token_mix(const at::Tensor& weights, const at::Tensor& codes, const at::Tensor& scale,
                            const at::Tensor& zero, int64_t levels, int64_t head_dim, int64_t chunk_codes,
                            int64_t chunk_bytes, int64_t group) {
  const int64_t B = weights.size(0), H = weights.size(1), T = weights.size(3);
  const int64_t D = head_dim;
  TORCH_CHECK(codes.size(2) == T, "weights and codes disagree on T");
  TORCH_CHECK(group > 0 && D % group == 0, "group must divide head_dim");
  auto p = check_rows(weights, "weights", B, H);
  const View4 sv(scale), zv(zero);
  TORCH_CHECK(sv.cols == D / group && zv.cols == D / group, "scale and zero must be [B, H_kv, T, D / G]");
  Decoder which = Decoder::kTable;
  if (shift_unpackable(levels, D, chunk_bytes)) {
    const int bits = __builtin_ctzll(levels);
    // a group is whole 8-byte spans (64 / b channels), or half of one (each lane's codes then lie
    // in one group: lanes 0-3 in the first)
    if (group % (64 / bits) == 0 || 2 * group == 64 / bits) which = Decoder::kShift;
  } else if (group == D && digit_rows_fit(levels, chunk_codes, chunk_bytes)) {
    which = Decoder::kDigits;
  }
  return with_raw_rows<true>(which, false, codes, identity_table(levels), levels, D, chunk_codes, chunk_bytes,
                             [&](const auto& rows, const std::vector<int64_t>& pos) {
                               return mix_over(p, D, rows, TokenGroupMix(sv, zv, D, group, pos, rows.width()));
                             });
}

// Codebook codes with an optional per-token scale and zero ([B, H_kv, T, 1]: TurboQuant's norms,
// KVQuant's per-token value ranges); other parameter layouts go through code_scores / code_mix.
at::Tensor codebook_token_scores(const at::Tensor& query, const at::Tensor& codes, const at::Tensor& table,
                                 const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& zero,
                                 int64_t levels, int64_t head_dim, int64_t chunk_codes, int64_t chunk_bytes) {
  const int64_t B = query.size(0), H = query.size(1), D = head_dim, T = codes.size(2);
  if (!per_token_params(scale, zero, T))
    return code_scores(query, codes, table, scale, zero, levels, D, chunk_codes, chunk_bytes, 1, 1, c10::nullopt,
                       c10::nullopt, 0);
  auto q = check_rows(query, "query", B, H);
  const Decoder which = codebook_shiftable(levels, D, chunk_bytes)            ? Decoder::kShift
                        : digit_rows_fit(levels, chunk_codes, chunk_bytes) ? Decoder::kDigits
                                                                           : Decoder::kTable;
  return with_raw_rows<true>(which, true, codes, table, levels, D, chunk_codes, chunk_bytes,
                             [&](const auto& rows, const std::vector<int64_t>& pos) {
                               return scores_over(q, T, rows, TokenScalarScores(scale, zero, pos));
                             });
}

at::Tensor codebook_token_mix(const at::Tensor& weights, const at::Tensor& codes, const at::Tensor& table,
                              const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& zero,
                              int64_t levels, int64_t head_dim, int64_t chunk_codes, int64_t chunk_bytes) {
  const int64_t B = weights.size(0), H = weights.size(1), T = weights.size(3);
  const int64_t D = head_dim;
  TORCH_CHECK(codes.size(2) == T, "weights and codes disagree on T");
  if (!per_token_params(scale, zero, T))
    return code_mix(weights, codes, table, scale, zero, levels, D, chunk_codes, chunk_bytes, 1, 1);
  auto p = check_rows(weights, "weights", B, H);
  const Decoder which = codebook_shiftable(levels, D, chunk_bytes) ? Decoder::kShift : Decoder::kTable;
  return with_raw_rows<false>(which, true, codes, table, levels, D, chunk_codes, chunk_bytes,
                              [&](const auto& rows, const std::vector<int64_t>& pos) {
                                return mix_over(p, D, rows, TokenScalarMix(scale, zero, pos));
                              });
}

// v, hidden from the optimiser, so that no multiply-add is fused across it.
inline float opaque(float v) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("" : "+x"(v));
#else
  volatile float w = v;
  v = w;
#endif
  return v;
}

// Round to the storage dtype and back, as torch does after every operation on Half or BFloat16.
inline float round_to(at::ScalarType type, float x) {
  if (type == at::kHalf) return static_cast<float>(c10::Half(x));
  if (type == at::kBFloat16) return static_cast<float>(c10::BFloat16(x));
  return x;
}

namespace {

// One row of codes packed as kvbench.quant.packing.pack does: chunks of c base-L digits, code i the
// i-th digit, each chunk a little-endian word of m bytes.
void pack_row(const uint8_t* codes, int64_t chunks, int64_t chunk_codes, int64_t chunk_bytes, int64_t levels,
              uint8_t* out) {
  for (int64_t j = 0; j < chunks; ++j) {
    uint64_t word = 0, weight = 1;
    for (int64_t i = 0; i < chunk_codes; ++i, weight *= static_cast<uint64_t>(levels))
      word += codes[j * chunk_codes + i] * weight;
    for (int64_t k = 0; k < chunk_bytes; ++k) out[j * chunk_bytes + k] = static_cast<uint8_t>(word >> (8 * k));
  }
}

}  // namespace

// Per-token affine quantization and packing of new tokens (the append of KIVI's value store),
// bit-identical to kvbench.quant.affine.quantize_grouped(axis="token") followed by
// kvbench.quant.packing.pack: each token's groups of G channels get s and z, codes are packed as
// little-endian words of c base-L digits in m bytes.
//   fp32 (arithmetic 0): float32 min/max; s = (max - min) / (L - 1) and z = min (minmax) or
//     s = (max - min) / 2, z = (3 min + max) / 4 (specache), both rounded to `param` before
//     q = clamp(floor((x - z) / s + 0.5), 0, L - 1) is computed against them; q = 0 where s = 0.
//   kivi (arithmetic 1): every operation in x's dtype (rounded after each, as torch does for
//     Half): s = (max - min) / (L - 1), q = round_half_even(clamp((x - min) / s, 0, L - 1));
//     s and min kept in x's dtype.
std::vector<at::Tensor> token_quantize_pack(const at::Tensor& x, int64_t levels, int64_t group,
                                            int64_t arithmetic, int64_t specache, at::ScalarType param,
                                            int64_t chunk_codes, int64_t chunk_bytes) {
  TORCH_CHECK(x.dim() == 4 && x.device().is_cpu(), "x must be a CPU [B, H_kv, T, D] tensor");
  const auto type = x.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kHalf || type == at::kBFloat16, "x must be a float tensor");
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  TORCH_CHECK(group > 0 && D % group == 0, "group must divide the head dim");
  TORCH_CHECK(levels >= 2 && levels <= 256, "levels must be in 2..256");
  const int64_t ng = D / group;
  const int64_t chunks = (D + chunk_codes - 1) / chunk_codes;
  const at::ScalarType kept = arithmetic == 1 ? type : param;
  auto xf = x.to(at::kFloat).contiguous();
  auto packed = at::zeros({B, H, T, chunks * chunk_bytes}, x.options().dtype(at::kByte));
  auto scale = at::empty({B, H, T, ng}, x.options().dtype(at::kFloat));
  auto zero = at::empty({B, H, T, ng}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  uint8_t* pp = packed.data_ptr<uint8_t>();
  float* sp = scale.data_ptr<float>();
  float* zp = zero.data_ptr<float>();
  const float top = static_cast<float>(levels - 1);
  at::parallel_for(0, B * H * T, 16, [&](int64_t lo_row, int64_t hi_row) {
    std::vector<uint8_t> codes(chunks * chunk_codes);
    for (int64_t r = lo_row; r < hi_row; ++r) {
      const float* xr = xp + r * D;
      std::fill(codes.begin(), codes.end(), 0);
      for (int64_t gi = 0; gi < ng; ++gi) {
        const float* xg = xr + gi * group;
        float lo = xg[0], hi = xg[0];
        for (int64_t i = 1; i < group; ++i) {
          lo = std::min(lo, xg[i]);
          hi = std::max(hi, xg[i]);
        }
        float s, z;
        if (arithmetic == 1) {
          s = round_to(type, round_to(type, hi - lo) / top);
          z = lo;
          const float div = s == 0.f ? 1.f : s;
          for (int64_t i = 0; i < group; ++i) {
            float y = round_to(type, round_to(type, xg[i] - z) / div);
            y = std::min(std::max(y, 0.f), top);
            const float q = s == 0.f ? 0.f : std::nearbyint(round_to(type, y));
            codes[gi * group + i] = static_cast<uint8_t>(q);
          }
        } else {
          const float span = hi - lo;
          s = round_to(param, specache ? span / 2.f : span / top);
          // 3 min is rounded before max is added, as torch's two operations do (no fused multiply-add)
          z = round_to(param, specache ? (opaque(3.f * lo) + hi) / 4.f : lo);
          const float div = s == 0.f ? 1.f : s;
          for (int64_t i = 0; i < group; ++i) {
            const float y = (xg[i] - z) / div;
            float q = std::floor(y + 0.5f);
            q = std::min(std::max(q, 0.f), top);
            codes[gi * group + i] = s == 0.f ? 0 : static_cast<uint8_t>(q);
          }
        }
        sp[r * ng + gi] = s;
        zp[r * ng + gi] = z;
      }
      pack_row(codes.data(), chunks, chunk_codes, chunk_bytes, levels, pp + r * chunks * chunk_bytes);
    }
  });
  return {packed, scale.to(kept), zero.to(kept)};
}

// KVQuant's dense-and-sparse append (kvbench.cache.dense_sparse.DenseSparseTokens.append on float32
// x [B, H_kv, T, D]), bit-identical to its torch reference and without reading a count back:
//   online ranges (values): the k = `topk` largest-magnitude entries of each token are outliers
//     (ties at the k-th magnitude to the lowest channel), [lo, hi] the min/max of the others
//     (0 if none), scale = fp16((hi - lo) / 2), zero = fp16((hi + lo) / 2);
//   fixed ranges (keys: `channel_scale` / `channel_zero`, float32 [1, H_kv, 1, D]): an entry with
//     |x - zero| > scale is an outlier when `thresholds`;
//   every entry: y = clamp((x - zero) / scale, -1, 1) (0 where scale = 0), code = the number of
//     decision boundaries `mid` below y, packed as kvbench.quant.packing.pack.
// Returns packed codes, the per-token fp16 scale and zero ([B, H_kv, T, 1], empty for fixed
// ranges), and the outliers in token, batch, head, channel order: token index (int64), flat column
// (b H_kv + h) D + d (int64) and exact value (float32).
std::vector<at::Tensor> dense_sparse_quantize_pack(const at::Tensor& x, const at::Tensor& mid, int64_t levels,
                                                   int64_t chunk_codes, int64_t chunk_bytes, int64_t topk,
                                                   const c10::optional<at::Tensor>& channel_scale,
                                                   const c10::optional<at::Tensor>& channel_zero, bool thresholds) {
  TORCH_CHECK(x.dim() == 4 && x.device().is_cpu() && x.scalar_type() == at::kFloat,
              "x must be a float32 CPU [B, H_kv, T, D] tensor");
  TORCH_CHECK(levels >= 2 && levels <= 256 && mid.numel() == levels - 1, "mid must hold levels - 1 boundaries");
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  const bool fixed = channel_scale.has_value();
  TORCH_CHECK(fixed == channel_zero.has_value(), "channel_scale and channel_zero go together");
  TORCH_CHECK(topk >= 0 && topk <= D, "topk must be in 0..D");
  auto xc = x.contiguous();
  auto bounds = mid.to(at::kFloat).contiguous();
  at::Tensor cs, cz;
  if (fixed) {
    cs = channel_scale->to(at::kFloat).expand({1, H, 1, D}).contiguous();
    cz = channel_zero->to(at::kFloat).expand({1, H, 1, D}).contiguous();
  }
  const int64_t chunks = (D + chunk_codes - 1) / chunk_codes;
  auto packed = at::zeros({B, H, T, chunks * chunk_bytes}, x.options().dtype(at::kByte));
  auto scale = at::empty({fixed ? 0 : B, H, fixed ? 0 : T, 1}, x.options().dtype(at::kHalf));
  auto zero = at::empty({fixed ? 0 : B, H, fixed ? 0 : T, 1}, x.options().dtype(at::kHalf));
  const float* xp = xc.data_ptr<float>();
  const float* mp = bounds.data_ptr<float>();
  uint8_t* pp = packed.data_ptr<uint8_t>();
  const int64_t nmid = levels - 1;
  // per row (b, h, t): the outlier channels, ascending
  std::vector<std::vector<int32_t>> outliers(B * H * T);
  at::parallel_for(0, B * H * T, 16, [&](int64_t lo_row, int64_t hi_row) {
    std::vector<uint8_t> codes(chunks * chunk_codes);
    std::vector<int32_t> order(D);
    std::vector<char> is_out(D);
    for (int64_t r = lo_row; r < hi_row; ++r) {
      const float* xr = xp + r * D;
      const int64_t h = (r / T) % H;
      std::vector<int32_t>& out_r = outliers[r];
      std::fill(is_out.begin(), is_out.end(), 0);
      const float* sr = fixed ? cs.data_ptr<float>() + h * D : nullptr;
      const float* zr = fixed ? cz.data_ptr<float>() + h * D : nullptr;
      float s_tok = 0.f, z_tok = 0.f;
      if (fixed) {
        if (thresholds)
          for (int64_t d = 0; d < D; ++d)
            if (std::fabs(xr[d] - zr[d]) > sr[d]) {
              is_out[d] = 1;
              out_r.push_back(static_cast<int32_t>(d));
            }
      } else {
        if (topk > 0) {
          for (int64_t d = 0; d < D; ++d) order[d] = static_cast<int32_t>(d);
          std::partial_sort(order.begin(), order.begin() + topk, order.end(), [&](int32_t a, int32_t b) {
            const float fa = std::fabs(xr[a]), fb = std::fabs(xr[b]);
            return fa > fb || (fa == fb && a < b);
          });
          for (int64_t i = 0; i < topk; ++i) is_out[order[i]] = 1;
          for (int64_t d = 0; d < D; ++d)
            if (is_out[d]) out_r.push_back(static_cast<int32_t>(d));
        }
        float lo = INFINITY, hi = -INFINITY;
        for (int64_t d = 0; d < D; ++d)
          if (!is_out[d]) {
            lo = std::min(lo, xr[d]);
            hi = std::max(hi, xr[d]);
          }
        if (!std::isfinite(lo)) lo = 0.f;
        if (!std::isfinite(hi)) hi = 0.f;
        const c10::Half sh((hi - lo) / 2.f), zh((hi + lo) / 2.f);
        scale.data_ptr<c10::Half>()[r] = sh;
        zero.data_ptr<c10::Half>()[r] = zh;
        s_tok = static_cast<float>(sh);
        z_tok = static_cast<float>(zh);
      }
      for (int64_t d = 0; d < D; ++d) {
        const float s = fixed ? sr[d] : s_tok, z = fixed ? zr[d] : z_tok;
        float y = s == 0.f ? 0.f : (xr[d] - z) / s;
        y = std::min(std::max(y, -1.f), 1.f);
        int64_t c = 0;
        while (c < nmid && mp[c] < y) ++c;  // boundaries ascending: bucketize, ties to the lower code
        codes[d] = static_cast<uint8_t>(c);
      }
      for (int64_t d = D; d < chunks * chunk_codes; ++d) codes[d] = 0;
      pack_row(codes.data(), chunks, chunk_codes, chunk_bytes, levels, pp + r * chunks * chunk_bytes);
    }
  });
  // entries in token order, then batch, head, channel
  int64_t n = 0;
  for (const auto& o : outliers) n += static_cast<int64_t>(o.size());
  auto rows = at::empty({n}, x.options().dtype(at::kLong));
  auto cols = at::empty({n}, x.options().dtype(at::kLong));
  auto vals = at::empty({n}, x.options().dtype(at::kFloat));
  int64_t* rp = rows.data_ptr<int64_t>();
  int64_t* cp = cols.data_ptr<int64_t>();
  float* vp = vals.data_ptr<float>();
  int64_t i = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t bh = 0; bh < B * H; ++bh) {
      const int64_t r = bh * T + t;
      for (int32_t d : outliers[r]) {
        rp[i] = t;
        cp[i] = bh * D + d;
        vp[i] = xp[r * D + d];
        ++i;
      }
    }
  return {packed, scale, zero, rows, cols, vals};
}

void register_plane_kernels(pybind11::module& m);  // planes.cpp
void register_sparse_kernels(pybind11::module& m);  // sparse.cpp
void register_lloyd_kernels(pybind11::module& m);   // lloyd.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fp_scores", &fp_scores, "query [B,H,M,D] . full-precision keys [B,H,T,D] -> [B,H,M,T]");
  m.def("fp_mix", &fp_mix, "weights [B,H,M,T] x full-precision values [B,H,T,D] -> [B,H,M,D]");
  m.def("code_scores", &code_scores, "query . packed codes through table/scale/zero/RoPE");
  m.def("code_mix", &code_mix, "weights x packed codes through table/scale/zero");
  m.def("affine_channel_scores", &affine_channel_scores, "query . per-channel affine codes (folded)");
  m.def("affine_token_mix", &affine_token_mix, "weights x per-token affine codes (folded)");
  m.def("codebook_token_scores", &codebook_token_scores, "query . codebook codes with per-token scale/zero");
  m.def("codebook_token_mix", &codebook_token_mix, "weights x codebook codes with per-token scale/zero");
  m.def("token_quantize_pack", &token_quantize_pack, "per-token affine codes of new tokens, packed");
  m.def("dense_sparse_quantize_pack", &dense_sparse_quantize_pack,
        "KVQuant's append: codebook codes of new tokens, packed, and their sparse outliers");
  register_plane_kernels(m);
  register_sparse_kernels(m);
  register_lloyd_kernels(m);
}
