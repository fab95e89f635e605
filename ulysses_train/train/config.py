"""Typed run configuration, grouped by concern: every command-line flag is a field of one group dataclass here
(`TrainConfig.data.seq_len`, `TrainConfig.optim.lr`, ...), with its type (`Literal` for choices), its bounds and its
help text. The parser, YAML files (flat or grouped), `--help` (one section per group), the resolved `config.yaml` and
the Python API all read these classes. Every check that can be made before any process group exists is made in
`TrainConfig.validate`, so that bad settings fail on every rank the same way, before any work, with a message that
names the flag to change. Flag names are unique across the groups, so a flat mapping of flags is a whole config."""

import argparse
import copy
import dataclasses
import json
import math
import os
import re
import sys
import typing
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from ..data.load import DataSettings
from ..data.messages import parse_role_map
from ..data.mixture import dataset_entries
from ..data.sft import DATA_FORMATS, LOSS_ON, TRUNCATION
from ..errors import ConfigError
from ..levers.policy import ATTN_RECOMPUTE, AUTO_ON_OFF, LOSS_KERNELS, LOSS_KINDS, LeverRequest
from ..levers.preference_loss import LOSS_TYPES, METHODS
from ..levers.rope import ROPE_SCALINGS
from ..sp.kernels import ATTN_KERNELS
from ..sp.linear_kernel import LINEAR_KERNELS
from . import aliases
from .ds_config import load_ds_config
from .metrics import PROGRESS
from .schedule import LR_SCHEDULES

# The choices of the flags whose choices live here; the other tuples come from the modules that act on them. Each
# field's type is Literal[<tuple>], and the parser reads the choices back from that type.
DTYPES = ("auto", "bf16", "fp32")
LAST_SAMPLE = ("drop", "pad")
LEAN_NORM = (*AUTO_ON_OFF, "true", "false")  # true and false as when the flag was a switch
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _f(default, help: str, *, gt=None, ge=None, lt=None, le=None, why: str = "", repeated: bool = False):
    """A flag's field: its default, its help, its bounds (checked by `check_bounds`: gt/ge/lt/le, `why` said after a
    violation) and whether it may be given several times."""
    bounds = {k: v for k, v in (("gt", gt), ("ge", ge), ("lt", lt), ("le", le)) if v is not None}
    return field(default=default, metadata={"help": help, "bounds": bounds, "why": why, "repeated": repeated})


@dataclass
class ModelConfig:
    """Model: the pretrained weights or the random initialisation, the precision, the rotary positions.

    `TrainConfig.base` (the flag --model is its path, so the group takes another name)."""

    model: Optional[str] = _f(None, "Local folder or hub id of a pretrained causal LM (weights and tokenizer are "
                              "loaded from it). Mutually exclusive with --model_config.")
    model_config: Optional[str] = _f(None, "Random initialisation from a preset (tiny, qwen3-0.6b, qwen3-4b, qwen3-8b, "
                                     "qwen3-30b-a3b) or a config.json path. Default: tiny, when --model is not given.")
    num_layers: Optional[int] = _f(None, "Override the number of decoder layers of --model_config (for benchmarks at "
                                   "reduced depth).", gt=0)
    dtype: Literal[DTYPES] = _f("auto", "Training precision: auto is bf16 on GPU and fp32 on CPU.")
    rope_scaling: Literal[ROPE_SCALINGS] = _f("none", "yarn: YaRN rescaling of rotary positions for sequences past the "
                                              "model's pretrained length; rope_theta and that length are read from the "
                                              "model config.")
    rope_factor: Optional[float] = _f(None, "YaRN factor. Default: --seq_len / the model's pretrained length.")
    rope_theta: Optional[float] = _f(None, "Only as a check: must equal the model's rope_theta (it is read from the "
                                     "model config).")
    rope_original_max_positions: Optional[int] = _f(None, "Only as a check: must equal the model's pretrained length "
                                                    "(read from the model config).")


@dataclass
class DataConfig:
    """Data: what is read, how it is tokenized and cut into samples (data/ takes this group)."""

    dataset: Union[str, dict, list, None] = _f(None, "Training data: a hub id (datasets.load_dataset) or a local "
                                               "file/folder of .txt (one file = one document), .jsonl/.json, .parquet, "
                                               ".arrow, or a save_to_disk folder. Given several times (or as a YAML "
                                               "list), a mixture: each entry a path or a JSON object {path, split, "
                                               "weight | samples, data_format, text_column, messages_field, role_map} "
                                               "(README: Data). Default: generated tokens (the embedded default).",
                                               repeated=True)
    dataset_split: str = _f("train", "Split of --dataset.")
    text_column: Optional[str] = _f(None, "Column holding the text. Default: 'text'.")
    data_format: Literal[DATA_FORMATS] = _f("auto", "What --dataset holds. messages: a list of {role, content} per "
                                            "row, rendered with the chat template; prompt_completion: prompt and "
                                            "completion strings or message lists; tokens: input_ids, with optional "
                                            "labels or assistant_masks; text: raw text. auto: from the columns, in "
                                            "that order.")
    messages_field: Optional[str] = _f(None, "The column holding each row's message list, for layouts other than "
                                       "`messages` and ShareGPT's `conversations` (both detected).")
    role_map: Optional[str] = _f(None, "The data's roles -> the chat template's, as from=to pairs with commas (or a "
                                 "mapping in YAML), over the defaults human=user, gpt=assistant, observation=tool, "
                                 "function_call=assistant (a tool call) (README: Data).")
    tokenizer: Optional[str] = _f(None, "'bytes' (byte-level, 259 ids, offline), a tokenizer path/hub id, or by "
                                  "default the --model's own (bytes when there is no --model).")
    seq_len: int = _f(1024, "Tokens per sequence (one sample). Must be a multiple of --sp_size.", gt=0)
    pad_to_sp: bool = _f(False, "Pad sequences to a multiple of --sp_size (padding not trained on) instead of failing "
                         "when --seq_len is not one.")
    packing: bool = _f(False, "Keep document boundaries inside a sample: positions restart at each document and "
                       "attention never crosses one (also under sequence parallelism). Conversations: pack whole ones "
                       "into each sample (first-fit decreasing) instead of one per sample.")
    last_sample: Literal[LAST_SAMPLE] = _f("drop", "The corpus's last partial sample: drop it, or pad it (padding is "
                                           "not trained on).")
    streaming: bool = _f(False, "Stream a hub dataset instead of downloading it whole (with --max_tokens).")
    max_tokens: Optional[int] = _f(None, "Stop reading the corpus after this many tokens.", gt=0)
    num_proc: Optional[int] = _f(None, "Processes for tokenizing (datasets.map).", gt=0)
    data_cache_dir: str = _f(os.path.join(os.path.expanduser("~"), ".cache", "ulysses_train"),
                             "Where the tokenized corpus arrays are cached (keyed by the data and tokenizer).")
    seed: int = _f(0, "Seed for initialisation and data. The same seed gives the same data whatever --sp_size is.")


