// `pagedoptim prepare`: tokenise documents into DIR/train.bin and DIR/val.bin.
//
// Documents: in "text" format each input file is one document; in "brown"
// format each Brown corpus file (names c[a-r]NN) is one document, its
// "word/tag" tokens stripped of tags and rejoined into plain text, one sentence
// per line (see brown_to_text). Directories expand to the files in them, sorted
// by name; in brown format files that are not Brown texts (CONTENTS, README,
// cats.txt, categories.pickle, ...) are skipped with a warning.
// With GPT-2's tokenizer each document is followed by <|endoftext|> (50256);
// with one that has a BOS (Llama: <s> = 1) each document starts with it instead.
// The token files are llm.c's uint16 format either way, so the tokenizer's
// vocabulary must have at most 65536 ids (checked before anything is read).
//
// Split: with D documents in input order and fraction f, document d (0-based) goes
// to val iff floor((d+1)·f) > floor(d·f) — floor(D·f) documents spread evenly
// (every 10th for f = 0.1), so val samples every genre of an ordered corpus.
// When that gives val no document (D·f < 1, e.g. a single file), val is instead the
// last ceil(f·N) tokens of the whole N-token stream. f = 0 leaves val.bin empty.
//
// Everything is read and tokenised before anything is written, and each output
// is written atomically, so an error never destroys an existing output.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace po::data {

struct PrepareOptions {
  std::vector<std::string> inputs;  // files or directories
  std::string out_dir;              // created if missing
  double val_fraction = 0.1;        // in [0, 1)
  std::string format = "text";      // "text" | "brown"
  std::string tokenizer_root;       // see find_tokenizer_files; "" searches upwards from the cwd
  std::string tokenizer;            // see load_tokenizer (a tokenizer.json, tokenizer.bin, GPT-2
                                    // files or directory); "" = GPT-2 from tokenizer_root
};

struct PrepareResult {
  std::string train_path, val_path;
  int64_t train_tokens = 0, val_tokens = 0;        // including the separators (EOS or BOS)
  int64_t train_documents = 0, val_documents = 0;  // whole documents (0 val documents: token-tail split)
};

// Throws InvalidArgument for bad options, a missing input, a bad tokenizer or one
// with over 65536 ids, or invalid UTF-8 (naming the file and byte offset);
// IoError if reading or writing fails.
PrepareResult prepare(const PrepareOptions& options);

// DIR/train.bin and DIR/val.bin, DIR created if missing (InvalidArgument if
// it cannot be).
std::pair<std::string, std::string> output_paths(const std::string& out_dir);

// Plain text of one Brown corpus file: tags stripped ("The/at" -> "The"),
// `` and '' -> ", no space before closing punctuation or after opening
// brackets/quotes, a doubled . ; or , printed once, one sentence per line.
std::string brown_to_text(std::string_view tagged);

// Whether a file name is a Brown corpus text (c[a-r] followed by two digits).
bool is_brown_file_name(std::string_view name);

}  // namespace po::data
