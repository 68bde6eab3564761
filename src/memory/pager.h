// The pager: N fixed-size pages that live in one of three tiers — a frame of
// the compute tier (where the optimizer reads and writes them), a frame of
// the host tier (a RAM cache below it), or a slot of the NVMe swap file — and
// move between them along an access order that is known in advance.
//
// A pass (for_each) visits every page once, forward on even passes and in
// reverse on odd ones (`alternate`), so the pages a pass touched last are the
// first the next one needs and are still resident. Around the page being
// used:
//   - prefetch: the next `prefetch` pages of the pass (more where frames
//     allow: all but the one in use and the few kept for write back) are
//     brought into free
//     compute frames ahead of use (NVMe reads in flight, host copies done);
//   - eviction: when a frame is needed the victim is the resident page whose
//     next use is furthest away (Belady's choice, exact here because the
//     order of this pass and the next is known);
//   - write-back behind: a page leaving the compute tier goes to a free host
//     frame (a copy) or is written to its NVMe slot asynchronously; its frame
//     is reused once the write completes. A page leaving the host tier is
//     written to NVMe at once (the slow write stays off the compute side).
// Pages start as zeros without any I/O. Each page written to NVMe carries an
// XXH3 checksum, verified when it is read back; a mismatch, a short read, EIO
// or ENOSPC stops with core::IoError naming the page, the file and the tier.
//
// Frames are tensor::Storage of the compute and host pools, so the budgets
// set on those pools (memory.compute_budget, memory.host_budget) bound them.
//
// Lent frames: memory the engine already holds but does not use for a while
// (the activations of a block once the last backward through it is done,
// until its next forward) can be lent to the pager as extra compute frames
// (lend), and taken back (claim). Lent memory is counted where it was
// allocated, so lending never moves the compute pool. The pager uses them as
// follows, every decision from the order of calls alone:
//   - lend, between passes: the new frames are filled at once with reads of
//     the pages the next pass needs first that are not resident (a read
//     ahead of the whole sweep, while the backward runs on);
//   - in a pass, lent frames are frames like the others; reads go as far
//     ahead as the frames allow (memory.prefetch pages at least);
//   - at a pass's end every changed page in a lent frame starts its write
//     back, in the order the regions will be claimed (the writes run behind
//     the next forward); a claim waits only for what is still in flight.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "memory/nvme_store.h"
#include "tensor/tensor.h"

namespace po::memory {

struct PagerOptions {
  size_t page_bytes = size_t{4} << 20;  // a multiple of 4096 (memory.page_size)
  size_t compute_frames = 0;            // pages resident in the compute tier at once
  size_t host_frames = 0;               // pages the host tier caches
  int prefetch = 2;                     // pages brought in ahead of use
  bool alternate = true;                // reverse the order every pass
  std::string nvme_dir;                 // needed when pages > compute + host frames
  std::string file_name = "pagedoptim.swap";
  NvmeOptions nvme;
  // What "next use" means outside passes. kPasses: the next pass (the
  // optimizer's state pages: between sweeps they wait for the next one).
  // kFollowAccesses: pages with no passes of their own, walked up or down
  // (ZeRO-Infinity's parameter and gradient shards: gathers ascend in the
  // forward and descend in the backward): the pages just behind the last
  // access, in the direction it moved, are used furthest ahead.
  enum class Order : uint8_t { kPasses, kFollowAccesses };
  Order order = Order::kPasses;
};

// Traffic and waiting since the last take_stats(). Bytes count requests
// as the pager starts them, so they follow its decisions, not I/O timing.
struct PagerStats {
  uint64_t nvme_read_bytes = 0, nvme_written_bytes = 0;
  uint64_t host_read_bytes = 0, host_written_bytes = 0;  // copies host -> compute, compute -> host
  // Every access found its page in one tier: hits (the compute tier, its
  // read done), host_hits (a copy from the host tier), and the rest waited
  // for NVMe (a read in flight or started then).
  uint64_t accesses = 0, hits = 0, host_hits = 0;
  uint64_t lent_read_bytes = 0;     // NVMe reads into lent frames started outside passes
  double wait_s = 0;                // waiting for reads and writes
  double claim_wait_s = 0;          //   of which: claims waiting for their frames' writes
  double pass_s = 0;                // inside for_each (the optimizer's sweep over the pages)
  double read_busy_s = 0, write_busy_s = 0;  // the swap file's disk busy reading / writing
  double hit_rate() const { return accesses ? static_cast<double>(hits) / accesses : 1.0; }
  // Adds another pager's traffic (`sweep`: its pass_s too).
  void add(const PagerStats& t, bool sweep = true) {
    nvme_read_bytes += t.nvme_read_bytes;
    nvme_written_bytes += t.nvme_written_bytes;
    host_read_bytes += t.host_read_bytes;
    host_written_bytes += t.host_written_bytes;
    accesses += t.accesses;
    hits += t.hits;
    host_hits += t.host_hits;
    lent_read_bytes += t.lent_read_bytes;
    wait_s += t.wait_s;
    claim_wait_s += t.claim_wait_s;
    read_busy_s += t.read_busy_s;
    write_busy_s += t.write_busy_s;
    if (sweep) pass_s += t.pass_s;
  }
};

class Pager {
 public:
  // The fewest compute frames a pager with `prefetch` works with: the page in
  // use, the ones read ahead, and one to write back from.
  static size_t min_compute_frames(int prefetch) { return static_cast<size_t>(prefetch) + 2; }

