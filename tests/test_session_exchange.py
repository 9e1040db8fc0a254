"""The parts of a session request that are plain Python: output shown in batches and bounded,
interrupts counted instead of raised, what a cell takes from the notebook, and a failed
request's failures and its one error."""
from __future__ import annotations

import signal
import threading
import time

import pytest

from ddp_notebook.core.bounds import LINE_CHARS
from ddp_notebook.core.failures import FailureKind
from ddp_notebook.lifecycle.cell_names import cell_binds, notebook_names, packed, pickled_names
from ddp_notebook.lifecycle.session_exchange import SHOWN_DISPLAYS, CellOutput, Gathered, interrupts_counted
from ddp_notebook.lifecycle.session_failures import cell_error, failures_of, push_hint
from ddp_notebook.transfer import pickling

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def sigint_handler_put_back():
    """An exchange that counted a press holds the next ones for a second (``hold_presses``): the
    next test starts with the handler it had."""
    original = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, original)


def _writes(**bounds):
    writes = []
    return writes, CellOutput(lambda stream, text: writes.append((stream, text)), **bounds)


def test_output_is_written_once_per_stream_per_flush_each_line_named_by_its_rank():
    writes, out = _writes()
    for i in range(500):
        out.add(i % 2, "stdout", f"line {i}\n")
    out.add(1, "stderr", "warn\n")
    out.flush()
    assert [w[0] for w in writes] == ["stdout", "stderr"]
    assert writes[0][1].count("\n") == 500 and writes[0][1].startswith("[rank 0] line 0\n[rank 1] line 1\n")
    assert writes[1][1] == "[rank 1] warn\n"


def test_a_line_without_its_end_shows_at_once_and_goes_on_where_it_stopped():
    writes, out = _writes()
    out.add(0, "stdout", "epoch 1 ")  # print(..., end='')
    out.flush()
    assert writes == [("stdout", "[rank 0] epoch 1 ")]
    out.add(0, "stdout", "loss 0.5\n")
    out.flush()
    assert writes[-1] == ("stdout", "loss 0.5\n")
    out.add(0, "stdout", "a")
    out.add(1, "stdout", "b\n")  # another rank's line between the pieces of rank 0's: each stays whole
    out.add(0, "stdout", "c")
    out.close()  # a line still open is ended: what comes next starts on a line of its own
    assert "".join(t for _, t in writes[2:]) == "[rank 1] b\n[rank 0] ac\n"


def test_the_pieces_of_two_ranks_prints_never_split_each_others_lines():
    writes, out = _writes()
    for word in ("step", " ", "1", " ", "loss", " ", "0.5", "\n"):  # print('step', 1, 'loss', 0.5), as it writes
        out.add(0, "stdout", word)
        out.add(1, "stdout", word)
    out.close()
    assert "".join(t for _, t in writes) == "[rank 0] step 1 loss 0.5\n[rank 1] step 1 loss 0.5\n"


def test_a_carriage_return_redraws_the_line_with_its_rank_named_again():
    writes, out = _writes()
    for pct in (10, 50, 100):
        out.add(1, "stderr", f"\r{pct}%|###")
        out.flush()
    out.add(1, "stderr", "\n")
    out.close()
    text = "".join(t for _, t in writes)
    assert text == "[rank 1] 10%|###\r[rank 1] 50%|###\r[rank 1] 100%|###\n", text
    writes, out = _writes()
    out.add(0, "stdout", "a\r\nb\r\n")  # Windows line ends are line ends
    out.close()
    assert "".join(t for _, t in writes) == "[rank 0] a\n[rank 0] b\n"


