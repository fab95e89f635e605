"""Flag parsing, DS-config reconciliation and launcher-environment parsing (no processes)."""

import json
import os
import re

import pytest

from ulysses_train.errors import ConfigError
from ulysses_train.sp.dims import ParallelDims, check_heads, check_lengths, valid_sp_sizes, validate
from ulysses_train.train.config.config_file import parse_args
from ulysses_train.train.config.ds_config import resolve_ds_config
from ulysses_train.train.config.ds_file import load_ds_config
from ulysses_train.train.config.groups import REPO_ROOT
from ulysses_train.train.process.launcher import expand_nodelist, normalise_launcher_env

ZERO3 = os.path.join(REPO_ROOT, "ds_configs", "zero3.json")


def _resolve(argv, raw=None, dp=2, sp=2):
    cfg, explicit = parse_args(argv)
    raw = raw if raw is not None else load_ds_config(ZERO3)
    return resolve_ds_config(raw, cfg, explicit, dp, sp, hidden_size=64, use_bf16=False, random_init=True)


def test_auto_values_come_from_flags():
    ds = _resolve(["--micro_batch_size", "2", "--grad_accum", "3", "--max_grad_norm", "0.5"])
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["gradient_accumulation_steps"] == 3
    assert ds["train_batch_size"] == 2 * 3 * 2 and ds["gradient_clipping"] == 0.5
    assert ds["bf16"]["enabled"] is False and ds["sequence_parallel_size"] == 2
    assert ds["zero_optimization"]["reduce_bucket_size"] == 64 * 64


