#include <doctest/doctest.h>

#include <cstdint>
#include <numeric>
#include <vector>

#include "kda/error.h"
#include "testing/tp_shard.h"

namespace {

using kda::detail::HostLayerTensors;

// A small full model: 4 heads of 128 (P = 512), hidden 16, gate rank 8.
kda::ModelConfig full_model() {
  kda::ModelConfig m;
  m.hidden_size = 16;
  m.num_heads = 4;
  m.gate_rank = 8;
  return m;
}

// Every element holds its own index, so a shard shows exactly which elements it took.
template <typename T>
std::vector<T> iota_vector(int64_t n, T start = 0) {
  std::vector<T> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), start);
  return v;
}

HostLayerTensors full_tensors(const kda::ModelConfig& m) {
  const int64_t D = m.hidden_size, P = m.part_dim(), r = m.gate_rank;
  HostLayerTensors w;
  w.in_proj = iota_vector<uint16_t>(m.in_proj_cols() * D);
  w.conv_weight = iota_vector<float>(3 * P * 4);
  w.f_b = iota_vector<uint16_t>(P * r, 1);
  w.g_b = iota_vector<uint16_t>(P * r, 7);
  w.A_log = iota_vector<float>(m.num_heads, 100);
  w.dt_bias = iota_vector<float>(P, 1000);
  w.o_norm_weight = iota_vector<uint16_t>(m.head_dim, 3);
  w.o_proj = iota_vector<uint16_t>(D * P);
  return w;
}

}  // namespace

TEST_CASE("the ranks' shards put back together give the full layer") {
  const kda::ModelConfig m = full_model();
  const HostLayerTensors w = full_tensors(m);
  const int64_t D = m.hidden_size, Pf = m.part_dim(), Hf = m.num_heads, r = m.gate_rank;
  for (int64_t size : {1, 2, 4}) {
    CAPTURE(size);
    std::vector<HostLayerTensors> s;
    for (int64_t rank = 0; rank < size; ++rank) s.push_back(kda::detail::shard_layer(m, w, size, rank));
    const int64_t P = Pf / size, H = Hf / size;
    // in_proj: q, k, v and b rows by rank, f_a and g_a replicated.
    std::vector<uint16_t> in_proj;
    for (int part = 0; part < 3; ++part)
      for (int64_t rank = 0; rank < size; ++rank)
        in_proj.insert(in_proj.end(), s[rank].in_proj.begin() + part * P * D, s[rank].in_proj.begin() + (part + 1) * P * D);
    for (int64_t rank = 0; rank < size; ++rank)
      in_proj.insert(in_proj.end(), s[rank].in_proj.begin() + 3 * P * D, s[rank].in_proj.begin() + (3 * P + H) * D);
    in_proj.insert(in_proj.end(), s[0].in_proj.begin() + (3 * P + H) * D, s[0].in_proj.end());
    CHECK(in_proj == w.in_proj);
    for (int64_t rank = 0; rank < size; ++rank) {
      CHECK(std::vector<uint16_t>(s[rank].in_proj.begin() + (3 * P + H) * D, s[rank].in_proj.end()) ==
            std::vector<uint16_t>(w.in_proj.begin() + (3 * Pf + Hf) * D, w.in_proj.end()));
      CHECK(s[rank].o_norm_weight == w.o_norm_weight);
      CHECK(static_cast<int64_t>(s[rank].in_proj.size()) == kda::detail::rank_model(m, size, rank).in_proj_cols() * D);
    }
    std::vector<float> conv, a_log, dt;
    std::vector<uint16_t> f_b, g_b, o_proj(static_cast<std::size_t>(D * Pf));
    for (int part = 0; part < 3; ++part)
      for (int64_t rank = 0; rank < size; ++rank)
        conv.insert(conv.end(), s[rank].conv_weight.begin() + part * P * 4, s[rank].conv_weight.begin() + (part + 1) * P * 4);
    for (int64_t rank = 0; rank < size; ++rank) {
      f_b.insert(f_b.end(), s[rank].f_b.begin(), s[rank].f_b.end());
      g_b.insert(g_b.end(), s[rank].g_b.begin(), s[rank].g_b.end());
      a_log.insert(a_log.end(), s[rank].A_log.begin(), s[rank].A_log.end());
      dt.insert(dt.end(), s[rank].dt_bias.begin(), s[rank].dt_bias.end());
      for (int64_t row = 0; row < D; ++row)
        for (int64_t c = 0; c < P; ++c) o_proj[row * Pf + rank * P + c] = s[rank].o_proj[row * P + c];
    }
    CHECK(conv == w.conv_weight);
    CHECK(f_b == w.f_b);
    CHECK(g_b == w.g_b);
    CHECK(a_log == w.A_log);
    CHECK(dt == w.dt_bias);
    CHECK(o_proj == w.o_proj);
    CHECK(s[0].f_b.size() == static_cast<std::size_t>(P * r));
  }
}