def test_each_ranks_progress_bar_goes_on_below_the_others_at_a_pace_without_taking_its_lines():
    # tqdm on two ranks: each redraw of one rank's bar comes after the other's line, so it cannot
    # be drawn over; it goes on on a line of its own every REDRAW_EVERY seconds, and those lines do
    # not spend the lines a rank may show (its last lines still show).
    from ddp_notebook.lifecycle.session_exchange import REDRAW_EVERY

    now = [0.0]
    writes: dict[str, list[str]] = {"stdout": [], "stderr": []}
    out = CellOutput(lambda stream, text: writes[stream].append(text), ranks=2, lines=20, clock=lambda: now[0])
    for i in range(1200):  # 120 s of bars, flushed every 0.1 s
        out.add(0, "stderr", f"\rstep {i}")
        out.add(1, "stderr", f"\rstep {i}")
        out.flush()
        now[0] += 0.1
    for r in (0, 1):
        out.add(r, "stderr", "\n")
        out.add(r, "stdout", f"FINAL {r}\n")
    out.close()
    assert "".join(writes["stdout"]) == "[rank 0] FINAL 0\n[rank 1] FINAL 1\n", writes["stdout"]
    text = "".join(writes["stderr"])
    lines = text.replace("\r", "\n").splitlines()
    assert "not shown" not in text and text.count("\n") <= 2 * 120 / REDRAW_EVERY + 4, text.count("\n")
    assert lines[-2:] == ["[rank 0] step 1199", "[rank 1] step 1199"], lines[-4:]  # each bar's last state
    # A bar ended by its rank's newline after another rank's line adds no empty line.
    writes, out = _writes()
    for i in range(5):
        for r in (0, 1):
            out.add(r, "stdout", f"\r{i}/5")
        out.flush()
    for r in (0, 1):
        out.add(r, "stdout", "\n")
    out.close()
    shown = "".join(t for _, t in writes).replace("\r", "\n").splitlines()
    assert "[rank 0] " not in shown and "[rank 1] " not in shown, shown
    assert shown[-2:] == ["[rank 0] 4/5", "[rank 1] 4/5"], shown


def test_lines_two_ranks_go_on_after_each_others_still_count_and_a_held_redraw_stays_small():
    writes, out = _writes(lines=20, ranks=2)
    for _ in range(1000):  # print('.', end='', flush=True) on both ranks: each piece goes on after the other's
        out.add(0, "stdout", ".")
        out.add(1, "stdout", ".")
        out.flush()
    out.close()
    text = "".join(t for _, t in writes)
    assert text.count("\n") <= 24 and "more lines not shown" in text, text.count("\n")
    import time as _time
    now = [0.0]
    out = CellOutput(lambda stream, text: None, ranks=2, clock=lambda: now[0])
    out.add(0, "stderr", "\rbar")
    out.add(1, "stderr", "x\n")  # rank 0's bar is ended by rank 1's line, then redrawn (held) with huge pieces
    out.flush()
    out.add(0, "stderr", "\rbar")
    began = _time.monotonic()
    for _ in range(400):
        out.add(0, "stderr", "y" * 128 * 1024)
    assert _time.monotonic() - began < 2.0  # a held redraw longer than a line is shown, cut, not grown


def test_a_write_that_fails_loses_its_text_rather_than_write_it_twice():
    writes, failing = [], [True]

    def write(stream, text):
        if failing[0]:
            raise OSError("broken pipe")
        writes.append(text)

    out = CellOutput(write)
    out.add(0, "stdout", "a\n")
    with pytest.raises(OSError):
        out.flush()
    failing[0] = False
    out.add(0, "stdout", "b\n")
    out.close()
    assert "".join(writes) == "[rank 0] b\n"


def test_what_ranks_print_between_cells_never_waits_on_the_notebooks_streams(monkeypatch, caplog):
    import contextvars
    import io
    import sys
    import threading
    import time as _time

    from ddp_notebook.lifecycle.session_exchange import BetweenCells

    gate = threading.Event()

    class Stuck(io.StringIO):  # a terminal paused, a pipe nobody reads
        def write(self, text):
            gate.wait(30)
            return super().write(text)

    stuck = Stuck()
    monkeypatch.setattr(sys, "stdout", stuck)
    between = BetweenCells()
    between.ranks = 2
    began = _time.monotonic()
    for i in range(3 * BetweenCells.HELD):  # the run's thread hands text over and goes on
        between.add(i % 2, "stdout", f"bg {i}\n")
    assert _time.monotonic() - began < 5.0
    gate.set()
    between.close()
    shown = stuck.getvalue()
    assert "[rank 0] bg 0\n" in shown and "[rank 1] bg 1\n" in shown, shown[:200]

    class Broken(io.StringIO):
        def write(self, text):
            raise ValueError("I/O operation on closed file")

    monkeypatch.setattr(sys, "stdout", Broken())
    between = BetweenCells()
    between.follow(contextvars.copy_context())
    for i in range(5):
        between.add(0, "stdout", f"bg {i}\n")
    between.close()  # logged once, dropped; nothing raised on the run's thread
    assert sum("could not be shown" in r.getMessage() for r in caplog.records) == 1
    assert [t.name for t in threading.enumerate() if t.name == "ddp-session-output"] == []  # its thread ended


