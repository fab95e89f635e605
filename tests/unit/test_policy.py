"""The planner and the trainer resolve the same levers: for a grid of models, sequence lengths and GPU counts, the
planner's answer for the default flags, and for every rung of its ladder given as the flags it prints, equals what
the trainer derives from those flags (its DeepSpeed config, micro-batch, tokens per rank) on the same machine."""

import dataclasses

import pytest

from ulysses_train.levers.policy import DeviceInfo, LeverRequest, resolve_levers
from ulysses_train.model.build import load_model_config
from ulysses_train.model.geometry import geometry
from ulysses_train.sp.dims import valid_sp_sizes
from ulysses_train.tools import plan
from ulysses_train.train.config.config_file import parse_args
from ulysses_train.train.config.ds_config import resolve_ds_config
from ulysses_train.train.config.ds_file import load_ds_config
from ulysses_train.train.run.trainer import run_layout, run_levers

GPU_GIB, HOST_GIB = 139.7, 125.0


def _trainer_side(argv: list[str], gpus: int, sp: int, host_gib: float = HOST_GIB):
    cfg, explicit = parse_args(argv)
    config = load_model_config(cfg.base.model, cfg.base.model_config, cfg.base.num_layers)
    ds = resolve_ds_config(load_ds_config(cfg.parallel.ds_config), cfg, explicit, gpus // sp, sp, config.hidden_size,
                           use_bf16=True, random_init=True)
    device = DeviceInfo.gpu(GPU_GIB, host_gib, local_ranks=min(gpus, 8))
    layout = run_layout(cfg, config, gpus, "cuda", (9, 0), local_ranks=lambda: min(gpus, 8))
    assert layout.sp_size == sp and layout.bf16
    return run_levers(cfg, config, ds, layout, device)


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "qwen3-4b", "qwen3-8b", "qwen3-30b-a3b"])
def test_planner_and_trainer_agree_on_every_lever(preset):
    g = geometry(load_model_config(None, preset))
    gpu, host = GPU_GIB * 2**30, HOST_GIB * 2**30
    checked = 0
    for seq_len in (32768, 131072, 1 << 20):
        for gpus in (1, 2, 8):
            for sp in valid_sp_sizes(gpus, g["heads"], g["kv"]):
                base = ["--model_config", preset, "--seq_len", str(seq_len), "--sp_size", str(sp)]
                default = plan.levers_for(LeverRequest(), g, seq_len, gpus, sp, gpu, host)
                trainer = _trainer_side(base, gpus, sp)
                assert trainer == default and trainer.why == default.why, (preset, seq_len, gpus, sp)
                for rung in plan._ladder(g, seq_len, gpus, sp, gpu, host, None):
                    assert _trainer_side(base + rung.flags().split(), gpus, sp) == rung, (rung.flags(), sp)
                    checked += 1
    assert checked > 50


def test_auto_decisions_and_their_reasons():
    g = geometry(load_model_config(None, "qwen3-4b"))
    h200 = DeviceInfo.gpu(GPU_GIB, HOST_GIB, local_ranks=1)
    short = resolve_levers(LeverRequest(), g, 65536, 2, h200)
    assert short.keep_attention and not short.tiled_mlp and short.fused_kernels and short.lean_norm
    assert "under" in short.why["keep_attention"] and "not over 2 GiB" in short.why["tiled_mlp"]
    long = resolve_levers(LeverRequest(offload_activations=True), g, 1 << 20, 2, h200)
    assert long.tiled_mlp and long.offload_activations  # one 1M x 9728 tensor is 19 GiB
    cpu = resolve_levers(LeverRequest(offload_activations=True), g, 4096, 4, DeviceInfo("cpu", 2**34, 2**34))
    assert not (cpu.keep_attention or cpu.offload_activations or cpu.fused_kernels or cpu.gqa_native is False)
    assert cpu.why["offload_activations"].startswith("needs CUDA")
    explicit = resolve_levers(LeverRequest(attn_recompute="never", tiled_mlp="on", lean_norm="off",
                                           fused_kernels="off"), g, 4096, 2, h200)
    assert explicit.keep_attention and explicit.tiled_mlp and not explicit.lean_norm and not explicit.fused_kernels
    assert not resolve_levers(LeverRequest(gradient_checkpointing=False, attn_recompute="never"), g, 4096, 2,
                              h200).keep_attention  # nothing is kept without checkpointing


