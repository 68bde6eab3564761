#include "cli/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "checkpoint/atomic_file.h"
#include "core/error.h"

namespace po::cli {
namespace fs = std::filesystem;
namespace {

using Points = std::vector<std::pair<double, double>>;

struct RunData {
  std::string name;
  Points loss, val, tps, mfu, comm_bytes, nvme_read, nvme_written, host_copy;
  // The time split per step, ms.
  Points compute, exposed, io_wait, bubble, checkpoint;
  std::map<std::string, double> memory;  // tier -> bytes (the largest rank's, last step)
  std::vector<int64_t> restarts_at;      // the step each restart resumed after (approximate: the last logged)
  int restarts = 0;
  std::set<int> threads;                 // threads_per_rank of its steps (older runs: none recorded)
};

double num(const nlohmann::json& r, const char* key, double fallback = 0) {
  return r.contains(key) && r[key].is_number() ? r[key].get<double>() : fallback;
}

RunData load_run(const std::string& dir) {
  RunData d;
  d.name = fs::path(dir).lexically_normal().filename().string();
  if (d.name.empty() || d.name == ".") d.name = fs::absolute(dir).lexically_normal().filename().string();
  const std::string path = (fs::path(dir) / "metrics.jsonl").string();
  std::ifstream f(path);
  PO_CHECK(f.good(), "report: ", dir, ": no metrics.jsonl (not a run directory?)");
  std::map<int64_t, size_t> seen;  // a resumed run logs a step again: the last one counts
  std::vector<nlohmann::json> steps;
  size_t n = 0;
  for (std::string line; std::getline(f, line);) {
    ++n;
    nlohmann::json r;
    try {
      r = nlohmann::json::parse(line);
    } catch (const std::exception& e) {
      PO_THROW(core::InvalidArgument, path, ":", n, ": not JSON (", e.what(), ")");
    }
    if (!r.contains("step")) continue;
    const double step = num(r, "step");
    if (r.contains("val_loss")) d.val.push_back({step, num(r, "val_loss")});
    if (r.contains("paging")) {
      const auto& p = r["paging"];
      d.nvme_read.push_back({step, num(p, "nvme_read_bytes")});
      d.nvme_written.push_back({step, num(p, "nvme_written_bytes")});
      d.host_copy.push_back({step, num(p, "host_read_bytes") + num(p, "host_written_bytes")});
      if (!d.io_wait.empty() && d.io_wait.back().first == step) d.io_wait.back().second = num(p, "io_wait_ms");
    }
    if (!r.contains("loss")) continue;
    const int64_t s = static_cast<int64_t>(step);
    if (auto it = seen.find(s); it != seen.end()) {  // the same step again, after a restart
      for (Points* pts : {&d.loss, &d.tps, &d.mfu, &d.comm_bytes, &d.compute, &d.exposed, &d.io_wait, &d.bubble,
                          &d.checkpoint})
        std::erase_if(*pts, [&](const auto& p) { return p.first >= step; });
    }
    seen[s] = n;
    const double step_ms = num(r, "step_ms");
    const double exposed = num(r, "exposed_comm_ms", num(r, "pp_wait_ms"));
    const double bubble = num(r, "pp_bubble") * step_ms;
    d.loss.push_back({step, num(r, "loss")});
    if (r.contains("threads_per_rank")) d.threads.insert(static_cast<int>(num(r, "threads_per_rank")));
    d.tps.push_back({step, num(r, "tokens_per_s")});
    if (r.contains("mfu")) d.mfu.push_back({step, num(r, "mfu")});
    double bytes = 0;
    if (r.contains("comm") && r["comm"].is_object())
      for (const auto& [op, v] : r["comm"].items()) bytes += num(v, "bytes");
    if (r.contains("pp_p2p_bytes")) bytes += num(r, "pp_p2p_bytes");
    d.comm_bytes.push_back({step, bytes});
    d.exposed.push_back({step, exposed});
    d.bubble.push_back({step, bubble});
    d.io_wait.push_back({step, 0});
    d.checkpoint.push_back({step, num(r, "checkpoint_ms")});
    d.compute.push_back({step, std::max(0.0, step_ms - exposed - bubble)});
    const auto& mem = r.contains("memory_per_rank") ? r["memory_per_rank"]
                      : r.contains("pp_memory_per_rank") ? r["pp_memory_per_rank"] : nlohmann::json();
    if (mem.is_array()) {
      d.memory.clear();
      for (const auto& rank : mem)
        for (const auto& [tier, v] : rank.items())
          if (v.is_number() && tier != "peak" && tier != "peak_rss" && tier != "total")
            d.memory[tier] = std::max(d.memory[tier], v.get<double>());
    }
  }
  PO_CHECK(!d.loss.empty(), "report: ", dir, ": metrics.jsonl holds no training step yet");
  // The I/O wait is recorded beside the step (a paging record): subtract it from compute.
  for (size_t i = 0; i < d.compute.size() && i < d.io_wait.size(); ++i)
    d.compute[i].second = std::max(0.0, d.compute[i].second - d.io_wait[i].second);
  std::ifstream ev(fs::path(dir) / "events.jsonl");
  for (std::string line; std::getline(ev, line);) {
    try {
      if (nlohmann::json::parse(line).value("event", "") == "restart") ++d.restarts;
    } catch (const std::exception&) {
    }
  }
  return d;
}

const char* kColors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                         "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

std::string fmt(double v) {
  char buf[32];
  const double a = std::fabs(v);
  if (a != 0 && (a >= 1e6 || a < 1e-3))
    std::snprintf(buf, sizeof buf, "%.3g", v);
  else
    std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

std::string escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '<') o += "&lt;";
    else if (c == '>') o += "&gt;";
    else if (c == '&') o += "&amp;";
    else if (c == '"') o += "&quot;";
    else o += c;
  }
  return o;
}

