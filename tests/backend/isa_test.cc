// The instruction-set choice (backend/isa.h): names, what this CPU runs, the
// table each path installs, and the one-line refusal of a path it cannot run.
// Run once per path (tests/isa/on_path.sh), so each check sees PO_ISA's path.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "backend/isa.h"
#include "backend/kernels.h"
#include "core/error.h"

namespace cpu = po::backend::cpu;
using cpu::Isa;

namespace {

// The kernels a path runs: its own build, except AMX (oneDNN's), which runs avx512bf16's.
std::string table_name(Isa isa) { return cpu::isa_name(isa == Isa::kAmx ? Isa::kAvx512Bf16 : isa); }

}  // namespace

TEST(Isa, NamesParseBack) {
  for (Isa i : {Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16, Isa::kAmx}) {
    Isa got = Isa::kAvx2;
    ASSERT_TRUE(cpu::parse_isa(cpu::isa_name(i), &got)) << cpu::isa_name(i);
    EXPECT_EQ(got, i) << cpu::isa_name(i);
  }
  Isa got = Isa::kAvx512;
  EXPECT_FALSE(cpu::parse_isa("avx512f", &got));
  EXPECT_FALSE(cpu::parse_isa("", &got));
  EXPECT_EQ(got, Isa::kAvx512) << "a failed parse must not write";
}

TEST(Isa, RunnablePathsAreEveryPathUpToTheDetectedOne) {
  const auto r = cpu::runnable_isas();
  ASSERT_FALSE(r.empty());
  EXPECT_EQ(r.front(), Isa::kAvx2);
  EXPECT_EQ(r.back(), cpu::detected_isa());
  EXPECT_EQ(r.size(), static_cast<size_t>(cpu::detected_isa()) + 1);
}

TEST(Isa, TheActivePathIsPoIsasAndItsTableWasBuiltForIt) {
  const char* env = std::getenv("PO_ISA");
  const Isa active = cpu::active_isa();
  if (env != nullptr && *env != '\0') {
    EXPECT_EQ(cpu::isa_name(active), std::string(env));
    EXPECT_EQ(cpu::isa_description(),
              std::string(env) + " (PO_ISA; this CPU: " + cpu::isa_name(cpu::detected_isa()) + ")");
  } else {
    EXPECT_EQ(active, cpu::detected_isa());
    EXPECT_EQ(cpu::isa_description(), std::string(cpu::isa_name(active)) + " (detected)");
  }
  EXPECT_EQ(cpu::kernels().isa, table_name(active));
}

TEST(Isa, EveryRunnablePathInstallsItsOwnTable) {
  const Isa before = cpu::active_isa();
  for (Isa i : cpu::runnable_isas()) {
    cpu::use_isa_for_testing(i);
    EXPECT_EQ(cpu::active_isa(), i);
    EXPECT_EQ(cpu::kernels().isa, table_name(i)) << "path " << cpu::isa_name(i);
  }
  cpu::use_isa_for_testing(before);
}

TEST(Isa, APathThisCpuCannotRunIsRefusedNamingWhatItRuns) {
  if (cpu::detected_isa() == Isa::kAmx) GTEST_SKIP() << "this CPU runs every path (amx)";
  const Isa before = cpu::active_isa();
  std::string e;
  try {
    cpu::use_isa_for_testing(Isa::kAmx);
  } catch (const po::core::Error& err) {
    e = err.what();
  }
  EXPECT_NE(e.find("instruction-set path amx: this CPU cannot run that path (it runs avx2"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find(cpu::isa_name(cpu::detected_isa())), std::string::npos) << e;
  EXPECT_EQ(cpu::active_isa(), before) << "a refused path must leave the active one";
  EXPECT_EQ(cpu::kernels().isa, table_name(before));
}
