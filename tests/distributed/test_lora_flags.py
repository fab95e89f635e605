"""The adapter settings a user can get wrong, each named (model/adapters.py, train/checkpoints/resume.py,
train/checkpoints/disk_space.py):

- resuming: the settings that decide which tensors are trained and their shapes (--use_peft, --lora_r,
  --lora_target_modules, --lora_modules_to_save) are refused on resume with one message, never offered as an
  override (the overrides once crashed inside DeepSpeed's load: a size mismatch, `KeyError
  'model.model.embed_tokens.weight'`, a bare state_dict error); --lora_alpha and --lora_dropout resume; an override
  of --model_config that changes a trained tensor's shape is named before DeepSpeed's load;
- --lora_target_modules empty (it once meant all-linear), a regular expression (taken as PEFT takes a string: a
  full match of the module's whole name), a --lora_r above a layer's rank (r 100000 on a hidden size of 128
  trained 486M parameters), and a tied LM head in --lora_modules_to_save under --verify;
- the first save's estimate of an adapter run counts what it saves, not the whole model's states.

Tiny models and one-step runs: the launches that train take seconds."""

import json
import re
import subprocess
import sys

import pytest
import torch

from tests.trainer_runs import run

TINY = ["--model_config", "tiny", "--seq_len", "64", "--steps", "1"]


def _error(proc) -> str:
    """The `error: ...` line of a launch that stopped on a setting (exit 2)."""
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert lines and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[-1]


# ---------------------------------------------------------------- resuming


def _settings_check(old_flags: list, new_flags: list):
    """compare_settings of a checkpoint saved with `old_flags` against a run launched with `new_flags`: the
    refusal's message, or None when the run may resume."""
    from ulysses_train.errors import ConfigError
    from ulysses_train.train.checkpoints.resume import compare_settings, training_settings
    from ulysses_train.train.config.config_file import parse_args

    old, _ = parse_args(old_flags)
    new, _ = parse_args(new_flags + ["--resume", "auto"])
    new.validate()
    state = {"config": old.to_dict(), "settings": training_settings(old, {})}
    try:
        compare_settings(state, new, training_settings(new, {}), "ckpt")
    except ConfigError as e:
        return str(e)
    return None


def test_resume_refuses_what_changes_the_trained_tensors_and_offers_no_override_for_it():
    """LoRA <-> full fine-tuning and the adapters' shapes: one message, with what to do instead; never a
    --resume_override suggestion (those overrides crashed in DeepSpeed's load). Alpha and dropout may change."""
    from ulysses_train.errors import ConfigError
    from ulysses_train.train.config.config_file import parse_args

    lora, model = ["--use_peft"], ["--model", "/models/base"]
    cases = [
        (lora, [], "use_peft True -> False"),
        ([], lora, "use_peft False -> True"),
        (lora, lora + ["--lora_r", "8"], "lora_r 16 -> 8"),
        (lora, lora + ["--lora_target_modules", "q_proj,v_proj"], "lora_target_modules all-linear -> q_proj,v_proj"),
        (lora, lora + ["--lora_modules_to_save", "norm"], "lora_modules_to_save None -> norm"),
    ]
    for old, new, change in cases:
        message = _settings_check(model + old, model + new + ["--resume_override", "lr"])
        assert message is not None and f"cannot continue with {change}:" in message, (old, new, message)
        assert "no --resume_override changes them" in message and "pass --resume_override" not in message
        assert "restore the old values" in message and "start a new --output_dir with --model OUT" in message
        assert ("--merge" in message) == ("--use_peft" in old)  # a LoRA checkpoint exports merged
    # LoRA on a random initialisation saved no base: no export to train from
    message = _settings_check(lora, lora + ["--lora_r", "8"])
    assert "start afresh in a new --output_dir" in message and "export" not in message
    # the other adapter settings change no trained tensor: an override applies them
    assert _settings_check(lora, lora + ["--lora_alpha", "8", "--lora_dropout", "0.1",
                                         "--resume_override", "lora_alpha,lora_dropout"]) is None
    assert "pass --resume_override lora_alpha" in _settings_check(lora, lora + ["--lora_alpha", "8"])
    for name in ("use_peft", "lora_r", "lora_target_modules", "lora_modules_to_save"):
        with pytest.raises(ConfigError, match=f"--resume_override {name}: {name} decides which tensors are trained"):
            parse_args(lora + ["--resume", "auto", "--resume_override", f"steps,{name}"])[0].validate()


