// Config loading (YAML -> structs, with file:line:key-path errors) and validation (no YAML).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "config/config_source.h"
#include "kda/config.h"
#include "kda/error.h"
#include "support/test_errors.h"

namespace {

using kda::test::error_of;
using kda::test::source_path;

std::string parse_error(const std::string& yaml) {
  return error_of([&] { kda::parse_config(yaml, "x.yaml"); }, "kda::parse_config");
}

std::string validate_error(const kda::Config& config) {
  return error_of([&] { kda::validate_config(config); }, "kda::validate_config");
}

// The smallest valid document: required keys only. Lines are 1-based as in messages.
const char* const kMinimal =
    "model:\n"                           // 1
    "  hidden_size: 256\n"               // 2
    "  num_heads: 2\n"                   // 3
    "runtime:\n"                         // 4
    "  token_buckets: [16, 64, 256]\n"   // 5
    "pools:\n"                           // 6
    "  cache_lines: 33\n";               // 7

// kMinimal with one more line appended to the section that starts `section:`.
std::string minimal_with(const std::string& section, const std::string& line) {
  std::string text = kMinimal;
  const std::string header = section + ":\n";
  const auto at = text.find(header);
  REQUIRE(at != std::string::npos);
  text.insert(at + header.size(), "  " + line + "\n");
  return text;
}

// Every recorded line of a loaded file holds its key (or, for a list item, its value).
void check_key_lines_match_file(const kda::Config& c, const kda::detail::ConfigSource& where) {
  std::ifstream in(where.file);
  REQUIRE(in);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  REQUIRE_FALSE(where.key_lines.empty());
  for (const auto& [path, line] : where.key_lines) {
    INFO(where.file << ": " << path << " at line " << line);
    REQUIRE(line >= 1);
    REQUIRE(line <= static_cast<int>(lines.size()));
    const std::string& text = lines[static_cast<std::size_t>(line - 1)];
    const auto bracket = path.find('[');
    if (bracket == std::string::npos) {
      const std::string key = path.substr(path.rfind('.') + 1);
      CHECK(text.find(key + ":") != std::string::npos);
    } else {
      const std::size_t i = std::stoul(path.substr(bracket + 1));
      CHECK(text.find(std::to_string(c.runtime.token_buckets[i])) != std::string::npos);
    }
  }
}

kda::Config code_config() {
  kda::Config c;
  c.model.hidden_size = 256;
  c.model.num_heads = 2;
  c.runtime.token_buckets = {16, 64, 256};
  c.pools.cache_lines = 33;
  return c;
}

}  // namespace

TEST_CASE("the shipped configs load with the documented sizes") {
  SUBCASE("seed scale") {
    kda::detail::ConfigSource where;
    const kda::Config c = kda::detail::load_config_with_source(source_path("configs/default.yaml"), where);
    check_key_lines_match_file(c, where);
    CHECK(c.name == "seed-scale");
    CHECK(c.model.hidden_size == 7168);
    CHECK(c.model.num_heads == 12);
    CHECK(c.model.head_dim == 128);
    CHECK(c.model.gate_rank == 128);
    CHECK(c.model.conv_width == 4);
    CHECK(c.model.norm_eps == doctest::Approx(1e-5));
    CHECK_FALSE(c.model.gate_lower_bound.has_value());
    CHECK(c.model.part_dim() == 1536);
    CHECK(c.model.in_proj_cols() == 3 * 1536 + 12 + 256);
    CHECK(c.model.in_proj_stride() == 4928);
    CHECK(c.runtime.token_buckets == std::vector<int64_t>{512, 1024, 2048, 4096, 8192, 16384});
    CHECK(c.runtime.max_seqs == 256);
    CHECK(c.runtime.max_batch_tokens == 65536);
    CHECK(c.runtime.batch_token_capacity() == 65536);
    CHECK(c.runtime.largest_bucket() == 16384);
    CHECK(c.runtime.capture == kda::CaptureMode::Lazy);
    CHECK(c.runtime.use_graphs);
    CHECK(c.runtime.num_layers == 2);
    CHECK(c.runtime.gemm_workspace_bytes == 32ll << 20);
    CHECK(c.runtime.max_checkpoints == 64);
    CHECK(c.pools.cache_lines == 513);
    CHECK(c.pools.null_line == 0);
    CHECK(c.conv_pool_elems() == 513 * 4608 * 3);
    CHECK(c.recurrent_pool_elems() == 513ll * 12 * 128 * 128);
    CHECK(where.file == source_path("configs/default.yaml"));
  }
  SUBCASE("Kimi-Linear-48B-A3B at TP 1") {
    kda::detail::ConfigSource where;
    const kda::Config c = kda::detail::load_config_with_source(source_path("configs/kimi-linear-48b-tp1.yaml"), where);
    check_key_lines_match_file(c, where);
    CHECK(c.name == "kimi-linear-48b-tp1");
    CHECK(c.model.hidden_size == 2304);
    CHECK(c.model.num_heads == 32);
    CHECK(c.model.part_dim() == 4096);
    CHECK(c.model.in_proj_cols() == 3 * 4096 + 32 + 256);
    CHECK(c.model.in_proj_stride() == 12608);
    CHECK(c.runtime.largest_bucket() == 16384);
    CHECK(c.runtime.batch_token_capacity() == 65536);
    CHECK(c.runtime.num_layers == 2);
    CHECK(c.runtime.max_checkpoints == 64);
    CHECK(c.pools.cache_lines == 513);
  }
  SUBCASE("tiny, for tests") {
    kda::detail::ConfigSource where;
    const kda::Config c = kda::detail::load_config_with_source(source_path("configs/tiny.yaml"), where);
    check_key_lines_match_file(c, where);
    CHECK(c.name == "tiny");
    CHECK(c.model.hidden_size == 256);
    CHECK(c.model.num_heads == 2);
    CHECK(c.model.gate_rank == 128);
    CHECK(c.model.part_dim() == 256);
    CHECK(c.model.in_proj_cols() == 1026);
    CHECK(c.model.in_proj_stride() == 1088);
    CHECK(c.runtime.token_buckets == std::vector<int64_t>{16, 64, 256});
    CHECK(c.runtime.max_seqs == 16);
    CHECK(c.runtime.batch_token_capacity() == 1024);
    CHECK(c.runtime.num_layers == 2);
    CHECK(c.runtime.max_checkpoints == 64);
    CHECK(c.pools.cache_lines == 33);
  }
}

