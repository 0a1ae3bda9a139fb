// YAML -> kda::Config. The only translation unit that includes yaml-cpp.
//
// Parsing checks form only: every key known and given once, every value of its type, every
// required key present. Ranges and relations between values are validate_config's job, so they
// can be tested on configs built in code. Both steps report "<source>:<line>: <key path>: ...".
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <locale>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "common/check.h"
#include "config/config_source.h"
#include "kda/config.h"

namespace kda {
namespace {

using detail::str_cat;

// 1-based line of a node; 0 when yaml-cpp has no mark for it.
int line_of(const YAML::Node& node) {
  const int line = node.Mark().line;
  return line >= 0 ? line + 1 : 0;
}

// yaml-cpp gives an untagged plain scalar the tag "?" and a quoted or block scalar "!" (0.7 and
// 0.8 alike); anything else was written as an explicit tag.
bool is_plain(const YAML::Node& node) { return node.Tag() == "?"; }
bool is_quoted(const YAML::Node& node) { return node.Tag() == "!"; }

std::string describe(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Null: return "null";
    case YAML::NodeType::Sequence: return "a list";
    case YAML::NodeType::Map: return "a map";
    case YAML::NodeType::Scalar:
      if (is_plain(node)) return str_cat('"', node.Scalar(), '"');
      if (is_quoted(node)) return str_cat("the quoted string \"", node.Scalar(), '"');
      return str_cat('"', node.Scalar(), "\" tagged ", node.Tag());
    case YAML::NodeType::Undefined: break;
  }
  return "nothing";
}

// Decimal integer text: optional sign, no leading zeros (so "010" is not read as 10 by one
// reader and 8 by another), no exponent or fraction.
bool is_integer_text(const std::string& s) {
  std::size_t i = (!s.empty() && (s[0] == '+' || s[0] == '-')) ? 1 : 0;
  if (i == s.size()) return false;
  if (s[i] == '0' && i + 1 != s.size()) return false;
  return std::all_of(s.begin() + static_cast<std::ptrdiff_t>(i), s.end(),
                     [](char c) { return c >= '0' && c <= '9'; });
}

// YAML 1.2 core-schema float text: [-+]? ( . digits | digits [. digits*] ) ( [eE] [-+]? digits )?
bool is_float_text(const std::string& s) {
  std::size_t i = 0;
  const auto digits = [&]() {
    const std::size_t start = i;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9') ++i;
    return i - start;
  };
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
  const std::size_t whole = digits();
  std::size_t frac = 0;
  if (i < s.size() && s[i] == '.') {
    ++i;
    frac = digits();
  }
  if (whole == 0 && frac == 0) return false;
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    ++i;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
    if (digits() == 0) return false;
  }
  return i == s.size();
}

// Edit distance, for "did you mean" on unknown keys.
std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// One key of a map section, as read.
struct Entry {
  std::string path;  // "runtime.token_buckets"
  int line = 0;      // of the key
  YAML::Node value;
};

class Reader {
 public:
  Reader(const char* function, detail::ConfigSource& where) : function_(function), where_(where) {}

  [[noreturn]] void fail(int line, const std::string& path, const std::string& what) const {
    std::string where = where_.file;
    if (line > 0) where += str_cat(':', line);
    KDA_FAIL_AT_INPUT(function_, where, ": ", path.empty() ? "" : path + ": ", what);
  }

  // The entries of a map node keyed by name, after rejecting a non-map, non-scalar keys,
  // duplicate keys and keys not in `known`. Records each key's line.
  std::map<std::string, Entry> section(const YAML::Node& node, const std::string& path,
                                       int line, const std::vector<std::string>& known) {
    if (!node.IsMap())
      fail(line, path,
           str_cat("expected a map", path.empty() ? " of the sections model, runtime and pools" : "",
                   ", got ", describe(node)));
    std::map<std::string, Entry> entries;
    for (auto it = node.begin(); it != node.end(); ++it) {
      const YAML::Node key = it->first;
      const int key_line = line_of(key);
      if (!key.IsScalar())
        fail(key_line, path, str_cat("keys must be names, got ", describe(key), " as a key"));
      const std::string& name = key.Scalar();
      const std::string key_path = path.empty() ? name : path + "." + name;
      // yaml-cpp keeps both entries of a repeated key but looks up only the first, so a
      // repeated key would otherwise be silently dropped.
      if (auto seen = entries.find(name); seen != entries.end())
        fail(key_line, key_path,
             str_cat("duplicate key; first given on line ", seen->second.line));
      if (std::find(known.begin(), known.end(), name) == known.end())
        fail(key_line, key_path, unknown_key_message(name, known));
      entries[name] = Entry{key_path, key_line, it->second};
      record_line(key_path, key_line);
    }
    return entries;
  }

