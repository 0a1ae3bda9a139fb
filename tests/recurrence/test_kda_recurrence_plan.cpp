// The recurrence's shared plan (src/recurrence/kda_recurrence_plan.cpp) on the CPU: the argument
// checks of both launchers; host only, no device memory is touched (the pointers are never
// dereferenced). kda_chunked's own plan is test_kda_chunked_plan.cpp's.
#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <string>

#include "kda/error.h"
#include "recurrence/kda_chunked.h"
#include "recurrence/kda_recurrence.h"
#include "recurrence/kda_recurrence_token.h"
#include "support/fake_pointers.h"

namespace {

using kda::test::fake;

kda::RecurrenceArgs valid_recurrence_args() {
  kda::RecurrenceArgs a;
  a.num_heads = 3;
  a.num_tokens = 100;
  a.varlen.num_seqs = 8;
  a.varlen.query_start_loc = fake<const int32_t>(1);
  a.varlen.cache_indices = fake<const int32_t>(2);
  a.varlen.has_initial_state = fake<const bool>(3);
  a.q = fake<const void>(4);
  a.k = fake<const void>(5);
  a.v = fake<const void>(6);
  a.qkv_row_stride = 384;
  a.g1 = fake<const void>(7);
  a.g1_row_stride = 388;
  a.b = fake<const void>(8);
  a.b_row_stride = 1472;
  a.b_col_offset = 1152;
  a.a_log = fake<const float>(9);
  a.dt_bias = fake<const float>(10);
  a.states = fake<void>(11);
  a.varlen.cache_lines = 5;
  a.state_stride_line = 3 * 128 * 128;
  a.state_stride_head = 128 * 128;
  a.state_stride_k = 128;
  a.state_stride_v = 1;
  a.o = fake<void>(12);
  a.o_row_stride = 384;
  return a;
}

}  // namespace

TEST_CASE("kda_recurrence_token_supported accepts well-formed arguments and names what is wrong") {
  kda::RecurrenceArgs a = valid_recurrence_args();
  std::string why;
  REQUIRE(kda::kda_recurrence_token_supported(a, &why));
  CHECK(why.empty());

  std::string expect;
  SUBCASE("head_dim") { a.head_dim = 64; expect = "only 128"; }
  SUBCASE("no heads") { a.num_heads = 0; expect = "num_heads 0"; }
  SUBCASE("too many heads for the grid") { a.num_heads = 20000; expect = "num_heads 20000"; }
  SUBCASE("negative tokens") { a.num_tokens = -1; expect = "num_tokens -1"; }
  SUBCASE("missing metadata") { a.varlen.cache_indices = nullptr; expect = "cache_indices"; }
  SUBCASE("missing plane") { a.v = nullptr; expect = "q, k, v, g1 and b"; }
  SUBCASE("missing pool") { a.states = nullptr; expect = "states"; }
  SUBCASE("fp16 state pool") { a.state_dtype = kda::DType::FP16; expect = "state_dtype fp16"; }
  SUBCASE("state_dtype out of range") {
    a.state_dtype = static_cast<kda::DType>(7);
    expect = "state_dtype invalid DType (value 7) is not supported";
  }
  SUBCASE("fp32 pool on a 2-byte boundary") {
    a.states = static_cast<char*>(a.states) + 2;
    expect = "states must be aligned to its 4-byte elements (state_dtype fp32)";
  }
  SUBCASE("bf16 pool on an odd address") {
    a.state_dtype = kda::DType::BF16;
    a.states = static_cast<char*>(a.states) + 1;
    expect = "states must be aligned to its 2-byte elements (state_dtype bf16)";
  }
  SUBCASE("missing o") { a.o = nullptr; expect = "o must be set"; }
  SUBCASE("row stride below P") { a.qkv_row_stride = 380; expect = "qkv_row_stride 380"; }
  SUBCASE("row stride not a multiple of 4") { a.g1_row_stride = 386; expect = "g1_row_stride 386"; }
  SUBCASE("misaligned q") { a.q = static_cast<const char*>(a.q) + 2; expect = "8-byte aligned"; }
  SUBCASE("misaligned v") { a.v = static_cast<const char*>(a.v) + 1; expect = "2-byte"; }
  SUBCASE("b columns past the row") { a.b_col_offset = 1470; expect = "b columns [1470, 1473)"; }
  SUBCASE("o row stride below P") { a.o_row_stride = 200; expect = "o_row_stride 200"; }
  SUBCASE("non-negative lower bound") { a.gate_lower_bound = 0.0; expect = "gate_lower_bound 0"; }
  SUBCASE("infinite lower bound") { a.gate_lower_bound = -std::numeric_limits<double>::infinity(); expect = "finite and negative"; }
  SUBCASE("zero state stride") { a.state_stride_v = 0; expect = "must be positive"; }
  SUBCASE("overlapping heads") { a.state_stride_head = 128 * 127; expect = "overlap"; }
  SUBCASE("overlapping lines") { a.state_stride_line = 2 * 128 * 128; expect = "overlap"; }
  SUBCASE("transposed state strides are fine") {
    a.state_stride_k = 1;
    a.state_stride_v = 128;
    a.state_stride_head = 128 * 128 + 32;
    a.state_stride_line = 3 * a.state_stride_head + 100;
    CHECK(kda::kda_recurrence_token_supported(a, &why));
    return;
  }
  SUBCASE("a bf16 pool on a 2-byte boundary is fine") {
    a.state_dtype = kda::DType::BF16;
    a.states = static_cast<char*>(a.states) + 2;
    CHECK(kda::kda_recurrence_token_supported(a, &why));
    std::string chunked_why;
    CHECK(kda::kda_chunked_supported(a, &chunked_why));
    return;
  }
  SUBCASE("a lower bound and has_initial_state absent are fine") {
    a.gate_lower_bound = -5.0;
    a.varlen.has_initial_state = nullptr;
    CHECK(kda::kda_recurrence_token_supported(a, &why));
    return;
  }
  CAPTURE(expect);
  CHECK_FALSE(kda::kda_recurrence_token_supported(a, &why));
  CHECK(why.find(expect) != std::string::npos);
  CHECK_FALSE(kda::kda_recurrence_token_supported(a));  // why is optional
  std::string chunked_why;  // the chunked kernel shares the checks
  CHECK_FALSE(kda::kda_chunked_supported(a, &chunked_why));
  CHECK(chunked_why == why);
  // The launcher reports the same sentence before touching the device.
  try {
    kda::kda_recurrence_token(a, nullptr);
    FAIL("kda_recurrence_token accepted bad arguments");
  } catch (const kda::Error& e) {
    CHECK(e.function() == "kda::kda_recurrence_token");
    CHECK(e.message() == why);
  }
}

