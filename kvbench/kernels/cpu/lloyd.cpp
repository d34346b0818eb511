// KVQuant's offline codebook fit on the CPU: Lloyd's algorithm in one dimension
// (kvbench.quant.nuq.kmeans_1d holds the plain-torch reference; tests/kernels/test_lloyd.py checks
// the two give the same bits).
//
// The reference spends each iteration on a bucketize of every value and two index_add_ passes; a
// calibration fits two codebooks per layer, up to 100 iterations each over 2^16 values. Here the
// cells are counted with vector compares and the sums of up to 16 cells run in vector lanes.
//
// The arithmetic is the reference's, step for step: the signposts sorted, the float32 midpoints
// (c[i] + c[i+1]) / 2, each value's cell the first midpoint not below it (torch.bucketize,
// right=False), each cell's sum accumulated in float32 in the values' order (index_add_ on the CPU
// is a serial loop), an empty cell keeping its signpost, and the stop at the first iteration that
// changes no signpost. The sums stay serial per cell on purpose: another order would change their
// float32 bits. Values must be finite (calibration clamps them to [-1, 1]); the dispatcher sends
// anything else to the reference.

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// Up to 16 signposts are held in float lanes: a value's cell sum is a masked add into every lane.
constexpr int64_t kLanes = 16;

// One Lloyd pass over the values with at most kLanes signposts: each value's cell (how many of the
// sorted midpoints lie below it: the first midpoint not below it, as torch.bucketize with
// right=False, for every finite value), the cells' counts, and the cells' sums in the values' order.
// Every lane but the value's own gets +0.0: a sum that starts at +0.0 is never -0.0 under
// round-to-nearest, so adding +0.0 leaves it unchanged and each lane holds the serial sum of its
// cell's values. ``mid`` holds kLanes - 1 midpoints, the unused ones +inf (never below a value).
#if defined(__AVX2__)
void lane_pass(const float* x, int64_t n, const float* mid, float* sums, int64_t* counts) {
  const __m256 mid_lo = _mm256_loadu_ps(mid);
  const __m256 mid_hi = _mm256_set_ps(INFINITY, mid[14], mid[13], mid[12], mid[11], mid[10], mid[9], mid[8]);
  const __m256i lane_lo = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lane_hi = _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15);
  __m256 acc_lo = _mm256_setzero_ps(), acc_hi = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m256 y = _mm256_set1_ps(x[j]);
    const int below = _mm256_movemask_ps(_mm256_cmp_ps(mid_lo, y, _CMP_LT_OQ)) |
                      (_mm256_movemask_ps(_mm256_cmp_ps(mid_hi, y, _CMP_LT_OQ)) << 8);
    const int cell = __builtin_popcount(below);
    ++counts[cell];
    const __m256i c = _mm256_set1_epi32(cell);
    acc_lo = _mm256_add_ps(acc_lo, _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(lane_lo, c)), y));
    acc_hi = _mm256_add_ps(acc_hi, _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(lane_hi, c)), y));
  }
  _mm256_storeu_ps(sums, acc_lo);
  _mm256_storeu_ps(sums + 8, acc_hi);
}
#endif

// The same pass for any number of signposts, one value at a time (every pass of a build without
// AVX2).
void scalar_pass(const float* x, int64_t n, const std::vector<float>& mid, float* sums, int64_t* counts) {
  for (int64_t j = 0; j < n; ++j) {
    const int64_t cell = std::lower_bound(mid.begin(), mid.end(), x[j]) - mid.begin();
    ++counts[cell];
    sums[cell] += x[j];
  }
}

torch::Tensor lloyd_1d(torch::Tensor values, torch::Tensor start, int64_t iters) {
  TORCH_CHECK(values.dim() == 1 && values.scalar_type() == torch::kFloat32, "values: 1-D float32");
  TORCH_CHECK(start.dim() == 1 && start.scalar_type() == torch::kFloat32, "start: 1-D float32");
  TORCH_CHECK(values.device().is_cpu() && start.device().is_cpu(), "CPU tensors only");
  const int64_t levels = start.numel();
  TORCH_CHECK(levels >= 1, "at least one signpost");
  const auto v = values.contiguous();
  const float* x = v.data_ptr<float>();
  const int64_t n = v.numel();
  auto s = start.contiguous();
  std::vector<float> c(s.data_ptr<float>(), s.data_ptr<float>() + levels);
  std::vector<float> mid(levels - 1), lanes(kLanes - 1), sums(std::max(levels, kLanes)), next(levels);
  std::vector<int64_t> counts(std::max(levels, kLanes));
  for (int64_t it = 0; it < iters; ++it) {
    std::sort(c.begin(), c.end());
    for (int64_t i = 0; i + 1 < levels; ++i) mid[i] = (c[i] + c[i + 1]) / 2.0f;
    std::fill(sums.begin(), sums.end(), 0.0f);
    std::fill(counts.begin(), counts.end(), 0);
#if defined(__AVX2__)
    if (levels <= kLanes) {
      std::fill(lanes.begin(), lanes.end(), INFINITY);
      std::copy(mid.begin(), mid.end(), lanes.begin());
      lane_pass(x, n, lanes.data(), sums.data(), counts.data());
    } else {
      scalar_pass(x, n, mid, sums.data(), counts.data());
    }
#else
    scalar_pass(x, n, mid, sums.data(), counts.data());
#endif
    bool same = true;
    for (int64_t i = 0; i < levels; ++i) {
      // the reference divides by float32 counts; below 2^24 they are these integers exactly
      next[i] = counts[i] > 0 ? sums[i] / static_cast<float>(counts[i]) : c[i];
      same = same && next[i] == c[i];
    }
    if (same) break;
    c.swap(next);
  }
  std::sort(c.begin(), c.end());
  auto out = torch::empty({levels}, torch::kFloat32);
  std::copy(c.begin(), c.end(), out.data_ptr<float>());
  return out;
}

}  // namespace

void register_lloyd_kernels(pybind11::module& m) {
  m.def("lloyd_1d", &lloyd_1d, "KVQuant's codebook: 1-D Lloyd iterations from sorted start signposts");
}