  Pager(size_t pages, const PagerOptions& options);
  ~Pager();
  Pager(const Pager&) = delete;
  Pager& operator=(const Pager&) = delete;

  size_t pages() const { return tier_.size(); }
  size_t page_bytes() const { return options_.page_bytes; }
  // fn(page, data) for every page with the page in the compute tier; every
  // page is written back afterwards (dirty).
  void for_each(const std::function<void(size_t page, char* data)>& fn);
  // One page, outside the passes (checkpoints, initialisation): resident while
  // fn runs; `dirty` when fn changes it.
  void access(size_t page, const std::function<void(char* data)>& fn, bool dirty);

  // Outside passes: page p is all zeros from now on, wherever it is: it is
  // zeroed where resident and its stale copies are dropped, so neither
  // keeping nor bringing it back costs I/O (gradients once consumed).
  void discard(size_t p);

  // Outside passes: start bringing page p into the compute tier (a read from
  // NVMe runs on while the caller goes on) if a frame can be had without
  // evicting a page needed sooner — kPasses: only a free frame (the next
  // pass's pages stay); kFollowAccesses: a page the walk needs later may go.
  // A hint: access() waits.
  void prefetch(size_t p);

  // Outside passes: `bytes` at `base` are this pager's as compute frames
  // (as many whole 4096-aligned pages as fit) until claim(region); a region
  // lent again at the same place reuses its frames. Returns the frames lent.
  // The free frames are then filled with the next pass's first pages
  // (unless !read_ahead: pages are updated outside passes, in their order).
  size_t lend(int region, char* base, size_t bytes, bool read_ahead = true);
  // Outside passes: region's memory is the owner's again when this returns:
  // changed pages in it are written (waited for) or moved, the rest dropped.
  void claim(int region);
  void claim_all();
  // Outside passes: changed pages in lent frames start their writes, regions
  // in the order they will be claimed (ascending ids); for_each does it at
  // its end, an owner that updates pages outside passes calls it after.
  void write_behind_lent();
  // Compute frames that hold pages or can: the own ones and those lent now.
  size_t usable_frames() const;
  // The frames lend() makes of `bytes` at address (or offset) `start`.
  static size_t frames_in(uintptr_t start, size_t bytes, size_t page_bytes) {
    const uintptr_t first = (start + 4095) & ~uintptr_t{4095};
    return first + page_bytes <= start + bytes ? (start + bytes - first) / page_bytes : 0;
  }

  PagerStats take_stats();
  // Pages in each tier now, and where the NVMe tier lives.
  size_t resident(Tier t) const;
  const NvmeStore* store() const { return store_.get(); }
  const PagerOptions& options() const { return options_; }

