"""Kept input projections (`--keep_projections`, levers/projections.py) on the CPU: the recompute of a layer that
keeps them skips exactly its marked projections' matmuls, the loss and every gradient are those of the plain
recompute bit for bit, and with the offload the kept outputs go to the host, exactly their bytes, as the planner's
memory estimate counts them. A dense model (Qwen3), a Gated DeltaNet one (Qwen3.5, the rule's exact reference
standing in for FLA's kernels) and a windowed one with post-norms (OLMo 3)."""

import contextlib
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.model_runs import checkpointed_loss
from tests.models import any_tiny_config, use_reference_deltanet_kernels
from ulysses_train.levers.projections import PROJECTION_OPS, is_kept, is_projection

SEQ = 48


class CountMatmuls(TorchDispatchMode):
    """Counts the matmuls that run (below the checkpoint's modes: a kept one returned from storage never gets here)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in PROJECTION_OPS
        return func(*args, **(kwargs or {}))


def _served(monkeypatch) -> CountMatmuls:
    """Counts, negated, the matmuls the recompute returns from storage instead of running them
    (checkpointing.UseKeptOutputs)."""
    from ulysses_train.levers import checkpointing

    counted, serve = CountMatmuls(), checkpointing.UseKeptOutputs.__torch_dispatch__

    def counting(mode, func, types, args=(), kwargs=None):
        counted.calls -= func in PROJECTION_OPS and is_kept(func, mode.ops)
        return serve(mode, func, types, args, kwargs)
    monkeypatch.setattr(checkpointing.UseKeptOutputs, "__torch_dispatch__", counting)
    return counted


def _step(name: str, keep_projections: int, monkeypatch, offload: bool = False, adapters=None):
    """Loss, gradients, the matmuls of the backward (recompute included), the host bytes of the offload, and the
    kept projections' output widths per layer, of a tiny `name` model (with LoRA `adapters` if given) checkpointed
    on every layer."""
    model, loss, hooks = checkpointed_loss(name, SEQ, offload,
                                           dict(keep_attention=True, keep_projections=keep_projections), adapters)
    # the rule's exact reference (Qwen3.5) runs torch.func in its backward, which no Python mode may wrap: there the
    # count is of the matmuls the recompute took from storage instead of running them
    with monkeypatch.context() as patch:
        counter = CountMatmuls() if name != "qwen3_5_text" else contextlib.nullcontext(_served(patch))
        with counter as counted:
            loss.backward()
    widths = [sum(m.out_features for n, m in layer.named_modules()
                  if isinstance(m, torch.nn.Linear) and is_projection(n.removesuffix(".base_layer")))
              for layer in model.model.layers]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.item(), grads, counted.calls, hooks.host_bytes if hooks else 0, widths


@pytest.fixture
def reference_kernels(monkeypatch):
    return use_reference_deltanet_kernels(monkeypatch)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5_text", "olmo3"])
def test_kept_projections_skip_their_matmuls_and_change_nothing(name, reference_kernels, monkeypatch):
    base_loss, base_grads, base_calls, _, widths = _step(name, 0, monkeypatch)
    layers = len(widths)
    counts = {}
    for kept in (1, layers):
        loss, grads, calls, _, _ = _step(name, kept, monkeypatch)
        counts[kept] = base_calls - calls
        assert loss == base_loss
        for param, ref in base_grads.items():
            assert torch.equal(grads[param], ref), param
    marked = {"qwen3": 3, "qwen3_5_text": 4, "olmo3": 3}[name]  # q, k, v; a DeltaNet layer's qkv, z, b, a
    # every layer of the tiny Qwen3.5 but its attention layer (q, k, v) is a DeltaNet layer
    per_layer = [3 if i == layers - 1 and name == "qwen3_5_text" else marked for i in range(layers)]
    assert counts == {1: per_layer[0], layers: sum(per_layer)}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_kept_projections_under_lora_keep_the_frozen_base_matmul_alone(dropout, monkeypatch):
    """Under --use_peft (LoRA on every linear layer, its dropout's masks included) a layer keeps the output of each
    projection's frozen base matmul (PEFT's base_layer) and its recompute runs the adapters' own matmuls again: the
    loss and every trainable gradient are those of the plain recompute bit for bit, and q, k, v's base matmuls, one
    a projection, are what the recompute skips."""
    from ulysses_train.model.adapters import AdapterSpec

    spec = AdapterSpec(r=4, alpha=8.0, dropout=dropout)
    base_loss, base_grads, base_calls, _, widths = _step("qwen3", 0, monkeypatch, adapters=spec)
    loss, grads, calls, _, _ = _step("qwen3", len(widths), monkeypatch, adapters=spec)
    assert loss == base_loss and grads.keys() == base_grads.keys() and len(grads) > 0
    assert all("lora_" in name for name in grads)
    for param, ref in base_grads.items():
        assert torch.equal(grads[param], ref), param
    assert base_calls - calls == 3 * len(widths)


def test_the_offload_moves_the_kept_projections_to_the_host(reference_kernels, monkeypatch):
    """Each layer's kept projection outputs (its widths x tokens x 4 bytes, fp32 model) go to the host with its input:
    the host holds exactly their bytes more."""
    _, base_grads, _, inputs_only, widths = _step("qwen3", 0, monkeypatch, offload=True)
    _, grads, _, with_kept, _ = _step("qwen3", len(widths), monkeypatch, offload=True)
    assert with_kept - inputs_only == SEQ * 4 * sum(widths)
    for param, ref in base_grads.items():
        assert torch.equal(grads[param], ref), param


def test_the_memory_estimate_counts_the_kept_projections_as_the_offload_holds_them(reference_kernels, monkeypatch):
    """The planner's bytes for the kept projections (policy.projection_bytes, fp32 here) are the host bytes the
    offload holds for them, layer by layer of a Qwen3.5 (DeltaNet and attention layers)."""
    from ulysses_train.levers.policy import projection_bytes
    from ulysses_train.model.geometry import geometry

    _, _, _, inputs_only, widths = _step("qwen3_5_text", 0, monkeypatch, offload=True)
    _, _, _, with_kept, _ = _step("qwen3_5_text", len(widths), monkeypatch, offload=True)
    g = geometry(any_tiny_config("qwen3_5_text"))
    assert [projection_bytes(g, shape, SEQ, 4) for shape in g["layer_shapes"]] == [SEQ * 4 * w for w in widths]
    assert with_kept - inputs_only == sum(projection_bytes(g, shape, SEQ, 4) for shape in g["layer_shapes"])


def test_the_flag_resolves_to_the_first_checkpointed_layers_and_the_planner_times_it():
    """all is every checkpointed layer, a number at most those; out-of-range values are errors naming the flag; the
    levers' flags ask for the same again; the time model's step is shorter with them kept (their matmuls leave the
    recompute) and the host holds their bytes."""
    from ulysses_train.errors import ConfigError
    from ulysses_train.levers.memory import estimate
    from ulysses_train.levers.policy import DeviceInfo, LeverRequest, resolve_levers
    from ulysses_train.levers.time_model import Run, step_time
    from ulysses_train.model.build import load_model_config
    from ulysses_train.model.geometry import geometry

    g = geometry(load_model_config(None, "qwen3.5-9b"))
    h200 = DeviceInfo.gpu(139.7, 125.0, 1)
    bf16 = {"zero_stage": 3, "bf16_states": True}

    def levers(**request):
        return resolve_levers(LeverRequest(offload_activations=True, **request), g, 65536, 2, h200, bf16)
    assert levers(keep_projections="all").keep_projections == 32
    assert levers(keep_projections="8", checkpoint_layers="3").keep_projections == 3
    assert "--keep_projections 16" in levers(keep_projections="16").flags()
    assert "--keep_projections 0" in levers(keep_projections="0").flags()
    for bad in ("33", "-1", "some"):
        with pytest.raises(ConfigError, match="--keep_projections"):
            levers(keep_projections=bad)
    none, every = levers(keep_projections="0"), levers(keep_projections="all")
    assert step_time(Run(g, 65536, 1, 1, every, kernel="sdpa"))["total"] < \
        step_time(Run(g, 65536, 1, 1, none, kernel="sdpa"))["total"]
    assert estimate(g, 65536, 1, 1, every)["host_total"] > estimate(g, 65536, 1, 1, none)["host_total"]


def _planned(preset: str, seq_len: int, host_gib: float = 125.0, model_type: str = "", **request):
    """The planner's levers (the trainer's: tests/unit/test_policy.py) for `preset` (its geometry labelled as
    `model_type` if given) on one H200 with the offload."""
    from ulysses_train.levers.policy import LeverRequest
    from ulysses_train.model.build import load_model_config
    from ulysses_train.model.geometry import geometry
    from ulysses_train.tools.plan import levers_for

    g = geometry(load_model_config(None, preset))
    g = {**g, "model_type": model_type} if model_type else g
    return g, levers_for(LeverRequest(offload_activations=True, **request), g, seq_len, 1, 1, 139.7 * 2**30,
                         host_gib * 2**30, {"zero_stage": 3, "bf16_states": True})


# Qwen3.5-9B with the offload on one H200: how many layers keep their projections under auto, by host size
AUTO_COUNTS = {(65536, 125.0): 32, (65536, 100.0): 24, (65536, 90.0): 16, (65536, 70.0): 0, (65536, 60.0): 0,
               (131072, 125.0): 0}


@pytest.mark.parametrize("seq_len,host_gib", list(AUTO_COUNTS))
def test_auto_keeps_the_fastest_count_that_fits(seq_len, host_gib):
    """`--keep_projections auto` (the default) on a GPU: of none and a quarter, half, three quarters or all of the
    checkpointed layers, the count with the shortest step by the time model among those whose whole plan stays
    under 80% of the device and the host, and none where that saves under 1%; its reason names the choice. Qwen3.5-9B
    with the offload on one H200: all 32 at 64k (the step 2.7% shorter), fewer on a smaller host, none where the
    fastest that fits saves under 1% (70 GiB), where not even 8 layers' fit (60 GiB) and at 131k."""
    from ulysses_train.levers.memory import estimate, fits
    from ulysses_train.levers.policy import KEEP_PLAN_FRACTION, KEEP_PROJECTIONS_MIN_GAIN
    from ulysses_train.levers.time_model import Run, step_time

    g, auto = _planned("qwen3.5-9b", seq_len, host_gib)

    def seconds(k):
        return step_time(Run(g, seq_len, 1, 1, dataclasses.replace(auto, keep_projections=k)))["total"]

    def room(k):
        return fits(estimate(g, seq_len, 1, 1, dataclasses.replace(auto, keep_projections=k)), 139.7 * 2**30,
                    host_gib * 2**30, KEEP_PLAN_FRACTION, host_share=KEEP_PLAN_FRACTION)
    fitting = [k for k in (8, 16, 24, 32) if room(k)]
    best = min(fitting, key=seconds, default=0)
    expected = best if fitting and seconds(best) <= (1 - KEEP_PROJECTIONS_MIN_GAIN) * seconds(0) else 0
    assert auto.keep_projections == expected == AUTO_COUNTS[seq_len, host_gib], auto.why["keep_projections"]
    reason = auto.why["keep_projections"]
    if expected:
        assert reason.startswith(f"auto: {expected} of 32") and seconds(expected) < seconds(0)
    elif fitting:
        assert reason.startswith("auto: none: the fastest that fits saves") and "under 1%" in reason
    else:
        assert reason.startswith("auto: none: with 8 layers' the whole plan is over 80%")


