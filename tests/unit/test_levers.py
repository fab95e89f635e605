"""Memory levers change memory and time, never the numbers: each one on versus off gives the same loss and the
same gradients, at SP=1 and SP=2 (fp32, CPU). And each one really acts: kept attention outputs mean the attention
kernel runs once per layer instead of twice, which we count at the dispatcher; the lean RMSNorm is among them; the
offload moves the layer inputs, and with kept attention its outputs too, which we count in bytes (on CPU the "host" copy
is a plain copy, so the bookkeeping and the exactness are what is tested here; tests/gpu/test_gpu.py runs the CUDA
streams)."""


import pytest
import torch

from tests.attention_calls import CountAttention
from tests.models import tiny_config
from tests.multiprocess import run_distributed
from ulysses_train.levers.fused_kernels import triton_importable

SEQ = 64


def _step(rank, world, keep_attention, loss_kind, checkpoint, tiled=False, offload=False, lean=False, kernel="sdpa",
          checkpoint_layers=None, gpu_checkpoints=0, every=1, config=None, dropout=0.0):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from ulysses_train.levers.loss import CausalLMWithSPLoss, global_token_count
    from ulysses_train.levers.offload import HostOffload
    from ulysses_train.model.surgery import enable_checkpointing, install_loss_head
    from ulysses_train.sp.attention import register_ulysses_attention
    from ulysses_train.sp.sharding import shard_sequence

    group = dist.new_group(list(range(world))) if world > 1 else None
    if kernel == "flash_attn_4":  # the registered op around FA4's kernels, running an exact reference on CPU
        from ulysses_train.sp import fa4_op

        fa4_op.IMPL.update(fa4_op.REFERENCE_IMPL)
    register_ulysses_attention(group, kernel)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config or tiny_config("qwen3"), attn_implementation="ulysses")
    model.train()
    for layer in model.model.layers if dropout else []:  # random masks that every recompute must repeat
        layer.mlp.register_forward_hook(lambda m, i, out: torch.nn.functional.dropout(out, dropout, training=True))
    hooks = HostOffload(min_bytes=0) if offload else None
    if checkpoint:
        enable_checkpointing(model, keep_attention, offload=hooks, layers=checkpoint_layers,
                             gpu_checkpoints=gpu_checkpoints, every=every)
    install_loss_head(model, fused=loss_kind == "fused", chunk_size=8)
    if lean:  # True: the lean norms; "fused": our Triton norms and rotary (interpreted on CPU)
        from ulysses_train.model.surgery import install_fused_mlp, install_fused_rotary, install_lean_norms

        assert install_lean_norms(model, fused=lean == "fused") > 0
        if lean == "fused":
            assert install_fused_rotary(model) == install_fused_mlp(model) == model.config.num_hidden_layers
    if tiled:
        from ulysses_train.model.surgery import enable_tiled_mlp

        assert enable_tiled_mlp(model, tile_tokens=5) == model.config.num_hidden_layers  # uneven last tile
    ids = torch.randint(3, 96, (1, SEQ), generator=torch.Generator().manual_seed(1))
    shard = shard_sequence(ids, world, rank)
    counter = CountAttention()
    with counter:
        loss = CausalLMWithSPLoss(model)(shard["input_ids"], shard["position_ids"], shard["labels"],
                                         global_token_count(shard["labels"], group))
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    if world > 1:
        for g in grads.values():
            dist.all_reduce(g, group=group)
        dist.all_reduce(loss.detach(), group=group)
    return loss.item(), grads, counter.calls, hooks.host_bytes if hooks else 0


def _steps(rank, world, runs):
    return [_step(rank, world, *args) for args in runs]


def _run_all(world, runs):
    """_step for each argument tuple of `runs`, in this process (world 1) or in one launch of `world` ranks; rank
    0's results, in order."""
    if world == 1:
        return _steps(0, 1, runs)
    return run_distributed(_steps, world, runs)[0]


