// `pagedoptim privacy` (docs/diloco.md): the RDP accountant from the command
// line. The MNIST DP-SGD setting (60000 examples, lots of 256, 60 epochs,
// σ 1.1, δ 1e-5) spends ε = 3.008 by Mironov's conversion and 2.597 by Balle
// et al.'s (TF Privacy's rounding of the steps: ceil(60 / q) = 14063); a
// target ε gives back a σ that spends no more than it; bad input is refused
// in one line naming the option.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "../test_util.h"

namespace {

double number_after(const std::string& text, const std::string& key) {
  const size_t at = text.find(key);
  if (at == std::string::npos) return -1;
  return std::strtod(text.c_str() + at + key.size(), nullptr);
}

TEST(PrivacyCli, EpsilonOfMnistsDpSgdMatchesThePublishedValues) {
  const std::string run = "privacy --dataset 60000 --batch 256 --epochs 60 --noise-multiplier 1.1";
  const auto balle = po::test::run_command(po::test::pagedoptim_command(1, run));
  ASSERT_EQ(balle.exit_code, 0) << balle.output;
  EXPECT_NEAR(number_after(balle.output, "epsilon "), 2.597, 5e-4) << balle.output;
  EXPECT_NE(balle.output.find("14063 steps"), std::string::npos) << balle.output;
  const auto classic = po::test::run_command(po::test::pagedoptim_command(1, run + " --classic"));
  ASSERT_EQ(classic.exit_code, 0) << classic.output;
  EXPECT_NEAR(number_after(classic.output, "epsilon "), 3.008, 5e-4) << classic.output;
}

TEST(PrivacyCli, ATargetEpsilonGivesANoiseThatSpendsNoMore) {
  const auto r = po::test::run_command(po::test::pagedoptim_command(
      1, "privacy --sample-rate 0.01 --steps 5000 --target-epsilon 2"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const double sigma = number_after(r.output, "noise multiplier ");
  ASSERT_GT(sigma, 0) << r.output;
  const auto back = po::test::run_command(po::test::pagedoptim_command(
      1, "privacy --sample-rate 0.01 --steps 5000 --noise-multiplier " + std::to_string(sigma * (1 + 1e-6))));
  ASSERT_EQ(back.exit_code, 0) << back.output;
  const double eps = number_after(back.output, "epsilon ");
  EXPECT_LE(eps, 2.0) << back.output;
  EXPECT_GT(eps, 1.99) << back.output;
}

TEST(PrivacyCli, BadInputIsRefusedNamingTheOption) {
  const std::pair<std::string, std::string> cases[] = {
      {"privacy --steps 10 --noise-multiplier 1", "--sample-rate 0"},
      {"privacy --sample-rate 0.1 --noise-multiplier 1", "give --steps or --epochs"},
      {"privacy --sample-rate 0.1 --steps 10", "give --noise-multiplier"},
      {"privacy --dataset 10 --batch 20 --steps 3 --noise-multiplier 1", "--dataset 10 and --batch 20"},
      {"privacy --sample-rate 0.1 --steps 10 --noise-multiplier 1 --delta 2", "privacy.delta"},
  };
  for (const auto& [args, says] : cases) {
    const auto r = po::test::run_command(po::test::pagedoptim_command(1, args));
    EXPECT_NE(r.exit_code, 0) << args << " was accepted:\n" << r.output;
    EXPECT_NE(r.output.find(says), std::string::npos) << args << ": the error does not name \"" << says << "\":\n"
                                                      << r.output;
  }
}

}  // namespace
