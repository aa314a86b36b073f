// y = x @ W (+ bias) on the CPU for few rows (decode steps): x float32 [M, K],
// W [K, N] packed once (PackFloat32, PackBFloat16, PackInt8) into the layout
// the kernels stream, y float32 [M, N]. Framework-free: raw pointers only.
//
// Packed layout. The columns of W are cut into panels of kPanelWidth (32)
// columns; the last one is padded with zero columns, so any N works. Panels
// lie one after another; inside a panel the K rows of its 32 weights are
// consecutive, so a thread that owns a range of panels reads one contiguous
// stretch of memory, front to back, once per block of rows of x:
//   float32:  float    [panels][K][32]          w[k][p*32 + c]
//   bfloat16: uint16   [panels][ceil(K/2)][32][2]
//             the two rows k = 2s, 2s+1 of a column side by side (the pair
//             vdpbf16ps multiplies; widening splits a pair with a shift and a
//             mask); an odd K is padded with a zero row
//   int8:     int8     [panels][K][32], symmetric, with float scales
//             [panels][ceil(K/G)][32]: w[k][c] = q[k][c] * scale[k/G][c] for a
//             group size G along K (G = K: one scale per output column)
// The layout does not depend on the instruction set: weights packed once run
// on every path.
//
// Every path accumulates in float32 in order of k (one pair of k at a time on
// the AVX512-BF16 path). They multiply the same float32 values of x and of the
// (widened or dequantized) weights and differ only in the rounding of that
// order (an FMA rounds once, the scalar path may round twice), except that the
// AVX512-BF16 path multiplies bfloat16 weights by x rounded to bfloat16.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_avx512_transpose.h"
#include "cpu_bfloat16.h"
#include "cpu_isa.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define PADDLE_STEP_CPU_X86 1
#include <immintrin.h>
#endif

namespace paddle_step::cpu {

constexpr int64_t kPanelWidth = 32;

enum class WeightFormat { kFloat32, kBFloat16, kInt8 };

inline const char* WeightFormatName(WeightFormat format) {
  switch (format) {
    case WeightFormat::kFloat32:
      return "float32";
    case WeightFormat::kBFloat16:
      return "bfloat16";
    case WeightFormat::kInt8:
      return "int8";
  }
  return "unknown";
}

inline int64_t PanelCount(int64_t n) {
  return (n + kPanelWidth - 1) / kPanelWidth;
}

// Rows of K a panel stores (bfloat16: pairs of rows).
inline int64_t PanelRows(WeightFormat format, int64_t k) {
  return format == WeightFormat::kBFloat16 ? (k + 1) / 2 : k;
}

// Elements (of the format's storage type) in one panel.
inline int64_t PanelElements(WeightFormat format, int64_t k) {
  const int64_t per_row =
      format == WeightFormat::kBFloat16 ? 2 * kPanelWidth : kPanelWidth;
  return PanelRows(format, k) * per_row;
}

inline int64_t GroupCount(int64_t k, int64_t group_size) {
  return (k + group_size - 1) / group_size;
}

// ---------------------------------------------------------------- packing

// W [k, n] as the packers read it: stored row-major, or as its transpose
// [n, k] row-major (a tied LM head is the embedding [vocab, hidden]: packed
// from it directly, without a transposed copy of its hundreds of MB).
template <typename T>
struct SourceMatrix {
  const T* data;
  int64_t k;
  int64_t n;
  bool transposed;

  T operator()(int64_t row, int64_t column) const {
    return transposed ? data[column * k + row] : data[row * n + column];
  }
};

// The packers fill panels [begin, end) of `packed` (threads take ranges).

// w: float32 [k, n]. packed: PanelCount(n) * PanelElements(kFloat32, k).
inline void PackFloat32(const SourceMatrix<float>& w, float* packed,
                        int64_t begin, int64_t end) {
  const int64_t k = w.k;
  for (int64_t p = begin; p < end; ++p) {
    const int64_t first = p * kPanelWidth;
    const int64_t width = std::min(kPanelWidth, w.n - first);
    float* panel = packed + p * PanelElements(WeightFormat::kFloat32, k);
    for (int64_t row = 0; row < k; ++row) {
      float* out = panel + row * kPanelWidth;
      if (w.transposed) {
        for (int64_t c = 0; c < width; ++c) out[c] = w(row, first + c);
      } else {
        std::memcpy(out, w.data + row * w.n + first, width * sizeof(float));
      }
      std::fill(out + width, out + kPanelWidth, 0.0f);
    }
  }
}

// w: [k, n], float32 (rounded to bfloat16) or bfloat16 bits (copied).
// packed: PanelCount(n) * PanelElements(kBFloat16, k) uint16.
template <typename Source>
inline void PackBFloat16(const SourceMatrix<Source>& w, uint16_t* packed,
                         int64_t begin, int64_t end) {
  static_assert(std::is_same_v<Source, float> ||
                std::is_same_v<Source, uint16_t>);
  const int64_t k = w.k;
  const int64_t pairs = PanelRows(WeightFormat::kBFloat16, k);
  for (int64_t p = begin; p < end; ++p) {
    const int64_t first = p * kPanelWidth;
    const int64_t width = std::min(kPanelWidth, w.n - first);
    uint16_t* panel = packed + p * PanelElements(WeightFormat::kBFloat16, k);
    std::fill(panel, panel + pairs * 2 * kPanelWidth, uint16_t{0});
    for (int64_t row = 0; row < k; ++row) {
      uint16_t* out = panel + (row / 2) * 2 * kPanelWidth + row % 2;
      for (int64_t c = 0; c < width; ++c) {
        if constexpr (std::is_same_v<Source, float>) {
          out[2 * c] = BFloat16FromFloat(w(row, first + c));
        } else {
          out[2 * c] = w(row, first + c);
        }
      }
    }
  }
}

// w: [k, n], float32 or bfloat16 bits (widened exactly), quantized per column
// and group of group_size rows: scale = max|w| / 127, q = round(w / scale).
// packed: PanelCount(n) * PanelElements(kInt8, k) int8; scales:
// PanelCount(n) * GroupCount(k, group_size) * kPanelWidth float.
template <typename Source>
inline void PackInt8(const SourceMatrix<Source>& source, int64_t group_size,
                     int8_t* packed, float* scales, int64_t begin,
                     int64_t end) {
  static_assert(std::is_same_v<Source, float> ||
                std::is_same_v<Source, uint16_t>);
  const auto w = [&](int64_t row, int64_t column) {
    return Widened(source(row, column));
  };
  const int64_t k = source.k;
  const int64_t groups = GroupCount(k, group_size);
  for (int64_t p = begin; p < end; ++p) {
    const int64_t first = p * kPanelWidth;
    const int64_t width = std::min(kPanelWidth, source.n - first);
    int8_t* panel = packed + p * PanelElements(WeightFormat::kInt8, k);
    float* panel_scales = scales + p * groups * kPanelWidth;
    std::fill(panel, panel + k * kPanelWidth, int8_t{0});
    std::fill(panel_scales, panel_scales + groups * kPanelWidth, 0.0f);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t row_end = std::min(k, (g + 1) * group_size);
      for (int64_t c = 0; c < width; ++c) {
        float largest = 0.0f;
        for (int64_t row = g * group_size; row < row_end; ++row) {
          largest = std::max(largest, std::fabs(w(row, first + c)));
        }
        if (largest == 0.0f) continue;  // all-zero group: q = 0, scale = 0
        const float scale = largest / 127.0f;
        panel_scales[g * kPanelWidth + c] = scale;
        for (int64_t row = g * group_size; row < row_end; ++row) {
          const float q = std::nearbyint(w(row, first + c) / scale);
          panel[row * kPanelWidth + c] =
              static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f));
        }
      }
    }
  }
}

// ---------------------------------------------------------------- products

// Packed weights, as the kernels read them.
struct PackedWeights {
  WeightFormat format = WeightFormat::kFloat32;
  int64_t k = 0;
  int64_t n = 0;
  const void* data = nullptr;     // the panels
  const float* scales = nullptr;  // int8 only
  int64_t group_size = 0;         // int8 only
  // Panel `panel`'s elements, of the format's storage type T.
  template <typename T>
  const T* Panel(int64_t panel) const {
    return static_cast<const T*>(data) + panel * PanelElements(format, k);
  }
};

