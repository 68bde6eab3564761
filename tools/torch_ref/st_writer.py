"""A safetensors writer that produces the same bytes as Hugging Face's library.

Debian 12 has no python3-safetensors and only Debian's and npm's registries are
reachable here, so test fixtures are written by this file instead. It follows
safetensors' Rust `serialize` (safetensors/src/tensor.rs, `prepare`), which
`safetensors.torch.save_file` calls:

  - tensors sorted by dtype, widest first in the library's Dtype enum order
    (BOOL < ... < U8 < I8 < F8_* < I16 < U16 < F16 < BF16 < I32 < U32 < F32 <
    C64 < F64 < I64 < U64), ties by name (bytewise);
  - the header: serde_json's compact JSON of {"__metadata__": {...} (only when
    given; a hash map in the library, so its order is unspecified with two or
    more keys), then NAME: {"dtype", "shape", "data_offsets": [begin, end]} in
    data order}; non-ASCII characters written as UTF-8, not escaped;
  - spaces pad the header to a multiple of 8 bytes; an 8-byte little-endian
    header length comes first; then the tensors' bytes, C order, little-endian.

save(path, {name: numpy array}, metadata) is the whole interface.
"""
import json
import struct

import numpy as np

# Library Dtype order (most recent; older releases lack some entries, the
# relative order is unchanged).
_ORDER = ["BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
          "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64",
          "F64", "I64", "U64"]
_RANK = {name: i for i, name in enumerate(_ORDER)}

_NUMPY = {np.dtype("bool"): "BOOL", np.dtype("uint8"): "U8", np.dtype("int8"): "I8",
          np.dtype("int16"): "I16", np.dtype("uint16"): "U16", np.dtype("float16"): "F16",
          np.dtype("int32"): "I32", np.dtype("uint32"): "U32", np.dtype("float32"): "F32",
          np.dtype("float64"): "F64", np.dtype("int64"): "I64", np.dtype("uint64"): "U64"}


def _dump(obj):
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def serialize(tensors, metadata=None):
    """tensors: {name: (dtype_name, shape, raw_bytes)} or {name: numpy array}."""
    items = []
    for name, t in tensors.items():
        if isinstance(t, np.ndarray):
            a = np.ascontiguousarray(t)
            t = (_NUMPY[a.dtype], list(a.shape), a.astype(a.dtype.newbyteorder("<")).tobytes())
        items.append((name, t))
    items.sort(key=lambda kv: (-_RANK[kv[1][0]], kv[0].encode("utf-8")))
    parts = []
    if metadata is not None:
        parts.append(_dump("__metadata__") + ":" + _dump(metadata))
    offset = 0
    for name, (dtype, shape, raw) in items:
        info = '{"dtype":' + _dump(dtype) + ',"shape":' + _dump([int(d) for d in shape]) + \
               ',"data_offsets":[' + str(offset) + "," + str(offset + len(raw)) + "]}"
        parts.append(_dump(name) + ":" + info)
        offset += len(raw)
    header = ("{" + ",".join(parts) + "}").encode("utf-8")
    header += b" " * ((8 - len(header) % 8) % 8)
    return struct.pack("<Q", len(header)) + header + b"".join(raw for _, (_, _, raw) in items)


def save(path, tensors, metadata=None):
    with open(path, "wb") as f:
        f.write(serialize(tensors, metadata))


def bf16_bytes(a):
    """float32 array -> BF16 raw bytes, round to nearest even (as torch's .to(bfloat16))."""
    u = np.ascontiguousarray(a, dtype="<f4").view("<u4").astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")
    return rounded.tobytes()


if __name__ == "__main__":
    # The library's own test vectors (tensor.rs: test_serialization, test_empty).
    data = struct.pack("<6f", 0, 1, 2, 3, 4, 5)
    out = serialize({"attn.0": ("F32", [1, 2, 3], data)})
    assert out[:8] == bytes([64, 0, 0, 0, 0, 0, 0, 0]) and out[-24:] == data, out
    assert serialize({}) == bytes([8, 0, 0, 0, 0, 0, 0, 0, 123, 125, 32, 32, 32, 32, 32, 32])
    assert serialize({}, {"framework": "pt"})[:8] == bytes([40, 0, 0, 0, 0, 0, 0, 0])
    print("st_writer: library test vectors reproduced")
