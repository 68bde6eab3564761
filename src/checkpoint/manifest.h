// The manifest of a sharded checkpoint (checkpoint/sharded.h): what a
// checkpoint directory holds and where each piece lives, as one JSON file,
// `manifest.json`. This header is the data model and its JSON form only (no
// file I/O, no layout), so parsers of untrusted bytes (fuzz/manifest_fuzz.cc)
// can use it alone.
//
// The state of a model is one flat buffer per unit (model/transformer.h) for
// each state kind: the parameters ("params", fp32: a bf16 run's master) and
// each checkpointed field of the optimizer's state schema (optim/state_schema.h:
// AdamW's "adam_m", "adam_v"). Version 2 records every kind by its schema
// field — name, dtype, bits and block scale — and the schema's name
// ("optimizer"), so a slice's bytes follow from its kind and a checkpoint of
// another state form is named, not misread. Version 1 (kinds as bare names,
// all fp32 AdamW) is still read, into the same model. A slice is a contiguous element
// range [lo, hi) of one unit of one kind, written by one rank to one file at a
// byte offset; its bytes are checksummed in chunks of `chunk_bytes` counted
// from the slice start (the last chunk may be short), so a reader that needs
// only part of a slice (resharding) reads and verifies only the chunks it
// touches.
//
// Invariants validate_manifest() enforces (and parse_manifest() therefore
// guarantees): for every kind listed, the slices of each unit tile [0, n_u)
// exactly; every slice lies inside its file's byte count, starts on a
// kShardAlign boundary past the file header and has one checksum per chunk;
// slices of one file do not overlap; tensors lie inside their unit and do
// not overlap; file names are plain names (no path), one per writer rank.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "optim/state_schema.h"

namespace po::checkpoint {

using optim::StateKind;  // params and the optimizer's checkpointed fields (optim/state_schema.h)
using optim::kAllStateKinds;
using optim::state_kind_field;
const char* state_kind_name(StateKind k);
std::optional<StateKind> parse_state_kind(std::string_view name);
// The optimizer whose state the kinds other than params are ("adamw").
inline constexpr std::string_view kOptimizerSchema = "adamw";

// Written: version 2. Read: 1 and 2.
inline constexpr int kShardedFormatVersion = 2;
inline constexpr int kOldestShardedFormatVersion = 1;
inline constexpr const char* kShardedFormatName = "pagedoptim-sharded-checkpoint";
// Default checksum chunk: 4 MiB (XXH3 hashes it in ~0.15 ms; a gpt2-1.5B
// checkpoint has ~4500 chunks, ~100 KB of manifest).
inline constexpr int64_t kDefaultChunkBytes = int64_t{4} << 20;
// Every slice starts at a multiple of this many bytes (page-aligned for mmap
// and O_DIRECT readers). The file header occupies the first kShardHeaderBytes.
inline constexpr int64_t kShardAlign = 4096;
inline constexpr int64_t kShardHeaderBytes = 64;

// One named tensor of the model: a view into its unit's flat buffer.
struct TensorRecord {
  std::string name;            // e.g. "h.0.attn.c_attn.weight"
  std::vector<int64_t> shape;  // engine layout
  int unit = 0;
  int64_t offset = 0;  // elements from the start of the unit
  int64_t numel() const;
  bool operator==(const TensorRecord&) const = default;
};

// What a checkpoint says about the run, beyond the state itself.
struct CheckpointMeta {
  int64_t step = 0;         // optimizer steps completed
  uint64_t seed = 0;        // train.seed
  uint64_t tokens = 0;      // tokens consumed
  int64_t adam_t = 0;       // AdamW's step count (bias correction)
  std::string config_toml;  // the resolved config of the run that wrote it
  int dp = 1;               // informational: parallel.dp of the writing run
  int zero_stage = 0;       // informational: parallel.zero_stage of the writing run
  int threads = 0;          // compute threads per rank of the writing run (0: not recorded)
  std::vector<TensorRecord> tensors;
};

// One shard file: rank_%05d.bin of writer rank `rank`, exactly `bytes` long.
struct FileRecord {
  std::string name;
  int rank = 0;
  int64_t bytes = 0;
};

struct SliceRecord {
  StateKind kind = StateKind::kParams;
  int unit = 0;
  int rank = 0;                // the writer (and owner of `file`)
  int64_t lo = 0, hi = 0;      // element range within the unit
  std::string file;            // a FileRecord name
  int64_t offset = 0;          // bytes from the start of the file
  std::vector<uint64_t> xxh3;  // XXH3-64 of each chunk
  int64_t bytes() const { return state_kind_field(kind).bytes(hi - lo); }
};

// A parsed manifest is in the current version's model whatever version the
// file was (`version` then says which it was); it is written as the current.
struct Manifest {
  int version = kShardedFormatVersion;
  std::string optimizer = std::string(kOptimizerSchema);
  CheckpointMeta meta;
  int writers = 1;  // rank files
  std::vector<int64_t> unit_numel;
  int64_t chunk_bytes = kDefaultChunkBytes;
  std::vector<StateKind> kinds;   // kinds stored (params only: a weights-only checkpoint)
  std::vector<FileRecord> files;  // ordered by rank
  std::vector<SliceRecord> slices;

  bool has(StateKind k) const;
  // The file named `name`; nullptr when the manifest lists none.
  const FileRecord* file(const std::string& name) const;
  // Σ slice bytes.
  int64_t data_bytes() const;
};

// Chunks of a slice of `bytes` bytes: ceil(bytes / chunk_bytes).
int64_t num_chunks(int64_t bytes, int64_t chunk_bytes);

// Checks every invariant above; InvalidArgument "<origin>: ..." naming the
// offending entry.
void validate_manifest(const Manifest& m, const std::string& origin);

// The manifest as JSON text: one line per top-level field and per tensor,
// file and slice, and a "manifest_xxh3" over its canonical form, so edits and
// bit flips are detected. Validates first.
std::string manifest_to_json(const Manifest& m);

// Parses and validates manifest text. `origin` names it in errors ("DIR/manifest.json").
// With `verify_checksum` false the manifest checksum is not required (fuzzing).
Manifest parse_manifest(std::string_view text, const std::string& origin,
                        bool verify_checksum = true);

// A rank's record of the slices it wrote (rank_%05d.json in the staging
// directory), merged into the manifest by rank 0. Same JSON conventions.
struct ShardRecord {
  int rank = 0, ranks = 1;
  std::vector<int64_t> unit_numel;
  int64_t chunk_bytes = kDefaultChunkBytes;
  std::vector<StateKind> kinds;
  FileRecord file;
  std::vector<SliceRecord> slices;
};
std::string shard_record_to_json(const ShardRecord& r);
ShardRecord parse_shard_record(std::string_view text, const std::string& origin);

// 16 lowercase hex digits.
std::string hex64(uint64_t v);

}  // namespace po::checkpoint
