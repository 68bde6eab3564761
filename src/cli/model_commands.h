// The subcommands that read a model file (cli/cli.h's `pagedoptim`):
// export, merge, generate and serve, with the model and tokenizer loading
// they share.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>

namespace po::cli {

// A subcommand: its CLI11 app, and what it runs once parsed.
struct Command {
  CLI::App* app;
  std::function<int()> run;
};

// The repository (or install) root: the tokenizer files live under
// node_modules/ there. The binary sits in ROOT/build*/; empty when not found.
std::string tokenizer_root();

Command add_export(CLI::App& app);
Command add_merge(CLI::App& app);
Command add_generate(CLI::App& app);
Command add_serve(CLI::App& app);

}  // namespace po::cli
