"""Peer baseline on any of our presets (random init): TRL SFTTrainer with trl_sft_1gpu.py's long-context recipe
(chunked loss, checkpoint offload, bf16), with the model config taken from ulysses_train's PRESETS.
usage: PRESET=gemma3-4b [ATTN=sdpa|flash_attention_4] [LAYERS=N] python benchmarks/peers/trl_sft_preset.py SEQ_LEN STEPS
(needs TRL: pip install trl==1.16.0); writes trl_<preset>_<SEQ_LEN>.json into $OUT or the current folder."""
import os, sys, time, json, resource
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
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
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation=os.environ.get("ATTN", "sdpa"))
print("params", sum(p.numel() for p in model.parameters()) / 1e9, "B", flush=True)
tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2}, unk_token="<unk>")),
                              pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
g = torch.Generator().manual_seed(0)
ds = Dataset.from_dict({"input_ids": [torch.randint(3, cfg.vocab_size, (T,), generator=g).tolist() for _ in range(STEPS)]})

class Timer(TrainerCallback):
    def __init__(self): self.times = []
    def on_step_begin(self, *a, **k): torch.cuda.synchronize(); self.t = time.perf_counter()
    def on_step_end(self, *a, **k):
        torch.cuda.synchronize(); self.times.append(time.perf_counter() - self.t)
        print(f"step {len(self.times)}: {self.times[-1]:.2f} s, peak {torch.cuda.max_memory_allocated()/2**30:.1f} GiB", flush=True)

args = SFTConfig(output_dir="/tmp/trl_out", max_length=T, per_device_train_batch_size=1, max_steps=STEPS, bf16=True,
                 gradient_checkpointing=True, gradient_checkpointing_kwargs={"offload": True, "use_reentrant": False},
                 logging_steps=1, report_to="none", learning_rate=1e-5, save_strategy="no", dataloader_num_workers=0)
timer = Timer()
SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, callbacks=[timer]).train()
res = dict(tool="trl", preset=os.environ.get("PRESET", "gemma3-4b"), attn=os.environ.get("ATTN", "sdpa"), T=T,
           layers=cfg.num_hidden_layers, step_s=timer.times, median_s=sorted(timer.times[1:])[len(timer.times[1:]) // 2],
           peak_gib=torch.cuda.max_memory_allocated() / 2**30,
           host_maxrss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
print("RESULT", json.dumps(res), flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), f"trl_{res['preset']}_{T}.json"), "w"), indent=1)
