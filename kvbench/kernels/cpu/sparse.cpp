// KVQuant's dense-and-sparse split on the CPU: the corrections the sparse outliers add to the dense
// kernels' scores and mix (kvbench.cache.dense_sparse, kvbench.kernels.cpu.parts._correct_scores /
// _correct_mix hold the plain-torch reference, tests/kernels/test_sparse_kernels.py).
//
// Each outlier entry (token rows[i], flat column cols[i] = (b H + h) D + d, exact value vals[i]) is
// read by the dense kernels as what its code reconstructs, table[c] s + z. These add the difference
// delta = exact - reconstructed back:
//   scores[b, h, m, t] += q[b, h, m, :] . RoPE_t(delta e_d),   mix[b, h, m, d] += p[b, h, m, t] delta.
//
// A decode step runs them once per layer over every entry (1% of the stored values: ~16-40K entries
// per layer at 8K tokens), so each entry costs a few nanoseconds: the stored int32 rows, int16/int32
// columns and fp16 values are read as they are (no widening copies), the code by one shift and mask
// for power-of-two levels (a digit table for the other one-byte layouts), the (batch, head) offsets
// are computed once per call, and the entries are split into fixed ranges run in parallel. Score
// ranges end at token boundaries (entries are in token order), so two tasks never write one score
// and every score gets its entries in entry order, as in a serial pass. Mix ranges accumulate into
// partial sums that are added in range order, so the result does not depend on the thread count.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVB_AVX2 1
#endif