def test_json_numbers_are_used_when_flag_not_typed():
    raw = dict(load_ds_config(ZERO3), train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
    ds = _resolve([], raw)
    assert ds["train_batch_size"] == 4 * 2 * 2


def test_contradiction_names_both_sides():
    raw = dict(load_ds_config(ZERO3), gradient_accumulation_steps=2)
    with pytest.raises(ConfigError, match=r"--grad_accum 3 contradicts gradient_accumulation_steps = 2"):
        _resolve(["--grad_accum", "3"], raw)
    with pytest.raises(ConfigError, match="train_batch_size"):
        _resolve([], dict(load_ds_config(ZERO3), train_batch_size=5))


def test_optimizer_lr_reconciled():
    raw = dict(load_ds_config(os.path.join(REPO_ROOT, "ds_configs", "zero3_offload.json")))
    assert _resolve(["--lr", "3e-4"], raw)["optimizer"]["params"]["lr"] == 3e-4
    raw["optimizer"]["params"]["lr"] = 1e-4
    with pytest.raises(ConfigError, match="--lr"):
        _resolve(["--lr", "3e-4"], raw)


def test_optimizer_betas_and_epsilon_reconciled():
    raw = load_ds_config(os.path.join(REPO_ROOT, "ds_configs", "zero3_offload.json"))
    params = _resolve(["--adam_beta2", "0.999", "--adam_epsilon", "1e-6"], raw)["optimizer"]["params"]
    assert (params["betas"], params["eps"]) == ([0.9, 0.999], 1e-6)
    assert _resolve([], raw)["optimizer"]["params"]["betas"] == [0.9, 0.95]  # the flags' defaults
    raw["optimizer"]["params"].update(betas=[0.8, 0.9], eps=1e-7)
    assert _resolve([], raw)["optimizer"]["params"]["betas"] == [0.8, 0.9]  # numbers stand when no flag is typed
    with pytest.raises(ConfigError, match=r"--adam_beta1 0.9 contradicts optimizer.params.betas\[0\] = 0.8"):
        _resolve(["--adam_beta1", "0.9"], raw)
    with pytest.raises(ConfigError, match="--adam_epsilon 1e-08 contradicts optimizer.params.eps = 1e-07"):
        _resolve(["--adam_epsilon", "1e-8"], raw)


def test_parallel_dims_and_errors_name_the_flag():
    dims = ParallelDims(world_size=8, sp_size=4)
    assert dims.dp_size == 2 and dims.sp_group_ranks(5) == [4, 5, 6, 7] and dims.dp_group_ranks(5) == [1, 5]
    with pytest.raises(ConfigError, match="--sp_size 3 does not divide the world size 8"):
        ParallelDims(8, 3)
    with pytest.raises(ConfigError, match="--sp_size 3 must divide the model's 8 attention heads"):
        check_heads(3, 8, 8)
    with pytest.raises(ConfigError, match="--sp_size 4 and the model's 6 KV heads"):
        check_heads(4, 8, 6)
    check_heads(8, 32, 8)  # split is fine
    check_heads(4, 8, 1)  # MQA: replicate
    with pytest.raises(ConfigError, match="--verify_seq_len 1001 is not a multiple of --sp_size 2"):
        check_lengths(2, {"seq_len": 1024, "verify_seq_len": 1001}, pad_to_sp=False)
    check_lengths(2, {"seq_len": 1001}, pad_to_sp=True)
    assert validate(8, 4, 32, 8, {"seq_len": 4096}).dp_size == 2
    assert valid_sp_sizes(8, 8, 4) == [1, 2, 4, 8] and valid_sp_sizes(6, 8, 4) == [1, 2]
    assert valid_sp_sizes(8, 28, 4, requested=8) == []  # Qwen2.5-7B's 28 heads


def test_ring_dims_layout_and_errors_name_the_flags():
    """SP = Ulysses x ring: Ulysses groups are consecutive ranks, rings stride across them, inside each SP group."""
    from ulysses_train.sp.dims import resolve_ring_size, sequence_multiple

    dims = ParallelDims(world_size=16, sp_size=8, ring_size=2)
    assert dims.ulysses_size == 4 and dims.dp_size == 2
    assert dims.ulysses_group_ranks(13) == [12, 13, 14, 15] and dims.ring_group_ranks(13) == [9, 13]
    assert dims.ring_group_ranks(2) == [2, 6] and dims.sp_group_ranks(13) == list(range(8, 16))
    # every SP group is the disjoint union of its Ulysses groups, and of its rings
    for rank in range(16):
        sp = set(dims.sp_group_ranks(rank))
        assert set().union(*(dims.ulysses_group_ranks(r) for r in sp)) == sp
        assert set().union(*(dims.ring_group_ranks(r) for r in sp)) == sp
        assert set(dims.ulysses_group_ranks(rank)) & set(dims.ring_group_ranks(rank)) == {rank}
    with pytest.raises(ConfigError, match="--ring_size 3 does not divide --sp_size 8"):
        ParallelDims(8, 8, 3)
    # Qwen2.5-7B: 28 heads, 4 KV heads; pure Ulysses at 8 fails and the message proposes the ring
    with pytest.raises(ConfigError, match=r"--sp_size 8 must divide the model's 28 attention heads; .*--ring_size 2 "
                                          r"\(Ulysses 4 x ring 2\), which --ring_size auto \(the default\) picks"):
        check_heads(8, 28, 4)
    check_heads(8, 28, 4, ring_size=2)
    with pytest.raises(ConfigError, match="--sp_size 16 / --ring_size 2 = Ulysses degree 8 must divide the model's "
                                          "28 attention heads"):
        check_heads(16, 28, 4, ring_size=2)
    with pytest.raises(ConfigError, match="Ulysses degree 8 and the model's 3 KV heads"):
        check_heads(16, 24, 3, ring_size=2)
    assert resolve_ring_size("auto", 8, 28, 4) == 2 and resolve_ring_size("auto", 32, 16, 8) == 2
    assert resolve_ring_size("auto", 8, 32, 8) == 1 and resolve_ring_size("auto", 6, 7, 7) == 6
    assert resolve_ring_size("3", 6, 8, 8) == 3
    assert sequence_multiple(8, 1) == 8 and sequence_multiple(8, 2) == 8 and sequence_multiple(6, 3) == 6
    assert sequence_multiple(2, 2) == 4 and sequence_multiple(12, 4) == 24
    with pytest.raises(ConfigError, match=r"--seq_len 36 is not a multiple of 24 \(2 x --ring_size 4 zigzag chunks"):
        validate(12, 12, 12, 12, {"seq_len": 36}, ring_size=4)
    assert valid_sp_sizes(8, 28, 4, requested=8, ring=True) == [8]
    for bad in ("0", "-1", "two"):
        cfg, _ = parse_args(["--ring_size", bad])
        with pytest.raises(ConfigError, match=f"--ring_size must be a positive number or auto, got {bad}"):
            cfg.validate()
    parse_args(["--ring_size", "auto"])[0].validate()
    # the default: no ring where the heads divide the SP size, the smallest ring where they do not (12 heads at 8)
    assert parse_args([])[0].parallel.ring_size == "auto"
    assert resolve_ring_size("auto", 8, 12, 12) == 2 and resolve_ring_size("auto", 4, 12, 12) == 1


def test_validate_rejects_bad_flags(tmp_path):
    cfg, _ = parse_args(["--model", "x", "--model_config", "tiny"])
    with pytest.raises(ConfigError, match="mutually exclusive"):
        cfg.validate()
    cfg, _ = parse_args(["--ds_config", str(tmp_path / "missing.json")])
    with pytest.raises(ConfigError, match="no such file"):
        cfg.validate()
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    cfg, _ = parse_args(["--ds_config", str(bad)])
    with pytest.raises(ConfigError, match="not valid JSON"):
        cfg.validate()


def test_unknown_flag_is_one_message():
    """argparse printed its 40-line usage on every rank; the error is now a ConfigError the CLI prints once."""
    with pytest.raises(ConfigError, match=r"^unrecognized arguments: --no_such_flag 1 \(python launch/train.py "
                                          r"--help lists the flags\)$"):
        parse_args(["--no_such_flag", "1"])
    with pytest.raises(ConfigError, match=r"^argument --seq_len: invalid int value: 'x'"):
        parse_args(["--seq_len", "x"])


@pytest.mark.parametrize("text, message", [
    ("seq_len: 64\nsteps: 2\nseq_len: 128\n", r"the key 'seq_len' appears twice \(lines 1 and 3\); keep one"),
    ("steps: 2\nmax_steps: 3\n", r"steps and max_steps name the same flag --steps: keep one"),
    ("seq-len: 64\nseq_len: 128\n", r"seq-len and seq_len name the same flag --seq_len: keep one"),
    ("help: true\n", r"'help' cannot be set in a config file"),
    ("config: other.yaml\n", r"'config' cannot be set in a config file"),
    ("seq_len: many\n", r"seq_len: invalid int value: 'many'"),
    ("dtype: fp16\n", r"dtype: invalid choice: 'fp16' \(choose from 'auto', 'bf16', 'fp32'\)"),
    ("packing: maybe\n", r"packing: expected true/false, got 'maybe'"),
    ("seq_lenn: 5\n", r"1 unsupported key: seq_lenn \(nearest flag: --seq_len\)"),
    ("seq_len: {a: 1}\n", r"seq_len: give a value or a list of values, not a nested mapping"),
    ("report_to: [[tensorboard]]\n", r"report_to: give a value or a list of values, not a nested list"),
    # 415 bytes of these allocated gigabytes and ended in MemoryError
    ('a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n'
     'c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n', r"line 2: the alias \*a is not allowed \(write the value out\)"),
    ("- 5\n", r"must hold a mapping of flag names to values"),
    ("seq_len: [5\n", r"is not valid YAML"),
])
def test_config_files_are_read_strictly_naming_the_file_and_key(tmp_path, text, message):
    """--config kept the last of two equal keys silently, exited 0 on `help: true`, let aliases expand without
    bound, and named a wrong value's flag but not the file."""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"^--config {re.escape(str(path))}:? " + message):
        parse_args(["--config", str(path)])


