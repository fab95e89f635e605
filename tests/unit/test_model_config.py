"""--model_config and --model read through transformers' AutoConfig, then refused before anything is built when the
trainer cannot run them: unsupported kinds of model by name, and sizes, lengths and rotary values by field."""

import json
import subprocess
import sys

import pytest
from transformers import AutoConfig

from tests.trainer_runs import ROOT, child_env
from ulysses_train.errors import ConfigError
from ulysses_train.model.build import load_model_config

TINY_QWEN3 = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16)

UNSUPPORTED = {  # model_type -> what the refusal calls it
    "nemotron_h": "state-space \\(Mamba\\) model or Mamba hybrid", "falcon_h1": "state-space",
    "mamba2": "state-space", "mamba": "state-space", "jamba": "state-space",
    "llava": "multimodal wrapper", "qwen2_vl": "multimodal wrapper",
    "bert": "an encoder \\(bidirectional attention\\)", "t5": "an encoder-decoder",
    "gpt2": "learned absolute positions \\(GPT-2 style",
}


@pytest.mark.parametrize("model_type", UNSUPPORTED)
def test_an_unsupported_kind_of_model_is_refused_by_name(model_type, tmp_path):
    """transformers' own saved config.json (with its `{"__float__": "Infinity"}` values, which a plain JSON reader
    handed to AutoConfig.for_model failed on) loads, as a file and as a folder, and is refused in one line that
    names the model type and what it is."""
    AutoConfig.for_model(model_type).save_pretrained(tmp_path)
    for spec in (str(tmp_path / "config.json"), str(tmp_path)):
        with pytest.raises(ConfigError, match=rf"^--model_config {spec}: model type '{model_type}' is .*"
                                              rf"{UNSUPPORTED[model_type]}") as e:
            load_model_config(None, spec)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("model_type", ["bert", "mamba2", "llama"])
def test_a_malformed_value_is_refused_in_one_line_before_transformers_validates_it(model_type, tmp_path):
    """`rope_parameters: [0]` (a list where transformers expects a mapping): a config of a family the trainer does
    not train is refused as that kind of model, from its model_type alone, before transformers parses the values
    (its rope validator raised AttributeError on bert's); one the trainer trains is refused as transformers refuses
    it, in one line naming the flag. Found by the probe suite (tests/unit/test_probes.py)."""
    values = dict(model_type=model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=300,
                  max_position_embeddings=256, rope_parameters=[0])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(values))
    message = (UNSUPPORTED[model_type] if model_type in UNSUPPORTED else
               "transformers refuses the config: .*rope_parameters")
    with pytest.raises(ConfigError, match=rf"^--model_config {path}: .*{message}") as e:
        load_model_config(None, str(path))
    assert "\n" not in str(e.value)


def test_a_validator_that_breaks_on_a_value_is_a_refusal_naming_the_flag(tmp_path, monkeypatch):
    """transformers' validators assume the types they check later (`.get` on a rope mapping): an AttributeError
    from them is the config's fault, refused in one line, not a traceback."""
    from transformers import AutoConfig as Auto

    def broken(*args, **kwargs):
        raise AttributeError("'list' object has no attribute 'get'")
    monkeypatch.setattr(Auto, "from_pretrained", broken)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(AutoConfig.for_model("qwen3", **TINY_QWEN3).to_dict()))
    with pytest.raises(ConfigError, match=rf"^--model_config {path}: transformers refuses the config: "
                                          "AttributeError: 'list' object has no attribute 'get'"):
        load_model_config(None, str(path))


def test_a_size_nulled_through_its_alias_is_refused_by_name(tmp_path):
    """GPT-OSS's `num_experts` is an alias of `num_local_experts` (transformers' attribute_map): null there passes
    transformers' type check of `num_local_experts` and leaves it None, which the model would be built without
    (the geometry failed on it with a TypeError). Refused by the name the file uses. Found by the probe suite."""
    values = dict(model_type="gpt_oss", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=300,
                  max_position_embeddings=256, num_experts=None)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(values))
    with pytest.raises(ConfigError, match=rf"^--model_config {path}: num_experts is None; it must be a positive "
                                          "whole number \\(the model type's default is 128\\)$"):
        load_model_config(None, str(path))
    values["num_experts"] = 4
    path.write_text(json.dumps(values))
    assert load_model_config(None, str(path)).num_local_experts == 4