@dataclass
class SFTConfig:
    """SFT: which tokens are trained and how conversations are rendered and cut."""

    loss_on: Literal[LOSS_ON] = _f("auto", "Which tokens are trained. assistant: every assistant turn (content and "
                                   "end-of-turn token); completion: what the completion adds to the prompt; all: every "
                                   "token. auto: assistant for messages, completion for prompt/completion, all for "
                                   "text, and for tokens their labels or assistant_masks.")
    chat_template: Optional[str] = _f(None, "A Jinja chat template file for messages data, instead of the tokenizer's "
                                      "own. Its {%% generation %%} markers, if any, say what is trained; otherwise "
                                      "assistant turns are found by rendering growing prefixes of each conversation.")
    truncation: Literal[TRUNCATION] = _f("error", "A conversation longer than --seq_len: error (the message gives how "
                                         "many and the longest), left (keep its end) or right (keep its start).")


@dataclass
class PreferenceConfig:
    """Preference training: DPO, SimPO, ORPO on prompt/chosen/rejected pairs (train/preference.py)."""

    method: Literal[METHODS] = _f("sft", "sft: the next-token loss on what --loss_on trains. dpo: Direct Preference "
                                  "Optimization on prompt/chosen/rejected pairs against the reference (the initial "
                                  "weights; their log-probs computed once per dataset under SP and cached beside the "
                                  "tokens). simpo, orpo: reference-free (README: \"Preference training\").")
    beta: float = _f(0.1, "The preference loss's beta (TRL's): DPO's KL weight, SimPO's reward scale, ORPO's "
                     "odds-ratio weight.", gt=0)
    loss_type: Literal[LOSS_TYPES] = _f("sigmoid", "DPO's loss, as TRL names it: sigmoid (DPO), ipo (IPO, per-token "
                                        "means), hinge (SLiC).")
    simpo_gamma: float = _f(0.5, "SimPO's target reward margin gamma (TRL's simpo_gamma).")
    max_length: Optional[int] = _f(None, "Preference pairs: the most tokens of one side (prompt + completion), TRL's "
                                   "max_length; a longer side is an error or cut by --truncation (left: the prompt's "
                                   "start, right: the completions' ends). Default: --seq_len / 2 (a row of --seq_len "
                                   "holds both sides of a pair).", gt=0)


@dataclass
class AdapterConfig:
    """Adapters: LoRA and QLoRA with PEFT, under TRL's flag names (model/adapters.py takes this group)."""

    use_peft: bool = _f(False, "Train LoRA adapters (PEFT) on the frozen model instead of every weight: only the "
                        "adapters and --lora_modules_to_save get gradients, optimizer states and checkpoint space. "
                        "Exact under SP and ZeRO-3 (--verify compares with transformers + PEFT).")
    lora_r: int = _f(16, "LoRA rank (with --use_peft).", gt=0)
    lora_alpha: int = _f(32, "LoRA alpha: the adapter's update is scaled by alpha / r (with --use_peft).", gt=0)
    lora_dropout: float = _f(0.0, "Dropout on each LoRA layer's input (with --use_peft; 0: none, the run is "
                             "deterministic and --verify can check it).", ge=0, lt=1)
    lora_target_modules: str = _f("all-linear", "Modules that get adapters: comma-separated names (matched as PEFT "
                                  "does: the module's name or its last components, e.g. q_proj,v_proj; lm_head too), "
                                  "or all-linear: every linear layer of the decoder, not the LM head.")
    lora_modules_to_save: Optional[str] = _f(None, "Modules trained whole beside the adapters and saved with them "
                                             "(PEFT's modules_to_save: a module whose name ends with the string), e.g. "
                                             "embed_tokens,lm_head,norm; norm takes every RMSNorm (LongLoRA's "
                                             "trainable embeddings and norms).")
    load_in_4bit: bool = _f(False, "QLoRA: the frozen base in bitsandbytes' 4-bit NF4, computing in bf16 (with "
                            "--use_peft and a pretrained --model; CUDA and bitsandbytes only).")


