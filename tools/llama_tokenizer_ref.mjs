#!/usr/bin/env node
// Reference driver for the C++ Llama-2 tokenizer (src/data/llama_tokenizer.h),
// built on the npm package llama-tokenizer-js (the Llama-2 vocabulary and
// merges, with a JavaScript encoder).
//
//   node tools/llama_tokenizer_ref.mjs FILE...    prints one JSON line: an array
//                                                 with, per FILE (read as UTF-8),
//                                                 the ids of the package's
//                                                 encode(text): BOS (1), then the
//                                                 text with the dummy prefix; []
//                                                 for an empty text (no BOS)
//   node tools/llama_tokenizer_ref.mjs --write DIR
//                                                 writes DIR/tokenizer.json (the
//                                                 Hugging Face Llama-2 layout) and
//                                                 DIR/tokenizer.bin (llama2.c's
//                                                 layout) from the package's data
//   node tools/llama_tokenizer_ref.mjs --write-model FILE
//                                                 writes a SentencePiece ModelProto
//                                                 (tokenizer.model) of the same
//                                                 pieces and scores, for checking
//                                                 against the SentencePiece library
//                                                 (spm_encode from Debian's
//                                                 `sentencepiece`); not used by tests
//
// The package ships pieces and merge ranks, not SentencePiece scores. The
// tokenizer.bin scores are rebuilt the way Llama-2's tokenizer.model has them:
// 0 for <unk>, <s>, </s> and the 256 byte pieces; -1e9 for the pieces made only
// of "▁" (which is why "  the" is "▁", "▁the"); -(id - 259) for the rest. The
// script checks that this orders merges exactly as the package's merge ranks do
// (up to the ranks among pairs that make the same piece, which SentencePiece
// does not have) and fails otherwise.
//
// The package as a reference: it merges by HF merge rank, ties to the leftmost,
// as HF's BPE does. Its tie-break adds origPos / text.length (UTF-16 units) to
// 2·rank + 1, which could reorder two different merges in text where byte
// fallback makes many more symbols than UTF-16 units (emoji, rare CJK); no text
// tried showed it (the test set, 3000 random emoji/CJK/ASCII code points). Its
// encode() of "" is [] (no BOS). With --write-model, Debian's SentencePiece
// 0.1.97 gave the same ids as the C++ tokenizer on the test set and all 500
// Brown files (raw and as text): whitespace runs, digits and "  the" -> "▁",
// "▁the" included.
//
// llama-tokenizer-js is loaded from the repository's node_modules (run the
// set-up script, which runs `npm install` at the repository root).
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
const pkgFile = path.join(here, '..', 'node_modules', 'llama-tokenizer-js', 'llama-tokenizer.js');

function fail(msg) {
  process.stderr.write('llama_tokenizer_ref.mjs: ' + msg + '\n');
  process.exit(2);
}

const kSpace = '\u2581';
const isByte = (p) => /^<0x[0-9A-F]{2}>$/.test(p);
const isSpaceRun = (p) => p.length > 0 && [...p].every((c) => c === kSpace);

function scores(vocab, merges) {
  const s = vocab.map((p, id) => (id < 3 || isByte(p) ? 0 : isSpaceRun(p) ? -1e9 : -(id - 259)));
  // Each merge's result must score no better than the one of the merge before it.
  let prev = Infinity;
  const ids = new Map(vocab.map((p, i) => [p, i]));
  merges.forEach((m, rank) => {
    const [a, b] = m.split(' ');
    const score = s[ids.get(a + b)];
    if (score > prev) fail('merge ' + rank + ' "' + m + '" scores ' + score + ', above the merge before it (' + prev + ')');
    prev = score;
  });
  return s;
}

