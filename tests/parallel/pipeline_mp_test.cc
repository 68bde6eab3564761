// Pipeline parallel's exactness on real processes under mpirun (1, 2, 3, 4
// and 8 ranks): at pp = world size, every schedule (gpipe, 1f1b,
// interleaved, zb-h1, zbv) at m = p, 2p and 2p + 1 micro-batches trains
// three steps with clipping active and gives, bit for bit, the losses, the
// gradient norms and the final weights (and Adam moments) of one stage —
// each rank runs that pp = 1 reference itself (the executor's one-stage
// schedule, the trainer's step) and checks the units it holds, the
// tied table's replica on the head's rank included (the two copies never
// drift apart). GPT-2 with its tied embedding and Llama (untied). The
// engine's own count of micro-batches in flight stays within each
// schedule's bound (1F1B: p on the first stage). At 8 ranks: dp 2 × tp 2 ×
// pp 2 follows dp 1 within 1e-5 over 20 steps, at ZeRO 0 and 1 (ZeRO-1 with
// ZeRO-0's bits); at 4 ranks dp 2 × pp 2 the same.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "../mpi_world.h"
#include "backend/ops.h"
#include "comm/mesh.h"
#include "parallel/pipeline_executor.h"
#include "parallel/pipeline_stages.h"
#include "parallel/tensor_parallel.h"