namespace {

// Entries per task: ~10 us of work, so a task outweighs its scheduling.
constexpr int64_t kEntries = 4096;

inline float half_to_float(uint16_t h) {
#ifdef KVB_AVX2
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// One float32, float16 or bfloat16 value at p, as float32 (p need not be aligned).
inline float load_scalar(const char* p, at::ScalarType type) {
  if (type == at::kFloat) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return type == at::kHalf ? half_to_float(h) : bf16_to_float(h);
}

// A 1-d tensor of indices or values read in its own dtype through its stride; the switch is on one
// dtype per call, so it predicts perfectly.
struct Column {
  const char* data;
  at::ScalarType type;
  int64_t stride;

  explicit Column(const at::Tensor& x)
      : data(static_cast<const char*>(x.data_ptr())), type(x.scalar_type()), stride(x.stride(0)) {}

  int64_t index(int64_t i) const {
    const int64_t j = i * stride;
    switch (type) {
      case at::kInt: return reinterpret_cast<const int32_t*>(data)[j];
      case at::kShort: return reinterpret_cast<const int16_t*>(data)[j];
      case at::kLong: return reinterpret_cast<const int64_t*>(data)[j];
      default: return reinterpret_cast<const uint8_t*>(data)[j];
    }
  }
  // entries [i0, i0 + n) as int64 / float32, one typed loop each
  void indices(int64_t i0, int64_t n, int64_t* out) const {
    switch (type) {
      case at::kInt: copy(reinterpret_cast<const int32_t*>(data), i0, n, out); break;
      case at::kShort: copy(reinterpret_cast<const int16_t*>(data), i0, n, out); break;
      case at::kLong: copy(reinterpret_cast<const int64_t*>(data), i0, n, out); break;
      default: for (int64_t j = 0; j < n; ++j) out[j] = index(i0 + j);
    }
  }
  void values(int64_t i0, int64_t n, float* out) const {
    if (type == at::kFloat) {
      copy(reinterpret_cast<const float*>(data), i0, n, out);
    } else if (type == at::kHalf) {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(data);
      for (int64_t j = 0; j < n; ++j) out[j] = half_to_float(src[(i0 + j) * stride]);
    } else {
      for (int64_t j = 0; j < n; ++j) out[j] = value(i0 + j);
    }
  }
  template <class S, class O>
  void copy(const S* src, int64_t i0, int64_t n, O* out) const {
    if (stride == 1) {
      for (int64_t j = 0; j < n; ++j) out[j] = static_cast<O>(src[i0 + j]);
    } else {
      for (int64_t j = 0; j < n; ++j) out[j] = static_cast<O>(src[(i0 + j) * stride]);
    }
  }
  float value(int64_t i) const {
    const int64_t j = i * stride;
    switch (type) {
      case at::kHalf: return half_to_float(reinterpret_cast<const uint16_t*>(data)[j]);
      case at::kFloat: return reinterpret_cast<const float*>(data)[j];
      case at::kBFloat16: return bf16_to_float(reinterpret_cast<const uint16_t*>(data)[j]);
      default: return static_cast<float>(reinterpret_cast<const double*>(data)[j]);
    }
  }
};

Column column(const at::Tensor& x, const char* name, std::initializer_list<at::ScalarType> types) {
  TORCH_CHECK(x.dim() == 1 && x.device().is_cpu(), name, " must be a 1-d CPU tensor");
  TORCH_CHECK(std::find(types.begin(), types.end(), x.scalar_type()) != types.end(), name,
              " has an unsupported dtype ", x.scalar_type());
  return Column(x);
}

// A scale or zero ([B or 1, H or 1, T or 1, D or 1], float32/fp16/bf16) read one entry at a time.
struct ParamAt {
  const char* data = nullptr;
  at::ScalarType type = at::kFloat;
  int64_t item = 4, st = 0, sd = 0, channels_per_value = 1;
  std::vector<int64_t> base;  // per flat (batch, head): element offset

  ParamAt(const c10::optional<at::Tensor>& x, int64_t rows_per_token, int64_t B, int64_t H, int64_t D) {
    if (!x) return;
    TORCH_CHECK(x->dim() == 4 && x->device().is_cpu(), "scale/zero must be 4-d CPU tensors");
    const at::ScalarType t = x->scalar_type();
    TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16, "scale/zero must be a float type");
    TORCH_CHECK(D % x->size(3) == 0, "scale/zero channels must divide head_dim");
    data = static_cast<const char*>(x->data_ptr());
    type = t;
    item = x->element_size();
    D_ = D;
    const int64_t sb = x->size(0) == 1 ? 0 : x->stride(0), sh = x->size(1) == 1 ? 0 : x->stride(1);
    st = rows_per_token == 0 || x->size(2) == 1 ? 0 : x->stride(2);
    sd = x->size(3) == 1 ? 0 : x->stride(3);
    channels_per_value = D / x->size(3);
    base.resize(B * H);
    for (int64_t bh = 0; bh < B * H; ++bh) base[bh] = (bh / H) * sb + (bh % H) * sh;
    if (st == 0) {
      fixed.resize(B * H * D);
      for (int64_t bh = 0; bh < B * H; ++bh)
        for (int64_t d = 0; d < D; ++d) fixed[bh * D + d] = read(bh, 0, d);
    }
    token_scalar = st != 0 && x->size(3) == 1;
  }
  bool valid() const { return data != nullptr; }
  float at(int64_t bh, int64_t t, int64_t d) const {
    if (!fixed.empty()) return fixed[bh * D_ + d];
    return read(bh, t, token_scalar ? 0 : d);
  }
  // fixed ranges: every (batch, head)'s row, float32 [B H, D]; token_scalar: one number per token
  std::vector<float> fixed;
  bool token_scalar = false;
  int64_t D_ = 0;

  float read(int64_t bh, int64_t t, int64_t d) const {
    const int64_t c = channels_per_value == 1 ? d : d / channels_per_value;
    return load_scalar(data + (base[bh] + t * st + c * sd) * item, type);
  }
};

// The reconstruction table[c] s + z of one stored entry, and so its delta.
struct Deltas {
  const uint8_t* codes;
  int64_t code_st, nbytes, D, chunk_codes, chunk_bytes;
  uint64_t levels;
  std::vector<int64_t> code_base;  // per flat (batch, head): byte offset of token 0
  // power-of-two levels: the chunks are whole bytes of b-bit codes with no padding
  // (kvbench.quant.packing), so the row is one bit stream and channel d starts at bit d b
  int bits = 0;
  uint32_t mask = 0;
  // other one-byte layouts: digit_lut[byte * c + digit]
  std::vector<uint8_t> digit_lut;
  // other base-L words: L^digit
  std::vector<uint64_t> pow;
  std::vector<float> table;
  ParamAt scale, zero;

