"""ulysses-train: long-context fine-tuning of Hugging Face causal LMs with Ulysses sequence parallelism on DeepSpeed.

    from ulysses_train import TrainConfig, train
    result = train("run.yaml", learning_rate=1e-4)   # in this process (train/api.py); see docs/python-api.md

`ulysses_train.train` is that function; the package of the same name is imported by its modules' full names
(`from ulysses_train.train.config.train_config import ...`).

    families/ one record per model family: what the trainer knows of it beyond its transformers config
    sp/       sequence parallelism: parallel sizes, process groups, the all-to-all, sharding, the attention wrapper
              and its kernels
    levers/   the memory and speed levers (fused loss, checkpointing and host offload, tiled MLP, lean norms, fused
              kernels, YaRN, shared master weights) and the policy that resolves them
    model/    model presets and building, its buffers, and every patch the levers make to it (surgery)
    data/     generated tokens, corpora, batches
    train/    the run, in rooms that follow its flow: config/, process/, checkpoints/, step/, preference/, run/
              (the trainer), verify/; the Python API (api.py) and the command line (cli.py)
    tools/    the planner, export, the position check, the preview, demos (also as `python -m ulysses_train.<tool>`)
"""

from .levers.loss import fused_linear_cross_entropy, global_token_count, sp_backward_scale
from .model.surgery import install_loss_head
from .sp.all_to_all import all_to_all
from .sp.attention import UlyssesAttention, register_ulysses_attention
from .sp.groups import SequenceParallelGroups, init_distributed
from .sp.sharding import shard_sequence
from .train.api import Trainer, TrainResult, train
from .train.config.groups import (
                                  AdapterConfig,
                                  DataConfig,
                                  EvalConfig,
                                  LeverConfig,
                                  LogConfig,
                                  ModelConfig,
                                  OptimConfig,
                                  OutputConfig,
                                  ParallelConfig,
                                  PreferenceConfig,
                                  SFTConfig,
                                  VerifyConfig,
)
from .train.config.train_config import TrainConfig

__all__ = ["TrainConfig", "TrainResult", "Trainer", "train", "ModelConfig", "DataConfig", "SFTConfig",
           "PreferenceConfig", "AdapterConfig", "OptimConfig", "ParallelConfig", "LeverConfig", "OutputConfig",
           "LogConfig", "EvalConfig", "VerifyConfig", "all_to_all", "UlyssesAttention", "register_ulysses_attention",
           "fused_linear_cross_entropy", "global_token_count", "install_loss_head", "SequenceParallelGroups",
           "shard_sequence", "init_distributed", "sp_backward_scale"]
__version__ = "0.1.0"
