"""The token cache: every setting that changes the stored tokens is in its key; builds of one cache at the same
time and a damaged cache never give a crash or wrong tokens; a corrupt dataset is one error naming --dataset."""

import json
import multiprocessing
import os

import numpy as np
import pytest

from ulysses_train.data.corpus import (
    ByteTokenizer,
    build_token_store,
    cache_settings,
    corpus_samples,
    store_key,
    tokenizer_identity,
)
from ulysses_train.errors import ConfigError

WORDS = " ".join(f"w{i}" for i in range(80))  # 309 bytes: with its EOS, 310 tokens per document


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _tokens(dataset, cache, **kw):
    _, store = corpus_samples(dataset, "train", kw.pop("text_column", None), ByteTokenizer(), 16, str(cache), **kw)
    return store


def test_max_tokens_is_part_of_the_key(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", [{"text": WORDS}] * 20)
    capped = _tokens(data, tmp_path / "cache", max_tokens=3000)
    full = _tokens(data, tmp_path / "cache")  # the capped store must not answer for the whole corpus
    assert (len(capped.tokens), len(full.tokens)) == (3100, 6200) and not full.cache_hit
    again = _tokens(data, tmp_path / "cache", max_tokens=3000)
    assert again.cache_hit and len(again.tokens) == 3100


@pytest.mark.parametrize("streaming", [False, True])
def test_text_column_is_part_of_the_key(tmp_path, streaming):
    data = _jsonl(tmp_path / "d.jsonl", [{"text": "a" * 40, "body": "b" * 50}] * 3)
    text = _tokens(data, tmp_path / "cache", streaming=streaming)
    body = _tokens(data, tmp_path / "cache", streaming=streaming, text_column="body")
    assert len(text.tokens) == 3 * 41 and len(body.tokens) == 3 * 51


def test_split_is_part_of_the_key(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a" * 10]}),
                          "test": datasets.Dataset.from_dict({"text": ["b" * 20]})}).save_to_disk(tmp_path / "dd")
    train = corpus_samples(str(tmp_path / "dd"), "train", None, ByteTokenizer(), 4, str(tmp_path / "cache"))[1]
    test = corpus_samples(str(tmp_path / "dd"), "test", None, ByteTokenizer(), 4, str(tmp_path / "cache"))[1]
    assert (len(train.tokens), len(test.tokens)) == (11, 21)


def _word_tokenizer(folder, vocab, lowercase=False):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    if lowercase:
        backend.normalizer = normalizers.Lowercase()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>").save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def test_tokenizer_vocabulary_and_normalisation_are_part_of_the_key(tmp_path):
    """The same folder, the same size: a tokenizer rewritten in place must not reuse the old tokens."""
    base = {"<unk>": 0, "<eos>": 1, "a": 2, "b": 3}
    folder = tmp_path / "tok"
    keys = []
    for vocab, lowercase in ((base, False), ({**base, "a": 3, "b": 2}, False), (base, True)):
        tokenizer = _word_tokenizer(folder, vocab, lowercase)
        keys.append(store_key(cache_settings("same-data", tokenizer, "d.jsonl", "train", "text", None)))
    assert len(set(keys)) == 3
    assert tokenizer_identity(ByteTokenizer()) == tokenizer_identity(ByteTokenizer())


def test_each_setting_changes_the_key():
    tok = ByteTokenizer()
    base = dict(fingerprint="f", tokenizer=tok, dataset="d", split="train", text_column="text", max_tokens=None)
    changes = dict(fingerprint="g", dataset="e", split="test", text_column="body", max_tokens=3000)
    keys = {store_key(cache_settings(**base))} | {store_key(cache_settings(**{**base, k: v}))
                                                  for k, v in changes.items()}
    assert len(keys) == 1 + len(changes)


# ---------------------------------------------------------------- concurrent builds, damaged caches

DOCS = [np.arange(3, 3 + n, dtype=np.int64) for n in (50, 70, 30, 90)]
EXPECTED = np.concatenate([np.append(d, 1) for d in DOCS])


class RivalMidway:
    """Token arrays of a streamed dataset; halfway through, another build of the same cache runs to completion
    (what a second process does when two runs start together)."""

    def __init__(self, cache, key):
        self.cache, self.key = cache, key

    def __iter__(self):
        for i, ids in enumerate(DOCS):
            if i == len(DOCS) // 2:
                rival = build_token_store([{"input_ids": d} for d in DOCS], 1, self.cache, self.key)
                assert np.array_equal(rival.tokens, EXPECTED)
            yield {"input_ids": ids}


def test_a_build_that_finishes_during_another_is_safe(tmp_path):
    cache = str(tmp_path / "cache")
    store = build_token_store(RivalMidway(cache, "k"), 1, cache, "k")
    assert np.array_equal(store.tokens, EXPECTED)
    assert build_token_store([], 1, cache, "k").cache_hit
    assert os.listdir(cache) == ["k"]  # no temporary left behind


def _build_in_process(cache, barrier, out):
    barrier.wait()
    store = build_token_store([{"input_ids": d} for d in DOCS * 200], 1, cache, "k")
    np.save(out, np.asarray(store.tokens))


def test_processes_building_one_cache_at_once(tmp_path):
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(3)
    outs = [str(tmp_path / f"seen{i}.npy") for i in range(3)]
    procs = [ctx.Process(target=_build_in_process, args=(str(tmp_path / "cache"), barrier, out)) for out in outs]
    for p in procs:
        p.start()
    for p in procs:
        p.join()  # a builder that crashes exits non-zero: nothing here waits on it
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert all(np.array_equal(np.load(out), np.tile(EXPECTED, 200)) for out in outs)


@pytest.mark.parametrize("damage", ["truncated tokens", "truncated doc starts", "missing tokens", "bad settings"])
def test_a_damaged_cache_is_named_and_rebuilt(tmp_path, capsys, damage):
    cache = str(tmp_path / "cache")
    build_token_store([{"input_ids": d} for d in DOCS], 1, cache, "k")
    folder = os.path.join(cache, "k")
    victim = {"truncated tokens": "tokens.npy", "truncated doc starts": "doc_starts.npy",
              "missing tokens": "tokens.npy", "bad settings": "settings.json"}[damage]
    path = os.path.join(folder, victim)
    if damage == "missing tokens":
        os.remove(path)
    else:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    rebuilt = build_token_store([{"input_ids": d} for d in DOCS], 1, cache, "k")
    assert not rebuilt.cache_hit and np.array_equal(rebuilt.tokens, EXPECTED)
    warning = capsys.readouterr().err
    assert folder in warning and "rebuilding" in warning
    assert build_token_store([], 1, cache, "k").cache_hit


# ---------------------------------------------------------------- unreadable datasets

def _corrupt_parquet(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": ["x" * 100] * 50}).to_parquet(str(tmp_path / "good.parquet"))
    data = (tmp_path / "good.parquet").read_bytes()
    (tmp_path / "bad.parquet").write_bytes(data[:len(data) // 2])
    return str(tmp_path / "bad.parquet")


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "jsonl streamed"])
def test_a_corrupt_dataset_is_one_error_naming_it(tmp_path, kind):
    if kind == "parquet":
        path = _corrupt_parquet(tmp_path)
    else:
        path = str(tmp_path / "bad.jsonl")
        (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": "cut here\n')
    with pytest.raises(ConfigError, match=rf"--dataset {path} cannot be read"):
        _tokens(path, tmp_path / "cache", streaming=kind.endswith("streamed"))
    cache = tmp_path / "cache"
    assert not cache.exists() or not os.listdir(cache)  # a failed build leaves nothing behind
