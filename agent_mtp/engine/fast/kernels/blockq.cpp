// Linear layers over block-quantized weights for AVX2 CPUs (and AVX-512 forms with the same numbers, below), computed
// in float32.
//
// The default model ships as a GGUF file whose decoder weights are Q4_1 (per block of 32: w = d * q + m, q in 0..15)
// and whose embedding is Q8_0 (w = d * q, q in -128..127). Its float32 weights are exactly those values, so reading
// the blocks instead of the float32 copy reads ~5x fewer bytes for bit-identical weights: each weight is rebuilt in
// float32 with one fused multiply-add (q * d is exact, so it rounds once, as the dequantizer's q * d + m) and
// multiplied in float32.
//
// Two kernels multiply the blocks, each the faster one for its pass size: passes under kLaneRows rows (5 for Q4_1,
// 2 for Q8_0) take "row" kernels (each output is 8 lanes over k, lanes summed at the end: the weights' bytes are
// unpacked 32 at a time, which a one-token pass, bound by memory, needs), longer ones "lane" kernels (8 output
// features in the 8 lanes, one chain over k each: one rebuilt weight vector feeds every row of a tile, ~1.5x the
// multiply-adds per second of the row kernels from 5 rows up for Q4_1; Q8_0's row kernels lose from 2 rows). Within
// each class every output y[r, n] is one fixed sequence of float32 operations whatever the number of rows and however
// the work is split, so a row's result does not depend on the other rows of its pass; between the classes the
// summation order differs (last bits).
//
// Where the CPU has AMX-INT8 (namespace tiles) or AVX-512 VNNI (namespace vnni), block passes instead multiply the
// inputs, put on a 24-bit grid per block, by the integer quants exactly and scale the sums in float32: no weight is
// rebuilt, and both paths give the same numbers, whatever the pass size.
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/view_as_real.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;     // weights per quantization block (Q4_1 and Q8_0)

inline float lane_sum(__m256 v) {
  // ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)): the same order for every output.
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// How many of a pass's ``rows`` rows are flagged for the 8-bit grid in ``coarse`` (none where it is null).
inline int64_t light_rows(const uint8_t* coarse, int64_t rows) {
  return coarse == nullptr ? 0 : std::count_if(coarse, coarse + rows, [](uint8_t c) { return c != 0; });
}

// A thread's share of shared_for's tasks, [lo, hi) packed in one word: its owner takes chunks from the front, a
// thread that has finished its own takes from the back.
struct alignas(64) Share {
  std::atomic<uint64_t> span{0};
  static uint64_t pack(int64_t lo, int64_t hi) { return static_cast<uint64_t>(hi) << 32 | static_cast<uint64_t>(lo); }
  // [begin, end) taken from the front (owner: a quarter of what is left) or the back (thief: half); false when empty
  bool take(bool front, int64_t& begin, int64_t& end) {
    uint64_t seen = span.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t lo = static_cast<int64_t>(seen & 0xFFFFFFFFu), hi = static_cast<int64_t>(seen >> 32);
      if (lo >= hi) return false;
      const int64_t count = std::max<int64_t>(1, (hi - lo) / (front ? 4 : 2));
      begin = front ? lo : hi - count;
      end = front ? lo + count : hi;
      if (span.compare_exchange_weak(seen, front ? pack(end, hi) : pack(lo, begin), std::memory_order_relaxed))
        return true;
    }
  }
};

// body(begin, end, state) over the tasks [0, tasks) on torch's threads. Each thread starts on its contiguous share,
// as a static split would (its prefetches run on into its next task), and a thread that finishes early takes the
// rest of another's share from its end: a thread slowed by anything else on its core (a server's Python, another
// process) hands its work over instead of holding every thread at the region's end. Each task is computed whole by
// one thread, so no number depends on which thread takes it. ``State`` is per-thread scratch handed to each chunk
// the thread takes; ``done(state)`` runs once per thread at the end.
template <class State, class Body, class Done>
void shared_for(int64_t tasks, Body&& body, Done&& done) {
  if (tasks <= 0) return;
  TORCH_CHECK(tasks < (int64_t{1} << 31), "shared_for takes fewer than 2^31 tasks, got ", tasks);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
  std::vector<Share> shares(static_cast<size_t>(threads));
  for (int64_t t = 0; t < threads; ++t)
    shares[t].span.store(Share::pack(tasks * t / threads, tasks * (t + 1) / threads), std::memory_order_relaxed);
  at::parallel_for(0, threads, 1, [&](int64_t me, int64_t) {
    State state{};
    int64_t begin = 0, end = 0;
    for (int64_t k = 0; k < threads; ++k) {
      Share& share = shares[(me + k) % threads];
      while (share.take(k == 0, begin, end)) body(begin, end, state);
    }
    done(state);
  });
}

void check_inputs(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale, int64_t bytes_per_block) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous 2-D float32 CPU tensor");
  const int64_t k = x.size(1);
  TORCH_CHECK(k % kBlock == 0, "in_features must be a multiple of 32, got ", k);
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kByte && qs.is_contiguous() &&
                  qs.size(1) == k / kBlock * bytes_per_block,
              "qs must be a contiguous uint8 [out, in / 32 * ", bytes_per_block, "] tensor");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == qs.size(0) * (k / kBlock),
              "scale must be a contiguous float32 [out, in / 32] tensor");
}

// Weights are stored in groups of 8 output features, block-interleaved: for group g and block b the 8 features'
// bytes lie together ([groups][blocks][8][bytes per block]) and so do their scales ([groups][blocks][8]), so a
// pass over a group reads one contiguous stream.
constexpr int64_t kGroup = 8;

// The row kernels walk a group's stream once per slice of its features (a 2-row pass twice, 3-4 rows four times), the
// first walk reading only the first of each block's cache lines: it asks for the whole block kAhead blocks ahead
// (quants and scales), so that the later lines and walks find them in cache instead of waiting on memory. Reads past a
// group's end fetch the next group's stream (contiguous), which the next task reads.
constexpr int64_t kAhead = 8;
inline void prefetch_group_block(const uint8_t* quants, int64_t bytes, const float* d, const float* m, int64_t b) {
  for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(reinterpret_cast<const char*>(quants + at), _MM_HINT_T0);
  if (b % 2 == 0) {  // 8 scales of 4 bytes per block: one line per two blocks
    _mm_prefetch(reinterpret_cast<const char*>(d + b * kGroup), _MM_HINT_T0);
    if (m != nullptr) _mm_prefetch(reinterpret_cast<const char*>(m + b * kGroup), _MM_HINT_T0);
  }
}

// Rows r0..r0+R against the C features c0..c0+C of one group (Q4_1): y[r, c] = dot(x[r], w[c]).
template <int R, int C>
inline void q4_1_kernel(const float* x, int64_t k, const uint8_t* qs, const float* d, const float* m, int c0,
                        float* y, int64_t ldy, bool add) {
  const int64_t blocks = k / kBlock;
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const __m128i low_mask = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* qb = qs + (b * kGroup + c0) * 16;
    const float* db = d + b * kGroup + c0;
    const float* mb = m + b * kGroup + c0;
    const float* xb = x + b * kBlock;
    if (c0 == 0) prefetch_group_block(qs + (b + kAhead) * kGroup * 16, 128, d, m, b + kAhead);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + c * 16));
      const __m128i lo = _mm_and_si128(bytes, low_mask);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_mask);
      const __m256 vd = _mm256_broadcast_ss(db + c), vm = _mm256_broadcast_ss(mb + c);
      // q * d is exact (4-bit q, 11-bit d), so one fused multiply-add rounds once, as the dequantizer's q * d + m.
      const __m256 w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), vd, vm);
      const __m256 w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), vd, vm);
      const __m256 w2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), vd, vm);
      const __m256 w3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), vd, vm);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const float* xr = xb + r * k;
        acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w0, acc[r][c]);
        acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w1, acc[r][c]);
        acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w2, acc[r][c]);
        acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w3, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c] = add ? y[r * ldy + c] + lane_sum(acc[r][c]) : lane_sum(acc[r][c]);
}

// Rows r0..r0+R against the C features c0..c0+C of one group (Q8_0).
template <int R, int C>
inline void q8_0_kernel(const float* x, int64_t k, const uint8_t* qs, const float* d, const float* /*m*/, int c0,
                        float* y, int64_t ldy, bool add) {
  const int64_t blocks = k / kBlock;
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* qb = reinterpret_cast<const int8_t*>(qs) + (b * kGroup + c0) * 32;
    const float* db = d + b * kGroup + c0;
    const float* xb = x + b * kBlock;
    if (c0 == 0) prefetch_group_block(qs + (b + kAhead) * kGroup * 32, 256, d, nullptr, b + kAhead);
    for (int c = 0; c < C; ++c) {
      const __m256 vd = _mm256_broadcast_ss(db + c);
      __m256 w[4];
      for (int p = 0; p < 4; ++p) {
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + c * 32 + 8 * p));
        w[p] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), vd);
      }
      for (int r = 0; r < R; ++r) {
        const float* xr = xb + r * k;
        for (int p = 0; p < 4; ++p) acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8 * p), w[p], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c] = add ? y[r * ldy + c] + lane_sum(acc[r][c]) : lane_sum(acc[r][c]);
}

// ---- lane kernels (passes of L::kLaneRows rows or more) ----------------------------------------------------------
// The quants of a group are also kept feature-interleaved ("lanes"): for group g, block b and position i in the block,
// the 8 features' quants lie together, [groups][blocks][32][bytes per position]. They become the 8 features' weights
// at one input position (rebuilt with the same operations as the row kernels), which every row of the tile multiplies
// into its accumulator (lane f = feature f), so y[r, f] is one chain over k in order.
constexpr int kLaneTile = 8;  // rows per tile: 8 accumulators hide the multiply-add latency (9-13 measured slower)

// Q4_1: one 32-bit word per position, feature f in bits 4f..4f+3; w = q * d + m in one fused multiply-add.
struct Q41Lanes {
  static constexpr int64_t kBytes = 4;
  static constexpr int64_t kLaneRows = 5;  // its row kernels' 4-row tiles are faster up to 4 rows
  static inline __m256 weights(const uint8_t* at, __m256 vd, __m256 vm) {
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);  // a constant the inlined loop hoists
    int32_t word;
    std::memcpy(&word, at, sizeof word);
    const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), _mm256_set1_epi32(0x0F));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), vd, vm);
  }
};
// Q8_0: 8 signed bytes per position; w = q * d (exact), as the row kernel.
struct Q80Lanes {
  static constexpr int64_t kBytes = 8;
  static constexpr int64_t kLaneRows = 2;  // its row kernels lose from 2 rows (1.1-1.9x slower at 2-4 rows, Zen 3)
  static inline __m256 weights(const uint8_t* at, __m256 vd, __m256 /*vm*/) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(at));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), vd);
  }
};

template <class L, int R>
inline void lanes_kernel(const float* x, int64_t k, const uint8_t* lanes, const float* d, const float* m, float* y,
                         int64_t ldy, bool add) {
  const int64_t blocks = k / kBlock;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* lb = lanes + b * kBlock * L::kBytes;
    const __m256 vd = _mm256_loadu_ps(d + b * kGroup);
    const __m256 vm = m != nullptr ? _mm256_loadu_ps(m + b * kGroup) : _mm256_setzero_ps();
    const float* xb = x + b * kBlock;
    __m256 w = L::weights(lb, vd, vm);
#pragma GCC unroll 4
    for (int i = 0; i < kBlock; ++i) {
      // the next position's weights first: their rebuild (a load, a shift, a conversion, a multiply-add) is a chain
      // of ~15 cycles that this position's multiply-adds hide (Zen 3, one thread, the gate/up and down products at
      // 8-16 rows: 31.5-31.9 -> 34.0-34.3 GMAC/s, the same numbers)
      const __m256 next = i + 1 < kBlock ? L::weights(lb + (i + 1) * L::kBytes, vd, vm) : w;
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(xb + r * k + i), w, acc[r]);
      w = next;
    }
  }
  for (int r = 0; r < R; ++r) {
    float* yr = y + r * ldy;
    _mm256_storeu_ps(yr, add ? _mm256_add_ps(_mm256_loadu_ps(yr), acc[r]) : acc[r]);
  }
}

// Rows [0, rows) in tiles of at most kLaneTile rows spread evenly (9 rows or more: tiles of 4-8): calls
// tile(first row, std::integral_constant<int, size>) for each, so the kernel is instantiated per tile size.
template <class Tile>
inline void for_each_lane_tile(int64_t rows, Tile&& tile) {
  const int64_t tiles = (rows + kLaneTile - 1) / kLaneTile;
  int64_t r = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t size = rows / tiles + (t < rows % tiles ? 1 : 0);
    switch (size) {
      case 8: tile(r, std::integral_constant<int, 8>{}); break;
      case 7: tile(r, std::integral_constant<int, 7>{}); break;
      case 6: tile(r, std::integral_constant<int, 6>{}); break;
      case 5: tile(r, std::integral_constant<int, 5>{}); break;
      case 4: tile(r, std::integral_constant<int, 4>{}); break;
      case 3: tile(r, std::integral_constant<int, 3>{}); break;
      case 2: tile(r, std::integral_constant<int, 2>{}); break;
      default: tile(r, std::integral_constant<int, 1>{}); break;
    }
    r += size;
  }
}

// Short tiles (2-5 rows) have too few accumulators to hide the multiply-add latency (~4 cycles on Zen 3: a 2-row tile
// of one group made one multiply-add per chain every 4 cycles, and Q8_0's output head took as long at 2, 3 and 4 rows),
// so they take several groups at once: each output is still one chain over k in order with the same operations (the
// same bits as one group at a time, whatever the tile), R x G chains in flight instead of R.
template <class L, int R, int G>
inline void lanes_kernel_groups(const float* x, int64_t k, const uint8_t* lanes, int64_t lane_stride, const float* d,
                                const float* m, int64_t scale_stride, float* y, int64_t ldy, bool add) {
  const int64_t blocks = k / kBlock;
  __m256 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kBlock;
    __m256 vd[G], vm[G];
    for (int g = 0; g < G; ++g) {
      vd[g] = _mm256_loadu_ps(d + g * scale_stride + b * kGroup);
      vm[g] = m != nullptr ? _mm256_loadu_ps(m + g * scale_stride + b * kGroup) : _mm256_setzero_ps();
    }
    const uint8_t* lb = lanes + b * kBlock * L::kBytes;
#pragma GCC unroll 2
    for (int i = 0; i < kBlock; ++i) {
      __m256 w[G];
      for (int g = 0; g < G; ++g) w[g] = L::weights(lb + g * lane_stride + i * L::kBytes, vd[g], vm[g]);
      for (int r = 0; r < R; ++r) {
        const __m256 xr = _mm256_broadcast_ss(xb + r * k + i);
        for (int g = 0; g < G; ++g) acc[r][g] = _mm256_fmadd_ps(xr, w[g], acc[r][g]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      float* yr = y + r * ldy + g * kGroup;
      _mm256_storeu_ps(yr, add ? _mm256_add_ps(_mm256_loadu_ps(yr), acc[r][g]) : acc[r][g]);
    }
}

// Groups a tile of R rows multiplies at once: enough chains to hide the latency, few enough to stay in registers.
constexpr int64_t lane_groups(int64_t rows) { return rows >= 6 ? 1 : rows >= 3 ? 2 : 4; }

// Rows [0, R) of ``count`` adjacent groups (lanes, scales and minimums ``lane_stride`` / ``scale_stride`` apart).
template <class L, int R>
void lanes_tile(const float* x, int64_t k, const uint8_t* lanes, int64_t lane_stride, const float* d, const float* m,
                int64_t scale_stride, float* y, int64_t ldy, bool add, int64_t count) {
  constexpr int G = static_cast<int>(lane_groups(R));
  int64_t g = 0;
  const auto run = [&](auto groups) {
    constexpr int n = decltype(groups)::value;
    if constexpr (n == 1)
      lanes_kernel<L, R>(x, k, lanes + g * lane_stride, d + g * scale_stride, m != nullptr ? m + g * scale_stride : m,
                         y + g * kGroup, ldy, add);
    else
      lanes_kernel_groups<L, R, n>(x, k, lanes + g * lane_stride, lane_stride, d + g * scale_stride,
                                   m != nullptr ? m + g * scale_stride : m, scale_stride, y + g * kGroup, ldy, add);
    g += n;
  };
  while (count - g >= G) run(std::integral_constant<int, G>{});
  if constexpr (G >= 4)
    if (count - g == 3) run(std::integral_constant<int, 3>{});
  if constexpr (G >= 3)
    if (count - g == 2) run(std::integral_constant<int, 2>{});
  if (count - g == 1) run(std::integral_constant<int, 1>{});
}

// Rows [0, rows) of ``count`` adjacent groups.
template <class L>
void lanes_groups(const float* x, int64_t rows, int64_t k, const uint8_t* lanes, int64_t lane_stride, const float* d,
                  const float* m, int64_t scale_stride, float* y, int64_t ldy, bool add, int64_t count) {
  for_each_lane_tile(rows, [&](int64_t r, auto size) {
    lanes_tile<L, decltype(size)::value>(x + r * k, k, lanes, lane_stride, d, m, scale_stride, y + r * ldy, ldy, add,
                                         count);
  });
}

// Groups one task of a lane pass of ``rows`` rows takes: what its shortest tile multiplies at once.
inline int64_t lane_task_groups(int64_t rows) {
  const int64_t tiles = (rows + kLaneTile - 1) / kLaneTile;
  return lane_groups(rows / tiles);
}

// ---- buffered lane passes (passes of kBufferedRows rows or more) -------------------------------------------------
// A lane tile rebuilds every position's weights for its own rows: one rebuild (five operations, one of them on the
// multiply-add pipes) per 8 multiply-adds in a tile of 8 rows, again for each tile. Long passes (a prefill, a large
// batch) instead rebuild a task's groups once into a buffer (the same operations, so the same weights) and multiply
// every tile from there: tiles of up to 4 rows x 3 groups, 12 chains, one weight load per 4 multiply-adds and one
// broadcast per 3. Each output is still one chain over k in order with the same operations: the same bits as
// lanes_kernel. Zen 3, one thread, gate/up's shape (3072 x 576), GMAC/s in tiles against buffered: 8 rows 34 / 29,
// 16 rows 35 / 37, 32 rows 35 / 43, 128 rows 34 / 47 (what the two multiply-add pipes allow); the rebuild on its own
// costs ~2 cycles per 8 weights, hence tiles below 9 rows. From 9 rows: whole passes there were a tie on Zen 3
// (0.98-1.01x, 9-15 rows), and on Zen 1 (128-bit FMA pipes, where a tile's broadcasts and rebuilds weigh more) 0.75x
// the time at 10 and 12 rows (66.8 / 75.5 against 88.8 / 102.0 ms, 2 threads, alternated twice), 0.90x at 8 rows.
// Below 9 rows the machines part (Zen 3: tiles 34 against buffered 29 GMAC/s at 8 rows; Zen 1: buffered 0.90-0.95x
// the pass time at 5-8 rows), so the Python side measures which is faster there once per process and may move the
// threshold down to 5 (g_buffered_rows; blockq.settle_buffered_rows). The same bits either way.
constexpr int64_t kBufferedRows = 9;
std::atomic<int64_t> g_buffered_rows{kBufferedRows};

// Set (request >= 1) or read (-1) g_buffered_rows: AVX2 lane passes of this many rows or more take the buffered path.
int64_t buffered_rows(int64_t request) {
  TORCH_CHECK(request == -1 || request >= 1, "buffered_rows takes -1 (leave as is) or a row count >= 1, got ", request);
  if (request >= 1) g_buffered_rows = request;
  return g_buffered_rows.load();
}
constexpr int kBufferedGroups = 3, kBufferedTile = 4;

// The weights of ``count`` adjacent groups (lanes, scales and minimums ``lane_stride`` / ``scale_stride`` apart) as
// float32, buf[i * count + g] = group g's 8 features at input position i.
template <class L>
void rebuild_groups(int64_t k, const uint8_t* lanes, int64_t lane_stride, const float* d, const float* m,
                    int64_t scale_stride, int64_t count, __m256* buf) {
  const int64_t blocks = k / kBlock;
  for (int64_t g = 0; g < count; ++g)
    for (int64_t b = 0; b < blocks; ++b) {
      const __m256 vd = _mm256_loadu_ps(d + g * scale_stride + b * kGroup);
      const __m256 vm = m != nullptr ? _mm256_loadu_ps(m + g * scale_stride + b * kGroup) : _mm256_setzero_ps();
      const uint8_t* lb = lanes + g * lane_stride + b * kBlock * L::kBytes;
      __m256* out = buf + b * kBlock * count + g;
#pragma GCC unroll 8
      for (int i = 0; i < kBlock; ++i) out[i * count] = L::weights(lb + i * L::kBytes, vd, vm);
    }
}

// Rows x[0..R) against G groups' rebuilt weights: y[r, 0..8G).
template <int R, int G>
__attribute__((always_inline)) inline void buffered_tile(const float* x, int64_t k, const __m256* buf, float* y,
                                                         int64_t ldy, bool add) {
  __m256 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int64_t i = 0; i < k; ++i) {
    __m256 w[G];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) w[g] = buf[i * G + g];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * k + i);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) acc[r][g] = _mm256_fmadd_ps(xr, w[g], acc[r][g]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      float* yr = y + r * ldy + g * kGroup;
      _mm256_storeu_ps(yr, add ? _mm256_add_ps(_mm256_loadu_ps(yr), acc[r][g]) : acc[r][g]);
    }
}

