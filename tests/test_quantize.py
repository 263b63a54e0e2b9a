"""kmp.scaling.quantize: the two 8-bit float formats, nearest-value encoding, block scales, XLA, and a numpy
reference written apart from the module."""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kmp.scaling import quantize as kq

FORMATS = {"signed": True, "unsigned": False}


def _values(signed: bool) -> np.ndarray:
    """Each code's value in float64, built from the layout: (sign,) 4 exponent bits e, k significand bits f,
    2**(e - 15) * (1 + f / 2**k), and 0.0 for a zero magnitude."""
    k = 3 if signed else 4
    values = np.zeros(256)
    for code in range(256):
        magnitude = code & 0x7F if signed else code
        e, f = magnitude >> k, magnitude & ((1 << k) - 1)
        value = 0.0 if magnitude == 0 else 2.0 ** (e - 15) * (1 + f / 2 ** k)
        values[code] = -value if signed and code & 0x80 else value
    return values


def _nearest(x: np.ndarray, signed: bool) -> np.ndarray:
    """The reference encoder: the code whose value is nearest x (float64 distances), a tie to the code with the
    even significand, and above the largest magnitude the top code. A value that rounds to 2**-15 or less (half
    way to the smallest magnitude, or under) is 0 when signed, the smallest code when unsigned and positive. A
    subnormal float32 counts as 0 (TensorFlow on CPU flushes them)."""
    x = np.where(np.abs(x) < np.finfo(np.float32).tiny, np.float32(0), x)
    values = _values(signed)
    candidates = np.arange(256)[(np.arange(256) & (0x7F if signed else 0xFF)) > 0]
    # Past 4 the top code is nearest: clipped first, so float64 keeps the distances apart.
    distance = np.abs(values[candidates][None, :] - np.clip(x.astype(np.float64), -4, 4)[:, None])
    tied = distance == distance.min(axis=1, keepdims=True)
    even = (candidates[None, :] & 1) == 0
    codes = candidates[np.where(tied.sum(axis=1) > 1, np.argmax(tied & even, axis=1), np.argmax(tied, axis=1))]
    floor = 2.0 ** -15 * (1 + 2.0 ** -(4 if signed else 5))
    if signed:
        codes = np.where(np.abs(x) <= floor, 0, codes)
    else:
        codes = np.where(x > 0, np.where(x <= floor, 1, codes), 0)
    return codes.astype(np.uint8)


