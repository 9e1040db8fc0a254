import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddp_notebook import Device, parse_devices
from ddp_notebook.core.devices import MAX_WORKERS, format_devices
from ddp_notebook.errors import DeviceSpecError

pytestmark = pytest.mark.unit


def names(spec, gpus=0):
    return [str(d) for d in parse_devices(spec, cuda_count=lambda: gpus)]


@pytest.mark.parametrize("spec, expected", [
    ("cpu:0,cpu:1", ["cpu:0", "cpu:1"]),
    (" CUDA:0 , cuda:1 ", ["cuda:0", "cuda:1"]),
    ("cuda:0-3", ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]),
    ("cpu*4", ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]),
    ("cuda", ["cuda:0", "cuda:1"]),
    ("gpu:1", ["cuda:1"]),
    ("cpu,cpu", ["cpu:0", "cpu:1"]),
    ("cpu:1,cpu", ["cpu:1", "cpu:0"]),
    (["cuda:1", "cuda:0"], ["cuda:1", "cuda:0"]),
    ([Device("cpu", 3)], ["cpu:3"]),
    ("", []),
])
def test_parse_forms(spec, expected):
    assert names(spec, gpus=2) == expected


def test_torch_devices():
    import torch

    assert names([torch.device("cpu"), torch.device("cpu")]) == ["cpu:0", "cpu:1"]
    assert names([torch.device("cuda", 1), torch.device("cuda")]) == ["cuda:1", "cuda:0"]
    assert names(torch.device("cuda", 2)) == ["cuda:2"]


@pytest.mark.parametrize("spec, words", [
    ("tpu:0", "unknown device kind 'tpu'; valid kinds are cpu, cuda"),
    ("cuda:", "expected KIND"),
    ("cuda:-1", "expected KIND"),
    ("cuda:3-1", "the range ends (1) before it starts (3)"),
    ("cpu*0", "a count of 0"),
    ("cpu:0,,cpu:1", "an empty entry"),
    ("0,1", "expected KIND"),
    ("cuda", "no CUDA device is visible"),
    (f"cpu*{MAX_WORKERS + 1}", f"more than {MAX_WORKERS} devices"),
    (["cpu:0,cpu:1"], "a list entry holds one device"),
    ([3.5], "cannot read device 3.5 (a float)"),
])
def test_parse_errors_say_what_is_wrong(spec, words):
    with pytest.raises(DeviceSpecError) as e:
        parse_devices(spec, cuda_count=lambda: 0)
    assert words in str(e.value)


def test_cuda_count_asked_only_for_bare_cuda():
    def boom():
        raise AssertionError("probe called")

    assert names("cuda:0,cuda:1") == ["cuda:0", "cuda:1"]
    assert [str(d) for d in parse_devices("cuda:0", cuda_count=boom)] == ["cuda:0"]


def test_format_and_torch_device():
    devices = parse_devices("cpu:2,cpu:5", cuda_count=lambda: 0)
    assert format_devices(devices) == "cpu:2,cpu:5"
    assert str(devices[0].torch_device()) == "cpu"
    assert str(Device("cuda", 1).torch_device()) == "cuda:1"


@settings(max_examples=400, deadline=None)
@given(st.one_of(
    st.text(),
    st.text(alphabet="cpuagdCUDA:0123456789,*- ", max_size=30),
    st.lists(st.text(alphabet="cpuda:0123456789*-", max_size=10), max_size=5),
))
def test_any_spec_parses_or_gives_our_error(spec):
    try:
        out = parse_devices(spec, cuda_count=lambda: 2)
    except DeviceSpecError as e:
        assert str(e)
    else:
        assert all(isinstance(d, Device) and d.kind in ("cpu", "cuda") and d.index >= 0 for d in out)
        assert len(out) <= MAX_WORKERS