 private:
  // kAway: a lent frame its owner has claimed back.
  enum class Frame : uint8_t { kFree, kPage, kReading, kWriting, kAway };
  struct FrameState {
    Frame state = Frame::kFree;
    size_t page = 0;
    NvmeStore::Ticket ticket = 0;
    int region = -1;  // lent frames: the region they belong to
  };
  struct Region {
    char* base = nullptr;
    size_t bytes = 0;
    std::vector<size_t> frames;
  };
  char* compute_frame(size_t f) { return cdata_[f]; }
  // Between passes: the next pass's pages, first first, into free frames
  // (never evicting, never waiting).
  void read_ahead();
  size_t free_frames() const;
  // Frames free or being written back from: a frame can be had without
  // evicting a page.
  size_t takeable_frames() const;
  // An access to page p, by the tier it is found in (PagerStats' hits).
  void count_access(size_t p);
  // Page p's write back in flight from a compute frame: that frame, or -1.
  int64_t writing_frame(size_t p) const;
  char* host_frame(size_t f) { return host_ + f * options_.page_bytes; }
  // Brings page p into a compute frame (starting a read when it is on NVMe);
  // false when no frame can be had without evicting a page needed sooner
  // (unless `demand`: needed now, any page but those in use may go).
  bool bring_in(size_t p, int64_t now, bool demand = false);
  bool ready(size_t p);
  // Waits for page p's read, verifies it; returns its frame.
  size_t make_resident(size_t p);
  int64_t next_use(size_t p, int64_t now) const;
  // A compute frame to use: a free one, one whose write completed, or one
  // freed by evicting the page used furthest in the future (not before
  // `limit`); -1 when none.
  int64_t take_compute_frame(int64_t now, int64_t limit);
  void evict_compute(size_t f, int64_t now);
  int64_t take_host_frame(int64_t now, int64_t limit);
  // The frame of `frames` holding the page used furthest ahead, if its next
  // use is after `limit`; -1 when none.
  int64_t furthest(const std::vector<FrameState>& frames, int64_t now, int64_t limit) const;
  void write_to_nvme(size_t p, const char* data, NvmeStore::Ticket* ticket);
  void wait_ticket(NvmeStore::Ticket t);
  void check_read(size_t p, const char* data);
  NvmeStore& io();

  PagerOptions options_;
  tensor::Storage compute_storage_, host_storage_;
  char* compute_ = nullptr;
  char* host_ = nullptr;
  std::vector<FrameState> cframes_, hframes_;
  std::vector<char*> cdata_;          // per compute frame: its memory (own frames first)
  std::vector<Region> regions_;       // lent memory, by region id
  std::vector<Tier> tier_;            // per page
  std::vector<int64_t> frame_;        // per page: its compute or host frame, or -1
  std::vector<bool> zero_;            // per page: never written (all zeros)
  std::vector<uint64_t> checksum_;    // per page: of its NVMe copy
  std::vector<bool> on_nvme_;         // per page: its NVMe copy is current
  std::unique_ptr<NvmeStore> store_;
  // The current pass: position of each page, and the direction of the next.
  std::vector<int64_t> pos_;          // position in the current pass, or -1 outside passes
  bool forward_ = true;               // direction of the current / next pass
  bool in_pass_ = false;
  size_t cursor_ = 0;      // kFollowAccesses: the page accessed last
  bool ascending_ = true;  //   and the direction accesses moved in
  PagerStats stats_;
  double read_busy_seen_ = 0, write_busy_seen_ = 0;  // the store's busy seconds at take_stats()
};

// `frames` split over pagers of `pages` pages: each keeps min(its pages,
// `least`), the rest goes out in proportion to their pages, none gets more
// than its pages (all of them when everything fits); the shares add up to
// min(frames, Σ pages) whenever frames covers the kept ones.
std::vector<size_t> split_frames(size_t frames, const std::vector<size_t>& pages, size_t least);
// The same with each pager's own minimum (least[i] <= pages[i]: a pager of
// several, optim::PagedState, keeps one per field).
std::vector<size_t> split_frames(size_t frames, const std::vector<size_t>& pages, const std::vector<size_t>& least);

}  // namespace po::memory
