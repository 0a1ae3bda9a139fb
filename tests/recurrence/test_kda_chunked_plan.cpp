// The plan of kda_chunked (src/recurrence/kda_chunked_plan.cpp) on the CPU: the segment choice
// (the cost model of docs/design.md, "Segments"), the segment length of an explicit or automatic
// segment_tokens, the workspace layout, and the checks kda_chunked adds to the shared ones.
// The tables pin the plan's values over a grid of capacities and SM counts (segment lengths in
// tokens, 0 for no cut): a sequence's bits depend on its segment length and the module's memory
// on the layout, so neither may drift.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "common/arg_checks.h"
#include "recurrence/kda_chunked.h"
#include "recurrence/kda_recurrence.h"

namespace {

// A grid of capacities and SM counts: tokens x heads, one value per SM count of kSms.
constexpr int kSms[] = {0, 1, 66, 78, 114, 132};
struct AutoRow {
  int64_t tokens, heads;
  int64_t segment_tokens[6];  // auto_segment_tokens(tokens, heads, kSms[i])
};
const AutoRow kAuto[] = {
    {0, 1, {0, 0, 0, 0, 0, 0}},
    {0, 2, {0, 0, 0, 0, 0, 0}},
    {0, 4, {0, 0, 0, 0, 0, 0}},
    {0, 8, {0, 0, 0, 0, 0, 0}},
    {0, 12, {0, 0, 0, 0, 0, 0}},
    {0, 16, {0, 0, 0, 0, 0, 0}},
    {0, 32, {0, 0, 0, 0, 0, 0}},
    {0, 128, {0, 0, 0, 0, 0, 0}},
    {1, 1, {0, 0, 0, 0, 0, 0}},
    {1, 2, {0, 0, 0, 0, 0, 0}},
    {1, 4, {0, 0, 0, 0, 0, 0}},
    {1, 8, {0, 0, 0, 0, 0, 0}},
    {1, 12, {0, 0, 0, 0, 0, 0}},
    {1, 16, {0, 0, 0, 0, 0, 0}},
    {1, 32, {0, 0, 0, 0, 0, 0}},
    {1, 128, {0, 0, 0, 0, 0, 0}},
    {64, 1, {0, 0, 0, 0, 0, 0}},
    {64, 2, {0, 0, 0, 0, 0, 0}},
    {64, 4, {0, 0, 0, 0, 0, 0}},
    {64, 8, {0, 0, 0, 0, 0, 0}},
    {64, 12, {0, 0, 0, 0, 0, 0}},
    {64, 16, {0, 0, 0, 0, 0, 0}},
    {64, 32, {0, 0, 0, 0, 0, 0}},
    {64, 128, {0, 0, 0, 0, 0, 0}},
    {65, 1, {0, 0, 0, 0, 0, 0}},
    {65, 2, {0, 0, 0, 0, 0, 0}},
    {65, 4, {0, 0, 0, 0, 0, 0}},
    {65, 8, {0, 0, 0, 0, 0, 0}},
    {65, 12, {0, 0, 0, 0, 0, 0}},
    {65, 16, {0, 0, 0, 0, 0, 0}},
    {65, 32, {0, 0, 0, 0, 0, 0}},
    {65, 128, {0, 0, 0, 0, 0, 0}},
    {1000, 1, {0, 0, 0, 0, 0, 0}},
    {1000, 2, {0, 0, 0, 0, 0, 0}},
    {1000, 4, {0, 0, 0, 0, 0, 0}},
    {1000, 8, {0, 0, 0, 0, 0, 0}},
    {1000, 12, {0, 0, 0, 0, 0, 0}},
    {1000, 16, {0, 0, 0, 0, 0, 0}},
    {1000, 32, {0, 0, 0, 0, 0, 0}},
    {1000, 128, {0, 0, 0, 0, 0, 0}},
    {1024, 1, {0, 0, 0, 0, 0, 0}},
    {1024, 2, {0, 0, 0, 0, 0, 0}},
    {1024, 4, {0, 0, 0, 0, 0, 0}},
    {1024, 8, {0, 0, 0, 0, 0, 0}},
    {1024, 12, {0, 0, 0, 0, 0, 0}},
    {1024, 16, {0, 0, 0, 0, 0, 0}},
    {1024, 32, {0, 0, 0, 0, 0, 0}},
    {1024, 128, {0, 0, 0, 0, 0, 0}},
    {2048, 1, {0, 0, 0, 0, 0, 0}},
    {2048, 2, {0, 0, 0, 0, 0, 0}},
    {2048, 4, {0, 0, 0, 0, 0, 0}},
    {2048, 8, {0, 0, 0, 0, 0, 0}},
    {2048, 12, {0, 0, 0, 0, 0, 0}},
    {2048, 16, {0, 0, 0, 0, 0, 0}},
    {2048, 32, {0, 0, 0, 0, 0, 0}},
    {2048, 128, {0, 0, 0, 0, 0, 0}},
    {4096, 1, {0, 0, 1024, 1024, 1024, 1024}},
    {4096, 2, {0, 0, 1024, 1024, 1024, 1024}},
    {4096, 4, {0, 0, 1024, 1024, 1024, 1024}},
    {4096, 8, {0, 0, 0, 0, 1024, 1024}},
    {4096, 12, {0, 0, 0, 0, 0, 1024}},
    {4096, 16, {0, 0, 0, 0, 0, 0}},
    {4096, 32, {0, 0, 0, 0, 0, 0}},
    {4096, 128, {0, 0, 0, 0, 0, 0}},
    {8192, 1, {0, 0, 1024, 1024, 1024, 1024}},
    {8192, 2, {0, 0, 1024, 1024, 1024, 1024}},
    {8192, 4, {0, 0, 1024, 1024, 1024, 1024}},
    {8192, 8, {0, 0, 2048, 1024, 1024, 1024}},
    {8192, 12, {0, 0, 0, 2048, 1024, 2048}},
    {8192, 16, {0, 0, 0, 0, 2048, 2048}},
    {8192, 32, {0, 0, 0, 0, 0, 0}},
    {8192, 128, {0, 0, 0, 0, 0, 0}},
    {16384, 1, {0, 0, 1024, 1024, 1024, 1024}},
    {16384, 2, {0, 0, 1024, 1024, 1024, 1024}},
    {16384, 4, {0, 0, 2048, 1024, 2048, 1024}},
    {16384, 8, {0, 0, 4096, 2048, 2048, 2048}},
    {16384, 12, {0, 0, 0, 4096, 2048, 4096}},
    {16384, 16, {0, 0, 0, 0, 4096, 4096}},
    {16384, 32, {0, 0, 0, 0, 0, 0}},
    {16384, 128, {0, 0, 0, 0, 0, 0}},
    {32768, 1, {0, 0, 2048, 2048, 2048, 1024}},
    {32768, 2, {0, 0, 2048, 2048, 2048, 2048}},
    {32768, 4, {0, 0, 4096, 2048, 4096, 2048}},
    {32768, 8, {0, 0, 8192, 4096, 4096, 4096}},
    {32768, 12, {0, 0, 0, 8192, 4096, 8192}},
    {32768, 16, {0, 0, 0, 0, 8192, 8192}},
    {32768, 32, {0, 0, 0, 0, 0, 0}},
    {32768, 128, {0, 0, 0, 0, 0, 0}},
    {65536, 1, {0, 0, 2048, 2048, 2048, 2048}},
    {65536, 2, {0, 0, 4096, 4096, 2048, 2048}},
    {65536, 4, {0, 0, 8192, 4096, 8192, 4096}},
    {65536, 8, {0, 0, 16384, 8192, 8192, 8192}},
    {65536, 12, {0, 0, 0, 16384, 8192, 16384}},
    {65536, 16, {0, 0, 0, 0, 16384, 16384}},
    {65536, 32, {0, 0, 0, 0, 0, 0}},
    {65536, 128, {0, 0, 0, 0, 0, 0}},
    {131072, 1, {0, 0, 4096, 4096, 4096, 4096}},
    {131072, 2, {0, 0, 8192, 8192, 2048, 4096}},
    {131072, 4, {0, 0, 16384, 8192, 16384, 8192}},
    {131072, 8, {0, 0, 4096, 16384, 16384, 16384}},
    {131072, 12, {0, 0, 0, 32768, 16384, 32768}},
    {131072, 16, {0, 0, 0, 0, 32768, 4096}},
    {131072, 32, {0, 0, 0, 0, 0, 0}},
    {131072, 128, {0, 0, 0, 0, 0, 0}},
    {1048576, 1, {0, 0, 32768, 32768, 8192, 16384}},
    {1048576, 2, {0, 0, 65536, 8192, 8192, 32768}},
    {1048576, 4, {0, 0, 131072, 65536, 8192, 65536}},
    {1048576, 8, {0, 0, 32768, 16384, 131072, 131072}},
    {1048576, 12, {0, 0, 0, 262144, 131072, 262144}},
    {1048576, 16, {0, 0, 0, 0, 262144, 32768}},
    {1048576, 32, {0, 0, 0, 0, 0, 0}},
    {1048576, 128, {0, 0, 0, 0, 0, 0}},
};

// segment_tokens_of for 12 heads, 8 sequences and 132 SMs, per RecurrenceArgs::segment_tokens
// of kSegmentTokens.
constexpr int64_t kSegmentTokens[] = {-1, 0, 64, 65, 100, 128, 1024, 4096, 1048576};
struct SegmentRow {
  int64_t tokens;
  int64_t resolved[9];
};
const SegmentRow kSegments[] = {
    {0, {0, 0, 0, 0, 0, 0, 0, 0, 0}},
    {1, {0, 0, 0, 0, 0, 0, 0, 0, 0}},
    {64, {0, 0, 0, 0, 0, 0, 0, 0, 0}},
    {65, {0, 0, 64, 0, 0, 0, 0, 0, 0}},
    {1000, {0, 0, 64, 128, 128, 128, 0, 0, 0}},
    {1024, {0, 0, 64, 128, 128, 128, 0, 0, 0}},
    {2048, {0, 0, 64, 128, 128, 128, 1024, 0, 0}},
    {4096, {1024, 0, 64, 128, 128, 128, 1024, 0, 0}},
    {8192, {2048, 0, 64, 128, 128, 128, 1024, 4096, 0}},
    {16384, {4096, 0, 64, 128, 128, 128, 1024, 4096, 0}},
    {32768, {8192, 0, 64, 128, 128, 128, 1024, 4096, 0}},
    {65536, {16384, 0, 64, 128, 128, 128, 1024, 4096, 0}},
    {131072, {32768, 0, 64, 128, 128, 128, 1024, 4096, 0}},
    {1048576, {262144, 0, 64, 128, 128, 128, 1024, 4096, 0}},
};

// chunked_layout(args of tokens, seqs, heads; segment_tokens).
struct LayoutRow {
  int64_t tokens, seqs, heads, segment_tokens;
  int64_t slots, seg_slots;
  std::size_t record_bytes, seg_bytes;
};
const LayoutRow kLayouts[] = {
    {0, 0, 1, 64, 0, 0, 0, 0},
    {0, 0, 1, 1024, 0, 0, 0, 0},
    {0, 0, 1, 4096, 0, 0, 0, 0},
    {0, 0, 1, 0, 0, 0, 0, 0},
    {0, 0, 12, 64, 0, 0, 0, 0},
    {0, 0, 12, 1024, 0, 0, 0, 0},
    {0, 0, 12, 4096, 0, 0, 0, 0},
    {0, 0, 12, 0, 0, 0, 0, 0},
    {0, 1, 1, 64, 0, 0, 0, 0},
    {0, 1, 1, 1024, 0, 0, 0, 0},
    {0, 1, 1, 4096, 0, 0, 0, 0},
    {0, 1, 1, 0, 0, 0, 0, 0},
    {0, 1, 12, 64, 0, 0, 0, 0},
    {0, 1, 12, 1024, 0, 0, 0, 0},
    {0, 1, 12, 4096, 0, 0, 0, 0},
    {0, 1, 12, 0, 0, 0, 0, 0},
    {0, 7, 1, 64, 0, 0, 0, 0},
    {0, 7, 1, 1024, 0, 0, 0, 0},
    {0, 7, 1, 4096, 0, 0, 0, 0},
    {0, 7, 1, 0, 0, 0, 0, 0},
    {0, 7, 12, 64, 0, 0, 0, 0},
    {0, 7, 12, 1024, 0, 0, 0, 0},
    {0, 7, 12, 4096, 0, 0, 0, 0},
    {0, 7, 12, 0, 0, 0, 0, 0},
    {0, 256, 1, 64, 0, 0, 0, 0},
    {0, 256, 1, 1024, 0, 0, 0, 0},
    {0, 256, 1, 4096, 0, 0, 0, 0},
    {0, 256, 1, 0, 0, 0, 0, 0},
    {0, 256, 12, 64, 0, 0, 0, 0},
    {0, 256, 12, 1024, 0, 0, 0, 0},
    {0, 256, 12, 4096, 0, 0, 0, 0},
    {0, 256, 12, 0, 0, 0, 0, 0},
    {100, 0, 1, 64, 0, 0, 0, 0},
    {100, 0, 1, 1024, 0, 0, 0, 0},
    {100, 0, 1, 4096, 0, 0, 0, 0},
    {100, 0, 1, 0, 0, 0, 0, 0},
    {100, 0, 12, 64, 0, 0, 0, 0},
    {100, 0, 12, 1024, 0, 0, 0, 0},
    {100, 0, 12, 4096, 0, 0, 0, 0},
    {100, 0, 12, 0, 0, 0, 0, 0},
    {100, 1, 1, 64, 2, 2, 181248, 131072},
    {100, 1, 1, 1024, 2, 1, 181248, 65536},
    {100, 1, 1, 4096, 2, 1, 181248, 65536},
    {100, 1, 1, 0, 2, 1, 181248, 0},
    {100, 1, 12, 64, 2, 2, 2174976, 1572864},
    {100, 1, 12, 1024, 2, 1, 2174976, 786432},
    {100, 1, 12, 4096, 2, 1, 2174976, 786432},
    {100, 1, 12, 0, 2, 1, 2174976, 0},
    {100, 7, 1, 64, 8, 8, 724992, 524288},
    {100, 7, 1, 1024, 8, 7, 724992, 458752},
    {100, 7, 1, 4096, 8, 7, 724992, 458752},
    {100, 7, 1, 0, 8, 7, 724992, 0},
    {100, 7, 12, 64, 8, 8, 8699904, 6291456},
    {100, 7, 12, 1024, 8, 7, 8699904, 5505024},
    {100, 7, 12, 4096, 8, 7, 8699904, 5505024},
    {100, 7, 12, 0, 8, 7, 8699904, 0},
    {100, 256, 1, 64, 257, 257, 23290368, 16842752},
    {100, 256, 1, 1024, 257, 256, 23290368, 16777216},
    {100, 256, 1, 4096, 257, 256, 23290368, 16777216},
    {100, 256, 1, 0, 257, 256, 23290368, 0},
    {100, 256, 12, 64, 257, 257, 279484416, 202113024},
    {100, 256, 12, 1024, 257, 256, 279484416, 201326592},
    {100, 256, 12, 4096, 257, 256, 279484416, 201326592},
    {100, 256, 12, 0, 257, 256, 279484416, 0},
    {4096, 0, 1, 64, 0, 0, 0, 0},
    {4096, 0, 1, 1024, 0, 0, 0, 0},
    {4096, 0, 1, 4096, 0, 0, 0, 0},
    {4096, 0, 1, 0, 0, 0, 0, 0},
    {4096, 0, 12, 64, 0, 0, 0, 0},
    {4096, 0, 12, 1024, 0, 0, 0, 0},
    {4096, 0, 12, 4096, 0, 0, 0, 0},
    {4096, 0, 12, 0, 0, 0, 0, 0},
    {4096, 1, 1, 64, 65, 65, 5890560, 4259840},
    {4096, 1, 1, 1024, 65, 5, 5890560, 327680},
    {4096, 1, 1, 4096, 65, 2, 5890560, 131072},
    {4096, 1, 1, 0, 65, 1, 5890560, 0},
    {4096, 1, 12, 64, 65, 65, 70686720, 51118080},
    {4096, 1, 12, 1024, 65, 5, 70686720, 3932160},
    {4096, 1, 12, 4096, 65, 2, 70686720, 1572864},
    {4096, 1, 12, 0, 65, 1, 70686720, 0},
    {4096, 7, 1, 64, 71, 71, 6434304, 4653056},
    {4096, 7, 1, 1024, 71, 11, 6434304, 720896},
    {4096, 7, 1, 4096, 71, 8, 6434304, 524288},
    {4096, 7, 1, 0, 71, 7, 6434304, 0},
    {4096, 7, 12, 64, 71, 71, 77211648, 55836672},
    {4096, 7, 12, 1024, 71, 11, 77211648, 8650752},
    {4096, 7, 12, 4096, 71, 8, 77211648, 6291456},
    {4096, 7, 12, 0, 71, 7, 77211648, 0},
    {4096, 256, 1, 64, 320, 320, 28999680, 20971520},
    {4096, 256, 1, 1024, 320, 260, 28999680, 17039360},
    {4096, 256, 1, 4096, 320, 257, 28999680, 16842752},
    {4096, 256, 1, 0, 320, 256, 28999680, 0},
    {4096, 256, 12, 64, 320, 320, 347996160, 251658240},
    {4096, 256, 12, 1024, 320, 260, 347996160, 204472320},
    {4096, 256, 12, 4096, 320, 257, 347996160, 202113024},
    {4096, 256, 12, 0, 320, 256, 347996160, 0},
    {65536, 0, 1, 64, 0, 0, 0, 0},
    {65536, 0, 1, 1024, 0, 0, 0, 0},
    {65536, 0, 1, 4096, 0, 0, 0, 0},
    {65536, 0, 1, 0, 0, 0, 0, 0},
    {65536, 0, 12, 64, 0, 0, 0, 0},
    {65536, 0, 12, 1024, 0, 0, 0, 0},
    {65536, 0, 12, 4096, 0, 0, 0, 0},
    {65536, 0, 12, 0, 0, 0, 0, 0},
    {65536, 1, 1, 64, 1025, 1025, 92889600, 67174400},
    {65536, 1, 1, 1024, 1025, 65, 92889600, 4259840},
    {65536, 1, 1, 4096, 1025, 17, 92889600, 1114112},
    {65536, 1, 1, 0, 1025, 1, 92889600, 0},
    {65536, 1, 12, 64, 1025, 1025, 1114675200, 806092800},
    {65536, 1, 12, 1024, 1025, 65, 1114675200, 51118080},
    {65536, 1, 12, 4096, 1025, 17, 1114675200, 13369344},
    {65536, 1, 12, 0, 1025, 1, 1114675200, 0},
    {65536, 7, 1, 64, 1031, 1031, 93433344, 67567616},
    {65536, 7, 1, 1024, 1031, 71, 93433344, 4653056},
    {65536, 7, 1, 4096, 1031, 23, 93433344, 1507328},
    {65536, 7, 1, 0, 1031, 7, 93433344, 0},
    {65536, 7, 12, 64, 1031, 1031, 1121200128, 810811392},
    {65536, 7, 12, 1024, 1031, 71, 1121200128, 55836672},
    {65536, 7, 12, 4096, 1031, 23, 1121200128, 18087936},
    {65536, 7, 12, 0, 1031, 7, 1121200128, 0},
    {65536, 256, 1, 64, 1280, 1280, 115998720, 83886080},
    {65536, 256, 1, 1024, 1280, 320, 115998720, 20971520},
    {65536, 256, 1, 4096, 1280, 272, 115998720, 17825792},
    {65536, 256, 1, 0, 1280, 256, 115998720, 0},
    {65536, 256, 12, 64, 1280, 1280, 1391984640, 1006632960},
    {65536, 256, 12, 1024, 1280, 320, 1391984640, 251658240},
    {65536, 256, 12, 4096, 1280, 272, 1391984640, 213909504},
    {65536, 256, 12, 0, 1280, 256, 1391984640, 0},
};

kda::RecurrenceArgs capacities(int64_t tokens, int64_t seqs, int64_t heads) {
  kda::RecurrenceArgs a;
  a.num_tokens = tokens;
  a.varlen.num_seqs = seqs;
  a.num_heads = heads;
  return a;
}

}  // namespace

