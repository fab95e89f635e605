"""Gated DeltaNet on the GPU (marked gpu, skipped without CUDA): FLA's kernel inside our mixer, packed and not,
against transformers' torch rule in fp32 on each document alone, and --linear_kernel's choice.

Qwen3.5's layer at reduced width (2 key heads and 4 value heads of 128, as the real model's head size), 3 DeltaNet
layers and one gated attention layer, in bf16 through our mixer with FLA; the reference is the same weights in fp32
through transformers with the torch rule, each document alone. bf16 against fp32: each gradient held to twice
transformers' own bf16 error on the same weights (as --verify holds a run, docs/verify.md), or 2e-2 where that is
smaller; a wrong document restart or a miscompiled backward is off by order one. The decay's parameters (A_log, the
`a` projection) sum many small contributions with cancellation: in bf16 they come out about 4% from fp32 on an H100
with FLA 0.6.0, with the kernels FLA's own rule and ours run alike (the same numbers kept or recomputed)."""

import pytest
import torch

pytestmark = pytest.mark.gpu

SEQ = 1024
DOCS = [300, 2, 500, 222]


def _config():
    from transformers import AutoConfig

    return AutoConfig.for_model("qwen3_5_text", vocab_size=512, hidden_size=256, intermediate_size=512,
                                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
                                linear_value_head_dim=128, use_cache=False, pad_token_id=0)


def _fla_or_skip():
    from ulysses_train.sp.linear_kernel import fla_problem

    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    problem = fla_problem(torch.device("cuda"))
    if problem:
        pytest.skip(problem)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _reference(state, ids, docs, monkeypatch, dtype=torch.float32):
    """Plain transformers with its torch rule (not the FLA binding it makes when `fla` imports), each document
    alone, in `dtype`: the loss (mean over targets) and gradients."""
    import inspect

    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5 import modeling_qwen3_5

    monkeypatch.setattr(modeling_qwen3_5, "torch_chunk_gated_delta_rule",
                        inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule))
    model = AutoModelForCausalLM.from_config(_config(), attn_implementation="sdpa").cuda()
    model.load_state_dict(state)
    model.to(dtype)
    bounds = [0, *torch.tensor(docs).cumsum(0).tolist()]
    targets = SEQ - len(docs)
    loss = sum(model(input_ids=ids[:, a:b], labels=ids[:, a:b]).loss * (b - a - 1)
               for a, b in zip(bounds[:-1], bounds[1:])) / targets
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("packed,kept", [(False, False), (True, False), (False, True), (True, True)])
def test_fla_mixer_in_bf16_matches_the_torch_rule_in_fp32(packed, kept, monkeypatch):
    """Also with every layer checkpointed and the gated delta rule's outputs kept (--linear_recompute never): the
    rule's op then runs once per DeltaNet layer, and the numbers are the same."""
    from transformers import AutoModelForCausalLM

    from ulysses_train.levers.loss import CausalLMWithSPLoss, global_token_count
    from ulysses_train.model.surgery import enable_checkpointing, install_deltanet_mixers, install_loss_head
    from ulysses_train.sp import gated_delta_op
    from ulysses_train.sp.attention import register_ulysses_attention
    from ulysses_train.sp.linear_kernel import LinearKernel
    from ulysses_train.sp.sharding import shard_sequence

    _fla_or_skip()
    attention = register_ulysses_attention(None, "sdpa")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(), attn_implementation="ulysses").cuda()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1)).cuda()
    docs = DOCS if packed else [SEQ]
    attention.doc_lengths = [docs] if packed else None
    model.to(torch.bfloat16)
    install_loss_head(model)
    assert install_deltanet_mixers(model, None, LinearKernel("fla"), attention if packed else None) == 3
    if kept:
        enable_checkpointing(model, True, None, keep_linear=True)
    calls, forward = [], gated_delta_op.IMPL["forward"]
    monkeypatch.setitem(gated_delta_op.IMPL, "forward", lambda *a: calls.append(1) or forward(*a))
    labels, positions = ids.clone(), torch.cat([torch.arange(n) for n in docs])[None].cuda()
    labels[0, torch.tensor([0, *torch.tensor(docs).cumsum(0)[:-1].tolist()])] = -100
    shard = shard_sequence(ids, 1, 0, labels=labels, position_ids=positions)
    loss = CausalLMWithSPLoss(model)(shard["input_ids"], shard["position_ids"], shard["labels"],
                                     global_token_count(shard["labels"], None))
    loss.backward()
    assert len(calls) == 3  # once per DeltaNet layer: not again in a recompute
    ref_loss, ref_grads = _reference(state, ids, docs, monkeypatch)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-2)
    _, own_grads = _reference(state, ids, docs, monkeypatch, torch.bfloat16)  # transformers' own bf16
    over = {n: (_rel(p.grad, ref_grads[n]), _rel(own_grads[n], ref_grads[n])) for n, p in model.named_parameters()
            if ref_grads[n].norm() > 0}
    over = {n: errors for n, errors in over.items() if errors[0] > max(2e-2, 2 * errors[1])}
    assert not over, over  # name -> (ours, transformers' bf16) relative to fp32


