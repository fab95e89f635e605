"""GPU checks (marked gpu, skipped without CUDA): the kernels, the levers and SP over NCCL.

Tolerances: fp32 runs compare at 1e-5 as on CPU (TF32 is off for these checks); bf16 runs compare the sharded bf16
result with the unsharded bf16 result of the same kernel (same per-head arithmetic: tight, 2e-2 absolute on O(1)
values covers kernel tiling differences across sequence lengths) and with an fp32 reference at ~1e-2 relative norm
(bf16 has 8 mantissa bits)."""

import re

import pytest
import torch

from tests.multiprocess import run_distributed
from tests.references import causal_attention

pytestmark = pytest.mark.gpu
B, S, D = 1, 4096, 128


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("kernel", ["sdpa", "flash_attn", "flash_attn_4"])
def test_kernel_bf16_matches_fp32_reference(kernel):
    from ulysses_train.sp.attention import UlyssesAttention
    from ulysses_train.sp.kernels import kernel_available

    if not kernel_available(kernel):
        pytest.skip(f"{kernel} not installed")
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, h, S, D, device="cuda", generator=g) for h in (32, 8, 8))
    ref = causal_attention(q.double(), k.double(), v.double())
    out, _ = UlyssesAttention(None, kernel)(None, *(t.bfloat16() for t in (q, k, v)), None, scaling=D ** -0.5)
    assert _rel(out, ref) < 1e-2


def test_offload_and_kept_attention_are_exact_on_gpu():
    from transformers import AutoModelForCausalLM

    from tests.models import tiny_config
    from ulysses_train.levers.loss import CausalLMWithSPLoss, global_token_count
    from ulysses_train.levers.offload import HostOffload
    from ulysses_train.model.surgery import enable_checkpointing, install_loss_head
    from ulysses_train.sp.attention import register_ulysses_attention
    from ulysses_train.sp.sharding import shard_sequence

    torch.backends.cuda.matmul.allow_tf32 = False
    register_ulysses_attention(None, "sdpa")
    ids = torch.randint(3, 96, (1, 2048), generator=torch.Generator().manual_seed(0))
    results, host_bytes = {}, {}
    for name, keep, offload in (("plain", False, False), ("keep", True, False), ("offload", False, True),
                                ("both", True, True)):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("qwen3"), attn_implementation="ulysses").cuda().train()
        hooks = HostOffload(min_bytes=0) if offload else None
        enable_checkpointing(model, keep, hooks)
        install_loss_head(model)
        batch = {k: v.cuda() for k, v in shard_sequence(ids, 1, 0).items()}
        loss = CausalLMWithSPLoss(model)(batch["input_ids"], batch["position_ids"], batch["labels"],
                                         global_token_count(batch["labels"], None))
        loss.backward()
        if offload:
            assert hooks.host_bytes > 0  # the layer inputs really went to the host
            host_bytes[name] = hooks.host_bytes
        results[name] = (loss.item(), {n: p.grad.cpu() for n, p in model.named_parameters()})
    # with kept attention, its outputs went to the host too: (b, s, heads, head_dim) per layer, at least
    kept_out = 2 * 2048 * tiny_config("qwen3").num_attention_heads * tiny_config("qwen3").head_dim * 4
    assert host_bytes["both"] >= host_bytes["offload"] + kept_out
    base_loss, base_grads = results.pop("plain")
    for name, (loss, grads) in results.items():
        assert loss == base_loss, name
        for n, g in grads.items():
            torch.testing.assert_close(g, base_grads[n], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name} {n}: {m}")


