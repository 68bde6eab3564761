// The engine's counters, gauges and histograms in Prometheus' text
// exposition (GET /metrics): TGI's names where TGI has the metric, ours
// (pagedoptim_*) for the KV cache, the prefix cache and preemption.
#include <iterator>
#include <sstream>
#include <string>

#include "serve/engine.h"

namespace po::serve {

std::string Engine::metrics_text() const {
  const EngineStats st = stats();
  std::ostringstream o;
  auto counter = [&](const char* name, const char* help, int64_t v) {
    o << "# HELP " << name << ' ' << help << "\n# TYPE " << name << " counter\n" << name << ' ' << v << '\n';
  };
  auto gauge = [&](const char* name, const char* help, double v) {
    o << "# HELP " << name << ' ' << help << "\n# TYPE " << name << " gauge\n" << name << ' ' << v << '\n';
  };
  auto histogram = [&](const char* name, const char* help, const EngineStats::Histogram& h) {
    o << "# HELP " << name << ' ' << help << "\n# TYPE " << name << " histogram\n";
    int64_t cum = 0;
    for (size_t b = 0; b < std::size(kLatencyBuckets); ++b) {
      cum += h.counts.empty() ? 0 : h.counts[b];
      o << name << "_bucket{le=\"" << kLatencyBuckets[b] << "\"} " << cum << '\n';
    }
    o << name << "_bucket{le=\"+Inf\"} " << h.count << '\n'
      << name << "_sum " << h.sum << '\n'
      << name << "_count " << h.count << '\n';
  };
  counter("tgi_request_count", "Requests received", st.requests);
  counter("tgi_request_success", "Requests finished (length, EOS or stop sequence)", st.finished);
  counter("tgi_request_cancelled", "Requests cancelled (client gone, shutdown, failed step)", st.cancelled);
  counter("tgi_request_overloaded", "Requests rejected with 429", st.rejected);
  histogram("tgi_request_duration", "Request end-to-end seconds", st.request_duration);
  histogram("tgi_request_queue_duration", "Seconds from arrival to first scheduling", st.queue_duration);
  histogram("tgi_request_time_to_first_token", "Seconds from arrival to the first token", st.time_to_first_token);
  histogram("tgi_request_inter_token_latency", "Seconds between a request's tokens", st.inter_token_latency);
  gauge("tgi_queue_size", "Requests waiting", static_cast<double>(st.waiting));
  gauge("tgi_running_requests", "Requests holding KV blocks", static_cast<double>(st.running));
  gauge("tgi_batch_current_size", "Sequences sampled in the last step", static_cast<double>(st.batch_size));
  gauge("pagedoptim_kv_blocks_total", "KV blocks in the compute tier", static_cast<double>(st.kv_blocks_total));
  gauge("pagedoptim_kv_blocks_used", "KV blocks referenced by requests", static_cast<double>(st.kv_blocks_used));
  gauge("pagedoptim_kv_blocks_free", "KV blocks not referenced (free or prefix-cached)",
        static_cast<double>(st.kv_blocks_total - st.kv_blocks_used));
  gauge("pagedoptim_kv_blocks_cached", "Unreferenced KV blocks kept for the prefix cache",
        static_cast<double>(st.kv_blocks_cached));
  gauge("pagedoptim_kv_blocks_host", "KV blocks of preempted requests in host RAM",
        static_cast<double>(st.kv_blocks_host));
  gauge("pagedoptim_kv_tokens_held", "Positions whose keys and values the used blocks hold",
        static_cast<double>(st.kv_tokens_held));
  counter("pagedoptim_prefix_cache_queries", "Full prompt blocks looked up in the prefix cache", st.prefix_queries);
  counter("pagedoptim_prefix_cache_hits", "Full prompt blocks found in the prefix cache", st.prefix_hits);
  counter("pagedoptim_preemptions", "Requests preempted for KV room", st.preemptions);
  counter("pagedoptim_preemptions_swapped", "Preemptions that moved blocks to the host tier", st.swapped_out);
  counter("pagedoptim_kv_copy_on_write", "Shared KV blocks copied before a write", st.cow_copies);
  counter("tgi_request_input_count", "Prompt tokens of requests that produced a token", st.prompt_tokens);
  counter("tgi_request_generated_tokens", "Tokens generated", st.generated_tokens);
  counter("pagedoptim_steps", "Engine steps (batched forwards)", st.steps);
  return o.str();
}

}  // namespace po::serve
