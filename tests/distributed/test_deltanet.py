"""Gated DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) under Ulysses SP equal plain transformers.

A DeltaNet layer never passes through the attention interface: left alone, each rank would run the causal conv and
the recurrence on its own shard as if the sequence started there. With the SP mixer (sp/deltanet.py) each rank runs
them on the whole sequence for its heads. The sequence (80) is longer than the torch fallback's chunk (64), so the
recurrence crosses a chunk boundary, and every rank's shard reads the conv's and the state's past from another rank.
At SP 4 the 2 key heads are fewer than the ranks: each is replicated on 2 ranks, which split its 2 value heads.

Reference: transformers on the same weights, fp32, one process, computed in the same test (its torch fallback of
the chunked gated delta rule on CPU). Every gradient is held to 1e-5 relative, but those of `A_log` and `dt_bias`,
which reach the loss through exponentials of cumulative sums of the decay: transformers' own fp32 gradients of them
move by up to 4e-5 when only its projections round otherwise (fp64 projections, the same fp32 recurrence), and a
shard's projections round otherwise than the whole sequence's. Those two are held, as `--verify` holds a bf16 run,
to twice transformers' own error against that more precise reference (and never below 1e-5); a cut in the wrong
place moves every gradient by orders of magnitude more. Each rank runs the SP
mixer, the Ulysses attention for the gated attention layer and our fused loss head, and back-propagates its share;
the sum of the ranks' gradients must equal the reference's, per tensor. One launch per SP size runs every family.

Packed (`--packing`): three documents of 30, 2 and 48 tokens in one row (one shorter than the conv's window, one
across every rank's shard boundary at SP 2 and 4). The reference is each document run alone through transformers,
whose torch fallback on a packed row would carry the conv's and the state's past across documents: the loss is the
sum of each document's over all targets, the gradients the sum of theirs. The same cases run at SP=1 in one process
(the mixer restarts at documents there too)."""

import pytest
import torch

from tests.models import any_tiny_config, perturb_deltanet
from tests.multiprocess import run_distributed
from ulysses_train.errors import ConfigError
from ulysses_train.sp.support import check_support

SEQ = 80
DOCS = [30, 2, 48]  # packed cases: one row of three documents
FAMILIES = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"]
LIMIT = 1e-5
DECAY = ("A_log", "dt_bias")


def _model(name: str, attention: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(any_tiny_config(name), attn_implementation=attention)


def _ids(model, seed: int) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(seed))


def _pieces(docs):
    """The (start, end) of each document, the whole row when not packed."""
    bounds = [0] + torch.tensor(docs or [SEQ]).cumsum(0).tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _document_loss(model, ids, docs):
    """The mean over every target of each document run alone (a document's last token has no target)."""
    pieces = _pieces(docs)
    targets = SEQ - len(pieces)
    return sum(model(input_ids=ids[:, a:b], labels=ids[:, a:b]).loss * (b - a - 1) for a, b in pieces) / targets


def _reference(name: str, seed: int, docs=None):
    torch.manual_seed(seed)
    model = _model(name, "eager")
    perturb_deltanet(model, seed)
    ids = _ids(model, seed)
    loss = _document_loss(model, ids, docs)
    loss.backward()
    return model.state_dict(), ids, loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _packed_inputs(ids, docs):
    """labels (-100 at each document's first token, so no target crosses a boundary) and positions restarting."""
    labels, positions = ids.clone(), torch.cat([torch.arange(b - a) for a, b in _pieces(docs)])[None]
    labels[0, [a for a, _ in _pieces(docs)]] = -100
    return labels, positions


