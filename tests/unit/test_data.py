"""The corpus pipeline on small fixtures written by the tests (offline)."""

import json
import os

import numpy as np
import pytest
import torch

from tests.models import tiny_config
from tests.multiprocess import run_distributed
from ulysses_train.data.corpus import (
    ByteTokenizer,
    TokenSamples,
    build_token_store,
    cache_settings,
    load_corpus,
    load_tokenizer,
    pick_text_column,
    store_key,
    tokenize_corpus,
)
from ulysses_train.data.sources import build_batch
from ulysses_train.errors import ConfigError
from ulysses_train.sp.sharding import IGNORE_INDEX

DOCS = ["first book. " * 7, "second, longer book! " * 9, "third: ünïcode ✓ " * 5]


def _store(path, tmp_path, seq_len=None, column=None):
    tok = ByteTokenizer()
    ds = load_corpus(str(path))
    column = pick_text_column(ds.column_names, column)
    tokenized = tokenize_corpus(ds, tok, column, None)
    key = store_key(cache_settings(tokenized._fingerprint, tok, str(path), "train", column, None))
    return build_token_store(tokenized, tok.eos_token_id, str(tmp_path / "cache"), key)


def _expected_tokens(docs):
    """Each document's UTF-8 bytes + 3, followed by EOS (id 1)."""
    return np.concatenate([np.append(np.frombuffer(d.encode(), np.uint8).astype(np.int64) + 3, 1) for d in docs])


def _write(fmt, folder):
    import datasets

    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "txt":
        for i, d in enumerate(DOCS):
            (folder / f"{i}.txt").write_text(d)
        return folder
    if fmt == "jsonl":
        (folder / "d.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
        return folder / "d.jsonl"
    ds = datasets.Dataset.from_dict({"text": DOCS, "id": list(range(len(DOCS)))})
    if fmt == "parquet":
        ds.to_parquet(str(folder / "d.parquet"))
        return folder
    if fmt == "save_to_disk":
        ds.save_to_disk(str(folder / "saved"))
        return folder / "saved"
    if fmt == "arrow":
        ds.save_to_disk(str(folder / "tmp"))
        arrow = next(f for f in os.listdir(folder / "tmp") if f.endswith(".arrow"))
        os.rename(folder / "tmp" / arrow, folder / "d.arrow")
        return folder / "d.arrow"
    raise ValueError(fmt)


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "parquet", "arrow", "save_to_disk"])
def test_local_formats_join_documents_with_eos(fmt, tmp_path):
    store = _store(_write(fmt, tmp_path / fmt), tmp_path)
    assert np.array_equal(np.asarray(store.tokens, np.int64), _expected_tokens(DOCS))
    assert store.doc_starts.tolist() == [0, len(DOCS[0].encode()) + 1,
                                         len(DOCS[0].encode()) + len(DOCS[1].encode()) + 2]


def test_second_run_hits_the_cache(tmp_path):
    folder = _write("txt", tmp_path / "txt")
    first = _store(folder, tmp_path)
    cached_files = sorted(os.listdir(tmp_path / "cache"))
    second = _store(folder, tmp_path)
    assert not first.cache_hit and second.cache_hit
    assert sorted(os.listdir(tmp_path / "cache")) == cached_files
    assert np.array_equal(first.tokens, second.tokens)


