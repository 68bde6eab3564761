// `pagedoptim k8s`: for each gang scheduler, the manifests parse as YAML and
// the Secret, Service and Job validate against the Kubernetes API's schemas
// (tests/cli/k8s_validate.mjs, npm's kubernetes-models); the ranks' variables
// add up (WORLD_SIZE, RANK from the completion index, MASTER_ADDR on pod 0
// through the headless Service); bad input is named. There is no cluster
// here: nothing is applied or scheduled (docs/operations.md says so).
#include <gtest/gtest.h>

#include "../test_util.h"

namespace {

using po::test::run_command;

class K8s : public po::test::TinyTraining {
 protected:
  std::string k8s(const std::string& args) const {
    return std::string(PO_BINARY) + " k8s -c " + config_ + " --image registry.example/pagedoptim:1 " +
           "--set train.batch_size=8 " + args;
  }
};

TEST_F(K8s, ManifestsValidateForEveryGangScheduler) {
  for (const std::string gang : {"workload", "kueue", "volcano"}) {
    const std::string out = dir_ / ("k8s-" + gang + ".yaml");
    auto r = run_command(k8s("--nodes 2 --procs-per-node 2 --gang " + gang + " --cpus 4 --memory 8Gi --name tiny-run") +
                         " > " + out);
    const std::string y = po::test::read_file(out);
    ASSERT_EQ(r.exit_code, 0) << gang << ": " << r.output << y;
    r = run_command("cd " + std::string(PO_SOURCE_DIR) + " && node tests/cli/k8s_validate.mjs < " + out);
    EXPECT_EQ(r.exit_code, 0) << gang << ":\n" << r.output << "\n" << y;
    for (const char* kind : {"Secret tiny-run-rdzv ok", "Service tiny-run ok", "Job tiny-run ok"})
      EXPECT_NE(r.output.find(kind), std::string::npos) << gang << ": " << r.output;
    if (gang == "workload") {
      EXPECT_NE(r.output.find("Workload tiny-run ok"), std::string::npos) << r.output;
    }
    if (gang == "volcano") {
      EXPECT_NE(r.output.find("PodGroup tiny-run ok"), std::string::npos) << r.output;
    }
    if (gang == "kueue") {
      EXPECT_NE(y.find("kueue.x-k8s.io/queue-name: \"default\""), std::string::npos) << y;
      EXPECT_NE(y.find("  suspend: true"), std::string::npos) << y;
    }
    // The ranks: 2 pods x 2 processes, RANK from the completion index, rank 0's stable name.
    EXPECT_NE(y.find("completionMode: Indexed"), std::string::npos) << y;
    EXPECT_NE(y.find("name: WORLD_SIZE\n          value: \"4\""), std::string::npos) << y;
    EXPECT_NE(y.find("RANK=$((JOB_COMPLETION_INDEX * 2 + i))"), std::string::npos) << y;
    EXPECT_NE(y.find("value: \"tiny-run-0.tiny-run.default.svc\""), std::string::npos) << y;
    EXPECT_NE(y.find("--set 'parallel.dp=4'"), std::string::npos) << y;
    EXPECT_NE(y.find("secretKeyRef"), std::string::npos) << y;
  }
  // A fresh secret each time.
  const auto a = run_command(k8s("--nodes 1 --procs-per-node 2 --name x") + " | grep 'secret:'").output;
  const auto b = run_command(k8s("--nodes 1 --procs-per-node 2 --name x") + " | grep 'secret:'").output;
  EXPECT_NE(a, b);
  EXPECT_EQ(a.size(), b.size());
}

TEST_F(K8s, BadInputIsNamed) {
  auto r = run_command(k8s("--nodes 3 --procs-per-node 1"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("train.batch_size = 8 must be a multiple of parallel.dp"), std::string::npos) << r.output;
  r = run_command(k8s("--nodes 1 --procs-per-node 2 --name Bad_Name"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--name 'Bad_Name': a Kubernetes name here must be lowercase"), std::string::npos)
      << r.output;
  r = run_command(k8s("--nodes 1 --procs-per-node 2 --gang slurm"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--gang"), std::string::npos) << r.output;
}

}  // namespace
