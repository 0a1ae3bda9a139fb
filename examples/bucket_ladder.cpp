// bucket_ladder: proposes runtime.token_buckets from a histogram of the batch sizes a server
// logged. For each graph count it prints the ladder with the least padding (see
// kda::detail::propose_buckets), the share of the rows the graphs run that are padding, and for
// comparison the share of a power-of-two ladder with as many graphs; then it writes the YAML
// lines of the last graph count (to --out, or to stdout after the table).
//
//   bucket_ladder --histogram tests/data/histograms/chat_mixed.csv --graphs 4,6,8
//   bucket_ladder --histogram traffic.csv --graphs 6 --max-bucket 16384 --out ladder.yaml
//   bucket_ladder --histogram traffic.csv --graphs 6 --min-largest 4096
//
// The histogram is a CSV of `tokens,count` lines or a single column of batch sizes (header,
// blank lines and # comments allowed); see kda::detail::parse_token_histogram.
//
// Exit codes: 0 success (and --help); 1 the --out file could not be written; 2 bad arguments, a
// histogram that cannot be read (the message says why) or is bad (it names file:line), or limits no
// ladder can meet.
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "kda/error.h"
#include "runtime/bucket_ladder.h"

namespace {

using kda::detail::LadderLimits;
using kda::detail::TokenHistogram;

constexpr const char* kUsage =
    "usage: bucket_ladder --histogram FILE.csv [--graphs N[,N...]]... [--align A]\n"
    "                     [--max-bucket B] [--min-largest M] [--out FILE.yaml]\n"
    "\n"
    "Proposes runtime.token_buckets for a logged batch-size histogram: for each graph count N\n"
    "the ladder of at most N buckets with the fewest padded tokens, its padded share of the\n"
    "tokens run, and the share of a power-of-two ladder of N buckets. Batches above the\n"
    "largest bucket run in windows of it (only the last window is padded).\n"
    "\n"
    "  --histogram FILE  CSV of `tokens,count` lines, or one batch size per line\n"
    "  --graphs N,...    graph counts to propose, 1..64 (default 6); repeatable; the YAML\n"
    "                    is written for the last one\n"
    "  --align A         every bucket is a multiple of A (default 16)\n"
    "  --max-bucket B    largest allowed bucket (default 1048576); bigger batches run in\n"
    "                    windows and the YAML sets runtime.max_batch_tokens for them\n"
    "  --min-largest M   let the largest bucket go down to M (default: the largest batch,\n"
    "                    capped at B); the largest bucket is then searched too. Only\n"
    "                    padding is counted: a smaller one runs long batches in more\n"
    "                    windows, so more graph replays\n"
    "  --out FILE        write the YAML lines there instead of stdout\n"
    "  --help            this text\n";

struct Options {
  std::string histogram;
  std::vector<int> graphs;
  LadderLimits limits;
  std::string out;
};

struct UsageError {
  std::string message;
};

int64_t parse_integer(const std::string& flag, const std::string& text) {
  std::size_t used = 0;
  long long value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (text.empty() || used != text.size())
    throw UsageError{flag + " expects an integer, got \"" + text + "\""};
  return value;
}

void add_graphs(Options& options, const std::string& list) {
  std::stringstream in(list);
  std::string item;
  bool any = false;
  while (std::getline(in, item, ',')) {
    const int64_t n = parse_integer("--graphs", item);
    if (n < 1 || n > kda::detail::kLadderMaxGraphs)
      throw UsageError{"--graphs " + item + " is outside 1.." +
                       std::to_string(kda::detail::kLadderMaxGraphs)};
    options.graphs.push_back(static_cast<int>(n));
    any = true;
  }
  if (!any) throw UsageError{"--graphs expects a count or a comma-separated list"};
}

// Returns false for --help.
bool parse_args(int argc, char** argv, Options& options) {
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    std::string value;
    bool has_value = false;
    const std::size_t eq = flag.find('=');
    if (flag.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
      has_value = true;
    }
    if (flag == "--help" || flag == "-h") return false;
    const auto next = [&]() -> std::string {
      if (has_value) return value;
      if (i + 1 >= argc) throw UsageError{flag + " expects a value"};
      return argv[++i];
    };
    if (flag == "--histogram") {
      options.histogram = next();
    } else if (flag == "--graphs") {
      add_graphs(options, next());
      // `--graphs 4 6 8`: counts may also follow as separate arguments.
      while (!has_value && i + 1 < argc && argv[i + 1][0] != '-') add_graphs(options, argv[++i]);
    } else if (flag == "--align") {
      options.limits.align = parse_integer(flag, next());
    } else if (flag == "--max-bucket") {
      options.limits.max_bucket = parse_integer(flag, next());
    } else if (flag == "--min-largest") {
      options.limits.min_largest = parse_integer(flag, next());
      if (options.limits.min_largest < 1) throw UsageError{"--min-largest must be at least 1"};
    } else if (flag == "--out") {
      options.out = next();
    } else {
      throw UsageError{"unknown argument \"" + std::string(argv[i]) + "\""};
    }
  }
  if (options.histogram.empty()) throw UsageError{"--histogram is required"};
  if (options.graphs.empty()) options.graphs.push_back(6);
  return true;
}

