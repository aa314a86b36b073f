// One sampling step of a batch of rows on the CPU: the per-row controls, the
// draw and the raw logprobs, with the semantics of
// python/paddle_step/layers/sampler.py (its docstrings are the contract; this
// is the CPU float32 path of the same thing). Framework-free: raw pointers.
//
// Per row, in this order: tokens outside `allowed` and, while the row is under
// its `min_tokens`, its stop ids go to -inf; `logit_bias` is added; the
// repetition penalty (over prompt and generated ids), then the frequency and
// presence penalties (over generated ids) change the ids they list. A greedy
// row (temperature 0, or no uniforms at all) takes the lowest id among the
// largest controlled logits. A sampled row weighs each token by
// e = exp(logit / t - max / t) (t: the temperature, at least 1e-6), keeps the
// tokens with e >= min_p (the largest e is 1), then the top_k largest (ties of
// the last kept kept too), then the nucleus: of the kept by decreasing e, each
// one whose predecessors' mass is under top_p of the kept mass (ties of the
// last kept kept too); it draws by inverting the CDF of the kept, in id order,
// at its uniform. Every cut is a floor on e, so the kept set is
// {e >= floor, e > 0}. Logprobs are of the raw logits' log-softmax.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_float_math.h"
#include "cpu_float_vectors.h"
#include "cpu_isa.h"

// A row's functions are all inlined into SampleRowsLoop::Run, which RunOn
// (cpu_float_vectors.h) compiles once per instruction set: their plain C++
// loops then vectorize to that set's width.
#define PADDLE_STEP_ROW_INLINE PADDLE_STEP_LOOP_INLINE

namespace paddle_step::cpu {

// The batch and its controls. A null pointer turns a control off for every
// row; a row that does not use a control set for the batch holds its neutral
// value. Id tables use -1 pads; ids outside [0, vocab) are skipped.
struct SamplingBatch {
  int64_t rows = 0;
  int64_t vocab = 0;
  const float* logits = nullptr;  // [rows, vocab], rows `logits_stride` apart
  int64_t logits_stride = 0;
  const float* temperature = nullptr;  // [rows]; <= 0: greedy
  const float* top_p = nullptr;        // [rows]; >= 1: no nucleus cut
  const int64_t* top_k = nullptr;      // [rows]; 0: all
  const float* min_p = nullptr;        // [rows]; 0: all
  const double* uniforms = nullptr;    // [rows] in [0, 1); null: all greedy
  // The allowed tokens, packed: [rows, ceil(vocab / 32)] words, bit j of
  // word w allows token 32 w + j (llguidance's bitmask layout).
  const uint32_t* allowed_bits = nullptr;
  // Stop ids [rows, stop_width], masked while step_idx < min_tokens.
  const int64_t* stop_ids = nullptr;
  int64_t stop_width = 0;
  const int64_t* min_tokens = nullptr;
  // Tokens generated so far: output_ids[row, 1 .. step_idx[row]] (column 0 is
  // the slot state's scratch), rows `output_stride` apart.
  const int64_t* step_idx = nullptr;
  const int64_t* output_ids = nullptr;
  int64_t output_width = 0;
  // logit_bias: ids [rows, bias_width] (-1 pads) and their float32 values.
  const int64_t* bias_ids = nullptr;
  const float* bias_values = nullptr;
  int64_t bias_width = 0;
  int64_t bias_ids_stride = 0;
  int64_t bias_values_stride = 0;
  const float* presence_penalty = nullptr;   // [rows], with frequency_penalty
  const float* frequency_penalty = nullptr;  // [rows]
  const float* repetition_penalty = nullptr;  // [rows], with prompt_ids
  // The prompt: [rows, prompt_width], each row's ids up to its first pad.
  const int64_t* prompt_ids = nullptr;
  int64_t prompt_width = 0;
  // Logprobs: -1 none; else the chosen token's and the `top_logprobs` most
  // likely (ids and values [rows, top_logprobs], most likely first, lowest id
  // first on ties).
  int64_t top_logprobs = -1;
  // TokenLogprobsRows' tokens [rows] (prompt positions: given, not drawn).
  const int64_t* given_tokens = nullptr;
  // Outputs.
  int64_t* tokens = nullptr;          // [rows]
  float* chosen_logprobs = nullptr;   // [rows]
  int64_t* top_ids = nullptr;         // [rows, top_logprobs]
  float* top_values = nullptr;        // [rows, top_logprobs]
  // [rows] or null: how many tokens have a logprob at least the chosen one's,
  // itself included (1 = most likely; vLLM's rank).
  int64_t* ranks = nullptr;
};

namespace sampling {

// The lowest id among the largest values (0 when all are -inf or NaN).
PADDLE_STEP_ROW_INLINE int64_t ArgMax(const float* values, int64_t count) {
  const float best = Max(values, count);
  for (int64_t i = 0; i < count; ++i) {
    if (values[i] == best) return i;
  }
  return 0;
}

// Histogram keys of positive floats: the exponent and 3 leading mantissa bits,
// in the order of the values (1.0f is key 1016).
constexpr int kBuckets = 1024;
PADDLE_STEP_ROW_INLINE int BucketOf(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return static_cast<int>(bits >> 20);
}

// The scratch of one thread, reused from row to row.
struct RowScratch {
  std::vector<float> logits;    // the controlled logits
  std::vector<float> weights;   // e, then raw exp for logprobs
  std::vector<float> gathered;  // the weights a cut looks at
  std::vector<int64_t> ids;     // the tokens of the weights under a min_p floor
  std::vector<uint32_t> stamp;  // penalties: ids seen in this row's epoch
  std::vector<int32_t> counts;  // penalties: generated count per id
  std::vector<int64_t> touched;  // penalties: the ids seen, in first-seen order
  std::vector<int32_t> bucket_counts;
  std::vector<double> bucket_mass;
  uint32_t epoch = 0;