// Round tick spacing (1, 2 or 5 times a power of ten) for about `n` ticks.
double nice_step(double span, int n) {
  const double raw = span / n;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (raw <= m * p) return m * p;
  return 10 * p;
}

struct Series {
  std::string label;
  std::string color;
  bool dashed = false;
  Points pts;
};

// An SVG line chart; every point's value is also the title of its marker.
std::string line_chart(const std::string& title, const std::string& ylabel, const std::vector<Series>& series) {
  constexpr double W = 760, H = 300, L = 70, R = 170, T = 30, B = 40;
  double x0 = 1e300, x1 = -1e300, y0 = 1e300, y1 = -1e300;
  for (const auto& s : series)
    for (const auto& [x, y] : s.pts) {
      x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
    }
  std::ostringstream o;
  o << "<figure><svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
    << "\" role=\"img\" aria-label=\"" << escape(title) << "\">"
    << "<text x=\"" << L << "\" y=\"18\" class=\"t\">" << escape(title) << "</text>";
  if (x0 > x1) {
    o << "<text x=\"" << L << "\" y=\"" << H / 2 << "\">no data</text></svg></figure>";
    return o.str();
  }
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) {
    y0 -= y0 == 0 ? 1 : std::fabs(y0) * 0.05;
    y1 += y1 == 0 ? 1 : std::fabs(y1) * 0.05;
  }
  const double pad = (y1 - y0) * 0.05;
  y0 -= pad, y1 += pad;
  auto X = [&](double x) { return L + (x - x0) / (x1 - x0) * (W - L - R); };
  auto Y = [&](double y) { return H - B - (y - y0) / (y1 - y0) * (H - T - B); };
  o << "<rect x=\"" << L << "\" y=\"" << T << "\" width=\"" << W - L - R << "\" height=\"" << H - T - B
    << "\" class=\"frame\"/>";
  const double ys = nice_step(y1 - y0, 5);
  for (double v = std::ceil(y0 / ys) * ys; v <= y1; v += ys) {
    if (std::fabs(v) < ys * 1e-9) v = 0;  // not "-0"
    o << "<line x1=\"" << L << "\" x2=\"" << W - R << "\" y1=\"" << Y(v) << "\" y2=\"" << Y(v)
      << "\" class=\"grid\"/><text x=\"" << L - 6 << "\" y=\"" << Y(v) + 4 << "\" class=\"yt\">" << fmt(v)
      << "</text>";
  }
  const double xs = nice_step(x1 - x0, 6);
  for (double v = std::ceil(x0 / xs) * xs; v <= x1; v += xs)
    o << "<text x=\"" << X(v) << "\" y=\"" << H - B + 16 << "\" class=\"xt\">" << fmt(v) << "</text>";
  o << "<text x=\"" << (L + W - R) / 2 << "\" y=\"" << H - 6 << "\" class=\"xt\">step</text>"
    << "<text transform=\"translate(14," << (T + H - B) / 2 << ") rotate(-90)\" class=\"xt\">" << escape(ylabel)
    << "</text>";
  for (size_t i = 0; i < series.size(); ++i) {
    const Series& s = series[i];
    if (s.pts.empty()) continue;
    o << "<polyline class=\"series\" data-label=\"" << escape(s.label) << "\" fill=\"none\" stroke=\"" << s.color
      << "\" stroke-width=\"1.8\"" << (s.dashed ? " stroke-dasharray=\"5,3\"" : "") << " points=\"";
    for (const auto& [x, y] : s.pts) o << X(x) << "," << Y(y) << " ";
    o << "\"/>";
    if (s.pts.size() <= 64)
      for (const auto& [x, y] : s.pts)
        o << "<circle cx=\"" << X(x) << "\" cy=\"" << Y(y) << "\" r=\"2\" fill=\"" << s.color << "\"><title>"
          << escape(s.label) << " step " << fmt(x) << ": " << fmt(y) << "</title></circle>";
    const double ly = T + 14 + 16.0 * static_cast<double>(i);
    o << "<line x1=\"" << W - R + 10 << "\" x2=\"" << W - R + 30 << "\" y1=\"" << ly - 4 << "\" y2=\"" << ly - 4
      << "\" stroke=\"" << s.color << "\" stroke-width=\"2\"" << (s.dashed ? " stroke-dasharray=\"5,3\"" : "")
      << "/><text x=\"" << W - R + 34 << "\" y=\"" << ly << "\" class=\"lg\">" << escape(s.label) << "</text>";
  }
  o << "</svg></figure>\n";
  return o.str();
}

