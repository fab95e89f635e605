"""Ring attention and the hybrid Ulysses x ring (ulysses_train/sp/ring.py): exact against one process.

In fp64 on CPU, so that any error of indexing, masking or merging (O(1)) stands out from rounding (1e-15); the
references are plain SDPA over the whole sequence with a causal (and, packed, same-document) mask
(tests/references.py), computed in the same test. The ring's arithmetic is checked in one process first (every rank
in turn, benchmarks/ring_bench.py's `ring_in_one_process`), then through real process groups (gloo) for (ulysses,
ring) in {(1,2), (2,2), (1,4)} in one launch of 4 processes and {(2,4), (4,2)} in one launch of 8 (the cases of
tests/ring_cases.py): outputs and dq/dk/dv of every rank's shard, GQA with KV heads split or replicated inside the
Ulysses part, packed documents, and the FA4 block path (its kernels swapped for their exact reference, as in
tests/unit/test_levers.py)."""

import pytest
import torch

from benchmarks.ring_bench import ring_in_one_process
from tests.multiprocess import run_distributed
from tests.references import doc_ids, masked_attention_with_grads
from tests.ring_cases import CASES_4, CASES_8, DTYPE, PACKED, inputs, run_cases
from ulysses_train.sp.block_kernels import REFERENCE, block_kernel
from ulysses_train.sp.ring import step_tiles
from ulysses_train.sp.sharding import block_positions, shard_order, shard_sequence

TOL = dict(rtol=1e-10, atol=1e-12)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: threads only add waiting (10 s instead of 0.2 s on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- one process


def test_ring_arithmetic_in_one_process():
    """Every rank of a zigzag ring in turn (tiles, LSE merge, backward from the merged output, dK/dV summed per
    block) equals one causal call: R = 2, 3, 4, MHA and GQA, packed or not, through ATen's CPU flash kernel and
    the plain-ops reference (what FA4's path runs on CPU)."""
    for ring in (2, 3, 4):
        s = 8 * ring * 2
        for (hq, hkv), docs in (((4, 4), None), ((4, 2), None), ((4, 1), [[3, s - 10, 7], [s]])):
            q, k, v, dout = inputs(ring * 10 + hkv, hq, hkv, s)
            want = masked_attention_with_grads(q, k, v, dout, docs)
            ids = None if docs is None else doc_ids(docs)
            for kernel in (block_kernel("sdpa", q.device, DTYPE), REFERENCE):
                out, grads = ring_in_one_process(q, k, v, ring, 0.3, kernel, ids, dout)
                for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), want):
                    torch.testing.assert_close(got, ref, **TOL, msg=lambda m: f"R={ring} {hq}/{hkv} {name}: {m}")