def test_config_file_values_are_taken_as_typed(tmp_path):
    """A value starting with -- was taken for a flag (argparse: "expected one argument")."""
    path = tmp_path / "run.yaml"
    path.write_text("output_dir: --odd-name\nweight_decay: -1e-2\nreport_to: [tensorboard, wandb]\npacking: true\n"
                    "steps: 3\n")
    cfg, explicit = parse_args(["--config", str(path), "--steps", "4"])
    assert (cfg.output.output_dir, cfg.optim.weight_decay, cfg.log.report_to, cfg.data.packing) == ("--odd-name", -0.01,
                                                                              "tensorboard,wandb", True)
    assert cfg.optim.steps == 4 and {"output_dir", "weight_decay", "report_to", "packing", "steps"} <= explicit


def test_slurm_environment():
    assert expand_nodelist("gpu[01-03,7],login1") == ["gpu01", "gpu02", "gpu03", "gpu7", "login1"]
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "n[4-5]",
           "SLURM_JOB_ID": "1234"}
    assert normalise_launcher_env(env) == "srun"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("3", "8", "1", "n4")
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    normalise_launcher_env(torchrun)
    assert torchrun["RANK"] == "1"


def test_ds_configs_are_valid_json():
    for name in ("zero3.json", "zero3_offload.json", "zero2.json"):
        json.load(open(os.path.join(REPO_ROOT, "ds_configs", name)))