@dataclass
class OptimConfig:
    """Optimisation: steps or epochs, the lr schedule, AdamW, clipping, accumulation."""

    steps: int = _f(30, "Optimizer steps to run.", gt=0)
    epochs: Optional[float] = _f(None, "Passes over --dataset: --steps becomes ceil(epochs x samples / (micro batch x "
                                 "grad_accum x data-parallel size)). A --steps given as well wins (as max_steps does "
                                 "in transformers).", gt=0)
    lr: Optional[float] = _f(None, "Peak learning rate. Default: the DS config's optimizer lr, else 1e-3 for random "
                             "init and 1e-5 for a pretrained --model.", gt=0)
    lr_scheduler_type: Literal[LR_SCHEDULES] = _f("cosine", "The lr after the warmup: cosine or linear decay from --lr "
                                                  "to --lr x --min_lr_ratio at the last step, or constant_with_warmup.")
    min_lr_ratio: float = _f(0.1, "Cosine decay ends at lr * min_lr_ratio.",
                             ge=0, le=1, why="it is the fraction of --lr the cosine decay ends at")
    warmup_steps: Optional[int] = _f(None, "Linear warmup steps. Default: --warmup_ratio, else 10%% of --steps.")
    warmup_ratio: Optional[float] = _f(None, "Warmup as a fraction of --steps (rounded up), unless --warmup_steps is "
                                       "given and > 0.", ge=0, le=1)
    weight_decay: float = _f(0.0, "AdamW weight decay.", ge=0)
    max_grad_norm: Optional[float] = _f(None, "Gradient clipping norm (0 disables). Default: the DS config's "
                                        "gradient_clipping, else 1.0.", ge=0)
    adam_beta1: float = _f(0.9, "AdamW's beta1 (a --ds_config optimizer block's \"auto\" betas take it).", ge=0, lt=1)
    adam_beta2: float = _f(0.95, "AdamW's beta2 (transformers' default is 0.999; 0.95 is the usual choice for LLM "
                           "training).", ge=0, lt=1)
    adam_epsilon: float = _f(1e-8, "AdamW's epsilon (a --ds_config optimizer block's \"auto\" eps takes it).", gt=0)
    grad_accum: Optional[int] = _f(None, "Micro-steps per optimizer step. Default: the DS config's "
                                   "gradient_accumulation_steps, else 1.", gt=0)
    skip_nonfinite: bool = _f(False, "Skip an optimizer step whose loss is NaN/inf instead of stopping the run (needs "
                              "--grad_accum 1).")


@dataclass
class ParallelConfig:
    """Parallelism: the sequence-parallel layout, the micro batch, the DeepSpeed JSON, the watchdog."""

    sp_size: Optional[int] = _f(None, "Sequence-parallel group size: ranks that share one sequence. Must divide the "
                                "world size; the rest is data parallel. Default: the ranks on one node.", gt=0)
    ring_size: str = _f("1", "Ring attention degree inside each SP group: --sp_size ranks run as Ulysses (sp / ring "
                        "consecutive ranks split the heads) x ring (K/V blocks passed around, zigzag balanced, exact, "
                        "packing kept). A ring lifts the head-count limit (28 heads at --sp_size 8: --ring_size 2). "
                        "auto: the largest Ulysses degree the heads allow.")
    micro_batch_size: Optional[int] = _f(None, "Sequences per SP group per micro-step. Default: the DS config's "
                                         "train_micro_batch_size_per_gpu, else 1.", gt=0)
    ds_config: str = _f(os.path.join(REPO_ROOT, "ds_configs", "zero3.json"),
                        "DeepSpeed JSON config. Values set to \"auto\" are filled from the flags.")
    dist_timeout: float = _f(600.0, "Seconds a rank may go without a heartbeat before it is named frozen and every "
                             "rank stops with exit code 3 (the heartbeat runs beside the training loop, so long steps "
                             "never trip it; see train/watchdog.py).", gt=0)


@dataclass
class LeverConfig:
    """Memory and speed levers: kernels, checkpointing, recompute, tiling, offload (levers/ takes this group).

    They compute the same numbers (docs/verify.md checks them against transformers)."""

    attn_kernel: Literal[ATTN_KERNELS] = _f("auto", "Local attention kernel run inside the Ulysses all-to-all. auto: "
                                            "flash_attn_4 where it runs (package flash-attn-4 installed, compute "
                                            "capability 9.0+, bf16/fp16), else sdpa (cuDNN on Hopper).")
    linear_kernel: Literal[LINEAR_KERNELS] = _f("auto", "Kernel of the Gated DeltaNet layers' recurrence (Qwen3.5, "
                                                "Qwen3-Next). fla: flash-linear-attention's (CUDA; pip install -e "
                                                "\".[fla]\"; on Hopper with Triton < 3.7.1 it needs tilelang too). "
                                                "torch: transformers' reference, any device, much slower on a GPU. "
                                                "auto: fla where it runs and agrees with torch in a self-check at "
                                                "start-up, else torch (the reason logged).")
    loss: Literal[LOSS_KINDS] = _f("fused", "fused: LM head + cross-entropy in row chunks, gradients computed in the "
                                   "forward, so the full logits never exist. plain: the ordinary loss, for comparison.")
    loss_kernel: Literal[LOSS_KERNELS] = _f("auto", "Whose fused loss runs. liger: Liger-Kernel's fused linear "
                                            "cross-entropy (1.7x faster than ours on the H200; it picks its own "
                                            "chunks, about tokens x hidden logits). ours: ulysses_train's, chunked by "
                                            "--loss_chunk_size, on any device. auto: liger on CUDA when liger-kernel "
                                            "is installed and agrees with ours in a self-check at start-up, else ours "
                                            "(the reason logged).")
    loss_chunk_size: int = _f(4096, "Rows per chunk of our fused loss (--loss_kernel ours; peak loss memory ~ chunk x "
                              "vocab x 6 bytes in bf16).", gt=0)
    gradient_checkpointing: bool = _f(True, "Checkpoint every decoder layer (recompute it in backward).")
    checkpoint_layers: str = _f("all", "How many decoder layers are checkpointed: the first N (0 to the model's "
                                "depth); the others keep their activations, which costs memory and saves their "
                                "recompute. all: every layer. auto: the fewest checkpointed layers with which the "
                                "planner's memory estimate fits the device (python -m ulysses_train.plan prints it; "
                                "every layer on the CPU).")
    attn_recompute: Literal[ATTN_RECOMPUTE] = _f("auto", "never: keep each layer's attention output and log-sum-exp "
                                                 "from the forward, so the recompute skips the attention kernel (costs "
                                                 "layers x seq/sp x hidden x 2 bytes; on the host with "
                                                 "--offload_activations). always: plain checkpointing. auto: keep "
                                                 "while that takes under 15%% of the device memory, or with "
                                                 "--offload_activations while it and the checkpoints take under half "
                                                 "the host memory.")
    tiled_mlp: Literal[AUTO_ON_OFF] = _f("auto", "Run each dense MLP over sequence tiles of --mlp_tile_tokens, "
                                         "recomputed per tile in backward, so its seq x intermediate tensors never "
                                         "exist whole. auto: on when one such tensor would exceed 2 GiB.")
    mlp_tile_tokens: int = _f(16384, "Tokens per MLP tile (per rank).", gt=0)
    share_master_weights: bool = _f(True, "ZeRO-3 with master weights in the model's dtype (bf16 states, or fp32): the "
                                    "optimizer updates the model's partition in place instead of a copy of it (2 bytes "
                                    "per parameter less in bf16; the same numbers).")
    lean_norm: Literal[LEAN_NORM] = _f("auto", "Llama-style RMSNorms save their input in the model dtype and one fp32 "
                                       "number per row for the backward, instead of an fp32 copy of the input (4 bytes "
                                       "less per element in bf16; the same forward, bit for bit). auto: on where the "
                                       "model has such norms. on (true): required. off (false): transformers' norms.")
    fused_kernels: Literal[AUTO_ON_OFF] = _f("auto", "Our Triton kernels for the RMSNorms (lean, as --lean_norm), the "
                                             "rotary embedding and the SwiGLU product: one kernel each way instead of "
                                             "up to seven small ones (docs/benchmarks.md). auto: on for CUDA devices "
                                             "with Triton installed, if a self-check against the ops they replace "
                                             "passes (else those ops, the reason logged). on: required. off: "
                                             "transformers' ops.")
    offload_activations: bool = _f(False, "Move checkpointed layer inputs to pinned host memory on a side stream, "
                                   "prefetched back one layer ahead of the backward (GPU only).")


