"""Every supported family on the GPU with the trainer's defaults (marked gpu, skipped without CUDA).

Each case is a published checkpoint's shape (a preset, or the config.json values of the checkpoint named beside it)
cut to two layers that keep one of each of its layer types (a window or chunk layer and a full one, a Gated
DeltaNet layer and an attention one), so every kernel the family runs at full depth runs here, at its real head
count, head size, window and vocabulary. MoE families keep their expert width and routing but fewer experts where
the real count would not fit two runs on one GPU (said per case): the count changes no kernel's shape.

Two checks per family, both with every lever at its default (the attention kernel `auto`: FlashAttention-4 where
it is installed and takes the model's heads, else SDPA; the fused kernels; kept attention; Liger's loss):
- `test_family_trains_two_steps_with_the_defaults`: two optimizer steps at 8,192 tokens, finite losses and norms;
- `test_family_verifies_in_bf16_with_the_defaults`: `--verify` in bf16 against plain transformers on the same
  weights and tokens, at 4,096 tokens, passes (docs/verify.md says what it holds the run to).

Run side by side (`-n 4`), each launch first takes the GPU memory the planner gives its run (tests/gpu/gpu_share.py):
the cases range from 12 to 36 GiB, and five of them at once do not fit an 80 GiB H100. Each test also records what
it measured (steps, or the verify's setup, seconds by part and errors) as properties, which `--junitxml=FILE` keeps
where pytest-xdist's workers swallow the printed lines.

This is the test that would have caught OLMo 3's crash with the defaults (its fused rotary returned fp32 q and k
beside a bf16 v) and Gemma 4's (global heads of 512, wider than FA4 takes): the CPU suite ran the families in fp32
and without the GPU's kernels (tests/unit/test_fused_kernels.py now runs them in bf16 too).
"""

import json
import math
import sys

import pytest

from tests.gpu.gpu_share import gpu_share, planned_gib, verify_gib
from tests.trainer_runs import metrics, run

pytestmark = pytest.mark.gpu

# name -> (model_type or preset, config values over it, what was cut besides the depth)
FAMILIES = {
    "qwen3": ("qwen3-4b", {}, ""),
    # meta-llama/Llama-3.1-8B
    "llama": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                            vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                            tie_word_embeddings=False,
                            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 8192}), ""),
    # mistralai/Mistral-7B-v0.3
    "mistral": ("mistral", dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                num_key_value_heads=8, vocab_size=32768, max_position_embeddings=32768,
                                rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False,
                                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), ""),
    # Qwen/Qwen2.5-7B
    "qwen2": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                            vocab_size=152064, max_position_embeddings=131072, rms_norm_eps=1e-6,
                            tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), ""),
    "qwen3_moe": ("qwen3-30b-a3b", {}, ""),
    # google/gemma-2-9b
    "gemma2": ("gemma2", dict(hidden_size=3584, intermediate_size=14336, num_attention_heads=16,
                              num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
                              attn_logit_softcapping=50.0, final_logit_softcapping=30.0, vocab_size=256000,
                              layer_types=["sliding_attention", "full_attention"]), ""),
    "gemma3_text": ("gemma3-4b", dict(layer_types=["sliding_attention", "full_attention"]), ""),
    # transformers' Gemma4TextConfig defaults (google/gemma-4-e2b's text model)
    "gemma4_text": ("gemma4_text", dict(layer_types=["sliding_attention", "full_attention"],
                                        per_layer_config={"1": {"head_dim": 512}}), ""),
    "olmo3": ("olmo3-7b", dict(layer_types=["sliding_attention", "full_attention"]), ""),
    "gpt_oss": ("gpt-oss-20b", {}, ""),
    # transformers' Llama4TextConfig defaults (meta-llama/Llama-4-Scout-17B-16E's text model)
    "llama4_text": ("llama4_text", dict(layer_types=["chunked_attention", "full_attention"], no_rope_layers=[1, 0],
                                        num_local_experts=4), "4 of 16 experts"),
    "qwen3_5_text": ("qwen3.5-9b", dict(layer_types=["linear_attention", "full_attention"]), ""),
    "qwen3_next": ("qwen3-next-80b-a3b", dict(layer_types=["linear_attention", "full_attention"], num_experts=64),
                   "64 of 512 experts"),
}
SEQ_LEN = "8192"
VERIFY_SEQ_LEN = "4096"


