"""The planner's arithmetic on a small config, checked against values computed by hand here."""

import inspect
import re

import pytest
from transformers import AutoConfig

from tests.models import TINY, qwen2_28_heads_config, tiny_config
from ulysses_train.levers.policy import GiB, Levers
from ulysses_train.model.geometry import geometry
from ulysses_train.sp.dims import valid_sp_sizes
from ulysses_train.tools.plan import estimate, main, plan


def sp_sizes(g: dict, gpus: int) -> list[int]:
    return valid_sp_sizes(gpus, g["heads"], g["kv"])


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "llama"])
def test_geometry_counts_the_parameters_of_the_real_model(family):
    from transformers import AutoModelForCausalLM

    config = tiny_config(family)
    model = AutoModelForCausalLM.from_config(config)
    assert geometry(config)["params"] == sum(p.numel() for p in model.parameters())


def test_components_by_hand():
    g = geometry(tiny_config("qwen3"))  # hidden 64, heads 8 x head_dim 8, kv 4, inter 128, vocab 96, 2 layers
    n = g["params"]
    e = estimate(g, seq_len=1024, gpus=4, sp=2, levers=Levers(keep_attention=True), loss_chunk=256)
    t = 512
    assert e["tokens_per_rank"] == t
    assert e["gpu"]["checkpoints"] == 2 * t * 64 * 2
    assert e["gpu"]["kept outputs"] == 2 * t * (64 * 2 + 8 * 4)  # output, and fp32 log-sum-exp per head
    assert e["gpu"]["model states"] == pytest.approx(2 * n / 4 + 14 * n / 4 + 4 * g["layer_params"])
    assert e["gpu"]["loss"] == 256 * 96 * 6 + 96 * 64 * 4 + 2 * t * 64 * 2
    assert e["gpu"]["all-to-all buffers"] == t * (64 + 2 * max(32, 16)) * 2  # the received q, k, v
    from ulysses_train.levers.memory import CUDA_OVERHEAD, NCCL_GROUP_BYTES

    assert e["gpu"]["NCCL buffers"] == NCCL_GROUP_BYTES  # an SP group's NCCL, beside the transient layer
    alone = estimate(g, seq_len=512, gpus=2, sp=1, levers=Levers(keep_attention=True), loss_chunk=256)
    assert "NCCL buffers" not in alone["gpu"] and alone["gpu"]["all-to-all buffers"] == 0
    transient = max(e["gpu"]["layer working set"] + e["gpu"]["all-to-all buffers"], e["gpu"]["loss"])
    assert e["gpu_total"] == pytest.approx(e["gpu"]["model states"] + e["gpu"]["checkpoints"] + e["gpu"]["kept outputs"]
                                           + transient + NCCL_GROUP_BYTES + CUDA_OVERHEAD)
    offloaded = estimate(g, 1024, 4, 2, Levers(offload_activations=True, bf16_states=True))
    assert offloaded["gpu"]["checkpoints"] == 0
    assert offloaded["gpu"]["kept outputs"] == 0  # the offload takes the kept attention outputs too
    assert offloaded["host"]["offloaded checkpoints"] == 4 * 2 * t * (64 * 2 + 64 * 2 + 8 * 4)  # 4 ranks on the host
    plain_norms = estimate(g, 1024, 4, 2, Levers(lean_norm=False, gqa_native=False))["gpu"]["layer working set"]
    lean_norms = estimate(g, 1024, 4, 2, Levers(lean_norm=True, gqa_native=False))["gpu"]["layer working set"]
    assert plain_norms - lean_norms == 4 * t * (64 + 64 + 32)  # fp32 copies: input norm, q norm, k norm
    from ulysses_train.levers.memory import (
        ATTENTION_TENSORS,
        ATTENTION_TENSORS_GQA,
        ATTENTION_TENSORS_MHA,
        FUSED_ROTARY_SAVING,
        MLP_TENSORS_FUSED,
    )

    wide_attention = dict(g, inter=8)  # so that attention, not the MLP, is the larger part of the layer
    expanded = estimate(wide_attention, 1024, 4, 2, Levers(gqa_native=False))["gpu"]["layer working set"]
    native = estimate(wide_attention, 1024, 4, 2, Levers(gqa_native=True))["gpu"]["layer working set"]
    assert expanded - native == pytest.approx((ATTENTION_TENSORS - ATTENTION_TENSORS_GQA) * t * 64 * 2)
    wide_mlp = dict(g, inter=64 * 64)  # so that the MLP, not attention, is the larger part of the layer
    tiled = estimate(wide_mlp, 1 << 20, 1, 1, Levers(tiled_mlp=True))
    untiled = estimate(wide_mlp, 1 << 20, 1, 1, Levers())
    assert tiled["gpu"]["layer working set"] < untiled["gpu"]["layer working set"]
    # the fused kernels: a quarter of a (tokens x intermediate) tensor less where the MLP sets the peak (one less
    # counted, 0.75 of the allocator's rounding fitted: MLP_TENSORS_FUSED), the rotary's temporaries less where
    # attention does
    fused_mlp = estimate(wide_mlp, 1 << 20, 1, 1, Levers(fused_kernels=True))
    assert untiled["gpu"]["layer working set"] - fused_mlp["gpu"]["layer working set"] == \
        (6 - MLP_TENSORS_FUSED) * (1 << 20) * 64 * 64 * 2
    fused_attention = estimate(wide_attention, 1024, 4, 2, Levers(fused_kernels=True))["gpu"]["layer working set"]
    assert native - fused_attention == pytest.approx(FUSED_ROTARY_SAVING * t * 64 * 2)
    # without GQA (as many KV heads as query heads) nothing is copied, and the block is its own measured count
    mha = dict(wide_attention, kv=g["heads"], kv_width=g["attn_width"])
    no_gqa = estimate(mha, 1024, 4, 2, Levers(gqa_native=True))["gpu"]["layer working set"]
    assert native - no_gqa == pytest.approx((ATTENTION_TENSORS_GQA - ATTENTION_TENSORS_MHA) * t * 64 * 2)
    # kept projections offloaded: one layer's are on the GPU again for its backward (q, k, v: 64 + 2 x 32 wide)
    kept = estimate(g, 1024, 4, 2, Levers(offload_activations=True, keep_projections=2))["gpu"]["layer working set"]
    plain = estimate(g, 1024, 4, 2, Levers(offload_activations=True))["gpu"]["layer working set"]
    assert kept - plain == t * (64 + 2 * 32) * 2


