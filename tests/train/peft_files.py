"""Checks a PEFT LoRA adapter directory the way peft's loader reads it, with the
standard library only (no engine code): adapter_config.json's fields and types,
adapter_model.safetensors' header (metadata {"format": "pt"}), and every tensor's
name and shape: base_model.model.<module path>.lora_A.weight [r, in] and
.lora_B.weight [out, r] in pairs, each module one of target_modules.

    python3 tests/train/peft_files.py DIR IN_FEATURES_JSON

IN_FEATURES_JSON maps a module suffix to [in, out], e.g. {"attn.c_attn": [32, 96]}.
Prints "ok: N modules" and exits 0, or prints each problem and exits 1.
"""
import json
import os
import re
import struct
import sys


def main():
    d, features = sys.argv[1], json.loads(sys.argv[2])
    problems = []
    with open(os.path.join(d, "adapter_config.json")) as f:
        c = json.load(f)
    want = {"peft_type": str, "r": int, "lora_alpha": (int, float), "target_modules": list,
            "lora_dropout": (int, float), "use_rslora": bool, "use_dora": bool,
            "base_model_name_or_path": str}
    for k, t in want.items():
        if k not in c:
            problems.append("adapter_config.json: no " + k)
        elif not isinstance(c[k], t) or (t is int and isinstance(c[k], bool)):
            problems.append("adapter_config.json: %s is %r" % (k, c[k]))
    if c.get("peft_type") != "LORA":
        problems.append("peft_type is %r" % c.get("peft_type"))
    r = c.get("r")
    with open(os.path.join(d, "adapter_model.safetensors"), "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        size = len(f.read())
    if header.get("__metadata__") != {"format": "pt"}:
        problems.append("metadata is %r, not {'format': 'pt'}" % header.get("__metadata__"))
    name_re = re.compile(r"^base_model\.model\.(.+)\.(lora_A|lora_B)\.weight$")
    pairs = {}
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        end = max(end, info["data_offsets"][1])
        m = name_re.match(name)
        if not m:
            problems.append("unexpected tensor name " + name)
            continue
        module, kind = m.group(1), m.group(2)
        suffix = next((s for s in features if module.endswith("." + s)), None)
        if suffix is None or not any(module.endswith("." + t) or module == t
                                     for t in c.get("target_modules", [])):
            problems.append(name + ": its module is not among target_modules")
            continue
        fin, fout = features[suffix]
        shape = [r, fin] if kind == "lora_A" else [fout, r]
        if info["shape"] != shape:
            problems.append("%s is %s, want %s" % (name, info["shape"], shape))
        if info["dtype"] not in ("F32", "F16", "BF16"):
            problems.append("%s has dtype %s" % (name, info["dtype"]))
        pairs.setdefault(module, set()).add(kind)
    for module, kinds in pairs.items():
        if kinds != {"lora_A", "lora_B"}:
            problems.append(module + ": has only " + ", ".join(sorted(kinds)))
    if end != size:
        problems.append("the data is %d bytes, the header covers %d" % (size, end))
    if not pairs:
        problems.append("no adapter tensors")
    for p in problems:
        print(p)
    if not problems:
        print("ok: %d modules" % len(pairs))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