// PrefetchAhead's distance until a measurement chooses one.
constexpr int64_t kDefaultPrefetchBytes = 2048;

struct LinearProblem {
  const float* x = nullptr;  // [m, k], rows x_stride apart
  int64_t m = 0;
  int64_t x_stride = 0;
  PackedWeights w;
  const float* bias = nullptr;  // [n] or null
  float* y = nullptr;           // [m, n], rows y_stride apart
  int64_t y_stride = 0;
  // x in the form the dot-product kernels multiply (PrepareActivations):
  // [m][x_words_stride] 32-bit words, each a pair of k (bfloat16) or a quad
  // of k (uint8: x / x_scales[row] rounded, plus 128).
  const uint32_t* x_words = nullptr;
  int64_t x_words_stride = 0;
  const float* x_scales = nullptr;  // [m], uint8 quads only
  // x's rows in tiles of kFloat32TileRows for the AVX-512 path's float32
  // tiles (PrepareActivations): [ceil(m / 12)][k][12] floats, a short last
  // tile padded with zeros; null where the tiles read x itself.
  const float* x_tiles = nullptr;
  // How far ahead of its loads a tile asks for weights (PrefetchAhead), in
  // bytes: into the first-level cache at prefetch_bytes (0 leaves them to the
  // hardware prefetcher), and into the second-level cache at
  // prefetch_l2_bytes as well (0: not at all). The best distances depend on
  // the CPU, its memory and the tile's rows, so the caller passes measured
  // ones.
  int64_t prefetch_bytes = kDefaultPrefetchBytes;
  int64_t prefetch_l2_bytes = 0;
};

// The rows of x a tile of a product multiplies: [row, row + its rows).
struct TileRows {
  TileRows(const LinearProblem& p, int64_t row)
      : x(p.x + row * p.x_stride), x_stride(p.x_stride) {}
  const float* x;  // the tile's first row
  int64_t x_stride;
};

// The rows of the AVX-512 path's float32 tiles, and the fewest rows of x it
// reads in tiles (x_tiles): 12 rows read from one pointer, where 12 row
// pointers did not fit the registers (the tile spilled them, and ran 8-14%
// slower at M = 32 on an Intel Xeon); up to 8 rows gained nothing.
constexpr int64_t kFloat32TileRows = 12;
constexpr int64_t kFloat32TiledFromRows = 9;

// The form of x a product multiplies (ActivationFormOf).
enum class ActivationForm {
  kFloat32,        // x as it is
  kFloat32Tiles,   // x's rows in tiles of 12 (x_tiles), for float32 weights
  kFloat32Tiles6,  // x's rows in tiles of 6 (x_tiles), the AVX2 path's
  kBFloat16Pairs,  // x rounded to bfloat16, for bfloat16 weights (vdpbf16ps)
  kUint8Quads,     // x quantized per row, for int8 weights (vpdpbusd)
};

// The largest K whose uint8 x int8 sums fit int32: K * 255 * 127 < 2^31.
constexpr int64_t kMaxQuadK = 65536;

namespace scalar_path {

// One panel, rows [row, row + rows) of x: plain C++ over the packed layout.
inline void PanelRows(const LinearProblem& p, int64_t panel, int64_t row,
                      int64_t rows) {
  const PackedWeights& w = p.w;
  const int64_t first = panel * kPanelWidth;
  const int64_t width = std::min(kPanelWidth, w.n - first);
  const int64_t groups =
      w.format == WeightFormat::kInt8 ? GroupCount(w.k, w.group_size) : 0;
  for (int64_t r = row; r < row + rows; ++r) {
    const float* x = p.x + r * p.x_stride;
    float acc[kPanelWidth] = {};
    for (int64_t kk = 0; kk < w.k; ++kk) {
      for (int64_t c = 0; c < kPanelWidth; ++c) {
        float weight;
        if (w.format == WeightFormat::kFloat32) {
          weight = w.Panel<float>(panel)[kk * kPanelWidth + c];
        } else if (w.format == WeightFormat::kBFloat16) {
          weight = FloatFromBFloat16(w.Panel<uint16_t>(
              panel)[(kk / 2) * 2 * kPanelWidth + 2 * c + kk % 2]);
        } else {
          const int8_t q = w.Panel<int8_t>(panel)[kk * kPanelWidth + c];
          const float scale =
              w.scales[(panel * groups + kk / w.group_size) * kPanelWidth + c];
          weight = static_cast<float>(q) * scale;
        }
        acc[c] += x[kk] * weight;
      }
    }
    float* y = p.y + r * p.y_stride + first;
    for (int64_t c = 0; c < width; ++c) {
      y[c] = p.bias ? acc[c] + p.bias[first + c] : acc[c];
    }
  }
}

inline void Panels(const LinearProblem& p, int64_t begin, int64_t end) {
  for (int64_t panel = begin; panel < end; ++panel) {
    PanelRows(p, panel, 0, p.m);
  }
}

}  // namespace scalar_path

// The one of three (a path's kernels for each format) that `format` runs.
template <typename T>
inline T ForFormat(WeightFormat format, T float32, T bfloat16, T int8) {
  switch (format) {
    case WeightFormat::kBFloat16:
      return bfloat16;
    case WeightFormat::kInt8:
      return int8;
    case WeightFormat::kFloat32:
      break;
  }
  return float32;
}

// Panels [begin, end) in tiles of up to max_rows rows of x, each panel's
// tiles one after another (its weights stay in cache between them):
// tiles[rows](p, panel, first row), tiles[0] unused.
template <typename Tile>
inline void RowTiles(const LinearProblem& p, int64_t begin, int64_t end,
                     const Tile* tiles, int64_t max_rows) {
  for (int64_t panel = begin; panel < end; ++panel) {
    for (int64_t row = 0; row < p.m; row += max_rows) {
      tiles[std::min(max_rows, p.m - row)](p, panel, row);
    }
  }
}

#ifdef PADDLE_STEP_CPU_X86

#define PADDLE_STEP_INLINE inline __attribute__((always_inline))

// A 12-row tile table's entries: none for 0 rows, then tile<1> .. tile<12>.
#define PADDLE_STEP_TILES_1_TO_12(tile)                                     \
  nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>, tile<7>, \
      tile<8>, tile<9>, tile<10>, tile<11>, tile<12>

// ------------------------------------------------------------------ AVX-512
// A tile is kAvx512Rows rows of x times one panel (two 16-float vectors):
// 2 * rows accumulators live in registers for the whole of K, each weight
// vector is loaded (and widened) once per tile and used by every row.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,fma")
namespace avx512_path {

constexpr int kRows = 8;

// Asks for the cache line `ahead` bytes past `at` in the panels, and where
// `l2_ahead` is not 0 for the one that far past it into the second-level
// cache: a tile that computes between its loads reads memory slower than the
// hardware prefetcher alone keeps up with (measured: the int8 LM head at M = 8
// took twice as long without it; on an Intel Xeon, float32 products of 1 and 8
// rows streamed 10-16% faster with lines 8 KB ahead asked into L2 besides
// those 2 KB ahead). Call once per 64 bytes of weights read.
PADDLE_STEP_INLINE void PrefetchAhead(const void* at, int64_t ahead,
                                      int64_t l2_ahead) {
  const char* line = static_cast<const char*>(at);
  _mm_prefetch(line + ahead, _MM_HINT_T0);
  if (l2_ahead) _mm_prefetch(line + l2_ahead, _MM_HINT_T1);
}

// The sums of a tile: its kTileRows rows of x times one panel.
template <int kTileRows>
struct Accumulators : TileRows {
  __m512 sum[kTileRows][2];

  PADDLE_STEP_INLINE Accumulators(const LinearProblem& p, int64_t row)
      : TileRows(p, row) {
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r) {
      sum[r][0] = _mm512_setzero_ps();
      sum[r][1] = _mm512_setzero_ps();
    }
  }

