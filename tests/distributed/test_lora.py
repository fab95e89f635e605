"""LoRA (PEFT) under Ulysses SP and ZeRO-3: exact against plain transformers + PEFT, resumed bit for bit, exported in
PEFT's format and merged, with the training-time logits.

One launch of 4 ranks builds several trainers (model/adapters.py, train/run/trainer.py):
- `--verify` at SP=4 and at DP=2 x SP=2 with two micro-steps: one step against a single process of plain
  transformers + PEFT (`get_peft_model`, the same LoraConfig and modules_to_save) on the same weights and tokens,
  LoRA-B drawn non-zero so that A's gradients are not zero; the loss and every trainable parameter's gradient, under
  ZeRO-3, with the levers (tiled MLP, kept attention, uncheckpointed layers, lean norms, our fused loss with a
  trained and a LoRA'd head, Liger-Kernel's with a frozen and a LoRA'd one), and a MoE whose experts take PEFT's
  adapters on their fused parameters;
  `--lora_modules_to_save embed_tokens,lm_head,norm` (every RMSNorm) on a tied model, embed_tokens,norm beside a
  LoRA'd head on an untied one;
- training at DP=2 x SP=2 from a saved pretrained folder, checkpoints at steps 2 and 4, the trained model's logits
  gathered over the SP group; then a run resumed from step 2.
The test process then checks the resume bit for bit, that the checkpoints hold only what is trained, and exports
both forms, loaded back by `PeftModel.from_pretrained` and `from_pretrained`, against the training-time logits."""

import json
import os

import pytest
import torch

from tests.multiprocess import run_distributed

SEQ = 64
TRAIN = ["--tokenizer", "bytes", "--seq_len", str(SEQ), "--steps", "4", "--save_steps", "2", "--lr", "3e-3",
         "--sp_size", "2", "--use_peft", "--lora_modules_to_save", "embed_tokens,lm_head,norm"]
LINEARS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def _trainer(argv):
    from ulysses_train.train.config.config_file import parse_args
    from ulysses_train.train.run.trainer import Trainer

    cfg, explicit = parse_args(argv)
    return Trainer(cfg, explicit)


def _release(trainer):
    if trainer.lock is not None:
        trainer.lock.release()


def _logits(trainer) -> torch.Tensor:
    """The trained model's logits on a fixed input, through the sharded path, gathered over the SP group."""
    import torch.distributed as dist

    from ulysses_train.sp.sharding import shard_sequence

    g = trainer.groups
    ids = torch.arange(3, 3 + SEQ)[None] % trainer.model_config.vocab_size
    shard = shard_sequence(ids, g.sp_size, g.sp_rank)
    model = trainer.module.model
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=shard["input_ids"], position_ids=shard["position_ids"])[0]
        logits = model.get_output_embeddings()(hidden)  # (1, SEQ/sp, V): this rank's shard
    parts = [torch.empty_like(logits) for _ in range(g.sp_size)]
    dist.all_gather(parts, logits.contiguous(), group=g.sp_group)
    return torch.cat(parts, dim=1)


