#include "checkpoint/gguf.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <limits>

#include "checkpoint/atomic_file.h"
#include "checkpoint/mapped_file.h"
#include "core/error.h"

namespace po::checkpoint {
namespace {

constexpr char kMagic[4] = {'G', 'G', 'U', 'F'};
constexpr uint32_t kDefaultAlignment = 32;
constexpr uint32_t kMaxDims = 4;  // GGML_MAX_DIMS

// Bytes of one scalar of type t (0 for strings and arrays, which vary).
size_t scalar_bytes(GgufType t) {
  switch (t) {
    case GgufType::kU8: case GgufType::kI8: case GgufType::kBool: return 1;
    case GgufType::kU16: case GgufType::kI16: return 2;
    case GgufType::kU32: case GgufType::kI32: case GgufType::kF32: return 4;
    case GgufType::kU64: case GgufType::kI64: case GgufType::kF64: return 8;
    default: return 0;
  }
}

bool is_integer(GgufType t) {
  return t == GgufType::kU8 || t == GgufType::kI8 || t == GgufType::kU16 || t == GgufType::kI16 ||
         t == GgufType::kU32 || t == GgufType::kI32 || t == GgufType::kU64 || t == GgufType::kI64;
}

// A cursor over the file's bytes; every read names what it reads in the
// error when the bytes run out.
class Cursor {
 public:
  Cursor(const std::byte* data, size_t size, const std::string& origin) : d_(data), n_(size), origin_(origin) {}
  size_t pos() const { return pos_; }
  size_t left() const { return n_ - pos_; }