// Rows [0, rows) of ``count`` (1..kBufferedGroups) adjacent groups: rebuilt once, then tiles of up to kBufferedTile
// rows spread evenly.
template <class L>
void lanes_buffered(const float* x, int64_t rows, int64_t k, const uint8_t* lanes, int64_t lane_stride, const float* d,
                    const float* m, int64_t scale_stride, float* y, int64_t ldy, bool add, int64_t count) {
  static thread_local std::vector<__m256> buf;  // 32-byte aligned elements (C++17 aligned new)
  buf.resize(static_cast<size_t>(k * count));
  rebuild_groups<L>(k, lanes, lane_stride, d, m, scale_stride, count, buf.data());
  const int64_t tiles = (rows + kBufferedTile - 1) / kBufferedTile;
  const auto groups = [&](auto g) {
    constexpr int G = decltype(g)::value;
    for (int64_t t = 0, r = 0; t < tiles; ++t) {
      const int64_t size = rows / tiles + (t < rows % tiles ? 1 : 0);
      const float* xr = x + r * k;
      float* yr = y + r * ldy;
      switch (size) {
        case 4: buffered_tile<4, G>(xr, k, buf.data(), yr, ldy, add); break;
        case 3: buffered_tile<3, G>(xr, k, buf.data(), yr, ldy, add); break;
        case 2: buffered_tile<2, G>(xr, k, buf.data(), yr, ldy, add); break;
        default: buffered_tile<1, G>(xr, k, buf.data(), yr, ldy, add); break;
      }
      r += size;
    }
  };
  static_assert(kBufferedGroups == 3);
  if (count == 3) groups(std::integral_constant<int, 3>{});
  else if (count == 2) groups(std::integral_constant<int, 2>{});
  else groups(std::integral_constant<int, 1>{});
}

// ---- AVX-512 (where the CPU has it) ------------------------------------------------------------------------------
// The same two kernel classes, twice as wide, and bit for bit the same numbers: every 512-bit register holds two
// 256-bit halves that each perform exactly the operations of an AVX2 register above, in the same order. Row kernels
// put features c and c + 1 in the two halves (each half a feature's 8 lanes over k, summed by lane_sum as above); lane
// kernels put two groups of 8 features side by side (one chain over k per lane, as above). What changes is how many
// instructions rebuild the weights: a pass here is bound by that, not by the bytes read.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi")
namespace wide {

// [a x 8 | b x 8]
inline __m512 pair_broadcast(const float* a, const float* b) {
  return _mm512_insertf32x8(_mm512_set1_ps(*a), _mm256_set1_ps(*b), 1);
}

inline void store_pair(float* y, __m512 acc, bool add) {
  const float lo = lane_sum(_mm512_castps512_ps256(acc)), hi = lane_sum(_mm512_extractf32x8_ps(acc, 1));
  y[0] = add ? y[0] + lo : lo;
  y[1] = add ? y[1] + hi : hi;
}

// Byte indices that put weights 8j..8j+7 of features c and c + 1 into dword lanes 0-7 and 8-15 (zero-extended by
// the byte permute's zero mask) from [c's low nibbles | c + 1's low | c's high | c + 1's high] (16 bytes each).
inline __m512i nibble_index(int j) {
  alignas(64) int8_t idx[64] = {};
  for (int lane = 0; lane < 16; ++lane) idx[4 * lane] = static_cast<int8_t>((lane < 8 ? 0 : 16) + 8 * (j % 2) + 32 * (j / 2) + lane % 8);
  return _mm512_load_si512(idx);
}

// [v[2p] x 8 | v[2p + 1] x 8] for the 8 floats v of a block's features.
inline __m512 pair_of(__m512 v, int p) {
  return _mm512_permutexvar_ps(_mm512_setr_epi32(2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p + 1,
                                                 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1,
                                                 2 * p + 1),
                               v);
}

// Rows x[0..R) against features c0..c0 + 2P of one group (Q4_1), two features per register. Per block the P
// registers of nibbles are unpacked once, then each 8-input slice j of the block is rebuilt in float32 for every
// feature pair and multiplied into every row: R x P accumulators plus R inputs and a few constants stay in the 32
// registers at R = P = 4 (all 32 inputs of every row held at once spilled: a 4-row pass cost 1.4x a 3-row one on
// Zen 4; now 1.15x). Each accumulator still takes slices 0-3 of every block in order: the same numbers.
template <int R, int P>
inline void q4_1_rows(const float* x, int64_t k, const uint8_t* qs, const float* d, const float* m, int c0, float* y,
                      int64_t ldy, bool add) {
  const int64_t blocks = k / kBlock;
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  const __m512i idx0 = nibble_index(0), idx1 = nibble_index(1), idx2 = nibble_index(2), idx3 = nibble_index(3);
  constexpr __mmask64 kDwords = 0x1111111111111111ULL;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* qb = qs + (b * kGroup + c0) * 16;
    const __m512 d8 = _mm512_castps256_ps512(_mm256_loadu_ps(d + b * kGroup));
    const __m512 m8 = _mm512_castps256_ps512(_mm256_loadu_ps(m + b * kGroup));
    const float* xb = x + b * kBlock;
    __m512i nibbles[P];
    __m512 vd[P], vm[P];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      // features c and c + 1's 32 bytes in both halves; the upper half shifted to the high nibbles
      const __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + p * 32)));
      nibbles[p] = _mm512_and_si512(_mm512_mask_srli_epi16(raw, 0xFFFF0000u, raw, 4), low_mask);
      vd[p] = pair_of(d8, c0 / 2 + p);
      vm[p] = pair_of(m8, c0 / 2 + p);
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i idx = j == 0 ? idx0 : j == 1 ? idx1 : j == 2 ? idx2 : idx3;
      __m512 xs[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) xs[r] = _mm512_broadcast_f32x8(_mm256_loadu_ps(xb + r * k + 8 * j));
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        const __m512i q = _mm512_maskz_permutexvar_epi8(kDwords, idx, nibbles[p]);
        const __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), vd[p], vm[p]);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][p] = _mm512_fmadd_ps(xs[r], w, acc[r][p]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) store_pair(y + r * ldy + 2 * p, acc[r][p], add);
}

// Byte indices that put bytes 8j..8j+7 of features c and c + 1 (32 bytes each, side by side) into the top byte of
// dword lanes 0-7 and 8-15: each lane then holds q * 2^24, signed.
inline __m512i top_byte_index(int j) {
  alignas(64) int8_t idx[64] = {};
  for (int lane = 0; lane < 16; ++lane) idx[4 * lane + 3] = static_cast<int8_t>((lane < 8 ? 0 : 32) + 8 * j + lane % 8);
  return _mm512_load_si512(idx);
}

// Rows x[0..R) against features c0..c0 + 2P of one group (Q8_0), two features per register. A weight is
// (q * 2^24) * (d * 2^-24): both factors exact, so the product rounds as q * d does (it is exact: 8-bit q, 11-bit d).
// Slice by slice, as q4_1_rows.
template <int R, int P>
inline void q8_0_rows(const float* x, int64_t k, const uint8_t* qs, const float* d, const float* /*m*/, int c0,
                      float* y, int64_t ldy, bool add) {
  const int64_t blocks = k / kBlock;
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  constexpr __mmask64 kTopBytes = 0x8888888888888888ULL;
  const __m512 unscale = _mm512_set1_ps(1.0f / 16777216.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* qb = qs + (b * kGroup + c0) * 32;
    const __m512 d8 = _mm512_mul_ps(_mm512_castps256_ps512(_mm256_loadu_ps(d + b * kGroup)), unscale);
    const float* xb = x + b * kBlock;
    __m512 vd[P];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) vd[p] = pair_of(d8, c0 / 2 + p);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i idx = top_byte_index(j);
      __m512 xs[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) xs[r] = _mm512_broadcast_f32x8(_mm256_loadu_ps(xb + r * k + 8 * j));
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        const __m512i both = _mm512_loadu_si512(qb + p * 64);  // feature c's 32 bytes, then c + 1's
        const __m512i q = _mm512_maskz_permutexvar_epi8(kTopBytes, idx, both);
        const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(q), vd[p]);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[r][p] = _mm512_fmadd_ps(xs[r], w, acc[r][p]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) store_pair(y + r * ldy + 2 * p, acc[r][p], add);
}

// One group's 8 features for ``rows`` rows, in tiles of up to 4 rows (the numbers do not depend on the tiles).
template <bool Q4>
void rows_group(const float* x, int64_t rows, int64_t k, const uint8_t* q, const float* d, const float* m, float* y,
                int64_t ldy, bool add) {
  const auto tile = [&]<int R>(int64_t r) {
    if constexpr (Q4)
      q4_1_rows<R, 4>(x + r * k, k, q, d, m, 0, y + r * ldy, ldy, add);
    else
      q8_0_rows<R, 4>(x + r * k, k, q, d, m, 0, y + r * ldy, ldy, add);
  };
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) tile.template operator()<4>(r);
  if (rows - r == 3) tile.template operator()<3>(r);
  if (rows - r == 2) tile.template operator()<2>(r);
  if (rows - r == 1) tile.template operator()<1>(r);
}

// Lane weights of two groups at one input position: [group g's 8 features | group g + 1's].
struct Q41Lanes {
  static inline __m512 weights(const uint8_t* a, const uint8_t* b, __m512 vd, __m512 vm) {
    const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    int32_t wa, wb;
    std::memcpy(&wa, a, sizeof wa);
    std::memcpy(&wb, b, sizeof wb);
    const __m512i words = _mm512_inserti64x4(_mm512_set1_epi32(wa), _mm256_set1_epi32(wb), 1);
    const __m512i q = _mm512_and_si512(_mm512_srlv_epi32(words, shifts), _mm512_set1_epi32(0x0F));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), vd, vm);
  }
};
struct Q80Lanes {
  static inline __m512 weights(const uint8_t* a, const uint8_t* b, __m512 vd, __m512 /*vm*/) {
    const __m256i qa = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)));
    const __m256i qb = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_inserti64x4(_mm512_castsi256_si512(qa), qb, 1)), vd);
  }
};

inline __m512 pair_load(const float* a, const float* b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}

// Rows x[0..R) against two groups (lanes a and b, scales da / db, minimums ma / mb): y[r, 0..16).
template <class W, int64_t Bytes, int R>
inline void lanes_kernel(const float* x, int64_t k, const uint8_t* la, const uint8_t* lb, const float* da,
                         const float* db, const float* ma, const float* mb, float* y, int64_t ldy, bool add) {
  const int64_t blocks = k / kBlock;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* pa = la + b * kBlock * Bytes;
    const uint8_t* pb = lb + b * kBlock * Bytes;
    const __m512 vd = pair_load(da + b * kGroup, db + b * kGroup);
    const __m512 vm = ma != nullptr ? pair_load(ma + b * kGroup, mb + b * kGroup) : _mm512_setzero_ps();
    const float* xb = x + b * kBlock;
#pragma GCC unroll 4
    for (int i = 0; i < kBlock; ++i) {
      const __m512 w = W::weights(pa + i * Bytes, pb + i * Bytes, vd, vm);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * k + i]), w, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* yr = y + r * ldy;
    _mm512_storeu_ps(yr, add ? _mm512_add_ps(_mm512_loadu_ps(yr), acc[r]) : acc[r]);
  }
}

// Rows [0, rows) of two adjacent groups, in the tiles of for_each_lane_tile.
template <class W, int64_t Bytes>
void lanes_pair(const float* x, int64_t rows, int64_t k, const uint8_t* la, const uint8_t* lb, const float* da,
                const float* db, const float* ma, const float* mb, float* y, int64_t ldy, bool add) {
  for_each_lane_tile(rows, [&](int64_t r, auto size) {
    lanes_kernel<W, Bytes, decltype(size)::value>(x + r * k, k, la, lb, da, db, ma, mb, y + r * ldy, ldy, add);
  });
}

}  // namespace wide
#pragma GCC pop_options

bool cpu_has_avx512() {
  __builtin_cpu_init();  // g_wide below is set while the library loads, possibly before libgcc's own set-up
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vbmi");
}

// Which kernel classes run their AVX-512 forms (bits: kWideRows, the row kernels and the multi-row attention loops
// of short passes; kWideLanes, the lane kernels): each is measured apart, since a CPU that splits 512-bit
// instructions in two can gain on one class and lose on the other (Zen 4 did until the Q8_0 lane kernel below was
// fixed). All on where the CPU has them.
constexpr int64_t kWideRows = 1, kWideLanes = 2, kWideAll = kWideRows | kWideLanes;
std::atomic<int64_t> g_wide{cpu_has_avx512() ? kWideAll : 0};

inline bool wide_rows_on() { return (g_wide.load(std::memory_order_relaxed) & kWideRows) != 0; }
inline bool wide_lanes_on() { return (g_wide.load(std::memory_order_relaxed) & kWideLanes) != 0; }

// request 0-3: the classes (bits above) to run in AVX-512 where the CPU has them, -1: leave as is. Returns the
// classes in use.
int64_t avx512_forms(int64_t request) {
  TORCH_CHECK(request >= -1 && request <= kWideAll, "avx512_forms takes -1 (leave as is) or a mask of 0-3, got ",
              request);
  if (request >= 0) g_wide = cpu_has_avx512() ? request : 0;
  return g_wide.load();
}

// Bits of the grid exact rows take: 24 (float32-accurate: the default) or 16 (a block's inputs at 2^-15 of its
// largest |x|: a2 = 0, so VNNI skips its 8 products a block and an exact row costs 16 instead of 24). Outside the
// AVX-512 target regions: every CPU calls it.
inline void check_grid_bits(int64_t bits) {
  TORCH_CHECK(bits == 24 || bits == 16, "grid_bits must be 24 or 16, got ", bits);
}

// ---- AMX tiles (where the CPU has AMX-INT8) ------------------------------------------------------------------------
// Intel's AMX multiplies 8-bit integer tiles at ~1,000 multiply-adds per cycle, summed exactly in 32-bit integers.
// A block's quants are integers, so sum_i q_i x_i needs only x in integers too, with no precision lost where it
// matters: each row's block of 32 inputs is put on a fixed-point grid of 24 bits under the block's largest magnitude
// (X_i = round(x_i 2^(23 - e)), |x_i| < 2^e, the rounding error at most half of 2^(e - 23): an element at the
// block's top exponent keeps 23 of its 24 bits, as a float32 product's rounding would), and X is split into one
// signed and two unsigned bytes (X = a0 2^16 + a1 2^8 + a2). Three tile products (signed x unsigned for a0, unsigned x
// unsigned for a1 and a2; Q8_0's signed quants: signed x signed and unsigned x signed) give the exact integer sums
// C_j = sum_i a_ji q_i, and per output, block and row the float32 result is
//   t = (C2 + 256 C1) + 65536 C0, y += t * (d 2^(e - 23)) + m * sum_i x_i      (Q8_0: no m term)
// in that order, with fused multiply-adds; sum_i x_i is summed in float32 in a fixed order. Every output is one fixed
// sequence of operations on its own row's inputs whatever the pass size or the rows beside it, as in the kernel
// classes above (the numbers differ from theirs in the last bits: the products are exact here, rounded there).
//
// Weights: per 16 output features and block one record, Q4_1 [256 bytes of quants | d x 16 | m x 16, float16: five
// cache lines] and Q8_0 [512 bytes of quants | d x 16, float32]: the quants in the B-tile order of a 32-deep block
// (8 tile rows of 16 features x 4 consecutive inputs), Q4_1's tile rows 2c and 2c + 1 in the low and high nibbles of
// the 64 bytes c.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,amx-tile,amx-int8")
namespace tiles {

constexpr int64_t kFeatures = 16;   // outputs per record (a tile's 16 int32 columns)
constexpr int64_t kQ41Record = 256 + 2 * 32, kQ80Record = 512 + 64;  // Q4_1: d and m in float16
constexpr int kChunk = 8;           // rows per tile product: a0 rows fill 8 tile rows, a1 / a2 rows 16
constexpr int kCoarseChunk = 16;    // rows per tile product where all are on the 8-bit grid (a0 only)
constexpr int64_t kAhead = 4;       // blocks a record stream is prefetched ahead of its product

struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0 = B (quants), 1 = A (a0 of the chunk's rows), 2 = A (a1, a2 interleaved by row), 3 = C of 1, 4 = C of 2;
// 5-7: B and the two C of a second record stream (chunk_product).
inline void configure(int chunk) {
  Config c;
  c.rows[0] = 8, c.colsb[0] = 64;
  c.rows[1] = chunk, c.colsb[1] = 32;
  c.rows[2] = 2 * chunk, c.colsb[2] = 32;
  c.rows[3] = chunk, c.colsb[3] = 64;
  c.rows[4] = 2 * chunk, c.colsb[4] = 64;
  c.rows[5] = 8, c.colsb[5] = 64;  // the second stream's B, C of a0 and C of a1 / a2
  c.rows[6] = chunk, c.colsb[6] = 64;
  c.rows[7] = 2 * chunk, c.colsb[7] = 64;
  _tile_loadconfig(&c);
}

// A pass's inputs on each block's grid: a0 [blocks][rows][32] int8, a12 [blocks][rows][2][32] uint8, and per row and
// block the grid step 2^(e - 23) and the float32 sum of the inputs.
//
// Rows are in the pass's order, or (``ordered``, for the tiles) the exact rows first and the 8-bit ones after them:
// grid row r holds the pass's row order[r], rows [0, exact) are exact and [exact, rows) on the 8-bit grid, so that a
// tile can load a chunk of 8-bit rows alone (their tile products need none of the exact rows' two low bytes).
struct Grid {
  std::vector<int8_t> a0;
  std::vector<uint8_t> a12;
  std::vector<float> step, sum;  // [rows][blocks]
  const uint8_t* coarse = nullptr;  // [pass rows] or none: 1 where a row is on an 8-bit grid (a0 = x * 127 / peak)
  std::vector<int64_t> order;       // grid row -> pass row where the rows are reordered, else empty
  int64_t exact = 0;                // grid rows [0, exact) exact, [exact, rows) 8-bit where reordered, else all rows
  int low_bytes = 2;                // of an exact row: 2 (a1, a2: 24 bits) or 1 (16 bits: a2 = 0, its products skipped)
  int64_t row_of(int64_t r) const { return order.empty() ? r : order[r]; }
  bool coarse_row(int64_t r) const { return coarse != nullptr && coarse[row_of(r)] != 0; }
};

// sum of 32 floats as ((v0 + v1) lane sums, reduced in a fixed order).
inline float block_sum(__m512 v0, __m512 v1) { return _mm512_reduce_add_ps(_mm512_add_ps(v0, v1)); }

// For a finite peak > 0: e with peak < 2^e (frexp's exponent) and the grid step 2^(e - 23), read off the float's
// bits where both are normal numbers (frexp and ldexp are library calls, ~a quarter of a grid's time), else by them.
inline float grid_step(float peak, int& e) {
  uint32_t bits = 0;
  std::memcpy(&bits, &peak, sizeof bits);
  const int biased = static_cast<int>(bits >> 23);  // peak > 0: no sign bit
  if (biased < 23) {  // peak or its step subnormal
    std::frexp(peak, &e);
    return std::ldexp(1.0f, e - 23);
  }
  e = biased - 126;  // peak in [2^(biased - 127), 2^(biased - 126))
  const uint32_t step_bits = static_cast<uint32_t>(biased - 22) << 23;  // 2^(e - 23): exponent e - 23 + 127
  float step = 0.0f;
  std::memcpy(&step, &step_bits, sizeof step);
  return step;
}

// Grids of fewer (row, block) pairs than this are built on the calling thread: ~20 ns a pair, so under ~20 us a
// call, where a parallel region's fork and join cost more than the split saves (measured: passes of 4 rows spent
// 0.67 ms a pass on grids split across 2 threads, 0.25 ms built on one).
constexpr int64_t kGridGrain = 1024;

// Whether a tile pass of ``rows`` rows, ``light`` of them on the 8-bit grid, costs less with those in coarse chunks
// of up to 16 (one tile product and store a block for each stream) than mixed into the exact chunks of up to 8 (two
// of each). Tile products and stores run one at a time at ~3-5 ns each whatever their rows (microbenchmarked on a
// Sapphire Rapids-class VM), so the count of chunks prices a pass: an exact chunk ~33 ns a block of a stream pair, a
// coarse one ~24. Splitting off 3 draft rows of a 4-row pass adds a chunk (1.2x slower, measured); the 24 draft rows
// of 8 sequences' 4-row passes take 2 coarse chunks instead of 3 exact ones.
inline bool coarse_chunks_pay(int64_t rows, int64_t light) {
  const auto chunks = [](int64_t n, int64_t per) { return (n + per - 1) / per; };
  return light > 0 && 33 * chunks(rows - light, kChunk) + 24 * chunks(light, kCoarseChunk) < 33 * chunks(rows, kChunk);
}

// The grid is built in storage this thread keeps from call to call (a pass makes ~120 grids: four fresh vectors
// each cost ~2 us a call), so it serves until this thread's next on_grid. ``bits``: of the exact rows (above).
const Grid& on_grid(const float* x, int64_t rows, int64_t k, const uint8_t* coarse = nullptr, bool ordered = false,
                    int64_t bits = 24) {
  const int64_t blocks = k / kBlock;
  static thread_local Grid storage;
  Grid& g = storage;  // a local name: the threads of the parallel_for below must write the caller's grid, not theirs
  g.coarse = coarse;  // the caller's flags, alive for the product's call
  g.low_bytes = bits == 16 ? 1 : 2;
  // 16 bits: x 2^(15 - e) rounded inside [-2^15, 2^15) and moved up a byte, the 24-bit grid's value with a2 = 0 (the
  // same step 2^(e - 23), so every product and scaling below reads it as it reads a 24-bit row)
  const int shift_bits = bits == 16 ? 15 : 23;
  const __m512i top16 = _mm512_set1_epi32((1 << 15) - 1), bottom16 = _mm512_set1_epi32(-(1 << 15));
  g.order.clear();
  g.exact = rows;
  if (ordered && coarse_chunks_pay(rows, light_rows(coarse, rows))) {
    for (int64_t r = 0; r < rows; ++r)
      if (coarse[r] == 0) g.order.push_back(r);
    g.exact = static_cast<int64_t>(g.order.size());
    for (int64_t r = 0; r < rows; ++r)
      if (coarse[r] != 0) g.order.push_back(r);
  }
  g.a0.resize(static_cast<size_t>(blocks * rows * kBlock));
  g.a12.resize(static_cast<size_t>(blocks * rows * 2 * kBlock));
  g.step.resize(static_cast<size_t>(rows * blocks));
  g.sum.resize(static_cast<size_t>(rows * blocks));
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  const __m512i top = _mm512_set1_epi32((1 << 23) - 1), bottom = _mm512_set1_epi32(-(1 << 23));
  const __m512i byte = _mm512_set1_epi32(0xFF);
  // (row, block) pairs are independent: split over the threads where there are enough of them
  at::parallel_for(0, rows * blocks, kGridGrain, [&](int64_t begin, int64_t end) {
    for (int64_t slot = begin; slot < end; ++slot) {
      const int64_t r = slot / blocks, b = slot % blocks;
      const float* xb = x + g.row_of(r) * k + b * kBlock;
      const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
      const float peak = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, abs_mask), _mm512_and_ps(v1, abs_mask)));
      g.sum[r * blocks + b] = block_sum(v0, v1);
      int e = 0;
      const bool usable = std::isfinite(peak) && peak > 0.0f;
      int8_t* a0 = g.a0.data() + (b * rows + r) * kBlock;
      uint8_t* a12 = g.a12.data() + (b * rows + r) * 2 * kBlock;
      if (g.coarse_row(r)) {
        // 8 bits: x * 127 / peak rounded to nearest (the block's largest |x| at +-127, as llama.cpp's Q8_0
        // activations), a1 = a2 = 0; the step scales a0's sums as the 24-bit grid's top byte (x 65536) would.
        const __m512 inv = _mm512_set1_ps(usable ? 127.0f / peak : 0.0f);
        g.step[r * blocks + b] = usable ? peak / (127.0f * 65536.0f) : 0.0f;
        const __m512i most = _mm512_set1_epi32(127), least = _mm512_set1_epi32(-127);
        for (int h = 0; h < 2; ++h) {
          __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(h == 0 ? v0 : v1, inv));
          q = _mm512_max_epi32(_mm512_min_epi32(q, most), least);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(a0 + 16 * h), _mm512_cvtepi32_epi8(q));
        }
        std::memset(a12, 0, 2 * kBlock);
        continue;
      }
      if (usable) g.step[r * blocks + b] = grid_step(peak, e);
      else g.step[r * blocks + b] = 0.0f;
      const __m512 shift = _mm512_set1_ps(static_cast<float>(shift_bits - e));
      for (int h = 0; h < 2; ++h) {
        __m512i q = _mm512_setzero_si512();
        if (usable) {
          // x 2^(23 - e) is exact (a power of two); round to nearest even, keep inside the 24-bit grid
          q = _mm512_cvtps_epi32(_mm512_scalef_ps(h == 0 ? v0 : v1, shift));
          if (shift_bits == 15) q = _mm512_slli_epi32(_mm512_max_epi32(_mm512_min_epi32(q, top16), bottom16), 8);
          q = _mm512_max_epi32(_mm512_min_epi32(q, top), bottom);
        }
        _mm_storeu_si128(reinterpret_cast<__m128i*>(a0 + 16 * h), _mm512_cvtepi32_epi8(_mm512_srai_epi32(q, 16)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(a12 + 16 * h),
                         _mm512_cvtepi32_epi8(_mm512_and_si512(_mm512_srli_epi32(q, 8), byte)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(a12 + kBlock + 16 * h),
                         _mm512_cvtepi32_epi8(_mm512_and_si512(q, byte)));
      }
    }
  });
  return g;
}

