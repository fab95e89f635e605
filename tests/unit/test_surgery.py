"""Every patch of model/surgery.py takes exactly the modules it declares, in every supported family, on the
installed transformers. A release that changes one of these modules (its norm, rotary or MLP no longer computing
what we replace) fails here, and the trainer then refuses a lever its flag asked for and turns an `auto` one off,
saying why, instead of running with fewer patched modules than the planner counts."""

import pytest
import torch

from tests.models import any_tiny_config
from tests.patch_counts import EXPECTED
from ulysses_train.errors import ConfigError
from ulysses_train.levers.fused_kernels import kernels_run_on
from ulysses_train.levers.policy import LeverRequest, Levers
from ulysses_train.model.surgery import apply_levers

DEVICE = torch.device("cpu")
LAYERS = 2  # tests/models.py
ALL_ON = Levers(keep_attention=True, tiled_mlp=True, lean_norm=True, fused_kernels=True)


def _model(family):
    from transformers import AutoModelForCausalLM

    from ulysses_train.sp.attention import register_ulysses_attention

    register_ulysses_attention(None, "sdpa")
    return AutoModelForCausalLM.from_config(any_tiny_config(family), attn_implementation="ulysses")


def _apply(model, levers, request):
    return apply_levers(model, levers, request, DEVICE, torch.float32, loss_chunk_size=16, mlp_tile_tokens=8,
                        offload=None)


@pytest.mark.skipif(not kernels_run_on(DEVICE), reason="the fused kernels need Triton (its interpreter on the CPU)")
@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_every_patch_takes_the_modules_it_declares(family):
    levers, report = _apply(_model(family), ALL_ON, LeverRequest(tiled_mlp="auto", fused_kernels="auto"))
    assert {name: done for name, (done, _) in report.counts.items()} == EXPECTED[family]
    if family in ("qwen3", "llama", "mistral", "qwen2", "qwen3_moe"):  # the families whose modules all match
        assert all(done == expected for done, expected in report.counts.values()), report.counts
        assert levers.fused_kernels and levers.lean_norm and levers.keep_attention
    # Qwen3-MoE has no dense MLP to tile: auto turns the lever off, and says so
    assert levers.tiled_mlp == (EXPECTED[family]["tiled MLP"] > 0)
    if family == "qwen3_moe":
        assert levers.why["tiled_mlp"].startswith("auto: off, no module of Qwen3MoeForCausalLM")
        with pytest.raises(ConfigError, match="--tiled_mlp: no module of this Qwen3MoeForCausalLM matched"):
            _apply(_model(family), ALL_ON, LeverRequest(tiled_mlp="on", fused_kernels="auto"))


def test_a_norm_that_stops_matching_is_an_error_when_asked_for_and_off_under_auto(monkeypatch):
    """As if transformers changed Qwen3's RMSNorm to an arithmetic no norm rule has (an offset of 2): nothing matches
    any more."""
    from transformers.models.qwen3 import modeling_qwen3

    def unknown(self, x):
        x32 = x.float()
        return ((2 + self.weight.float()) * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    monkeypatch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", unknown)
    lean_only = Levers(keep_attention=False, fused_kernels=False)
    with pytest.raises(ConfigError, match="--lean_norm: no module of this Qwen3ForCausalLM matched"):
        _apply(_model("qwen3"), lean_only, LeverRequest(lean_norm="on", fused_kernels="off"))
    levers, report = _apply(_model("qwen3"), lean_only, LeverRequest(lean_norm="auto", fused_kernels="off"))
    assert report.counts["RMSNorm"] == (0, 9) and not levers.lean_norm
    assert levers.why["lean_norm"].startswith("auto: off")
    with pytest.raises(ConfigError, match="--lean_norm: no module"):  # asked for: whatever else the fused kernels patch
        _apply(_model("qwen3"), ALL_ON, LeverRequest(lean_norm="on", fused_kernels="auto"))


def test_the_rotary_patch_changes_nothing_global():
    """The patched attention reads our rotary through its own copy of the module globals: the modeling file keeps
    its function, and a second, unpatched model of the same family uses transformers' own."""
    import sys

    model = _model("qwen3")
    modeling = sys.modules[type(model.model.layers[0].self_attn).__module__]
    original = modeling.apply_rotary_pos_emb
    from ulysses_train.model.surgery import install_fused_rotary

    assert install_fused_rotary(model) == LAYERS
    assert modeling.apply_rotary_pos_emb is original
    assert type(model.model.layers[0].self_attn).__module__ == modeling.__name__
    assert type(_model("qwen3").model.layers[0].self_attn) is not type(model.model.layers[0].self_attn)


CHECKPOINT_COUNTER = """
import json, sys, torch
from transformers import AutoModelForCausalLM
import ulysses_train.levers.checkpointing as ckpt
from tests.models import tiny_config
from ulysses_train import train

calls = []
plain = ckpt.checkpoint
def counted(function, *args, **kwargs):
    calls.append(function.__self__.training if hasattr(function, "__self__") else None)
    return plain(function, *args, **kwargs)
ckpt.checkpoint = counted
folder, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
AutoModelForCausalLM.from_config(tiny_config("qwen3")).save_pretrained(folder)
counts = {}
for name, source in (("pretrained", {"model": folder, "tokenizer": "bytes"}), ("built", {"model_config": "tiny"})):
    calls.clear()
    train({**source, "seq_len": 64, "steps": 2, "output_dir": f"{out}/{name}", "save_final": False})
    counts[name] = len(calls)
print("COUNTS " + json.dumps(counts), flush=True)
"""


@pytest.mark.slow
def test_a_pretrained_model_is_checkpointed_like_a_built_one(tmp_path):
    """transformers' `from_pretrained` returns the model in eval mode, and its layers checkpoint only in training
    mode: a `--model` run trained without any checkpointing (every layer's activations kept: QLoRA at 434k tokens
    on the H200 peaked 18.7 GiB over LoRA, and offloaded nothing) while a `--model_config` run checkpointed. Both
    now checkpoint every layer at every step."""
    import json
    import subprocess
    import sys

    from tests.trainer_runs import ROOT, child_env

    driver = tmp_path / "driver.py"
    driver.write_text(CHECKPOINT_COUNTER)
    env = {k: v for k, v in child_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(driver), str(tmp_path / "model"), str(tmp_path / "out")], cwd=ROOT,
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    counts = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("COUNTS "))[7:])
    layers = 2  # tiny_config's
    assert counts == {"pretrained": 2 * layers, "built": 2 * layers}, counts
