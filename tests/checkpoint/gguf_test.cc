// GGUF files (checkpoint/gguf.h) against references written outside this
// code: tests/golden/gguf/blocks.gguf, written by tools/gguf/gguf_np.py (a
// numpy writer following ggml's docs/gguf.md and ggml-common.h's block
// structs), holds one tensor per type (F32, F16, BF16, Q8_0, Q4_0, Q4_K,
// Q6_K; normal, outlier, zero and tie rows, and random K-quant bytes), and
// blocks_ref.safetensors the numpy decoding of each. Shown here:
//   - every tensor decodes to numpy's values bit for bit;
//   - Q8_0 and Q4_0 encode the f32 sources to the numpy port of ggml's
//     reference quantizers byte for byte, ties included;
//   - the metadata and tensor table agree with npm's @huggingface/gguf parser
//     (tools/gguf/gguf_meta.mjs), every value type included;
//   - write_gguf's files read back (metadata, tensors, alignment) and parse
//     with @huggingface/gguf too;
//   - truncated files, lying offsets, unknown types and malformed metadata
//     are one-line errors naming the file and the tensor or key.
// Missing node or the npm package is a failure, never a skip.
#include "checkpoint/gguf.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../test_util.h"
#include "backend/block_formats.h"
#include "checkpoint/safetensors.h"

namespace po::checkpoint {
namespace {

using backend::GgmlType;
using nlohmann::json;

const std::string kDir = std::string(PO_SOURCE_DIR) + "/tests/golden/gguf/";

std::vector<float> decoded(const GgufFile& f, const std::string& name) {
  const GgufTensorInfo* t = f.find_tensor(name);
  EXPECT_NE(t, nullptr) << name;
  if (t == nullptr) return {};
  std::vector<float> v(static_cast<size_t>(t->numel));
  f.read_f32(*t, v.data());
  return v;
}

// "" when a and b are equal bit for bit, else the first difference.
std::string first_difference(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return "sizes " + std::to_string(a.size()) + " and " + std::to_string(b.size());
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], 4) != 0)
      return "element " + std::to_string(i) + ": " + std::to_string(a[i]) + " vs " + std::to_string(b[i]);
  return "";
}

TEST(Gguf, EveryTypeDecodesToTheNumpyReferenceBitForBit) {
  const GgufFile f = GgufFile::open(kDir + "blocks.gguf");
  const auto ref = SafetensorsReader::open(kDir + "blocks_ref.safetensors");
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 64u);
  int checked = 0;
  for (const GgufTensorInfo& t : f.tensors()) {
    SCOPED_TRACE(t.name + " (" + std::string(backend::ggml_type_name(t.type)) + ")");
    ASSERT_TRUE(ref.has(t.name));
    EXPECT_EQ(ref.get(t.name).shape, t.shape());
    EXPECT_EQ(first_difference(decoded(f, t.name), ref.read_f32(t.name, t.shape())), "");
    ++checked;
  }
  for (const char* name : {"t.f32", "t.f16", "t.bf16", "t.q8_0", "t.q4_0", "t.q4_k", "t.q6_k", "raw.q4_k", "raw.q6_k"})
    EXPECT_NE(f.find_tensor(name), nullptr) << name;
  EXPECT_GE(checked, 9);
}

TEST(Gguf, Q8AndQ4EncodeAsGgmlsReferenceQuantizers) {
  const GgufFile f = GgufFile::open(kDir + "blocks.gguf");
  const auto ref = SafetensorsReader::open(kDir + "blocks_ref.safetensors");
  for (const char* name : {"t.q8_0", "t.q4_0", "t.f16", "t.bf16"}) {
    SCOPED_TRACE(name);
    const GgufTensorInfo& t = *f.find_tensor(name);
    const std::vector<float> src = ref.read_f32(std::string("src.") + name, t.shape());
    std::vector<char> ours(static_cast<size_t>(t.bytes));
    backend::ggml_quantize(t.type, src.data(), ours.data(), t.numel);
    const char* theirs = reinterpret_cast<const char*>(f.tensor_data(t));
    size_t first = ours.size();
    for (size_t i = 0; i < ours.size() && first == ours.size(); ++i)
      if (ours[i] != theirs[i]) first = i;
    EXPECT_EQ(first, ours.size()) << "first differing byte " << first << " (block "
                                  << first / static_cast<size_t>(backend::ggml_block_bytes(t.type)) << ")";
  }
}

