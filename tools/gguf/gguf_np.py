"""A numpy GGUF v3 writer, reader and ggml block codec, written from the
published format (ggml's docs/gguf.md) and ggml's block structs
(ggml-common.h) and reference routines (ggml-quants.c); it shares no code
with ggml or gguf-py. Used by make_gguf.py to write test fixtures that the
C++ reader (src/checkpoint/gguf.*) is checked against.

File layout (all little-endian):
  header    "GGUF", u32 version = 3, u64 tensor_count, u64 kv_count
  kv        kv_count x (string key, u32 value_type, value)
  infos     tensor_count x (string name, u32 n_dims, u64 ne[n_dims] innermost
            first, u32 ggml_type, u64 offset relative to the data section)
  padding   zeros to the next multiple of ALIGNMENT (general.alignment, u32,
            32 when absent)
  data      each tensor at an ALIGNMENT-multiple offset, zero padded
A string is a u64 byte length then UTF-8 bytes (no NUL); an array is u32
element type, u64 element count, then the elements.

API
  write_gguf(path, kv, tensors, alignment=32)
      kv: [(key, vtype, value)], vtype one of VALUE_TYPES' names ('u8', 'i8',
      'u16', 'i16', 'u32', 'i32', 'f32', 'bool', 'str', 'u64', 'i64', 'f64')
      or ('arr', elem_vtype) with a list value. The writer adds
      general.alignment (u32) when alignment != 32 and general.
      quantization_version (u32 2, which the spec requires once any tensor
      is quantized) when a quantized tensor is written; neither is added
      when the key is already in kv.
      tensors: [(name, type_name, payload)], type_name a key of TYPES
      ('F32', 'F16', 'BF16', 'Q8_0', 'Q4_0', 'Q4_K', 'Q6_K'); payload either
      a float32 numpy array in numpy (row-major) shape, encoded by
      quantize(), or a tuple (raw_bytes, numpy_shape) stored as given.
  quantize(type_name, x) -> bytes          x: float32 values, row-major
  dequantize(type_name, raw, n) -> np.float32 array of n values
  read_gguf(path) -> dict: version, alignment, data_offset (absolute),
      kv [(key, vtype, value)], metadata {key: value}, tensors [{name, type
      (name), type_id, ne, shape (numpy order), offset (relative), nbytes,
      raw (bytes)}]
  tensor_f32(info) -> the tensor decoded to float32, numpy shape
"""
import struct

import numpy as np

f32 = np.float32

# ggml type name -> (type id, elements per block, bytes per block).
TYPES = {
    "F32": (0, 1, 4),
    "F16": (1, 1, 2),
    "Q4_0": (2, 32, 2 + 16),           # f16 d, 16 bytes of nibbles
    "Q8_0": (8, 32, 2 + 32),           # f16 d, 32 int8
    "Q4_K": (12, 256, 2 + 2 + 12 + 128),  # f16 d, f16 dmin, scales[12], qs[128]
    "Q6_K": (14, 256, 128 + 64 + 16 + 2),  # ql[128], qh[64], int8 scales[16], f16 d
    "BF16": (30, 1, 2),
}
TYPE_BY_ID = {v[0]: k for k, v in TYPES.items()}
QUANTIZED = {"Q4_0", "Q8_0", "Q4_K", "Q6_K"}
GGML_QNT_VERSION = 2  # general.quantization_version of current ggml files

# GGUF metadata value types: name -> (id, struct format or None).
VALUE_TYPES = {
    "u8": (0, "<B"), "i8": (1, "<b"), "u16": (2, "<H"), "i16": (3, "<h"),
    "u32": (4, "<I"), "i32": (5, "<i"), "f32": (6, "<f"), "bool": (7, "<B"),
    "str": (8, None), "arr": (9, None), "u64": (10, "<Q"), "i64": (11, "<q"),
    "f64": (12, "<d"),
}
VALUE_TYPE_BY_ID = {v[0]: k for k, v in VALUE_TYPES.items()}
DEFAULT_ALIGNMENT = 32


def _type(name):
    name = name.upper()
    if name not in TYPES:
        raise ValueError(f"unsupported ggml type {name!r}")
    return name


def _nbytes(type_name, n):
    _, blk, size = TYPES[type_name]
    if n % blk:
        raise ValueError(f"{type_name}: {n} elements is not a whole number of {blk}-element blocks")
    return n // blk * size


# ----------------------------------------------------------------- float16s

def _f16(raw_u16):
    """f16 bit patterns -> float32 (exact, subnormals included)."""
    return np.asarray(raw_u16, dtype="<u2").view("<f2").astype(f32)