// Q4_1 quants of one record's block -> the B tile's 512 bytes (low nibbles: rows 2c, high: rows 2c + 1).
inline void unpack_q4(const uint8_t* rec, uint8_t* out) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_loadu_si512(rec + 64 * c);
    _mm512_store_si512(out + 128 * c, _mm512_and_si512(v, low));
    _mm512_store_si512(out + 128 * c + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
  }
}

// A record block's scales: Q4_1's d and m are float16 values (exactly: the GGUF's), widened here; Q8_0's d is stored
// as float32 (its m is zero).
template <bool kQ4>
inline __m512 record_d(const uint8_t* rec) {
  return kQ4 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 256)))
             : _mm512_loadu_ps(reinterpret_cast<const float*>(rec + 512));
}
template <bool kQ4>
inline __m512 record_m(const uint8_t* rec) {
  return kQ4 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 288))) : _mm512_setzero_ps();
}

// acc + one row's exact sums of a block (s0 of a0, s1 / s2 of a1 / a2) scaled as above. Both record paths scale
// with it (AMX from the stored C tiles, VNNI from registers), so their numbers are the same bits.
template <bool kQ4>
inline __m512 scale_row(__m512 acc, __m512i s0, __m512i s1, __m512i s2, __m512 d, __m512 m, float step, float sum) {
  __m512 t = _mm512_cvtepi32_ps(s2);
  t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_set1_ps(256.0f), t);
  t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_set1_ps(65536.0f), t);
  acc = _mm512_fmadd_ps(t, _mm512_mul_ps(d, _mm512_set1_ps(step)), acc);
  if constexpr (kQ4) acc = _mm512_fmadd_ps(m, _mm512_set1_ps(sum), acc);
  return acc;
}

// scale_row for a row on the 8-bit grid (s1 = s2 = 0) in the same bits with two conversions and an FMA less: there
// scale_row's t is fma(cvt(s0), 65536, fma(+0, 256, +0)) = cvt(s0) * 65536, a product by a power of two (exact).
template <bool kQ4>
inline __m512 scale_coarse_row(__m512 acc, __m512i s0, __m512 d, __m512 m, float step, float sum) {
  const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(s0), _mm512_set1_ps(65536.0f));
  acc = _mm512_fmadd_ps(t, _mm512_mul_ps(d, _mm512_set1_ps(step)), acc);
  if constexpr (kQ4) acc = _mm512_fmadd_ps(m, _mm512_set1_ps(sum), acc);
  return acc;
}

// acc[i] += the block's exact sums (C0 of row i at c0 + 16 i, C1 / C2 at c12 + 32 i / + 16) scaled as above.
template <bool kQ4, int kRows>
inline void scale_into(__m512* acc, const int32_t* c0, const int32_t* c12, const uint8_t* rec, const float* step,
                       const float* sum, int64_t blocks) {
  const __m512 d = record_d<kQ4>(rec), m = record_m<kQ4>(rec);
#pragma GCC unroll 8
  for (int i = 0; i < kRows; ++i)
    acc[i] = scale_row<kQ4>(acc[i], _mm512_load_si512(c0 + 16 * i), _mm512_load_si512(c12 + 32 * i),
                            _mm512_load_si512(c12 + 32 * i + 16), d, m, step[i * blocks], sum[i * blocks]);
}

// One block's exact sums of a record stream: C of a0 into tile C0, of a1 / a2 into C12, its quants in tile B (the
// inputs in tiles 1 and 2, shared by both streams). A macro: the tile intrinsics take literal register numbers.
#define AGENT_MTP_BLOCK_SUMS(kQ4, B, C0, C12) \
  do {                                        \
    _tile_zero(C0);                           \
    _tile_zero(C12);                          \
    if constexpr (kQ4) { /* unsigned quants */ \
      _tile_dpbsud(C0, 1, B);                 \
      _tile_dpbuud(C12, 2, B);                \
    } else { /* signed quants */              \
      _tile_dpbssd(C0, 1, B);                 \
      _tile_dpbusd(C12, 2, B);                \
    }                                         \
  } while (false)

// y[i, 0:16] (and y[i, 16:32] for a pair) (+)= rows r0 + i (i < kRows) of the grid against one or two record streams
// (16 features each, every block). Both streams share the block's A tiles; tiles 0-4 serve stream a, 5-7 stream b,
// so the two streams' products and scaling overlap; a Q4_1 block is unpacked one block ahead of its product.
template <bool kQ4, int kRows, bool kPair>
inline void chunk_product(const Grid& g, int64_t rows, int64_t r0, int64_t blocks, const uint8_t* rec_a,
                          const uint8_t* rec_b, float* y, int64_t ldy, bool add, __mmask16 keep_b,
                          const int64_t* out) {
  alignas(64) uint8_t quants[2][2][512];
  alignas(64) int32_t c0[2][kChunk * 16], c12[2][2 * kChunk * 16];
  __m512 acc_a[kRows], acc_b[kRows];
  for (int i = 0; i < kRows; ++i) acc_a[i] = acc_b[i] = _mm512_setzero_ps();
  constexpr int64_t record = kQ4 ? kQ41Record : kQ80Record;
  if constexpr (kQ4) {
    unpack_q4(rec_a, quants[0][0]);
    if constexpr (kPair) unpack_q4(rec_b, quants[0][1]);
  }
  const float* step = g.step.data() + r0 * blocks;
  const float* sum = g.sum.data() + r0 * blocks;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* ra = rec_a + b * record;
    const uint8_t* rb = kPair ? rec_b + b * record : nullptr;
    const int now = static_cast<int>(b & 1);
    for (int64_t line = 0; line < record; line += 64) {  // the streams' next records, a few blocks ahead
      _mm_prefetch(reinterpret_cast<const char*>(ra + kAhead * record + line), _MM_HINT_T0);
      if constexpr (kPair) _mm_prefetch(reinterpret_cast<const char*>(rb + kAhead * record + line), _MM_HINT_T0);
    }
    if constexpr (kQ4) {
      if (b + 1 < blocks) {
        unpack_q4(ra + record, quants[now ^ 1][0]);
        if constexpr (kPair) unpack_q4(rb + record, quants[now ^ 1][1]);
      }
      _tile_loadd(0, quants[now][0], 64);
      if constexpr (kPair) _tile_loadd(5, quants[now][1], 64);
    } else {
      _tile_loadd(0, ra, 64);
      if constexpr (kPair) _tile_loadd(5, rb, 64);
    }
    _tile_loadd(1, g.a0.data() + (b * rows + r0) * kBlock, kBlock);
    _tile_loadd(2, g.a12.data() + (b * rows + r0) * 2 * kBlock, kBlock);
    AGENT_MTP_BLOCK_SUMS(kQ4, 0, 3, 4);
    if constexpr (kPair) AGENT_MTP_BLOCK_SUMS(kQ4, 5, 6, 7);
    _tile_stored(3, c0[0], 64);
    _tile_stored(4, c12[0], 64);
    if constexpr (kPair) {
      _tile_stored(6, c0[1], 64);
      _tile_stored(7, c12[1], 64);
    }
    scale_into<kQ4, kRows>(acc_a, c0[0], c12[0], ra, step + b, sum + b, blocks);
    if constexpr (kPair) scale_into<kQ4, kRows>(acc_b, c0[1], c12[1], rb, step + b, sum + b, blocks);
  }
  for (int i = 0; i < kRows; ++i) {
    float* yr = y + (out != nullptr ? out[i] : i) * ldy;
    _mm512_storeu_ps(yr, add ? _mm512_add_ps(_mm512_loadu_ps(yr), acc_a[i]) : acc_a[i]);
    if constexpr (kPair) {
      const __m512 before = add ? _mm512_maskz_loadu_ps(keep_b, yr + 16) : _mm512_setzero_ps();
      _mm512_mask_storeu_ps(yr + 16, keep_b, add ? _mm512_add_ps(before, acc_b[i]) : acc_b[i]);
    }
  }
}

template <bool kQ4, bool kPair>
inline void rows_of(int chunk, const Grid& g, int64_t rows, int64_t r0, int64_t blocks, const uint8_t* ra,
                    const uint8_t* rb, float* y, int64_t ldy, bool add, __mmask16 keep, const int64_t* out) {
  switch (chunk) {
    case 8: chunk_product<kQ4, 8, kPair>(g, rows, r0, blocks, ra, rb, y, ldy, add, keep, out); break;
    case 7: chunk_product<kQ4, 7, kPair>(g, rows, r0, blocks, ra, rb, y, ldy, add, keep, out); break;
    case 6: chunk_product<kQ4, 6, kPair>(g, rows, r0, blocks, ra, rb, y, ldy, add, keep, out); break;
    case 5: chunk_product<kQ4, 5, kPair>(g, rows, r0, blocks, ra, rb, y, ldy, add, keep, out); break;
    case 4: chunk_product<kQ4, 4, kPair>(g, rows, r0, blocks, ra, rb, y, ldy, add, keep, out); break;
    case 3: chunk_product<kQ4, 3, kPair>(g, rows, r0, blocks, ra, rb, y, ldy, add, keep, out); break;
    case 2: chunk_product<kQ4, 2, kPair>(g, rows, r0, blocks, ra, rb, y, ldy, add, keep, out); break;
    default: chunk_product<kQ4, 1, kPair>(g, rows, r0, blocks, ra, rb, y, ldy, add, keep, out); break;
  }
}

// Tiles for a chunk of up to kCoarseChunk rows on the 8-bit grid alone: 0 = B (quants), 1 = A (a0 of the rows), 3 = C.
constexpr int kCoarseConfig = 16;  // ``configured`` values above this: a coarse chunk of (value - 16) rows
inline void configure_coarse(int chunk) {
  Config c;
  c.rows[0] = 8, c.colsb[0] = 64;
  c.rows[1] = chunk, c.colsb[1] = 32;
  c.rows[3] = chunk, c.colsb[3] = 64;
  _tile_loadconfig(&c);
}

// y[out[i], 0:16] (+)= grid rows r0 + i (i < kRows <= 16, every one on the 8-bit grid: a1 = a2 = 0) against one
// record stream (``keep``: the features written). One tile product and one store a block serve all of them, where an
// exact chunk takes two of each for 8 rows: on a 2-core Sapphire Rapids-class VM a tile product or store costs
// ~3-5 ns whatever its rows (coarse_chunks_pay). Scaled by scale_coarse_row (scale_row's bits for zero low sums), as
// VNNI and the exact chunks scale such a row: the same bits.
template <bool kQ4, int kRows>
inline void coarse_product(const Grid& g, int64_t rows, int64_t r0, int64_t blocks, const uint8_t* rec, float* y,
                           int64_t ldy, bool add, __mmask16 keep, const int64_t* out) {
  alignas(64) uint8_t quants[2][512];
  alignas(64) int32_t c0[2][kCoarseChunk * 16];
  __m512 acc[kRows];
  for (int i = 0; i < kRows; ++i) acc[i] = _mm512_setzero_ps();
  constexpr int64_t record = kQ4 ? kQ41Record : kQ80Record;
  if constexpr (kQ4) unpack_q4(rec, quants[0]);
  const float* step = g.step.data() + r0 * blocks;
  const float* sum = g.sum.data() + r0 * blocks;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rb = rec + b * record;
    const int now = static_cast<int>(b & 1);
    for (int64_t line = 0; line < record; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rb + kAhead * record + line), _MM_HINT_T0);
    if constexpr (kQ4) {
      if (b + 1 < blocks) unpack_q4(rb + record, quants[now ^ 1]);
      _tile_loadd(0, quants[now], 64);
    } else {
      _tile_loadd(0, rb, 64);
    }
    _tile_loadd(1, g.a0.data() + (b * rows + r0) * kBlock, kBlock);
    _tile_zero(3);
    if constexpr (kQ4) {
      _tile_dpbsud(3, 1, 0);  // signed a0 x unsigned quants
    } else {
      _tile_dpbssd(3, 1, 0);
    }
    _tile_stored(3, c0[now], 64);
    const __m512 d = record_d<kQ4>(rb), m = record_m<kQ4>(rb);
#pragma GCC unroll 16
    for (int i = 0; i < kRows; ++i)
      acc[i] = scale_coarse_row<kQ4>(acc[i], _mm512_load_si512(c0[now] + 16 * i), d, m, step[i * blocks + b],
                                     sum[i * blocks + b]);
  }
  for (int i = 0; i < kRows; ++i) {
    float* yr = y + out[i] * ldy;
    const __m512 before = add ? _mm512_maskz_loadu_ps(keep, yr) : _mm512_setzero_ps();
    _mm512_mask_storeu_ps(yr, keep, add ? _mm512_add_ps(before, acc[i]) : acc[i]);
  }
}

template <bool kQ4>
inline void coarse_rows_of(int chunk, const Grid& g, int64_t rows, int64_t r0, int64_t blocks, const uint8_t* rec,
                           float* y, int64_t ldy, bool add, __mmask16 keep, const int64_t* out) {
  switch (chunk) {
#define AGENT_MTP_COARSE_CASE(n) \
  case n: coarse_product<kQ4, n>(g, rows, r0, blocks, rec, y, ldy, add, keep, out); break;
    AGENT_MTP_COARSE_CASE(16) AGENT_MTP_COARSE_CASE(15) AGENT_MTP_COARSE_CASE(14) AGENT_MTP_COARSE_CASE(13)
    AGENT_MTP_COARSE_CASE(12) AGENT_MTP_COARSE_CASE(11) AGENT_MTP_COARSE_CASE(10) AGENT_MTP_COARSE_CASE(9)
    AGENT_MTP_COARSE_CASE(8) AGENT_MTP_COARSE_CASE(7) AGENT_MTP_COARSE_CASE(6) AGENT_MTP_COARSE_CASE(5)
    AGENT_MTP_COARSE_CASE(4) AGENT_MTP_COARSE_CASE(3) AGENT_MTP_COARSE_CASE(2)
    default: coarse_product<kQ4, 1>(g, rows, r0, blocks, rec, y, ldy, add, keep, out); break;
#undef AGENT_MTP_COARSE_CASE
  }
}

// Outputs f0..f0 + features (1-32: one record stream, or two side by side) for every row; ``configured``: what the
// calling thread's tiles are configured for (0: nothing yet; 1-8: an exact chunk of that many rows; above
// kCoarseConfig: a coarse chunk). Where the grid is ordered, its exact rows take the exact chunks and its 8-bit rows
// the coarse ones, each writing the pass's own rows of y.
// ``exact_end``: the exact rows [exact_end, g.exact) are left to the caller (VNNI, tile_rows_of), else g.exact.
template <bool kQ4>
void records_product(const Grid& g, int64_t rows, int64_t blocks, const uint8_t* rec, int64_t stride, float* y,
                     int64_t ldy, bool add, int64_t features, int& configured, int64_t exact_end) {
  const bool pair = features > kFeatures;
  const int64_t last = pair ? features - kFeatures : features;
  const __mmask16 keep = static_cast<__mmask16>((1u << last) - 1u);
  const int64_t* order = g.order.empty() ? nullptr : g.order.data();
  for (int64_t r0 = 0; r0 < exact_end; r0 += kChunk) {
    const int chunk = static_cast<int>(std::min<int64_t>(kChunk, exact_end - r0));
    if (chunk != configured) configure(configured = chunk);
    float* yc = order != nullptr ? y : y + r0 * ldy;  // with an order, rows are placed through it
    const int64_t* out = order != nullptr ? order + r0 : nullptr;
    if (pair) {
      rows_of<kQ4, true>(chunk, g, rows, r0, blocks, rec, rec + stride, yc, ldy, add, keep, out);
    } else if (last == kFeatures) {
      rows_of<kQ4, false>(chunk, g, rows, r0, blocks, rec, nullptr, yc, ldy, add, keep, out);
    } else {  // a last partial record: its first ``last`` outputs
      alignas(64) float part[kChunk * kFeatures];
      rows_of<kQ4, false>(chunk, g, rows, r0, blocks, rec, nullptr, part, kFeatures, false, keep, nullptr);
      for (int i = 0; i < chunk; ++i) {
        float* yr = y + g.row_of(r0 + i) * ldy;
        for (int64_t f = 0; f < last; ++f) yr[f] = add ? yr[f] + part[i * kFeatures + f] : part[i * kFeatures + f];
      }
    }
  }
  for (int64_t r0 = g.exact; r0 < rows; r0 += kCoarseChunk) {  // the 8-bit rows of an ordered grid
    const int chunk = static_cast<int>(std::min<int64_t>(kCoarseChunk, rows - r0));
    if (configured != kCoarseConfig + chunk) {
      configured = kCoarseConfig + chunk;
      configure_coarse(chunk);
    }
    coarse_rows_of<kQ4>(chunk, g, rows, r0, blocks, rec, y, ldy, add, pair ? __mmask16{0xFFFF} : keep, order + r0);
    if (pair) coarse_rows_of<kQ4>(chunk, g, rows, r0, blocks, rec + stride, y + kFeatures, ldy, add, keep, order + r0);
  }
}

#undef AGENT_MTP_BLOCK_SUMS

inline void release() { _tile_release(); }

}  // namespace tiles

