"""ulysses-train: long-context fine-tuning of Hugging Face causal LMs with Ulysses sequence parallelism on DeepSpeed."""

from .all_to_all import all_to_all
from .attention import UlyssesAttention, register_ulysses_attention
from .loss import fused_linear_cross_entropy, global_token_count, install_loss_head
from .parallel import SequenceParallelGroups
from .sharding import shard_sequence

__all__ = ["all_to_all", "UlyssesAttention", "register_ulysses_attention", "fused_linear_cross_entropy",
           "global_token_count", "install_loss_head", "SequenceParallelGroups", "shard_sequence"]
__version__ = "0.1.0"