  // Sizes the buffers for rows of `vocab` logits.
  void Reserve(int64_t vocab) {
    if (static_cast<int64_t>(logits.size()) == vocab) return;
    logits.assign(vocab, 0.0f);
    weights.assign(vocab, 0.0f);
    gathered.assign(vocab, 0.0f);
    ids.assign(vocab, 0);
    stamp.assign(vocab, 0);
    counts.assign(vocab, 0);
    bucket_counts.assign(kBuckets, 0);
    bucket_mass.assign(kBuckets, 0.0);
    epoch = 0;
  }

  // A fresh stamp for a row's penalties (stamps restart when it wraps).
  uint32_t NextEpoch() {
    if (++epoch == 0) {
      std::fill(stamp.begin(), stamp.end(), 0);
      epoch = 1;
    }
    return epoch;
  }
};

// The controls that change logits, on row `row` of `x` (a copy of its raw
// logits), in the documented order.
PADDLE_STEP_ROW_INLINE void ApplyControls(const SamplingBatch& b, int64_t row,
                                          float* x, RowScratch& scratch) {
  const int64_t vocab = b.vocab;
  if (b.allowed_bits != nullptr) {
    const uint32_t* words = b.allowed_bits + row * ((vocab + 31) / 32);
    for (int64_t i = 0; i < vocab; ++i) {
      x[i] = (words[i >> 5] >> (i & 31)) & 1u ? x[i] : kNegInf;
    }
  }
  if (b.stop_ids != nullptr && b.step_idx[row] < b.min_tokens[row]) {
    const int64_t* ids = b.stop_ids + row * b.stop_width;
    for (int64_t k = 0; k < b.stop_width; ++k) {
      if (ids[k] >= 0 && ids[k] < vocab) x[ids[k]] = kNegInf;
    }
  }
  if (b.bias_ids != nullptr) {
    const int64_t* ids = b.bias_ids + row * b.bias_ids_stride;
    const float* values = b.bias_values + row * b.bias_values_stride;
    for (int64_t k = 0; k < b.bias_width; ++k) {
      if (ids[k] >= 0 && ids[k] < vocab) x[ids[k]] = x[ids[k]] + values[k];
    }
  }
  if (b.output_ids == nullptr) return;
  // The ids the penalties change, each once: the generated ones (with their
  // counts), then, for the repetition penalty, the prompt's.
  const uint32_t epoch = scratch.NextEpoch();
  scratch.touched.clear();
  auto touch = [&](int64_t id) {
    if (scratch.stamp[id] != epoch) {
      scratch.stamp[id] = epoch;
      scratch.counts[id] = 0;
      scratch.touched.push_back(id);
    }
  };
  const int64_t generated = std::min<int64_t>(
      std::max<int64_t>(b.step_idx[row], 0), b.output_width - 1);
  const int64_t* output = b.output_ids + row * b.output_width;
  for (int64_t k = 1; k <= generated; ++k) {
    const int64_t id = output[k];
    if (id < 0 || id >= vocab) continue;
    touch(id);
    ++scratch.counts[id];
  }
  const bool repetition = b.repetition_penalty != nullptr;
  if (repetition && b.prompt_ids != nullptr) {
    const int64_t* prompt = b.prompt_ids + row * b.prompt_width;
    // The prompt is a prefix: it ends at the first pad (a row of a long
    // max_model_len is mostly pads).
    for (int64_t k = 0; k < b.prompt_width && prompt[k] >= 0; ++k) {
      if (prompt[k] < vocab) touch(prompt[k]);
    }
  }
  const float penalty = repetition ? b.repetition_penalty[row] : 1.0f;
  const bool frequency = b.frequency_penalty != nullptr;
  const float per_count = frequency ? b.frequency_penalty[row] : 0.0f;
  const float presence = frequency ? b.presence_penalty[row] : 0.0f;
  for (const int64_t id : scratch.touched) {
    float value = x[id];
    if (repetition) value = value > 0 ? value / penalty : value * penalty;
    if (frequency) {
      const int32_t count = scratch.counts[id];
      value = value - static_cast<float>(count) * per_count;
      value = value - (count > 0 ? 1.0f : 0.0f) * presence;
    }
    x[id] = value;
  }
}

// Per-bucket counts and masses of `count` positive weights.
PADDLE_STEP_ROW_INLINE void Histogram(const float* values, int64_t count,
                                      RowScratch& scratch) {
  std::fill(scratch.bucket_counts.begin(), scratch.bucket_counts.end(), 0);
  std::fill(scratch.bucket_mass.begin(), scratch.bucket_mass.end(), 0.0);
  for (int64_t i = 0; i < count; ++i) {
    const int key = BucketOf(values[i]);
    ++scratch.bucket_counts[key];
    scratch.bucket_mass[key] += values[i];
  }
}

// Copies the `count` values that are > 0 and >= floor (and, for key >= 0, in
// bucket `key`) to the front of `out`; returns how many. The test is mostly
// true (no cut yet) or mostly false (past a cut), so it predicts well.
PADDLE_STEP_ROW_INLINE int64_t Select(const float* values, int64_t count,
                                      float floor, int key, float* out) {
  int64_t kept = 0;
  for (int64_t i = 0; i < count; ++i) {
    if (values[i] > 0.0f && values[i] >= floor &&
        (key < 0 || BucketOf(values[i]) == key)) {
      out[kept++] = values[i];
    }
  }
  return kept;
}

constexpr auto kDescending = [](float a, float c) { return a > c; };

// The top_k floor of the weights e >= floor: the k-th largest of them
// (`floor` when there are at most k). A histogram of their values finds the
// bucket that holds it; only that bucket is partitioned.
PADDLE_STEP_ROW_INLINE float TopKFloor(const float* e, int64_t vocab,
                                       float floor, int64_t k,
                                       RowScratch& scratch) {
  float* kept = scratch.gathered.data();
  const int64_t count = Select(e, vocab, floor, -1, kept);
  if (count <= k) return floor;
  Histogram(kept, count, scratch);
  int64_t above = 0;
  int key = kBuckets - 1;
  while (above + scratch.bucket_counts[key] < k) {
    above += scratch.bucket_counts[key--];
  }
  const int64_t in_bucket = Select(kept, count, floor, key, kept);
  const int64_t rank = k - above - 1;
  std::nth_element(kept, kept + rank, kept + in_bucket, kDescending);
  return kept[rank];
}

// The nucleus floor of the weights e >= floor: the smallest e whose
// predecessors, by decreasing e, hold under `need` (`floor` when rounding
// leaves the need unmet: all stay). Few are sorted; of many, a histogram of
// their values finds the bucket where the mass reaches `need`, and only that
// bucket is sorted.
PADDLE_STEP_ROW_INLINE float NucleusFloor(const float* e, int64_t vocab,
                                          float floor, double need,
                                          RowScratch& scratch) {
  float* kept = scratch.gathered.data();
  int64_t count = Select(e, vocab, floor, -1, kept);
  double mass = 0.0;  // of the values before kept[0 .. count)
  constexpr int64_t kSortAll = 256;
  if (count > kSortAll) {
    Histogram(kept, count, scratch);
    int key = kBuckets - 1;
    for (; key >= 0 && mass + scratch.bucket_mass[key] < need; --key) {
      mass += scratch.bucket_mass[key];
    }
    if (key < 0) return floor;
    count = Select(kept, count, floor, key, kept);
  }
  if (count == 0) return floor;
  std::sort(kept, kept + count, kDescending);
  // The first always belongs: its predecessors hold `mass` < need (or none).
  float last = kept[0];
  mass += kept[0];
  for (int64_t k = 1; k < count && mass < need; ++k) {
    last = kept[k];
    mass += kept[k];
  }
  return last;
}

// Sum of the values >= floor, in eight float lanes added up in double.
PADDLE_STEP_ROW_INLINE double SumAtLeast(const float* values, int64_t count,
                                         float floor) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    for (int j = 0; j < 8; ++j) {
      lanes[j] += values[i + j] >= floor ? values[i + j] : 0.0f;
    }
  }
  double total = 0.0;
  for (; i < count; ++i) total += values[i] >= floor ? values[i] : 0.0f;
  for (int j = 0; j < 8; ++j) total += lanes[j];
  return total;
}

