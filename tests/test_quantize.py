"""kmp.scaling.quantize: bitsandbytes' dynamic maps, block-wise 8-bit round trips, XLA, and an independent
numpy reference."""

import math
import re
from fractions import Fraction

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kmp.scaling import quantize as kq

MAPS = {"signed": True, "unsigned": False}
SLACK = 2.0 ** -22  # float32 rounding of x / absmax and of code * absmax: 4 ulps of absmax covers both


def _half_gap(code) -> float:
    """The largest distance from a value in the map's range ([-1, 1] or [0, 1]) to its nearest code value."""
    c = code.astype(np.float64)
    bottom = -1.0 if c[0] < 0 else 0.0
    return max(np.diff(c).max() / 2, c[0] - bottom, 1.0 - c[-1])


def _reference(x, code, block_size=256):
    """numpy, written apart from kmp.scaling.quantize: argmin |code - x / absmax| per element (np.argmin takes the first
    minimum, so a tie goes to the lower index, as the module's lower-bound search does); absmax 0 below 2**-126."""
    n = len(x)
    blocks = math.ceil(n / block_size)
    xb = np.zeros(blocks * block_size, np.float32)
    xb[:n] = x
    xb = xb.reshape(blocks, block_size)
    absmax = np.abs(xb).max(axis=1)
    absmax = np.where(absmax >= np.finfo(np.float32).tiny, absmax, np.float32(0))
    v = xb / np.where(absmax > 0, absmax, np.float32(1))[:, None]
    # Float64 distances are exact near a tie: there v and both codes are float32 of like magnitude.
    q = np.abs(code.astype(np.float64) - v.reshape(-1, 1).astype(np.float64)).argmin(axis=1).astype(np.uint8)[:n]
    deq = (code[q].reshape(-1) * np.repeat(absmax, block_size)[:n]).astype(np.float32)
    return q, absmax.astype(np.float32), deq


def _round_trip(x, code, block_size=256):
    q, absmax = kq.quantize(tf.constant(x), code, block_size)
    return q.numpy(), absmax.numpy(), kq.dequantize(q, absmax, code, block_size).numpy()


def _assert_bound(x, absmax, deq, code, block_size=256):
    """|x - deq| <= (half the largest gap) * absmax of the element's block, elementwise."""
    scale = np.repeat(absmax.astype(np.float64), block_size)[: len(x)]
    err = np.abs(x.astype(np.float64) - deq.astype(np.float64))
    bad = err > (_half_gap(code) + SLACK) * scale
    assert not bad.any(), f"{bad.sum()} elements over the bound, first at {np.flatnonzero(bad)[:5]}"


def _bits(a):
    return np.asarray(a).view(np.uint32 if np.asarray(a).dtype == np.float32 else np.uint8)


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_structure(signed):
    code = kq.dynamic_map(signed)
    assert code.shape == (256,) and code.dtype == np.float32
    assert np.all(np.diff(code) > 0)  # sorted, and the source's 256 values are all distinct
    assert code[-1] == 1.0 and 0.0 in code
    # create_dynamic_map: decade i (i = 0..6) holds 10**(i-6) times the midpoints of linspace(0.1, 1, k + 1),
    # k = 2**i fractions a sign when signed, else 2**(i+1); plus 0 and 1.
    for i in range(7):
        low, high = 10.0 ** (i - 7), 10.0 ** (i - 6)
        assert np.sum((code > low) & (code < high)) == (2 ** i if signed else 2 ** (i + 1))
        assert np.sum((code < -low) & (code > -high)) == (2 ** i if signed else 0)
    if signed:
        assert code[127] == 0.0 and np.array_equal(code[:127], -code[128:255][::-1])
        assert -1.0 < code[0] < -0.99  # no -1: 127 negatives, 0, 127 positives and 1
    else:
        assert code[0] == 0.0


@pytest.mark.parametrize("signed, index, float32_value, by_hand", [
    # The float32 results of the source's operations; by hand: 1e-6 * (0.1 + 1) / 2, 1e-5 * (0.1 + 0.55) / 2 ...
    (True, 128, 5.5000004e-07, 5.5e-7),
    (True, 129, 3.2500002e-06, 3.25e-6),
    (True, 254, 0.99296874, 1 - 0.9 / 128),  # decade 6: 64 fractions of width 0.9 / 64, the last centred
    (True, 0, -0.99296874, -(1 - 0.9 / 128)),
    (False, 1, 3.2500003e-07, 1e-6 * (0.1 + 0.55) / 2),  # unsigned decade 0: linspace(0.1, 1, 3)
    (False, 2, 7.7499999e-07, 1e-6 * (0.55 + 1) / 2),
    (False, 254, 0.9964844, 1 - 0.9 / 256),
])
def test_dynamic_map_values(signed, index, float32_value, by_hand):
    code = kq.dynamic_map(signed)
    assert code[index] == np.float32(float32_value)
    assert code[index] == pytest.approx(by_hand, rel=1e-6)