TEST_CASE("absent optional keys take the defaults of config.h") {
  const kda::Config c = kda::parse_config(kMinimal);
  const kda::Config defaults;
  CHECK(c.name.empty());
  // parse_config's default source name is what its messages start with.
  CHECK_THROWS_WITH_AS(kda::parse_config("model: [1]"), doctest::Contains("kda::parse_config: <string>:"), kda::Error);
  CHECK(c.model.head_dim == 128);
  CHECK(c.model.gate_rank == 128);
  CHECK(c.model.conv_width == 4);
  CHECK(c.model.norm_eps == defaults.model.norm_eps);
  CHECK_FALSE(c.model.gate_lower_bound.has_value());
  CHECK(c.runtime.max_seqs == 256);
  CHECK(c.runtime.max_batch_tokens == 0);
  CHECK(c.runtime.batch_token_capacity() == 256);
  CHECK(c.runtime.capture == kda::CaptureMode::Lazy);
  CHECK(c.runtime.use_graphs);
  CHECK(c.runtime.layer_steps == kda::LayerSteps::Full);
  CHECK(c.runtime.recurrence == kda::Recurrence::Chunked);
  CHECK(c.runtime.num_layers == 1);
  CHECK(c.runtime.gemm_workspace_bytes == 32ll << 20);
  CHECK(c.runtime.max_checkpoints == 0);
  CHECK(c.runtime.sequence_parallel);
  CHECK(c.pools.null_line == 0);
}

TEST_CASE("values are read with their YAML types") {
  SUBCASE("capture modes") {
    CHECK(kda::parse_config(minimal_with("runtime", "capture: eager")).runtime.capture ==
          kda::CaptureMode::Eager);
    CHECK(kda::parse_config(minimal_with("runtime", "capture: lazy")).runtime.capture ==
          kda::CaptureMode::Lazy);
    CHECK(kda::parse_config(minimal_with("runtime", "capture: \"eager\"")).runtime.capture ==
          kda::CaptureMode::Eager);
  }
  SUBCASE("recurrence") {
    CHECK(kda::parse_config(minimal_with("runtime", "recurrence: token")).runtime.recurrence ==
          kda::Recurrence::TokenByToken);
    CHECK(kda::parse_config(minimal_with("runtime", "recurrence: chunked")).runtime.recurrence ==
          kda::Recurrence::Chunked);
    CHECK(parse_error(minimal_with("runtime", "recurrence: fast")) ==
          "x.yaml:5: runtime.recurrence: expected chunked or token, got \"fast\"");
  }
  SUBCASE("layer steps") {
    CHECK(kda::parse_config(minimal_with("runtime", "layer_steps: conv")).runtime.layer_steps ==
          kda::LayerSteps::InProjConv);
    CHECK(kda::parse_config(minimal_with("runtime", "layer_steps: full")).runtime.layer_steps ==
          kda::LayerSteps::Full);
    CHECK(parse_error(minimal_with("runtime", "layer_steps: half")) ==
          "x.yaml:5: runtime.layer_steps: expected full or conv, got \"half\"");
  }
  SUBCASE("max_checkpoints") {
    CHECK(kda::parse_config(minimal_with("runtime", "max_checkpoints: 64")).runtime.max_checkpoints == 64);
    CHECK_THROWS_WITH_AS(kda::parse_config(minimal_with("runtime", "max_checkpoints: -1"), "x.yaml"),
                         doctest::Contains("x.yaml:5: runtime.max_checkpoints: -1 is outside [0, 65536]; "
                                           "state checkpoints per batch (0: none)"),
                         kda::Error);
  }
  SUBCASE("sequence_parallel switch") {
    CHECK_FALSE(kda::parse_config(minimal_with("runtime", "sequence_parallel: false")).runtime.sequence_parallel);
    CHECK_THROWS_WITH_AS(kda::parse_config(minimal_with("runtime", "sequence_parallel: sometimes"), "x.yaml"),
                         doctest::Contains("x.yaml:5: runtime.sequence_parallel:"), kda::Error);
  }
  SUBCASE("graphs switch") {
    CHECK_FALSE(kda::parse_config(minimal_with("runtime", "graphs: false")).runtime.use_graphs);
    CHECK(kda::parse_config(minimal_with("runtime", "graphs: true")).runtime.use_graphs);
  }
  SUBCASE("gate lower bound: a number, null or absent") {
    const auto set = kda::parse_config(minimal_with("model", "gate_lower_bound: -5.0"));
    REQUIRE(set.model.gate_lower_bound.has_value());
    CHECK(*set.model.gate_lower_bound == -5.0);
    CHECK_FALSE(kda::parse_config(minimal_with("model", "gate_lower_bound: null"))
                    .model.gate_lower_bound.has_value());
    CHECK_FALSE(kda::parse_config(minimal_with("model", "gate_lower_bound: ~"))
                    .model.gate_lower_bound.has_value());
    CHECK_FALSE(kda::parse_config(minimal_with("model", "gate_lower_bound:"))
                    .model.gate_lower_bound.has_value());
  }
  SUBCASE("floats in any core-schema spelling, integers included") {
    CHECK(kda::parse_config(minimal_with("model", "norm_eps: 1e-6")).model.norm_eps == 1e-6);
    CHECK(kda::parse_config(minimal_with("model", "norm_eps: 0.5")).model.norm_eps == 0.5);
    CHECK(kda::parse_config(minimal_with("model", "norm_eps: .25")).model.norm_eps == 0.25);
    CHECK(kda::parse_config(minimal_with("model", "norm_eps: 1")).model.norm_eps == 1.0);
    CHECK(kda::parse_config(minimal_with("model", "norm_eps: 2.5E-3")).model.norm_eps == 2.5e-3);
  }
  SUBCASE("gemm_workspace_mib is converted to bytes") {
    CHECK(kda::parse_config(minimal_with("runtime", "gemm_workspace_mib: 0"))
              .runtime.gemm_workspace_bytes == 0);
    CHECK(kda::parse_config(minimal_with("runtime", "gemm_workspace_mib: 1024"))
              .runtime.gemm_workspace_bytes == 1ll << 30);
  }
  SUBCASE("integers with a sign, block lists and a display name") {
    const auto c = kda::parse_config(
        "name: \"my run\"\n"
        "model: {hidden_size: +512, num_heads: 4}\n"
        "runtime:\n"
        "  token_buckets:\n"
        "    - 8\n"
        "    - 32\n"
        "pools: {cache_lines: 9, null_line: 8}\n");
    CHECK(c.name == "my run");
    CHECK(c.model.hidden_size == 512);
    CHECK(c.runtime.token_buckets == std::vector<int64_t>{8, 32});
    CHECK(c.pools.null_line == 8);
  }
}