  Deltas(const at::Tensor& codes_, const at::Tensor& table_, const c10::optional<at::Tensor>& scale_,
         const c10::optional<at::Tensor>& zero_, int64_t levels_, int64_t head_dim, int64_t chunk_codes_,
         int64_t chunk_bytes_, int64_t scale_rows, int64_t zero_rows)
      : D(head_dim), chunk_codes(chunk_codes_), chunk_bytes(chunk_bytes_), levels(levels_),
        scale(scale_, scale_rows, codes_.size(0), codes_.size(1), head_dim),
        zero(zero_, zero_rows, codes_.size(0), codes_.size(1), head_dim) {
    TORCH_CHECK(codes_.scalar_type() == at::kByte && codes_.dim() == 4 && codes_.stride(3) == 1 &&
                    codes_.device().is_cpu(),
                "codes must be uint8 [B, H_kv, T, bytes] on the CPU, contiguous along the bytes");
    TORCH_CHECK(levels_ >= 2 && chunk_codes_ >= 1 && chunk_bytes_ >= 1 && chunk_bytes_ <= 8,
                "bad code layout");
    const int64_t B = codes_.size(0), H = codes_.size(1);
    codes = codes_.data_ptr<uint8_t>();
    code_st = codes_.stride(2);
    nbytes = codes_.size(3);
    code_base.resize(B * H);
    for (int64_t bh = 0; bh < B * H; ++bh) code_base[bh] = (bh / H) * codes_.stride(0) + (bh % H) * codes_.stride(1);
    auto tab = table_.to(at::kFloat).contiguous();
    TORCH_CHECK(tab.numel() == levels_, "table must hold one value per level");
    table.assign(tab.data_ptr<float>(), tab.data_ptr<float>() + levels_);
    if ((levels & (levels - 1)) == 0 && levels <= 256) {
      bits = __builtin_ctzll(levels);
      mask = static_cast<uint32_t>(levels - 1);
      TORCH_CHECK(chunk_codes * bits == 8 * chunk_bytes, "power-of-two codes must fill their chunks");
    } else if (chunk_bytes == 1) {
      digit_lut.resize(256 * chunk_codes);
      for (int64_t byte = 0; byte < 256; ++byte) {
        int64_t rest = byte;
        for (int64_t i = 0; i < chunk_codes; ++i) {
          digit_lut[byte * chunk_codes + i] = static_cast<uint8_t>(std::min<int64_t>(rest % levels_, 255));
          rest /= levels_;
        }
      }
    } else {
      pow.resize(chunk_codes);
      uint64_t p = 1;
      for (int64_t i = 0; i < chunk_codes; ++i, p *= levels) pow[i] = p;
    }
  }

  int64_t code(const uint8_t* row, int64_t d) const {
    if (bits) {
      const int64_t bit = d * bits;
      const int64_t byte = bit >> 3;
      uint32_t w = row[byte];
      if (byte + 1 < nbytes) w |= static_cast<uint32_t>(row[byte + 1]) << 8;
      return (w >> (bit & 7)) & mask;
    }
    if (chunk_bytes == 1) {
      const int64_t chunk = d / chunk_codes, digit = d - chunk * chunk_codes;
      return digit_lut[row[chunk] * chunk_codes + digit];
    }
    const int64_t chunk = d / chunk_codes, digit = d - chunk * chunk_codes;
    uint64_t word = 0;
    for (int64_t k = 0; k < chunk_bytes; ++k) word |= static_cast<uint64_t>(row[chunk * chunk_bytes + k]) << (8 * k);
    return static_cast<int64_t>((word / pow[digit]) % levels);
  }

