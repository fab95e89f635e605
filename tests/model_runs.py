"""A tiny HF model's loss and gradients, one process with plain transformers and sharded under DeepSpeed ZeRO and
Ulysses SP on every rank: the two runs tests/distributed/test_model_equivalence.py compares on CPU and
tests/gpu/test_gpu.py on GPUs."""

from typing import Optional

import torch

from tests.models import tiny_config

SEQ = 64


def transformers_reference(family, seed, loss_kind):
    """One process, plain transformers (its SDPA attention, its own loss): (state dict, ids, loss, every
    parameter's gradient) of a tiny `family` model seeded with `seed`, on SEQ random tokens. The loss is always
    transformers' own: `loss_kind` only mirrors `sharded_run`'s arguments."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family), attn_implementation="sdpa")
    ids = torch.randint(3, model.config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(seed + 1))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return model.state_dict(), ids, out.loss.item(), grads


def sharded_run(rank, world, family, seed, loss_kind, stage, reduce_scatter=True, tiled=False, dtype="float32",
                lean=False, kernels=("ours",)):
    """On each rank of a launch of `world` (SP = world): the reference's weights in a model with Ulysses attention under
    ZeRO `stage`, its loss head fused or plain (`loss_kind`); returns {loss kernel: (the SP group's loss, every
    parameter's full gradient)} for each of `kernels`."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    from ulysses_train.levers.loss import CausalLMWithSPLoss, global_token_count, sp_backward_scale
    from ulysses_train.model.surgery import install_loss_head
    from ulysses_train.sp.attention import register_ulysses_attention
    from ulysses_train.sp.groups import SequenceParallelGroups
    from ulysses_train.sp.sharding import shard_sequence

    state, ids, _, _ = transformers_reference(family, seed, loss_kind)
    groups = SequenceParallelGroups(world)
    register_ulysses_attention(groups.sp_group, "sdpa")
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "sequence_parallel_size": world,
          "zero_optimization": {"stage": stage, "reduce_scatter": reduce_scatter}, "steps_per_print": 10**9,
          "bf16": {"enabled": dtype == "bfloat16"}}
    hf_ds = HfDeepSpeedConfig(ds) if stage == 3 else None  # noqa: F841  (kept alive for zero.Init)
    # built under zero.Init exactly when stage 3 asks for it (an earlier case's config in this process must not linger)
    assert is_deepspeed_zero3_enabled() == (stage == 3)
    model = AutoModelForCausalLM.from_config(tiny_config(family), attn_implementation="ulysses",
                                             dtype=getattr(torch, dtype))
    for name, param in model.named_parameters():  # the reference's weights, into the partitioned model
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            if rank == 0:
                param.data.copy_(state[name])
    install_loss_head(model, fused=loss_kind == "fused", chunk_size=7)  # odd chunk: partial chunks get tested
    if tiled:  # ZeRO-3 must wait for the last tile before reducing an MLP weight's gradient
        from ulysses_train.model.surgery import enable_tiled_mlp

        enable_tiled_mlp(model, tile_tokens=6)
    if lean:  # our RMSNorm Function: the weight is a ZeRO-3-partitioned parameter saved for its backward
        from ulysses_train.model.surgery import install_lean_norms

        assert install_lean_norms(model) > 0
    wrapped = CausalLMWithSPLoss(model)
    engine, *_ = deepspeed.initialize(model=wrapped, optimizer=torch.optim.AdamW(wrapped.parameters(), lr=0.0),
                                      config=ds, mpu=groups)
    shard = {k: v.to(engine.device) for k, v in shard_sequence(ids, groups.sp_size, groups.sp_rank).items()}
    normalizer = global_token_count(shard["labels"], groups.sp_group)
    results = {}
    for kernel in kernels:
        model.get_output_embeddings().kernel = kernel
        loss = engine(shard["input_ids"], shard["position_ids"], shard["labels"], normalizer)
        engine.backward(loss * sp_backward_scale(ds, groups.sp_size))
        grads = {n.removeprefix("model."): safe_get_full_grad(p).float().cpu()
                 for n, p in engine.module.named_parameters()}
        total = loss.detach().float().clone()
        torch.distributed.all_reduce(total, group=groups.sp_group)
        results[kernel] = (total.item(), grads)
        engine.step()  # lr 0: the weights stay as they are, and the gradients are cleared for the next kernel
    return results


def checkpointed_loss(name: str, seq: int, offload: bool = False, checkpointing: Optional[dict] = None,
                      adapters=None):
    """A tiny `name` model through our attention (SDPA) and, for a Gated DeltaNet family (Qwen3.5), our mixers on the
    `fla` kernel (what tests/models.py: use_reference_deltanet_kernels makes of it on the CPU), with `adapters` (an
    AdapterSpec: PEFT's LoRA layers, as --use_peft injects them) if given, every layer checkpointed with
    `checkpointing` (enable_checkpointing's keyword arguments; None: not checkpointed), the fused loss head: (model,
    its loss on `seq` tokens, not yet backpropagated, the offload's hooks or None)."""
    from transformers import AutoModelForCausalLM

    from tests.models import any_tiny_config, perturb_deltanet
    from ulysses_train.levers.loss import CausalLMWithSPLoss, global_token_count
    from ulysses_train.levers.offload import HostOffload
    from ulysses_train.model.surgery import enable_checkpointing, install_deltanet_mixers, install_loss_head
    from ulysses_train.sp.attention import register_ulysses_attention
    from ulysses_train.sp.linear_kernel import LinearKernel
    from ulysses_train.sp.sharding import shard_sequence

    register_ulysses_attention(None, "sdpa")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(any_tiny_config(name), attn_implementation="ulysses")
    if name == "qwen3_5_text":
        perturb_deltanet(model, 3)
        assert install_deltanet_mixers(model, None, LinearKernel("fla"), None) == 3
    if adapters is not None:
        from ulysses_train.model.adapters import add_adapters

        add_adapters(model, adapters)
    hooks = HostOffload(min_bytes=0) if offload else None
    if checkpointing is not None:
        levers = dict(checkpointing)
        enable_checkpointing(model, levers.pop("keep_attention", False), hooks, **levers)
    install_loss_head(model, fused=True, chunk_size=16)
    ids = torch.randint(3, 96, (1, seq), generator=torch.Generator().manual_seed(1))
    shard = shard_sequence(ids, 1, 0)
    loss = CausalLMWithSPLoss(model)(shard["input_ids"], shard["position_ids"], shard["labels"],
                                     global_token_count(shard["labels"], None))
    return model, loss, hooks
