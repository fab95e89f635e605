"""The run's settings by concern: one dataclass per group (model, data, SFT, preference, adapters, optimisation,
parallelism, levers, output, logging, evaluation, verification), each field a command-line flag with its type
(`Literal[...]` for choices, built from the tuple of the module that acts on them), its bounds and its help.
`FLAGS` reads them (types through typing.get_type_hints) for the parser, YAML files, `--help`, `config.yaml` and
the Python API (train/config/flag_parser.py, train/config/config_file.py). Flag names are unique across the groups,
and no group is named like a flag."""

import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from ...data.sft import DATA_FORMATS, LOSS_ON, TRUNCATION
from ...levers.policy import ATTN_RECOMPUTE, AUTO_ON_OFF, LOSS_KERNELS, LOSS_KINDS
from ...levers.preference_loss import LOSS_TYPES, METHODS
from ...levers.rope import ROPE_SCALINGS
from ...sp.kernels import ATTN_KERNELS
from ...sp.linear_kernel import LINEAR_KERNELS

# The choices of the flags whose choices live here (train/ modules read these: the config is the room below them);
# the other tuples come from the lower packages' modules that act on them. Each
# field's type is Literal[<tuple>], and the parser reads the choices back from that type.
DTYPES = ("auto", "bf16", "fp32")
LAST_SAMPLE = ("drop", "pad")
LEAN_NORM = (*AUTO_ON_OFF, "true", "false")  # true and false as when the flag was a switch
LR_SCHEDULES = ("cosine", "linear", "constant_with_warmup")  # schedule.py builds them
PROGRESS = ("auto", "bar", "lines", "none")  # metrics.py draws them
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _f(default, help: str, *, default_text: str = "", gt=None, ge=None, lt=None, le=None, why: str = "",
       repeated: bool = False):
    """A flag's field: its default, its help, what an unset (None) default means in words where the run decides it
    (`default_text`, e.g. "min(--seq_len, 4096)"), its bounds (checked by `check_bounds`: gt/ge/lt/le, `why` said
    after a violation) and whether it may be given several times. --help and docs/flags.md read all of it from
    here (flag_parser.py's `flag_help`, tools/flags_doc.py). Help texts are argparse's: a % is written %%."""
    bounds = {k: v for k, v in (("gt", gt), ("ge", ge), ("lt", lt), ("le", le)) if v is not None}
    return field(default=default, metadata={"help": help, "default_text": default_text, "bounds": bounds, "why": why,
                                            "repeated": repeated})


class Settings:
    """A group's (and TrainConfig's) attributes are its fields: setting another (`cfg.data.seq_lenn = 512`) is an
    AttributeError naming the nearest field, not a setting silently ignored."""

    __slots__ = ()

    def __setattr__(self, name: str, value) -> None:
        fields = getattr(type(self), "__dataclass_fields__", {})
        if name not in fields:
            close = difflib.get_close_matches(name, list(fields), n=1, cutoff=0.6)
            raise AttributeError(f"{type(self).__name__} has no setting {name!r}"
                                 + (f" (did you mean {close[0]!r}?)" if close else
                                    f"; its settings: {', '.join(fields)}"))
        object.__setattr__(self, name, value)


@dataclass
class ModelConfig(Settings):
    """Model: the pretrained weights or the random initialisation, the precision, the rotary positions.

    `TrainConfig.base` (the flag --model is its path, so the group takes another name)."""

    model: Optional[str] = _f(None, "Local folder or hub id of a pretrained causal LM (weights and tokenizer are "
                              "loaded from it). Mutually exclusive with --model_config.")
    model_config: Optional[str] = _f(None, "Random initialisation from a preset (tiny, qwen3-4b, gemma3-4b, olmo3-7b, "
                                     "...: docs/models.md), a config.json, a model folder or a hub id (its config "
                                     "only).",
                                     default_text="tiny, when --model is not given")
    num_layers: Optional[int] = _f(None, "Override the number of decoder layers of --model_config (for benchmarks at "
                                   "reduced depth).", gt=0)
    dtype: Literal[DTYPES] = _f("auto", "Training precision: auto is bf16 on GPU and fp32 on CPU.")
    rope_scaling: Literal[ROPE_SCALINGS] = _f("none", "yarn: YaRN rescaling of rotary positions for sequences past the "
                                              "model's pretrained length; rope_theta and that length are read from the "
                                              "model config.")
    rope_factor: Optional[float] = _f(None, "YaRN factor.",
                                      default_text="--seq_len / the model's pretrained length")
    rope_theta: Optional[float] = _f(None, "Only as a check: must equal the model's rope_theta (it is read from the "
                                     "model config).")
    rope_original_max_positions: Optional[int] = _f(None, "Only as a check: must equal the model's pretrained length "
                                                    "(read from the model config).")