def test_kept_projections_are_exact_and_offloaded_on_gpu():
    """`--keep_projections` on the GPU, bf16, with kept attention and the host offload (its side streams and pinned
    copies): the loss is the plain recompute's bit for bit, every gradient within bf16 noise, and the host holds
    the kept q, k, v outputs beside the layer inputs (tests/unit/test_projections.py checks the counts on CPU)."""
    from transformers import AutoModelForCausalLM

    from tests.models import tiny_config
    from ulysses_train.levers.loss import CausalLMWithSPLoss, global_token_count
    from ulysses_train.levers.offload import HostOffload
    from ulysses_train.model.surgery import enable_checkpointing, install_loss_head
    from ulysses_train.sp.attention import register_ulysses_attention
    from ulysses_train.sp.sharding import shard_sequence

    register_ulysses_attention(None, "sdpa")
    config = tiny_config("qwen3")
    ids = torch.randint(3, 96, (1, 2048), generator=torch.Generator().manual_seed(0))
    results, host_bytes = {}, {}
    for kept in (0, config.num_hidden_layers):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="ulysses", dtype=torch.bfloat16)
        model = model.cuda().train()
        hooks = HostOffload(min_bytes=0)
        enable_checkpointing(model, True, hooks, keep_projections=kept)
        install_loss_head(model)
        batch = {k: v.cuda() for k, v in shard_sequence(ids, 1, 0).items()}
        loss = CausalLMWithSPLoss(model)(batch["input_ids"], batch["position_ids"], batch["labels"],
                                         global_token_count(batch["labels"], None))
        loss.backward()
        host_bytes[kept] = hooks.host_bytes
        results[kept] = (loss.item(), {n: p.grad.float().cpu() for n, p in model.named_parameters()})
    widths = config.num_attention_heads * config.head_dim + 2 * config.num_key_value_heads * config.head_dim
    assert host_bytes[config.num_hidden_layers] - host_bytes[0] == config.num_hidden_layers * 2048 * widths * 2
    (base_loss, base), (loss, grads) = results[0], results[config.num_hidden_layers]
    assert loss == base_loss
    for name, grad in grads.items():
        assert _rel(grad, base[name]) < 1e-2, name