  const Entry* find(const std::map<std::string, Entry>& entries, const char* key) const {
    auto it = entries.find(key);
    return it == entries.end() ? nullptr : &it->second;
  }

  const Entry& require(const std::map<std::string, Entry>& entries, const char* key,
                       const std::string& path, int line) const {
    const Entry* entry = find(entries, key);
    if (!entry) fail(line, path, str_cat("missing required key ", key));
    return *entry;
  }

  int64_t integer(const YAML::Node& node, const std::string& path, int line) const {
    const std::string what = "expected an integer, got ";
    if (!node.IsScalar() || !is_plain(node)) fail(line, path, what + describe(node));
    const std::string& text = node.Scalar();
    if (!is_integer_text(text)) fail(line, path, what + describe(node));
    const char* first = text.data() + (text[0] == '+' ? 1 : 0);
    int64_t value = 0;
    const auto [end, error] = std::from_chars(first, text.data() + text.size(), value);
    if (error != std::errc() || end != text.data() + text.size())
      fail(line, path, str_cat(text, " is out of range for a 64-bit integer"));
    return value;
  }

  int64_t integer(const Entry& entry) const { return integer(entry.value, entry.path, entry.line); }

  double number(const Entry& entry) const {
    const YAML::Node& node = entry.value;
    const std::string what = "expected a number, got ";
    if (!node.IsScalar() || !is_plain(node)) fail(entry.line, entry.path, what + describe(node));
    const std::string& text = node.Scalar();
    // YAML spells the specials .inf and .nan; they are read so validation can name the problem.
    static const std::map<std::string, double> specials = {
        {".inf", HUGE_VAL},  {".Inf", HUGE_VAL},  {".INF", HUGE_VAL},
        {"+.inf", HUGE_VAL}, {"+.Inf", HUGE_VAL}, {"+.INF", HUGE_VAL},
        {"-.inf", -HUGE_VAL}, {"-.Inf", -HUGE_VAL}, {"-.INF", -HUGE_VAL},
        {".nan", std::numeric_limits<double>::quiet_NaN()},
        {".NaN", std::numeric_limits<double>::quiet_NaN()},
        {".NAN", std::numeric_limits<double>::quiet_NaN()},
    };
    if (auto special = specials.find(text); special != specials.end()) return special->second;
    if (!is_float_text(text)) fail(entry.line, entry.path, what + describe(node));
    // The classic locale: a server's global locale may use ',' as the decimal separator.
    std::istringstream in(text);
    in.imbue(std::locale::classic());
    double value = 0;
    in >> value;
    if (in.fail() || !std::isfinite(value))
      fail(entry.line, entry.path, str_cat(text, " is out of range for a double"));
    return value;
  }

  bool boolean(const Entry& entry) const {
    const YAML::Node& node = entry.value;
    if (node.IsScalar() && is_plain(node)) {
      if (node.Scalar() == "true") return true;
      if (node.Scalar() == "false") return false;
    }
    fail(entry.line, entry.path, str_cat("expected true or false, got ", describe(node)));
  }

  // A plain or quoted scalar.
  std::string text(const Entry& entry) const {
    const YAML::Node& node = entry.value;
    if (!node.IsScalar() || !(is_plain(node) || is_quoted(node)))
      fail(entry.line, entry.path, str_cat("expected a string, got ", describe(node)));
    return node.Scalar();
  }

  // A string naming one of two choices: `first` or `second` (the message lists both).
  template <typename Enum>
  Enum choice(const Entry& entry, const char* first, Enum first_value, const char* second,
              Enum second_value) const {
    const std::string word = text(entry);
    if (word == first) return first_value;
    if (word == second) return second_value;
    fail(entry.line, entry.path, str_cat("expected ", first, " or ", second, ", got ", describe(entry.value)));
  }

  void record_line(const std::string& path, int line) { where_.key_lines[path] = line; }

 private:
  static std::string unknown_key_message(const std::string& name,
                                         const std::vector<std::string>& known) {
    std::string message = "unknown key; expected one of ";
    const std::string* closest = nullptr;
    std::size_t best = 3;  // suggest only near misses: at most two edits
    for (const std::string& k : known) {
      if (&k != &known.front()) message += ", ";
      message += k;
      const std::size_t d = edit_distance(name, k);
      if (d < best) {
        best = d;
        closest = &k;
      }
    }
    if (closest) message += str_cat(" (did you mean ", *closest, "?)");
    return message;
  }

