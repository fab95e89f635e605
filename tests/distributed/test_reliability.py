"""Nothing silent, nothing hangs: one run per output folder, one message per failure, a frozen rank named, Ctrl-C
and a killed launcher saving like SIGTERM, a busy port named.

Ranks are started as plain processes with the launcher's variables (as tests/distributed/test_failures.py does) where a
launcher would hide what the ranks do; the 10-minute guard is a hang detector, not a speed requirement."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.trainer_runs import ROOT, TRAIN, child_env, deepspeed_launcher, launch_port

HANG_GUARD_S = 600
COMMON = ["--seq_len", "64", "--lr", "3e-3"]


def start_ranks(world: int, args: list, env: dict = None) -> list[subprocess.Popen]:
    port = str(launch_port())
    return [subprocess.Popen([sys.executable, TRAIN] + COMMON + args, cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env=child_env() | (env or {}) | dict(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
            for r in range(world)]


def wait_for_steps(out, n: int, procs) -> None:
    path = out / "metrics.jsonl"
    while not (path.exists() and len(path.read_text().splitlines()) >= n):
        assert all(p.poll() is None for p in procs), procs[0].communicate()[1][-3000:]
        time.sleep(0.2)


def finish(procs) -> list[tuple[int, str]]:
    texts = ["".join(p.communicate(timeout=HANG_GUARD_S)) for p in procs]
    return [(p.returncode, text) for p, text in zip(procs, texts)]


def test_one_run_per_output_folder(tmp_path):
    """A live run's lock stops a second run before any work, naming the holder; a lock left by a process that
    died is taken over with a warning."""
    from ulysses_train.train.checkpoints.run_lock import RunLock

    out = tmp_path / "run"
    holder = RunLock(str(out))
    holder.acquire()  # this test process plays the live run
    proc = subprocess.run([sys.executable, TRAIN, "--steps", "1", "--output_dir", str(out)] + COMMON, cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"is in use by another run (pid {os.getpid()} on {socket.gethostname()}" in proc.stderr
    assert "Traceback" not in proc.stderr and not (out / "metrics.jsonl").exists()
    os.close(holder.fd)  # the holder dies without cleaning up: its holder file stays, the kernel drops the lock
    proc = subprocess.run([sys.executable, TRAIN, "--steps", "1", "--output_dir", str(out)] + COMMON, cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"warning: took over {out / '.lock'} from a run that did not end cleanly (pid {os.getpid()}" in proc.stdout


def test_an_unexpected_error_is_one_line_naming_the_rank(tmp_path):
    """rank 1 raises at step 2: one line names it and its error, the traceback goes to a file (and to the terminal
    with --debug), rank 0's "connection closed" stays quiet, every rank exits 3."""
    results = finish(start_ranks(2, ["--steps", "4", "--output_dir", str(tmp_path)],
                                 env={"ULYSSES_TRAIN_FAULT": "raise:2:1"}))
    assert [code for code, _ in results] == [3, 3], results
    rank1 = results[1][1]
    assert "error: rank 1 failed: RuntimeError: injected failure on rank 1 at step 2" in rank1
    assert "Traceback" not in rank1 and "Traceback" not in results[0][1]
    assert "Connection closed" not in results[0][1] and "error:" not in results[0][1]
    assert "injected failure on rank 1" in (tmp_path / "errors" / "rank_1.txt").read_text()


def test_a_frozen_rank_is_named_and_every_rank_stops(tmp_path):
    """SIGSTOP on rank 1 mid-run: rank 0 names it within --dist_timeout and exits 3 (no 30-minute hang)."""
    procs = start_ranks(2, ["--steps", "100000", "--dist_timeout", "5", "--output_dir", str(tmp_path)])
    wait_for_steps(tmp_path, 2, procs)
    procs[1].send_signal(signal.SIGSTOP)
    code, text = procs[0].wait(timeout=HANG_GUARD_S), procs[0].communicate()[1]
    procs[1].kill()
    procs[1].communicate()
    assert code == 3, text[-2000:]
    assert "rank 1 has not answered for 5 s" in text and "--dist_timeout" in text