std::string percent(double share) {
  char text[32];
  const double p = 100.0 * share;
  std::snprintf(text, sizeof text, p > 0.0 && p < 0.1 ? "%.3f%%" : "%.1f%%", p);
  return text;
}

std::string list(const std::vector<int64_t>& values) {
  std::string text = "[";
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(values[i]);
  }
  return text + "]";
}

// The whole file at `path` into `text`; false, with errno telling why, when it cannot be read.
bool read_file(const std::string& path, std::string& text) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (!file) return false;
  char buffer[1 << 14];
  for (std::size_t got; (got = std::fread(buffer, 1, sizeof buffer, file)) > 0;) text.append(buffer, got);
  const bool ok = std::ferror(file) == 0;
  const int read_errno = errno;
  std::fclose(file);
  errno = read_errno;
  return ok;
}

int run(const Options& options) {
  std::string text;
  if (!read_file(options.histogram, text)) {
    std::fprintf(stderr, "bucket_ladder: %s: cannot read the histogram: %s\n", options.histogram.c_str(),
                 std::strerror(errno));
    return 2;
  }
  const TokenHistogram histogram = kda::detail::parse_token_histogram(text, options.histogram);
  const kda::detail::HistogramTotals totals = kda::detail::histogram_totals(histogram);
  std::printf("%s: %lld batches, %lld tokens, %lld distinct sizes from %lld to %lld tokens\n",
              options.histogram.c_str(), static_cast<long long>(totals.batches),
              static_cast<long long>(totals.tokens), static_cast<long long>(totals.distinct),
              static_cast<long long>(histogram.counts.front().first),
              static_cast<long long>(totals.largest));

  std::vector<int64_t> chosen;
  double chosen_share = 0.0;
  for (int graphs : options.graphs) {
    const std::vector<int64_t> ladder =
        kda::detail::propose_buckets(histogram, graphs, options.limits);
    const std::vector<int64_t> pow2 =
        kda::detail::power_of_two_ladder(histogram, graphs, options.limits);
    const double share = kda::detail::padded_share(histogram, ladder);
    std::string used;
    if (static_cast<int>(ladder.size()) < graphs)
      used = " (" + std::to_string(ladder.size()) + " needed)";
    std::printf("%d graphs%s: %s  padded %s of the tokens run  (powers of two %s: %s)\n", graphs,
                used.c_str(), list(ladder).c_str(), percent(share).c_str(), list(pow2).c_str(),
                percent(kda::detail::padded_share(histogram, pow2)).c_str());
    chosen = ladder;
    chosen_share = share;
  }

  std::ostringstream yaml;
  yaml << "# runtime: lines proposed by bucket_ladder for " << options.graphs.back()
       << " graphs from " << options.histogram << " (padded " << percent(chosen_share)
       << " of the tokens run)\n";
  yaml << "token_buckets: " << list(chosen) << "\n";
  if (totals.largest > chosen.back()) {
    // validate_config: a batch above the largest bucket needs max_batch_tokens to split it.
    yaml << "max_batch_tokens: " << totals.largest << "  # the largest logged batch, run in "
         << "windows of " << chosen.back() << "\n";
  }
  if (options.out.empty()) {
    std::printf("\n%s", yaml.str().c_str());
    return 0;
  }
  std::ofstream out(options.out, std::ios::binary | std::ios::trunc);
  out << yaml.str();
  out.close();
  if (!out) {
    std::fprintf(stderr, "bucket_ladder: cannot write %s\n", options.out.c_str());
    return 1;
  }
  std::printf("wrote %s\n", options.out.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  try {
    if (!parse_args(argc, argv, options)) {
      std::fputs(kUsage, stdout);
      return 0;
    }
  } catch (const UsageError& e) {
    std::fprintf(stderr, "bucket_ladder: %s\n\n%s", e.message.c_str(), kUsage);
    return 2;
  }
  try {
    return run(options);
  } catch (const kda::Error& e) {
    // The histogram's file:line message, or the limits no ladder can meet.
    std::fprintf(stderr, "bucket_ladder: %s\n", e.message().c_str());
    return 2;
  }
}
