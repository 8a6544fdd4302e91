import pytest
from hypothesis import given
from hypothesis import strategies as st

from autotune.errors import InputError
from autotune.units import fmt_bytes, parse_bandwidth, parse_bytes, parse_flops, parse_time


@pytest.mark.parametrize("text,value", [
    ("450GB/s", 450e9), ("400Gbit/s", 50e9), ("400Gbps", 50e9), ("25 GB/s", 25e9), ("1.5TB/s", 1.5e12),
    ("10GiB/s", 10 * 2**30),
])
def test_bandwidth(text, value):
    assert parse_bandwidth(text) == pytest.approx(value)


@pytest.mark.parametrize("text,value", [("80GiB", 80 * 2**30), ("24GB", 24e9), ("512MiB", 512 * 2**20), ("1KiB", 1024)])
def test_bytes(text, value):
    assert parse_bytes(text) == pytest.approx(value)


@pytest.mark.parametrize("text,value", [("3us", 3e-6), ("10ms", 1e-2), ("2s", 2.0), ("5ns", 5e-9), ("0.5s", 0.5), (0, 0.0), ("0", 0.0)])
def test_time(text, value):
    assert parse_time(text) == pytest.approx(value)


def test_flops():
    assert parse_flops("989TFLOP/s") == pytest.approx(989e12)


@pytest.mark.parametrize("bad", ["fast", "450GB", "-3GB/s", "", "GB/s", True, None, [1]])
def test_bad_bandwidth(bad):
    with pytest.raises(InputError):
        parse_bandwidth(bad, field="x.bandwidth")


@given(st.integers(min_value=1, max_value=10**15))
def test_fmt_bytes_round_trips_within_rounding(n):
    s = fmt_bytes(n)
    assert parse_bytes(s) == pytest.approx(n, rel=0.06)


@given(st.text(max_size=20))
def test_parsers_never_raise_anything_but_input_error(s):
    for f in (parse_bandwidth, parse_bytes, parse_time, parse_flops):
        try:
            f(s)
        except InputError:
            pass


@pytest.mark.parametrize("parse,bare,units", [
    (parse_time, 3, "us"), (parse_time, "3", "ms"), (parse_bandwidth, 1e9, "GB/s"), (parse_bandwidth, "25", "Gbit/s"),
    (parse_bytes, 1024, "GiB"), (parse_bytes, "80", "GB"), (parse_flops, 1e12, "TFLOP/s"),
])
def test_a_value_without_its_unit_is_refused_naming_the_field_and_its_units(parse, bare, units):
    # one rule for numbers and strings: `latency: 3` once silently meant 3 seconds
    with pytest.raises(InputError) as e:
        parse(bare, field="nodes[0].intra_node.x")
    assert e.value.field == "nodes[0].intra_node.x"
    assert "no unit" in e.value.message and units in e.value.message


def test_a_count_takes_its_noun_in_the_number_it_is():
    from autotune.units import counted

    assert counted(1, "plan") == "1 plan"
    assert counted(0, "plan") == "0 plans"
    assert counted(1024, "device") == "1,024 devices"
    assert counted(2, "batch", "batches") == "2 batches"
    assert counted(1, "batch", "batches") == "1 batch"
