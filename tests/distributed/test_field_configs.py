"""A TRL or axolotl user's own config, unchanged: every key of TRL's SFTConfig / DPOConfig (and its scripts'
ModelConfig and ScriptArguments) has a meaning here or a reason; the keys with a meaning read as our settings; the
rest are refused in one message; and a TRL SFT YAML and an axolotl YAML, in the shape of their published examples
(TRL's trl/scripts configs, axolotl's examples/qwen3/*.yaml) pointing at a tiny local model and data, train."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import yaml

from ulysses_train.errors import ConfigError
from ulysses_train.train.config import aliases, field_keys
from ulysses_train.train.config.config_file import NOT_SETTINGS, config_from, parse_args
from ulysses_train.train.config.train_config import FLAGS

# the keys of axolotl's examples/qwen3/*.yaml and of the settings the issue names (axolotl's schema has hundreds)
AXOLOTL_KEYS = ("base_model", "load_in_8bit", "load_in_4bit", "strict", "chat_template", "datasets",
                "dataset_prepared_path", "val_set_size", "output_dir", "sequence_len", "sample_packing",
                "eval_sample_packing", "adapter", "lora_model_dir", "lora_r", "lora_alpha", "lora_dropout",
                "lora_target_linear", "lora_target_modules", "wandb_project", "wandb_entity", "wandb_watch",
                "wandb_name", "wandb_log_model", "gradient_accumulation_steps", "micro_batch_size", "num_epochs",
                "optimizer", "lr_scheduler", "learning_rate", "bf16", "tf32", "gradient_checkpointing",
                "gradient_checkpointing_kwargs", "resume_from_checkpoint", "logging_steps", "attn_implementation",
                "flash_attention", "warmup_ratio", "evals_per_epoch", "saves_per_epoch", "weight_decay", "fsdp",
                "fsdp_config", "special_tokens", "plugins", "sequence_parallel_degree", "context_parallel_size",
                "lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel", "hub_model_id")


def _known(name: str) -> bool:
    return name in FLAGS or name in aliases.BY_NAME or field_keys.is_field_key(name) or name in NOT_SETTINGS


def test_every_key_of_trls_configs_and_axolotls_examples_has_a_meaning_or_a_reason():
    trl = pytest.importorskip("trl")
    classes = (trl.SFTConfig, trl.DPOConfig, trl.ModelConfig, trl.ScriptArguments)
    names = {f.name for cls in classes for f in dataclasses.fields(cls)}
    assert len(names) > 150 and not [n for n in sorted(names) if not _known(n)]
    assert not [n for n in AXOLOTL_KEYS if not _known(n)]
    # a name means one thing: no alias is a table key (axolotl's datasets: --datasets, whose entries a file's
    # translation reads)
    assert set(aliases.BY_NAME) & (set(field_keys.BY_NAME) | set(field_keys.CONTEXT_KEYS)) == {"datasets"}


def _cfg(values: dict):
    return config_from(values)[0]


def test_the_field_keys_read_as_our_settings():
    axolotl = _cfg({"base_model": "m", "adapter": "qlora", "load_in_4bit": True, "lora_target_linear": True,
                    "sample_packing": True, "sequence_parallel_degree": 2, "lr_scheduler": "linear", "bf16": "auto",
                    "flash_attention": True, "val_set_size": 0.05, "gradient_checkpointing": "offload",
                    "wandb_project": None, "optimizer": "adamw_torch_fused", "tiled_mlp": True,
                    "datasets": [{"path": "chats.jsonl", "type": "chat_template", "field_messages": "conversations",
                                  "message_property_mappings": {"role": "from", "content": "value"},
                                  "roles": {"assistant": ["gpt", "model"]}}]})
    assert (axolotl.base.model, axolotl.adapters.use_peft, axolotl.adapters.load_in_4bit,
            axolotl.adapters.lora_target_modules, axolotl.data.packing, axolotl.parallel.sp_size,
            axolotl.optim.lr_scheduler_type, axolotl.base.dtype, axolotl.levers.attn_kernel, axolotl.eval.val_set_size,
            axolotl.levers.offload_activations, axolotl.levers.tiled_mlp) == (
        "m", True, True, "all-linear", True, 2, "linear", "auto", "flash_attn", 0.05, True, "on")
    assert axolotl.data.dataset == {"path": "chats.jsonl", "data_format": "messages", "messages_field": "conversations",
                                    "role_map": {"gpt": "assistant", "model": "assistant"}}
    # TRL's max_length is the sequence length of SFT and the pair's longest side in preference training
    assert _cfg({"max_length": 512}).data.seq_len == 512 and parse_args(["--max_length", "512"])[0].data.seq_len == 512
    dpo = _cfg({"max_length": 512, "seq_len": 2048, "method": "dpo", "dataset": "pairs.jsonl"})
    assert (dpo.pref.max_length, dpo.data.seq_len) == (512, 2048)
    assert _cfg({"loss_type": "nll"}).pref.loss_type == "sigmoid"  # SFT's default loss, ours
    trl = _cfg({"model_name_or_path": "m", "dtype": "bfloat16", "dataset_name": "d", "eval_strategy": "steps",
                "eval_steps": 5, "dataset_test_split": "validation", "save_strategy": "no", "warmup_steps": 0.1,
                "lr_scheduler_kwargs": {"min_lr_rate": 0.0}, "truncation_mode": "keep_end", "push_to_hub": False})
    assert (trl.base.dtype, trl.eval.eval_dataset, trl.eval.eval_split, trl.eval.eval_steps, trl.output.save_steps,
            trl.output.save_final, trl.optim.warmup_ratio, trl.optim.min_lr_ratio, trl.sft.truncation) == (
        "bf16", "d", "validation", 5, 0, False, 0.1, 0.0, "left")
    assert _cfg({"dataset": "d", "eval_strategy": "no", "dataset_test_split": "test"}).eval.eval_dataset is None
    # axolotl evaluates nothing without an eval set: evals_per_epoch is then unset
    assert _cfg({"dataset": "d", "evals_per_epoch": 4, "val_set_size": 0.0}).eval.evals_per_epoch is None
    with pytest.raises(ConfigError, match=r"--max_length 512 is the sequence length of an SFT run .* but --seq_len is "
                                          r"1024: keep one"):
        _cfg({"max_length": 512, "seq_len": 1024})


def test_every_key_without_a_meaning_is_refused_in_one_message_with_what_to_use():
    with pytest.raises(ConfigError) as error:
        _cfg({"fsdp": ["full_shard"], "plugins": ["liger"], "hub_model_id": "me/model", "fp16": True,
              "adapter": "ia3", "load_in_8bit": True, "optim": "adamw_8bit", "loss_type": "dft",
              "datasets": [{"path": "a.jsonl", "type": "alpaca"}], "chat_template": "qwen3",
              "eval_strategy": "steps", "use_peft": True, "lora_target_linear": True, "lora_target_modules": "q_proj",
              "lernin_rate": 1e-4})
    message = str(error.value)
    assert message.startswith("the settings dict: 13 unsupported keys: ") and "\n" not in message
    for expected in ("fsdp (ZeRO-3 (--ds_config) shards", "plugins (the fused loss (--loss_kernel)",
                     "hub_model_id (checkpoints stay in --output_dir", "fp16 (fp16 is not supported",
                     "adapter ('ia3': the adapters here are lora and qlora)", "load_in_8bit (--load_in_4bit",
                     "optim (the optimizer is torch's AdamW", "loss_type ('dft': SFT's loss here",
                     "datasets[0].type ('alpaca': the formats read here are chat_template",
                     "chat_template ('qwen3' names one of axolotl's built-in templates",
                     "eval_strategy (evaluation needs an eval set",
                     "lora_target_modules (gives --lora_target_modules q_proj, but lora_target_linear: True gives "
                     "all-linear: keep one)", "lernin_rate (nearest flag: --lr)"):
        assert expected in message, expected
    # a translation and a key that agree are one setting
    assert _cfg({"adapter": "qlora", "load_in_4bit": True}).adapters.load_in_4bit is True


# ---------------------------------------------------------------- the field's files, trained as they are

TRL_SFT = """# trl sft --config sft.yaml (the shape of TRL's trl/scripts configs)
model_name_or_path: {model}
dtype: float32
attn_implementation: sdpa
dataset_name: {chats}
dataset_train_split: train
dataset_test_split: train
dataset_num_proc: 1
max_length: 128
packing: false
assistant_only_loss: true
learning_rate: 3.0e-3
lr_scheduler_type: cosine
lr_scheduler_kwargs: {{}}
warmup_ratio: 0.1
num_train_epochs: 1
max_steps: 4
per_device_train_batch_size: 2
gradient_accumulation_steps: 1
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: false
eval_strategy: steps
eval_steps: 2
per_device_eval_batch_size: null
logging_steps: 1
save_strategy: steps
save_steps: 4
save_total_limit: 1
bf16: false
fp16: false
seed: 42
report_to: none
push_to_hub: false
output_dir: {out}
use_peft: true
lora_r: 8
lora_alpha: 16
lora_dropout: 0.0
lora_target_modules: all-linear
"""

AXOLOTL = """# axolotl train lora.yaml (the shape of axolotl's examples/qwen3/*.yaml)
base_model: {model}
load_in_8bit: false
load_in_4bit: false
strict: false