def test_dynamic_map_is_a_copy():
    kq.dynamic_map(True)[0] = 5.0
    assert kq.dynamic_map(True)[0] < 0


@pytest.mark.parametrize("signed", [True, False])
def test_random_normal_round_trip_bounds(signed):
    x = np.random.default_rng(1).standard_normal(256 * 64).astype(np.float32)
    x = x if signed else np.abs(x)
    code = kq.dynamic_map(signed)
    q, absmax, deq = _round_trip(x, code)
    _assert_bound(x, absmax, deq, code)
    mean = np.mean(np.abs(x.astype(np.float64) - deq) / np.repeat(absmax, 256))
    # Measured mean |error| / absmax: 0.0028 (signed on N(0, 1)), 0.0014 (unsigned on |N(0, 1)|).
    assert mean < (0.0030 if signed else 0.0015)
    assert mean > 0.25 * _half_gap(code)  # not vacuous: a lossless round trip would mean the test measures nothing


@pytest.mark.parametrize("signed", [True, False])
def test_exact_zeros(signed):
    code = kq.dynamic_map(signed)
    x = np.zeros(256 * 3 + 40, np.float32)
    x[256:512] = np.random.default_rng(2).random(256)
    x[600] = -0.0
    x[512 + 7] = 1e-39  # subnormal: a block whose absmax is subnormal is stored as zeros
    for fn in (_round_trip, lambda x, code: [t.numpy() for t in _xla(code)(tf.constant(x))]):
        q, absmax, deq = fn(x, code)
        assert absmax[0] == 0 and absmax[2] == 0 and absmax[3] == 0 and absmax[1] > 0
        assert not np.isnan(deq).any()
        assert np.all(deq[:256] == 0) and np.all(deq[512:] == 0)
        assert np.all(code[q[:256]] == 0) and np.all(code[q[512:]] == 0)  # the zero code, not 0 / 0 -> NaN -> q 0
    assert np.all(_round_trip(np.zeros(1, np.float32), code)[2] == 0)


@pytest.mark.parametrize("signed", [True, False])
def test_one_huge_element_per_block(signed):
    rng = np.random.default_rng(3)
    x = rng.standard_normal(1000).astype(np.float32)
    x = x if signed else np.abs(x)
    huge = np.array([1e4, -1e4, 1e4] if signed else [1e4, 1e4, 1e4], np.float32)
    where = [5, 256 + 100, 512 + 255]  # blocks 0..2; block 3 (232 elements) keeps only normal values
    x[where] = huge
    code = kq.dynamic_map(signed)
    q, absmax, deq = _round_trip(x, code)
    _assert_bound(x, absmax, deq, code)
    assert np.array_equal(absmax[:3], np.abs(huge))
    assert np.array_equal(deq[where], np.where(huge > 0, huge, code[0] * np.abs(huge)))  # 1 -> exact, -1 -> code[0]
    # Block 3 is quantized alone, as if the outliers did not exist.
    assert np.array_equal(q[768:], _round_trip(x[768:], code)[0])
    # The dynamic map keeps values 1e-4 of their block's absmax: every one above half the smallest positive code
    # decodes nonzero with its sign (a linear 8-bit scale would round all of |v| < 1 / 254 to 0).
    small = np.ones(1000, bool)
    small[where] = False
    small[768:] = False
    v = x / np.repeat(absmax, 256)[:1000]
    kept = small & (np.abs(v) > code[code > 0][0] / 2)
    assert kept.sum() > 700 and np.all(np.sign(deq[kept]) == np.sign(x[kept]))


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("n", [1, 255, 256, 257, 1000])
def test_sizes_match_the_reference(n, signed):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    x = x if signed else x * x
    code = kq.dynamic_map(signed)
    q, absmax, deq = _round_trip(x, code)
    assert q.dtype == np.uint8 and q.shape == (n,)
    assert absmax.dtype == np.float32 and absmax.shape == (math.ceil(n / 256),)
    assert deq.dtype == np.float32 and deq.shape == (n,)
    ref_q, ref_absmax, ref_deq = _reference(x, code)
    assert np.array_equal(q, ref_q) and np.array_equal(_bits(absmax), _bits(ref_absmax))
    assert np.array_equal(_bits(deq), _bits(ref_deq))
    _assert_bound(x, absmax, deq, code)