TEST_CASE("key_lines records the 1-based line of every key path read") {
  const std::string yaml =
      "# a comment\n"                      // 1
      "model:\n"                           // 2
      "  hidden_size: 256\n"               // 3
      "  num_heads: 2\n"                   // 4
      "runtime:\n"                         // 5
      "  token_buckets:\n"                 // 6
      "    - 16\n"                         // 7
      "    - 64\n"                         // 8
      "  max_seqs: 4\n"                    // 9
      "pools:\n"                           // 10
      "  cache_lines: 33\n";               // 11
  kda::detail::ConfigSource where;
  kda::detail::parse_config_with_source(yaml, "lines.yaml", where);
  CHECK(where.file == "lines.yaml");
  CHECK(where.key_lines.at("model") == 2);
  CHECK(where.key_lines.at("model.hidden_size") == 3);
  CHECK(where.key_lines.at("model.num_heads") == 4);
  CHECK(where.key_lines.at("runtime.token_buckets") == 6);
  CHECK(where.key_lines.at("runtime.token_buckets[0]") == 7);
  CHECK(where.key_lines.at("runtime.token_buckets[1]") == 8);
  CHECK(where.key_lines.at("runtime.max_seqs") == 9);
  CHECK(where.key_lines.at("pools.cache_lines") == 11);
  CHECK(where.key_lines.count("runtime.num_layers") == 0);  // absent keys have no line
}

TEST_CASE("validation errors of a parsed file name the file, line and key path") {
  SUBCASE("the bucket out of order, on its own line") {
    const std::string yaml =
        "model:\n"
        "  hidden_size: 256\n"
        "  num_heads: 2\n"
        "runtime:\n"
        "  token_buckets:\n"
        "    - 1024\n"
        "    - 8192\n"
        "    - 4096\n"   // line 8
        "pools:\n"
        "  cache_lines: 33\n";
    CHECK_THROWS_WITH_AS(
        kda::parse_config(yaml, "configs/x.yaml"),  // a source name, not a file
        doctest::Contains(
            "configs/x.yaml:8: runtime.token_buckets[2]: 4096 after 8192, buckets must increase"),
        kda::Error);
  }
  SUBCASE("a model size") {
    const std::string yaml = "model:\n  hidden_size: 250\n  num_heads: 2\n" +
                             std::string(kMinimal).substr(std::string(kMinimal).find("runtime:"));
    CHECK_THROWS_WITH_AS(kda::parse_config(yaml, "x.yaml"),
                         doctest::Contains("x.yaml:2: model.hidden_size: 250 is not a multiple of 8"),
                         kda::Error);
  }
  SUBCASE("a key left at its default has the file but no line") {
    kda::detail::ConfigSource where;
    kda::Config c = kda::detail::parse_config_with_source(kMinimal, "x.yaml", where);
    c.runtime.num_layers = 0;
    CHECK(error_of([&] { kda::detail::validate_config(c, &where); }, "kda::validate_config") ==
          "x.yaml: runtime.num_layers: 0 is outside [1, 1024]; KDA layers per module");
  }
  SUBCASE("validation errors thrown through parse_config come from validate_config") {
    const std::string message = error_of(
        [&] { kda::parse_config(minimal_with("pools", "null_line: 33"), "x.yaml"); },
        "kda::validate_config");
    CHECK(message.find("x.yaml:7: pools.null_line: 33 is outside [0, 33)") == 0);
  }
}

TEST_CASE("unknown keys are rejected with the keys that are allowed") {
  SUBCASE("a misspelt model key, with a suggestion") {
    const std::string yaml = "model:\n  hiden_size: 256\n  num_heads: 2\n";
    CHECK(parse_error(yaml) ==
          "x.yaml:2: model.hiden_size: unknown key; expected one of hidden_size, num_heads, "
          "head_dim, gate_rank, conv_width, norm_eps, gate_lower_bound (did you mean hidden_size?)");
  }
  SUBCASE("a key far from any known one gets no suggestion") {
    const std::string message = parse_error(minimal_with("runtime", "streams: 4"));
    CHECK(message.find("x.yaml:5: runtime.streams: unknown key; expected one of token_buckets, "
                       "max_seqs, max_batch_tokens, capture, graphs, layer_steps, recurrence, num_layers, "
                       "gemm_workspace_mib, max_checkpoints") == 0);
    CHECK(message.find("did you mean") == std::string::npos);
  }
  SUBCASE("an unknown section") {
    CHECK(parse_error(std::string(kMinimal) + "graphs:\n  buckets: [1]\n") ==
          "x.yaml:8: graphs: unknown key; expected one of name, model, runtime, pools, tensor_parallel");
  }
  SUBCASE("an unknown pools key") {
    CHECK(parse_error(minimal_with("pools", "lines: 4")).find("x.yaml:7: pools.lines: unknown key") ==
          0);
  }
}