@dataclass
class DataConfig(Settings):
    """Data: what is read, how it is tokenized and cut into samples (data/ takes this group)."""

    dataset: Union[str, dict, list, None] = _f(None, "Training data: a hub id (datasets.load_dataset) or a local "
                                               "file/folder of .txt (one file = one document), .jsonl/.json, "
                                               ".parquet, .arrow, or a save_to_disk folder. Given several times (or "
                                               "as a YAML list), a mixture: each entry a path or a JSON object {path, "
                                               "split, weight | samples, data_format, text_column, messages_field, "
                                               "role_map} (docs/data.md).",
                                               default_text="generated tokens (the embedded default)",
                                               repeated=True)
    dataset_split: str = _f("train", "Split of --dataset.")
    text_column: Optional[str] = _f(None, "Column holding the text.",
                                    default_text="'text'")
    data_format: Literal[DATA_FORMATS] = _f("auto", "What --dataset holds. messages: a list of {role, content} per "
                                            "row, rendered with the chat template; prompt_completion: prompt and "
                                            "completion strings or message lists; tokens: input_ids, with optional "
                                            "labels or assistant_masks; text: raw text. auto: from the columns, in "
                                            "that order.")
    messages_field: Optional[str] = _f(None, "The column holding each row's message list, for layouts other than "
                                       "`messages` and ShareGPT's `conversations` (both detected).")
    role_map: Optional[str] = _f(None, "The data's roles -> the chat template's, as from=to pairs with commas (or a "
                                 "mapping in YAML), over the defaults human=user, gpt=assistant, observation=tool, "
                                 "function_call=assistant (a tool call) (docs/data.md).")
    tokenizer: Optional[str] = _f(None, "'bytes' (byte-level, 259 ids, offline), a tokenizer path/hub id, or by "
                                  "default the --model's own (bytes when there is no --model).")
    seq_len: int = _f(1024, "Tokens per sequence (one sample). Must be a multiple of --sp_size.", gt=0)
    pad_to_sp: bool = _f(False, "Pad sequences to a multiple of --sp_size (padding not trained on) instead of failing "
                         "when --seq_len is not one.")
    packing: bool = _f(False, "Keep document boundaries inside a sample: positions restart at each document and "
                       "attention never crosses one (also under sequence parallelism). Conversations: pack whole ones "
                       "into each sample (first-fit decreasing) instead of one per sample. Preference pairs: on "
                       "unless given (several whole pairs a row); --packing false keeps one pair a row.")
    last_sample: Literal[LAST_SAMPLE] = _f("drop", "The corpus's last partial sample: drop it, or pad it (padding is "
                                           "not trained on).")
    streaming: bool = _f(False, "Stream a hub dataset instead of downloading it whole (with --max_tokens).")
    max_tokens: Optional[int] = _f(None, "Stop reading the corpus after this many tokens.", gt=0)
    num_proc: Optional[int] = _f(None, "Processes for tokenizing (datasets.map).", gt=0)
    data_cache_dir: str = _f(os.path.join(os.path.expanduser("~"), ".cache", "ulysses_train"),
                             "Where the tokenized corpus arrays are cached (keyed by the data and tokenizer).")
    seed: int = _f(0, "Seed for initialisation and data. The same seed gives the same data whatever --sp_size is.",
                   ge=0, le=2**32 - 1, why="the data's and the initialisation's generators are seeded from it")