TEST_CASE("auto_segment_tokens over tokens x heads x SM counts") {
  for (const AutoRow& r : kAuto)
    for (int i = 0; i < 6; ++i) {
      CAPTURE(r.tokens);
      CAPTURE(r.heads);
      CAPTURE(kSms[i]);
      CHECK(kda::recurrence::auto_segment_tokens(r.tokens, r.heads, kSms[i]) == r.segment_tokens[i]);
    }
}

TEST_CASE("segment_tokens_of resolves explicit and automatic lengths") {
  for (const SegmentRow& r : kSegments)
    for (int i = 0; i < 9; ++i) {
      kda::RecurrenceArgs a = capacities(r.tokens, 8, 12);
      a.segment_tokens = kSegmentTokens[i];
      CAPTURE(r.tokens);
      CAPTURE(a.segment_tokens);
      const int64_t got = kda::recurrence::segment_tokens_of(a, 132);
      CHECK(got == r.resolved[i]);
      // The kernels' shift is the same length in chunks.
      const int shift = kda::recurrence::segment_chunk_shift(got);
      if (got == 0)
        CHECK(shift == kda::recurrence::kNoSegments);
      else
        CHECK((int64_t{64} << shift) == got);
    }
}

TEST_CASE("segment lengths beyond the longest sequence cut nothing, up to INT64_MAX") {
  // The workspace query resolves lengths that supported() has not checked.
  kda::RecurrenceArgs a = capacities(16384, 8, 12);
  for (int64_t len : {int64_t{16384}, int64_t{16385}, (int64_t{1} << 62) + 1,
                      std::numeric_limits<int64_t>::max()}) {
    CAPTURE(len);
    a.segment_tokens = len;
    CHECK(kda::recurrence::segment_tokens_of(a, 132) == 0);
    CHECK(kda::recurrence::chunked_workspace_bytes(a, 132) ==
          kda::recurrence::chunked_layout(a, 0).total());
  }
  a.segment_tokens = 8192;  // the longest one that still cuts a 16384-token sequence
  CHECK(kda::recurrence::segment_tokens_of(a, 132) == 8192);
}