TEST_CASE("a single rank holds the whole layer unchanged") {
  const kda::ModelConfig m = full_model();
  const HostLayerTensors w = full_tensors(m);
  const HostLayerTensors s = kda::detail::shard_layer(m, w, 1, 0);
  CHECK(s.in_proj == w.in_proj);
  CHECK(s.conv_weight == w.conv_weight);
  CHECK(s.o_proj == w.o_proj);
  CHECK(kda::detail::rank_model(m, 1, 0).num_heads == 4);
}

TEST_CASE("pools shard by channel and by head") {
  const kda::ModelConfig m = full_model();
  const int64_t lines = 3, Pf = m.part_dim(), Hf = m.num_heads;
  const auto conv = iota_vector<float>(lines * 3 * Pf * 3);
  const auto rec = iota_vector<float>(lines * Hf * 128 * 128);
  for (int64_t size : {1, 2, 4}) {
    const int64_t P = Pf / size, H = Hf / size;
    for (int64_t rank = 0; rank < size; ++rank) {
      CAPTURE(size);
      CAPTURE(rank);
      const auto c = kda::detail::shard_conv_pool(m, conv, lines, size, rank);
      const auto t = kda::detail::shard_recurrent_pool(m, rec, lines, size, rank);
      REQUIRE(c.size() == static_cast<std::size_t>(lines * 3 * P * 3));
      REQUIRE(t.size() == static_cast<std::size_t>(lines * H * 128 * 128));
      int64_t bad = 0;
      for (int64_t line = 0; line < lines; ++line)
        for (int part = 0; part < 3; ++part)
          for (int64_t ch = 0; ch < P; ++ch)
            for (int tap = 0; tap < 3; ++tap)
              bad += c[((line * 3 + part) * P + ch) * 3 + tap] !=
                     conv[((line * 3 * Pf) + part * Pf + rank * P + ch) * 3 + tap];
      for (int64_t line = 0; line < lines; ++line)
        for (int64_t h = 0; h < H; ++h)
          bad += t[(line * H + h) * 128 * 128 + 5] != rec[(line * Hf + rank * H + h) * 128 * 128 + 5];
      CHECK(bad == 0);
    }
  }
}

TEST_CASE("sharding refuses heads that do not divide, ranks out of range and wrong sizes") {
  const kda::ModelConfig m = full_model();
  const HostLayerTensors w = full_tensors(m);
  CHECK_THROWS_WITH_AS(kda::detail::shard_layer(m, w, 3, 0),
                       doctest::Contains("model.num_heads 4 is not divisible by tensor_parallel.size 3"), kda::Error);
  CHECK_THROWS_WITH_AS(kda::detail::shard_layer(m, w, 2, 2),
                       doctest::Contains("tensor_parallel.rank 2 is outside [0, 2)"), kda::Error);
  CHECK_THROWS_WITH_AS(kda::detail::rank_model(m, 0, 0),
                       doctest::Contains("tensor_parallel.size 0 is outside [1, 64]"), kda::Error);
  HostLayerTensors short_proj = w;
  short_proj.o_proj.pop_back();
  CHECK_THROWS_WITH_AS(kda::detail::shard_layer(m, short_proj, 2, 0),
                       doctest::Contains("o_proj has 8191 elements, expected 8192"), kda::Error);
  CHECK_THROWS_WITH_AS(kda::detail::shard_conv_pool(m, std::vector<float>(10), 3, 2, 0),
                       doctest::Contains("the conv-state pool has 10 elements"), kda::Error);
}