def test_output_past_its_bounds_is_counted_per_rank_and_said_at_the_end():
    # Each rank of the request has its share of the lines: one whose output came first (a flood,
    # sent in large events) does not hide the others'.
    writes, out = _writes(lines=4, ranks=2)
    out.add(1, "stdout", "c\nd\ne\n")
    out.add(0, "stdout", "a\nb\n")
    out.add(0, "stdout", "f\n")
    out.close()
    text = "".join(t for _, t in writes)
    assert text.splitlines() == ["[rank 1] c", "[rank 1] d", "[rank 0] a", "[rank 0] b",
                                 "[rank 0] 1 more line not shown (session.current_run.output(0) has them)",
                                 "[rank 1] 1 more line not shown (session.current_run.output(1) has them)"]
    writes, out = _writes(chars=100)
    out.add(0, "stdout", "x" * 60 + "\n" + "y" * 60 + "\n" + "z\n")
    out.close()
    text = "".join(t for _, t in writes)
    assert text.startswith("[rank 0] " + "x" * 60 + "\n[rank 0] yyy") and "…\n" in text, text
    assert "[rank 0] 1 more line not shown" in text, text


def test_a_line_without_end_is_cut_and_shown_not_held_forever_and_its_rest_is_not_a_line_of_its_own():
    writes, out = _writes()
    out.add(0, "stdout", "z" * (5 * LINE_CHARS))
    out.flush()
    assert len(writes) == 1 and len(writes[0][1]) < LINE_CHARS + 100, writes
    assert writes[0][1].endswith("… [cut at 2000 characters: the run's output has the whole line]"), writes
    out.add(0, "stdout", "z" * 100)
    out.add(0, "stdout", "zz\nnext\n")  # the end of the long line, then a line of its own
    out.close()
    assert "".join(t for _, t in writes[1:]) == "\n[rank 0] next\n", writes


def test_what_a_rank_displays_comes_after_what_it_printed_under_its_name():
    shown, writes = [], []
    out = CellOutput(lambda stream, text: writes.append(text), display=lambda d, m, **kw: shown.append((len(writes), d)))
    out.add(1, "stdout", "before")
    out.display(1, {"text/plain": "<HTML>", "text/html": "<b>x</b>"}, {})
    out.display(0, {"text/plain": "just text"}, {}, label="Out: ")
    out.close()
    assert "".join(writes) == "[rank 1] before\n[rank 1]\n[rank 0] Out: just text\n", writes
    assert shown == [(2, {"text/plain": "<HTML>", "text/html": "<b>x</b>"})]


def test_a_progress_bar_redrawn_thousands_of_times_keeps_the_bounds_and_the_lines_after_it():
    writes, out = _writes(chars=4000)
    for flush in range(50):
        for i in range(1000):  # a thousand redraws between two flushes: only the last is written
            out.add(0, "stderr", f"\r{flush * 1000 + i:>6}/50000 |{'#' * (flush // 5)}")
        out.flush()
    out.add(0, "stderr", "\n")
    out.add(0, "stdout", "TRAINING DONE\n")
    out.close()
    text = "".join(t for _, t in writes)
    assert len(text) < 4000 and "[rank 0] TRAINING DONE\n" in text, (len(text), text[-300:])
    assert text.count("\r[rank 0] ") == 49 and "cut at" not in text, text[:300]


def test_displays_past_their_bound_are_counted():
    shown, writes = [], []
    out = CellOutput(lambda stream, text: writes.append(text), display=lambda d, m, **kw: shown.append(d))
    for i in range(SHOWN_DISPLAYS + 5):
        out.display(i % 2, {"text/plain": str(i), "text/html": f"<b>{i}</b>"}, {})
    out.display(0, {"text/plain": "7", "text/html": "<b>7</b>"}, {}, label="Out: ")  # a value: always shown
    out.close()
    assert len(shown) == SHOWN_DISPLAYS + 1
    assert "[rank 0] 3 more displays not shown" in "".join(writes) and "[rank 1] 2 more displays" in "".join(writes)


