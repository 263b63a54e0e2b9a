"""One MultiWorkerMirroredStrategy worker of tests/test_real_models.py: real models trained under kmp.

    python tests/real_model_worker.py OUT.json CASE:POLICY:PATH [CASE:POLICY:PATH ...]

TF_CONFIG names the cluster (kmp.cli.launch.LocalJob sets it). Each case is built,
wrapped, prepared and trained as the in-process matrix does, on each worker's
share of the same global batches; OUT.json gets, per case, each step's loss
and the path kmp took.
"""

import json
import os
import sys


def main(argv: list[str]) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [os.path.dirname(here), here]
    import keras
    import tensorflow as tf

    import kmp
    import real_models
    from kmp.engine import replica_step
    from test_real_models import BATCH, STEPS

    tf.config.threading.set_intra_op_parallelism_threads(1)  # two workers share the cores
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=150)
    strategy = kmp.distribute.resolve_strategy(communication_options=options)
    results = {}
    for spec in argv[1:]:
        name, policy, path = spec.split(":")
        case = real_models.CASES[name]
        keras.config.set_dtype_policy(policy)
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = case.build()
            real_models.compile_case(case, model, lambda: kmp.wrap(real_models.adamw()))
        kmp.prepare(model, flat_buffers=path == "flat")
        losses = real_models.fit_steps(case, model, STEPS, BATCH)
        results[spec] = {"losses": losses, "path": replica_step.describe_path(model),
                         "replicas": strategy.num_replicas_in_sync,
                         "skipped": real_models.skipped_steps(model)}
    with open(argv[0], "w", encoding="utf-8") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
