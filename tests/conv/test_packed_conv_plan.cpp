// The packed conv's plan (src/conv/packed_conv_plan.cpp) on the CPU:
// packed_causal_conv1d_supported() and the launcher's argument handling: every reason is
// reported with a clear message, packed_causal_conv1d throws it as a kda::Error
// before touching CUDA, and the launch shape (vector width, chunk length, grid) is as
// documented in conv/packed_conv.h.
#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <string>

#include "conv/packed_conv.h"
#include "common/varlen_map.h"
#include "kda/error.h"
#include "kda/packed_conv.h"
#include "support/fake_pointers.h"

namespace {

using kda::test::fake_pointer;

// The seed-scale KDA conv: 3 x 1536 channels of the 4928-wide (in_proj_stride()) bf16 in_proj output.
kda::PackedConvArgs kda_args() {
  kda::PackedConvArgs a;
  a.x = fake_pointer<const void>(1);
  a.x_dtype = kda::DType::BF16;
  a.num_tokens = 2048;
  a.dim = 3 * 1536;
  a.x_row_stride = 4928;
  a.weight = fake_pointer<const float>(2);
  a.weight_stride_dim = 4;
  a.weight_stride_tap = 1;
  a.bias = nullptr;
  a.conv_states = fake_pointer<void>(3);
  a.varlen.cache_lines = 17;
  a.state_len = 3;
  a.state_stride_line = a.dim * 3;
  a.state_stride_dim = 3;
  a.state_stride_tap = 1;
  a.varlen.query_start_loc = fake_pointer<const int32_t>(4);
  a.varlen.num_seqs = 4;
  a.varlen.cache_indices = fake_pointer<const int32_t>(5);
  a.cache_indices_stride = 1;
  a.varlen.has_initial_state = fake_pointer<const bool>(6);
  a.part_dim = 1536;
  a.silu = true;
  a.varlen.null_line = 0;
  a.out = fake_pointer<void>(7);
  a.out_plane_stride = 0;
  return a;
}

std::string why_not(const kda::PackedConvArgs& a) {
  std::string why = "(not set)";
  const bool ok = kda::packed_causal_conv1d_supported(a, &why);
  return ok ? std::string("supported") : why;
}

}  // namespace

TEST_CASE("the seed-scale KDA arguments are supported and the reason is cleared") {
  std::string why = "stale";
  CHECK(kda::packed_causal_conv1d_supported(kda_args(), &why));
  CHECK(why.empty());
  CHECK(kda::packed_causal_conv1d_supported(kda_args()));
}

TEST_CASE("well-formed variants are supported") {
  kda::PackedConvArgs a = kda_args();
  SUBCASE("fp16 and fp32 inputs") {
    a.x_dtype = kda::DType::FP16;
    CHECK(why_not(a) == "supported");
    a.x_dtype = kda::DType::FP32;
    CHECK(why_not(a) == "supported");
  }
  SUBCASE("a bias, no SiLU, no null block") {
    a.bias = fake_pointer<const float>(8);
    a.silu = false;
    a.varlen.null_line.reset();
    CHECK(why_not(a) == "supported");
  }
  SUBCASE("no has_initial_state array means no sequence has an initial state") {
    a.varlen.has_initial_state = nullptr;
    CHECK(why_not(a) == "supported");
  }
  SUBCASE("the transposed (lines, 3, dim) conv state layout") {
    a.state_stride_line = 3 * a.dim;
    a.state_stride_dim = 1;
    a.state_stride_tap = a.dim;
    CHECK(why_not(a) == "supported");
  }
  SUBCASE("state_len above 3, a strided cache_indices, a dense x") {
    a.state_len = 4;
    a.state_stride_line = 4 * a.dim;
    a.state_stride_dim = 4;
    a.cache_indices_stride = 2;
    a.x_row_stride = a.dim;
    CHECK(why_not(a) == "supported");
  }
  SUBCASE("an out_plane_stride sized for a larger batch") {
    a.out_plane_stride = 4 * a.num_tokens * a.part_dim;
    CHECK(why_not(a) == "supported");
    a.out_plane_stride = a.num_tokens * a.part_dim;
    CHECK(why_not(a) == "supported");
  }
  SUBCASE("other part counts and part_dim 64") {
    a.part_dim = 64;
    a.dim = 5 * 64;
    a.x_row_stride = a.dim;
    a.state_stride_line = 3 * a.dim;
    CHECK(why_not(a) == "supported");
  }
  SUBCASE("bf16 conv-state lines in both layouts, 2-byte aligned") {
    a.state_dtype = kda::DType::BF16;
    CHECK(why_not(a) == "supported");
    a.state_stride_dim = 1;
    a.state_stride_tap = a.dim;
    CHECK(why_not(a) == "supported");
    a.conv_states = fake_pointer<void>(3, 2);  // a bf16 element boundary, not an fp32 one
    CHECK(why_not(a) == "supported");
  }
  SUBCASE("an empty batch") {
    a.num_tokens = 0;
    CHECK(why_not(a) == "supported");
    a = kda_args();
    a.varlen.num_seqs = 0;
    CHECK(why_not(a) == "supported");
  }
}

