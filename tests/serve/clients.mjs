// Real clients against `pagedoptim serve` (tests/cli/serve_cli_test.cc):
// the openai package (chat and completions, streaming and not, echo with
// logprobs, maxRetries 0)
// and @huggingface/inference (textGenerationStream), and TGI's own routes
// through a third-party TGI client: @huggingface/inference 2.8.1, pinned in
// package.json under the alias hf-inference-tgi, the last line that posts
// TGI's request shapes to the URL it is given (4.x posts OpenAI's to /v1).
// Prints one JSON object of the texts each got; the test compares them.
//   node tests/serve/clients.mjs BASE_URL API_KEY PROMPT MAX_TOKENS
import OpenAI from "openai";
import { InferenceClient } from "@huggingface/inference";
import { HfInference } from "hf-inference-tgi";

const [base, key, prompt, max] = process.argv.slice(2);
const n = Number(max);
const openai = new OpenAI({ baseURL: `${base}/v1`, apiKey: key, maxRetries: 0 });
const out = {};

let text = "";
for await (const c of await openai.completions.create({ model: "served", prompt, max_tokens: n, temperature: 0, stream: true }))
  text += c.choices[0]?.text ?? "";
out.completion_stream = text;
const comp = await openai.completions.create({ model: "served", prompt, max_tokens: n, temperature: 0 });
out.completion = comp.choices[0].text;
out.completion_usage = comp.usage;
// echo with logprobs: the prompt's tokens, scored (the first null), lead.
const echo = await openai.completions.create({ model: "served", prompt, max_tokens: n, temperature: 0, echo: true, logprobs: 1 });
out.echo = { text: echo.choices[0].text, tokens: echo.choices[0].logprobs.tokens,
             token_logprobs: echo.choices[0].logprobs.token_logprobs };

const messages = [{ role: "user", content: prompt }];
text = "";
let usage = null;
for await (const c of await openai.chat.completions.create({
  model: "served", messages, max_tokens: n, temperature: 0, stream: true, stream_options: { include_usage: true },
})) {
  text += c.choices[0]?.delta?.content ?? "";
  if (c.usage) usage = c.usage;
}
out.chat_stream = text;
out.chat_stream_usage = usage;
const chat = await openai.chat.completions.create({ model: "served", messages, max_tokens: n, temperature: 0 });
out.chat = chat.choices[0].message.content;
out.models = (await openai.models.list()).data.map((m) => m.id);

// @huggingface/inference 4.x: with an endpointUrl, textGenerationStream posts
// to {endpointUrl}/v1/completions and yields OpenAI's chunks (older versions:
// TGI's events at the URL itself); both shapes are read.
const hf = new InferenceClient(key, { endpointUrl: base });
text = "";
for await (const r of hf.textGenerationStream({ inputs: prompt, parameters: { max_new_tokens: n, temperature: 0 } }))
  text += r.choices?.[0]?.text ?? r.token?.text ?? "";
out.hf_stream = text;

// TGI's routes, TGI's shapes: /generate ({inputs, parameters} -> {generated_text}),
// / (the compat route: [{generated_text}], which textGeneration checks) and
// /generate_stream (token events, then generated_text).
const tgi = new HfInference(key);
const params = { max_new_tokens: n, do_sample: false };
out.tgi_generate = (await tgi.request({ model: `${base}/generate`, inputs: prompt, parameters: params })).generated_text;
out.tgi_compat = (await tgi.textGeneration({ model: base, inputs: prompt, parameters: params })).generated_text;
text = "";
let final = null;
for await (const e of tgi.textGenerationStream({ model: `${base}/generate_stream`, inputs: prompt, parameters: params })) {
  text += e.token.special ? "" : e.token.text;
  if (e.generated_text !== null && e.generated_text !== undefined) final = e.generated_text;
}
out.tgi_stream = text;
out.tgi_stream_final = final;

// A wrong key: the client's error carries the 401.
try {
  await new OpenAI({ baseURL: `${base}/v1`, apiKey: "wrong", maxRetries: 0 }).completions.create({ model: "served", prompt, max_tokens: 1 });
  out.wrong_key_status = 200;
} catch (e) {
  out.wrong_key_status = e.status ?? -1;
}
console.log(JSON.stringify(out));