def test_loss_kernel_auto_forced_and_refused():
    """auto: Liger's on CUDA where liger-kernel is installed, ours otherwise, each with its reason; a forced liger
    that cannot be is an error naming --loss_kernel; the flags the planner prints ask for what it resolved."""
    from ulysses_train.errors import ConfigError

    g = geometry(load_model_config(None, "qwen3-4b"))
    h200 = DeviceInfo.gpu(GPU_GIB, HOST_GIB, local_ranks=1)
    cpu = DeviceInfo("cpu", 2**34, 2**34)
    bare = DeviceInfo("cuda", 2**37, 2**37, liger=False)
    auto = resolve_levers(LeverRequest(), g, 65536, 2, h200)
    assert auto.loss_kernel == "liger" and auto.why["loss_kernel"] == "auto: Liger-Kernel's on CUDA"
    assert "--loss_kernel" not in auto.flags()
    on_cpu, without = (resolve_levers(LeverRequest(), g, 4096, 4, d) for d in (cpu, bare))
    assert on_cpu.loss_kernel == without.loss_kernel == "ours"
    assert "CUDA" in on_cpu.why["loss_kernel"] and "not installed" in without.why["loss_kernel"]
    ours = resolve_levers(LeverRequest(loss_kernel="ours"), g, 65536, 2, h200)
    assert ours.loss_kernel == "ours" and "loss_kernel" not in ours.why and "--loss_kernel ours" in ours.flags()
    assert _trainer_side(["--model_config", "qwen3-4b", "--seq_len", "65536", *ours.flags().split()], 1, 1) == ours
    assert resolve_levers(LeverRequest(loss_kernel="liger"), g, 4096, 4, cpu).loss_kernel == "liger"  # interpreter
    with pytest.raises(ConfigError, match="--loss_kernel liger: liger-kernel is not installed"):
        resolve_levers(LeverRequest(loss_kernel="liger"), g, 4096, 2, bare)
    with pytest.raises(ConfigError, match="--loss_kernel liger needs --loss fused"):
        resolve_levers(LeverRequest(loss="plain", loss_kernel="liger"), g, 4096, 2, h200)
    assert resolve_levers(LeverRequest(loss="plain"), g, 4096, 2, h200).loss_kernel == "ours"


