"""A run's files are unpickled (by its workers, by ``Run.load``): never from a folder another user
could write to. Tested with a real second local user (created here; needs root)."""
import os
import pwd
import stat
import subprocess
import textwrap

import pytest

import ddp_notebook
from ddp_notebook.core.rundir import RunDir, check_private_folder
from ddp_notebook.errors import UnsafeRunDirError

import faults

# No module-wide mark: the tests that start processes (runs, the second user's) say so; the
# checks made before anything starts are unit tests (conftest.py marks them).

OTHER = "ddpnbother"


@pytest.fixture(scope="module")
def other_user():
    if os.geteuid() != 0:
        pytest.skip("creating a second local user needs root")
    try:
        pwd.getpwnam(OTHER)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER], check=True)
    return pwd.getpwnam(OTHER)


def shared(tmp_path, mode, owner=None):
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, mode)
    if owner is not None:
        os.chown(folder, owner.pw_uid, owner.pw_gid)
    return folder


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_runs_folder_others_can_write_to_is_refused_before_anything_starts(tmp_path, mode):
    folder = shared(tmp_path, mode)
    with pytest.raises(UnsafeRunDirError, match=r"is writable by other users \(mode 7\d\d\), so another user could "
                                                r"replace a run's files and have your workers load their code"):
        ddp_notebook.launch(lambda ctx: ctx.rank, devices="cpu*2", run_root=str(folder / "runs"))
    assert list(folder.iterdir()) == []


@pytest.mark.processes
def test_a_runs_folder_of_another_user_is_refused(tmp_path, other_user):
    folder = shared(tmp_path, 0o755, owner=other_user)
    with pytest.raises(UnsafeRunDirError, match=f"belongs to {OTHER}"):
        ddp_notebook.launch(lambda ctx: ctx.rank, devices="cpu*2", run_root=str(folder))


@pytest.mark.processes
def test_a_sticky_shared_folder_like_tmp_is_fine_and_runs_are_owner_only(tmp_path):
    folder = shared(tmp_path, 0o1777)
    run = ddp_notebook.launch(faults.saves_a_checkpoint, devices="cpu*2", run_root=str(folder / "runs"))
    assert run.wait(timeout=120) == 0
    # Every file of a run is its owner's alone, every folder too (the event log, the checkpoints and
    # the pointers to the latest and best among them included).
    modes = {os.path.relpath(os.path.join(d, n), run.run_dir): stat.S_IMODE(os.stat(os.path.join(d, n)).st_mode)
             for d, dirs, files in os.walk(run.run_dir) for n in dirs + files}
    assert {"events.jsonl", RunDir.RESULT, "checkpoints", "checkpoints/latest", "checkpoints/best"} <= set(modes)
    assert {p: m for p, m in modes.items() if m != (0o700 if os.path.isdir(os.path.join(run.run_dir, p)) else 0o600)} \
        == {}
    assert stat.S_IMODE(os.stat(run.run_dir).st_mode) == 0o700


ATTACK = textwrap.dedent("""
    import os, sys, time
    # The other user watches the shared folder and swaps each new run directory for its own.
    root, marker = sys.argv[1], sys.argv[2]
    end = time.monotonic() + 20
    while time.monotonic() < end:
        for name in os.listdir(root):
            if name.startswith("2") and not name.endswith(".mine"):
                try:
                    os.rename(os.path.join(root, name), os.path.join(root, name + ".mine"))
                    os.mkdir(os.path.join(root, name))
                    with open(os.path.join(root, name, "payload.pkl"), "wb") as f:
                        f.write(b"cos\\nsystem\\n(S'touch " + marker.encode() + b"'\\ntR.")
                except OSError:
                    pass
        time.sleep(0.001)
""")


@pytest.mark.processes
def test_the_swap_attack_of_a_second_user_is_refused_with_a_clear_error(tmp_path, other_user):
    folder = shared(tmp_path, 0o777)  # what the attack needs: a runs folder the other user can write to
    marker = tmp_path / "owned"
    os.chmod(tmp_path, 0o755)
    attacker = subprocess.Popen(["setpriv", f"--reuid={other_user.pw_uid}", f"--regid={other_user.pw_gid}",
                                 "--clear-groups", "python3", "-c", ATTACK, str(folder), str(marker)])
    try:
        for _ in range(5):
            with pytest.raises(UnsafeRunDirError):
                ddp_notebook.launch(lambda ctx: ctx.rank, devices="cpu*2", run_root=str(folder))
    finally:
        attacker.kill()
        attacker.wait()
    assert not marker.exists() and list(folder.iterdir()) == []