@pytest.mark.parametrize("pad_last", [False, True])
def test_samples_are_exact_slices(pad_last, tmp_path):
    store = _store(_write("txt", tmp_path / "txt"), tmp_path)
    total = len(store.tokens)
    seq_len = 100
    samples = TokenSamples(store, seq_len, pad_id=0, pad_last=pad_last)
    assert len(samples) == (-(-total // seq_len) if pad_last else total // seq_len)
    joined = torch.cat([samples.sample(i)[0][:samples.sample(i)[1]] for i in range(len(samples))])
    assert all(samples.sample(i)[0].shape == (seq_len,) for i in range(len(samples)))
    assert torch.equal(joined, torch.from_numpy(np.asarray(store.tokens[:len(joined)], np.int64)))
    if pad_last:
        ids, valid = samples.sample(len(samples) - 1)
        assert valid == total % seq_len and (ids[valid:] == 0).all()
        batch = build_batch([(ids, valid, None)], packing=False)
        assert (batch["labels"][0, valid:] == IGNORE_INDEX).all()
    lengths = samples.document_lengths(0, seq_len)
    assert sum(lengths) == seq_len and lengths[0] == len(DOCS[0].encode()) + 1


def test_dataset_shorter_than_one_sample_gives_both_numbers(tmp_path):
    store = _store(_write("txt", tmp_path / "txt"), tmp_path)
    with pytest.raises(ConfigError,
                       match=rf"has {len(store.tokens)} tokens, fewer than one sample of --seq_len 100000"):
        TokenSamples(store, 100000, 0, pad_last=False)


def test_bad_inputs(tmp_path):
    folder = _write("jsonl", tmp_path / "j")
    ds = load_corpus(str(folder))
    with pytest.raises(ConfigError,
                       match=r"--text_column body is not in the dataset; its columns are \['text', 'id'\]"):
        pick_text_column(ds.column_names, "body")
    with pytest.raises(ConfigError, match="no 'text' column"):
        pick_text_column(["body"], None)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="no .txt, .jsonl"):
        load_corpus(str(empty))
    (empty / "blank.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    assert len(_store(empty / "blank.jsonl", tmp_path).tokens) == 0  # the trainer turns this into an error
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.txt").write_bytes(b"ok \xff\xfe bytes")
    store = _store(bad, tmp_path)  # documented: undecodable bytes become U+FFFD, never a crash
    assert "\ufffd".encode() in bytes((np.asarray(store.tokens[:-1]) - 3).astype(np.uint8))


def test_tokenizer_without_eos_is_an_error(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "tok"
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")),
                            unk_token="<unk>").save_pretrained(folder)
    with pytest.raises(ConfigError, match="has no EOS token"):
        load_tokenizer(str(folder), None)
    assert isinstance(load_tokenizer(None, None), ByteTokenizer)


# ---------------------------------------------------------------- packing under SP

DOC_LENGTHS = [20, 30, 14]  # one packed sample of 64 tokens


def _packed_sp(rank, world, seed):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from ulysses_train.levers.loss import CausalLMWithSPLoss, global_token_count
    from ulysses_train.model.surgery import install_loss_head
    from ulysses_train.sp.attention import register_ulysses_attention
    from ulysses_train.sp.sharding import shard_sequence

    group = dist.new_group(list(range(world)))
    attention = register_ulysses_attention(group, "sdpa")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3"), attn_implementation="ulysses")
    install_loss_head(model, chunk_size=8)
    ids = torch.randint(3, 96, (sum(DOC_LENGTHS),), generator=torch.Generator().manual_seed(seed))
    batch = build_batch([(ids, len(ids), DOC_LENGTHS)], packing=True)
    attention.doc_lengths = batch["docs"]
    shard = shard_sequence(batch["input_ids"], world, rank, labels=batch["labels"],
                           position_ids=batch["position_ids"])
    loss = CausalLMWithSPLoss(model)(shard["input_ids"], shard["position_ids"], shard["labels"],
                                     global_token_count(shard["labels"], group))
    loss.backward()
    dist.all_reduce(loss.detach(), group=group)
    grads = {n: p.grad for n, p in model.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g, group=group)
    return loss.item(), grads


@pytest.mark.slow
def test_packed_sp2_equals_each_document_alone(tmp_path):
    from transformers import AutoModelForCausalLM

    seed = 5
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3"), attn_implementation="sdpa")
    ids = torch.randint(3, 96, (sum(DOC_LENGTHS),), generator=torch.Generator().manual_seed(seed))
    total, targets, start = 0.0, sum(n - 1 for n in DOC_LENGTHS), 0
    for n in DOC_LENGTHS:  # each document alone, positions from 0, its own shifted loss
        doc = ids[start:start + n][None]
        total = total + model(input_ids=doc, labels=doc).loss * (n - 1)
        start += n
    reference = total / targets
    reference.backward()
    for loss, grads in run_distributed(_packed_sp, 2, seed):
        assert loss == pytest.approx(reference.item(), rel=1e-5)
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_streaming_reads_the_same_tokens(tmp_path):
    path = _write("jsonl", tmp_path / "s")
    tok = ByteTokenizer()
    ds = load_corpus(str(path), streaming=True)
    tokenized = tokenize_corpus(ds, tok, pick_text_column(ds.column_names, None), None)
    store = build_token_store(tokenized, tok.eos_token_id, str(tmp_path / "cache"), "stream", max_tokens=None)
    assert np.array_equal(np.asarray(store.tokens, np.int64), _expected_tokens(DOCS))
    capped = build_token_store(tokenize_corpus(load_corpus(str(path), streaming=True), tok, "text", None),
                               tok.eos_token_id, str(tmp_path / "cache"), "capped", max_tokens=10)
    assert len(capped.doc_starts) == 1  # stops reading after the document that crosses --max_tokens
