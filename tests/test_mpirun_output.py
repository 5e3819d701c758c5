"""mpirun's own output: its tagged rank lines reassembled, and the rank its abort notice names."""

from __future__ import annotations

from phalanx.executors.mpirun import TagOutputRouter


def test_fragments_of_one_line_are_reassembled_per_rank():
    route = TagOutputRouter()
    assert route(b"[1,0]<stdout>:a[1,0]<stdout>: [1,1]<stdout>:x\n") == [(1, b"x\n")]
    assert route(b"[1,0]<stdout>:b[1,0]<stdout>:\n") == [(0, b"a b\n")]


def test_the_rank_mpirun_noticed_ending_the_job_is_known_whatever_order_ranks_vanished_in():
    """The rank killed first is the cause; mpirun ends the others and names only that one."""
    route = TagOutputRouter()
    assert route.noticed is None
    route(b"[1,2]<stdout>:still computing\n")
    out = route(b"mpirun noticed that process rank 1 with PID 4242 on node px-h1 exited on signal 9 (Killed).\n")
    assert out and out[0][0] is None  # mpirun's own line, not a rank's
    assert route.noticed == 1
    route(b"mpirun noticed that process rank 2 with PID 4243 on node px-h1 exited on signal 9 (Killed).\n")
    assert route.noticed == 1  # the first notice names the cause


def test_a_rank_that_prints_the_notice_text_is_not_taken_for_mpirun():
    route = TagOutputRouter()
    route(b"[1,0]<stdout>:mpirun noticed that process rank 3 with PID 1 on node x exited on signal 9.\n")
    assert route.noticed is None
