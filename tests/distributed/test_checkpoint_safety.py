"""Checkpoint files without a launch: manifests, the choice of checkpoint to resume from, pruning, the output
folder (writability, a previous run, a rollback), settings compared on resume, metrics repair. Checkpoints here are
folders of small files laid out like real ones; `save_checkpoint` runs on a real ZeRO-3 engine in two processes."""

import json
import os
import subprocess

import pytest
import torch

from tests.multiprocess import run_distributed
from tests.trainer_runs import listing_names
from ulysses_train.errors import CheckpointError, ConfigError
from ulysses_train.train.checkpoints import checkpoint, manifest, resume, run_folder
from ulysses_train.train.config.config_file import parse_args
from ulysses_train.train.config.train_config import OptimConfig, TrainConfig

SHARD = os.path.join("ds", "zero_pp_rank_1_mp_rank_00_model_states.pt")


def fake_checkpoint(output_dir, step, config=None, with_manifest=True):
    """A complete checkpoint folder as save_checkpoint leaves it, with small stand-in files."""
    folder = os.path.join(output_dir, "checkpoints", f"step_{step:08d}")
    os.makedirs(os.path.join(folder, "ds"))
    for rank in range(2):
        with open(os.path.join(folder, "ds", f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"), "wb") as f:
            f.write(os.urandom(3000))
    with open(os.path.join(folder, "trainer_state.json"), "w") as f:
        json.dump({"step": step, "dp_size": 1, "sp_size": 2, "config": config or TrainConfig().to_dict()}, f)
    if with_manifest:
        manifest.write_manifest(folder)
    with open(os.path.join(folder, checkpoint.COMPLETE), "w") as f:
        f.write(manifest.complete_marker(step) if with_manifest else f"{step}\n")  # before manifests: the step
    with open(os.path.join(output_dir, "checkpoints", checkpoint.LATEST), "w") as f:
        f.write(os.path.basename(folder) + "\n")
    return folder


def read_only(path):
    """Makes `path` unwritable, also for root (chattr +i where chmod is not enough); skips if impossible."""
    os.chmod(path, 0o555)
    try:
        open(os.path.join(path, ".probe"), "w").close()
    except OSError:
        return lambda: os.chmod(path, 0o755)
    os.remove(os.path.join(path, ".probe"))
    if subprocess.run(["chattr", "+i", path], capture_output=True).returncode != 0:
        os.chmod(path, 0o755)
        pytest.skip("cannot make a folder read-only here (root without chattr)")
    return lambda: (subprocess.run(["chattr", "-i", path]), os.chmod(path, 0o755))


# ---------------------------------------------------------------- manifests


def test_manifest_names_a_missing_truncated_or_changed_file(tmp_path):
    folder = fake_checkpoint(str(tmp_path), 4)
    assert manifest.damage(folder) is None
    shard = os.path.join(folder, SHARD)
    data = open(shard, "rb").read()
    open(shard, "wb").write(data[:100])
    assert manifest.damage(folder) == f"{SHARD} has 100 bytes, the manifest says 3000 (truncated or overwritten)"
    open(shard, "wb").write(data[:1500] + bytes([data[1500] ^ 1]) + data[1501:])
    assert manifest.damage(folder) == f"{SHARD} does not match its hash in the manifest"
    os.remove(shard)
    assert manifest.damage(folder) == f"{SHARD} is missing"
    with pytest.raises(CheckpointError, match=f"{folder} is damaged: {SHARD} is missing"):
        manifest.verify_checkpoint(folder)
    os.remove(os.path.join(folder, manifest.MANIFEST))  # COMPLETE says there was one
    assert manifest.damage(folder) == "MANIFEST.json is missing"


def test_large_files_are_hashed_in_samples_that_catch_a_zeroed_stretch(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest, "FULL_HASH_BYTES", 1 << 20)
    monkeypatch.setattr(manifest, "EDGE_BYTES", 64 << 10)
    monkeypatch.setattr(manifest, "SAMPLE_BYTES", 4 << 10)
    path = tmp_path / "big.pt"
    data = bytearray(os.urandom(8 << 20))
    path.write_bytes(data)
    digest = manifest.file_digest(str(path))
    data[3 << 20:4 << 20] = bytes(1 << 20)  # a zero-filled MiB in the middle, as a crash can leave
    path.write_bytes(data)
    assert manifest.file_digest(str(path)) != digest


def test_a_truncated_trainer_state_is_named(tmp_path):
    folder = fake_checkpoint(str(tmp_path), 2, with_manifest=False)  # no manifest: the JSON itself is checked
    state = os.path.join(folder, "trainer_state.json")
    open(state, "w").write('{"step": 2, "dp_')
    with pytest.raises(CheckpointError, match=f"{state} is not valid JSON"):
        checkpoint.read_trainer_state(folder)


# ---------------------------------------------------------------- which checkpoint to resume from


def test_auto_falls_back_to_the_newest_intact_checkpoint_with_a_warning(tmp_path):
    out = str(tmp_path)
    fake_checkpoint(out, 2)
    newest = fake_checkpoint(out, 4)
    os.remove(os.path.join(newest, SHARD))
    warnings = []
    assert checkpoint.resolve_resume("auto", out, warnings.append) == os.path.join(out, "checkpoints",
                                                                                  "step_00000002")
    assert warnings == [f"{newest} is damaged ({SHARD} is missing); resuming from the newest intact checkpoint, "
                        f"{os.path.join(out, 'checkpoints', 'step_00000002')}"]
    with pytest.raises(CheckpointError, match=f"{SHARD} is missing"):
        checkpoint.resolve_resume(newest, out, warnings.append)


def test_auto_with_only_damaged_checkpoints_stops_instead_of_starting_over(tmp_path):
    out = str(tmp_path)
    only = fake_checkpoint(out, 2)
    os.remove(os.path.join(only, SHARD))
    with pytest.raises(CheckpointError, match="no intact checkpoint"):
        checkpoint.resolve_resume("auto", out, lambda message: None)


def test_auto_ignores_a_stale_latest_and_abandoned_checkpoints(tmp_path):
    out = str(tmp_path)
    fake_checkpoint(out, 2)
    fake_checkpoint(out, 3)
    with open(os.path.join(out, "checkpoints", "latest"), "w") as f:
        f.write("step_00000009\n")  # names a folder that is gone
    os.makedirs(os.path.join(out, "checkpoints", "abandoned", "rollback_to_step_00000001"))
    fake_checkpoint(os.path.join(out, "checkpoints", "abandoned", "rollback_to_step_00000001"), 7)
    assert checkpoint.resolve_resume("auto", out, print).endswith("step_00000003")


def _rewrite_state(folder, **changes):
    """Edits trainer_state.json and rewrites the manifest, as a hand edit that also regenerated it would."""
    path = os.path.join(folder, "trainer_state.json")
    with open(path) as f:
        state = json.load(f)
    with open(path, "w") as f:
        json.dump(state | changes, f)
    manifest.write_manifest(folder)


def test_checkpoints_are_what_their_names_say(tmp_path):
    """`cp -r step_3 step_99` made the copy the newest for ever (every --resume auto restarted at step 3 and
    overwrote step 4 and 5); a symlinked step_N pointing outside --output_dir was loaded; a hand-edited "step": -3
    trained steps -2..5. The step is the one trainer_state.json holds: checkpoints are ordered by it, and a folder
    whose name says otherwise, or a link, is left out and named."""
    import shutil

    out = str(tmp_path / "run")
    fake_checkpoint(out, 3)
    real = fake_checkpoint(out, 4)
    root = os.path.join(out, "checkpoints")
    shutil.copytree(os.path.join(root, "step_00000003"), os.path.join(root, "step_00000099"))  # an intact copy
    elsewhere = fake_checkpoint(str(tmp_path / "other"), 7)
    os.symlink(elsewhere, os.path.join(root, "step_00000007"))
    negative = fake_checkpoint(str(tmp_path / "neg"), 8)
    _rewrite_state(negative, step=-3)
    shutil.move(negative, os.path.join(root, "step_00000008"))
    warnings = []
    assert checkpoint.resolve_resume("auto", out, warnings.append) == real
    assert sorted(warnings) == sorted([
        f"{root}/step_00000007 is left out: a symbolic link to {elsewhere}, not a checkpoint folder of this run",
        f"{root}/step_00000008 is left out: its trainer_state.json says step -3, not a step of a run (a whole number "
        f">= 0)",
        f"{root}/step_00000099 is left out: its trainer_state.json holds step 3, not the step its name says (a copy "
        f"or a renamed folder?)"])
    assert checkpoint.complete_checkpoints(out) == [os.path.join(root, "step_00000003"), real]
    assert checkpoint.prune_checkpoints(out, keep=1, saved_step=4) == [os.path.join(root, "step_00000003")]
    assert os.path.isdir(os.path.join(root, "step_00000099"))  # not this run's to delete either
    with pytest.raises(ConfigError, match=rf"--resume {root}/step_00000007 is a symbolic link \(to {elsewhere}\)"):
        checkpoint.resolve_resume(os.path.join(root, "step_00000007"), out, print)
    with pytest.raises(CheckpointError, match=r"step_00000008: its trainer_state.json says step -3"):
        checkpoint.resolve_resume(os.path.join(root, "step_00000008"), out, print)
    with pytest.raises(CheckpointError, match=r"step_00000099: its trainer_state.json holds step 3, not the step"):
        checkpoint.resolve_resume(os.path.join(root, "step_00000099"), out, print)


def test_a_checkpoint_under_another_name_resumes_and_rolls_back_by_its_step(tmp_path):
    """--resume best/ (a copy under another name) crashed after the model was built (int('best') in the
    rollback); its step is trainer_state.json's, checked before the model is built."""
    import shutil

    out = str(tmp_path)
    fake_checkpoint(out, 2)
    fake_checkpoint(out, 4, config=TrainConfig(optim=OptimConfig(steps=6)).to_dict())
    fake_checkpoint(out, 6)
    best = os.path.join(out, "best")
    shutil.copytree(os.path.join(out, "checkpoints", "step_00000004"), best)
    cfg, _ = parse_args(["--output_dir", out, "--resume", best, "--steps", "6"])
    plan = resume._decide(cfg, resume.training_settings(cfg, {}), 1, 2, True, print, print)
    assert (plan.checkpoint, plan.step) == (best, 4)
    aside = run_folder.abandon_newer(out, best, log=print)
    assert aside.endswith("rollback_to_step_00000004") and sorted(os.listdir(aside)) == ["step_00000006"]
    assert listing_names(out) == ["step_00000002", "step_00000004"]


def test_manifest_paths_stay_inside_the_checkpoint(tmp_path):
    """MANIFEST.json entries such as ../../../../etc/hostname were read and hashed."""
    folder = fake_checkpoint(str(tmp_path / "run"), 4)
    outside = tmp_path / "secret"
    outside.write_bytes(b"not the checkpoint's")
    entry = {"size": outside.stat().st_size, "blake2b": manifest.file_digest(str(outside))}
    path = os.path.join(folder, manifest.MANIFEST)
    original = json.load(open(path))
    for name in ("../../../secret", str(outside)):
        json.dump(original | {"files": original["files"] | {name: entry}}, open(path, "w"))
        assert manifest.damage(folder) == f"MANIFEST.json names {name!r}, a path outside the checkpoint folder"
    os.symlink(str(outside), os.path.join(folder, "ds", "linked.pt"))  # a file of the folder that leads out
    json.dump(original | {"files": original["files"] | {"ds/linked.pt": entry}}, open(path, "w"))
    assert manifest.damage(folder) == f"ds/linked.pt is a link to {outside}, outside the checkpoint folder"


# ---------------------------------------------------------------- pruning


def test_pruning_keeps_the_checkpoint_just_written_and_never_touches_newer_ones(tmp_path):
    out = str(tmp_path)
    for step in (1, 2, 3, 5):
        fake_checkpoint(out, step)
    removed = checkpoint.prune_checkpoints(out, keep=2, saved_step=3)
    assert [os.path.basename(p) for p in removed] == ["step_00000001"]
    assert sorted(n for n in os.listdir(os.path.join(out, "checkpoints")) if n.startswith("step_")) == [
        "step_00000002", "step_00000003", "step_00000005"]
    checkpoint.prune_checkpoints(out, keep=1, saved_step=3)
    assert sorted(n for n in os.listdir(os.path.join(out, "checkpoints")) if n.startswith("step_")) == [
        "step_00000003", "step_00000005"]


# ---------------------------------------------------------------- the output folder


def test_an_output_folder_that_is_a_file_is_refused(tmp_path):
    target = tmp_path / "out"
    target.write_text("")
    with pytest.raises(ConfigError, match=f"--output_dir {target} is a file"):
        run_folder.check_writable(str(target))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("")
    with pytest.raises(ConfigError, match="checkpoints is not a folder"):
        run_folder.check_writable(str(tmp_path / "run"))
    run_folder.check_writable(str(tmp_path / "new" / "deeper"))  # created later, under a writable parent
    assert not (tmp_path / "new").exists()


def test_a_read_only_checkpoints_folder_is_refused_naming_the_untouched_checkpoint(tmp_path):
    previous = fake_checkpoint(str(tmp_path), 2)
    restore = read_only(str(tmp_path / "checkpoints"))
    try:
        with pytest.raises(ConfigError) as error:
            run_folder.check_writable(str(tmp_path))
    finally:
        restore()
    assert f"cannot write to {tmp_path / 'checkpoints'}" in str(error.value)
    assert f"the previous checkpoint {previous} is untouched" in str(error.value)


def test_a_fresh_run_into_a_used_folder_is_refused_unless_overwritten(tmp_path):
    out = str(tmp_path)
    fake_checkpoint(out, 2)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="--resume auto.*--overwrite_output_dir"):
        run_folder.claim_for_fresh_run(out, overwrite=False, log=print)
    assert os.path.exists(os.path.join(out, "checkpoints", "step_00000002"))
    run_folder.claim_for_fresh_run(out, overwrite=True, log=print)
    assert sorted(os.listdir(out)) == ["notes.txt"]


def test_a_rollback_moves_newer_checkpoints_and_the_metrics_aside(tmp_path):
    out = str(tmp_path)
    resumed = fake_checkpoint(out, 2)
    fake_checkpoint(out, 4)
    fake_checkpoint(out, 6)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 7)))
    aside = run_folder.abandon_newer(out, resumed, log=print)
    assert aside == os.path.join(out, "checkpoints", "abandoned", "rollback_to_step_00000002")
    assert sorted(os.listdir(aside)) == ["metrics.jsonl", "step_00000004", "step_00000006"]
    assert listing_names(out) == ["step_00000002"]
    assert open(os.path.join(out, "checkpoints", "latest")).read().strip() == "step_00000002"
    fake_checkpoint(out, 3)  # a second rollback to the same step keeps the first one's folder
    assert run_folder.abandon_newer(out, resumed, log=print) == aside + ".2"