def test_ring_bench_runs_on_cpu_and_checks_itself(tmp_path, capsys):
    """benchmarks/ring_bench.py at a tiny size on the CPU: a row per ring size, each checked against one call."""
    import json

    from benchmarks.ring_bench import main

    out = tmp_path / "bench.json"
    assert main(["--device", "cpu", "--seq", "64", "--rings", "2", "4", "--heads", "4", "--kv_heads", "2",
                 "--head_dim", "8", "--dtype", "fp32", "--check_seq", "32", "--warmup", "0", "--reps", "1",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kernel"], r["ring"]) for r in rows] == [("sdpa", 1), ("sdpa", 2), ("sdpa", 4)]
    assert all(r["rel_error"] < 1e-5 and r["seconds"] > 0 for r in rows)
    assert capsys.readouterr().out.splitlines()[-1].startswith("sdpa")  # the table comes last


def test_zigzag_gives_every_rank_the_same_work_at_every_step():
    """Causal balance: at each step every rank computes the same number of query-key products (a ring without the
    zigzag would leave rank 0 idle after step 0 and rank R-1 busy at every step)."""
    for ring in (2, 4, 8):
        chunk = 5
        for step in range(ring):
            work = set()
            for me in range(ring):
                tiles = step_tiles(me, (me - step) % ring, chunk)
                work.add(sum((t.q.stop - t.q.start) * (t.k.stop - t.k.start + (1 if t.causal else 0)) //
                             (2 if t.causal else 1) for t in tiles))
            assert len(work) == 1, (ring, step, work)


def test_shards_are_the_zigzag_chunks_with_their_labels_and_positions():
    """sp = ulysses x ring: the Ulysses ranks of ring rank i together hold chunks i and 2R-1-i, in that order
    (what the all-to-all gathers for the ring), with labels shifted on the whole sequence and global positions."""
    s, ids = 40, torch.arange(100, 140)[None]
    positions = torch.arange(s)[None] % 7  # packed documents restart their positions: carried as given
    for ulysses, ring in ((1, 2), (2, 2), (1, 4), (2, 4), (4, 2)):
        sp = ulysses * ring
        shards = [shard_sequence(ids, sp, r, position_ids=positions, ring_size=ring) for r in range(sp)]
        order = shard_order(shards[0]["input_ids"].shape[1] * sp, ring)
        assert sorted(order.tolist()) == list(range(len(order)))
        padded = len(order)
        for i in range(ring):
            gathered = torch.cat([shards[i * ulysses + u]["input_ids"] for u in range(ulysses)], dim=1)[0]
            pos = block_positions(i, ring, padded // (2 * ring))
            real = pos < s
            assert torch.equal(gathered[real], ids[0, pos[real]]) and (gathered[~real] == 0).all()
        labels = torch.cat([sh["labels"] for sh in shards], dim=1)[0]
        for j, p in enumerate(order.tolist()):
            assert labels[j] == (ids[0, p + 1] if p + 1 < s else -100)
        assert torch.equal(torch.cat([sh["position_ids"] for sh in shards], dim=1)[0, order < s],
                           positions[0, order[order < s]])


# ---------------------------------------------------------------- process groups


def _check_attention(per_rank, cases):
    for c, (sp, ring, hq, hkv, packed, kernel, seed) in enumerate(cases):
        want = masked_attention_with_grads(*inputs(seed, hq, hkv), PACKED if packed else None)
        ulysses = sp // ring
        for rank, results in enumerate(per_rank):
            got = results[c]
            first = rank // sp * sp
            assert got["ulysses"] == list(range(rank // ulysses * ulysses, rank // ulysses * ulysses + ulysses))
            assert got["ring"] == list(range(first + rank % ulysses, first + sp, ulysses))
            for name, ref in zip(("out", "dq", "dk", "dv"), want):
                torch.testing.assert_close(got[name], ref[:, got["rows"]], **TOL,
                                           msg=lambda m: f"{cases[c]} rank {rank} {name}: {m}")


# ---------------------------------------------------------------- the model under ZeRO-3, every lever on

MODEL_SEQ = 64
MODEL_DOCS = [9, 30, 25]  # packed documents of the model case


def _model_batch(family, seed, packed):
    from ulysses_train.data.sources import build_batch

    ids = torch.randint(3, 96, (MODEL_SEQ,), generator=torch.Generator().manual_seed(seed))
    return build_batch([(ids, MODEL_SEQ, MODEL_DOCS if packed else None)], packing=packed)


def _model_reference(family, seed, packed):
    """Plain transformers (SDPA, its own loss), fp32: the whole sequence, or each document alone. Returns the
    initial weights, the loss (mean over every target) and every parameter's gradient."""
    from transformers import AutoModelForCausalLM

    from tests.models import tiny_config

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family), attn_implementation="sdpa")
    ids = _model_batch(family, seed, packed)["input_ids"]
    pieces = torch.split(ids, MODEL_DOCS, dim=1) if packed else [ids]
    targets = sum(p.shape[1] - 1 for p in pieces)
    loss = sum(model(input_ids=p, labels=p).loss * (p.shape[1] - 1) for p in pieces) / targets
    loss.backward()
    return model.state_dict(), loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _model_case(rank, world, family, sp, ring, packed, seed):
    """One step of the model with every lever the CPU runs (fused loss, checkpointing with kept attention and the
    host offload, tiled MLP, lean norms, our Triton kernels) under ZeRO-3 on Ulysses x ring; returns the SP group's
    loss, every full gradient, and how often the ring's forward ran."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from tests.models import tiny_config
    from ulysses_train.levers.loss import CausalLMWithSPLoss, global_token_count, sp_backward_scale
    from ulysses_train.levers.offload import HostOffload
    from ulysses_train.levers.policy import LeverRequest, Levers
    from ulysses_train.model.surgery import apply_levers
    from ulysses_train.sp.attention import register_ulysses_attention
    from ulysses_train.sp.groups import SequenceParallelGroups

    state, _, _ = _model_reference(family, seed, packed)
    groups = SequenceParallelGroups(sp, ring)
    attention = register_ulysses_attention(groups.ulysses_group, "sdpa", groups.ring_group)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "sequence_parallel_size": sp,
          "zero_optimization": {"stage": 3}, "steps_per_print": 10**9}
    hf_ds = HfDeepSpeedConfig(ds)  # noqa: F841  (kept alive for zero.Init)
    model = AutoModelForCausalLM.from_config(tiny_config(family), attn_implementation="ulysses")
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            if rank == 0:
                param.data.copy_(state[name])
    levers = Levers(loss="fused", checkpointing=True, keep_attention=True, offload_activations=True, tiled_mlp=True,
                    lean_norm=True, fused_kernels=True)
    levers, report = apply_levers(model, levers, LeverRequest(fused_kernels="on", tiled_mlp="on", lean_norm="on"),
                                  torch.device("cpu"), torch.float32, 7, 6, HostOffload(min_bytes=0))
    assert levers.fused_kernels and all(done == expected for done, expected in report.counts.values()), report
    wrapped = CausalLMWithSPLoss(model)
    engine, *_ = deepspeed.initialize(model=wrapped, optimizer=torch.optim.AdamW(wrapped.parameters(), lr=0.0),
                                      config=ds, mpu=groups)
    batch = _model_batch(family, seed, packed)
    shard = shard_sequence(batch["input_ids"], sp, groups.sp_rank, labels=batch["labels"],
                           position_ids=batch["position_ids"], ring_size=ring)
    attention.doc_lengths = batch["docs"]
    with CountRing() as counter:
        loss = engine(shard["input_ids"], shard["position_ids"], shard["labels"],
                      global_token_count(shard["labels"], groups.sp_group))
        engine.backward(loss * sp_backward_scale(ds, sp))
    grads = {n.removeprefix("model."): safe_get_full_grad(p).float() for n, p in engine.module.named_parameters()}
    total = loss.detach().clone()
    torch.distributed.all_reduce(total, group=groups.sp_group)
    return total.item(), grads, counter.calls


class CountRing:
    """Counts the ring's forward op at the dispatcher (the recompute must not run it when outputs are kept)."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.calls += "ring_fwd" in str(func)
                return func(*args, **(kwargs or {}))

        self.calls, self.mode = 0, Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def _four_ranks(rank, world, attention_cases, model_case):
    return run_cases(rank, world, attention_cases), _model_case(rank, world, *model_case)


MODEL_CASE = ("qwen3", 4, 2, True, 21)  # family, sp, ring, packed, seed


def test_hybrid_attention_and_model_on_4_ranks_match_one_process():
    """Attention: (ulysses, ring) = (1, 2) on each half of the world, (2, 2) and (1, 4); GQA, MQA replicated
    over the Ulysses pair, packing, FA4's block path. Model: a packed batch at (2, 2) under ZeRO-3 with every
    lever gives the loss and every gradient of plain transformers run on each document alone."""
    per_rank = run_distributed(_four_ranks, 4, CASES_4, MODEL_CASE, use_deepspeed=True)
    _check_attention([r[0] for r in per_rank], CASES_4)
    _, ref_loss, ref_grads = _model_reference(MODEL_CASE[0], MODEL_CASE[-1], MODEL_CASE[3])
    layers = 2
    for loss, grads, ring_calls in (r[1] for r in per_rank):
        assert ring_calls == layers  # kept outputs: the checkpoint's recompute did not run the ring again
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert grads.keys() == ref_grads.keys()
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------- 8 ranks: the trainer, and the attention


def _qwen2_28_heads(folder):
    """Qwen2.5-7B's head layout (28 query heads, 4 KV heads) at tiny widths."""
    from transformers import AutoConfig

    AutoConfig.for_model("qwen2", vocab_size=320, hidden_size=112, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=512,
                         attention_dropout=0.0, use_cache=False, tie_word_embeddings=True).save_pretrained(folder)
    return str(folder / "config.json")


def test_28_heads_train_at_sp8_as_4x2_and_hybrid_attention_on_8_ranks(tmp_path):
    """A model of 28 heads cannot use Ulysses at 8 ranks; `--sp_size 8 --ring_size 2` (Ulysses 4 x ring 2) trains it
    through the real trainer on packed text, with kept attention outputs, tiled MLP and lean norms, and its loss and
    gradient norm match the single-process run step for step. The same 8 processes then check the attention at
    (ulysses, ring) = (2, 4) and (4, 2), KV heads split and replicated, packed."""
    import subprocess
    import sys

    from tests.trainer_runs import ROOT, assert_same_curve, child_env, launch_port, metrics

    books = tmp_path / "books"
    books.mkdir()
    for i in range(3):
        (books / f"book{i}.txt").write_text(" ".join([f"chapter {i} the cat sat on the mat."] * (20 * i + 15)))
    args = ["--model_config", _qwen2_28_heads(tmp_path / "model"), "--dataset", str(books), "--tokenizer", "bytes",
            "--packing", "--seq_len", "128", "--steps", "4", "--lr", "3e-3", "--data_cache_dir", str(tmp_path / "c"),
            "--attn_recompute", "never", "--tiled_mlp", "on", "--mlp_tile_tokens", "8", "--fused_kernels", "off"]
    single = subprocess.run([sys.executable, "launch/train.py", *args, "--output_dir", str(tmp_path / "single")],
                            cwd=ROOT, env=child_env(), capture_output=True, text=True)
    assert single.returncode == 0, single.stderr[-3000:]
    (tmp_path / "cases").mkdir()
    ring = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "8", "--master_port",
                           str(launch_port()), "tests/helpers/train_then_ring_cases.py", *args, "--sp_size", "8",
                           "--ring_size", "2", "--output_dir", str(tmp_path / "ring")], cwd=ROOT,
                          env=dict(child_env(), RING_CASES_OUT=str(tmp_path / "cases")), capture_output=True, text=True)
    assert ring.returncode == 0, f"{ring.stdout[-3000:]}\n{ring.stderr[-5000:]}"
    assert "world 8 = dp 1 x sp 8 (Ulysses 4 x ring 2)" in ring.stdout
    assert "attention kept: True" in ring.stdout and "tiled MLP: True" in ring.stdout
    assert_same_curve(metrics(tmp_path / "ring"), metrics(tmp_path / "single"))
    _check_attention([torch.load(tmp_path / "cases" / f"{r}.pt") for r in range(8)], CASES_8)
