import os

import pytest

from ddp_notebook.lifecycle.stall import is_waiting_in_collective, main_thread_stack, pick_stalled, torch_dir

pytestmark = pytest.mark.unit

TORCH = torch_dir()
DUMP = f'''Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000002 (most recent call first):
  File "{TORCH}/distributed/distributed_c10d.py", line 2100 in all_reduce
  File "/home/me/train.py", line 12 in train
'''


def test_main_thread_is_found_by_ident():
    frames = main_thread_stack(DUMP, 0x7F0000000002)
    assert frames[0][2] == "all_reduce" and frames[1] == ("/home/me/train.py", 12, "train")
    assert main_thread_stack(DUMP, 0x7F0000000001)[0][2] == "wait"
    assert main_thread_stack("", None) == []


def test_waiting_in_collective():
    assert is_waiting_in_collective(main_thread_stack(DUMP, 0x7F0000000002), TORCH)
    assert not is_waiting_in_collective([("/home/me/train.py", 3, "train")], TORCH)
    assert not is_waiting_in_collective([(os.path.join(TORCH, "utils", "data", "dataloader.py"), 1, "next")], TORCH)
    assert is_waiting_in_collective([(os.path.join(TORCH, "autograd", "graph.py"), 1, "_engine_run_backward")], TORCH)


def test_pick_stalled():
    assert pick_stalled({0: True, 1: False, 2: True}, {0: 5, 1: 4, 2: 5}) == [1]
    assert pick_stalled({0: True, 1: True}, {0: 5, 1: 4}) == [1]
    assert pick_stalled({0: False, 1: False}, {0: 3, 1: None}) == [1]
    assert pick_stalled({0: False}, {}) == [0]