TEST_CASE("every unsupported argument is named in the reason and in the error") {
  kda::PackedConvArgs a = kda_args();
  std::string expected;
  SUBCASE("an invalid dtype value") {
    a.x_dtype = static_cast<kda::DType>(7);
    expected = "x_dtype has the invalid value 7; supported are bf16, fp16 and fp32";
  }
  SUBCASE("an invalid state_dtype value") {
    a.state_dtype = static_cast<kda::DType>(9);
    expected = "state_dtype has the invalid value 9; supported are fp32, and bf16 with x_dtype bf16";
  }
  SUBCASE("fp16 conv states") {
    a.state_dtype = kda::DType::FP16;
    expected = "state_dtype fp16 is not supported; conv states are fp32, or bf16 with x_dtype bf16";
  }
  SUBCASE("bf16 conv states with fp16 inputs") {
    a.x_dtype = kda::DType::FP16;
    a.state_dtype = kda::DType::BF16;
    expected = "state_dtype bf16 needs x_dtype bf16: a bf16 conv-state line would round the fp16 "
               "inputs it keeps";
  }
  SUBCASE("bf16 conv states with fp32 inputs") {
    a.x_dtype = kda::DType::FP32;
    a.state_dtype = kda::DType::BF16;
    expected = "state_dtype bf16 needs x_dtype bf16: a bf16 conv-state line would round the fp32 "
               "inputs it keeps";
  }
  SUBCASE("a bf16 pool on an odd address") {
    a.state_dtype = kda::DType::BF16;
    a.conv_states = fake_pointer<void>(3, 1);
    expected = "conv_states is not aligned to its 2-byte bf16 elements (state_dtype)";
  }
  SUBCASE("an fp32 pool on a bf16 element boundary") {
    a.conv_states = fake_pointer<void>(3, 2);
    expected = "conv_states is not aligned to its 4-byte fp32 elements (state_dtype)";
  }
  SUBCASE("null x") { a.x = nullptr; expected = "x is null"; }
  SUBCASE("null weight") { a.weight = nullptr; expected = "weight is null"; }
  SUBCASE("null conv_states") { a.conv_states = nullptr; expected = "conv_states is null"; }
  SUBCASE("null query_start_loc") {
    a.varlen.query_start_loc = nullptr;
    expected = "query_start_loc is null";
  }
  SUBCASE("null cache_indices") { a.varlen.cache_indices = nullptr; expected = "cache_indices is null"; }
  SUBCASE("null out") { a.out = nullptr; expected = "out is null"; }
  SUBCASE("a misaligned x") {
    a.x = fake_pointer<const void>(1, 1);
    expected = "x is not aligned to its 2-byte bf16 elements";
  }
  SUBCASE("a misaligned fp32 out") {
    a.x_dtype = kda::DType::FP32;
    a.out = fake_pointer<void>(7, 2);
    expected = "out is not aligned to its 4-byte fp32 elements";
  }
  SUBCASE("a misaligned weight") {
    a.weight = fake_pointer<const float>(2, 2);
    expected = "weight, bias, query_start_loc and cache_indices must be aligned to their 4-byte "
               "elements";
  }
  SUBCASE("negative num_tokens") { a.num_tokens = -1; expected = "num_tokens -1 is negative"; }
  SUBCASE("num_tokens beyond int32") {
    a.num_tokens = int64_t{1} << 31;
    expected = "num_tokens 2147483648 exceeds 2147483647 (query_start_loc is int32)";
  }
  SUBCASE("negative num_seqs") { a.varlen.num_seqs = -3; expected = "num_seqs -3 is negative"; }
  SUBCASE("num_seqs beyond int32") {
    a.varlen.num_seqs = std::numeric_limits<int32_t>::max();
    expected = "num_seqs 2147483647 must be below 2147483647";
  }
  SUBCASE("part_dim zero") { a.part_dim = 0; expected = "part_dim 0 must be positive"; }
  SUBCASE("part_dim not a multiple of 64") {
    a.part_dim = 1500;
    a.dim = 4500;
    expected = "part_dim 1500 is not a multiple of 64";
  }
  SUBCASE("dim zero") { a.dim = 0; expected = "dim 0 must be positive"; }
  SUBCASE("dim not a multiple of part_dim") {
    a.dim = 4608 + 64;
    expected = "dim 4672 is not a multiple of part_dim 1536";
  }
  SUBCASE("x_row_stride below dim") {
    a.x_row_stride = 4600;
    expected = "x_row_stride 4600 is smaller than dim 4608";
  }
  SUBCASE("a negative weight stride") {
    a.weight_stride_tap = -1;
    expected = "weight strides (4, -1) must not be negative";
  }
  SUBCASE("weight strides that overflow") {
    a.weight_stride_dim = std::numeric_limits<int64_t>::max() / 2;
    expected = "weight's extent (dim, strides) overflows 64-bit addressing";
  }
  SUBCASE("no cache lines") {
    a.varlen.cache_lines = 0;
    expected = "cache_lines 0 must be at least 1";
  }
  SUBCASE("state_len below 3") {
    a.state_len = 2;
    expected = "state_len 2 is below 3 (the width-4 conv keeps 3 history columns)";
  }
  SUBCASE("a negative state stride") {
    a.state_stride_dim = -3;
    expected = "conv_states strides (13824, -3, 1) must not be negative";
  }
  SUBCASE("state strides that make channels overlap") {
    a.state_stride_dim = 1;  // channel c, tap 1 is channel c + 1, tap 0
    expected = "conv_states strides (13824, 1, 1) make different (line, channel, tap) elements "
               "overlap";
  }
  SUBCASE("state strides that make lines overlap") {
    a.state_stride_line = 3 * a.dim - 1;
    expected = "conv_states strides (13823, 3, 1) make different";
  }
  SUBCASE("cache_indices_stride zero") {
    a.cache_indices_stride = 0;
    expected = "cache_indices_stride 0 must be at least 1";
  }
  SUBCASE("a cache_indices stride that overflows") {
    a.cache_indices_stride = std::numeric_limits<int64_t>::max() / 2;
    expected = "cache_indices' extent (num_seqs, cache_indices_stride) overflows";
  }
  SUBCASE("a negative out_plane_stride") {
    a.out_plane_stride = -1;
    expected = "out_plane_stride -1 is negative";
  }
  SUBCASE("an out_plane_stride smaller than a plane") {
    a.out_plane_stride = a.num_tokens * a.part_dim - 1;
    expected = "out_plane_stride 3145727 is smaller than num_tokens * part_dim = 3145728";
  }
  SUBCASE("an x row stride whose extent overflows") {
    a.x_row_stride = std::numeric_limits<int64_t>::max() / 1024;
    expected = "x's extent (num_tokens, x_row_stride) overflows 64-bit addressing";
  }
  SUBCASE("an out that overlaps x") {
    // The last plane of out ends inside x's first row.
    a.out = fake_pointer<void>(1, -3 * 2048 * 1536 * 2 + 64);
    expected = "out overlaps x";
  }
  SUBCASE("a grid y extent beyond 65535 column groups") {
    // 4 warps of 128 channels per CTA: 65536 groups need 2^25 channels in one plane.
    a.part_dim = int64_t{1} << 25;
    a.dim = a.part_dim;
    a.x_row_stride = a.dim;
    a.state_stride_line = 3 * a.dim;
    a.num_tokens = 16;
    a.x = fake_pointer<const void>(1);
    a.out = fake_pointer<void>(1 << 12);
    expected = "column groups per plane, more than the 65535 a grid's y extent can hold";
  }

  CAPTURE(expected);
  std::string why = "(not set)";
  CHECK_FALSE(kda::packed_causal_conv1d_supported(a, &why));
  CHECK(why.find(expected) != std::string::npos);
  CHECK_FALSE(kda::packed_causal_conv1d_supported(a));  // why may be null
  // The launcher throws the same reason before it touches CUDA (there is no GPU in CI).
  CHECK_THROWS_WITH_AS(kda::packed_causal_conv1d(a, nullptr), doctest::Contains(expected.c_str()),
                       kda::Error);
  CHECK_THROWS_WITH_AS(kda::packed_causal_conv1d(a, nullptr),
                       doctest::Contains("kda::packed_causal_conv1d: "), kda::Error);
  try {
    kda::packed_causal_conv1d(a, nullptr);
  } catch (const kda::Error& e) {
    CHECK(e.function() == "kda::packed_causal_conv1d");
    CHECK(e.message() == why);
    CHECK(std::string(e.what()).find("[src/conv/packed_conv.cu:") != std::string::npos);
  }
}

