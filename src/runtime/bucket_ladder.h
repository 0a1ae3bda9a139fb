// Bucket ladders from served traffic: a histogram of batch token counts (what a server logged)
// and the runtime.token_buckets that bound the padding it would run. Plain C++ (no CUDA, no
// YAML), so CI tests all of it; examples/bucket_ladder.cpp is the command-line front end.
//
// The cost model is the module's (runtime/batch_plan.h): a batch of T tokens runs in the
// smallest bucket >= T; one with more tokens than the largest bucket L runs in windows of L rows,
// every window in the smallest bucket >= its real rows, so only the last window, of
// r = (T - 1) % L + 1 rows, is padded. The padded-token share of a ladder is
//   padded / (real + padded)   summed over every logged batch,
// the fraction of the rows the graphs run that carry no token.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "config/config_limits.h"

namespace kda::detail {

// The limits of validate_config a ladder has to meet.
constexpr int kLadderMaxGraphs = static_cast<int>(limits::kMaxBuckets);  // runtime.token_buckets entries
constexpr int64_t kLadderMaxBucket = limits::kMaxBucketTokens;           // tokens of one bucket
constexpr int64_t kHistogramMaxTokens = limits::kMaxBatchTokens;         // runtime.max_batch_tokens
// Bounds that keep every sum in int64: at most 2^40 batches of at most 2^62 tokens in all, so
// the padding (< 2^20 per batch) stays below 2^60 and real + padded below 2^63.
constexpr int64_t kHistogramMaxBatches = int64_t{1} << 40;
constexpr int64_t kHistogramMaxTotalTokens = int64_t{1} << 62;

// Batch token count -> number of batches of that size. parse_token_histogram returns it with
// tokens strictly increasing and every count >= 1; the functions below accept any order,
// duplicates (summed) and zero counts (ignored).
struct TokenHistogram {
  std::vector<std::pair<int64_t, int64_t>> counts;
};

struct HistogramTotals {
  int64_t batches = 0;   // sum of the counts
  int64_t tokens = 0;    // sum of tokens * count
  int64_t largest = 0;   // largest batch with a nonzero count
  int64_t distinct = 0;  // distinct batch sizes with a nonzero count
};

// Throws kda::Error for tokens < 1, count < 0, totals beyond the bounds above or no batch.
HistogramTotals histogram_totals(const TokenHistogram& histogram);

// Parses a CSV histogram. Lines are `tokens,count` (a batch size and how many batches had it) or
// a single column of raw batch sizes, one batch per line; the first data line decides which,
// and every later line must have the same number of fields. An optional header line of names
// (`tokens,count`, `tokens`) may come first. Blank lines and `#` comments (whole-line or after
// the fields) are skipped; fields may carry spaces around them and lines may end in CRLF.
// Duplicated sizes are summed. Throws kda::Error "<source>:<line>: <what is wrong>" for a field
// that is not an integer, tokens < 1, tokens > max_tokens, count < 0, a line with the wrong
// number of fields, totals beyond the bounds above, and "<source>: ..." for a histogram
// without any batch.
TokenHistogram parse_token_histogram(const std::string& text, const std::string& source,
                                     int64_t max_tokens = kHistogramMaxTokens);

// Reads `path` and parses it with `path` as the source. Throws kda::Error when unreadable.
TokenHistogram load_token_histogram(const std::string& path,
                                    int64_t max_tokens = kHistogramMaxTokens);

struct LadderCost {
  int64_t real_tokens = 0;
  int64_t padded_tokens = 0;
  // padded / (real + padded); 0 for a histogram without tokens.
  double share() const;
};

// Real and padded tokens of the histogram's batches run with `buckets` (strictly increasing,
// each in [1, kLadderMaxBucket]; throws kda::Error otherwise), windows included, exactly as
// plan_windows + choose_bucket split and key them.
LadderCost ladder_cost(const TokenHistogram& histogram, const std::vector<int64_t>& buckets);
double padded_share(const TokenHistogram& histogram, const std::vector<int64_t>& buckets);

struct LadderLimits {
  // Every proposed bucket is a multiple of align (the GEMMs and the conv tile rows by 16).
  int64_t align = 16;
  // Largest allowed bucket; the ladder's top is at most max_bucket rounded down to align.
  int64_t max_bucket = kLadderMaxBucket;
  // The ladder's top is at least min_largest rounded up to align. 0: the histogram's largest
  // batch, capped at the largest allowed bucket (bigger batches then run in windows).
  int64_t min_largest = 0;
  // The lower buckets are searched over every distinct rounded size while there are at most
  // this many; above, over a grid where consecutive values are at most 1/512 apart relative
  // to the smaller one (see propose_buckets).
  int64_t max_exact_candidates = 4096;
};

// The ladder of at most num_graphs (1..kLadderMaxGraphs) buckets with the least padded tokens
// on this histogram, within `limits` (throws kda::Error for bad limits). Ties go to fewer
// buckets, then to the ladder whose buckets, compared from the largest down, are smaller.
//
// Search space and exactness. The top L is one of: the smallest allowed top lo, the largest
// useful top hi = min(largest batch rounded up, largest allowed), and every rounded batch size
// in between (L above hi only adds padding; with more than 32 such values, 32 spread evenly
// over them, lo and hi included). For each L the buckets below it are found by exact dynamic
// programming: an optimal bucket can always be lowered to the rounded size of the largest
// (window-residual) batch it serves, so the rounded residual sizes below L are the only
// candidates. With more than limits.max_exact_candidates of them they are thinned to a grid
// that keeps, for every candidate c, one c' >= c with c' - c <= c / 512; rounding an optimal
// ladder up onto it runs at most 1/512 more rows, so the share is at most 0.2 points above the
// optimum for that L. The grid holds at most ~512 + 512 ln(max_bucket / (512 align)) values
// (about 4400 for align 1, 3000 for align 16, with 2^20), and the DP over m candidates costs
// O(num_graphs m log m) (divide and conquer: the interval cost is Monge); 10^5 distinct sizes and
// 64 graphs take tens of milliseconds per top.
std::vector<int64_t> propose_buckets(const TokenHistogram& histogram, int num_graphs,
                                     const LadderLimits& limits = {});

// The comparison ladder: num_graphs consecutive powers of two (fewer if they would go below 1)
// whose top is the smallest power of two >= the ladder top the limits ask for (lo above), or
// the largest power of two <= max_bucket when that one is bigger than max_bucket.
std::vector<int64_t> power_of_two_ladder(const TokenHistogram& histogram, int num_graphs,
                                         const LadderLimits& limits = {});

}  // namespace kda::detail
