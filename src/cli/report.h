// `pagedoptim report RUN [RUN ...] --out report.html`: one self-contained
// HTML file (inline SVG that we draw, no script and no network to open it)
// of one or more runs, overlaid where they share an axis (a sweep):
// - loss and validation loss against the step;
// - tokens/s and MFU;
// - each run's step time split: compute, exposed communication, paging I/O
//   wait, pipeline bubble, checkpoint;
// - memory per tier (the last step's, the largest rank's);
// - communication bytes and paging traffic per step;
// - restarts (events.jsonl) marked on the loss curve;
// and a summary table. The numbers behind every curve are in the file too
// (a JSON block, id "report-data"), so what is drawn can be checked.
#pragma once

#include <string>
#include <vector>

namespace po::cli {

// Writes the report; returns its path. Errors name the run directory.
std::string write_report(const std::vector<std::string>& runs, const std::string& out);

}  // namespace po::cli