def _lower_midpoints_by_fractions(code):
    """Each exact midpoint rounded down to float32, found with exact rational arithmetic."""
    out = []
    for a, b in zip(code[:-1], code[1:]):
        m = (Fraction(float(a)) + Fraction(float(b))) / 2
        f = np.float32(float(m))
        while Fraction(float(f)) > m:
            f = np.nextafter(f, np.float32(-np.inf))
        while Fraction(float(np.nextafter(f, np.float32(np.inf)))) <= m:
            f = np.nextafter(f, np.float32(np.inf))
        out.append(f)
    return np.array(out, np.float32)


@pytest.mark.parametrize("signed", [True, False])
def test_ties_and_midpoints(signed):
    """At a midpoint (rounded down) the lower code wins; one ulp above it the upper one does."""
    code = kq.dynamic_map(signed)
    low = _lower_midpoints_by_fractions(code)
    up = np.nextafter(low, np.float32(np.inf))
    x = np.concatenate([[1.0], low, up]).astype(np.float32)  # one block, absmax 1: v == x exactly
    q, absmax, _ = _round_trip(x, code, block_size=512)
    assert absmax[0] == 1.0
    assert np.array_equal(q[1:256], np.arange(255)) and np.array_equal(q[256:], np.arange(1, 256))
    assert np.array_equal(q, _reference(x, code, block_size=512)[0])
    # bitsandbytes' (code[:-1] + code[1:]) / 2 in float32 rounds to nearest: some of its midpoints lie above the
    # exact ones, so this test tells the two apart (and tf.searchsorted on our midpoints agrees with us).
    assert np.any((code[:-1] + code[1:]) / np.float32(2) != low)
    ss = tf.searchsorted(tf.constant(low), tf.constant(x), side="left").numpy()
    assert np.array_equal(ss, q)


def _xla(code, block_size=256):
    @tf.function(jit_compile=True)
    def f(x):
        q, absmax = kq.quantize(x, code, block_size)
        return q, absmax, kq.dequantize(q, absmax, code, block_size)

    return f


@pytest.mark.parametrize("signed, n", [(True, 1000), (False, 1000), (True, 257)])
def test_xla_equals_eager_bit_for_bit(signed, n):
    code = kq.dynamic_map(signed)
    x = np.random.default_rng(4).standard_normal(n).astype(np.float32) * np.float32(1e-3)
    x = x if signed else x * x
    q, absmax, deq = (t.numpy() for t in _xla(code)(tf.constant(x)))
    eq, eabsmax, edeq = _round_trip(x, code)
    assert np.array_equal(q, eq) and np.array_equal(_bits(absmax), _bits(eabsmax))
    assert np.array_equal(_bits(deq), _bits(edeq))