  // sum[r] += x[r][kk] * (w0, w1) for every row of the tile.
  PADDLE_STEP_INLINE void Add(int64_t kk, __m512 w0, __m512 w1) {
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * x_stride + kk]);
      sum[r][0] = _mm512_fmadd_ps(xv, w0, sum[r][0]);
      sum[r][1] = _mm512_fmadd_ps(xv, w1, sum[r][1]);
    }
  }

  // sum[r] += x_k[r] * (w0, w1) for every row of the tile: x_k holds one k's
  // value of each row side by side (x_tiles).
  PADDLE_STEP_INLINE void AddSideBySide(const float* x_k, __m512 w0,
                                        __m512 w1) {
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r) {
      const __m512 xv = _mm512_set1_ps(x_k[r]);
      sum[r][0] = _mm512_fmadd_ps(xv, w0, sum[r][0]);
      sum[r][1] = _mm512_fmadd_ps(xv, w1, sum[r][1]);
    }
  }

  // Writes the tile: rows [row, row + kTileRows) of y, the panel's columns
  // (those below n), plus the bias.
  PADDLE_STEP_INLINE void Store(const LinearProblem& p, int64_t panel,
                                int64_t row) {
    const int64_t first = panel * kPanelWidth;
    float* y = p.y + row * p.y_stride + first;
    const float* bias = p.bias ? p.bias + first : nullptr;
    const int64_t width = std::min(kPanelWidth, p.w.n - first);
    const int64_t y_stride = p.y_stride;
    const __mmask16 low = static_cast<__mmask16>(
        width >= 16 ? 0xFFFF : (1u << width) - 1);
    const __mmask16 high = static_cast<__mmask16>(
        width >= 32 ? 0xFFFF : width <= 16 ? 0 : (1u << (width - 16)) - 1);
    __m512 b0 = _mm512_setzero_ps();
    __m512 b1 = _mm512_setzero_ps();
    if (bias) {
      b0 = _mm512_maskz_loadu_ps(low, bias);
      b1 = _mm512_maskz_loadu_ps(high, bias + 16);
    }
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r) {
      __m512 v0 = sum[r][0];
      __m512 v1 = sum[r][1];
      if (bias) {
        v0 = _mm512_add_ps(v0, b0);
        v1 = _mm512_add_ps(v1, b1);
      }
      _mm512_mask_storeu_ps(y + r * y_stride, low, v0);
      _mm512_mask_storeu_ps(y + r * y_stride + 16, high, v1);
    }
  }
};

template <int kTileRows>
void TileFloat32(const LinearProblem& p, int64_t panel, int64_t row) {
  const int64_t k = p.w.k;
  const float* w = p.w.Panel<float>(panel);
  const int64_t ahead = p.prefetch_bytes;
  const int64_t l2_ahead = p.prefetch_l2_bytes;
  Accumulators<kTileRows> acc(p, row);
  // add(kk, w0, w1) for every k: one loop for either form of x.
  const auto over_k = [&](auto add) {
    for (int64_t kk = 0; kk < k; ++kk) {
      PrefetchAhead(w + kk * kPanelWidth, ahead, l2_ahead);
      PrefetchAhead(w + kk * kPanelWidth + 16, ahead, l2_ahead);
      add(kk, _mm512_loadu_ps(w + kk * kPanelWidth),
          _mm512_loadu_ps(w + kk * kPanelWidth + 16));
    }
  };
  if (p.x_tiles) {
    const float* x = p.x_tiles + row * k;  // row: a multiple of 12
    over_k([&](int64_t kk, __m512 w0, __m512 w1) {
      acc.AddSideBySide(x + kk * kFloat32TileRows, w0, w1);
    });
  } else {
    over_k([&](int64_t kk, __m512 w0, __m512 w1) { acc.Add(kk, w0, w1); });
  }
  acc.Store(p, panel, row);
}

// A pair row (k = 2s, 2s+1) of a bfloat16 panel widened to float32: the low
// half of each 32-bit lane is row 2s, the high half row 2s + 1.
PADDLE_STEP_INLINE __m512 EvenRow(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
}
PADDLE_STEP_INLINE __m512 OddRow(__m512i pairs) {
  return _mm512_castsi512_ps(
      _mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

template <int kTileRows>
void TileBFloat16(const LinearProblem& p, int64_t panel, int64_t row) {
  const int64_t k = p.w.k;
  const uint16_t* w = p.w.Panel<uint16_t>(panel);
  const int64_t ahead = p.prefetch_bytes;
  const int64_t l2_ahead = p.prefetch_l2_bytes;
  Accumulators<kTileRows> acc(p, row);
  const int64_t full_pairs = k / 2;
  for (int64_t s = 0; s < full_pairs; ++s) {
    const uint16_t* pair_row = w + s * 2 * kPanelWidth;
    PrefetchAhead(pair_row, ahead, l2_ahead);
    PrefetchAhead(pair_row + 32, ahead, l2_ahead);
    const __m512i low = _mm512_loadu_si512(pair_row);
    const __m512i high = _mm512_loadu_si512(pair_row + 32);
    acc.Add(2 * s, EvenRow(low), EvenRow(high));
    acc.Add(2 * s + 1, OddRow(low), OddRow(high));
  }
  if (k % 2) {  // the last row alone: its pair is padding, x has no column k
    const uint16_t* pair_row = w + full_pairs * 2 * kPanelWidth;
    acc.Add(k - 1, EvenRow(_mm512_loadu_si512(pair_row)),
            EvenRow(_mm512_loadu_si512(pair_row + 32)));
  }
  acc.Store(p, panel, row);
}

// 16 int8 weights as float32 (exact): the scales multiply sums, not weights.
PADDLE_STEP_INLINE __m512 Int8Values(const int8_t* q) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}

// acc += x[:, kk] * q[kk] for the rows [begin, end) of K of an int8 panel.
template <int kTileRows>
PADDLE_STEP_INLINE void AddInt8Rows(const int8_t* w, int64_t begin,
                                    int64_t end, const LinearProblem& p,
                                    Accumulators<kTileRows>& acc) {
  const int64_t ahead = p.prefetch_bytes;
  const int64_t l2_ahead = p.prefetch_l2_bytes;
  for (int64_t kk = begin; kk < end; ++kk) {
    if (kk % 2 == 0) PrefetchAhead(w + kk * kPanelWidth, ahead, l2_ahead);
    acc.Add(kk, Int8Values(w + kk * kPanelWidth),
            Int8Values(w + kk * kPanelWidth + 16));
  }
}

// One scale per column (a single group): the sums over K times the scale.
template <int kTileRows>
void TileInt8(const LinearProblem& p, int64_t panel, int64_t row) {
  const int64_t k = p.w.k;
  const int8_t* w = p.w.Panel<int8_t>(panel);
  const float* scales = p.w.scales + panel * kPanelWidth;
  Accumulators<kTileRows> acc(p, row);
  AddInt8Rows(w, 0, k, p, acc);
  const __m512 s0 = _mm512_loadu_ps(scales);
  const __m512 s1 = _mm512_loadu_ps(scales + 16);
#pragma GCC unroll 16
  for (int r = 0; r < kTileRows; ++r) {
    acc.sum[r][0] = _mm512_mul_ps(acc.sum[r][0], s0);
    acc.sum[r][1] = _mm512_mul_ps(acc.sum[r][1], s1);
  }
  acc.Store(p, panel, row);
}

// Groups along K: each group's sums times its scale, added to the total. Twice
// the accumulators of a single group, hence fewer rows per tile.
constexpr int kGroupedRows = 6;

template <int kTileRows>
void TileInt8Grouped(const LinearProblem& p, int64_t panel, int64_t row) {
  const int64_t k = p.w.k;
  const int64_t group_size = p.w.group_size;
  const int64_t groups = GroupCount(k, group_size);
  const int8_t* w = p.w.Panel<int8_t>(panel);
  const float* scales = p.w.scales + panel * groups * kPanelWidth;
  Accumulators<kTileRows> total(p, row);
  for (int64_t g = 0; g < groups; ++g) {
    Accumulators<kTileRows> part(p, row);
    AddInt8Rows(w, g * group_size, std::min(k, (g + 1) * group_size), p,
                part);
    const __m512 s0 = _mm512_loadu_ps(scales + g * kPanelWidth);
    const __m512 s1 = _mm512_loadu_ps(scales + g * kPanelWidth + 16);
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r) {
      total.sum[r][0] = _mm512_fmadd_ps(part.sum[r][0], s0, total.sum[r][0]);
      total.sum[r][1] = _mm512_fmadd_ps(part.sum[r][1], s1, total.sum[r][1]);
    }
  }
  total.Store(p, panel, row);
}

