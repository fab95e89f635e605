"""The field's dataset layouts and mixtures: ShareGPT `conversations` (from/value, tool calls and results), other
columns and role names (--messages_field, --role_map), each stored with transformers' own tokens and assistant mask
of the same conversation; a mixture of datasets in their own formats, each sample drawn as that dataset gives it
(no processes)."""

import json

import numpy as np
import pytest

from tests.sft_fixtures import (
    CHATML_TOOLS,
    CORPUS,
    MULTI_TURN,
    SHAREGPT,
    SHAREGPT_AS_MESSAGES,
    tiny_tokenizer,
    write_jsonl,
)
from ulysses_train.data.corpus import load_corpus
from ulysses_train.data.load import load_source
from ulysses_train.data.mixture import MixtureSource, dataset_entries
from ulysses_train.data.sft import detect_format, sft_samples
from ulysses_train.errors import ConfigError
from ulysses_train.train.config.config_file import config_from

CUSTOMER = [{"speaker": "customer", "role": "customer", "content": m["content"]} if m["role"] == "user" else
            {"role": "agent" if m["role"] == "assistant" else m["role"], "content": m["content"]}
            for m in MULTI_TURN if m["role"] != "tool"]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _stored(tok, tmp_path, rows, **kw):
    path = write_jsonl(tmp_path / f"rows{len(list(tmp_path.iterdir()))}.jsonl", rows)
    corpus = load_corpus(path)
    fmt = detect_format(list(corpus.column_names), "auto", None, kw.get("messages_field"))
    template = tmp_path / "tools.jinja"
    template.write_text(CHATML_TOOLS)
    samples, store, settings = sft_samples(corpus, fmt, tok, 256, dataset=path, split="train",
                                           cache_dir=str(tmp_path / "cache"), chat_template=str(template), **kw)
    ends = list(store.doc_starts[1:]) + [len(store.tokens)]
    return fmt, [(np.asarray(store.tokens[a:b]).tolist(), np.asarray(store.trained[a:b]).tolist())
                 for a, b in zip(store.doc_starts, ends)], settings


def _transformers(tok, messages):
    out = tok.apply_chat_template(messages, chat_template=CHATML_TOOLS, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def test_sharegpt_is_detected_and_stored_as_transformers_renders_its_messages(tok, tmp_path):
    fmt, stored, settings = _stored(tok, tmp_path, [{"conversations": SHAREGPT, "id": 1}])
    assert fmt == "messages" and settings["messages_column"] == "conversations"
    ids, mask = _transformers(tok, SHAREGPT_AS_MESSAGES)  # the tool call is trained, the tool's result is not
    assert stored == [(ids, mask)] and sum(mask) > 0


def test_other_columns_and_role_names_by_messages_field_and_role_map(tok, tmp_path):
    rows = [{"dialog": CUSTOMER, "messages": "not this one"}]
    fmt, stored, _ = _stored(tok, tmp_path, rows, messages_field="dialog", role_map="customer=user,agent=assistant")
    expected = [{"role": {"customer": "user", "agent": "assistant"}.get(m["role"], m["role"]), "content": m["content"],
                 **({"speaker": "customer"} if "speaker" in m else {})} for m in CUSTOMER]
    assert fmt == "messages" and stored == [_transformers(tok, expected)]
    with pytest.raises(ConfigError, match=r"no target: .* \(roles other than ShareGPT's are named with --role_map\)"):
        _stored(tok, tmp_path, rows, messages_field="dialog", role_map={"customer": "user"})  # "agent" passed on
    with pytest.raises(ConfigError, match=r"--messages_field turns is not a column of the dataset"):
        _stored(tok, tmp_path, rows, messages_field="turns")
    with pytest.raises(ConfigError, match="--role_map agent: give from=to pairs"):
        _stored(tok, tmp_path, rows, messages_field="dialog", role_map="agent")


def test_a_mixture_draws_each_dataset_as_it_is_alone(tok, tmp_path):
    tok.save_pretrained(tmp_path / "tok")
    template = tmp_path / "tools.jinja"
    template.write_text(CHATML_TOOLS)
    sharegpt = write_jsonl(tmp_path / "sharegpt.jsonl", [{"conversations": SHAREGPT[:3 + i]} for i in range(3)])
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": f"Add {i} and {i}.", "completion": f" {2 * i}."}
                                                   for i in range(4)])
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in CORPUS])
    spec = [{"path": sharegpt, "samples": 5}, {"path": pairs, "weight": 0.5}, text]
    settings = {"dataset": spec, "tokenizer": str(tmp_path / "tok"), "chat_template": str(template),
                "seq_len": 128, "data_cache_dir": str(tmp_path / "cache"), "seed": 3}
    cfg, _ = config_from(settings)
    logged = []
    _, mixture = load_source(cfg.data_settings(), cfg.data.dataset, "train", 128, 512, 0, logged.append)
    plain = cfg.with_flags(chat_template=None)  # which a text dataset alone refuses
    alone = [load_source(c.data_settings(), path, "train", 128, 512, 0, print)[1]
             for c, path in ((cfg, sharegpt), (cfg, pairs), (plain, text))]
    assert isinstance(mixture, MixtureSource) and mixture.counts == [5, 2, alone[2].num_samples]
    assert "a mixture of 3" in logged[-1] and f"{sharegpt}: 5 of its 3 samples (5 samples)" in logged[-1]
    drawn = {0: [], 1: [], 2: []}
    for index in range(mixture.num_samples):
        j, local = mixture.locate(index)
        drawn[j].append(local)
        got, expected = mixture.get(index), alone[j].get(local)
        assert got.ids.equal(expected.ids) and got.docs == expected.docs
        assert (got.labels is None and expected.labels is None) or got.labels.equal(expected.labels)
    assert sorted(drawn[0][:3]) == [0, 1, 2] and len(drawn[0]) == 5  # every one once, then again
    assert len(set(drawn[1])) == 2 and sorted(drawn[2]) == list(range(alone[2].num_samples))
    assert alone[1].get(0).labels is not None and alone[2].get(0).labels is None  # own formats: labels and text


@pytest.mark.parametrize("value, message", [
    ({"path": "a", "weight": 1, "samples": 2}, "give weight or samples, not both"),
    ({"path": "a", "wieght": 1}, r"unknown key\(s\) wieght; an entry takes path, split"),
    ({"path": "a", "weight": -1}, "weight must be a positive number, got -1"),
    ({"path": "a", "samples": 1.5}, "samples must be a positive whole number, got 1.5"),
    ({"split": "train"}, "an entry is a path or a mapping with a path"),
])
def test_bad_mixture_entries_are_named(value, message):
    with pytest.raises(ConfigError, match=message):
        dataset_entries([value])
    with pytest.raises(ConfigError, match=message):
        config_from({"dataset": [json.dumps(value) if "path" not in value else value, "b"]})[0].validate()