@dataclass
class OutputConfig:
    """Output and checkpoints: where the run writes, when it saves, how it resumes."""

    output_dir: str = _f("outputs/run", "Where metrics.jsonl (and TensorBoard logs) are written.")
    config: Optional[str] = _f(None, "A YAML file whose keys are these flags (without --), at the top level or under "
                               "their group's key (data: {seq_len: 4096}); the command line overrides it. The "
                               "resolved settings are written, grouped, to <output_dir>/config.yaml.")
    save_steps: int = _f(0, "Save a checkpoint every N optimizer steps (0: only the final one and on SIGTERM).", ge=0)
    save_final: bool = _f(True, "Save a checkpoint after the last step, so that a finished run leaves its weights.")
    save_total_limit: Optional[int] = _f(None, "Keep only the newest K complete checkpoints (the one just written "
                                         "always among them).", gt=0)
    resume: Optional[str] = _f(None, "auto: continue from the newest intact checkpoint in <output_dir> (start fresh if "
                               "there is none); or a checkpoint path (a rollback: the newer checkpoints move to "
                               "<output_dir>/checkpoints/abandoned/).")
    resume_override: Optional[str] = _f(None, "Comma-separated settings that may differ from the resumed checkpoint's, "
                                        "e.g. lr,steps (the new values apply; the lr schedule becomes the one the new "
                                        "flags give). Without it a setting that changes what is trained is an error "
                                        "naming each difference.")
    overwrite_output_dir: bool = _f(False, "Start afresh in an --output_dir that holds another run's checkpoints: "
                                    "removes its checkpoints/, metrics.jsonl and tensorboard/.")


@dataclass
class LogConfig:
    """Logging: the step lines, the progress bar, the trackers, memory profiles, tracebacks."""

    log_every: int = _f(1, "Print a metrics line every N optimizer steps (metrics.jsonl gets every step).", gt=0)
    progress: Literal[PROGRESS] = _f("auto", "Rank 0's progress: bar (a progress bar, the step lines above it), lines "
                                     "(the step lines alone: `grep '^step'` finds them in a redirected log), none "
                                     "(neither). auto: bar when stderr is a terminal, else lines.")
    report_to: str = _f("none", "Experiment trackers beside metrics.jsonl, comma-separated: tensorboard, wandb, mlflow "
                        "(or none). They work offline, into <output_dir>, unless WANDB_MODE / an API key or "
                        "MLFLOW_TRACKING_URI point elsewhere (train/tracking.py); wandb and mlflow come with the "
                        "[track] extra.")
    tensorboard: bool = _f(False, "Also write the metrics to TensorBoard under <output_dir>/tensorboard (the same as "
                           "adding tensorboard to --report_to).")
    profile_memory: int = _f(0, "Record memory for the first N steps: <output_dir>/memory/memory.png (stacked by "
                             "category), memory.json and, on CUDA, PyTorch's snapshot.pickle. Slows those steps.", ge=0)
    debug: bool = _f(False, "Print full tracebacks of unexpected errors (they always go to "
                     "<output_dir>/errors/rank_N.txt).")


@dataclass
class EvalConfig:
    """Evaluation: the validation loss on --eval_dataset."""

    eval_dataset: Optional[str] = _f(None, "Validation data, in any form --dataset takes (the same format flags "
                                     "apply): its loss, at --seq_len under SP, goes to metrics.jsonl and the trackers "
                                     "every --eval_steps and after the last step.")
    eval_split: Optional[str] = _f(None, "Split of --eval_dataset. Default: --dataset_split.")
    eval_steps: int = _f(0, "Evaluate every N optimizer steps (0: only after the last step).", ge=0)
    eval_samples: Optional[int] = _f(None, "Evaluate on the first N samples of --eval_dataset. Default: all.", gt=0)


@dataclass
class VerifyConfig:
    """Verification: one step compared with plain transformers instead of training."""

    verify: bool = _f(False, "Check this run against plain transformers instead of training: one step of the run as "
                      "configured (every flag applies) at --verify_seq_len, its loss and every parameter's gradient "
                      "compared with a single-process transformers reference on the same weights and tokens, in fp32 "
                      "and in the run's dtype. Prints a table and the verdict; exit code 0 within tolerance, 1 outside "
                      "it (README: \"Is my run exact?\").")
    verify_seq_len: Optional[int] = _f(None, "Tokens per sequence of the --verify step. Default: min(--seq_len, 4096).",
                                       gt=0)