def _launch(rank, world, verify_settings, base, tmp):
    from ulysses_train.train.step.loop import train
    from ulysses_train.train.verify.verify import run_verify

    results = {"verify": []}
    for i, argv in enumerate(verify_settings):
        trainer = _trainer(argv + ["--verify", "--output_dir", os.path.join(tmp, f"verify{i}")])
        results["verify"].append(run_verify(trainer))
        results.setdefault("trainable", []).append(
            sorted(n.removeprefix("model.") for n, p in trainer.module.named_parameters() if p.requires_grad))
        _release(trainer)
    trainer = _trainer(TRAIN + ["--model", base, "--output_dir", os.path.join(tmp, "run")])
    results["losses"] = [r["loss"] for r in train(trainer)]
    results["logits"] = _logits(trainer)
    _release(trainer)
    step2 = os.path.join(tmp, "run", "checkpoints", "step_00000002")
    trainer = _trainer(TRAIN + ["--model", base, "--output_dir", os.path.join(tmp, "resumed"), "--resume", step2])
    results["resumed_losses"] = [r["loss"] for r in train(trainer)]
    _release(trainer)
    return results


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    """A pretrained tiny model folder (the preset's tied Qwen3), the base the adapters train on."""
    from transformers import AutoModelForCausalLM

    from ulysses_train.model.build import load_model_config

    folder = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(load_model_config(None, "tiny")).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def launched(tmp_path_factory, base):
    from tests.models import TINY
    from ulysses_train.model.build import PRESETS

    tmp = tmp_path_factory.mktemp("lora")
    untied, moe = tmp / "untied.json", tmp / "moe.json"
    untied.write_text(json.dumps(dict(PRESETS["tiny"], tie_word_embeddings=False)))
    moe.write_text(json.dumps(dict(TINY["qwen3_moe"], model_type="qwen3_moe")))
    common = ["--verify_seq_len", "128", "--use_peft"]
    settings = [
        # SP=4: every lever with the tied model, embeddings, LM head and every norm trained whole
        common + ["--sp_size", "4", "--lora_modules_to_save", "embed_tokens,lm_head,norm", "--tiled_mlp", "on",
                  "--mlp_tile_tokens", "8", "--attn_recompute", "never", "--checkpoint_layers", "1",
                  "--lean_norm", "on"],
        # DP=2 x SP=2, two micro-steps: a LoRA'd LM head through the fused loss (ours, odd chunks), an untied model
        common + ["--sp_size", "2", "--grad_accum", "2", "--model_config", str(untied), "--lora_r", "8",
                  "--lora_alpha", "16", "--lora_target_modules", LINEARS + ",lm_head",
                  "--lora_modules_to_save", "embed_tokens,norm", "--loss_chunk_size", "37"],
        # Liger-Kernel's loss (Triton's interpreter) with the head frozen (the CUDA default), and with it LoRA'd
        common + ["--sp_size", "2", "--model_config", str(untied), "--loss_kernel", "liger"],
        common + ["--sp_size", "4", "--model_config", str(untied), "--loss_kernel", "liger",
                  "--lora_target_modules", "q_proj,down_proj,lm_head"],
        # a MoE: all-linear puts PEFT's adapters on the fused experts' parameters too
        common + ["--sp_size", "2", "--model_config", str(moe)],
    ]
    return run_distributed(_launch, 4, settings, base, str(tmp), use_deepspeed=True)[0], tmp