def test_checkpoint_layers_number_auto_and_the_planner_agree():
    """`--checkpoint_layers`: a number is taken as given (0: no checkpointing), more than the model's layers is an
    error naming the flag; auto is the fewest layers for which `fits` holds (memory only falls as more layers are
    checkpointed), on the CPU every layer; and the trainer's auto equals the planner's for the same machine."""
    from ulysses_train.errors import ConfigError

    g = geometry(load_model_config(None, "qwen3-4b"))
    h200 = DeviceInfo.gpu(GPU_GIB, HOST_GIB, local_ranks=1)
    some = resolve_levers(LeverRequest(checkpoint_layers="10"), g, 65536, 2, h200)
    assert some.checkpointed(36) == 10 and some.checkpointing and "--checkpoint_layers 10" in some.flags()
    none = resolve_levers(LeverRequest(checkpoint_layers="0"), g, 65536, 2, h200)
    assert not none.checkpointing and not none.keep_attention and "--checkpoint_layers 0" in none.flags()
    assert resolve_levers(LeverRequest(checkpoint_layers="36"), g, 65536, 2, h200) == resolve_levers(
        LeverRequest(), g, 65536, 2, h200)
    with pytest.raises(ConfigError, match="--checkpoint_layers 37: the model has 36 layers"):
        resolve_levers(LeverRequest(checkpoint_layers="37"), g, 65536, 2, h200)
    asked = []
    auto = resolve_levers(LeverRequest(checkpoint_layers="auto"), g, 65536, 2, h200,
                          fits=lambda lv: asked.append(lv.checkpointed(36)) or lv.checkpointed(36) >= 20)
    assert auto.checkpointed(36) == 20 and asked == list(range(21)) and "20 of 36" in auto.why["checkpoint_layers"]
    cpu = resolve_levers(LeverRequest(checkpoint_layers="auto"), g, 4096, 4, DeviceInfo("cpu", 2**34, 2**34),
                         fits=lambda lv: True)
    assert cpu.checkpointed(36) == 36
    gpu, host = GPU_GIB * 2**30, HOST_GIB * 2**30
    for seq_len, gpus, sp in ((65536, 1, 1), (131072, 2, 2), (524288, 8, 8)):
        planned = plan.levers_for(LeverRequest(checkpoint_layers="auto"), g, seq_len, gpus, sp, gpu, host)
        trainer = _trainer_side(["--model_config", "qwen3-4b", "--seq_len", str(seq_len), "--sp_size", str(sp),
                                 "--checkpoint_layers", "auto"], gpus, sp)
        assert trainer == planned and trainer.why == planned.why and 0 < planned.checkpointed(36) < 36, seq_len
        fewer = dataclasses.replace(planned, checkpoint_layers=planned.checkpointed(36) - 1)
        assert plan.fits(plan.estimate(g, seq_len, gpus, sp, planned), gpu, host)
        assert not plan.fits(plan.estimate(g, seq_len, gpus, sp, fewer), gpu, host)


def test_attn_recompute_auto_keeps_the_outputs_where_the_whole_plan_leaves_room():
    """Qwen3-8B LoRA at 131k on one H200: the kept outputs (36.6 GiB) are over 15% of the device, but the planner's
    estimate of the whole run with them is 105 GiB of 140, under 80%: auto keeps them (the recompute skips the
    attention kernel). Full fine-tuning of the same model, or LoRA at 160k, leaves no such room; with
    `--checkpoint_layers auto`, the layer search spends the memory instead; without an estimate (`fits` None) the
    15% rule alone decides, as before."""
    from ulysses_train.levers.memory import estimate, fits

    argv = ["--model_config", "qwen3-8b", "--seq_len", "131072", "--rope_scaling", "yarn"]
    lora = _trainer_side(argv + ["--use_peft"], 1, 1)
    assert lora.keep_attention and "over 21.0 GiB" in lora.why["keep_attention"]
    assert "under 80% of the device and the host: kept" in lora.why["keep_attention"]
    cfg, _ = parse_args(argv + ["--use_peft"])
    from ulysses_train.train.run.trainer import run_geometry

    g = run_geometry(cfg, load_model_config(None, "qwen3-8b"))
    gpu, host = GPU_GIB * 2**30, HOST_GIB * 2**30
    planned = estimate(g, 131072, 1, 1, dataclasses.replace(lora, tiled_mlp=True))  # judged before the untiling
    assert fits(planned, gpu, host, 0.8) and not fits(planned, gpu, host, 0.7)
    assert not _trainer_side(argv, 1, 1).keep_attention  # full fine-tuning: no room
    longer = _trainer_side(["--model_config", "qwen3-8b", "--seq_len", "163840", "--use_peft"], 1, 1)
    assert not longer.keep_attention and "over 80%" in longer.why["keep_attention"]
    # judged with the layers the run checkpoints: 29 of 36 leave 7 layers' whole activations beside the outputs
    partial = _trainer_side(argv + ["--use_peft", "--checkpoint_layers", "29"], 1, 1)
    assert partial.checkpointed(36) == 29 and not partial.keep_attention
    assert "over 80%" in partial.why["keep_attention"] and fits(estimate(g, 131072, 1, 1, partial), gpu, host)
    assert not fits(estimate(g, 131072, 1, 1, dataclasses.replace(partial, keep_attention=True)), gpu, host)
    searched = _trainer_side(argv + ["--use_peft", "--checkpoint_layers", "auto"], 1, 1)
    assert not searched.keep_attention and "80%" not in searched.why["keep_attention"]
    assert 0 < searched.checkpointed(36) < 36
    no_estimate = resolve_levers(LeverRequest(), g, 131072, 2, DeviceInfo.gpu(GPU_GIB, HOST_GIB, local_ranks=1))
    assert not no_estimate.keep_attention and "80%" not in no_estimate.why["keep_attention"]
    assert plan.levers_for(LeverRequest(), g, 131072, 1, 1, gpu, host) == lora  # the planner decides the same