def _nccl_attention(rank, world, dtype_name, seed):
    import torch.distributed as dist

    from ulysses_train.sp.attention import UlyssesAttention

    dtype = getattr(torch, dtype_name)
    torch.backends.cuda.matmul.allow_tf32 = False
    group = dist.new_group(list(range(world)))
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, S, D, generator=g).to("cuda", dtype) for h in (32, 8, 8))
    grad_out = torch.randn(B, S, 32, D, generator=g).to("cuda", dtype)
    cut = slice(rank * S // world, (rank + 1) * S // world)
    ql, kl, vl = (t[:, :, cut].clone().requires_grad_() for t in (q, k, v))
    out, _ = UlyssesAttention(group, "sdpa")(None, ql, kl, vl, None, scaling=D ** -0.5)
    out.backward(grad_out[:, cut])
    return {n: t.detach().float().cpu() for n, t in (("out", out), ("dq", ql.grad), ("dk", kl.grad), ("dv", vl.grad))}


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_sp2_attention_over_nccl(dtype_name):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    results = run_distributed(_nccl_attention, 2, dtype_name, 7, backend="nccl")
    single = _nccl_single(dtype_name, 7)
    for name, dim in (("out", 1), ("dq", 2), ("dk", 2), ("dv", 2)):
        got = torch.cat([r[name] for r in results], dim=dim)
        if dtype_name == "float32":
            torch.testing.assert_close(got, single[name], rtol=1e-5, atol=1e-5)
        else:
            assert _rel(got, single[name]) < 1e-2, name


def _nccl_single(dtype_name, seed):
    """The same inputs on one GPU, whole sequence, same kernel and dtype."""
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, S, D, generator=g).to("cuda", dtype).requires_grad_() for h in (32, 8, 8))
    grad_out = torch.randn(B, S, 32, D, generator=g).to("cuda", dtype)
    from ulysses_train.sp.attention import UlyssesAttention

    out, _ = UlyssesAttention(None, "sdpa")(None, q, k, v, None, scaling=D ** -0.5)
    out.backward(grad_out)
    return {n: t.detach().float().cpu() for n, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))}


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_sp2_model_under_zero3_over_nccl(dtype_name):
    """The CPU model-equivalence test on 2 GPUs, with both loss kernels (ours, Liger's): tiny Qwen3, ZeRO-3, SP=2
    over NCCL against one process in fp32.
    fp32: 1e-5 as on CPU (TF32 stays off: torch's default for matmuls). bf16: every parameter's gradient within
    5e-2 relative norm of the fp32 reference (bf16 weights and activations, 8 mantissa bits, through 2 layers)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from tests.model_runs import sharded_run, transformers_reference

    _, _, ref_loss, ref_grads = transformers_reference("qwen3", 3, "fused")
    results = run_distributed(sharded_run, 2, "qwen3", 3, "fused", 3, True, False, dtype_name, False, ("ours", "liger"),
                              use_deepspeed=True, backend="nccl")
    for loss, grads in (by_kernel[kernel] for by_kernel in results for kernel in ("ours", "liger")):
        if dtype_name == "float32":
            assert loss == pytest.approx(ref_loss, rel=1e-5)
            for name, ref in ref_grads.items():
                torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        else:
            assert loss == pytest.approx(ref_loss, rel=2e-2)
            for name, ref in ref_grads.items():
                assert _rel(grads[name], ref) < 5e-2, name


def test_liger_loss_matches_ours_at_scale():
    """Liger's loss as the trainer calls it (the default on CUDA) against ours and the float64 plain loss of the same
    bf16 operands: 16,384 tokens, vocabulary 32,000, hidden 1,024, so Liger cuts 32 parts of 512 rows and ours 4
    chunks of 4,096. The self-check passes in both dtypes. Losses: both sum in fp32 from bf16 logits (1e-4, which
    also covers cuBLAS rounding a logit differently for another chunk shape); gradients: one bf16 rounding of the
    logits' gradient and of each matmul (1e-2 relative norm)."""
    from ulysses_train.levers.loss import (
        fused_linear_cross_entropy,
        liger_check,
        liger_linear_cross_entropy,
        plain_loss,
    )

    assert liger_check(torch.device("cuda"), torch.float32) is None
    assert liger_check(torch.device("cuda"), torch.bfloat16) is None
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(16384, 1024, device="cuda", generator=g).bfloat16()
    w = (torch.randn(32000, 1024, device="cuda", generator=g) * 0.02).bfloat16()
    y = torch.randint(0, 32000, (16384,), device="cuda", generator=g)
    y[:3000] = -100
    n = (y != -100).sum().float()
    out = {}
    for name, fn, dtype in (("liger", liger_linear_cross_entropy, torch.bfloat16),
                            ("ours", fused_linear_cross_entropy, torch.bfloat16),
                            ("plain", lambda h, w, y, n: plain_loss(h @ w.t(), y, n), torch.float64)):
        h1, w1 = h.to(dtype).clone().requires_grad_(), w.to(dtype).clone().requires_grad_()
        loss = fn(h1, w1, y, n.to(torch.promote_types(dtype, torch.float32)))
        loss.backward()
        out[name] = (loss.detach(), h1.grad, w1.grad)
    for ref in ("ours", "plain"):
        assert _rel(out["liger"][0], out[ref][0]) < 1e-4, ref
        assert _rel(out["liger"][1], out[ref][1]) < 1e-2, ref
        assert _rel(out["liger"][2], out[ref][2]) < 1e-2, ref


def test_profile_memory_on_cuda_writes_snapshot_and_picture(tmp_path):
    """--profile_memory on CUDA: PyTorch's allocator snapshot (for memory_viz) and our picture, with kept attention
    outputs and checkpoints offloaded (so neither should show as GPU checkpoints beyond small tensors)."""
    import json
    import os
    import pickle
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, os.path.join(root, "launch", "train.py"), "--steps", "2", "--seq_len",
                           "4096", "--profile_memory", "1", "--attn_recompute", "never", "--offload_activations",
                           "--output_dir", str(out)], capture_output=True, text=True, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    snapshot = pickle.loads((out / "memory" / "snapshot.pickle").read_bytes())
    assert snapshot["device_traces"] and any(snapshot["device_traces"])
    assert (out / "memory" / "memory.png").stat().st_size > 10_000
    peak = json.loads((out / "memory" / "memory.json").read_text())["peak_gib"]
    assert peak["model states"] > 0 and peak["gradients"] > 0 and peak["recomputed layer"] > 0


