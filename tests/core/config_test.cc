// Config: schema validation, overrides, sizes, errors that name the key.
#include "core/config.h"

#include <gtest/gtest.h>

#include <functional>

#include "core/error.h"

using po::core::Config;

TEST(Config, DefaultsAndFileValues) {
  Config c = Config::parse("[train]\nlr = 0.001\nsteps = 5\n[model]\npreset = \"bench-small\"\n", "t.toml");
  EXPECT_DOUBLE_EQ(c.get_float("train.lr"), 0.001);
  EXPECT_EQ(c.get_int("train.steps"), 5);
  EXPECT_EQ(c.get_string("model.preset"), "bench-small");
  EXPECT_DOUBLE_EQ(c.get_float("train.beta1"), 0.9);
  EXPECT_TRUE(c.is_set("train.lr"));
  EXPECT_FALSE(c.is_set("train.beta1"));
}

TEST(Config, OverridesParseByType) {
  Config c;
  c.set_override("train.lr=3e-4");
  c.set_override("train.steps=7");
  c.set_override("run.dir=/tmp/x");
  c.set_override("memory.host_budget=8GiB");
  c.set_override("train.resume=true");
  EXPECT_DOUBLE_EQ(c.get_float("train.lr"), 3e-4);
  EXPECT_EQ(c.get_int("train.steps"), 7);
  EXPECT_EQ(c.get_string("run.dir"), "/tmp/x");
  EXPECT_EQ(c.get_size("memory.host_budget"), 8ull << 30);
  EXPECT_TRUE(c.get_bool("train.resume"));
}

TEST(Config, UnknownKeyIsNamed) {
  try {
    Config::parse("[train]\nlearning_rate = 1\n", "my.toml");
    FAIL() << "expected an error";
  } catch (const po::core::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("train.learning_rate"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("my.toml"), std::string::npos) << e.what();
  }
  Config c;
  EXPECT_THROW(c.set_override("nope.key=1"), po::core::InvalidArgument);
}

TEST(Config, BadValuesAreNamed) {
  Config c;
  try {
    c.set_override("train.steps=-3");
    FAIL();
  } catch (const po::core::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("train.steps"), std::string::npos) << e.what();
  }
  EXPECT_THROW(c.set_override("train.steps=abc"), po::core::InvalidArgument);
  EXPECT_THROW(c.set_override("train.lr=fast"), po::core::InvalidArgument);
  EXPECT_THROW(c.set_override("memory.page_size=12 parsecs"), po::core::InvalidArgument);
  EXPECT_THROW(Config::parse("[train\n", "broken.toml"), po::core::InvalidArgument);
  EXPECT_THROW(c.set_override("no_equals_sign"), po::core::InvalidArgument);
  // A float where an integer goes, beyond int64's range (libFuzzer's find:
  // toml++ converted it with undefined behaviour before the type was checked).
  try {
    (void)Config::parse("[model]\nn_layer = 6e74\n", "big.toml");
    FAIL() << "n_layer = 6e74 accepted";
  } catch (const po::core::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("model.n_layer must be an integer"), std::string::npos) << e.what();
  }
}

TEST(Config, ResolvedTomlRoundTrips) {
  Config c;
  c.set_override("train.lr=0.00123");
  c.set_override("model.preset=gpt2-124M");
  Config back = Config::parse(c.to_toml(), "resolved");
  EXPECT_DOUBLE_EQ(back.get_float("train.lr"), 0.00123);
  EXPECT_EQ(back.get_string("model.preset"), "gpt2-124M");
  EXPECT_EQ(back.hash(), c.hash());
}

TEST(Config, Sizes) {
  EXPECT_EQ(po::core::parse_size("512MiB", "x"), 512ull << 20);
  EXPECT_EQ(po::core::parse_size("4096", "x"), 4096u);
  EXPECT_EQ(po::core::parse_size("1GB", "x"), 1000000000u);
  EXPECT_THROW(po::core::parse_size("lots", "x"), po::core::InvalidArgument);
}

// A size of 2^64 bytes or more was undefined behaviour (a double cast to
// uint64_t; UBSan via fuzz/cluster_fuzz.cc). It is a one-line error naming the
// key, from a file and from an override alike.
TEST(Config, SizeAbove64BitsIsAnErrorNamingTheKey) {
  const std::string huge = "1111111111111111111111111111111111124GiB";
  auto expect_named = [](const std::function<void()>& f, const std::string& key) {
    try {
      f();
      ADD_FAILURE() << "expected an error naming " << key;
    } catch (const po::core::InvalidArgument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(key), std::string::npos) << what;
      EXPECT_NE(what.find("too large"), std::string::npos) << what;
      EXPECT_EQ(what.find('\n'), std::string::npos) << "not one line: " << what;
    }
  };
  expect_named([&] { Config::parse("[memory]\nhost_budget = \"" + huge + "\"\n", "big.toml"); },
               "big.toml: memory.host_budget");
  Config c;
  expect_named([&] { c.set_override("memory.page_size=" + huge); }, "memory.page_size");
  expect_named([&] { c.set_override("memory.compute_budget=1e300TiB"); }, "memory.compute_budget");
  expect_named([] { po::core::parse_size("16777216TiB", "exactly 2^64"); }, "exactly 2^64");
  EXPECT_EQ(po::core::parse_size("16777215TiB", "x"), 16777215ull << 40);
}
