// The `pagedoptim` command line: subcommands prepare, train, export, generate.
#pragma once

namespace po::cli {

// Parses argv, runs the subcommand and returns the process exit code.
int run(int argc, char** argv);

}  // namespace po::cli
