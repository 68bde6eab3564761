// One capability table (plan/capabilities.h): for every pipeline layout of a
// small grid, `train`'s start-up check refuses exactly what the table
// refuses, with the table's first row's message, and `plan` calls exactly
// those layouts not trainable, naming the same rows.
#include "plan/capabilities.h"

#include <gtest/gtest.h>

#include "core/config.h"
#include "core/error.h"
#include "plan/planner.h"
#include "train/trainer.h"

namespace {

using po::core::Config;

Config config_for(const po::plan::Layout& l) {
  Config c = Config::parse(
      "[model]\npreset = \"gpt2-tiny\"\nn_layer = 4\nn_embd = 32\nn_head = 4\nvocab_size = 64\n"
      "seq_len = 16\n[train]\nbatch_size = 8\nmicro_batch_size = 1\nsteps = 1\n"
      "[data]\ntrain = \"unused.bin\"\n",
      "test");
  c.set_override("parallel.dp=" + std::to_string(l.dp));
  c.set_override("parallel.tp=" + std::to_string(l.tp));
  c.set_override("parallel.pp=" + std::to_string(l.pp));
  c.set_override("parallel.cp=" + std::to_string(l.cp));
  c.set_override("parallel.zero_stage=" + std::to_string(l.zero_stage));
  c.set_override(std::string("train.precision=") + (l.bf16 ? "bf16" : "fp32"));
  c.set_override(std::string("parallel.vocab_parallel=") + (l.vocab_parallel ? "true" : "false"));
  return c;
}

TEST(Capabilities, TrainAndPlanRefuseWhatTheTableRefuses) {
  int refused = 0, trained = 0;
  for (int pp : {1, 2})
    for (int tp : {1, 2})
      for (int cp : {1, 2})
        for (int zero = 0; zero <= 3; ++zero)
          for (bool bf16 : {false, true})
            for (bool vocab : {false, true}) {
              po::plan::Layout l;
              l.dp = 1, l.tp = tp, l.pp = pp, l.cp = cp, l.zero_stage = zero, l.bf16 = bf16;
              l.vocab_parallel = vocab;
              l.batch = 8, l.micro = 1, l.seq = 16;
              const std::string what = l.describe() + (vocab ? ", vocabulary parallel" : "");
              const auto rows = po::plan::refusals(l);
              std::string train_error;
              try {
                po::train::check_config(config_for(l));
              } catch (const po::core::Error& e) {
                train_error = e.what();
              }
              if (rows.empty()) {
                EXPECT_EQ(train_error, "") << what << ": the table trains it, train refused it";
                ++trained;
              } else {
                EXPECT_NE(train_error.find(rows.front().message()), std::string::npos)
                    << what << ": train said \"" << train_error << "\", the table \""
                    << rows.front().message() << "\"";
                ++refused;
              }
              po::plan::ModelSpec m = po::plan::model_preset("gpt2-124M");
              const po::plan::Plan p =
                  po::plan::make_plan(m, po::plan::cluster_preset("h100-80gb-ib400", 1), l);
              std::string named;
              for (const auto& r : rows) named += (named.empty() ? "" : ", ") + r.what;
              const bool plan_refuses = !p.not_trainable.empty();
              EXPECT_EQ(plan_refuses, !rows.empty()) << what;
              if (!rows.empty()) {
                EXPECT_EQ(p.not_trainable, std::vector<std::string>{"pipeline parallel with " + named}) << what;
              }
            }
  EXPECT_GT(refused, 0);
  EXPECT_GT(trained, 0);
}

}  // namespace
