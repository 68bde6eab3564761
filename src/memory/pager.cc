#include "memory/pager.h"

// XXH3 compiled here, for the build's x86-64-v3 (its AVX2 loop), instead of
// the shared library's SSE2 build: compiled for AVX-512 it measured 1.8x
// (27 vs 15 GB/s on 4 MiB pages), and every page read or written is hashed
// on the training thread. The hash is the same.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "core/error.h"
#include "core/timer.h"

namespace po::memory {
namespace {

// Frames of one pool in one allocation, every frame 4096-aligned for
// O_DIRECT (2 MiB aligned when large, for huge pages).
tensor::Storage frames(size_t count, size_t page_bytes, tensor::Pool pool) {
  if (count == 0) return {};
  const size_t bytes = count * page_bytes;
  return tensor::Storage(bytes, pool, bytes >= (size_t{2} << 20) ? (size_t{2} << 20) : 4096);
}

// A page's checksum: XXH3 of the XXH3s of its two halves, hashed by two
// threads where the page is large enough to pay for the fork. Every page
// read or written is hashed on the training thread; the update's other
// thread waits there otherwise. (Scratch files only: the format is ours.)
uint64_t page_checksum(const char* data, size_t bytes) {
  const size_t half = bytes / 2;
  uint64_t parts[2];
#pragma omp parallel for num_threads(2) schedule(static) if (bytes >= (size_t{1} << 20))
  for (int i = 0; i < 2; ++i)
    parts[i] = XXH3_64bits(data + static_cast<size_t>(i) * half, i == 0 ? half : bytes - half);
  return XXH3_64bits(parts, sizeof parts);
}

}  // namespace

Pager::Pager(size_t pages, const PagerOptions& options) : options_(options) {
  PO_CHECK(options.page_bytes > 0 && options.page_bytes % 4096 == 0, "memory.page_size = ",
           options.page_bytes, " bytes: must be a positive multiple of 4096");
  PO_CHECK(options.prefetch >= 0, "memory.prefetch = ", options.prefetch, " must be >= 0");
  const size_t need = std::min(pages, min_compute_frames(options.prefetch));
  PO_CHECK(options.compute_frames >= need, "the compute tier holds ", options.compute_frames,
           " pages; the pager needs at least ", need, " (the page in use, ", options.prefetch,
           " read ahead, one written back) = ", need * options.page_bytes, " bytes");
  const size_t cf = std::min(options.compute_frames, pages);
  const size_t hf = std::min(options.host_frames, pages > cf ? pages - cf : 0);
  options_.compute_frames = cf;
  options_.host_frames = hf;
  compute_storage_ = frames(cf, options.page_bytes, tensor::Pool::kCompute);
  host_storage_ = frames(hf, options.page_bytes, tensor::Pool::kHost);
  compute_ = static_cast<char*>(compute_storage_.data());
  host_ = static_cast<char*>(host_storage_.data());
  cframes_.assign(cf, {});
  hframes_.assign(hf, {});
  for (size_t f = 0; f < cf; ++f) cdata_.push_back(compute_ + f * options.page_bytes);
  tier_.assign(pages, Tier::kNvme);
  frame_.assign(pages, -1);
  zero_.assign(pages, true);
  checksum_.assign(pages, 0);
  on_nvme_.assign(pages, false);
  pos_.assign(pages, -1);
  if (pages > cf + hf) {
    PO_CHECK(!options.nvme_dir.empty(), pages * options.page_bytes,
             " bytes of paged state exceed the compute and host tiers (",
             (cf + hf) * options.page_bytes, " bytes): set memory.nvme_dir");
    store_ = std::make_unique<NvmeStore>(options.nvme_dir, options.file_name, pages,
                                         options.page_bytes, options.nvme);
  }
}

Pager::~Pager() {
  // Writes in flight read the frames: finish them before the frames go.
  if (store_) {
    for (auto& f : cframes_)
      if (f.state == Frame::kWriting || f.state == Frame::kReading) {
        try {
          store_->wait(f.ticket);
        } catch (...) {
        }
      }
  }
}

NvmeStore& Pager::io() {
  PO_ASSERT(store_ != nullptr, "Pager: no NVMe tier");
  return *store_;
}

size_t Pager::resident(Tier t) const {
  size_t n = 0;
  for (size_t p = 0; p < tier_.size(); ++p) {
    if (t == Tier::kNvme) {
      n += tier_[p] == Tier::kNvme && !zero_[p] ? 1 : 0;
    } else {
      n += tier_[p] == t ? 1 : 0;
    }
  }
  return n;
}

// Distance, in page uses, from `now` (the position in the current pass; -1
// between passes) to page p's next use.
int64_t Pager::next_use(size_t p, int64_t now) const {
  const auto n = static_cast<int64_t>(tier_.size());
  auto pos_in = [&](bool forward) { return forward ? static_cast<int64_t>(p) : n - 1 - static_cast<int64_t>(p); };
  if (!in_pass_ && options_.order == PagerOptions::Order::kFollowAccesses) {
    const int64_t d = ascending_ ? static_cast<int64_t>(p) - static_cast<int64_t>(cursor_)
                                 : static_cast<int64_t>(cursor_) - static_cast<int64_t>(p);
    return (d % n + n) % n + 1;
  }
  if (!in_pass_) return pos_in(forward_) + 1;
  const int64_t here = pos_in(forward_);
  if (here >= now) return here - now;
  const bool next_forward = options_.alternate ? !forward_ : forward_;
  return n - now + pos_in(next_forward);
}

void Pager::wait_ticket(NvmeStore::Ticket t) {
  if (io().done(t)) {
    io().wait(t);  // collects its error, if any
    return;
  }
  core::Timer timer;
  io().wait(t);
  stats_.wait_s += timer.seconds();
}

void Pager::write_to_nvme(size_t p, const char* data, NvmeStore::Ticket* ticket) {
  checksum_[p] = page_checksum(data, options_.page_bytes);
  *ticket = io().write(p, data);
  stats_.nvme_written_bytes += options_.page_bytes;
  on_nvme_[p] = true;
}

void Pager::check_read(size_t p, const char* data) {
  const uint64_t h = page_checksum(data, options_.page_bytes);
  if (h != checksum_[p])
    PO_THROW(core::IoError, "page ", p, " read from ", io().path(), " (nvme tier, slot ", p,
             ", ", options_.page_bytes, " bytes at offset ", p * options_.page_bytes,
             ") fails its checksum: the swap file was changed or the disk returned bad data");
}

int64_t Pager::furthest(const std::vector<FrameState>& frames, int64_t now, int64_t limit) const {
  int64_t victim = -1, far = limit;
  for (size_t f = 0; f < frames.size(); ++f) {
    if (frames[f].state != Frame::kPage) continue;
    const int64_t d = next_use(frames[f].page, now);
    if (d > far) {
      far = d;
      victim = static_cast<int64_t>(f);
    }
  }
  return victim;
}

// A host frame is never left writing: its page goes to NVMe synchronously
// (the host tier is the fast one; the compute tier's writes are the ones
// that overlap).
int64_t Pager::take_host_frame(int64_t now, int64_t limit) {
  for (size_t f = 0; f < hframes_.size(); ++f)
    if (hframes_[f].state == Frame::kFree) return static_cast<int64_t>(f);
  const int64_t victim = furthest(hframes_, now, limit);
  if (victim < 0) return -1;
  FrameState& h = hframes_[static_cast<size_t>(victim)];
  const size_t p = h.page;
  tier_[p] = Tier::kNvme;
  frame_[p] = -1;
  if (!on_nvme_[p]) {
    NvmeStore::Ticket t;
    write_to_nvme(p, host_frame(static_cast<size_t>(victim)), &t);
    wait_ticket(t);
  }
  h.state = Frame::kFree;
  return victim;
}

// Page p leaves compute frame f: to the host tier if it has room for a page
// used sooner than what it holds, else to NVMe (asynchronously: the frame is
// kWriting until the write completes).
void Pager::evict_compute(size_t f, int64_t now) {
  FrameState& c = cframes_[f];
  const size_t p = c.page;
  if (!hframes_.empty()) {
    const int64_t h = take_host_frame(now, next_use(p, now));
    if (h >= 0) {
      std::memcpy(host_frame(static_cast<size_t>(h)), compute_frame(f), options_.page_bytes);
      stats_.host_written_bytes += options_.page_bytes;
      hframes_[static_cast<size_t>(h)] = {Frame::kPage, p, 0};
      tier_[p] = Tier::kHost;
      frame_[p] = h;
      c.state = Frame::kFree;
      return;
    }
  }
  tier_[p] = Tier::kNvme;
  frame_[p] = -1;
  if (zero_[p] || on_nvme_[p]) {  // nothing new to write
    c.state = Frame::kFree;
    return;
  }
  write_to_nvme(p, compute_frame(f), &c.ticket);
  c.state = Frame::kWriting;
}

// Decisions depend only on the sequence of requests, never on when I/O
// completes: the same run moves the same pages (so its traffic and hit rate
// are reproducible). Order: a free frame; the frame of the oldest write back
// (waited for); a victim evicted by next use; a read ahead (demand only).
int64_t Pager::take_compute_frame(int64_t now, int64_t limit) {
  for (size_t f = 0; f < cframes_.size(); ++f)
    if (cframes_[f].state == Frame::kFree) return static_cast<int64_t>(f);
  int64_t oldest = -1;
  for (size_t f = 0; f < cframes_.size(); ++f)
    if (cframes_[f].state == Frame::kWriting &&
        (oldest < 0 || cframes_[f].ticket < cframes_[static_cast<size_t>(oldest)].ticket))
      oldest = static_cast<int64_t>(f);
  if (oldest >= 0) {
    wait_ticket(cframes_[static_cast<size_t>(oldest)].ticket);
    cframes_[static_cast<size_t>(oldest)].state = Frame::kFree;
    return oldest;
  }
  const int64_t victim = furthest(cframes_, now, limit);
  if (victim >= 0) {
    evict_compute(static_cast<size_t>(victim), now);
    if (cframes_[static_cast<size_t>(victim)].state == Frame::kWriting) {
      wait_ticket(cframes_[static_cast<size_t>(victim)].ticket);
      cframes_[static_cast<size_t>(victim)].state = Frame::kFree;
    }
    return victim;
  }
  // Needed now (limit < 0) and every frame is a read ahead in flight: finish
  // the one used last and let it go (it is clean: its copy is on NVMe).
  if (limit < 0) {
    int64_t victim = -1, far = -1;
    for (size_t f = 0; f < cframes_.size(); ++f) {
      const int64_t d = next_use(cframes_[f].page, now);
      if (cframes_[f].state == Frame::kReading && d > far) {
        far = d;
        victim = static_cast<int64_t>(f);
      }
    }
    if (victim >= 0) {
      FrameState& c = cframes_[static_cast<size_t>(victim)];
      wait_ticket(c.ticket);
      check_read(c.page, compute_frame(static_cast<size_t>(victim)));
      tier_[c.page] = Tier::kNvme;
      frame_[c.page] = -1;
      c.state = Frame::kFree;
      return victim;
    }
  }
  return -1;
}

bool Pager::bring_in(size_t p, int64_t now, bool demand) {
  if (tier_[p] == Tier::kCompute) return true;
  // Still being written back from a compute frame: take it back.
  if (const int64_t w = writing_frame(p); w >= 0) {
    FrameState& c = cframes_[static_cast<size_t>(w)];
    wait_ticket(c.ticket);
    c.state = Frame::kPage;
    tier_[p] = Tier::kCompute;
    frame_[p] = w;
    return true;
  }
  // Read ahead only over pages needed later; a page needed now takes any frame.
  const int64_t f = take_compute_frame(now, demand ? -1 : next_use(p, now));
  if (f < 0) return false;
  FrameState& c = cframes_[static_cast<size_t>(f)];
  char* dst = compute_frame(static_cast<size_t>(f));
  if (tier_[p] == Tier::kHost) {
    const auto h = static_cast<size_t>(frame_[p]);
    std::memcpy(dst, host_frame(h), options_.page_bytes);
    stats_.host_read_bytes += options_.page_bytes;
    hframes_[h].state = Frame::kFree;
    c = {Frame::kPage, p, 0};
  } else if (zero_[p]) {
    std::memset(dst, 0, options_.page_bytes);
    c = {Frame::kPage, p, 0};
  } else {
    c = {Frame::kReading, p, io().read(p, dst)};
    stats_.nvme_read_bytes += options_.page_bytes;
  }
  tier_[p] = Tier::kCompute;
  frame_[p] = f;
  return true;
}

// A hit: the page is in a compute frame and its read (if any) is complete.
bool Pager::ready(size_t p) {
  if (tier_[p] != Tier::kCompute) return false;
  const FrameState& c = cframes_[static_cast<size_t>(frame_[p])];
  return c.state == Frame::kPage || io().done(c.ticket);
}

size_t Pager::make_resident(size_t p) {
  const int64_t now = in_pass_ ? pos_[p] : -1;
  if (tier_[p] != Tier::kCompute)
    PO_ASSERT(bring_in(p, now, true), "Pager: no compute frame for page ", p);
  const auto f = static_cast<size_t>(frame_[p]);
  FrameState& c = cframes_[f];
  if (c.state == Frame::kReading) {
    wait_ticket(c.ticket);
    check_read(p, compute_frame(f));
    c.state = Frame::kPage;
  }
  return f;
}

void Pager::for_each(const std::function<void(size_t page, char* data)>& fn) {
  core::Timer pass;
  const auto n = static_cast<int64_t>(tier_.size());
  in_pass_ = true;
  for (int64_t k = 0; k < n; ++k) pos_[static_cast<size_t>(forward_ ? k : n - 1 - k)] = k;
  auto page_at = [&](int64_t k) { return static_cast<size_t>(forward_ ? k : n - 1 - k); };
  // Frames kept free or being written back, ahead of the reads.
  const int64_t spare = std::max<int64_t>(
      1, std::min<int64_t>(options_.prefetch + 1,
                           static_cast<int64_t>(usable_frames()) - options_.prefetch - 1));
  const bool streams = n > static_cast<int64_t>(usable_frames());
  // How far ahead reads go: memory.prefetch at least, deeper where frames
  // allow (the one in use and the spare ones aside): lent frames make it deep.
  // memory.prefetch = 0 turns reading ahead off.
  const int64_t ahead =
      options_.prefetch == 0
          ? 0
          : std::max<int64_t>(options_.prefetch, static_cast<int64_t>(usable_frames()) - spare - 1);
  for (int64_t k = 0; k < n; ++k) {
    const size_t p = page_at(k);
    count_access(p);
    if (tier_[p] != Tier::kCompute) bring_in(p, k, true);
    for (int64_t j = 1; j <= ahead && k + j < n; ++j)
      if (!bring_in(page_at(k + j), k)) break;
    const size_t f = make_resident(p);
    fn(p, compute_frame(f));
    zero_[p] = false;
    on_nvme_[p] = false;
    // Write back behind: pages this pass is done with (their next use is in
    // the next pass) leave first, so the reads ahead find frames; a page
    // still ahead in this pass is never written out for it.
    if (streams) {
      auto ready = static_cast<int64_t>(takeable_frames());
      while (ready < spare) {
        const int64_t victim = furthest(cframes_, k, n - 1 - k);
        if (victim < 0) break;
        evict_compute(static_cast<size_t>(victim), k);
        ++ready;
      }
    }
  }
  in_pass_ = false;
  std::fill(pos_.begin(), pos_.end(), -1);
  if (options_.alternate) forward_ = !forward_;
  write_behind_lent();
  stats_.pass_s += pass.seconds();
}

void Pager::count_access(size_t p) {
  ++stats_.accesses;
  if (ready(p)) {
    ++stats_.hits;
  } else if (tier_[p] == Tier::kHost) {
    ++stats_.host_hits;
  }
}

size_t Pager::usable_frames() const {
  size_t n = 0;
  for (const auto& c : cframes_) n += c.state != Frame::kAway ? 1 : 0;
  return n;
}

size_t Pager::free_frames() const {
  size_t n = 0;
  for (const auto& c : cframes_) n += c.state == Frame::kFree ? 1 : 0;
  return n;
}

size_t Pager::takeable_frames() const {
  size_t n = 0;
  for (const auto& c : cframes_) n += c.state == Frame::kFree || c.state == Frame::kWriting;
  return n;
}

int64_t Pager::writing_frame(size_t p) const {
  for (size_t f = 0; f < cframes_.size(); ++f)
    if (cframes_[f].state == Frame::kWriting && cframes_[f].page == p) return static_cast<int64_t>(f);
  return -1;
}

// Between passes the frames free or written back from (the oldest write
// waited for: long done by now) take the next pass's pages in its order;
// a page needed sooner is never evicted for one needed later.
void Pager::read_ahead() {
  const auto n = static_cast<int64_t>(tier_.size());
  for (int64_t k = 0; k < n; ++k) {
    if (takeable_frames() == 0) break;
    const auto p = static_cast<size_t>(forward_ ? k : n - 1 - k);
    if (tier_[p] == Tier::kCompute || writing_frame(p) >= 0) continue;
    const bool from_nvme = tier_[p] == Tier::kNvme && !zero_[p];
    if (!bring_in(p, -1)) break;
    if (from_nvme) stats_.lent_read_bytes += options_.page_bytes;
  }
}

size_t Pager::lend(int region, char* base, size_t bytes, bool read_ahead_pages) {
  PO_ASSERT(!in_pass_, "Pager::lend inside a pass");
  PO_CHECK(region >= 0, "Pager::lend: region ", region, " must be >= 0");
  if (static_cast<size_t>(region) >= regions_.size()) regions_.resize(static_cast<size_t>(region) + 1);
  Region& r = regions_[static_cast<size_t>(region)];
  for (size_t f : r.frames)
    PO_ASSERT(cframes_[f].state == Frame::kAway, "Pager::lend: region ", region, " is lent already");
  if (r.base != base || r.bytes != bytes) {  // new memory: new frames (old ones stay away)
    r = Region{base, bytes, {}};
    const auto addr = reinterpret_cast<uintptr_t>(base);
    const uintptr_t first = (addr + 4095) & ~uintptr_t{4095};
    const size_t n = frames_in(addr, bytes, options_.page_bytes);
    for (size_t i = 0; i < n; ++i) {
      r.frames.push_back(cframes_.size());
      cframes_.push_back({Frame::kAway, 0, 0, region});
      cdata_.push_back(reinterpret_cast<char*>(first + i * options_.page_bytes));
    }
  }
  for (size_t f : r.frames) cframes_[f].state = Frame::kFree;
  if (read_ahead_pages && options_.order == PagerOptions::Order::kPasses) read_ahead();
  return r.frames.size();
}

void Pager::claim(int region) {
  PO_ASSERT(!in_pass_, "Pager::claim inside a pass");
  if (region < 0 || static_cast<size_t>(region) >= regions_.size()) return;
  const double waited = stats_.wait_s;
  for (size_t f : regions_[static_cast<size_t>(region)].frames) {
    FrameState& c = cframes_[f];
    switch (c.state) {
      case Frame::kAway:
      case Frame::kFree:
        break;
      case Frame::kWriting:
        wait_ticket(c.ticket);
        break;
      case Frame::kReading:  // a read ahead not used yet: its NVMe copy is current
        wait_ticket(c.ticket);
        tier_[c.page] = Tier::kNvme;
        frame_[c.page] = -1;
        break;
      case Frame::kPage:
        evict_compute(f, -1);  // to the host tier, to NVMe, or dropped when clean
        if (c.state == Frame::kWriting) wait_ticket(c.ticket);
        break;
    }
    c.state = Frame::kAway;
  }
  stats_.claim_wait_s += stats_.wait_s - waited;
}

void Pager::claim_all() {
  for (size_t r = 0; r < regions_.size(); ++r) claim(static_cast<int>(r));
}

void Pager::write_behind_lent() {
  for (const Region& r : regions_)
    for (size_t f : r.frames) {
      const FrameState& c = cframes_[f];
      if (c.state == Frame::kPage && !zero_[c.page] && !on_nvme_[c.page]) evict_compute(f, -1);
    }
}

void Pager::access(size_t p, const std::function<void(char* data)>& fn, bool dirty) {
  PO_ASSERT(!in_pass_, "Pager::access inside a pass");
  PO_CHECK(p < tier_.size(), "Pager: page ", p, " out of range (", tier_.size(), " pages)");
  count_access(p);
  if (p != cursor_) ascending_ = p > cursor_;
  cursor_ = p;
  const size_t f = make_resident(p);
  fn(compute_frame(f));
  if (dirty) {
    zero_[p] = false;
    on_nvme_[p] = false;
  }
}

void Pager::discard(size_t p) {
  PO_ASSERT(!in_pass_, "Pager::discard inside a pass");
  PO_CHECK(p < tier_.size(), "Pager: page ", p, " out of range (", tier_.size(), " pages)");
  for (auto& c : cframes_)  // a write back or a read of it in flight: let it land, then drop it
    if ((c.state == Frame::kWriting || c.state == Frame::kReading) && c.page == p) {
      wait_ticket(c.ticket);
      c.state = c.state == Frame::kWriting ? Frame::kFree : Frame::kPage;
    }
  if (tier_[p] == Tier::kCompute)
    std::memset(compute_frame(static_cast<size_t>(frame_[p])), 0, options_.page_bytes);
  else if (tier_[p] == Tier::kHost)
    std::memset(host_frame(static_cast<size_t>(frame_[p])), 0, options_.page_bytes);
  zero_[p] = true;
  on_nvme_[p] = false;
}

void Pager::prefetch(size_t p) {
  PO_ASSERT(!in_pass_, "Pager::prefetch inside a pass");
  PO_CHECK(p < tier_.size(), "Pager: page ", p, " out of range (", tier_.size(), " pages)");
  if (tier_[p] == Tier::kCompute) return;
  // Following accesses, a page needed later than p may make room for it.
  if (options_.order == PagerOptions::Order::kFollowAccesses) {
    bring_in(p, -1);
    return;
  }
  // Only into a frame that is free now: a hint never evicts, and leaves one
  // frame for the pages needed at once.
  if (free_frames() >= 2) bring_in(p, -1);
}

PagerStats Pager::take_stats() {
  PagerStats s = stats_;
  stats_ = {};
  if (store_) {
    const double r = store_->busy_seconds(true), w = store_->busy_seconds(false);
    s.read_busy_s = r - read_busy_seen_;
    s.write_busy_s = w - write_busy_seen_;
    read_busy_seen_ = r;
    write_busy_seen_ = w;
  }
  return s;
}

std::vector<size_t> split_frames(size_t frames, const std::vector<size_t>& pages, size_t least) {
  std::vector<size_t> kept(pages.size());
  for (size_t i = 0; i < pages.size(); ++i) kept[i] = std::min(pages[i], least);
  return split_frames(frames, pages, kept);
}

std::vector<size_t> split_frames(size_t frames, const std::vector<size_t>& pages, const std::vector<size_t>& least) {
  PO_ASSERT(least.size() == pages.size(), "split_frames: ", least.size(), " minima for ", pages.size(), " pagers");
  size_t total = 0, kept = 0;
  for (size_t i = 0; i < pages.size(); ++i) {
    total += pages[i];
    kept += std::min(pages[i], least[i]);
  }
  if (frames >= total) return pages;
  const size_t spare = frames > kept ? frames - kept : 0;
  std::vector<size_t> out(pages.size());
  size_t given = 0;
  for (size_t i = 0; i < pages.size(); ++i) {
    out[i] = std::min(pages[i], std::min(pages[i], least[i]) + spare * pages[i] / total);
    given += out[i];
  }
  // Rounding leftovers to whoever has room, in order.
  for (size_t i = 0; i < pages.size() && given < frames; ++i) {
    const size_t more = std::min(pages[i] - out[i], frames - given);
    out[i] += more;
    given += more;
  }
  return out;
}

}  // namespace po::memory
