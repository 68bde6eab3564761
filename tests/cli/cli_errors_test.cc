// Bad input through the real binary: each case must exit non-zero with one
// clear line naming the file or key, never crash, and leave what was already
// written intact.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <vector>

#include "../test_util.h"
#include "checkpoint/safetensors.h"

namespace fs = std::filesystem;
using po::test::run_command;

namespace {

const std::string kBin = PO_BINARY;

// Expects failure with a single "pagedoptim: error:" line containing every needle.
void expect_clean_error(const po::test::CommandResult& r, const std::vector<std::string>& needles) {
  EXPECT_NE(r.exit_code, 0) << "expected failure, output:\n" << r.output;
  EXPECT_LT(r.exit_code, 128) << "crashed (signal " << r.exit_code - 128 << "):\n" << r.output;
  const auto pos = r.output.find("pagedoptim: error: ");
  ASSERT_NE(pos, std::string::npos) << "no error line in:\n" << r.output;
  const std::string line = r.output.substr(pos, r.output.find('\n', pos) - pos);
  for (const auto& n : needles)
    EXPECT_NE(line.find(n), std::string::npos) << "error line lacks '" << n << "': " << line;
  EXPECT_EQ(r.output.find("terminate called"), std::string::npos) << r.output;
}

class CliErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    po::test::write_tokens(train_, 5000, 64);
    po::test::write_tokens(val_, 2000, 64, 3);
    po::test::write_file(config_, po::test::tiny_config(train_, val_, run_, 3));
  }
  std::string train_cmd(const std::string& extra = "") const {
    return kBin + " train -c " + config_ + " " + extra;
  }
  po::test::TempDir dir_;
  std::string train_ = dir_ / "train.bin", val_ = dir_ / "val.bin";
  std::string config_ = dir_ / "c.toml", run_ = dir_ / "run";
};

TEST_F(CliErrors, UnknownConfigKeyIsNamed) {
  expect_clean_error(run_command(train_cmd("--set train.learning_rate=1")),
                     {"train.learning_rate"});
  po::test::write_file(dir_ / "bad.toml", "[train]\nstepz = 3\n");
  expect_clean_error(run_command(kBin + " train -c " + (dir_ / "bad.toml")),
                     {"bad.toml", "train.stepz"});
}

TEST_F(CliErrors, OutOfRangeValueIsNamed) {
  expect_clean_error(run_command(train_cmd("--set train.beta1=1.5")), {"train.beta1"});
  expect_clean_error(run_command(train_cmd("--set model.n_head=3")), {"model.n_head"});
  expect_clean_error(run_command(train_cmd("--set train.micro_batch_size=3")),
                     {"train.micro_batch_size"});
}

TEST_F(CliErrors, TokenFileWithWrongMagic) {
  std::string bytes = po::test::read_file(train_);
  bytes[0] ^= 0x5a;
  po::test::write_file(dir_ / "badmagic.bin", bytes);
  expect_clean_error(run_command(train_cmd("--set data.train=" + (dir_ / "badmagic.bin"))),
                     {"badmagic.bin"});
  EXPECT_FALSE(fs::exists(run_)) << "a failed start must not create the run directory";
}

TEST_F(CliErrors, TokenIdBeyondVocabulary) {
  std::vector<int32_t> t(400, 5);
  t[123] = 60000;
  po::data::write_token_file(dir_ / "big.bin", t);
  expect_clean_error(run_command(train_cmd("--set data.train=" + (dir_ / "big.bin"))),
                     {"big.bin", "60000"});
}

TEST_F(CliErrors, ValidationFileTooSmallFailsBeforeTraining) {
  po::data::write_token_file(dir_ / "tiny_val.bin", std::vector<int32_t>(20, 3));
  expect_clean_error(run_command(train_cmd("--set data.val=" + (dir_ / "tiny_val.bin"))),
                     {"tiny_val.bin"});
  EXPECT_FALSE(fs::exists(run_)) << "a failed start must not create the run directory";
}

TEST_F(CliErrors, MissingCheckpoint) {
  expect_clean_error(run_command(kBin + " export " + (dir_ / "nope.ckpt") + " --out " +
                                 (dir_ / "o.safetensors")),
                     {"nope.ckpt"});
}

