// The table (capabilities.h).
#include "plan/capabilities.h"

#include "core/error.h"

namespace po::plan {

namespace {


// Adapters on a frozen base (lora.r > 0, model/layout.h): data parallel with
// ZeRO 0-3, context parallel, pipelines and paging (of the adapters'
// parameters and state: the frozen base is not paged), in fp32 or bf16, with
// activation checkpointing, so far.
void adapter_rows(const Layout& l, std::vector<Refusal>& out) {
  if (l.lora_r == 0) return;
  const auto row = [&](const std::string& with, const std::string& what) {
    out.push_back({core::str_cat("lora.r = ", l.lora_r, " with ", with),
                   " is not built yet; adapters train under data, context and pipeline parallel, ZeRO 0-3",
                   "adapters " + what});
  };
  if (l.pp > 1 && l.vocab_parallel)
    row("parallel.vocab_parallel", "with the vocabulary-parallel head");
  if (l.lora_dropout && l.cp > 1)
    out.push_back({core::str_cat("lora.dropout > 0 with parallel.cp = ", l.cp),
                   " is not built yet (the masks follow a token's place in the batch, not a chunk's)",
                   "adapter dropout with context parallel"});
  if (l.tp > 1) row(core::str_cat("parallel.tp = ", l.tp), "with tensor parallel");
}

// SFT data (data/sft.h): the loss over the counted targets under every
// layout; packed rows at cp = 1 (tensor parallel, sequence parallel and
// pipelines included).
void sft_rows(const Layout& l, std::vector<Refusal>& out) {
  if (!l.pack) return;
  if (l.cp > 1)
    out.push_back({core::str_cat("data.pack with parallel.cp = ", l.cp),
                   " is not built yet (examples cut across the context group's chunks); use data.pack = false",
                   "packed SFT rows with context parallel"});
}

// A mixture of experts (model.moe_experts, docs/moe.md): one rank's layer
// in every block, under data parallel with ZeRO 0-3, paging and pipelines
// whose backward is whole, in fp32, so far (tensor parallel, bf16 and
// serving are refused where the model is made: TransformerConfig).
void moe_rows(const Layout& l, std::vector<Refusal>& out) {
  if (l.moe_experts == 0) return;
  const std::string with = core::str_cat("model.moe_experts = ", l.moe_experts, " with ");
  if (l.cp > 1)
    out.push_back({with + core::str_cat("parallel.cp = ", l.cp),
                   " is not built yet (the balance loss counts whole sequences; a context rank holds a part)",
                   "a mixture of experts with context parallel"});
  if (l.pp > 1 && (l.schedule == parallel::pipeline::ScheduleKind::kZbH1 ||
                   l.schedule == parallel::pipeline::ScheduleKind::kZbV))
    out.push_back({with + "parallel.schedule = " + parallel::pipeline::schedule_name(l.schedule),
                   " is not built yet (the experts' weight gradients are not split from the backward); use "
                   "gpipe, 1f1b or interleaved",
                   "a mixture of experts under a zero-bubble schedule"});
}

}  // namespace

std::vector<Refusal> refusals(const Layout& l) {
  std::vector<Refusal> out;
  adapter_rows(l, out);
  sft_rows(l, out);
  moe_rows(l, out);
  if (l.pp == 1) return out;  // every pp = 1 layout of check_layout trains
  if (l.zero_stage >= 2 && l.vocab_parallel)
    out.push_back({core::str_cat("parallel.zero_stage = ", l.zero_stage,
                                 " with parallel.vocab_parallel and parallel.pp = ", l.pp),
                   " is not built (the head's pieces reduce their rows at the step, not per "
                   "micro-batch); use parallel.zero_stage = 0 or 1",
                   core::str_cat("ZeRO-", l.zero_stage, " with vocabulary parallel")});
  if (l.vocab_parallel && l.bf16)
    out.push_back({"parallel.vocab_parallel with train.precision = \"bf16\"",
                   " is not built yet (fp32 only)", "vocabulary parallel in bf16"});
  if (l.vocab_parallel && l.tp > 1)
    out.push_back({core::str_cat("parallel.vocab_parallel with parallel.tp = ", l.tp),
                   " is not built (the tensor group cuts the head's vocabulary already); use one or "
                   "the other",
                   "vocabulary parallel with tp > 1"});
  if (l.vocab_parallel && l.cp > 1)
    out.push_back({"parallel.vocab_parallel with parallel.cp > 1", " is not built yet",
                   "vocabulary parallel with cp > 1"});
  return out;
}

}  // namespace po::plan
