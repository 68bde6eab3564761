// Entry point: the only place that turns exceptions into exit codes.
#include "cli/cli.h"

int main(int argc, char** argv) { return po::cli::run(argc, argv); }