  template <typename T>
  T read(const std::string& what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, d_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string string(const std::string& what) {
    const auto len = read<uint64_t>(what);
    PO_CHECK(len <= left(), origin_, ": ", what, ": a string of ", len, " bytes but ", left(),
             " bytes are left (a truncated file?)");
    std::string s(reinterpret_cast<const char*>(d_ + pos_), static_cast<size_t>(len));
    pos_ += static_cast<size_t>(len);
    return s;
  }
  void need(size_t bytes, const std::string& what) const {
    PO_CHECK(bytes <= left(), origin_, ": truncated in ", what, ": it needs ", bytes, " bytes at offset ",
             pos_, ", ", left(), " are left");
  }

 private:
  const std::byte* d_;
  size_t n_;
  size_t pos_ = 0;
  const std::string& origin_;
};

nlohmann::json read_scalar(Cursor& c, GgufType t, const std::string& what) {
  switch (t) {
    case GgufType::kU8: return c.read<uint8_t>(what);
    case GgufType::kI8: return c.read<int8_t>(what);
    case GgufType::kU16: return c.read<uint16_t>(what);
    case GgufType::kI16: return c.read<int16_t>(what);
    case GgufType::kU32: return c.read<uint32_t>(what);
    case GgufType::kI32: return c.read<int32_t>(what);
    case GgufType::kU64: return c.read<uint64_t>(what);
    case GgufType::kI64: return c.read<int64_t>(what);
    case GgufType::kF32: return static_cast<double>(c.read<float>(what));
    case GgufType::kF64: return c.read<double>(what);
    case GgufType::kBool: {
      const auto b = c.read<uint8_t>(what);
      PO_CHECK(b <= 1, "a bool of value ", int{b}, " (0 or 1 expected)");
      return b == 1;
    }
    case GgufType::kString: return c.string(what);
    default: break;
  }
  PO_THROW(core::InvalidArgument, what, ": unknown value type ", static_cast<uint32_t>(t));
}

GgufType value_type(uint32_t raw, const std::string& origin, const std::string& key) {
  PO_CHECK(raw <= static_cast<uint32_t>(GgufType::kF64), origin, ": metadata '", key, "' has unknown value type ",
           raw, " (gguf.md defines 0-12)");
  return static_cast<GgufType>(raw);
}

}  // namespace

const char* gguf_type_name(GgufType t) {
  static const char* const kNames[] = {"u8", "i8",  "u16",   "i16", "u32", "i32", "f32",
                                       "bool", "string", "array", "u64", "i64", "f64"};
  const auto i = static_cast<uint32_t>(t);
  return i < 13 ? kNames[i] : "unknown";
}

GgufFile GgufFile::open(const std::string& path) {
  GgufFile f;
  auto map = std::make_shared<const MappedFile>(path);
  f.data_ = map->data();
  f.size_ = map->size();
  f.map_ = std::move(map);
  f.origin_ = path;
  f.parse();
  return f;
}

GgufFile GgufFile::from_bytes(const void* data, size_t size, std::string origin) {
  GgufFile f;
  f.data_ = static_cast<const std::byte*>(data);
  f.size_ = size;
  f.origin_ = std::move(origin);
  f.parse();
  return f;
}

void GgufFile::parse() {
  const std::string& o = origin_;
  Cursor c(data_, size_, o);
  c.need(4, "the magic");
  PO_CHECK(std::memcmp(data_, kMagic, 4) == 0, o, ": not a GGUF file (it does not start with \"GGUF\")");
  c.read<uint32_t>("the magic");
  version_ = c.read<uint32_t>("the version");
  PO_CHECK(version_ == 2 || version_ == 3, o, ": GGUF version ", version_,
           " (versions 2 and 3 are read; version 1's counts are 32-bit: convert it with a newer llama.cpp)");
  const auto n_tensors = c.read<uint64_t>("the tensor count");
  const auto n_kv = c.read<uint64_t>("the metadata count");
  // Each key-value takes at least 13 bytes, each tensor info at least 29:
  // counts beyond the file are lies, refused before anything is allocated.
  PO_CHECK(n_kv <= c.left() / 13, o, ": ", n_kv, " metadata entries cannot fit in the ", c.left(),
           " bytes left (a corrupt count?)");
  PO_CHECK(n_tensors <= c.left() / 29, o, ": ", n_tensors, " tensors cannot fit in the ", c.left(),
           " bytes left (a corrupt count?)");

  for (uint64_t i = 0; i < n_kv; ++i) {
    const std::string at = "metadata entry " + std::to_string(i);
    std::string key = c.string(at + "'s key");
    const std::string what = "metadata '" + key + "'";
    GgufValue v;
    v.type = value_type(c.read<uint32_t>(what + "'s type"), o, key);
    try {
      if (v.type == GgufType::kArray) {
        v.elem = value_type(c.read<uint32_t>(what + "'s element type"), o, key);
        PO_CHECK(v.elem != GgufType::kArray, "an array of arrays (not read, as ggml does not)");
        const auto len = c.read<uint64_t>(what + "'s length");
        const size_t min_elem = v.elem == GgufType::kString ? 8 : scalar_bytes(v.elem);
        PO_CHECK(len <= c.left() / min_elem, "an array of ", len, " ", gguf_type_name(v.elem), " but only ",
                 c.left(), " bytes are left");
        v.value = nlohmann::json::array();
        v.value.get_ref<nlohmann::json::array_t&>().reserve(static_cast<size_t>(len));
        for (uint64_t j = 0; j < len; ++j) v.value.push_back(read_scalar(c, v.elem, what));
      } else {
        v.value = read_scalar(c, v.type, what);
      }
    } catch (const core::InvalidArgument& e) {
      const std::string m = e.what();
      if (m.rfind(o + ":", 0) == 0) throw;
      PO_THROW(core::InvalidArgument, o, ": ", what, ": ", m);
    }
    PO_CHECK(key_index_.emplace(key, metadata_.size()).second, o, ": metadata key '", key, "' appears twice");
    metadata_.emplace_back(std::move(key), std::move(v));
  }
  if (const GgufValue* a = find("general.alignment")) {
    PO_CHECK(a->type == GgufType::kU32, o, ": metadata general.alignment is ", gguf_type_name(a->type),
             ", gguf.md makes it u32");
    const auto al = a->value.get<uint32_t>();
    PO_CHECK(al != 0 && (al & (al - 1)) == 0, o, ": general.alignment = ", al, " is not a power of two");
    alignment_ = al;
  }

  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensorInfo t;
    t.name = c.string("tensor info " + std::to_string(i) + "'s name");
    const std::string what = "tensor '" + t.name + "'";
    const auto n_dims = c.read<uint32_t>(what + "'s dimension count");
    PO_CHECK(n_dims >= 1 && n_dims <= kMaxDims, o, ": ", what, " has ", n_dims, " dimensions (1 to ", kMaxDims,
             " are allowed)");
    t.numel = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const auto ne = c.read<uint64_t>(what + "'s dimensions");
      PO_CHECK(ne >= 1 && ne <= (uint64_t{1} << 40), o, ": ", what, " has dimension ", d, " = ", ne);
      t.ne.push_back(static_cast<int64_t>(ne));
      PO_CHECK(t.numel <= (int64_t{1} << 50) / t.ne.back(), o, ": ", what, " has more than 2^50 elements");
      t.numel *= t.ne.back();
    }
    const auto raw_type = c.read<uint32_t>(what + "'s type");
    const auto type = backend::ggml_type_from_id(raw_type);
    PO_CHECK(type.has_value(), o, ": ", what, " is stored as ", backend::ggml_type_name(raw_type), " (ggml type ",
             raw_type, "), which is not read: F32, F16, BF16, Q8_0, Q4_0, Q4_K and Q6_K are");
    t.type = *type;
    const int64_t block = backend::ggml_block_elems(t.type);
    PO_CHECK(t.ne[0] % block == 0, o, ": ", what, " is ", backend::ggml_type_name(t.type), " with rows of ",
             t.ne[0], " elements, not a whole number of its ", block, "-element blocks");
    t.bytes = t.numel / block * backend::ggml_block_bytes(t.type);
    t.offset = c.read<uint64_t>(what + "'s offset");
    PO_CHECK(t.offset % alignment_ == 0, o, ": ", what, " has offset ", t.offset,
             ", not a multiple of the alignment ", alignment_);
    PO_CHECK(tensor_index_.emplace(t.name, tensors_.size()).second, o, ": tensor '", t.name, "' appears twice");
    tensors_.push_back(std::move(t));
  }