def test_ctrl_c_saves_like_sigterm_and_a_second_one_stops_at_once(tmp_path):
    """The second run is held in its save (ULYSSES_TRAIN_FAULT=hold_in_save) until the second Ctrl-C arrives: it
    used to finish the save and exit 0 first when the machine was quick."""
    procs = start_ranks(2, ["--steps", "100000", "--output_dir", str(tmp_path / "once")])
    wait_for_steps(tmp_path / "once", 2, procs)
    for p in procs:
        p.send_signal(signal.SIGINT)
    results = finish(procs)
    assert [code for code, _ in results] == [0, 0], results
    text = results[0][1]
    assert "SIGINT: finishing the current step and saving; Ctrl-C again stops at once" in text
    assert "SIGINT received: saved step" in text and "Traceback" not in text + results[1][1]
    assert (tmp_path / "once" / "checkpoints" / "latest").exists()

    procs = start_ranks(2, ["--steps", "100000", "--output_dir", str(tmp_path / "twice")],
                        env={"ULYSSES_TRAIN_FAULT": "hold_in_save"})
    wait_for_steps(tmp_path / "twice", 2, procs)
    for p in procs:
        p.send_signal(signal.SIGINT)
    seen = ""
    while "Ctrl-C again stops at once" not in seen:  # the first one was handled: now the second
        seen += procs[0].stderr.readline()
    for p in procs:
        p.send_signal(signal.SIGINT)
    results = finish(procs)
    assert [code for code, _ in results] == [130, 130], results
    assert "stopped: SIGINT (nothing to save)" in results[0][1] and "Traceback" not in results[0][1]
    assert not (tmp_path / "twice" / "checkpoints" / "latest").exists()  # the held save never completed


def test_a_second_ctrl_c_during_the_first_ones_message_stops_at_once(monkeypatch):
    """CPython runs a pending signal's handler at the next bytecode, also inside a running handler. The first
    Ctrl-C's handler wrote its message before setting the flag: a second Ctrl-C right after the message (a user's
    double press; the test above under load) ran as another first one, and the run held on in its save. The flag
    is now set before the message, so the nested second one stops at once."""
    from ulysses_train.train.process.faults import Interrupted, StopFlag

    stop = StopFlag()
    try:
        stop.armed = True
        writes = []

        def write_then_second_signal(fd, data):
            writes.append(data)
            if len(writes) == 1:  # the second Ctrl-C lands while the first handler is writing
                stop._on_signal(signal.SIGINT, None)
            return len(data)

        monkeypatch.setenv("RANK", "0")
        monkeypatch.setattr(os, "write", write_then_second_signal)
        with pytest.raises(Interrupted):
            stop._on_signal(signal.SIGINT, None)
        assert stop.requested and len(writes) == 1 and b"Ctrl-C again stops at once" in writes[0]
    finally:
        stop.restore()


def test_a_ctrl_c_after_the_watchdog_saw_the_launcher_go_is_the_first_one(monkeypatch, capfd):
    """Under DeepSpeed's launcher a Ctrl-C also ends the `deepspeed` command; a rank whose watchdog saw it gone
    before the rank ran its SIGINT handler took that Ctrl-C for a second one: `stopped: SIGINT (nothing to save)`,
    exit 130, the finished step lost. A second Ctrl-C is now a second SIGINT."""
    from ulysses_train.train.process.faults import Interrupted, StopFlag

    stop = StopFlag()
    try:
        stop.armed = True
        monkeypatch.setenv("RANK", "0")
        stop.request("the launcher was stopped")  # the watchdog's thread
        stop._on_signal(signal.SIGINT, None)
        stop._on_signal(signal.SIGTERM, None)  # DeepSpeed's launch.py passes it on
        assert stop.requested and stop.reason == "SIGINT received"
        assert capfd.readouterr().err.count("SIGINT: finishing the current step and saving; Ctrl-C again") == 1
        with pytest.raises(Interrupted):
            stop._on_signal(signal.SIGINT, None)
    finally:
        stop.restore()