chat_template: tokenizer_default
datasets:
  - path: {sharegpt}
    type: chat_template
    field_messages: conversations
    message_property_mappings:
      role: from
      content: value
dataset_prepared_path: {cache}
val_set_size: 0.25
output_dir: {out}

sequence_len: 128
sample_packing: true
eval_sample_packing: true

adapter: lora
lora_model_dir:
lora_r: 8
lora_alpha: 16
lora_dropout: 0.0
lora_target_linear: true

wandb_project:
wandb_entity:
wandb_watch:
wandb_name:
wandb_log_model:

gradient_accumulation_steps: 1
micro_batch_size: 2
num_epochs: 2
optimizer: adamw_torch_fused
lr_scheduler: cosine
learning_rate: 0.003

bf16: auto
tf32: true

gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: false
resume_from_checkpoint:
logging_steps: 1
attn_implementation: sdpa

warmup_ratio: 0.1
evals_per_epoch: 2
saves_per_epoch: 1
weight_decay: 0.0
special_tokens:
"""


@pytest.fixture(scope="module")
def field_runs(tmp_path_factory):
    """The tiny model folder (weights, tokenizer with its chat template), the data, and each file trained by
    launch/train.py --config FILE, as a user runs it."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.sft_fixtures import CHATML_QWEN, arithmetic_chats, tiny_tokenizer, write_jsonl
    from tests.trainer_runs import ROOT, TRAIN, child_env
    from ulysses_train.model.build import load_model_config

    folder = tmp_path_factory.mktemp("field")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(load_model_config(None, "tiny")).save_pretrained(folder / "model")
    tiny_tokenizer(template=CHATML_QWEN).save_pretrained(folder / "model")
    chats = arithmetic_chats(24)
    paths = {"model": str(folder / "model"), "cache": str(folder / "cache"),
             "chats": write_jsonl(folder / "chats.jsonl", chats),
             "sharegpt": write_jsonl(folder / "sharegpt.jsonl", [
                 {"conversations": [{"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
                                    for m in row["messages"]]} for row in chats])}
    runs = {}
    for name, text in (("trl", TRL_SFT), ("axolotl", AXOLOTL)):
        out = folder / name
        config = folder / f"{name}.yaml"
        config.write_text(text.format(out=out, **paths))
        proc = subprocess.run([sys.executable, TRAIN, "--config", str(config), "--data_cache_dir", paths["cache"]],
                              cwd=ROOT, env=child_env(), capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        records = [json.loads(line) for line in open(out / "metrics.jsonl")]
        resolved = {k: v for group in yaml.safe_load(open(out / "config.yaml")).values() for k, v in group.items()}
        runs[name] = {"records": records, "config": resolved, "out": out, "stdout": proc.stdout}
    return runs


def test_a_trl_sft_yaml_trains_as_written(field_runs):
    run = field_runs["trl"]
    config, records = run["config"], run["records"]
    assert (config["seq_len"], config["loss_on"], config["use_peft"], config["dtype"], config["eval_dataset"],
            config["eval_steps"], config["steps"], config["lr"]) == (128, "assistant", True, "fp32",
                                                                     config["dataset"], 2, 4, 3e-3)
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]  # eval_strategy steps, every 2
    assert records[-1]["loss"] < records[0]["loss"]
    assert os.path.isdir(run["out"] / "checkpoints" / "step_00000004")


def test_an_axolotl_yaml_trains_as_written_with_its_held_out_eval_set(field_runs):
    run = field_runs["axolotl"]
    config, records = run["config"], run["records"]
    assert (config["use_peft"], config["lora_target_modules"], config["packing"], config["val_set_size"],
            config["dtype"], config["tf32"], config["epochs"]) == (True, "all-linear", True, 0.25, "auto", True, 2.0)
    steps = config["steps"]
    per_epoch = steps // 2
    evaluated = [r["step"] for r in records if "eval_loss" in r]
    assert evaluated == sorted(set(range(max(1, per_epoch // 2), steps + 1, max(1, per_epoch // 2))) | {steps})
    assert "held out as the eval set" in run["stdout"]