def test_a_lora_checkpoint_resumes_with_a_new_alpha_and_refuses_a_new_rank_or_shape(tmp_path):
    """The issue's commands: a LoRA run, then `--resume auto --resume_override steps,lora_r` (refused, naming the
    flag, where it crashed with a tensor size error), `--lora_r 8` with `steps` overridden (one message, no
    override offered), a --model_config override that narrows the MLP (named before DeepSpeed's load), and a new
    --lora_alpha and --lora_dropout (resumed)."""
    from ulysses_train.model.build import PRESETS

    out = tmp_path / "run"
    run([sys.executable], TINY + ["--use_peft"], out)
    resume = TINY[:-1] + ["2", "--use_peft", "--resume", "auto"]
    message = _error(run([sys.executable], resume + ["--lora_r", "8", "--resume_override", "steps,lora_r"], out,
                         expect_ok=False))
    assert "--resume_override lora_r: lora_r decides which tensors are trained and their shapes" in message
    message = _error(run([sys.executable], resume + ["--lora_r", "8", "--resume_override", "steps"], out,
                         expect_ok=False))
    assert "step_00000001 cannot continue with lora_r 16 -> 8" in message and "--resume_override lora_r" not in message
    narrow = tmp_path / "narrow.json"
    narrow.write_text(json.dumps(dict(PRESETS["tiny"], intermediate_size=256)))
    changed = [a if a != "tiny" else str(narrow) for a in resume]
    message = _error(run([sys.executable], changed + ["--resume_override", "steps,model_config"], out,
                         expect_ok=False))
    assert ("trained other tensors than this run trains (model.model.layers.0.mlp.gate_proj.lora_B.default.weight: "
            "384x16 there, 256x16 here") in message
    proc = run([sys.executable], resume + ["--lora_alpha", "8", "--lora_dropout", "0.1",
                                           "--resume_override", "steps,lora_alpha,lora_dropout"], out)
    assert re.search(r"resumed from \S+step_00000001 at step 1 with .*lora_alpha 32 -> 8", proc.stdout), proc.stdout
    assert (out / "checkpoints" / "step_00000002" / "COMPLETE").exists()


def test_a_full_fine_tuning_checkpoint_is_not_resumed_as_lora(tmp_path):
    """Once `KeyError: 'model.model.embed_tokens.weight'` from DeepSpeed's load with --resume_override use_peft."""
    out = tmp_path / "run"
    run([sys.executable], TINY, out)
    resume = TINY[:-1] + ["2", "--use_peft", "--resume", "auto"]
    message = _error(run([sys.executable], resume + ["--resume_override", "steps,use_peft"], out, expect_ok=False))
    assert "--resume_override use_peft: use_peft decides which tensors are trained" in message
    message = _error(run([sys.executable], resume + ["--resume_override", "steps"], out, expect_ok=False))
    assert "cannot continue with use_peft False -> True" in message
    assert "(python -m ulysses_train.export " in message and " OUT) and start a new --output_dir with --model OUT" \
        in message


# ---------------------------------------------------------------- target modules, rank, tied head


def _meta_model(family: str = "qwen3"):
    from transformers import AutoModelForCausalLM

    from tests.models import tiny_config
    from ulysses_train.model.build import load_model_config

    config = load_model_config(None, "tiny") if family == "tiny" else tiny_config(family)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _spec(**flags):
    from ulysses_train.model.adapters import AdapterSpec
    from ulysses_train.train.config.config_file import parse_args

    argv = ["--use_peft"] + [a for name, value in flags.items() for a in (f"--{name}", str(value))]
    return AdapterSpec.from_config(parse_args(argv)[0].adapters)


