// Optimizer state as a schema: an optimizer's per-element state is a list of
// fields, each {name, dtype, bits per element, block scale}. The pages
// (optim/paged_state.h) are cut by the schema's bytes, and a checkpoint
// records each stored kind by its field's name and form (checkpoint/manifest.h,
// version 2), so a new optimizer (8-bit Adam: {m u8 with a per-256 absmax, v
// likewise, master f32}) is a schema and a kernel, not a copy of the paged
// sweep or of the checkpoint writer.
//
// Header-only and constexpr: the manifest parser (fuzzed alone) reads it too.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

namespace po::optim {

enum class StateDtype : uint8_t { kF32, kBf16, kU8, kU4 };

constexpr int dtype_bits(StateDtype d) {
  switch (d) {
    case StateDtype::kF32: return 32;
    case StateDtype::kBf16: return 16;
    case StateDtype::kU8: return 8;
    case StateDtype::kU4: return 4;
  }
  return 0;
}

constexpr std::string_view dtype_name(StateDtype d) {
  switch (d) {
    case StateDtype::kF32: return "f32";
    case StateDtype::kBf16: return "bf16";
    case StateDtype::kU8: return "u8";
    case StateDtype::kU4: return "u4";
  }
  return "?";
}

constexpr std::optional<StateDtype> parse_state_dtype(std::string_view s) {
  for (StateDtype d : {StateDtype::kF32, StateDtype::kBf16, StateDtype::kU8, StateDtype::kU4})
    if (s == dtype_name(d)) return d;
  return std::nullopt;
}

// One field. Its n elements are stored as n codes of dtype_bits(dtype) bits,
// then (with a block scale) one fp32 scale per `block` elements, the last
// block possibly short.
struct StateField {
  std::string_view name;  // the checkpoint's kind name: stable across builds
  StateDtype dtype = StateDtype::kF32;
  int64_t block = 0;        // elements sharing one fp32 scale; 0: no scale
  bool checkpointed = true;  // false: held elsewhere in a checkpoint (the master is "params")
  // Blocks cut at tensor edges (8- and 4-bit Adam: a block is a grid block
  // ∩ a tensor): a second scale per block, for a tensor's part of it that
  // ends inside the block (optim/adamw.h). With tensors of at least `block`
  // elements a grid block holds at most two such parts, so two scales do.
  bool cut_blocks = false;

  constexpr int bits() const { return dtype_bits(dtype); }
  constexpr int64_t code_bytes(int64_t n) const { return (n * bits() + 7) / 8; }
  constexpr int64_t scale_bytes(int64_t n) const {
    return block > 0 ? (n + block - 1) / block * 4 * (cut_blocks ? 2 : 1) : 0;
  }
  constexpr int64_t bytes(int64_t n) const { return code_bytes(n) + scale_bytes(n); }
  // Element counts whose codes and scales start on whole bytes and scales:
  // a piece of the field may start only at a multiple of this.
  constexpr int64_t granule() const {
    const int64_t g = bits() >= 8 ? 1 : 8 / bits();
    return block > g ? block : g;
  }
  constexpr bool operator==(const StateField&) const = default;
};

// The parameters as a checkpoint stores them (the fp32 master of a bf16 run).
inline constexpr StateField kParamsField{"params", StateDtype::kF32};

// An optimizer's fields, in page order.
struct StateSchema {
  std::string_view name;  // "adamw"
  std::span<const StateField> fields;

  // The index of the field named `field`, or -1.
  constexpr int find(std::string_view field) const {
    for (size_t i = 0; i < fields.size(); ++i)
      if (fields[i].name == field) return static_cast<int>(i);
    return -1;
  }
  // Where n elements of each field lie, fields in order, each field's codes
  // and its scales starting on an `align`-byte boundary (the page layout's
  // rule): at(i, codes, scales) with byte offsets (scales -1: none); returns
  // the bytes in all.
  template <typename At>
  constexpr int64_t place(int64_t n, int64_t align, At at) const {
    const auto up = [align](int64_t b) { return (b + align - 1) / align * align; };
    int64_t b = 0;
    for (size_t i = 0; i < fields.size(); ++i) {
      const StateField& f = fields[i];
      const int64_t codes = b;
      b = up(b + f.code_bytes(n));
      const int64_t scales = f.block > 0 ? b : -1;
      if (f.block > 0) b = up(b + f.scale_bytes(n));
      at(i, codes, scales);
    }
    return b;
  }
  // Bytes n elements of every field take, placed as place() does.
  constexpr int64_t bytes(int64_t n, int64_t align = 1) const {
    return place(n, align, [](size_t, int64_t, int64_t) {});
  }
};

// AdamW: the moments m and v in fp32, and for a bf16 run the fp32 master
// weights (checkpointed as "params"). Field indices are AdamW::kM, kV, kMaster.
inline constexpr StateField kAdamWFields[] = {
    {"adam_m", StateDtype::kF32},
    {"adam_v", StateDtype::kF32},
    {"master", StateDtype::kF32, 0, false},
};
constexpr StateSchema adamw_schema(bool master) {
  return {"adamw", std::span<const StateField>(kAdamWFields, master ? 3 : 2)};
}

// A kind of per-element state a run keeps, checkpoints and reshards: the
// parameters, and each checkpointed field of the optimizer's schema. One
// name for the trainer, the pipeline executor and the checkpoint files.
enum class StateKind : uint8_t { kParams, kAdamM, kAdamV };
inline constexpr std::array<StateKind, 3> kAllStateKinds = {StateKind::kParams, StateKind::kAdamM,
                                                            StateKind::kAdamV};

// The schema field a kind is stored as ("params", "adam_m", "adam_v").
constexpr const StateField& state_kind_field(StateKind k) {
  switch (k) {
    case StateKind::kParams: return kParamsField;
    case StateKind::kAdamM: return kAdamWFields[0];
    case StateKind::kAdamV: return kAdamWFields[1];
  }
  return kParamsField;
}

}  // namespace po::optim