def test_lora_under_sp_and_zero3_equals_transformers_and_peft(launched):
    results, _ = launched
    for result, trainable in zip(results["verify"], results["trainable"]):
        assert result["passed"], result
        assert result["peft_version"] is not None
        assert result["ours"]["loss"] < 1e-5 and result["ours"]["grad_max"] < 1e-5  # fp32 on CPU: rounding only
        # every trained tensor compared: A's gradients are not zero (B drawn), nor are B's
        assert result["ours"]["tensors"] == len(trainable), (result["ours"], trainable)
        assert any(".lora_A." in n for n in trainable)
        assert all(".lora_" in n or ".base_layer." not in n for n in trainable)  # no frozen base weight trained
    first, head, liger, liger_head, _ = results["verify"]
    assert "sp 4 x dp 1" in first["setup"] and "tiled MLP: True" in first["setup"]
    assert "attention kept: True" in first["setup"] and "checkpointing 1 of 2 layers" in first["setup"]
    assert "lean norms: 9" in first["setup"]
    # embed_tokens (tied to lm_head: one tensor) and the 9 RMSNorms, trained whole; 14 LoRA'd linears
    assert sum(".lora_" in n for n in results["trainable"][0]) == 28
    assert {n for n in results["trainable"][0] if ".lora_" not in n} == {
        "model.embed_tokens.weight", "model.norm.weight",
        *(f"model.layers.{i}.{m}.weight" for i in (0, 1) for m in
          ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"))}
    assert "sp 2 x dp 2" in head["setup"] and head["sequences"] == 4 and "loss fused (ours)" in head["setup"]
    assert "lm_head.lora_A.default.weight" in results["trainable"][1]
    assert "loss fused (liger)" in liger["setup"] and "loss fused (liger)" in liger_head["setup"]
    assert not any("lm_head" in n for n in results["trainable"][2])  # frozen
    assert "lm_head.lora_B.default.weight" in results["trainable"][3]
    assert "model.layers.1.mlp.experts.base_layer.lora_A.default.weight" in results["trainable"][4]


def test_lora_checkpoints_resume_bit_exact_and_hold_only_what_is_trained(launched):
    from tests.trainer_runs import checkpoint_weights

    results, tmp = launched
    losses, resumed = results["losses"], results["resumed_losses"]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert resumed == losses[2:]  # the resumed run's steps 3 and 4, bit for bit
    ckpt = "checkpoints/step_00000004"
    straight, again = checkpoint_weights(tmp / "run" / ckpt), checkpoint_weights(tmp / "resumed" / ckpt)
    assert straight.keys() == again.keys() and all(torch.equal(straight[k], again[k]) for k in straight)
    # only the adapters and the modules trained whole (lm_head is embed_tokens, tied)
    assert all(".lora_" in k or k.endswith("norm.weight") or k.endswith(("embed_tokens.weight", "lm_head.weight"))
               for k in straight)
    assert not any(".base_layer." in k for k in straight)


def test_lora_export_adapter_and_merged_give_the_training_time_logits(launched, base):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ulysses_train.tools.export import main as export_main

    results, tmp = launched
    ids = torch.arange(3, 3 + SEQ)[None]
    checkpoint = str(tmp / "run" / "checkpoints" / "step_00000004")
    assert export_main([checkpoint, str(tmp / "adapter")]) == 0
    assert export_main([checkpoint, str(tmp / "merged"), "--merge"]) == 0
    config = json.loads((tmp / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == base and config["r"] == 16 and config["lora_alpha"] == 32
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(tmp / "adapter"))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp / "merged"))
    plain = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        got = {"adapter": peft(input_ids=ids).logits, "merged": merged(input_ids=ids).logits}
        untrained = plain(input_ids=ids).logits
    # the checkpoint itself is PEFT's adapter folder, the trained values in fp32, its base the run's --model
    saved = json.loads((tmp / "run" / "checkpoints" / "step_00000004" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == base
    from_checkpoint = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), checkpoint)
    with torch.no_grad():
        got["checkpoint"] = from_checkpoint(input_ids=ids).logits
    for form, logits in got.items():
        torch.testing.assert_close(logits, results["logits"], rtol=1e-5, atol=1e-5, msg=form)
    assert not torch.allclose(untrained, results["logits"], atol=1e-3)  # training changed the model


def test_export_never_writes_into_a_folder_that_holds_files(launched, capsys):
    """A folder with a model in it is refused (its weights, tokenizer and chat template stayed, beside new adapter
    files); --overwrite replaces it whole, through a temporary folder renamed into place; a failed export leaves
    the folder as it was."""
    from ulysses_train.tools.export import main as export_main

    _, tmp = launched
    checkpoint = str(tmp / "run" / "checkpoints" / "step_00000004")
    target = tmp / "held"
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / "tokenizer_config.json").write_text("{}")
    assert export_main([checkpoint, str(target)]) == 2
    assert "is not empty (config.json, tokenizer_config.json): give a new folder, or --overwrite" in \
        capsys.readouterr().err
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "tokenizer_config.json"]
    assert export_main([checkpoint, str(target), "--overwrite", "--merge", "--base_model", str(tmp / "none")]) == 2
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "tokenizer_config.json"]
    assert export_main([checkpoint, str(target), "--overwrite"]) == 0
    assert (target / "adapter_model.safetensors").exists() and not (target / "config.json").exists()  # whole
    assert not [p for p in tmp.iterdir() if ".export-" in p.name]  # no temporary folder left


def test_a_bf16_merge_says_how_much_of_the_update_it_rounds_away(capsys):
    """The merge is computed in fp32 and cast once. An update far below bf16's step on the weights (a short run's)
    is rounded away by the cast: `auto` keeps the merged weights in fp32 and says why, `--dtype bf16` warns with the
    share lost; an update bf16 holds is cast as asked."""
    import copy

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.models import tiny_config
    from ulysses_train.train.checkpoints.export_model import _merged_dtype, lost_update_share

    config = tiny_config("qwen3")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # the merge runs in fp32
    config.dtype = torch.bfloat16  # the run's dtype, which --dtype auto exports in
    for scale, lost_much in ((1e-5, True), (1.0, False)):
        peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules="all-linear"))
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn_like(p) * scale)
        merged = copy.deepcopy(peft).merge_and_unload()
        lost = lost_update_share(peft, merged, torch.bfloat16)
        assert (lost > 0.5) if lost_much else (lost < 0.1), (scale, lost)
        assert _merged_dtype("auto", config, peft, merged) == (torch.float32 if lost_much else torch.bfloat16)
        assert _merged_dtype("bf16", config, peft, merged) == torch.bfloat16
        err = capsys.readouterr().err
        assert ("the merged weights stay fp32" in err and "--dtype bf16 rounds away" in err) == lost_much, err