TEST_F(CliErrors, CorruptAndTruncatedCheckpointsAreDetected) {
  ASSERT_EQ(run_command(train_cmd()).exit_code, 0);
  const std::string ckpt = run_ + "/checkpoints/step_00000003";
  const std::string good = po::test::read_file(ckpt + "/rank_00000.bin");
  ASSERT_FALSE(good.empty());
  // Copies of the checkpoint with its shard file replaced by `bytes`.
  auto damaged = [&](const std::string& name, const std::string& bytes) {
    const std::string dir = dir_ / name;
    fs::copy(ckpt, dir, fs::copy_options::recursive);
    po::test::write_file(dir + "/rank_00000.bin", bytes);
    return dir;
  };
  std::string flipped = good;
  flipped[4096 + 100] ^= 1;  // inside the first slice (params of unit 0), which export reads
  const std::string export_to = " --out " + (dir_ / "o.safetensors");
  expect_clean_error(run_command(kBin + " export " + damaged("flipped", flipped) + export_to),
                     {"flipped/rank_00000.bin", "checksum mismatch"});
  const std::string short_dir = damaged("short", good.substr(0, good.size() / 2));
  expect_clean_error(run_command(kBin + " export " + short_dir + export_to),
                     {"short/rank_00000.bin", "truncated"});
  const std::string gone = damaged("gone", good);
  fs::remove(gone + "/rank_00000.bin");
  expect_clean_error(run_command(kBin + " export " + gone + export_to),
                     {"gone/rank_00000.bin", "missing"});
  po::test::write_file(damaged("badmanifest", good) + "/manifest.json", "{\"format\": ");
  expect_clean_error(run_command(kBin + " export " + (dir_ / "badmanifest") + export_to),
                     {"badmanifest/manifest.json", "not valid JSON"});
  EXPECT_FALSE(fs::exists(dir_ / "o.safetensors"));
  // Resuming from a corrupt newest checkpoint fails and destroys nothing.
  po::test::write_file(ckpt + "/rank_00000.bin", flipped);
  const std::string metrics = po::test::read_file(run_ + "/metrics.jsonl");
  expect_clean_error(run_command(train_cmd("--resume --set train.steps=5")),
                     {"step_00000003/rank_00000.bin"});
  EXPECT_EQ(po::test::read_file(ckpt + "/rank_00000.bin"), flipped);
  EXPECT_EQ(po::test::read_file(run_ + "/metrics.jsonl"), metrics);
}

TEST_F(CliErrors, CkptInfoPrintsTheManifest) {
  ASSERT_EQ(run_command(train_cmd()).exit_code, 0);
  auto r = run_command(kBin + " ckpt info " + run_);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (const char* needle : {"step_00000003", "step 3,", "written by 1 rank(s)", "wte.weight",
                             "h.1.mlp.c_proj.bias", "rank_00000.bin", "adam_v"})
    EXPECT_NE(r.output.find(needle), std::string::npos) << "lacks '" << needle << "':\n"
                                                         << r.output;
  expect_clean_error(run_command(kBin + " ckpt info " + (dir_ / "nope")), {"nope"});
}

TEST_F(CliErrors, ExistingRunIsNotOverwritten) {
  ASSERT_EQ(run_command(train_cmd()).exit_code, 0);
  const std::string metrics = po::test::read_file(run_ + "/metrics.jsonl");
  expect_clean_error(run_command(train_cmd()), {"run.dir", "--resume"});
  EXPECT_EQ(po::test::read_file(run_ + "/metrics.jsonl"), metrics);
}