TEST_CASE("the chunked workspace layout over capacities and segment lengths") {
  for (const LayoutRow& r : kLayouts) {
    CAPTURE(r.tokens);
    CAPTURE(r.seqs);
    CAPTURE(r.heads);
    CAPTURE(r.segment_tokens);
    const kda::recurrence::ChunkedLayout l =
        kda::recurrence::chunked_layout(capacities(r.tokens, r.seqs, r.heads), r.segment_tokens);
    CHECK(l.slots == r.slots);
    CHECK(l.seg_slots == r.seg_slots);
    CHECK(l.record_bytes == r.record_bytes);
    CHECK(l.seg_bytes == r.seg_bytes);
    CHECK(l.seg_chunk_shift == kda::recurrence::segment_chunk_shift(r.segment_tokens));
  }
}

TEST_CASE("chunked_workspace_bytes is the layout of the resolved segment length") {
  for (const AutoRow& r : kAuto)
    for (int i = 0; i < 6; ++i) {
      kda::RecurrenceArgs a = capacities(r.tokens, 8, r.heads);
      CAPTURE(r.tokens);
      CAPTURE(r.heads);
      CAPTURE(kSms[i]);
      const std::size_t want =
          r.tokens == 0 ? 0 : kda::recurrence::chunked_layout(a, r.segment_tokens[i]).total();
      CHECK(kda::recurrence::chunked_workspace_bytes(a, kSms[i]) == want);
      a.segment_tokens = 0;  // no cut: the SM count is not read
      CHECK(kda::recurrence::chunked_workspace_bytes(a, kSms[i]) ==
            (r.tokens == 0 ? 0 : kda::recurrence::chunked_layout(a, 0).total()));
    }
}