def test_loss_term_of_each_kernel_by_hand():
    """Ours: a --loss_chunk_size chunk of fp32 logits and their bf16 gradient. Liger's (0.8.5): rows cut into
    ceil(V / H) parts, rounded up to a power of two, one bf16 chunk of logits, and at the end its fp32 head gradient
    beside the bf16 cast; both with the hidden states and their gradient and the fp32 head gradient."""
    from ulysses_train.levers.memory import liger_chunk_rows

    g = geometry(tiny_config("qwen3"))  # hidden 64, vocab 96: 2 parts
    t = 512
    states = 2 * t * 64 * 2 + 96 * 64 * 4
    assert liger_chunk_rows(t, 96, 64) == 256 and liger_chunk_rows(3, 96, 64) == 2 and liger_chunk_rows(1, 96, 64) == 1
    ours = estimate(g, 1024, 4, 2, Levers(loss_kernel="ours"), loss_chunk=256)["gpu"]["loss"]
    liger = estimate(g, 1024, 4, 2, Levers(loss_kernel="liger"), loss_chunk=256)["gpu"]["loss"]
    assert ours == states + 256 * 96 * 6
    assert liger == states + 256 * 96 * 2 + 4 * t  # the chunk's logits outweigh the 96 x 64 head
    short = estimate(g, 8, 1, 1, Levers(loss_kernel="liger"))["gpu"]["loss"]  # 4 rows of logits < the head
    assert short == 2 * 8 * 64 * 2 + 96 * 64 * 4 + 96 * 64 * 2 + 4 * 8
    # Qwen3-4B (vocab 151,936, hidden 2,560: 60 parts): 1,093 rows at 64k -> 2,048; 2,185 at 131k -> 4,096
    assert [liger_chunk_rows(n, 151936, 2560) for n in (65536, 131072)] == [2048, 4096]


def test_recommends_cheapest_levers_and_smallest_sp():
    g = geometry(tiny_config("qwen3"))
    sp, levers, est, _ = plan(g, 4096, 4, sp_sizes(g, 4), gpu_mem=80 * GiB, host_mem=100 * GiB)
    assert sp == 1 and levers.keep_attention and not (levers.offload_activations or levers.tiled_mlp)  # tiny
    sp, levers, est, tried = plan(g, 1 << 26, 4, sp_sizes(g, 4), gpu_mem=80 * GiB, host_mem=100 * GiB)
    assert sp is None or (est["gpu_total"] <= 0.95 * 80 * GiB)
    assert sp_sizes(g, 8) == [1, 2, 4, 8] and sp_sizes(g, 6) == [1, 2]  # heads 8, kv 4