// The last id of positive weight in `w`; -1 when there is none.
PADDLE_STEP_ROW_INLINE int64_t LastPositive(const float* w, int64_t vocab) {
  for (int64_t i = vocab - 1; i >= 0; --i) {
    if (w[i] > 0.0f) return i;
  }
  return -1;
}

// The first id whose running sum of `w` (weights, 0 for the tokens not
// kept) passes `target`; the last one of positive weight when none does
// (rounding), -1 when all weights are 0. Blocks whose sum keeps the running
// sum at or under the target are skipped whole.
PADDLE_STEP_ROW_INLINE int64_t InvertCdf(const float* w, int64_t vocab,
                                         float target) {
  constexpr int64_t kBlock = 64;
  float cdf = 0.0f;
  for (int64_t start = 0; start < vocab; start += kBlock) {
    const int64_t count = std::min(kBlock, vocab - start);
    const float block = static_cast<float>(Sum(w + start, count));
    if (!(cdf + block > target)) {
      cdf += block;
      continue;
    }
    for (int64_t i = start; i < start + count; ++i) {
      cdf += w[i];
      if (w[i] > 0.0f && cdf > target) return i;
    }
  }
  return LastPositive(w, vocab);
}

// The sampled token of a row whose controlled logits are `x`.
PADDLE_STEP_ROW_INLINE int64_t Draw(const SamplingBatch& b, int64_t row,
                                    const float* x, RowScratch& scratch) {
  const int64_t vocab = b.vocab;
  float* e = scratch.weights.data();
  const float scale = std::max(b.temperature[row], 1e-6f);
  // Division by a positive scale keeps the order: max(x / t) = max(x) / t.
  const float top = Max(x, vocab) / scale;
  if (!(top > kNegInf)) return ArgMax(x, vocab);  // nothing may be drawn
  float floor = b.min_p != nullptr ? b.min_p[row] : 0.0f;
  // The weights looked at: every token's, or under a min_p floor only those
  // of the tokens whose logit can reach it (e >= min_p needs
  // x / t - top >= ln(min_p); the slack is far wider than the exp's
  // rounding), with their ids, in id order.
  const int64_t* ids = nullptr;
  int64_t count = vocab;
  for (int64_t i = 0; i < vocab; ++i) e[i] = x[i] / scale - top;
  if (floor > 0.0f) {
    const float bound = std::log(floor) - 1e-3f;
    int64_t* candidates = scratch.ids.data();
    count = 0;
    // Blocks of 16 with no candidate (most, past a min_p cut) are skipped
    // on one vector test.
    constexpr int64_t kBlock = 16;
    for (int64_t start = 0; start < vocab; start += kBlock) {
      const int64_t end = std::min(start + kBlock, vocab);
      if (end - start == kBlock && !(Max(e + start, kBlock) >= bound)) continue;
      for (int64_t i = start; i < end; ++i) {
        if (e[i] >= bound) {
          e[count] = e[i];
          candidates[count++] = i;
        }
      }
    }
    ids = candidates;
  }
  ExpNonPositive(e, e, count);

  const int64_t top_k = b.top_k != nullptr ? b.top_k[row] : 0;
  if (top_k > 0 && top_k < count) {
    floor = TopKFloor(e, count, floor, top_k, scratch);
  }
  if (b.top_p[row] < 1.0f) {
    const double need =
        static_cast<double>(b.top_p[row]) * SumAtLeast(e, count, floor);
    floor = NucleusFloor(e, count, floor, need, scratch);
  }
  for (int64_t i = 0; i < count; ++i) e[i] = e[i] >= floor ? e[i] : 0.0f;
  const float total = static_cast<float>(Sum(e, count));
  const float target = static_cast<float>(b.uniforms[row]) * total;
  // A uniform within float rounding of 1 draws the last kept token.
  const int64_t drawn = target < total ? InvertCdf(e, count, target)
                                       : LastPositive(e, count);
  if (drawn < 0) return ArgMax(x, vocab);
  return ids != nullptr ? ids[drawn] : drawn;
}