  // exact - (table[c] s + z) at token t, flat (batch, head) bh, channel d
  float operator()(int64_t t, int64_t bh, int64_t d, float exact) const {
    const uint8_t* row = codes + code_base[bh] + t * code_st;
    float recon = table[code(row, d)];
    if (scale.valid()) recon = recon * scale.at(bh, t, d);
    if (zero.valid()) recon = recon + zero.at(bh, t, d);
    return exact - recon;
  }
};

struct Entries {
  Column rows, cols, vals;
  int64_t n;

  Entries(const at::Tensor& rows_, const at::Tensor& cols_, const at::Tensor& vals_)
      : rows(column(rows_, "rows", {at::kInt, at::kLong})),
        cols(column(cols_, "cols", {at::kShort, at::kInt, at::kLong})),
        vals(column(vals_, "vals", {at::kHalf, at::kFloat, at::kBFloat16})),
        n(rows_.numel()) {
    TORCH_CHECK(cols_.numel() == n && vals_.numel() == n, "rows, cols and vals disagree on the count");
  }
};

// Starts of the score tasks' entry ranges (and n at the end): every kEntries entries, moved on to
// the next token, so that one token's entries, the only ones that write its scores, share a task.
// Entries out of token order (not the store's layout) run as one range.
std::vector<int64_t> token_ranges(const Entries& e) {
  std::vector<int64_t> starts{0};
  if (e.n > kEntries) {
    bool ordered = true;
    int64_t block[257];
    for (int64_t b0 = 0; b0 + 1 < e.n && ordered; b0 += 256) {
      const int64_t n = std::min<int64_t>(257, e.n - b0);
      e.rows.indices(b0, n, block);
      for (int64_t j = 1; j < n; ++j) ordered &= block[j - 1] <= block[j];
    }
    if (ordered) {
      for (int64_t s = kEntries; s < e.n; s += kEntries) {
        int64_t i = std::max(s, starts.back() + 1);
        const int64_t t = e.rows.index(i - 1);
        while (i < e.n && e.rows.index(i) == t) ++i;
        if (i < e.n && i > starts.back()) starts.push_back(i);
      }
    }
  }
  starts.push_back(e.n);
  return starts;
}

// (flat batch-head, channel) of a flat column, by shift where D is a power of two
struct Split {
  int64_t D;
  int shift;
  explicit Split(int64_t D_) : D(D_), shift((D_ & (D_ - 1)) == 0 ? __builtin_ctzll(D_) : -1) {}
  void operator()(int64_t col, int64_t& bh, int64_t& d) const {
    if (shift >= 0) {
      bh = col >> shift;
      d = col & (D - 1);
    } else {
      bh = col / D;
      d = col - bh * D;
    }
  }
};

// f(t, bh, d, value) for the entries [i0, i1) in order, read a block at a time in their dtypes
template <class F>
void each_entry(const Entries& e, const Split& split, int64_t i0, int64_t i1, int64_t T, int64_t BH, F&& f) {
  constexpr int64_t kBlock = 256;
  int64_t rows[kBlock], cols[kBlock];
  float vals[kBlock];
  for (int64_t b0 = i0; b0 < i1; b0 += kBlock) {
    const int64_t n = std::min(kBlock, i1 - b0);
    e.rows.indices(b0, n, rows);
    e.cols.indices(b0, n, cols);
    e.vals.values(b0, n, vals);
    for (int64_t j = 0; j < n; ++j) {
      int64_t bh, d;
      split(cols[j], bh, d);
      const int64_t t = rows[j];
      TORCH_CHECK(t >= 0 && t < T && bh >= 0 && bh < BH, "outlier entry ", b0 + j, " out of range");
      f(t, bh, d, vals[j]);
    }
  }
}

void outlier_scores(at::Tensor& out, const at::Tensor& query, const at::Tensor& codes, const at::Tensor& table,
                    const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& zero, int64_t levels,
                    int64_t head_dim, int64_t chunk_codes, int64_t chunk_bytes, int64_t scale_rows, int64_t zero_rows,
                    const at::Tensor& rows, const at::Tensor& cols, const at::Tensor& vals,
                    const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin, int64_t rope_offset) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 4, "out must be contiguous float32 4-d");
  const int64_t BH = out.size(0) * out.size(1), M = out.size(2), T = out.size(3), D = head_dim;
  TORCH_CHECK(query.dim() == 4 && query.size(0) * query.size(1) == BH && query.size(2) == M && query.size(3) == D,
              "query must be [B, H_kv, M, head_dim]");
  TORCH_CHECK(codes.size(0) * codes.size(1) == BH, "codes and out disagree on [B, H_kv]");
  const Entries e(rows, cols, vals);
  if (e.n == 0) return;
  const Deltas delta(codes, table, scale, zero, levels, D, chunk_codes, chunk_bytes, scale_rows, zero_rows);
  auto q = query.to(at::kFloat).contiguous();
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::Tensor cf, sf;
  if (cos) {
    TORCH_CHECK(sin.has_value(), "cos without sin");
    cf = cos->to(at::kFloat).contiguous();
    sf = sin->to(at::kFloat).contiguous();
    TORCH_CHECK(cf.size(-1) == D && sf.size(-1) == D, "the RoPE table must be [positions, head_dim]");
  }
  const float* cp = cos ? cf.data_ptr<float>() : nullptr;
  const float* sp = cos ? sf.data_ptr<float>() : nullptr;
  TORCH_CHECK(!cos || (rope_offset >= 0 && cf.numel() / D >= rope_offset + T), "the RoPE table is too short");
  const int64_t half = D / 2;
  const Split split(D);
  const std::vector<int64_t> starts = token_ranges(e);
  at::parallel_for(0, static_cast<int64_t>(starts.size()) - 1, 1, [&](int64_t lo, int64_t hi) {
    each_entry(e, split, starts[lo], starts[hi], T, BH, [&](int64_t t, int64_t bh, int64_t d, float exact) {
      const float dv = delta(t, bh, d, exact);
      const float* qb = qp + bh * M * D;
      float* ob = op + bh * M * T + t;
      if (cp == nullptr) {
        for (int64_t m = 0; m < M; ++m) ob[m * T] += qb[m * D + d] * dv;
        return;
      }
      // RoPE of delta e_d: delta cos at d, and +-delta sin at the partner channel d -+ D/2
      const int64_t pos = rope_offset + t;
      const int64_t partner = d < half ? d + half : d - half;
      const float sign = d < half ? 1.f : -1.f;
      const float a0 = dv * cp[pos * D + d];
      const float a1 = sign * dv * sp[pos * D + partner];
      for (int64_t m = 0; m < M; ++m) ob[m * T] += qb[m * D + d] * a0 + qb[m * D + partner] * a1;
    });
  });
}