GROUPS = {"base": ModelConfig, "data": DataConfig, "sft": SFTConfig, "pref": PreferenceConfig,
          "adapters": AdapterConfig, "optim": OptimConfig, "parallel": ParallelConfig, "levers": LeverConfig,
          "output": OutputConfig, "log": LogConfig, "eval": EvalConfig, "check": VerifyConfig}


class Flag(typing.NamedTuple):
    """One flag: its group's attribute on TrainConfig, its field, its value type (int, float, str, bool; a Literal's
    values' type) and its choices (a Literal's values, else None)."""

    group: str
    field: dataclasses.Field
    type: type
    choices: Optional[tuple]


def _flag(group: str, f: dataclasses.Field, hint) -> Flag:
    """The Flag of a field from its type hint: Optional[X] is X (None is the unset default), Literal[...] a str."""
    if typing.get_origin(hint) is typing.Union:
        hint = [a for a in typing.get_args(hint) if a is not type(None)][0]
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        return Flag(group, f, type(choices[0]), choices)
    return Flag(group, f, hint if isinstance(hint, type) else str, None)


def _all_flags() -> dict[str, Flag]:
    flags = {}
    for group, cls in GROUPS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            assert f.name not in flags and f.name not in GROUPS, f"flag {f.name} named twice"
            flags[f.name] = _flag(group, f, hints[f.name])
    return flags


FLAGS = _all_flags()  # flag name -> Flag, in the groups' order


@dataclass
class TrainConfig:
    """Every setting of a run, by concern. Construct it with the groups you change, e.g.
    `TrainConfig(optim=OptimConfig(lr=1e-4), data=DataConfig(seq_len=4096))`, or from flat flag names with
    `TrainConfig.from_flags({"lr": 1e-4})`. `to_dict()` is flat (flag -> value: checkpoints' trainer_state.json and
    the resume comparison); `grouped()` is nested (group -> flag -> value: `<output_dir>/config.yaml`)."""

    base: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    pref: PreferenceConfig = field(default_factory=PreferenceConfig)
    adapters: AdapterConfig = field(default_factory=AdapterConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    levers: LeverConfig = field(default_factory=LeverConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    check: VerifyConfig = field(default_factory=VerifyConfig)

    def __post_init__(self):
        for name, cls in GROUPS.items():
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"TrainConfig.{name} takes a {cls.__name__}, not {type(getattr(self, name)).__name__}")

    @classmethod
    def from_flags(cls, values: dict) -> "TrainConfig":
        """A config from flat flag names (the defaults for the others)."""
        unknown = [name for name in values if name not in FLAGS]
        if unknown:
            raise TypeError(f"TrainConfig has no flag {', '.join(map(repr, unknown))}")
        groups: dict[str, dict] = {name: {} for name in GROUPS}
        for name, value in values.items():
            groups[FLAGS[name].group][name] = value
        return cls(**{name: GROUPS[name](**given) for name, given in groups.items()})

    def with_flags(self, **flags) -> "TrainConfig":
        """A copy with these flags (flat names) changed."""
        return TrainConfig.from_flags({**self.to_dict(), **flags})

    def get(self, flag: str):
        """A flag's value by its flat name (ds_config.py reconciles flags by name)."""
        return getattr(getattr(self, FLAGS[flag].group), flag)

    def to_dict(self) -> dict:
        return {name: copy.deepcopy(self.get(name)) for name in FLAGS}

    def grouped(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name in GROUPS}

    def data_settings(self):
        """What data/ reads of this config (data/load.py DataSettings)."""
        return DataSettings(self.data, self.sft, self.pref, self.base.model,
                            "--verify_seq_len" if self.check.verify else "--seq_len")

    def lever_request(self) -> LeverRequest:
        """What levers/ reads of this config: the levers group, and the adapters' dropout (random masks that a
        recompute must repeat)."""
        return LeverRequest.from_config(self.levers, self.adapters.lora_dropout if self.adapters.use_peft else 0.0)

    def overrides(self) -> set[str]:
        """The settings --resume_override names."""
        return {name.strip() for name in (self.output.resume_override or "").split(",") if name.strip()}

    def validate(self) -> None:
        """All checks that need neither a model nor a process group."""
        base, data, sft, optim = self.base, self.data, self.sft, self.optim
        check_bounds(self)
        if base.model and base.model_config:
            raise ConfigError("--model and --model_config are mutually exclusive: give one of them")
        ring_size_number(self.parallel.ring_size)
        from .tracking import parse_report_to

        parse_report_to(self.log.report_to, self.log.tensorboard)  # an unknown tracker or a missing package
        if not self.eval.eval_dataset and (self.eval.eval_steps or self.eval.eval_samples or self.eval.eval_split):
            raise ConfigError("--eval_steps, --eval_samples and --eval_split need --eval_dataset")
        self._validate_resume()
        self._validate_adapters()
        self._validate_checkpoint_layers()
        if data.streaming and not data.dataset:
            raise ConfigError("--streaming needs --dataset")
        for group, name, default in ((data, "data_format", "auto"), (sft, "chat_template", None),
                                     (sft, "loss_on", "auto"), (sft, "truncation", "error"),
                                     (data, "messages_field", None), (data, "role_map", None)):
            if getattr(group, name) != default and not data.dataset:
                raise ConfigError(f"--{name} needs --dataset (generated tokens train every token)")
        if data.dataset:
            dataset_entries(data.dataset)  # a mixture's entries: their keys and shares
        parse_role_map(data.role_map)
        from .preference import check_preference_flags

        check_preference_flags(self)  # --method, --beta, --loss_type, --simpo_gamma, --max_length
        if optim.epochs is not None and not data.dataset:
            raise ConfigError("--epochs needs --dataset (generated tokens never end: give --steps)")
        if optim.epochs is None:  # else the trainer checks once the data has said how many steps they are
            self.check_steps()
        load_ds_config(self.parallel.ds_config)  # exists, is JSON, and every top-level key is one DeepSpeed reads

    def check_steps(self) -> None:
        """The checks against --steps (given, or made from --epochs)."""
        steps, warmup, profile = self.optim.steps, self.optim.warmup_steps, self.log.profile_memory
        if warmup is not None and not 0 <= warmup <= steps:
            raise ConfigError(f"--warmup_steps must be in [0, --steps={steps}], got {warmup}")
        if profile > steps:
            raise ConfigError(f"--profile_memory must be in [0, --steps={steps}], got {profile}")

    def _validate_checkpoint_layers(self) -> None:
        value = self.levers.checkpoint_layers
        if value not in ("all", "auto") and not (value.isdigit()):
            raise ConfigError(f"--checkpoint_layers must be all, auto or a number of layers >= 0, got {value!r}")
        if not self.levers.gradient_checkpointing and value not in ("all", "0"):
            raise ConfigError(f"--checkpoint_layers {value} needs --gradient_checkpointing true (false checkpoints "
                              f"no layer)")

    def _validate_adapters(self) -> None:
        """The adapter flags (model/adapters.py checks the module names against the model, and the device)."""
        adapters = self.adapters
        if not adapters.use_peft:
            given = [f.name for f in dataclasses.fields(adapters)
                     if getattr(adapters, f.name) != getattr(AdapterConfig(), f.name)]
            if given:
                raise ConfigError(f"--{given[0]} configures adapters: add --use_peft")
            return
        if adapters.load_in_4bit and not self.base.model:
            raise ConfigError("--load_in_4bit quantizes pretrained weights: give --model (a random initialisation "
                              "has none)")
        if adapters.load_in_4bit and self.base.dtype == "fp32":
            raise ConfigError("--load_in_4bit computes in bf16: drop --dtype fp32")
        if self.check.verify and adapters.lora_dropout:
            raise ConfigError("--verify compares one step with a reference on the same tokens: dropout draws other "
                              "masks there; verify with --lora_dropout 0")

    def _validate_resume(self) -> None:
        output = self.output
        if output.resume_override and not output.resume:
            raise ConfigError("--resume_override needs --resume (auto or a checkpoint path)")
        if output.overwrite_output_dir and output.resume:
            raise ConfigError("--overwrite_output_dir starts afresh: it cannot be combined with --resume")
        for name in sorted(self.overrides()):
            if name not in FLAGS:
                raise ConfigError(f"--resume_override {name}: no such setting (give flag names without --, "
                                  f"e.g. lr,steps)")
            if name in FREE_SETTINGS:
                raise ConfigError(f"--resume_override {name}: {name} never needs an override (it does not change "
                                  f"what is trained)")


def check_bounds(cfg: TrainConfig) -> None:
    """Every number against its field's bounds (`_f`'s gt/ge/lt/le), after refusing nan and inf everywhere (nan
    passes every comparison); None is an unset default and passes."""
    values = [(name, cfg.get(name), flag) for name, flag in FLAGS.items()]
    for name, value, _ in values:
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"--{name} must be a finite number, got {value}")
    for name, value, flag in values:
        bounds = flag.field.metadata["bounds"]
        if value is None or not bounds:
            continue
        gt, ge, lt, le = (bounds.get(k) for k in ("gt", "ge", "lt", "le"))
        if ((gt is None or value > gt) and (ge is None or value >= ge) and (lt is None or value < lt)
                and (le is None or value <= le)):
            continue
        why = flag.field.metadata["why"]
        raise ConfigError(f"--{name} must be {_describe(bounds)}, got {value}" + (f": {why}" if why else ""))