TEST_CASE("an empty batch launches nothing and needs no GPU") {
  kda::PackedConvArgs a = kda_args();
  SUBCASE("no tokens") { a.num_tokens = 0; }
  SUBCASE("no sequences") { a.varlen.num_seqs = 0; }
  CHECK_NOTHROW(kda::packed_causal_conv1d(a, nullptr));
  CHECK_NOTHROW(kda::conv::launch_packed_conv(a, kda::conv::ConvTuning{8, 16, 2}, nullptr));
}

TEST_CASE("the vector width follows part_dim and the alignment of x and out") {
  kda::PackedConvArgs a = kda_args();
  SUBCASE("aligned seed scale: 4 channels per lane") { CHECK(kda::conv::default_vec(a) == 4); }
  SUBCASE("part_dim 192 allows 64-channel tiles only") {
    a.part_dim = 192;
    a.dim = 576;
    a.x_row_stride = 576;
    CHECK(kda::conv::default_vec(a) == 2);
  }
  SUBCASE("an x that is only 2-byte aligned") {
    a.x = fake_pointer<const void>(1, 2);
    CHECK(kda::conv::default_vec(a) == 1);
  }
  SUBCASE("an x 4-byte but not 8-byte aligned") {
    a.x = fake_pointer<const void>(1, 4);
    CHECK(kda::conv::default_vec(a) == 2);
  }
  SUBCASE("an odd x row stride") {
    a.x_row_stride = 4865;
    CHECK(kda::conv::default_vec(a) == 1);
  }
  SUBCASE("an out plane stride of an odd number of 4-element groups") {
    a.out_plane_stride = a.num_tokens * a.part_dim + 2;
    CHECK(kda::conv::default_vec(a) == 2);
  }
  SUBCASE("fp32 x with 16-byte rows") {
    a.x_dtype = kda::DType::FP32;
    CHECK(kda::conv::default_vec(a) == 4);
    a.x = fake_pointer<const void>(1, 8);
    CHECK(kda::conv::default_vec(a) == 2);
  }
}

