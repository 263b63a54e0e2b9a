"""A fresh process that trains real models for tests/test_real_models.py.

    python tests/real_model_worker.py local OUT.json SPECS.json
    python tests/real_model_worker.py workers OUT.json CASE:POLICY:PATH [CASE:POLICY:PATH ...]

`local`: one process with two logical CPUs measures each [model, axis, path] of
SPECS.json as tests/real_models.measure does (path null: only stock Keras's
reference). Each model's cases run in a process of their own because XLA's
compilation cache is never freed: the suite's processes grew past 13 GB with
the conv nets' executables.

`workers`: one MultiWorkerMirroredStrategy worker; TF_CONFIG names the cluster
(kmp.cli.launch.LocalJob sets it). Each case is built, wrapped, prepared and
trained as the local matrix does, on each worker's share of the same global
batches; OUT.json gets, per case, each step's loss, the path kmp took, and
the .npz file of its trained weights (real_models.save_weights).
"""

import json
import os
import sys


def main(argv: list[str]) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [os.path.dirname(here), here]
    mode, out, *specs = argv
    return local(out, specs[0]) if mode == "local" else workers(out, specs)


def local(out: str, specs_file: str) -> int:
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
    import real_models

    with open(specs_file, encoding="utf-8") as f:
        specs = json.load(f)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    real_models.measure_all(specs, strategy, os.path.dirname(os.path.abspath(out)), out)
    return 0


def workers(out: str, specs: list[str]) -> int:
    import tensorflow as tf

    import kmp
    import parity
    import real_models
    from kmp.engine import replica_step

    tf.config.threading.set_intra_op_parallelism_threads(1)  # two workers share the cores
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=300)  # as multiworker_worker.py
    strategy = kmp.distribute.resolve_strategy(communication_options=options)
    results = {}
    for index, spec in enumerate(specs):
        name, policy, path = spec.split(":")
        case = real_models.CASES[name]
        model = real_models.kmp_model(case, real_models.Axis(policy), path, strategy)
        losses = real_models.fit_steps(case, model, real_models.STEPS, real_models.BATCH)
        weights = f"{os.path.splitext(out)[0]}-{index}.npz"
        real_models.save_weights(weights, trained=parity.trainable(model))
        results[spec] = {"losses": losses, "path": replica_step.describe_path(model),
                         "replicas": strategy.num_replicas_in_sync,
                         "skipped": real_models.skipped_steps(model), "weights": weights}
    with open(out, "w", encoding="utf-8") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