def _as_at_a_terminal() -> None:
    """A command typed at a terminal starts with Ctrl-C's default action. A test suite run in a background job
    (`nohup ... &`, no job control) has SIGINT ignored, and every process it starts inherits that: the `deepspeed`
    command (which sets no handler of its own) would then live through the Ctrl-C, its ranks would wait for it to
    go, and DeepSpeed's launch.py would kill them 30 s later."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _readable(text: str) -> str:
    """A run's log for an assertion message: without c10d's C++ stack frames, its last 6000 characters."""
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("frame #"))[-6000:]


def _last_lines_until(stream, text: str) -> str:
    """What `stream` gives up to the line holding `text` (the run's log as it comes)."""
    seen = ""
    while text not in seen:
        line = stream.readline()
        assert line, seen[-3000:]  # the run ended first
        seen += line
    return seen


def test_ctrl_c_and_sigterm_under_the_deepspeed_launcher_save_the_step_once(tmp_path):
    """A Ctrl-C at the terminal (SIGINT to the `deepspeed` command, its launch.py and the ranks: their process
    group) and SIGTERM to them all (a scheduler, `kill -- -PGID`): every rank finishes the step under way (3), saves
    it once, and the next launch resumes from it. The ranks are held at step 3 as inside a long kernel
    (ULYSSES_TRAIN_FAULT=busy_at:3: their signal handlers run once the watchdog has seen the `deepspeed` command
    go), the order that lost the step to "nothing to save". The `deepspeed` command itself dies of the signal (its
    runner has no handler on one node: DeepSpeed's, not ours)."""
    from tests.trainer_runs import metrics, run

    for signum in (signal.SIGINT, signal.SIGTERM):
        out, name = tmp_path / signum.name, signum.name
        proc = subprocess.Popen(deepspeed_launcher(2) + [TRAIN, "--steps", "6", "--dist_timeout", "20",
                                                        "--output_dir", str(out)] + COMMON,
                                cwd=ROOT, env=child_env() | {"ULYSSES_TRAIN_FAULT": "busy_at:3"},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                preexec_fn=_as_at_a_terminal)
        seen = _last_lines_until(proc.stdout, "busy at step 3")
        assert [r["step"] for r in metrics(out)] == [1, 2]  # steps 1 and 2 finished, 3 under way
        os.killpg(proc.pid, signum)
        text = seen + proc.communicate(timeout=HANG_GUARD_S)[0]
        (tmp_path / f"{name}.log").write_text(text)  # the whole log: c10d's stack frames crowd the messages' tail
        assert proc.returncode == -signum, _readable(text)
        assert f"{name}: finishing the current step and saving" in text, text[-3000:]
        assert f"{name} received: saved step 3, exiting" in text and "nothing to save" not in text, text[-3000:]
        assert text.count("saved checkpoint ") == 1 and "error:" not in text, text[-3000:]
        assert [r["step"] for r in metrics(out)] == [1, 2, 3]
        saved = out / "checkpoints" / "step_00000003"
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_00000003"]
        assert (saved / "COMPLETE").exists() and sorted(p.name for p in (saved / "rng").iterdir()) == \
            ["rank_0.pt", "rank_1.pt"]  # every rank saved its part
    resumed = run(deepspeed_launcher(2), COMMON + ["--steps", "6", "--dist_timeout", "20", "--resume", "auto"],
                  tmp_path / "SIGINT")
    assert "at step 3" in resumed.stdout and [r["step"] for r in metrics(tmp_path / "SIGINT")] == [1, 2, 3, 4, 5, 6]


def test_killing_the_deepspeed_command_stops_and_saves(tmp_path):
    """`kill <pid>` of the `deepspeed` command the user started: its launch.py and the ranks would train on,
    orphaned; the ranks notice, save after the current step and exit 0."""
    proc = subprocess.Popen(deepspeed_launcher(2) + [TRAIN, "--steps", "100000", "--dist_timeout", "20",
                                                    "--output_dir", str(tmp_path)] + COMMON,
                            cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    wait_for_steps(tmp_path, 2, [proc])
    proc.send_signal(signal.SIGTERM)  # the deepspeed command only
    out, _ = proc.communicate(timeout=HANG_GUARD_S)  # ends when launch.py and the ranks have closed the pipe
    assert "the launcher was stopped: saved step" in out, out[-3000:]
    assert (tmp_path / "checkpoints" / "latest").exists()


def _agree_on_one_ranks_stop(rank, world):
    import torch

    from ulysses_train.train.process.faults import StopFlag

    stop = StopFlag()
    try:
        if rank == 1:  # only rank 1's watchdog saw the launcher go
            stop.request("the launcher was stopped")
        return stop.agreed(torch.device("cpu")), stop.requested, stop.reason
    finally:
        stop.restore()


def test_every_rank_learns_why_another_rank_stopped():
    """The test above failed under load with rank 0 logging "None: saved step 3": rank 1's watchdog noticed the
    stopped launcher first, and rank 0 learned of the stop only through the agreement, without a reason of its own.
    The agreement now carries the stopping rank's reason to every rank."""
    from tests.multiprocess import run_distributed

    assert run_distributed(_agree_on_one_ranks_stop, 2) == [(True, True, "the launcher was stopped")] * 2


def test_a_busy_port_names_the_flag(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        env = child_env() | dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(busy.getsockname()[1]))
        proc = subprocess.run([sys.executable, TRAIN, "--steps", "1", "--output_dir", str(tmp_path)] + COMMON,
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "is in use (another run on this host?)" in proc.stderr and "--master_port" in proc.stderr


def launch_like_deepspeed(world: int, args: list, rank0_late_s: float) -> list[tuple[int, str]]:
    """The ranks as DeepSpeed's launch.py runs them, and like it (and torchrun) every rank ended with SIGTERM as
    soon as one exits non-zero; rank 0 starts last, once another rank has exited or `rank0_late_s` later (a
    loaded machine can leave it that far behind)."""
    port = str(launch_port())
    procs = {}
    for rank in reversed(range(world)):
        if rank == 0:
            late = time.monotonic() + rank0_late_s
            while time.monotonic() < late and all(p.poll() is None for p in procs.values()):
                time.sleep(0.02)
        procs[rank] = subprocess.Popen([sys.executable, TRAIN] + args, cwd=ROOT, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True,
                                       env=child_env() | dict(RANK=str(rank), WORLD_SIZE=str(world),
                                                         LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                                                         MASTER_PORT=port))
    procs = [procs[r] for r in range(world)]
    deadline = time.monotonic() + HANG_GUARD_S
    while not any(p.poll() not in (None, 0) for p in procs) and not all(p.poll() == 0 for p in procs):
        assert time.monotonic() < deadline, "hang"
        time.sleep(0.02)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    return [(p.wait(timeout=HANG_GUARD_S), p.stdout.read()) for p in procs]


def test_a_settings_error_is_printed_once_before_any_rank_exits(tmp_path):
    """1 run in 5 with a settings error exited 2 with nothing printed: rank 1 exited at once and the launcher
    killed rank 0 before it printed; and each rank printed argparse's 40-line usage. Now rank 0 prints one line,
    naming the --config file and the key, and the others exit only once it has. Repeated, rank 0 starting after
    rank 1 has exited (or 4 s late), which lost the message every time."""
    config = tmp_path / "run.yaml"
    config.write_text("seq_len: many\n")
    for args, message in ((["--steps", "0"], "error: --steps must be positive, got 0"),
                          (["--steps", "0"], "error: --steps must be positive, got 0"),
                          (["--config", str(config)], f"error: --config {config}: seq_len: invalid int value: 'many'")):
        results = launch_like_deepspeed(2, args + ["--output_dir", str(tmp_path / "out")], rank0_late_s=4.0)
        text = "".join(out for _, out in results)
        assert text.count(message) == 1 and message in results[0][1], results
        assert "usage:" not in text and "Traceback" not in text, results
        assert results[1][0] in (2, -signal.SIGTERM) and results[0][0] == 2, results


def test_a_rank_stays_quiet_only_about_a_collective_that_lost_its_peer():
    """`Connection refused` anywhere in an exception was taken for a peer's failure, so rank 0's own MLflow
    ConnectionRefusedError went unreported (exit 3, nothing printed). A peer's failure is now recognised by where
    the error came from, a collective (c10d's error types, torch.distributed's code, the backend's own message), and
    by what it says. Real collectives losing their peer: test_an_unexpected_error_is_one_line_naming_the_rank."""
    import torch.distributed as dist

    from ulysses_train.train.cli import _peer_failure

    def raised(make, *args):
        try:
            make(*args)
        except BaseException as e:  # noqa: BLE001
            return e
        raise AssertionError("nothing raised")

    def throw(error):
        raise error

    # gloo's message after an async collective's Work.wait(): the backend's source file comes first
    assert _peer_failure(raised(throw, RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
                                                    "Connection closed by peer [127.0.0.1]:4321")))
    assert _peer_failure(raised(throw, dist.DistBackendError("NCCL communicator was aborted on rank 1")))
    # the same words from this rank's own code
    assert not _peer_failure(raised(throw, ConnectionRefusedError(111, "Connection refused")))
    assert not _peer_failure(raised(throw, RuntimeError("API request to http://127.0.0.1:9/api/2.0/mlflow failed: "
                                                        "[Errno 111] Connection refused")))
    assert not _peer_failure(raised(throw, RuntimeError("[enforce fail at inline_container.cc:672] . unexpected "
                                                        "pos 64 vs 0")))
