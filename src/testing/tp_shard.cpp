#include "testing/tp_shard.h"

#include "common/check.h"

namespace kda::detail {

namespace {

constexpr const char* kFn = "kda::detail::shard_layer";

// Rows [row0, row0 + rows) of a row-major (*, cols) tensor appended to out.
template <typename T>
void append_rows(std::vector<T>& out, const std::vector<T>& src, int64_t cols, int64_t row0, int64_t rows) {
  out.insert(out.end(), src.begin() + row0 * cols, src.begin() + (row0 + rows) * cols);
}

template <typename T>
void check_size(const std::vector<T>& v, int64_t expected, const char* name) {
  KDA_CHECK(static_cast<int64_t>(v.size()) == expected, kFn, name, " has ", v.size(),
            " elements, expected ", expected, " for the full model");
}

}  // namespace

ModelConfig rank_model(const ModelConfig& full, int64_t size, int64_t rank) {
  constexpr const char* fn = "kda::detail::rank_model";
  KDA_CHECK(size >= 1 && size <= 64, fn, "tensor_parallel.size ", size, " is outside [1, 64]");
  KDA_CHECK(rank >= 0 && rank < size, fn, "tensor_parallel.rank ", rank, " is outside [0, ", size, ")");
  KDA_CHECK(full.num_heads % size == 0, fn, "model.num_heads ", full.num_heads,
            " is not divisible by tensor_parallel.size ", size, ": every rank needs whole heads");
  ModelConfig m = full;
  m.num_heads = full.num_heads / size;
  return m;
}

HostLayerTensors shard_layer(const ModelConfig& full, const HostLayerTensors& w, int64_t size, int64_t rank) {
  const ModelConfig m = rank_model(full, size, rank);
  const int64_t D = full.hidden_size, r = full.gate_rank, Pf = full.part_dim(), Hf = full.num_heads;
  const int64_t P = m.part_dim(), H = m.num_heads;
  check_size(w.in_proj, full.in_proj_cols() * D, "in_proj");
  check_size(w.conv_weight, 3 * Pf * 4, "conv_weight");
  check_size(w.f_b, Pf * r, "f_b");
  check_size(w.g_b, Pf * r, "g_b");
  check_size(w.A_log, Hf, "A_log");
  check_size(w.dt_bias, Pf, "dt_bias");
  check_size(w.o_norm_weight, full.head_dim, "o_norm_weight");
  check_size(w.o_proj, D * Pf, "o_proj");

  HostLayerTensors s;
  for (int part = 0; part < 3; ++part) append_rows(s.in_proj, w.in_proj, D, part * Pf + rank * P, P);  // q, k, v
  append_rows(s.in_proj, w.in_proj, D, 3 * Pf + rank * H, H);                                       // b
  append_rows(s.in_proj, w.in_proj, D, 3 * Pf + Hf, 2 * r);                                         // f_a, g_a
  for (int part = 0; part < 3; ++part) append_rows(s.conv_weight, w.conv_weight, 4, part * Pf + rank * P, P);
  append_rows(s.f_b, w.f_b, r, rank * P, P);
  append_rows(s.g_b, w.g_b, r, rank * P, P);
  append_rows(s.A_log, w.A_log, 1, rank * H, H);
  append_rows(s.dt_bias, w.dt_bias, 1, rank * P, P);
  s.o_norm_weight = w.o_norm_weight;
  s.o_proj.reserve(static_cast<std::size_t>(D * P));
  for (int64_t row = 0; row < D; ++row)
    s.o_proj.insert(s.o_proj.end(), w.o_proj.begin() + row * Pf + rank * P, w.o_proj.begin() + row * Pf + (rank + 1) * P);
  return s;
}

std::vector<float> shard_conv_pool(const ModelConfig& full, const std::vector<float>& pool, int64_t lines,
                                   int64_t size, int64_t rank) {
  const ModelConfig m = rank_model(full, size, rank);
  const int64_t Pf = full.part_dim(), P = m.part_dim();
  check_size(pool, lines * 3 * Pf * 3, "the conv-state pool");
  std::vector<float> out;
  out.reserve(static_cast<std::size_t>(lines * 3 * P * 3));
  for (int64_t line = 0; line < lines; ++line)
    for (int part = 0; part < 3; ++part)
      append_rows(out, pool, 3, line * 3 * Pf + part * Pf + rank * P, P);
  return out;
}

std::vector<float> shard_recurrent_pool(const ModelConfig& full, const std::vector<float>& pool, int64_t lines,
                                        int64_t size, int64_t rank) {
  const ModelConfig m = rank_model(full, size, rank);
  const int64_t Hf = full.num_heads, H = m.num_heads, per_head = full.head_dim * full.head_dim;
  check_size(pool, lines * Hf * per_head, "the recurrent-state pool");
  std::vector<float> out;
  out.reserve(static_cast<std::size_t>(lines * H * per_head));
  for (int64_t line = 0; line < lines; ++line) append_rows(out, pool, per_head, line * Hf + rank * H, H);
  return out;
}

}  // namespace kda::detail