function tokenizerJson(vocab, merges) {
  const special = (id, content) => ({ id, content, single_word: false, lstrip: false, rstrip: false,
                                      normalized: false, special: true });
  return {
    version: '1.0',
    truncation: null,
    padding: null,
    added_tokens: [special(0, '<unk>'), special(1, '<s>'), special(2, '</s>')],
    normalizer: { type: 'Sequence', normalizers: [{ type: 'Prepend', prepend: kSpace },
                                                  { type: 'Replace', pattern: { String: ' ' }, content: kSpace }] },
    pre_tokenizer: null,
    post_processor: { type: 'TemplateProcessing',
                      single: [{ SpecialToken: { id: '<s>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
                      pair: [{ SpecialToken: { id: '<s>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } },
                             { SpecialToken: { id: '<s>', type_id: 1 } }, { Sequence: { id: 'B', type_id: 1 } }],
                      special_tokens: { '<s>': { id: '<s>', ids: [1], tokens: ['<s>'] } } },
    decoder: { type: 'Sequence', decoders: [{ type: 'Replace', pattern: { String: kSpace }, content: ' ' },
                                            { type: 'ByteFallback' }, { type: 'Fuse' },
                                            { type: 'Strip', content: ' ', start: 1, stop: 0 }] },
    model: { type: 'BPE', dropout: null, unk_token: '<unk>', continuing_subword_prefix: null,
             end_of_word_suffix: null, fuse_unk: true, byte_fallback: true,
             vocab: Object.fromEntries(vocab.map((p, i) => [p, i])), merges },
  };
}

// llama2.c's tokenizer.bin: uint32 max_token_length, then per piece float32
// score, int32 byte length, the bytes; "▁" written as " ", <s>/</s> as
// "\n<s>\n"/"\n</s>\n" (llama2.c's tokenizer.py export).
function tokenizerBin(vocab, s) {
  const pieces = vocab.map((p, id) => Buffer.from(id === 1 ? '\n<s>\n' : id === 2 ? '\n</s>\n' : p.replaceAll(kSpace, ' '), 'utf-8'));
  const maxLen = Math.max(...pieces.map((b) => b.length));
  const parts = [];
  const head = Buffer.alloc(4);
  head.writeUInt32LE(maxLen);
  parts.push(head);
  pieces.forEach((b, id) => {
    const rec = Buffer.alloc(8);
    rec.writeFloatLE(s[id], 0);
    rec.writeInt32LE(b.length, 4);
    parts.push(rec, b);
  });
  return Buffer.concat(parts);
}

// Protocol-buffer encoding, just what ModelProto needs.
function varint(n) {
  const out = [];
  for (n = BigInt(n); n >= 0x80n; n >>= 7n) out.push(Number(n & 0x7Fn) | 0x80);
  out.push(Number(n));
  return Buffer.from(out);
}
const field = (num, wire, payload) => Buffer.concat([varint((num << 3) | wire), payload]);
const fVarint = (num, v) => field(num, 0, varint(v));
const fBytes = (num, b) => field(num, 2, Buffer.concat([varint(b.length), b]));
const fFloat = (num, x) => { const b = Buffer.alloc(4); b.writeFloatLE(x); return field(num, 5, b); };

// sentencepiece_model.proto: ModelProto{1 pieces{1 piece, 2 score, 3 type}, 2
// trainer_spec{3 model_type (2 = BPE), 35 byte_fallback, 40-43 unk/bos/eos/pad
// ids}, 3 normalizer_spec{1 name, 3 add_dummy_prefix, 4 remove_extra_whitespaces,
// 5 escape_whitespaces}}; piece types NORMAL 1, UNKNOWN 2, CONTROL 3, BYTE 6.
function tokenizerModel(vocab, s) {
  const pieces = vocab.map((p, id) => fBytes(1, Buffer.concat([
    fBytes(1, Buffer.from(p, 'utf-8')), fFloat(2, s[id]), fVarint(3, id === 0 ? 2 : id < 3 ? 3 : isByte(p) ? 6 : 1)])));
  const trainer = Buffer.concat([fVarint(3, 2), fVarint(4, vocab.length), fVarint(35, 1), fVarint(40, 0), fVarint(41, 1),
                                 fVarint(42, 2), fVarint(43, (1n << 64n) - 1n)]);
  const normalizer = Buffer.concat([fBytes(1, Buffer.from('identity')), fVarint(3, 1), fVarint(4, 0), fVarint(5, 1)]);
  return Buffer.concat([...pieces, fBytes(2, trainer), fBytes(3, normalizer)]);
}

async function main() {
  const args = process.argv.slice(2);
  if (!fs.existsSync(pkgFile)) fail(pkgFile + ' is missing; run the set-up script (npm install at the repository root)');
  const { LlamaTokenizer } = await import(pathToFileURL(pkgFile).href);
  const tok = new LlamaTokenizer();
  if (args[0] === '--write') {
    if (args.length !== 2) fail('usage: --write DIR');
    const vocab = tok.vocabById;
    // The package keeps merges as a map "a b" -> 2·rank + 1, in rank order.
    const merges = [...tok.merges.keys()];
    if (vocab.length !== 32000 || merges.length === 0) fail('unexpected vocabulary: ' + vocab.length + ' pieces, ' + merges.length + ' merges');
    fs.mkdirSync(args[1], { recursive: true });
    fs.writeFileSync(path.join(args[1], 'tokenizer.json'), JSON.stringify(tokenizerJson(vocab, merges)));
    fs.writeFileSync(path.join(args[1], 'tokenizer.bin'), tokenizerBin(vocab, scores(vocab, merges)));
    return;
  }
  if (args[0] === '--write-model') {
    if (args.length !== 2) fail('usage: --write-model FILE');
    const merges = [...tok.merges.keys()];
    fs.writeFileSync(args[1], tokenizerModel(tok.vocabById, scores(tok.vocabById, merges)));
    return;
  }
  const result = args.map((f) => tok.encode(fs.readFileSync(f, 'utf-8')));
  process.stdout.write(JSON.stringify(result) + '\n');
}

main().catch((e) => fail(String(e && e.stack || e)));