def _to_f16_bits(x):
    """float32 -> f16 bits, round to nearest even (as ggml's GGML_FP32_TO_FP16)."""
    return np.asarray(x, dtype=f32).astype("<f2").view("<u2")


def _to_bf16_bits(x):
    """float32 -> bf16 bits: round to nearest even on the dropped 16 bits; a NaN
    keeps its top bits with the quiet bit (0x40) set (ggml_compute_fp32_to_bf16)."""
    u = np.ascontiguousarray(x, dtype="<f4").view("<u4").astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (u >> 16) | 64, rounded).astype("<u2")


def _round_half_away(v):
    """C's roundf on float32 values (ties away from zero). float64 holds
    |v| + 0.5 exactly for every float32 v below 2^29."""
    v = np.asarray(v, dtype=np.float64)
    return np.sign(v) * np.floor(np.abs(v) + 0.5)


# --------------------------------------------------------------- quantizers

def _q8_0(x):
    """ggml's quantize_row_q8_0_ref: d = amax/127 stored as f16, q = roundf(x/d)
    computed as x * (1/d) in float32 (id = 0 when d == 0)."""
    xb = x.reshape(-1, 32)
    amax = np.abs(xb).max(axis=1)
    d = amax / f32(127)
    with np.errstate(divide="ignore"):
        idv = np.where(d != 0, f32(1) / d, f32(0)).astype(f32)
    q = _round_half_away(xb * idv[:, None]).astype(np.int8)
    out = np.zeros((xb.shape[0], 34), np.uint8)
    out[:, 0:2] = _to_f16_bits(d).view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q.view(np.uint8)
    return out.tobytes()


def _q4_0(x):
    """ggml's quantize_row_q4_0_ref: max = the first element of largest |x|
    (+0.0 when all are zero, so d = -0.0), d = max / -8 stored as f16,
    q = min(15, (int8)(x*id + 8.5f)) in float32 with C's truncation; byte j
    holds element j in its low nibble and element j+16 in its high nibble."""
    xb = x.reshape(-1, 32)
    a = np.abs(xb)
    i = np.argmax(a, axis=1)  # first index of the largest |x|, as C's strict `<`
    mx = xb[np.arange(len(xb)), i]
    mx = np.where(a.max(axis=1) > 0, mx, f32(0)).astype(f32)
    d = (mx / f32(-8)).astype(f32)
    with np.errstate(divide="ignore"):
        idv = np.where(d != 0, f32(1) / d, f32(0)).astype(f32)
    v = (xb * idv[:, None]).astype(f32) + f32(8.5)  # float32 sum, then truncation
    q = np.minimum(15, np.trunc(v).astype(np.int64)).astype(np.uint8)
    out = np.zeros((xb.shape[0], 18), np.uint8)
    out[:, 0:2] = _to_f16_bits(d).view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q[:, :16] | (q[:, 16:] << 4)
    return out.tobytes()


def _pack_k4_scales(ls, lm):
    """Packs 8 6-bit scales `ls` and 8 6-bit mins `lm` per block into Q4_K's 12
    bytes: for j < 4, byte j = scale j and byte j+4 = min j (low 6 bits each);
    for j >= 4, byte j+4 = scale j low 4 bits | min j low 4 bits << 4, and their
    top 2 bits go to bits 6-7 of bytes j-4 (scale) and j (min)."""
    s = np.zeros((ls.shape[0], 12), np.uint8)
    for j in range(4):
        s[:, j] = ls[:, j]
        s[:, j + 4] = lm[:, j]
    for j in range(4, 8):
        s[:, j + 4] = (ls[:, j] & 0xF) | ((lm[:, j] & 0xF) << 4)
        s[:, j - 4] |= (ls[:, j] >> 4) << 6
        s[:, j] |= (lm[:, j] >> 4) << 6
    return s