@pytest.mark.parametrize("preset,flag,value", [("qwen3.5-9b", "gpu_checkpoints", "all"),
                                               ("olmo3-7b", "gpu_checkpoints", "all"),
                                               ("qwen3-8b", "checkpoint_every", "2")])
def test_auto_judges_the_checkpoints_where_the_flags_put_them(preset, flag, value):
    """With `--gpu_checkpoints` or `--checkpoint_every` given as numbers, auto judges the run as those place it: the
    kept projections of layers whose checkpoints stay on the GPU take the GPU's memory (with every checkpoint there,
    keeping them all would not fit an H200), and with segments the time model's step is the segments' (where kept
    projections no longer pay). The plan auto leaves fits; every count it passed over that fits is no faster."""
    from ulysses_train.levers.memory import estimate, fits
    from ulysses_train.levers.time_model import Run, step_time

    g, auto = _planned(preset, 65536, **{flag: value})
    _, unplaced = _planned(preset, 65536)
    assert unplaced.keep_projections == g["layers"]  # with the checkpoints placed by auto: every layer keeps them
    assert auto.keep_projections < g["layers"]
    gib = 2**30
    assert fits(estimate(g, 65536, 1, 1, auto), 139.7 * gib, 125 * gib)
    every = dataclasses.replace(auto, keep_projections=g["layers"])
    assert not fits(estimate(g, 65536, 1, 1, every), 139.7 * gib, 125 * gib) or \
        step_time(Run(g, 65536, 1, 1, every))["total"] >= step_time(Run(g, 65536, 1, 1, auto))["total"]


