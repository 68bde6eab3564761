// Prints what npm's @huggingface/gguf parser reads from a local GGUF file, as
// JSON on stdout (a reference independent of src/checkpoint/gguf*):
//   {"version", "tensor_count", "metadata": {key: value},
//    "tensors": [{"name", "shape" (ne order, innermost first), "dtype" (ggml
//    type id), "offset" (relative to the data section, as stored)}]}
// 64-bit integers (the parser's bigints) are decimal strings; shape entries are
// numbers; arrays are plain arrays; f32 values are the stored float widened to
// a double. The parser's own entries version / tensor_count / kv_count are left
// out of "metadata".
//
//   node tools/gguf/gguf_meta.mjs FILE.gguf
import { gguf } from "@huggingface/gguf";
import path from "node:path";

const file = process.argv[2];
if (!file) {
  console.error("usage: node tools/gguf/gguf_meta.mjs FILE.gguf");
  process.exit(2);
}

// A relative path is taken from the current directory (the library's local
// reader receives it as given; a path starting with "http" would be a URL).
const { metadata, tensorInfos } = await gguf(path.resolve(file), { allowLocalFile: true });

const plain = (v) => {
  if (typeof v === "bigint") return v.toString();
  if (Array.isArray(v) || ArrayBuffer.isView(v)) return Array.from(v, plain);
  return v;
};

const { version, tensor_count, kv_count, ...rest } = metadata;
const out = {
  version,
  tensor_count: plain(tensor_count),
  metadata: Object.fromEntries(Object.entries(rest).map(([k, v]) => [k, plain(v)])),
  tensors: tensorInfos.map((t) => ({
    name: t.name,
    shape: t.shape.map(Number),
    dtype: t.dtype,
    offset: plain(t.offset),
  })),
};
if (Number(kv_count) !== Object.keys(out.metadata).length)
  throw new Error(`kv_count ${kv_count} but ${Object.keys(out.metadata).length} keys read`);
process.stdout.write(JSON.stringify(out) + "\n");