// ---- VNNI (AVX-512 VNNI and VBMI without AMX: Zen 4, Ice Lake) ------------------------------------------------------
// The same record streams and the same grid as the tiles, multiplied with vpdpbusd (16 int32 lanes, each adding four
// unsigned x signed byte products): a record block's tile row t (16 features x inputs 4t..4t+3) is one register,
// multiplied by a broadcast of the row's four grid bytes there. The sums are the tiles' exact integers (Q8_0's signed
// quants against the signed a0: (a0 + 128) x q minus 128 x sum(q)), scaled by the tiles' own code, so the numbers are
// the tiles' bit for bit. Against the AVX kernels a block needs no weight rebuilt in float32: ~40 instructions per
// 512 weights and row instead of ~130, which the one-token pass was bound by. Serves every pass size (in chunks of
// up to 16 rows), so a row's numbers never depend on the pass.
namespace vnni {

// Rows per pass over a record stream (its 8 quant registers feed them all), at most: a pass of more rows is split
// into chunks as equal as can be. Each row's sums and scaling are its own, so the chunking never changes a bit. Chunks
// of up to 8 made a pass of 9 rows one of 8 and one of 1, the lone row at a one-row pass's latency-bound rate (~50
// cycles a record block on Zen 5, against ~16 a row at 8-16 rows, measured in a standalone copy of the kernel; its
// stream was still in the core's cache); 12 and 16 rows a chunk cost a row what 8 do (AVX-512 has 32 registers: 16
// sums, 8 quant registers and a row's 6 product chains, a few spills). Whole passes of 9 / 10 / 12 rows took 0.96x /
// 0.97x / 0.98x the time on a 2-core Zen 5, 8 and 14-16 rows the same.
constexpr int kChunk = 16;
// The largest chunk passes take (kChunk; 8 keeps the chunks of before, for comparisons: vnni_chunk below).
std::atomic<int64_t> g_vnni_chunk{kChunk};
// Blocks a record stream is prefetched ahead of its product (into L1; the last ones fetch the next stream's start,
// which is contiguous). Short passes are bound by memory: on a 2-core Emerald Rapids VM 1-2-row passes took
// 0.88-0.94x the time with 8 blocks ahead instead of the tiles' 4; 12 blocks, or 4 plus an L2 prefetch 24 ahead,
// did as well as 8.
constexpr int64_t kAhead = 8;

inline __m512i broadcast4(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

// acc + the unsigned bytes of ``u8`` times the four signed bytes at ``p`` in every lane: vpdpbusd with its memory
// operand broadcast ({1to16}), one instruction where a separate broadcast and product took two (GCC 12 does not fold
// _mm512_set1_epi32 of a load into it). Only the signed operand can come from memory.
inline __m512i dpbusd_broadcast(__m512i acc, __m512i u8, const uint8_t* p) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u8), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// y[i, 0:16] (+)= rows r0 + i (i < R) of the grid against one record stream (16 features; ``keep``: the features
// written). Each row's sums are scaled as soon as they are made (tiles::scale_row, as the tiles scale them), and a
// Q4_1 row's a0 bytes are read by the products themselves (dpbusd_broadcast): an exact row costs a block 24
// products, 16 broadcasts (loads) and its scaling, a draft-only (8-bit) row 8 products and its scaling. The rows are
// unrolled and each sum is made in two registers (even and odd quant registers, added at the end: integers, so the
// same sums) so that the products are six short chains instead of three of eight: on a 2-core Emerald Rapids VM,
// where 512-bit products issue on two ports at a latency of ~5 cycles, 4-16-row passes took 0.88-0.94x the time of
// the one-register chains (same bits).
template <bool kQ4, int R>
inline void stream_product(const tiles::Grid& g, int64_t rows, int64_t r0, int64_t blocks, const uint8_t* rec,
                           float* y, int64_t ldy, bool add, __mmask16 keep) {
  constexpr int64_t record = kQ4 ? tiles::kQ41Record : tiles::kQ80Record;
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i ones = _mm512_set1_epi8(1), zero = _mm512_setzero_si512();
  const float* step = g.step.data() + r0 * blocks;
  const float* sum = g.sum.data() + r0 * blocks;
  const bool sixteen = g.low_bytes == 1;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rb = rec + b * record;
    for (int64_t line = 0; line < record; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rb + kAhead * record + line), _MM_HINT_T0);
    __m512i w[8];
    __m512i qsum = zero;
    if constexpr (kQ4) {
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(rb + 64 * c);
        w[2 * c] = _mm512_and_si512(v, low);
        w[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    } else {
      for (int t = 0; t < 8; ++t) {
        w[t] = _mm512_loadu_si512(rb + 64 * t);
        qsum = _mm512_dpbusd_epi32(qsum, ones, w[t]);
      }
    }
    const __m512 d = tiles::record_d<kQ4>(rb), m = tiles::record_m<kQ4>(rb);
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const uint8_t* a0 = reinterpret_cast<const uint8_t*>(g.a0.data()) + (b * rows + r0 + i) * kBlock;
      const uint8_t* a1 = g.a12.data() + (b * rows + r0 + i) * 2 * kBlock;
      const uint8_t* a2 = a1 + kBlock;
      __m512i s0[2] = {zero, zero}, s1[2] = {zero, zero}, s2[2] = {zero, zero};
      const bool coarse = g.coarse_row(r0 + i);  // on the 8-bit grid: a1 = a2 = 0, one product per register
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        if constexpr (kQ4)
          s0[t % 2] = dpbusd_broadcast(s0[t % 2], w[t], a0 + 4 * t);  // unsigned quants x signed a0
        else  // (a0 + 128) x q
          s0[t % 2] = _mm512_dpbusd_epi32(s0[t % 2], _mm512_xor_si512(broadcast4(a0 + 4 * t), flip), w[t]);
      }
      if (!coarse && sixteen) {  // a 16-bit grid: a2 = 0, its products left out (the same sums)
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) s1[t % 2] = _mm512_dpbusd_epi32(s1[t % 2], broadcast4(a1 + 4 * t), w[t]);
      } else if (!coarse) {
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) {
          s1[t % 2] = _mm512_dpbusd_epi32(s1[t % 2], broadcast4(a1 + 4 * t), w[t]);
          s2[t % 2] = _mm512_dpbusd_epi32(s2[t % 2], broadcast4(a2 + 4 * t), w[t]);
        }
      }
      __m512i c0 = _mm512_add_epi32(s0[0], s0[1]);
      if constexpr (!kQ4) c0 = _mm512_sub_epi32(c0, _mm512_slli_epi32(qsum, 7));
      if (coarse)
        acc[i] = tiles::scale_coarse_row<kQ4>(acc[i], c0, d, m, step[i * blocks + b], sum[i * blocks + b]);
      else
        acc[i] = tiles::scale_row<kQ4>(acc[i], c0, _mm512_add_epi32(s1[0], s1[1]), _mm512_add_epi32(s2[0], s2[1]), d,
                                       m, step[i * blocks + b], sum[i * blocks + b]);
    }
  }
  for (int i = 0; i < R; ++i) {
    float* yr = y + i * ldy;
    const __m512 before = add ? _mm512_maskz_loadu_ps(keep, yr) : _mm512_setzero_ps();
    _mm512_mask_storeu_ps(yr, keep, add ? _mm512_add_ps(before, acc[i]) : acc[i]);
  }
}

// Outputs f0..f0 + features (1-32: one record stream, or two side by side) for the rows [first_row, rows), as
// tiles::records_product (first_row > 0: an exact tile pass's short last chunk beside the tiles' full ones,
// tile_rows_of; the grid in the pass's order).
template <bool kQ4>
void records_product(const tiles::Grid& g, int64_t rows, int64_t blocks, const uint8_t* rec, int64_t stride,
                     float* y, int64_t ldy, bool add, int64_t features, int64_t first_row = 0) {
  for (int64_t s = 0; s * tiles::kFeatures < features; ++s) {
    const int64_t last = std::min<int64_t>(tiles::kFeatures, features - s * tiles::kFeatures);
    const __mmask16 keep = static_cast<__mmask16>((1u << last) - 1u);
    const uint8_t* stream = rec + s * stride;
    float* ys = y + s * tiles::kFeatures;
    const int64_t left = rows - first_row, most = g_vnni_chunk.load(std::memory_order_relaxed);
    const int64_t chunks = (left + most - 1) / most;
    for (int64_t c = 0, r0 = first_row; c < chunks; ++c) {
      const int64_t size = left / chunks + (c < left % chunks ? 1 : 0);  // as equal as can be, larger ones first
      switch (size) {
#define AGENT_MTP_STREAM_CASE(R) \
  case R: stream_product<kQ4, R>(g, rows, r0, blocks, stream, ys + r0 * ldy, ldy, add, keep); break;
        AGENT_MTP_STREAM_CASE(16) AGENT_MTP_STREAM_CASE(15) AGENT_MTP_STREAM_CASE(14) AGENT_MTP_STREAM_CASE(13)
        AGENT_MTP_STREAM_CASE(12) AGENT_MTP_STREAM_CASE(11) AGENT_MTP_STREAM_CASE(10) AGENT_MTP_STREAM_CASE(9)
#undef AGENT_MTP_STREAM_CASE
        case 8: stream_product<kQ4, 8>(g, rows, r0, blocks, stream, ys + r0 * ldy, ldy, add, keep); break;
        case 7: stream_product<kQ4, 7>(g, rows, r0, blocks, stream, ys + r0 * ldy, ldy, add, keep); break;
        case 6: stream_product<kQ4, 6>(g, rows, r0, blocks, stream, ys + r0 * ldy, ldy, add, keep); break;
        case 5: stream_product<kQ4, 5>(g, rows, r0, blocks, stream, ys + r0 * ldy, ldy, add, keep); break;
        case 4: stream_product<kQ4, 4>(g, rows, r0, blocks, stream, ys + r0 * ldy, ldy, add, keep); break;
        case 3: stream_product<kQ4, 3>(g, rows, r0, blocks, stream, ys + r0 * ldy, ldy, add, keep); break;
        case 2: stream_product<kQ4, 2>(g, rows, r0, blocks, stream, ys + r0 * ldy, ldy, add, keep); break;
        default: stream_product<kQ4, 1>(g, rows, r0, blocks, stream, ys + r0 * ldy, ldy, add, keep); break;
      }
      r0 += size;
    }
  }
}

}  // namespace vnni

// ---- greedy rows of the output head screened on the 8-bit grid -----------------------------------------------------
// A greedy row reads only the argmax of its logits, and at 8 rows and more the Q8_0 head's exact rows (three byte
// products per weight) cost a pass ~1-2 ms more than rows on the 8-bit grid (one). A screened row is multiplied on the
// 8-bit grid, then every output f's distance from its exact value is bounded:
//   |exact_f - coarse_f| <= sum_b W[f, b] e_b + margin,
// W[f, b] = |d_fb| sum_i |q_fbi| (the block's absolute weight, precomputed and rounded up), e_b the largest rounding
// of an input of block b onto the 8-bit grid (half a step, with slack) and the margin ~2^-12 of sum_b max_f W[f, b]
// peak_b, far above the float rounding of either product and the 24-bit grid's own rounding. The outputs whose upper
// bound reaches the best lower bound are then recomputed exactly: their whole record stream of 16 outputs on the
// row's exact grid, with the exact product's own kernel (stream_product), so the same bits. An output left coarse is
// below its upper bound, below the best lower bound, at most an exact recomputed output: the row's first maximum is
// the exact product's. Prefilter: any output whose upper bound reaches the best lower bound has a coarse value of at
// least the largest coarse value less twice the loose bound (every W[f, b] at its largest) and twice the margin, so
// only those read the bound table. On the agent prompts' rows a median of 4 outputs (at most ~120) were candidates.
namespace screen {

// Row r of a pass: ``yr`` its coarse outputs (width ``width`` of records; outputs [0, valid) are logits), ``xr`` its
// (normalised) inputs [k], ``exact`` the pass's exact grid (every row), ``tp`` the records, ``bounds`` [>= valid,
// blocks] and ``peak_bounds`` [blocks] (the largest W[f, b] per block), ``excluded`` outputs (float32 exception rows,
// overwritten by the caller) never candidates. Returns how many record streams were recomputed.
int64_t row(const tiles::Grid& exact, int64_t rows, int64_t r, const float* xr, int64_t k, const uint8_t* tp,
            int64_t width, int64_t valid, const float* bounds, const float* peak_bounds, const int64_t* excluded,
            int64_t excluded_count, float* yr) {
  const int64_t blocks = k / kBlock;
  constexpr int64_t record = tiles::kQ80Record;
  const int64_t streams = (width + tiles::kFeatures - 1) / tiles::kFeatures;
  const auto recompute = [&](int64_t s) {
    const int64_t f0 = s * tiles::kFeatures, last = std::min<int64_t>(tiles::kFeatures, width - f0);
    const __mmask16 keep = static_cast<__mmask16>((1u << last) - 1u);
    vnni::stream_product<false, 1>(exact, rows, r, blocks, tp + s * blocks * record, yr + f0, 0, false, keep);
  };
  const auto recompute_all = [&] {
    for (int64_t s = 0; s < streams; ++s) recompute(s);
    return streams;
  };
  static thread_local std::vector<double> e;
  e.assign(static_cast<size_t>(blocks), 0.0);
  double loose = 0.0, margin = 0.0;
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  const __m512 infinity = _mm512_set1_ps(INFINITY);
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = xr + b * kBlock;
    const __m512 v0 = _mm512_and_ps(_mm512_loadu_ps(xb), abs_mask), v1 = _mm512_and_ps(_mm512_loadu_ps(xb + 16), abs_mask);
    // a NaN or an infinity (|x| not below infinity; max would drop a NaN): no bound, the row is computed exactly
    if ((_mm512_cmp_ps_mask(v0, infinity, _CMP_NLT_UQ) | _mm512_cmp_ps_mask(v1, infinity, _CMP_NLT_UQ)) != 0)
      return recompute_all();
    const double peak = _mm512_reduce_max_ps(_mm512_max_ps(v0, v1));
    // a block so small that 127 / peak overflows float32 is put on no 8-bit grid the bound describes
    if (peak > 0.0 && peak < 1e-35) return recompute_all();
    e[b] = peak * (0.5 / 127.0) * (1.0 + 1.0 / 1024.0);
    loose += static_cast<double>(peak_bounds[b]) * e[b];
    margin += static_cast<double>(peak_bounds[b]) * peak;
  }
  margin = margin * 0x1p-12 + 1e-30;
  for (int64_t i = 0; i < excluded_count; ++i)
    if (excluded[i] < valid) yr[excluded[i]] = -INFINITY;
  // One pass over the outputs: the largest so far, and every output within reach of it (2 loose bounds and margins
  // below; the reach only rises), kept for the bounds below. The largest output at the end is among them.
  const double reach = 2.0 * loose + 2.0 * margin;
  static thread_local std::vector<int64_t> near;
  near.clear();
  float best = -INFINITY;
  __m512 best_v = _mm512_set1_ps(-INFINITY), floor_v = best_v;
  const auto raise = [&](float value) {
    best = value;
    best_v = _mm512_set1_ps(best);
    // rounded down: the float compare keeps every output the exact (double) floor keeps
    floor_v = _mm512_set1_ps(std::nextafter(static_cast<float>(static_cast<double>(best) - reach), -INFINITY));
  };
  int64_t f = 0;
  for (; f + 16 <= valid; f += 16) {
    const __m512 v = _mm512_loadu_ps(yr + f);
    uint32_t reached = _mm512_cmp_ps_mask(v, floor_v, _CMP_GE_OQ);
    if (reached == 0) continue;
    if (_mm512_cmp_ps_mask(v, best_v, _CMP_GT_OQ) != 0) raise(_mm512_reduce_max_ps(v));
    for (reached = _mm512_cmp_ps_mask(v, floor_v, _CMP_GE_OQ); reached != 0; reached &= reached - 1)
      near.push_back(f + __builtin_ctz(reached));
  }
  for (; f < valid; ++f) {
    if (yr[f] > best) raise(yr[f]);
    if (static_cast<double>(yr[f]) >= static_cast<double>(best) - reach) near.push_back(f);  // (best only rises)
  }
  if (!std::isfinite(best) || !std::isfinite(loose)) return recompute_all();
  // each output within reach of the final largest: its own bound; the best lower bound
  const double floor = static_cast<double>(best) - reach;
  static thread_local std::vector<std::pair<int64_t, double>> upper;
  upper.clear();
  double lower = -INFINITY;
  for (const int64_t g : near) {
    const double c = yr[g];
    if (c < floor) continue;
    const float* w = bounds + g * blocks;
    double bound = margin;
    for (int64_t b = 0; b < blocks; ++b) bound += static_cast<double>(w[b]) * e[b];
    lower = std::max(lower, c - bound);
    upper.emplace_back(g, c + bound);
  }
  // the record streams of the outputs whose upper bound reaches it, fetched together, then recomputed in order
  static thread_local std::vector<int64_t> chosen;
  chosen.clear();
  for (const auto& [g, high] : upper) {  // ascending outputs
    const int64_t s = g / tiles::kFeatures;
    if (high >= lower && (chosen.empty() || chosen.back() != s)) chosen.push_back(s);
  }
  for (const int64_t s : chosen) {
    const uint8_t* rec = tp + s * blocks * record;
    for (int64_t line = 0; line < std::min<int64_t>(vnni::kAhead, blocks) * record; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rec + line), _MM_HINT_T0);
  }
  for (const int64_t s : chosen) recompute(s);
  const int64_t done = static_cast<int64_t>(chosen.size());
  return done;
}

}  // namespace screen
#pragma GCC pop_options

// Whether this process may use AMX-INT8 tiles: the CPU has them (CPUID leaf 7: AMX-TILE, AMX-INT8), the OS saves
// their state (XCR0 bits 17-18), and Linux granted this process the tile data (arch_prctl ARCH_REQ_XCOMP_PERM).
bool amx_supported() {
  static const bool supported = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_max(0, nullptr) < 7) return false;
    __cpuid_count(7, 0, a, b, c, d);
    if (!((d >> 24) & 1) || !((d >> 25) & 1)) return false;
    __cpuid(1, a, b, c, d);
    if (!((c >> 27) & 1)) return false;  // OSXSAVE
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if (((lo >> 17) & 3) != 3) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return supported;
}

std::atomic<bool> g_tiles{false};  // set at load (below): AMX tiles for passes that have a tile layout (records_path)

// request 1: use the tiles where the CPU has them, 0: not, -1: leave as is. Returns whether they are in use.
bool amx_tiles(int64_t request) {
  TORCH_CHECK(request >= -1 && request <= 1, "amx_tiles takes -1 (leave as is), 0 or 1, got ", request);
  if (request >= 0) g_tiles = request == 1 && amx_supported();
  return g_tiles.load();
}

// Whether the CPU has what the VNNI record kernels use (the AVX-512 forms' F/BW/DQ/VL/VBMI, VNNI, F16C).
bool vnni_supported() {
  __builtin_cpu_init();
  return cpu_has_avx512() && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
}

std::atomic<bool> g_vnni{false};  // set at load (below): VNNI for block passes that have a record layout

// request 1: multiply block passes on VNNI where the weights have records (and AMX is not in use), 0: not, -1: leave
// as is. Returns whether VNNI is in use.
bool vnni_records(int64_t request) {
  TORCH_CHECK(request >= -1 && request <= 1, "vnni_records takes -1 (leave as is), 0 or 1, got ", request);
  if (request >= 0) g_vnni = request == 1 && vnni_supported();
  return g_vnni.load();
}

// Where both record paths serve (AMX on, VNNI on), the pass weight from which the tiles take over. A tile product
// costs about the same for 1-8 rows of any kind, while VNNI's cost grows with the rows: three byte products per
// weight for an exact row, one for a row on the 8-bit grid (plus the scaling both share). So short passes are cheaper
// on VNNI (a 2-core Sapphire-Rapids-class VM: one row 8.3 ms of products against 12.2 on the tiles), long exact ones
// on the tiles, and a draft-only row weighs less than an exact one. Weights in 1/1024 of an exact row: a pass weighs
// 1024 per exact row plus g_light_weight per 8-bit row; 0: the tiles serve every pass. Both paths give the same
// bits, so the choice never changes a number.
constexpr int64_t kRowWeight = 1024;
std::atomic<int64_t> g_tiles_from{0};
std::atomic<int64_t> g_light_weight{kRowWeight};

// Set (request >= 0) or read (-1) the pass weight from which the tiles serve and an 8-bit row's weight (both in
// 1/1024 of an exact row). Returns [tiles_from, light_weight].
std::vector<int64_t> tiles_from(int64_t weight, int64_t light_weight) {
  TORCH_CHECK(weight >= -1 && light_weight >= -1, "tiles_from takes -1 (leave as is) or weights >= 0, got ", weight,
              " and ", light_weight);
  if (weight >= 0) g_tiles_from = weight;
  if (light_weight >= 0) g_light_weight = light_weight;
  return {g_tiles_from.load(), g_light_weight.load()};
}

// Where the tiles serve a pass and VNNI is on: an exact pass's last partial chunk of at most this many rows is
// multiplied on VNNI beside the tiles' full chunks of 8 (the same bits). A tile chunk's cost counts blocks, not rows
// (~8 tile loads, products and stores a block, each ~3-5 ns), so a 9th row cost a whole second chunk: on a 2-core
// Sapphire-Rapids-class VM 8 sequences x 1 row took 20.0 ms a pass and one more row 25.3 ms, while VNNI's cost grows
// with its rows (a VNNI row ~27% of an 8-row tile chunk, perf). 0: the tiles take every row; the Python side sets
// blockq.VNNI_TAIL_ROWS at load.
std::atomic<int64_t> g_tail_rows{2};

// Set (request >= 0, at most 8) or read (-1) g_tail_rows.
int64_t tail_rows(int64_t request) {
  TORCH_CHECK(request >= -1 && request <= 8, "tail_rows takes -1 (leave as is) or 0-8 rows, got ", request);
  if (request >= 0) g_tail_rows = request;
  return g_tail_rows.load();
}

// The exact rows the tiles multiply in a tile pass over ``g`` (the rest, a short last chunk, on VNNI): all of them
// where VNNI is off, the grid is reordered (draft rows in coarse chunks after the exact ones) or there is no full
// chunk before the tail.
inline int64_t tile_rows_of(const tiles::Grid& g) {
  const int64_t tail = g.exact % tiles::kChunk;
  if (tail == 0 || g.exact < tiles::kChunk || !g.order.empty() || tail > g_tail_rows.load(std::memory_order_relaxed) ||
      !g_vnni.load(std::memory_order_relaxed))
    return g.exact;
  return g.exact - tail;
}

enum class Records { kNone = 0, kVnni = 1, kTiles = 2 };

// Which record path multiplies a pass of ``rows`` rows, ``light`` of them on the 8-bit grid, for weights with a
// record layout: AMX tiles, or VNNI where the tiles are off or the pass weighs less than g_tiles_from; none (the AVX
// kernels) where both are off.
inline Records records_path(int64_t rows, int64_t light) {
  const bool vnni = g_vnni.load(std::memory_order_relaxed);
  const int64_t weight = kRowWeight * (rows - light) + g_light_weight.load(std::memory_order_relaxed) * light;
  if (g_tiles.load(std::memory_order_relaxed) && (!vnni || weight >= g_tiles_from.load(std::memory_order_relaxed)))
    return Records::kTiles;
  return vnni ? Records::kVnni : Records::kNone;
}

// records_path for a pass whose 8-bit rows are flagged in ``coarse`` (or none).
Records records_path(int64_t rows, const uint8_t* coarse) { return records_path(rows, light_rows(coarse, rows)); }

// records_path as an op (0: none, 1: VNNI, 2: tiles), for tests and benchmarks.
int64_t records_path_of(int64_t rows, int64_t light) {
  TORCH_CHECK(rows >= 1 && 0 <= light && light <= rows, "records_path needs rows >= 1 and 0 <= light <= rows, got ",
              rows, " and ", light);
  return static_cast<int64_t>(records_path(rows, light));
}

// y[r, e] = dot(x[r], dense[e]) for float32 rows e in [e0, e1) (a few, e.g. an adapter's low-rank factor).
void dense_rows(const float* x, int64_t rows, int64_t k, const float* dense, int64_t e0, int64_t e1, float* y,
                int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t e = e0; e < e1; ++e) {
      const float* w = dense + e * k;
      const float* xr = x + r * k;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
      for (int64_t i = 0; i < k; i += kBlock) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(w + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + i + 8), _mm256_loadu_ps(w + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + i + 16), _mm256_loadu_ps(w + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + i + 24), _mm256_loadu_ps(w + i + 24), a3);
      }
      y[r * ldy + e] = lane_sum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    }
}