namespace po::parallel {
namespace {
using model::Transformer;
using model::TransformerConfig;
using pipeline::ScheduleKind;

comm::Communicator& world() { return po::test::MpiWorld::world(); }

constexpr int64_t kB = 2, kT = 16;
constexpr uint64_t kSeed = 11;

TransformerConfig gpt2() {
  TransformerConfig c = TransformerConfig::arch_defaults("gpt2");
  c.n_layer = 8;
  c.n_embd = 32;
  c.n_head = 2;
  c.vocab_size = 67;
  c.seq_len = kT;
  return c;
}

TransformerConfig llama() {
  TransformerConfig c = TransformerConfig::arch_defaults("llama");
  c.n_layer = 8;
  c.n_embd = 32;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.ffn_hidden = 48;
  c.vocab_size = 71;
  c.seq_len = kT;
  c.tie_embeddings = false;
  return c;
}

optim::AdamWConfig adam() {
  optim::AdamWConfig a;
  a.grad_clip = 0.05;  // below the norms: clipping acts on every step
  return a;
}

// Micro-batch `micro` of step `step` (of this data rank's slice at `first`).
void fill(const TransformerConfig& c, int64_t step, int64_t index, int32_t* in, int32_t* tg) {
  for (int64_t i = 0; i < kB * kT; ++i) {
    const uint64_t h = static_cast<uint64_t>((step * 131 + index) * 977 + i * 7919);
    in[i] = static_cast<int32_t>((h >> 3) % static_cast<uint64_t>(c.vocab_size));
    tg[i] = static_cast<int32_t>((h >> 7) % static_cast<uint64_t>(c.vocab_size));
  }
}

struct StepLog {
  std::vector<float> loss;  // the sum of the micro-batches' mean losses, per step
  std::vector<double> norm;
};

double lr_at(int64_t step) { return 1e-2 * (1.0 + 0.1 * static_cast<double>(step)); }
// The 3-D run's rate: small enough that 20 steps do not amplify the
// rounding differences of other reduction orders past 1e-5.
double lr_3d(int64_t) { return 1e-3; }

PipelineSetup setup_for(const TransformerConfig& c, ScheduleKind kind, int p, int m,
                        comm::Communicator* pipe, bool vocab = false) {
  PipelineSetup s;
  pipeline::Pipeline built = pipeline::make_pipeline(c, kT, kind, p, m, 2, vocab);  // the engine's
  s.schedule = std::move(built.schedule);
  s.stage_units = std::move(built.stages);
  s.micro = kB;
  s.T = kT;
  s.pipe = pipe;
  return s;
}

StepLog run_pipeline(PipelineExecutor& ex, const TransformerConfig& c, int m, int steps,
                     double (*lr)(int64_t) = lr_at) {
  StepLog log;
  ex.init_random(kSeed);
  for (int64_t s = 0; s < steps; ++s) {
    const PipelineStepStats st = ex.forward_backward(
        [&](int micro, int32_t* in, int32_t* tg) { fill(c, s, micro, in, tg); },
        1.0f / static_cast<float>(m * kB * kT));
    const pipeline::Schedule& sch = ex.schedule();
    EXPECT_LE(st.peak_in_flight, sch.in_flight_cap(ex.rank()))
        << pipeline::schedule_name(sch.kind) << " m=" << m << ": rank " << ex.rank() << " held "
        << st.peak_in_flight << " micro-batches, the schedule's bound is "
        << sch.in_flight_cap(ex.rank());
    if (sch.kind == ScheduleKind::k1F1B && ex.rank() == 0) {
      // p, or p + 1 under vocabulary parallel
      EXPECT_EQ(st.peak_in_flight, std::min(m, sch.in_flight_cap(0))) << "1F1B's first stage holds min(m, its cap)";
    }
    log.norm.push_back(ex.step(lr(s)));
    log.loss.push_back(static_cast<float>(st.loss_sum));  // the last stage's (0 elsewhere)
  }
  return log;
}

// The reference: one stage (pp = 1, the trainer's step) on this rank alone,
// m micro-batches a step.
struct Reference {
  PipelineExecutor ex;
  StepLog log;
  Reference(const TransformerConfig& c, int m, int steps, double (*lr)(int64_t) = lr_at)
      : ex(c, adam(), setup_for(c, ScheduleKind::k1F1B, 1, m, nullptr)) {
    log = run_pipeline(ex, c, m, steps, lr);
  }
};

// The pp = 1 reference's unit u (parameters, m, v) against the executor's.
void expect_unit_bits(Reference& ref, PipelineExecutor& ex, int u, const std::string& what) {
  const int64_t n = ex.layout().unit_numel(u);
  std::vector<float> state[3], reference[3];
  using S = PipelineExecutor::State;
  const S kinds[3] = {S::kParams, S::kAdamM, S::kAdamV};
  const float* got[3];
  const float* want[3];
  for (int k = 0; k < 3; ++k) {
    state[k].resize(static_cast<size_t>(n));
    reference[k].resize(static_cast<size_t>(n));
    ex.read_unit(kinds[k], u, state[k].data());
    ref.ex.read_unit(kinds[k], u, reference[k].data());
    got[k] = state[k].data();
    want[k] = reference[k].data();
  }
  const char* names[3] = {"parameters", "Adam m", "Adam v"};
  for (int k = 0; k < 3; ++k) {
    int64_t i = 0;
    while (i < n && std::memcmp(&got[k][i], &want[k][i], sizeof(float)) == 0) ++i;
    EXPECT_EQ(i, n) << what << ": unit " << u << " " << names[k] << " differ from pp = 1 first at "
                    << i << ": " << (i < n ? got[k][i] : 0.0f) << " vs " << (i < n ? want[k][i] : 0.0f);
  }
}

// The engine's bytes on this rank against PipelineExecutor::predict (what the planner reads).
void expect_predicted_memory(const PipelineExecutor& ex, const TransformerConfig& c,
                             ScheduleKind kind, int p, int m, const std::string& what,
                             bool vocab = false) {
  const PipelineExecutor::Memory got = ex.memory();
  const PipelineExecutor::Memory want =
      PipelineExecutor::predict(c, setup_for(c, kind, p, m, nullptr, vocab), ex.rank());
  EXPECT_EQ(got.params, want.params) << what << ": parameter bytes on rank " << ex.rank();
  EXPECT_EQ(got.grads, want.grads) << what << ": gradient bytes on rank " << ex.rank();
  EXPECT_EQ(got.adam, want.adam) << what << ": Adam bytes on rank " << ex.rank();
  EXPECT_EQ(got.activations, want.activations) << what << ": activation bytes on rank " << ex.rank();
  EXPECT_EQ(got.w_queue, want.w_queue) << what << ": W-queue bytes on rank " << ex.rank();
  EXPECT_EQ(got.buffers, want.buffers) << what << ": message buffer bytes on rank " << ex.rank();
}

class Pipeline : public ::testing::Test {
 protected:
  void SetUp() override { backend::cpu::set_num_threads(1); }
};

void check_all_schedules(const TransformerConfig& c, const std::string& model_name,
                         bool vocab = false) {
  const int p = world().size();
  constexpr int kSteps = 3;
  for (int m : {p, 2 * p, 2 * p + 1}) {
    Reference ref(c, m, kSteps);
    for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved,
                              ScheduleKind::kZbH1, ScheduleKind::kZbV}) {
      const std::string what = model_name + " " + pipeline::schedule_name(kind) + " pp=" +
                               std::to_string(p) + " m=" + std::to_string(m) +
                               (vocab ? " vocabulary parallel" : "");
      SCOPED_TRACE(what);
      PipelineExecutor ex(c, adam(), setup_for(c, kind, p, m, p > 1 ? &world() : nullptr, vocab));
      const StepLog got = run_pipeline(ex, c, m, kSteps);
      for (int s = 0; s < kSteps; ++s) {
        EXPECT_EQ(got.norm[s], ref.log.norm[s]) << what << " step " << s << ": gradient norm";
        if (ex.has_loss()) {
          EXPECT_EQ(got.loss[s], ref.log.loss[s]) << what << " step " << s << ": loss";
        }
      }
      for (int u = 0; u < ref.ex.layout().num_units(); ++u)
        if (ex.holds(u)) expect_unit_bits(ref, ex, u, what);
      expect_predicted_memory(ex, c, kind, p, m, what, vocab);
      // The evaluation runs through the stages too.
      std::vector<int32_t> in(kB * kT), tg(kB * kT);
      fill(c, 99, 0, in.data(), tg.data());
      EXPECT_EQ(ex.evaluate(in.data(), tg.data()), ref.ex.evaluate(in.data(), tg.data()))
          << what << ": evaluation loss";
      if (::testing::Test::HasFailure()) return;  // one layout's report is enough
    }
  }
}