TEST_F(CliErrors, SafetensorsInitProblemsAreNamed) {
  ASSERT_EQ(run_command(train_cmd()).exit_code, 0);
  const std::string st = dir_ / "w.safetensors";
  ASSERT_EQ(run_command(kBin + " export " + run_ + " --out " + st).exit_code, 0);
  auto file = po::checkpoint::SafetensorsReader::open(st);
  auto rewrite = [&](const std::string& out, const std::string& drop, bool reshape, bool f16) {
    std::vector<po::checkpoint::StTensorRef> refs;
    std::vector<std::vector<char>> keep;
    for (const auto& name : file.names()) {
      if (name == drop && !reshape && !f16) continue;
      const auto& t = file.get(name);
      keep.emplace_back(reinterpret_cast<const char*>(t.data),
                        reinterpret_cast<const char*>(t.data) + t.nbytes);
      po::checkpoint::StTensorRef r{name, t.dtype, t.shape, keep.back().data()};
      if (name == drop && reshape) r.shape = {t.numel()};
      if (name == drop && f16) {
        r.dtype = po::checkpoint::StDtype::kI32;
      }
      refs.push_back(r);
    }
    po::checkpoint::write_safetensors(out, refs);
  };
  const std::string base = train_cmd("--set model.init=");
  rewrite(dir_ / "missing.safetensors", "h.1.mlp.c_fc.bias", false, false);
  expect_clean_error(run_command(base + (dir_ / "missing.safetensors") + " --set run.dir=" +
                                 (dir_ / "r1")),
                     {"missing.safetensors", "h.1.mlp.c_fc.bias"});
  rewrite(dir_ / "shape.safetensors", "h.0.attn.c_attn.weight", true, false);
  expect_clean_error(run_command(base + (dir_ / "shape.safetensors") + " --set run.dir=" +
                                 (dir_ / "r2")),
                     {"shape.safetensors", "h.0.attn.c_attn.weight"});
  rewrite(dir_ / "dtype.safetensors", "wte.weight", false, true);
  expect_clean_error(run_command(base + (dir_ / "dtype.safetensors") + " --set run.dir=" +
                                 (dir_ / "r3")),
                     {"dtype.safetensors", "wte.weight"});
}

TEST_F(CliErrors, NonUtf8TextForPrepare) {
  po::test::write_file(dir_ / "latin1.txt", "caf\xe9 au lait\n");
  expect_clean_error(run_command(kBin + " prepare --input " + (dir_ / "latin1.txt") + " --out " +
                                 (dir_ / "prep")),
                     {"latin1.txt"});
}

TEST_F(CliErrors, ExportAndInitRoundTripThroughSafetensors) {
  ASSERT_EQ(run_command(train_cmd()).exit_code, 0);
  const std::string st = dir_ / "w.safetensors";
  ASSERT_EQ(run_command(kBin + " export " + run_ + " --out " + st).exit_code, 0);
  // Training 0 further steps from the exported weights and exporting again gives the same bytes.
  auto r = run_command(train_cmd("--set model.init=" + st + " --set run.dir=" + (dir_ / "r2") +
                                 " --set train.steps=1 --set train.lr=0 --set train.min_lr=0 "
                                 "--set train.weight_decay=0"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_EQ(run_command(kBin + " export " + (dir_ / "r2") + " --out " + (dir_ / "w2.safetensors"))
                .exit_code,
            0);
  EXPECT_TRUE(po::test::read_file(st) == po::test::read_file(dir_ / "w2.safetensors"))
      << "export -> model.init -> export changed the weights";
}

}  // namespace

namespace {

TEST_F(CliErrors, GenerateIsDeterministicPerSeed) {
  ASSERT_EQ(run_command(train_cmd()).exit_code, 0);
  // "A" is GPT-2 token 32, inside the tiny model's 64-token vocabulary.
  const std::string gen = kBin + " generate " + run_ + " --prompt A --max-new-tokens 12 --top-k 8";
  auto a = run_command(gen + " --seed 5"), b = run_command(gen + " --seed 5");
  ASSERT_EQ(a.exit_code, 0) << a.output;
  // The text (stderr's timing line after it differs run to run).
  const auto text = [](const std::string& out) { return out.substr(0, out.find("\nprefill: ")); };
  EXPECT_NE(a.output.find("\nprefill: "), std::string::npos) << "no timing line: " << a.output;
  EXPECT_EQ(text(a.output), text(b.output)) << "same seed, different text";
  EXPECT_EQ(a.output.rfind("A", 0), 0u) << "output should start with the prompt: " << a.output;
  auto greedy = run_command(gen + " --temperature 0");
  ASSERT_EQ(greedy.exit_code, 0) << greedy.output;
  expect_clean_error(run_command(kBin + " generate " + run_ + " --prompt 'The jury'"),
                     {"vocabulary"});
}

}  // namespace
