// The instruction-set path, picked once at start-up from cpuid (docs/isa.md).
//
// The engine is built for x86-64-v3 (AVX2, FMA, F16C, BMI2): every x86 CPU it
// runs on has those. The kernel files of backend/cpu/ are built once more per
// wider path, and the path this CPU can run selects their table
// (backend/kernels.h):
//   avx2        the portable build's kernels;
//   avx512      AVX-512 F/CD/BW/DQ/VL kernels (16-lane tiles, decode rows);
//   avx512bf16  those with AVX512-BF16 (bf16 attention tiles, oneDNN's bf16 GEMM);
//   amx         avx512bf16's kernels, with oneDNN free to use AMX tiles.
// PO_ISA=<path> forces a lower path (oneDNN is capped to match); a path this
// CPU cannot run is an error naming what it can.
#pragma once

#include <string>
#include <vector>

namespace po::backend::cpu {

enum class Isa { kAvx2 = 0, kAvx512 = 1, kAvx512Bf16 = 2, kAmx = 3 };

const char* isa_name(Isa isa);
// The widest path this CPU (and its OS) supports.
Isa detected_isa();
// Every path this CPU can run, narrowest first.
std::vector<Isa> runnable_isas();
// The path in use: detected_isa(), or PO_ISA's, fixed at the first call (or
// at the first kernel or GEMM). Throws a one-line error if PO_ISA is unknown
// or names a path this CPU cannot run.
Isa active_isa();
// "avx512bf16 (detected)" or "avx2 (PO_ISA; this CPU: avx512bf16)", for the
// start-up lines.
std::string isa_description();
// Tests: run the kernels of another runnable path in this process (oneDNN
// keeps the cap it started with). Throws if this CPU cannot run it.
void use_isa_for_testing(Isa isa);
// Parses a path's name; false if it is not one.
bool parse_isa(const std::string& name, Isa* isa);

}  // namespace po::backend::cpu