TEST_CASE("the default chunk length is 16 tokens, whatever the capacities") {
  static_assert(kda::conv::kDefaultChunkLen == 16, "the default chunk length");
  kda::PackedConvArgs a = kda_args();
  for (int64_t tokens : {1, 2048, 4096, 16384, 65536}) {
    a.num_tokens = tokens;
    a.out_plane_stride = 0;
    CHECK(kda::conv::make_params(a).chunk_shift == 4);
  }
}

TEST_CASE("make_params resolves the plane stride and sizes the grid from capacities") {
  kda::PackedConvArgs a = kda_args();
  const kda::conv::PackedConvParams p = kda::conv::make_params(a);
  CHECK(p.out_plane_stride == 2048 * 1536);
  CHECK(p.vec == 4);
  CHECK(p.tile == 128);
  CHECK(p.num_col_blocks == 36);
  CHECK(p.chunk_shift == 4);
  CHECK(p.search_steps == 1);
  CHECK(p.search_stride == 1);
  CHECK(p.programs_per_col_block == 2048 / 16 + 4);
  CHECK(p.num_programs == (2048 / 16 + 4) * 36);
  CHECK(p.warps_per_cta == 2);  // 2048 tokens: below the 4096 where 4 warps start
  CHECK(p.planes == 3);
  CHECK(p.cols_per_plane == 12);
  CHECK(p.col_groups_per_plane == 6);
  CHECK(p.chunks_per_cta == 1);  // 2048 tokens: below the 4096 where 2 per CTA start
  CHECK(p.cta_programs == (p.programs_per_col_block + p.chunks_per_cta - 1) / p.chunks_per_cta);
  CHECK(p.num_ctas == p.cta_programs * 6 * 3);
  CHECK(p.has_null_line);
  CHECK(p.null_line == 0);

  SUBCASE("a forced tuning") {
    const kda::conv::PackedConvParams q = kda::conv::make_params(a, {8, 128, 1});
    CHECK(q.vec == 8);
    CHECK(q.tile == 256);
    CHECK(q.num_col_blocks == 18);
    CHECK(q.chunk_shift == 7);
    CHECK(q.cols_per_plane == 6);
    CHECK(q.col_groups_per_plane == 6);
    CHECK(q.num_ctas == q.cta_programs * 18);
  }
  SUBCASE("the grid does not depend on the batch, only on the capacities") {
    a.varlen.num_seqs = 300;
    a.out_plane_stride = 8192 * 1536;
    const kda::conv::PackedConvParams q = kda::conv::make_params(a);
    CHECK(q.search_steps == 2);
    CHECK(q.search_stride == 32);
    CHECK(q.programs_per_col_block == 2048 / 16 + 300);
    CHECK(q.out_plane_stride == 8192 * 1536);
  }
  SUBCASE("no null line") {
    a.varlen.null_line.reset();
    CHECK_FALSE(kda::conv::make_params(a).has_null_line);
  }
  SUBCASE("the conv-state element type is carried as a flag, with the same launch shape") {
    CHECK_FALSE(p.state_dtype_is_bf16);
    a.state_dtype = kda::DType::BF16;
    const kda::conv::PackedConvParams q = kda::conv::make_params(a);
    CHECK(q.state_dtype_is_bf16);
    CHECK(q.conv_states == a.conv_states);
    CHECK(q.vec == p.vec);
    CHECK(q.num_ctas == p.num_ctas);
  }
  SUBCASE("4 warps per CTA from 4096 tokens of capacity") {
    a.num_tokens = 4096;
    const kda::conv::PackedConvParams q = kda::conv::make_params(a);
    CHECK(q.warps_per_cta == 4);
    CHECK(q.col_groups_per_plane == 3);
    CHECK(q.chunks_per_cta == 2);
    a.part_dim = 768;  // 6 column blocks of 128: 4 does not divide them, 2 does
    a.dim = 3 * a.part_dim;
    CHECK(kda::conv::make_params(a).warps_per_cta == 2);
  }
  SUBCASE("the default warps per CTA divide a plane's column blocks") {
    a.part_dim = 768;  // 6 column blocks of 128: 2 warps per CTA, 3 groups
    a.dim = 3 * a.part_dim;
    const kda::conv::PackedConvParams q = kda::conv::make_params(a);
    CHECK(q.cols_per_plane == 6);
    CHECK(q.warps_per_cta == 2);
    CHECK(q.col_groups_per_plane == 3);
    a.part_dim = 128 * 5;  // 5 blocks: 1 warp per CTA
    a.dim = 2 * a.part_dim;
    const kda::conv::PackedConvParams r = kda::conv::make_params(a);
    CHECK(r.warps_per_cta == 1);
    CHECK(r.col_groups_per_plane == 5);
    CHECK(r.num_ctas == r.cta_programs * 5 * 2);
  }
  SUBCASE("a forced warps per CTA leaves the last group short") {
    const kda::conv::PackedConvParams q = kda::conv::make_params(a, {4, 0, 8});
    CHECK(q.col_groups_per_plane == 2);  // 12 blocks in groups of 8
  }
}