def test_pinned_pool_unregisters_its_memory_when_released():
    """Buffers registered with cudaHostRegister are unregistered before they can be freed, by `release` or when the
    pool is collected: memory freed while still registered made later host-to-GPU copies at the same addresses fail
    ("invalid argument") in this test process. A view kept past the pool holds its memory alive, so whether CUDA still
    counts it as pinned shows the registration (is_pinned asks cudaPointerGetAttributes)."""
    import gc

    from ulysses_train.levers.offload import PinnedPool

    for explicit in (True, False):
        pool = PinnedPool(pin=True)
        buf = pool.take((1 << 22,), torch.bfloat16)
        assert buf.is_pinned() and len(pool.registered) == 1
        gpu = torch.ones_like(buf, device="cuda")
        buf.copy_(gpu, non_blocking=True)  # a copy in flight when the pool goes
        if explicit:
            pool.release()
            assert pool.registered == [] and pool.bytes == 0
        del pool
        gc.collect()
        assert not buf.is_pinned(), explicit
        assert torch.equal(buf.cuda(), gpu)  # the finished copy, read back from pageable memory
    for _ in range(4):  # fresh host tensors of that size, likely at the addresses just freed, copy as usual
        host = torch.ones(1 << 22, dtype=torch.bfloat16)
        assert torch.equal(host.cuda(), gpu)


def _train_on_cuda(out, *flags):
    import sys

    from tests.trainer_runs import metrics, run

    # 4 steps at lr 3e-3 (the e2e tests' common flags), 4096 tokens, bf16 optimizer states
    proc = run([sys.executable], ["--seq_len", "4096", "--ds_config", "ds_configs/zero3_bf16_states.json", *flags],
               out)
    return proc.stdout + proc.stderr, metrics(out)


def test_pinned_pool_and_shared_master_train_as_the_plain_run(tmp_path):
    """The real trainer on CUDA, 4 steps: the offload into our reused pinned buffers (checkpoints and kept
    attention outputs) and the master weights sharing the model's partition, against a run with neither. Losses
    after step 1 and the gradient norms depend on every backward, so a buffer handed back too early or a master
    copy out of step would show; cuDNN's backward is not bitwise deterministic, hence 1e-2 relative (bf16)."""
    plain_log, plain = _train_on_cuda(tmp_path / "plain", "--share_master_weights", "false",
                                      "--attn_recompute", "always")
    levers_log, levers = _train_on_cuda(tmp_path / "levers", "--offload_activations", "--attn_recompute", "never")
    assert "master weights share" in levers_log and "master weights share" not in plain_log
    assert levers[-1]["host_offload_gib"] > 0
    for a, b in zip(plain, levers, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-2), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-2), (a, b)
    assert levers[-1]["loss"] < levers[0]["loss"]  # it trains


def test_fa4_outputs_are_kept_and_offloaded_on_gpu():
    """FlashAttention-4 through our registered op: with kept outputs (offloaded) the kernel runs once per layer, the
    loss is the recompute run's bit for bit (same forward kernels) and the gradients agree within bf16 noise (FA4's
    backward accumulates dq with atomics, so two runs differ in the last bits)."""
    from ulysses_train.sp.kernels import kernel_available

    if not kernel_available("flash_attn_4"):
        pytest.skip("flash_attn_4 not installed")
    from transformers import AutoModelForCausalLM

    from tests.attention_calls import CountAttention
    from tests.models import tiny_config
    from ulysses_train.levers.loss import CausalLMWithSPLoss, global_token_count
    from ulysses_train.levers.offload import HostOffload
    from ulysses_train.model.surgery import enable_checkpointing, install_loss_head
    from ulysses_train.sp.attention import register_ulysses_attention
    from ulysses_train.sp.sharding import shard_sequence

    config = tiny_config("qwen3")
    config.head_dim, config.hidden_size, config.num_attention_heads, config.num_key_value_heads = 128, 256, 4, 2
    register_ulysses_attention(None, "flash_attn_4")
    ids = torch.randint(3, 96, (1, 4096), generator=torch.Generator().manual_seed(0))
    results = {}
    for keep in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="ulysses", dtype=torch.bfloat16)
        model = model.cuda().train()
        hooks = HostOffload(min_bytes=0) if keep else None
        enable_checkpointing(model, keep, hooks)
        install_loss_head(model)
        batch = {k: v.cuda() for k, v in shard_sequence(ids, 1, 0).items()}
        with CountAttention() as counter:
            loss = CausalLMWithSPLoss(model)(batch["input_ids"], batch["position_ids"], batch["labels"],
                                             global_token_count(batch["labels"], None))
            loss.backward()
        assert counter.calls == (1 if keep else 2) * config.num_hidden_layers
        results[keep] = (loss.item(), {n: p.grad.float().cpu() for n, p in model.named_parameters()})
    assert results[True][0] == results[False][0]
    for name, grad in results[True][1].items():
        assert _rel(grad, results[False][1][name]) < 1e-2, name