def test_tiled_mlp_auto_leaves_the_mlp_whole_where_the_whole_plan_leaves_room():
    """Qwen3-8B LoRA at 131k on one H200: one seq x intermediate tensor is 3 GiB (over the 2 GiB rule), but with the
    attention outputs kept the planner's estimate of the whole run untiled stays under 85% of the device: auto
    leaves the MLP whole (each tile's recompute is a third forward of the MLP: 3.0 s of a 43.3 s step, measured).
    The kept outputs are decided first (they save more). LoRA at 256k leaves no such room; with
    `--checkpoint_layers auto` the untiling is judged before the layer search spends what is left; `--tiled_mlp on`
    and an estimate-less resolve keep the tiles."""
    from ulysses_train.levers.memory import estimate, fits

    argv = ["--model_config", "qwen3-8b", "--seq_len", "131072", "--rope_scaling", "yarn", "--use_peft"]
    lora = _trainer_side(argv, 1, 1)
    assert lora.keep_attention and not lora.tiled_mlp
    assert "(over 2 GiB)" in lora.why["tiled_mlp"] and "under 85% of the device: whole" in lora.why["tiled_mlp"]
    cfg, _ = parse_args(argv)
    from ulysses_train.train.run.trainer import run_geometry

    g = run_geometry(cfg, load_model_config(None, "qwen3-8b"))
    gpu, host = GPU_GIB * 2**30, HOST_GIB * 2**30
    assert fits(estimate(g, 131072, 1, 1, lora), gpu, host, 0.85)
    assert not fits(estimate(g, 131072, 1, 1, lora), gpu, host, 0.8)  # the kept outputs' 80% rule would refuse it
    # at 160k the outputs are recomputed (over 80% with them), and the whole MLP fits beside the rest; at 256k not
    untiled = _trainer_side(["--model_config", "qwen3-8b", "--seq_len", "163840", "--use_peft"], 1, 1)
    assert not untiled.keep_attention and not untiled.tiled_mlp
    longer = _trainer_side(["--model_config", "qwen3-8b", "--seq_len", "262144", "--use_peft"], 1, 1)
    assert longer.tiled_mlp and "over 85%" in longer.why["tiled_mlp"]
    assert _trainer_side(argv + ["--tiled_mlp", "on"], 1, 1).tiled_mlp
    searched = _trainer_side(argv + ["--checkpoint_layers", "auto"], 1, 1)
    assert not searched.tiled_mlp and 0 < searched.checkpointed(36) < 36
    assert fits(estimate(g, 131072, 1, 1, searched), gpu, host)
    assert not fits(estimate(g, 131072, 1, 1, dataclasses.replace(searched, tiled_mlp=False,
                                                                  checkpoint_layers=searched.checkpointed(36) - 1)),
                    gpu, host)
    no_estimate = resolve_levers(LeverRequest(), g, 131072, 2, DeviceInfo.gpu(GPU_GIB, HOST_GIB, local_ranks=1))
    assert no_estimate.tiled_mlp and "85%" not in no_estimate.why["tiled_mlp"]
    assert plan.levers_for(LeverRequest(), g, 131072, 1, 1, gpu, host) == lora  # the planner decides the same