  data_start_ = (c.pos() + alignment_ - 1) / alignment_ * alignment_;
  const size_t data_bytes = data_start_ <= size_ ? size_ - data_start_ : 0;
  std::vector<const GgufTensorInfo*> by_offset;
  for (const GgufTensorInfo& t : tensors_) {
    PO_CHECK(t.offset <= data_bytes && static_cast<uint64_t>(t.bytes) <= data_bytes - t.offset, o, ": tensor '",
             t.name, "' (", backend::ggml_type_name(t.type), ", ", t.bytes, " bytes) at data offset ", t.offset,
             " runs past the end of the file (", data_bytes,
             " bytes of data): the file is truncated or the offset is wrong");
    by_offset.push_back(&t);
  }
  std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const GgufTensorInfo& a = *by_offset[i - 1];
    const GgufTensorInfo& b = *by_offset[i];
    PO_CHECK(a.offset + static_cast<uint64_t>(a.bytes) <= b.offset, o, ": tensor '", b.name, "' at data offset ",
             b.offset, " overlaps tensor '", a.name, "' (bytes ", a.offset, " to ", a.offset + a.bytes, ")");
  }
}

const GgufValue* GgufFile::find(std::string_view key) const {
  auto it = key_index_.find(key);
  return it == key_index_.end() ? nullptr : &metadata_[it->second].second;
}

std::optional<int64_t> GgufFile::find_int(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  PO_CHECK(is_integer(v->type), origin_, ": metadata ", key, " is ", gguf_type_name(v->type), ", an integer expected");
  if (v->value.is_number_unsigned()) {
    const auto u = v->value.get<uint64_t>();
    PO_CHECK(u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), origin_, ": metadata ", key, " = ",
             u, " is out of range");
    return static_cast<int64_t>(u);
  }
  return v->value.get<int64_t>();
}

std::optional<double> GgufFile::find_float(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  PO_CHECK(is_integer(v->type) || v->type == GgufType::kF32 || v->type == GgufType::kF64, origin_, ": metadata ",
           key, " is ", gguf_type_name(v->type), ", a number expected");
  return v->value.get<double>();
}

int64_t GgufFile::get_int(std::string_view key) const {
  auto v = find_int(key);
  PO_CHECK(v.has_value(), origin_, ": no metadata ", key);
  return *v;
}

double GgufFile::get_float(std::string_view key) const {
  auto v = find_float(key);
  PO_CHECK(v.has_value(), origin_, ": no metadata ", key);
  return *v;
}

const std::string& GgufFile::get_string(std::string_view key) const {
  const GgufValue* v = find(key);
  PO_CHECK(v != nullptr, origin_, ": no metadata ", key);
  PO_CHECK(v->type == GgufType::kString, origin_, ": metadata ", key, " is ", gguf_type_name(v->type),
           ", a string expected");
  return v->value.get_ref<const std::string&>();
}

const nlohmann::json& GgufFile::get_array(std::string_view key, GgufType elem) const {
  const GgufValue* v = find(key);
  PO_CHECK(v != nullptr, origin_, ": no metadata ", key);
  PO_CHECK(v->type == GgufType::kArray && v->elem == elem, origin_, ": metadata ", key, " is ",
           gguf_type_name(v->type), v->type == GgufType::kArray ? std::string(" of ") + gguf_type_name(v->elem) : "",
           ", an array of ", gguf_type_name(elem), " expected");
  return v->value;
}

const GgufTensorInfo* GgufFile::find_tensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

void GgufFile::read_f32(const GgufTensorInfo& t, float* dst) const {
  backend::ggml_dequantize(t.type, tensor_data(t), dst, t.numel);
}

bool is_gguf(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return in.read(magic, 4) && std::memcmp(magic, kMagic, 4) == 0;
}

