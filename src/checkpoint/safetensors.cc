// See safetensors.h. Validation mirrors the reference implementation
// (huggingface/safetensors): header at most 100 MB, a JSON object, every
// tensor entry complete, offsets tiling the buffer exactly.
#include "checkpoint/safetensors.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <set>
#include <nlohmann/json.hpp>

#include "checkpoint/atomic_file.h"
#include "core/bf16.h"
#include "core/error.h"

namespace po::checkpoint {
namespace {

using Json = nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr const char* kMetadataKey = "__metadata__";

struct DtypeInfo {
  StDtype dtype;
  const char* name;
  size_t size;
};

constexpr std::array<DtypeInfo, 15> kDtypes = {{
    {StDtype::kBool, "BOOL", 1},  {StDtype::kU8, "U8", 1},     {StDtype::kI8, "I8", 1},
    {StDtype::kF8E5M2, "F8_E5M2", 1}, {StDtype::kF8E4M3, "F8_E4M3", 1},
    {StDtype::kI16, "I16", 2},    {StDtype::kU16, "U16", 2},   {StDtype::kF16, "F16", 2},
    {StDtype::kBF16, "BF16", 2},  {StDtype::kI32, "I32", 4},   {StDtype::kU32, "U32", 4},
    {StDtype::kF32, "F32", 4},    {StDtype::kF64, "F64", 8},   {StDtype::kI64, "I64", 8},
    {StDtype::kU64, "U64", 8},
}};

const DtypeInfo& info(StDtype d) {
  for (const auto& i : kDtypes)
    if (i.dtype == d) return i;
  PO_ASSERT(false, "unknown StDtype ", static_cast<int>(d));
  return kDtypes[0];
}

uint64_t load_le64(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

void store_le64(char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t{h & 0x8000u} << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Byte size of a tensor, or nullopt on overflow.
std::optional<uint64_t> byte_size(const tensor::Shape& shape, size_t elem) {
  uint64_t n = elem;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return std::nullopt;
  }
  return n;
}

// The 8-byte length prefix plus the space-padded JSON header.
std::string build_header(const std::vector<StTensorRef>& tensors,
                         const std::map<std::string, std::string>& metadata, uint64_t* data_bytes) {
  Json header = Json::object();
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    PO_CHECK(!t.name.empty(), "safetensors: empty tensor name");
    PO_CHECK(t.name != kMetadataKey, "safetensors: tensor name '", t.name, "' is reserved");
    PO_CHECK(!header.contains(t.name), "safetensors: duplicate tensor name '", t.name, "'");
    auto bytes = byte_size(t.shape, st_dtype_size(t.dtype));
    PO_CHECK(bytes.has_value(), "safetensors: tensor '", t.name, "' has invalid shape ",
             tensor::shape_str(t.shape));
    PO_CHECK(*bytes == 0 || t.data != nullptr, "safetensors: tensor '", t.name, "' has no data");
    header[t.name] = {{"dtype", st_dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + *bytes}}};
    offset += *bytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const Json::exception& e) {  // e.g. a name that is not valid UTF-8
    PO_THROW(core::InvalidArgument, "safetensors: cannot encode header: ", e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  store_le64(out.data(), text.size());
  out += text;
  *data_bytes = offset;
  return out;
}

// A JSON string literal as serde_json writes it: the same escapes as
// nlohmann's dump() (\" \\ \b \f \n \r \t, other controls \u00xx in lower
// case, UTF-8 passed through).
std::string json_string(const std::string& s) {
  try {
    return Json(s).dump();
  } catch (const Json::exception& e) {  // not valid UTF-8
    PO_THROW(core::InvalidArgument, "safetensors: cannot encode '", s, "': ", e.what());
  }
}

// Hugging Face's order: descending dtype, then name.
std::vector<StTensorRef> hf_order(const std::vector<StTensorRef>& tensors) {
  std::vector<StTensorRef> sorted = tensors;
  std::stable_sort(sorted.begin(), sorted.end(), [](const StTensorRef& a, const StTensorRef& b) {
    if (a.dtype != b.dtype) return a.dtype > b.dtype;
    return a.name < b.name;
  });
  return sorted;
}

// The header of serialize_safetensors_hf for tensors already in HF's order.
std::string build_header_hf(const std::vector<StTensorRef>& tensors,
                            const std::map<std::string, std::string>& metadata,
                            uint64_t* data_bytes) {
  std::string text = "{";
  bool first = true;
  if (!metadata.empty()) {
    text += "\"__metadata__\":{";
    for (const auto& [k, v] : metadata) {
      if (!first) text += ',';
      first = false;
      text += json_string(k) + ':' + json_string(v);
    }
    text += '}';
    first = false;
  }
  uint64_t offset = 0;
  std::set<std::string> seen;
  for (const auto& t : tensors) {
    PO_CHECK(!t.name.empty(), "safetensors: empty tensor name");
    PO_CHECK(t.name != kMetadataKey, "safetensors: tensor name '", t.name, "' is reserved");
    PO_CHECK(seen.insert(t.name).second, "safetensors: duplicate tensor name '", t.name, "'");
    auto bytes = byte_size(t.shape, st_dtype_size(t.dtype));
    PO_CHECK(bytes.has_value(), "safetensors: tensor '", t.name, "' has invalid shape ",
             tensor::shape_str(t.shape));
    PO_CHECK(*bytes == 0 || t.data != nullptr, "safetensors: tensor '", t.name, "' has no data");
    if (!first) text += ',';
    first = false;
    text += json_string(t.name) + ":{\"dtype\":\"" + st_dtype_name(t.dtype) + "\",\"shape\":[";
    for (size_t i = 0; i < t.shape.size(); ++i) {
      if (i > 0) text += ',';
      text += std::to_string(t.shape[i]);
    }
    text += "],\"data_offsets\":[" + std::to_string(offset) + ',' +
            std::to_string(offset + *bytes) + "]}";
    offset += *bytes;
  }
  text += '}';
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  store_le64(out.data(), text.size());
  out += text;
  *data_bytes = offset;
  return out;
}

}  // namespace

size_t st_dtype_size(StDtype d) { return info(d).size; }
const char* st_dtype_name(StDtype d) { return info(d).name; }

std::optional<StDtype> st_dtype_parse(std::string_view name) {
  for (const auto& i : kDtypes)
    if (name == i.name) return i.dtype;
  return std::nullopt;
}

std::optional<tensor::DType> st_to_dtype(StDtype d) {
  switch (d) {
    case StDtype::kF32: return tensor::DType::kF32;
    case StDtype::kBF16: return tensor::DType::kBF16;
    case StDtype::kF16: return tensor::DType::kF16;
    case StDtype::kI32: return tensor::DType::kI32;
    case StDtype::kU16: return tensor::DType::kU16;
    default: return std::nullopt;
  }
}

StDtype st_from_dtype(tensor::DType d) {
  switch (d) {
    case tensor::DType::kF32: return StDtype::kF32;
    case tensor::DType::kBF16: return StDtype::kBF16;
    case tensor::DType::kF16: return StDtype::kF16;
    case tensor::DType::kI32: return StDtype::kI32;
    case tensor::DType::kU16: return StDtype::kU16;
  }
  PO_ASSERT(false, "unknown DType ", static_cast<int>(d));
  return StDtype::kF32;
}

SafetensorsReader SafetensorsReader::open(const std::string& path) {
  SafetensorsReader r;
  r.origin_ = path;
  r.file_ = MappedFile(path);
  r.parse(r.file_.data(), r.file_.size());
  return r;
}

SafetensorsReader SafetensorsReader::from_bytes(const void* data, size_t size,
                                                const std::string& origin) {
  SafetensorsReader r;
  r.origin_ = origin;
  r.parse(static_cast<const std::byte*>(data), size);
  return r;
}

namespace {

// Parses one tensor entry of the header; `where` is "FILE: tensor 'NAME'".
StTensor parse_entry(const std::string& where, const std::string& name, const Json& e,
                     uint64_t buffer_size, uint64_t* begin, uint64_t* end) {
  PO_CHECK(e.is_object(), where, ": entry is not a JSON object");
  for (const char* key : {"dtype", "shape", "data_offsets"})
    PO_CHECK(e.contains(key), where, ": missing \"", key, "\"");
  const Json& jd = e["dtype"];
  PO_CHECK(jd.is_string(), where, ": \"dtype\" is not a string");
  auto dtype = st_dtype_parse(jd.get_ref<const std::string&>());
  PO_CHECK(dtype.has_value(), where, ": unknown dtype \"", jd.get_ref<const std::string&>(), "\"");
  const Json& js = e["shape"];
  PO_CHECK(js.is_array(), where, ": \"shape\" is not an array");
  StTensor t;
  t.name = name;
  t.dtype = *dtype;
  for (const Json& d : js) {
    PO_CHECK(d.is_number_unsigned() &&
                 d.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
             where, ": \"shape\" has an entry that is not a non-negative integer");
    t.shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
  }
  const Json& jo = e["data_offsets"];
  PO_CHECK(jo.is_array() && jo.size() == 2 && jo[0].is_number_unsigned() &&
               jo[1].is_number_unsigned(),
           where, ": \"data_offsets\" is not a pair of non-negative integers");
  *begin = jo[0].get<uint64_t>();
  *end = jo[1].get<uint64_t>();
  PO_CHECK(*begin <= *end, where, ": data_offsets [", *begin, ", ", *end, "] has begin > end");
  PO_CHECK(*end <= buffer_size, where, ": data_offsets [", *begin, ", ", *end,
           "] out of range of the ", buffer_size, "-byte data buffer");
  auto bytes = byte_size(t.shape, st_dtype_size(t.dtype));
  PO_CHECK(bytes.has_value(), where, ": shape ", tensor::shape_str(t.shape), " overflows");
  PO_CHECK(*bytes == *end - *begin, where, ": ", st_dtype_name(t.dtype), " ",
           tensor::shape_str(t.shape), " needs ", *bytes, " bytes but data_offsets [", *begin,
           ", ", *end, "] hold ", *end - *begin);
  t.nbytes = static_cast<size_t>(*bytes);
  return t;
}

}  // namespace

void SafetensorsReader::parse(const std::byte* data, size_t size) {
  const std::string& f = origin_;
  PO_CHECK(size >= 8, f, ": not a safetensors file: ", size, " bytes, shorter than the 8-byte header length");
  uint64_t n = load_le64(data);
  PO_CHECK(n <= size - 8, f, ": header length ", n, " exceeds the file (", size - 8,
           " bytes after the length)");
  PO_CHECK(n <= kMaxHeaderBytes, f, ": header length ", n, " exceeds the limit of ",
           kMaxHeaderBytes, " bytes");
  const char* hbegin = reinterpret_cast<const char*>(data + 8);
  Json header;
  try {
    header = Json::parse(hbegin, hbegin + n);
  } catch (const Json::exception& e) {
    PO_THROW(core::InvalidArgument, f, ": header is not valid JSON: ", e.what());
  }
  PO_CHECK(header.is_object(), f, ": header is not a JSON object");
  const std::byte* buffer = data + 8 + n;
  const uint64_t buffer_size = size - 8 - n;

  struct Span {
    uint64_t begin, end;
    const std::string* name;
  };
  std::vector<Span> spans;
  for (const auto& [name, entry] : header.items()) {
    if (name == kMetadataKey) {
      PO_CHECK(entry.is_object(), f, ": \"__metadata__\" is not a JSON object");
      for (const auto& [k, v] : entry.items()) {
        PO_CHECK(v.is_string(), f, ": \"__metadata__\" value for '", k, "' is not a string");
        metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    uint64_t begin = 0, end = 0;
    StTensor t = parse_entry(core::str_cat(f, ": tensor '", name, "'"), name, entry, buffer_size,
                             &begin, &end);
    t.data = buffer + begin;
    auto it = tensors_.emplace(name, std::move(t)).first;
    spans.push_back({begin, end, &it->first});
  }

  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t covered = 0;
  const std::string* prev = nullptr;
  for (const Span& s : spans) {
    PO_CHECK(s.begin >= covered, f, ": tensor '", *s.name, "' [", s.begin, ", ", s.end,
             ") overlaps tensor '", prev ? *prev : std::string(), "' (ends at ", covered, ")");
    PO_CHECK(s.begin == covered, f, ": data buffer bytes [", covered, ", ", s.begin,
             ") are not covered by any tensor (gap before tensor '", *s.name, "')");
    covered = s.end;
    prev = s.name;
    names_.push_back(*s.name);
  }
  PO_CHECK(covered == buffer_size, f, ": data buffer has ", buffer_size,
           " bytes but the tensors cover only ", covered);
}

const StTensor* SafetensorsReader::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

const StTensor& SafetensorsReader::get(const std::string& name) const {
  const StTensor* t = find(name);
  PO_CHECK(t != nullptr, origin_, ": missing tensor '", name, "'");
  return *t;
}

const StTensor& SafetensorsReader::require(const std::string& name, StDtype dtype,
                                           const tensor::Shape& shape) const {
  const StTensor& t = get(name);
  PO_CHECK(t.dtype == dtype, origin_, ": tensor '", name, "' has dtype ", st_dtype_name(t.dtype),
           ", expected ", st_dtype_name(dtype));
  PO_CHECK(t.shape == shape, origin_, ": tensor '", name, "' has shape ",
           tensor::shape_str(t.shape), ", expected ", tensor::shape_str(shape));
  return t;
}

void SafetensorsReader::read_f32(const std::string& name, const tensor::Shape& shape,
                                 float* dst) const {
  const StTensor& t = get(name);
  PO_CHECK(t.shape == shape, origin_, ": tensor '", name, "' has shape ",
           tensor::shape_str(t.shape), ", expected ", tensor::shape_str(shape));
  const size_t n = static_cast<size_t>(t.numel());
  switch (t.dtype) {
    case StDtype::kF32:
      if (n > 0) std::memcpy(dst, t.data, n * 4);
      return;
    case StDtype::kF16:
    case StDtype::kBF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, t.data + 2 * i, 2);
        dst[i] = t.dtype == StDtype::kF16 ? f16_to_f32(h) : core::bf16_to_f32(core::bf16{h});
      }
      return;
    default:
      PO_THROW(core::InvalidArgument, origin_, ": tensor '", name, "' has dtype ",
               st_dtype_name(t.dtype), ", expected F32 (or F16/BF16)");
  }
}

std::vector<float> SafetensorsReader::read_f32(const std::string& name,
                                               const tensor::Shape& shape) const {
  std::vector<float> out(static_cast<size_t>(tensor::shape_numel(shape)));
  read_f32(name, shape, out.data());
  return out;
}

void write_safetensors(const std::string& path, const std::vector<StTensorRef>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  uint64_t data_bytes = 0;
  const std::string header = build_header(tensors, metadata, &data_bytes);
  write_file_atomic(path, [&](AtomicFile& f) {
    f.write(header.data(), header.size());
    for (const auto& t : tensors) {
      size_t bytes = static_cast<size_t>(*byte_size(t.shape, st_dtype_size(t.dtype)));
      if (bytes > 0) f.write(t.data, bytes);
    }
  });
}

std::string serialize_safetensors(const std::vector<StTensorRef>& tensors,
                                  const std::map<std::string, std::string>& metadata) {
  uint64_t data_bytes = 0;
  std::string out = build_header(tensors, metadata, &data_bytes);
  out.reserve(out.size() + data_bytes);
  for (const auto& t : tensors) {
    size_t bytes = static_cast<size_t>(*byte_size(t.shape, st_dtype_size(t.dtype)));
    if (bytes > 0) out.append(static_cast<const char*>(t.data), bytes);
  }
  return out;
}

std::string serialize_safetensors_hf(const std::vector<StTensorRef>& tensors,
                                     const std::map<std::string, std::string>& metadata) {
  const std::vector<StTensorRef> sorted = hf_order(tensors);
  uint64_t data_bytes = 0;
  std::string out = build_header_hf(sorted, metadata, &data_bytes);
  out.reserve(out.size() + data_bytes);
  for (const auto& t : sorted) {
    size_t bytes = static_cast<size_t>(*byte_size(t.shape, st_dtype_size(t.dtype)));
    if (bytes > 0) out.append(static_cast<const char*>(t.data), bytes);
  }
  return out;
}

void write_safetensors_hf(const std::string& path, const std::vector<StTensorRef>& tensors,
                          const std::map<std::string, std::string>& metadata) {
  const std::vector<StTensorRef> sorted = hf_order(tensors);
  uint64_t data_bytes = 0;
  const std::string header = build_header_hf(sorted, metadata, &data_bytes);
  write_file_atomic(path, [&](AtomicFile& f) {
    f.write(header.data(), header.size());
    for (const auto& t : sorted) {
      size_t bytes = static_cast<size_t>(*byte_size(t.shape, st_dtype_size(t.dtype)));
      if (bytes > 0) f.write(t.data, bytes);
    }
  });
}

}  // namespace po::checkpoint