using TileFunction = void (*)(const LinearProblem&, int64_t, int64_t);

#define PADDLE_STEP_TILE_TABLE(name)                                    \
  inline const TileFunction* name##Table() {                            \
    static constexpr TileFunction table[kRows + 1] = {                  \
        nullptr,       name<1>, name<2>, name<3>, name<4>, name<5>,      \
        name<6>,       name<7>, name<8>};                               \
    return table;                                                       \
  }
PADDLE_STEP_TILE_TABLE(TileBFloat16)
PADDLE_STEP_TILE_TABLE(TileInt8)
#undef PADDLE_STEP_TILE_TABLE

// Rows of x [m, k] (x_stride apart) into tiles of kFloat32TileRows rows:
// out[t][kk][r] = x[12 t + r][kk], rows past m zero (x_tiles). 16 values of
// k of each row at a time, transposed in registers: a scalar copy (one
// strided store per value) cost what the tiles gained on a narrow product.
inline void TileRowsOfX(const float* x, int64_t m, int64_t k, int64_t x_stride,
                        float* out) {
  constexpr __mmask16 kTileLanes = (1u << kFloat32TileRows) - 1;
  for (int64_t first = 0; first < m; first += kFloat32TileRows) {
    float* tile = out + first * k;
    const int64_t rows = std::min(kFloat32TileRows, m - first);
    for (int64_t kk = 0; kk < k; kk += 16) {
      const int64_t left = std::min<int64_t>(16, k - kk);
      const __mmask16 lanes =
          static_cast<__mmask16>(left == 16 ? 0xFFFF : (1u << left) - 1);
      __m512 v[16];
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) {
        v[r] = r < rows ? _mm512_maskz_loadu_ps(
                              lanes, x + (first + r) * x_stride + kk)
                        : _mm512_setzero_ps();
      }
      Transpose16(v);
      for (int64_t j = 0; j < left; ++j) {
        _mm512_mask_storeu_ps(tile + (kk + j) * kFloat32TileRows, kTileLanes,
                              v[j]);
      }
    }
  }
}

// float32 weights need no widening registers: 12 rows (24 accumulators, 2
// weight vectors and a broadcast of the 32 registers) load each weight vector
// for 12 FMAs instead of 8.
inline const TileFunction* TileFloat32Table() {
  static_assert(kFloat32TileRows == 12, "the table lists tiles of 1 to 12 rows");
  static constexpr TileFunction table[kFloat32TileRows + 1] = {
      PADDLE_STEP_TILES_1_TO_12(TileFloat32)};
  return table;
}

inline const TileFunction* TileInt8GroupedTable() {
  static constexpr TileFunction table[kGroupedRows + 1] = {
      nullptr,            TileInt8Grouped<1>, TileInt8Grouped<2>,
      TileInt8Grouped<3>, TileInt8Grouped<4>, TileInt8Grouped<5>,
      TileInt8Grouped<6>};
  return table;
}

inline void Panels(const LinearProblem& p, int64_t begin, int64_t end) {
  if (p.w.format == WeightFormat::kInt8 && p.w.group_size < p.w.k) {
    RowTiles(p, begin, end, TileInt8GroupedTable(), kGroupedRows);
    return;
  }
  if (p.w.format == WeightFormat::kFloat32) {
    RowTiles(p, begin, end, TileFloat32Table(), kFloat32TileRows);
    return;
  }
  RowTiles(p, begin, end,
           p.w.format == WeightFormat::kBFloat16 ? TileBFloat16Table()
                                                 : TileInt8Table(),
           kRows);
}

}  // namespace avx512_path
#pragma GCC pop_options

// ------------------------------------------------------------- AVX512-BF16
// bfloat16 weights times x rounded to bfloat16. vdpbf16ps multiplies a pair of
// x (k = 2s, 2s+1; one 32-bit word broadcast to every lane) by the same pair of
// 16 columns, a pair row of the panel as packed, and adds both products to a
// float32 sum: one instruction does the work of two FMAs, and no weight is
// widened. A product of two bfloat16 values is exact in float32, so only the
// sums round (as the FMA paths' do), and x's rounding to bfloat16 (nearest
// even, once per call: PrepareActivations) is the only other difference from
// the AVX-512 path. Denormal inputs count as zero (the instructions' rule).
//
// int8 weights with one scale per column times x quantized per row (scale =
// max |x| / 127, rounded to nearest even, stored plus 128 as uint8):
// vpdpbusd adds 4 products of uint8 x and int8 weights to an int32 sum, 4
// times the multiply-adds of an FMA. The sums are exact; 128 * sum(w) of the
// column (a vpdpbusd of 128s, shared by the tile's rows) comes off before the
// two scales multiply them. The panels keep their [K][32] layout: 4 rows of
// k are interleaved into quads in registers (Quads), once per tile.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,fma")
namespace avx512_bf16_path {

// 2 * kRows accumulators + 2 weight vectors of the 32 registers.
constexpr int kRows = 12;

// Rows of x [m, k] (x_stride apart) rounded to bfloat16 into rows of
// 2 * ceil(k / 2) values (an odd k's last pair padded with zero).
inline void RoundRows(const float* x, int64_t m, int64_t k, int64_t x_stride,
                      uint16_t* out) {
  const int64_t width = 2 * PanelRows(WeightFormat::kBFloat16, k);
  for (int64_t r = 0; r < m; ++r) {
    const float* in = x + r * x_stride;
    uint16_t* row = out + r * width;
    for (int64_t c = 0; c < width; c += 32) {
      const int64_t left = k - c;  // may be below 32, 16 or 0
      const __mmask16 low = static_cast<__mmask16>(
          left >= 16 ? 0xFFFF : left <= 0 ? 0 : (1u << left) - 1);
      const __mmask16 high = static_cast<__mmask16>(
          left >= 32 ? 0xFFFF : left <= 16 ? 0 : (1u << (left - 16)) - 1);
      const __m512bh rounded =
          _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(high, in + c + 16),
                              _mm512_maskz_loadu_ps(low, in + c));
      const int64_t count = std::min<int64_t>(32, width - c);
      const __mmask32 store = static_cast<__mmask32>(
          count >= 32 ? 0xFFFFFFFFu : (1u << count) - 1);
      _mm512_mask_storeu_epi16(row + c, store,
                               reinterpret_cast<const __m512i&>(rounded));
    }
  }
}

template <int kTileRows>
void TileBFloat16(const LinearProblem& p, int64_t panel, int64_t row) {
  const int64_t pairs = PanelRows(WeightFormat::kBFloat16, p.w.k);
  const __m512i* w =
      reinterpret_cast<const __m512i*>(p.w.Panel<uint16_t>(panel));
  const uint32_t* x = p.x_words + row * p.x_words_stride;
  const int64_t ahead = p.prefetch_bytes;
  const int64_t l2_ahead = p.prefetch_l2_bytes;
  avx512_path::Accumulators<kTileRows> acc(p, row);
  for (int64_t s = 0; s < pairs; ++s) {
    avx512_path::PrefetchAhead(w + 2 * s, ahead, l2_ahead);
    avx512_path::PrefetchAhead(w + 2 * s + 1, ahead, l2_ahead);
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + 2 * s));
    const __m512bh w1 =
        reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + 2 * s + 1));
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r) {
      const __m512bh xv = reinterpret_cast<__m512bh>(
          _mm512_set1_epi32(static_cast<int>(x[r * p.x_words_stride + s])));
      acc.sum[r][0] = _mm512_dpbf16_ps(acc.sum[r][0], xv, w0);
      acc.sum[r][1] = _mm512_dpbf16_ps(acc.sum[r][1], xv, w1);
    }
  }
  acc.Store(p, panel, row);
}

using TileFunction = void (*)(const LinearProblem&, int64_t, int64_t);

