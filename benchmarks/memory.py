"""Memory as the process holds it: stock Keras beside kmp on every path, each configuration in its own process.

    python benchmarks/memory.py                       # both GPT-2 sizes, every configuration
    python benchmarks/memory.py --sizes small --only kmp-mirrored,zero1-mirrored
    python benchmarks/memory.py --checkpointing       # activation checkpointing: memory, step, losses
    python benchmarks/memory.py --largest             # the largest GPT-2 that trains a step here
    python benchmarks/memory.py --largest --only kmp --start 40x1536 --limit 22

The models are keras-hub GPT2CausalLMs built from a config (no download).
The table: "large" is 8 layers x hidden 512, vocabulary 16384 (33.6M
parameters), "small" 4 x 256, vocabulary 8192 (5.3M); batch 4, sequence 64,
AdamW, two epochs of 6 steps, mixed_float16 unless the configuration says
otherwise. Each row is one process (its own TensorFlow runtime):

    peak        resource.getrusage(RUSAGE_SELF).ru_maxrss after training: what the process held at most
    rest        resident memory with the model built and compiled, before the first step
    held        resident memory after training (what the step freed returned to the system), less `rest`
    variables   the bytes each device's variables hold (kmp.measured_bytes's categories, summed)
    estimated held  kmp.memory_estimate(model) of what the variables hold (its transient gradient left out),
                per process: each replica's, and the host's copy once
    device peak tf.config.experimental.get_memory_info(device)["peak"], on devices that report it (GPUs)

Bytes per parameter are the slope between the two sizes: (peak_large -
peak_small) / (parameters_large - parameters_small), so what does not grow
with the model (the TensorFlow runtime, the input pipeline, most of XLA's
compile) drops out; the held slope is the one the estimate predicts.

--checkpointing: a GPT-2 of 8 x 256, vocabulary 1024, sequence 512, batch 8,
mixed_bfloat16, one device, with and without
kmp.prepare(activation_checkpointing=True), Keras's step (no XLA, its
default on a CPU) and with jit_compile=True: peak above rest, the median
step after the first epoch, the losses. Were XLA to merge the recomputation
into the forward pass, its peak would not fall. The step ratio is then
measured again in one process, the two models' steps in alternation
(common.alternating_steps), so that a busy machine slows both alike.

--largest: for each setup, the GPT-2s of `LADDER` in turn, each in its own
process that trains one step of batch 1, sequence 256, vocabulary 50257
(killed past --limit GiB of resident memory): the largest that trained.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MB = 1e6
SIZES = {  # layers, hidden, heads, vocabulary
    "small": (4, 256, 4, 8192),
    "large": (8, 512, 8, 16384),
}
TABLE = dict(batch=4, sequence=64, steps=6, epochs=2)

# name -> (what it is, settings). Settings: replicas, precision, stock (Keras alone) or kmp's wrap
# arguments, flat (kmp.prepare's flat_buffers; no kmp.prepare without it), checkpointing, jit.
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
    "kmp-mirrored-nojit": ("the same, kmp.prepare(jit_compile=False)", dict(replicas=2, flat=True, jit=False)),
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

CHECKPOINTING_MODEL = dict(layers=8, hidden=256, heads=4, vocabulary=1024, batch=8, sequence=512, steps=6, epochs=2,
                           precision="mixed_bfloat16", replicas=1, flat=False)
CHECKPOINTING = {
    "plain": ("Keras's step (no XLA)", dict()),
    "checkpointed": ("the same, activation_checkpointing=True", dict(checkpointing=True)),
    "plain-xla": ("jit_compile=True", dict(jit=True)),
    "checkpointed-xla": ("jit_compile=True, activation_checkpointing=True", dict(jit=True, checkpointing=True)),
}

# The largest model that fits: (layers, hidden), GPT-2's own family and sizes between them.
LADDER = [(12, 768), (24, 1024), (36, 1280), (40, 1536), (48, 1600), (48, 1792), (48, 2048), (56, 2304)]
LARGEST_RUN = dict(vocabulary=50257, batch=1, sequence=256, steps=1, epochs=1)
LARGEST = {
    "stock Keras, float32": dict(stock=True, precision="float32"),
    "stock Keras, mixed_float16": dict(stock=True, precision="mixed_float16"),
    "kmp, mixed_bfloat16, 8-bit states, activation checkpointing": dict(precision="mixed_bfloat16", states="8bit",
                                                                      flat=False, checkpointing=True),
}


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(spec: dict) -> dict:
    """Build, compile and train one configuration in this process; its memory, as a dict."""
    import resource

    import numpy as np

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    spec = {"precision": "mixed_float16", "stock": False, "train": True, "replicas": 1, **spec}
    import tensorflow as tf

    if spec["replicas"] > 1 and not tf.config.list_physical_devices("GPU"):
        cpus = tf.config.list_physical_devices("CPU")
        tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    import keras_hub

    import kmp
    from kmp.engine.engine import engine_of
    from kmp.engine.recompute import checkpointed

    keras.config.set_dtype_policy(spec["precision"])
    keras.utils.set_random_seed(0)
    strategy = tf.distribute.MirroredStrategy() if spec["replicas"] > 1 else tf.distribute.get_strategy()
    devices = [d.name for d in tf.config.list_logical_devices() if d.device_type in ("GPU", "CPU")]
    before = {d: tf.config.experimental.get_memory_info(d)["current"] for d in devices}
    vocabulary, sequence = spec["vocabulary"], spec["sequence"]
    with strategy.scope():
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=vocabulary, num_layers=spec["layers"], num_heads=spec["heads"],
            hidden_dim=spec["hidden"], intermediate_dim=4 * spec["hidden"], max_sequence_length=sequence, dropout=0.0)
        model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        inner = keras.optimizers.AdamW(1e-4)
        if spec["stock"]:
            optimizer = inner
            if spec["precision"] == "mixed_float16":
                optimizer = keras.optimizers.LossScaleOptimizer(inner)
        else:
            optimizer = kmp.wrap(inner, states=spec.get("states", "32bit"),
                                 **({"zero_stage": spec["zero_stage"]} if "zero_stage" in spec else {}))
        jit = spec.get("jit", spec["replicas"] == 1 and spec["stock"])
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=jit if spec["replicas"] == 1 else False)
    if "flat" in spec:
        kmp.prepare(model, flat_buffers=spec["flat"], activation_checkpointing=spec.get("checkpointing", False),
                    **({"jit_compile": spec["jit"]} if "jit" in spec else {}))
    rows = spec["batch"] * spec["steps"]
    tokens = np.random.default_rng(0).integers(1, vocabulary, (rows, sequence + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((rows, sequence), "int32")}
    y = tokens[:, 1:]
    model({k: v[:1] for k, v in x.items()})  # the weights built; the optimizer builds at the first step
    rest = _rss()
    for device in devices:
        tf.config.experimental.reset_memory_stats(device)
    losses, marks, between = [], [], {}
    if spec["train"]:
        def batch_end(batch, logs):
            marks.append(time.perf_counter())
            for device in devices:  # between steps: what the variables and buffers hold in training
                current = tf.config.experimental.get_memory_info(device)["current"] - before[device]
                between[device] = max(between.get(device, 0), current)

        clock = keras.callbacks.LambdaCallback(on_train_batch_end=batch_end)
        clock.kmp_reads_weights = False
        history = model.fit(x, y, batch_size=spec["batch"], epochs=spec["epochs"], verbose=0, shuffle=False,
                            callbacks=[clock])
        losses = [float(v) for v in history.history["loss"]]
    steady = [b - a for a, b in zip(marks[spec["steps"]:], marks[spec["steps"] + 1:])]  # after the first epoch
    parameters = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the step freed goes back: `held` is what stays
    held = _rss() - rest
    variables, slots, estimate, estimate_held = {}, {}, None, None
    if model.optimizer.built:
        variables = {device: sum(vars(b).values()) for device, b in kmp.measured_bytes(model).items()}
        slots = _slots_per_device(model, engine_of(model))
        found = kmp.memory_estimate(model)
        # Per process: each replica's share (its devices are this process's) and the host's copy once.
        estimate = found.total * spec["replicas"] + found.host
        estimate_held = sum(vars(found.in_variables()).values()) * spec["replicas"] + found.host
    # TensorFlow's allocator, per device (a GPU's own memory; the CPUs of one process share one allocator):
    # the tensors held between steps (variables and buffers: after fit() the flat buffers and the Keras
    # variables stored from them share memory until the next step writes) and the most in use in training.
    allocator = {}
    for device in devices:
        info = tf.config.experimental.get_memory_info(device)
        allocator[device] = dict(held=between.get(device, info["current"] - before[device]),
                                 peak=info["peak"] - before[device])
    path = ""
    if "flat" in spec:
        path = "flat" if engine_of(model) is not None else "per variable"
        path += f", {len(checkpointed(model))} blocks checkpointed" if spec.get("checkpointing") else ""
    return dict(parameters=parameters, peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rest=rest,
                held=held, variables=variables, slots=slots, estimate=estimate, estimate_held=estimate_held,
                allocator=allocator, losses=losses, ms=sorted(steady)[len(steady) // 2] * 1000 if steady else None,
                path=path)


def _slots_per_device(model, engine) -> dict:
    """{device: bytes} of the optimizer state the step updates there: the flat buffers' slots, or the slot
    variables (Keras's copy, held on the host with the buffers, is in `variables`)."""
    import numpy as np
    import tensorflow as tf

    strategy = model.distribute_strategy
    if engine is not None:
        states = [engine.buffers.buffers[name] for name in engine.buffers.slot_names]
    else:
        inner = getattr(model.optimizer, "inner_optimizer", model.optimizer)
        skip = {id(inner._iterations), id(inner._learning_rate)}
        states = [v.value for v in inner.variables if id(v) not in skip]
    out = {}
    for state in states:
        for component in strategy.experimental_local_results(state):
            device = tf.DeviceSpec.from_string(component.device).to_string()
            out[device] = out.get(device, 0) + int(np.prod(component.shape)) * component.dtype.size
    return out


def run(spec: dict, limit: float | None = None) -> dict:
    """`spec` trained by a worker process; its row (or {"failure": why}). Past `limit` bytes resident, killed."""
    command = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if limit is not None:
        import psutil

        watched = psutil.Process(child.pid)
        while child.poll() is None:
            try:
                if watched.memory_info().rss > limit:
                    child.kill()
                    child.wait()
                    return dict(failure=f"past {limit / 2**30:.0f} GiB resident, stopped")
            except psutil.NoSuchProcess:
                break
            time.sleep(0.5)  # a sampling period, not a synchronisation
    out, err = child.communicate()
    for line in out.splitlines():
        if line.startswith("@@"):
            return json.loads(line[2:])
    if child.returncode < 0:  # SIGKILL from outside: the kernel's out-of-memory killer
        return dict(failure=f"killed by signal {-child.returncode} (out of memory)")
    said = [line for line in err.strip().splitlines() if not line[:1] in "IWE" or not line[1:5].isdigit()]
    return dict(failure=(said or [f"exit status {child.returncode}"])[-1][:200])


def table(sizes: list[str], names: list[str], save: str = "") -> None:
    rows = {}
    for size in sizes:
        layers, hidden, heads, vocabulary = SIZES[size]
        for name in names:
            spec = dict(layers=layers, hidden=hidden, heads=heads, vocabulary=vocabulary, **TABLE,
                        **CONFIGURATIONS[name][1])
            rows[size, name] = r = run(spec)
            print(f"{size} {name}: " + (r["failure"] if "failure" in r else
                  f"peak {r['peak'] / MB:,.0f} MB, rest {r['rest'] / MB:,.0f} MB, {r['parameters']:,} parameters"),
                  file=sys.stderr, flush=True)
    head = " | ".join(f"{s}: peak / above rest (MB)" for s in sizes)
    print(f"\n| configuration | {head} | bytes/parameter: peak / held / estimated held | "
          f"{sizes[-1]}: variables per device / optimizer state stepped per device (MB) | path |")
    print("| --- |" + " --- |" * (len(sizes) + 3))
    for name in names:
        cells, slopes, path = [], "", ""
        for size in sizes:
            r = rows[size, name]
            cells.append(r["failure"] if "failure" in r else f"{r['peak'] / MB:,.0f} / {(r['peak'] - r['rest']) / MB:,.0f}")
            path = r.get("path") or path
        first, last = rows[sizes[0], name], rows[sizes[-1], name]
        if len(sizes) > 1 and "peak" in first and "peak" in last:
            per = last["parameters"] - first["parameters"]
            slope = [(last[k] - first[k]) / per if last.get(k) is not None else None
                     for k in ("peak", "held", "estimate_held")]
            slopes = " / ".join("" if v is None else f"{v:.1f}" for v in slope)
        devices = ", ".join(f"{v / MB:,.0f}" for v in last.get("variables", {}).values())
        stepped = ", ".join(f"{v / MB:,.0f}" for v in last.get("slots", {}).values())
        print(f"| {name}: {CONFIGURATIONS[name][0]} | " + " | ".join(cells) +
              f" | {slopes} | {devices} / {stepped} | {path} |")
    if save:
        with open(save, "w") as out:
            json.dump([{"size": size, "name": name, **r} for (size, name), r in rows.items()], out, indent=1)
    print(f"\n| configuration | {sizes[-1]}: TensorFlow's allocator, held between steps / peak (MB) | held / "
          "estimated held | bytes/parameter: held / estimated held |")
    print("| --- | --- | --- | --- |")
    for name in names:
        first, last = rows[sizes[0], name], rows[sizes[-1], name]
        if not last.get("estimate_held"):
            continue
        cells = [f"{device.rpartition('device:')[2]}: {info['held'] / MB:,.0f} / {info['peak'] / MB:,.0f}"
                 for device, info in _allocators(last).items()]
        slope, per = "", last["parameters"] - first["parameters"]
        if first.get("estimate_held") and per:
            slope = (f"{(_held(last) - _held(first)) / per:.1f} / "
                     f"{(last['estimate_held'] - first['estimate_held']) / per:.1f}")
        print(f"| {name} | {', '.join(cells)} | {_held(last) / last['estimate_held']:.2f} | {slope} |")


def _allocators(row: dict) -> dict:
    """The row's allocators, each once (the CPUs of one process share one: the same figures)."""
    out, seen = {}, set()
    for device, info in row.get("allocator", {}).items():
        if (info["held"], info["peak"]) not in seen:
            seen.add((info["held"], info["peak"]))
            out[device] = info
    return out


def _held(row: dict) -> int:
    return sum(info["held"] for info in _allocators(row).values())


def checkpointing() -> None:
    rows = {name: run({**CHECKPOINTING_MODEL, **settings}) for name, (_, settings) in CHECKPOINTING.items()}
    print("\n| run | peak / above rest (MB) | above rest vs plain | ms per step | step vs plain | losses | path |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, (what, _) in CHECKPOINTING.items():
        r, base = rows[name], rows[name.replace("checkpointed", "plain")]
        if "failure" in r or "failure" in base:
            print(f"| {name}: {what} | {r.get('failure', '')} | | | | | |")
            continue
        above, base_above = r["peak"] - r["rest"], base["peak"] - base["rest"]
        print(f"| {name}: {what} | {r['peak'] / MB:,.0f} / {above / MB:,.0f} | {above / base_above:.2f}x | "
              f"{r['ms']:,.0f} | {r['ms'] / base['ms']:.2f}x | {', '.join(f'{v:.5f}' for v in r['losses'])} | "
              f"{r['path']} |")
    print("\n| Keras's step | ms per step, plain / checkpointed, in alternation in one process | step vs plain |")
    print("| --- | --- | --- |")
    for jit in (False, True):
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--steps-ab", "1" if jit else "0"],
                             capture_output=True, text=True)
        found = [json.loads(line[2:]) for line in out.stdout.splitlines() if line.startswith("@@")]
        if not found:
            print(f"| jit_compile={jit} | {(out.stderr.strip().splitlines() or ['failed'])[-1][:200]} | |")
            continue
        ms = found[0]
        print(f"| jit_compile={jit} | {ms['plain']:,.0f} / {ms['checkpointed']:,.0f} | "
              f"{ms['checkpointed'] / ms['plain']:.2f}x |", flush=True)


def checkpointing_steps(jit: bool, steps: int = 10) -> dict:
    """ms per step of the checkpointing model without and with checkpointing, in alternation in this process."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import keras
    import keras_hub
    import tensorflow as tf

    import kmp
    from common import alternating_steps

    spec = CHECKPOINTING_MODEL
    rows = spec["batch"] * 4
    tokens = np.random.default_rng(0).integers(1, spec["vocabulary"], (rows, spec["sequence"] + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((rows, spec["sequence"]), "int32")}
    data = tf.data.Dataset.from_tensor_slices((x, tokens[:, 1:])).batch(spec["batch"]).repeat()

    def built(checkpointing):
        keras.config.set_dtype_policy(spec["precision"])
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=spec["vocabulary"], num_layers=spec["layers"], num_heads=spec["heads"],
            hidden_dim=spec["hidden"], intermediate_dim=4 * spec["hidden"], max_sequence_length=spec["sequence"],
            dropout=0.0)
        model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        model.compile(optimizer=kmp.wrap(keras.optimizers.AdamW(1e-4)), jit_compile=jit,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        kmp.prepare(model, flat_buffers=False, activation_checkpointing=checkpointing)
        model.fit(data, steps_per_epoch=1, verbose=0)  # trace, compile
        return model, iter(data)

    times = alternating_steps({"plain": built(False), "checkpointed": built(True)}, steps, warmup=2)
    return {name: sorted(values)[len(values) // 2] for name, values in times.items()}


def largest(limit: float, setups: list[str], start: str = "") -> None:
    print(f"\n| setup | largest that trained (layers x hidden: parameters) | the next (why not) |")
    print("| --- | --- | --- |")
    ladder = LADDER[[f"{layers}x{hidden}" for layers, hidden in LADDER].index(start):] if start else LADDER
    for name, settings in LARGEST.items():
        if setups and not any(s in name for s in setups):
            continue
        best, stop = None, ""
        for layers, hidden in ladder:
            r = run({**LARGEST_RUN, "layers": layers, "hidden": hidden, "heads": hidden // 64, **settings},
                    limit=limit)
            print(f"{name}, {layers} x {hidden}: " + (r.get("failure") or f"peak {r['peak'] / 2**30:.1f} GiB"),
                  file=sys.stderr, flush=True)
            if "failure" in r:
                stop = f"{layers} x {hidden}: {r['failure']}"
                break
            best = f"{layers} x {hidden}: {r['parameters'] / 1e6:,.0f}M (peak {r['peak'] / 2**30:.1f} GiB)"
        print(f"| {name} | {best or 'none'} | {stop or 'the ladder ended'} |", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="small,large")
    parser.add_argument("--only", default="",
                        help="configurations, comma separated (default: all); --largest: setups whose name holds one")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing instead")
    parser.add_argument("--largest", action="store_true", help="the largest model that fits instead")
    parser.add_argument("--limit", type=float, default=22.0, help="--largest: GiB of resident memory per trial")
    parser.add_argument("--start", default="", help="--largest: the ladder's first rung, as LAYERSxHIDDEN")
    parser.add_argument("--json", default="", help="the table's rows, also written to this file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--steps-ab", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps_ab is not None:
        print("@@" + json.dumps(checkpointing_steps(args.steps_ab == "1")), flush=True)
    elif args.worker:
        print("@@" + json.dumps(worker(json.loads(args.worker))), flush=True)
    elif args.checkpointing:
        checkpointing()
    elif args.largest:
        largest(args.limit * 2**30, args.only.split(",") if args.only else [], args.start)
    else:
        table(args.sizes.split(","), args.only.split(",") if args.only else list(CONFIGURATIONS), args.json)


if __name__ == "__main__":
    main()