void outlier_mix(at::Tensor& out, const at::Tensor& weights, const at::Tensor& codes, const at::Tensor& table,
                 const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& zero, int64_t levels,
                 int64_t head_dim, int64_t chunk_codes, int64_t chunk_bytes, int64_t scale_rows, int64_t zero_rows,
                 const at::Tensor& rows, const at::Tensor& cols, const at::Tensor& vals) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 4, "out must be contiguous float32 4-d");
  const int64_t BH = out.size(0) * out.size(1), M = out.size(2), D = head_dim, T = weights.size(3);
  TORCH_CHECK(out.size(3) == D, "out must be [B, H_kv, M, head_dim]");
  TORCH_CHECK(weights.dim() == 4 && weights.size(0) * weights.size(1) == BH && weights.size(2) == M,
              "weights must be [B, H_kv, M, T]");
  TORCH_CHECK(codes.size(0) * codes.size(1) == BH, "codes and out disagree on [B, H_kv]");
  const Entries e(rows, cols, vals);
  if (e.n == 0) return;
  const Deltas delta(codes, table, scale, zero, levels, D, chunk_codes, chunk_bytes, scale_rows, zero_rows);
  auto p = weights.to(at::kFloat).contiguous();
  const float* pp = p.data_ptr<float>();
  const Split split(D);
  const int64_t tasks = (e.n + kEntries - 1) / kEntries, size = BH * M * D;
  // one task adds straight into out (the serial order); more keep partial sums, added in task order
  std::vector<float> partial(tasks > 1 ? tasks * size : 0, 0.f);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, tasks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      float* acc = tasks > 1 ? partial.data() + k * size : op;
      const int64_t stop = std::min(e.n, (k + 1) * kEntries);
      each_entry(e, split, k * kEntries, stop, T, BH, [&](int64_t t, int64_t bh, int64_t d, float exact) {
        const float dv = delta(t, bh, d, exact);
        const float* pb = pp + bh * M * T + t;
        float* ab = acc + bh * M * D + d;
        for (int64_t m = 0; m < M; ++m) ab[m * D] += pb[m * T] * dv;
      });
    }
  });
  if (tasks > 1) {
    for (int64_t k = 0; k < tasks; ++k) {
      const float* src = partial.data() + k * size;
#pragma omp simd
      for (int64_t j = 0; j < size; ++j) op[j] += src[j];
    }
  }
}