@dataclass
class SFTConfig(Settings):
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
class PreferenceConfig(Settings):
    """Preference training: DPO, SimPO, ORPO on prompt/chosen/rejected pairs (train/preference/pairs.py)."""

    method: Literal[METHODS] = _f("sft", "sft: the next-token loss on what --loss_on trains. dpo: Direct Preference "
                                  "Optimization on prompt/chosen/rejected pairs against the reference (the initial "
                                  "weights; their log-probs computed once per dataset under SP and cached beside the "
                                  "tokens). simpo, orpo: reference-free (docs/preference.md).",
                                  default_text=("dpo for one --dataset with `chosen` and `rejected` columns (and no "
                                                "--data_format, --text_column, --messages_field or --loss_on), else "
                                                "sft"))
    beta: float = _f(0.1, "The preference loss's beta (TRL's): DPO's KL weight, SimPO's reward scale, ORPO's "
                     "odds-ratio weight.", gt=0)
    loss_type: Literal[LOSS_TYPES] = _f("sigmoid", "DPO's loss, as TRL names it: sigmoid (DPO), ipo (IPO, per-token "
                                        "means), hinge (SLiC).")
    simpo_gamma: float = _f(0.5, "SimPO's target reward margin gamma (TRL's simpo_gamma).")
    max_length: Optional[int] = _f(None, "Preference pairs: the most tokens of one side (prompt + completion), TRL's "
                                   "max_length; a longer side is an error or cut by --truncation (left: the prompt's "
                                   "start, right: the completions' ends).",
                                   default_text="--seq_len / 2 (a row of --seq_len holds both sides of a pair)", gt=0)
    max_prompt_length: Optional[int] = _f(None, "Preference pairs: the most tokens of a pair's prompt, TRL's "
                                          "max_prompt_length: a longer prompt keeps its last tokens (its start is cut "
                                          "from both sides, counted in the log), before --max_length applies.",
                                          default_text="prompts whole", gt=0)
    ref_model: Optional[str] = _f(None, "DPO's reference, a separate frozen model (TRL's ref_model): a pretrained "
                                  "folder or hub id with the parameters of --model's architecture. Its log-probs are "
                                  "computed once per dataset, its weights swapped into the model for that forward "
                                  "pass (no second model is held), and cached like the default's.",
                                  default_text=("the run's initial weights (with --use_peft, the base with the "
                                                "adapters off)"))


@dataclass
class AdapterConfig(Settings):
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
                                  "a regular expression (a value with *, |, ( ...: PEFT's string form, matched against "
                                  "whole module names, e.g. '.*\\.(q|v)_proj'), or all-linear: every linear layer "
                                  "of the decoder, not the LM head.")
    lora_modules_to_save: Optional[str] = _f(None, "Modules trained whole beside the adapters and saved with them "
                                             "(PEFT's modules_to_save: a module whose name ends with the string), e.g. "
                                             "embed_tokens,lm_head,norm; norm takes every RMSNorm (LongLoRA's "
                                             "trainable embeddings and norms).")
    load_in_4bit: bool = _f(False, "QLoRA: the frozen base in bitsandbytes' 4-bit NF4, computing in bf16 (with "
                            "--use_peft and a pretrained --model; CUDA and bitsandbytes only).")


@dataclass
class OptimConfig(Settings):
    """Optimisation: steps or epochs, the lr schedule, AdamW, clipping, accumulation."""

    steps: int = _f(30, "Optimizer steps to run.", gt=0)
    epochs: Optional[float] = _f(None, "Passes over --dataset: --steps becomes ceil(epochs x samples / (micro batch x "
                                 "grad_accum x data-parallel size)). A --steps given as well wins (as max_steps does "
                                 "in transformers).", gt=0)
    lr: Optional[float] = _f(None, "Peak learning rate.",
                             default_text=("the DS config's optimizer lr, else 1e-3 for random init and 1e-5 for a "
                                           "pretrained --model"), gt=0)
    lr_scheduler_type: Literal[LR_SCHEDULES] = _f("cosine", "The lr after the warmup: cosine or linear decay from --lr "
                                                  "to --lr x --min_lr_ratio at the last step, or constant_with_warmup.")
    min_lr_ratio: float = _f(0.1, "Where the cosine and linear decays end: --lr x min_lr_ratio at the last step "
                             "(0: transformers' schedules, which end at 0).",
                             ge=0, le=1, why="it is the fraction of --lr the decay ends at")
    warmup_steps: Optional[int] = _f(None, "Linear warmup steps.",
                                     default_text="--warmup_ratio, else 10%% of --steps")
    warmup_ratio: Optional[float] = _f(None, "Warmup as a fraction of --steps (rounded up), unless --warmup_steps is "
                                       "given and > 0.", ge=0, le=1)
    weight_decay: float = _f(0.0, "AdamW weight decay.", ge=0)
    max_grad_norm: Optional[float] = _f(None, "Gradient clipping norm (0 disables).",
                                        default_text="the DS config's gradient_clipping, else 1.0", ge=0)
    adam_beta1: float = _f(0.9, "AdamW's beta1 (a --ds_config optimizer block's \"auto\" betas take it).", ge=0, lt=1)
    adam_beta2: float = _f(0.95, "AdamW's beta2 (transformers' default is 0.999; 0.95 is the usual choice for LLM "
                           "training).", ge=0, lt=1)
    adam_epsilon: float = _f(1e-8, "AdamW's epsilon (a --ds_config optimizer block's \"auto\" eps takes it).", gt=0)
    grad_accum: Optional[int] = _f(None, "Micro-steps per optimizer step.",
                                   default_text="the DS config's gradient_accumulation_steps, else 1", gt=0)
    skip_nonfinite: bool = _f(False, "Skip an optimizer step whose loss is NaN/inf instead of stopping the run (needs "
                              "--grad_accum 1).")