  const char* function_;
  detail::ConfigSource& where_;
};

void read_model(Reader& r, const Entry& section, ModelConfig& model) {
  const auto e = r.section(section.value, section.path, section.line,
                           {"hidden_size", "num_heads", "head_dim", "gate_rank", "conv_width",
                            "norm_eps", "gate_lower_bound"});
  model.hidden_size = r.integer(r.require(e, "hidden_size", section.path, section.line));
  model.num_heads = r.integer(r.require(e, "num_heads", section.path, section.line));
  if (const Entry* v = r.find(e, "head_dim")) model.head_dim = r.integer(*v);
  if (const Entry* v = r.find(e, "gate_rank")) model.gate_rank = r.integer(*v);
  if (const Entry* v = r.find(e, "conv_width")) model.conv_width = r.integer(*v);
  if (const Entry* v = r.find(e, "norm_eps")) model.norm_eps = r.number(*v);
  // null says "no lower bound" as explicitly as leaving the key out.
  if (const Entry* v = r.find(e, "gate_lower_bound"); v && !v->value.IsNull())
    model.gate_lower_bound = r.number(*v);
}

void read_runtime(Reader& r, const Entry& section, RuntimeConfig& runtime) {
  const auto e = r.section(section.value, section.path, section.line,
                           {"token_buckets", "max_seqs", "max_batch_tokens", "capture", "graphs",
                            "layer_steps", "recurrence", "num_layers", "gemm_workspace_mib",
                            "max_checkpoints", "sequence_parallel"});
  const Entry& buckets = r.require(e, "token_buckets", section.path, section.line);
  if (!buckets.value.IsSequence())
    r.fail(buckets.line, buckets.path,
           str_cat("expected a list of integers, got ", describe(buckets.value)));
  runtime.token_buckets.clear();
  for (std::size_t i = 0; i < buckets.value.size(); ++i) {
    const YAML::Node item = buckets.value[i];
    const std::string path = str_cat(buckets.path, '[', i, ']');
    const int line = line_of(item) > 0 ? line_of(item) : buckets.line;
    r.record_line(path, line);
    runtime.token_buckets.push_back(r.integer(item, path, line));
  }
  if (const Entry* v = r.find(e, "max_seqs")) runtime.max_seqs = r.integer(*v);
  if (const Entry* v = r.find(e, "max_batch_tokens")) runtime.max_batch_tokens = r.integer(*v);
  if (const Entry* v = r.find(e, "capture"))
    runtime.capture = r.choice(*v, "eager", CaptureMode::Eager, "lazy", CaptureMode::Lazy);
  if (const Entry* v = r.find(e, "graphs")) runtime.use_graphs = r.boolean(*v);
  if (const Entry* v = r.find(e, "recurrence"))
    runtime.recurrence = r.choice(*v, "chunked", Recurrence::Chunked, "token", Recurrence::TokenByToken);
  if (const Entry* v = r.find(e, "layer_steps"))
    runtime.layer_steps = r.choice(*v, "full", LayerSteps::Full, "conv", LayerSteps::InProjConv);
  if (const Entry* v = r.find(e, "num_layers")) runtime.num_layers = r.integer(*v);
  if (const Entry* v = r.find(e, "max_checkpoints")) runtime.max_checkpoints = r.integer(*v);
  if (const Entry* v = r.find(e, "sequence_parallel")) runtime.sequence_parallel = r.boolean(*v);
  if (const Entry* v = r.find(e, "gemm_workspace_mib")) {
    constexpr int64_t kMiB = int64_t{1} << 20;
    const int64_t mib = r.integer(*v);
    // The range proper is validate_config's; this only keeps the conversion from overflowing.
    if (mib > std::numeric_limits<int64_t>::max() / kMiB ||
        mib < std::numeric_limits<int64_t>::min() / kMiB)
      r.fail(v->line, v->path, str_cat(mib, " MiB is out of range; expected at most 1024"));
    runtime.gemm_workspace_bytes = mib * kMiB;
  }
}