TEST_CASE("duplicate keys are rejected with the line of the first") {
  SUBCASE("in a section") {
    CHECK(parse_error(minimal_with("model", "num_heads: 4")) ==
          "x.yaml:4: model.num_heads: duplicate key; first given on line 2");
  }
  SUBCASE("a repeated section") {
    CHECK(parse_error(std::string(kMinimal) + "pools:\n  cache_lines: 9\n") ==
          "x.yaml:8: pools: duplicate key; first given on line 6");
  }
  SUBCASE("in a flow map") {
    CHECK_THROWS_WITH_AS(
        kda::parse_config("model: {hidden_size: 256, num_heads: 2, hidden_size: 512}\n", "x.yaml"),
        doctest::Contains("x.yaml:1: model.hidden_size: duplicate key"), kda::Error);
  }
}

TEST_CASE("wrongly typed values name what was expected and what was found") {
  SUBCASE("integers") {
    CHECK(parse_error(minimal_with("runtime", "max_seqs: 7k")) ==
          "x.yaml:5: runtime.max_seqs: expected an integer, got \"7k\"");
    CHECK(parse_error(minimal_with("runtime", "max_seqs: 1.5")) ==
          "x.yaml:5: runtime.max_seqs: expected an integer, got \"1.5\"");
    CHECK(parse_error(minimal_with("runtime", "max_seqs: 1e3")) ==
          "x.yaml:5: runtime.max_seqs: expected an integer, got \"1e3\"");
    CHECK(parse_error(minimal_with("runtime", "max_seqs: 0x10")) ==
          "x.yaml:5: runtime.max_seqs: expected an integer, got \"0x10\"");
    CHECK(parse_error(minimal_with("runtime", "max_seqs: 010")) ==
          "x.yaml:5: runtime.max_seqs: expected an integer, got \"010\"");
    CHECK(parse_error(minimal_with("runtime", "max_seqs:")) ==
          "x.yaml:5: runtime.max_seqs: expected an integer, got null");
    CHECK(parse_error(minimal_with("runtime", "max_seqs: [4]")) ==
          "x.yaml:5: runtime.max_seqs: expected an integer, got a list");
    CHECK(parse_error(minimal_with("runtime", "max_seqs: 99999999999999999999")) ==
          "x.yaml:5: runtime.max_seqs: 99999999999999999999 is out of range for a 64-bit integer");
  }
  SUBCASE("quoted numbers are strings") {
    CHECK(parse_error(minimal_with("runtime", "max_seqs: \"16\"")) ==
          "x.yaml:5: runtime.max_seqs: expected an integer, got the quoted string \"16\"");
    CHECK(parse_error(minimal_with("runtime", "max_seqs: '16'")) ==
          "x.yaml:5: runtime.max_seqs: expected an integer, got the quoted string \"16\"");
    CHECK(parse_error(minimal_with("model", "norm_eps: \"1e-5\"")) ==
          "x.yaml:2: model.norm_eps: expected a number, got the quoted string \"1e-5\"");
  }
  SUBCASE("explicit tags are not read") {
    CHECK(parse_error(minimal_with("runtime", "max_seqs: !!int 16")) ==
          "x.yaml:5: runtime.max_seqs: expected an integer, got \"16\" tagged "
          "tag:yaml.org,2002:int");
  }
  SUBCASE("list items") {
    const std::string yaml =
        "model: {hidden_size: 256, num_heads: 2}\n"
        "runtime:\n"
        "  token_buckets: [16, 64, \"4k\"]\n"
        "pools: {cache_lines: 33}\n";
    CHECK(parse_error(yaml) ==
          "x.yaml:3: runtime.token_buckets[2]: expected an integer, got the quoted string \"4k\"");
  }
  SUBCASE("numbers") {
    CHECK(parse_error(minimal_with("model", "norm_eps: small")) ==
          "x.yaml:2: model.norm_eps: expected a number, got \"small\"");
    CHECK(parse_error(minimal_with("model", "norm_eps: 1e")) ==
          "x.yaml:2: model.norm_eps: expected a number, got \"1e\"");
    CHECK(parse_error(minimal_with("model", "norm_eps: 1e999")) ==
          "x.yaml:2: model.norm_eps: 1e999 is out of range for a double");
    CHECK(parse_error(minimal_with("model", "gate_lower_bound: [1]")) ==
          "x.yaml:2: model.gate_lower_bound: expected a number, got a list");
  }
  SUBCASE("booleans are true or false") {
    CHECK(parse_error(minimal_with("runtime", "graphs: yes")) ==
          "x.yaml:5: runtime.graphs: expected true or false, got \"yes\"");
    CHECK(parse_error(minimal_with("runtime", "graphs: 1")) ==
          "x.yaml:5: runtime.graphs: expected true or false, got \"1\"");
    CHECK(parse_error(minimal_with("runtime", "graphs: \"true\"")) ==
          "x.yaml:5: runtime.graphs: expected true or false, got the quoted string \"true\"");
  }
  SUBCASE("capture is eager or lazy") {
    CHECK(parse_error(minimal_with("runtime", "capture: sometimes")) ==
          "x.yaml:5: runtime.capture: expected eager or lazy, got \"sometimes\"");
    CHECK(parse_error(minimal_with("runtime", "capture: {mode: eager}")) ==
          "x.yaml:5: runtime.capture: expected a string, got a map");
  }
  SUBCASE("values that do not fit their field") {
    CHECK(parse_error(minimal_with("pools", "null_line: 4294967296")) ==
          "x.yaml:7: pools.null_line: 4294967296 does not fit the 32-bit cache index");
    CHECK(parse_error(minimal_with("runtime", "gemm_workspace_mib: 9223372036854775807"))
              .find("x.yaml:5: runtime.gemm_workspace_mib: 9223372036854775807 MiB is out of "
                    "range") == 0);
  }
  SUBCASE("a display name is a string") {
    CHECK(parse_error(std::string(kMinimal) + "name: [a, b]\n") ==
          "x.yaml:8: name: expected a string, got a list");
  }
}