TEST_CASE("the segment plan cuts only where few heads leave SMs idle") {
  using kda::recurrence::auto_segment_tokens;
  // Heads enough that a second wave of blocks costs what a cut saves, or sequences too short
  // to pay: never cut.
  CHECK(auto_segment_tokens(16384, 32, 132) == 0);
  CHECK(auto_segment_tokens(16384, 96, 132) == 0);
  CHECK(auto_segment_tokens(2048, 4, 132) == 0);
  CHECK(auto_segment_tokens(65536, 4, 0) == 0);  // no device: no cut
  // Few heads over long sequences: segments of at least 1024 tokens, shorter than the sequence.
  for (int64_t heads : {1, 2, 4}) {
    CAPTURE(heads);
    const int64_t len = auto_segment_tokens(65536, heads, 132);
    CHECK(len >= kda::recurrence::kMinAutoSegmentTokens);
    CHECK(len < 65536);
  }
  CHECK(auto_segment_tokens(4096, 1, 132) != 0);

  kda::RecurrenceArgs a;
  a.num_heads = 4;
  a.num_tokens = 65536;
  a.varlen.num_seqs = 8;
  a.segment_tokens = 0;
  CHECK(kda::recurrence::segment_tokens_of(a, 132) == 0);
  a.segment_tokens = 128;
  CHECK(kda::recurrence::segment_tokens_of(a, 132) == 128);
  a.segment_tokens = 65536;  // as long as the bucket: nothing to cut
  CHECK(kda::recurrence::segment_tokens_of(a, 132) == 0);
  a.segment_tokens = kda::kKdaAutoSegments;
  CHECK(kda::recurrence::segment_tokens_of(a, 132) == auto_segment_tokens(65536, 4, 132));

  // The workspace: the records, then E and P per segment slot and head.
  const kda::recurrence::ChunkedLayout whole = kda::recurrence::chunked_layout(a, 0);
  CHECK(whole.slots == 65536 / 64 + 8);
  CHECK(whole.record_bytes == static_cast<size_t>(whole.slots) * 4 * kda::recurrence::kRecordBytes);
  CHECK(whole.total() == whole.record_bytes);
  const kda::recurrence::ChunkedLayout cut = kda::recurrence::chunked_layout(a, 1024);
  CHECK(cut.seg_slots == 65536 / 1024 + 8);
  CHECK(cut.seg_bytes == static_cast<size_t>(cut.seg_slots) * 4 * 128 * 128 * 4);
  CHECK(cut.total() == whole.record_bytes + 2 * cut.seg_bytes);
}

