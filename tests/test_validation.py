import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ddp_notebook
from ddp_notebook import InvalidDevicesError, validate_devices
from ddp_notebook.core.probes import StaticProbe

from helpers import started_processes

pytestmark = pytest.mark.unit

GiB = 1 << 30


def codes(report, level="error"):
    return [f.code for f in report.findings if f.level == level]


def test_valid_cpu_list():
    r = validate_devices("cpu:0,cpu:1", probe=StaticProbe(cpus=4))
    assert r.ok and r.backend == "gloo" and not r.findings
    assert [str(d) for d in r.devices] == ["cpu:0", "cpu:1"]
    assert "OK" in str(r) and "rank 0 = cpu:0 (main)" in str(r)


def test_all_cuda_uses_nccl():
    r = validate_devices("cuda", probe=StaticProbe(gpus_free=[(8 * GiB, 16 * GiB)] * 2))
    assert r.ok and r.backend == "nccl" and [str(d) for d in r.devices] == ["cuda:0", "cuda:1"]


def test_empty():
    r = validate_devices("", probe=StaticProbe())
    assert codes(r) == ["empty"] and "empty" in r.errors[0].message


def test_duplicate_names_ranks():
    r = validate_devices("cuda:0,cuda:1,cuda:0", probe=StaticProbe(gpus_free=[(GiB, GiB)] * 2))
    assert codes(r) == ["duplicate"]
    assert r.errors[0].message == "cuda:0 is listed 2 times (ranks 0, 2); each device may appear once."


def test_missing_device_says_how_many_exist():
    r = validate_devices("cuda:0,cuda:1", probe=StaticProbe(gpus_free=[(GiB, GiB)]))
    assert codes(r) == ["missing"]
    assert r.errors[0].message == "cuda:1 does not exist: 1 CUDA device is visible (cuda:0)."
    r = validate_devices("cuda:5", probe=StaticProbe(gpus_free=[(GiB, GiB)] * 2))
    assert "2 CUDA devices are visible (cuda:0, cuda:1)" in r.errors[0].message
    r = validate_devices("cuda:0", probe=StaticProbe())
    assert "no CUDA device is visible" in r.errors[0].message


def test_not_enough_gpu_memory():
    probe = StaticProbe(gpus_free=[(10 * GiB, 80 * GiB), (GiB // 2, 80 * GiB)])
    r = validate_devices("cuda:0,cuda:1", min_free_memory=4 * GiB, probe=probe)
    assert codes(r) == ["memory"] and r.errors[0].device == "cuda:1"
    assert r.errors[0].message == "cuda:1 has 512.0 MiB free of 80.0 GiB; each worker needs 4.0 GiB."


def test_not_enough_host_memory_for_cpu_workers():
    r = validate_devices("cpu*2", min_free_memory=3 * GiB, probe=StaticProbe(host_memory=5 * GiB))
    assert codes(r) == ["memory"] and "need 6.0 GiB of host memory and 5.0 GiB is available" in r.errors[0].message


def test_mixed_kinds():
    r = validate_devices("cpu:0,cuda:0", probe=StaticProbe(gpus_free=[(GiB, GiB)]))
    assert "mixed" in codes(r)


def test_backend_cannot_serve_list():
    r = validate_devices("cpu*2", backend="nccl", probe=StaticProbe())
    assert codes(r) == ["backend"] and "nccl backend needs CUDA devices" in r.errors[0].message
    r = validate_devices("cpu*2", backend="mpi", probe=StaticProbe())
    assert "Unknown backend 'mpi'; valid backends are gloo, nccl." == r.errors[0].message
    r = validate_devices("cuda:0", probe=StaticProbe(gpus_free=[(GiB, GiB)], nccl=False))
    assert codes(r) == ["backend"]
    assert validate_devices("cuda:0", backend="gloo", probe=StaticProbe(gpus_free=[(GiB, GiB)], nccl=False)).ok


def test_more_cpu_workers_than_cores_is_a_warning():
    r = validate_devices("cpu*3", probe=StaticProbe(cpus=2))
    assert r.ok and codes(r, "warning") == ["oversubscribed"]
    assert "3 CPU workers share 2 cores" in str(r)


def test_several_problems_reported_together():
    r = validate_devices("cuda:0,cuda:0,cuda:3,cpu:0", probe=StaticProbe(gpus_free=[(GiB, GiB)]))
    assert sorted(codes(r)) == ["duplicate", "missing", "mixed"]
    assert "3 error(s)" in str(r)


def test_syntax_error_is_a_finding_not_an_exception():
    r = validate_devices("cuda:x", probe=StaticProbe())
    assert codes(r) == ["syntax"] and "cannot read device 'cuda:x'" in r.summary()


def test_launch_refuses_invalid_list_before_starting_anything(tmp_path):

    children = started_processes()
    with pytest.raises(InvalidDevicesError) as e:
        ddp_notebook.launch(lambda ctx: None, devices="cpu:0,cpu:0", run_root=str(tmp_path))
    assert e.value.report.errors[0].code == "duplicate"
    assert "cpu:0 is listed 2 times" in str(e.value)
    assert isinstance(e.value, ddp_notebook.DDPNotebookError)
    assert started_processes() == children
    assert list(tmp_path.iterdir()) == []


def test_default_probe_leaves_cuda_uninitialized():
    import torch

    validate_devices("cuda:0")  # asks a child process, whatever this machine has
    assert not torch.cuda.is_initialized()


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="cpugdaCU:0123456789,*- x", max_size=25))
def test_validation_never_raises(spec):
    r = validate_devices(spec, probe=StaticProbe(cpus=2, gpus_free=[(GiB, GiB)]))
    assert r.ok or r.errors