// What @huggingface/gguf (npm) reads from `path`.
json npm_gguf(const std::string& path) {
  const auto r = test::run_command("cd " + std::string(PO_SOURCE_DIR) + " && node tools/gguf/gguf_meta.mjs " + path);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  try {
    return json::parse(r.output);
  } catch (const json::exception& e) {
    ADD_FAILURE() << "gguf_meta.mjs printed no JSON: " << e.what() << "\n" << r.output.substr(0, 2000);
    return json::object();
  }
}

// Our value in the JSON form gguf_meta.mjs prints (64-bit integers as
// decimal strings, floats as numbers).
json as_npm(const GgufValue& v) {
  const auto one = [](GgufType t, const json& x) -> json {
    if (t == GgufType::kU64 || t == GgufType::kI64) return x.dump();
    return x;
  };
  if (v.type != GgufType::kArray) return one(v.type, v.value);
  json a = json::array();
  for (const json& x : v.value) a.push_back(one(v.elem, x));
  return a;
}

void expect_agrees_with_npm(const GgufFile& f) {
  const json npm = npm_gguf(f.origin());
  ASSERT_TRUE(npm.contains("metadata")) << npm.dump().substr(0, 500);
  EXPECT_EQ(npm["metadata"].size(), f.metadata().size());
  for (const auto& [key, v] : f.metadata()) {
    SCOPED_TRACE(key);
    ASSERT_TRUE(npm["metadata"].contains(key));
    const json ours = as_npm(v), theirs = npm["metadata"][key];
    if (v.type == GgufType::kF32 || v.type == GgufType::kF64 ||
        (v.type == GgufType::kArray && (v.elem == GgufType::kF32 || v.elem == GgufType::kF64))) {
      // Both are the stored float widened to a double (JSON may print 10000.0 as 10000).
      const json a = ours.is_array() ? ours : json::array({ours}), b = theirs.is_array() ? theirs : json::array({theirs});
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].get<double>(), b[i].get<double>()) << "element " << i;
    } else {
      EXPECT_EQ(ours, theirs);
    }
  }
  ASSERT_EQ(npm["tensors"].size(), f.tensors().size());
  for (size_t i = 0; i < f.tensors().size(); ++i) {
    const GgufTensorInfo& t = f.tensors()[i];
    const json& n = npm["tensors"][i];
    SCOPED_TRACE(t.name);
    EXPECT_EQ(n["name"], t.name);
    EXPECT_EQ(n["dtype"], static_cast<uint32_t>(t.type));
    EXPECT_EQ(n["offset"].is_string() ? std::stoull(n["offset"].get<std::string>()) : n["offset"].get<uint64_t>(),
              t.offset);
    std::vector<int64_t> ne;
    for (const json& d : n["shape"]) ne.push_back(d.is_string() ? std::stoll(d.get<std::string>()) : d.get<int64_t>());
    EXPECT_EQ(ne, t.ne);
  }
}

TEST(Gguf, MetadataAgreesWithHuggingFacesParser) {
  const GgufFile f = GgufFile::open(kDir + "blocks.gguf");
  for (const char* key : {"test.u8", "test.i8", "test.u16", "test.i16", "test.u32", "test.i32", "test.f32",
                          "test.bool", "test.str", "test.u64", "test.i64", "test.f64", "test.arr_u32",
                          "test.arr_f32", "test.arr_str", "test.arr_i8", "test.arr_empty"})
    EXPECT_NE(f.find(key), nullptr) << key;
  EXPECT_EQ(f.get_string("general.architecture"), "blocks-test");
  EXPECT_LT(f.get_int("test.i64"), 0);
  EXPECT_GT(f.find("test.u64")->value.get<uint64_t>(), uint64_t{1} << 53);
  expect_agrees_with_npm(f);
}

