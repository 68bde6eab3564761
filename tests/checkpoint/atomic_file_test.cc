// Atomic replacement: the old file survives any failure and no temp file is left.
#include "checkpoint/atomic_file.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "checkpoint/mapped_file.h"
#include "core/error.h"
#include "test_dir.h"

namespace po::checkpoint {
namespace {

namespace fs = std::filesystem;
using testing::ScratchDir;

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Files in `dir` other than those named.
int entries(const std::string& dir) {
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir)) (void)e, ++n;
  return n;
}

TEST(AtomicFile, WritesAndReplaces) {
  ScratchDir d;
  const std::string p = d.file("a.bin");
  write_file_atomic(p, "hello", 5);
  EXPECT_EQ(slurp(p), "hello");
  write_file_atomic(p, "bye", 3);
  EXPECT_EQ(slurp(p), "bye");
  EXPECT_EQ(entries(d.path()), 1) << "temp file left behind";
}

TEST(AtomicFile, ThrowingFillKeepsOldFileAndRemovesTemp) {
  ScratchDir d;
  const std::string p = d.file("a.bin");
  write_file_atomic(p, "old", 3);
  std::string temp;
  EXPECT_THROW(write_file_atomic(p,
                                 [&](AtomicFile& f) {
                                   temp = f.temp_path();
                                   f.write("new data", 8);
                                   EXPECT_TRUE(fs::exists(temp));
                                   throw std::runtime_error("simulated failure");
                                 }),
               std::runtime_error);
  EXPECT_EQ(slurp(p), "old");
  EXPECT_FALSE(fs::exists(temp)) << temp;
  EXPECT_EQ(entries(d.path()), 1);
}

TEST(AtomicFile, FailedRenameKeepsTargetAndRemovesTemp) {
  // Renaming a file over a non-empty directory fails (EISDIR) even as root:
  // the failure comes after the temp file was written and fsynced.
  ScratchDir d;
  const std::string p = d.file("target");
  fs::create_directories(p + "/inner");
  try {
    write_file_atomic(p, "x", 1);
    FAIL() << "expected IoError";
  } catch (const core::IoError& e) {
    EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("directory"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(fs::is_directory(p + "/inner"));
  EXPECT_EQ(entries(d.path()), 1) << "temp file left behind";
}

TEST(AtomicFile, ParentIsAFileIsIoErrorNamingPath) {
  ScratchDir d;
  write_file_atomic(d.file("plain"), "x", 1);
  const std::string p = d.file("plain/child.bin");
  try {
    write_file_atomic(p, "x", 1);
    FAIL() << "expected IoError";
  } catch (const core::IoError& e) {
    EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("Not a directory"), std::string::npos) << e.what();
  }
  EXPECT_EQ(slurp(d.file("plain")), "x");
}

TEST(AtomicFile, DestroyWithoutCommitDiscards) {
  ScratchDir d;
  std::string temp;
  {
    AtomicFile f(d.file("never"));
    temp = f.temp_path();
    f.write("abc", 3);
    f.write_zeros(5000);
    EXPECT_EQ(f.size(), 5003u);
  }
  EXPECT_FALSE(fs::exists(temp));
  EXPECT_FALSE(fs::exists(d.file("never")));
}

TEST(AtomicFile, ReplaceDirAtomic) {
  ScratchDir d;
  const std::string final_dir = d.file("ckpt");
  fs::create_directories(d.file("stage1"));
  write_file_atomic(d.file("stage1/a"), "1", 1);
  replace_dir_atomic(d.file("stage1"), final_dir);
  EXPECT_EQ(slurp(final_dir + "/a"), "1");
  fs::create_directories(d.file("stage2"));
  write_file_atomic(d.file("stage2/b"), "2", 1);
  replace_dir_atomic(d.file("stage2"), final_dir);
  EXPECT_EQ(slurp(final_dir + "/b"), "2");
  EXPECT_FALSE(fs::exists(final_dir + "/a"));
  EXPECT_FALSE(fs::exists(d.file("stage2")));
  EXPECT_THROW(replace_dir_atomic(d.file("missing"), final_dir), core::IoError);
}

TEST(MappedFile, MissingAndEmpty) {
  ScratchDir d;
  EXPECT_THROW(MappedFile(d.file("nope")), core::IoError);
  write_file_atomic(d.file("empty"), "", 0);
  MappedFile m(d.file("empty"));
  EXPECT_EQ(m.size(), 0u);
  EXPECT_THROW(MappedFile(d.path()), core::IoError);  // a directory
}

TEST(AtomicFile, ParentDir) {
  EXPECT_EQ(parent_dir("a"), ".");
  EXPECT_EQ(parent_dir("/a"), "/");
  EXPECT_EQ(parent_dir("x/y/z"), "x/y");
}

}  // namespace
}  // namespace po::checkpoint