def test_presses_inside_are_counted_and_a_quick_press_after_them_is_dropped(monkeypatch):
    from ddp_notebook.lifecycle import session_exchange

    # "Quick" is within PRESS_HELD of the last counted press: an hour here, so that a busy machine
    # never turns a dropped press into one re-sent to this process (it was: the xdist worker died).
    monkeypatch.setattr(session_exchange, "PRESS_HELD", 3600.0)
    with interrupts_counted() as presses:
        pass
    assert presses.count == 0
    with pytest.raises(KeyboardInterrupt):  # nothing pressed inside: a press after is a press
        signal.raise_signal(signal.SIGINT)
    original = signal.getsignal(signal.SIGINT)
    try:
        with interrupts_counted() as presses:
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
        assert presses.count == 2
        # The second press of a double press, landing as the interrupt is raised and shown: dropped.
        signal.raise_signal(signal.SIGINT)
        with interrupts_counted() as again:  # a request in that time: counted as ever, and held after it
            signal.raise_signal(signal.SIGINT)
        assert again.count == 1
        signal.raise_signal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, original)


def test_a_press_after_the_held_time_raises_and_puts_the_handler_back(monkeypatch):
    from ddp_notebook.lifecycle import session_exchange

    monkeypatch.setattr(session_exchange, "PRESS_HELD", 0.0)
    original = signal.getsignal(signal.SIGINT)
    with interrupts_counted():
        signal.raise_signal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):  # sent again once the handler returned: it lands in the sleep
        signal.raise_signal(signal.SIGINT)
        time.sleep(60)
    assert signal.getsignal(signal.SIGINT) is original


def test_a_cell_takes_the_notebooks_functions_classes_and_modules_it_names_not_what_it_binds():
    import math

    def f():
        pass

    namespace = {"f": f, "math": math, "data": [1], "t": f, "rank": f, "g": f}
    assert sorted(notebook_names("f(math.pi) + len(data) + rank", namespace)) == ["f", "math"]
    code = "t = torch.ones(1)\ndist.all_reduce(t)\ndef g(f):\n    return f\nimport math as m"
    assert notebook_names(code, namespace) == {}


def test_a_value_pushed_that_cannot_be_pickled_is_named_as_a_launch_names_its_argument():
    import threading

    from ddp_notebook.errors import NotPicklableError

    for by_value in (False, True):  # placed in shared memory, or pickled whole (ranks on engines)
        with pytest.raises(NotPicklableError, match=r"the value of 'guard'.*lock"):
            packed({"lr": 0.1, "guard": threading.Lock()}, by_value=by_value)
    data, placed = packed({"lr": 0.1})  # nothing large: nothing placed
    assert pickling.loads(data) == {"lr": 0.1} and placed.table == {"segments": [], "pieces": []}


def test_a_notebook_function_a_cell_uses_that_cannot_be_pickled_is_named_down_to_what_it_holds():
    import threading

    from ddp_notebook.errors import NotPicklableError

    guard = threading.Lock()

    def step():
        return guard

    with pytest.raises(NotPicklableError, match=r"guard.*lock"):
        pickled_names("step()", {"step": step})
    assert pickling.loads(pickled_names("len([])", {"step": step})) == {}  # not named: not sent


def _reply(op, rank, when=0.0, interrupted=False, message="boom", name=None):
    if op == "done":
        return {"op": "done", "value": pickling.dumps(rank * 10)}
    error = {"kind": "error", "phase": "run", "exc_type": "KeyboardInterrupt" if interrupted else "ValueError",
             "message": "" if interrupted else message, "traceback": "", "locals": [], "time": when}
    if name:
        error["name"] = name
    return {"op": "error", "error": error, "interrupted": interrupted}


