#include "runtime/bucket_ladder.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>

#include "common/check.h"

namespace kda::detail {

namespace {

constexpr const char* kParse = "kda::detail::parse_token_histogram";
constexpr const char* kLoad = "kda::detail::load_token_histogram";
constexpr const char* kCost = "kda::detail::ladder_cost";
constexpr const char* kPropose = "kda::detail::propose_buckets";
constexpr const char* kPowerOfTwo = "kda::detail::power_of_two_ladder";

// Tops tried by propose_buckets when the smallest allowed top is below the largest batch.
constexpr std::size_t kMaxTops = 32;
// Relative spacing of the thinned candidate grid: every candidate c keeps a c' in [c, c + c/512].
constexpr int64_t kGridDivisor = 512;
// Above every cost the DP can reach (< 2^60, see the histogram bounds), with room to add one.
constexpr int64_t kInfinite = int64_t{1} << 62;

int64_t round_up(int64_t value, int64_t align) { return (value + align - 1) / align * align; }

std::string trim(const std::string& s) {
  std::size_t b = 0;
  std::size_t e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

std::vector<std::string> split_fields(const std::string& line) {
  std::vector<std::string> fields;
  std::size_t start = 0;
  while (true) {
    const std::size_t comma = line.find(',', start);
    fields.push_back(trim(line.substr(start, comma == std::string::npos ? comma : comma - start)));
    if (comma == std::string::npos) return fields;
    start = comma + 1;
  }
}

// A header field: a name such as `tokens` or `batch_count`, never a (malformed) number.
bool is_name(const std::string& field) {
  if (field.empty()) return false;
  const auto first = static_cast<unsigned char>(field[0]);
  if (!std::isalpha(first) && first != '_') return false;
  return std::all_of(field.begin(), field.end(), [](char c) {
    const auto u = static_cast<unsigned char>(c);
    return std::isalnum(u) || u == '_' || u == ' ';
  });
}

bool parse_int(const std::string& field, int64_t& value) {
  if (field.empty()) return false;
  const char* begin = field.data();
  const char* end = begin + field.size();
  const auto result = std::from_chars(begin, end, value);
  return result.ec == std::errc() && result.ptr == end;
}

// The histogram's nonzero entries, tokens strictly increasing, duplicates summed; checks what
// parse_token_histogram guarantees, for a histogram built by hand.
std::vector<std::pair<int64_t, int64_t>> normalized(const TokenHistogram& histogram,
                                                    const char* function) {
  std::map<int64_t, int64_t> merged;
  int64_t batches = 0;
  int64_t tokens = 0;
  for (const auto& [size, count] : histogram.counts) {
    KDA_CHECK(size >= 1, function, "batch size ", size, " must be at least 1");
    KDA_CHECK(size <= kHistogramMaxTokens, function, "batch size ", size, " is more than ",
              kHistogramMaxTokens, " tokens");
    KDA_CHECK(count >= 0, function, "count ", count, " of batch size ", size,
              " must not be negative");
    if (count == 0) continue;
    KDA_CHECK(count <= kHistogramMaxBatches - batches, function, "more than ",
              kHistogramMaxBatches, " batches in all");
    KDA_CHECK(count <= (kHistogramMaxTotalTokens - tokens) / size, function, "more than ",
              kHistogramMaxTotalTokens, " tokens in all");
    batches += count;
    tokens += count * size;
    merged[size] += count;
  }
  KDA_CHECK(batches > 0, function, "the histogram has no batch");
  return {merged.begin(), merged.end()};
}

// Rows of the window that gets padded: the whole batch, or the last window of a split one.
int64_t padded_rows(int64_t tokens, int64_t largest) {
  return tokens <= largest ? tokens : (tokens - 1) % largest + 1;
}

// A proposal for one top: total padding and the buckets, increasing.
struct Ladder {
  int64_t padded = kInfinite;
  std::vector<int64_t> buckets;
};

// The tie order of propose_buckets: less padding, fewer buckets, then smaller buckets compared
// from the largest down.
bool better(const Ladder& a, const Ladder& b) {
  if (a.padded != b.padded) return a.padded < b.padded;
  if (a.buckets.size() != b.buckets.size()) return a.buckets.size() < b.buckets.size();
  return std::lexicographical_compare(a.buckets.rbegin(), a.buckets.rend(), b.buckets.rbegin(),
                                      b.buckets.rend());
}

// Least padding with at most `graphs` buckets whose top is `top`, for the histogram's batches.
// Buffers live in the object so that trying several tops reuses them.
class TopSolver {
 public:
  TopSolver(const std::vector<std::pair<int64_t, int64_t>>& entries, int64_t align,
            int64_t max_exact)
      : entries_(entries), align_(align), max_exact_(max_exact) {}

  Ladder solve(int64_t top, int graphs) {
    build_candidates(top);
    const int positions = static_cast<int>(values_.size());  // candidates, the top last
    const int layers = std::min(graphs, positions);

    // f[k][j]: least padding of the residuals up to candidate j with exactly k buckets, the
    // largest at j (positions 1..positions; 0 is "below every candidate").
    prev_.assign(static_cast<std::size_t>(positions) + 1, kInfinite);
    cur_.assign(prev_.size(), kInfinite);
    arg_.assign(static_cast<std::size_t>(layers + 1) * prev_.size(), -1);
    for (int j = 1; j <= positions; ++j) prev_[j] = cost(0, j);
    std::vector<int64_t> at_top(static_cast<std::size_t>(layers) + 1, kInfinite);
    at_top[1] = prev_[positions];
    for (int k = 2; k <= layers; ++k) {
      std::fill(cur_.begin(), cur_.end(), kInfinite);
      layer_ = k;
      // Row j may use predecessors k-1..j-1; every prev_ there is finite.
      divide(k, positions, k - 1, positions - 1);
      at_top[k] = cur_[positions];
      std::swap(prev_, cur_);
    }

    // Fewest buckets among the least padding (more buckets never pad more).
    int best_k = 1;
    for (int k = 2; k <= layers; ++k)
      if (at_top[k] < at_top[best_k]) best_k = k;

    Ladder ladder;
    ladder.padded = at_top[best_k];
    int j = positions;
    for (int k = best_k; k >= 1; --k) {
      ladder.buckets.push_back(values_[static_cast<std::size_t>(j) - 1]);
      if (k > 1) j = arg_[static_cast<std::size_t>(k) * prev_.size() + j];
    }
    std::reverse(ladder.buckets.begin(), ladder.buckets.end());
    return ladder;
  }

 private:
  // Padding of the residuals in (candidate i, candidate j], all run in candidate j.
  int64_t cost(int i, int j) const {
    return values_[static_cast<std::size_t>(j) - 1] * (count_[j] - count_[i]) -
           (tokens_[j] - tokens_[i]);
  }

  // Rows jlo..jhi of layer `layer_`, whose leftmost best predecessors lie in olo..ohi. The cost
  // is Monge (cost(i,j) + cost(i',j') - cost(i,j') - cost(i',j) = (c_j - c_j')(N_i' - N_i) <= 0
  // for i < i' < j < j'), so leftmost minima move right with j: each row splits the search.
  // The strict < keeps the leftmost (smallest) predecessor, the tie order's choice.
  void divide(int jlo, int jhi, int olo, int ohi) {
    if (jlo > jhi) return;
    const int mid = jlo + (jhi - jlo) / 2;
    int64_t best = kInfinite;
    int best_i = olo;
    const int last = std::min(ohi, mid - 1);
    for (int i = olo; i <= last; ++i) {
      const int64_t v = prev_[i] + cost(i, mid);
      if (v < best) {
        best = v;
        best_i = i;
      }
    }
    cur_[mid] = best;
    arg_[static_cast<std::size_t>(layer_) * prev_.size() + mid] = best_i;
    divide(jlo, mid - 1, olo, best_i);
    divide(mid + 1, jhi, best_i, ohi);
  }

  // values_: the candidate buckets below `top` (rounded residual sizes, thinned when there are
  // more than max_exact_) and then `top`; count_/tokens_: prefix sums of the residual batches
  // and their rows over the candidates, each residual counted at the smallest candidate >= it.
  void build_candidates(int64_t top) {
    const auto slots = static_cast<std::size_t>(top / align_);
    slot_count_.assign(slots + 1, 0);
    slot_tokens_.assign(slots + 1, 0);
    for (const auto& [size, count] : entries_) {
      const int64_t rows = padded_rows(size, top);
      const auto slot = static_cast<std::size_t>((rows + align_ - 1) / align_);
      slot_count_[slot] += count;
      slot_tokens_[slot] += rows * count;
    }
    std::vector<std::size_t> lower;
    for (std::size_t s = 1; s < slots; ++s)
      if (slot_count_[s] > 0) lower.push_back(s);
    if (static_cast<int64_t>(lower.size()) > max_exact_) lower = thinned(lower);

    values_.clear();
    for (std::size_t s : lower) values_.push_back(static_cast<int64_t>(s) * align_);
    values_.push_back(top);
    lower.push_back(slots);

    count_.assign(lower.size() + 1, 0);
    tokens_.assign(lower.size() + 1, 0);
    std::size_t slot = 1;
    for (std::size_t j = 0; j < lower.size(); ++j) {
      int64_t n = 0;
      int64_t t = 0;
      for (; slot <= lower[j]; ++slot) {
        n += slot_count_[slot];
        t += slot_tokens_[slot];
      }
      count_[j + 1] = count_[j] + n;
      tokens_[j + 1] = tokens_[j] + t;
    }
  }

  // Greedy cover: from the smallest uncovered candidate c, keep the largest candidate
  // <= c + c/512; it covers everything from c up to itself within the relative spacing.
  std::vector<std::size_t> thinned(const std::vector<std::size_t>& slots) const {
    std::vector<std::size_t> kept;
    std::size_t i = 0;
    while (i < slots.size()) {
      const int64_t start = static_cast<int64_t>(slots[i]) * align_;
      const int64_t limit = start + start / kGridDivisor;
      std::size_t t = i;
      while (t + 1 < slots.size() && static_cast<int64_t>(slots[t + 1]) * align_ <= limit) ++t;
      kept.push_back(slots[t]);
      i = t + 1;
    }
    return kept;
  }

  const std::vector<std::pair<int64_t, int64_t>>& entries_;
  const int64_t align_;
  const int64_t max_exact_;
  std::vector<int64_t> slot_count_, slot_tokens_;
  std::vector<int64_t> values_, count_, tokens_;
  std::vector<int64_t> prev_, cur_;
  std::vector<int> arg_;
  int layer_ = 0;
};

struct TopRange {
  int64_t lo = 0;          // smallest allowed top
  int64_t hi = 0;          // largest useful top
  int64_t max_allowed = 0; // max_bucket rounded down to align
};

TopRange top_range(const std::vector<std::pair<int64_t, int64_t>>& entries,
                   const LadderLimits& limits, const char* function) {
  KDA_CHECK(limits.max_bucket >= 1 && limits.max_bucket <= kLadderMaxBucket, function,
            "max_bucket ", limits.max_bucket, " must be in [1, ", kLadderMaxBucket, "]");
  KDA_CHECK(limits.align >= 1 && limits.align <= limits.max_bucket, function, "align ",
            limits.align, " must be in [1, max_bucket ", limits.max_bucket, "]");
  KDA_CHECK(limits.min_largest >= 0 && limits.min_largest <= limits.max_bucket, function,
            "min_largest ", limits.min_largest, " must be in [0, max_bucket ", limits.max_bucket,
            "]");
  TopRange range;
  range.max_allowed = limits.max_bucket / limits.align * limits.align;
  const int64_t largest_up = round_up(entries.back().first, limits.align);
  if (limits.min_largest == 0) {
    range.lo = std::min(largest_up, range.max_allowed);
  } else {
    range.lo = round_up(limits.min_largest, limits.align);
    KDA_CHECK(range.lo <= range.max_allowed, function, "no multiple of align ", limits.align,
              " lies in [min_largest ", limits.min_largest, ", max_bucket ", limits.max_bucket,
              "]");
  }
  range.hi = std::max(range.lo, std::min(largest_up, range.max_allowed));
  return range;
}

}  // namespace

HistogramTotals histogram_totals(const TokenHistogram& histogram) {
  const auto entries = normalized(histogram, "kda::detail::histogram_totals");
  HistogramTotals totals;
  for (const auto& [size, count] : entries) {
    totals.batches += count;
    totals.tokens += size * count;
  }
  totals.largest = entries.back().first;
  totals.distinct = static_cast<int64_t>(entries.size());
  return totals;
}

TokenHistogram parse_token_histogram(const std::string& text, const std::string& source,
                                     int64_t max_tokens) {
  KDA_CHECK(max_tokens >= 1 && max_tokens <= kHistogramMaxTokens, kParse, "max_tokens ",
            max_tokens, " must be in [1, ", kHistogramMaxTokens, "]");
  std::map<int64_t, int64_t> merged;
  int64_t batches = 0;
  int64_t tokens = 0;
  std::size_t columns = 0;  // 0 until the header or the first data line sets it
  int64_t columns_line = 0;
  bool any_line = false;

  std::istringstream in(text);
  std::string raw;
  int64_t line_no = 0;
  while (std::getline(in, raw)) {
    ++line_no;
    const std::size_t hash = raw.find('#');
    const std::string line = trim(hash == std::string::npos ? raw : raw.substr(0, hash));
    if (line.empty()) continue;
    const std::vector<std::string> fields = split_fields(line);
    const auto where = [&] { return str_cat(source, ':', line_no, ": "); };

    if (!any_line && std::all_of(fields.begin(), fields.end(), is_name)) {
      any_line = true;
      KDA_CHECK(fields.size() <= 2, kParse, where(), "header has ", fields.size(),
                " fields; expected `tokens,count` or `tokens`");
      columns = fields.size();
      columns_line = line_no;
      continue;
    }
    any_line = true;
    if (columns == 0) {
      KDA_CHECK(fields.size() <= 2, kParse, where(), fields.size(),
                " fields; expected `tokens,count` or a single batch size");
      columns = fields.size();
      columns_line = line_no;
    } else if (fields.size() != columns) {
      KDA_FAIL(kParse, where(), fields.size(), fields.size() == 1 ? " field" : " fields",
               ", expected ", columns, columns == 1 ? " (a batch size)" : " (tokens,count)",
               " as on line ", columns_line);
    }

    int64_t size = 0;
    KDA_CHECK(parse_int(fields[0], size), kParse, where(), "tokens \"", fields[0],
              "\" is not an integer");
    KDA_CHECK(size >= 1, kParse, where(), "tokens ", size, " must be at least 1");
    KDA_CHECK(size <= max_tokens, kParse, where(), "tokens ", size, " is more than the limit ",
              max_tokens);
    int64_t count = 1;
    if (columns == 2) {
      KDA_CHECK(parse_int(fields[1], count), kParse, where(), "count \"", fields[1],
                "\" is not an integer");
      KDA_CHECK(count >= 0, kParse, where(), "count ", count, " must not be negative");
    }
    if (count == 0) continue;
    KDA_CHECK(count <= kHistogramMaxBatches - batches, kParse, where(), "more than ",
              kHistogramMaxBatches, " batches in all");
    KDA_CHECK(count <= (kHistogramMaxTotalTokens - tokens) / size, kParse, where(), "more than ",
              kHistogramMaxTotalTokens, " tokens in all");
    batches += count;
    tokens += count * size;
    merged[size] += count;
  }
  KDA_CHECK(batches > 0, kParse, source, ": no batches (the histogram is empty)");
  TokenHistogram histogram;
  histogram.counts.assign(merged.begin(), merged.end());
  return histogram;
}

TokenHistogram load_token_histogram(const std::string& path, int64_t max_tokens) {
  errno = 0;
  std::ifstream file(path, std::ios::binary);
  const int open_errno = errno;
  KDA_CHECK(file.good(), kLoad, path, ": cannot open the histogram",
            open_errno ? std::string(": ") + std::strerror(open_errno) : std::string());
  std::ostringstream text;
  text << file.rdbuf();
  KDA_CHECK(!file.bad(), kLoad, path, ": cannot read the histogram");
  return parse_token_histogram(text.str(), path, max_tokens);
}

double LadderCost::share() const {
  const int64_t run = real_tokens + padded_tokens;
  return run > 0 ? static_cast<double>(padded_tokens) / static_cast<double>(run) : 0.0;
}

LadderCost ladder_cost(const TokenHistogram& histogram, const std::vector<int64_t>& buckets) {
  KDA_CHECK(!buckets.empty(), kCost, "no buckets");
  for (std::size_t i = 0; i < buckets.size(); ++i) {
    KDA_CHECK(buckets[i] >= 1 && buckets[i] <= kLadderMaxBucket, kCost, "bucket[", i, "] = ",
              buckets[i], " must be in [1, ", kLadderMaxBucket, "]");
    KDA_CHECK(i == 0 || buckets[i] > buckets[i - 1], kCost, "bucket[", i, "] = ", buckets[i],
              " after ", buckets[i - 1], ": buckets must increase");
  }
  LadderCost cost;
  const int64_t largest = buckets.back();
  for (const auto& [size, count] : normalized(histogram, kCost)) {
    const int64_t rows = padded_rows(size, largest);
    const int64_t bucket = *std::lower_bound(buckets.begin(), buckets.end(), rows);
    cost.real_tokens += size * count;
    cost.padded_tokens += (bucket - rows) * count;
  }
  return cost;
}

double padded_share(const TokenHistogram& histogram, const std::vector<int64_t>& buckets) {
  return ladder_cost(histogram, buckets).share();
}

std::vector<int64_t> propose_buckets(const TokenHistogram& histogram, int num_graphs,
                                     const LadderLimits& limits) {
  KDA_CHECK(num_graphs >= 1 && num_graphs <= kLadderMaxGraphs, kPropose, "num_graphs ",
            num_graphs, " must be in [1, ", kLadderMaxGraphs, "]");
  KDA_CHECK(limits.max_exact_candidates >= 1, kPropose, "max_exact_candidates ",
            limits.max_exact_candidates, " must be at least 1");
  const auto entries = normalized(histogram, kPropose);
  const TopRange range = top_range(entries, limits, kPropose);

  // Tops: lo, the rounded sizes strictly between, hi. A top above hi pads more than hi: no batch
  // is above hi unless hi is the largest allowed bucket.
  std::vector<int64_t> tops{range.lo};
  for (const auto& entry : entries) {
    const int64_t t = round_up(entry.first, limits.align);
    if (t > range.lo && t < range.hi && t != tops.back()) tops.push_back(t);
  }
  if (range.hi != range.lo) tops.push_back(range.hi);
  if (tops.size() > kMaxTops) {
    std::vector<int64_t> spread;
    for (std::size_t i = 0; i < kMaxTops; ++i)
      spread.push_back(tops[i * (tops.size() - 1) / (kMaxTops - 1)]);
    tops = std::move(spread);
  }

  TopSolver solver(entries, limits.align, limits.max_exact_candidates);
  Ladder best;
  for (int64_t top : tops) {
    Ladder ladder = solver.solve(top, num_graphs);
    if (better(ladder, best)) best = std::move(ladder);
  }
  return best.buckets;
}

std::vector<int64_t> power_of_two_ladder(const TokenHistogram& histogram, int num_graphs,
                                         const LadderLimits& limits) {
  KDA_CHECK(num_graphs >= 1 && num_graphs <= kLadderMaxGraphs, kPowerOfTwo, "num_graphs ",
            num_graphs, " must be in [1, ", kLadderMaxGraphs, "]");
  const TopRange range = top_range(normalized(histogram, kPowerOfTwo), limits, kPowerOfTwo);
  int64_t top = 1;
  while (top < range.lo) top *= 2;
  if (top > limits.max_bucket) top /= 2;
  std::vector<int64_t> ladder;
  for (int g = 0; g < num_graphs && top >= 1; ++g, top /= 2) ladder.push_back(top);
  std::reverse(ladder.begin(), ladder.end());
  return ladder;
}

}  // namespace kda::detail
