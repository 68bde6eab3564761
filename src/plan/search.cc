// The layout search: every factorisation of the devices into dp × tp × pp ×
// cp, each ZeRO stage, micro-batch and checkpointing choice (and with pp > 1
// the head on the last stage or spread over the ranks), paged only where
// the unpaged layout does not fit; fitting plans ranked by tokens/s.
#include <algorithm>
#include <utility>
#include <vector>

#include "core/error.h"
#include "plan/planner.h"

namespace po::plan {

SearchResult search(const ModelSpec& model, const ClusterSpec& cluster, const Layout& base, int devices,
                    bool trainable_only) {
  SearchResult r;
  auto divisors = [](int n) {
    std::vector<int> d;
    for (int i = 1; i <= n; ++i)
      if (n % i == 0) d.push_back(i);
    return d;
  };
  // One layout, unpaged and (only where that does not fit) paged.
  auto consider = [&](const Layout& unpaged) {
    bool unpaged_fits = false;
    for (int paging = 0; paging < 2; ++paging) {
      Layout l = unpaged;
      l.paging = paging == 1;
      l.compute_budget = 0;
      l.host_budget = 0;
      l.nvme = false;
      if (l.paging) {
        if (unpaged_fits) return;  // paging only where the state does not fit otherwise
        if (l.tp * l.pp * l.cp == 1) {
          // The engine's pages: the device keeps what its memory
          // holds; the rest goes to host RAM (a GPU node) or NVMe
          // (a CPU node, whose host RAM is its device memory).
          const double device = cluster.memory_per_rank(devices);
          l.compute_budget = static_cast<uint64_t>(std::max(0.0, device - cluster.overhead));
          if (cluster.shared_cores) l.nvme = cluster.nvme_read_bw > 0;
          else l.host_budget = static_cast<uint64_t>(cluster.host_memory / cluster.devices_per_node);
        }
      }
      try {
        check_layout(model, l, devices);
      } catch (const core::Error&) {
        ++r.invalid;
        continue;
      }
      Plan p = make_plan(model, cluster, l);
      if (!l.paging) unpaged_fits = p.fits;
      if (trainable_only && !p.not_trainable.empty()) continue;
      (p.fits ? r.fitting : r.rejected).push_back(std::move(p));
    }
  };
  for (int tp : divisors(devices)) {
    if (tp > cluster.devices_per_node) continue;
    for (int pp : divisors(devices / tp)) {
      for (int cp : divisors(devices / tp / pp)) {
        if (cp > 8) continue;
        for (int stage = 0; stage <= 3; ++stage) {
          for (int64_t micro : {1, 2, 4, 8, 16}) {
            for (bool ckpt : {false, true}) {
              // With pp > 1 the head on the last stage, and spread over the
              // ranks (vocabulary parallel: fp32 at tp 1, as the engine trains it).
              for (bool vocab : {false, true}) {
                if (vocab && (pp == 1 || pp > 8 || tp > 1 || cp > 1 || base.bf16)) continue;
                Layout l = base;
                l.dp = devices / tp / pp / cp;
                l.tp = tp;
                l.pp = pp;
                l.cp = cp;
                l.zero_stage = stage;
                l.micro = micro;
                l.checkpointing = ckpt;
                l.vocab_parallel = vocab;
                consider(l);
              }
            }
          }
        }
      }
    }
  }
  auto faster = [](const Plan& a, const Plan& b) { return a.tokens_per_s > b.tokens_per_s; };
  std::stable_sort(r.fitting.begin(), r.fitting.end(), faster);
  std::stable_sort(r.rejected.begin(), r.rejected.end(), faster);
  return r;
}

}  // namespace po::plan