TEST_CASE("sections and lists must have the right node kind") {
  SUBCASE("a map where a list is expected") {
    CHECK(parse_error("model: {hidden_size: 256, num_heads: 2}\n"
                      "runtime:\n"
                      "  token_buckets: {small: 16}\n"
                      "pools: {cache_lines: 33}\n") ==
          "x.yaml:3: runtime.token_buckets: expected a list of integers, got a map");
  }
  SUBCASE("a scalar where a list is expected") {
    CHECK(parse_error("model: {hidden_size: 256, num_heads: 2}\n"
                      "runtime: {token_buckets: 16}\n"
                      "pools: {cache_lines: 33}\n") ==
          "x.yaml:2: runtime.token_buckets: expected a list of integers, got \"16\"");
  }
  SUBCASE("a list where a section map is expected") {
    CHECK(parse_error("model: [256, 2]\n") == "x.yaml:1: model: expected a map, got a list");
  }
  SUBCASE("an empty section") {
    CHECK(parse_error("model:\nruntime:\npools:\n") == "x.yaml:1: model: expected a map, got null");
  }
  SUBCASE("a top level that is not a map") {
    CHECK(parse_error("- model\n- runtime\n") == "x.yaml:1: expected a map of the sections model, runtime and pools, got a list");
  }
  SUBCASE("a key that is not a name") {
    CHECK(parse_error("model:\n  [a, b]: 1\n").find("x.yaml:2: model: keys must be names") == 0);
  }
}

TEST_CASE("missing required keys and sections are named") {
  SUBCASE("hidden_size") {
    CHECK(parse_error("model:\n  num_heads: 2\nruntime: {token_buckets: [16]}\npools: {cache_lines: 3}\n") ==
          "x.yaml:1: model: missing required key hidden_size");
  }
  SUBCASE("num_heads") {
    CHECK(parse_error("model: {hidden_size: 256}\nruntime: {token_buckets: [16]}\npools: {cache_lines: 3}\n") ==
          "x.yaml:1: model: missing required key num_heads");
  }
  SUBCASE("token_buckets") {
    CHECK(parse_error("model: {hidden_size: 256, num_heads: 2}\nruntime: {max_seqs: 4}\npools: {cache_lines: 3}\n") ==
          "x.yaml:2: runtime: missing required key token_buckets");
  }
  SUBCASE("cache_lines") {
    CHECK(parse_error("model: {hidden_size: 256, num_heads: 2}\nruntime: {token_buckets: [16]}\npools: {null_line: 0}\n") ==
          "x.yaml:3: pools: missing required key cache_lines");
  }
  SUBCASE("a whole section") {
    CHECK(parse_error("model: {hidden_size: 256, num_heads: 2}\nruntime: {token_buckets: [16]}\n") ==
          "x.yaml: pools: missing required section (model, runtime and pools are required)");
  }
}

TEST_CASE("documents that are not one YAML map are rejected") {
  SUBCASE("empty text") {
    CHECK(parse_error("") ==
          "x.yaml: empty document; expected a map with the sections model, runtime and pools");
  }
  SUBCASE("comments only") {
    CHECK(parse_error("# nothing here\n\n").find("x.yaml: empty document") == 0);
  }
  SUBCASE("two documents") {
    CHECK(parse_error(std::string(kMinimal) + "---\nmodel: {}\n") ==
          "x.yaml:9: more than one YAML document; a config is one document");
  }
  SUBCASE("a syntax error carries the line yaml-cpp reports") {
    const std::string message = parse_error("model:\n  hidden_size: [256\n  num_heads: 2\n");
    CHECK(message.find("x.yaml:") == 0);
    CHECK(message.find("YAML syntax error") != std::string::npos);
  }
  SUBCASE("a bad indent") {
    CHECK(parse_error("model:\n  hidden_size: 256\n num_heads: 2\n").find("x.yaml:3: YAML syntax error") == 0);
  }
}

TEST_CASE("load_config reports files it cannot read") {
  SUBCASE("a missing file") {
    const std::string message = error_of(
        [] { kda::load_config("/nonexistent/dir/none.yaml"); }, "kda::load_config");
    CHECK(message ==
          "/nonexistent/dir/none.yaml: cannot open the config file: No such file or directory");
  }
  SUBCASE("a directory") {
    CHECK_THROWS_WITH_AS(kda::load_config("/"), doctest::Contains("/: cannot read the config file"),
                         kda::Error);
  }
  SUBCASE("parse errors of a file name the file and come from load_config") {
    const std::string path = "test_config_bad.yaml";
    {
      std::ofstream out(path);
      REQUIRE(out);
      out << "model:\n  hidden_size: 7k\n";
    }
    const std::string message = error_of([&] { kda::load_config(path); }, "kda::load_config");
    std::remove(path.c_str());
    CHECK(message == path + ":2: model.hidden_size: expected an integer, got \"7k\"");
  }
}