inline const TileFunction* TileBFloat16Table() {
  static_assert(kRows == 12, "the table lists tiles of 1 to 12 rows");
  static constexpr TileFunction table[kRows + 1] = {
      PADDLE_STEP_TILES_1_TO_12(TileBFloat16)};
  return table;
}

// Rows of x [m, k] (x_stride apart) quantized into rows of 4 * ceil(k / 4)
// bytes (padding: 128, a zero) and their scales.
inline void QuantizeRows(const float* x, int64_t m, int64_t k, int64_t x_stride,
                         uint8_t* out, float* scales) {
  const int64_t width = 4 * ((k + 3) / 4);
  for (int64_t r = 0; r < m; ++r) {
    const float* in = x + r * x_stride;
    __m512 largest = _mm512_setzero_ps();
    for (int64_t c = 0; c < k; c += 16) {
      const __mmask16 mask = static_cast<__mmask16>(
          k - c >= 16 ? 0xFFFF : (1u << (k - c)) - 1);
      largest = _mm512_max_ps(largest, _mm512_abs_ps(_mm512_maskz_loadu_ps(mask, in + c)));
    }
    const float scale = _mm512_reduce_max_ps(largest) / 127.0f;
    scales[r] = scale;
    // An all-zero row: every q is 0 whatever the divisor.
    const __m512 divisor = _mm512_set1_ps(scale > 0.0f ? scale : 1.0f);
    uint8_t* row = out + r * width;
    for (int64_t c = 0; c < width; c += 16) {
      const int64_t left = k - c;
      const __mmask16 mask = static_cast<__mmask16>(
          left >= 16 ? 0xFFFF : left <= 0 ? 0 : (1u << left) - 1);
      const __m512i q = _mm512_cvtps_epi32(
          _mm512_div_ps(_mm512_maskz_loadu_ps(mask, in + c), divisor));
      const __m512i clamped = _mm512_max_epi32(
          _mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
      const __m128i bytes = _mm512_cvtepi32_epi8(
          _mm512_add_epi32(clamped, _mm512_set1_epi32(128)));
      const int64_t count = std::min<int64_t>(16, width - c);
      _mm_mask_storeu_epi8(row + c,
                           static_cast<__mmask16>(count >= 16 ? 0xFFFF : (1u << count) - 1),
                           bytes);
    }
  }
}

// Rows k = 4t .. 4t+3 of an int8 panel ([4][32] bytes from `rows`) as two
// vectors of quads, column c's 4 bytes in one 32-bit lane. Lanes hold the
// columns in the order [0-3, 16-19, 8-11, 24-27] (q0), [4-7, 20-23, 12-15,
// 28-31] (q1), which Unpermute undoes on the sums.
PADDLE_STEP_INLINE void Quads(const int8_t* rows, __m512i* q0, __m512i* q1) {
  const __m512i a = _mm512_loadu_si512(rows);       // rows 0 | 1
  const __m512i b = _mm512_loadu_si512(rows + 64);  // rows 2 | 3
  // [row 0, row 0, row 2, row 2] and [row 1, row 1, row 3, row 3] by 16 columns
  const __m512i even = _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(1, 0, 1, 0));
  const __m512i odd = _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(3, 2, 3, 2));
  // byte pairs of rows (0, 1) and (2, 3): columns 0-7, 16-23 (low), 8-15, 24-31
  const __m512i low = _mm512_unpacklo_epi8(even, odd);
  const __m512i high = _mm512_unpackhi_epi8(even, odd);
  const __m512i rows01 = _mm512_shuffle_i64x2(low, high, _MM_SHUFFLE(1, 0, 1, 0));
  const __m512i rows23 = _mm512_shuffle_i64x2(low, high, _MM_SHUFFLE(3, 2, 3, 2));
  *q0 = _mm512_unpacklo_epi16(rows01, rows23);
  *q1 = _mm512_unpackhi_epi16(rows01, rows23);
}

// Sums in Quads' lane order back to columns 0-15 (first) and 16-31.
PADDLE_STEP_INLINE void Unpermute(__m512i s0, __m512i s1, __m512i* first,
                                  __m512i* second) {
  *first = _mm512_permutex2var_epi64(
      s0, _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0), s1);
  *second = _mm512_permutex2var_epi64(
      s0, _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2), s1);
}

constexpr int kInt8Rows = 8;

template <int kTileRows>
void TileInt8(const LinearProblem& p, int64_t panel, int64_t row) {
  const int64_t k = p.w.k;
  const int8_t* w = p.w.Panel<int8_t>(panel);
  const uint32_t* x = p.x_words + row * p.x_words_stride;
  __m512i sum[kTileRows][2];
#pragma GCC unroll 16
  for (int r = 0; r < kTileRows; ++r) {
    sum[r][0] = _mm512_setzero_si512();
    sum[r][1] = _mm512_setzero_si512();
  }
  __m512i offset0 = _mm512_setzero_si512();  // 128 * sum(w), per column
  __m512i offset1 = _mm512_setzero_si512();
  const __m512i x128 = _mm512_set1_epi32(static_cast<int>(0x80808080u));
  const auto add_quad = [&](const int8_t* rows, int64_t t)
                            __attribute__((always_inline)) {
    __m512i q0, q1;
    Quads(rows, &q0, &q1);
    offset0 = _mm512_dpbusd_epi32(offset0, x128, q0);
    offset1 = _mm512_dpbusd_epi32(offset1, x128, q1);
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r) {
      const __m512i xv =
          _mm512_set1_epi32(static_cast<int>(x[r * p.x_words_stride + t]));
      sum[r][0] = _mm512_dpbusd_epi32(sum[r][0], xv, q0);
      sum[r][1] = _mm512_dpbusd_epi32(sum[r][1], xv, q1);
    }
  };
  const int64_t quads = k / 4;
  const int64_t ahead = p.prefetch_bytes;
  const int64_t l2_ahead = p.prefetch_l2_bytes;
  for (int64_t t = 0; t < quads; ++t) {
    const int8_t* rows = w + 4 * t * kPanelWidth;
    avx512_path::PrefetchAhead(rows, ahead, l2_ahead);
    avx512_path::PrefetchAhead(rows + 64, ahead, l2_ahead);
    add_quad(rows, t);
  }
  if (k % 4) {  // the last rows, padded with zero rows (the panel ends there)
    alignas(64) int8_t tail[4 * kPanelWidth] = {};
    std::memcpy(tail, w + 4 * quads * kPanelWidth, (k % 4) * kPanelWidth);
    add_quad(tail, quads);
  }
  const float* scales = p.w.scales + panel * kPanelWidth;
  const __m512 s0 = _mm512_loadu_ps(scales);
  const __m512 s1 = _mm512_loadu_ps(scales + 16);
  avx512_path::Accumulators<kTileRows> acc(p, row);
#pragma GCC unroll 16
  for (int r = 0; r < kTileRows; ++r) {
    __m512i first, second;
    Unpermute(_mm512_sub_epi32(sum[r][0], offset0),
              _mm512_sub_epi32(sum[r][1], offset1), &first, &second);
    const __m512 x_scale = _mm512_set1_ps(p.x_scales[row + r]);
    acc.sum[r][0] = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(first), x_scale), s0);
    acc.sum[r][1] = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(second), x_scale), s1);
  }
  acc.Store(p, panel, row);
}

inline const TileFunction* TileInt8Table() {
  static constexpr TileFunction table[kInt8Rows + 1] = {
      nullptr,     TileInt8<1>, TileInt8<2>, TileInt8<3>, TileInt8<4>,
      TileInt8<5>, TileInt8<6>, TileInt8<7>, TileInt8<8>};
  return table;
}

inline void Panels(const LinearProblem& p, int64_t begin, int64_t end) {
  if (p.w.format == WeightFormat::kInt8) {
    RowTiles(p, begin, end, TileInt8Table(), kInt8Rows);
    return;
  }
  RowTiles(p, begin, end, TileBFloat16Table(), kRows);
}

}  // namespace avx512_bf16_path
#pragma GCC pop_options