#ifdef KVB_AVX2
// Pre-RoPE codebook keys (KVQuant's): x_t = RoPE_{offset + t}(table[c_t] s + z), scores q . x_t, for
// power-of-two level counts up to 16. Their codes are one bit stream (channel d at bit d b), so the
// 8 codes of channels 8j..8j+7 are the b bytes at 8j b / 8: one 32-bit load, a variable shift per
// lane, a mask, and the table looked up in registers (one permute for L <= 8, two and a blend for
// L = 16); then the affine map as one FMA and RoPE on whole vectors of the two halves. The generic
// row decoder (attention.cpp's CodeRows) does the same in scalar loops.
struct RopeRows {
  const uint8_t* codes = nullptr;
  int64_t code_st = 0, nbytes = 0, D = 0, bits = 0;
  __m256 lo_tab, hi_tab;
  __m256i shifts, mask;
  // scale/zero: a fixed row per (batch, head) (D floats), or one number per token
  struct P {
    bool present = false, per_token = false;
    const char* data = nullptr;
    at::ScalarType type = at::kFloat;
    int64_t item = 4, st = 0, base = 0;
    std::vector<float> row;
  } s, z;
  const float* cos = nullptr;
  const float* sin = nullptr;
  int64_t offset = 0;

  // token t's row into out [D]; mapped: D floats of 32-byte aligned scratch
  void load_row(int64_t t, float* mapped, float* out) const {
    const uint8_t* row = codes + t * code_st;
    for (int64_t j = 0; j < D / 8; ++j) {
      const int64_t at = j * bits;
      uint32_t w = 0;
      if (at + 4 <= nbytes) {
        std::memcpy(&w, row + at, 4);
      } else {
        for (int64_t k = at; k < nbytes; ++k) w |= static_cast<uint32_t>(row[k]) << (8 * (k - at));
      }
      __m256i c = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), shifts), mask);
      __m256 v = _mm256_permutevar8x32_ps(lo_tab, c);
      if (bits == 4) {
        const __m256 hi = _mm256_permutevar8x32_ps(hi_tab, c);
        const __m256 pick = _mm256_castsi256_ps(_mm256_slli_epi32(c, 28));  // bit 3 to the sign
        v = _mm256_blendv_ps(v, hi, pick);
      }
      _mm256_store_ps(mapped + 8 * j, v);
    }
    const float sv = s.per_token ? scalar(s, t) : 1.f, zv = z.per_token ? scalar(z, t) : 0.f;
    for (int64_t j = 0; j < D; j += 8) {
      __m256 v = _mm256_load_ps(mapped + j);
      if (s.present) v = _mm256_mul_ps(v, s.per_token ? _mm256_set1_ps(sv) : _mm256_loadu_ps(s.row.data() + j));
      if (z.present) v = _mm256_add_ps(v, z.per_token ? _mm256_set1_ps(zv) : _mm256_loadu_ps(z.row.data() + j));
      _mm256_store_ps(mapped + j, v);
    }
    const int64_t half = D / 2;
    const float* c = cos + (offset + t) * D;
    const float* sn = sin + (offset + t) * D;
    for (int64_t j = 0; j < half; j += 8) {
      const __m256 a = _mm256_load_ps(mapped + j), b = _mm256_load_ps(mapped + half + j);
      _mm256_storeu_ps(out + j, _mm256_sub_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + j)),
                                              _mm256_mul_ps(b, _mm256_loadu_ps(sn + j))));
      _mm256_storeu_ps(out + half + j, _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + half + j)),
                                                     _mm256_mul_ps(a, _mm256_loadu_ps(sn + half + j))));
    }
  }
  static float scalar(const P& p, int64_t t) {
    return load_scalar(p.data + (p.base + t * p.st) * p.item, p.type);
  }
};

inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// Whether a parameter is absent, one row for every token (fixed ranges) or one number per token;
// anything else takes the generic kernel.
bool rope_param(const c10::optional<at::Tensor>& x, int64_t rows, int64_t T, int64_t D, RopeRows::P& p) {
  if (!x) return true;
  const at::ScalarType t = x->scalar_type();
  if (x->dim() != 4 || !(t == at::kFloat || t == at::kHalf || t == at::kBFloat16)) return false;
  p.present = true;
  p.data = static_cast<const char*>(x->data_ptr());
  p.type = t;
  p.item = x->element_size();
  if (rows == 0 || x->size(2) == 1) return x->size(3) == 1 || x->size(3) == D;
  p.per_token = true;
  p.st = x->stride(2);
  return x->size(3) == 1 && x->size(2) == T;
}

void bind_param(const c10::optional<at::Tensor>& x, int64_t b, int64_t h, int64_t D, RopeRows::P& p) {
  if (!p.present) return;
  const int64_t sb = x->size(0) == 1 ? 0 : x->stride(0), sh = x->size(1) == 1 ? 0 : x->stride(1);
  p.base = b * sb + h * sh;
  if (p.per_token) return;
  const int64_t sd = x->size(3) == 1 ? 0 : x->stride(3);
  p.row.resize(D);
  RopeRows::P one = p;
  one.st = 0;
  for (int64_t d = 0; d < D; ++d) {
    one.base = p.base + d * sd;
    p.row[d] = RopeRows::scalar(one, 0);
  }
}
#endif