namespace {

void put_bytes(std::vector<char>& out, const void* p, size_t n) {
  const auto* c = static_cast<const char*>(p);
  out.insert(out.end(), c, c + n);
}
template <typename T>
void put(std::vector<char>& out, T v) {
  put_bytes(out, &v, sizeof(T));
}
void put_string(std::vector<char>& out, const std::string& s) {
  put<uint64_t>(out, s.size());
  put_bytes(out, s.data(), s.size());
}

void put_scalar(std::vector<char>& out, GgufType t, const nlohmann::json& v, const std::string& key) {
  switch (t) {
    case GgufType::kU8: return put(out, v.get<uint8_t>());
    case GgufType::kI8: return put(out, v.get<int8_t>());
    case GgufType::kU16: return put(out, v.get<uint16_t>());
    case GgufType::kI16: return put(out, v.get<int16_t>());
    case GgufType::kU32: return put(out, v.get<uint32_t>());
    case GgufType::kI32: return put(out, v.get<int32_t>());
    case GgufType::kU64: return put(out, v.get<uint64_t>());
    case GgufType::kI64: return put(out, v.get<int64_t>());
    case GgufType::kF32: return put(out, static_cast<float>(v.get<double>()));
    case GgufType::kF64: return put(out, v.get<double>());
    case GgufType::kBool: return put<uint8_t>(out, v.get<bool>() ? 1 : 0);
    case GgufType::kString: return put_string(out, v.get<std::string>());
    default: PO_THROW(core::InvalidArgument, "write_gguf: metadata '", key, "': an array inside an array");
  }
}

}  // namespace

void write_gguf(const std::string& path, const GgufMetadata& metadata, const std::vector<GgufTensorOut>& tensors,
                uint32_t alignment) {
  PO_CHECK(alignment != 0 && (alignment & (alignment - 1)) == 0, "write_gguf: alignment ", alignment,
           " is not a power of two");
  GgufMetadata kv = metadata;
  if (alignment != kDefaultAlignment &&
      std::none_of(kv.begin(), kv.end(), [](const auto& e) { return e.first == "general.alignment"; }))
    kv.emplace_back("general.alignment", GgufValue::u32(alignment));
  std::vector<char> head;
  put_bytes(head, kMagic, 4);
  put<uint32_t>(head, 3);
  put<uint64_t>(head, tensors.size());
  put<uint64_t>(head, kv.size());
  for (const auto& [key, v] : kv) {
    put_string(head, key);
    put<uint32_t>(head, static_cast<uint32_t>(v.type));
    if (v.type == GgufType::kArray) {
      put<uint32_t>(head, static_cast<uint32_t>(v.elem));
      put<uint64_t>(head, v.value.size());
      for (const auto& e : v.value) put_scalar(head, v.elem, e, key);
    } else {
      put_scalar(head, v.type, v.value, key);
    }
  }
  std::vector<int64_t> bytes;
  uint64_t offset = 0;
  for (const GgufTensorOut& t : tensors) {
    PO_CHECK(!t.ne.empty() && t.ne.size() <= kMaxDims, "write_gguf: tensor '", t.name, "' has ", t.ne.size(),
             " dimensions");
    int64_t numel = 1;
    for (int64_t d : t.ne) numel *= d;
    PO_CHECK(t.ne[0] % backend::ggml_block_elems(t.type) == 0, "write_gguf: tensor '", t.name, "' has rows of ",
             t.ne[0], ", not whole ", backend::ggml_type_name(t.type), " blocks of ",
             backend::ggml_block_elems(t.type));
    bytes.push_back(backend::ggml_row_bytes(t.type, t.ne[0]) * (numel / t.ne[0]));
    put_string(head, t.name);
    put<uint32_t>(head, static_cast<uint32_t>(t.ne.size()));
    for (int64_t d : t.ne) put<uint64_t>(head, static_cast<uint64_t>(d));
    put<uint32_t>(head, static_cast<uint32_t>(t.type));
    put<uint64_t>(head, offset);
    offset += (static_cast<uint64_t>(bytes.back()) + alignment - 1) / alignment * alignment;
  }
  write_file_atomic(path, [&](AtomicFile& f) {
    f.write(head.data(), head.size());
    f.write_zeros((alignment - head.size() % alignment) % alignment);
    std::vector<float> values;
    std::vector<char> encoded;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const GgufTensorOut& t = tensors[i];
      const int64_t numel = bytes[i] / backend::ggml_block_bytes(t.type) * backend::ggml_block_elems(t.type);
      values.resize(static_cast<size_t>(numel));
      t.fill(values.data());
      encoded.resize(static_cast<size_t>(bytes[i]));
      backend::ggml_quantize(t.type, values.data(), encoded.data(), numel);
      f.write(encoded.data(), encoded.size());
      f.write_zeros((alignment - encoded.size() % alignment) % alignment);
    }
  });
}

}  // namespace po::checkpoint
