"""QSGD quantisation: unbiased, on levels, packing exact, seeded, zero buckets give zeros."""

from __future__ import annotations

import numpy as np
import pytest

from asynccoll.collectives.sparse import quantize as qsgd
from asynccoll.errors import ProtocolError
from asynccoll.transport.frames import PROTOCOL_VERSION, Format, Header, Message


@pytest.mark.parametrize("bits", qsgd.BITS)
def test_pack_unpack_round_trip(bits: int) -> None:
    rng = np.random.default_rng(bits)
    for n in (0, 1, 3, 7, 8, 1001):
        codes = rng.integers(0, 1 << bits, n).astype(np.uint8)
        packed = qsgd.pack(codes, bits)
        assert packed.size == -(-n * bits // 8)
        assert np.array_equal(qsgd.unpack(packed, bits, n), codes)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bits", qsgd.BITS)
def test_outputs_lie_on_levels(bits: int, dtype: type) -> None:
    rng = np.random.default_rng(0)
    n, bucket = 2000, 512
    x = (rng.standard_normal(n) * 3).astype(dtype)
    q = qsgd.quantize(x, bits, bucket, seed=1)
    y = qsgd.dequantize(q)
    assert y.dtype == x.dtype
    s = qsgd.levels(bits)
    assert q.nbytes == 4 * q.nbuckets + -(-n * bits // 8)
    for b in range(q.nbuckets):
        seg = slice(b * bucket, min(n, (b + 1) * bucket))
        scale = float(q.scales[b])
        assert scale >= np.abs(x[seg]).max()
        lv = y[seg] * s / scale
        assert np.allclose(lv, np.round(lv), atol=1e-4)
        assert np.all(np.abs(np.round(lv)) <= s)
        # never more than one level from the input, with the input's sign or zero
        assert np.all(np.abs(y[seg] - x[seg]) <= scale / s * (1 + 1e-5))
        assert np.all(y[seg] * x[seg] >= 0)


@pytest.mark.parametrize("bits", qsgd.BITS)
def test_unbiased_monte_carlo(bits: int) -> None:
    rng = np.random.default_rng(5)
    n, trials = 600, 1500
    x = rng.standard_normal(n).astype(np.float64)
    gen = np.random.default_rng(123)
    total = np.zeros(n)
    for _ in range(trials):
        total += qsgd.dequantize(qsgd.quantize(x, bits, 256, rng=gen))
    mean = total / trials
    s = qsgd.levels(bits)
    scale = np.abs(x).max()
    # each sample is within one level (width scale/s) of x: the std is at most half a level
    band = 5.0 * (scale / s / 2) / np.sqrt(trials)
    assert np.all(np.abs(mean - x) <= band)
    # and the band is tight enough to catch a biased rounding (round-to-nearest)
    biased = np.round(x / (scale / s)) * (scale / s)
    if bits < 8:
        assert np.any(np.abs(biased - x) > band)


def test_deterministic_for_a_seed() -> None:
    x = np.random.default_rng(0).standard_normal(3000).astype(np.float32)
    a = qsgd.quantize(x, 4, seed=42)
    b = qsgd.quantize(x, 4, seed=42)
    c = qsgd.quantize(x, 4, seed=43)
    assert np.array_equal(a.buf, b.buf)
    assert not np.array_equal(a.buf, c.buf)


@pytest.mark.parametrize("bits", qsgd.BITS)
def test_zero_buckets_decode_to_zeros(bits: int) -> None:
    x = np.zeros(1200, np.float32)
    x[600:700] = np.linspace(-1, 1, 100)
    q = qsgd.quantize(x, bits, 512, seed=0)
    y = qsgd.dequantize(q)
    assert not np.any(np.isnan(y))
    assert q.scales[0] == 0
    assert q.scales[2] == 0
    assert np.all(y[:512] == 0)
    assert np.all(y[1024:] == 0)
    assert np.all(qsgd.dequantize(qsgd.quantize(np.zeros(7, np.float32), bits)) == 0)


def test_rejects_bad_arguments() -> None:
    x = np.ones(10, np.float32)
    with pytest.raises(ValueError, match="bits"):
        qsgd.quantize(x, 3)
    with pytest.raises(ValueError, match="bucket"):
        qsgd.quantize(x, 4, 0)
    with pytest.raises(TypeError, match="float"):
        qsgd.quantize(np.ones(10, np.int32), 4)
    with pytest.raises(ValueError, match="finite"):
        qsgd.quantize(np.array([1.0, np.inf], np.float32), 4)


def test_wire_round_trip_and_validation() -> None:
    x = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    q = qsgd.quantize(x, 2, 128, seed=3)
    p = qsgd.to_payload(q)
    assert p.fmt == Format.QUANTIZED
    assert p.shape == (1000, 2, 128)

    def msg(shape: tuple[int, ...], data: np.ndarray, dtype: str = "<f4") -> Message:
        mv = memoryview(bytearray(data.tobytes()))
        return Message(Header(PROTOCOL_VERSION, 0, 1, 0, 0, 0, dtype, shape,
                              int(Format.QUANTIZED), len(mv)), mv)

    back = qsgd.from_message(msg(p.shape, q.buf), 1000, np.float32)
    assert np.array_equal(qsgd.dequantize(back), qsgd.dequantize(q))
    with pytest.raises(ProtocolError, match="bytes"):
        qsgd.from_message(msg(p.shape, q.buf[:-1]))
    with pytest.raises(ProtocolError, match="expected 999"):
        qsgd.from_message(msg(p.shape, q.buf), 999)
    with pytest.raises(ProtocolError, match="bits"):
        qsgd.from_message(msg((1000, 3, 128), q.buf))
    bad = q.buf.copy()
    bad[:4] = np.array([-1.0], np.float32).view(np.uint8)
    with pytest.raises(ProtocolError, match="scales"):
        qsgd.from_message(msg(p.shape, bad))