TEST_CASE("validate_config accepts the config that code builds") {
  CHECK_NOTHROW(kda::validate_config(code_config()));
  kda::Config c = code_config();
  c.model.gate_lower_bound = -5.0;
  c.runtime.max_batch_tokens = 256;
  c.runtime.gemm_workspace_bytes = 0;
  c.pools.null_line = 32;
  CHECK_NOTHROW(kda::validate_config(c));
  c.runtime.token_buckets.assign(64, 0);
  for (int i = 0; i < 64; ++i) c.runtime.token_buckets[static_cast<std::size_t>(i)] = 16 * (i + 1);
  c.runtime.max_batch_tokens = 1 << 24;
  CHECK_NOTHROW(kda::validate_config(c));
  c.runtime.token_buckets = {1, 1 << 20};
  c.runtime.max_seqs = 1 << 20;
  c.runtime.num_layers = 1024;
  c.runtime.gemm_workspace_bytes = 1ll << 30;
  c.model.gate_rank = 1024;
  CHECK_NOTHROW(kda::validate_config(c));
}

TEST_CASE("validate_config rejects each rule's violation with the key path") {
  kda::Config c = code_config();
  std::string expected;

  SUBCASE("hidden_size positive") {
    c.model.hidden_size = 0;
    expected = "model.hidden_size: expected a positive size, got 0";
  }
  SUBCASE("hidden_size a multiple of 8") {
    c.model.hidden_size = 7170;
    expected = "model.hidden_size: 7170 is not a multiple of 8; the GEMMs need 16-byte bf16 rows";
  }
  SUBCASE("hidden_size not huge") {
    c.model.hidden_size = 1 << 18;
    expected = "model.hidden_size: 262144 is outside [8, 131072]; larger sizes are not supported";
  }
  SUBCASE("num_heads positive") {
    c.model.num_heads = -1;
    expected = "model.num_heads: expected a positive head count, got -1";
  }
  SUBCASE("num_heads not huge") {
    c.model.num_heads = 1025;
    expected = "model.num_heads: 1025 is outside [1, 1024]; larger head counts are not supported";
  }
  SUBCASE("head_dim 128") {
    c.model.head_dim = 64;
    expected = "model.head_dim: 64 is not supported; only 128 is";
  }
  SUBCASE("gate_rank at least 1") {
    c.model.gate_rank = 0;
    expected = "model.gate_rank: 0 is outside [1, 1024]";
  }
  SUBCASE("gate_rank at most 1024") {
    c.model.gate_rank = 1025;
    expected = "model.gate_rank: 1025 is outside [1, 1024]";
  }
  SUBCASE("conv_width 4") {
    c.model.conv_width = 3;
    expected = "model.conv_width: 3 is not supported; only 4 taps are";
  }
  SUBCASE("norm_eps positive") {
    c.model.norm_eps = 0;
    expected = "model.norm_eps: expected a positive finite epsilon, got 0";
  }
  SUBCASE("norm_eps finite") {
    c.model.norm_eps = std::numeric_limits<double>::infinity();
    expected = "model.norm_eps: expected a positive finite epsilon, got inf";
  }
  SUBCASE("norm_eps not NaN") {
    c.model.norm_eps = std::nan("");
    expected = "model.norm_eps: expected a positive finite epsilon";
  }
  SUBCASE("gate_lower_bound negative") {
    c.model.gate_lower_bound = 0.0;
    expected = "model.gate_lower_bound: 0 is not negative";
  }
  SUBCASE("gate_lower_bound finite") {
    c.model.gate_lower_bound = -std::numeric_limits<double>::infinity();
    expected = "model.gate_lower_bound: expected a finite number, got -inf";
  }
  SUBCASE("token_buckets non-empty") {
    c.runtime.token_buckets.clear();
    expected = "runtime.token_buckets: no buckets; give at least one token count";
  }
  SUBCASE("at most 64 buckets") {
    c.runtime.token_buckets.clear();
    for (int i = 1; i <= 65; ++i) c.runtime.token_buckets.push_back(i);
    expected = "runtime.token_buckets: 65 buckets; at most 64 are allowed";
  }
  SUBCASE("buckets at least 1 token") {
    c.runtime.token_buckets = {0, 16};
    expected = "runtime.token_buckets[0]: 0 tokens; a bucket holds at least 1";
  }
  SUBCASE("buckets strictly increasing") {
    c.runtime.token_buckets = {16, 64, 64};
    expected = "runtime.token_buckets[2]: 64 after 64, buckets must increase";
  }
  SUBCASE("largest bucket at most 1<<20") {
    c.runtime.token_buckets = {16, (1 << 20) + 1};
    expected = "runtime.token_buckets[1]: 1048577 tokens is more than the largest supported "
               "bucket, 1048576";
  }
  SUBCASE("max_seqs at least 1") {
    c.runtime.max_seqs = 0;
    expected = "runtime.max_seqs: 0 is outside [1, 1048576]";
  }
  SUBCASE("max_seqs at most 1<<20") {
    c.runtime.max_seqs = (1 << 20) + 1;
    expected = "runtime.max_seqs: 1048577 is outside [1, 1048576]";
  }
  SUBCASE("max_batch_tokens below the largest bucket") {
    c.runtime.max_batch_tokens = 255;
    expected = "runtime.max_batch_tokens: 255 is less than the largest bucket, 256; use 0 for the "
               "largest bucket, or more to split batches into windows";
  }
  SUBCASE("max_batch_tokens negative") {
    c.runtime.max_batch_tokens = -1;
    expected = "runtime.max_batch_tokens: -1 is less than the largest bucket";
  }
  SUBCASE("max_batch_tokens at most 1<<24") {
    c.runtime.max_batch_tokens = (1 << 24) + 1;
    expected = "runtime.max_batch_tokens: 16777217 is more than the supported 16777216 tokens";
  }
  SUBCASE("num_layers at least 1") {
    c.runtime.num_layers = 0;
    expected = "runtime.num_layers: 0 is outside [1, 1024]";
  }
  SUBCASE("num_layers at most 1024") {
    c.runtime.num_layers = 1025;
    expected = "runtime.num_layers: 1025 is outside [1, 1024]";
  }
  SUBCASE("max_checkpoints within [0, 65536]") {
    c.runtime.max_checkpoints = 65537;
    expected = "runtime.max_checkpoints: 65537 is outside [0, 65536]";
  }
  SUBCASE("workspace not negative") {
    c.runtime.gemm_workspace_bytes = -1;
    expected = "runtime.gemm_workspace_mib: -1 bytes";
  }
  SUBCASE("workspace at most 1 GiB") {
    c.runtime.gemm_workspace_bytes = 2ll << 30;
    expected = "runtime.gemm_workspace_mib: 2147483648 bytes (2048 MiB) is outside [0, 1024] MiB";
  }
  SUBCASE("cache_lines at least 2") {
    c.pools.cache_lines = 1;
    c.pools.null_line = 0;
    expected = "pools.cache_lines: 1 is too few; a pool needs at least 2 lines";
  }
  SUBCASE("cache_lines not huge") {
    c.pools.cache_lines = (1 << 24) + 1;
    expected = "pools.cache_lines: 16777217 is outside [2, 16777216]";
  }
  SUBCASE("null_line not negative") {
    c.pools.null_line = -1;
    expected = "pools.null_line: -1 is outside [0, 33)";
  }
  SUBCASE("null_line inside the pool") {
    c.pools.null_line = 33;
    expected = "pools.null_line: 33 is outside [0, 33)";
  }

  REQUIRE_FALSE(expected.empty());
  // A code-built config has no source: the message starts with the key path.
  CHECK(validate_error(c).find(expected) == 0);
  CHECK_THROWS_WITH_AS(kda::validate_config(c), doctest::Contains(expected.c_str()), kda::Error);
}

