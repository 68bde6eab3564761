// The optimizer's keys (optim_keys.h).
#include "train/optim_keys.h"

#include "core/error.h"

namespace po::train {

optim::AdamWConfig adamw_config(const core::Config& cfg) {
  optim::AdamWConfig o;
  o.beta1 = cfg.get_float("train.beta1");
  o.beta2 = cfg.get_float("train.beta2");
  o.eps = cfg.get_float("train.eps");
  o.weight_decay = cfg.get_float("train.weight_decay");
  o.grad_clip = cfg.get_float("train.grad_clip");
  o.state_bits = static_cast<int>(cfg.get_int("optim.state_bits"));
  PO_CHECK(o.state_bits == 32 || o.state_bits == 8 || o.state_bits == 4, "optim.state_bits = ",
           o.state_bits, " is not one of 32, 8, 4");
  const int64_t block = cfg.get_int("optim.block_size");
  PO_CHECK(block == 0 || (block >= 2 && (block & (block - 1)) == 0), "optim.block_size = ", block,
           " is not a power of two (2 to 4096; 0 takes 256 at 8 bits, 128 at 4)");
  o.block_size = block != 0 ? block : o.state_bits == 4 ? 128 : 256;
  o.state_bits_exclude = cfg.get_string("optim.state_bits_exclude");
  const std::string& name = cfg.get_string("optim.name");
  PO_CHECK(name == "adamw" || name == "sgd", "optim.name = \"", name, "\": choose \"adamw\" or \"sgd\"");
  o.sgd = name == "sgd";
  PO_CHECK(!o.sgd || o.state_bits == 32, "optim.name = \"sgd\" keeps no moments to quantize: optim.state_bits = ",
           o.state_bits, " applies to adamw");
  return o;
}

}  // namespace po::train