def _q4_k(x):
    """A simple valid Q4_K encoder (NOT ggml's iterative search): per 32-element
    sub-block, min m = max(0, -min x) and step = (max x + m)/15; d and dmin are
    the largest step and min over 63, stored as f16; the 6-bit scale and min
    are those over the stored d and dmin, and q = clip(round((x + dmin*lm) /
    (d*ls)), 0, 15). Decoded value: d*ls*q - dmin*lm."""
    xb = x.reshape(-1, 8, 32).astype(np.float64)
    mins = np.maximum(0.0, -xb.min(axis=2))
    steps = (xb.max(axis=2) + mins) / 15
    d = _f16(_to_f16_bits(steps.max(axis=1) / 63)).astype(np.float64)
    dmin = _f16(_to_f16_bits(mins.max(axis=1) / 63)).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = np.where(d[:, None] > 0, np.rint(steps / d[:, None]), 0)
        lm = np.where(dmin[:, None] > 0, np.rint(mins / dmin[:, None]), 0)
        ls = np.clip(ls, 0, 63).astype(np.uint8)
        lm = np.clip(lm, 0, 63).astype(np.uint8)
        step = d[:, None] * ls
        q = np.where(step[..., None] > 0,
                     np.rint((xb + (dmin[:, None] * lm)[..., None]) / step[..., None]), 0)
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)
    out = np.zeros((xb.shape[0], 144), np.uint8)
    out[:, 0:2] = _to_f16_bits(d).view(np.uint8).reshape(-1, 2)
    out[:, 2:4] = _to_f16_bits(dmin).view(np.uint8).reshape(-1, 2)
    out[:, 4:16] = _pack_k4_scales(ls, lm)
    # 64-element group g: qs[32g + l] = q[64g + l] | q[64g + 32 + l] << 4
    out[:, 16:] = (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(-1, 128)
    return out.tobytes()


def _q6_k(x):
    """A simple valid Q6_K encoder (NOT ggml's search): per 16-element sub-block
    step = max|x| / 31; d = largest step / 127 as f16; int8 scale = round(step
    / d) in 0..127; q = clip(round(x / (d*scale)), -32, 31), stored + 32 as
    4 low bits (ql) and 2 high bits (qh). Decoded value: d*scale*q."""
    xb = x.reshape(-1, 16, 16).astype(np.float64)
    steps = np.abs(xb).max(axis=2) / 31
    d = _f16(_to_f16_bits(steps.max(axis=1) / 127)).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.where(d[:, None] > 0, np.rint(steps / d[:, None]), 0), 0, 127)
        step = d[:, None] * sc
        q = np.where(step[..., None] > 0, np.rint(xb / step[..., None]), 0)
    L = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [block, half, quarter, l]
    ql = np.concatenate([(L[:, :, 0] & 0xF) | ((L[:, :, 2] & 0xF) << 4),
                         (L[:, :, 1] & 0xF) | ((L[:, :, 3] & 0xF) << 4)], axis=2)  # [block, half, 64]
    qh = (L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4) | ((L[:, :, 3] >> 4) << 6)
    out = np.zeros((xb.shape[0], 210), np.uint8)
    out[:, 0:128] = ql.reshape(-1, 128)
    out[:, 128:192] = qh.reshape(-1, 64)
    out[:, 192:208] = sc.astype(np.int8).view(np.uint8)
    out[:, 208:210] = _to_f16_bits(d).view(np.uint8).reshape(-1, 2)
    return out.tobytes()


