// One path's kernels table (backend/kernels.h), built once per path with the
// kernel files (backend/cpu/kernel_isa.h).
#include "backend/cpu/kernel_isa.h"


PO_KERNELS_BEGIN

extern const Kernels kTable;
const Kernels kTable = {
    PO_AVX512BF16 ? "avx512bf16" : PO_AVX512 ? "avx512" : "avx2",
#define PO_KERNEL_ENTRY(member, name, ret, params, args) static_cast<ret(*) params>(&name),
    PO_KERNELS(PO_KERNEL_ENTRY)
#undef PO_KERNEL_ENTRY
};

PO_KERNELS_END
