"""Peer baseline: TRL DPOTrainer, long-context recipe (fused LM head, checkpoint offload, precomputed reference
log-probs, bf16), random-init Qwen3-4B, one pair per step (chosen and rejected: two rows of SIDE tokens).
usage: [ATTN=sdpa|flash_attention_4] [LAYERS=36] python benchmarks/peers/trl_dpo_1gpu.py DATA_DIR SIDE STEPS
DATA_DIR holds what benchmarks/dpo_data.py --side SIDE wrote (pairs_SIDE.jsonl, tokenizer/); needs trl==1.16.0.
Writes trl_dpo_<SIDE>.json into $OUT or the current folder."""
import json
import os
import resource
import sys
import time

import torch
from datasets import load_dataset
from peer_common import StepTimer
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config
from trl import DPOConfig, DPOTrainer

DATA, SIDE, STEPS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
LAYERS, ATTN = int(os.environ.get("LAYERS", 36)), os.environ.get("ATTN", "sdpa")
T = 2 * SIDE  # tokens per step: the pair's two rows
cfg = Qwen3Config(vocab_size=151936, num_hidden_layers=LAYERS, hidden_size=2560, intermediate_size=9728,
                  tie_word_embeddings=True, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                  max_position_embeddings=40960, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 1_000_000, "factor": max(1.0, SIDE / 40960),
                                   "original_max_position_embeddings": 40960})
torch.manual_seed(0)
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation=ATTN)
print("params", sum(p.numel() for p in model.parameters()) / 1e9, "B", flush=True)
tok = PreTrainedTokenizerFast.from_pretrained(os.path.join(DATA, "tokenizer"))
ds = load_dataset("json", data_files=os.path.join(DATA, f"pairs_{SIDE}.jsonl"), split="train")


args = DPOConfig(output_dir="/tmp/trl_dpo_out", max_length=None, per_device_train_batch_size=1, max_steps=STEPS,
                 bf16=True, gradient_checkpointing=True,
                 gradient_checkpointing_kwargs={"offload": True, "use_reentrant": False},
                 precompute_ref_log_probs=True, logging_steps=1, report_to="none", learning_rate=1e-5,
                 save_strategy="no", dataloader_num_workers=0)
timer = StepTimer()
start = time.perf_counter()
tr = DPOTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, callbacks=[timer])
init_s = time.perf_counter() - start  # tokenizing and the reference log-probs of every pair
lengths = [len(r["prompt_ids"]) + len(r["chosen_ids"]) for r in tr.train_dataset]
print(f"init {init_s:.1f} s (tokenizing, reference log-probs), sides of {min(lengths)}-{max(lengths)} tokens",
      flush=True)
torch.cuda.reset_peak_memory_stats()
tr.train()
res = dict(tool="trl_dpo", attn=ATTN, side=SIDE, T=T, layers=LAYERS, step_s=timer.times, init_s=init_s,
           peak_gib=torch.cuda.max_memory_allocated() / 2**30,
           host_maxrss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
           tokens_per_s=T / min(timer.times[1:] or timer.times), trl=__import__("trl").__version__)
with open(os.path.join(os.environ.get("OUT", "."), f"trl_dpo_{SIDE}.json"), "w") as f:
    json.dump(res, f, indent=1)
print("RESULT", json.dumps(res), flush=True)
