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


def test_the_control_pipe_carries_frames_stop_flush_a_sessions_request_with_its_body_then_release():
    import os
    import threading

    from ddp_notebook.core.events import Control
    from ddp_notebook.worker.channel import take_requests, watch_lifeline

    r, w = os.pipe()
    got, flushed = [], threading.Event()
    stop, release = threading.Event(), threading.Event()
    take_requests(got.append)
    try:
        body = b"\x80" * 100_000  # bigger than a pipe holds: read whole all the same
        data = b"".join([encode({"kind": Control.STOP}), encode({"kind": Control.FLUSH}),
                         encode({"kind": Control.REQUEST, "op": "run", "id": 3}, body),
                         encode({"kind": Control.RELEASE})])
        writer = threading.Thread(target=os.write, args=(w, data))
        writer.start()
        watch_lifeline(r, stop, release, flushed.set)  # returns at release
        writer.join()
        assert stop.is_set() and release.is_set() and flushed.wait(10)
        assert len(got) == 1 and got[0]["op"] == "run" and got[0]["id"] == 3 and got[0]["blob"] == body
    finally:
        take_requests(None)
        os.close(r)
        os.close(w)