// --------------------------------------------------------------------- AVX2
// 16 vector registers. A tile is kTileRows rows of x times kVectors 8-float
// vectors of one panel, from column `column` of the panel: kTileRows *
// kVectors accumulators, kVectors weight vectors and a broadcast must fit.
// One or two rows take the whole panel (4 vectors: 8 accumulators keep both
// FMA units busy); more rows take half a panel (2 vectors) at a time, up to 6
// rows, so that each weight vector loaded serves up to 6 rows.
//
// A panel is multiplied a span of kSpanBytes of it at a time: every tile over
// the span (every block of rows, both halves of each) runs before the next
// span, so the span is read from memory once and then from the first-level
// cache; the tiles of later spans continue the sums they left in y (in the
// order of k, so the bits are those of one pass). The span's tiles share
// asking for lines a measured distance ahead (near a span's length: the next
// span, while they compute), in the order the next span's first tile reads
// them: each tile asks for a stretch of consecutive rows, the first tile for
// the first stretch. Asking in turn (tile i of n for every n-th row from the
// i-th) left the next span's first tile waiting for rows asked for last:
// 3 to 12 rows from memory ran 8-14% slower on a Zen 3. Half-panel tiles
// over the whole of K read each panel from memory twice, every other line: at
// 8 rows a product ran at a quarter of the read bandwidth on a Zen 3
// (docs/performance-cpu.md).
// Large M also takes rows of x kChunkRows at a time (x read in tiles of 6
// rows): 2,048 rows ran at half the rate of 512 without.
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2_path {

constexpr int kWideRows = 2;    // tiles of 4 vectors: up to 2 rows
constexpr int kNarrowRows = 6;  // tiles of 2 vectors: up to 6 rows
// From kTiledFromRows rows, the narrow tiles read x regrouped once per product
// into tiles of their 6 rows (x_tiles), each k's 6 values side by side: one
// stream of x a tile reads front to back, instead of 6 rows' streams.
constexpr int64_t kTileRowsOfX = kNarrowRows;
constexpr int64_t kTiledFromRows = 9;
constexpr int64_t kSpanBytes = 8192;
// Tiles of x take longer spans: a tile's call, and its sums' reload from y,
// then come once per 128 rows of K (float32), not 64; the span (16 KB) and a
// tile of x over it (3 KB) still stay in the first-level cache. Prefill-sized
// products (256 to 512 rows) ran 10-30% faster on a Zen 3.
constexpr int64_t kTiledSpanBytes = 16384;
// Rows of x multiplied by a thread's panels before the next rows: a span's
// worth of so many rows of x stays in the second-level cache (a multiple of
// kTileRowsOfX: chunks start at a tile of x).
constexpr int64_t kChunkRows = 96;

// Storage rows [begin, end) of a panel (pairs of k for bfloat16), whether
// they start a tile's sums and end them (the bias and int8's column scale
// come with the last), and the tile's share of asking for the rows ahead:
// at row prefetch_row and every prefetch_step rows after it, it asks for the
// lines the distance past row prefetch_target, then prefetch_rows rows
// further (the span's tiles share the asking).
struct Span {
  int64_t begin;
  int64_t end;
  bool first;
  bool last;
  int64_t prefetch_row;
  int64_t prefetch_step;
  int64_t prefetch_target;
  int64_t prefetch_rows;
};

// See avx512_path::PrefetchAhead; a 128-byte panel row is two lines.
PADDLE_STEP_INLINE void PrefetchRow(const void* row, int64_t ahead,
                                    int64_t l2_ahead) {
  const char* line = static_cast<const char*>(row);
  _mm_prefetch(line + ahead, _MM_HINT_T0);
  _mm_prefetch(line + ahead + 64, _MM_HINT_T0);
  if (l2_ahead) {
    _mm_prefetch(line + l2_ahead, _MM_HINT_T1);
    _mm_prefetch(line + l2_ahead + 64, _MM_HINT_T1);
  }
}

// The lanes of vector v of a tile below `width` columns.
PADDLE_STEP_INLINE __m256i LaneMask(int64_t width, int v) {
  const int lanes = static_cast<int>(std::clamp<int64_t>(width - 8 * v, 0, 8));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// The sums of a tile: its kTileRows rows of x times kVectors vectors of one
// panel, from column `column` of panel `panel`.
template <int kTileRows, int kVectors, bool kTiledX>
struct Accumulators : TileRows {
  __m256 sum[kTileRows][kVectors];
  float* y;  // the tile's first row and column in y
  int64_t y_stride;
  const float* bias;  // the tile's first column of the bias, or null
  int64_t width;      // the tile's columns below n (may pass 8 * kVectors)

  PADDLE_STEP_INLINE Accumulators(const LinearProblem& p, int64_t panel,
                                  int64_t row, int64_t column, const Span& span)
      : TileRows(p, row), y_stride(p.y_stride) {
    if (kTiledX)
      x = p.x_tiles + row * p.w.k;  // row: a multiple of kTileRowsOfX
    const int64_t first = panel * kPanelWidth + column;
    y = p.y + row * p.y_stride + first;
    bias = p.bias ? p.bias + first : nullptr;
    width = p.w.n - first;
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r) {
#pragma GCC unroll 4
      for (int v = 0; v < kVectors; ++v) {
        sum[r][v] = span.first ? _mm256_setzero_ps()
                               : Load(y + r * y_stride + 8 * v, v);
      }
    }
  }

  // Vector v of a tile's row at `at`: plain loads and stores where its 8
  // columns are all below n (masked stores are microcoded on AMD's cores).
  PADDLE_STEP_INLINE __m256 Load(const float* at, int v) const {
    return width >= 8 * (v + 1) ? _mm256_loadu_ps(at)
                                : _mm256_maskload_ps(at, LaneMask(width, v));
  }
  PADDLE_STEP_INLINE void Write(float* at, int v, __m256 values) const {
    if (width >= 8 * (v + 1)) {
      _mm256_storeu_ps(at, values);
    } else {
      _mm256_maskstore_ps(at, LaneMask(width, v), values);
    }
  }

  // sum[r] += x[r][kk] * w for every row of the tile.
  PADDLE_STEP_INLINE void Add(int64_t kk, const __m256 (&w)[kVectors]) {
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r) {
      const __m256 xv = _mm256_broadcast_ss(kTiledX ? x + kk * kTileRowsOfX + r
                                                    : x + r * x_stride + kk);
#pragma GCC unroll 4
      for (int v = 0; v < kVectors; ++v) {
        sum[r][v] = _mm256_fmadd_ps(xv, w[v], sum[r][v]);
      }
    }
  }

  // Writes the tile's sums to y (its columns below n): the partial sums, or
  // after the last span, times `scale` (where not null) plus the bias.
  PADDLE_STEP_INLINE void Store(const Span& span,
                                const __m256* scale = nullptr) {
    __m256 b[kVectors];
#pragma GCC unroll 4
    for (int v = 0; v < kVectors; ++v) {
      b[v] = span.last && bias ? Load(bias + 8 * v, v) : _mm256_setzero_ps();
    }
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r) {
#pragma GCC unroll 4
      for (int v = 0; v < kVectors; ++v) {
        __m256 out = sum[r][v];
        if (span.last && scale) {
          out = _mm256_mul_ps(out, scale[v]);
          // Rounded on its own: the compiler may not fuse it with the bias
          // add into an FMA in some tiles and not in others (a row's bits
          // would then depend on its batch).
          asm("" : "+x"(out));
        }
        if (span.last && bias) out = _mm256_add_ps(out, b[v]);
        Write(y + r * y_stride + 8 * v, v, out);
      }
    }
  }
};

