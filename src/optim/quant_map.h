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
//
// linspace(0.1, 1, k) is the exact points 0.1 + 0.9 j / (k - 1), rounded to
// float32. torch's own linspace, which bitsandbytes calls, differs by CPU
// dispatch (its default, AVX2 and AVX-512 kernels give three different
// maps, 44 of the 256 signed entries a unit in the last place apart on this
// project's Debian torch); docs/optim_bits.md says more.
#pragma once

#include "backend/codebook.h"

namespace po::optim {

enum class QuantMap { kSigned8, kUnsigned8, kSigned4, kUnsigned4 };

const backend::Codebook& codebook(QuantMap which);

// bitsandbytes' create_dynamic_map(signed, max_exponent_bits, total_bits),
// its values ascending (2^total_bits of them); exposed for the tests.
std::vector<float> dynamic_map(bool is_signed, int max_exponent_bits, int total_bits);

}  // namespace po::optim
