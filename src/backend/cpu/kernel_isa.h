// Every kernel file of backend/cpu/ (all but gemm.cc and isa.cc) is compiled
// once per instruction-set path (CMakeLists.txt: po_kernels_<path>), with
// PO_KERNEL_LEVEL 1 (avx2), 2 (avx512) or 3 (avx512bf16). Its code sits
// between PO_KERNELS_BEGIN and PO_KERNELS_END: in that path's namespace
// (po::backend::cpu::<path>), so no symbol is shared between paths, and
// under that path's `#pragma GCC target`, so the wider instructions appear
// only there. Headers (the standard library's, core/'s) are included before
// PO_KERNELS_BEGIN: their inline functions and templates keep the portable
// target wherever the linker keeps one copy of them.
//
// GCC does not define __AVX512F__ and friends under a target pragma: the
// kernels test PO_AVX512 and PO_AVX512BF16 instead.
#pragma once

#include <immintrin.h>

#include "backend/kernels.h"

#if !defined(PO_KERNEL_LEVEL)
#error "backend/cpu kernel files are built once per instruction-set path (CMakeLists.txt)"
#elif PO_KERNEL_LEVEL == 1
#define PO_AVX512 0
#define PO_AVX512BF16 0
#define PO_KERNELS_NS avx2
#define PO_KERNELS_BEGIN namespace po::backend::cpu::avx2 {
#define PO_KERNELS_END }
#elif PO_KERNEL_LEVEL == 2
#define PO_AVX512 1
#define PO_AVX512BF16 0
#define PO_KERNELS_NS avx512
#define PO_KERNELS_TARGET avx512f,avx512cd,avx512bw,avx512dq,avx512vl
#elif PO_KERNEL_LEVEL == 3
#define PO_AVX512 1
#define PO_AVX512BF16 1
#define PO_KERNELS_NS avx512bf16
#define PO_KERNELS_TARGET avx512f,avx512cd,avx512bw,avx512dq,avx512vl,avx512bf16
#else
#error "PO_KERNEL_LEVEL is 1, 2 or 3"
#endif

#if PO_KERNEL_LEVEL > 1
// The target list is expanded first, then stringised into the pragma.
#define PO_STRING(...) #__VA_ARGS__
#define PO_PRAGMA(...) _Pragma(PO_STRING(__VA_ARGS__))
#define PO_EXPAND_PRAGMA(...) PO_PRAGMA(__VA_ARGS__)
#define PO_TARGET_STRING_OF(...) PO_STRING(__VA_ARGS__)
#define PO_TARGET_STRING PO_TARGET_STRING_OF(PO_KERNELS_TARGET)
#define PO_TARGET_STRING_512 PO_TARGET_STRING_OF(PO_KERNELS_TARGET,prefer-vector-width=512)
#if defined(__clang__)  // the fuzz build compiles with clang
#define PO_KERNELS_BEGIN                                                                      \
  PO_EXPAND_PRAGMA(clang attribute push(__attribute__((target(PO_TARGET_STRING))), apply_to = function)) \
  namespace po::backend::cpu::PO_KERNELS_NS {
#define PO_KERNELS_END } PO_PRAGMA(clang attribute pop)
#else
#define PO_KERNELS_BEGIN                                                                \
  PO_PRAGMA(GCC push_options)                                                           \
  PO_EXPAND_PRAGMA(GCC target(PO_TARGET_STRING_512))                                    \
  namespace po::backend::cpu::PO_KERNELS_NS {
#define PO_KERNELS_END } PO_PRAGMA(GCC pop_options)
#endif
#endif

// The path's own declarations of the table's ops: a kernel calling another
// calls its own path's (qualified as this_path:: where an argument's type,
// such as RopeScaling, would also find ops.h's by argument-dependent lookup),
// and the table takes their addresses.
PO_KERNELS_BEGIN
#define PO_KERNEL_DECLARE(member, name, ret, params, args) ret name params;
PO_KERNELS(PO_KERNEL_DECLARE)
#undef PO_KERNEL_DECLARE
namespace this_path = po::backend::cpu::PO_KERNELS_NS;
PO_KERNELS_END