def test_the_plan_room_rules_apply_only_where_the_memory_estimate_is_measured():
    """auto spends memory on the planner's word only in the families whose peaks are measured against it (their
    record's `estimate_measured`; Gemma 3's within 5% with the current kernels, docs/memory.md). At 131k on one H200
    Gemma 3's plan leaves room for the whole MLP, and Gemma 3 untiles; the same geometry labelled as a family whose
    peaks are not measured (Gemma 2) keeps the tiles."""
    from ulysses_train.levers.memory import fits_on

    g = geometry(load_model_config(None, "gemma3-4b"))
    gpu, host = GPU_GIB * 2**30, HOST_GIB * 2**30
    device = DeviceInfo.gpu(GPU_GIB, HOST_GIB, local_ranks=1)
    fits = fits_on(g, 131072, 1, 1, gpu, host)
    gemma3 = resolve_levers(LeverRequest(), g, 131072, 2, device, fits=fits)
    assert not gemma3.tiled_mlp and "85%" in gemma3.why["tiled_mlp"]
    unmeasured = resolve_levers(LeverRequest(), {**g, "model_type": "gemma2"}, 131072, 2, device, fits=fits)
    assert unmeasured.tiled_mlp and "85%" not in unmeasured.why["tiled_mlp"]


def test_gpu_checkpoints_auto_grows_with_the_gpu_and_segments_only_where_gpu_and_host_fall_short():
    """`--gpu_checkpoints auto` with the offload (levers/placement.py): Qwen3-8B at 256k on one GPU (bf16 optimizer
    states) leaves every checkpoint on a host that holds them (125 GiB); on a host that does not (70 GiB) it keeps
    more checkpoints on the GPU the more memory the GPU has, each time the most under 90% of it (one more is over),
    all of them on a large enough GPU; `--checkpoint_every auto` stays 1 while GPU and host hold a checkpoint per
    layer, and only where they do not (a smaller host) takes the smallest k that fits."""
    from ulysses_train.levers.memory import estimate, fits
    from ulysses_train.levers.placement import GPU_CHECKPOINT_FRACTION

    g = geometry(load_model_config(None, "qwen3-8b"))
    request = LeverRequest(attn_recompute="always", tiled_mlp="on", offload_activations=True)
    seq_len, host, bf16 = 262144, 70 * 2**30, {"bf16_states": True}
    roomy = plan.levers_for(request, g, seq_len, 1, 1, 139.7 * 2**30, HOST_GIB * 2**30, bf16)
    assert roomy.gpu_checkpoints == 0 and "which holds them" in roomy.why["gpu_checkpoints"]
    placed = []
    for gpu_gib in (120, 139.7, 180, 400):
        levers = plan.levers_for(request, g, seq_len, 1, 1, gpu_gib * 2**30, host, bf16)
        placed.append(levers.gpu_checkpoints)
        assert levers.checkpoint_every == 1 and "checkpoint_every" not in levers.why
        if levers.gpu_checkpoints:  # (0: none fits under 90%, though the run may fit with all on the host)
            assert fits(estimate(g, seq_len, 1, 1, levers), gpu_gib * 2**30, host, GPU_CHECKPOINT_FRACTION,
                        host=False)
        if levers.gpu_checkpoints < 36:
            more = dataclasses.replace(levers, gpu_checkpoints=levers.gpu_checkpoints + 1)
            assert not fits(estimate(g, seq_len, 1, 1, more), gpu_gib * 2**30, host, GPU_CHECKPOINT_FRACTION,
                            host=False)
    assert 0 < placed[0] < placed[1] < placed[2] < placed[-1] == 36, placed
    assert "on the GPU" in levers.why["gpu_checkpoints"]
    # a small host: at 256k a checkpoint per layer no longer fits beside the GPU's; every k-th layer does
    small = 24 * 2**30
    segmented = plan.levers_for(request, g, seq_len, 1, 1, 139.7 * 2**30, small, bf16)
    k = segmented.checkpoint_every
    assert k > 1 and f"every {k} layers" in segmented.why["checkpoint_every"]
    assert fits(estimate(g, seq_len, 1, 1, segmented), 139.7 * 2**30, small)
    fewer = plan.levers_for(dataclasses.replace(request, checkpoint_every=str(k - 1)), g, seq_len, 1, 1,
                            139.7 * 2**30, small, bf16)
    assert fewer.checkpoint_every == k - 1 and not fits(estimate(g, seq_len, 1, 1, fewer), 139.7 * 2**30, small)


