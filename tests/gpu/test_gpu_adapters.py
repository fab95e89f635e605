"""A LoRA run on the GPU, loaded back as users do (marked gpu, skipped without CUDA): its checkpoint with
`PeftModel.from_pretrained(base, checkpoint)`, its merged export with `from_pretrained` alone, each giving the trained
model's logits within bf16 rounding, far below what the adapters changed.

The run trains in bf16 with every lever at its default on a two-layer Qwen3-0.6B-shaped model saved as a pretrained
folder (a random init: numerics of a load do not depend on what the weights are), at a learning rate that moves the
adapters well clear of bf16's rounding of the logits."""

import pytest
import torch

pytestmark = pytest.mark.gpu
SEQ = 2048
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU for a dry run of the test itself


def _trained_logits(trainer, ids: torch.Tensor) -> torch.Tensor:
    model = trainer.module.model
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids.to(DEVICE),
                                     position_ids=torch.arange(ids.shape[1])[None].to(DEVICE))[0]
        return model.get_output_embeddings()(hidden).float().cpu()


def test_a_lora_checkpoint_and_its_merged_export_load_with_the_trained_logits(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ulysses_train.model.build import load_model_config
    from ulysses_train.tools.export import main as export_main
    from ulysses_train.train.api import launcher_environment
    from ulysses_train.train.config.config_file import parse_args
    from ulysses_train.train.run.trainer import Trainer
    from ulysses_train.train.step.loop import train

    base = tmp_path / "base"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(load_model_config(None, "qwen3-0.6b", 2), dtype=torch.bfloat16
                                     ).save_pretrained(base)
    cfg, explicit = parse_args(["--model", str(base), "--tokenizer", "bytes", "--seq_len", str(SEQ), "--steps", "6",
                                "--lr", "2e-3", "--use_peft", "--output_dir", str(tmp_path / "run")])
    ids = torch.randint(3, 200, (1, 256), generator=torch.Generator().manual_seed(1))
    with launcher_environment():  # rank 0 of 1, as a single process sets for itself
        trainer = Trainer(cfg, explicit)
        try:
            losses = [r["loss"] for r in train(trainer)]
            trained = _trained_logits(trainer, ids)
        finally:
            trainer.close()
    checkpoint = str(tmp_path / "run" / "checkpoints" / "step_00000006")
    assert export_main([checkpoint, str(tmp_path / "merged"), "--merge"]) == 0
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).to(DEVICE)
    with torch.no_grad():
        untrained = plain(input_ids=ids.to(DEVICE)).logits.float().cpu()
        loaded = PeftModel.from_pretrained(plain, checkpoint)(input_ids=ids.to(DEVICE)).logits.float().cpu()
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").to(DEVICE)(input_ids=ids.to(DEVICE))
    merged = merged.logits.float().cpu()
    change = (trained - untrained).norm() / untrained.norm()
    print(f"losses {losses}; adapters changed the logits by {change:.3e}")
    assert losses[-1] < losses[0] and change > 5e-2
    for name, logits in (("checkpoint + PEFT", loaded), ("merged export", merged)):
        error = ((logits - trained).norm() / trained.norm()).item()
        print(f"{name}: {error:.3e} from the trained logits")
        assert error < 2e-2 and error < change / 4, name  # bf16 rounding of the logits, far below the change
