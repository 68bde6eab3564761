// Safetensors: round trip of every dtype, and every malformed input rejected
// with a message naming the file and the tensor.
#include "checkpoint/safetensors.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>

#include "core/error.h"
#include "test_dir.h"

namespace po::checkpoint {
namespace {

using testing::ScratchDir;

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// A file image from a header text and a buffer.
std::string image(const std::string& header, const std::string& buffer) {
  return le64(header.size()) + header + buffer;
}

// The InvalidArgument message from parsing `bytes` as "mem.safetensors".
std::string parse_error(const std::string& bytes) {
  try {
    SafetensorsReader::from_bytes(bytes.data(), bytes.size(), "mem.safetensors");
  } catch (const core::InvalidArgument& e) {
    return e.what();
  }
  return "<no error>";
}

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << (haystack)

TEST(Safetensors, RoundTripAllDtypes) {
  ScratchDir d;
  const std::vector<StDtype> all = {
      StDtype::kBool, StDtype::kU8,  StDtype::kI8,  StDtype::kF8E5M2, StDtype::kF8E4M3,
      StDtype::kI16,  StDtype::kU16, StDtype::kF16, StDtype::kBF16,   StDtype::kI32,
      StDtype::kU32,  StDtype::kF32, StDtype::kF64, StDtype::kI64,    StDtype::kU64};
  std::vector<std::vector<uint8_t>> bufs;
  std::vector<StTensorRef> refs;
  for (size_t i = 0; i < all.size(); ++i) {
    tensor::Shape shape = {2, static_cast<int64_t>(i + 1)};
    std::vector<uint8_t> b(2 * (i + 1) * st_dtype_size(all[i]));
    std::iota(b.begin(), b.end(), static_cast<uint8_t>(i * 7));
    bufs.push_back(std::move(b));
    refs.push_back({std::string("t.") + st_dtype_name(all[i]), all[i], shape, bufs.back().data()});
  }
  refs.push_back({"scalar", StDtype::kF32, {}, bufs[11].data()});
  refs.push_back({"empty", StDtype::kF32, {0, 3}, nullptr});
  const std::string p = d.file("m.safetensors");
  write_safetensors(p, refs, {{"format", "pt"}, {"note", "hi"}});

  SafetensorsReader r = SafetensorsReader::open(p);
  EXPECT_EQ(r.names().size(), refs.size());
  EXPECT_EQ(r.metadata().at("format"), "pt");
  EXPECT_EQ(r.metadata().at("note"), "hi");
  for (size_t i = 0; i < refs.size(); ++i) {
    EXPECT_EQ(r.names()[i], refs[i].name) << "data not laid out in the given order";
    const StTensor& t = r.require(refs[i].name, refs[i].dtype, refs[i].shape);
    size_t n = static_cast<size_t>(t.numel()) * st_dtype_size(t.dtype);
    ASSERT_EQ(t.nbytes, n);
    if (n > 0) {
      EXPECT_EQ(std::memcmp(t.data, refs[i].data, n), 0) << refs[i].name;
    }
  }
  EXPECT_EQ(SafetensorsReader::open(p).get("scalar").shape, tensor::Shape{});
  // Our writer aligns the data buffer to 8 bytes.
  std::string bytes = serialize_safetensors(refs);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
}

TEST(Safetensors, ReadF32ConvertsHalfTypes) {
  const float f32[3] = {1.5f, -2.0f, 0.0f};
  const uint16_t f16[3] = {0x3e00, 0xc000, 0x0001};  // 1.5, -2, smallest subnormal
  const uint16_t bf16[3] = {0x3fc0, 0xc000, 0x7f80};  // 1.5, -2, inf
  std::string img = serialize_safetensors({{"a", StDtype::kF32, {3}, f32},
                                           {"b", StDtype::kF16, {3}, f16},
                                           {"c", StDtype::kBF16, {3}, bf16},
                                           {"d", StDtype::kI32, {3}, f32}});
  auto r = SafetensorsReader::from_bytes(img.data(), img.size(), "x");
  EXPECT_EQ(r.read_f32("a", {3}), (std::vector<float>{1.5f, -2.0f, 0.0f}));
  auto b = r.read_f32("b", {3});
  EXPECT_EQ(b[0], 1.5f);
  EXPECT_EQ(b[1], -2.0f);
  EXPECT_EQ(b[2], 5.9604645e-08f);
  auto c = r.read_f32("c", {3});
  EXPECT_EQ(c[0], 1.5f);
  EXPECT_TRUE(std::isinf(c[2]));
  try {
    r.read_f32("d", {3});
    FAIL();
  } catch (const core::InvalidArgument& e) {
    EXPECT_HAS(e.what(), "x: tensor 'd' has dtype I32, expected F32");
  }
}

TEST(Safetensors, RequireMessages) {
  std::vector<float> w(64 * 192);
  std::string img =
      serialize_safetensors({{"h.0.attn.c_attn.weight", StDtype::kF32, {64, 192}, w.data()}});
  auto r = SafetensorsReader::from_bytes(img.data(), img.size(), "gpt2.safetensors");
  auto msg = [&](auto fn) {
    try {
      fn();
    } catch (const core::InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("<no error>");
  };
  EXPECT_HAS(msg([&] { r.require("h.0.attn.c_attn.weight", StDtype::kF32, {64, 193}); }),
             "gpt2.safetensors: tensor 'h.0.attn.c_attn.weight' has shape [64, 192], expected [64, 193]");
  EXPECT_HAS(msg([&] { r.require("x", StDtype::kF32, {1}); }),
             "gpt2.safetensors: missing tensor 'x'");
  EXPECT_HAS(msg([&] { r.require("h.0.attn.c_attn.weight", StDtype::kF16, {64, 192}); }),
             "has dtype F32, expected F16");
  EXPECT_HAS(msg([&] { r.read_f32("h.0.attn.c_attn.weight", {192, 64}); }),
             "has shape [64, 192], expected [192, 64]");
  EXPECT_TRUE(r.has("h.0.attn.c_attn.weight"));
  EXPECT_EQ(r.find("nope"), nullptr);
}

TEST(Safetensors, RejectsMalformedFiles) {
  const std::string ok = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  EXPECT_EQ(parse_error(image(ok, std::string(8, 'x'))), "<no error>");

  EXPECT_HAS(parse_error("abc"), "mem.safetensors: not a safetensors file: 3 bytes");
  EXPECT_HAS(parse_error(le64(100) + "{}"), "mem.safetensors: header length 100 exceeds the file");
  EXPECT_HAS(parse_error(le64(~0ull) + "{}"), "header length");
  EXPECT_HAS(parse_error(image("{nope", "")), "mem.safetensors: header is not valid JSON");
  EXPECT_HAS(parse_error(image("[1,2]", "")), "mem.safetensors: header is not a JSON object");
  EXPECT_HAS(parse_error(image(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", std::string(8, 'x'))),
             "mem.safetensors: tensor 'a': missing \"dtype\"");
  EXPECT_HAS(parse_error(image(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", std::string(8, 'x'))),
             "tensor 'a': missing \"shape\"");
  EXPECT_HAS(parse_error(image(R"({"a":{"dtype":"F32","shape":[2]}})", std::string(8, 'x'))),
             "tensor 'a': missing \"data_offsets\"");
  EXPECT_HAS(parse_error(image(R"({"a":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})",
                               std::string(8, 'x'))),
             "tensor 'a': unknown dtype \"F33\"");
  EXPECT_HAS(parse_error(image(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})",
                               std::string(8, 'x'))),
             "tensor 'a': \"shape\" has an entry that is not a non-negative integer");
  EXPECT_HAS(parse_error(image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})",
                               std::string(8, 'x'))),
             "tensor 'a': data_offsets [0, 16] out of range");
  EXPECT_HAS(parse_error(image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})",
                               std::string(8, 'x'))),
             "tensor 'a': data_offsets [8, 0] has begin > end");
  EXPECT_HAS(parse_error(image(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})",
                               std::string(8, 'x'))),
             "tensor 'a': F32 [3] needs 12 bytes but data_offsets [0, 8] hold 8");
  EXPECT_HAS(parse_error(image(R"({"a":{"dtype":"F32","shape":[4611686018427387904, 8],"data_offsets":[0,8]}})",
                               std::string(8, 'x'))),
             "tensor 'a': shape [4611686018427387904, 8] overflows");
  EXPECT_HAS(parse_error(image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                               R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                               std::string(12, 'x'))),
             "mem.safetensors: tensor 'b' [4, 12) overlaps tensor 'a'");
  EXPECT_HAS(parse_error(image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                               std::string(12, 'x'))),
             "data buffer bytes [0, 4) are not covered by any tensor (gap before tensor 'a')");
  EXPECT_HAS(parse_error(image(ok, std::string(12, 'x'))),
             "mem.safetensors: data buffer has 12 bytes but the tensors cover only 8");
  EXPECT_HAS(parse_error(image(R"({"__metadata__":{"k":1}})", "")),
             "\"__metadata__\" value for 'k' is not a string");
  EXPECT_HAS(parse_error(image(R"({"__metadata__":[]})", "")), "\"__metadata__\" is not a JSON object");
  EXPECT_HAS(parse_error(image(R"({"a":[1]})", "")), "tensor 'a': entry is not a JSON object");
  EXPECT_HAS(parse_error(image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})",
                               std::string(8, 'x'))),
             "\"data_offsets\" is not a pair");
}

