"""The SLURM batch scripts under a real Slurm: slurmctld and slurmd on localhost, one node, CPU ranks with gloo.

The fixture installs Debian's Slurm and munge when they are missing (CI runs as root with Debian's registry), writes
a one-node slurm.conf on free ports, starts the daemons and stops them afterwards. If Slurm cannot be installed or
started, the tests are skipped with that reason (pytest -rs prints it); they never pass without running."""

import json
import os
import shutil
import socket
import subprocess
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
HANG_GUARD_S = 600


def _port():
    from ulysses_train.train.process.launcher import free_port

    return free_port()


def _ensure_installed():
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged")):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "Slurm is not installed and apt-get is not usable here"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "slurmctld", "slurmd",
                                               "slurm-client", "munge"]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
        if proc.returncode != 0:
            return f"could not install Slurm: {' '.join(cmd)}: {proc.stderr[-500:]}"
    return None


def _ensure_munge():
    if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
        return None
    if not os.path.exists("/etc/munge/munge.key"):
        subprocess.run(["mungekey", "-c"], capture_output=True)
    os.makedirs("/run/munge", exist_ok=True)
    subprocess.run("chown -R munge: /etc/munge /run/munge /var/lib/munge /var/log/munge", shell=True,
                   capture_output=True)
    subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", "munged"], capture_output=True)
    for _ in range(50):
        if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
            return None
        time.sleep(0.1)
    return "munged (Slurm's authentication) would not start"


def _stop_daemons(d):
    for pid_file in ("slurmd.pid", "slurmctld.pid"):
        try:
            os.kill(int((d / pid_file).read_text()), 15)
        except (OSError, ValueError):
            pass


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = _ensure_installed() or _ensure_munge()
    if reason:
        pytest.skip(reason)
    d = tmp_path_factory.mktemp("slurm")
    host = socket.gethostname().split(".")[0]
    (d / "state").mkdir()
    (d / "spool").mkdir()
    conf = d / "slurm.conf"
    conf.write_text(f"""ClusterName=ci
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_port()}
SlurmdPort={_port()}
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait=5
MinJobAge=600
SchedulerParameters=sched_interval=1
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=ci Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
    env = dict(os.environ, SLURM_CONF=str(conf))
    for daemon in ("slurmctld", "slurmd"):
        started = subprocess.run([daemon, "-f", str(conf)], env=env, capture_output=True, text=True)
        if started.returncode != 0:
            _stop_daemons(d)
            log = d / f"{daemon}.log"
            pytest.skip(f"{daemon} would not start here: {started.stderr[-500:]} "
                        f"{log.read_text()[-500:] if log.exists() else ''}")
    for _ in range(100):
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout
        if "idle" in out:
            break
        time.sleep(0.2)
    else:
        _stop_daemons(d)
        pytest.skip(f"slurmd did not come up: {(d / 'slurmd.log').read_text()[-1000:]}")
    yield env
    _stop_daemons(d)


def sbatch(env, options, script, train_args, out_dir, extra_env=None):
    base = dict(env, NPROC_PER_NODE="2", OUTPUT_DIR=str(out_dir / "out"), LOG_DIR=str(out_dir / "logs"),
                REPO_DIR=ROOT, PYTHONPATH=ROOT, **(extra_env or {}))
    cmd = ["sbatch", "--parsable", "--chdir", str(out_dir), "--export=ALL"] + options + [
        os.path.join(ROOT, "launch", "slurm", script)] + train_args
    return subprocess.run(cmd, env=base, check=True, capture_output=True, text=True).stdout.strip().split(";")[0]


def job_state(env, job):
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def wait_for(env, job, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")):
    deadline = time.time() + HANG_GUARD_S
    while time.time() < deadline:
        state = job_state(env, job)
        if state.get("JobState") in states:
            return state
        time.sleep(0.5)
    raise AssertionError(f"job {job} did not finish: {job_state(env, job)}")


def steps(out_dir):
    with open(out_dir / "out" / "metrics.jsonl") as f:
        return [json.loads(line)["step"] for line in f]


@pytest.mark.parametrize("script,options", [
    ("train_torchrun.sbatch", ["--nodes", "1", "--cpus-per-task", "2"]),
    ("train_deepspeed.sbatch", ["--nodes", "1", "--ntasks", "2", "--cpus-per-task", "1"]),
])
def test_batch_script_trains(slurm, script, options, tmp_path):
    job = sbatch(slurm, options, script, ["--steps", "4", "--seq_len", "256"], tmp_path)
    state = wait_for(slurm, job)
    log = "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.out"))
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", log[-3000:]
    assert steps(tmp_path) == [1, 2, 3, 4]
    assert "dp 1 x sp 2" in log and "done: 4 steps" in log


def test_requeue_resumes_after_preemption_signal(slurm, tmp_path):
    """USR1 to the batch shell, as `--signal=B:USR1@300` sends before the time limit: the script requeues the job,
    the trainer saves on SIGTERM, and the requeued job (same id, same output dir) resumes and finishes. The first
    job waits at step 4 until its SIGTERM (ULYSSES_TRAIN_FAULT=hold_at:4), so that it cannot finish its 40 steps
    before the signal (the requeued one starts at step 5, past the hold)."""
    job = sbatch(slurm, ["--nodes", "1", "--cpus-per-task", "2"], "train_torchrun.sbatch",
                 ["--steps", "40", "--seq_len", "128"], tmp_path, {"ULYSSES_TRAIN_FAULT": "hold_at:4"})
    metrics = tmp_path / "out" / "metrics.jsonl"
    deadline = time.time() + HANG_GUARD_S
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert time.time() < deadline and job_state(slurm, job).get("JobState") in ("PENDING", "RUNNING")
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm, check=True)
    while job_state(slurm, job).get("Restarts", "0") == "0" or job_state(slurm, job)["JobState"] != "PENDING":
        assert time.time() < deadline
        time.sleep(0.2)
    # Slurm holds a requeued job back for a while (BeginTime); release it now
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=slurm, capture_output=True)
    state = wait_for(slurm, job)
    log = "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.out"))
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", log[-3000:]
    assert "SIGTERM received: saved step 4" in log and "resumed from" in log
    assert steps(tmp_path) == list(range(1, 41))