def quantize(type_name, x):
    """float32 values (any shape, row-major) -> the bytes of `type_name`."""
    t = _type(type_name)
    x = np.ascontiguousarray(x, dtype=f32).reshape(-1)
    _nbytes(t, x.size)
    if t == "F32":
        return x.astype("<f4").tobytes()
    if t == "F16":
        return _to_f16_bits(x).tobytes()
    if t == "BF16":
        return _to_bf16_bits(x).tobytes()
    return {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_K": _q4_k, "Q6_K": _q6_k}[t](x)


# ------------------------------------------------------------- dequantizers
# All arithmetic in float32, in ggml's order of operations (dequantize_row_*),
# so the results are bit-exact to the C reference built without FMA
# contraction.

def _k4_scale_min(s):
    """Q4_K's get_scale_min_k4 for j = 0..7 over scale bytes s [nb, 12] ->
    (sc, m) [nb, 8] as float32."""
    s = s.astype(np.int32)
    sc = np.zeros((s.shape[0], 8), np.int32)
    m = np.zeros_like(sc)
    for j in range(8):
        if j < 4:
            sc[:, j] = s[:, j] & 63
            m[:, j] = s[:, j + 4] & 63
        else:
            sc[:, j] = (s[:, j + 4] & 0xF) | ((s[:, j - 4] >> 6) << 4)
            m[:, j] = (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4)
    return sc.astype(f32), m.astype(f32)


def dequantize(type_name, raw, n):
    """The first n values of `raw` (bytes of `type_name`) as float32."""
    t = _type(type_name)
    size = _nbytes(t, n)
    b = np.frombuffer(raw, dtype=np.uint8, count=size)
    if t == "F32":
        return b.view("<f4").astype(f32)
    if t == "F16":
        return _f16(b.view("<u2"))
    if t == "BF16":
        return (b.view("<u2").astype(np.uint32) << 16).view(f32)
    blk = b.reshape(-1, TYPES[t][2])
    if t == "Q8_0":  # y = q * d
        d = _f16(blk[:, 0:2].copy().view("<u2")[:, 0])
        return (blk[:, 2:].view(np.int8).astype(f32) * d[:, None]).reshape(-1)
    if t == "Q4_0":  # y = (nibble - 8) * d; low nibbles first, then high
        d = _f16(blk[:, 0:2].copy().view("<u2")[:, 0])
        qs = blk[:, 2:].astype(np.int32)
        q = np.concatenate([(qs & 0xF) - 8, (qs >> 4) - 8], axis=1).astype(f32)
        return (q * d[:, None]).reshape(-1)
    if t == "Q4_K":
        d = _f16(blk[:, 0:2].copy().view("<u2")[:, 0])
        dmin = _f16(blk[:, 2:4].copy().view("<u2")[:, 0])
        sc, m = _k4_scale_min(blk[:, 4:16])
        d1 = d[:, None] * sc            # [nb, 8] float32: d * sc
        m1 = dmin[:, None] * m          # dmin * m
        qs = blk[:, 16:].reshape(-1, 4, 32).astype(np.int32)  # 4 groups of 64 values
        q = np.stack([qs & 0xF, qs >> 4], axis=2).reshape(-1, 8, 32).astype(f32)  # sub-block 2g, 2g+1
        return (d1[:, :, None] * q - m1[:, :, None]).reshape(-1)  # (d1*q) - m1
    if t == "Q6_K":
        ql = blk[:, 0:128].reshape(-1, 2, 64).astype(np.int32)   # per 128-value half
        qh = blk[:, 128:192].reshape(-1, 2, 32).astype(np.int32)
        sc = blk[:, 192:208].view(np.int8).astype(f32)            # [nb, 16]
        d = _f16(blk[:, 208:210].copy().view("<u2")[:, 0])
        lo, hi = ql[:, :, :32], ql[:, :, 32:]
        q = np.stack([(lo & 0xF) | (((qh >> 0) & 3) << 4),    # values l      (q1)
                      (hi & 0xF) | (((qh >> 2) & 3) << 4),    # values l + 32 (q2)
                      (lo >> 4) | (((qh >> 4) & 3) << 4),     # values l + 64 (q3)
                      (hi >> 4) | (((qh >> 6) & 3) << 4)],    # values l + 96 (q4)
                     axis=2) - 32                             # [nb, half, quarter, 32]
        q = q.reshape(-1, 16, 16).astype(f32)   # 16-value sub-block k uses scale k
        ds = d[:, None] * sc                    # d * sc, then * q
        return (ds[:, :, None] * q).reshape(-1)
    raise AssertionError(t)


# ------------------------------------------------------------------ writer

def _pack_value(vtype, value):
    if isinstance(vtype, tuple):  # ('arr', elem_vtype)
        assert vtype[0] == "arr", vtype
        elem = vtype[1]
        eid = VALUE_TYPES["arr" if isinstance(elem, tuple) else elem][0]
        return struct.pack("<IQ", eid, len(value)) + b"".join(_pack_value(elem, v) for v in value)
    if vtype == "str":
        raw = value.encode("utf-8")
        return struct.pack("<Q", len(raw)) + raw
    if vtype == "bool":
        return struct.pack("<B", 1 if value else 0)  # 1 byte: 0 false, 1 true
    return struct.pack(VALUE_TYPES[vtype][1], value)


def _vtype_id(vtype):
    return VALUE_TYPES["arr" if isinstance(vtype, tuple) else vtype][0]


def _align(n, a):
    return n + (a - n % a) % a


def write_gguf(path, kv, tensors, alignment=DEFAULT_ALIGNMENT):
    """Writes a GGUF v3 file; see the module docstring for kv and tensors."""
    if alignment <= 0 or alignment % 8:
        raise ValueError("alignment must be a positive multiple of 8 (docs/gguf.md)")
    kv = list(kv)
    keys = [k for k, _, _ in kv]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate metadata key")
    last_general = max([i for i, k in enumerate(keys) if k.startswith("general.")], default=-1)
    if "general.alignment" in keys:
        if next(v for k, _, v in kv if k == "general.alignment") != alignment:
            raise ValueError("general.alignment in kv disagrees with alignment")
    elif alignment != DEFAULT_ALIGNMENT:
        last_general += 1
        kv.insert(last_general, ("general.alignment", "u32", alignment))
    if any(_type(t) in QUANTIZED for _, t, _ in tensors) and "general.quantization_version" not in keys:
        kv.insert(last_general + 1, ("general.quantization_version", "u32", GGML_QNT_VERSION))

    infos, blobs, offset = [], [], 0
    for name, type_name, payload in tensors:
        t = _type(type_name)
        if isinstance(payload, tuple):  # (raw bytes, numpy shape)
            raw, shape = bytes(payload[0]), tuple(int(s) for s in payload[1])
        else:
            shape = tuple(payload.shape)
            raw = quantize(t, payload)
        if not shape or len(shape) > 4:
            raise ValueError(f"{name}: ggml tensors have 1 to 4 dimensions")
        if len(name.encode("utf-8")) >= 64:
            raise ValueError(f"{name}: tensor names are at most 63 bytes (GGML_MAX_NAME 64 with NUL)")
        if shape[-1] % TYPES[t][1] or len(raw) != _nbytes(t, int(np.prod(shape))):
            raise ValueError(f"{name}: {len(raw)} bytes do not hold {t} of shape {shape} (rows whole blocks)")
        ne = shape[::-1]  # innermost (contiguous) dimension first
        infos.append(_pack_value("str", name) + struct.pack("<I", len(ne)) +
                     struct.pack(f"<{len(ne)}Q", *ne) + struct.pack("<IQ", TYPES[t][0], offset))
        blobs.append(raw + b"\0" * (_align(len(raw), alignment) - len(raw)))
        offset += len(blobs[-1])

    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv))
    head += b"".join(_pack_value("str", k) + struct.pack("<I", _vtype_id(vt)) + _pack_value(vt, v)
                     for k, vt, v in kv)
    head += b"".join(infos)
    head += b"\0" * (_align(len(head), alignment) - len(head))
    with open(path, "wb") as f:
        f.write(head)
        for blob in blobs:
            f.write(blob)