TEST_CASE("kda_recurrence_token_supported checks the state-checkpoint tables") {
  kda::RecurrenceArgs a = valid_recurrence_args();
  a.checkpoint_seqs = fake<const kda::CheckpointSeq>(13);
  a.checkpoint_entries = fake<const kda::CheckpointEntry>(14);
  a.max_checkpoints = 4;
  std::string why;
  REQUIRE(kda::kda_recurrence_token_supported(a, &why));

  std::string expect;
  SUBCASE("entries without sequences") { a.checkpoint_seqs = nullptr; expect = "set together"; }
  SUBCASE("sequences without entries") { a.checkpoint_entries = nullptr; expect = "set together"; }
  SUBCASE("negative max_checkpoints") { a.max_checkpoints = -1; expect = "max_checkpoints -1"; }
  SUBCASE("max_checkpoints past int32") {
    a.max_checkpoints = int64_t{1} << 31;
    expect = "max_checkpoints 2147483648";
  }
  SUBCASE("tables with no entries") { a.max_checkpoints = 0; expect = "max_checkpoints is 0"; }
  SUBCASE("misaligned sequence table") {
    a.checkpoint_seqs = reinterpret_cast<const kda::CheckpointSeq*>(
        reinterpret_cast<const char*>(a.checkpoint_seqs) + 4);
    expect = "16-byte aligned";
  }
  SUBCASE("misaligned entry table") {
    a.checkpoint_entries = reinterpret_cast<const kda::CheckpointEntry*>(
        reinterpret_cast<const char*>(a.checkpoint_entries) + 8);
    expect = "16-byte aligned";
  }
  SUBCASE("no tables, with or without a capacity, are fine") {
    a.checkpoint_seqs = nullptr;
    a.checkpoint_entries = nullptr;
    CHECK(kda::kda_recurrence_token_supported(a, &why));
    a.max_checkpoints = 0;
    CHECK(kda::kda_recurrence_token_supported(a, &why));
    return;
  }
  CAPTURE(expect);
  CHECK_FALSE(kda::kda_recurrence_token_supported(a, &why));
  CHECK(why.find(expect) != std::string::npos);
  std::string chunked_why;  // the chunked kernel shares the checks
  CHECK_FALSE(kda::kda_chunked_supported(a, &chunked_why));
  CHECK(chunked_why == why);
  try {
    kda::kda_recurrence_token(a, nullptr);
    FAIL("kda_recurrence_token accepted bad checkpoint tables");
  } catch (const kda::Error& e) {
    CHECK(e.message() == why);
  }
}

TEST_CASE("launches with no tokens or no sequences enqueue nothing") {
  // Without a device a launch would fail; these return before any CUDA call.
  kda::RecurrenceArgs r = valid_recurrence_args();
  r.varlen.num_seqs = 0;
  CHECK_NOTHROW(kda::kda_recurrence_token(r, nullptr));
  r = valid_recurrence_args();
  r.num_tokens = 0;
  CHECK_NOTHROW(kda::kda_recurrence_token(r, nullptr));
}