def test_the_first_rank_to_raise_is_the_cause_and_those_interrupted_after_are_knock_ons():
    devices = ["cpu:0", "cpu:1", "cpu:2"]
    gathered = Gathered({0: _reply("error", 0, when=5.0, message="late"), 1: _reply("error", 1, when=1.0),
                         2: _reply("error", 2, interrupted=True)})
    failures, values, interrupted = failures_of(3, gathered, devices, {})
    error = cell_error(3, failures, values, world_size=3, interrupted=interrupted)
    assert [f.rank for f in error.failures] == [1, 0] and values == {} and error.interrupted == (2,)
    assert str(error) == ("cell 3 failed on rank 1 (cpu:1): ValueError: boom. Also raised: rank 0, ValueError: late. "
                          "Rank 2, still in it, was interrupted. The session goes on: its namespaces are kept."), str(error)
    assert not error.failures[1].consequence  # it raised on its own: "as well"


def test_a_rank_left_waiting_is_a_stall_the_cause_when_no_rank_raised():
    gathered = Gathered({1: _reply("done", 1)}, left_waiting={0: "all_reduce (<ddp cell 4>:2) for rank 1, which "
                                                               "finished the cell"}, waited={0: 5.0})
    failures, values, _ = failures_of(4, gathered, ["cpu:0", "cpu:1"], {0: 123})
    assert values == {1: 10}
    (failure,) = failures
    assert failure.kind == FailureKind.STALL and not failure.knock_on and failure.pid == 123
    error = cell_error(4, failures, values, 2, note="Formed again.", formed_again=True)
    assert str(error) == ("cell 4 failed on rank 0 (cpu:0): stalled: no progress for 5.0 s: waits in all_reduce "
                          "(<ddp cell 4>:2) for rank 1, which finished the cell. Formed again.")


def test_the_same_error_on_every_rank_is_said_once_and_a_notebook_name_gets_its_push():
    gathered = Gathered({r: _reply("error", r, when=r, message="name 'data' is not defined", name="data")
                         for r in (0, 1)})
    failures, values, _ = failures_of(None, gathered, ["cpu:0", "cpu:1"], {})
    hint = push_hint(gathered.replies, {"data": [1, 2]})
    assert hint == "'data' is the notebook's, not the ranks': session.push(data=data) sends it to every rank"
    assert push_hint(gathered.replies, {}) == ""
    # The cell binds 'data' itself (after using it): the notebook's was never to be sent.
    assert push_hint(gathered.replies, {"data": [1, 2]}, cell_binds("print(data)\ndata = 3")) == (
        "The cell uses 'data' before it defines it: a name the cell binds is the ranks' own, never the notebook's")
    error = cell_error(None, failures, values, 2, note=hint, what="pull 'data'")
    assert str(error).startswith("pull 'data' failed on every rank (cpu:0, cpu:1) the same way: ValueError")
    assert str(error).endswith("The session goes on: its namespaces are kept. " + hint + ".")


# ---- one request, on scripted answers: what the ranks answer is put in the answers queue as the
# run's supervisor puts it (rank, event, attachment), a rank's end as the session's subscription
# does ({"op": "exited"}); the verdict is the supervisor's (its own tests judge phases): here, the
# phase ends once every rank asked has answered.
class _Attached:
    def __init__(self, data):
        self.data = data


class _Record:
    def __init__(self):
        self.replied = []

    def mark_replied(self, rank, op):
        self.replied.append((rank, op))

    def mark_interrupting(self):
        pass

    def interrupt_asked(self):
        return False


class _Ranks:
    """A world of ranks that answer each request as ``answer(rank, message)`` says: a list of
    answers (dicts, or "exited")."""

    def __init__(self, answer):
        from ddp_notebook.lifecycle.session_exchange import Answers

        self.answers = Answers()
        self.answer = answer
        self.sent = []
        self.phase = None

    def begin(self, request_id, cell, ranks):
        from ddp_notebook.lifecycle.cell_phase import CellPhase

        self.phase = CellPhase(request_id, cell, ranks, 2, 0.0)
        return self.phase

    def tell(self, ranks, header, body, give_up):
        from ddp_notebook.core.events import SESSION_ROUTED

        message = pickling.joined(header, body, SESSION_ROUTED)
        self.sent.append((list(ranks), message))
        for rank in ranks:
            for reply in self.answer(rank, message):
                if reply == "exited":
                    self.answers.put((rank, {"op": "exited"}, None))
                    continue
                if reply.get("kind") == "output":  # what the rank wrote, an event of the run
                    self.answers.put((rank, reply, None))
                    continue
                head, rest = pickling.split(reply, SESSION_ROUTED)
                self.answers.put((rank, {"kind": "session", **head}, _Attached(rest) if rest else None))
                if reply["op"] in ("done", "error"):
                    self.phase.answered(rank, reply["op"], False, 0.0)
        if not self.phase.waiting():
            self.phase.outcome.ended.set()
        return []

    def exchange(self, ranks, cell=1, output=None):
        from ddp_notebook.lifecycle.session_exchange import Exchange

        return Exchange(self.tell, self.answers, self.begin, ranks, {"op": "run", "id": 7, "cell": cell, "code": "x"},
                        cell, _Record(), output or CellOutput(lambda s, t: None))