@pytest.mark.slow
@pytest.mark.parametrize("sp", [1, 2])
def test_levers_do_not_change_loss_or_gradients(sp):
    config = tiny_config("qwen3")
    layers = config.num_hidden_layers
    layer_input = SEQ // sp * config.hidden_size * 4  # fp32 bytes of one layer's input on this rank
    attention_out = SEQ * config.num_attention_heads // sp * config.head_dim * 4  # after the all-to-all
    variants = ((False, "plain", False, False, False, 2 * layers), (True, "plain", False, False, False, layers),
                (True, "fused", False, False, False, layers), (False, "fused", True, False, False, 2 * layers),
                (True, "fused", True, False, False, layers), (False, "fused", False, True, False, 2 * layers),
                (False, "plain", False, False, True, 2 * layers), (True, "fused", True, True, True, layers))
    base = (False, "plain", False)  # no checkpointing, plain loss
    (base_loss, base_grads, base_calls, _), *results = _run_all(sp, [base] + [
        (keep, loss_kind, True, tiled, offload, lean) for keep, loss_kind, tiled, offload, lean, _ in variants])
    assert base_calls == layers
    offloaded = {}
    for (keep, loss_kind, tiled, offload, lean, expected_calls), result in zip(variants, results):
        loss, grads, calls, offloaded[keep, offload] = result
        assert calls == expected_calls, (keep, loss_kind)  # recompute re-runs the kernel unless outputs are kept
        assert loss == pytest.approx(base_loss, rel=1e-6)
        for name, ref in base_grads.items():
            torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    assert offloaded[False, True] >= layers * layer_input  # every checkpointed layer's input went out
    assert offloaded[True, True] >= offloaded[False, True] + layers * attention_out  # and every kept output


def test_partial_checkpointing_is_exact_and_checkpoints_only_the_first_layers():
    """`--checkpoint_layers N`: with N of the layers checkpointed (kept attention outputs offloaded, and plain
    recompute) the loss and every gradient equal those of full checkpointing and of none; only the first N layers
    recompute (the attention kernel runs layers + N times without kept outputs) and offload (N layers' bytes)."""
    layers = tiny_config("qwen3").num_hidden_layers
    assert layers == 2  # so that 1 is partial
    base_loss, base_grads, base_calls, _ = _step(0, 1, False, "fused", False)  # no checkpointing
    offloaded = {}
    for keep in (True, False):
        for n in (0, 1, layers):
            loss, grads, calls, offloaded[keep, n] = _step(0, 1, keep, "fused", True, False, True, False, "sdpa", n)
            assert calls == base_calls + (0 if keep else n), (keep, n)
            assert loss == pytest.approx(base_loss, rel=1e-6), (keep, n)
            for name, ref in base_grads.items():
                torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
        assert offloaded[keep, 0] == 0 and offloaded[keep, layers] == layers * offloaded[keep, 1] > 0
    assert offloaded[True, 1] > offloaded[False, 1]  # the kept outputs of the checkpointed layer went out too


def _five_layers(**extra):
    from transformers import AutoConfig

    from tests.models import TINY

    return AutoConfig.for_model("qwen3", **{**TINY["qwen3"], "num_hidden_layers": 5, **extra})


def test_checkpoints_split_between_gpu_and_host_and_segments_are_exact():
    """`--gpu_checkpoints` and `--checkpoint_every` (levers/placement.py): five layers, the last two keeping their
    checkpoints on the "GPU" (not offloaded) and the first three offloading theirs, and segments of two layers (the
    second's input regenerated in the backward, the attention kernel run once more per regenerating layer), alone,
    with the offload split, with kept outputs and beside uncheckpointed layers: the loss and every gradient equal
    those without checkpointing, and the offloaded bytes are those of the layers placed on the host."""
    config = _five_layers()
    layers, layer_input = 5, SEQ * config.hidden_size * 4
    base_loss, base_grads, base_calls, _ = _step(0, 1, False, "fused", False, config=config)
    assert base_calls == layers
    # (keep, offload, checkpoint_layers, gpu_checkpoints, every) -> attention kernel calls, offloaded layer inputs
    variants = {(False, True, None, 2, 1): (2 * layers, 3), (True, True, None, 2, 1): (layers, 3),
                (False, False, None, 0, 2): (2 * layers + 2, 0), (True, True, None, 1, 2): (layers + 2, 2),
                (False, True, 4, 1, 3): (layers + 4 + 2, 1)}
    for (keep, offload, n, gpu, every), (calls_expected, inputs) in variants.items():
        loss, grads, calls, offloaded = _step(0, 1, keep, "fused", True, False, offload, False, "sdpa", n, gpu, every,
                                              config)
        assert calls == calls_expected, (keep, offload, n, gpu, every)
        assert loss == pytest.approx(base_loss, rel=1e-6), (keep, offload, n, gpu, every)
        for name, ref in base_grads.items():
            torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
        if not keep:
            assert offloaded == inputs * layer_input, (offload, n, gpu, every)