# ---------------------------------------------------------------- settings compared on resume


def settings_of(argv):
    cfg, _ = parse_args(argv)
    return cfg, resume.training_settings(cfg, {"lr": cfg.optim.lr or 1e-3, "micro_batch_size": 1, "grad_accum": 1,
                                               "max_grad_norm": 1.0, "dtype": "fp32", "ds_config": {}})


def saved_state(argv, step=3):
    cfg, settings = settings_of(argv)
    return {"step": step, "config": cfg.to_dict(), "settings": settings}


def test_changed_training_settings_are_refused_naming_each_difference():
    state = saved_state(["--seq_len", "256", "--lr", "3e-3"])
    cfg, settings = settings_of(["--seq_len", "512", "--lr", "1e-3", "--seed", "5", "--save_steps", "7",
                                 "--log_every", "3", "--resume", "auto"])
    with pytest.raises(ConfigError) as error:
        resume.compare_settings(state, cfg, settings, "ckpt/step_00000003")
    message = str(error.value)
    assert "lr 0.003 -> 0.001" in message and "seq_len 256 -> 512" in message and "seed 0 -> 5" in message
    assert "--resume_override lr,seed,seq_len" in message
    assert "save_steps" not in message and "log_every" not in message


def test_overridden_settings_are_applied_and_free_ones_need_no_override():
    state = saved_state(["--lr", "3e-3", "--steps", "4"])
    cfg, settings = settings_of(["--lr", "1e-3", "--steps", "8", "--resume_override", "lr,steps",
                                 "--save_total_limit", "2", "--resume", "auto"])
    overridden, free = resume.compare_settings(state, cfg, settings, "ckpt")
    assert overridden == {"lr": "lr 0.003 -> 0.001", "steps": "steps 4 -> 8"}
    assert free == ["save_total_limit None -> 2"]  # resume and resume_override differ by nature: not listed