@pytest.mark.parametrize("preset", ["tiny", "qwen3-0.6b", "qwen3-4b", "qwen3-8b", "qwen3-30b-a3b"])
def test_presets_build_configs_with_the_published_shapes(preset):
    from ulysses_train.model.build import load_model_config
    from ulysses_train.sp.layout import attention_heads
    from ulysses_train.tools.plan import geometry

    config = load_model_config(None, preset)
    billions = {"qwen3-0.6b": 0.6, "qwen3-4b": 4.0, "qwen3-8b": 8.2, "qwen3-30b-a3b": None}.get(preset)
    if billions:  # dense presets: parameter count as published
        assert geometry(config)["params"] / 1e9 == pytest.approx(billions, rel=0.05)
    q, kv = attention_heads(config)
    assert q % kv == 0 and config.model_type in ("qwen3", "qwen3_moe")


def test_attention_kernel_choice(monkeypatch):
    """auto takes FlashAttention-4 only where it runs (installed, CUDA, compute capability 9.0+, half precision);
    an explicit kernel that cannot run is an error that names the flag."""
    from ulysses_train.sp import kernels
    from ulysses_train.sp.kernels import resolve_kernel

    assert resolve_kernel("auto", "cpu") == "sdpa"
    monkeypatch.setattr(kernels, "kernel_available", lambda name: True)
    assert resolve_kernel("auto", "cuda", True, (9, 0)) == "flash_attn_4"
    assert resolve_kernel("auto", "cuda", True, (10, 0)) == "flash_attn_4"
    assert resolve_kernel("auto", "cuda", True, (8, 0)) == "sdpa"  # Ampere: FA4 has no kernels for it
    assert resolve_kernel("auto", "cuda", False, (9, 0)) == "sdpa"  # fp32: FA4 is bf16/fp16 only
    assert resolve_kernel("auto", "cpu", True) == "sdpa"
    # Gemma 4's global layers have heads of 512, wider than FA4 takes on SM90: auto is SDPA, an explicit FA4 refused
    assert resolve_kernel("auto", "cuda", True, (9, 0), head_dim=256) == "flash_attn_4"
    assert resolve_kernel("auto", "cuda", True, (9, 0), head_dim=512) == "sdpa"
    with pytest.raises(ConfigError, match="--attn_kernel flash_attn_4 takes heads of up to 256, .* heads of 512: use "
                                          "--attn_kernel sdpa"):
        resolve_kernel("flash_attn_4", "cuda", True, (9, 0), head_dim=512)
    with pytest.raises(ConfigError, match="--attn_kernel flash_attn_4 runs in bf16/fp16 only"):
        resolve_kernel("flash_attn_4", "cuda", False, (9, 0))
    with pytest.raises(ConfigError, match="--attn_kernel flash_attn_4 runs on CUDA GPUs only"):
        resolve_kernel("flash_attn_4", "cpu", True)
    monkeypatch.setattr(kernels, "kernel_available", lambda name: False)
    assert resolve_kernel("auto", "cuda", True, (9, 0)) == "sdpa"
    with pytest.raises(ConfigError, match="pip install flash-attn-4"):
        resolve_kernel("flash_attn_4", "cuda", True, (9, 0))