def test_lora_target_modules_empty_is_refused_and_a_regular_expression_matches_as_peft_does():
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    from ulysses_train.errors import ConfigError
    from ulysses_train.model.adapters import add_adapters
    from ulysses_train.tools.plan import main as plan_main

    for empty in ("", " , "):
        with pytest.raises(ConfigError, match="--lora_target_modules is empty: give module names .* or all-linear"):
            _spec(lora_target_modules=empty)
    assert plan_main(["--model_config", "tiny", "--seq_len", "1024", "--use_peft", "--lora_target_modules", ""]) == 2
    regex = r".*\.(q|v)_proj"
    spec = _spec(lora_target_modules=regex)
    assert spec.target_regex == regex and spec.lora_config().target_modules == regex
    ours = add_adapters(_meta_model(), spec, input_grads=False).lora_modules
    peft = get_peft_model(_meta_model(), LoraConfig(r=16, target_modules=regex))
    theirs = [n.removeprefix("base_model.model.") for n, m in peft.named_modules() if isinstance(m, LoraLayer)]
    assert ours == theirs and len(ours) == 4
    with pytest.raises(ConfigError, match=r"--lora_target_modules \(q_proj: not a valid regular expression"):
        _spec(lora_target_modules="(q_proj")
    with pytest.raises(ConfigError, match=r"a regular expression, matched as PEFT matches one against each module's "
                                          r"whole name \(e.g. model.layers.0.self_attn.q_proj\)"):
        add_adapters(_meta_model(), _spec(lora_target_modules=r".*\.qq_proj"), input_grads=False)
    with pytest.raises(ConfigError, match=r"--lora_target_modules \.\*: it matches a Qwen3Model, which takes no "
                                          r"adapter"):
        add_adapters(_meta_model(), _spec(lora_target_modules=".*"), input_grads=False)


def test_a_lora_r_above_a_layers_rank_is_refused_naming_the_layer():
    """tiny: hidden 128, k_proj and v_proj 128 -> 64. A MoE's router (4 experts here, 8 for Mixtral) is left out:
    the default r 16 is above its width, as PEFT trains it."""
    from ulysses_train.errors import ConfigError
    from ulysses_train.model.adapters import AdapterSpec, add_adapters

    with pytest.raises(ConfigError, match=r"--lora_r 100000 is above the rank of model.layers.0.self_attn.q_proj "
                                          r"\(128 inputs, 128 outputs: its update has rank 128 at most\), and of 13 "
                                          r"more LoRA'd layers; .* give --lora_r 64 or less"):
        add_adapters(_meta_model("tiny"), AdapterSpec(r=100000), input_grads=False)
    with pytest.raises(ConfigError, match=r"--lora_r 65 is above the rank of model.layers.0.self_attn.k_proj "
                                          r"\(128 inputs, 64 outputs"):
        add_adapters(_meta_model("tiny"), AdapterSpec(r=65), input_grads=False)
    assert len(add_adapters(_meta_model("tiny"), AdapterSpec(r=64), input_grads=False).lora_modules) == 14
    assert add_adapters(_meta_model("tiny"), AdapterSpec(r=128, target_modules=("q_proj",)), input_grads=False)
    # the MoE: k_proj 64 -> 32, each expert's down_proj 32 -> 64; the router 64 -> 4
    moe = add_adapters(_meta_model("qwen3_moe"), AdapterSpec(r=32), input_grads=False)
    assert {"model.layers.0.mlp.gate", "model.layers.0.mlp.experts"} <= set(moe.lora_modules)
    with pytest.raises(ConfigError, match=r"--lora_r 33 is above .* and of 5 more LoRA'd layers; .* 32 or less"):
        add_adapters(_meta_model("qwen3_moe"), AdapterSpec(r=33), input_grads=False)