def test_gpu_checkpoints_and_checkpoint_every_as_numbers_and_what_the_planner_prints():
    """A number is taken as given, `all` is every checkpointed layer, more than the layers is an error naming the
    flag; without the offload every checkpoint is on the GPU already (0 placed, k 1 under auto); the flags the plan
    prints make the trainer resolve the same levers."""
    from ulysses_train.errors import ConfigError

    g = geometry(load_model_config(None, "qwen3-4b"))
    h200 = DeviceInfo.gpu(GPU_GIB, HOST_GIB, local_ranks=1)
    offload = LeverRequest(offload_activations=True)
    five = resolve_levers(dataclasses.replace(offload, gpu_checkpoints="5", checkpoint_every="3"), g, 65536, 2, h200)
    assert (five.gpu_checkpoints, five.checkpoint_every) == (5, 3)
    assert "--gpu_checkpoints 5 --checkpoint_every 3" in five.flags()
    assert resolve_levers(dataclasses.replace(offload, gpu_checkpoints="all", checkpoint_layers="20"), g, 65536, 2,
                          h200).gpu_checkpoints == 20
    with pytest.raises(ConfigError, match="--gpu_checkpoints must be auto, all or a number from 0 to 36"):
        resolve_levers(dataclasses.replace(offload, gpu_checkpoints="37"), g, 65536, 2, h200)
    with pytest.raises(ConfigError, match="--checkpoint_every must be auto, all or a number from 1 to 36"):
        resolve_levers(LeverRequest(checkpoint_every="0"), g, 65536, 2, h200)
    plain = resolve_levers(LeverRequest(), g, 65536, 2, h200, fits=lambda lv, *a, **k: False)
    assert (plain.gpu_checkpoints, plain.checkpoint_every) == (0, 1)  # nothing to place, no segments without offload
    every = resolve_levers(LeverRequest(checkpoint_every="2"), g, 65536, 2, h200)
    assert every.checkpoint_every == 2 and "--checkpoint_every 2" in every.flags()
    gpu, host = GPU_GIB * 2**30, 80 * 2**30  # a host that holds 256k's checkpoints, not 512k's
    for seq_len in (262144, 524288):
        planned = plan.levers_for(offload, g, seq_len, 1, 1, gpu, host)
        base = ["--model_config", "qwen3-4b", "--seq_len", str(seq_len), "--offload_activations"]
        trainer = _trainer_side(base, 1, 1, host_gib=80)
        assert trainer == planned and trainer.why == planned.why, seq_len
        assert (planned.gpu_checkpoints > 0) == (seq_len == 524288), (seq_len, planned.why)
        assert _trainer_side(base + planned.flags().split(), 1, 1, host_gib=80) == planned