// h = rms_norm(x) * weight, row by row: (x * (1 / sqrt(mean(x^2) + eps))) * weight, as torch's rms_norm orders it.
// Into storage this thread keeps from call to call (as on_grid's), valid until its next call.
const float* rms_normed(const float* xp, int64_t rows, int64_t k, const float* w, double eps) {
  static thread_local std::vector<float> h;
  h.resize(static_cast<size_t>(rows * k));
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + r * k;
    float* hr = h.data() + r * k;
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) {
      const __m256 a = _mm256_loadu_ps(xr + i), b = _mm256_loadu_ps(xr + i + 8);
      s0 = _mm256_fmadd_ps(a, a, s0);
      s1 = _mm256_fmadd_ps(b, b, s1);
    }
    const float mean = lane_sum(_mm256_add_ps(s0, s1)) / static_cast<float>(k);
    const __m256 inv = _mm256_set1_ps(1.0f / std::sqrt(mean + static_cast<float>(eps)));
    for (int64_t i = 0; i < k; i += 8)
      _mm256_storeu_ps(hr + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), inv), _mm256_loadu_ps(w + i)));
  }
  return h.data();
}

// A block-quantized projection's weights as checked raw pointers: what grouped_linear's tensors give on each call,
// or what a LayerStack checks once at load, so that a pass reads no tensor's metadata per projection (between the
// parallel products a pass's serial code finds its data cold: the products stream ~100 MB through the caches).
struct BlockView {
  const uint8_t* qs = nullptr;
  const float* scale = nullptr;
  const float* minimum = nullptr;   // Q4_1's block minimums, else null
  int64_t out_features = 0, k = 0;
  const float* dense = nullptr;     // float32 extra rows [extra, k] (an adapter's A), or null
  int64_t extra = 0;
  const float* norm = nullptr;      // RMS norm weight [k]: the rows multiplied are rms_norm(x) * norm
  const uint8_t* lanes = nullptr;   // the quants in the lane kernels' layout, or null
  const uint8_t* tiles = nullptr;   // the records' layout (AMX, VNNI), or null
};

// The checks grouped_linear made on every call, once: ``k`` input features, the layouts' sizes for kind L.
template <class L>
BlockView block_view(const at::Tensor& qs, const at::Tensor& scale, const float* minimum, int64_t k,
                     const std::optional<at::Tensor>& dense, const std::optional<at::Tensor>& norm,
                     const std::optional<at::Tensor>& lanes, const std::optional<at::Tensor>& tiles) {
  TORCH_CHECK(k > 0 && k % kBlock == 0, "in_features must be a positive multiple of 32, got ", k);
  const int64_t blocks = k / kBlock;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() % blocks == 0,
              "scale must be a contiguous float32 [out, in / 32] tensor");
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous(), "qs must be a contiguous uint8 tensor");
  BlockView w;
  w.qs = qs.data_ptr<uint8_t>();
  w.scale = scale.data_ptr<float>();
  w.minimum = minimum;
  w.k = k;
  w.out_features = scale.numel() / blocks;
  if (dense.has_value() && dense->numel() > 0) {
    TORCH_CHECK(dense->dim() == 2 && dense->size(1) == k && dense->scalar_type() == at::kFloat &&
                    dense->is_contiguous(),
                "extra rows must be a contiguous float32 [r, in_features] tensor");
    w.dense = dense->data_ptr<float>();
    w.extra = dense->size(0);
  }
  if (norm.has_value()) {
    TORCH_CHECK(norm->scalar_type() == at::kFloat && norm->is_contiguous() && norm->numel() == k,
                "norm weight must be a contiguous float32 [in_features] tensor");
    w.norm = norm->data_ptr<float>();
  }
  const int64_t groups = w.out_features / kGroup;
  if (lanes.has_value()) {
    TORCH_CHECK(lanes->scalar_type() == at::kByte && lanes->is_contiguous() &&
                    lanes->numel() == groups * blocks * kBlock * L::kBytes,
                "lanes must be a contiguous uint8 [out / 8, in / 32 * ", kBlock * L::kBytes, "] tensor");
    w.lanes = lanes->data_ptr<uint8_t>();
  }
  if (tiles.has_value()) {
    const int64_t records = (w.out_features + tiles::kFeatures - 1) / tiles::kFeatures;
    const int64_t record = L::kBytes == 4 ? tiles::kQ41Record : tiles::kQ80Record;
    TORCH_CHECK(tiles->scalar_type() == at::kByte && tiles->is_contiguous() &&
                    tiles->numel() == records * blocks * record,
                "tiles must be a contiguous uint8 [ceil(out / 16), in / 32 * ", record, "] tensor");
    w.tiles = tiles->data_ptr<uint8_t>();
  }
  return w;
}

// The products of ``rows`` rows of x [rows, k] (contiguous) with the view's block rows, into op (row stride ldo;
// added into it with ``add``), and with its extra rows into ep (row stride lde). ``bytes_per_block``: 16 (Q4_1) or
// 32 (Q8_0) bytes of quants.
template <template <int, int> class K, class L>
void grouped_product(const float* x, int64_t rows, const BlockView& w, int64_t bytes_per_block, double eps,
                     float* op, int64_t ldo, bool add, float* ep, int64_t lde, const uint8_t* coarse,
                     int64_t grid_bits) {
  const int64_t k = w.k, blocks = k / kBlock, out_features = w.out_features, extra = w.extra;
  // With a norm weight, the rows multiplied are rms_norm(x) * norm (one call instead of a norm op and a product).
  const float* xp = w.norm != nullptr ? rms_normed(x, rows, k, w.norm, eps) : x;
  const uint8_t* q = w.qs;
  const float* d = w.scale;
  const float* minimum = w.minimum;
  const float* dp = w.dense;
  const int64_t groups = out_features / kGroup;
  const bool by_lanes = w.lanes != nullptr && rows >= L::kLaneRows;
  const uint8_t* lw = by_lanes ? w.lanes : nullptr;
  constexpr bool q4 = L::kBytes == 4;
  using WideLanes = std::conditional_t<q4, wide::Q41Lanes, wide::Q80Lanes>;
  const bool wide_path = by_lanes ? wide_lanes_on() : wide_rows_on();
  // The wide lane kernels take two groups per task (a last odd group takes the AVX2 one: the same numbers).
  // AMX tiles, or VNNI where those are off or the pass is light enough that VNNI is cheaper (the same bits)
  const Records path = w.tiles != nullptr ? records_path(rows, coarse) : Records::kNone;
  const bool on_tiles = path == Records::kTiles, on_vnni = path == Records::kVnni;
  if (on_tiles || on_vnni) {
    // AMX (or VNNI): one task per two record streams of 16 features (a last partial one keeps its first features),
    // then the float32 extra rows.
    const int64_t records = (out_features + tiles::kFeatures - 1) / tiles::kFeatures;
    const int64_t record = q4 ? tiles::kQ41Record : tiles::kQ80Record;
    const tiles::Grid& grid = tiles::on_grid(xp, rows, k, coarse, on_tiles, grid_bits);
    const int64_t tile_end = on_tiles ? tile_rows_of(grid) : 0;
    const uint8_t* tp = w.tiles;
    const int64_t pairs = (records + 1) / 2;  // a task multiplies two record streams (32 features)
    const int64_t dense_tasks = (extra + kGroup - 1) / kGroup, early = dense_tasks / 2;
    // The float32 extra rows' tasks are slower per output: half come first and half last, so that the threads'
    // contiguous shares of the range stay even.
    shared_for<int>(pairs + dense_tasks, [&](int64_t begin, int64_t end, int& configured) {
      for (int64_t slot = begin; slot < end; ++slot) {
        const bool dense_task = slot < early || slot >= early + pairs;
        const int64_t task = dense_task ? (slot < early ? slot : slot - pairs) : slot - early;
        if (dense_task) {
          const int64_t e0 = task * kGroup;
          dense_rows(xp, rows, k, dp, e0, std::min(e0 + kGroup, extra), ep, lde);
          continue;
        }
        const int64_t f0 = task * 2 * tiles::kFeatures, features = std::min(2 * tiles::kFeatures, out_features - f0);
        const uint8_t* streams = tp + 2 * task * blocks * record;
        if (on_vnni)
          vnni::records_product<q4>(grid, rows, blocks, streams, blocks * record, op + f0, ldo, add, features);
        else {
          tiles::records_product<q4>(grid, rows, blocks, streams, blocks * record, op + f0, ldo, add, features,
                                     configured, tile_end);
          if (tile_end < grid.exact)
            vnni::records_product<q4>(grid, rows, blocks, streams, blocks * record, op + f0, ldo, add, features,
                                      tile_end);
        }
      }
    }, [](int configured) {
      if (configured != 0) tiles::release();
    });
    return;
  }
  const bool buffered = by_lanes && !wide_path && rows >= g_buffered_rows.load(std::memory_order_relaxed);
  const int64_t per_task = !by_lanes ? 1 : wide_path ? 2 : buffered ? kBufferedGroups : lane_task_groups(rows);
  const int64_t block_tasks = (groups + per_task - 1) / per_task;
  const int64_t dense_tasks = (extra + kGroup - 1) / kGroup, early = dense_tasks / 2;
  // As on the records' path: the float32 extra rows' tasks (~5x a block task's bytes) half first and half last, so
  // that the threads' contiguous shares stay even.
  shared_for<int>(block_tasks + dense_tasks, [&](int64_t begin, int64_t end, int&) {
    for (int64_t slot = begin; slot < end; ++slot) {
      if (slot < early || slot >= early + block_tasks) {
        const int64_t e0 = (slot < early ? slot : slot - block_tasks) * kGroup;
        dense_rows(xp, rows, k, dp, e0, std::min(e0 + kGroup, extra), ep, lde);
        continue;
      }
      const int64_t task = slot - early;
      const int64_t g = task * per_task;
      const uint8_t* qg = q + g * blocks * kGroup * bytes_per_block;
      const float* dg = d + g * blocks * kGroup;
      const float* mg = minimum != nullptr ? minimum + g * blocks * kGroup : nullptr;
      float* og = op + g * kGroup;
      const int64_t lane_stride = blocks * kBlock * L::kBytes, scale_stride = blocks * kGroup;
      if (by_lanes && wide_path && g + 1 < groups) {
        wide::lanes_pair<WideLanes, L::kBytes>(xp, rows, k, lw + g * lane_stride, lw + (g + 1) * lane_stride, dg,
                                               dg + scale_stride, mg, mg != nullptr ? mg + scale_stride : nullptr,
                                               og, ldo, add);
        continue;
      }
      if (buffered) {
        lanes_buffered<L>(xp, rows, k, lw + g * lane_stride, lane_stride, dg, mg, scale_stride, og, ldo, add,
                          std::min(per_task, groups - g));
        continue;
      }
      if (by_lanes) {
        lanes_groups<L>(xp, rows, k, lw + g * lane_stride, lane_stride, dg, mg, scale_stride, og, ldo, add,
                        std::min(per_task, groups - g));
        continue;
      }
      if (wide_path) {
        wide::rows_group<q4>(xp, rows, k, qg, dg, mg, og, ldo, add);
        continue;
      }
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4)
        for (int c = 0; c < kGroup; c += 2) K<4, 2>::run(xp + r * k, k, qg, dg, mg, c, og + r * ldo + c, ldo, add);
      switch (rows - r) {
        case 3:
          for (int c = 0; c < kGroup; c += 2) K<3, 2>::run(xp + r * k, k, qg, dg, mg, c, og + r * ldo + c, ldo, add);
          break;
        case 2:
          for (int c = 0; c < kGroup; c += 4) K<2, 4>::run(xp + r * k, k, qg, dg, mg, c, og + r * ldo + c, ldo, add);
          break;
        case 1:
          K<1, 8>::run(xp + r * k, k, qg, dg, mg, 0, og + r * ldo, ldo, add);
          break;
        default:
          break;
      }
    }
  }, [](int) {});
}

// grouped_linear on a checked view: y [rows, out + extra] (or, with a residual, the block rows' products added into
// it and y [rows, extra] the extra rows').
template <template <int, int> class K, class L>
at::Tensor view_linear(const at::Tensor& x, const BlockView& w, int64_t bytes_per_block,
                       const std::optional<at::Tensor>& residual, double eps, const uint8_t* coarse,
                       int64_t grid_bits) {
  const int64_t rows = x.size(0), out_features = w.out_features, extra = w.extra;
  const bool add = residual.has_value();
  if (add)
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == rows && residual->size(1) == out_features &&
                    residual->scalar_type() == at::kFloat && residual->stride(1) == 1,
                "residual must be a float32 [rows, out_features] tensor with unit column stride");
  // With a residual, the block rows' products are added into it and y holds only the extra rows' products.
  const int64_t width = add ? extra : out_features + extra;
  at::Tensor y = at::empty({rows, width}, x.options());
  float* yp = y.data_ptr<float>();
  float* op = add ? residual->data_ptr<float>() : yp;
  const int64_t ldo = add ? residual->stride(0) : width;
  grouped_product<K, L>(x.data_ptr<float>(), rows, w, bytes_per_block, eps, op, ldo, add, yp + (add ? 0 : out_features),
                        width, coarse, grid_bits);
  return y;
}

// y = x [W; dense]^T: the block-quantized W (groups of 8 features), then the optional float32 rows ``dense``.
// ``lanes``: the quants in the lane kernels' layout L (or none: row kernels for every pass size).
template <template <int, int> class K, class L>
at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                          const float* minimum, int64_t bytes_per_block, const std::optional<at::Tensor>& dense,
                          const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& norm,
                          double eps, const std::optional<at::Tensor>& lanes = std::nullopt,
                          const std::optional<at::Tensor>& tiles = std::nullopt, const uint8_t* coarse = nullptr,
                          int64_t grid_bits = 24) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous 2-D float32 tensor");
  check_grid_bits(grid_bits);
  const BlockView w = block_view<L>(qs, scale, minimum, x.size(1), dense, norm, lanes, tiles);
  return view_linear<K, L>(x, w, bytes_per_block, residual, eps, coarse, grid_bits);
}



template <int R, int C>
struct Q41 {
  static void run(const float* x, int64_t k, const uint8_t* q, const float* d, const float* m, int c, float* y,
                  int64_t ldy, bool add) {
    q4_1_kernel<R, C>(x, k, q, d, m, c, y, ldy, add);
  }
};
template <int R, int C>
struct Q80 {
  static void run(const float* x, int64_t k, const uint8_t* q, const float* d, const float* m, int c, float* y,
                  int64_t ldy, bool add) {
    q8_0_kernel<R, C>(x, k, q, d, m, c, y, ldy, add);
  }
};

// Per-row flags from flattened [start, stop) runs: 1 for the rows that go on the 8-bit grid (empty: none).
std::vector<uint8_t> coarse_flags(at::IntArrayRef runs, int64_t rows) {
  std::vector<uint8_t> flags;
  if (runs.empty()) return flags;
  TORCH_CHECK(runs.size() % 2 == 0, "coarse_runs must be [start, stop) pairs");
  flags.assign(static_cast<size_t>(rows), 0);
  for (size_t i = 0; i + 1 < runs.size(); i += 2) {
    TORCH_CHECK(0 <= runs[i] && runs[i] <= runs[i + 1] && runs[i + 1] <= rows, "coarse run [", runs[i], ", ",
                runs[i + 1], ") is outside the ", rows, " rows");
    std::fill(flags.begin() + runs[i], flags.begin() + runs[i + 1], uint8_t{1});
  }
  return flags;
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale, const at::Tensor& minimum,
                       const std::optional<at::Tensor>& extra, const std::optional<at::Tensor>& residual,
                       const std::optional<at::Tensor>& norm, double eps, const std::optional<at::Tensor>& lanes,
                       const std::optional<at::Tensor>& tiles, at::IntArrayRef coarse_runs, int64_t grid_bits) {
  check_inputs(x, qs, scale, 16);
  const std::vector<uint8_t> coarse = coarse_flags(coarse_runs, x.size(0));
  TORCH_CHECK(minimum.scalar_type() == at::kFloat && minimum.is_contiguous() && minimum.numel() == scale.numel(),
              "minimum must be a contiguous float32 tensor shaped like scale");
  TORCH_CHECK(qs.size(0) % kGroup == 0, "out_features must be a multiple of 8, got ", qs.size(0));
  return grouped_linear<Q41, Q41Lanes>(x, qs, scale, minimum.data_ptr<float>(), 16, extra, residual, norm, eps,
                                      lanes, tiles, coarse.empty() ? nullptr : coarse.data(), grid_bits);
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                       const std::optional<at::Tensor>& extra, const std::optional<at::Tensor>& residual,
                       const std::optional<at::Tensor>& norm, double eps, const std::optional<at::Tensor>& lanes,
                       const std::optional<at::Tensor>& tiles, at::IntArrayRef coarse_runs, int64_t grid_bits) {
  check_inputs(x, qs, scale, 32);
  const std::vector<uint8_t> coarse = coarse_flags(coarse_runs, x.size(0));
  TORCH_CHECK(qs.size(0) % kGroup == 0, "out_features must be a multiple of 8, got ", qs.size(0));
  return grouped_linear<Q80, Q80Lanes>(x, qs, scale, nullptr, 32, extra, residual, norm, eps, lanes, tiles,
                                      coarse.empty() ? nullptr : coarse.data(), grid_bits);
}

// q8_0_linear whose rows in ``screen_runs`` (flattened [start, stop) runs: greedy rows, read only for their argmax)
// are multiplied on the 8-bit grid and their few outputs that could be the argmax recomputed exactly (screen::row):
// each screened row's first maximum over its first ``valid`` outputs is the exact product's, the other outputs are
// approximations below it. ``bounds`` [out, in / 32] float32: |d| sum |q| per output and block, rounded up;
// ``peak_bounds`` [in / 32]: its largest per block; ``excluded``: outputs never screened (float32 exception rows the
// caller writes over). Where the records path cannot serve (no records, VNNI and AMX off, a CPU without VNNI) every
// row is exact. Returns (y, record streams recomputed).
std::tuple<at::Tensor, int64_t> q8_0_screened(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                                              const std::optional<at::Tensor>& extra,
                                              const std::optional<at::Tensor>& norm, double eps,
                                              const std::optional<at::Tensor>& lanes, const at::Tensor& tiles,
                                              at::IntArrayRef coarse_runs, int64_t grid_bits, const at::Tensor& bounds,
                                              const at::Tensor& peak_bounds, at::IntArrayRef excluded, int64_t valid,
                                              at::IntArrayRef screen_runs) {
  check_inputs(x, qs, scale, 32);
  check_grid_bits(grid_bits);
  TORCH_CHECK(qs.size(0) % kGroup == 0, "out_features must be a multiple of 8, got ", qs.size(0));
  const int64_t rows = x.size(0), k = x.size(1), blocks = k / kBlock;
  const BlockView view = block_view<Q80Lanes>(qs, scale, nullptr, k, extra, norm, lanes, std::optional<at::Tensor>(tiles));
  TORCH_CHECK(0 < valid && valid <= view.out_features, "valid must be in [1, ", view.out_features, "], got ", valid);
  TORCH_CHECK(bounds.scalar_type() == at::kFloat && bounds.is_contiguous() && bounds.dim() == 2 &&
                  bounds.size(0) >= valid && bounds.size(1) == blocks,
              "bounds must be a contiguous float32 [>= valid, in / 32] tensor");
  TORCH_CHECK(peak_bounds.scalar_type() == at::kFloat && peak_bounds.is_contiguous() && peak_bounds.numel() == blocks,
              "peak_bounds must be a contiguous float32 [in / 32] tensor");
  std::vector<uint8_t> flags = coarse_flags(coarse_runs, rows);
  const std::vector<uint8_t> screened = coarse_flags(screen_runs, rows);
  std::vector<int64_t> chosen;
  for (int64_t r = 0; r < static_cast<int64_t>(screened.size()); ++r)
    if (screened[r] != 0 && (flags.empty() || flags[r] == 0)) chosen.push_back(r);  // a coarse row stays coarse
  if (!chosen.empty() && records_path(rows, static_cast<const uint8_t*>(nullptr)) != Records::kNone &&
      vnni_supported()) {
    if (flags.empty()) flags.assign(static_cast<size_t>(rows), 0);
    for (const int64_t r : chosen) flags[r] = 1;
  } else {
    chosen.clear();
  }
  // the rows multiplied: rms_norm(x) * norm where there is a norm, normalised once here for both products
  BlockView plain = view;
  plain.norm = nullptr;
  const float* xp = view.norm != nullptr ? rms_normed(x.data_ptr<float>(), rows, k, view.norm, eps) : x.data_ptr<float>();
  const int64_t width = view.out_features + view.extra;
  at::Tensor y = at::empty({rows, width}, x.options());
  float* yp = y.data_ptr<float>();
  grouped_product<Q80, Q80Lanes>(xp, rows, plain, 32, eps, yp, width, false, yp + view.out_features, width,
                                 flags.empty() ? nullptr : flags.data(), grid_bits);
  if (chosen.empty()) return {y, 0};
  const tiles::Grid& exact = tiles::on_grid(xp, rows, k, nullptr, false, grid_bits);
  std::atomic<int64_t> recomputed{0};
  at::parallel_for(0, static_cast<int64_t>(chosen.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = chosen[i];
      recomputed += screen::row(exact, rows, r, xp + r * k, k, view.tiles, view.out_features, valid,
                                bounds.data_ptr<float>(), peak_bounds.data_ptr<float>(), excluded.data(),
                                static_cast<int64_t>(excluded.size()), yp + r * width);
    }
  });
  return {y, recomputed.load()};
}


// ---- attention of short passes ------------------------------------------------------------------------------------
// A pass of a few new rows per sequence attends each row to at most a few thousand cached positions: a few hundred
// thousand multiply-adds per layer, which ATen's bmm / softmax / bmm (plus RoPE, the cache write and the views
// around them) spend more time dispatching than computing. ``attend`` does all of it for every sequence of a pass
// in one call: RoPE on the new queries and keys (in place), the new keys and values into each sequence's cache,
// then causal softmax attention of every new row to its cache, in float32.