@dataclass
class ParallelConfig(Settings):
    """Parallelism: the sequence-parallel layout, the micro batch, the DeepSpeed JSON, the watchdog."""

    sp_size: Optional[int] = _f(None, "Sequence-parallel group size: ranks that share one sequence. Must divide the "
                                "world size; the rest is data parallel.",
                                default_text="the ranks on one node", gt=0)
    ring_size: str = _f("auto", "Ring attention degree inside each SP group: --sp_size ranks run as Ulysses (sp / "
                        "ring consecutive ranks split the heads) x ring (K/V blocks passed around, zigzag balanced, "
                        "exact, packing kept). A ring lifts the head-count limit (28 heads at --sp_size 8: a ring of "
                        "2). auto: the largest Ulysses degree the heads allow (no ring when they divide --sp_size).")
    micro_batch_size: Optional[int] = _f(None, "Sequences per SP group per micro-step.",
                                         default_text="the DS config's train_micro_batch_size_per_gpu, else 1", gt=0)
    ds_config: str = _f(os.path.join(REPO_ROOT, "ds_configs", "zero3.json"),
                        "DeepSpeed JSON config. Values set to \"auto\" are filled from the flags.")
    dist_timeout: float = _f(600.0, "Seconds a rank may go without a heartbeat before it is named frozen and every "
                             "rank stops with exit code 3 (the heartbeat runs beside the training loop, so long steps "
                             "never trip it; see train/process/watchdog.py).", gt=0)