_SIGNS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def _describe(bounds: dict) -> str:
    """gt=0: positive; ge=0: >= 0; both ends: an interval, [ or ( as the end is included or not."""
    if bounds == {"gt": 0}:
        return "positive"
    if len(bounds) == 1:
        (kind, limit), = bounds.items()
        return f"{_SIGNS[kind]} {limit}"
    low = f"[{bounds['ge']}" if "ge" in bounds else f"({bounds['gt']}"
    high = f"{bounds['le']}]" if "le" in bounds else f"{bounds['lt']})"
    return f"in {low}, {high}"


# Settings that do not change what is trained: a resumed run may change them freely. Every other flag alters the
# weights, the data or the schedule, so changing it on resume needs --resume_override (train/resume.py); a new flag
# belongs here only if that is clearly not so. sp_size is checked apart (the ZeRO shards are per data-parallel rank).
FREE_SETTINGS = frozenset({
    "output_dir", "save_steps", "save_final", "save_total_limit", "resume", "resume_override",
    "overwrite_output_dir", "log_every", "progress", "tensorboard", "profile_memory", "num_proc", "data_cache_dir",
    "verify", "verify_seq_len", "skip_nonfinite", "sp_size", "pad_to_sp", "dist_timeout", "debug", "report_to",
    "config",
    "eval_dataset", "eval_split", "eval_steps", "eval_samples",
    "ring_size",  # the same attention, split another way
    # kernels and memory levers compute the same thing (docs/verify.md checks them against transformers)
    "attn_kernel", "gradient_checkpointing", "checkpoint_layers", "attn_recompute", "tiled_mlp",
    "mlp_tile_tokens", "share_master_weights", "lean_norm", "fused_kernels", "offload_activations",
    "loss_chunk_size", "loss_kernel", "linear_kernel"})


def ring_size_number(value: str) -> Optional[int]:
    """--ring_size as typed: a positive number, or None for auto (resolved against the heads: sp/dims.py)."""
    if str(value) == "auto":
        return None
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise ConfigError(f"--ring_size must be a positive number or auto, got {value}")
    return number


def _str2bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {value!r}")