TEST_CASE("tensor_parallel is optional, and its rank must lie inside its size") {
  const kda::Config plain = kda::parse_config(kMinimal, "x.yaml");
  CHECK(plain.tensor_parallel.size == 1);
  CHECK(plain.tensor_parallel.rank == 0);
  const kda::Config tp = kda::parse_config(std::string(kMinimal) + "tensor_parallel: {size: 4, rank: 3}\n", "x.yaml");
  CHECK(tp.tensor_parallel.size == 4);
  CHECK(tp.tensor_parallel.rank == 3);
  CHECK_THROWS_WITH_AS(kda::parse_config(std::string(kMinimal) + "tensor_parallel: {size: 2, rank: 2}\n", "x.yaml"),
                       doctest::Contains("tensor_parallel.rank: 2 is outside [0, 2)"), kda::Error);
  CHECK_THROWS_WITH_AS(kda::parse_config(std::string(kMinimal) + "tensor_parallel: {size: 0}\n", "x.yaml"),
                       doctest::Contains("tensor_parallel.size: 0 is outside [1, 64]"), kda::Error);
  CHECK(parse_error(std::string(kMinimal) + "tensor_parallel: {ranks: 2}\n").find(
            "tensor_parallel.ranks: unknown key") != std::string::npos);
}

TEST_CASE("tensor_parallel size and rank are checked together, in files and in code") {
  // A rank without a size is a rank of one: only 0 is valid.
  CHECK_THROWS_WITH_AS(kda::parse_config(std::string(kMinimal) + "tensor_parallel: {rank: 1}\n", "x.yaml"),
                       doctest::Contains("x.yaml:8: tensor_parallel.rank: 1 is outside [0, 1); tensor_parallel.size is 1"),
                       kda::Error);
  CHECK_THROWS_WITH_AS(kda::parse_config(std::string(kMinimal) + "tensor_parallel: {size: 2, rank: -1}\n", "x.yaml"),
                       doctest::Contains("tensor_parallel.rank: -1 is outside [0, 2)"), kda::Error);
  CHECK_THROWS_WITH_AS(kda::parse_config(std::string(kMinimal) + "tensor_parallel: {size: 65}\n", "x.yaml"),
                       doctest::Contains("tensor_parallel.size: 65 is outside [1, 64]"), kda::Error);
  CHECK_THROWS_WITH_AS(kda::parse_config(std::string(kMinimal) + "tensor_parallel: {size: 2.0}\n", "x.yaml"),
                       doctest::Contains("tensor_parallel.size: expected an integer"), kda::Error);
  kda::Config c = code_config();
  c.tensor_parallel.size = 8;
  c.tensor_parallel.rank = 7;
  CHECK_NOTHROW(kda::validate_config(c));
  c.tensor_parallel.rank = 8;
  CHECK(validate_error(c) == "tensor_parallel.rank: 8 is outside [0, 8); tensor_parallel.size is 8");
  c.tensor_parallel.size = -2;
  c.tensor_parallel.rank = 0;
  CHECK(validate_error(c).find("tensor_parallel.size: -2 is outside [1, 64]") == 0);
}

TEST_CASE("validate_config prefixes source and line when the config source has the path") {
  kda::Config c = code_config();
  c.runtime.token_buckets = {16, 8};
  kda::detail::ConfigSource where;
  where.file = "mine.yaml";
  where.key_lines["runtime.token_buckets[1]"] = 12;
  const auto error_with_source = [&] {
    return error_of([&] { kda::detail::validate_config(c, &where); }, "kda::validate_config");
  };
  CHECK(error_with_source() == "mine.yaml:12: runtime.token_buckets[1]: 8 after 16, buckets must increase");
  where.key_lines.clear();
  CHECK(error_with_source() == "mine.yaml: runtime.token_buckets[1]: 8 after 16, buckets must increase");
  CHECK(validate_error(c) == "runtime.token_buckets[1]: 8 after 16, buckets must increase");
}