def _precise(name: str, seed: int, state, ids, docs=None) -> dict:
    """The gradients of the decay's parameters with fp64 projections (transformers' recurrence stays fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(any_tiny_config(name), attn_implementation="eager",
                                             experts_implementation="eager").double()  # grouped_mm takes no fp64
    model.load_state_dict(state)
    _document_loss(model, ids, docs).backward()
    return {n: p.grad for n, p in model.named_parameters() if n.endswith(DECAY)}


def _relative(grad, ref) -> float:
    return ((grad.double() - ref).norm() / ref.norm()).item() if ref.norm() > 0 else grad.norm().item()


def _sharded(rank, world, cases):
    import torch.distributed as dist

    from tests.multiprocess import summed_over
    from ulysses_train.levers.loss import CausalLMWithSPLoss, global_token_count
    from ulysses_train.model.surgery import install_deltanet_mixers, install_loss_head
    from ulysses_train.sp.attention import register_ulysses_attention
    from ulysses_train.sp.linear_kernel import LinearKernel
    from ulysses_train.sp.sharding import shard_sequence

    group = dist.new_group(list(range(world))) if world > 1 else None
    attention = register_ulysses_attention(group, "sdpa")
    results = {}
    for name, seed, docs in cases:
        state, ids, _, _ = _reference(name, seed, docs)
        model = _model(name, "ulysses")
        model.load_state_dict(state)
        install_loss_head(model, fused=True, chunk_size=16)
        attention.doc_lengths = None if docs is None else [docs]
        patched = install_deltanet_mixers(model, group, LinearKernel("torch"), attention if docs else None)
        labels, positions = _packed_inputs(ids, docs) if docs else (None, None)
        shard = shard_sequence(ids, world, rank, labels=labels, position_ids=positions)
        loss = CausalLMWithSPLoss(model)(shard["input_ids"], shard["position_ids"], shard["labels"],
                                         global_token_count(shard["labels"], group))
        if group is None:
            loss.backward()
            results[(name, docs is not None)] = (loss.item(), {n: p.grad for n, p in model.named_parameters()},
                                                 patched)
        else:
            results[(name, docs is not None)] = (*summed_over(group, loss, model), patched)
    return results


def _check(results, cases):
    for name, seed, docs in cases:
        state, ids, ref_loss, ref_grads = _reference(name, seed, docs)
        precise = _precise(name, seed, state, ids, docs)
        for by_case in results:
            loss, grads, patched = by_case[(name, docs is not None)]
            assert patched == 3, (name, patched)  # the tiny configs' 3 DeltaNet layers of 4
            assert loss == pytest.approx(ref_loss, rel=1e-5), name
            for pname, ref in ref_grads.items():  # per tensor, as --verify measures: fp32 sums in another order
                if pname in precise:
                    error = _relative(grads[pname], precise[pname])
                    limit = 2 * max(_relative(ref, precise[pname]), LIMIT)
                else:
                    error, limit = _relative(grads[pname], ref), LIMIT
                assert error <= limit, f"{name}, {pname}, packed {docs}: relative error {error:.2e} (limit {limit:.2e})"


def _cases(first_seed: int) -> list:
    return [(name, first_seed + i, docs) for docs in (None, DOCS) for i, name in enumerate(FAMILIES)]


def test_deltanet_families_at_sp2_match_transformers_packed_and_not():
    cases = _cases(5)
    _check(run_distributed(_sharded, 2, cases), cases)


def test_deltanet_families_at_sp4_with_replicated_key_heads_match_transformers_packed_and_not():
    cases = _cases(17)
    _check(run_distributed(_sharded, 4, cases), cases)


def test_deltanet_at_sp1_matches_transformers_and_packed_restarts_at_each_document_like_each_alone():
    """SP=1: Qwen3.5's conv reads the projection's own output (no all-to-all, no copy), Qwen3-Next's the joined
    q, k, v; packed, both restart at each document."""
    cases = _cases(29)
    _check([_sharded(0, 1, cases)], cases)


def _refused(config, **run) -> str:
    with pytest.raises(ConfigError) as e:
        check_support(config, **run)
    return str(e.value)


def test_the_support_check_lets_deltanet_through_under_sp_and_refuses_the_rest():
    for name in FAMILIES:
        config = any_tiny_config(name)
        check_support(config, sp_size=2)
        check_support(config, sp_size=4)  # 2 key heads, replicated
        assert "--ring_size 1" in _refused(config, sp_size=4, ring_size=2)
        check_support(config, sp_size=2, packing=True)
    config = any_tiny_config("qwen3_5_text")
    config.linear_num_key_heads, config.linear_num_value_heads = 3, 6  # 3 key heads: neither split nor replicated
    message = _refused(config, sp_size=2)
    assert "--sp_size 2" in message and "3 linear key heads" in message and "6 linear value heads" in message
    config.linear_num_key_heads, config.linear_num_value_heads = 2, 2  # replicated keys, but 2 value heads for 4
    assert "2 linear value heads" in _refused(config, sp_size=4)


def test_each_familys_mixer_has_what_the_sp_forward_reads_and_a_changed_one_fails_naming_the_version():
    import transformers
    from transformers import AutoModelForCausalLM

    from ulysses_train.sp.deltanet import is_deltanet, layout_of

    layouts = {}
    for name in FAMILIES:
        model = AutoModelForCausalLM.from_config(any_tiny_config(name))
        mixers = [m for m in model.modules() if is_deltanet(m)]
        assert len(mixers) == 3, name
        layouts[name] = {layout_of(m) for m in mixers}
    assert layouts == {"qwen3_5_text": {"qkv, z, b, a"}, "qwen3_5_moe_text": {"qkv, z, b, a"},
                       "qwen3_next": {"qkvz, ba"}}
    del mixers[0].dt_bias
    with pytest.raises(TypeError, match=f"transformers {transformers.__version__} lacks dt_bias"):
        layout_of(mixers[0])


def test_verify_passes_for_the_deltanet_families_at_sp2_packed_and_not(tmp_path):
    """`--verify` (the trainer as configured: ZeRO-3, every lever the policy picks, our fused loss) at SP=2 against
    plain transformers, one trainer after another in one launch: Qwen3.5 on one sequence; Qwen3.5-MoE (with its
    router's load-balancing loss) and Qwen3-Next on packed rows of pre-tokenized documents, whose reference runs
    each document alone (train/verify/reference_model.py: forward_by_document). The first keeps the attention
    outputs, which failed in the backward under ZeRO-3 with torch's selective checkpointing (levers/checkpointing.py
    says why)."""
    import json

    from tests.verify_runs import verify_settings

    data = tmp_path / "docs.jsonl"
    lengths = [23, 2, 41, 17, 30, 9, 50, 12]  # packed first-fit into 64-token rows: several documents a row
    g = torch.Generator().manual_seed(3)
    data.write_text("".join(json.dumps({"input_ids": torch.randint(3, 96, (n,), generator=g).tolist()}) + "\n"
                            for n in lengths))
    settings = []
    for name, packed in (("qwen3_5_text", False), ("qwen3_5_moe_text", True), ("qwen3_next", True)):
        config = any_tiny_config(name)
        config.output_router_logits = name == "qwen3_5_moe_text"
        config.vocab_size = 259 if packed else config.vocab_size  # the byte tokenizer's ids (its pad and EOS)
        path = tmp_path / f"{name}.json"
        path.write_text(config.to_json_string())
        argv = ["--model_config", str(path), "--sp_size", "2", "--verify_seq_len", "64", "--ds_config",
                "ds_configs/zero3.json"]
        if not packed:  # kept attention under ZeRO-3, whose gathers differ between forward and recompute; the
            # gated delta rule's asked for, but the CPU's torch rule is not a kept op: the trainer says so
            argv += ["--attn_recompute", "never", "--linear_recompute", "never"]
        if packed:
            argv += ["--dataset", str(data), "--tokenizer", "bytes", "--packing", "--seq_len", "64",
                     "--data_cache_dir", str(tmp_path / "cache")]
        settings.append(argv)
    results = run_distributed(verify_settings, 2, settings, str(tmp_path), use_deepspeed=True)[0]
    for (name, _), result in zip((("qwen3_5_text", 0), ("qwen3_5_moe_text", 1), ("qwen3_next", 1)), results):
        assert result["passed"], (name, result)
        assert "sp 2 x dp 1" in result["setup"], name
    assert "attention kept: True, gated delta rule kept: False" in results[0]["setup"], results[0]["setup"]


def test_linear_kernel_choice_on_the_cpu():
    """auto falls back to transformers' torch rule with the reason; fla asked for where it cannot run is a
    ConfigError naming the flag; the torch rule is transformers' own function even where `fla` would bind."""
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5

    from ulysses_train.sp.linear_kernel import LinearKernel, choose_linear_kernel

    rule = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)
    auto = choose_linear_kernel("auto", torch.device("cpu"), rule)
    assert auto.name == "torch" and "FLA's kernels run on CUDA, not on cpu" in auto.why
    with pytest.raises(ConfigError, match="--linear_kernel fla: FLA's kernels run on CUDA"):
        choose_linear_kernel("fla", torch.device("cpu"), rule)
    model = _model("qwen3_5_text", "eager")
    mixer = next(m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    assert LinearKernel("torch").rule(mixer) is rule
