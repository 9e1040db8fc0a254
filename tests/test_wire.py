import json

import pytest

from ddp_notebook.core.events import FrameDecoder, encode, to_json_value

pytestmark = pytest.mark.unit


def test_frames_survive_any_split():
    data = encode({"kind": "progress", "step": 1}) + encode({"kind": "done"}, b"\x00" * 70000) + encode({"kind": "x"})
    for size in (1, 3, 4096, len(data)):
        d = FrameDecoder()
        out = []
        for i in range(0, len(data), size):
            out += d.feed(data[i:i + size])
        assert [e["kind"] for e, _ in out] == ["progress", "done", "x"]
        assert out[1][1] == b"\x00" * 70000 and out[1][0]["blob"] == 70000
        assert not d.incomplete


def test_incomplete_frame_is_visible():
    d = FrameDecoder()
    assert d.feed(encode({"kind": "x"})[:-1]) == [] and d.incomplete


def test_metric_values():
    import torch

    assert to_json_value(torch.tensor(2.5)) == 2.5
    assert to_json_value(3) == 3 and to_json_value("a") == "a"
    assert to_json_value(float("nan")) == "nan"
    json.dumps(to_json_value(float("inf")), allow_nan=False)
    with pytest.raises(TypeError, match="metric 'loss' must be a number"):
        to_json_value([1, 2], "loss")
    with pytest.raises(TypeError, match="one-element tensor"):
        to_json_value(torch.ones(3), "acc")