// e^x for x <= 0 (scores minus their maximum): x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor
// polynomial (relative error < 2e-7), 2^n put into the exponent bits. Clamped at -87 (e^-87 ~ 1.6e-38, ~0).
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 split in two (Cody-Waite): exact n * c1
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// e^x for x clamped to [-87, 88] (e^88 ~ 1.7e38 stays finite), as exp_nonpositive.
inline __m256 exp_clamped(__m256 x) {
  return exp_nonpositive(_mm256_min_ps(x, _mm256_set1_ps(88.0f)));
}

// act[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i] for a Llama MLP: x / (1 + e^-x) (IEEE division), then the
// product, in the order of torch's silu and mul_. One call per layer: ATen's silu on the slice and its mul_ cost
// ~10-20 us of dispatch and iterator set-up per layer on a one-row pass for 1536 elements (one-token passes took
// 0.96x the time with this call, paired in one process, Emerald Rapids VM). e^-x is the attention's polynomial
// (relative error < 2e-7; torch's Sleef exp: 1 ulp), so the result is within a few ulps of torch's.
constexpr int64_t kSiluGrain = 1 << 15;  // elements of silu_mul below which a chunk is not split off

at::Tensor silu_mul(const at::Tensor& gate_up, int64_t inter) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat && gate_up.stride(1) == 1 &&
                  gate_up.size(1) >= 2 * inter && inter % 8 == 0 && inter > 0,
              "silu_mul needs a float32 [rows, >= 2 * inter] tensor with unit column stride and inter % 8 == 0, got ",
              gate_up.sizes(), " and inter ", inter);
  const int64_t rows = gate_up.size(0), ld = gate_up.stride(0);
  at::Tensor act = at::empty({rows, inter}, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* a = act.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  // A prefill's rows split across the threads (each element computed alike, so the same bits); a decode pass's few
  // rows stay on this thread: one chunk takes at least kSiluGrain elements (one thread took 23 ms of a 300-token
  // prefill's 416 ms on a 2-core Zen 4, ~1.7 ns an element).
  at::parallel_for(0, rows, std::max<int64_t>(1, kSiluGrain / inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gr = g + r * ld;
      float* ar = a + r * inter;
      for (int64_t i = 0; i < inter; i += 8) {
        const __m256 x = _mm256_loadu_ps(gr + i);
        const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, exp_clamped(_mm256_xor_ps(x, sign))));
        _mm256_storeu_ps(ar + i, _mm256_mul_ps(silu, _mm256_loadu_ps(gr + inter + i)));
      }
    }
  });
  return act;
}

// ---- recovering blocks from float32 weights (at load) ---------------------------------------------------------
// What blockq._q4_1_blocks / _q8_0_blocks compute with torch ops, in one pass over the weights instead of ~11 (each
// a full pass over them, ~1.2 s for the default model's 135 M weights on a 2-core Zen 1): the same operations on
// every value, so the same numbers (tests compare them on exact blocks, perturbed ones, zero, constant, tiny, huge,
// infinite and NaN blocks). float16 rounding as torch's .half() (round to nearest even, overflow to infinity).
inline float fp16_round(float x) { return static_cast<float>(c10::Half(x)); }

// torch.round (half to even) under the default rounding mode, then clamp_(lo, hi); NaN (a block holding NaN or
// infinity) becomes 0, where the torch form leaves the value to the uint8 / int8 conversion: such rows are never
// rebuilt bit for bit, so their quants are not used.
inline float quant(float t, float lo, float hi) { return t == t ? std::clamp(std::nearbyint(t), lo, hi) : 0.0f; }

// ok [rows] of [rows, n, 32] float32 values: block(index, values) recovers block ``index`` (r * n + b), stores its
// quants and scales and says whether they rebuild its values bit for bit; rows spread across the threads.
template <class Block>
at::Tensor recover_rows(const at::Tensor& blocks, const char* op, Block&& block) {
  TORCH_CHECK(blocks.dim() == 3 && blocks.size(2) == kBlock && blocks.scalar_type() == at::kFloat &&
                  blocks.is_contiguous(),
              op, " needs contiguous float32 [rows, blocks, 32] values, got ", blocks.sizes());
  const int64_t rows = blocks.size(0), n = blocks.size(1);
  at::Tensor ok = at::empty({rows}, blocks.options().dtype(at::kBool));
  const float* v = blocks.data_ptr<float>();
  bool* okp = ok.data_ptr<bool>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      bool same = true;
      for (int64_t b = r * n; b < (r + 1) * n; ++b) same = block(b, v + b * kBlock) && same;  // every block stored
      okp[r] = same;
    }
  });
  return ok;
}

// The shape of [rows, n] per-block values (a 3-d input's first two sizes; recover_rows checks the rest).
std::vector<int64_t> block_grid(const at::Tensor& blocks) {
  TORCH_CHECK(blocks.dim() == 3, "block recovery needs [rows, blocks, 32] values, got ", blocks.sizes());
  return {blocks.size(0), blocks.size(1)};
}

// (q [rows, n, 32] uint8, d [rows, n], m [rows, n], ok [rows] bool) of [rows, n, 32] float32 values: d the
// float16-rounded (max - min) / 15, m the minimum, q = round((v - m) / d) in [0, 15] (0 where d is 0); ok where every
// q * d + m equals its value and every m is a float16 number.
std::vector<at::Tensor> recover_q4_1(const at::Tensor& blocks) {
  const std::vector<int64_t> grid = block_grid(blocks);
  at::Tensor q = at::empty({grid[0], grid[1], kBlock}, blocks.options().dtype(at::kByte));
  at::Tensor d = at::empty(grid, blocks.options()), m = at::empty(grid, blocks.options());
  uint8_t* qp = q.data_ptr<uint8_t>();
  float *dp = d.data_ptr<float>(), *mp = m.data_ptr<float>();
  at::Tensor ok = recover_rows(blocks, "recover_q4_1", [&](int64_t index, const float* x) {
    float low = x[0], high = x[0];
    for (int64_t i = 1; i < kBlock; ++i) {  // NaN propagates, as torch's amin / amax
      low = (x[i] < low || x[i] != x[i]) ? x[i] : low;
      high = (x[i] > high || x[i] != x[i]) ? x[i] : high;
    }
    const float scale = fp16_round((high - low) / 15.0f);
    const float safe = scale > 0 ? scale : 1.0f;
    bool same = fp16_round(low) == low;
    for (int64_t i = 0; i < kBlock; ++i) {
      const float qi = scale > 0 ? quant((x[i] - low) / safe, 0.0f, 15.0f) : 0.0f;
      qp[index * kBlock + i] = static_cast<uint8_t>(qi);
      same = same && (qi * scale + low == x[i]);  // -ffp-contract=off: a product, then a sum, as torch's
    }
    dp[index] = scale;
    mp[index] = low;
    return same;
  });
  return {q, d, m, ok};
}

// (q [rows, n, 32] int8, d [rows, n], ok [rows] bool): d the float16-rounded max |v| / 127, q = round(v / d) in
// [-128, 127] (0 where d is 0); ok where every q * d equals its value.
std::vector<at::Tensor> recover_q8_0(const at::Tensor& blocks) {
  const std::vector<int64_t> grid = block_grid(blocks);
  at::Tensor q = at::empty({grid[0], grid[1], kBlock}, blocks.options().dtype(at::kChar));
  at::Tensor d = at::empty(grid, blocks.options());
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  at::Tensor ok = recover_rows(blocks, "recover_q8_0", [&](int64_t index, const float* x) {
    float peak = std::fabs(x[0]);
    for (int64_t i = 1; i < kBlock; ++i) {
      const float a = std::fabs(x[i]);
      peak = (a > peak || a != a) ? a : peak;
    }
    const float scale = fp16_round(peak / 127.0f);
    const float safe = scale > 0 ? scale : 1.0f;
    bool same = true;
    for (int64_t i = 0; i < kBlock; ++i) {
      const float qi = scale > 0 ? quant(x[i] / safe, -128.0f, 127.0f) : 0.0f;
      qp[index * kBlock + i] = static_cast<int8_t>(qi);
      same = same && (qi * scale == x[i]);
    }
    dp[index] = scale;
    return same;
  });
  return {q, d, ok};
}

// The 8 lanes of v summed as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), the order sum8 gives every lane.
inline float pair_sum(__m256 v) {
  const __m256 h = _mm256_hadd_ps(v, v);  // [l0+l1, l2+l3, ., . | l4+l5, l6+l7, ., .]
  const __m256 q = _mm256_hadd_ps(h, h);  // [(l0+l1)+(l2+l3), ... | (l4+l5)+(l6+l7), ...]
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1)));
}

// [pair_sum(a[0]), ..., pair_sum(a[7])] in one vector.
inline __m256 sum8(const __m256* a) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// A row's running maximum of its scores: blocks of 8 keys in a vector, keys past the last whole block one by one.
struct ScoreMax {
  __m256 blocks = _mm256_set1_ps(-INFINITY);
  float tail = -INFINITY;
  float value() const {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, blocks);
    return std::max(*std::max_element(lanes, lanes + 8), tail);
  }
};

// Eight cached keys' or values' elements as float32: the cache holds float32, or float16 (``kv_cache="fp16"``: half
// the bytes a pass reads from it; every half converts to float32 exactly, so the sums below are the same operations).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// d elements of a new key or value row into the cache (float16: rounded to nearest even, as torch's conversion).
inline void store_row(const float* from, int64_t d, float* to) { std::copy_n(from, d, to); }
inline void store_row(const float* from, int64_t d, uint16_t* to) {
  for (int64_t t = 0; t < d; t += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(to + t),
                     _mm256_cvtps_ph(_mm256_loadu_ps(from + t), _MM_FROUND_TO_NEAREST_INT));
}

// Cache lines a loop asks for a few at a time as it goes: a share of the next chunk of keys or values (attend_rows).
struct Ahead {
  const char* next = nullptr;
  int64_t lines = 0;
  // ask for up to ``count`` of the lines left
  void ask(int64_t count) {
    for (; count > 0 && lines > 0; --count, --lines, next += 64) _mm_prefetch(next, _MM_HINT_T0);
  }
  // how many to ask for per block of 8 of ``keys`` positions so that the last block asks for the last of them
  int64_t per_block(int64_t keys) const { return keys > 0 ? (lines * 8 + keys - 1) / keys : lines; }
};

// scores[j] = scale * (q . keys[j]) for j in [j0, j1) (j0 a multiple of 8): keys in blocks of eight (independent
// accumulators) below ``whole`` (the row's key count rounded down to 8), the rest one at a time. A score's operations
// do not depend on j0 / j1, only on the row's count.
template <typename KV>
void dot_scores(const float* q, const KV* keys, int64_t j0, int64_t j1, int64_t whole, int64_t d, float scale,
                float* scores, ScoreMax& top, Ahead ahead = {}) {
  const __m256 vscale = _mm256_set1_ps(scale);
  int64_t j = j0;
  const int64_t per_block = ahead.per_block(j1 - j0);
  for (; j + 8 <= std::min(j1, whole); j += 8) {
    ahead.ask(per_block);
    const KV* kj = keys + j * d;
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t t = 0; t < d; t += 8) {
      const __m256 qt = _mm256_loadu_ps(q + t);
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qt, load8(kj + i * d + t), acc[i]);
    }
    const __m256 s = _mm256_mul_ps(sum8(acc), vscale);
    _mm256_storeu_ps(scores + j, s);
    top.blocks = _mm256_max_ps(top.blocks, s);
  }
  for (; j < j1; ++j) {  // the last < 8 keys: the same sums, one key at a time
    const KV* kj = keys + j * d;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t t = 0; t < d; t += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + t), load8(kj + t), acc);
    scores[j] = pair_sum(acc) * scale;
    top.tail = std::max(top.tail, scores[j]);
  }
  ahead.ask(ahead.lines);
}

// acc[0:8W] += sum_j p[j] * values[j, 0:8W] for j in [j0, j1) (rows of ``values`` are ``d`` apart), in order.
template <int W, typename KV>
inline void weighted_values(const float* p, const KV* values, int64_t j0, int64_t j1, int64_t d, float* out,
                            Ahead ahead = {}) {
  __m256 acc[W];
  for (int t = 0; t < W; ++t) acc[t] = _mm256_loadu_ps(out + 8 * t);
  const int64_t per_block = ahead.per_block(j1 - j0);
  for (int64_t j = j0; j < j1; ++j) {
    if (((j - j0) & 7) == 0) ahead.ask(per_block);
    const __m256 pj = _mm256_broadcast_ss(p + j);
    const KV* vj = values + j * d;
    for (int t = 0; t < W; ++t) acc[t] = _mm256_fmadd_ps(pj, load8(vj + 8 * t), acc[t]);
  }
  for (int t = 0; t < W; ++t) _mm256_storeu_ps(out + 8 * t, acc[t]);
  ahead.ask(ahead.lines);
}

// Every 64-dimension slice of acc[0:d] += sum_j p[j] * values[j] over [j0, j1) (8 accumulators in registers); the
// first slice's loop asks for ``ahead``'s lines as it goes.
template <typename KV>
void weighted_range(const float* p, const KV* values, int64_t j0, int64_t j1, int64_t d, float* acc,
                    Ahead ahead = {}) {
  for (int64_t c = 0; c < d; c += 64) {
    const Ahead slice = std::exchange(ahead, {});  // the first slice's loop asks for the lines
    switch (std::min<int64_t>(64, d - c) / 8) {
      case 8: weighted_values<8>(p, values + c, j0, j1, d, acc + c, slice); break;
      case 7: weighted_values<7>(p, values + c, j0, j1, d, acc + c, slice); break;
      case 6: weighted_values<6>(p, values + c, j0, j1, d, acc + c, slice); break;
      case 5: weighted_values<5>(p, values + c, j0, j1, d, acc + c, slice); break;
      case 4: weighted_values<4>(p, values + c, j0, j1, d, acc + c, slice); break;
      case 3: weighted_values<3>(p, values + c, j0, j1, d, acc + c, slice); break;
      case 2: weighted_values<2>(p, values + c, j0, j1, d, acc + c, slice); break;
      default: weighted_values<1>(p, values + c, j0, j1, d, acc + c, slice); break;
    }
  }
}

// scores[0:count] = exp(scores - top) (in place); returns 1 / their sum.
float exp_scores(float* scores, int64_t count, float top) {
  const __m256 vtop = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + j), vtop));
    _mm256_storeu_ps(scores + j, e);
    total = _mm256_add_ps(total, e);
  }
  if (j < count) {  // the last < 8 scores, through the same function (lanes past the end count 0)
    alignas(32) float tail[8];
    for (int i = 0; i < 8; ++i) tail[i] = j + i < count ? scores[j + i] - top : -INFINITY;
    const __m256 e = exp_nonpositive(_mm256_load_ps(tail));
    _mm256_store_ps(tail, e);
    for (int i = 0; i < 8; ++i) {
      if (j + i < count)
        scores[j + i] = tail[i];
      else
        tail[i] = 0.0f;
    }
    total = _mm256_add_ps(total, _mm256_load_ps(tail));
  }
  return 1.0f / lane_sum(total);
}

// Keys (and values) per chunk: 64 rows of a 64-dimension head are 16 KB each, so a chunk read for a pass's first row
// is still in L1 for its other rows.
constexpr int64_t kKeyChunk = 64;
// Rows of one sequence per task: enough to share each chunk, few enough to split a pass over the threads.
constexpr int64_t kRowsPerTask = 4;
// (row, head) pairs per task at most: the query heads that share a key / value head go in one task, so that each key
// and value chunk is read from memory once for all of them (grouped-query attention: 3 query heads per key head in
// the default model) and not once per query head.
constexpr int64_t kPairsPerTask = 12;

// AVX-512 forms of the multi-row loops, bit for bit the AVX2 ones: two rows' scores in the two halves of a register
// (the same multiply-adds and the same pairwise sums per half), and one load of a value row for up to 4 rows.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi")
namespace wide {

// _mm256_hadd_ps on each 256-bit half: [x0 + x1, x2 + x3, y0 + y1, y2 + y3] per 128-bit lane.
inline __m512 hadd(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}

// sum8 above, on each half.
inline __m512 sum8(const __m512* a) {
  const __m512 s0123 = hadd(hadd(a[0], a[1]), hadd(a[2], a[3]));
  const __m512 s4567 = hadd(hadd(a[4], a[5]), hadd(a[6], a[7]));
  const __m512i low = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
  const __m512i high = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  return _mm512_add_ps(_mm512_permutex2var_ps(s0123, low, s4567), _mm512_permutex2var_ps(s0123, high, s4567));
}

// Sixteen cached elements as float32 (see load8).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Scores of rows a and b for the key blocks [j0, j1) (multiples of 8): dot_scores' block operations, a low, b high.
template <typename KV>
void dot_pair(const float* qa, const float* qb, const KV* keys, int64_t j0, int64_t j1, int64_t d, float scale,
              float* sa, float* sb, ScoreMax& ta, ScoreMax& tb, Ahead ahead = {}) {
  const __m512 vscale = _mm512_set1_ps(scale);
  const int64_t per_block = ahead.per_block(j1 - j0);
  for (int64_t j = j0; j < j1; j += 8) {
    ahead.ask(per_block);
    const KV* kj = keys + j * d;
    __m512 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < d; t += 8) {
      const __m512 qt = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(qa + t)), _mm256_loadu_ps(qb + t), 1);
      for (int i = 0; i < 8; ++i)
        acc[i] = _mm512_fmadd_ps(qt, _mm512_broadcast_f32x8(load8(kj + i * d + t)), acc[i]);
    }
    const __m512 sc = _mm512_mul_ps(sum8(acc), vscale);
    const __m256 lo = _mm512_castps512_ps256(sc), hi = _mm512_extractf32x8_ps(sc, 1);
    _mm256_storeu_ps(sa + j, lo);
    _mm256_storeu_ps(sb + j, hi);
    ta.blocks = _mm256_max_ps(ta.blocks, lo);
    tb.blocks = _mm256_max_ps(tb.blocks, hi);
  }
  ahead.ask(ahead.lines);
}

