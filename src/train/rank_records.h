// What every rank reports after a step, gathered to every rank in one
// collective: its memory by kind (the executor's ledger, MemoryReport's
// kinds, plus the process's peak RSS), when its backward
// ended (for the exposed-communication split) and its paging traffic; and
// their forms in metrics.jsonl and the log.
#pragma once

#include <array>
#include <cstdint>
#include <iterator>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "memory/pager.h"
#include "parallel/memory_report.h"

namespace po::train {

// "peak": the compute pool's high-water mark (every tensor::Storage the
// engine allocates, transient ones included) since set-up ended; in the
// set-up table, the peak of set-up itself.
inline constexpr const char* kMemoryKinds[] = {
    "params",      "grads", "master", "adam",  "gathered", "buckets",
    "activations", "pages", "host",   "total", "peak",     "peak_rss"};
inline constexpr size_t kMemoryFields = std::size(kMemoryKinds);
using MemoryRow = std::array<uint64_t, kMemoryFields>;

// Paging, per rank (all zero without): see paging_json().
inline constexpr const char* kPagingKinds[] = {
    "resident_compute_bytes", "resident_host_bytes", "resident_nvme_bytes",
    "nvme_read_bytes",        "nvme_written_bytes",  "host_read_bytes",
    "host_written_bytes",     "accesses",            "hits",
    "io_wait_us",             "pass_us",             "pages_updated_in_backward",
    "host_hits",              "lent_read_bytes",     "claim_wait_us",
    "lent_frames",            "read_busy_us",        "write_busy_us"};
using PagingRow = std::array<uint64_t, std::size(kPagingKinds)>;

struct RankRecord {
  MemoryRow memory;
  int64_t backward_end_ns;
  PagingRow paging;
  // Context parallel: the step's milliseconds in attention blocks and
  // blocked on the ring (or the gather) that the blocks did not hide.
  double cp_attention_ms = 0, cp_wait_ms = 0;
};
static_assert(sizeof(RankRecord) % sizeof(int32_t) == 0);

// What one rank says of itself after a step (PipelineExecutor::memory_report, paging_report).
struct RankReport {
  parallel::MemoryReport memory;
  parallel::PagingReport paging;
  int64_t backward_end_ns = 0;
  double cp_attention_ms = 0, cp_wait_ms = 0;  // (RankRecord's)
};

// One row per rank (a collective over `world`; null: this process's only).
std::vector<RankRecord> gather_records(comm::Communicator* world, const RankReport& mine,
                                       const memory::PagerStats& paging = {});

// metrics.jsonl's memory_per_rank: one object per rank, keyed by kMemoryKinds.
nlohmann::json memory_json(const std::vector<RankRecord>& rows);

// The step's collectives on the data-parallel group: {"allreduce": {"calls":
// c, "bytes": b}, ...}, operations that ran only (payload bytes: comm::Traffic).
nlohmann::json traffic_json(const comm::Traffic& t);

// The log's table, MiB per rank and kind; `note`, when given, a last line.
std::string memory_table(const std::vector<RankRecord>& rows, const std::string& note = "");
// The same table of any kinds: `title`, then a row per rank of bytes, in MiB.
std::string memory_table(const std::string& title, const std::vector<const char*>& kinds,
                         const std::vector<std::vector<uint64_t>>& rows, const std::string& note = "");

// `paging`: rank 0's traffic this step; `paging_per_rank`: every rank's.
nlohmann::json paging_json(int64_t step, const std::vector<RankRecord>& rows);

}  // namespace po::train
