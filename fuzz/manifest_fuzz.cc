// Fuzzes the sharded-checkpoint manifest parser (checkpoint/manifest.h) and
// the per-rank shard record parser. Bad input may only raise
// po::core::Error. Each input is parsed with its checksum verified and, so
// mutations reach the structural checks behind it, without; an accepted
// manifest must re-serialise to text that parses (checksum verified) back to
// the same manifest.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string_view>

#include "checkpoint/manifest.h"
#include "core/error.h"

using namespace po::checkpoint;

namespace {

bool same_slices(const std::vector<SliceRecord>& a, const std::vector<SliceRecord>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const SliceRecord &x = a[i], &y = b[i];
    if (x.kind != y.kind || x.unit != y.unit || x.rank != y.rank || x.lo != y.lo || x.hi != y.hi ||
        x.file != y.file || x.offset != y.offset || x.xxh3 != y.xxh3)
      return false;
  }
  return true;
}

bool same(const Manifest& a, const Manifest& b) {
  const CheckpointMeta &x = a.meta, &y = b.meta;
  if (x.step != y.step || x.seed != y.seed || x.tokens != y.tokens || x.adam_t != y.adam_t ||
      x.config_toml != y.config_toml || x.dp != y.dp || x.zero_stage != y.zero_stage ||
      x.tensors != y.tensors)
    return false;
  // (b is a re-parse of a as written: the current version whatever a's was.)
  if (b.version != kShardedFormatVersion || a.optimizer != b.optimizer || a.writers != b.writers || a.unit_numel != b.unit_numel ||
      a.chunk_bytes != b.chunk_bytes || a.kinds != b.kinds || a.files.size() != b.files.size())
    return false;
  for (size_t i = 0; i < a.files.size(); ++i)
    if (a.files[i].name != b.files[i].name || a.files[i].rank != b.files[i].rank ||
        a.files[i].bytes != b.files[i].bytes)
      return false;
  return same_slices(a.slices, b.slices);
}

void check(std::string_view text, bool verify) {
  std::optional<Manifest> m;
  try {
    m.emplace(parse_manifest(text, "fuzz", verify));
  } catch (const po::core::Error&) {
    return;
  }
  const std::string again = manifest_to_json(*m);
  if (!same(*m, parse_manifest(again, "roundtrip", true))) std::abort();
}

void check_record(std::string_view text) {
  std::optional<ShardRecord> r;
  try {
    r.emplace(parse_shard_record(text, "fuzz"));
  } catch (const po::core::Error&) {
    return;
  }
  const ShardRecord again = parse_shard_record(shard_record_to_json(*r), "roundtrip");
  if (again.rank != r->rank || again.ranks != r->ranks || again.unit_numel != r->unit_numel ||
      again.kinds != r->kinds || again.chunk_bytes != r->chunk_bytes ||
      again.file.name != r->file.name || again.file.bytes != r->file.bytes ||
      !same_slices(again.slices, r->slices))
    std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  check(text, true);
  check(text, false);
  check_record(text);
  return 0;
}