// acc[r][0:d] += sum_j p[r][j] * values[j] for j in [j0, j1) and R rows (d a multiple of 64): each value row read
// once for all of them.
template <int R, typename KV>
void weighted_rows(const float* const* p, const KV* values, int64_t j0, int64_t j1, int64_t d, float* const* out,
                   Ahead ahead) {
  const int64_t per_block = ahead.per_block(j1 - j0);
  for (int64_t c = 0; c < d; c += 64) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < 4; ++t) acc[r][t] = _mm512_loadu_ps(out[r] + c + 16 * t);
    for (int64_t j = j0; j < j1; ++j) {
      if (((j - j0) & 7) == 0) ahead.ask(per_block);  // the first slice's loop asks for the lines
      const KV* vj = values + j * d + c;
      const __m512 v0 = load16(vj), v1 = load16(vj + 16), v2 = load16(vj + 32), v3 = load16(vj + 48);
      for (int r = 0; r < R; ++r) {
        const __m512 pj = _mm512_set1_ps(p[r][j]);
        acc[r][0] = _mm512_fmadd_ps(pj, v0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(pj, v1, acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(pj, v2, acc[r][2]);
        acc[r][3] = _mm512_fmadd_ps(pj, v3, acc[r][3]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < 4; ++t) _mm512_storeu_ps(out[r] + c + 16 * t, acc[r][t]);
  }
  ahead.ask(ahead.lines);
}

template <typename KV>
void weighted_common(int64_t n, const float* const* p, const KV* values, int64_t j0, int64_t j1, int64_t d,
                     float* const* out, Ahead ahead = {}) {
  switch (n) {
    case 4: weighted_rows<4>(p, values, j0, j1, d, out, ahead); break;
    case 3: weighted_rows<3>(p, values, j0, j1, d, out, ahead); break;
    case 2: weighted_rows<2>(p, values, j0, j1, d, out, ahead); break;
    default: weighted_rows<1>(p, values, j0, j1, d, out, ahead); break;
  }
}

}  // namespace wide
#pragma GCC pop_options

// Ask for rows [from, to) of a key or value head (d elements each) ahead of their use: a pass streams each sequence's
// cache once, one task after another, and on the 2-core VMs measured the hardware prefetchers alone left the cores
// waiting on it (one layer's attention over 8 caches of 500 positions: ~2.5x the time it takes with them in L2).
// Prefetches change no result.
//
// How: each chunk of 64 keys asked for the whole next chunk (16 KB, 256 lines) before its first score. On a 2-core
// Zen 3 that burst stalled the thread once the core's outstanding misses were used up, and the loops then waited on
// memory anyway: without any software prefetch the same attention took 0.94-0.96x the time. The AVX2 loops now ask
// for the next chunk a few lines per block of 8 keys (each pair of the task a share of it; dot_scores and
// weighted_values, `Ahead`): 0.82-0.92x the time of the burst (8 caches of 400 / 800 positions, one of 800, 8 rows on
// one of 400; 30 layers' caches, cold; scripts/attention_prefetch.py), whole 8-sequence passes at 400 positions
// 0.93-0.96x. The AVX-512 pair loops (dot_pair, weighted_rows) do the same since, each pair or group of pairs its
// share: on a 2-core Zen 4, against the burst there, attention alone 0.80-0.81x (8 caches of 400 / 800 positions),
// 0.91x (8 rows on one of 400), whole passes 0.92x (8 and 16 caches of 400), 0.91x (one of 1,500).
// g_attention_prefetch: 1 spread (the default), 0 the burst at each chunk, 2 spread in the AVX2 loops and a burst in
// the pair loops (the form before; tests and measurements compare them).
std::atomic<int64_t> g_attention_prefetch{1};

int64_t vnni_chunk(int64_t request) {
  TORCH_CHECK(request == -1 || (request >= 1 && request <= vnni::kChunk), "vnni_chunk takes -1 (read) or the most "
              "rows a VNNI chunk may hold, 1 to ", vnni::kChunk, ", got ", request);
  if (request >= 1) vnni::g_vnni_chunk = request;
  return vnni::g_vnni_chunk.load();
}

int64_t attention_prefetch(int64_t request) {
  TORCH_CHECK(request >= -1 && request <= 2, "attention_prefetch takes -1 (read), 0 (a burst per chunk), 1 "
              "(spread over the loops) or 2 (spread over the AVX2 loops, a burst for the AVX-512 pairs), got ",
              request);
  if (request >= 0) g_attention_prefetch = request;
  return g_attention_prefetch.load();
}

template <typename KV>
inline void prefetch_rows(const KV* rows, int64_t from, int64_t to, int64_t d) {
  const char* begin = reinterpret_cast<const char*>(rows + from * d);
  const char* end = reinterpret_cast<const char*>(rows + to * d);
  for (const char* line = begin; line < end; line += 64) _mm_prefetch(line, _MM_HINT_T0);
}

// Causal softmax attention of n (row, head) pairs sharing one key / value head: query q[i] attends keys / values
// [0, count[i]) and writes out[i]. Key chunks outer, pairs inner: each chunk is read from memory once for all n pairs
// (a sequence's rows, and the query heads of a group), while every pair's result is the same sequence of operations
// as if it ran alone (with AVX-512, pairs share registers too). ``scratch``: n * (max count + 8) + n * d floats.
template <typename KV>
void attend_rows(const float* const* q, const int64_t* count, int64_t n, const KV* keys, const KV* values,
                 int64_t d, float scale, float* const* out, float* scratch, float* stats = nullptr) {
  const int64_t longest = *std::max_element(count, count + n), shortest = *std::min_element(count, count + n);
  const int64_t stride = longest + 8;
  const bool wide_rows = n > 1 && wide_rows_on();
  float* acc = scratch + n * stride;
  ScoreMax tops[kPairsPerTask];
  // the loops ask for the next chunk as they go, pairs [i, k) a share (see prefetch_rows)
  const int64_t form = g_attention_prefetch.load(std::memory_order_relaxed);
  const bool spread = form == 1 || (form == 2 && !wide_rows);
  const auto share = [&](const KV* rows, int64_t count, int64_t i, int64_t k) {
    const int64_t lines = (count * d * static_cast<int64_t>(sizeof(KV)) + 63) / 64;
    const int64_t first = lines * i / n;
    return spread ? Ahead{reinterpret_cast<const char*>(rows) + first * 64, lines * k / n - first} : Ahead{};
  };
  for (int64_t j0 = 0; j0 < longest; j0 += kKeyChunk) {
    // the next chunk of keys, else the first of values
    const bool last = j0 + kKeyChunk >= longest;
    const KV* next = last ? values : keys + (j0 + kKeyChunk) * d;
    const int64_t next_count = last ? std::min(kKeyChunk, longest) : std::min(kKeyChunk, longest - j0 - kKeyChunk);
    if (!spread) prefetch_rows(next, 0, next_count, d);
    int64_t i = 0;
    for (; wide_rows && i + 1 < n; i += 2) {  // pairs i and i + 1: whole blocks of both together, the rest alone
      const int64_t both = std::max(j0, std::min(j0 + kKeyChunk, std::min(count[i], count[i + 1]) / 8 * 8));
      float* sa = scratch + i * stride;
      wide::dot_pair(q[i], q[i + 1], keys, j0, both, d, scale, sa, sa + stride, tops[i], tops[i + 1],
                     share(next, next_count, i, i + 2));
      for (int64_t r = i; r < i + 2; ++r) {
        const int64_t end = std::min(j0 + kKeyChunk, count[r]);
        if (both < end) dot_scores(q[r], keys, both, end, count[r] / 8 * 8, d, scale, scratch + r * stride, tops[r]);
      }
    }
    for (; i < n; ++i)
      if (j0 < count[i])
        dot_scores(q[i], keys, j0, std::min(j0 + kKeyChunk, count[i]), count[i] / 8 * 8, d, scale,
                   scratch + i * stride, tops[i], share(next, next_count, i, i + 1));
  }
  float inv[kPairsPerTask];
  const float* p[kPairsPerTask];
  float* a[kPairsPerTask];
  for (int64_t i = 0; i < n; ++i) {
    inv[i] = exp_scores(scratch + i * stride, count[i], tops[i].value());
    if (stats != nullptr) {  // a key segment's part of a row (attend_pairs merges the parts): its max and sum
      stats[2 * i] = tops[i].value();
      stats[2 * i + 1] = 1.0f / inv[i];
    }
    p[i] = scratch + i * stride;
    a[i] = acc + i * d;
    std::fill_n(a[i], d, 0.0f);
  }
  for (int64_t j0 = 0; j0 < longest; j0 += kKeyChunk) {
    const int64_t next_count = std::max<int64_t>(0, std::min(kKeyChunk, longest - j0 - kKeyChunk));
    const KV* next = next_count > 0 ? values + (j0 + kKeyChunk) * d : values;
    if (!spread && next_count > 0) prefetch_rows(next, 0, next_count, d);
    // keys every pair attends, for up to 4 pairs at once, then each pair's own last keys
    const int64_t common = wide_rows && d % 64 == 0 ? std::max(j0, std::min(j0 + kKeyChunk, shortest)) : j0;
    if (common > j0)
      for (int64_t i = 0; i < n; i += 4)
        wide::weighted_common(std::min<int64_t>(4, n - i), p + i, values, j0, common, d, a + i,
                              share(next, next_count, i, std::min<int64_t>(i + 4, n)));
    for (int64_t i = 0; i < n; ++i) {  // (where the common loops ran, they asked for the lines)
      const int64_t end = std::min(j0 + kKeyChunk, count[i]);
      if (common < end)
        weighted_range(p[i], values, common, end, d, a[i], common > j0 ? Ahead{} : share(next, next_count, i, i + 1));
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const __m256 vinv = _mm256_set1_ps(inv[i]);
    for (int64_t c = 0; c < d; c += 8) _mm256_storeu_ps(out[i] + c, _mm256_mul_ps(_mm256_loadu_ps(a[i] + c), vinv));
  }
}

// (a + bi)(c + si) on the (even, odd) pairs of ``heads`` heads of d floats.
void rotate(float* v, int64_t heads, int64_t d, const float* rope) {
  for (int64_t h = 0; h < heads; ++h, v += d)
    for (int64_t p = 0; p < d; p += 2) {
      const float a = v[p], b = v[p + 1], c = rope[p], s = rope[p + 1];
      v[p] = a * c - b * s;
      v[p + 1] = a * s + b * c;
    }
}

// Positions a row attends in one task; a row with more attends them in segments of this many (attend_pairs).
constexpr int64_t kKeySegment = 1024;

// out[r, h] = the parts of row r (more than kKeySegment positions) merged: each part's normalised result weighted by
// its sum of exponentials rescaled to the largest part maximum, in part order.
void merge_parts(const std::vector<float>& parts, const std::vector<float>& stats, at::IntArrayRef starts,
                 at::IntArrayRef rows, const std::vector<int64_t>& first_row, int64_t n, int64_t num_heads, int64_t d,
                 float* out) {
  const int64_t q_dim = num_heads * d;
  std::vector<float> weights;
  for (size_t s = 0; s < rows.size(); ++s)
    for (int64_t i = 0; i < rows[s]; ++i) {
      const int64_t r = first_row[s] + i, total = starts[s] + i + 1;
      if (total <= kKeySegment) continue;  // written whole by its task
      const int64_t count = (total + kKeySegment - 1) / kKeySegment;
      for (int64_t h = 0; h < num_heads; ++h) {
        float top = -INFINITY;
        for (int64_t part = 0; part < count; ++part) top = std::max(top, stats[2 * ((part * n + r) * num_heads + h)]);
        weights.assign(static_cast<size_t>(count), 0.0f);
        float total_weight = 0.0f;
        for (int64_t part = 0; part < count; ++part) {
          const int64_t at = (part * n + r) * num_heads + h;
          weights[part] = stats[2 * at + 1] * std::exp(stats[2 * at] - top);
          total_weight += weights[part];
        }
        float* o = out + r * q_dim + h * d;
        for (int64_t c = 0; c < d; ++c) {
          float sum = 0.0f;
          for (int64_t part = 0; part < count; ++part) sum += weights[part] * parts[(part * n + r) * q_dim + h * d + c];
          o[c] = sum / total_weight;
        }
      }
    }
}

// qkv [N, q + 2 kv] (row stride free, column stride 1): the new rows of every segment (sequence), in order;
// rope [N, 1, d / 2] complex; caches[s] [2, kv_heads, capacity, d] (this layer's keys and values of segment s, whose
// ``rows[s]`` new tokens go to positions starts[s]..). Returns the attended rows [N, q].
at::Tensor attend_pairs(const at::Tensor& qkv, const at::Tensor& pairs, at::TensorList caches, at::IntArrayRef starts,
                        at::IntArrayRef rows, int64_t num_heads, int64_t kv_heads, int64_t d, double scale) {
  const int64_t segments = static_cast<int64_t>(caches.size());
  TORCH_CHECK(static_cast<int64_t>(starts.size()) == segments && static_cast<int64_t>(rows.size()) == segments,
              "attend needs one start and one row count per cache");
  TORCH_CHECK(d % 8 == 0 && num_heads % kv_heads == 0, "attend needs head_dim % 8 == 0 and whole query groups");
  const int64_t q_dim = num_heads * d, kv_dim = kv_heads * d, groups = num_heads / kv_heads;
  int64_t n = 0;
  for (int64_t s = 0; s < segments; ++s) n += rows[s];
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.stride(1) == 1 && qkv.size(0) == n &&
                  qkv.size(1) == q_dim + 2 * kv_dim,
              "qkv must be float32 [", n, ", ", q_dim + 2 * kv_dim, "] with unit column stride");
  TORCH_CHECK(pairs.scalar_type() == at::kFloat && pairs.is_contiguous() && pairs.numel() == n * d,
              "rope must be contiguous complex [", n, ", 1, d / 2]");
  std::vector<int64_t> first_row(segments + 1, 0);
  TORCH_CHECK(segments >= 1, "attend needs at least one cache");
  const bool half = caches[0].scalar_type() == at::kHalf;
  for (int64_t s = 0; s < segments; ++s) {
    const at::Tensor& kv = caches[s];
    TORCH_CHECK(kv.dim() == 4 && kv.size(0) == 2 && kv.size(1) == kv_heads && kv.size(3) == d &&
                    kv.scalar_type() == caches[0].scalar_type() &&
                    (kv.scalar_type() == at::kFloat || kv.scalar_type() == at::kHalf) && kv.is_contiguous() &&
                    starts[s] >= 0 && starts[s] + rows[s] <= kv.size(2) && rows[s] >= 1,
                "cache ", s, " must be a contiguous float32 or float16 [2, ", kv_heads, ", capacity, ", d,
                "] tensor (all of one dtype) with room for positions ", starts[s], "..", starts[s] + rows[s]);
    first_row[s + 1] = first_row[s] + rows[s];
  }
  float* base = qkv.data_ptr<float>();
  const int64_t ld = qkv.stride(0);
  const float* rp = pairs.data_ptr<float>();
  int64_t work = 0;
  const auto write_rows = [&](auto* kv, int64_t s) {
    const int64_t capacity = caches[s].size(2);
    for (int64_t i = 0; i < rows[s]; ++i) {
      const int64_t r = first_row[s] + i, position = starts[s] + i;
      float* row = base + r * ld;
      rotate(row, num_heads + kv_heads, d, rp + r * d);
      for (int64_t h = 0; h < kv_heads; ++h) {
        store_row(row + q_dim + h * d, d, kv + (h * capacity + position) * d);
        store_row(row + q_dim + kv_dim + h * d, d, kv + ((kv_heads + h) * capacity + position) * d);
      }
      work += (position + 1) * num_heads * d;
    }
  };
  for (int64_t s = 0; s < segments; ++s) {
    if (half)
      write_rows(reinterpret_cast<uint16_t*>(caches[s].data_ptr<at::Half>()), s);
    else
      write_rows(caches[s].data_ptr<float>(), s);
  }
  at::Tensor out = at::empty({n, q_dim}, qkv.options());
  float* op = out.data_ptr<float>();
  // A task is (sequence, a chunk of its rows, a set of query heads that share one key / value head): the heads of a
  // group together where they fit in kPairsPerTask pairs (else the largest divisor of the group that does), and as
  // many of the sequence's rows (up to kRowsPerTask) as then fit.
  int64_t heads_per_task = std::min(groups, kPairsPerTask);
  while (groups % heads_per_task != 0) --heads_per_task;
  int64_t rows_per_task = std::clamp<int64_t>(kPairsPerTask / heads_per_task, 1, kRowsPerTask);
  std::vector<int64_t> chunk_segment, chunk_row;
  const auto chunk_rows = [&] {
    chunk_segment.clear();
    chunk_row.clear();
    for (int64_t s = 0; s < segments; ++s)
      for (int64_t i = 0; i < rows[s]; i += rows_per_task) {
        chunk_segment.push_back(s);
        chunk_row.push_back(first_row[s] + i);
      }
  };
  chunk_rows();
  // Head sets [set_first[i], set_first[i + 1]) of one group each. Where whole groups would give the threads fewer
  // than two tasks each (a one-token pass: 3 tasks of 3 heads on 2 threads, one thread doing two), groups split
  // into sets of at most two heads (a pair and a single head for groups of 3), so that the threads share the work
  // evenly; each set reads its group's keys and values itself. Every (row, head) pair runs the same operations
  // in either split (attend_rows: pairs of heads or rows share registers, a head alone runs the one-row loops, each
  // giving the same bits), so a row's numbers do not depend on it.
  const int64_t threads = at::get_num_threads();
  // key segments of chunk c's last (longest) row: ceil(its position count / kKeySegment)
  const auto parts_of = [&](size_t c) {
    const int64_t s = chunk_segment[c], last = std::min(chunk_row[c] + rows_per_task, first_row[s + 1]) - 1;
    return (starts[s] + (last - first_row[s]) + kKeySegment) / kKeySegment;
  };
  int64_t units = 0;  // (chunk, key segment) pairs: a long cache's segments are tasks of their own (below)
  for (size_t c = 0; c < chunk_row.size(); ++c) units += parts_of(c);
  const bool split = groups > 2 && units * (num_heads / heads_per_task) < 2 * threads;
  std::vector<int64_t> set_first{0};
  for (int64_t g = 0; g < kv_heads; ++g)
    for (int64_t h = g * groups; h < (g + 1) * groups;) {
      h = std::min(h + (split ? 2 : heads_per_task), (g + 1) * groups);
      set_first.push_back(h);
    }
  if (split) {
    rows_per_task = std::clamp<int64_t>(kPairsPerTask / 2, 1, kRowsPerTask);
    chunk_rows();
  }
  const int64_t head_sets = static_cast<int64_t>(set_first.size()) - 1;
  // A row attending more than kKeySegment positions attends them in segments of kKeySegment (from position 0), one
  // task each, whose normalised parts are merged by their maxima and sums: a long cache is then read by every
  // thread, a contiguous part each, instead of by the one or two holding its row's query heads. The segments
  // depend only on the row's own position count, so its numbers still do not depend on the batch or the threads.
  std::vector<int64_t> chunk_parts(chunk_row.size());
  int64_t most_parts = 1;
  for (size_t c = 0; c < chunk_row.size(); ++c) {
    chunk_parts[c] = parts_of(c);  // after the split above, which may have changed the chunks
    most_parts = std::max(most_parts, chunk_parts[c]);
  }
  std::vector<int64_t> task_chunk, task_part;  // (chunk, key segment) of each task; its head set is t % head_sets
  for (size_t c = 0; c < chunk_row.size(); ++c)
    for (int64_t part = 0; part < chunk_parts[c]; ++part) {
      task_chunk.push_back(static_cast<int64_t>(c));
      task_part.push_back(part);
    }
  // parts of rows with more than one segment: [part][row][head] (d floats) and their (max, sum)
  std::vector<float> parts, part_stats;
  if (most_parts > 1) {
    parts.resize(static_cast<size_t>(most_parts * n * q_dim));
    part_stats.resize(static_cast<size_t>(most_parts * n * num_heads * 2));
  }
  const int64_t max_count = std::min(*std::max_element(starts.begin(), starts.end()) + n, kKeySegment);
  const int64_t tasks = static_cast<int64_t>(task_chunk.size()) * head_sets;
  const auto attend_tasks = [&](int64_t begin, int64_t end, std::vector<float>& scratch) {
    scratch.resize(static_cast<size_t>(kPairsPerTask * (max_count + 8 + d)));
    const float* q[kPairsPerTask];
    float* o[kPairsPerTask];
    int64_t count[kPairsPerTask];
    float stats[2 * kPairsPerTask];
    int64_t stat_at[kPairsPerTask];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t unit = t / head_sets, set = t % head_sets;
      const int64_t chunk = task_chunk[unit], part = task_part[unit], s = chunk_segment[chunk];
      const int64_t h0 = set_first[set], h1 = set_first[set + 1];
      const int64_t r0 = chunk_row[chunk], r1 = std::min(r0 + rows_per_task, first_row[s + 1]);
      const int64_t from = part * kKeySegment;
      int64_t pairs = 0;
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t total = starts[s] + (r - first_row[s]) + 1;
        if (total <= from) continue;  // this row's positions end before the segment
        const bool whole = total <= kKeySegment;  // one segment: the result itself
        for (int64_t h = h0; h < h1; ++h, ++pairs) {
          q[pairs] = base + r * ld + h * d;
          o[pairs] = whole ? op + r * q_dim + h * d : parts.data() + (part * n + r) * q_dim + h * d;
          count[pairs] = std::min(total - from, kKeySegment);
          stat_at[pairs] = whole ? -1 : (part * n + r) * num_heads + h;
        }
      }
      if (pairs == 0) continue;
      const int64_t capacity = caches[s].size(2), g = h0 / groups;
      const auto attend_group = [&](const auto* kv) {
        const auto* keys = kv + (g * capacity + from) * d;
        const auto* values = kv + ((kv_heads + g) * capacity + from) * d;
        attend_rows(q, count, pairs, keys, values, d, static_cast<float>(scale), o, scratch.data(),
                    most_parts > 1 ? stats : nullptr);
      };
      if (half)
        attend_group(reinterpret_cast<const uint16_t*>(caches[s].data_ptr<at::Half>()));
      else
        attend_group(caches[s].data_ptr<float>());
      if (most_parts > 1)
        for (int64_t i = 0; i < pairs; ++i)
          if (stat_at[i] >= 0) {
            part_stats[2 * stat_at[i]] = stats[2 * i];
            part_stats[2 * stat_at[i] + 1] = stats[2 * i + 1];
          }
    }
  };
  if (work < (1 << 16)) {  // under ~64k multiply-adds the whole call stays on this thread
    std::vector<float> scratch;
    attend_tasks(0, tasks, scratch);
  } else {
    shared_for<std::vector<float>>(tasks, attend_tasks, [](const std::vector<float>&) {});
  }
  if (most_parts > 1) merge_parts(parts, part_stats, starts, rows, first_row, n, num_heads, d, op);
  return out;
}

at::Tensor attend(const at::Tensor& qkv, const at::Tensor& rope, at::TensorList caches, at::IntArrayRef starts,
                  at::IntArrayRef rows, int64_t num_heads, int64_t kv_heads, int64_t d, double scale) {
  TORCH_CHECK(rope.scalar_type() == at::kComplexFloat, "rope must be complex64 (cos + i sin per pair)");
  return attend_pairs(qkv, at::view_as_real(rope), caches, starts, rows, num_heads, kv_heads, d, scale);
}

// Every decoder layer of a Llama-family model for a short block pass (one sequence or a batch), in one call: the same
// kernels and ATen ops in the same order as the Python layer loop (engine/fast/model.py: FastModel._layer), so the
// numbers are identical; what goes is ~15 Python-level calls per layer. ``weights`` holds 38 tensors
// per layer (see engine/fast/model.py: _fused_weights); an absent adapter factor, lane or tile layout is an empty
// tensor.
constexpr int64_t kPerLayer = 38;

std::optional<at::Tensor> present(const at::Tensor& t) {
  return t.numel() > 0 ? std::optional<at::Tensor>(t) : std::nullopt;
}

// A model's decoder weights for decode_layers (kPerLayer tensors per layer), handed to C++ once at load: a pass then
// passes one object instead of ~900 tensors that Python unpacked and reference-counted on every call (~2% of a
// one-token pass on 2 cores), and the optional ones are kept as optionals, not rebuilt per pass.
struct LayerStack : torch::CustomClassHolder {
  std::vector<at::Tensor> weights;
  std::vector<std::optional<at::Tensor>> optional;  // weights[i], or nothing where it is an empty tensor

  std::vector<BlockView> views;  // per layer: qkv, o, gate_up, down (checked here, once)

  explicit LayerStack(std::vector<at::Tensor> all) : weights(std::move(all)) {
    TORCH_CHECK(!weights.empty() && weights.size() % kPerLayer == 0, "a layer stack needs ", kPerLayer,
                " weight tensors per layer, got ", weights.size());
    optional.reserve(weights.size());
    for (const at::Tensor& t : weights) optional.push_back(present(t));
    // per projection: qs, scale, minimum, extra rows (adapter A), (adapter B^T), lanes, norm, tiles
    constexpr int64_t kParts[4][7] = {{1, 2, 3, 4, 6, 0, 26}, {7, 8, 9, 10, 12, -1, 27},
                                      {14, 15, 16, 17, 19, 13, 28}, {20, 21, 22, 23, 25, -1, 29}};
    views.reserve(static_cast<size_t>(4 * layers()));
    for (int64_t layer = 0; layer < layers(); ++layer) {
      const at::Tensor* w = weights.data() + layer * kPerLayer;
      const std::optional<at::Tensor>* o = optional.data() + layer * kPerLayer;
      for (const auto& part : kParts) {
        const at::Tensor& qs = w[part[0]];
        TORCH_CHECK(qs.dim() == 2 && w[part[2]].scalar_type() == at::kFloat && w[part[2]].is_contiguous(),
                    "a layer stack's projections must be Q4_1 blocks (qs [out, in / 32 * 16], float32 minimums)");
        const int64_t k = qs.size(1) / 16 * kBlock;
        const std::optional<at::Tensor> norm = part[5] >= 0 ? o[part[5]] : std::nullopt;
        views.push_back(block_view<Q41Lanes>(qs, w[part[1]], w[part[2]].data_ptr<float>(), k, o[part[3]], norm,
                                             o[part[4]], o[part[6]]));
      }
    }
  }
  int64_t layers() const { return static_cast<int64_t>(weights.size()) / kPerLayer; }
};