def test_an_lr_equal_to_the_old_default_is_no_change():
    state = saved_state([])  # lr resolved to 1e-3 for random init
    cfg, settings = settings_of(["--lr", "1e-3", "--resume", "auto"])
    assert resume.compare_settings(state, cfg, settings, "ckpt")[0] == {}


def test_every_setting_the_issue_names_needs_an_override_and_overrides_are_checked():
    for name in ("model", "model_config", "num_layers", "dataset", "dataset_split", "text_column", "tokenizer",
                 "seq_len", "packing", "seed", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "steps",
                 "dtype", "loss", "rope_scaling", "rope_factor", "micro_batch_size", "grad_accum", "max_grad_norm",
                 "ds_config"):
        assert name not in resume.FREE_SETTINGS, name
    with pytest.raises(ConfigError, match="--resume_override save_steps: save_steps never needs an override"):
        parse_args(["--resume", "auto", "--resume_override", "save_steps"])[0].validate()
    with pytest.raises(ConfigError, match="--resume_override needs --resume"):
        parse_args(["--resume_override", "lr"])[0].validate()
    with pytest.raises(ConfigError, match="--overwrite_output_dir starts afresh"):
        parse_args(["--resume", "auto", "--overwrite_output_dir"])[0].validate()


def test_a_model_config_edited_in_place_is_a_changed_setting(tmp_path):
    """--model_config was compared by its path: a file edited in place (another depth, other heads) resumed the
    checkpoint into another model without a word. It is compared by its content, as --ds_config is."""
    from ulysses_train.model.build import PRESETS, model_config_values

    path = tmp_path / "model.json"
    path.write_text(json.dumps(PRESETS["tiny"]))

    def settings(argv):
        cfg, _ = parse_args(argv)
        return cfg, resume.training_settings(cfg, {"model_config": model_config_values(cfg.base.model_config)})

    _, saved = settings(["--model_config", str(path)])
    state = {"step": 3, "config": parse_args(["--model_config", str(path)])[0].to_dict(), "settings": saved}
    path.write_text(json.dumps(PRESETS["tiny"] | {"num_hidden_layers": 3}))
    cfg, now = settings(["--model_config", str(path), "--resume", "auto"])
    with pytest.raises(ConfigError, match=rf"was trained with other settings: model_config {path} \(its content "
                                          rf"differs from the checkpoint's: edited since\?\)"):
        resume.compare_settings(state, cfg, now, "ckpt")
    moved = tmp_path / "moved.json"
    moved.write_text(json.dumps(PRESETS["tiny"]))  # the same content elsewhere: no change
    cfg, now = settings(["--model_config", str(moved), "--resume", "auto"])
    assert resume.compare_settings(state, cfg, now, "ckpt")[0] == {}
    old = state | {"settings": saved | {"model_config": str(path)}}  # saved when it held the path
    cfg, now = settings(["--model_config", str(path), "--resume", "auto"])
    assert resume.compare_settings(old, cfg, now, "ckpt")[0] == {}


