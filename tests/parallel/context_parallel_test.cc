// Context parallel's bookkeeping, without processes: the zig-zag and
// contiguous splits cover every position of a sequence exactly once, and a
// rank's activation memory (the engine's ledger: the model's activations and
// the ring's buffers) at sequence 4096 is ½ and ¼ of cp 1's at cp 2 and 4.
#include <gtest/gtest.h>

#include <vector>

#include "model/config.h"
#include "model/parallel_ops.h"
#include "model/transformer.h"
#include "parallel/context_parallel.h"

namespace {

using po::model::ContextSplit;

TEST(ContextSplit, EveryPositionBelongsToExactlyOneRank) {
  for (bool zigzag : {true, false})
    for (int cp : {1, 2, 3, 4, 8}) {
      const int64_t T = 2 * 8 * 12;  // divisible by 2·cp for every cp above
      std::vector<int> owner(T, -1);
      for (int r = 0; r < cp; r++) {
        const ContextSplit s{cp, r, zigzag};
        const int64_t Tl = T / cp;
        for (int64_t t = 0; t < Tl; t++) {
          const int64_t p = s.position(t, Tl);
          ASSERT_GE(p, 0);
          ASSERT_LT(p, T);
          EXPECT_EQ(owner[p], -1) << "position " << p << " held by ranks " << owner[p] << " and "
                                  << r << " (cp " << cp << (zigzag ? " zigzag" : " contiguous") << ")";
          owner[p] = r;
        }
      }
      for (int64_t p = 0; p < T; p++)
        EXPECT_NE(owner[p], -1) << "position " << p << " held by no rank (cp " << cp << ")";
    }
}

TEST(ContextSplit, ZigzagPairsAnEarlyChunkWithALateOne) {
  // cp 4: 8 chunks; rank 1 holds chunks 1 and 6, so rows 0..S-1 are positions
  // S..2S-1 and rows S..2S-1 are 6S..7S-1.
  const ContextSplit s{4, 1, true};
  const int64_t T = 64, Tl = T / 4, S = T / 8;
  EXPECT_EQ(s.position(0, Tl), S);
  EXPECT_EQ(s.position(S - 1, Tl), 2 * S - 1);
  EXPECT_EQ(s.position(S, Tl), 6 * S);
  EXPECT_EQ(s.position(2 * S - 1, Tl), 7 * S - 1);
  const ContextSplit c{4, 1, false};
  EXPECT_EQ(c.position(0, Tl), Tl);
  EXPECT_EQ(c.position(Tl - 1, Tl), 2 * Tl - 1);
}

// The head's logits chunk (Transformer::head_chunk_rows rows of the
// vocabulary) does not depend on the sequence: it is the same at every cp and
// is held apart; the rest of a rank's activations is ½ and ¼ of cp 1's
// within 10%. The ring's buffers (five copies of a rank's keys and values in
// the backward) come on top, outside the model's ledger: at cp 2, 3% of cp 1's
// activations for llama-mini's grouped kv heads, 7% for gpt2-mini's.
TEST(ContextParallelMemory, ActivationsPerRankFallAsOneOverCp) {
  for (const char* preset : {"llama-mini", "gpt2-mini"}) {
    po::model::TransformerConfig cfg = po::model::TransformerConfig::preset(preset);
    cfg.seq_len = 4096;
    const int64_t T = 4096, B = 1, kv = cfg.n_kv_head * cfg.head_dim();
    ASSERT_EQ(po::model::Transformer::head_chunk_rows(B, T),
              po::model::Transformer::head_chunk_rows(B, T / 4));
    const size_t chunk = static_cast<size_t>(po::model::Transformer::head_chunk_rows(B, T) *
                                             cfg.vocab_size) * sizeof(float);
    auto acts = [&](int cp) {
      return po::model::Transformer::predicted_activation_bytes(cfg, B, T / cp, 1) - chunk;
    };
    const double one = static_cast<double>(acts(1));
    for (int cp : {2, 4}) {
      const double ratio = static_cast<double>(acts(cp)) / one;
      const size_t ring = po::parallel::ContextParallelOps::predicted_buffer_bytes(
          po::parallel::CpMode::kRing, cp, B, T / cp, kv);
      EXPECT_NEAR(ratio, 1.0 / cp, 0.1 / cp)
          << preset << " at sequence 4096: cp " << cp << " holds " << acts(cp)
          << " activation bytes per rank against cp 1's " << acts(1) << " (besides the head's "
          << chunk << "-byte logits chunk)";
      EXPECT_LT(static_cast<double>(ring) / one, 0.07 / (cp / 2))
          << preset << ": the ring's buffers at cp " << cp << " are " << ring << " bytes";
    }
  }
}

}  // namespace