// A config error names the place in the config to fix; a library source line would name a
// helper of the parser or the validator, so what() has none.
std::string what_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const kda::Error& e) {
    return e.what();
  }
  FAIL("expected a kda::Error");
  return {};
}

TEST_CASE("a config error's what() is the function and the config location, no library source line") {
  CHECK(what_of([] { kda::parse_config(minimal_with("runtime", "max_seqs: 7k"), "x.yaml"); }) ==
        "kda::parse_config: x.yaml:5: runtime.max_seqs: expected an integer, got \"7k\"");
  CHECK(what_of([] { kda::parse_config(minimal_with("runtime", "max_seqs: 0"), "x.yaml"); }) ==
        "kda::validate_config: x.yaml:5: runtime.max_seqs: 0 is outside [1, 1048576]; sequences per batch");
  kda::Config c = code_config();
  c.model.head_dim = 64;
  CHECK(what_of([&] { kda::validate_config(c); }) ==
        "kda::validate_config: model.head_dim: 64 is not supported; only 128 is (the kernels' tiles are built "
        "for K = V = 128)");
  CHECK(what_of([] { kda::load_config("/nonexistent/x.yaml"); }) ==
        "kda::load_config: /nonexistent/x.yaml: cannot open the config file: No such file or directory");
}

TEST_CASE("errors outside the config keep the library source location of their check") {
  const std::string what = kda::Error("kda::f", "m", "/build/src/conv/x.cu", 12).what();
  CHECK(what == "kda::f: m [src/conv/x.cu:12]");
}

TEST_CASE("pools.external and the pool layouts are read, with their choices named on error") {
  const kda::Config defaults = kda::parse_config(kMinimal);
  CHECK_FALSE(defaults.pools.external);
  CHECK(defaults.pools.recurrent_layout == kda::RecurrentLayout::HKV);
  CHECK(defaults.pools.conv_layout == kda::ConvStateLayout::DimTap);
  CHECK(defaults.conv_line_elems() == 3 * 256 * 3);
  CHECK(defaults.recurrent_line_elems() == 2 * 128 * 128);

  kda::Config c = kda::parse_config(minimal_with("pools", "external: true"));
  CHECK(c.pools.external);
  c = kda::parse_config(minimal_with("pools", "recurrent_layout: hvk"));
  CHECK(c.pools.recurrent_layout == kda::RecurrentLayout::HVK);
  c = kda::parse_config(minimal_with("pools", "conv_layout: tap_dim"));
  CHECK(c.pools.conv_layout == kda::ConvStateLayout::TapDim);

  CHECK_THROWS_WITH_AS(kda::parse_config(minimal_with("pools", "recurrent_layout: kvh"), "x.yaml"),
                       doctest::Contains("x.yaml:7: pools.recurrent_layout: expected hkv or hvk"), kda::Error);
  CHECK_THROWS_WITH_AS(kda::parse_config(minimal_with("pools", "conv_layout: 3x3p"), "x.yaml"),
                       doctest::Contains("x.yaml:7: pools.conv_layout: expected dim_tap or tap_dim"), kda::Error);
  CHECK_THROWS_WITH_AS(kda::parse_config(minimal_with("pools", "external: maybe"), "x.yaml"),
                       doctest::Contains("x.yaml:7: pools.external: expected"), kda::Error);
}

TEST_CASE("pools.recurrent_dtype and pools.conv_dtype are read, checked and default to fp32") {
  const kda::Config defaults = kda::parse_config(kMinimal);
  CHECK(defaults.pools.recurrent_dtype == kda::DType::FP32);
  CHECK(defaults.pools.conv_dtype == kda::DType::FP32);

  kda::Config c = kda::parse_config(minimal_with("pools", "recurrent_dtype: bf16"));
  CHECK(c.pools.recurrent_dtype == kda::DType::BF16);
  CHECK(c.pools.conv_dtype == kda::DType::FP32);
  c = kda::parse_config(minimal_with("pools", "conv_dtype: bf16"));
  CHECK(c.pools.conv_dtype == kda::DType::BF16);
  CHECK(c.pools.recurrent_dtype == kda::DType::FP32);
  c = kda::parse_config(minimal_with("pools", "conv_dtype: fp32"));
  CHECK(c.pools.conv_dtype == kda::DType::FP32);
  // The line's element count does not depend on the element type.
  CHECK(c.conv_line_elems() == defaults.conv_line_elems());

  CHECK_THROWS_WITH_AS(kda::parse_config(minimal_with("pools", "recurrent_dtype: fp16"), "x.yaml"),
                       doctest::Contains("x.yaml:7: pools.recurrent_dtype: expected fp32 or bf16"), kda::Error);
  CHECK_THROWS_WITH_AS(kda::parse_config(minimal_with("pools", "conv_dtype: 16"), "x.yaml"),
                       doctest::Contains("x.yaml:7: pools.conv_dtype: expected fp32 or bf16"), kda::Error);

  // A Config built in code may hold any DType: validate_config names the key.
  kda::Config code = defaults;
  code.pools.recurrent_dtype = kda::DType::FP16;
  CHECK_THROWS_WITH_AS(kda::validate_config(code),
                       doctest::Contains("pools.recurrent_dtype: fp16 is not a pool element type; expected fp32 or bf16"),
                       kda::Error);
  code = defaults;
  code.pools.conv_dtype = kda::DType::FP16;
  CHECK_THROWS_WITH_AS(kda::validate_config(code),
                       doctest::Contains("pools.conv_dtype: fp16 is not a pool element type; expected fp32 or bf16"),
                       kda::Error);
}
