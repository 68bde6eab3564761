#include "cli/plan_layout.h"

#include "core/error.h"
#include "optim/adamw.h"
#include "train/optim_keys.h"

namespace po::cli {

plan::Layout plan_layout(const core::Config& cfg, const plan::ModelSpec& model) {
  plan::Layout l;
  // DiLoCo's replicas each hold what one replica's ranks do, plus the outer
  // state of their slice; the planner does not model the outer step yet.
  PO_CHECK(cfg.get_int("parallel.replicas") == 1, "pagedoptim plan: parallel.replicas = ",
           cfg.get_int("parallel.replicas"), " is not modelled yet: plan one replica (--set parallel.replicas=1); ",
           "every replica's ranks hold what its ranks do, plus the outer state of their slice (8 bytes an element ",
           "for Nesterov, 12 for Adam, none in memory when paged to memory.nvme_dir; docs/diloco.md)");
  l.dp = static_cast<int>(cfg.get_int("parallel.dp"));
  l.tp = static_cast<int>(cfg.get_int("parallel.tp"));
  l.pp = static_cast<int>(cfg.get_int("parallel.pp"));
  l.cp = static_cast<int>(cfg.get_int("parallel.cp"));
  l.cp_allgather = cfg.get_string("parallel.cp_mode") == "allgather";
  l.sequence_parallel = cfg.get_bool("parallel.sequence_parallel");
  l.schedule = parallel::pipeline::parse_schedule(cfg.get_string("parallel.schedule"));
  l.virtual_stages = static_cast<int>(cfg.get_int("parallel.virtual_stages"));
  l.vocab_parallel = cfg.get_bool("parallel.vocab_parallel");
  l.stage_layers = cfg.get_string("parallel.stage_layers");
  l.zero_stage = static_cast<int>(cfg.get_int("parallel.zero_stage"));
  const std::string& precision = cfg.get_string("train.precision");
  PO_CHECK(precision == "fp32" || precision == "bf16", "train.precision = \"", precision,
           "\": choose \"fp32\" or \"bf16\"");
  l.bf16 = precision == "bf16";
  l.reduce_bf16 = cfg.get_string("parallel.reduce_dtype") == "bf16";
  l.batch = cfg.get_int("train.batch_size");
  l.micro = cfg.get_int("train.micro_batch_size");
  if (l.micro == 0) l.micro = l.batch / l.dp;
  l.seq = model.seq_len;
  l.checkpointing = cfg.get_bool("model.activation_checkpointing");
  l.overlap = cfg.get_bool("parallel.overlap_comm");
  l.bucket_bytes = cfg.get_size("parallel.bucket_size");
  l.prefetch = static_cast<int>(cfg.get_int("parallel.prefetch"));
  l.compute_budget = cfg.get_size("memory.compute_budget");
  l.host_budget = cfg.get_size("memory.host_budget");
  l.nvme = !cfg.get_string("memory.nvme_dir").empty();
  l.paging = l.host_budget > 0 || l.nvme;  // as the trainer decides (train/paging_setup.cc)
  l.page_bytes = cfg.get_size("memory.page_size");
  l.page_prefetch = static_cast<int>(cfg.get_int("memory.prefetch"));
  l.lend_activations = cfg.get_bool("memory.lend_activations");
  const optim::AdamWConfig adam = train::adamw_config(cfg);
  l.state_bits = adam.state_bits;
  l.state_block = adam.block_size;
  l.state_bits_exclude = adam.state_bits_exclude;
  l.lora_r = cfg.get_int("lora.r");
  l.moe_experts = model.engine.moe.experts;
  return l;
}

}  // namespace po::cli