// A view without its extra rows (passes with no mask row leave the adapter's A factors unread).
inline BlockView without_extra(BlockView w) {
  w.dense = nullptr;
  w.extra = 0;
  return w;
}

// A low-rank factor's values: float32, or bfloat16 (the top half of a float32, so widening is exact).
inline float factor_value(float v) { return v; }
inline float factor_value(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f = 0.0f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline __m256 load_factor8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_factor8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
__attribute__((target("avx512f"))) inline __m512 load_factor16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 load_factor16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// target[r, :] += low[r, :] b_t for the rows r of ``runs`` (flattened [start, stop) pairs): an adapter's low-rank
// delta at the mask rows. Per 8 outputs, the rank products are summed in order (fused multiply-add) and added to the
// target once. One call instead of an ATen addmm per run and projection (~90 per pass with masks, each costing more
// to dispatch than its few thousand multiply-adds).
// A fused projection's b_t is block diagonal (each part's rank rows reach only its own outputs), so ``spans`` names,
// per 64 outputs, the rank rows [lo, hi) that are not all zero there: the rest are not read (a multiply-add of an exact
// zero leaves a finite sum as it is, so the numbers stay the same; on the default model 1/3 of qkv's b_t and 1/2 of
// gate_up's are zeros). Rows flagged in ``coarse`` (mask rows that are only drafts) take ``draft`` instead of b_t:
// the same factor in bfloat16, half the bytes (a masked pass of the default model read ~11 MB of float32 factors
// beside ~96 MB of weights, and one mask row's delta cost more than its products).
// AVX-512: rows r0..r0 + R of a run against outputs c0..c0 + 64 at once (each b_t row loaded once for the R rows),
// each output's operations those of the AVX2 loop below (fused multiply-adds over j in order, then one add).
template <int R, class T>
__attribute__((target("avx512f"))) inline void low_rank_tile(const float* lp, int64_t ldl, const T* bp, int64_t j0,
                                                              int64_t j1, int64_t out, float* tp, int64_t ldt,
                                                              int64_t r0, int64_t c0) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) acc[r][q] = _mm512_setzero_ps();
  for (int64_t j = j0; j < j1; ++j) {
    const T* bj = bp + j * out + c0;
    const __m512 b0 = load_factor16(bj), b1 = load_factor16(bj + 16), b2 = load_factor16(bj + 32),
                 b3 = load_factor16(bj + 48);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(lp[(r0 + r) * ldl + j]);
      acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(a, b2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(a, b3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) {
      float* t = tp + (r0 + r) * ldt + c0 + 16 * q;
      _mm512_storeu_ps(t, _mm512_add_ps(_mm512_loadu_ps(t), acc[r][q]));
    }
}

// Rows r0..r0 + count against outputs c0..c1 with rank rows j0..j1, one row and 8 outputs at a time (AVX2; the
// AVX-512 tiles' operations, output by output).
template <class T>
void low_rank_rows(const float* lp, int64_t ldl, const T* bp, int64_t j0, int64_t j1, int64_t out, float* tp,
                   int64_t ldt, int64_t r0, int64_t count, int64_t c0, int64_t c1) {
  const int64_t vec_end = out / 8 * 8;
  for (int64_t r = r0; r < r0 + count; ++r) {
    const float* a = lp + r * ldl;
    float* t = tp + r * ldt;
    for (int64_t c = c0; c + 8 <= c1; c += 8) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t j = j0; j < j1; ++j) acc = _mm256_fmadd_ps(_mm256_set1_ps(a[j]), load_factor8(bp + j * out + c), acc);
      _mm256_storeu_ps(t + c, _mm256_add_ps(_mm256_loadu_ps(t + c), acc));
    }
    for (int64_t c = std::max(c0, vec_end); c < c1; ++c) {
      float acc = 0.0f;
      for (int64_t j = j0; j < j1; ++j) acc = std::fma(a[j], factor_value(bp[j * out + c]), acc);
      t[c] += acc;
    }
  }
}

// The rank rows of b_t that are not all zero in each 64 outputs, as [slices, 2] int32 [lo, hi) (lo = hi: none).
at::Tensor low_rank_spans(const at::Tensor& b_t) {
  TORCH_CHECK(b_t.dim() == 2 && b_t.scalar_type() == at::kFloat && b_t.is_contiguous(),
              "b_t must be a contiguous float32 [rank, out] tensor");
  const int64_t rank = b_t.size(0), out = b_t.size(1), slices = (out + 63) / 64;
  at::Tensor spans = at::empty({slices, 2}, b_t.options().dtype(at::kInt));
  const float* bp = b_t.data_ptr<float>();
  int32_t* sp = spans.data_ptr<int32_t>();
  for (int64_t s = 0; s < slices; ++s) {
    const int64_t c0 = s * 64, c1 = std::min(out, c0 + 64);
    int64_t lo = rank, hi = 0;
    for (int64_t j = 0; j < rank; ++j)
      for (int64_t c = c0; c < c1; ++c)
        if (bp[j * out + c] != 0.0f) {
          lo = std::min(lo, j);
          hi = j + 1;
          break;
        }
    sp[2 * s] = static_cast<int32_t>(std::min(lo, hi));
    sp[2 * s + 1] = static_cast<int32_t>(hi);
  }
  return spans;
}

void low_rank_add_rows(at::Tensor target, const at::Tensor& low, const at::Tensor& b_t, at::IntArrayRef runs,
                       const std::optional<at::Tensor>& draft, const std::optional<at::Tensor>& spans,
                       const uint8_t* coarse) {
  if (b_t.numel() == 0 || runs.empty()) return;
  const int64_t rank = b_t.size(0), out = b_t.size(1);
  TORCH_CHECK(b_t.dim() == 2 && b_t.scalar_type() == at::kFloat && b_t.is_contiguous(),
              "b_t must be a contiguous float32 [rank, out] tensor");
  TORCH_CHECK(target.dim() == 2 && target.scalar_type() == at::kFloat && target.stride(1) == 1 &&
                  target.size(1) == out,
              "target must be a float32 [rows, out] tensor with unit column stride");
  TORCH_CHECK(low.dim() == 2 && low.scalar_type() == at::kFloat && low.stride(1) == 1 && low.size(1) == rank &&
                  low.size(0) == target.size(0),
              "low must be a float32 [rows, rank] tensor with unit column stride");
  TORCH_CHECK(runs.size() % 2 == 0, "runs must be [start, stop) pairs");
  const int64_t slices = (out + 63) / 64;
  if (draft.has_value())
    TORCH_CHECK(draft->scalar_type() == at::kBFloat16 && draft->is_contiguous() && draft->size(0) == rank &&
                    draft->size(1) == out,
                "the draft factor must be a contiguous bfloat16 [rank, out] tensor like b_t");
  if (spans.has_value())
    TORCH_CHECK(spans->scalar_type() == at::kInt && spans->is_contiguous() && spans->numel() == 2 * slices,
                "spans must be a contiguous int32 [", slices, ", 2] tensor (low_rank_spans of b_t)");
  const float* bp = b_t.data_ptr<float>();
  const uint16_t* dp = draft.has_value() ? reinterpret_cast<const uint16_t*>(draft->data_ptr<at::BFloat16>()) : nullptr;
  const int32_t* sp = spans.has_value() ? spans->data_ptr<int32_t>() : nullptr;
  const float* lp = low.data_ptr<float>();
  float* tp = target.data_ptr<float>();
  const int64_t ldt = target.stride(0), ldl = low.stride(0);
  // The runs' rows in tiles of up to 4 x 64-output slices: independent work (each output's sum is the same whatever
  // the split), AVX-512 tiles where the CPU has them and every slice is whole, else the AVX2 loop row by row; a
  // tile's rows are all drafts or none, so they share one factor.
  std::vector<std::pair<int64_t, int>> row_tiles;
  for (size_t i = 0; i + 1 < runs.size(); i += 2) {
    TORCH_CHECK(0 <= runs[i] && runs[i] <= runs[i + 1] && runs[i + 1] <= target.size(0), "run out of range");
    for (int64_t r = runs[i]; r < runs[i + 1];) {
      int count = 1;  // up to 4 rows, all drafts or none
      while (count < 4 && r + count < runs[i + 1] &&
             (coarse == nullptr || coarse[r + count] == coarse[r]))
        ++count;
      row_tiles.emplace_back(r, count);
      r += count;
    }
  }
  static const bool has_avx512 = cpu_has_avx512();
  const bool wide = has_avx512 && out % 64 == 0;
  const int64_t work = static_cast<int64_t>(row_tiles.size()) * slices;
  const int64_t grain = std::max<int64_t>(1, 128 / std::max<int64_t>(1, rank));  // ~32k multiply-adds a chunk
  at::parallel_for(0, work, grain, [&](int64_t begin, int64_t end) {
    for (int64_t slot = begin; slot < end; ++slot) {
      const auto [r0, count] = row_tiles[slot / slices];
      const int64_t s = slot % slices, c0 = s * 64, c1 = std::min(out, c0 + 64);
      const int64_t j0 = sp != nullptr ? sp[2 * s] : 0, j1 = sp != nullptr ? sp[2 * s + 1] : rank;
      const bool drafted = dp != nullptr && coarse != nullptr && coarse[r0] != 0;
      const auto tile = [&](const auto* b) {
        if (!wide) {
          low_rank_rows(lp, ldl, b, j0, j1, out, tp, ldt, r0, count, c0, c1);
          return;
        }
        switch (count) {
          case 4: low_rank_tile<4>(lp, ldl, b, j0, j1, out, tp, ldt, r0, c0); break;
          case 3: low_rank_tile<3>(lp, ldl, b, j0, j1, out, tp, ldt, r0, c0); break;
          case 2: low_rank_tile<2>(lp, ldl, b, j0, j1, out, tp, ldt, r0, c0); break;
          default: low_rank_tile<1>(lp, ldl, b, j0, j1, out, tp, ldt, r0, c0); break;
        }
      };
      if (drafted)
        tile(dp);
      else
        tile(bp);
    }
  });
}

void low_rank_add(at::Tensor target, const at::Tensor& low, const at::Tensor& b_t, at::IntArrayRef runs,
                  const std::optional<at::Tensor>& draft, const std::optional<at::Tensor>& spans,
                  at::IntArrayRef coarse_runs) {
  const std::vector<uint8_t> coarse = coarse_flags(coarse_runs, target.size(0));
  low_rank_add_rows(target, low, b_t, runs, draft, spans, coarse.empty() ? nullptr : coarse.data());
}

// y[rows, :out] += y[rows, out:] b_t at the mask rows; returns y[:, :out].
at::Tensor with_delta(const at::Tensor& y, int64_t out, const at::Tensor& b_t, at::IntArrayRef runs,
                      const std::optional<at::Tensor>& draft, const std::optional<at::Tensor>& spans,
                      const uint8_t* coarse) {
  // a pass without mask rows has no extra columns: y itself (each slice is a tensor made and freed, ~1-2 us with the
  // caches cold between a pass's products; 60 of them a one-token pass)
  if (runs.empty() || b_t.numel() == 0) return y.size(1) == out ? y : y.slice(1, 0, out);
  low_rank_add_rows(y.slice(1, 0, out), y.slice(1, out), b_t, runs, draft, spans, coarse);
  return y.slice(1, 0, out);
}

// x += (block product into x) and, at the mask rows, the adapter's delta from the extra rows' product ``low``.
void add_delta(at::Tensor& x, const at::Tensor& low, const at::Tensor& b_t, at::IntArrayRef runs,
               const std::optional<at::Tensor>& draft, const std::optional<at::Tensor>& spans, const uint8_t* coarse) {
  low_rank_add_rows(x, low, b_t, runs, draft, spans, coarse);
}

// ``caches`` holds every layer's cache of every sequence, layer-major (layer l, sequence s at l * S + s); sequence s
// has ``rows[s]`` rows of x, in order, and its new tokens go to positions starts[s]..; ``mask_runs`` are the mask
// rows as flattened [start, stop) pairs.
void decode_layers(at::Tensor x, const c10::intrusive_ptr<LayerStack>& stack, at::TensorList caches,
                   const at::Tensor& rope, at::IntArrayRef starts, at::IntArrayRef rows, at::IntArrayRef mask_runs,
                   int64_t num_heads, int64_t kv_heads, int64_t head_dim, int64_t inter, double eps, double scale,
                   at::IntArrayRef coarse_runs, int64_t grid_bits) {
  check_grid_bits(grid_bits);
  const int64_t layers = stack->layers();
  const int64_t sequences = static_cast<int64_t>(starts.size());
  TORCH_CHECK(static_cast<int64_t>(caches.size()) == layers * sequences && sequences > 0,
              "decode_layers needs one cache per layer and sequence");
  TORCH_CHECK(mask_runs.size() % 2 == 0, "mask_runs must be [start, stop) pairs");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be contiguous float32");
  const int64_t q_dim = num_heads * head_dim, kv_dim = kv_heads * head_dim;
  const int64_t qkv_out = q_dim + 2 * kv_dim;
  TORCH_CHECK(rope.scalar_type() == at::kComplexFloat, "rope must be complex64 (cos + i sin per pair)");
  const at::Tensor pairs = at::view_as_real(rope);
  // The adapter's extra rows (its A factors) are multiplied only for passes with mask rows, the only rows whose
  // delta is added (a one-token pass reads ~160 KB less float32 per adapted layer).
  const bool masked = !mask_runs.empty();
  // Rows on the 8-bit grid (record paths): mask rows whose products are drafts only, never a real row's input.
  const std::vector<uint8_t> coarse_rows = coarse_flags(coarse_runs, x.size(0));
  const uint8_t* coarse = coarse_rows.empty() ? nullptr : coarse_rows.data();
  for (int64_t layer = 0; layer < layers; ++layer) {
    // per projection: qs, scale, minimum, extra rows (adapter A), adapter B^T, lanes; norms at 0 and 13; tiles at
    // 26-29; per projection the adapter's bfloat16 B^T for draft rows and B^T's spans at 30-37
    const at::Tensor* w = stack->weights.data() + layer * kPerLayer;
    const std::optional<at::Tensor>* o = stack->optional.data() + layer * kPerLayer;
    const BlockView* v = stack->views.data() + 4 * layer;
    const auto view = [&](int part) { return masked ? v[part] : without_extra(v[part]); };
    const at::Tensor y = view_linear<Q41, Q41Lanes>(x, view(0), 16, std::nullopt, eps, coarse, grid_bits);
    const at::Tensor qkv = with_delta(y, qkv_out, w[5], mask_runs, o[30], o[31], coarse);
    const at::Tensor attended = attend_pairs(qkv, pairs, caches.slice(layer * sequences, sequences), starts, rows,
                                             num_heads, kv_heads, head_dim, scale);
    const at::Tensor low_o = view_linear<Q41, Q41Lanes>(attended, view(1), 16, x, eps, coarse, grid_bits);
    add_delta(x, low_o, w[11], mask_runs, o[32], o[33], coarse);
    const at::Tensor gu_all = view_linear<Q41, Q41Lanes>(x, view(2), 16, std::nullopt, eps, coarse, grid_bits);
    const at::Tensor gate_up = with_delta(gu_all, 2 * inter, w[18], mask_runs, o[34], o[35], coarse);
    const at::Tensor act = silu_mul(gate_up, inter);
    const at::Tensor low_d = view_linear<Q41, Q41Lanes>(act, view(3), 16, x, eps, coarse, grid_bits);
    add_delta(x, low_d, w[24], mask_runs, o[36], o[37], coarse);
  }
}

}  // namespace

TORCH_LIBRARY(agent_mtp_blockq, m) {
  // extra: float32 rows multiplied after the block rows; residual: add the block rows' products into it (in place;
  // the result then holds only the extra rows'); norm: multiply rms_norm(x, eps) * norm instead of x; lanes: the
  // quants in the lane kernels' layout, which passes of kLaneRows rows or more (per kind) then read; grid_bits: of the
  // exact rows' grid on the record paths (AMX, VNNI): 24 (float32-accurate) or 16 (VNNI: 16 products a block, not 24).
  m.def(
      "q4_1_linear(Tensor x, Tensor qs, Tensor scale, Tensor minimum, Tensor? extra=None, Tensor(a!)? residual=None, "
      "Tensor? norm=None, float eps=1e-5, Tensor? lanes=None, Tensor? tiles=None, int[] coarse_runs=[], "
      "int grid_bits=24) -> Tensor");
  m.def(
      "q8_0_linear(Tensor x, Tensor qs, Tensor scale, Tensor? extra=None, Tensor(a!)? residual=None, "
      "Tensor? norm=None, float eps=1e-5, Tensor? lanes=None, Tensor? tiles=None, int[] coarse_runs=[], "
      "int grid_bits=24) -> Tensor");
  // q8_0_linear with the rows of screen_runs (greedy rows) on the 8-bit grid and the outputs that could be their
  // argmax recomputed exactly (see q8_0_screened); returns (y, record streams recomputed)
  m.def(
      "q8_0_screened(Tensor x, Tensor qs, Tensor scale, Tensor? extra, Tensor? norm, float eps, Tensor? lanes, "
      "Tensor tiles, int[] coarse_runs, int grid_bits, Tensor bounds, Tensor peak_bounds, int[] excluded, int valid, "
      "int[] screen_runs) -> (Tensor, int)");
  // which kernel classes take their AVX-512 forms (the same numbers as the AVX2 ones; bits 1: row kernels and
  // attention, 2: lane kernels); 0 where the CPU lacks them
  m.def("avx512_forms(int request=-1) -> int", &avx512_forms);
  // whether passes with a tile layout multiply on AMX-INT8 tiles (1: where the CPU has them, 0: not, -1: as is)
  m.def("amx_tiles(int request=-1) -> bool", &amx_tiles);
  // whether the CPU and the OS let this process use AMX-INT8 tiles
  m.def("amx_supported() -> bool", &amx_supported);
  // whether block passes with a record layout multiply on AVX-512 VNNI where AMX is not in use (1: where the CPU
  // has it, 0: not, -1: as is); whether the CPU has it
  m.def("vnni_records(int request=-1) -> bool", &vnni_records);
  m.def("vnni_supported() -> bool", &vnni_supported);
  // where AMX and VNNI are both on: the pass weight from which the tiles serve (lighter passes VNNI) and an 8-bit
  // row's weight, in 1/1024 of an exact row (>= 0 sets, -1 reads); which path a pass of rows (light: 8-bit) takes
  m.def("tiles_from(int weight=-1, int light_weight=-1) -> int[]", &tiles_from);
  m.def("records_path(int rows, int light=0) -> int", &records_path_of);
  // where the tiles serve a pass and VNNI is on: the most rows of an exact pass's last partial chunk that VNNI
  // multiplies beside the tiles' full chunks (0-8 sets, -1 reads; 0: the tiles take every row)
  m.def("tail_rows(int rows=-1) -> int", &tail_rows);
  m.def("buffered_rows(int rows=-1) -> int", &buffered_rows);
  // how attention's AVX2 loops ask for the next chunk of keys / values: 1 a few lines per block of 8 keys (the
  // default), 0 the whole chunk at once (as before); -1 reads. The same numbers either way.
  m.def("attention_prefetch(int request=-1) -> int", &attention_prefetch);
  // the most rows a VNNI chunk holds (16, the default; 8 as before 2026-12-07); -1 reads. The same numbers either way.
  m.def("vnni_chunk(int request=-1) -> int", &vnni_chunk);
  // target[r] += low[r] b_t at the rows of runs (flattened [start, stop) pairs): an adapter's delta at the mask rows
  // (draft: b_t in bfloat16 for the rows of coarse_runs, mask rows that are only drafts; spans: low_rank_spans(b_t),
  // the rank rows not all zero per 64 outputs); low_rank_spans: those spans, [ceil(out / 64), 2] int32
  m.def(
      "low_rank_add(Tensor(a!) target, Tensor low, Tensor b_t, int[] runs, Tensor? draft=None, Tensor? spans=None, "
      "int[] coarse_runs=[]) -> ()");
  m.def("low_rank_spans(Tensor b_t) -> Tensor");
  // silu(gate_up[:, :inter]) * gate_up[:, inter:2 inter] (a Llama MLP's activation) in one call
  m.def("silu_mul(Tensor gate_up, int inter) -> Tensor");
  // blocks recovered from float32 values [rows, blocks, 32] in one pass (blockq._q4_1_blocks / _q8_0_blocks)
  m.def("recover_q4_1(Tensor blocks) -> Tensor[]");
  m.def("recover_q8_0(Tensor blocks) -> Tensor[]");
  // every decoder layer of a short block pass (one sequence or a batch), in place on x and the caches (see above)
  m.class_<LayerStack>("LayerStack").def(torch::init<std::vector<at::Tensor>>()).def("layers", &LayerStack::layers);
  m.def(
      "decode_layers(Tensor(a!) x, __torch__.torch.classes.agent_mtp_blockq.LayerStack weights, Tensor(b!)[] caches, "
      "Tensor rope, int[] starts, int[] rows, int[] mask_runs, int num_heads, int kv_heads, int head_dim, int inter, "
      "float eps, float scale, int[] coarse_runs=[], int grid_bits=24) -> ()");
  // RoPE, the cache write and causal attention of a pass's new rows, every sequence (segment) of it in one call
  m.def(
      "attend(Tensor(a!) qkv, Tensor rope, Tensor(b!)[] caches, int[] starts, int[] rows, int num_heads, "
      "int kv_heads, int head_dim, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(agent_mtp_blockq, CPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("attend", &attend);
  m.impl("low_rank_add", &low_rank_add);
  m.impl("low_rank_spans", &low_rank_spans);
  m.impl("silu_mul", &silu_mul);
  m.impl("recover_q4_1", &recover_q4_1);
  m.impl("recover_q8_0", &recover_q8_0);
  m.impl("q4_1_linear", &q4_1_linear);
  m.impl("q8_0_linear", &q8_0_linear);
  m.impl("q8_0_screened", &q8_0_screened);
}
