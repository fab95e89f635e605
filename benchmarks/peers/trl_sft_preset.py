"""Peer baseline on any of our presets (random init): TRL SFTTrainer with trl_sft_1gpu.py's long-context recipe
(chunked loss, checkpoint offload, bf16), with the model config taken from ulysses_train's PRESETS.
usage: PRESET=gemma3-4b [ATTN=sdpa|flash_attention_4] [LAYERS=N] python benchmarks/peers/trl_sft_preset.py SEQ_LEN STEPS
(needs TRL: pip install trl==1.16.0); writes trl_<preset>_<SEQ_LEN>.json into $OUT or the current folder."""
import json
import os
import resource
import sys

import torch
from peer_common import StepTimer, random_rows, word_tokenizer
from transformers import AutoConfig, AutoModelForCausalLM
from trl import SFTConfig, SFTTrainer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from ulysses_train.model.build import PRESETS

T, STEPS = int(sys.argv[1]), int(sys.argv[2])
preset = dict(PRESETS[os.environ.get("PRESET", "gemma3-4b")])
if "LAYERS" in os.environ:
    preset["num_hidden_layers"] = int(os.environ["LAYERS"])
    if preset.get("layer_types"):
        preset["layer_types"] = preset["layer_types"][:preset["num_hidden_layers"]]
cfg = AutoConfig.for_model(**preset)
if getattr(cfg, "layer_types", None):
    cfg.layer_types = cfg.layer_types[:cfg.num_hidden_layers]
torch.manual_seed(0)
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16,
                                             attn_implementation=os.environ.get("ATTN", "sdpa"))
print("params", sum(p.numel() for p in model.parameters()) / 1e9, "B", flush=True)
tok = word_tokenizer()
ds = random_rows(cfg.vocab_size, T, STEPS)


args = SFTConfig(output_dir="/tmp/trl_out", max_length=T, per_device_train_batch_size=1, max_steps=STEPS, bf16=True,
                 gradient_checkpointing=True, gradient_checkpointing_kwargs={"offload": True, "use_reentrant": False},
                 logging_steps=1, report_to="none", learning_rate=1e-5, save_strategy="no", dataloader_num_workers=0)
timer = StepTimer()
SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, callbacks=[timer]).train()
res = dict(tool="trl", preset=os.environ.get("PRESET", "gemma3-4b"), attn=os.environ.get("ATTN", "sdpa"), T=T,
           layers=cfg.num_hidden_layers, step_s=timer.times,
           median_s=sorted(timer.times[1:])[len(timer.times[1:]) // 2],
           peak_gib=torch.cuda.max_memory_allocated() / 2**30,
           host_maxrss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
print("RESULT", json.dumps(res), flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), f"trl_{res['preset']}_{T}.json"), "w"), indent=1)
