// Token + position embedding: forward exact, backward scatter with repeated
// tokens (accumulating into existing gradients), and finite differences.
#include <gtest/gtest.h>

#include "backend/ops.h"
#include "test_util.h"

namespace cpu = po::backend::cpu;
using po::test::all_close;
using po::test::random_vec;

TEST(Embedding, ForwardBackwardMatchReference) {
  const int64_t B = 3, T = 11, C = 37, V = 13;
  std::vector<int32_t> tok(B * T);
  for (int64_t i = 0; i < B * T; i++) tok[i] = static_cast<int32_t>((i * 5) % V);  // repeats
  auto wte = random_vec(V * C, 1), wpe = random_vec(T * C, 2), dout = random_vec(B * T * C, 3);
  std::vector<float> out(B * T * C);
  cpu::embedding_forward(out.data(), tok.data(), wte.data(), wpe.data(), B, T, C);
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = 0; t < T; t++)
      for (int64_t c = 0; c < C; c++) {
        const int64_t i = (b * T + t) * C + c;
        ASSERT_EQ(out[i], wte[tok[b * T + t] * C + c] + wpe[t * C + c]) << "out[" << i << "]";
      }
  auto dwte = random_vec(V * C, 4), dwpe = random_vec(T * C, 5);
  std::vector<double> dwte_ref(dwte.begin(), dwte.end()), dwpe_ref(dwpe.begin(), dwpe.end());
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = 0; t < T; t++)
      for (int64_t c = 0; c < C; c++) {
        dwte_ref[tok[b * T + t] * C + c] += dout[(b * T + t) * C + c];
        dwpe_ref[t * C + c] += dout[(b * T + t) * C + c];
      }
  cpu::embedding_backward(dwte.data(), dwpe.data(), dout.data(), tok.data(), B, T, C);
  EXPECT_TRUE(all_close("dwte", dwte.data(), dwte_ref.data(), dwte.size(), 1e-6));
  EXPECT_TRUE(all_close("dwpe", dwpe.data(), dwpe_ref.data(), dwpe.size(), 1e-6));
}

TEST(Embedding, FiniteDifferenceGradients) {
  const int64_t B = 2, T = 5, C = 9, V = 4;
  std::vector<int32_t> tok{0, 1, 1, 3, 0, 2, 1, 1, 0, 3};
  auto wte = random_vec(V * C, 6), wpe = random_vec(T * C, 7), rw = random_vec(B * T * C, 8);
  std::vector<float> out(B * T * C), dwte(V * C, 0.0f), dwpe(T * C, 0.0f);
  cpu::embedding_backward(dwte.data(), dwpe.data(), rw.data(), tok.data(), B, T, C);
  auto loss = [&] {
    cpu::embedding_forward(out.data(), tok.data(), wte.data(), wpe.data(), B, T, C);
    double l = 0.0;
    for (size_t i = 0; i < out.size(); i++) l += static_cast<double>(out[i]) * rw[i];
    return l;
  };
  std::vector<size_t> all_wte(V * C), all_wpe(T * C);
  for (size_t i = 0; i < all_wte.size(); i++) all_wte[i] = i;
  for (size_t i = 0; i < all_wpe.size(); i++) all_wpe[i] = i;
  EXPECT_TRUE(po::test::grad_check("dwte", wte, dwte, all_wte, loss, 1e-2f, 1e-3, 0.05));
  EXPECT_TRUE(po::test::grad_check("dwpe", wpe, dwpe, all_wpe, loss, 1e-2f, 1e-3, 0.05));
}
