// The instruction-set path and the kernels table it selects (backend/isa.h,
// backend/kernels.h). Built for the portable x86-64-v3 baseline: this file
// runs before any wider path is known to be safe.
#include "backend/isa.h"

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>
#include <string_view>

#include "backend/kernels.h"
#include "core/error.h"

#if defined(PO_BLAS_DNNL)
#include <dnnl.h>
#endif

namespace po::backend::cpu {

// One table per path, each in its own build of the kernel files
// (backend/cpu/kernel_table.cc).
namespace avx2 { extern const Kernels kTable; }
namespace avx512 { extern const Kernels kTable; }
namespace avx512bf16 { extern const Kernels kTable; }

namespace {

constexpr Isa kAll[] = {Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16, Isa::kAmx};

const Kernels& table_of(Isa isa) {
  switch (isa) {
    case Isa::kAvx2: return avx2::kTable;
    case Isa::kAvx512: return avx512::kTable;
    case Isa::kAvx512Bf16:
    case Isa::kAmx: return avx512bf16::kTable;  // AMX is oneDNN's; our kernels are avx512bf16's
  }
  return avx2::kTable;
}

struct Active {
  Isa isa = Isa::kAvx2;
  bool forced = false;
};
std::atomic<const Kernels*> g_table{nullptr};
Active g_active;
std::once_flag g_once;

// The CPU's widest path, read once (cpuid does not change under a process).
Isa detect() {
  __builtin_cpu_init();
  // libgcc's checks include the OS's XSAVE state (XCR0) for AVX-512.
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512vl");
  if (!avx512) return Isa::kAvx2;
  if (!__builtin_cpu_supports("avx512bf16")) return Isa::kAvx512;
  if (__builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16")) return Isa::kAmx;
  return Isa::kAvx512Bf16;
}

// Paths are ordered: a CPU runs its own and every narrower one.
bool runnable(Isa isa) { return static_cast<int>(isa) <= static_cast<int>(detected_isa()); }

// `what` names who asked ("PO_ISA=avx512"), in the one error for every caller.
void require_runnable(Isa isa, const std::string& what) {
  if (runnable(isa)) return;
  std::string names;
  for (Isa i : runnable_isas()) names += (names.empty() ? "" : ", ") + std::string(isa_name(i));
  PO_CHECK(false, what, ": this CPU cannot run that path (it runs ", names, ")");
}

// Installs `isa`'s table, checking that the table was built for that path
// (the build's wiring of kernel_table.cc, see CMakeLists.txt).
void install(Isa isa) {
  const Kernels& t = table_of(isa);
  const char* want = isa_name(isa == Isa::kAmx ? Isa::kAvx512Bf16 : isa);
  PO_CHECK(std::string_view(t.isa) == want, "kernels table for ", isa_name(isa), " was built as ",
           t.isa, ": the build's kernel objects are miswired");
  g_active.isa = isa;
  g_table.store(&t, std::memory_order_release);
}

// Reads PO_ISA, caps oneDNN to match (before its first primitive: gemm() and
// the kernels call this first) and installs the table.
void choose() {
  Active a{detected_isa(), false};
  if (const char* env = std::getenv("PO_ISA"); env != nullptr && *env != '\0') {
    Isa want;
    PO_CHECK(parse_isa(env, &want), "PO_ISA=", env,
             ": unknown instruction-set path (avx2, avx512, avx512bf16 or amx)");
    require_runnable(want, core::str_cat("PO_ISA=", env));
    a = {want, true};
  }
#if defined(PO_BLAS_DNNL)
  if (a.forced) {
    const dnnl_cpu_isa_t cap = a.isa == Isa::kAvx2         ? dnnl_cpu_isa_avx2
                               : a.isa == Isa::kAvx512     ? dnnl_cpu_isa_avx512_core
                               : a.isa == Isa::kAvx512Bf16 ? dnnl_cpu_isa_avx512_core_bf16
                                                           : dnnl_cpu_isa_all;
    PO_CHECK(dnnl_set_max_cpu_isa(cap) == dnnl_success, "PO_ISA=", isa_name(a.isa),
             ": oneDNN was already in use and could not be capped to it");
  }
#endif
  g_active.forced = a.forced;
  install(a.isa);
}

void ensure_chosen() {
  if (g_table.load(std::memory_order_acquire) == nullptr) std::call_once(g_once, choose);
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx512Bf16: return "avx512bf16";
    case Isa::kAmx: return "amx";
  }
  return "?";
}

bool parse_isa(const std::string& name, Isa* isa) {
  for (Isa i : kAll)
    if (name == isa_name(i)) {
      *isa = i;
      return true;
    }
  return false;
}

Isa detected_isa() {
  static const Isa d = detect();
  return d;
}

std::vector<Isa> runnable_isas() {
  std::vector<Isa> out;
  for (Isa i : kAll)
    if (runnable(i)) out.push_back(i);
  return out;
}

Isa active_isa() {
  ensure_chosen();
  return g_active.isa;
}

std::string isa_description() {
  ensure_chosen();
  if (!g_active.forced) return core::str_cat(isa_name(g_active.isa), " (detected)");
  return core::str_cat(isa_name(g_active.isa), " (PO_ISA; this CPU: ", isa_name(detected_isa()),
                       ")");
}

void use_isa_for_testing(Isa isa) {
  ensure_chosen();
  require_runnable(isa, core::str_cat("instruction-set path ", isa_name(isa)));
  install(isa);
}

const Kernels& kernels() {
  const Kernels* t = g_table.load(std::memory_order_acquire);
  if (t == nullptr) [[unlikely]] {
    ensure_chosen();
    t = g_table.load(std::memory_order_acquire);
  }
  return *t;
}

// ops.h's functions: one call through the table each.
#define PO_DISPATCH(member, name, ret, params, args) \
  ret name params { return kernels().member args; }
PO_KERNELS(PO_DISPATCH)
#undef PO_DISPATCH

}  // namespace po::backend::cpu
