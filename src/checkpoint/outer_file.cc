// The DiLoCo side file (outer_file.h).
#include "checkpoint/outer_file.h"

#include <xxhash.h>

#include <cstring>
#include <fstream>
#include <iterator>

#include "checkpoint/atomic_file.h"
#include "core/error.h"

namespace po::checkpoint {
namespace {

constexpr char kMagic[8] = {'P', 'O', 'D', 'I', 'L', 'O', 'C', 'O'};
constexpr uint32_t kVersion = 1;

template <typename T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);
}

// Reads the file front to back; every read is bounds-checked.
struct Reader {
  std::string_view b;
  size_t at = 0;
  const std::string& what;
  const char* take(size_t n, const char* field) {
    need(n <= b.size() - at, field);
    const char* p = b.data() + at;
    at += n;
    return p;
  }
  template <typename T>
  T get(const char* field) {
    T v;
    std::memcpy(&v, take(sizeof v, field), sizeof v);
    return v;
  }
  void need(bool ok, const char* field) const {
    if (!ok) PO_THROW(core::IoError, what, ": a DiLoCo side file cut short or damaged (at ", field, ")");
  }
};

}  // namespace

const std::vector<float>& OuterFile::array(const std::string& name, const std::string& what) const {
  for (size_t i = 0; i < names.size(); ++i)
    if (names[i] == name) return arrays[i];
  PO_THROW(core::IoError, what, ": holds no ", name);
}

std::string outer_file_bytes(const OuterFile& f) {
  PO_ASSERT(f.names.size() == f.arrays.size(), "outer file: ", f.names.size(), " names for ", f.arrays.size(), " arrays");
  std::string out(kMagic, sizeof kMagic);
  put<uint32_t>(out, kVersion);
  put<uint32_t>(out, static_cast<uint32_t>(f.arrays.size()));
  put<uint32_t>(out, static_cast<uint32_t>(f.steps.size()));
  for (int64_t s : f.steps) put<int64_t>(out, s);
  for (size_t i = 0; i < f.arrays.size(); ++i) {
    put<uint32_t>(out, static_cast<uint32_t>(f.names[i].size()));
    out += f.names[i];
    put<uint64_t>(out, f.arrays[i].size());
    if (!f.arrays[i].empty())
      out.append(reinterpret_cast<const char*>(f.arrays[i].data()), f.arrays[i].size() * sizeof(float));
  }
  put<uint64_t>(out, XXH3_64bits(out.data(), out.size()));
  return out;
}

OuterFile parse_outer_file(std::string_view bytes, const std::string& what) {
  Reader r{bytes, 0, what};
  r.need(bytes.size() >= sizeof kMagic + 8, "the header");
  uint64_t sum;
  std::memcpy(&sum, bytes.data() + bytes.size() - 8, 8);
  r.need(XXH3_64bits(bytes.data(), bytes.size() - 8) == sum, "the checksum");
  r.b = bytes.substr(0, bytes.size() - 8);
  r.need(std::memcmp(r.take(sizeof kMagic, "the magic"), kMagic, sizeof kMagic) == 0, "the magic");
  r.need(r.get<uint32_t>("the version") == kVersion, "the version");
  const uint32_t arrays = r.get<uint32_t>("the array count"), steps = r.get<uint32_t>("the step count");
  r.need(steps <= (r.b.size() - r.at) / 8, "the steps");
  OuterFile f;
  for (uint32_t i = 0; i < steps; ++i) f.steps.push_back(r.get<int64_t>("the steps"));
  for (uint32_t i = 0; i < arrays; ++i) {
    const uint32_t len = r.get<uint32_t>("a name's length");
    f.names.emplace_back(r.take(len, "a name"), len);
    const uint64_t n = r.get<uint64_t>("an array's length");
    r.need(n <= (r.b.size() - r.at) / sizeof(float), "an array");
    std::vector<float> a(static_cast<size_t>(n));
    const char* src = r.take(n * sizeof(float), "an array");
    if (n > 0) std::memcpy(a.data(), src, n * sizeof(float));  // (an empty vector's data() may be null)
    f.arrays.push_back(std::move(a));
  }
  r.need(r.at == r.b.size(), "its end (bytes left over)");
  return f;
}

void write_outer_file(const std::string& path, const OuterFile& f) {
  const std::string bytes = outer_file_bytes(f);
  write_file_atomic(path, bytes.data(), bytes.size());
}

OuterFile read_outer_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) PO_THROW(core::IoError, path, ": cannot read the DiLoCo side file");
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return parse_outer_file(bytes, path);
}

}  // namespace po::checkpoint