class _Parser(argparse.ArgumentParser):
    """The flags' parser; with `raise_errors` (the Python API) a bad flag or value is a ConfigError, not an exit."""

    hint = ""  # said after an error's message (the command line's: where the flags are listed)

    def __init__(self, *args, raise_errors: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.raise_errors = raise_errors

    def error(self, message: str):
        message = re.sub(r"^argument (--\w+)(/--[\w-]+)+:", r"argument \1:", message)  # the flag, not its aliases
        if self.raise_errors:
            raise ConfigError(message + self.hint)
        super().error(message)

    def parse_sources(self, sources: list[list[str]]) -> argparse.Namespace:
        """Each source's words in turn (a config file, then the command line): later ones win, and a repeated flag
        (--dataset) given by a later source replaces the earlier source's list instead of adding to it."""
        namespace = argparse.Namespace()
        for words in sources:
            for action in self._actions:
                if isinstance(action, _Repeated):
                    action.fresh = True
            namespace = self.parse_args(words, namespace)
        return namespace


class _Repeated(argparse.Action):
    """A flag that may be given several times (--dataset): one value stays a value, several become a list."""

    fresh = True

    def __call__(self, parser, namespace, values, option_string=None):
        before = None if self.fresh else getattr(namespace, self.dest, None)
        self.fresh = False
        if before is None:
            setattr(namespace, self.dest, values)
        else:
            setattr(namespace, self.dest, (before if isinstance(before, list) else [before]) + [values])


class _Alias(argparse.Action):
    """A name of the field whose values differ from ours (aliases.py): translated, then set on our flag."""

    def __init__(self, option_strings, dest, alias=None, target=None, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.alias, self.target = alias, target

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            value = self.alias.convert(values)
            if value is not None:
                value = self.target.type(value) if self.target.type else value
        except (ConfigError, ValueError, argparse.ArgumentTypeError) as e:
            raise argparse.ArgumentError(self, f"{values!r}: {e}") from None
        if value is not None and self.target.choices and value not in self.target.choices:
            raise argparse.ArgumentError(self, f"{values!r} gives --{self.target.dest} {value}, not one of "
                                               f"{', '.join(map(str, self.target.choices))}")
        if value is not None:
            setattr(namespace, self.target.dest, value)


def dataset_entry(text: str):
    """One --dataset value: a path or hub id, or a JSON object (a mixture's entry with its own settings)."""
    if not text.lstrip().startswith("{"):
        return text
    try:
        entry = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not a JSON object ({e}): {text}") from None
    try:
        dataset_entries(entry)  # its keys and share
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return entry


def _help(f: dataclasses.Field) -> str:
    """A flag's help: its field's, its aliases, its default and its bounds."""
    names = [a.name for a in aliases.ALIASES if a.flag == f.name and a.convert is None]
    also = f" Also --{', --'.join(names)}." if names else ""
    bounds = f"; {_describe(f.metadata['bounds'])}" if f.metadata["bounds"] else ""
    return f"{f.metadata['help']}{also} (default: {f.default}{bounds})"


def build_parser(raise_errors: bool = False) -> _Parser:
    """Every flag of TrainConfig, with its aliases (aliases.py), in one section of --help per group (its title from
    the group's docstring). No flag has a default in the parser: what was given is what the namespace holds
    (_parse adds the defaults), so a file and the command line can be layered."""
    parser = _Parser(prog="launch/train.py", raise_errors=raise_errors, argument_default=argparse.SUPPRESS,
                     description="Long-context fine-tuning with Ulysses sequence parallelism on the DeepSpeed engine. "
                                 "A --config YAML file takes these flags flat (seq_len: 4096) or under their "
                                 "group's key, in brackets below (data: {seq_len: 4096}).")
    sections = {name: parser.add_argument_group(*_section(name, cls)) for name, cls in GROUPS.items()}
    actions = {}
    for name, flag in FLAGS.items():
        kw = dict(help=_help(flag.field), dest=name)
        if flag.choices:
            kw["choices"] = flag.choices
        if flag.type is bool:
            kw.update(type=_str2bool, nargs="?", const=True, metavar="BOOL")
        else:
            kw["type"] = flag.type
        if flag.field.metadata["repeated"]:
            kw.update(action=_Repeated, type=dataset_entry)
        names = [a.name for a in aliases.ALIASES if a.flag == name and a.convert is None]
        actions[name] = sections[flag.group].add_argument(f"--{name}", *(f"--{n}" for n in names), **kw)
    for alias in (a for a in aliases.ALIASES if a.convert is not None):
        target = actions[alias.flag]
        sections[FLAGS[alias.flag].group].add_argument(
            f"--{alias.name}", action=_Alias, alias=alias, target=target, dest=f"alias:{alias.name}", nargs="?",
            const="true", metavar="VALUE", help=f"{alias.origin}'s name for --{alias.flag}: {alias.values}.")
    # launchers (deepspeed, older torch.distributed.launch) append --local_rank; the rank comes from the environment
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    return parser


def _section(name: str, cls: type) -> tuple[str, str]:
    """A group's --help title and description: its docstring's first line, split at the colon."""
    title, _, description = cls.__doc__.splitlines()[0].partition(": ")
    return f"{title} [{name}]", description[:1].upper() + description[1:]


def write_resolved_config(cfg: TrainConfig, folder: Optional[str] = None) -> str:
    """Every setting of the run, defaults included, by its canonical name under its group's key, as a file `--config`
    reads back: `<folder>/config.yaml`, by default `<output_dir>/config.yaml` (checkpoints hold the same settings,
    flat, in trainer_state.json)."""
    import yaml

    folder = folder or cfg.output.output_dir
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "config.yaml")
    values = {group: {k: v for k, v in flags.items() if k not in ("config", "resume", "overwrite_output_dir")}
              for group, flags in cfg.grouped().items()}
    with open(path, "w") as f:
        yaml.safe_dump(values, f, sort_keys=False)
    return path


# keys a file or a dict cannot set: they are not training settings
NOT_SETTINGS = ("config", "help", "h", "local_rank")


def mapping_words(values: dict, where: str) -> list[str]:
    """A mapping of flags (or their aliases) to values as command-line words, every key checked first (all the
    unknown ones named at once: aliases.check_keys) and then each value as its flag's parser takes it, so that a
    wrong value is named by `where` and its key. Flags may be given flat or under their group's key
    (`data: {seq_len: 4096}`), or both ways in one mapping."""
    values = _ungrouped(values, where)
    for key in values:
        if str(key).replace("-", "_") in NOT_SETTINGS:
            raise ConfigError(f"{where}: {key!r} cannot be set in a config file (it holds training settings; "
                              f"python launch/train.py --help prints them)")
    repeated = {name for name, flag in FLAGS.items() if flag.field.metadata["repeated"]}
    checker = build_parser(raise_errors=True)
    words = []
    for key, value in aliases.check_keys(values, list(FLAGS), where).items():
        many = aliases.canonical(key) in repeated
        _refuse_nesting(where, key, value, many)
        these = aliases.value_words(key, value, repeated=many)
        try:
            checker.parse_args(these, argparse.Namespace())
        except ConfigError as e:
            raise ConfigError(f"{where}: {key}: {re.sub(r'^argument [^:]+: ', '', str(e))}") from None
        words += these
    return words


def _ungrouped(values: dict, where: str) -> dict:
    """A mapping with its groups' mappings (`data: {seq_len: 4096}`) opened into flat keys. A group's key holds a
    mapping whose keys are its own flags (or their aliases); a flag given both flat and in its group is refused."""
    flat = {}
    for key, value in values.items():
        if key not in GROUPS or (not isinstance(value, dict) and key in aliases.NO_COUNTERPART):
            flat.setdefault(key, value)  # (transformers' `optim: adamw_torch` is theirs, named as such)
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {key} is a group of settings: give it a mapping of its flags to values "
                              f"(e.g. {key}: {{{next(iter(dataclasses.fields(GROUPS[key]))).name}: ...}})")
        for inner, setting in value.items():
            name = aliases.canonical(str(inner).replace("-", "_"))
            if name in FLAGS and FLAGS[name].group != key:
                raise ConfigError(f"{where}: {key}: {inner} belongs to the group {FLAGS[name].group}, not {key}")
            if inner in flat or inner in values:
                raise ConfigError(f"{where}: {inner} is given both at the top level and in {key}: keep one")
            flat[inner] = setting
    return flat