// Logprobs of row `row`'s raw logits: the chosen token's and the top ones.
PADDLE_STEP_ROW_INLINE void Logprobs(const SamplingBatch& b, int64_t row,
                                     const float* raw, int64_t token,
                                     RowScratch& scratch) {
  const int64_t vocab = b.vocab;
  float* shifted = scratch.weights.data();
  const float top = Max(raw, vocab);
  for (int64_t i = 0; i < vocab; ++i) shifted[i] = raw[i] - top;
  ExpNonPositive(shifted, shifted, vocab);
  const float log_total = static_cast<float>(std::log(Sum(shifted, vocab)));
  auto logprob = [&](int64_t id) { return (raw[id] - top) - log_total; };
  const float chosen = logprob(token);
  b.chosen_logprobs[row] = chosen;
  if (b.ranks != nullptr) {  // each logprob as computed above, not the logits
    int64_t count = 0;
    for (int64_t i = 0; i < vocab; ++i) count += logprob(i) >= chosen;
    b.ranks[row] = count;
  }
  const int64_t width = b.top_logprobs;
  if (width <= 0) return;
  // The `width` largest, most likely first; a later id enters only when
  // strictly larger, so ties keep the lowest ids first.
  int64_t* ids = b.top_ids + row * width;
  float* values = b.top_values + row * width;
  // `bar`: what a logit must beat to enter (kept in a register, not read back
  // from `values`, which the compiler must assume the stores may change).
  // Blocks whose largest logit does not beat it are skipped whole.
  constexpr int64_t kBlock = 64;
  int64_t filled = 0;
  float bar = kNegInf;
  for (int64_t start = 0; start < vocab; start += kBlock) {
    const int64_t end = std::min(start + kBlock, vocab);
    if (filled == width && !(Max(raw + start, end - start) > bar)) continue;
    for (int64_t i = start; i < end; ++i) {
      const float value = raw[i];
      if (filled == width && !(value > bar)) continue;
      int64_t at = filled < width ? filled++ : width - 1;  // width <= vocab
      while (at > 0 && value > values[at - 1]) {
        values[at] = values[at - 1];
        ids[at] = ids[at - 1];
        --at;
      }
      values[at] = value;
      ids[at] = i;
      if (filled == width) bar = values[width - 1];
    }
  }
  for (int64_t k = 0; k < width; ++k) values[k] = logprob(ids[k]);
}

}  // namespace sampling