TEST(Gguf, WrittenFilesReadBackAndParseElsewhere) {
  test::TempDir dir;
  std::vector<float> w(4 * 64), v(5);
  for (size_t i = 0; i < w.size(); ++i) w[i] = std::sin(0.37f * static_cast<float>(i)) * 0.1f;
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i) - 2.5f;
  const GgufMetadata kv = {{"general.architecture", GgufValue::str("x")},
                           {"x.flag", GgufValue::boolean(true)},
                           {"x.big", GgufValue::of(GgufType::kU64, uint64_t{1} << 60)},
                           {"x.neg", GgufValue::of(GgufType::kI16, -7)},
                           {"x.eps", GgufValue::f32(1e-5f)},
                           {"x.names", GgufValue::array(GgufType::kString, json::array({"a", "ü", ""}))}};
  for (uint32_t alignment : {32u, 128u}) {
    SCOPED_TRACE(alignment);
    const std::string path = dir / ("w" + std::to_string(alignment) + ".gguf");
    write_gguf(path, kv,
               {{"w.f32", {64, 4}, GgmlType::kF32, [&](float* d) { std::copy(w.begin(), w.end(), d); }},
                {"w.q8", {64, 4}, GgmlType::kQ8_0, [&](float* d) { std::copy(w.begin(), w.end(), d); }},
                {"w.q4", {64, 4}, GgmlType::kQ4_0, [&](float* d) { std::copy(w.begin(), w.end(), d); }},
                {"v", {5}, GgmlType::kF32, [&](float* d) { std::copy(v.begin(), v.end(), d); }}},
               alignment);
    const GgufFile f = GgufFile::open(path);
    EXPECT_EQ(f.alignment(), alignment);
    EXPECT_EQ(f.metadata().size(), kv.size() + (alignment == 32 ? 0 : 1));
    EXPECT_EQ(f.find("x.big")->value.get<uint64_t>(), uint64_t{1} << 60);
    EXPECT_EQ(f.get_int("x.neg"), -7);
    EXPECT_EQ(static_cast<float>(f.get_float("x.eps")), 1e-5f);
    EXPECT_EQ(f.get_array("x.names", GgufType::kString)[1], "ü");
    EXPECT_EQ(first_difference(decoded(f, "w.f32"), w), "");
    EXPECT_EQ(first_difference(decoded(f, "v"), v), "");
    EXPECT_EQ(f.find_tensor("w.q8")->shape(), (tensor::Shape{4, 64}));
    // Q8_0 within half a step (amax/127) of each value; Q4_0 within one step
    // (amax/8): the side opposite the block's extreme clamps at code 15 = +7 steps.
    for (const char* q : {"w.q8", "w.q4"}) {
      const std::vector<float> got = decoded(f, q);
      const float bound = std::string(q) == "w.q8" ? 0.1f / 127 * 0.51f : 0.1f / 8 * 1.01f;
      for (size_t i = 0; i < w.size(); ++i) EXPECT_LE(std::fabs(got[i] - w[i]), bound) << q << " " << i;
    }
    expect_agrees_with_npm(f);
  }
}