TEST(Safetensors, FileErrorsNameThePath) {
  ScratchDir d;
  const std::string p = d.file("bad.safetensors");
  std::ofstream(p, std::ios::binary) << "1234";
  try {
    SafetensorsReader::open(p);
    FAIL();
  } catch (const core::InvalidArgument& e) {
    EXPECT_HAS(e.what(), p + ": not a safetensors file");
  }
  EXPECT_THROW(SafetensorsReader::open(d.file("missing.safetensors")), core::IoError);
}

TEST(Safetensors, WriterRejectsBadInput) {
  float x = 0;
  EXPECT_THROW(serialize_safetensors({{"a", StDtype::kF32, {1}, &x}, {"a", StDtype::kF32, {1}, &x}}),
               core::InvalidArgument);
  EXPECT_THROW(serialize_safetensors({{"", StDtype::kF32, {1}, &x}}), core::InvalidArgument);
  EXPECT_THROW(serialize_safetensors({{"__metadata__", StDtype::kF32, {1}, &x}}),
               core::InvalidArgument);
  EXPECT_THROW(serialize_safetensors({{"a", StDtype::kF32, {-1}, &x}}), core::InvalidArgument);
  EXPECT_THROW(serialize_safetensors({{"\xff", StDtype::kF32, {1}, &x}}), core::InvalidArgument);
}

TEST(Safetensors, DtypeMapping) {
  for (auto d : {tensor::DType::kF32, tensor::DType::kBF16, tensor::DType::kF16,
                 tensor::DType::kI32, tensor::DType::kU16}) {
    EXPECT_EQ(st_to_dtype(st_from_dtype(d)), d);
    EXPECT_EQ(st_dtype_size(st_from_dtype(d)), tensor::dtype_size(d));
  }
  EXPECT_EQ(st_to_dtype(StDtype::kI64), std::nullopt);
  EXPECT_EQ(st_dtype_parse("BF16"), StDtype::kBF16);
  EXPECT_EQ(st_dtype_parse("bf16"), std::nullopt);
}

}  // namespace
}  // namespace po::checkpoint