// scores [B, H, M, T], or None where the layout is not one this kernel takes (the caller then runs
// the generic code_scores).
c10::optional<at::Tensor> rope_code_scores(const at::Tensor& query, const at::Tensor& codes, const at::Tensor& table,
                                           const c10::optional<at::Tensor>& scale,
                                           const c10::optional<at::Tensor>& zero, int64_t levels, int64_t head_dim,
                                           int64_t scale_rows, int64_t zero_rows, const at::Tensor& cos,
                                           const at::Tensor& sin, int64_t rope_offset) {
#ifdef KVB_AVX2
  const int64_t D = head_dim;
  if (!(levels == 2 || levels == 4 || levels == 8 || levels == 16) || D % 16 != 0 || D > 256) return c10::nullopt;
  if (codes.scalar_type() != at::kByte || codes.dim() != 4 || codes.stride(3) != 1 || !codes.device().is_cpu())
    return c10::nullopt;
  const int64_t B = codes.size(0), H = codes.size(1), T = codes.size(2), bits = __builtin_ctzll(levels);
  if (codes.size(3) != D * bits / 8 || query.dim() != 4 || query.size(0) != B || query.size(1) != H ||
      query.size(3) != D || !query.device().is_cpu())
    return c10::nullopt;
  RopeRows proto;
  if (!rope_param(scale, scale_rows, T, D, proto.s) || !rope_param(zero, zero_rows, T, D, proto.z)) return c10::nullopt;
  auto cf = cos.to(at::kFloat).contiguous(), sf = sin.to(at::kFloat).contiguous();
  TORCH_CHECK(cf.size(-1) == D && sf.size(-1) == D, "the RoPE table must be [positions, head_dim]");
  TORCH_CHECK(rope_offset >= 0 && cf.numel() / D >= rope_offset + T, "the RoPE table is too short");
  auto tab = table.to(at::kFloat).contiguous();
  TORCH_CHECK(tab.numel() == levels, "table must hold one value per level");
  alignas(32) float lanes[16] = {0};
  std::memcpy(lanes, tab.data_ptr<float>(), levels * sizeof(float));
  proto.lo_tab = _mm256_load_ps(lanes);
  proto.hi_tab = _mm256_load_ps(lanes + 8);
  proto.shifts = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int>(bits)));
  proto.mask = _mm256_set1_epi32(static_cast<int>(levels - 1));
  proto.bits = bits;
  proto.D = D;
  proto.nbytes = codes.size(3);
  proto.code_st = codes.stride(2);
  proto.cos = cf.data_ptr<float>();
  proto.sin = sf.data_ptr<float>();
  proto.offset = rope_offset;
  auto q = query.to(at::kFloat).contiguous();
  const int64_t M = q.size(2);
  auto out = at::empty({B, H, M, T}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  // Tasks over token ranges, every (batch, head) inside: a token's cos/sin rows are read from
  // memory once and reused from L1 for every head (they outweigh the codes: 2 D floats a token).
  std::vector<RopeRows> bound(B * H, proto);
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    bound[bh].codes = cp + b * codes.stride(0) + h * codes.stride(1);
    bind_param(scale, b, h, D, bound[bh].s);
    bind_param(zero, b, h, D, bound[bh].z);
  }
  constexpr int64_t chunk = 64;
  const int64_t BH = B * H;
  at::parallel_for(0, (T + chunk - 1) / chunk, 1, [&](int64_t lo, int64_t hi) {
    alignas(32) float x[4][256];
    alignas(32) float mapped[256];
    for (int64_t t0 = lo * chunk; t0 < std::min(T, hi * chunk); t0 += chunk) {
      const int64_t t1 = std::min(T, t0 + chunk);
      for (int64_t t = t0; t < t1; t += 4) {
        const int64_t n = std::min<int64_t>(4, t1 - t);
        for (int64_t bh = 0; bh < BH; ++bh) {
          const RopeRows& rows = bound[bh];
          const float* qb = qp + bh * M * D;
          float* ob = op + bh * M * T;
          for (int64_t j = 0; j < n; ++j) rows.load_row(t + j, mapped, x[j]);
          if (n == 4) {
            for (int64_t m = 0; m < M; ++m) {
              const float* qm = qb + m * D;
              __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
              for (int64_t d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qm + d);
                a0 = _mm256_fmadd_ps(qv, _mm256_load_ps(x[0] + d), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_load_ps(x[1] + d), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_load_ps(x[2] + d), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_load_ps(x[3] + d), a3);
              }
              _mm_storeu_ps(ob + m * T + t, hsum4(a0, a1, a2, a3));
            }
            continue;
          }
          for (int64_t j = 0; j < n; ++j)
            for (int64_t m = 0; m < M; ++m) {
              const float* qm = qb + m * D;
              float acc = 0.f;
              for (int64_t d = 0; d < D; ++d) acc += qm[d] * x[j][d];
              ob[m * T + t + j] = acc;
            }
        }
      }
    }
  });
  return out;
#else
  return c10::nullopt;
#endif
}

}  // namespace

void register_sparse_kernels(pybind11::module& m) {
  m.def("outlier_scores", &outlier_scores, "adds q . (exact - reconstructed) at sparse outliers, in place");
  m.def("outlier_mix", &outlier_mix, "adds p (exact - reconstructed) at sparse outliers, in place");
  m.def("rope_code_scores", &rope_code_scores,
        "query . pre-RoPE codebook keys (power-of-two levels <= 16), or None for other layouts");
}
