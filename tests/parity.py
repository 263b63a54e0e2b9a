"""Two trainings compared by their trained weights, from the same initial weights:

    moved = |reference - initial|    how far the reference's update took its weights (2-norm over all)
    apart = |trained - reference|
    the same update: moved > 0 and apart <= rtol * moved

A run whose update does nothing (learning rate 0, an apply skipped) lies `moved` from the reference, so it
fails for any rtol < 1, where a few steps' losses, which move little, may not tell it.
"""

import numpy as np


def trainable(model) -> list:
    """The model's trainable weights as arrays: what its updates change."""
    return [np.array(v) for v in model.trainable_weights]


def update_gap(initial, reference, trained) -> tuple[float, float]:
    """(moved, apart) of three lists of arrays, weight by weight alike."""
    runs = [[np.asarray(w, np.float64) for w in weights] for weights in (initial, reference, trained)]
    assert len({len(r) for r in runs}) == 1 and all(len({w.shape for w in ws}) == 1 for ws in zip(*runs)), \
        "the three runs' weights differ in number or shape"
    initial, reference, trained = runs
    moved = np.sqrt(sum(np.sum((r - i) ** 2) for r, i in zip(reference, initial)))
    apart = np.sqrt(sum(np.sum((t - r) ** 2) for t, r in zip(trained, reference)))
    return float(moved), float(apart)


def check_gap(moved: float, apart: float, rtol: float) -> None:
    assert rtol < 1, "a run that does not train is 1 apart: rtol must be below it"
    assert moved > 0, "the reference did not train: its weights are the initial ones, and so are an untrained run's"
    assert apart <= rtol * moved, (f"the trained weights lie {apart / moved:.3g} of the reference's update from its "
                                   f"weights (at most {rtol}; an untrained run lies 1 from them)")


def assert_same_update(initial, reference, trained, rtol: float) -> None:
    check_gap(*update_gap(initial, reference, trained), rtol)