// Horizontal bars of memory per tier, one group per run.
std::string memory_chart(const std::vector<RunData>& runs) {
  std::vector<std::string> tiers;
  for (const auto& r : runs)
    for (const auto& [t, v] : r.memory)
      if (v > 0 && std::find(tiers.begin(), tiers.end(), t) == tiers.end()) tiers.push_back(t);
  double top = 1;
  for (const auto& r : runs)
    for (const auto& [t, v] : r.memory) top = std::max(top, v);
  constexpr double W = 760, L = 110, R = 120, bar = 9;
  const double H = 40 + static_cast<double>(tiers.size()) * (bar * static_cast<double>(runs.size()) + 8);
  std::ostringstream o;
  o << "<figure><svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
    << "\"><text x=\"" << L << "\" y=\"18\" class=\"t\">Memory per tier (MiB, the largest rank, last step)</text>";
  double y = 30;
  for (const auto& t : tiers) {
    o << "<text x=\"" << L - 6 << "\" y=\"" << y + bar * static_cast<double>(runs.size()) / 2 + 4
      << "\" class=\"yt\">" << escape(t) << "</text>";
    for (size_t i = 0; i < runs.size(); ++i) {
      const auto it = runs[i].memory.find(t);
      const double v = it == runs[i].memory.end() ? 0 : it->second;
      const double w = v / top * (W - L - R);
      o << "<rect x=\"" << L << "\" y=\"" << y << "\" width=\"" << w << "\" height=\"" << bar - 1 << "\" fill=\""
        << kColors[i % 10] << "\"><title>" << escape(runs[i].name) << " " << escape(t) << ": " << fmt(v / 1048576.0)
        << " MiB</title></rect><text x=\"" << L + w + 4 << "\" y=\"" << y + bar - 1 << "\" class=\"lg\">"
        << fmt(v / 1048576.0) << "</text>";
      y += bar;
    }
    y += 8;
  }
  o << "</svg></figure>\n";
  return o.str();
}

nlohmann::json points_json(const Points& p) {
  nlohmann::json a = nlohmann::json::array();
  for (const auto& [x, y] : p) a.push_back({x, y});
  return a;
}

double mean_of(const Points& p, size_t skip) {
  double s = 0;
  size_t n = 0;
  for (size_t i = skip; i < p.size(); ++i, ++n) s += p[i].second;
  return n ? s / static_cast<double>(n) : 0;
}

}  // namespace