# ------------------------------------------------------------------ reader

class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, fmt):
        v = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v[0] if len(v) == 1 else v

    def string(self):
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError("string runs past the end of the file")
        s = self.buf[self.pos:self.pos + n].decode("utf-8")
        self.pos += n
        return s

    def value(self, tid):
        vt = VALUE_TYPE_BY_ID[tid]
        if vt == "str":
            return vt, self.string()
        if vt == "arr":
            eid, n = self.take("<IQ")
            vals = [self.value(eid) for _ in range(n)]
            ev = VALUE_TYPE_BY_ID[eid]
            elem = vals[0][0] if vals and ev == "arr" else ev
            return ("arr", elem), [v for _, v in vals]
        v = self.take(VALUE_TYPES[vt][1])
        if vt == "bool":
            if v not in (0, 1):
                raise ValueError(f"bool value {v} is not 0 or 1")
            v = bool(v)
        return vt, v


def read_gguf(path):
    """Parses a GGUF v3 file (checks layout, alignment and bounds)."""
    with open(path, "rb") as f:
        buf = f.read()
    c = _Cursor(buf)
    if buf[:4] != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    c.pos = 4
    version, n_tensors, n_kv = c.take("<IQQ")
    if version != 3:
        raise ValueError(f"{path}: GGUF version {version}, expected 3")
    kv = []
    for _ in range(n_kv):
        key = c.string()
        vt, v = c.value(c.take("<I"))
        kv.append((key, vt, v))
    metadata = {k: v for k, _, v in kv}
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        nd = c.take("<I")
        ne = list(struct.unpack_from(f"<{nd}Q", buf, c.pos))
        c.pos += 8 * nd
        tid, off = c.take("<IQ")
        t = TYPE_BY_ID[tid]
        infos.append({"name": name, "type": t, "type_id": tid, "ne": ne, "shape": tuple(ne[::-1]),
                      "offset": off, "nbytes": _nbytes(t, int(np.prod(ne)))})
    data = _align(c.pos, alignment)
    for t in infos:
        if t["offset"] % alignment:
            raise ValueError(f"{path}: tensor {t['name']} offset {t['offset']} is not aligned")
        start = data + t["offset"]
        if start + t["nbytes"] > len(buf):
            raise ValueError(f"{path}: tensor {t['name']} runs past the end of the file")
        t["raw"] = buf[start:start + t["nbytes"]]
    return {"version": version, "alignment": alignment, "data_offset": data, "kv": kv,
            "metadata": metadata, "tensors": infos}


def tensor_f32(info):
    """A tensor from read_gguf decoded to float32 in numpy shape."""
    return dequantize(info["type"], info["raw"], int(np.prod(info["shape"]))).reshape(info["shape"])