def test_fa4_op_at_head_dim_256_matches_fp64_with_the_faster_backward(monkeypatch):
    """Our FA4 op at Qwen3.5's attention heads (16 query, 4 KV, head_dim 256), bf16, 4k tokens: the output and every
    gradient within bf16 noise of an fp64 reference. On Hopper the backward is cuDNN's from FA4's forward outputs
    (sp/fa4_op.py, `cudnn_backward_is_faster`), so this is where that pairing is checked: a log-sum-exp read in the
    wrong base or layout is off by order one."""
    from ulysses_train.sp import fa4_op
    from ulysses_train.sp.kernels import KERNELS, kernel_available

    if not kernel_available("flash_attn_4"):
        pytest.skip("flash_attn_4 not installed")
    calls, cudnn = [], fa4_op._cudnn_backward
    monkeypatch.setattr(fa4_op, "_cudnn_backward", lambda *args: calls.append(1) or cudnn(*args))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, S, 256, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
               for h in (16, 4, 4))
    dout = torch.randn(1, S, 16, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    out = KERNELS["flash_attn_4"](q, k, v, 256 ** -0.5)
    got = (out, *torch.autograd.grad(out, (q, k, v), dout))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = causal_attention(*leaves)
    want = (ref, *torch.autograd.grad(ref, leaves, dout.double()))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert _rel(a, b) < 1e-2, name
    assert len(calls) == int(torch.cuda.get_device_capability() == (9, 0))


def test_fa4_varlen_equals_sdpa_per_document_on_gpu():
    """Packed documents through FA4's varlen kernel (one call) against cuDNN/SDPA run document by document, bf16:
    outputs and gradients within bf16 noise, on two rows packed differently with GQA."""
    from ulysses_train.sp.kernels import KERNELS, kernel_available

    if not kernel_available("flash_attn_4"):
        pytest.skip("flash_attn_4 not installed")
    g = torch.Generator(device="cuda").manual_seed(0)
    docs = [[1000, 2500, 596], [4096]]
    q, k, v = (torch.randn(2, h, S, D, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
               for h in (32, 8, 8))
    dout = torch.randn(2, S, 32, D, device="cuda", generator=g, dtype=torch.bfloat16)
    results = {}
    for kernel in ("flash_attn_4", "sdpa"):
        out = KERNELS[kernel](q, k, v, D ** -0.5, docs)
        results[kernel] = (out, *torch.autograd.grad(out, (q, k, v), dout))
    for got, want in zip(results["flash_attn_4"], results["sdpa"]):
        assert _rel(got, want) < 1e-2


def test_fused_kernels_train_as_transformers_ops(tmp_path):
    """The real trainer on CUDA, 4 steps, with our Triton norms, rotary and SwiGLU (the default `auto` there) against
    transformers' ops with the lean norm: the log names the kernels, and losses and gradient norms agree to bf16
    (1e-2 relative, as cuDNN's backward is not bitwise deterministic either). tests/unit/test_fused_kernels.py checks
    the kernels one by one on this GPU."""
    fused_log, fused = _train_on_cuda(tmp_path / "fused", "--offload_activations")
    plain_log, plain = _train_on_cuda(tmp_path / "plain", "--offload_activations", "--fused_kernels", "off")
    found = re.search(r"fused kernels: (\d+) norms, (\d+) rotary, (\d+) gated MLP", fused_log)
    norms, rotary, mlps = map(int, found.groups())
    assert rotary > 0 and norms == 4 * rotary + 1 and mlps == rotary  # Qwen3: 4 norms per layer and the final one
    assert "fused kernels: off" in plain_log
    for a, b in zip(plain, fused, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-2), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-2), (a, b)
    assert fused[-1]["loss"] < fused[0]["loss"]


@pytest.mark.parametrize("ds_config", ["zero3.json", "zero2.json"])
def test_first_step_in_bf16_is_as_exact_as_transformers(tmp_path, ds_config):
    """The trainer's first step on CUDA in bf16 with every lever at its default (FA4 where installed, the fused
    kernels, kept attention), on a Qwen3-4B-shaped model cut to 4 layers at 8,192 tokens, against plain
    transformers on the same weights and tokens (`--verify`): each error from the fp32 reference is within 2x of
    transformers' own bf16 error, and the buffers (rotary frequencies) equal plain transformers' bit for bit. Under
    ZeRO-3 with transformers 5.17 the rotary frequencies used to end in bf16 (25x transformers' loss error)."""
    import json
    import sys

    from tests.trainer_runs import run

    proc = run([sys.executable], ["--verify", "--model_config", "qwen3-4b", "--num_layers", "4", "--seq_len", "8192",
                                  "--verify_seq_len", "8192",
                                  "--ds_config", f"ds_configs/{ds_config}", "--offload_activations"], tmp_path,
               expect_ok=False)
    result = json.loads((tmp_path / "verify" / "verify.json").read_text())
    assert proc.returncode == (0 if result["passed"] else 1)
    assert result["dtype"] == "bfloat16" and not result["buffer_mismatches"], result
    assert result["passed"], proc.stdout[-3000:]


@pytest.mark.parametrize("kernel", ["sdpa", "flash_attn", "flash_attn_4"])
@pytest.mark.parametrize("ring", [2, 4])
def test_ring_blocks_bf16_match_fp64_reference(kernel, ring):
    """The ring's block kernels on the GPU (cuDNN, FA2, FA4: forward with the log-sum-exp, backward from the merged
    output), every rank in one process, packed documents in the second row: against fp64 masked attention."""
    from benchmarks.ring_bench import ring_in_one_process
    from tests.references import doc_ids, masked_attention_with_grads
    from ulysses_train.sp.block_kernels import block_kernel
    from ulysses_train.sp.kernels import kernel_available

    if not kernel_available(kernel):
        pytest.skip(f"{kernel} not installed")
    g = torch.Generator().manual_seed(ring)
    q, k, v, dout = (torch.randn(2, S, h, D, generator=g) for h in (32, 8, 8, 32))
    docs = [[S], [1000, 96, S - 1096]]
    want = [t.cpu() for t in masked_attention_with_grads(*(t.cuda().double() for t in (q, k, v, dout)), docs,
                                                         D ** -0.5)]
    got_out, got_grads = ring_in_one_process(*(t.to("cuda", torch.bfloat16) for t in (q, k, v)), ring, D ** -0.5,
                                             block_kernel(kernel, torch.device("cuda"), torch.bfloat16),
                                             doc_ids(docs), dout.to("cuda", torch.bfloat16))
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (got_out, *got_grads), want):
        assert _rel(got.cpu(), ref) < 2e-2, name