TEST_CASE("the largest capacities fit the grid with the default chunks per CTA, not with 1") {
  kda::PackedConvArgs a = kda_args();
  a.num_tokens = std::numeric_limits<int32_t>::max();
  a.varlen.num_seqs = std::numeric_limits<int32_t>::max() - 1;
  a.part_dim = 64;
  a.dim = a.part_dim;
  a.x_row_stride = a.dim;
  a.state_stride_line = 3 * a.dim;
  a.x = fake_pointer<const void>(1);
  a.out = fake_pointer<void>(1 << 12);
  // (2^31 / 16 + 2^31) programs: 2 per CTA stay below 2^31 CTAs, 1 per CTA does not.
  std::string why;
  CHECK_MESSAGE(kda::packed_causal_conv1d_supported(a, &why), why);
  CHECK(kda::conv::make_params(a).chunks_per_cta == 2);
  CHECK(kda::conv::check_tuning(a, {0, 0, 0, 1}) ==
        "the launch needs 2281701373 CTAs per column group ((num_tokens / 16 + num_seqs) / 1), more "
        "than the 2147483647 a grid's x extent can hold");
  CHECK_THROWS_WITH_AS(kda::conv::launch_packed_conv(a, {0, 0, 0, 1}, nullptr),
                       doctest::Contains("CTAs per column group"), kda::Error);
}