void read_pools(Reader& r, const Entry& section, PoolConfig& pools) {
  const auto e = r.section(section.value, section.path, section.line,
                           {"cache_lines", "null_line", "external", "recurrent_layout", "conv_layout",
                            "recurrent_dtype", "conv_dtype"});
  pools.cache_lines = r.integer(r.require(e, "cache_lines", section.path, section.line));
  if (const Entry* v = r.find(e, "null_line")) {
    const int64_t line = r.integer(*v);
    if (line < std::numeric_limits<int32_t>::min() || line > std::numeric_limits<int32_t>::max())
      r.fail(v->line, v->path, str_cat(line, " does not fit the 32-bit cache index"));
    pools.null_line = static_cast<int32_t>(line);
  }
  if (const Entry* v = r.find(e, "external")) pools.external = r.boolean(*v);
  if (const Entry* v = r.find(e, "recurrent_layout"))
    pools.recurrent_layout = r.choice(*v, "hkv", RecurrentLayout::HKV, "hvk", RecurrentLayout::HVK);
  if (const Entry* v = r.find(e, "conv_layout"))
    pools.conv_layout = r.choice(*v, "dim_tap", ConvStateLayout::DimTap, "tap_dim", ConvStateLayout::TapDim);
  if (const Entry* v = r.find(e, "recurrent_dtype"))
    pools.recurrent_dtype = r.choice(*v, "fp32", DType::FP32, "bf16", DType::BF16);
  if (const Entry* v = r.find(e, "conv_dtype"))
    pools.conv_dtype = r.choice(*v, "fp32", DType::FP32, "bf16", DType::BF16);
}

void read_tensor_parallel(Reader& r, const Entry& section, TensorParallelConfig& tp) {
  const auto e = r.section(section.value, section.path, section.line, {"size", "rank"});
  if (const Entry* v = r.find(e, "size")) tp.size = r.integer(*v);
  if (const Entry* v = r.find(e, "rank")) tp.rank = r.integer(*v);
}

Config parse(const std::string& yaml_text, const std::string& source, const char* function,
             detail::ConfigSource& where) {
  Config config;
  where = detail::ConfigSource{source, {}};
  Reader r(function, where);

  std::vector<YAML::Node> documents;
  try {
    documents = YAML::LoadAll(yaml_text);
  } catch (const YAML::Exception& e) {
    const int line = e.mark.line >= 0 ? e.mark.line + 1 : 0;
    const std::string column = e.mark.column >= 0 ? str_cat(" at column ", e.mark.column + 1) : "";
    r.fail(line, "", str_cat("YAML syntax error", column, ": ", e.msg));
  }
  if (documents.size() > 1)
    r.fail(line_of(documents[1]), "", "more than one YAML document; a config is one document");
  if (documents.empty() || documents[0].IsNull())
    r.fail(0, "", "empty document; expected a map with the sections model, runtime and pools");

  const YAML::Node& root = documents[0];
  const auto top = r.section(root, "", line_of(root), {"name", "model", "runtime", "pools", "tensor_parallel"});
  if (const Entry* v = r.find(top, "name")) config.name = r.text(*v);
  const auto section = [&](const char* key) -> const Entry& {
    const Entry* entry = r.find(top, key);
    if (!entry) r.fail(0, key, "missing required section (model, runtime and pools are required)");
    return *entry;
  };
  read_model(r, section("model"), config.model);
  read_runtime(r, section("runtime"), config.runtime);
  read_pools(r, section("pools"), config.pools);
  if (const Entry* tp = r.find(top, "tensor_parallel")) read_tensor_parallel(r, *tp, config.tensor_parallel);

  detail::validate_config(config, &where);
  return config;
}

std::string read_file(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (!file) KDA_FAIL_AT_INPUT("kda::load_config", path, ": cannot open the config file: ", std::strerror(errno));
  std::string text;
  char buffer[1 << 14];
  std::size_t got = 0;
  while ((got = std::fread(buffer, 1, sizeof buffer, file)) > 0) text.append(buffer, got);
  const bool read_error = std::ferror(file) != 0;
  const int read_errno = errno;
  std::fclose(file);
  if (read_error)
    KDA_FAIL_AT_INPUT("kda::load_config", path, ": cannot read the config file: ", std::strerror(read_errno));
  return text;
}

}  // namespace

Config detail::parse_config_with_source(const std::string& yaml_text, const std::string& source,
                                        ConfigSource& where) {
  return parse(yaml_text, source, "kda::parse_config", where);
}

Config detail::load_config_with_source(const std::string& path, ConfigSource& where) {
  return parse(read_file(path), path, "kda::load_config", where);
}

Config parse_config(const std::string& yaml_text, const std::string& source) {
  detail::ConfigSource where;
  return detail::parse_config_with_source(yaml_text, source, where);
}

Config load_config(const std::string& path) {
  detail::ConfigSource where;
  return detail::load_config_with_source(path, where);
}

}  // namespace kda