def test_adapter_settings_a_user_can_get_wrong_are_named():
    from transformers import AutoModelForCausalLM

    from tests.models import tiny_config
    from ulysses_train.errors import ConfigError
    from ulysses_train.model.adapters import AdapterSpec, add_adapters, check_4bit
    from ulysses_train.train.config.config_file import parse_args

    def adapters(**spec):
        model = AutoModelForCausalLM.from_config(tiny_config("qwen3"))
        return add_adapters(model, AdapterSpec(**spec))

    with pytest.raises(ConfigError, match="--lora_target_modules qq_proj: no module .* q_proj, up_proj, v_proj"):
        adapters(target_modules=("q_proj", "qq_proj"))
    with pytest.raises(ConfigError, match="--lora_modules_to_save embeddings: no module"):
        adapters(modules_to_save=("embeddings",))
    with pytest.raises(ConfigError, match="both LoRA'd .* and trained whole"):
        adapters(target_modules=("q_proj",), modules_to_save=("q_proj",))
    with pytest.raises(ConfigError, match="ties its LM head"):
        adapters(target_modules=("q_proj", "lm_head"))
    found = adapters(modules_to_save=("norm",))
    assert len(found.lora_modules) == 14 and len(found.saved_modules) == 9  # all-linear; every RMSNorm
    # the frozen embedding's output requires grad (for checkpointing, as PEFT's enable_input_require_grads)
    for input_grads in (True, False):
        model = AutoModelForCausalLM.from_config(tiny_config("qwen3"))
        add_adapters(model, AdapterSpec(), input_grads=input_grads)
        assert model.get_input_embeddings()(torch.tensor([[3, 4]])).requires_grad == input_grads
    with pytest.raises(ConfigError, match="--load_in_4bit: .* run on CUDA, not on cpu"):
        check_4bit(torch.device("cpu"))
    import importlib.util

    real = importlib.util.find_spec
    importlib.util.find_spec = lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    try:
        with pytest.raises(ConfigError, match="--load_in_4bit needs bitsandbytes"):
            check_4bit(torch.device("cuda"))
    finally:
        importlib.util.find_spec = real
    for argv, message in ((["--lora_r", "8"], "--lora_r configures adapters: add --use_peft"),
                          (["--use_peft", "--load_in_4bit"], "--load_in_4bit quantizes pretrained weights"),
                          (["--use_peft", "--lora_dropout", "1"], "--lora_dropout must be in"),
                          (["--use_peft", "--lora_dropout", "0.1", "--verify"], "verify with --lora_dropout 0")):
        with pytest.raises(ConfigError, match=message):
            parse_args(argv)[0].validate()