def test_the_plan_says_nothing_to_do_and_refuses_schedule_overrides_under_a_ds_config_scheduler(tmp_path):
    out = str(tmp_path)
    # saved before resolved settings were
    path = fake_checkpoint(out, 2, config=TrainConfig(optim=OptimConfig(steps=2)).to_dict())

    def decide(argv, own_scheduler=True):
        cfg, _ = parse_args(["--output_dir", out, "--resume", path] + argv)
        return resume._decide(cfg, resume.training_settings(cfg, {}), 1, 2, own_scheduler, print, print)

    with pytest.raises(resume.NothingToDo, match=f"nothing to do: {path} is at step 2 of --steps 2"):
        decide(["--steps", "2"])
    with pytest.raises(ConfigError, match=r"--resume_override lr: the scheduler of --ds_config"):
        decide(["--steps", "2", "--lr", "1e-3", "--resume_override", "lr"], own_scheduler=False)
    plan = decide(["--steps", "4", "--resume_override", "steps"])
    assert (plan.checkpoint, plan.step, plan.overridden) == (path, 2, ["steps 2 -> 4"])


def test_the_schedule_follows_the_new_settings_from_the_resumed_step():
    from ulysses_train.train.step.schedule import warmup_cosine

    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(4, 0, 0.1))
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    new = warmup_cosine(8, 0, 0.1)
    scheduler.lr_lambdas = [new]
    resume.apply_schedule(scheduler, 1e-3)
    assert optimizer.param_groups[0]["lr"] == 1e-3 * new(2) == scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 1e-3 * new(3)


