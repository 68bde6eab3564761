// See sharded.h. Writers stream each slice from the caller's memory, hashing
// chunk by chunk as they write; readers pread whole chunks, straight into the
// destination when a chunk lies inside the range they need and through a
// scratch buffer at the range's edges, and verify each chunk before use.
#include "checkpoint/sharded.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>

#include "checkpoint/atomic_file.h"
#include "comm/communicator.h"
#include "core/error.h"
#include "parallel/shard_layout.h"

namespace po::checkpoint {
namespace fs = std::filesystem;
namespace {

constexpr char kMagic[8] = {'P', 'O', 'S', 'H', 'A', 'R', 'D', '\0'};
constexpr uint32_t kShardFileVersion = 1;
constexpr const char* kManifestName = "manifest.json";

std::string rank_name(int rank, const char* ext) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "rank_%05d.%s", rank, ext);
  return buf;
}

std::string join(const std::string& dir, const std::string& name) {
  return (fs::path(dir) / name).string();
}

int64_t align_up(int64_t v) { return (v + kShardAlign - 1) / kShardAlign * kShardAlign; }

void put(unsigned char* p, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) p[i] = static_cast<unsigned char>((v >> (8 * i)) & 0xff);
}
uint64_t get(const unsigned char* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

struct Header {
  uint32_t version = kShardFileVersion;
  uint32_t rank = 0, ranks = 1;
  int64_t step = 0;
  uint64_t bytes = 0;
};

void encode_header(const Header& h, unsigned char out[kShardHeaderBytes]) {
  std::memset(out, 0, kShardHeaderBytes);
  std::memcpy(out, kMagic, 8);
  put(out + 8, h.version, 4);
  put(out + 12, h.rank, 4);
  put(out + 16, h.ranks, 4);
  put(out + 24, static_cast<uint64_t>(h.step), 8);
  put(out + 32, h.bytes, 8);
  put(out + 56, XXH3_64bits(out, 56), 8);
}

// The header, or nullopt when the magic or its checksum is wrong.
std::optional<Header> decode_header(const unsigned char in[kShardHeaderBytes]) {
  if (std::memcmp(in, kMagic, 8) != 0 || get(in + 56, 8) != XXH3_64bits(in, 56)) return {};
  Header h;
  h.version = static_cast<uint32_t>(get(in + 8, 4));
  h.rank = static_cast<uint32_t>(get(in + 12, 4));
  h.ranks = static_cast<uint32_t>(get(in + 16, 4));
  h.step = static_cast<int64_t>(get(in + 24, 8));
  h.bytes = get(in + 32, 8);
  return h;
}

std::string read_text(const std::string& path, const std::string& missing_hint) {
  std::error_code ec;
  if (!fs::exists(path, ec)) PO_THROW(core::IoError, path, ": missing", missing_hint);
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  if (!in.good() && !in.eof()) PO_THROW(core::IoError, path, ": cannot read");
  return ss.str();
}

// The kinds in file order (params, adam_m, adam_v), each once.
std::vector<StateKind> normalized(std::vector<StateKind> kinds) {
  std::sort(kinds.begin(), kinds.end());
  kinds.erase(std::unique(kinds.begin(), kinds.end()), kinds.end());
  return kinds;
}

// A file descriptor, closed on destruction.
struct Fd {
  int fd = -1;
  Fd() = default;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// A shard file opened for reading, checked against its manifest entry.
class ShardReader {
 public:
  ShardReader(const std::string& dir, const Manifest& m, const FileRecord& rec)
      : path_(join(dir, rec.name)) {
    do {
      fd_.fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    } while (fd_.fd < 0 && errno == EINTR);
    if (fd_.fd < 0 && errno == ENOENT)
      PO_THROW(core::IoError, path_, ": missing (manifest.json names it as rank ", rec.rank,
               "'s shard file)");
    if (fd_.fd < 0) PO_THROW(core::IoError, path_, ": cannot open: ", std::strerror(errno));
    struct stat st {};
    if (::fstat(fd_.fd, &st) != 0)
      PO_THROW(core::IoError, path_, ": cannot stat: ", std::strerror(errno));
    const auto size = static_cast<int64_t>(st.st_size);
    PO_CHECK(size >= rec.bytes, path_, ": truncated: ", size, " bytes, but manifest.json says ",
             rec.bytes);
    PO_CHECK(size == rec.bytes, path_, ": ", size, " bytes, but manifest.json says ", rec.bytes,
             " (not the file this checkpoint wrote)");
    unsigned char raw[kShardHeaderBytes];
    read(raw, 0, kShardHeaderBytes);
    auto h = decode_header(raw);
    PO_CHECK(h.has_value(), path_, ": bad header (not a PagedOptim shard file, or corrupt)");
    PO_CHECK(h->version == kShardFileVersion, path_, ": shard file version ", h->version,
             " (this build reads ", kShardFileVersion, ")");
    PO_CHECK(static_cast<int>(h->rank) == rec.rank && static_cast<int>(h->ranks) == m.writers &&
                 h->step == m.meta.step && static_cast<int64_t>(h->bytes) == rec.bytes,
             path_, ": header says rank ", h->rank, " of ", h->ranks, ", step ", h->step,
             ", but manifest.json expects rank ", rec.rank, " of ", m.writers, ", step ",
             m.meta.step, " (a file from another checkpoint?)");
  }
  void read(void* dst, int64_t offset, int64_t bytes) const {
    auto* p = static_cast<char*>(dst);
    while (bytes > 0) {
      const size_t n = static_cast<size_t>(std::min<int64_t>(bytes, int64_t{1} << 30));
      const ssize_t got = ::pread(fd_.fd, p, n, offset);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0)
        PO_THROW(core::IoError, path_, ": read failed at byte ", offset, ": ",
                 std::strerror(errno));
      PO_CHECK(got > 0, path_, ": truncated: ends before byte ", offset + bytes);
      p += got;
      offset += got;
      bytes -= got;
    }
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  Fd fd_;
};

// Reads elements [x0, x1) of slice `s` into out[0 .. x1-x0), verifying every
// chunk it touches.
void read_slice_range(const ShardReader& file, const SliceRecord& s, int64_t chunk_bytes,
                      int64_t x0, int64_t x1, float* out, std::vector<char>& scratch) {
  const int64_t ce = chunk_bytes / 4;
  for (int64_t k = (x0 - s.lo) / ce; k <= (x1 - 1 - s.lo) / ce; ++k) {
    const int64_t c0 = s.lo + k * ce, c1 = std::min(s.hi, c0 + ce);
    const int64_t off = s.offset + (c0 - s.lo) * 4, len = (c1 - c0) * 4;
    const bool whole = c0 >= x0 && c1 <= x1;
    if (!whole && scratch.size() < static_cast<size_t>(len))
      scratch.resize(static_cast<size_t>(len));
    char* buf = whole ? reinterpret_cast<char*>(out + (c0 - x0)) : scratch.data();
    file.read(buf, off, len);
    const uint64_t h = XXH3_64bits(buf, static_cast<size_t>(len));
    PO_CHECK(h == s.xxh3[static_cast<size_t>(k)], file.path(), ": checksum mismatch in bytes [",
             off, ", ", off + len, ") (", state_kind_name(s.kind), " of unit ", s.unit,
             ", elements [", c0, ", ", c1, ")): the file is corrupt");
    if (!whole) {
      const int64_t a = std::max(c0, x0), b = std::min(c1, x1);
      std::memcpy(out + (a - x0), buf + (a - c0) * 4, static_cast<size_t>(b - a) * 4);
    }
  }
}

void check_units(const Manifest& m, const parallel::ShardLayout& layout,
                 const std::string& origin) {
  PO_CHECK(static_cast<int>(m.unit_numel.size()) == layout.num_units(), origin, ": holds ",
           m.unit_numel.size(), " units but the model has ", layout.num_units());
  for (int u = 0; u < layout.num_units(); ++u)
    PO_CHECK(m.unit_numel[u] == layout.unit_numel(u), origin, ": unit ", u, " holds ",
             m.unit_numel[u], " elements but the model's has ", layout.unit_numel(u));
}

std::string format_bytes(int64_t b) {
  char buf[32];
  const double v = static_cast<double>(b);
  if (b < 1024)
    std::snprintf(buf, sizeof(buf), "%lld B", static_cast<long long>(b));
  else if (b < (int64_t{1} << 20))
    std::snprintf(buf, sizeof(buf), "%.1f KiB", v / 1024);
  else if (b < (int64_t{1} << 30))
    std::snprintf(buf, sizeof(buf), "%.1f MiB", v / (1 << 20));
  else
    std::snprintf(buf, sizeof(buf), "%.2f GiB", v / (1 << 30));
  return buf;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Phase 2's last act, once the rank file is on disk: STAGING/rank_r.json,
// the record commit_sharded reads.
void write_shard_record(const std::string& staging, const ShardRecord& rec) {
  write_file_atomic(join(staging, rank_name(rec.rank, "json")), [&](AtomicFile& out) {
    const std::string text = shard_record_to_json(rec);
    out.write(text.data(), text.size());
  });
}

// The rank file's record for `layout`: its slices at their offsets (the
// checksums are filled as they are written).
ShardRecord plan_shard(const std::string& dir, const parallel::ShardLayout& layout, const SaveOptions& options) {
  ShardRecord rec;
  rec.rank = layout.rank();
  rec.ranks = layout.ranks();
  rec.chunk_bytes = options.chunk_bytes;
  rec.kinds = normalized(options.kinds);
  PO_CHECK(!rec.kinds.empty(), dir, ": a checkpoint needs at least one state kind");
  for (int u = 0; u < layout.num_units(); ++u) rec.unit_numel.push_back(layout.unit_numel(u));
  rec.file.name = rank_name(rec.rank, "bin");
  rec.file.rank = rec.rank;
  int64_t pos = kShardHeaderBytes;
  for (StateKind k : rec.kinds) {
    for (int u = 0; u < layout.num_units(); ++u) {
      if (layout.owned(u) == 0) continue;
      SliceRecord s;
      s.kind = k;
      s.unit = u;
      s.rank = rec.rank;
      s.lo = layout.begin(u);
      s.hi = layout.end(u);
      s.file = rec.file.name;
      s.offset = pos = align_up(pos);
      pos += s.bytes();
      rec.slices.push_back(std::move(s));
    }
  }
  rec.file.bytes = pos;
  return rec;
}

}  // namespace

std::string staging_dir(const std::string& dir) {
  std::string d = dir;
  while (d.size() > 1 && d.back() == '/') d.pop_back();
  return d + ".tmp";
}

void prepare_sharded_save(const std::string& dir) {
  const std::string staging = staging_dir(dir);
  std::error_code ec;
  fs::remove_all(staging, ec);
  PO_CHECK(!ec, staging, ": cannot remove the stale staging directory: ", ec.message());
  fs::create_directories(staging, ec);
  if (ec) PO_THROW(core::IoError, staging, ": cannot create: ", ec.message());
}

void write_shard(const std::string& dir, const CheckpointMeta& meta,
                 const parallel::ShardLayout& layout, const ShardSource& source,
                 const SaveOptions& options) {
  const std::string staging = staging_dir(dir);
  std::error_code ec;
  if (!fs::is_directory(staging, ec))
    PO_THROW(core::IoError, staging, ": missing (prepare_sharded_save runs first, on rank 0)");
  PO_CHECK(options.chunk_bytes >= 4 && options.chunk_bytes % 4 == 0, "checkpoint chunk of ",
           options.chunk_bytes, " bytes must be a positive multiple of 4");
  ShardRecord rec = plan_shard(dir, layout, options);
  const int64_t pos = rec.file.bytes;
  const std::string path = join(staging, rec.file.name);
  AtomicFile f(path);
  Header h;
  h.rank = static_cast<uint32_t>(rec.rank);
  h.ranks = static_cast<uint32_t>(rec.ranks);
  h.step = meta.step;
  h.bytes = static_cast<uint64_t>(pos);
  unsigned char raw[kShardHeaderBytes];
  encode_header(h, raw);
  f.write(raw, sizeof(raw));
  for (SliceRecord& s : rec.slices) {
    const float* src = source(s.kind, s.unit);
    PO_CHECK(src != nullptr, path, ": no source for ", state_kind_name(s.kind), " of unit ",
             s.unit);
    f.write_zeros(static_cast<size_t>(s.offset) - f.size());
    const auto* bytes = reinterpret_cast<const char*>(src);
    for (int64_t done = 0; done < s.bytes(); done += options.chunk_bytes) {
      const auto len = static_cast<size_t>(std::min(options.chunk_bytes, s.bytes() - done));
      s.xxh3.push_back(XXH3_64bits(bytes + done, len));
      f.write(bytes + done, len);
    }
  }
  PO_ASSERT(static_cast<int64_t>(f.size()) == pos, "shard file size ", f.size(), " != ", pos);
  f.commit();
  write_shard_record(staging, rec);
}

ShardImage::ShardImage(const parallel::ShardLayout& layout, const SaveOptions& options)
    : rec_(plan_shard("a background checkpoint", layout, options)) {
  PO_CHECK(options.chunk_bytes >= 4 && options.chunk_bytes % 4 == 0, "checkpoint chunk of ",
           options.chunk_bytes, " bytes must be a positive multiple of 4");
  capacity_ = static_cast<size_t>(align_up(rec_.file.bytes));
  // Mapped (page-aligned, zero: the gaps between slices stay zero), in huge
  // pages where the kernel has them, and populated now rather than page by
  // page inside the first checkpoint's step.
  void* p = ::mmap(nullptr, capacity_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  PO_CHECK(p != MAP_FAILED, "cannot map ", capacity_, " bytes for a checkpoint's copy: ", std::strerror(errno));
  ::madvise(p, capacity_, MADV_HUGEPAGE);
  image_ = static_cast<char*>(p);
  for (size_t i = 0; i < capacity_; i += 4096) image_[i] = 0;
}

ShardImage::~ShardImage() { ::munmap(image_, capacity_); }

void ShardImage::fill(const CheckpointMeta& meta, const ShardSource& source) {
  Header h;
  h.rank = static_cast<uint32_t>(rec_.rank);
  h.ranks = static_cast<uint32_t>(rec_.ranks);
  h.step = meta.step;
  h.bytes = static_cast<uint64_t>(rec_.file.bytes);
  encode_header(h, reinterpret_cast<unsigned char*>(image_));
  // The sources first (a paged source may stage through its own buffer:
  // called on this thread, one at a time), then the copy on every usable
  // core: at a step boundary the training threads are idle, and the copy is
  // all the step waits for.
  struct Piece {
    const char* src;
    char* dst;
    size_t bytes;
  };
  std::vector<Piece> pieces;
  size_t total = 0;
  for (const SliceRecord& s : rec_.slices) {
    const float* src = source(s.kind, s.unit);
    PO_CHECK(src != nullptr, "checkpoint copy: no source for ", state_kind_name(s.kind), " of unit ", s.unit);
    if (direct_sources_) {
      pieces.push_back({reinterpret_cast<const char*>(src), image_ + s.offset, static_cast<size_t>(s.bytes())});
      total += static_cast<size_t>(s.bytes());
    } else {
      std::memcpy(image_ + s.offset, src, static_cast<size_t>(s.bytes()));
    }
  }
  if (pieces.empty()) return;
  const unsigned threads = std::max(1u, std::min(4u, std::thread::hardware_concurrency()));
  auto copy_share = [&](unsigned t) {  // bytes [total·t/T, total·(t+1)/T) of the pieces, in order
    const size_t lo = total * t / threads, hi = total * (t + 1) / threads;
    size_t at = 0;
    for (const Piece& p : pieces) {
      const size_t a = std::max(lo, at), b = std::min(hi, at + p.bytes);
      if (a < b) std::memcpy(p.dst + (a - at), p.src + (a - at), b - a);
      at += p.bytes;
    }
  };
  std::vector<std::thread> helpers;
  for (unsigned t = 1; t < threads; ++t) helpers.emplace_back(copy_share, t);
  copy_share(0);
  for (auto& h : helpers) h.join();
}

void ShardImage::write(const std::string& dir) {
  const std::string staging = staging_dir(dir);
  const std::string path = join(staging, rec_.file.name);
  for (SliceRecord& s : rec_.slices) {
    s.file = rec_.file.name;
    s.xxh3.clear();
    for (int64_t done = 0; done < s.bytes(); done += rec_.chunk_bytes)
      s.xxh3.push_back(XXH3_64bits(image_ + s.offset + done,
                                   static_cast<size_t>(std::min(rec_.chunk_bytes, s.bytes() - done))));
  }
  // O_DIRECT: whole aligned blocks from the aligned image, then the file cut
  // to its size; a file system without it (tmpfs) gets ordinary writes.
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644);
  const bool direct = fd >= 0;
  if (!direct) fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  PO_CHECK(fd >= 0, path, ": cannot create: ", std::strerror(errno));
  Fd guard;
  guard.fd = fd;
  const size_t total = direct ? capacity_ : static_cast<size_t>(rec_.file.bytes);
  for (size_t done = 0; done < total;) {
    const size_t n = std::min<size_t>(total - done, size_t{64} << 20);
    const ssize_t w = ::pwrite(fd, image_ + done, n, static_cast<off_t>(done));
    if (w < 0 && errno == EINTR) continue;
    PO_CHECK(w > 0, path, ": write failed at byte ", done, ": ", w < 0 ? std::strerror(errno) : "no progress");
    done += static_cast<size_t>(w);
  }
  PO_CHECK(::ftruncate(fd, rec_.file.bytes) == 0, path, ": cannot set its size: ", std::strerror(errno));
  PO_CHECK(::fsync(fd) == 0, path, ": fsync failed: ", std::strerror(errno));
  write_shard_record(staging, rec_);
}

void commit_sharded(const std::string& dir, const CheckpointMeta& meta, int writers) {
  const std::string staging = staging_dir(dir);
  PO_CHECK(writers >= 1, dir, ": ", writers, " writer ranks");
  Manifest m;
  m.meta = meta;
  m.writers = writers;
  std::vector<std::string> records;
  for (int r = 0; r < writers; ++r) {
    const std::string path = join(staging, rank_name(r, "json"));
    const ShardRecord rec = parse_shard_record(
        read_text(path, core::str_cat(" (rank ", r, " did not finish writing its shard)")), path);
    PO_CHECK(rec.rank == r && rec.ranks == writers, path, ": written by rank ", rec.rank, " of ",
             rec.ranks, ", expected rank ", r, " of ", writers);
    if (r == 0) {
      m.unit_numel = rec.unit_numel;
      m.kinds = rec.kinds;
      m.chunk_bytes = rec.chunk_bytes;
    }
    PO_CHECK(
        rec.unit_numel == m.unit_numel && rec.kinds == m.kinds && rec.chunk_bytes == m.chunk_bytes,
        path, ": units, kinds or chunk size differ from rank 0's");
    std::error_code ec;
    const auto size = fs::file_size(join(staging, rec.file.name), ec);
    PO_CHECK(!ec && static_cast<int64_t>(size) == rec.file.bytes, path, ": its shard file '",
             rec.file.name, "' is missing or not ", rec.file.bytes, " bytes");
    m.files.push_back(rec.file);
    m.slices.insert(m.slices.end(), rec.slices.begin(), rec.slices.end());
    records.push_back(path);
  }
  const std::string manifest_path = join(staging, kManifestName);
  validate_manifest(m, manifest_path);
  const std::string text = manifest_to_json(m);
  for (const auto& p : records) {
    std::error_code ec;
    fs::remove(p, ec);
    if (ec) PO_THROW(core::IoError, p, ": cannot remove: ", ec.message());
  }
  write_file_atomic(manifest_path, text.data(), text.size());  // fsyncs the staging directory
  replace_dir_atomic(staging, dir);                            // fsyncs the parent
}

void agree_on_success(comm::Communicator* comm, std::exception_ptr mine, const std::string& what) {
  if (comm != nullptr && comm->size() > 1) {
    float failed = mine ? static_cast<float>(comm->rank() + 1) : 0.0f;
    comm->allreduce(&failed, 1, tensor::DType::kF32, comm::ReduceOp::kMax);
    if (!mine && failed > 0)
      PO_THROW(core::IoError, what, ": rank ", static_cast<int>(failed) - 1,
               " failed (its error is reported by that rank)");
  }
  if (mine) std::rethrow_exception(mine);
}

void save_sharded(const std::string& dir, const CheckpointMeta& meta,
                  const parallel::ShardLayout& layout, const ShardSource& source,
                  comm::Communicator* comm, const SaveOptions& options) {
  if (comm == nullptr) {
    PO_CHECK(layout.ranks() == 1, dir, ": a layout of ", layout.ranks(),
             " ranks needs a communicator to save");
  } else {
    PO_CHECK(comm->size() == layout.ranks() && comm->rank() == layout.rank(), dir,
             ": layout is rank ", layout.rank(), " of ", layout.ranks(), " but the group '",
             comm->name(), "' has this process as rank ", comm->rank(), " of ", comm->size());
  }
  const bool leader = layout.rank() == 0;
  auto phase = [&](bool run, const std::function<void()>& fn, const char* what) {
    std::exception_ptr e;
    if (run) {
      try {
        fn();
      } catch (...) {
        e = std::current_exception();
      }
    }
    try {
      agree_on_success(comm, e, core::str_cat(dir, ": ", what));
    } catch (...) {
      std::error_code ec;
      if (leader) fs::remove_all(staging_dir(dir), ec);  // best effort; the next save retries
      throw;
    }
  };
  phase(
      leader, [&] { prepare_sharded_save(dir); }, "preparing the checkpoint");
  phase(
      true, [&] { write_shard(dir, meta, layout, source, options); }, "writing a shard");
  phase(
      leader, [&] { commit_sharded(dir, meta, layout.ranks()); }, "committing the checkpoint");
}

Manifest read_manifest(const std::string& dir) {
  const std::string path = join(dir, kManifestName);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) PO_THROW(core::IoError, dir, ": no such checkpoint directory");
  return parse_manifest(
      read_text(path,
                " (not a complete checkpoint; a save that was interrupted leaves only "
                "DIR.tmp, so this directory was made some other way)"),
      path);
}

CheckpointMeta read_sharded_meta(const std::string& dir) { return read_manifest(dir).meta; }

void load_sharded(const std::string& dir, const Manifest& m, const parallel::ShardLayout& layout,
                  const ShardDest& dest, const std::vector<StateKind>& kinds) {
  check_units(m, layout, join(dir, kManifestName));
  for (StateKind k : kinds)
    PO_CHECK(m.has(k), dir, ": holds no ", state_kind_name(k),
             " (a weights-only checkpoint cannot restore optimizer state)");
  std::map<std::pair<int, int>, std::vector<const SliceRecord*>> by_unit;  // (kind, unit)
  for (const auto& s : m.slices) by_unit[{static_cast<int>(s.kind), s.unit}].push_back(&s);
  std::map<std::string, std::unique_ptr<ShardReader>> files;
  std::vector<char> scratch;
  for (StateKind k : normalized(kinds)) {
    for (int u = 0; u < layout.num_units(); ++u) {
      const int64_t a = layout.begin(u), b = layout.end(u);
      if (a == b) continue;
      float* out = dest(k, u);
      PO_CHECK(out != nullptr, dir, ": no destination for ", state_kind_name(k), " of unit ", u);
      for (const SliceRecord* s : by_unit[{static_cast<int>(k), u}]) {
        const int64_t x0 = std::max(a, s->lo), x1 = std::min(b, s->hi);
        if (x0 >= x1) continue;
        auto& f = files[s->file];
        if (!f) f = std::make_unique<ShardReader>(dir, m, *m.file(s->file));
        read_slice_range(*f, *s, m.chunk_bytes, x0, x1, out + (x0 - a), scratch);
      }
    }
  }
}

Manifest load_sharded(const std::string& dir, const parallel::ShardLayout& layout,
                      const ShardDest& dest, const std::vector<StateKind>& kinds) {
  Manifest m = read_manifest(dir);
  load_sharded(dir, m, layout, dest, kinds);
  return m;
}

void check_tensors(const Manifest& manifest, const std::vector<TensorRecord>& expected,
                   const std::string& origin) {
  std::map<std::string, const TensorRecord*> have;
  for (const auto& t : manifest.meta.tensors) have[t.name] = &t;
  for (const auto& e : expected) {
    auto it = have.find(e.name);
    PO_CHECK(it != have.end(), origin, ": holds no tensor '", e.name, "'");
    const TensorRecord& t = *it->second;
    PO_CHECK(t.shape == e.shape, origin, ": tensor '", e.name, "' has shape ", shape_text(t.shape),
             " but the model's is ", shape_text(e.shape));
    PO_CHECK(t.unit == e.unit && t.offset == e.offset, origin, ": tensor '", e.name,
             "' is at unit ", t.unit, " offset ", t.offset, " but the model's is at unit ", e.unit,
             " offset ", e.offset);
    have.erase(it);
  }
  PO_CHECK(have.empty(), origin, ": holds tensor '", have.empty() ? "" : have.begin()->first,
           "' that the model does not have");
}

std::string format_manifest(const std::string& dir) {
  const Manifest m = read_manifest(dir);
  const CheckpointMeta& meta = m.meta;
  std::string out;
  auto line = [&](const char* fmt, auto... args) {
    std::vector<char> buf(static_cast<size_t>(std::snprintf(nullptr, 0, fmt, args...)) + 1);
    std::snprintf(buf.data(), buf.size(), fmt, args...);
    out += buf.data();
    out += '\n';
  };
  int64_t total_numel = 0;
  for (int64_t n : m.unit_numel) total_numel += n;
  std::string kinds;
  for (StateKind k : m.kinds) {
    const optim::StateField& f = state_kind_field(k);
    kinds += core::str_cat(kinds.empty() ? "" : ", ", f.name, " ", optim::dtype_name(f.dtype));
    if (f.block > 0) kinds += core::str_cat(" (+ fp32 scale per ", f.block, ")");
  }
  line("checkpoint %s", dir.c_str());
  line("  format %s v%d; checksums XXH3-64 per %s chunk", kShardedFormatName, m.version,
       format_bytes(m.chunk_bytes).c_str());
  line("  step %lld, tokens %llu, adam_t %lld, seed %llu", static_cast<long long>(meta.step),
       static_cast<unsigned long long>(meta.tokens), static_cast<long long>(meta.adam_t),
       static_cast<unsigned long long>(meta.seed));
  line("  written by %d rank(s) (parallel.dp = %d, zero_stage = %d%s)", m.writers, meta.dp,
       meta.zero_stage,
       meta.threads > 0 ? core::str_cat(", ", meta.threads, " threads per rank").c_str() : "");
  line("  state of %s: %s; %zu units, %lld elements", m.optimizer.c_str(), kinds.c_str(),
       m.unit_numel.size(), static_cast<long long>(total_numel));
  int64_t file_bytes = 0;
  for (const auto& f : m.files) file_bytes += f.bytes;
  line("  total: %s of state in %zu file(s) of %s", format_bytes(m.data_bytes()).c_str(),
       m.files.size(), format_bytes(file_bytes).c_str());
  line("\ntensors (%zu):", meta.tensors.size());
  line("  %-5s %-12s %-14s %-12s %s", "unit", "offset", "shape", "elements", "name");
  for (const auto& t : meta.tensors)
    line("  %-5d %-12lld %-14s %-12lld %s", t.unit, static_cast<long long>(t.offset),
         shape_text(t.shape).c_str(), static_cast<long long>(t.numel()), t.name.c_str());
  line("\nfiles (%zu):", m.files.size());
  line("  %-5s %-14s %-12s %s", "rank", "bytes", "size", "name");
  for (const auto& f : m.files) {
    std::error_code ec;
    const std::string path = join(dir, f.name);
    std::string status;
    if (!fs::exists(path, ec)) {
      status = "  MISSING";
    } else {
      const auto size = static_cast<int64_t>(fs::file_size(path, ec));
      if (ec)
        status = "  UNREADABLE";
      else if (size < f.bytes)
        status = core::str_cat("  TRUNCATED (", size, " bytes)");
      else if (size > f.bytes)
        status = core::str_cat("  WRONG SIZE (", size, " bytes)");
    }
    line("  %-5d %-14lld %-12s %s%s", f.rank, static_cast<long long>(f.bytes),
         format_bytes(f.bytes).c_str(), f.name.c_str(), status.c_str());
  }
  line("\nslices (%zu):", m.slices.size());
  line("  %-7s %-5s %-5s %-27s %-16s %-12s %-12s %s", "kind", "unit", "rank", "elements [lo, hi)",
       "file", "offset", "bytes", "chunks");
  for (const auto& s : m.slices) {
    const std::string range = core::str_cat("[", s.lo, ", ", s.hi, ")");
    line("  %-7s %-5d %-5d %-27s %-16s %-12lld %-12lld %zu", state_kind_name(s.kind), s.unit,
         s.rank, range.c_str(), s.file.c_str(), static_cast<long long>(s.offset),
         static_cast<long long>(s.bytes()), s.xxh3.size());
  }
  return out;
}

}  // namespace po::checkpoint