@pytest.mark.parametrize("argv, message", [
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--lr", "inf"], "--lr must be a finite number, got inf"),
    (["--min_lr_ratio", "nan"], "--min_lr_ratio must be a finite number, got nan"),
    (["--min_lr_ratio", "1.5"], r"--min_lr_ratio must be in \[0, 1\], got 1.5"),
    (["--min_lr_ratio=-0.1"], r"--min_lr_ratio must be in \[0, 1\], got -0.1"),
    (["--weight_decay=-1"], "--weight_decay must be >= 0, got -1.0"),
    (["--max_grad_norm=-inf"], "--max_grad_norm must be a finite number, got -inf"),
    (["--rope_factor", "nan"], "--rope_factor must be a finite number, got nan"),
    (["--checkpoint_layers=-1"], "--checkpoint_layers must be all, auto or a number of layers >= 0, got '-1'"),
    (["--checkpoint_layers", "half"], "--checkpoint_layers must be all, auto or a number of layers >= 0"),
    (["--checkpoint_layers", "4", "--gradient_checkpointing", "false"],
     "--checkpoint_layers 4 needs --gradient_checkpointing true"),
    (["--epochs", "0", "--dataset", "d.jsonl"], "--epochs must be positive, got 0.0"),
    (["--num_train_epochs", "2"], r"--epochs needs --dataset \(generated tokens never end"),
    (["--warmup_ratio", "1.5"], r"--warmup_ratio must be in \[0, 1\], got 1.5"),
    (["--adam_beta2", "1"], r"--adam_beta2 must be in \[0, 1\), got 1.0"),
    (["--adam_epsilon", "0"], "--adam_epsilon must be positive, got 0.0"),
    (["--warmup_steps", "40"], r"--warmup_steps must be in \[0, --steps=30\], got 40"),
    # seeds past 64 bits (seed x 1000003 for a sample's generator) crashed the run's first step with an OverflowError
    (["--seed", str(2**63)], r"--seed must be in \[0, 4294967295\], got 9223372036854775808: the data's and the "
                             r"initialisation's generators are seeded from it"),
    (["--seed=-1"], r"--seed must be in \[0, 4294967295\], got -1"),
])
def test_validate_rejects_non_finite_and_out_of_range_floats(argv, message):
    cfg, _ = parse_args(argv)
    with pytest.raises(ConfigError, match=message):
        cfg.validate()


def test_a_kernel_package_that_does_not_import_is_not_taken(monkeypatch, tmp_path):
    """FA4 found but broken (its CuTe DSL libraries missing, as a partial install leaves it): `auto` runs SDPA and
    says why, and an explicit --attn_kernel flash_attn_4 stops before the build with the import's error, where
    both used to pass the check and fail at the first layer on every rank."""
    import sys
    import warnings

    from ulysses_train.sp import kernels

    package = tmp_path / "flash_attn"
    (package / "cute").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "cute" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'cutlass'\")\n")
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    kernels._import_problem.cache_clear()
    try:
        assert not kernels.kernel_available("flash_attn_4")
        assert "No module named 'cutlass'" in kernels.kernel_problem("flash_attn_4")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert kernels.resolve_kernel("auto", "cuda", True, (9, 0), head_dim=128) == "sdpa"
        assert any("flash-attn-4 is installed but its import fails" in str(w.message) for w in caught)
        with pytest.raises(ConfigError, match="--attn_kernel flash_attn_4 needs the flash-attn-4 package, which is "
                                              "installed but its import fails .*cutlass.*--attn_kernel auto"):
            kernels.resolve_kernel("flash_attn_4", "cuda", True, (9, 0), head_dim=128)
    finally:
        kernels._import_problem.cache_clear()


