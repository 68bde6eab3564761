// Per-rank records: gathered as int32 words (RankRecord is a whole number of
// them), so one all_gather carries memory, timing and paging together.
#include "train/rank_records.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "core/error.h"
#include "optim/adamw.h"
#include "tensor/tensor.h"
#include "train/metrics.h"

namespace po::train {
namespace {

PagingRow paging_row(const parallel::PagingReport& p, const memory::PagerStats& s) {
  return {p.resident_bytes[0],
          p.resident_bytes[1],
          p.resident_bytes[2],
          s.nvme_read_bytes,
          s.nvme_written_bytes,
          s.host_read_bytes,
          s.host_written_bytes,
          s.accesses,
          s.hits,
          static_cast<uint64_t>(s.wait_s * 1e6),
          static_cast<uint64_t>(s.pass_s * 1e6),
          p.pages_updated_in_backward,
          s.host_hits,
          s.lent_read_bytes,
          static_cast<uint64_t>(s.claim_wait_s * 1e6),
          p.lent_frames,
          static_cast<uint64_t>(s.read_busy_s * 1e6),
          static_cast<uint64_t>(s.write_busy_s * 1e6)};
}

// One rank's paging row as metrics: the same keys as the row, with the
// derived prefetch_hit_rate, hits_by_tier (where each access found its page:
// the compute tier ready, the host tier, or a wait for NVMe), io_wait_ms,
// pass_ms, claim_wait_ms (the forward waiting for lent frames).
nlohmann::json paging_object(const PagingRow& r) {
  nlohmann::json j;
  for (size_t k = 0; k < 7; ++k) j[kPagingKinds[k]] = r[k];
  const double accesses = static_cast<double>(r[7]);
  auto share = [&](uint64_t n) { return r[7] ? static_cast<double>(n) / accesses : 0.0; };
  j["accesses"] = r[7];
  j["prefetch_hit_rate"] = r[7] ? share(r[8]) : 1.0;
  j["hits_by_tier"] = {{"compute", share(r[8])},
                       {"host", share(r[12])},
                       {"nvme", share(r[7] - r[8] - r[12])}};
  j["io_wait_ms"] = static_cast<double>(r[9]) / 1000;
  j["pass_ms"] = static_cast<double>(r[10]) / 1000;
  j["pages_updated_in_backward"] = r[11];
  j["lent_frames"] = r[15];
  j["lent_read_bytes"] = r[13];
  j["claim_wait_ms"] = static_cast<double>(r[14]) / 1000;
  // The disk's time with reads (writes) in flight: bytes / these = the
  // bandwidth while it worked.
  j["read_busy_ms"] = static_cast<double>(r[16]) / 1000;
  j["write_busy_ms"] = static_cast<double>(r[17]) / 1000;
  return j;
}

RankRecord own_record(const RankReport& r, const memory::PagerStats& paging) {
  const parallel::MemoryReport& m = r.memory;
  return {{m.params, m.grads, m.master, m.adam, m.gathered, m.buckets, m.activations, m.pages, m.host, m.total(),
           tensor::pool_bytes_peak(tensor::Pool::kCompute), peak_rss_bytes()},
          r.backward_end_ns,
          paging_row(r.paging, paging),
          r.cp_attention_ms,
          r.cp_wait_ms};
}

std::vector<RankRecord> gather(comm::Communicator* world, const RankRecord& mine) {
  std::vector<RankRecord> rows(world ? static_cast<size_t>(world->size()) : 1);
  if (world)
    world->all_gather(&mine, rows.data(), sizeof(RankRecord) / sizeof(int32_t),
                      tensor::DType::kI32);
  else
    rows[0] = mine;
  return rows;
}

}  // namespace

std::vector<RankRecord> gather_records(comm::Communicator* world, const RankReport& mine,
                                       const memory::PagerStats& paging) {
  return gather(world, own_record(mine, paging));
}

nlohmann::json memory_json(const std::vector<RankRecord>& rows) {
  nlohmann::json out = nlohmann::json::array();
  for (const RankRecord& r : rows) {
    nlohmann::json j;
    for (size_t k = 0; k < kMemoryFields; ++k) j[kMemoryKinds[k]] = r.memory[k];
    out.push_back(j);
  }
  return out;
}

nlohmann::json traffic_json(const comm::Traffic& t) {
  nlohmann::json out = nlohmann::json::object();
  for (int i = 0; i < comm::kNumCommOps; ++i) {
    if (t.calls[i] == 0) continue;
    out[comm::comm_op_name(static_cast<comm::CommOp>(i))] = {{"calls", t.calls[i]},
                                                             {"bytes", t.bytes[i]}};
  }
  return out;
}

std::string memory_table(const std::string& title, const std::vector<const char*>& kinds,
                         const std::vector<std::vector<uint64_t>>& rows, const std::string& note) {
  std::string t = title + "\n  rank";
  for (const char* k : kinds) t += core::str_cat(" ", std::string(12 - std::min<size_t>(11, std::strlen(k)), ' '), k);
  for (size_t r = 0; r < rows.size(); ++r) {
    t += core::str_cat("\n  ", r < 10 ? "   " : "  ", r);
    for (uint64_t v : rows[r]) {
      char buf[32];
      std::snprintf(buf, sizeof buf, " %12.1f", static_cast<double>(v) / (1 << 20));
      t += buf;
    }
  }
  if (!note.empty()) t += "\n  " + note;
  return t;
}

std::string memory_table(const std::vector<RankRecord>& rows, const std::string& note) {
  std::vector<std::vector<uint64_t>> values;
  for (const RankRecord& r : rows) values.emplace_back(r.memory.begin(), r.memory.end());
  return memory_table("memory per rank (MiB):", {std::begin(kMemoryKinds), std::end(kMemoryKinds)}, values, note);
}

nlohmann::json paging_json(int64_t step, const std::vector<RankRecord>& rows) {
  nlohmann::json all = nlohmann::json::array();
  for (const RankRecord& r : rows) all.push_back(paging_object(r.paging));
  return {{"step", step}, {"paging", all[0]}, {"paging_per_rank", all}};
}

}  // namespace po::train