def _encode(x, signed, block_size=256):
    """Encode float32 x with scale 1 in every block (the codes of x itself)."""
    scales = tf.ones([-(-len(x) // block_size)])
    return kq.encode(tf.constant(x, tf.float32), scales, signed, block_size).numpy()


@pytest.mark.parametrize("signed", FORMATS.values(), ids=FORMATS)
def test_each_code_decodes_to_the_value_its_layout_gives(signed):
    values = kq.FORMATS[signed].values()
    np.testing.assert_array_equal(values, _values(signed).astype(np.float32))
    magnitudes = np.unique(np.abs(values))
    assert len(magnitudes) == (128 if signed else 256) and magnitudes[0] == 0.0
    assert magnitudes[1] == 2.0 ** -15 * (1.125 if signed else 1.0625) and magnitudes[-1] == kq.FORMATS[signed].top
    # Every value is 2**-k-relative apart from its neighbour at most: the precision the docs promise.
    k = 3 if signed else 4
    assert np.max(np.diff(magnitudes[1:]) / magnitudes[1:-1]) == 2.0 ** -k


@pytest.mark.parametrize("signed", FORMATS.values(), ids=FORMATS)
def test_every_code_value_and_every_midpoint_encodes_as_the_reference(signed):
    values = np.unique(_values(signed))
    mids = (values[:-1] + values[1:]) / 2
    below, above = (np.nextafter(mids.astype(np.float32), np.float32(side)) for side in (-np.inf, np.inf))
    x = np.concatenate([values, mids, below, above,
                        [2.0, 1e30, -1e30, 1e-30, -1e-30, 0.0, -0.0]]).astype(np.float32)
    np.testing.assert_array_equal(_encode(x, signed), _nearest(x, signed))
    # And each code value comes back exactly.
    codes = _encode(values.astype(np.float32), signed)
    np.testing.assert_array_equal(kq.decode(codes, tf.ones([len(codes) // 256 + 1]), signed).numpy(),
                                  values.astype(np.float32))


@settings(max_examples=60, deadline=None)
@given(x=hnp.arrays(np.float32, st.integers(1, 600), elements=st.floats(-4, 4, width=32)),
       signed=st.booleans())
def test_property_nearest_code_as_the_reference(x, signed):
    np.testing.assert_array_equal(_encode(x, signed), _nearest(x, signed))


@pytest.mark.parametrize("signed", FORMATS.values(), ids=FORMATS)
def test_round_trip_within_the_formats_precision_and_blocks_apart(signed):
    rng = np.random.default_rng(0)
    n = 256 * 40 + 77  # a partial last block
    x = (rng.standard_normal(n) * np.repeat(10.0 ** rng.uniform(-20, 20, 41), 256)[:n]).astype(np.float32)
    if not signed:
        x = np.abs(x)
    codes, scales = kq.quantize(tf.constant(x), signed)
    y = kq.decode(codes, scales, signed).numpy()
    scale = np.repeat(scales.numpy(), 256)[:n].astype(np.float64)
    largest = np.repeat(np.abs(np.pad(x, (0, -n % 256))).reshape(-1, 256).max(axis=1), 256)[:n]
    np.testing.assert_allclose(scale * kq.FORMATS[signed].top, largest, rtol=1e-6)
    k = 3 if signed else 4
    err = np.abs(y.astype(np.float64) - x)
    within = np.abs(x) >= 2.0 ** -15 * scale
    assert np.all(err[within] <= np.abs(x[within]) * 2.0 ** -(k + 1) * (1 + 1e-6))
    # Under the window: 0 (signed), or the smallest value, never 0 for a positive (unsigned).
    assert np.all(err[~within] <= 2.0 ** -15 * 1.125 * scale[~within] * (1 + 1e-6))
    if not signed:
        assert np.all((y > 0) == (x > 0))


@pytest.mark.parametrize("signed", FORMATS.values(), ids=FORMATS)
def test_zero_blocks_and_non_finite_blocks(signed):
    x = np.zeros(1024, np.float32)
    x[300], x[600] = np.inf, np.nan
    x[900:] = np.linspace(0, 1, 124)
    codes, scales = kq.quantize(tf.constant(x), signed)
    y = kq.decode(codes, scales, signed).numpy()
    assert scales.numpy()[0] == 0 and np.all(y[:256] == 0)  # a zero block: scale 0, exact zeros
    assert not np.isfinite(y[256:768]).any()  # inf and NaN poison their own blocks
    np.testing.assert_allclose(y[900:], x[900:], rtol=2.0 ** -(4 if signed else 5), atol=1e-4)


def test_values_over_the_scale_take_the_top_code():
    scales = tf.constant([1.0])
    codes = kq.encode(tf.constant([5.0, -5.0, 1.9], tf.float32), scales, True).numpy()
    assert list(codes) == [0x7F, 0xFF, 0x7F]
    assert list(kq.encode(tf.constant([5.0, -5.0], tf.float32), scales, False).numpy()) == [0xFF, 0]


@pytest.mark.parametrize("n", [1, 255, 256, 1000])
def test_xla_equals_eager_bit_for_bit_and_has_no_table(n):
    rng = np.random.default_rng(n)
    x = tf.constant((rng.standard_normal(n) * 10.0 ** rng.uniform(-8, 8, n)).astype(np.float32))
    for signed in (True, False):
        eager = kq.quantize(x, signed)
        xla = tf.function(lambda x: kq.quantize(x, signed), jit_compile=True)
        compiled = xla(x)
        for a, b in zip(eager, compiled):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
        np.testing.assert_array_equal(kq.decode(*eager, signed).numpy(),
                                      tf.function(lambda c, s: kq.decode(c, s, signed), jit_compile=True)(*eager))
    # The speed of the design: encode and decode are arithmetic on the bits, no gather or search.
    hlo = xla.experimental_get_compiler_ir(x)(stage="optimized_hlo")
    assert " gather(" not in hlo and " sort(" not in hlo


def test_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match="1-D tensor of static length"):
        kq.quantize(tf.zeros([2, 3]), True)
    with pytest.raises(ValueError, match="block_size >= 1"):
        kq.quantize(tf.zeros([8]), True, block_size=0)
    with pytest.raises(ValueError, match="1-D tensor of static length"):
        kq.decode(tf.zeros([0], tf.uint8), tf.zeros([0]), True)


@pytest.mark.parametrize("signed", FORMATS.values(), ids=FORMATS)
def test_stochastic_rounding_picks_a_neighbour_and_is_right_on_average(signed):
    rng = np.random.default_rng(1)
    x = (rng.uniform(0.5, 1.8, 64) * (rng.choice([-1, 1], 64) if signed else 1)).astype(np.float32)
    draws = 4000
    form = kq.FORMATS[signed]
    noise = kq.dither(tf.reshape(tf.range(draws * 64), [draws, 64]), 7)
    codes = kq.encode_codes(tf.broadcast_to(tf.constant(x), [draws, 64]), form, noise)
    values = kq.decode_codes(codes, form).numpy().astype(np.float64)
    nearest = _values(signed)[_nearest(x, signed)]
    step = 2.0 ** -(form.significand_bits) * 2.0 ** np.floor(np.log2(np.abs(x)))
    assert np.all(np.abs(values - x) < step)  # one of the two codes around x
    # The mean of the draws is x (its standard error is under step / 2 / sqrt(draws)); the nearest code is not.
    np.testing.assert_allclose(values.mean(axis=0), x, atol=float(4 * step.max() / 2 / np.sqrt(draws)))
    assert np.abs(nearest - x).max() > 4 * step.max() / 2 / np.sqrt(draws)


def test_dither_is_murmur3s_finalizer():
    def fmix32(h):
        for multiplier, shift in ((0x85EBCA6B, 16), (0xC2B2AE35, 13), (None, 16)):
            h ^= h >> shift
            h = h * multiplier & 0xFFFFFFFF if multiplier else h
        return h

    keys = np.array([0, 1, 2, 12345, -7, 2 ** 31 - 1, -2 ** 31], np.int32)
    got = kq.dither(tf.constant(keys), 0x5BD1E995).numpy().view(np.uint32)
    np.testing.assert_array_equal(got, [fmix32((int(k) ^ 0x5BD1E995) & 0xFFFFFFFF) for k in keys])