def test_auto_keeps_none_without_a_gpu_a_measured_estimate_or_projections():
    """auto keeps none on the CPU, in a family whose memory estimate is not measured (Gemma 3's geometry labelled as
    Gemma 2, where Gemma 3 itself keeps all 34), where no layer is checkpointed, and where the model has no
    projections to keep (Qwen2's are biased); a number is kept as given."""
    from ulysses_train.levers.policy import DeviceInfo, LeverRequest, resolve_levers
    from ulysses_train.model.build import load_model_config
    from ulysses_train.model.geometry import geometry

    g = geometry(load_model_config(None, "qwen3.5-9b"))
    cpu = resolve_levers(LeverRequest(), g, 4096, 4, DeviceInfo("cpu", 2**34, 2**34))
    assert cpu.keep_projections == 0 and cpu.why["keep_projections"] == "auto: none (the CPU)"
    _, gemma3 = _planned("gemma3-4b", 65536)
    _, unmeasured = _planned("gemma3-4b", 65536, model_type="gemma2")
    assert gemma3.keep_projections == 34 and unmeasured.keep_projections == 0
    assert "no memory estimate measured" in unmeasured.why["keep_projections"]
    _, whole = _planned("qwen3.5-9b", 65536, checkpoint_layers="0")
    assert whole.keep_projections == 0 and "keep_projections" not in whole.why
    _, given = _planned("qwen3.5-9b", 65536, keep_projections="5")
    assert given.keep_projections == 5 and "keep_projections" not in given.why
    qwen2 = geometry(any_tiny_config("qwen2"))
    biased = resolve_levers(LeverRequest(), qwen2, 4096, 2, DeviceInfo.gpu(139.7, 125.0, 1), fits=lambda *a, **k: True,
                            seconds=lambda levers: 1.0)
    assert biased.keep_projections == 0 and "no input projections" in biased.why["keep_projections"]