def test_num_layers_beyond_the_models_depth_names_it():
    from ulysses_train.model.build import load_model_config

    with pytest.raises(ConfigError, match=r"--num_layers 40: qwen3-4b has 36 layers; give 1 to 36"):
        load_model_config(None, "qwen3-4b", 40)
    with pytest.raises(ConfigError, match=r"--num_layers 0: tiny has 2 layers"):
        load_model_config(None, None, 0)
    assert load_model_config(None, "qwen3-4b", 36).num_hidden_layers == 36


def _ds_file(tmp_path, text):
    path = tmp_path / "ds.json"
    path.write_text(text if isinstance(text, str) else json.dumps(text))
    return str(path)


@pytest.mark.parametrize("content, message", [
    ({"optimzer": {"type": "AdamW"}}, r"unknown top-level key 'optimzer' \(did you mean 'optimizer'\?\)"),
    ({"zero_optimisation": {"stage": 3}}, r"'zero_optimisation' \(did you mean 'zero_optimization'\?\)"),
    ({"my_own_setting": 1}, r"unknown top-level key 'my_own_setting'; DeepSpeed reads"),
    ('{"bf16": {"enabled": true}, "bf16": {"enabled": false}}', "key 'bf16' appears twice"),
    ("[1, 2]", "must hold a JSON object"),
    ("{", "is not valid JSON"),
])
def test_ds_config_typos_and_malformed_files_are_errors(tmp_path, content, message):
    path = _ds_file(tmp_path, content)
    with pytest.raises(ConfigError, match=rf"--ds_config {path}: .*{message}|--ds_config {path} {message}"):
        load_ds_config(path)
    cfg, _ = parse_args(["--ds_config", path])
    with pytest.raises(ConfigError, match=message):
        cfg.validate()


def test_shipped_ds_configs_pass_the_key_check():
    for name in os.listdir(os.path.join(REPO_ROOT, "ds_configs")):
        load_ds_config(os.path.join(REPO_ROOT, "ds_configs", name))


def test_the_key_allow_list_covers_every_top_level_key_deepspeed_reads():
    """DeepSpeedConfig parses a config through a dict that records each top-level key it looks up: all of them must
    be allowed (a DeepSpeed upgrade that reads a new key fails here, naming it)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from ulysses_train.train.config.ds_file import DEEPSPEED_TOP_LEVEL_KEYS

    read = set()

    class Recording(dict):
        def get(self, key, default=None):
            read.add(key)
            return dict.get(self, key, default)

        def __getitem__(self, key):
            read.add(key)
            return dict.__getitem__(self, key)

        def __contains__(self, key):
            read.add(key)
            return dict.__contains__(self, key)

        def keys(self):  # `key in config.keys()` is how DeepSpeed asks for some of them
            return self

        def __copy__(self):
            return self

    DeepSpeedConfig(Recording(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, train_batch_size=1,
                              zero_optimization={"stage": 3}))
    assert len(read) > 40, sorted(read)
    assert read <= set(DEEPSPEED_TOP_LEVEL_KEYS), sorted(read - set(DEEPSPEED_TOP_LEVEL_KEYS))


@pytest.mark.parametrize("argv", [["--data_format", "messages"], ["--chat_template", "t.jinja"],
                                  ["--loss_on", "assistant"], ["--truncation", "left"]])
def test_conversation_flags_need_a_dataset(argv):
    cfg, _ = parse_args(argv)
    with pytest.raises(ConfigError, match=rf"^{argv[0]} needs --dataset"):
        cfg.validate()
    parse_args(argv + ["--dataset", "chats.jsonl"])[0].validate()


def test_a_missing_chat_template_is_named_before_any_work(tmp_path):
    from ulysses_train.train.run.preflight import preflight

    (tmp_path / "chats.jsonl").write_text("")
    cfg, _ = parse_args(["--dataset", str(tmp_path / "chats.jsonl"), "--chat_template", str(tmp_path / "t.jinja")])
    with pytest.raises(ConfigError, match=rf"--chat_template {tmp_path}/t.jinja: no such file"):
        preflight(cfg)