# ---------------------------------------------------------------- metrics


def test_a_torn_last_metrics_line_is_dropped_with_a_warning(tmp_path, capsys):
    from ulysses_train.train.step.metrics import MetricsLogger

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n{"step": 3, "lo')
    with MetricsLogger(str(tmp_path), 5, True, start_step=2):
        pass
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n'
    assert "partial last line" in capsys.readouterr().err


# ---------------------------------------------------------------- save_checkpoint on a real engine


def _save_twice(rank, world, out):
    """Saves step 1, makes checkpoints/ read-only (rank 0), saves step 2: what each rank raised."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    from tests.models import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3"))
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3},
          "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      config=ds)
    state = {"step": 1, "dp_size": world, "sp_size": 1, "config": {}}
    first = checkpoint.save_checkpoint(engine, out, 1, state, model.config, None, rank)
    assert manifest.damage(first) is None
    restore = read_only(os.path.join(out, "checkpoints")) if rank == 0 else None
    torch.distributed.barrier()
    try:
        checkpoint.save_checkpoint(engine, out, 2, dict(state, step=2), model.config, None, rank)
        return "saved"
    except CheckpointError as e:
        return str(e)
    finally:
        torch.distributed.barrier()
        if restore:
            restore()


def test_an_unwritable_save_fails_on_every_rank_naming_the_untouched_checkpoint(tmp_path):
    restore = read_only(str(tmp_path))  # skips here, before starting processes, where that is impossible
    restore()
    results = run_distributed(_save_twice, 2, str(tmp_path), use_deepspeed=True)
    previous = os.path.join(str(tmp_path), "checkpoints", "step_00000001")
    for message in results:
        assert "saving checkpoint step_00000002 failed" in message
        assert f"the previous checkpoint {previous} is untouched" in message
    assert listing_names(str(tmp_path)) == ["step_00000001"]


# ---------------------------------------------------------------- a real full disk


@pytest.fixture
def small_disk(tmp_path):
    """A 20 MiB tmpfs mounted here for the test (root with CAP_SYS_ADMIN); skipped, saying why, elsewhere."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_run_stops_at_the_save_that_does_not_fit_naming_the_previous_checkpoint(small_disk):
    """The issue's command: 8 steps saving every step onto 20 MiB, about three checkpoints of the tiny model. The
    save that cannot fit is refused (exit 3) naming the checkpoint before it, after a warning one save earlier; no
    temporary folder is left to keep the disk full."""
    import sys

    from tests.trainer_runs import ROOT, TRAIN, child_env

    out = small_disk / "run"
    proc = subprocess.run([sys.executable, TRAIN, "--output_dir", str(out), "--steps", "8", "--save_steps", "1",
                           "--seq_len", "64"], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-3000:]
    saved = listing_names(str(out))
    last, refused = saved[-1], f"step_{int(saved[-1][5:]) + 1:08d}"
    assert len(saved) >= 2 and sorted(os.listdir(out / "checkpoints")) == ["latest"] + saved  # no .tmp-step_N
    assert f"warning: the next save will fail: No space left on device for it: the file system of " \
           f"{out / 'checkpoints'} has" in proc.stderr
    assert f"error: saving checkpoint {refused} failed (rank 0: [Errno 28] No space left on device for it" in \
        proc.stderr and f"the previous checkpoint {out / 'checkpoints' / last} is untouched" in proc.stderr
    assert "Traceback" not in proc.stderr and (out / "checkpoints" / "latest").read_text().strip() == last


def test_a_first_save_onto_a_full_disk_says_so_in_plain_words(small_disk):
    """The first save of a run onto a disk too small for it: torch's zip writer failed inside
    (`[enforce fail at inline_container.cc] . unexpected pos ...`) and the message said "the previous checkpoint
    (none) is untouched". Now: no space left, how much is free, and that the run has no checkpoint yet."""
    import sys

    from tests.trainer_runs import ROOT, TRAIN, child_env

    _fill(small_disk, 3 << 20)  # 3 MiB left: a checkpoint of the tiny model takes about 7
    out = small_disk / "run"
    proc = subprocess.run([sys.executable, TRAIN, "--output_dir", str(out), "--steps", "1", "--seq_len", "64"],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=900)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 3 and len(errors) == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert errors[0].startswith("error: saving checkpoint step_00000001 failed (rank 0: no space left on device: ")
    assert errors[0].endswith("it was this run's first, so no checkpoint of it exists yet")
    assert "inline_container" not in proc.stderr and "(none)" not in proc.stderr and "Traceback" not in proc.stderr


def _fill(folder, leave: int) -> None:
    """Fills the file system of `folder` up to `leave` free bytes."""
    import shutil

    free = shutil.disk_usage(folder).free
    with open(os.path.join(folder, "filler"), "wb") as f:
        f.write(b"\0" * max(0, free - leave))


def _save_onto_a_full_disk(rank, world, out):
    """Saves step 1; fills the disk to half a checkpoint; saves step 2 (refused before writing), then again with the
    free-space check off (fails writing, in torch's zip writer or an OSError): what each rank raised, and what
    checkpoints/ held after each."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    from tests.models import tiny_config
    from ulysses_train.train.checkpoints import disk_space

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3"))
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3},
          "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      config=ds)
    state = {"step": 1, "dp_size": world, "sp_size": 1, "config": {}}
    first = checkpoint.save_checkpoint(engine, out, 1, state, model.config, None, rank)
    root = os.path.join(out, "checkpoints")
    if rank == 0:
        os.makedirs(os.path.join(root, ".tmp-step_00000009"))  # left by a save that was killed: dead weight
        with open(os.path.join(root, ".tmp-step_00000009", "shard.pt"), "wb") as f:
            f.write(b"\0" * (64 << 10))
        _fill(out, disk_space.checkpoint_bytes(first) // 3)
    outcomes = []
    for check in (True, False):
        torch.distributed.barrier()
        if not check:
            checkpoint.too_little_space = lambda *args: None
        try:
            checkpoint.save_checkpoint(engine, out, 2, dict(state, step=2), model.config, None, rank)
            outcomes.append(("saved", sorted(os.listdir(root))))
        except CheckpointError as e:
            torch.distributed.barrier()
            outcomes.append((str(e), sorted(os.listdir(root))))
    return outcomes


def test_a_save_onto_a_full_disk_is_refused_or_fails_naming_the_previous_checkpoint(small_disk):
    """A real full file system: the save failed in torch's zip writer (`RuntimeError: [enforce fail at
    inline_container.cc] . unexpected pos`, not an OSError), so no "no space left", no previous checkpoint named,
    and .tmp-step_N left behind, keeping the disk full. A save that cannot fit is now refused before it writes;
    one that fails while writing is the promised message on every rank; the temporary folders go."""
    results = run_distributed(_save_onto_a_full_disk, 2, str(small_disk))
    previous = os.path.join(str(small_disk), "checkpoints", "step_00000001")
    for (refused, after_refusal), (failed, after_failure) in results:
        assert refused.startswith("saving checkpoint step_00000002 failed (rank 0: [Errno 28] No space left on device "
                                  "for it: the file system of "), refused
        assert f"the previous checkpoint {previous} is untouched" in refused
        assert failed.startswith("saving checkpoint step_00000002 failed (rank "), failed
        assert "no space left on device" in failed.lower() and f"the previous checkpoint {previous} is untouched" \
            in failed
        assert after_refusal == after_failure == ["latest", "step_00000001"]  # no .tmp-step_N, the stale one gone
    assert results[0] == results[1]  # every rank raised the same, none hung