TEST_CASE("check_grid names the extent that exceeds CUDA's limits") {
  kda::conv::PackedConvParams p = kda::conv::make_params(kda_args());
  CHECK(kda::conv::check_grid(p).empty());
  p.cta_programs = int64_t{1} << 31;
  CHECK(kda::conv::check_grid(p) ==
        "the launch needs 2147483648 CTAs per column group ((num_tokens / 16 + num_seqs) / 1), more "
        "than the 2147483647 a grid's x extent can hold");
  p.cta_programs = 100;
  p.planes = 70000;
  CHECK(kda::conv::check_grid(p) ==
        "dim / part_dim = 70000 planes, more than the 65535 a grid's z extent can hold");
  p.planes = 3;
  p.col_groups_per_plane = 65536;
  CHECK(kda::conv::check_grid(p) ==
        "part_dim 1536 needs 65536 column groups per plane, more than the 65535 a grid's y extent "
        "can hold");
}

TEST_CASE("a forced tuning outside the instances is refused before any launch") {
  kda::PackedConvArgs a = kda_args();
  using kda::conv::ConvTuning;
  SUBCASE("vec 3") {
    CHECK(kda::conv::check_tuning(a, {3, 0, 0}) ==
          "vec 3 is not one of 8, 4, 2, 1 (or 0 for the default)");
  }
  SUBCASE("vec 8 on misaligned rows") {
    a.x_row_stride = 4868;  // 8-byte but not 16-byte rows
    CHECK(kda::conv::check_tuning(a, {8, 0, 0}).find("vec 8 does not fit") == 0);
    CHECK(kda::conv::check_tuning(a, {4, 0, 0}).empty());
  }
  SUBCASE("chunk_len 48") {
    CHECK(kda::conv::check_tuning(a, {0, 48, 0}) ==
          "chunk_len 48 is not one of 8, 16, 32, 64, 128, 256 (or 0 for the default)");
  }
  SUBCASE("warps_per_cta 3") {
    CHECK(kda::conv::check_tuning(a, {0, 0, 3}) ==
          "warps_per_cta 3 is not one of 1, 2, 4, 8 (or 0 for the default)");
  }
  SUBCASE("chunks_per_cta 3") {
    CHECK(kda::conv::check_tuning(a, {0, 0, 0, 3}) ==
          "chunks_per_cta 3 is not one of 1, 2, 4, 8, 16 (or 0 for the default)");
    const kda::conv::PackedConvParams p = kda::conv::make_params(a, {0, 0, 0, 8});
    CHECK(p.cta_programs == (2048 / 16 + 4 + 7) / 8);
  }
  SUBCASE("too much shared memory") {
    CHECK(kda::conv::check_tuning(a, {8, 0, 8}) ==
          "warps_per_cta 8 with vec 8 needs 59136 bytes of shared memory, more than 49152");
    CHECK(kda::conv::check_tuning(a, {8, 0, 4}).empty());
  }
  SUBCASE("every listed tuning of the seed scale is accepted") {
    for (int vec : {8, 4, 2, 1})
      for (int chunk : {8, 16, 32, 64, 128, 256})
        for (int warps : {1, 2, 4}) CHECK(kda::conv::check_tuning(a, {vec, chunk, warps}).empty());
  }
  CHECK_THROWS_WITH_AS(kda::conv::launch_packed_conv(a, {3, 0, 0}, nullptr),
                       doctest::Contains("kda::conv::launch_packed_conv: vec 3 is not one of"),
                       kda::Error);
  a.x = nullptr;
  CHECK_THROWS_WITH_AS(kda::conv::launch_packed_conv(a, {}, nullptr),
                       doctest::Contains("kda::conv::launch_packed_conv: x is null"), kda::Error);
}
