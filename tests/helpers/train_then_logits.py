"""Run under torchrun: train with the real Trainer (flags from argv), then write the trained model's logits on a
fixed input, computed through the sharded Ulysses path and gathered, to $LOGITS_OUT (rank 0)."""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ulysses_train.sp.sharding import shard_order, shard_sequence  # noqa: E402
from ulysses_train.train.config.config_file import parse_args  # noqa: E402
from ulysses_train.train.process.launcher import exit_now, normalise_launcher_env  # noqa: E402
from ulysses_train.train.run.trainer import Trainer  # noqa: E402
from ulysses_train.train.step.loop import train  # noqa: E402

cfg, explicit = parse_args(sys.argv[1:])
normalise_launcher_env()
trainer = Trainer(cfg, explicit)
train(trainer)
g = trainer.groups
ids = torch.arange(3, 3 + 64)[None] % trainer.model_config.vocab_size
shard = shard_sequence(ids, g.sp_size, g.sp_rank, ring_size=g.ring_size)
model = trainer.module.model
with torch.no_grad():
    hidden = model.get_decoder()(input_ids=shard["input_ids"], position_ids=shard["position_ids"])[0]
    logits = model.get_output_embeddings()(hidden)  # (1, 64/sp, V): this rank's shard
parts = [torch.empty_like(logits) for _ in range(g.sp_size)]
dist.all_gather(parts, logits.contiguous(), group=g.sp_group)
if trainer.rank == 0:
    # shards laid end to end are in zigzag order under a ring: back to sequence order
    torch.save(torch.cat(parts, dim=1)[:, shard_order(64, g.ring_size).argsort()], os.environ["LOGITS_OUT"])
dist.barrier()
# as launch/train.py ends: gloo's teardown of the sub-groups at interpreter exit now and then aborts a rank that
# has finished ("terminate called without an active exception"), destroy_process_group first or not
exit_now(0)