def test_the_planner_counts_what_lora_changes(capsys):
    """Frozen weights in bf16 without gradient, master or optimizer state, the adapters with all of them (counted
    as PEFT counts them), no head gradient in the loss, a third less matmul work, and `plan --longest --use_peft`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ulysses_train.levers.memory import NF4_BYTES
    from ulysses_train.levers.policy import Levers
    from ulysses_train.levers.time_model import Run, step_time
    from ulysses_train.model.adapters import AdapterSpec, adapter_geometry
    from ulysses_train.model.build import load_model_config
    from ulysses_train.model.geometry import geometry
    from ulysses_train.tools.plan import estimate, main

    config = load_model_config(None, "qwen3-0.6b")
    full = geometry(config)
    lora = dict(full, adapters=adapter_geometry(config, AdapterSpec()))
    a = lora["adapters"]
    with torch.device("meta"):
        peft = get_peft_model(AutoModelForCausalLM.from_config(config),
                              LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    assert a["trainable"] == a["lora"] == sum(p.numel() for p in peft.parameters() if p.requires_grad)
    # r x (in + out) of q (1024 -> 2048), k, v (1024 -> 1024), o (2048 -> 1024), gate, up (1024 -> 3072), down
    assert a["lora"] == 16 * (3072 + 2 * 2048 + 3072 + 2 * 4096 + 4096) * 28
    assert a["frozen_matmul"] == a["matmul"] and not a["head_trainable"] and a["quantized"] == 0
    levers = Levers(loss_kernel="ours")
    est_full, est_lora = estimate(full, 65536, 1, 1, levers), estimate(lora, 65536, 1, 1, levers)
    gathered = 4 * full["layer_params"]
    assert est_full["gpu"]["model states"] == 16 * full["params"] + gathered
    assert est_lora["gpu"]["model states"] == 2 * full["params"] + 16 * a["trainable"] + gathered
    assert est_full["gpu"]["loss"] - est_lora["gpu"]["loss"] == full["vocab"] * full["hidden"] * 4
    time_full, time_lora = (step_time(Run(g, 65536, 1, 1, levers)) for g in (full, lora))
    # forward, recompute and the input's gradient: 3 of full fine-tuning's 4 passes of the linear layers
    assert time_lora["parts"]["matmul"] == pytest.approx(0.75 * time_full["parts"]["matmul"])
    assert time_lora["parts"]["loss"] == pytest.approx(2 / 3 * time_full["parts"]["loss"])
    assert 0 < time_lora["parts"]["adapters"] < time_lora["parts"]["matmul"]  # bandwidth-bound, not small here
    assert time_lora["parts"]["optimizer"] < time_full["parts"]["optimizer"] / 10
    qlora = dict(full, adapters=adapter_geometry(config, AdapterSpec(load_in_4bit=True)))
    nf4 = qlora["adapters"]["quantized"]
    assert nf4 == sum(s.matmul_params for s in full["layer_shapes"])  # every decoder linear, not the head
    assert estimate(qlora, 65536, 1, 1, levers)["gpu"]["model states"] == pytest.approx(
        est_lora["gpu"]["model states"] - gathered - nf4 * (2 - NF4_BYTES) + 2 * full["layer_params"] * NF4_BYTES
        + 2 * full["inter"] * full["hidden"])
    # the optimizer states on the GPU (an offloaded optimizer would leave both runs the same bf16 weights there)
    plan = ["--model_config", "qwen3-0.6b", "--gpus", "1", "--gpu_mem_gib", "16", "--longest", "--ds_config",
            os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "ds_configs", "zero3.json")]
    assert main(plan) == 0
    longest_full = capsys.readouterr().out
    assert main(plan + ["--use_peft"]) == 0
    longest_lora = capsys.readouterr().out
    assert "(10.1M trained: LoRA r 16)" in longest_lora

    def tokens(out):
        return int(out.split("longest sequence that fits: ")[1].split(" tokens")[0].replace(",", ""))
    assert tokens(longest_lora) > tokens(longest_full)


def test_the_fused_loss_skips_a_frozen_heads_gradient():
    """A frozen head (LoRA's default) costs the fused loss no (vocab x hidden) product nor buffer, and the hidden
    states' gradient is the plain loss's; a trained head still gets its gradient."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ulysses_train.levers.loss import fused_linear_cross_entropy, plain_loss

    class HeadSized(TorchDispatchMode):
        """Counts the ops whose output has the head's shape (its gradient's products and buffers)."""

        def __init__(self, shape):
            super().__init__()
            self.shape, self.count = shape, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.count += isinstance(out, torch.Tensor) and tuple(out.shape) == self.shape
            return out

    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 13, 16, generator=g), torch.randn(40, 16, generator=g)
    labels = torch.randint(0, 40, (2, 13), generator=g)
    labels[0, :4] = -100
    normalizer = (labels != -100).sum().float()
    h = hidden.clone().requires_grad_()
    with HeadSized((40, 16)) as frozen:
        fused_linear_cross_entropy(h, weight, labels, normalizer, chunk_size=5).backward()
    reference = hidden.clone().requires_grad_()
    plain_loss(reference @ weight.t(), labels, normalizer).backward()
    torch.testing.assert_close(h.grad, reference.grad, rtol=1e-5, atol=1e-7)
    assert frozen.count == 0 and weight.grad is None
    trained = weight.clone().requires_grad_()
    with HeadSized((40, 16)) as counted:
        fused_linear_cross_entropy(hidden, trained, labels, normalizer, chunk_size=5).backward()
    assert counted.count > 0 and trained.grad is not None


