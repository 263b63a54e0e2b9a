"""Memory as the process holds it: stock Keras beside kmp on every path, each configuration in its own process.

    python benchmarks/memory.py                       # both GPT-2 sizes, every configuration
    python benchmarks/memory.py --sizes small --only kmp-mirrored,zero1-mirrored
    python benchmarks/memory.py --json results.json

The model is a keras-hub GPT2CausalLM built from a config (no download):
"large" is 8 layers x hidden 512, vocabulary 16384 (33.6M parameters),
"small" 4 x 256, vocabulary 8192 (5.3M). Batch 4, sequence 64, AdamW, two
epochs of 6 steps, mixed_float16 unless the configuration says otherwise.

Each row is one process (its own TensorFlow runtime, nothing shared):

    peak        resource.getrusage(RUSAGE_SELF).ru_maxrss after training: what the process held at most
    rest        RSS with the model built and compiled, before the first step
    variables   the bytes each device's variables hold (kmp.measured_bytes's categories, summed)
    device peak tf.config.experimental.get_memory_info(device)["peak"], where the device reports it (GPUs)

Bytes per parameter are the slope between the two sizes: (peak_large -
peak_small) / (parameters_large - parameters_small), so what does not grow
with the model (the TensorFlow runtime, the input pipeline) drops out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MB = 1e6
SIZES = {  # layers, hidden, heads, vocabulary
    "small": (4, 256, 4, 8192),
    "large": (8, 512, 8, 16384),
}
BATCH, SEQUENCE, STEPS, EPOCHS = 4, 64, 6, 2

# name -> (what it is, settings). Settings: replicas, precision, stock (Keras alone) or kmp's
# wrap arguments and prepare's flat_buffers (None: no kmp.prepare).
CONFIGURATIONS = {
    "built": ("the model built and compiled, no step", dict(replicas=1, stock=True, train=False)),
    "stock-fp32": ("stock Keras, one device, jit_compile=True, float32",
                   dict(replicas=1, stock=True, precision="float32")),
    "stock": ("stock Keras, one device, jit_compile=True, LossScaleOptimizer", dict(replicas=1, stock=True)),
    "kmp-wrap": ("kmp.wrap, one device", dict(replicas=1)),
    "kmp": ("kmp.wrap + kmp.prepare, one device, flat buffers", dict(replicas=1, flat=True)),
    "kmp-pervar": ("kmp.wrap + kmp.prepare, one device, per variable", dict(replicas=1, flat=False)),
    "kmp-8bit": ("kmp, one device, flat buffers, states='8bit'", dict(replicas=1, flat=True, states="8bit")),
    "kmp-8bit-pervar": ("kmp, one device, per variable, states='8bit'",
                        dict(replicas=1, flat=False, states="8bit")),
    "stock-mirrored": ("stock Keras, MirroredStrategy on two logical CPUs", dict(replicas=2, stock=True)),
    "kmp-mirrored": ("kmp.wrap + kmp.prepare, MirroredStrategy, flat buffers", dict(replicas=2, flat=True)),
    "kmp-mirrored-pervar": ("kmp, MirroredStrategy, per variable", dict(replicas=2, flat=False)),
    "zero1-mirrored": ("kmp, MirroredStrategy, flat buffers, zero_stage=1",
                       dict(replicas=2, flat=True, zero_stage=1)),
    "8bit-mirrored": ("kmp, MirroredStrategy, flat buffers, states='8bit'",
                      dict(replicas=2, flat=True, states="8bit")),
    "8bit-zero1-mirrored": ("kmp, MirroredStrategy, flat buffers, states='8bit', zero_stage=1",
                            dict(replicas=2, flat=True, states="8bit", zero_stage=1)),
    "8bit-mirrored-pervar": ("kmp, MirroredStrategy, per variable, states='8bit'",
                             dict(replicas=2, flat=False, states="8bit")),
}


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(size: str, name: str) -> dict:
    """Build, compile and train one configuration in this process; its memory, as a dict."""
    import resource

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    settings = {"precision": "mixed_float16", "stock": False, "train": True, **CONFIGURATIONS[name][1]}
    import tensorflow as tf

    if settings["replicas"] > 1 and not tf.config.list_physical_devices("GPU"):
        cpus = tf.config.list_physical_devices("CPU")
        tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    import keras_hub
    import numpy as np

    import kmp

    keras.config.set_dtype_policy(settings["precision"])
    keras.utils.set_random_seed(0)
    strategy = tf.distribute.MirroredStrategy() if settings["replicas"] > 1 else tf.distribute.get_strategy()
    layers, hidden, heads, vocabulary = SIZES[size]
    with strategy.scope():
        backbone = keras_hub.models.GPT2Backbone(vocabulary_size=vocabulary, num_layers=layers, num_heads=heads,
                                                 hidden_dim=hidden, intermediate_dim=4 * hidden,
                                                 max_sequence_length=SEQUENCE, dropout=0.0)
        model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        inner = keras.optimizers.AdamW(1e-4)
        if settings["stock"]:
            optimizer = inner
            if settings["precision"] == "mixed_float16":
                optimizer = keras.optimizers.LossScaleOptimizer(inner)
        else:
            optimizer = kmp.wrap(inner, states=settings.get("states", "32bit"),
                                 **({"zero_stage": settings["zero_stage"]} if "zero_stage" in settings else {}))
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=settings["replicas"] == 1 and settings["stock"])
    if "flat" in settings:
        kmp.prepare(model, flat_buffers=settings["flat"])
    rows = BATCH * STEPS
    tokens = np.random.default_rng(0).integers(1, vocabulary, (rows, SEQUENCE + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((rows, SEQUENCE), "int32")}
    y = tokens[:, 1:]
    model({k: v[:1] for k, v in x.items()})  # the weights built; the optimizer builds at the first step
    rest = _rss()
    losses = []
    if settings["train"]:
        history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False)
        losses = [float(v) for v in history.history["loss"]]
    parameters = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    variables = {}
    if model.optimizer.built:
        variables = {device: sum(vars(b).values()) for device, b in kmp.measured_bytes(model).items()}
    device_peaks = {}
    for device in tf.config.list_logical_devices("GPU"):
        device_peaks[device.name] = tf.config.experimental.get_memory_info(device.name)["peak"]
    from kmp.engine.engine import engine_of

    engine = engine_of(model)
    return dict(size=size, name=name, parameters=parameters, peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                * 1024, rest=rest, end=_rss(), variables=variables, device_peaks=device_peaks, losses=losses,
                path=("flat" if engine is not None else "per variable") if "flat" in settings else "")


def run(size: str, name: str) -> dict:
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", size, name],
                          capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("@@"):
            return json.loads(line[2:])
    return dict(size=size, name=name, failure=(done.stderr.strip().splitlines() or ["no output"])[-1][:200])


def report(rows: list[dict]) -> None:
    by = {(r["size"], r["name"]): r for r in rows}
    sizes = [s for s in SIZES if any(r["size"] == s for r in rows)]
    names = list(dict.fromkeys(r["name"] for r in rows))
    head = " | ".join(f"{s}: peak / above rest MB" for s in sizes)
    print(f"\n| configuration | {head} | variables per device, large (MB) | bytes/parameter (slope) | path |")
    print("| --- |" + " --- |" * (len(sizes) + 3))
    for name in names:
        cells, slope, devices, path = [], "", "", ""
        for s in sizes:
            r = by.get((s, name), {})
            if "failure" in r:
                cells.append(f"failed: {r['failure']}")
            elif r:
                cells.append(f"{r['peak'] / MB:,.0f} / {(r['peak'] - r['rest']) / MB:,.0f}")
                path = r["path"] or path
            else:
                cells.append("")
        large, small = by.get(("large", name), {}), by.get(("small", name), {})
        if "peak" in large and "peak" in small:
            slope = f"{(large['peak'] - small['peak']) / (large['parameters'] - small['parameters']):.1f}"
        if large.get("variables"):
            devices = ", ".join(f"{v / MB:,.0f}" for v in large["variables"].values())
        print(f"| {name}: {CONFIGURATIONS[name][0]} | " + " | ".join(cells) + f" | {devices} | {slope} | {path} |")
    for r in rows:
        if r.get("device_peaks"):
            print(f"{r['size']} {r['name']}: device peaks (MB)",
                  {d: round(v / MB) for d, v in r["device_peaks"].items()})


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="small,large")
    parser.add_argument("--only", default="", help="configurations, comma separated (default: all)")
    parser.add_argument("--json", default="", help="also write the rows to this file")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print("@@" + json.dumps(worker(*args.worker)), flush=True)
        return
    names = args.only.split(",") if args.only else list(CONFIGURATIONS)
    rows = []
    for size in args.sizes.split(","):
        for name in names:
            rows.append(run(size, name))
            r = rows[-1]
            print(f"{size} {name}: " + (r["failure"] if "failure" in r else
                  f"peak {r['peak'] / MB:,.0f} MB, rest {r['rest'] / MB:,.0f} MB, {r['parameters']:,} parameters"),
                  file=sys.stderr, flush=True)
    report(rows)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