@dataclass
class LeverConfig(Settings):
    """Memory and speed levers: kernels, checkpointing, recompute, tiling, offload (levers/ takes this group).

    They compute the same numbers (docs/verify.md checks them against transformers)."""

    attn_kernel: Literal[ATTN_KERNELS] = _f("auto", "Local attention kernel run inside the Ulysses all-to-all. auto: "
                                            "flash_attn_4 where it runs (package flash-attn-4 installed and "
                                            "importing, compute capability 9.0+, bf16/fp16), else sdpa (cuDNN on "
                                            "Hopper). At head_dim 256 on Hopper flash_attn_4 runs cuDNN's "
                                            "backward from FA4's forward (plain causal layers), the faster each "
                                            "way.")
    linear_kernel: Literal[LINEAR_KERNELS] = _f("auto", "Kernel of the Gated DeltaNet layers' recurrence (Qwen3.5, "
                                                "Qwen3-Next). fla: flash-linear-attention's (CUDA; pip install -e "
                                                "\".[fla]\"; on Hopper with Triton < 3.7.1 it needs tilelang too). "
                                                "torch: transformers' reference, any device, much slower on a GPU. "
                                                "auto: fla where it runs and agrees with torch in a self-check at "
                                                "start-up, else torch (the reason logged).")
    loss: Literal[LOSS_KINDS] = _f("fused", "fused: LM head + cross-entropy in row chunks, gradients computed in the "
                                   "forward, so the full logits never exist. plain: the ordinary loss, for comparison.")
    loss_kernel: Literal[LOSS_KERNELS] = _f("auto", "Whose fused loss runs. liger: Liger-Kernel's fused linear "
                                            "cross-entropy (faster than ours on the H200: docs/benchmarks.md; it picks "
                                            "its own chunks, about tokens x hidden logits). ours: ulysses_train's, "
                                            "chunked by --loss_chunk_size, on any device. auto: liger on CUDA when "
                                            "liger-kernel is installed and agrees with ours in a self-check at "
                                            "start-up, else ours (the reason logged).")
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
                                                 "while that takes under 15%% of the device memory (with "
                                                 "--offload_activations: it and the checkpoints under half the host "
                                                 "memory), or while the planner's estimate of the whole run with it "
                                                 "stays under 80%% of the device and the host (without "
                                                 "--checkpoint_layers auto; in the families whose memory estimate is "
                                                 "measured).")
    linear_recompute: Literal[ATTN_RECOMPUTE] = _f("auto", "The Gated DeltaNet layers' --attn_recompute (Qwen3.5, "
                                                   "Qwen3-Next): never: keep the gated delta rule's output (and the "
                                                   "two tensors its backward reads, (value dim + 64) x value heads x "
                                                   "2 bytes a token and layer) so the recompute skips the "
                                                   "recurrence; FLA's kernel only (--linear_kernel). always: "
                                                   "recompute it. auto: keep while that, beside the kept attention, "
                                                   "takes under 15%% of the device memory (with "
                                                   "--offload_activations: under half the host memory with the "
                                                   "checkpoints), or while the planner's estimate of the whole run "
                                                   "with it stays under 80%% of the device and of the host.")
    tiled_mlp: Literal[AUTO_ON_OFF] = _f("auto", "Run each dense MLP over sequence tiles of --mlp_tile_tokens, "
                                         "recomputed per tile in backward, so its seq x intermediate tensors never "
                                         "exist whole. auto: on when one such tensor would exceed 2 GiB, unless "
                                         "on the GPU the planner's estimate of the whole run without the tiles is "
                                         "under 85%% of the device (the tiles cost a third forward of the MLP).")
    mlp_tile_tokens: int = _f(16384, "Tokens per MLP tile (per rank).", gt=0)
    share_master_weights: bool = _f(True, "ZeRO-3 with master weights in the model's dtype (bf16 states, or fp32): the "
                                    "optimizer updates the model's partition in place instead of a copy of it (2 bytes "
                                    "per parameter less in bf16; the same numbers).")
    lean_norm: Literal[LEAN_NORM] = _f("auto", "RMSNorms (Llama's, T5's, Gemma's 1 + weight) save their input in the "
                                       "model dtype and one fp32 "
                                       "number per row for the backward, instead of an fp32 copy of the input (4 bytes "
                                       "less per element in bf16; the same forward, bit for bit). auto: on where the "
                                       "model has such norms. on (true): required. off (false): transformers' norms.")
    fused_kernels: Literal[AUTO_ON_OFF] = _f("auto", "Our Triton kernels for the RMSNorms (lean, as --lean_norm), the "
                                             "rotary embedding, the gated MLP's product (SwiGLU, Gemma's GeGLU) and "
                                             "the Gated DeltaNet layers' gated norm: one kernel each way instead of "
                                             "up to a dozen small ones (docs/benchmarks.md). auto: on for CUDA devices "
                                             "with Triton installed, if a self-check against the ops they replace "
                                             "passes (else those ops, the reason logged). on: required. off: "
                                             "transformers' ops.")
    tf32: bool = _f(False, "Let CUDA run fp32 matmuls and convolutions in TF32 (Ampere and newer; the bf16 ones are "
                    "unchanged).")
    offload_activations: bool = _f(False, "Move checkpointed layer inputs to pinned host memory on a side stream, "
                                   "prefetched back one layer ahead of the backward (GPU only).")
    gpu_checkpoints: str = _f("auto", "With --offload_activations: how many checkpointed layers, the last ones, keep "
                              "their checkpoints on the GPU (the others' go to the host). auto: as many as the "
                              "planner's memory estimate fits beside the working set; all; or a number.")
    checkpoint_every: str = _f("auto", "Only every K-th checkpointed layer keeps its input; the others' are "
                               "regenerated in the backward by running their segment forward again (K - 1 layer "
                               "forwards per segment). auto: 1, or with --offload_activations on a GPU the smallest K "
                               "with which GPU and host hold the checkpoints.")
    keep_projections: str = _f("auto", "How many checkpointed layers, the first ones, keep their token mixer's input "
                               "projections' outputs (q, k, v; a DeltaNet layer's q, k, v, z, b, a) so their "
                               "recompute skips those matmuls: all, a number (0: none), or auto: on a GPU, the "
                               "count the time model finds fastest (by a hundredth of the step or more) within four "
                               "fifths of the device and the host, in the families whose memory estimate is "
                               "measured. Each costs those widths x tokens x 2 bytes, where the layer's checkpoint "
                               "goes (the host with --offload_activations).")