// Rows [begin, end) of `*b` with `*scratch` (reserved for b->vocab), as a
// RunOn loop: the Floats type only picks the instruction set it compiles for.
struct SampleRowsLoop {
  template <typename Floats>
  __attribute__((always_inline)) static void Run(
      const SamplingBatch* b, int64_t begin, int64_t end,
      sampling::RowScratch* scratch) {
    const int64_t vocab = b->vocab;
    for (int64_t row = begin; row < end; ++row) {
      const float* raw = b->logits + row * b->logits_stride;
      float* x = scratch->logits.data();
      std::copy(raw, raw + vocab, x);
      sampling::ApplyControls(*b, row, x, *scratch);
      const bool greedy =
          b->uniforms == nullptr || !(b->temperature[row] > 0.0f);
      const int64_t token = greedy ? sampling::ArgMax(x, vocab)
                                   : sampling::Draw(*b, row, x, *scratch);
      b->tokens[row] = token;
      if (b->top_logprobs >= 0) {
        sampling::Logprobs(*b, row, raw, token, *scratch);
      }
    }
  }
};

// Samples rows [begin, end) of `b` with `scratch` on `isa`'s vectors. Every
// path computes the same float32 operations element by element.
inline void SampleRows(Isa isa, const SamplingBatch& b, int64_t begin,
                       int64_t end, sampling::RowScratch& scratch) {
  int lanes = 1;
  RunOn<SampleRowsLoop>(isa, &lanes, &b, begin, end, &scratch);
}

// The logprobs of rows [begin, end) of `*b`'s raw logits at its given_tokens
// (no controls, no draw), as a RunOn loop.
struct TokenLogprobsLoop {
  template <typename Floats>
  __attribute__((always_inline)) static void Run(
      const SamplingBatch* b, int64_t begin, int64_t end,
      sampling::RowScratch* scratch) {
    for (int64_t row = begin; row < end; ++row) {
      sampling::Logprobs(*b, row, b->logits + row * b->logits_stride,
                         b->given_tokens[row], *scratch);
    }
  }
};

// TokenLogprobsLoop on `isa`'s vectors.
inline void TokenLogprobsRows(Isa isa, const SamplingBatch& b, int64_t begin,
                              int64_t end, sampling::RowScratch& scratch) {
  int lanes = 1;
  RunOn<TokenLogprobsLoop>(isa, &lanes, &b, begin, end, &scratch);
}

}  // namespace paddle_step::cpu
