// Where a parsed config's values came from, for error messages: the parser's bookkeeping, kept
// out of the public kda::Config. load_config and parse_config validate with it, so their errors
// name file, line and key path; validate_config on a Config built in code names the key path.
#pragma once

#include <map>
#include <string>

#include "kda/config.h"

namespace kda::detail {

struct ConfigSource {
  std::string file;                      // the file name, or parse_config's `source`
  std::map<std::string, int> key_lines;  // 1-based line of every key path read: "runtime.token_buckets[2]" -> 14
};

// parse_config / load_config that also report where each value came from.
Config parse_config_with_source(const std::string& yaml_text, const std::string& source, ConfigSource& where);
Config load_config_with_source(const std::string& path, ConfigSource& where);

// validate_config; messages start with "<file>:<line>: " as far as `where` (may be null) knows.
void validate_config(const Config& config, const ConfigSource* where);

}  // namespace kda::detail
