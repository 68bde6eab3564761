// The codebooks of low-bit optimizer state (backend/codebook.h), each built
// from its published construction at first use, never copied from a table:
//  - 8 bits, bitsandbytes' dynamic maps (create_dynamic_map, 7 exponent
//    bits): kSigned8 for Adam's m (127 negative values, 0, 128 positive;
//    no -1.0), kUnsigned8 for v (0 and 255 positive values); decade i of
//    the 7 holds 2^i (signed) or 2^(i+1) (unsigned) means of linspace(0.1,
//    1) points, scaled by 10^(i-6). Codes: the first nearest (argmin).
//  - 4 bits, torchao's (Li et al. 2023): kSigned4 for m, the dynamic map
//    with 3 exponent bits (7 negative values, 0, 8 positive); kUnsigned4 for
//    v, the linear map j/16, j = 1..16, without zero (a v of 0 would divide
//    m by eps). Codes: the lower neighbour, up on a half or more.
//  - 4 bits, bitsandbytes' NF4 (QLoRA, Dettmers et al. 2023): kNf4, the
//    normal map of the weight codec backend/nf4.h (7 negative values, 0, 8
//    positive; -1 and 1 both in). Codes: the first nearest (argmin).
//
// linspace(0.1, 1, k) is the exact points 0.1 + 0.9 j / (k - 1), rounded to
// float32. torch's own linspace, which bitsandbytes calls, differs by CPU
// dispatch (its default, AVX2 and AVX-512 kernels give three different
// maps, 44 of the 256 signed entries a unit in the last place apart on this
// project's Debian torch); docs/optim_bits.md says more.
#pragma once

#include "backend/codebook.h"

namespace po::backend {

enum class QuantMap { kSigned8, kUnsigned8, kSigned4, kUnsigned4, kNf4 };

const backend::Codebook& codebook(QuantMap which);

// bitsandbytes' create_dynamic_map(signed, max_exponent_bits, total_bits),
// its values ascending (2^total_bits of them); exposed for the tests.
std::vector<float> dynamic_map(bool is_signed, int max_exponent_bits, int total_bits);

// bitsandbytes' create_normal_map(offset = 0.9677083, use_extra_value =
// true), its 16 values ascending: Phi^-1 at linspace(offset, 0.5, 9)[:-1]
// (8 positive) and -Phi^-1 at linspace(offset, 0.5, 8)[:-1] (7 negative),
// and 0, each rounded to float32, divided by the largest in float32:
// -1, -0.6961928, ..., 0, 0.0795803, ..., 0.7229568, 1. The linspace points
// are torch's float32 ones (its CPU formula: step = (end - start) / (k - 1);
// start + step i below k / 2, end - step (k - 1 - i) from there); the exact
// points would put entry 1 an ulp from bitsandbytes' hard-coded table, which
// these points give bit for bit (tests/optim/nf4_test.cc).
std::vector<float> nf4_map();

// Phi^-1(p), the standard normal quantile, 0 < p < 1, in double: Wichura's
// AS241 (PPND16; Applied Statistics 37, 1988), relative error about 1e-16,
// the algorithm of Python's statistics.NormalDist.inv_cdf. Exposed for the tests.
double normal_quantile(double p);

}  // namespace po::backend