def test_cli_says_when_nothing_fits(capsys):
    assert main(["--model_config", "qwen3-8b", "--seq_len", str(1 << 26), "--gpus", "1"]) == 1
    assert "nothing fits" in capsys.readouterr().out
    assert main(["--model_config", "qwen3-4b", "--seq_len", "65536", "--gpus", "1"]) == 0
    out = capsys.readouterr().out
    assert "fits with --sp_size 1" in out and "loss (liger)" in out  # the default kernel on a GPU


def test_ds_config_fixes_zero_stage_and_optimizer(tmp_path, capsys):
    import json

    from ulysses_train.tools.plan import ds_config_choices

    g = geometry(tiny_config("qwen3"))
    n, gathered = g["params"], 4 * g["layer_params"]
    by_stage = {s: estimate(g, 1024, 4, 1, Levers(), zero_stage=s)["gpu"]["model states"] for s in (0, 1, 2, 3)}
    assert by_stage[0] == pytest.approx(16 * n)  # nothing partitioned, no gathering
    assert by_stage[1] == pytest.approx(4 * n + 12 * n / 4)  # optimizer states partitioned
    assert by_stage[2] == pytest.approx(2 * n + 14 * n / 4)  # and gradients
    assert by_stage[3] == pytest.approx(16 * n / 4 + gathered)  # and weights, gathered a layer (and the next) at a time
    shared, copied = (estimate(g, 1024, 4, 1, Levers(bf16_states=True, share_master=share))["gpu"]["model states"]
                      for share in (True, False))
    assert shared == pytest.approx(8 * n / 4 + gathered) and copied - shared == pytest.approx(2 * n / 4)
    offload = estimate(g, 1024, 4, 1, Levers(offload_optimizer=True), zero_stage=2)
    assert offload["gpu"]["model states"] == pytest.approx(2 * n)  # stage 2: weights whole; gradients go to the host
    assert offload["host"]["optimizer offload"] == pytest.approx(4 * 18 * n / 4)  # the four ranks share the host

    assert ds_config_choices("ds_configs/zero3_offload.json") == dict(zero_stage=3, offload_optimizer=True,
                                                                       bf16_states=False)
    assert ds_config_choices("ds_configs/zero3_bf16_states.json") == dict(zero_stage=3, offload_optimizer=False,
                                                                          bf16_states=True)
    stage2 = tmp_path / "z2.json"
    stage2.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert main(["--model_config", "qwen3-4b", "--seq_len", "65536", "--ds_config", str(stage2), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert str(stage2) in out["levers"]
    assert out["estimate"]["gpu"]["model states"] == pytest.approx(
        estimate(geometry_4b(), 65536, 1, 1, Levers(), zero_stage=2)["gpu"]["model states"])


def geometry_4b():
    from ulysses_train.model.build import load_model_config

    return geometry(load_model_config(None, "qwen3-4b", None))


def _alive_bytes_per_token(model) -> float:
    """Bytes a forward of the decoder layers leaves alive for the backward, per token: the growth between 256 and
    512 tokens, counted at every allocation and free on CPU, so constants cancel. The last layer's output stands for
    the next layer's input."""
    import torch

    from ulysses_train.train.step.memory_profile import MemoryTimeline

    decoder = model.get_decoder()
    # Gemma's rotary embedding is per layer type (the tests' Gemma layers are all full attention)
    layer_type = ("full_attention",) if "layer_type" in inspect.signature(decoder.rotary_emb.forward).parameters \
        else ()
    alive, outputs = {}, []
    for t in (256, 512):
        x = torch.randn(1, t, model.config.hidden_size, requires_grad=True)
        positions = torch.arange(t)[None]
        rotary = decoder.rotary_emb(x, positions, *layer_type)
        with MemoryTimeline("cpu") as tracker:
            h = x
            for layer in decoder.layers:
                h = layer(h, position_embeddings=rotary, position_ids=positions)
                h = h[0] if isinstance(h, tuple) else h
            alive[t] = tracker.live_bytes()
        outputs.append(h)  # keep the graph (and what it saved) alive until measured
    return (alive[512] - alive[256]) / 256


@pytest.mark.parametrize("keep", [False, True])
def test_saved_bytes_match_cpu_allocations(keep):
    """What a checkpointed forward leaves alive for the backward, per token, equals the planner's checkpoints plus
    kept attention outputs (fp32 here): measured as the growth between two lengths, so constants cancel."""
    from transformers import AutoModelForCausalLM

    from ulysses_train.model.surgery import enable_checkpointing
    from ulysses_train.sp.attention import register_ulysses_attention

    config = tiny_config("qwen3")
    register_ulysses_attention(None, "sdpa")
    model = AutoModelForCausalLM.from_config(config, attn_implementation="ulysses").train()
    enable_checkpointing(model, keep, None)
    per_token = _alive_bytes_per_token(model)
    g = geometry(config)
    e = estimate(g, seq_len=1, gpus=1, sp=1, levers=Levers(keep_attention=keep), act_bytes=4)
    planned = e["gpu"]["checkpoints"] + e["gpu"]["kept outputs"]  # per token, as seq_len is 1
    assert per_token == pytest.approx(planned, rel=0.05)


def test_longest_fits_and_one_step_more_does_not(capsys):
    from ulysses_train.tools.plan import longest_fit

    g = geometry_4b()
    sizes = sp_sizes(g, 1)
    longest = longest_fit(g, 1, sizes, gpu_mem=139.7 * GiB, host_mem=125 * GiB, step=8192)
    assert longest > 0 and longest % 8192 == 0
    assert plan(g, longest, 1, sizes, 139.7 * GiB, 125 * GiB)[0] is not None
    assert plan(g, longest + 8192, 1, sizes, 139.7 * GiB, 125 * GiB)[0] is None
    # more host memory lets the offloaded checkpoints of a longer sequence fit
    assert longest_fit(g, 1, sizes, 139.7 * GiB, 238 * GiB) > longest
    assert main(["--model_config", "qwen3-4b", "--longest"]) == 0
    assert f"longest sequence that fits: {longest:,} tokens" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--seq_len", "0"], "--seq_len must be positive, got 0"),
    (["--seq_len=-5"], "--seq_len must be positive, got -5"),
    (["--seq_len", "4096", "--num_layers", "0"], "--num_layers 0: qwen3-4b has 36 layers"),
    (["--seq_len", "4096", "--num_layers", "99"], "--num_layers 99: qwen3-4b has 36 layers"),
    (["--seq_len", "4096", "--sp_size", "8", "--gpus", "2"], "--sp_size 8 does not divide --gpus 2"),
    (["--seq_len", "4096", "--sp_size", "0"], "--sp_size must be >= 1, got 0"),
    (["--seq_len", "4096", "--gpus", "0"], "--gpus must be 1 to 65,536, got 0"),
    # these hung, printing nothing (the SP search walked every count up to --gpus)
    (["--seq_len", "1048576", "--gpus", "1000000000"], "--gpus must be 1 to 65,536, got 1,000,000,000"),
    (["--longest", "--gpus", "1000000"], "--gpus must be 1 to 65,536, got 1,000,000"),
    (["--seq_len", "4096", "--use_peft", "--lora_r", "1000000"], "--lora_r 1000000 is above the rank of"),
    (["--seq_len", "4096", "--gpu_mem_gib", "inf"], "--gpu_mem_gib must be a positive finite number, got inf"),
    (["--seq_len", "4096", "--gpu_mem_gib", "nan"], "--gpu_mem_gib must be a positive finite number, got nan"),
    (["--seq_len", "4096", "--host_mem_gib", "0"], "--host_mem_gib must be a positive finite number, got 0.0"),
    (["--longest", "--gpu_mem_gib", "inf"], "--gpu_mem_gib must be a positive finite number, got inf"),
    (["--seq_len", "4096", "--ds_config", "BAD"], "--ds_config .* is not valid JSON"),
    (["--seq_len", "4096", "--ds_config", "TYPO"], "did you mean 'zero_optimization'"),
    (["--seq_len", "4096", "--ds_config", "AUTO_STAGE"], "zero_optimization.stage must be 0, 1, 2 or 3, got 'auto'"),
])
def test_bad_settings_are_one_line_and_exit_2(argv, message, capsys, tmp_path):
    files = {"BAD": "{", "TYPO": '{"zero_optimisation": {"stage": 3}}',
             "AUTO_STAGE": '{"zero_optimization": {"stage": "auto"}}'}
    for name, text in files.items():
        if name in argv:
            (tmp_path / "ds.json").write_text(text)
            argv = [str(tmp_path / "ds.json") if a == name else a for a in argv]
    assert main(["--model_config", "qwen3-4b"] + argv) == 2
    out, err = capsys.readouterr()
    assert re.search(message, err) and err.startswith("error: ") and err.count("\n") == 1, err
    assert "fits" not in out


