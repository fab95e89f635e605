"""Bad settings fail before any work, with one message naming the flag, and a non-zero exit on *every* rank.

The ranks are started here as plain processes with the launcher's variables, not through a launcher that would
kill the survivors, so a rank left waiting in a collective would show up as a hang (the 10-minute guard below is a
hang detector, not a speed requirement)."""

import json
import subprocess
import sys

import pytest

from tests.multiprocess import run_distributed
from tests.trainer_runs import ROOT, TRAIN, child_env, deepspeed_launcher, launch_port

HANG_GUARD_S = 600


def run_ranks(world: int, args: list) -> list[subprocess.CompletedProcess]:
    port = str(launch_port())
    procs = []
    for rank in range(world):
        env = child_env() | dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, TRAIN, "--seq_len", "64", "--steps", "1"] + args, cwd=ROOT,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=HANG_GUARD_S)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


@pytest.fixture(scope="module")
def three_head_config(tmp_path_factory):
    from ulysses_train.model.build import PRESETS

    path = tmp_path_factory.mktemp("cfg") / "three_heads.json"
    path.write_text(json.dumps(dict(PRESETS["tiny"], num_attention_heads=3, num_key_value_heads=3, head_dim=16)))
    return str(path)


def bad_settings(tmp_path, three_head_config) -> dict:
    """{case: (flags, what the error says)}, with the files the cases read written under tmp_path."""
    (tmp_path / "books").mkdir()
    (tmp_path / "books" / "a.txt").write_text("short text")
    (tmp_path / "rows.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "cut.jsonl").write_text('{"text": "fine"}\n{"text": "cut he')
    (tmp_path / "noassist.jsonl").write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"hi {i}"}]})
                                                     + "\n" for i in range(8)))
    data = ["--tokenizer", "bytes", "--data_cache_dir", str(tmp_path / "cache")]
    conflicting = tmp_path / "ds.json"
    conflicting.write_text(json.dumps({"gradient_accumulation_steps": 3, "zero_optimization": {"stage": 3}}))
    return {
        "sp_not_dividing_world": (["--sp_size", "3"], "--sp_size 3 does not divide the world size 2"),
        # --ring_size auto (the default) would take the 3 heads with a ring of 2: a Ulysses-only run cannot
        "heads": (["--model_config", three_head_config, "--ring_size", "1"],
                  "--sp_size 2 must divide the model's 3 attention heads; or keep it with a ring over the rest: "
                  "--ring_size 2"),
        "seq_len": (["--seq_len", "63"], "--seq_len 63 is not a multiple of --sp_size 2"),
        "ds_contradiction": (["--ds_config", str(conflicting), "--grad_accum", "2"],
                             "--grad_accum 2 contradicts gradient_accumulation_steps = 3"),
        "unknown_flag": (["--sp_sise", "2"], "unrecognized arguments: --sp_sise"),
        "dataset_too_short": (["--dataset", str(tmp_path / "books")] + data,
                              "the dataset has 11 tokens, fewer than one sample of --seq_len 64"),
        "missing_column": (["--dataset", str(tmp_path / "rows.jsonl")] + data, "no 'text' column"),
        # read by rank 0 alone, its error broadcast: the other rank must not be left waiting
        "corrupt_dataset": (["--dataset", str(tmp_path / "cut.jsonl")] + data,
                            f"--dataset {tmp_path / 'cut.jsonl'} cannot be read"),
        "missing_model": (["--model", str(tmp_path / "no_model")], f"--model {tmp_path / 'no_model'}: no such file"),
        "output_dir_is_a_file": (["--output_dir", str(tmp_path / "rows.jsonl")],
                                 f"--output_dir {tmp_path / 'rows.jsonl'} is a file, not a folder"),
        # conversations without an assistant turn trained nothing, for a loss of 0.0000 and exit 0
        "no_target": (["--dataset", str(tmp_path / "noassist.jsonl"), "--chat_template",
                       f"{ROOT}/examples/chatml.jinja"] + data,
                      f"--dataset {tmp_path / 'noassist.jsonl'}: no target: none of its 8 conversations has a "
                      f"token the model is trained to write with --loss_on assistant"),
    }


# One launch per stage a run can stop at: the command line, the paths checked before the process group, a check
# every rank makes once the group exists, and the data rank 0 reads alone (its error broadcast). The other settings
# stop at one of these stages too; test_every_bad_setting_stops_every_rank_naming_the_flag checks their messages.
LAUNCHED = ["unknown_flag", "missing_model", "sp_not_dividing_world", "corrupt_dataset"]


@pytest.mark.parametrize("case", LAUNCHED)
def test_bad_settings_fail_on_every_rank(case, three_head_config, tmp_path):
    args, expected = bad_settings(tmp_path, three_head_config)[case]
    results = run_ranks(2, ["--output_dir", str(tmp_path / "out")] + args)  # the last --output_dir wins
    assert all(r.returncode == 2 for r in results), [(r.returncode, r.stderr[-2000:]) for r in results]
    assert expected in results[0].stderr
    for rank, r in enumerate(results):  # the one line is the last word: no rank adds a traceback, Python's or c10d's
        assert not any(t in r.stderr for t in ("Traceback", "Exception raised from")), (rank, r.stderr[-2000:])


def _build_each(rank, world, runs):
    """What building the run (as cli.main does: parse_args, then Trainer) raises on this rank, for each argv."""
    from ulysses_train.errors import ConfigError
    from ulysses_train.train.config.config_file import parse_args
    from ulysses_train.train.run.trainer import Trainer

    raised = {}
    for case, argv in runs:
        try:
            Trainer(*parse_args(argv))
            raised[case] = "no error"
        except ConfigError as e:  # what main prints (rank 0) and exits 2 for, as the launches above show
            raised[case] = str(e)
    return raised


def test_every_bad_setting_stops_every_rank_naming_the_flag(three_head_config, tmp_path):
    """The settings not launched above, all in one launch of two ranks: on every rank, building the run raises
    the ConfigError naming the flag (rank 0's data errors reach rank 1 too)."""
    cases = bad_settings(tmp_path, three_head_config)
    common = ["--seq_len", "64", "--steps", "1"]
    runs = [(case, common + ["--output_dir", str(tmp_path / "out" / case)] + args)
            for case, (args, _) in cases.items() if case not in LAUNCHED]
    assert len(runs) == 7
    for rank, raised in enumerate(run_distributed(_build_each, 2, runs, use_deepspeed=True)):
        for case, _ in runs:
            assert cases[case][1] in raised[case], (rank, case, raised[case])


def test_error_through_deepspeed_launcher():
    proc = subprocess.run(deepspeed_launcher(2) + [TRAIN, "--sp_size", "3"], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode != 0
    assert "--sp_size 3 does not divide the world size 2" in proc.stdout + proc.stderr
