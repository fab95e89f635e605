"""Peer baseline for LoRA: TRL SFTTrainer + PEFT with trl_sft_1gpu.py's long-context recipe (checkpoint offload,
bf16), LoRA r 16, alpha 32, dropout 0 on every linear layer ("all-linear", TRL's --lora_target_modules all-linear),
on a random-init preset of ulysses_train/model/build.py (default Qwen3-8B), one sequence of SEQ_LEN tokens a step.
usage: [PRESET=qwen3-8b] [ATTN=sdpa|flash_attention_4] [LAYERS=N] [LIGER=1] python benchmarks/peers/trl_sft_lora.py
       SEQ_LEN STEPS        (needs TRL and PEFT: pip install trl==1.16.0 peft)
writes trl_lora_<preset>_<SEQ_LEN>.json into $OUT or the current folder and prints RESULT {json}."""
import json
import os
import resource
import sys

import torch
from peer_common import StepTimer, random_rows, word_tokenizer
from peft import LoraConfig
from transformers import AutoConfig, AutoModelForCausalLM
from trl import SFTConfig, SFTTrainer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from ulysses_train.model.build import PRESETS

T, STEPS = int(sys.argv[1]), int(sys.argv[2])
name = os.environ.get("PRESET", "qwen3-8b")
preset = dict(PRESETS[name])
if "LAYERS" in os.environ:
    preset["num_hidden_layers"] = int(os.environ["LAYERS"])
# the same YaRN positions as our runs past the pretrained length (--rope_scaling yarn); the cost is the same either way
if preset.get("model_type") == "qwen3" and T > preset["max_position_embeddings"]:
    preset["rope_parameters"] = {"rope_type": "yarn", "rope_theta": preset.pop("rope_theta"),
                                 "factor": T / preset["max_position_embeddings"],
                                 "original_max_position_embeddings": preset["max_position_embeddings"]}
cfg = AutoConfig.for_model(**preset)
torch.manual_seed(0)
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16,
                                             attn_implementation=os.environ.get("ATTN", "sdpa"))
print("params", sum(p.numel() for p in model.parameters()) / 1e9, "B", flush=True)
tok = word_tokenizer()
ds = random_rows(cfg.vocab_size, T, STEPS)


peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
args = SFTConfig(output_dir="/tmp/trl_lora_out", max_length=T, per_device_train_batch_size=1, max_steps=STEPS,
                 bf16=True,
                 gradient_checkpointing=True, gradient_checkpointing_kwargs={"offload": True, "use_reentrant": False},
                 use_liger_kernel=os.environ.get("LIGER") == "1",
                 logging_steps=1, report_to="none", learning_rate=1e-4, save_strategy="no", dataloader_num_workers=0)
timer = StepTimer()
trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, callbacks=[timer],
                     peft_config=peft_config)
trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
trainer.train()
after = timer.times[1:] or timer.times
res = dict(tool="trl+peft", preset=name, attn=os.environ.get("ATTN", "sdpa"), liger=os.environ.get("LIGER") == "1",
           T=T, layers=cfg.num_hidden_layers, trainable_params=trainable, step_s=timer.times,
           median_s=sorted(after)[len(after) // 2], peak_gib=torch.cuda.max_memory_allocated() / 2**30,
           host_maxrss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
print("RESULT", json.dumps(res), flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), f"trl_lora_{name}_{T}.json"), "w"), indent=1)