template <int kTileRows, int kVectors, bool kTiledX>
void TileFloat32(const LinearProblem& p, int64_t panel, int64_t row,
                 int64_t column, const Span& span) {
  const float* w = p.w.Panel<float>(panel);
  const int64_t ahead = p.prefetch_bytes;
  const int64_t l2_ahead = p.prefetch_l2_bytes;
  Accumulators<kTileRows, kVectors, kTiledX> acc(p, panel, row, column, span);
  // The rows between two prefetches run as a loop of their own: its bounds in
  // registers, nothing but loads and multiply-adds in it.
  const int64_t end = span.end;
  const int64_t step = span.prefetch_step;
  int64_t prefetch_row = span.prefetch_row;  // >= span.begin
  int64_t target = span.prefetch_target;
  for (int64_t kk = span.begin; kk < end;) {
    if (kk == prefetch_row) {
      PrefetchRow(w + target * kPanelWidth, ahead, l2_ahead);
      prefetch_row += step;
      target += span.prefetch_rows;
    }
    const int64_t stop = std::min(end, prefetch_row);
    for (; kk < stop; ++kk) {
      const float* in = w + kk * kPanelWidth;
      __m256 v[kVectors];
#pragma GCC unroll 4
      for (int i = 0; i < kVectors; ++i)
        v[i] = _mm256_loadu_ps(in + column + 8 * i);
      acc.Add(kk, v);
    }
  }
  acc.Store(span);
}

PADDLE_STEP_INLINE __m256 EvenRow(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
}
PADDLE_STEP_INLINE __m256 OddRow(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(
      pairs, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

template <int kTileRows, int kVectors, bool kTiledX>
void TileBFloat16(const LinearProblem& p, int64_t panel, int64_t row,
                  int64_t column, const Span& span) {
  const int64_t k = p.w.k;
  const uint16_t* w = p.w.Panel<uint16_t>(panel);
  const int64_t ahead = p.prefetch_bytes;
  const int64_t l2_ahead = p.prefetch_l2_bytes;
  Accumulators<kTileRows, kVectors, kTiledX> acc(p, panel, row, column, span);
  int64_t prefetch_row = span.prefetch_row;
  int64_t target = span.prefetch_target;
  for (int64_t s = span.begin; s < span.end; ++s) {
    // A pair row holds 2 values per column: column c starts at element 2c.
    const uint16_t* pair_row = w + s * 2 * kPanelWidth;
    if (s == prefetch_row) {
      PrefetchRow(w + target * 2 * kPanelWidth, ahead, l2_ahead);
      prefetch_row += span.prefetch_step;
      target += span.prefetch_rows;
    }
    const __m256i* in = reinterpret_cast<const __m256i*>(pair_row + 2 * column);
    __m256i q[kVectors];
    __m256 even[kVectors];
#pragma GCC unroll 4
    for (int i = 0; i < kVectors; ++i) {
      q[i] = _mm256_loadu_si256(in + i);
      even[i] = EvenRow(q[i]);
    }
    acc.Add(2 * s, even);
    if (2 * s + 1 < k) {  // else padding, and x has no column k
      __m256 odd[kVectors];
#pragma GCC unroll 4
      for (int i = 0; i < kVectors; ++i) odd[i] = OddRow(q[i]);
      acc.Add(2 * s + 1, odd);
    }
  }
  acc.Store(span);
}

// 8 int8 weights as float32 (exact).
PADDLE_STEP_INLINE __m256 Int8Values(const int8_t* q) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

// One scale per column (a single group): the sums over K times the scale,
// after the last span. Groups along K: each weight times its group's scale
// (two sets of accumulators would not fit the 16 registers).
template <int kTileRows, int kVectors, bool kTiledX>
void TileInt8(const LinearProblem& p, int64_t panel, int64_t row,
              int64_t column, const Span& span) {
  const int64_t group_size = p.w.group_size;
  const int64_t groups = GroupCount(p.w.k, group_size);
  const int8_t* w = p.w.Panel<int8_t>(panel);
  const float* scales = p.w.scales + panel * groups * kPanelWidth + column;
  const int64_t ahead = p.prefetch_bytes;
  const int64_t l2_ahead = p.prefetch_l2_bytes;
  Accumulators<kTileRows, kVectors, kTiledX> acc(p, panel, row, column, span);
  __m256 scale[kVectors];
  int64_t prefetch_row = span.prefetch_row;
  int64_t target = span.prefetch_target;
  for (int64_t kk = span.begin; kk < span.end;) {
    const int64_t g = kk / group_size;
#pragma GCC unroll 4
    for (int i = 0; i < kVectors; ++i) {
      scale[i] = _mm256_loadu_ps(scales + g * kPanelWidth + 8 * i);
    }
    const int64_t group_end = std::min(span.end, (g + 1) * group_size);
    for (; kk < group_end; ++kk) {
      const int8_t* in = w + kk * kPanelWidth;
      if (kk == prefetch_row) {
        PrefetchRow(w + target * kPanelWidth, ahead, l2_ahead);
        prefetch_row += span.prefetch_step;
        target += span.prefetch_rows;
      }
      __m256 v[kVectors];
#pragma GCC unroll 4
      for (int i = 0; i < kVectors; ++i) {
        v[i] = groups == 1
                   ? Int8Values(in + column + 8 * i)
                   : _mm256_mul_ps(Int8Values(in + column + 8 * i), scale[i]);
      }
      acc.Add(kk, v);
    }
  }
  acc.Store(span, groups == 1 ? scale : nullptr);
}

using TileFunction = void (*)(const LinearProblem&, int64_t, int64_t, int64_t,
                              const Span&);

// Rows of x [m, k] (x_stride apart) into tiles of kTileRowsOfX rows:
// out[t][kk][r] = x[6 t + r][kk], rows past m zero (x_tiles).
inline void TileRowsOfX(const float* x, int64_t m, int64_t k, int64_t x_stride,
                        float* out) {
  for (int64_t first = 0; first < m; first += kTileRowsOfX) {
    float* tile = out + first * k;
    const int64_t rows = std::min<int64_t>(kTileRowsOfX, m - first);
    for (int64_t kk = 0; kk < k; ++kk) {
      for (int64_t r = 0; r < kTileRowsOfX; ++r) {
        tile[kk * kTileRowsOfX + r] =
            r < rows ? x[(first + r) * x_stride + kk] : 0.0f;
      }
    }
  }
}

#define PADDLE_STEP_AVX2_TABLES(name)                                          \
  inline const TileFunction* name##Wide() {                                    \
    static constexpr TileFunction table[kWideRows + 1] = {                     \
        nullptr, name<1, 4, false>, name<2, 4, false>};                        \
    return table;                                                              \
  }                                                                            \
  inline const TileFunction* name##Narrow() {                                  \
    static constexpr TileFunction table[kNarrowRows + 1] = {                   \
        nullptr,           name<1, 2, false>, name<2, 2, false>,               \
        name<3, 2, false>, name<4, 2, false>, name<5, 2, false>,               \
        name<6, 2, false>};                                                    \
    return table;                                                              \
  }                                                                            \
  inline const TileFunction* name##Tiled() {                                   \
    static constexpr TileFunction table[kNarrowRows + 1] = {nullptr,           \
                                                            name<1, 2, true>,  \
                                                            name<2, 2, true>,  \
                                                            name<3, 2, true>,  \
                                                            name<4, 2, true>,  \
                                                            name<5, 2, true>,  \
                                                            name<6, 2, true>}; \
    return table;                                                              \
  }
PADDLE_STEP_AVX2_TABLES(TileFloat32)
PADDLE_STEP_AVX2_TABLES(TileBFloat16)
PADDLE_STEP_AVX2_TABLES(TileInt8)
#undef PADDLE_STEP_AVX2_TABLES