def test_linear_kernel_auto_picks_fla_where_it_runs_and_agrees():
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5

    from ulysses_train.sp.linear_kernel import choose_linear_kernel, self_check

    _fla_or_skip()
    rule = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)
    assert self_check(torch.device("cuda"), rule) is None
    assert choose_linear_kernel("auto", torch.device("cuda"), rule).name == "fla"


@pytest.mark.parametrize("packed", [False, True])
def test_our_op_computes_what_flas_rule_computes(packed):
    """Our registered op (sp/gated_delta_op.py) makes FLA's calls: output and every gradient as FLA's own
    chunk_gated_delta_rule with the L2 norm in the kernel, at Qwen3.5-9B's head shapes (16 key and 32 value heads of
    128), bf16, 4,096 tokens, packed into documents or not."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from ulysses_train.sp.gated_delta_op import gated_delta_rule

    _fla_or_skip()
    g = torch.Generator(device="cuda").manual_seed(0)
    n = 4096
    shapes = [(1, n, 16, 128), (1, n, 16, 128), (1, n, 32, 128)]
    q, k, v = (torch.randn(*s, generator=g, device="cuda").bfloat16() for s in shapes)
    decay = -torch.rand(1, n, 32, generator=g, device="cuda") * 0.5
    beta = torch.rand(1, n, 32, generator=g, device="cuda").bfloat16()
    inputs = [t.requires_grad_() for t in (q, k, v, decay, beta)]
    grad_out = torch.randn(1, n, 32, 128, generator=g, device="cuda").bfloat16()
    cu = torch.tensor([0, 1000, 1001, 3000, n], device="cuda") if packed else None
    ours = gated_delta_rule(*inputs, cu_seqlens=cu)
    theirs = chunk_gated_delta_rule(*inputs[:3], g=inputs[3], beta=inputs[4], cu_seqlens=cu,
                                    use_qk_l2norm_in_kernel=True)[0]
    for name, a, b in zip(["out", "dq", "dk", "dv", "dg", "dbeta"],
                          [ours, *torch.autograd.grad(ours, inputs, grad_out)],
                          [theirs, *torch.autograd.grad(theirs, inputs, grad_out)]):
        assert _rel(a, b) < 1e-3, (name, _rel(a, b))


@pytest.mark.parametrize("packed", [False, True])
def test_flas_conv_computes_the_modeling_files_conv(packed):
    """FLA's causal depthwise conv with SiLU (linear_kernel.fla_conv), restarting at documents, against the modeling
    file's (an F.conv1d) run on each document alone: bf16 at Qwen3.5-9B's 8,192 channels, output and gradients."""
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5

    from ulysses_train.sp.linear_kernel import fla_conv

    _fla_or_skip()
    conv = inspect.unwrap(modeling_qwen3_5.causal_conv1d_fn)
    g = torch.Generator(device="cuda").manual_seed(0)
    n, channels = 4096, 8192
    x = torch.randn(1, n, channels, generator=g, device="cuda").bfloat16().requires_grad_()
    weight = (torch.randn(channels, 4, generator=g, device="cuda") * 0.5).bfloat16().requires_grad_()
    grad_out = torch.randn(1, n, channels, generator=g, device="cuda").bfloat16()
    bounds = [0, 1000, 1001, 3000, n] if packed else [0, n]
    ours = fla_conv(x, weight, None, "silu", torch.tensor(bounds, device="cuda") if packed else None)
    theirs = torch.cat([conv(x[:, a:b].transpose(1, 2), weight, None, activation="silu").transpose(1, 2)
                        for a, b in zip(bounds[:-1], bounds[1:])], dim=1)
    for name, a, b in zip(["out", "dx", "dweight"], [ours, *torch.autograd.grad(ours, (x, weight), grad_out)],
                          [theirs, *torch.autograd.grad(theirs, (x, weight), grad_out)]):
        assert _rel(a, b) < 1e-2, (name, _rel(a, b))