def family_config(name: str, tmp_path) -> str:
    """The case's config.json, two layers deep, written for --model_config."""
    from transformers import AutoConfig

    from ulysses_train.model.build import PRESETS

    base, values, _ = FAMILIES[name]
    if base in PRESETS:
        values = {**PRESETS[base], **values}
    else:
        values = {**AutoConfig.for_model(base).to_dict(), **values}
    values["num_hidden_layers"] = 2
    if "layer_types" in values and len(values["layer_types"]) != 2:  # one layer type throughout (Qwen2, GPT-OSS)
        values["layer_types"] = values["layer_types"][:2]
    values.setdefault("model_type", base)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(values))
    return str(path)


def _skip_without_its_kernel(name: str) -> None:
    """Gemma 2's attention softcap has no SDPA kernel on CUDA: without FA4 or FA2 the run is refused (by design)."""
    from ulysses_train.sp.kernels import kernel_available

    if name == "gemma2" and not (kernel_available("flash_attn_4") or kernel_available("flash_attn")):
        pytest.skip("Gemma 2's softcap needs FlashAttention-4 or FA2 on CUDA, and neither is installed")


@pytest.mark.parametrize("name", FAMILIES)
def test_family_trains_two_steps_with_the_defaults(name, tmp_path, record_property):
    _skip_without_its_kernel(name)
    flags = ["--model_config", family_config(name, tmp_path), "--steps", "2", "--lr", "1e-4", "--save_final", "false",
             "--ds_config", "ds_configs/zero3_bf16_states.json"]
    with gpu_share(planned_gib(flags, int(SEQ_LEN)), name):
        proc = run([sys.executable], flags + ["--seq_len", SEQ_LEN], tmp_path / "run")
    records = metrics(tmp_path / "run")
    record_property("steps", json.dumps(records))  # before the checks: a failing run's steps are kept too
    assert len(records) == 2, proc.stdout[-2000:]
    for r in records:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0, r
    print(f"{name}: " + "; ".join(f"step {r['step']} loss {r['loss']:.4f} {r['step_time_s']:.2f} s "
                                   f"{r['peak_mem_gib']:.1f} GiB" for r in records))


@pytest.mark.parametrize("name", FAMILIES)
def test_family_verifies_in_bf16_with_the_defaults(name, tmp_path, record_property):
    _skip_without_its_kernel(name)
    config = family_config(name, tmp_path)
    with gpu_share(verify_gib(["--model_config", config], int(VERIFY_SEQ_LEN)), name):
        proc = run([sys.executable], ["--verify", "--model_config", config, "--seq_len", SEQ_LEN,
                                      "--verify_seq_len", VERIFY_SEQ_LEN], tmp_path / "run", expect_ok=False)
    report = tmp_path / "run" / "verify" / "verify.json"
    assert report.exists(), f"--verify wrote no report:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads(report.read_text())
    for key in ("setup", "seconds", "ours", "transformers"):
        record_property(key, json.dumps(result.get(key)))
    assert result["dtype"] == "bfloat16" and not result["buffer_mismatches"], result
    assert proc.returncode == (0 if result["passed"] else 1)
    assert result["passed"], proc.stdout[-3000:]
    seconds = result["seconds"]
    print(f"{name}: verify passed, {seconds['ours']:.0f} s for our step and its gathers, "
          f"{seconds['reference']:.0f} s for the references (fp32 {seconds['truth_reference']:.0f} s, bf16 "
          f"{seconds['dtype_reference']:.0f} s, comparing {seconds['compare']:.0f} s)")