TEST_F(Pipeline, EverySchedulesIsBitIdenticalToOneStageGpt2) {
  PO_MP_RUNS_ONLY_IF(world().size() != 8, "8 ranks run the dp × tp × pp test");
  check_all_schedules(gpt2(), "gpt2");
}

TEST_F(Pipeline, EverySchedulesIsBitIdenticalToOneStageLlama) {
  PO_MP_RUNS_ONLY_IF(world().size() != 8, "8 ranks run the dp × tp × pp test");
  check_all_schedules(llama(), "llama");
}

// The head's vocabulary pieces spread over every pipeline rank (S and T
// actions, the statistics exchanged, the input gradient's sum handed from
// rank to rank, the head weight's rows gathered to its owner and sent back):
// still the bits of one stage, for every schedule, GPT-2 (tied: the
// embedding's rank reads its own table) and Llama (untied: copies).
TEST_F(Pipeline, VocabularyParallelIsBitIdenticalToOneStageGpt2) {
  PO_MP_RUNS_ONLY_IF(world().size() != 8, "8 ranks run the dp × tp × pp test");
  check_all_schedules(gpt2(), "gpt2", true);
}

TEST_F(Pipeline, VocabularyParallelIsBitIdenticalToOneStageLlama) {
  PO_MP_RUNS_ONLY_IF(world().size() != 8, "8 ranks run the dp × tp × pp test");
  check_all_schedules(llama(), "llama", true);
}

// A step that fails while messages are on their way (gpipe at pp 2: rank 0
// sends the activations of micro-batches 0 and 1 and fails at the third
// forward's batch; rank 1 fails at its first, with receives posted): the
// executors go, and the messages that arrive afterwards land in buffers
// they leaked, not in freed memory the program has since reused (which a
// wrong order of teardown corrupted: a heap abort in a later test).
TEST_F(Pipeline, AFailedStepLeavesNoMessageToLandInFreedMemory) {
  PO_MP_RUNS_ONLY_IF(world().size() == 2, "2 ranks");
  const TransformerConfig c = gpt2();
  const size_t floats = static_cast<size_t>(kB * kT * c.n_embd);  // one message
  // Its own group: the receives left posted (their messages never sent)
  // would take the next test's messages of the same tags.
  std::unique_ptr<comm::Communicator> group = world().split(0, world().rank(), "failed step");
  {
    PipelineExecutor ex(c, adam(), setup_for(c, ScheduleKind::kGPipe, 2, 4, group.get()));
    ex.init_random(kSeed);
    const int fail_at = ex.rank() == 0 ? 2 : 0;
    EXPECT_THROW(ex.forward_backward(
                     [&](int micro, int32_t* in, int32_t* tg) {
                       if (micro == fail_at) throw std::runtime_error("the batch failed");
                       fill(c, 0, micro, in, tg);
                     },
                     1.0f),
                 std::runtime_error);
  }
  // Blocks the size of the freed buffers, filled; the barrier lets the late
  // messages arrive; the blocks must be as filled.
  std::vector<std::vector<float>> blocks;
  for (int i = 0; i < 16; ++i) blocks.emplace_back(floats, 1234.5f);
  group->barrier();
  for (int i = 0; i < 16; ++i)
    for (size_t j = 0; j < floats; ++j)
      ASSERT_EQ(blocks[static_cast<size_t>(i)][j], 1234.5f)
          << "rank " << world().rank() << ": block " << i << " float " << j
          << " was written after the executor was gone";
}