std::string write_report(const std::vector<std::string>& dirs, const std::string& out) {
  PO_CHECK(!dirs.empty(), "report: give at least one run directory");
  std::vector<RunData> runs;
  for (const auto& d : dirs) runs.push_back(load_run(d));
  auto overlay = [&](Points RunData::*field, const char* suffix = "", bool dashed = false) {
    std::vector<Series> s;
    for (size_t i = 0; i < runs.size(); ++i)
      s.push_back({runs[i].name + suffix, kColors[i % 10], dashed, runs[i].*field});
    return s;
  };
  std::ostringstream h;
  h << "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>PagedOptim report</title>\n"
    << "<style>body{font-family:sans-serif;margin:24px;color:#222}h1{font-size:20px}h2{font-size:16px;margin-top:28px}"
       "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
       "th:first-child,td:first-child{text-align:left}figure{margin:8px 0}svg text{font-size:11px}"
       ".t{font-size:13px;font-weight:bold}.yt{text-anchor:end}.xt{text-anchor:middle}.lg{fill:#222}"
       ".frame{fill:none;stroke:#999}.grid{stroke:#eee}</style></head><body>\n"
    << "<h1>PagedOptim: " << runs.size() << (runs.size() == 1 ? " run" : " runs") << "</h1>\n";
  // Curves compared bit for bit need equal threads per rank (oneDNN splits a
  // GEMM's work by the thread count): a mix is said, here and on stderr.
  std::set<int> threads;
  for (const auto& r : runs) threads.insert(r.threads.begin(), r.threads.end());
  if (threads.size() > 1) {
    std::string list;
    for (const auto& r : runs)
      for (int t : r.threads) list += core::str_cat(list.empty() ? "" : ", ", r.name, ": ", t);
    const std::string note = core::str_cat(
        "these runs mix compute threads per rank (", list, "): their curves agree to rounding, not "
        "bit for bit (oneDNN splits a GEMM's work by the thread count)");
    std::fprintf(stderr, "report: warning: %s\n", note.c_str());
    h << "<p id=\"threads-warning\"><b>Note:</b> " << escape(note) << "</p>\n";
  }
  h << "<table id=\"summary\"><tr><th>run</th><th>steps</th><th>last loss</th><th>best val loss</th>"
       "<th>tokens/s</th><th>MFU</th><th>restarts</th></tr>\n";
  for (const auto& r : runs) {
    double best = -1;
    for (const auto& [x, v] : r.val) best = best < 0 ? v : std::min(best, v);
    h << "<tr><td>" << escape(r.name) << "</td><td>" << fmt(r.loss.back().first) << "</td><td>"
      << fmt(r.loss.back().second) << "</td><td>" << (best < 0 ? "-" : fmt(best)) << "</td><td>"
      << fmt(mean_of(r.tps, r.tps.size() > 1 ? 1 : 0)) << "</td><td>"
      << (r.mfu.empty() ? "-" : fmt(mean_of(r.mfu, r.mfu.size() > 1 ? 1 : 0))) << "</td><td>" << r.restarts
      << "</td></tr>\n";
  }
  h << "</table>\n<h2>Loss</h2>\n";
  std::vector<Series> loss = overlay(&RunData::loss);
  for (auto& s : overlay(&RunData::val, " val", true)) loss.push_back(std::move(s));
  h << line_chart("Training loss (solid) and validation loss (dashed)", "loss", loss);
  h << "<h2>Speed</h2>\n" << line_chart("Tokens per second", "tokens/s", overlay(&RunData::tps));
  h << line_chart("Model FLOPs utilisation", "MFU", overlay(&RunData::mfu));
  h << "<h2>Where each step's time went</h2>\n";
  for (const auto& r : runs)
    h << line_chart(r.name + ": step time split (ms)", "ms",
                    {{"compute", kColors[0], false, r.compute},
                     {"exposed comm", kColors[1], false, r.exposed},
                     {"paging I/O wait", kColors[2], false, r.io_wait},
                     {"pipeline bubble", kColors[3], false, r.bubble},
                     {"checkpoint", kColors[4], false, r.checkpoint}});
  h << "<h2>Memory</h2>\n" << memory_chart(runs);
  h << "<h2>Communication and paging</h2>\n"
    << line_chart("Bytes communicated per step (this rank's collectives)", "bytes", overlay(&RunData::comm_bytes));
  std::vector<Series> paging = overlay(&RunData::nvme_read, " NVMe read");
  for (auto& s : overlay(&RunData::nvme_written, " NVMe written", true)) paging.push_back(std::move(s));
  h << line_chart("Paging traffic per step (bytes)", "bytes", paging);
  nlohmann::json data = nlohmann::json::array();
  for (const auto& r : runs)
    data.push_back({{"run", r.name},
                    {"loss", points_json(r.loss)},
                    {"val_loss", points_json(r.val)},
                    {"tokens_per_s", points_json(r.tps)},
                    {"mfu", points_json(r.mfu)},
                    {"memory", r.memory},
                    {"restarts", r.restarts}});
  std::string json = data.dump();
  for (size_t p = json.find("</"); p != std::string::npos; p = json.find("</", p + 2)) json.replace(p, 2, "<\\/");
  h << "<script type=\"application/json\" id=\"report-data\">" << json << "</script>\n</body></html>\n";
  const std::string text = h.str();
  std::error_code ec;
  if (const fs::path parent = fs::path(out).parent_path(); !parent.empty()) fs::create_directories(parent, ec);
  checkpoint::write_file_atomic(out, text.data(), text.size());
  return out;
}

}  // namespace po::cli