@pytest.mark.processes
def test_run_load_refuses_a_run_directory_others_can_write_to(tmp_path):
    run = ddp_notebook.launch(lambda ctx: "secret", devices="cpu:0", run_root=str(tmp_path / "runs"))
    assert run.wait(timeout=120) == "secret"
    os.chmod(run.run_dir, 0o777)
    with pytest.raises(UnsafeRunDirError, match="the run directory"):
        ddp_notebook.Run.load(run.run_dir)


@pytest.mark.processes
def test_resume_from_refuses_a_checkpoint_another_user_could_have_written(tmp_path, other_user):
    import torch

    from ddp_notebook.core.errors import NoCheckpointError
    from ddp_notebook.lifecycle.resume import checkpoint_to_resume

    os.chmod(tmp_path, 0o700)
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    torch.save({"model": {}}, folder / "epoch-0000.pt")
    (folder / "latest").write_text("epoch-0000.pt")
    assert checkpoint_to_resume(str(tmp_path)) == str(folder / "epoch-0000.pt")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(NoCheckpointError, match="is not a checkpoint"):
        checkpoint_to_resume(str(tmp_path / "notes.txt"))
    # a file of another user's, even in a folder of mine
    theirs = tmp_path / "theirs.pt"
    torch.save({"model": {}}, theirs)
    os.chown(theirs, other_user.pw_uid, other_user.pw_gid)
    with pytest.raises(UnsafeRunDirError, match="belongs to"):
        checkpoint_to_resume(str(theirs))
    # a link in a folder of mine to a file in a folder others can write to
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    torch.save({"model": {}}, open_folder / "epoch-0000.pt")
    os.chmod(open_folder, 0o777)
    (tmp_path / "link.pt").symlink_to(open_folder / "epoch-0000.pt")
    with pytest.raises(UnsafeRunDirError, match="writable by other users"):
        checkpoint_to_resume(str(tmp_path / "link.pt"))
    os.chmod(folder, 0o777)
    with pytest.raises(UnsafeRunDirError, match="writable by other users"):
        checkpoint_to_resume(str(tmp_path))


@pytest.mark.processes
def test_a_kept_call_of_another_user_is_not_read(tmp_path, other_user):
    from ddp_notebook.core.rundir import RunDir

    os.chmod(tmp_path, 0o700)
    directory = RunDir(str(tmp_path))
    directory.write_private(RunDir.CALL, b"planted")
    os.chown(directory.join(RunDir.CALL), other_user.pw_uid, other_user.pw_gid)
    with pytest.raises(UnsafeRunDirError, match="belongs to"):
        directory.read_private(RunDir.CALL)
    os.unlink(directory.join(RunDir.CALL))
    os.symlink("/etc/hostname", directory.join(RunDir.CALL))
    with pytest.raises(UnsafeRunDirError, match="never writes a link there"):
        directory.read_private(RunDir.CALL)


def test_check_private_folder_accepts_this_users_own_folders(tmp_path):
    os.chmod(tmp_path, 0o700)
    check_private_folder(str(tmp_path / "not" / "yet" / "there"))


@pytest.mark.processes
def test_the_call_travels_over_the_control_pipe_and_never_lies_in_a_file(tmp_path):
    data = os.urandom(4 << 20)  # far more than a pipe holds at once
    run = ddp_notebook.launch(lambda ctx, blob: len(blob), devices="cpu*2", args=(data,),
                              run_root=str(tmp_path / "runs"))
    assert not os.path.exists(os.path.join(run.run_dir, RunDir.PAYLOAD))
    assert run.wait(timeout=120) == len(data)
    # Only the notebook reads a .pkl of the run (Run.load), after checking the folder is private;
    # the call kept for a retry after a restart is owner-only, like the result.
    assert sorted(n for n in os.listdir(run.run_dir) if n.endswith(".pkl")) == [RunDir.CALL, RunDir.RESULT]
    assert all(os.stat(os.path.join(run.run_dir, n)).st_mode & 0o777 == 0o600 for n in (RunDir.CALL, RunDir.RESULT))


@pytest.mark.processes
def test_a_stop_asked_while_a_large_call_is_still_being_sent_is_honoured(tmp_path):
    from ddp_notebook.executors.local import forkserver

    forkserver.disable()  # fresh interpreters: they read their assignment only once they imported torch
    try:
        run = ddp_notebook.launch(faults.wait_for_stop_carrying, devices="cpu*2", run_root=str(tmp_path / "runs"),
                                  kwargs=dict(ballast=os.urandom(4 << 20)))
        run.stop(grace=30)
        try:
            run.wait(timeout=120)
        except ddp_notebook.errors.RunStoppedError:
            pass
        assert run.status == "stopped" and all(w.status == "stopped" for w in run.workers)
    finally:
        forkserver.enable()
