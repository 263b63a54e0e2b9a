"""kmp.scaling.gradients.all_finite, the flat engine's overflow check: a finite sum answers at once, a sum that
is not finite is checked element by element, so the answer is always reduce_all(is_finite).

The steps it decides (skipped on inf or nan, on one device, on replicas, on shards) are in
test_engine, test_scatter and test_zero.
"""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from kmp.scaling.gradients import all_finite

# Finite values of every size, the largest float32 (whose sums overflow), and the non-finite ones.
_ELEMENTS = st.one_of(
    st.floats(-1e6, 1e6, width=32),
    st.sampled_from([3.4e38, -3.4e38, 1e38, np.inf, -np.inf, np.nan, 0.0, -0.0]),
)

_EAGER = all_finite
_GRAPH = tf.function(all_finite, autograph=False)
_XLA = tf.function(all_finite, autograph=False, jit_compile=True)


@settings(max_examples=60, deadline=None)
@given(values=st.lists(_ELEMENTS, min_size=0, max_size=64))
def test_the_answer_is_whether_every_element_is_finite(values):
    flat = tf.constant(values, tf.float32, shape=[len(values)])
    expected = bool(np.all(np.isfinite(np.asarray(values, np.float32))))
    assert bool(_GRAPH(flat)) == expected


@pytest.mark.parametrize("check", [_EAGER, _GRAPH, _XLA], ids=["eager", "graph", "xla"])
@pytest.mark.parametrize(
    "values, expected",
    [
        ([3.4e38] * 1000, True),  # finite, the sum overflows: checked element by element
        ([3.4e38, -3.4e38] * 500, True),
        ([1.0] * 999 + [np.inf], False),
        ([np.inf, -np.inf], False),  # their sum is nan, not a finite cancellation
        ([np.nan] + [1.0] * 999, False),
        ([3.4e38] * 10 + [np.nan], False),
        ([], True),
    ],
)
def test_overflowing_sums_and_non_finite_elements(check, values, expected):
    assert bool(check(tf.constant(values, tf.float32, shape=[len(values)]))) == expected


def test_a_single_bad_element_anywhere_in_two_million_is_found():
    flat = np.full(2_000_000, 1e-3, np.float32)
    for position in (0, 1_234_567, 1_999_999):
        for bad in (np.inf, -np.inf, np.nan):
            flat[position] = bad
            assert not bool(_GRAPH(tf.constant(flat)))
        flat[position] = 1e-3
    assert bool(_GRAPH(tf.constant(flat)))