// A minimal GGUF built byte by byte (independent of write_gguf): one string
// key, one tensor "w" of ne {ne0, 2} of ggml type `type` at `offset`, then
// `data_bytes` bytes of data.
struct Builder {
  std::string out;
  template <typename T>
  void put(T v) {
    out.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  void str(const std::string& s) {
    put<uint64_t>(s.size());
    out += s;
  }
};

std::string tiny_gguf(uint32_t type, uint64_t ne0, uint64_t offset, size_t data_bytes, uint32_t n_dims = 2) {
  Builder b;
  b.out = "GGUF";
  b.put<uint32_t>(3);
  b.put<uint64_t>(1);
  b.put<uint64_t>(1);
  b.str("general.architecture");
  b.put<uint32_t>(8);
  b.str("x");
  b.str("w");
  b.put<uint32_t>(n_dims);
  b.put<uint64_t>(ne0);
  for (uint32_t d = 1; d < n_dims; ++d) b.put<uint64_t>(2);
  b.put<uint32_t>(type);
  b.put<uint64_t>(offset);
  b.out.resize((b.out.size() + 31) / 32 * 32, '\0');
  b.out.append(data_bytes, '\0');
  return b.out;
}

// A header with one key of value type `vtype` followed by `value` bytes.
std::string one_key(const std::string& key, uint32_t vtype, const std::string& value, uint64_t n_kv = 1) {
  Builder b;
  b.out = "GGUF";
  b.put<uint32_t>(3);
  b.put<uint64_t>(0);
  b.put<uint64_t>(n_kv);
  b.str(key);
  b.put<uint32_t>(vtype);
  b.out += value;
  return b.out;
}

std::string error_for(const std::string& bytes) {
  return test::error_of([&] { GgufFile::from_bytes(bytes.data(), bytes.size(), "bad.gguf"); });
}

TEST(Gguf, BadFilesAreOneLineErrorsNamingTheTensorOrKey) {
  // A good one parses: F32 [32, 2] at offset 0.
  EXPECT_EQ(error_for(tiny_gguf(0, 32, 0, 256)), "");
  Builder u64_7, arr;
  u64_7.put<uint64_t>(7);
  arr.put<uint32_t>(9);  // an array of arrays
  arr.put<uint64_t>(1);
  struct Case {
    std::string bytes, expect;
  } cases[] = {
      {"GGML1234", "not a GGUF file"},
      {tiny_gguf(0, 32, 0, 256).substr(0, 6), "truncated in the version"},
      {tiny_gguf(0, 32, 0, 255), "tensor 'w' (F32, 256 bytes) at data offset 0 runs past the end of the file"},
      {tiny_gguf(0, 32, 64, 256), "tensor 'w' (F32, 256 bytes) at data offset 64 runs past the end"},
      {tiny_gguf(0, 32, 3, 256), "tensor 'w' has offset 3, not a multiple of the alignment 32"},
      {tiny_gguf(23, 32, 0, 256), "tensor 'w' is stored as IQ4_XS (ggml type 23), which is not read"},
      {tiny_gguf(99, 32, 0, 256), "tensor 'w' is stored as type 99 (ggml type 99)"},
      {tiny_gguf(8, 33, 0, 256), "tensor 'w' is Q8_0 with rows of 33 elements, not a whole number of its 32-element blocks"},
      {tiny_gguf(0, 32, 0, 256, 5), "tensor 'w' has 5 dimensions"},
      {tiny_gguf(0, 0, 0, 256), "tensor 'w' has dimension 0 = 0"},
      {one_key("k", 13, ""), "metadata 'k' has unknown value type 13"},
      {one_key("k", 7, "\x02"), "metadata 'k': a bool of value 2"},
      {one_key("k", 9, arr.out), "metadata 'k': an array of arrays"},
      {one_key("k", 8, u64_7.out + "abc"), "metadata 'k': a string of 7 bytes but 3 bytes are left"},
      {one_key("k", 4, "\x01\x02"), "truncated in metadata 'k'"},
      {one_key("k", 4, std::string("\x01\x00\x00\x00", 4), 1000000), "1000000 metadata entries cannot fit"},
  };
  for (const Case& c : cases) {
    const std::string e = error_for(c.bytes);
    EXPECT_NE(e.find("bad.gguf: "), std::string::npos) << e;
    EXPECT_NE(e.find(c.expect), std::string::npos) << "expected '" << c.expect << "' in: " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
  // Two tensors whose bytes overlap.
  {
    Builder b;
    b.out = "GGUF";
    b.put<uint32_t>(3);
    b.put<uint64_t>(2);
    b.put<uint64_t>(0);
    for (const char* name : {"a", "b"}) {
      b.str(name);
      b.put<uint32_t>(1);
      b.put<uint64_t>(16);
      b.put<uint32_t>(0);
      b.put<uint64_t>(name[0] == 'a' ? 0 : 32);
    }
    b.out.resize((b.out.size() + 31) / 32 * 32, '\0');
    b.out.append(128, '\0');
    EXPECT_NE(error_for(b.out).find("tensor 'b' at data offset 32 overlaps tensor 'a' (bytes 0 to 64)"),
              std::string::npos)
        << error_for(b.out);
  }
  // A cut real file names the tensor whose bytes are missing.
  const std::string whole = test::read_file(kDir + "blocks.gguf");
  const GgufFile f = GgufFile::from_bytes(whole.data(), whole.size(), "blocks.gguf");
  const GgufTensorInfo* last = &f.tensors().front();
  for (const GgufTensorInfo& t : f.tensors())
    if (t.offset > last->offset) last = &t;
  const std::string cut = whole.substr(0, f.data_start() + last->offset + static_cast<size_t>(last->bytes) - 1);
  const std::string e = error_for(cut);
  EXPECT_NE(e.find("tensor '" + last->name + "'"), std::string::npos) << e;
  EXPECT_NE(e.find("truncated or the offset is wrong"), std::string::npos) << e;
}

}  // namespace
}  // namespace po::checkpoint