def _nccl_ring(rank, world, kernel, seed):
    from ulysses_train.sp.attention import UlyssesAttention
    from ulysses_train.sp.groups import SequenceParallelGroups
    from ulysses_train.sp.sharding import shard_order

    groups = SequenceParallelGroups(world, world)  # a pure ring
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(B, S, h, D, generator=g).to("cuda", torch.bfloat16) for h in (32, 8, 8, 32))
    mine = shard_order(S, world)[rank * S // world:(rank + 1) * S // world].cuda()
    ql, kl, vl = (t[:, mine].transpose(1, 2).clone().requires_grad_() for t in (q, k, v))
    out, _ = UlyssesAttention(groups.ulysses_group, kernel, groups.ring_group)(None, ql, kl, vl, None,
                                                                               scaling=D ** -0.5)
    out.backward(dout[:, mine])
    return {"rows": mine.cpu(), **{n: t.detach().float().cpu() for n, t in (
        ("out", out), ("dq", ql.grad.transpose(1, 2)), ("dk", kl.grad.transpose(1, 2)),
        ("dv", vl.grad.transpose(1, 2)))}}


@pytest.mark.parametrize("kernel", ["sdpa", "flash_attn_4"])
def test_ring_over_nccl_matches_fp64_reference(kernel):
    """A ring of 2 GPUs (K/V blocks and dK/dV over NCCL point-to-point) in bf16: every rank's shard of the output
    and of dq, dk, dv against fp64 attention over the whole sequence."""
    from tests.references import masked_attention_with_grads
    from ulysses_train.sp.kernels import kernel_available

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    if not kernel_available(kernel):
        pytest.skip(f"{kernel} not installed")
    results = run_distributed(_nccl_ring, 2, kernel, 11, backend="nccl")
    g = torch.Generator().manual_seed(11)
    q, k, v, dout = (torch.randn(B, S, h, D, generator=g).cuda().bfloat16().double() for h in (32, 8, 8, 32))
    want = [t.cpu() for t in masked_attention_with_grads(q, k, v, dout, None, D ** -0.5)]
    for r in results:
        for name, ref in zip(("out", "dq", "dk", "dv"), want):
            assert _rel(r[name], ref[:, r["rows"]]) < 2e-2, name


@pytest.mark.parametrize("kernel", ["sdpa", "flash_attn", "flash_attn_4"])
@pytest.mark.parametrize("case", [dict(window=1024), dict(sinks=True), dict(window=128, sinks=True),
                                  dict(softcap=50.0), dict(softcap=50.0, window=1024)], ids=lambda c: "+".join(c))
def test_patterns_in_bf16_match_fp64_on_gpu(kernel, case):
    """Windows, sinks and softcaps in each kernel that takes them (sp/support.py says which), bf16 against plain
    attention in fp64, packed into two documents: the output and every gradient within bf16's error."""
    from tests.references import pattern_attention
    from ulysses_train.sp.kernels import KERNELS, kernel_available
    from ulysses_train.sp.patterns import Pattern

    if not kernel_available(kernel):
        pytest.skip(f"{kernel} not installed")
    if (kernel == "flash_attn" and case.get("sinks")) or (kernel == "sdpa" and case.get("softcap")):
        pytest.skip("refused by the support check for this kernel on CUDA")
    s, h, kv, d, docs = 4096, 8, 2, 128, [1536, 2560]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, h, s, d, device="cuda", generator=g)
    k, v = (torch.randn(1, kv, s, d, device="cuda", generator=g) for _ in range(2))
    sinks = torch.randn(h, device="cuda", generator=g) if case.get("sinks") else None
    dout = torch.randn(1, s, h, d, device="cuda", generator=g)
    results = []
    for dtype in (torch.float64, torch.bfloat16):
        inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)] + (
            [sinks.float().requires_grad_()] if sinks is not None else [])
        sink = inputs[3] if sinks is not None else None
        if dtype == torch.float64:
            out = pattern_attention(*inputs[:3], docs, case.get("window"), case.get("softcap"), sink.double()
                                    if sink is not None else None, d ** -0.5)
        else:
            out = KERNELS[kernel](*inputs[:3], d ** -0.5, [docs], Pattern(case.get("window"), case.get("softcap"),
                                                                          sink))
        results.append((out, torch.autograd.grad(out, inputs, dout.to(dtype))))
    (want, want_grads), (got, got_grads) = results
    assert _rel(got, want) < 1e-2
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got_grads, want_grads):
        assert _rel(a, b) < 2e-2, name


@pytest.mark.parametrize("window", [None, 128])
def test_sdpa_sinks_hold_no_scores_at_gpt_oss_shapes(window):
    """GPT-OSS's heads (64 query, 8 KV, 64 dims) with sinks at 8,192 tokens through SDPA in bf16: forward and
    backward stay within 1 GiB of the inputs (the math fallback held 16 GiB of fp32 scores a full layer)."""
    from ulysses_train.sp.kernels import KERNELS
    from ulysses_train.sp.patterns import Pattern

    s, h, kv, d = 8192, 64, 8, 64
    q = torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, kv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    sinks = torch.randn(h, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = KERNELS["sdpa"](q, k, v, d ** -0.5, None, Pattern(window=window, sinks=sinks))
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    held = (torch.cuda.max_memory_allocated() - before) / 2 ** 30
    assert held < 1.0, f"{held:.2f} GiB"
    assert torch.isfinite(sinks.grad).all() and torch.isfinite(q.grad).all()