@dataclass
class OutputConfig(Settings):
    """Output and checkpoints: where the run writes, when it saves, how it resumes."""

    output_dir: str = _f("outputs/run", "Where metrics.jsonl (and TensorBoard logs) are written.")
    config: Optional[str] = _f(None, "A YAML file whose keys are these flags (without --), at the top level or under "
                               "their group's key (data: {seq_len: 4096}); the command line overrides it. The "
                               "resolved settings are written, grouped, to <output_dir>/config.yaml.")
    save_steps: int = _f(0, "Save a checkpoint every N optimizer steps (0: only the final one and on SIGTERM).", ge=0)
    saves_per_epoch: Optional[int] = _f(None, "Save a checkpoint this many times per pass over --dataset (axolotl's "
                                        "saves_per_epoch): --save_steps becomes the steps of an epoch / N, rounded "
                                        "down (at least 1).", gt=0)
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
class LogConfig(Settings):
    """Logging: the step lines, the progress bar, the trackers, memory profiles, tracebacks."""

    log_every: int = _f(1, "Print a metrics line every N optimizer steps (metrics.jsonl gets every step).", gt=0)
    progress: Literal[PROGRESS] = _f("auto", "Rank 0's progress: bar (a progress bar, the step lines above it), lines "
                                     "(the step lines alone: `grep '^step'` finds them in a redirected log), none "
                                     "(neither). auto: bar when stderr is a terminal, else lines.")
    report_to: str = _f("none", "Experiment trackers beside metrics.jsonl, comma-separated: tensorboard, wandb, mlflow "
                        "(or none). They work offline, into <output_dir>, unless WANDB_MODE / an API key or "
                        "MLFLOW_TRACKING_URI point elsewhere (train/step/tracking.py); wandb and mlflow come with the "
                        "[track] extra.")
    tensorboard: bool = _f(False, "Also write the metrics to TensorBoard under <output_dir>/tensorboard (the same as "
                           "adding tensorboard to --report_to).")
    profile_memory: int = _f(0, "Record memory for the first N steps: <output_dir>/memory/memory.png (stacked by "
                             "category), memory.json and, on CUDA, PyTorch's snapshot.pickle. Slows those steps.", ge=0)
    debug: bool = _f(False, "Print full tracebacks of unexpected errors (they always go to "
                     "<output_dir>/errors/rank_N.txt).")


@dataclass
class EvalConfig(Settings):
    """Evaluation: the validation loss on --eval_dataset, or on a share of --dataset held out (--val_set_size)."""

    eval_dataset: Optional[str] = _f(None, "Validation data, in any form --dataset takes (the same format flags "
                                     "apply): its loss, at --seq_len under SP, goes to metrics.jsonl and the trackers "
                                     "every --eval_steps and after the last step; for preference pairs, their loss "
                                     "and TRL's metrics (eval_rewards/margins, ...).")
    eval_split: Optional[str] = _f(None, "Split of --eval_dataset.",
                                   default_text="--dataset_split")
    eval_steps: int = _f(0, "Evaluate every N optimizer steps (0: only after the last step).", ge=0)
    eval_samples: Optional[int] = _f(None, "Evaluate on the first N samples of the eval set.",
                                     default_text="all", gt=0)
    val_set_size: float = _f(0.0, "Hold out part of --dataset as the eval set (axolotl's val_set_size): a fraction "
                             "under 1 of its samples, or a number of samples; a fixed choice by --seed, the same "
                             "whatever the layout, never trained on. 0: none.", ge=0)
    evals_per_epoch: Optional[int] = _f(None, "Evaluate this many times per pass over --dataset (axolotl's "
                                        "evals_per_epoch): --eval_steps becomes the steps of an epoch / N, rounded "
                                        "down (at least 1).", gt=0)


@dataclass
class VerifyConfig(Settings):
    """Verification: one step compared with plain transformers instead of training."""

    verify: bool = _f(False, "Check this run against plain transformers instead of training: one step of the run as "
                      "configured (every flag applies) at --verify_seq_len, its loss and every parameter's gradient "
                      "compared with a single-process transformers reference on the same weights and tokens, in fp32 "
                      "and in the run's dtype. Prints a table and the verdict; exit code 0 within tolerance, 1 outside "
                      "it (docs/verify.md).")
    verify_seq_len: Optional[int] = _f(None, "Tokens per sequence of the --verify step.",
                                       default_text="min(--seq_len, 4096)",
                                       gt=0)


# the groups' attributes on TrainConfig (cfg.data, cfg.optim, ...) and their keys in a grouped YAML file
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
            if f.name in flags or f.name in GROUPS:  # a flat flag, or a YAML key, would mean two things
                raise TypeError(f"{f.name} names a flag of the group {group} and another flag or a group")
            flags[f.name] = _flag(group, f, hints[f.name])
    return flags


FLAGS = _all_flags()  # flag name -> Flag, in the groups' order