def test_segments_repeat_the_forward_random_state():
    """A regenerating forward runs under each layer's random state of the forward (as --lora_dropout's masks need):
    with dropout after every MLP the loss and gradients of segments of two equal those of a checkpoint per layer
    (which torch's checkpoint already replays exactly)."""
    config = _five_layers()
    loss, grads, _, _ = _step(0, 1, False, "fused", True, config=config, dropout=0.3)
    seg_loss, seg_grads, _, _ = _step(0, 1, False, "fused", True, every=2, config=config, dropout=0.3)
    assert seg_loss == pytest.approx(loss, rel=1e-6)
    for name, ref in grads.items():
        torch.testing.assert_close(seg_grads[name], ref, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif(not triton_importable(), reason="needs Triton (pip install triton): its interpreter runs the "
                                                     "kernels on CPU")
@pytest.mark.slow
@pytest.mark.parametrize("sp", [1, 2])
def test_fused_kernels_with_every_lever_do_not_change_loss_or_gradients(sp):
    """Our Triton RMSNorm, rotary and SwiGLU (ulysses_train/levers/fused_kernels.py) inside checkpointed layers that
    keep and offload their attention outputs, with tiled MLP and the fused loss: the same loss and gradients as the
    plain model, and the attention kernel still runs once per layer."""
    (base_loss, base_grads, _, _), (loss, grads, calls, _) = _run_all(
        sp, [(False, "plain", False), (True, "fused", True, True, True, "fused")])
    layers = tiny_config("qwen3").num_hidden_layers
    assert calls == layers
    assert loss == pytest.approx(base_loss, rel=1e-6)
    for name, ref in base_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_kept_output_offload_swaps_the_stored_outputs_for_host_copies():
    """After a kept op, the outputs the keeping mode stored go to the host (once: a host copy is not copied again),
    and come back equal."""
    from ulysses_train.levers.checkpointing import KeptOutput
    from ulysses_train.levers.offload import HostOffload, OffloadKeptOutputs, _HostCopy

    kept = torch.arange(1 << 18, dtype=torch.float32)
    storage = {"attention": [(KeptOutput(kept), 3)]}  # an op's outputs: a tensor and a plain number
    offload = HostOffload(min_bytes=0)
    mode = OffloadKeptOutputs.__new__(OffloadKeptOutputs)
    mode.storage, mode.offload = storage, offload
    mode._offload_new_entries()
    mode._offload_new_entries()
    entry, number = storage["attention"][0]
    assert isinstance(entry, _HostCopy) and number == 3 and offload.host_bytes == kept.numel() * 4
    assert torch.equal(entry.get_val(), kept)


def _disjoint(tensors) -> bool:
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    return all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def test_pinned_pool_reuses_its_memory_each_step(monkeypatch):
    """A step that asks for the same tensors again gets the same memory and registers nothing new; tensors lent in
    one step never share bytes (two of one size are two tensors)."""
    from ulysses_train.levers.offload import PinnedPool

    monkeypatch.setattr(PinnedPool, "MIN_CHUNK", 1)  # a chunk per tensor: the first step fills its chunks exactly
    pool = PinnedPool(pin=False)
    shapes = [((3, 5), torch.bfloat16), ((640, 7), torch.float32), ((3, 5), torch.bfloat16)]
    first = [pool.take(shape, dtype) for shape, dtype in shapes]
    assert [(b.shape, b.dtype) for b in first] == shapes and _disjoint(first)
    held = pool.bytes
    pool.give_back_all()
    second = [pool.take(shape, dtype) for shape, dtype in shapes]
    assert pool.bytes == held  # nothing new
    assert [b.data_ptr() for b in second] == [b.data_ptr() for b in first]


def test_pinned_pool_holds_one_step_when_packed_shapes_change_every_step(monkeypatch):
    """Packed documents give kept attention outputs per document: their shapes change every step, their sum does
    not. The pool must hold about the largest step's bytes, not a step's worth more for every new packing (which
    exhausted the H200 host's 128 GiB at the third step of 131k-token SFT on Qwen3-4B)."""
    import random

    from ulysses_train.levers.offload import PinnedPool

    # small chunks, so that the first steps of this small test overflow the region
    monkeypatch.setattr(PinnedPool, "MIN_CHUNK", 1 << 16)
    rng, pool, seq, width, largest = random.Random(0), PinnedPool(pin=False), 4096, 64, 0
    for step in range(12):
        cuts = sorted(rng.sample(range(1, seq), 2))
        documents = [b - a for a, b in zip([0] + cuts, cuts + [seq])]
        lent = []
        for _layer in range(4):
            lent.append(pool.take((seq, width), torch.bfloat16))  # the layer's checkpoint
            for n in documents:  # kept attention output and log-sum-exp, per document
                lent += [pool.take((n, width), torch.bfloat16), pool.take((4, n), torch.float32)]
        for i, t in enumerate(lent):
            t.fill_(i)
        assert all(bool((t == i).all()) for i, t in enumerate(lent)) and _disjoint(lent)
        largest = max(largest, sum(-(-t.numel() * t.element_size() // pool.ALIGN) * pool.ALIGN for t in lent))
        pool.give_back_all()
        assert pool.bytes <= largest * pool.MARGIN + pool.ALIGN, (step, pool.bytes, largest)


@pytest.mark.slow
@pytest.mark.parametrize("sp", [1, 2])
def test_fa4_op_outputs_are_kept_offloaded_and_exact(sp):
    """FlashAttention-4 runs through our registered ops (ulysses_train/sp/fa4_op.py) so that selective checkpointing
    keeps its outputs: with kept attention the op runs once per layer, the kept outputs go to the host with the
    offload, and loss and gradients equal SDPA's without checkpointing. The kernels themselves are swapped for an
    exact reference here (no GPU); tests/gpu/test_gpu.py runs the real ones."""
    layers = tiny_config("qwen3").num_hidden_layers
    variants = ((False, False, 2 * layers), (True, False, layers), (True, True, layers), (False, True, 2 * layers))
    (base_loss, base_grads, _, _), *results = _run_all(sp, [(False, "plain", False)] + [
        (keep, "fused", True, False, offload, True, "flash_attn_4") for keep, offload, _ in variants])
    offloaded = {}
    for (keep, offload, expected_calls), result in zip(variants, results):
        loss, grads, calls, offloaded[keep, offload] = result
        assert calls == expected_calls, (keep, offload)
        assert loss == pytest.approx(base_loss, rel=1e-6)
        for name, ref in base_grads.items():
            torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    attention_out = SEQ * tiny_config("qwen3").num_attention_heads // sp * tiny_config("qwen3").head_dim * 4
    assert offloaded[True, True] >= offloaded[False, True] + layers * attention_out


def test_fa4_packed_documents_run_in_one_varlen_call_as_sdpa_per_document(monkeypatch):
    """Packed documents go to FA4 in one varlen call per layer (its kept outputs then have one shape whatever the
    packing), and equal SDPA run document by document: outputs and gradients, GQA, two rows packed differently.
    The kernels are the exact reference here (no GPU); tests/gpu/test_gpu.py runs the real ones."""
    from ulysses_train.sp import fa4_op
    from ulysses_train.sp.kernels import KERNELS

    monkeypatch.setattr(fa4_op, "IMPL", dict(fa4_op.REFERENCE_IMPL))
    calls = []
    forward = fa4_op.IMPL["varlen_forward"]
    fa4_op.IMPL["varlen_forward"] = lambda *args: calls.append(args[3].tolist()) or forward(*args)
    g = torch.Generator().manual_seed(0)
    docs = [[5, 11, 8], [24]]
    q, k, v = (torch.randn(2, h, 24, 16, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    dout = torch.randn(2, 24, 4, 16, generator=g, dtype=torch.float64)
    results = []
    for kernel in ("flash_attn_4", "sdpa"):
        out = KERNELS[kernel](q, k, v, 0.3, docs)  # (b, s, h, d)
        results.append((out.detach(), *torch.autograd.grad(out, (q, k, v), dout)))
    assert calls == [[0, 5, 16, 24, 48]]
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)


def test_fa4_reference_matches_sdpa():
    """The reference the op test runs is itself checked: outputs and gradients against SDPA with GQA, fp64."""
    from ulysses_train.sp.fa4_op import reference_backward, reference_forward

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 24, h, 16, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    dout = torch.randn(2, 24, 4, 16, generator=g, dtype=torch.float64)
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           is_causal=True, scale=0.3, enable_gqa=True).transpose(1, 2)
    ref.backward(dout)
    with torch.no_grad():
        out, lse = reference_forward(q, k, v, 0.3)
        grads = reference_backward(dout, q, k, v, out, lse, 0.3)
    torch.testing.assert_close(out, ref)
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("case, faster", [
    (dict(), True),  # Qwen3.5's attention layers (and Gemma 3's global ones) on an H100 or H200
    (dict(head_dim=128, head_dim_v=128), False),  # FA4's own backward is the faster one at 128
    (dict(window_left=1023), False),  # a window: FA4 skips the blocks outside it, cuDNN's SDPA does not
    (dict(softcap=50.0), False),
    (dict(has_sink=True), False),
    (dict(causal=False), False),  # a ring's off-diagonal block: not measured
    (dict(capability=(10, 0)), False),  # Blackwell: FA4 has a head_dim-256 backward kernel of its own
])
def test_the_fa4_op_takes_cudnns_backward_only_where_it_is_faster(case, faster):
    from ulysses_train.sp.fa4_op import cudnn_backward_is_faster

    args = dict(head_dim=256, head_dim_v=256, causal=True, window_left=-1, softcap=0.0, has_sink=False,
                capability=(9, 0))
    assert cudnn_backward_is_faster(**{**args, **case}) is faster