def test_only_this_cells_output_is_shown_an_earlier_cells_thread_is_the_runs_alone():
    shown = []

    def answer(rank, message):
        if message["op"] != "run":
            return []
        return [{"kind": "output", "cell": 1, "stream": "stdout", "text": "late from cell 1\n"},
                {"kind": "output", "cell": 2, "stream": "stdout", "text": "from cell 2\n"},
                {"op": "done", "id": message["id"]}]

    outcome = _Ranks(answer).exchange([0], cell=2, output=CellOutput(lambda s, t: shown.append(t))).run()
    assert outcome.replies[0]["op"] == "done" and "".join(shown) == "[rank 0] from cell 2\n"


def test_a_rank_that_ends_while_the_cell_runs_ends_the_request_and_a_run_that_ended_refuses_it():
    from ddp_notebook.lifecycle.session_exchange import RankGone

    ranks = _Ranks(lambda rank, m: (["exited"] if rank == 1 else [{"op": "done", "id": m["id"]}])
                   if m["op"] == "run" else [])
    with pytest.raises(RankGone):
        ranks.exchange([0, 1]).run()
    ranks.begin = lambda *request: None  # no run to judge it
    with pytest.raises(RankGone):
        ranks.exchange([0, 1]).run()


def test_presses_while_a_request_is_sent_whole_interrupt_its_cell_and_never_abandon_it():
    # A press while a large cell was on its way was taken as handled: the cell ran to its end, and
    # a second press gave the ranks up (the session formed again, its namespaces lost).
    original = signal.getsignal(signal.SIGINT)
    try:
        for presses in (1, 2):
            ranks = _Ranks(lambda rank, m: [])

            def sent_whole(to, header, body, give_up, n=presses):
                for _ in range(n):
                    signal.raise_signal(signal.SIGINT)
                return []

            def begin(request_id, cell, chosen, ranks=ranks):
                phase = _Ranks.begin(ranks, request_id, cell, chosen)
                phase.wake = lambda: phase.outcome.ended.set() if phase.asked else None  # the ranks leave at once
                never_asked = threading.Timer(30.0, phase.outcome.ended.set)  # (fails, rather than hangs, if so)
                never_asked.daemon = True
                never_asked.start()
                return phase

            ranks.tell = sent_whole
            exchange = ranks.exchange([0, 1])
            exchange.begin = begin
            outcome = exchange.run()
            assert ranks.phase.asked == 1 and not ranks.phase.abandon_asked, presses
            assert outcome.interrupted and not outcome.abandoned and not outcome.cut
    finally:
        signal.signal(signal.SIGINT, original)


def test_a_third_interrupt_while_a_request_is_sent_abandons_it_and_a_rank_not_reached_ends_it():
    from ddp_notebook.lifecycle.session_exchange import RankGone

    def pressed_thrice(ranks, header, body, give_up):
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
        assert not give_up()  # a double press: the frame on its way arrives whole, then the cell is interrupted
        signal.raise_signal(signal.SIGINT)
        assert give_up()
        return list(ranks)

    ranks = _Ranks(lambda rank, m: [])
    ranks.tell = pressed_thrice
    outcome = ranks.exchange([0, 1]).run()
    assert outcome.abandoned and outcome.interrupted and outcome.cut and ranks.phase.abandon_asked
    ranks.tell = lambda ranks, header, body, give_up: [1]  # rank 1's pipe is gone
    with pytest.raises(RankGone):
        ranks.exchange([0, 1]).run()