def test_verify_trains_a_tied_lm_head_whole_as_peft_does(tmp_path):
    """`--lora_modules_to_save lm_head` on the tied tiny model: our weight goes by the embedding's name, PEFT trains
    both tied copies; --verify stopped with "PEFT trains parameters ours does not". Both are named now."""
    from ulysses_train.model.adapters import AdapterSpec, saved_module_names

    assert saved_module_names(_meta_model("tiny"), AdapterSpec(modules_to_save=("lm_head",))) == [
        "lm_head", "model.embed_tokens"]
    out = tmp_path / "verify"
    proc = run([sys.executable], ["--model_config", "tiny", "--verify", "--verify_seq_len", "64", "--use_peft",
                                  "--lora_modules_to_save", "lm_head"], out, expect_ok=False)
    result = json.loads((out / "verify" / "verify.json").read_text())
    assert proc.returncode == 0 and result["passed"], proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result["ours"]["tensors"] == 29  # 28 LoRA matrices and the tied embedding


# ---------------------------------------------------------------- the first save's estimate


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs (root with CAP_SYS_ADMIN), or None where none can be mounted."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    yield mount if done.returncode == 0 else None
    if done.returncode == 0:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_the_first_save_estimate_of_a_lora_run_counts_what_it_saves(small_disk, tmp_path):
    """A LoRA checkpoint of the tiny model is about 1.4 MB; the estimate counted the whole model's states (8.9 MB)
    and warned on a 4 MiB disk that the first save would fail. It now counts the trained parameters and PEFT's
    adapter file: at least the real size, at most twice it."""
    from ulysses_train.model.adapters import AdapterSpec, adapter_geometry
    from ulysses_train.model.build import load_model_config
    from ulysses_train.train.checkpoints.disk_space import checkpoint_bytes, estimated_checkpoint_bytes

    out = (small_disk or tmp_path) / "run"
    proc = run([sys.executable], TINY + ["--use_peft"], out)
    assert "first save will fail" not in proc.stderr, proc.stderr[-2000:]
    real = checkpoint_bytes(str(out / "checkpoints" / "step_00000001"))
    trained = adapter_geometry(load_model_config(None, "tiny"), AdapterSpec())["trainable"]
    estimate = estimated_checkpoint_bytes(trained, 4, adapters=True)
    assert real <= estimate <= 2 * real, (real, estimate)
    if small_disk is None:
        pytest.skip("no tmpfs could be mounted here: the estimate was checked, not the warning on a small disk")


def test_the_export_of_a_random_init_lora_run_needs_its_base(tmp_path, capsys):
    """A LoRA run on a random initialisation (--model_config) saved no base weights: an adapter folder of it (whose
    base_model_name_or_path was a folder without weights) and a merge are refused, naming --base_model; the
    checkpoint itself is still PEFT's adapter folder."""
    from ulysses_train.tools.export import main as export_main

    out = tmp_path / "run"
    run([sys.executable], TINY + ["--use_peft"], out)
    checkpoint = str(out / "checkpoints" / "step_00000001")
    for extra in ([], ["--merge"]):
        assert export_main([checkpoint, str(tmp_path / "exported"), *extra]) == 2
        assert "trained on a random initialisation (no --model)" in capsys.readouterr().err
        assert not (tmp_path / "exported").exists()
    assert json.loads((out / "checkpoints" / "step_00000001" / "adapter_config.json").read_text())["r"] == 16


def test_the_adapters_modules_in_another_order_are_the_same_on_resume():
    """--lora_target_modules q_proj,v_proj then v_proj,q_proj adapts the same layers: no change, nothing refused;
    another module is still a change. A regular expression stays one string."""
    old = ["--use_peft", "--lora_target_modules", "q_proj,v_proj", "--lora_modules_to_save", "norm,lm_head"]
    assert _settings_check(old, ["--use_peft", "--lora_target_modules", "v_proj, q_proj",
                                 "--lora_modules_to_save", "lm_head,norm"]) is None
    assert "lora_target_modules" in _settings_check(old, ["--use_peft", "--lora_target_modules", "q_proj,k_proj",
                                                          "--lora_modules_to_save", "norm,lm_head"])