inline void Panels(const LinearProblem& problem, int64_t begin, int64_t end) {
  // A span may end inside an int8 group: each span loads its groups' scales.
  const int64_t span_bytes = problem.x_tiles ? kTiledSpanBytes : kSpanBytes;
  // The caller's prefetch distance is measured on untiled products (kSpanBytes
  // spans: on a Zen 3 the distance chosen for 8 rows was one span); longer
  // spans ask as many spans ahead, further in proportion. At 12 and 32 rows
  // (a product from memory, one thread) the distance unscaled left the second
  // half of the next span to the hardware: 8-19% slower.
  LinearProblem p = problem;
  p.prefetch_bytes = problem.prefetch_bytes * span_bytes / kSpanBytes;
  p.prefetch_l2_bytes = problem.prefetch_l2_bytes * span_bytes / kSpanBytes;
  const bool wide = p.m <= kWideRows;
  const TileFunction* tiles =
      wide        ? ForFormat(p.w.format, TileFloat32Wide(), TileBFloat16Wide(),
                              TileInt8Wide())
      : p.x_tiles ? ForFormat(p.w.format, TileFloat32Tiled(),
                              TileBFloat16Tiled(), TileInt8Tiled())
                  : ForFormat(p.w.format, TileFloat32Narrow(),
                              TileBFloat16Narrow(), TileInt8Narrow());
  const int64_t rows = PanelRows(p.w.format, p.w.k);
  const int64_t row_bytes = p.w.format == WeightFormat::kInt8
                                ? kPanelWidth
                                : 4 * kPanelWidth;  // float32, bfloat16 pairs
  const int64_t span_rows = std::max<int64_t>(1, span_bytes / row_bytes);
  // A PrefetchRow covers 128 bytes: 4 rows of int8.
  const int64_t rows_per_prefetch = 4 * kPanelWidth / row_bytes;
  for (int64_t chunk = 0; chunk < p.m; chunk += kChunkRows) {
    const int64_t m = std::min(kChunkRows, p.m - chunk);
    // Blocks of rows of as even a size as the tiles allow (8 rows: 4 + 4,
    // not 6 + 2, whose 4 accumulators wait on the FMA latency); x in tiles
    // is cut where its tiles are.
    const int64_t block_limit = wide ? kWideRows : kNarrowRows;
    const int64_t blocks = (m + block_limit - 1) / block_limit;
    for (int64_t panel = begin; panel < end; ++panel) {
      const int64_t halves = wide                               ? 1
                             : panel * kPanelWidth + 16 < p.w.n ? 2
                                                                : 1;
      const int64_t passes = halves * blocks;  // tiles over each span
      for (int64_t s = 0; s < rows; s += span_rows) {
        const int64_t span_end = std::min(rows, s + span_rows);
        const int64_t asks =
            (span_end - s + rows_per_prefetch - 1) / rows_per_prefetch;
        Span span{s,      span_end,
                  s == 0, span_end == rows,
                  s,      passes * rows_per_prefetch,
                  s,      rows_per_prefetch};
        int64_t pass = 0;
        for (int64_t block = 0, row = chunk; block < blocks; ++block) {
          const int64_t block_rows =
              p.x_tiles ? std::min<int64_t>(kTileRowsOfX, chunk + m - row)
                        : m / blocks + (block < m % blocks ? 1 : 0);
          for (int64_t half = 0; half < halves; ++half, ++pass) {
            tiles[block_rows](p, panel, row, 16 * half, span);
            // Pass q asks at every passes-th of the span's asks from the
            // q-th, for the stretch of rows after the last pass's.
            span.prefetch_row += rows_per_prefetch;
            const int64_t pass_asks =
                pass < asks ? (asks - pass + passes - 1) / passes : 0;
            span.prefetch_target += pass_asks * rows_per_prefetch;
          }
          row += block_rows;
        }
      }
    }
  }
}

}  // namespace avx2_path
#pragma GCC pop_options

#undef PADDLE_STEP_INLINE
#endif  // PADDLE_STEP_CPU_X86

// The form of m rows of x a product on `isa` multiplies: the AVX2 path reads
// x in tiles of 6 rows from avx2_path::kTiledFromRows rows; the AVX512-BF16
// path's dot products take bfloat16 weights, and int8 weights with one scale
// per column and K up to kMaxQuadK; the AVX-512 path's float32 tiles read
// tiles of x from kFloat32TiledFromRows rows.
inline ActivationForm ActivationFormOf(Isa isa, const PackedWeights& w,
                                       int64_t m) {
#ifdef PADDLE_STEP_CPU_X86
  if (isa == Isa::kAvx2) {
    return m >= avx2_path::kTiledFromRows ? ActivationForm::kFloat32Tiles6
                                          : ActivationForm::kFloat32;
  }
#endif
  if (isa != Isa::kAvx512Bf16 && isa != Isa::kAvx512) {
    return ActivationForm::kFloat32;
  }
  if (w.format == WeightFormat::kFloat32) {
    return m >= kFloat32TiledFromRows ? ActivationForm::kFloat32Tiles
                                      : ActivationForm::kFloat32;
  }
  if (isa != Isa::kAvx512Bf16) return ActivationForm::kFloat32;
  if (w.format == WeightFormat::kBFloat16) return ActivationForm::kBFloat16Pairs;
  if (w.format == WeightFormat::kInt8 && w.group_size >= w.k &&
      w.k <= kMaxQuadK) {
    return ActivationForm::kUint8Quads;
  }
  return ActivationForm::kFloat32;
}

// Bytes of scratch PrepareActivations needs for m rows of x on `isa`.
inline int64_t ActivationBytes(Isa isa, const PackedWeights& w, int64_t m) {
  switch (ActivationFormOf(isa, w, m)) {
    case ActivationForm::kFloat32Tiles:
      return (m + kFloat32TileRows - 1) / kFloat32TileRows * kFloat32TileRows *
             w.k * 4;
    case ActivationForm::kFloat32Tiles6:
      return (m + 5) / 6 * 6 * w.k * 4;
    case ActivationForm::kBFloat16Pairs:
      return m * PanelRows(WeightFormat::kBFloat16, w.k) * 4;
    case ActivationForm::kUint8Quads:
      return m * (4 + 4 * ((w.k + 3) / 4));  // a scale and the quads per row
    case ActivationForm::kFloat32:
      break;
  }
  return 0;
}

// Fills `scratch` (ActivationBytes of it, 4-byte aligned) with the form of x
// the path multiplies, once per product, and points `p` at it.
inline void PrepareActivations(Isa isa, LinearProblem* p, void* scratch) {
#ifdef PADDLE_STEP_CPU_X86
  switch (ActivationFormOf(isa, p->w, p->m)) {
    case ActivationForm::kFloat32Tiles:
      avx512_path::TileRowsOfX(p->x, p->m, p->w.k, p->x_stride,
                               static_cast<float*>(scratch));
      p->x_tiles = static_cast<const float*>(scratch);
      return;
    case ActivationForm::kFloat32Tiles6:
      avx2_path::TileRowsOfX(p->x, p->m, p->w.k, p->x_stride,
                             static_cast<float*>(scratch));
      p->x_tiles = static_cast<const float*>(scratch);
      return;
    case ActivationForm::kBFloat16Pairs:
      avx512_bf16_path::RoundRows(p->x, p->m, p->w.k, p->x_stride,
                                  static_cast<uint16_t*>(scratch));
      p->x_words = static_cast<const uint32_t*>(scratch);
      p->x_words_stride = PanelRows(WeightFormat::kBFloat16, p->w.k);
      return;
    case ActivationForm::kUint8Quads: {
      float* scales = static_cast<float*>(scratch);
      uint8_t* quads = reinterpret_cast<uint8_t*>(scales + p->m);
      avx512_bf16_path::QuantizeRows(p->x, p->m, p->w.k, p->x_stride, quads,
                                     scales);
      p->x_scales = scales;
      p->x_words = reinterpret_cast<const uint32_t*>(quads);
      p->x_words_stride = (p->w.k + 3) / 4;
      return;
    }
    case ActivationForm::kFloat32:
      return;
  }
#else
  (void)isa, (void)p, (void)scratch;
#endif
}

// Panels [begin, end) of the product on the given path, which the CPU must
// support (DetectIsa), after PrepareActivations. A path without a kernel of
// its own for the format runs the next one down.
inline void LinearPanels(Isa isa, const LinearProblem& p, int64_t begin,
                         int64_t end) {
#ifdef PADDLE_STEP_CPU_X86
  switch (isa) {
    case Isa::kAvx512Bf16:
      if (p.w.format != WeightFormat::kFloat32 &&
          ActivationFormOf(isa, p.w, p.m) != ActivationForm::kFloat32) {
        avx512_bf16_path::Panels(p, begin, end);
        return;
      }
      avx512_path::Panels(p, begin, end);
      return;
    case Isa::kAvx512:
      avx512_path::Panels(p, begin, end);
      return;
    case Isa::kAvx2:
      avx2_path::Panels(p, begin, end);
      return;
    case Isa::kScalar:
      break;
  }
#endif
  (void)isa;
  scalar_path::Panels(p, begin, end);
}

}  // namespace paddle_step::cpu
