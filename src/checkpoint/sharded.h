// Sharded checkpoints: each rank writes only the state it owns, in parallel,
// and rank 0 writes one manifest (checkpoint/manifest.h) that says which file
// and byte offset holds every slice of every unit. Any layout can load any
// checkpoint: a reader intersects the element ranges it needs with the
// manifest's slices and reads only those bytes (reshard on load).
//
// A checkpoint is a directory DIR holding manifest.json and rank_%05d.bin,
// one per writing rank. A rank file is a 64-byte header (magic "POSHARD\0",
// u32 version, u32 rank, u32 ranks, u32 0, i64 step, u64 file bytes,
// 16 zero bytes, u64 XXH3-64 of the first 56 bytes; little-endian) followed by
// the rank's slices, each starting on a 4096-byte boundary: for each kind
// (params, adam_m, adam_v, in that order) and each unit, the f32 elements
// [layout.begin(u), layout.end(u)) of that unit, when not empty.
//
// Atomicity: all files are written into DIR.tmp (the staging directory) and
// fsynced; rank 0 writes the manifest last, then renames DIR.tmp to DIR and
// fsyncs the parent. So DIR is complete or absent, and a crash leaves at most
// a DIR.tmp, removed by the next save of DIR. All ranks must see one shared
// filesystem.
//
// Errors are one line naming the file: a missing or truncated rank file, a
// checksum mismatch (file, byte range, kind, unit), a malformed manifest, a
// unit-size or tensor mismatch with the loading model.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "checkpoint/manifest.h"

namespace po::comm {
class Communicator;
}
namespace po::parallel {
class ShardLayout;
}

namespace po::checkpoint {

// This rank's shard of `kind` in unit `unit`: a pointer to element
// layout.begin(unit) of the unit, holding layout.owned(unit) floats. Called
// only for the kinds being saved and units the rank owns elements of; must
// not return nullptr then.
using ShardSource = std::function<const float*(StateKind kind, int unit)>;
// Where to load this rank's shard of `kind` in unit `unit` (same contract).
using ShardDest = std::function<float*(StateKind kind, int unit)>;

struct SaveOptions {
  std::vector<StateKind> kinds = {kAllStateKinds.begin(), kAllStateKinds.end()};
  // Checksum chunk; tests use small ones to reach multi-chunk paths cheaply.
  int64_t chunk_bytes = kDefaultChunkBytes;
};

// "DIR.tmp": where a save of DIR is staged.
std::string staging_dir(const std::string& dir);

// Save phase 1 (rank 0 only, before any rank writes): removes a stale staging
// directory left by a crashed save, and creates a fresh one (and DIR's parents).
void prepare_sharded_save(const std::string& dir);

// Save phase 2 (every rank, in parallel): writes DIR.tmp/rank_r.bin with the
// shards `source` gives for `layout` (r = layout.rank()) and, once that is on
// disk, DIR.tmp/rank_r.json listing its slices and checksums.
void write_shard(const std::string& dir, const CheckpointMeta& meta,
                 const parallel::ShardLayout& layout, const ShardSource& source,
                 const SaveOptions& options = {});

// Save phase 2 from memory (background saves, train/async_checkpoint.h): the
// exact bytes of DIR.tmp/rank_r.bin in one buffer aligned for O_DIRECT,
// allocated and touched once, filled at a step boundary (a copy), written
// later by any thread: O_DIRECT where the file system allows it, so the
// write costs little CPU and no page cache. The file is the one write_shard
// writes for the same layout and kinds.
class ShardImage {
 public:
  ShardImage(const parallel::ShardLayout& layout, const SaveOptions& options = {});
  ~ShardImage();
  ShardImage(const ShardImage&) = delete;
  ShardImage& operator=(const ShardImage&) = delete;

  // The header for `meta` and this rank's slices out of `source`. With
  // `direct_sources` (the default) every pointer `source` returns stays valid
  // until fill returns, and the copy runs on several threads; otherwise each
  // is copied before the next call (a source that stages through one buffer).
  void fill(const CheckpointMeta& meta, const ShardSource& source);
  void set_direct_sources(bool direct) { direct_sources_ = direct; }
  // Checksums the slices, writes and fsyncs DIR.tmp/rank_r.bin, then its record.
  void write(const std::string& dir);
  int64_t file_bytes() const { return rec_.file.bytes; }

 private:
  ShardRecord rec_;
  char* image_ = nullptr;
  size_t capacity_ = 0;  // file_bytes() rounded up to kShardAlign
  bool direct_sources_ = true;
};

// Save phase 3 (rank 0 only, after every rank's write_shard returned): merges
// the `writers` ranks' records into manifest.json (checking they tile every
// unit), and renames DIR.tmp to DIR, replacing an existing DIR atomically.
void commit_sharded(const std::string& dir, const CheckpointMeta& meta, int writers);

// All three phases: a collective over `comm` (nullptr: a single process,
// layout.ranks() must be 1). Returns on every rank once DIR is complete; if
// any rank fails, every rank throws (the failing one its own error, the
// others one naming that rank) and DIR is untouched.
void save_sharded(const std::string& dir, const CheckpointMeta& meta,
                  const parallel::ShardLayout& layout, const ShardSource& source,
                  comm::Communicator* comm, const SaveOptions& options = {});

// Reads and verifies DIR/manifest.json (IoError when missing, InvalidArgument
// when malformed or failing its checksum).
Manifest read_manifest(const std::string& dir);

// The run metadata of a checkpoint (config, step, ...): its manifest's meta.
CheckpointMeta read_sharded_meta(const std::string& dir);

// Fills `dest` with this rank's shards under `layout` (any number of ranks)
// for each of `kinds`, reading and verifying only the chunks it needs. The
// layout's units must match the checkpoint's; a kind the checkpoint lacks is
// an error. Returns the manifest.
Manifest load_sharded(const std::string& dir, const parallel::ShardLayout& layout,
                      const ShardDest& dest, const std::vector<StateKind>& kinds);
// The same with a manifest already read from `dir`.
void load_sharded(const std::string& dir, const Manifest& manifest,
                  const parallel::ShardLayout& layout, const ShardDest& dest,
                  const std::vector<StateKind>& kinds);

// Checks that the checkpoint's tensors are exactly `expected` (names, shapes,
// units, offsets); InvalidArgument naming `origin` and the first difference.
void check_tensors(const Manifest& manifest, const std::vector<TensorRecord>& expected,
                   const std::string& origin);

// The manifest of DIR for people (`pagedoptim ckpt info`): run metadata,
// layout, tensors with shapes, files with sizes (and whether each is present
// and of the right size), slices per kind/unit/rank, totals.
std::string format_manifest(const std::string& dir);

// For collectives that must succeed everywhere or fail everywhere: every rank
// passes its own outcome (nullptr = success). Rethrows `mine`, or, when only
// another rank failed, throws IoError "<what>: rank k failed (see its error)".
// With comm == nullptr just rethrows `mine`.
void agree_on_success(comm::Communicator* comm, std::exception_ptr mine, const std::string& what);

}  // namespace po::checkpoint