FAMILY_NAMES = ["qwen3", "llama", "qwen2", "qwen3_moe", "mistral", "gemma2", "gemma3_text", "gemma4_text", "olmo3",
                "gpt_oss", "llama4_text", "smollm3", "qwen3_5_text", "qwen3_next", "qwen3_5_moe_text"]


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_the_planner_counts_what_each_family_marks(name):
    """Per layer of every family the trainer runs: the output widths of the layers mark_projections marks are the
    geometry's `input_projection_width` the planner counts (Gemma 4's shared-KV and k-equals-v layers have fewer
    projections; Qwen2's and GPT-OSS's biased ones are not kept)."""
    from transformers import AutoModelForCausalLM

    from ulysses_train.levers.projections import mark_projections
    from ulysses_train.model.geometry import geometry

    config = any_tiny_config(name)
    model = AutoModelForCausalLM.from_config(config)
    layers = model.model.layers if hasattr(model.model, "layers") else model.model.language_model.layers
    g = geometry(config)
    for layer, shape in zip(layers, g["layer_shapes"]):
        marked = [m for n, m in layer.named_modules()
                  if isinstance(m, torch.nn.Linear) and m.bias is None and is_projection(n)]
        assert sum(m.out_features for m in marked) == shape.input_projection_width, (name, shape.span)
        assert mark_projections(layer) == len(marked)
    if name in ("qwen2", "gpt_oss"):
        assert all(shape.input_projection_width == 0 for shape in g["layer_shapes"] if shape.span.attention)


def test_a_kept_output_changed_in_place_is_an_error():
    """DeepSpeed's ZeRO-3 linear adds a bias in place to the matmul's output (why biased layers are not marked):
    any such write into a kept output after the forward stored it stops the recompute with an error rather than
    handing it the changed values."""
    from ulysses_train.levers import projections
    from ulysses_train.levers.checkpointing import make_checkpoint_fn

    linear = torch.nn.Linear(8, 8, bias=False)
    projections.mark_projections(torch.nn.ModuleDict({"q_proj": linear}))
    checkpointed = make_checkpoint_fn(False, None, keep_projections=True)

    def layer(x, in_place):
        y = linear(x)
        if in_place:
            y += 1.0
        return (y * x).sum()
    x = torch.randn(4, 8, requires_grad=True)
    checkpointed(layer, x, False).backward()
    with pytest.raises(RuntimeError, match="changed in place after the forward stored it"):
        checkpointed(layer, x, True).backward()