def test_hybrid_models_count_kept_outputs_per_layer_type_and_keep_the_deltanet_outputs_last():
    """Qwen3.5-9B (24 Gated DeltaNet, 8 attention layers) at 131k on one H200 with the offload: the attention layers'
    kept outputs are 8 layers' (8.7 GB), not 32 layers' as if every layer attended (that count sent them over half
    the host with the checkpoints: recomputed); the DeltaNet layers' (39 GB) go over that rule and are kept by the
    plan's room (80 GiB of 125 planned); with a host of 96 GiB they are recomputed, and the trainer and the planner
    agree. A full-attention model has no such lever (None), and its flags do not name it."""
    from ulysses_train.levers.memory import checkpoint_split
    from ulysses_train.levers.policy import kept_outputs_bytes

    g = geometry(load_model_config(None, "qwen3.5-9b"))
    t, attention_out = 131072, 16 * 256 * 2 + 16 * 4
    assert kept_outputs_bytes(g, t, 2) == 8 * t * attention_out
    assert kept_outputs_bytes(g, t, 2, attention=False) == 24 * t * (32 * 128 * 2 + 32 * (64 * 2 + 4))
    argv = ["--model_config", "qwen3.5-9b", "--seq_len", "131072", "--offload_activations",
            "--ds_config", "ds_configs/zero3_bf16_states.json"]
    levers = _trainer_side(argv, 1, 1)
    assert levers.keep_attention and "under 62.5 GiB" in levers.why["keep_attention"]
    assert levers.keep_linear and "over 62.5 GiB" in levers.why["keep_linear"]
    assert "under 80% of the device and the host: kept" in levers.why["keep_linear"]
    assert "--attn_recompute never --linear_recompute never" in levers.flags()
    split = checkpoint_split(g, t, 2, levers)
    assert split["host kept"] == kept_outputs_bytes(g, t, 2) + kept_outputs_bytes(g, t, 2, attention=False)
    small_host = _trainer_side(argv, 1, 1, host_gib=96)
    assert small_host.keep_attention and small_host.keep_linear is False
    assert checkpoint_split(g, t, 2, small_host)["host kept"] == kept_outputs_bytes(g, t, 2)
    gpu = GPU_GIB * 2**30
    request = LeverRequest(offload_activations=True)
    for host_gib, want in ((HOST_GIB, levers), (96, small_host)):
        planned = plan.levers_for(request, g, t, 1, 1, gpu, host_gib * 2**30, {"bf16_states": True})
        assert planned == want and planned.why == want.why
    assert _trainer_side(argv + ["--linear_recompute", "always"], 1, 1).keep_linear is False
    assert _trainer_side(argv + ["--linear_recompute", "never"], 1, 1, host_gib=96).keep_linear
    dense = _trainer_side(["--model_config", "qwen3-4b", "--seq_len", "65536"], 1, 1)
    assert dense.keep_linear is None and "linear_recompute" not in dense.flags()
    cpu = resolve_levers(LeverRequest(linear_recompute="auto"), g, 4096, 4,
                         DeviceInfo("cpu", 2**36, 2**36))
    assert cpu.keep_linear is False and "CPU" in cpu.why["keep_linear"]


@pytest.mark.parametrize("host_gib,kept", [(125.0, True), (80.0, False)])
def test_kept_attention_by_the_plans_room_under_the_offload(host_gib, kept):
    """With the offload, `--attn_recompute auto` keeps the attention outputs beyond half the host (with the
    checkpoints) where the whole plan stays under 80% of the device and of the host: OLMo-3-7B at 131k on one H200
    with bf16 optimizer states (64.5 GiB of kept outputs and checkpoints, 68.5 GiB planned) keeps them with a 125 GiB
    host and not with an 80 GiB one; the trainer resolves the same from the same flags."""
    g = geometry(load_model_config(None, "olmo3-7b"))
    flags = ["--model_config", "olmo3-7b", "--seq_len", "131072", "--offload_activations", "--ds_config",
             "ds_configs/zero3_bf16_states.json"]
    planned = plan.levers_for(LeverRequest(offload_activations=True), g, 131072, 1, 1, GPU_GIB * 2**30,
                              host_gib * 2**30, {"zero_stage": 3, "bf16_states": True})
    assert planned.keep_attention is kept
    assert planned.why["keep_attention"].endswith(
        "under 80% of the device and the host: kept" if kept else "over 80% of the device and the host")
    assert _trainer_side(flags, 1, 1, host_gib=host_gib) == planned