def _refuse_nesting(where: str, key: str, value, repeated: bool) -> None:
    """A value is a scalar or a list of scalars; a mixture's entries (--dataset, `repeated`) may also be mappings."""
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(item, (list, tuple)) or (isinstance(item, dict) and not repeated):
            raise ConfigError(f"{where}: {key}: give a value or a list of values, not a nested "
                              f"{'mapping' if isinstance(item, dict) else 'list'}")


def config_file_words(path: str) -> list[str]:
    """The flags of a YAML file (`--config FILE`) as command-line words: every value passes the same parsing and
    checks as a typed flag, and counts as given explicitly. The file is read as strictly as the DeepSpeed JSON: a
    key given twice, a YAML alias (`*name`: a few hundred bytes of them expand to gigabytes), a nested value, a key
    that is no flag (all of them named at once), or a value its flag does not take is a ConfigError naming the file
    and the key."""
    return mapping_words(_read_config_file(path), f"--config {path}")


def _parse(parser: _Parser, sources: list[list[str]]) -> tuple[TrainConfig, set[str]]:
    given = vars(parser.parse_sources(sources))
    explicit = {name for name in given if name in list(FLAGS)}
    return TrainConfig.from_flags({name: given[name] for name in explicit}), explicit


def _read_config_file(path: str) -> dict:
    """The mapping of a --config YAML file, refusing what safe_load lets through: a key given twice, an alias."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise ConfigError(f"--config {path}: line {event.start_mark.line + 1}: the alias *{event.anchor} is "
                                  f"not allowed (write the value out)")
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):
            seen = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    raise ConfigError(f"--config {path}: the key {key!r} appears twice (lines {seen[key]} and "
                                      f"{key_node.start_mark.line + 1}); keep one")
                seen[key] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep)

    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.load(f, Loader=StrictLoader)  # noqa: S506 - a SafeLoader, stricter
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path} must hold a mapping of flag names to values")
    return values


def parse_args(argv=None) -> tuple[TrainConfig, set[str]]:
    """The command line (with `--config FILE` read first, so the typed flags win). Returns the config and the set of
    flags given explicitly, typed or in the file (they must then agree with the DS JSON)."""
    parser = build_parser(raise_errors=True)  # a mistyped flag or value: one message, printed once by the CLI
    parser.hint = " (python launch/train.py --help lists the flags)"
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    path = pre.parse_known_args(argv)[0].config
    sources = [config_file_words(path)] if path else []
    return _parse(parser, sources + [argv])


def config_from(config=None, overrides: Optional[dict] = None) -> tuple[TrainConfig, set[str]]:
    """The Python API's settings: `config` (a TrainConfig, a dict of flags or their aliases, or a YAML file's path)
    and keyword `overrides`, read as the command line reads a --config file and typed flags: the same names,
    values and checks, a ConfigError for anything wrong. A TrainConfig's given settings are those that differ from
    the defaults."""
    sources = []
    if isinstance(config, TrainConfig):
        defaults = TrainConfig().to_dict()
        sources.append(mapping_words({k: v for k, v in config.to_dict().items() if defaults[k] != v},
                                     "the TrainConfig"))
    elif isinstance(config, dict):
        sources.append(mapping_words(config, "the settings dict"))
    elif isinstance(config, (str, os.PathLike)):
        sources.append(config_file_words(os.fspath(config)))
    elif config is not None:
        raise TypeError(f"train() takes a TrainConfig, a dict or a YAML file's path, not {type(config).__name__}")
    if overrides:
        sources.append(mapping_words(overrides, "train()'s keyword arguments"))
    return _parse(build_parser(raise_errors=True), sources)