// The tied table's two copies (embedding rank, head rank) after training:
// the same bits (the head's replica is checked against the embedding's).
TEST_F(Pipeline, TiedTableCopiesNeverDriftApart) {
  const int p = world().size();
  PO_MP_RUNS_ONLY_IF(p != 1 && p != 8, "needs the embedding and the head on two ranks");
  const TransformerConfig c = gpt2();
  PipelineExecutor ex(c, adam(), setup_for(c, ScheduleKind::k1F1B, p, p, &world()));
  (void)run_pipeline(ex, c, p, 4);
  const model::Layout& l = ex.layout();
  const int64_t n = l.token_embedding().numel();
  std::vector<float> table(static_cast<size_t>(n));
  const int emb = ex.schedule().rank_of(0);
  if (ex.rank() == emb)
    std::memcpy(table.data(), ex.unit_params(0) + l.token_embedding().offset, n * sizeof(float));
  world().broadcast(table.data(), static_cast<size_t>(n), tensor::DType::kF32, emb);
  if (const auto* replica = static_cast<const float*>(ex.tied_replica())) {
    int64_t i = 0;
    while (i < n && std::memcmp(&replica[i], &table[static_cast<size_t>(i)], sizeof(float)) == 0) ++i;
    EXPECT_EQ(i, n) << "rank " << ex.rank() << "'s replica of the token table drifted from rank "
                    << emb << "'s at element " << i;
  }
  EXPECT_EQ(ex.tied_replica() != nullptr, ex.has_loss() && !ex.holds(0))
      << "the head's rank (and only it) holds a replica";
}

// Every unit this rank holds (parameters, Adam m and v; read_unit gathers
// ZeRO-1's shards), in unit order.
std::vector<float> held_state(PipelineExecutor& ex) {
  std::vector<float> out, unit;
  using S = PipelineExecutor::State;
  for (int u = 0; u < ex.layout().num_units(); ++u) {
    if (!ex.holds(u)) continue;
    unit.resize(static_cast<size_t>(ex.layout().unit_numel(u)));
    for (S k : {S::kParams, S::kAdamM, S::kAdamV}) {
      ex.read_unit(k, u, unit.data());
      out.insert(out.end(), unit.begin(), unit.end());
    }
  }
  return out;
}

