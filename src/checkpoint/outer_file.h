// The DiLoCo side file (train/outer_sync.h; docs/diloco.md): what a
// checkpoint of a run with train.local_steps holds besides the model's
// state: per rank, named float arrays (the outer state of its slice; on
// replicas other than 0 that replica's parameters, Adam m and v of the
// slice) and the outer steps each fragment has taken.
//
// Bytes, little-endian: "PODILOCO", u32 version (1), u32 arrays, u32 steps,
// steps × i64, then per array u32 name length, the name, u64 elements and
// the elements as f32; then the XXH3-64 of everything before it. A file
// that is not exactly this is refused naming it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace po::checkpoint {

struct OuterFile {
  std::vector<std::string> names;
  std::vector<std::vector<float>> arrays;  // one per name
  std::vector<int64_t> steps;
  const std::vector<float>& array(const std::string& name, const std::string& what) const;
};

std::string outer_file_bytes(const OuterFile& f);
// Throws core::IoError naming `what` on anything but a whole, intact file.
OuterFile parse_outer_file(std::string_view bytes, const std::string& what);
void write_outer_file(const std::string& path, const OuterFile& f);  // atomically
OuterFile read_outer_file(const std::string& path);

}  // namespace po::checkpoint