@pytest.mark.gpu
@pytest.mark.parametrize("quantized", [False, True], ids=["lora", "qlora"])
def test_lora_in_bf16_on_cuda_is_as_exact_as_transformers_and_peft(tmp_path, quantized):
    """The trainer's first LoRA step on CUDA in bf16 with the levers at their defaults (our fused kernels, Liger's
    loss with the head frozen, kept attention) and the offload, on a pretrained Qwen3-0.6B-shaped folder cut to 4
    layers, at 4,096 tokens, against transformers + PEFT on the same weights (`--verify`); QLoRA: the base in NF4 on
    both sides (bitsandbytes), quantized from the same folder."""
    import sys

    from transformers import AutoModelForCausalLM

    from tests.trainer_runs import run
    from ulysses_train.model.build import load_model_config

    if quantized:
        pytest.importorskip("bitsandbytes")
    folder = tmp_path / "base"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(load_model_config(None, "qwen3-0.6b", 4), dtype=torch.bfloat16).save_pretrained(
        folder)
    proc = run([sys.executable], ["--verify", "--model", str(folder), "--tokenizer", "bytes", "--use_peft",
                                  "--lora_modules_to_save", "norm", "--seq_len", "4096", "--offload_activations"]
               + (["--load_in_4bit"] if quantized else []), tmp_path / "out", expect_ok=False)
    result = json.loads((tmp_path / "out" / "verify" / "verify.json").read_text())
    assert result["dtype"] == "bfloat16" and result["peft_version"] and not result["buffer_mismatches"], result
    assert result["passed"] and proc.returncode == 0, proc.stdout[-3000:]


def test_the_fused_kernels_run_the_adapters():
    """Our fused SwiGLU, rotary and norm kernels (Triton's interpreter on the CPU) on a model with adapters compute
    what PEFT's model does without them: the loss and every adapter's gradient, LoRA-B non-zero. The SwiGLU patch
    calls the projections as modules, so PEFT's layers run inside it; without them the adapters would get nothing."""
    from transformers import AutoModelForCausalLM

    from tests.models import tiny_config
    from ulysses_train.levers.fused_kernels import kernels_run_on, triton_importable
    from ulysses_train.model.adapters import AdapterSpec, add_adapters, randomize_lora_b
    from ulysses_train.model.surgery import install_fused_mlp, install_fused_rotary, install_lean_norms

    if not (triton_importable() and kernels_run_on(torch.device("cpu"))):
        pytest.skip("Triton's interpreter is not available")
    ids = torch.randint(3, 96, (1, 24), generator=torch.Generator().manual_seed(1))
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("qwen3"))
        add_adapters(model, AdapterSpec(r=4, alpha=8))
        randomize_lora_b(model, seed=0, std=0.1)
        if fused:
            assert install_fused_mlp(model) == 2 and install_fused_rotary(model) == 2
            assert install_lean_norms(model, fused=True) == 9
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (plain_loss, plain), (fused_loss, fused) = results
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-5, atol=1e-6)
    assert plain.keys() == fused.keys() and len(plain) == 28
    for name in plain:
        assert plain[name].abs().sum() > 0, name
        torch.testing.assert_close(fused[name], plain[name], rtol=1e-4, atol=1e-6, msg=name)


def test_qlora_loading_arguments_pass_transformers_zero3_check():
    """--load_in_4bit under ZeRO-3 failed on the GPU before any weight was read: the device_map we passed is refused
    by transformers while an HfDeepSpeedConfig for ZeRO-3 lives. The arguments now pass transformers' own check
    there, and its bitsandbytes quantizer puts the model on the current device, where the map had."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.accelerate import check_and_set_device_map
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer

    from ulysses_train.model.adapters import quantization_config
    from ulysses_train.model.build import quantized_loading

    arguments = quantized_loading(quantization_config(torch.bfloat16))
    assert arguments["quantization_config"].load_in_4bit
    zero3 = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    try:
        assert check_and_set_device_map(arguments.get("device_map")) is None
        with pytest.raises(ValueError, match="Zero-3 is not compatible with passing a `device_map`"):
            check_and_set_device_map({"": 0})  # what was passed
    finally:
        unset_hf_deepspeed_config()
        del zero3
    placed = Bnb4BitHfQuantizer(arguments["quantization_config"]).update_device_map(None)
    assert placed == {"": torch.cuda.current_device() if torch.cuda.is_available() else "cpu"}