def test_ring_buffers_and_traffic_by_hand():
    """With a ring the all-to-all spans the Ulysses group only; the ring adds its K/V blocks and fp32 dK/dV
    accumulators (in flight and in hand) and dq's accumulator, and sends K/V and dK/dV blocks around."""
    from ulysses_train.levers.memory import communication

    g = geometry(tiny_config("qwen3"))  # heads 8 x head_dim 8, kv 4, 2 layers
    t, ulysses, ring = 128, 2, 4  # 1024 tokens over sp 8 = Ulysses 2 x ring 4
    e = estimate(g, 1024, 8, 8, Levers(keep_attention=True), ring=ring)
    assert e["ring_size"] == 4 and e["tokens_per_rank"] == t
    assert e["gpu"]["all-to-all buffers"] == t * (64 + 2 * max(32, 8 * ulysses)) * 2
    kv_block = 2 * (t * ulysses) * (4 // ulysses) * 8  # k and v of a ring rank's pair of chunks
    assert e["gpu"]["ring buffers"] == 2 * kv_block * 2 + 3 * kv_block * 4 + t * ulysses * (64 // ulysses) * 4
    assert "ring buffers" not in estimate(g, 1024, 8, 8, Levers())["gpu"]
    sent = communication(g, 1024, 8, ring, Levers(keep_attention=True))
    assert sent["ring point-to-point"] == 2 * ((ring - 1) * kv_block * 2 * 2 + ring * kv_block * 4)
    assert sent["all-to-all"] == 2 * 2 * (2 * 64 + 2 * 32) * t * 2 // 2  # forward and backward, half leaves
    recomputed = communication(g, 1024, 8, ring, Levers(keep_attention=False))  # the recompute sends K/V again
    assert recomputed["ring point-to-point"] - sent["ring point-to-point"] == 2 * (ring - 1) * kv_block * 2


def test_planner_proposes_a_ring_where_heads_forbid_ulysses(tmp_path, capsys):
    """28 heads and 4 KV heads (Qwen2.5-7B's layout) on 8 GPUs: SP 8 is Ulysses 4 x ring 2."""
    from ulysses_train.tools.plan import sp_plans

    config = qwen2_28_heads_config()
    config.save_pretrained(tmp_path)
    assert sp_plans(config, 8) == [(1, 1), (2, 1), (4, 1), (8, 2)]
    assert sp_plans(config, 8, ring=1) == [(1, 1), (2, 1), (4, 1)] and sp_plans(config, 8, 8, 4) == [(8, 4)]
    assert main(["--model_config", str(tmp_path / "config.json"), "--seq_len", "65536", "--gpus", "8",
                 "--sp_size", "8"]) == 0
    out = capsys.readouterr().out
    assert "with the default flags (--sp_size 8 --ring_size 2)" in out  # --ring_size auto, the default
    assert "fits with --sp_size 8 --ring_size 2 " in out and "ring buffers" in out and "ring point-to-point" in out
    assert main(["--model_config", str(tmp_path / "config.json"), "--seq_len", "65536", "--gpus", "8",
                 "--sp_size", "8", "--ring_size", "1"]) == 2
    assert "--sp_size 8 must divide the model's 28 attention heads" in capsys.readouterr().err


@pytest.mark.parametrize("lean, tiled", [(True, False), (False, False), (True, True)])
def test_uncheckpointed_layer_bytes_match_cpu_allocations(lean, tiled):
    """What a layer that is not checkpointed (`--checkpoint_layers`) leaves alive for its backward, counted at every
    allocation on CPU (fp32, SDPA), equals levers/layer_activations.py's count, with and without the lean norms and
    the tiled MLP: the planner's memory for the layers it does not checkpoint."""
    from transformers import AutoModelForCausalLM

    from ulysses_train.levers.layer_activations import kept_layer_bytes
    from ulysses_train.model.surgery import enable_tiled_mlp, install_lean_norms
    from ulysses_train.sp.attention import register_ulysses_attention

    config = tiny_config("qwen3")
    register_ulysses_attention(None, "sdpa")
    model = AutoModelForCausalLM.from_config(config, attn_implementation="ulysses").train()
    if lean:
        install_lean_norms(model)
    if tiled:
        enable_tiled_mlp(model, tile_tokens=100)
    per_token = _alive_bytes_per_token(model) / config.num_hidden_layers
    planned = kept_layer_bytes(geometry(config), 1, 4, Levers(lean_norm=lean, tiled_mlp=tiled))
    assert per_token == pytest.approx(planned, rel=0.02)


@pytest.mark.parametrize("tiled", [False, True])
def test_uncheckpointed_gemma_layer_bytes_match_cpu_allocations(tiled):
    """Gemma 3 normalises each sublayer's input and output (four hidden norms, and q and k per head): what an
    uncheckpointed layer keeps, counted on CPU with transformers' norms, is the same count with (2 + norms) H-wide
    tensors and a norm's fp32 copy and row statistic each."""
    from transformers import AutoModelForCausalLM

    from ulysses_train.levers.layer_activations import kept_layer_bytes
    from ulysses_train.model.surgery import enable_tiled_mlp
    from ulysses_train.sp.attention import register_ulysses_attention

    config = AutoConfig.for_model("gemma3_text", vocab_size=96, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                                  query_pre_attn_scalar=8, layer_types=["full_attention"] * 2, use_cache=False)
    register_ulysses_attention(None, "sdpa")
    model = AutoModelForCausalLM.from_config(config, attn_implementation="ulysses").train()
    if tiled:
        enable_tiled_mlp(model, tile_tokens=100)
    g = geometry(config)
    assert g["norms"] == 4 and g["qk_norm"]
    per_token = _alive_bytes_per_token(model) / config.num_hidden_layers
    assert per_token == pytest.approx(kept_layer_bytes(g, 1, 4, Levers(lean_norm=False, tiled_mlp=tiled)), rel=0.02)


def qwen35_config(layers: int = 4):
    """A tiny Qwen3.5: three Gated DeltaNet layers to one gated attention layer."""
    return AutoConfig.for_model("qwen3_5_text", vocab_size=96, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                linear_value_head_dim=12)


def test_deltanet_layers_keep_no_attention_outputs_and_send_nothing():
    """Qwen3.5's DeltaNet layers: only its attention layers keep kernel outputs (`--attn_recompute never`) and take
    part in the all-to-all; an uncheckpointed DeltaNet layer keeps its own count; its recomputed mixer is a
    candidate for the layer working set."""
    from ulysses_train.levers.layer_activations import kept_layer_bytes
    from ulysses_train.levers.memory import communication, deltanet_bytes

    g = geometry(qwen35_config(8))  # layers 3 and 7 attend
    t, b = 1024, 2
    e = estimate(g, t, 1, 1, Levers(keep_attention=True))
    assert e["gpu"]["kept outputs"] == 2 * t * (64 * b + 4 * 4)
    assert e["gpu"]["checkpoints"] == 8 * t * 64 * b
    half = estimate(g, t, 1, 1, Levers(keep_attention=True, checkpoint_layers=4))
    assert half["gpu"]["kept outputs"] == 1 * t * (64 * b + 4 * 4)  # layer 3 of the first four
    spans = g["attn_spans"][4:]
    assert half["gpu"]["uncheckpointed layers"] == sum(kept_layer_bytes(g, t, b, Levers(), 1, s) for s in spans)
    deltanet = kept_layer_bytes(g, t, b, Levers(), 1, spans[0])
    # x, normed x, h, normed h; conv q, k, v (2 x 16 + 48) three times; z, output, gated norm (48 each); MLP 4 I
    assert deltanet == t * ((4 * 64 + 3 * 80 + 3 * 48 + 4 * 128) * b + 4 * (2 + 4))
    assert deltanet_bytes(g, t, b) > 0 and deltanet_bytes(geometry(tiny_config("qwen3")), t, b) == 0
    one_attention_layer = communication(dict(g, layers=4), 4096, 2, 1, Levers(keep_attention=True))["all-to-all"]
    assert communication(g, 4096, 2, 1, Levers(keep_attention=True))["all-to-all"] == 2 * one_attention_layer


def test_partial_checkpointing_by_hand():
    """`--checkpoint_layers 1` of 2: half the checkpoints and kept outputs, and one layer's activations on the GPU
    with the transient on top of them; 0: none checkpointed."""
    from ulysses_train.levers.layer_activations import kept_layer_bytes

    g = geometry(tiny_config("qwen3"))
    full = estimate(g, 1024, 1, 1, Levers())
    half = estimate(g, 1024, 1, 1, Levers(checkpoint_layers=1))
    none = estimate(g, 1024, 1, 1, Levers(checkpointing=False, keep_attention=False))
    layer = kept_layer_bytes(g, 1024, 2, Levers())
    assert half["gpu"]["checkpoints"] == full["gpu"]["checkpoints"] / 2 == 1024 * 64 * 2
    assert half["gpu"]["kept outputs"] == full["gpu"]["kept outputs"] / 2
    assert half["gpu"]["uncheckpointed layers"] == layer and none["gpu"]["uncheckpointed layers"] == 2 * layer
    assert half["gpu_total"] - full["gpu_total"] == pytest.approx(layer - full["gpu"]["checkpoints"] / 2
                                                                  - full["gpu"]["kept outputs"] / 2)
    # by hand: 4 H + (A + KV) before the q/k norms + A + 2 KV for the kernel + A out + 3 I (fused SwiGLU), bf16;
    # fp32 per row: 2 + heads + kv for the norms, heads for the log-sum-exp
    assert kept_layer_bytes(g, 1, 2, Levers(fused_kernels=True)) == (4 * 64 + 96 + 64 + 64 + 64 + 3 * 128) * 2 \
        + 4 * (2 + 8 + 4 + 8)


def test_uncheckpointed_layers_peak_at_the_loss_or_their_own_backward_not_under_a_recompute():
    """With layers left uncheckpointed the peak is their activations plus the larger of the loss and their own
    backward's gradients (they are freed before any recompute starts), or the layer working set of a checkpointed
    layer's recompute, whichever is larger; by hand on a tiny config (H 64, A 64, KV' 32 of 4 heads, I 128)."""
    from ulysses_train.levers.layer_activations import kept_layer_bytes, uncheckpointed_backward_bytes

    g, t, b = geometry(tiny_config("qwen3")), 1024, 2
    # the gradients of the layer's hidden states (2 H) and the larger of attention's (dq, dk, dv: A + 2 KV' in bf16
    # and an fp32 dq accumulator, A) and the MLP's (d product, d gate, d up: 3 I with the fused SwiGLU, 4 I without)
    assert uncheckpointed_backward_bytes(g, t, b, Levers()) == t * b * (2 * 64 + max(64 + 2 * 32 + 2 * 64, 4 * 128))
    assert uncheckpointed_backward_bytes(g, t, b, Levers(fused_kernels=True)) == t * b * (2 * 64 + 3 * 128)
    tiled = Levers(tiled_mlp=True)  # the MLP's gradients of one 16,384-token tile at a time
    assert uncheckpointed_backward_bytes(g, 65536, b, tiled) == 65536 * b * (2 * 64 + 64 + 2 * 32 + 2 * 64)
    t = 65536  # the layer working set outgrows the loss (the loss stays at its chunk), as at 64k on the H200
    full = estimate(g, t, 1, 1, Levers())
    assert full["gpu"]["layer working set"] > full["gpu"]["loss"]
    for levers, kept in ((Levers(checkpoint_layers=1), 1), (Levers(checkpointing=False, keep_attention=False), 2)):
        part = estimate(g, t, 1, 1, levers)
        layers = kept * kept_layer_bytes(g, t, b, levers)
        transient = max(part["gpu"]["layer working set"],
                        layers + max(part["gpu"]["loss"], uncheckpointed_backward_bytes(g, t, b, levers)))
        expected = (full["gpu_total"] - full["gpu"]["checkpoints"] - full["gpu"]["kept outputs"]
                    - max(full["gpu"]["layer working set"], full["gpu"]["loss"])
                    + part["gpu"]["checkpoints"] + part["gpu"]["kept outputs"] + transient)
        assert part["gpu_total"] == pytest.approx(expected)


def test_the_plan_prints_a_command_to_copy_and_labels_its_breakdown(tmp_path, capsys):
    """The plan ends with the launch command of the run it planned (the trainer's parser reads its flags back), for a
    model folder as for a preset, with a command after -- too; each line of the breakdown says what it holds."""
    import shlex

    from ulysses_train.tools.plan import LABELS
    from ulysses_train.train.config.config_file import parse_args

    qwen2_28_heads_config().save_pretrained(tmp_path)  # a model folder: its config only is read
    assert main(["--model", str(tmp_path), "--seq_len", "65536", "--gpus", "8", "--sp_size", "8"]) == 0
    out = capsys.readouterr().out
    command = shlex.split(out.split("run it:\n")[1].strip().splitlines()[0])
    assert command[:4] == ["deepspeed", "--num_gpus", "8", "launch/train.py"]
    cfg, _ = parse_args(command[4:])
    assert (cfg.base.model, cfg.data.seq_len, cfg.parallel.sp_size, cfg.parallel.ring_size) == (
        str(tmp_path), 65536, 8, "2")
    for name in ("model states", "checkpoints", "layer working set", "all-to-all buffers", "optimizer offload"):
        assert re.search(rf"  {name} +[\d.]+ GiB  {re.escape(LABELS[name])}\n", out), name
    assert main(["--gpus", "16", "--", "--model_config", "qwen3-4b", "--seq_len", "32768"]) == 0
    command = shlex.split(capsys.readouterr().out.split("run it:\n")[1].strip())
    assert command[:8] == ["deepspeed", "--num_nodes", "2", "--hostfile", "HOSTFILE", "--num_gpus", "8",
                           "launch/train.py"] and parse_args(command[8:])[0].data.seq_len == 32768


def test_checkpoint_split_and_segments_by_hand():
    """`--gpu_checkpoints` and `--checkpoint_every` in the estimate: the last g checkpointed layers' inputs and
    kept outputs on the GPU, the others' on the host (of every rank), the two adding up to what the offload of
    every layer puts on the host; segments of k layers keep one input per segment and hold k - 1 regenerated inputs
    in the layer's working set."""
    import dataclasses

    g = geometry(AutoConfig.for_model("qwen3", **{**TINY["qwen3"], "num_hidden_layers": 5}))
    one, kept_one = 512 * 64 * 2, 512 * (64 * 2 + 8 * 4)  # 512 tokens a rank: a layer input, kept outputs
    host_all = estimate(g, 1024, 4, 2, Levers(offload_activations=True))
    assert host_all["host"]["offloaded checkpoints"] == 4 * 5 * (one + kept_one)
    for gpu in (0, 2, 5):
        split = estimate(g, 1024, 4, 2, Levers(offload_activations=True, gpu_checkpoints=gpu))
        assert split["gpu"]["checkpoints"] == gpu * one and split["gpu"]["kept outputs"] == gpu * kept_one
        assert split["host"]["offloaded checkpoints"] == 4 * (5 - gpu) * (one + kept_one)
        assert split["gpu_total"] - host_all["gpu_total"] == gpu * (one + kept_one)
    on_gpu = estimate(g, 1024, 4, 2, Levers())
    assert on_gpu["gpu"]["checkpoints"] == 5 * one and on_gpu["host"]["offloaded checkpoints"] == 0
    segments = estimate(g, 1024, 4, 2, Levers(checkpoint_every=2))  # layers 0, 2 and 4 hold their inputs
    assert segments["gpu"]["checkpoints"] == 3 * one and segments["gpu"]["kept outputs"] == 5 * kept_one
    assert segments["gpu"]["regenerated inputs"] == one
    assert segments["gpu"]["layer working set"] - on_gpu["gpu"]["layer working set"] == one
    # segments of 2 with the last two layers on the GPU: inputs of layers 0 and 2 on the host, of layer 4 on the GPU
    both = estimate(g, 1024, 4, 2, dataclasses.replace(Levers(offload_activations=True, keep_attention=False),
                                                         gpu_checkpoints=2, checkpoint_every=2))
    assert both["gpu"]["checkpoints"] == one and both["host"]["offloaded checkpoints"] == 4 * 2 * one
    assert both["checkpoint_split"]["checkpoints"] == 3 and both["checkpoint_split"]["gpu layers"] == 2


def test_the_plan_prints_where_the_checkpoints_are(capsys):
    """Past what the host holds, the plan keeps on the GPU what fits there and says so; past what GPU and host hold,
    it checkpoints every k-th layer and says that too."""
    assert main(["--model_config", "qwen3-8b", "--gpus", "1", "--seq_len", "458752"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("checkpoints:"))
    assert re.search(r"the last [1-9]\d* layers' on the GPU", line) and "--gpu_checkpoints" in out
    assert "one every" not in line and "--checkpoint_every 1" in out
    assert main(["--model_config", "qwen3-8b", "--gpus", "1", "--seq_len", "589824"]) == 0
    out = capsys.readouterr().out
    assert "one every 2 layers" in out and "--checkpoint_every 2" in out and "regenerated inputs" in out


def test_the_memory_estimate_against_every_measured_peak():
    """benchmarks/plan_vs_measured.py over docs/results (the table of docs/memory.md): every peak of the fitted
    families within 5% of the planner's estimate for the levers it ran, Qwen3.5-9B at 8 layers and 131k on one H100
    among them: with the MLP whole its DeltaNet layer peaks in the MLP's backward beside the mixer's saved q, k, v,
    with the MLP tiled at the mixer's own, smaller peak."""
    from benchmarks.plan_vs_measured import peaks

    errors = {name: est / measured - 1 for name, _, measured, est, kind in peaks() if kind == "fitted"}
    assert len(errors) >= 45, sorted(errors)
    deltanet = [name for name in errors if name.startswith("qwen3.5-9b_8layers_h100_131k")]
    assert len(deltanet) == 5, deltanet
    assert all(abs(e) < 0.05 for e in errors.values()), {k: e for k, e in errors.items() if abs(e) >= 0.05}