def test_xla_builds_no_n_by_256_array():
    """tf.searchsorted lowers to an n x 255 comparison under XLA; the binary search stays O(n)."""
    n = 1000
    hlo = tf.function(lambda x: kq.quantize(x, kq.dynamic_map(True)), jit_compile=True)
    text = hlo.experimental_get_compiler_ir(tf.zeros([n]))(stage="optimized_hlo")
    sizes = [math.prod(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\w+\[([\d,]*)\]", text)]
    assert sizes and max(sizes) <= 1024  # n padded to whole blocks


@pytest.mark.parametrize("signed", [True, False])
def test_non_finite_poisons_its_block_only(signed):
    code = kq.dynamic_map(signed)
    x = np.abs(np.random.default_rng(5).standard_normal(256 * 3)).astype(np.float32)
    x[256 + 9] = np.nan
    x[512 + 1], x[512 + 2] = np.inf, -np.inf
    clean_q, clean_absmax, clean_deq = _round_trip(x[:256], code)
    for q, absmax, deq in (_round_trip(x, code), [t.numpy() for t in _xla(code)(tf.constant(x))]):
        assert q.dtype == np.uint8
        assert np.isnan(absmax[1:]).all() and np.isnan(deq[256:]).all()
        assert np.array_equal(q[:256], clean_q) and absmax[0] == clean_absmax[0]
        assert np.array_equal(deq[:256], clean_deq)


def test_rejects_what_it_cannot_do():
    code = kq.dynamic_map(True)
    with pytest.raises(ValueError):
        kq.quantize(tf.zeros([2, 256]), code)
    with pytest.raises(ValueError):
        kq.quantize(tf.zeros([0]), code)
    with pytest.raises(ValueError):
        kq.quantize(tf.zeros([10]), code[::-1])


# Magnitudes from 1e-30 to 2**100 (smaller ones become 0): code * absmax then stays a normal float32, which
# TensorFlow and numpy round alike (TensorFlow on CPU flushes subnormals to zero, numpy does not).
_elements = st.floats(-(2.0 ** 100), 2.0 ** 100, width=32, allow_subnormal=False).map(
    lambda f: f if abs(f) >= 1e-30 else 0.0)


@settings(max_examples=60, deadline=None)
@given(x=hnp.arrays(np.float32, st.integers(1, 700), elements=_elements),
       signed=st.booleans(), block_size=st.sampled_from([1, 7, 64, 256]))
def test_property_matches_reference(x, signed, block_size):
    x = x if signed else np.abs(x)
    code = kq.dynamic_map(signed)
    q, absmax, deq = _round_trip(x, code, block_size)
    ref_q, ref_absmax, ref_deq = _reference(x, code, block_size)
    assert np.array_equal(q, ref_q)
    assert np.array_equal(absmax, ref_absmax) and np.array_equal(deq, ref_deq)
    _assert_bound(x, absmax, deq, code, block_size)


# --- the table lookup against the 8-step binary search it replaced ------------------------------------------------

def _binary_search_quantize(x, code, block_size=256):
    """kmp.scaling.quantize's former algorithm, kept as the reference: absmax by a float reduce_max and a finiteness
    check, then the lower bound of x / absmax among the midpoints by a branchless binary search of 8 gathers."""
    x = tf.convert_to_tensor(x, tf.float32)
    mid = tf.constant(kq._lower_midpoints(code))
    n = kq._static_length(x, block_size)
    xb = kq._blocks(x, block_size)
    absmax = tf.reduce_max(tf.abs(xb), axis=1)
    absmax = tf.where(absmax >= np.finfo(np.float32).tiny, absmax, 0.0)
    absmax = tf.where(tf.reduce_all(tf.math.is_finite(xb), axis=1), absmax, np.nan)
    v = xb / tf.where(absmax > 0.0, absmax, 1.0)[:, None]
    q = tf.zeros(tf.shape(v), tf.int32)
    for step in (128, 64, 32, 16, 8, 4, 2, 1):
        q = tf.where(tf.gather(mid, q + (step - 1)) < v, q + step, q)
    return tf.cast(tf.reshape(q, [-1])[:n], tf.uint8), absmax


def _both(x, code, block_size, xla):
    """(new q, new absmax), (old q, old absmax) as numpy, eagerly or both under XLA."""
    new = lambda x: kq.quantize(x, code, block_size)  # noqa: E731
    old = lambda x: _binary_search_quantize(x, code, block_size)  # noqa: E731
    if xla:
        new, old = (tf.function(f, jit_compile=True) for f in (new, old))
    return [[t.numpy() for t in f(tf.constant(x))] for f in (new, old)]


def _assert_same_bits(x, code, block_size=256, xla=False):
    (q, absmax), (old_q, old_absmax) = _both(x, code, block_size, xla)
    assert np.array_equal(q, old_q), f"codes differ at {np.flatnonzero(q != old_q)[:5]}"
    assert np.array_equal(_bits(absmax), _bits(old_absmax))


@pytest.mark.parametrize("signed", [True, False])
def test_the_tables_serve_the_dynamic_maps_and_fit_in_1024_entries(signed):
    tables = kq._search_tables(kq._lower_midpoints(kq.dynamic_map(signed)))
    assert tables is not None  # else quantize falls back to the binary search
    assert all(t.ndim == 1 and len(t) <= 1024 for t in tables)


def _around(values, ulps=2):
    """values and their float32 neighbours up to `ulps` either way."""
    values = np.asarray(values, np.float32)
    out = [values]
    for direction in (np.inf, -np.inf):
        near = values
        for _ in range(ulps):
            near = np.nextafter(near, np.float32(direction))
            out.append(near)
    return np.concatenate(out)


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("xla", [False, True])
def test_lookup_equals_the_search_at_every_bucket_edge_and_midpoint(signed, xla):
    """Every value where the tables change, or a code's midpoint lies, and their neighbours: with a 1.0 in the block,
    x / absmax is x itself, so these are exactly the quotients the lookup sees."""
    code = kq.dynamic_map(signed)
    mid = kq._lower_midpoints(code)[:-1]
    base, shift, low, _ = kq._search_tables(kq._lower_midpoints(code))
    edges = []
    for top in range(512):
        if top & 0xFF != 0xFF:
            count = 1 << (23 - int(shift[top]))
            starts = (top << 23) | (np.arange(count, dtype=np.int64) << int(shift[top]))
            edges.append(starts.astype(np.uint32).view(np.float32))
    values = _around(np.concatenate([mid, -mid, *edges, [0.0, -0.0, 1e-39, -1e-39, 1.0, -1.0]]))
    values = values[np.isfinite(values) & (np.abs(values) <= 1)]
    x = np.concatenate([[1.0], values]).astype(np.float32)
    assert len(x) > 2000
    _assert_same_bits(x, code, block_size=len(x), xla=xla)  # one block: absmax 1
    q = _both(x, code, len(x), xla)[0][0]
    assert np.array_equal(q, np.searchsorted(kq._lower_midpoints(code), x, side="left"))


# Values quantize must treat as the search did: midpoints of either map (times a power of two, with that power of
# two in the same block, so x / absmax is the midpoint) and their neighbours, zeros, subnormals, huge, inf and NaN.
_MIDPOINTS = _around(np.concatenate([kq._lower_midpoints(kq.dynamic_map(s))[:-1] for s in (True, False)]), 1)
_special = st.sampled_from([0.0, -0.0, 1e-39, -1e-39, 1e-45, 3e38, -3e38, np.inf, -np.inf, np.nan, 1.0, -1.0])
_adversarial = st.one_of(st.sampled_from(list(_MIDPOINTS) + list(-_MIDPOINTS)), _special,
                         st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True))


@settings(max_examples=150, deadline=None)
@given(x=hnp.arrays(np.float32, st.integers(1, 600), elements=_adversarial),
       scale=st.integers(-120, 120), signed=st.booleans(), block_size=st.sampled_from([1, 3, 64, 256]))
def test_property_same_bits_as_the_binary_search(x, scale, signed, block_size):
    with np.errstate(over="ignore"):
        x = x * np.float32(2.0 ** scale)  # a power of two: where it neither overflows nor underflows, the same quotients
    _assert_same_bits(x.astype(np.float32), kq.dynamic_map(signed), block_size)  # negatives too with the unsigned map


@pytest.mark.parametrize("signed", [True, False])
def test_under_xla_same_bits_as_the_binary_search_on_adversarial_blocks(signed):
    rng = np.random.default_rng(6)
    x = rng.choice(np.concatenate([_MIDPOINTS, -_MIDPOINTS]), 256 * 12).astype(np.float32)
    x[::256] = 1.0  # each block's absmax 1: the quotients are the midpoints and their neighbours
    x[256 * 3:256 * 4] *= np.float32(2.0 ** -60)  # a block of small values, one of huge, and of every kind at once
    x[256 * 4:256 * 5] *= np.float32(2.0 ** 100)
    x[256 * 5:256 * 6] = rng.choice(np.array([0.0, -0.0, 1e-39, -1e-39, 3e38, -3e38, 1e-30], np.float32), 256)
    x[256 * 6 + 7], x[256 * 7 + 8], x[256 * 8 + 9] = np.nan, np.inf, -np.inf
    x[256 * 9:256 * 10] = 0.0
    x[256 * 10:] = rng.standard_normal(512).astype(np.float32) * np.float32(1e-3)
    _assert_same_bits(x, kq.dynamic_map(signed), xla=True)
    _assert_same_bits(x[:1000], kq.dynamic_map(signed), xla=True)  # a partial last block


def test_a_code_the_tables_cannot_serve_falls_back_to_the_search():
    # Two codes 1e-6 and 2e-6 above another: their midpoints share any bucket a cut into at most 512 makes.
    linear = np.linspace(-1, 1, 254, dtype=np.float32)
    near = linear[np.argmin(np.abs(linear - 0.7))]
    code = np.sort(np.concatenate([linear, near + np.float32([1e-6, 2e-6])])).astype(np.float32)
    assert kq._search_tables(kq._lower_midpoints(code)) is None
    x = np.concatenate([[1.0], _around(kq._lower_midpoints(code)[:-1], 1),
                        np.random.default_rng(7).uniform(-1, 1, 500)]).astype(np.float32)
    q, absmax, _ = _round_trip(x, code, block_size=len(x))
    assert np.array_equal(q, _reference(x, code, block_size=len(x))[0])
    _assert_same_bits(x, code, block_size=len(x))