namespace {

// Arguments that pass every check of kda_chunked_supported (it reads no memory: aligned
// stand-ins for the pointers).
kda::RecurrenceArgs supported_args() {
  const auto at = [](uintptr_t x) { return reinterpret_cast<void*>(x << 12); };
  kda::RecurrenceArgs a;
  a.num_heads = 1;
  a.num_tokens = 256;
  a.varlen.num_seqs = 1;
  a.varlen.query_start_loc = static_cast<const int32_t*>(at(1));
  a.varlen.cache_indices = static_cast<const int32_t*>(at(2));
  a.q = at(3);
  a.k = at(4);
  a.v = at(5);
  a.qkv_row_stride = 128;
  a.g1 = at(6);
  a.g1_row_stride = 128;
  a.b = at(7);
  a.b_row_stride = 8;
  a.a_log = static_cast<const float*>(at(8));
  a.dt_bias = static_cast<const float*>(at(9));
  a.states = at(10);
  a.varlen.cache_lines = 2;
  a.state_stride_line = 128 * 128;
  a.state_stride_head = 128 * 128;
  a.state_stride_k = 128;
  a.state_stride_v = 1;
  a.o = at(11);
  a.o_row_stride = 128;
  return a;
}

}  // namespace

TEST_CASE("kda_chunked refuses a segment length that is not auto, 0 or a power of two >= 64") {
  kda::RecurrenceArgs a = supported_args();
  std::string why;
  for (int64_t good : {kda::kKdaAutoSegments, int64_t{0}, int64_t{64}, int64_t{4096}}) {
    CAPTURE(good);
    a.segment_tokens = good;
    CHECK_MESSAGE(kda::kda_chunked_supported(a, &why), why);
  }
  for (int64_t bad : {-2, 1, 32, 100, 1000}) {
    CAPTURE(bad);
    a.segment_tokens = bad;
    why.clear();
    CHECK_FALSE(kda::kda_chunked_supported(a, &why));
    CHECK(why.find("segment_tokens " + std::to_string(bad) + " is not") != std::string::npos);
  }
}

TEST_CASE("kda_chunked refuses chunk slots beyond phase 2's gridDim.x") {
  // Phase 2 runs up to 2 kStateSlices walk blocks per sequence or segment window along x.
  kda::RecurrenceArgs a = supported_args();
  const int64_t most = kda::detail::kInt32Max / (2 * kda::recurrence::kStateSlices);
  a.num_tokens = 64;
  a.varlen.num_seqs = most - 2;  // chunk slots: one plus num_seqs
  std::string why;
  CHECK_MESSAGE(kda::kda_chunked_supported(a, &why), why);
  a.varlen.num_seqs = most - 1;
  why.clear();
  CHECK_FALSE(kda::kda_chunked_supported(a, &why));
  CHECK(why.find("chunk slots exceed (2^31 - 1) / 4") != std::string::npos);
}
