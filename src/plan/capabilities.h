// What the engine does not train yet: one table, read by `train` (make_plan
// refuses a layout with the first row that matches, naming its keys and the
// reason), by `plan` (Plan::not_trainable: the rows' short forms) and so by
// `plan --search --trainable` and the launcher's checks. A new capability
// (ZeRO-2/3 in a pipeline, say) is one row removed here.
//
// Only what is not built lives here. A layout that cannot exist (tp not
// dividing the heads, a batch that does not split, more pipeline ranks than
// the head's vocabulary pieces) is an error of check_layout / make_plan, not
// a capability.
#pragma once

#include <string>
#include <vector>

#include "plan/planner.h"

namespace po::plan {

struct Refusal {
  std::string keys;    // the settings that make it, with their values
  std::string reason;  // what is not built, and what to do instead
  std::string what;    // the planner's short form (a part of "pipeline parallel with ...")
  std::string message() const { return keys + reason; }
};

// Every row of the table that refuses `layout` (empty: the engine trains it).
std::vector<Refusal> refusals(const Layout& layout);

}  // namespace po::plan
