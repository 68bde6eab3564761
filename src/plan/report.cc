// The plan as a person reads it (format_plan, format_search) and as a
// script does (plan_json).
#include <algorithm>
#include <cstdio>

#include "core/error.h"
#include "plan/planner.h"

namespace po::plan {
namespace {

std::string human_bytes(double b) {
  char buf[32];
  if (b >= kGiB) std::snprintf(buf, sizeof buf, "%.2f GiB", b / kGiB);
  else if (b >= 1 << 20) std::snprintf(buf, sizeof buf, "%.1f MiB", b / (1 << 20));
  else std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024);
  return buf;
}

std::string human_time(double s) {
  char buf[32];
  if (s >= 1) std::snprintf(buf, sizeof buf, "%.2f s", s);
  else if (s >= 1e-3) std::snprintf(buf, sizeof buf, "%.1f ms", s * 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f us", s * 1e6);
  return buf;
}

}  // namespace

std::string format_plan(const Plan& p) {
  std::string t;
  char line[256];
  std::snprintf(line, sizeof line, "plan: %s (%.2fB parameters) on %s, %d × %d devices\n", p.model.name.c_str(),
                static_cast<double>(p.model.num_params()) / 1e9, p.cluster.name.c_str(), p.cluster.nodes,
                p.cluster.devices_per_node);
  t += line;
  t += "layout: " + p.layout.describe() + core::str_cat(", batch ", p.layout.batch, " × ", p.layout.seq,
                                                           " tokens, ", p.layout.accum(), " micro-batches per step\n");
  t += p.engine_exact ? "model: the engine's own layout (exact)\n"
       : p.not_trainable.empty()
           ? "model: the pipeline executor's memory and messages (exact), analytic time and bubble\n"
           : "model: analytic (ZeRO ledger, Korthikanti et al. activations)\n";
  if (!p.not_trainable.empty()) {
    std::string why;
    for (const auto& w : p.not_trainable) why += (why.empty() ? "" : ", ") + w;
    t += "NOT YET TRAINABLE by the engine: " + why + "\n";
  }
  t += "\nmemory per rank\n";
  for (const MemoryItem& m : p.memory) {
    std::snprintf(line, sizeof line, "  %-24s %12s  %-8s %s\n", m.name.c_str(), human_bytes(m.bytes).c_str(),
                  memory::tier_name(m.tier), m.note.c_str());
    t += line;
  }
  const double overhead = p.device_peak - p.compute_peak;
  std::snprintf(line, sizeof line, "  %-24s %12s\n", "framework overhead", human_bytes(overhead).c_str());
  t += line;
  std::snprintf(line, sizeof line, "  %-24s %12s  of %s per device%s\n", "peak (compute tier)",
                human_bytes(p.device_peak).c_str(), human_bytes(p.cluster.device_memory).c_str(),
                p.fits ? "" : "  DOES NOT FIT");
  t += line;
  std::snprintf(line, sizeof line, "  activations: %s without checkpointing, %s with\n",
                human_bytes(p.activations_no_ckpt).c_str(), human_bytes(p.activations_ckpt).c_str());
  t += line;
  if (p.engine_exact) {
    std::snprintf(line, sizeof line,
                  "  (Korthikanti et al., 16-bit, flash-style attention, this layout: %s; the engine's kernels\n"
                  "   save %s activations and keep one layer's f32 working set)\n",
                  human_bytes(p.activations_formula).c_str(), p.layout.bf16 ? "bf16" : "f32");
    t += line;
  }
  t += "\ncommunication per rank per step\n";
  if (p.comm.empty()) t += "  none (one rank)\n";
  for (const CommItem& c : p.comm) {
    std::snprintf(line, sizeof line, "  %-3s %-15s %6llu calls %12s payload %12s sent %10s %s  %s\n", c.dim.c_str(),
                  c.op.c_str(), static_cast<unsigned long long>(c.calls), human_bytes(c.bytes).c_str(),
                  human_bytes(c.wire_bytes).c_str(), human_time(c.seconds).c_str(),
                  c.overlaps ? "overlaps" : "exposed ", c.what.c_str());
    t += line;
  }
  t += "\ntime per step\n";
  std::snprintf(line, sizeof line,
                "  compute %s (%.3g FLOP, %.0f%% of peak), pipeline bubble %s%s, communication %s of which "
                "exposed %s, paging I/O %s\n",
                human_time(p.compute_s).c_str(), p.model_flops, p.cluster.efficiency * 100,
                human_time(p.bubble_s).c_str(),
                p.layout.pp > 1 ? core::str_cat(" (", static_cast<int>(p.bubble_stages * 1000) / 10.0,
                                                "% of the step with the stages' costs; the schedule's ",
                                                static_cast<int>(p.bubble * 1000) / 10.0, "%)").c_str()
                                : "",
                human_time(p.comm_s).c_str(),
                human_time(p.exposed_comm_s).c_str(), human_time(p.io_s).c_str());
  t += line;
  if (p.io_total_s > 0) {
    std::snprintf(line, sizeof line,
                  "  paging: %s of page I/O per step, %s of it under the backward (reads) and %s behind "
                  "the forward (writes) in %.0f lent frames; limit when everything overlaps %s\n",
                  human_time(p.io_total_s).c_str(), human_time(p.io_under_backward_s).c_str(),
                  human_time(p.io_under_forward_s).c_str(), p.lent_frames, human_time(p.io_limit_s).c_str());
    t += line;
  }
  std::snprintf(line, sizeof line, "  step %s, %.0f tokens/s, MFU %.1f%%\n", human_time(p.step_s).c_str(),
                p.tokens_per_s, p.mfu * 100);
  t += line;
  for (const auto& r : p.rejections) t += "  does not fit: " + r + "\n";
  return t;
}

std::string format_search(const SearchResult& r, size_t top) {
  std::string t;
  char line[320];
  std::snprintf(line, sizeof line, "%zu layouts fit, %zu do not, %zu break a constraint\n\n", r.fitting.size(),
                r.rejected.size(), r.invalid);
  t += line;
  std::snprintf(line, sizeof line, "  %-3s %-66s %12s %10s %7s %11s  %s\n", "#", "layout", "peak/device",
                "step", "MFU", "tokens/s", "trainable");
  t += line;
  for (size_t i = 0; i < std::min(top, r.fitting.size()); ++i) {
    const Plan& p = r.fitting[i];
    std::snprintf(line, sizeof line, "  %-3zu %-66s %12s %10s %6.1f%% %11.0f  %s\n", i + 1,
                  p.layout.describe().c_str(), human_bytes(p.device_peak).c_str(), human_time(p.step_s).c_str(),
                  p.mfu * 100, p.tokens_per_s, p.not_trainable.empty() ? "yes" : "not yet");
    t += line;
  }
  if (!r.rejected.empty()) {
    t += "\nfastest layouts that do not fit:\n";
    for (size_t i = 0; i < std::min<size_t>(5, r.rejected.size()); ++i) {
      const Plan& p = r.rejected[i];
      t += "  " + p.layout.describe() + ": " + p.rejections.front() + "\n";
    }
  }
  return t;
}

nlohmann::json plan_json(const Plan& p) {
  nlohmann::json j;
  j["model"] = {{"name", p.model.name}, {"parameters", p.model.num_params()}, {"n_layer", p.model.n_layer},
                {"n_embd", p.model.n_embd}, {"n_head", p.model.n_head}, {"vocab", p.model.vocab}};
  j["cluster"] = {{"name", p.cluster.name}, {"nodes", p.cluster.nodes},
                  {"devices_per_node", p.cluster.devices_per_node}, {"device_memory", p.cluster.device_memory}, {"overhead", p.cluster.overhead},
                  {"source", p.cluster.source}};
  const Layout& l = p.layout;
  j["layout"] = {{"dp", l.dp}, {"tp", l.tp}, {"pp", l.pp}, {"cp", l.cp}, {"zero_stage", l.zero_stage},
                 {"precision", l.bf16 ? "bf16" : "fp32"}, {"micro_batch_size", l.micro},
                 {"batch_size", l.batch}, {"seq_len", l.seq}, {"activation_checkpointing", l.checkpointing},
                 {"paging", l.paging}, {"accum", l.accum()}};
  j["engine_exact"] = p.engine_exact;
  j["trainable"] = p.not_trainable.empty();
  j["not_trainable"] = p.not_trainable;
  nlohmann::json mem = nlohmann::json::array();
  for (const MemoryItem& m : p.memory)
    mem.push_back({{"name", m.name}, {"bytes", m.bytes}, {"tier", memory::tier_name(m.tier)}, {"note", m.note}});
  j["memory"] = mem;
  j["compute_peak_bytes"] = p.compute_peak;
  j["device_peak_bytes"] = p.device_peak;
  j["host_bytes"] = p.host_bytes;
  j["nvme_bytes"] = p.nvme_bytes;
  j["min_compute_budget"] = p.min_compute_budget;
  j["activations_no_ckpt_bytes"] = p.activations_no_ckpt;
  j["activations_ckpt_bytes"] = p.activations_ckpt;
  if (p.engine_exact) j["activations_formula_bytes"] = p.activations_formula;
  nlohmann::json comm = nlohmann::json::array();
  for (const CommItem& c : p.comm)
    comm.push_back({{"dim", c.dim}, {"op", c.op}, {"what", c.what}, {"calls", c.calls}, {"bytes", c.bytes},
                    {"wire_bytes", c.wire_bytes}, {"seconds", c.seconds}, {"overlaps", c.overlaps}});
  j["comm"] = comm;
  j["time"] = {{"model_flops", p.model_flops}, {"compute_s", p.compute_s}, {"bubble_s", p.bubble_s},
               {"bubble", p.bubble}, {"bubble_stages", p.bubble_stages},
               {"comm_s", p.comm_s}, {"exposed_comm_s", p.exposed_comm_s}, {"io_s", p.io_s}, {"io_total_s", p.io_total_s},
               {"io_under_backward_s", p.io_under_backward_s}, {"io_under_forward_s", p.io_under_forward_s},
               {"io_limit_s", p.io_limit_s}, {"lent_frames", p.lent_frames},
               {"step_s", p.step_s}, {"tokens_per_s", p.tokens_per_s}, {"mfu", p.mfu}};
  j["fits"] = p.fits;
  j["rejections"] = p.rejections;
  return j;
}

}  // namespace po::plan