// dp 2 × tp 2 × pp 2 (8 processes) against one process, 20 steps, 1f1b and
// zbv, at ZeRO 0-3: the reduction orders of dp and tp differ from one
// process's, so within 1e-5 (relative, per step's loss). ZeRO-1 gives
// ZeRO-0's bits (the update is element-wise on the same reduced gradient);
// ZeRO-2 sums each micro-batch's gradient over the data group (its own
// order) and holds only its shard of the gradient; ZeRO-3 gives ZeRO-2's
// bits holding only its shard of the parameters too (gathered per use).
// Every layout's memory is predict()'s. At 4 processes the same for
// dp 2 × pp 2. (Each rank runs one thread: the bits compared are at equal
// threads per rank.)
TEST_F(Pipeline, ThreeDimensionsFollowOneProcess) {
  PO_MP_RUNS_ONLY_IF(world().size() == 8 || world().size() == 4, "runs at 4 and 8 ranks");
  const TransformerConfig c = gpt2();
  const int tp = world().size() / 4;
  const int m = 4, steps = world().size() == 8 ? 20 : 6;
  const comm::DeviceMesh mesh(world().size(), {.dp = 2, .tp = tp, .pp = 2});
  const int r = world().rank();
  auto split = [&](comm::Axis axis, const char* name) {
    return world().split(mesh.group_color(r, axis), mesh.rank_in_group(r, axis),
                         std::string(name) + std::to_string(mesh.group_color(r, axis)));
  };
  auto data = split(comm::Axis::kData, "dp");
  auto tensor = split(comm::Axis::kTensor, "tp");
  auto pipe = split(comm::Axis::kPipeline, "pp");
  const comm::MeshCoords at = mesh.coords(r);
  // The reference: one process, batch = dp × m micro-batches.
  Reference ref(c, 2 * m, steps, lr_3d);
  for (ScheduleKind kind : {ScheduleKind::k1F1B, ScheduleKind::kZbV}) {
    std::vector<float> zero0_state, zero2_state;
    std::vector<double> zero0_norms, zero2_norms;
    size_t zero0_grads = 0, zero2_params = 0;
    for (int zero : {0, 1, 2, 3}) {
      const std::string what = std::string(pipeline::schedule_name(kind)) + " dp2×tp" +
                               std::to_string(tp) + "×pp2 ZeRO-" + std::to_string(zero);
      PipelineSetup s = setup_for(c, kind, 2, m, pipe.get());
      std::unique_ptr<TensorParallelOps> ops;
      if (tp > 1) ops = std::make_unique<TensorParallelOps>(*tensor);
      s.data = data.get();
      s.tensor = tp > 1 ? tensor.get() : nullptr;
      s.tp_ops = ops.get();
      s.split = {tp, at.tp};
      s.zero_stage = zero;
      PipelineExecutor ex(c, adam(), s);
      ex.init_random(kSeed);
      std::vector<double> norms;
      for (int64_t st = 0; st < steps; ++st) {
        const PipelineStepStats stats = ex.forward_backward(
            [&](int micro, int32_t* in, int32_t* tg) { fill(c, st, at.dp * m + micro, in, tg); },
            1.0f / static_cast<float>(2 * m * kB * kT));
        float loss = static_cast<float>(stats.loss_sum);
        data->allreduce(&loss, 1, tensor::DType::kF32, comm::ReduceOp::kSum);
        norms.push_back(ex.step(lr_3d(st)));
        if (ex.has_loss()) {
          const double want = ref.log.loss[static_cast<size_t>(st)];
          EXPECT_NEAR(loss, want, 1e-5 * std::abs(want))
              << what << " step " << st << ": loss " << loss << " vs one process " << want;
        }
      }
      PipelineSetup plan = s;
      plan.pipe = plan.data = plan.tensor = nullptr;
      plan.tp_ops = nullptr;
      plan.dp = 2;
      const PipelineExecutor::Memory got = ex.memory(),
                                     want = PipelineExecutor::predict(c, plan, ex.rank());
      EXPECT_EQ(got.adam, want.adam) << what << ": Adam bytes on pipeline rank " << ex.rank();
      EXPECT_EQ(got.grads, want.grads) << what << ": gradient bytes on pipeline rank " << ex.rank();
      EXPECT_EQ(got.total(), want.total()) << what << ": bytes on pipeline rank " << ex.rank();
      const std::vector<float> state = held_state(ex);
      if (zero == 2) {
        EXPECT_LT(got.grads, zero0_grads) << what << ": the gradient is not sharded (ZeRO-0 holds "
                                          << zero0_grads << " bytes)";
        zero2_state = state;
        zero2_norms = norms;
        zero2_params = got.params;
        continue;
      }
      if (zero == 3) {
        EXPECT_LT(got.params, zero2_params) << what << ": the parameters are not sharded (ZeRO-2 holds "
                                            << zero2_params << " bytes)";
        EXPECT_EQ(norms, zero2_norms) << what << ": gradient norms differ from ZeRO-2's";
        size_t i = 0;
        while (i < state.size() && std::memcmp(&state[i], &zero2_state[i], sizeof(float)) == 0) ++i;
        EXPECT_EQ(i, state.size()) << what << ": the state differs from ZeRO-2's first at element " << i;
        continue;
      }
      if (zero == 0) {
        zero0_grads = got.grads;
        zero0_state = state;
        zero0_norms = norms;
        continue;
      }
      EXPECT_EQ(norms, zero0_norms) << what << ": gradient norms differ from ZeRO-0's";
      size_t i = 0;
      while (i < state.size() && std::memcmp(&state[i], &zero0_state[i], sizeof(float)) == 0) ++i;
      EXPECT_EQ(i, state.size()) << what << ": the state (parameters, m, v of the held units) "
                                 << "differs from ZeRO-0's first at element " << i;
      EXPECT_LT(got.adam, ex.layout().num_params() * 8u) << what << ": Adam is not sharded";
    }
  }
}

}  // namespace
}  // namespace po::parallel