@pytest.mark.parametrize("model_type, layer_type, builders", [
    ("gemma2", "linear_attention", "its config has no linear_num_value_heads"),
    ("gemma2", "chunked_attention", "its config has no attention_chunk_size"),
    ("llama", "sliding_attention", "its config has no sliding_window")])
def test_a_layer_type_its_family_does_not_build_is_refused(model_type, layer_type, builders, tmp_path):
    """Gemma 2 builds full attention for every layer type but a sliding one, Llama for every one: a layer listed
    as Gated DeltaNet, chunked or sliding attention would have been planned and sharded as that (the geometry
    failed on the missing DeltaNet sizes, the layer plan on Llama's missing window). Refused naming the layer and
    what builds it. Found by the probe suite."""
    values = dict(model_type=model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=300,
                  max_position_embeddings=256, layer_types=["full_attention", layer_type])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(values))
    with pytest.raises(ConfigError) as e:
        load_model_config(None, str(path))
    assert str(e.value).startswith(f"--model_config {path}: model type '{model_type}': layer 1 is of type "
                                   f"'{layer_type}', which its modeling file does not build ({builders})"), str(e.value)


@pytest.mark.parametrize("field, value, message", [
    ("num_attention_heads", -8, "num_attention_heads is -8; it must be a positive whole number"),
    ("hidden_size", 0, "hidden_size is 0; it must be a positive whole number"),
    ("max_position_embeddings", float("nan"), "transformers refuses the config: .*max_position_embeddings"),
    ("rope_theta", float("inf"), "rope_theta is inf; it must be a positive finite number"),
    ("rope_theta", 5.0, "rope_theta 5.0 differs from rope_parameters.rope_theta 10000.0"),
    ("rope_parameters", {"rope_type": "yarn", "factor": -4.0, "rope_theta": 1e6},
     "rope_parameters.factor is -4.0; it must be a positive finite number"),
    ("num_key_value_heads", 0, "num_key_value_heads is 0"),
    ("pad_token_id", 512, "pad_token_id is 512, not a token of its 512-token vocabulary: give it a token id below "
                          "512 or null"),
    ("pad_token_id", -1, "pad_token_id is -1, not a token"),
])
def test_a_size_or_rope_value_the_trainer_cannot_run_is_refused_by_field(field, value, message, tmp_path):
    values = AutoConfig.for_model("qwen3", **TINY_QWEN3).to_dict()
    values[field] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(values))
    with pytest.raises(ConfigError, match=rf"^--model_config {path}: {message}"):
        load_model_config(None, str(path))


def test_a_folder_and_a_transformers_saved_config_load(tmp_path):
    """A model folder's config.json, saved by transformers with per-layer-type rope parameters, loads as
    --model_config; a name that is neither a preset, a file, a folder nor a hub id is refused."""
    from tests.models import frontier_config

    frontier_config("olmo3").save_pretrained(tmp_path)
    config = load_model_config(None, str(tmp_path))
    assert config.model_type == "olmo3" and set(config.rope_parameters) == {"full_attention", "sliding_attention"}
    with pytest.raises(ConfigError, match="not a preset .* nor a hub id"):
        load_model_config(None, "./no/such/config.json")


@pytest.mark.slow
def test_the_trainer_and_the_planner_refuse_an_unsupported_model_with_exit_2(tmp_path):
    """Before any model or engine is built: exit 2 and one error line, from the trainer and from the planner."""
    AutoConfig.for_model("mamba2").save_pretrained(tmp_path / "mamba2")
    config = str(tmp_path / "mamba2" / "config.json")
    for cmd in ([sys.executable, "launch/train.py", "--model_config", config, "--output_dir", str(tmp_path / "out")],
                [sys.executable, "-m", "ulysses_train.plan", "--model_config", config, "--seq_len", "8192"]):
        proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
        errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1, proc.stdout + proc.stderr
        assert "model type 'mamba2' is a state-space (Mamba) model" in errors[0]
        assert "Traceback" not in proc.stdout + proc.stderr


