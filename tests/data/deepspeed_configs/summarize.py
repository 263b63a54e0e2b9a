"""Print the summary tables of README.md from the corpus itself.

    python tests/data/deepspeed_configs/summarize.py [--deepspeed-git DIR]

With --deepspeed-git (a DeepSpeed git directory, e.g. a fetched snapshot), it
also lists every key the corpus uses that appears nowhere as a word in
DeepSpeed's Python sources at that directory's HEAD: keys DeepSpeed cannot be
reading. Standard library only; the corpus is data, not code under test.
"""

import argparse
import collections
import json
import os
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))

# Maps whose keys are names the user chose (groups, metrics, sequence
# lengths), not config keys: their own keys are not counted as keys.
FREE_FORM = {"different_groups", "arg_mappings", "mixed_seq_datasets", "mixed_seq_training"}


def load():
    with open(os.path.join(HERE, "SOURCES.json")) as f:
        records = json.load(f)
    for record in records:
        with open(os.path.join(HERE, record["file"]), "rb") as f:
            yield record, json.loads(f.read())


def walk(value, path=()):
    """Yield (path, value) for every key at every depth."""
    if isinstance(value, dict):
        for key, inner in value.items():
            yield path + (key,), inner
            if key not in FREE_FORM:
                yield from walk(inner, path + (key,))
            elif isinstance(inner, dict):
                for name, group in inner.items():
                    yield from walk(group, path + (key, name))


def table(title, rows, header):
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")


def fmt(value):
    return json.dumps(value)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed-git")
    args = parser.parse_args()

    corpus = list(load())
    configs = [(r, c) for r, c in corpus if isinstance(c, dict)]
    print(f"{len(corpus)} files: " + ", ".join(
        f"{source} {n}" for source, n in collections.Counter(
            r["file"].split("__")[0] for r, _ in corpus).most_common()))
    print(f"{sum(not r['is_training_config'] for r, _ in corpus)} marked is_training_config=false.")

    top = collections.Counter(k for _, c in configs for k in c)
    table("Top-level keys (files using each)", sorted(top.items(), key=lambda kv: (-kv[1], kv[0])),
          ["key", "files"])

    auto = collections.Counter()
    auto_files = set()
    for r, c in configs:
        for path, value in walk(c):
            if value == "auto":
                auto[".".join(path)] += 1
                auto_files.add(r["file"])
    print(f"\n{len(auto_files)} files use the value \"auto\".")
    table('"auto" key paths', sorted(auto.items(), key=lambda kv: (-kv[1], kv[0])), ["path", "files"])

    for block in ("optimizer", "scheduler"):
        types = collections.Counter()
        params = collections.defaultdict(collections.Counter)
        other = collections.defaultdict(collections.Counter)
        for _, c in configs:
            if isinstance(c.get(block), dict):
                kind = c[block].get("type")
                types[kind] += 1
                for key in c[block].get("params", {}) or {}:
                    params[kind][key] += 1
                for key in c[block]:
                    if key not in ("type", "params"):
                        other[kind][key] += 1
        rows = []
        for kind, n in types.most_common():
            seen = ", ".join(f"{k} ({v})" for k, v in sorted(params[kind].items()))
            beside = ", ".join(f"{k} ({v})" for k, v in sorted(other[kind].items()))
            rows.append((kind, n, seen or "-", beside or "-"))
        table(f"{block} types and the params seen (files)", rows,
              ["type", "files", "params keys (files)", f"other keys in the {block} block"])

    stages = collections.Counter()
    for _, c in configs:
        if "zero_optimization" in c:
            z = c["zero_optimization"]
            stages[fmt(z.get("stage", "(no stage key)")) if isinstance(z, dict)
                   else f"zero_optimization: {fmt(z)}"] += 1
        else:
            stages["(no zero_optimization)"] += 1
    table("ZeRO stage", sorted(stages.items()), ["stage", "files"])

    for block in ("fp16", "bf16", "bfloat16", "amp"):
        keys = collections.defaultdict(collections.Counter)
        n = 0
        for _, c in configs:
            if isinstance(c.get(block), dict):
                n += 1
                for key, value in c[block].items():
                    keys[key][fmt(value)] += 1
        if n:
            rows = [(k, sum(v.values()), ", ".join(f"{val} ({m})" for val, m in sorted(v.items())))
                    for k, v in sorted(keys.items(), key=lambda kv: -sum(kv[1].values()))]
            table(f"`{block}` block ({n} files): keys, values (files)", rows, ["key", "files", "values"])

    for key in ("gradient_accumulation_steps", "gradient_clipping", "train_batch_size",
                "train_micro_batch_size_per_gpu"):
        values = collections.Counter(fmt(c[key]) for _, c in configs if key in c)
        absent = sum(key not in c for _, c in configs)
        table(f"`{key}` values", sorted(values.items(), key=lambda kv: (-kv[1], kv[0]))
              + [("(absent)", absent)], ["value", "files"])

    if args.deepspeed_git:
        unknown(configs, args.deepspeed_git)


def unknown(configs, git_dir):
    """Keys no DeepSpeed Python file mentions as a word."""
    head = subprocess.run(["git", "-C", git_dir, "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    where = collections.defaultdict(set)
    for r, c in configs:
        if not r["is_training_config"]:
            continue
        for path, _ in walk(c):
            where[path[-1]].add(".".join(path))
    rows = []
    for key in sorted(where):
        found = subprocess.run(["git", "-C", git_dir, "grep", "-q", "-w", "-F", key.strip(), head,
                                "--", "deepspeed/*.py"]).returncode == 0
        if not found or key != key.strip():
            rows.append((repr(key) if key != key.strip() else key, ", ".join(sorted(where[key]))))
    table(f"Keys in training configs that DeepSpeed {head[:10]} never names (deepspeed/*.py)",
          rows, ["key", "where"])


if __name__ == "__main__":
    main()
