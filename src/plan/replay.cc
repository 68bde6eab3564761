// The engine-exact plan: the engine's own rules replayed for a layout it
// trains (data parallel × tensor parallel) — one tensor-parallel rank's units
// (model/layout.h), their ZeRO shards over the data group, the all-reduce
// buckets (DataParallel::bucket_units), UnitBuffers' pools walked along the
// declared schedule, the activation layout, the rings' scratch and the
// pager's frames — so that the predicted compute-tier peak and collectives
// are what the engine measures.
#include <algorithm>
#include <cmath>
#include <deque>
#include <numeric>
#include <optional>
#include <vector>

#include "core/error.h"
#include "model/layout.h"
#include "model/transformer.h"
#include "optim/adamw.h"
#include "parallel/context_parallel.h"
#include "parallel/data_parallel.h"
#include "parallel/quantized_state.h"
#include "parallel/shard_layout.h"
#include "parallel/units.h"
#include "parallel/working_set.h"
#include "plan/plan_parts.h"
#include "plan/planner.h"

namespace po::plan {
namespace detail {
namespace {

// The tensor group's collectives per step: each micro-batch's, as the model
// issues them (Transformer::predicted_tp_collectives, the one-stage range),
// and the gradient norm's sums of squares, one double per unit and rank at
// stages 0-1 (grad_norm.h), one per rank at stages 2-3
// (DataParallel::tensor_total).
void add_tensor_comm(Plan& p, const model::TransformerConfig& cfg) {
  const Layout& l = p.layout;
  if (l.tp == 1) return;
  const bool inter = spans_nodes(p.cluster, 1, l.tp);
  add_model_tp_comm(p, cfg, {0, -1}, static_cast<uint64_t>(l.accum()), inter);
  const double norm_values = l.zero_stage < 2 ? static_cast<double>(cfg.n_layer + 2) : 1.0;
  add_comm(p, "tp", "all_gather", "gradient norm (sums of squares)", 1, 8.0 * norm_values * l.tp,
           l.tp, inter, false);
}

}  // namespace

// `cp_buffers`: context parallel's buffers (compute tier, beside the model's
// activations), 0 without it.
void engine_plan_dp(Plan& p, bool context, double cp_buffers);

// Context parallel: a rank holds T / cp rows of each sequence and its data
// group is dp × cp (train/trainer.cc), so its model states, activations,
// working buffers and data-group collectives are those of the data-parallel
// layout of dp × cp ranks at sequence T / cp (without the deferred
// embedding, which context parallel turns off); on top come the ring's
// buffers and the context group's transfers (add_context_comm), which hide
// behind the blocks' attention.
void engine_plan(Plan& p) {
  const Layout l = p.layout;
  if (l.cp == 1) return engine_plan_dp(p, false, 0);
  Layout twin = l;
  twin.dp = l.dp * l.cp;
  twin.cp = 1;
  twin.seq = l.seq / l.cp;
  twin.batch = l.batch * l.cp;  // the same micro-batches per rank
  p.layout = twin;
  engine_plan_dp(p, true, context_buffer_bytes(p.model, l));
  p.layout = l;
  add_context_comm(p, static_cast<uint64_t>(p.model.engine.n_layer));
}

void engine_plan_dp(Plan& p, bool context, double cp_buffers) {
  const Layout& l = p.layout;
  const ModelSpec& m = p.model;
  model::TransformerConfig cfg = m.engine;
  cfg.seq_len = std::max(cfg.seq_len, l.seq);
  cfg.activation_checkpointing = l.checkpointing;
  cfg.bf16_activations = l.bf16;
  cfg.sequence_parallel = l.sequence_parallel && l.tp > 1;
  // One tensor-parallel rank's units (all ranks' are the same size), sharded
  // over the data group.
  const std::vector<int64_t> units = cfg.unit_numels(l.tp);
  const int N = l.dp, stage = l.zero_stage, U = static_cast<int>(units.size());
  // Quantized moments: cut on their blocks' grid, as DataParallel cuts.
  const int64_t align = l.state_bits < 32 ? l.state_block : 1;
  const parallel::ShardLayout layout(units, N, 0, align);
  const bool grouped = N > 1;
  const auto psi = static_cast<double>(std::accumulate(units.begin(), units.end(), int64_t{0}));
  const double local = static_cast<double>(layout.local_numel());
  const double esz = l.bf16 ? 2 : 4;
  const double resz = l.reduce_bf16 && l.bf16 ? 2 : 4;  // gradient bytes on the wire
  const int64_t accum = l.accum();
  const int64_t rows = l.micro * l.seq;

  // The working buffers (parallel/working_set.h: the count the trainer sizes pages by).
  parallel::WorkingSetOptions wo;
  wo.ranks = N;
  wo.align = align;
  wo.zero_stage = stage;
  wo.prefetch = l.prefetch;
  wo.bf16 = l.bf16;
  wo.reduce_bf16 = l.reduce_bf16;
  wo.overlap = l.overlap;
  wo.paged = l.paging;
  wo.micro = l.micro;
  wo.seq = l.seq;
  wo.accum = accum;
  wo.bucket_bytes = l.bucket_bytes;
  wo.tp = l.tp;
  wo.sequence_parallel = cfg.sequence_parallel;
  wo.context = context;
  const parallel::WorkingSet ws = parallel::working_set(cfg, wo);
  const bool defer = ws.defer;
  const std::vector<std::pair<int, int>>& buckets = ws.buckets;
  const std::vector<double>& bucket_numel = ws.bucket_numel;

  // Paging (the trainer's set-up, train/paging_setup.cc setup_paging).
  optim::PagedState::Layout pl;
  pl.schema = optim::adamw_schema(l.bf16);
  if (stage == 3) pl.param_bytes = pl.grad_bytes = static_cast<size_t>(esz);
  const bool paged = l.paging;
  const bool paged_shards = paged && stage == 3;
  const double state_numel = stage == 0 ? psi : local;

  // Model states (DataParallel::memory()'s kinds).
  double params = stage == 3 ? local * esz : psi * esz;
  if (stage == 3 && N == 1 && !l.bf16) params = psi * 4;
  double grads = stage < 2 ? psi * esz : local * esz;
  if (!l.bf16 && stage == 1) grads += local * 4;  // the update's shard of the reduced gradient
  // (A tied table's lookup part is kept as rows, with the buckets: tied_pair.h.)
  double master = l.bf16 ? state_numel * 4 : 0;
  // Quantized moments: this rank's AdamW (tensor-parallel rank 0's pieces),
  // as DataParallel builds it, counts them as stored and lays out their
  // pages (the units on the blocks' grid, the 32-bit tensors' moments in
  // side pages).
  std::optional<optim::AdamW> rank_adam;
  if (l.state_bits < 32) {
    optim::AdamWConfig a;
    a.state_bits = l.state_bits;
    a.block_size = l.state_block;
    a.state_bits_exclude = l.state_bits_exclude;
    const model::Layout tp_rank(cfg, model::TensorSplit{static_cast<int>(l.tp), 0});
    rank_adam.emplace(a, parallel::adam_ranges(tp_rank, a, stage == 0 ? nullptr : &layout, stage == 3),
                      static_cast<int64_t>(state_numel));
  }
  double adam = rank_adam ? static_cast<double>(rank_adam->moment_bytes()) : 8 * state_numel;
  const double unpaged_states = params + grads + master + adam;
  const double paged_bytes =
      !paged ? 0 : static_cast<double>(rank_adam ? rank_adam->ledger_paged_bytes(pl) : pl.bytes(static_cast<int64_t>(state_numel)));
  if (paged) {
    adam = 0;
    master = 0;
    if (paged_shards) {
      params = 0;
      grads = 0;
    }
  }
  add_memory(p, "parameters", params, Tier::kCompute, l.bf16 ? "bf16" : "fp32");
  add_memory(p, "gradients", grads);
  add_memory(p, "fp32 master weights", master);
  add_memory(p, "Adam m, v", adam, Tier::kCompute,
             l.state_bits < 32 ? core::str_cat(l.state_bits, "-bit in blocks of ", l.state_block, "; 32-bit: ",
                                               l.state_bits_exclude, l.state_bits_exclude.empty() ? "" : ", ",
                                               "tensors < 4096")
                               : std::string());

  add_memory(p, "gathered-unit buffers", ws.gathered);
  add_memory(p, "communication buckets", ws.buckets_bytes() + ws.staged, Tier::kCompute,
             ws.staged > 0 ? "incl. f32 staging of bf16 buckets" : "");

  // Activations: the engine's layout (model/transformer.cc layout_activations).
  const double logits = static_cast<double>(model::Transformer::predicted_logits_bytes(cfg, l.micro, l.seq, l.tp));
  const double acts = static_cast<double>(model::Transformer::predicted_activation_bytes(cfg, l.micro, l.seq, l.tp));
  add_memory(p, "activations", acts - logits, Tier::kCompute, l.checkpointing ? "checkpointed" : "");
  add_memory(p, "logits / loss buffers", logits);
  add_memory(p, "context-parallel buffers", cp_buffers, Tier::kCompute,
             p.layout.cp_allgather ? "all-gathered keys and values, their gradients"
                                   : "ring: 2 blocks in flight, 2 accumulators, its own share");
  model::TransformerConfig other = cfg;
  other.activation_checkpointing = !l.checkpointing;
  const double acts_other = static_cast<double>(model::Transformer::predicted_activation_bytes(other, l.micro, l.seq, l.tp));
  p.activations_no_ckpt = l.checkpointing ? acts_other : acts;
  p.activations_ckpt = l.checkpointing ? acts : acts_other;
  p.activations_formula = static_cast<double>(cfg.n_layer) *
                          korthikanti_layer_bytes(static_cast<double>(l.seq), static_cast<double>(l.micro),
                                                  static_cast<double>(cfg.n_embd),
                                                  static_cast<double>(cfg.n_head), l.tp,
                                                  cfg.sequence_parallel,
                                                  l.checkpointing, true);

  // Collectives per step (what comm::Traffic counts on the data group, whose
  // members sit tp ranks apart, and on the tensor group).
  add_tensor_comm(p, cfg);
  if (grouped) {
    const bool inter = spans_nodes(p.cluster, l.tp, N);
    if (stage < 2) {
      double total = 0;
      for (double n : bucket_numel) total += n * resz;
      add_comm(p, "dp", "allreduce", "gradient buckets", buckets.size(), total, N, inter, l.overlap);
      if (defer)
        add_comm(p, "dp", "all_gather", "embedding-lookup rows", 2,
                 static_cast<double>(rows * N) * (4 + 4.0 * static_cast<double>(cfg.n_embd)), N,
                 inter, false);
    } else {
      double rs = 0;
      for (int u = 0; u < U; ++u) rs += static_cast<double>(layout.stride(u) * N) * resz;
      add_comm(p, "dp", "reduce_scatter", "gradient shards, per unit and micro-batch",
               static_cast<uint64_t>(U * accum), rs * static_cast<double>(accum), N, inter, l.overlap);
      add_comm(p, "dp", "all_gather", "gradient norm (sums of squares)", 1, 8.0 * N, N, inter, false);
    }
    if (model::Layout(cfg, {l.tp, 0}).tied())  // the step's lookup rows (tied_pair.h)
      add_comm(p, "dp", "all_gather", "tied table's lookup rows", 2,
               static_cast<double>(accum * rows * N) * (4 + 4.0 * static_cast<double>(cfg.n_embd)), N,
               inter, false);
    if (stage == 1 || stage == 2) {
      double ag = 0;
      for (int u = 0; u < U; ++u) ag += static_cast<double>(layout.stride(u) * N) * esz;
      add_comm(p, "dp", "all_gather", "updated parameter shards", static_cast<uint64_t>(U), ag, N,
               inter, false);
    }
    if (stage == 3) {
      double ag = 0;
      const std::vector<int> order = parallel::UnitBuffers::gather_order(model::Layout(m.engine));
      const auto n = static_cast<int>(order.size());
      for (int u : order) ag += static_cast<double>(layout.stride(u) * N) * esz;
      add_comm(p, "dp", "all_gather", "parameter gathers, per unit use and micro-batch",
               static_cast<uint64_t>(n * accum), ag * static_cast<double>(accum), N, inter, true);
    }
  }
  add_memory(p, "ring scratch", ws.ring, Tier::kCompute, ws.ring > 0 ? "at most" : "");
  p.working_bytes = ws.total();

  // Pages: the trainer's frame count for the budgets.
  if (paged) {
    const optim::PagedState::Geometry geo =
        rank_adam ? optim::PagedState::geometry(rank_adam->paged_numel(pl), l.page_bytes, rank_adam->paged_layout(pl))
                  : optim::PagedState::geometry(static_cast<int64_t>(state_numel), l.page_bytes, pl);
    const double fixed = unpaged_states - paged_bytes + acts + cp_buffers + p.working_bytes;
    const memory::PagingPlan plan = memory::plan_paging(
        {geo.pages(), optim::PagedState::min_compute_frames(geo, l.page_prefetch), static_cast<size_t>(fixed)},
        {l.page_bytes, l.compute_budget, l.host_budget, l.nvme});
    add_paged_tiers(p, plan, l, "");
    add_paged_io(p, plan, cfg, l.seq, l.pp == 1);
  }
}

}  // namespace detail

double engine_working_bytes(const ModelSpec& model, const Layout& layout) {
  const std::vector<std::string> why = detail::not_trainable(model, layout);
  PO_CHECK(why.empty() && layout.pp == 1, "engine_working_bytes: ", layout.describe(),
           why.empty() ? std::string(" is a pipeline layout (its memory: PipelineExecutor::predict)")
                       : core::str_cat(" is not trained by the engine yet (", why.front(), ")"));
  Plan p;
  p.model = model;
  p.layout = layout;
  detail::engine_plan(p);
  return p.working_bytes;  // (context parallel's buffers are apart: Plan::memory)
}

}  // namespace po::plan