def test_the_widest_head_is_read_from_every_layer():
    """Gemma 4's global layers set their own head_dim (per_layer_config) or global_head_dim: the kernel choice
    reads the widest (FA4 takes up to 256 on SM90; with 512 it crashed the defaults on the GPU)."""
    from ulysses_train.model.build import PRESETS
    from ulysses_train.sp.layout import widest_head_dim

    gemma4 = AutoConfig.for_model("gemma4_text", num_hidden_layers=2, layer_types=["sliding_attention",
                                                                                   "full_attention"],
                                  per_layer_config={"1": {"head_dim": 512}})
    assert widest_head_dim(gemma4) == 512
    assert widest_head_dim(AutoConfig.for_model(**PRESETS["gemma3-4b"])) == 256
    assert widest_head_dim(AutoConfig.for_model(**PRESETS["tiny"])) == 16


def test_a_size_that_differs_between_layers_is_not_taken_for_a_null():
    """Gemma 4's per_layer_config lets a size differ by layer, and transformers then refuses to give one value for
    it (a RuntimeError, which `hasattr` does not catch): the check for sizes set to null passes over such a size,
    which the per-layer check covers."""
    from ulysses_train.model.config_check import check_model_config

    gemma4 = AutoConfig.for_model("gemma4_text", vocab_size=96, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  per_layer_config={"1": {"intermediate_size": 256}})
    check_model_config(gemma4, "--model_config gemma4")


class _Planted:
    """Unpickling this would call print: a stand-in for code planted in a pickled weights file."""

    def __reduce__(self):
        return (print, ("planted code ran",))


@pytest.mark.slow
def test_a_pickled_weights_file_with_objects_is_refused_naming_the_file(tmp_path):
    """torch's weights_only refusal came through with its advice to turn the protection off, and no file name:
    now one line naming the file and what to do, exit 2, and the planted object never runs."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "model"
    AutoModelForCausalLM.from_config(load_model_config(None, "tiny")).save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save({**state, "planted": _Planted()}, folder / "pytorch_model.bin")
    proc = subprocess.run([sys.executable, "launch/train.py", "--model", str(folder), "--tokenizer", "bytes",
                           "--steps", "1", "--output_dir", str(tmp_path / "out")], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stdout + proc.stderr
    assert f"{folder / 'pytorch_model.bin'} holds Python objects besides tensors" in errors[0]
    assert "weights_only=False" not in proc.stderr and "planted code ran" not in proc.stdout + proc.stderr


def test_an_unknown_model_type_is_one_line_naming_it_and_the_families(tmp_path):
    """transformers' refusal of an unknown model_type was a paragraph about upgrading, cut mid-word at 300
    characters; it is now one line naming the type and the families the trainer trains."""
    from ulysses_train.sp.support import FAMILIES

    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(TINY_QWEN3, model_type="qwen3x")))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(path.read_text())
    for flag, name, load in (("--model_config", path, lambda: load_model_config(None, str(path))),
                             ("--model", folder, lambda: load_model_config(str(folder), None))):
        with pytest.raises(ConfigError) as error:
            load()
        assert str(error.value) == (f"{flag} {name}: model_type 'qwen3x' is not a model type transformers knows (a "
                                    f"typo, or a newer transformers'?); the trainer trains {', '.join(FAMILIES)}")


def test_a_model_without_an_attention_layer_is_refused(tmp_path):
    """Qwen3.5's pattern (three linear-attention layers, then a full-attention one) at two layers has no attention
    layer: the trainer crashed planning its memory (`ValueError: max() arg is an empty sequence`)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(TINY_QWEN3, model_type="qwen3_5_text")))
    with pytest.raises(ConfigError, match=rf"^--model_config {path}: none of its 2 layers is an attention layer \(all "
                                          rf"linear_attention\), which the trainer plans its sequence parallelism "
                                          rf"from: give layer_types a full_attention layer$"):
        load_model_config(None, str(path))
    path.write_text(json.dumps(dict(TINY_QWEN3, model_type="qwen3_5_text", num_hidden_layers=4)))
    assert load_model_config(None, str(path)).layer_types[-1] == "full_attention"
    with pytest.raises(ConfigError, match=r"cut to --num_layers 3: none of its 3 layers is an attention layer .*: "
                                          r"give --num_layers a larger number$"):
        load_model_config(None, str(path), num_layers=3)
