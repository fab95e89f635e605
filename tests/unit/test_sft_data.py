"""Conversation data: formats, what is trained in each (checked by decoding the trained tokens), templates with and
without generation markers, errors that name the flag, the cache key (templates written in tests/sft_fixtures.py)."""

import numpy as np
import pytest

from tests.sft_fixtures import (
    CHATML_PLAIN,
    CHATML_QWEN,
    LLAMA3,
    MISTRAL,
    MULTI_TURN,
    REASONING,
    tiny_tokenizer,
    trained_spans,
    write_jsonl,
)
from ulysses_train.data.chat import assistant_mask, completion_mask, load_chat_template, marker_mask, prefix_mask
from ulysses_train.data.corpus import ByteTokenizer, load_corpus
from ulysses_train.data.sft import RowEncoder, detect_format, resolve_loss_on, sft_samples
from ulysses_train.errors import ConfigError

ASSISTANT_TURNS = ["Four.<|im_end|>", "It sat on the mat.<|im_end|>"]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


# ---------------------------------------------------------------- masks, per template style

@pytest.mark.parametrize("template", [CHATML_QWEN, CHATML_PLAIN], ids=["markers", "no markers"])
def test_chatml_multi_turn_trains_every_assistant_turn_and_its_end(tok, template):
    ids, mask = assistant_mask(tok, template, MULTI_TURN)
    assert tok.decode(ids).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert trained_spans(tok, ids, mask) == ASSISTANT_TURNS  # not the header, not the newline after <|im_end|>


@pytest.mark.parametrize("tokenizer", ["bpe", "bytes"])
def test_markers_and_prefixes_give_the_same_mask(tok, tokenizer):
    t = tok if tokenizer == "bpe" else ByteTokenizer()
    for messages in (MULTI_TURN, MULTI_TURN[1:3], MULTI_TURN[1:]):  # with and without system (Qwen's default)
        assert marker_mask(t, CHATML_QWEN, messages) == prefix_mask(t, CHATML_PLAIN, messages)
    ids, mask = assistant_mask(t, CHATML_QWEN, MULTI_TURN[1:3])
    assert "You are Qwen" in t.decode(ids) and trained_spans(t, ids, mask) == ASSISTANT_TURNS[:1]


def test_llama3_template(tok):
    ids, mask = assistant_mask(tok, LLAMA3, MULTI_TURN)
    assert tok.decode(ids[:2]) == "<|begin_of_text|><|start_header_id|>"
    assert trained_spans(tok, ids, mask) == ["Four.<|eot_id|>", "It sat on the mat.<|eot_id|>"]


def test_template_without_markers_or_generation_prompt():
    tok = tiny_tokenizer(bos="<s>", eos="</s>")
    messages = [m for m in MULTI_TURN if m["role"] in ("user", "assistant")]
    ids, mask = assistant_mask(tok, MISTRAL, messages)
    assert tok.decode(ids) == "<s>[INST] What is two plus two? [/INST] Four.</s>[INST] And the cat? [/INST] It sat " \
                              "on the mat.</s>"
    assert trained_spans(tok, ids, mask) == [" Four.</s>", " It sat on the mat.</s>"]


def test_a_template_whose_turns_cannot_be_found_names_the_flag(tok):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>x</think>Four."},
                {"role": "user", "content": "And?"}, {"role": "assistant", "content": "Done."}]
    with pytest.raises(ConfigError, match=r"--chat_template: cannot find the assistant's tokens: it has no "
                                          r"\{% generation %\} markers, and messages\[:2\] rendered is not a prefix"):
        assistant_mask(tok, REASONING, messages)
    empty_markers = CHATML_PLAIN.replace("{{- '\\n' }}", "{% generation %}{% endgeneration %}{{- '\\n' }}", 1)
    ids, mask = assistant_mask(tok, empty_markers, MULTI_TURN)  # markers that mark nothing: prefixes instead
    assert trained_spans(tok, ids, mask) == ASSISTANT_TURNS


def test_loading_templates(tok, tmp_path):
    with pytest.raises(ConfigError, match=r"has no chat template, which conversations need: give one with "
                                          r"--chat_template FILE"):
        load_chat_template(None, ByteTokenizer())
    assert load_chat_template(None, tiny_tokenizer(template=LLAMA3)) == LLAMA3
    (tmp_path / "t.jinja").write_text(CHATML_QWEN)
    assert load_chat_template(str(tmp_path / "t.jinja"), tok) == CHATML_QWEN
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match="--chat_template .*bad.jinja is not a valid Jinja template"):
        load_chat_template(str(tmp_path / "bad.jinja"), tok)


# ---------------------------------------------------------------- formats, row by row

def _encode(fmt, tokenizer, rows, loss_on, template=CHATML_QWEN):
    columns = {k: [r[k] for r in rows] for k in rows[0]}
    out = RowEncoder(fmt, tokenizer, template, loss_on)(columns, list(range(len(rows))))
    return [(ids.tolist(), mask.tolist()) for ids, mask in zip(out["input_ids"], out["trained"])]


def test_loss_on_all_and_assistant_for_messages(tok):
    (ids, mask), = _encode("messages", tok, [{"messages": MULTI_TURN}], "all")
    assert all(mask) and ids == assistant_mask(tok, CHATML_QWEN, MULTI_TURN)[0]
    (ids, mask), = _encode("messages", tok, [{"messages": MULTI_TURN}], "assistant")
    assert trained_spans(tok, ids, mask) == ASSISTANT_TURNS


@pytest.mark.parametrize("tokenizer", ["bpe", "bytes"])
def test_prompt_completion_strings(tok, tokenizer):
    t = tok if tokenizer == "bpe" else ByteTokenizer()
    (ids, mask), = _encode("prompt_completion", t, [{"prompt": "What is two plus two?", "completion": " Four."}],
                           "completion", None)
    assert ids == t.encode("What is two plus two?") + t.encode(" Four.") + [t.eos_token_id]  # EOS: learn to stop
    assert t.decode([i for i, m in zip(ids, mask) if m]) == (" Four.<|im_end|>" if tokenizer == "bpe" else " Four.")
    assert mask[-1] == 1 and not any(mask[:len(t.encode("What is two plus two?"))])
    (_, mask), = _encode("prompt_completion", t, [{"prompt": "Q", "completion": "A"}], "all", None)
    assert all(mask)
    with pytest.raises(ConfigError, match="row 0 of --dataset: --loss_on assistant needs message lists"):
        _encode("prompt_completion", t, [{"prompt": "Q", "completion": "A"}], "assistant", None)


def test_prompt_completion_messages(tok):
    row = {"prompt": MULTI_TURN[:4], "completion": MULTI_TURN[4:]}  # completion: a tool result and an answer
    (ids, mask), = _encode("prompt_completion", tok, [row], "completion")
    assert ids == assistant_mask(tok, CHATML_QWEN, MULTI_TURN)[0]
    assert trained_spans(tok, ids, mask) == ["<|im_start|>user\n<tool_response>\nsat on the mat\n</tool_response>"
                                             "<|im_end|>\n<|im_start|>assistant\nIt sat on the mat.<|im_end|>"]
    head = assistant_mask(tok, CHATML_QWEN, MULTI_TURN[:4])[0]
    assert not any(mask[:len(head) - 1])
    (ids, mask), = _encode("prompt_completion", tok, [row], "assistant")  # every assistant turn, the prompt's too
    assert trained_spans(tok, ids, mask) == ASSISTANT_TURNS
    ids, mask = completion_mask(tok, CHATML_QWEN, MULTI_TURN[1:2], MULTI_TURN[2:3])
    assert trained_spans(tok, ids, mask) == ASSISTANT_TURNS[:1]


def test_pre_tokenized_with_labels_or_assistant_masks(tok):
    ids = [5, 6, 7, 8, 9]
    (got, mask), = _encode("tokens", tok, [{"input_ids": ids, "labels": [-100, -100, 7, 8, -100]}], "labels")
    assert got == ids and mask == [0, 0, 1, 1, 0]
    (got, mask), = _encode("tokens", tok, [{"input_ids": ids, "assistant_masks": [0, 1, 1, 0, 0]}], "assistant_masks")
    assert mask == [0, 1, 1, 0, 0]
    (_, mask), = _encode("tokens", tok, [{"input_ids": ids, "labels": [-100] * 5}], "all")
    assert mask == [1] * 5
    with pytest.raises(ConfigError, match=r"row 0 of --dataset: `labels` must be the input_ids, unshifted, with -100 "
                                          r"where not trained; at position 1 the label is 7 and the token 6"):
        _encode("tokens", tok, [{"input_ids": ids, "labels": [-100, 7, 8, 9, -100]}], "labels")  # shifted
    with pytest.raises(ConfigError, match="`assistant_masks` has 4 entries and `input_ids` 5"):
        _encode("tokens", tok, [{"input_ids": ids, "assistant_masks": [0, 1, 1, 0]}], "assistant_masks")


def test_bad_rows_name_the_row(tok):
    with pytest.raises(ConfigError, match=r"row 1 of --dataset: `messages` must be a non-empty list of \{role, "
                                          r"content\} objects"):
        _encode("messages", tok, [{"messages": MULTI_TURN}, {"messages": "hello"}], "assistant")
    raising = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(ConfigError, match="row 0 of --dataset: the chat template .* Conversation roles must alternate"):
        _encode("messages", tok, [{"messages": MULTI_TURN}], "assistant", raising)
    # an id or a mask where a list belongs crashed with "TypeError: 'int' object is not iterable"
    with pytest.raises(ConfigError, match=r"row 0 of --dataset: `input_ids` is 7, not a list of one entry per token"):
        _encode("tokens", tok, [{"input_ids": 7}], "all")
    with pytest.raises(ConfigError, match=r"row 0 of --dataset: `labels` is 5, not a list of one entry per token"):
        _encode("tokens", tok, [{"input_ids": [5], "labels": 5}], "labels")
    # a null row named "`input_ids` or `all`", `all` being the --loss_on value, not a column
    with pytest.raises(ConfigError, match=r"row 0 of --dataset: `input_ids` is empty \(null\)$"):
        _encode("tokens", tok, [{"input_ids": None}], "all")
    with pytest.raises(ConfigError, match=r"row 0 of --dataset: `labels` is empty \(null\)$"):
        _encode("tokens", tok, [{"input_ids": [5], "labels": None}], "labels")


def test_format_detection_and_loss_on():
    assert detect_format(["messages", "id"], "auto", None) == "messages"
    assert detect_format(["prompt", "completion"], "auto", None) == "prompt_completion"
    assert detect_format(["input_ids", "labels"], "auto", None) == "tokens"
    assert detect_format(["text", "messages"], "auto", "text") == "text"  # --text_column asks for text
    assert detect_format(["text"], "auto", None) == "text"
    with pytest.raises(ConfigError, match=r"--data_format messages needs a `messages` or `conversations` column \(or "
                                          r"name yours with --messages_field\); the dataset has \['text'\]"):
        detect_format(["text"], "messages", None)
    with pytest.raises(ConfigError, match=r"no 'text' column in the dataset \(columns: \['body'\]\), nor .*"
                                          r"--text_column, or the format with --data_format"):
        detect_format(["body"], "auto", None)
    assert resolve_loss_on("messages", "auto", []) == "assistant"
    assert resolve_loss_on("prompt_completion", "auto", []) == "completion"
    assert resolve_loss_on("tokens", "auto", ["input_ids", "labels"]) == "labels"
    assert resolve_loss_on("tokens", "auto", ["input_ids"]) == "all"
    assert resolve_loss_on("tokens", "all", ["input_ids", "assistant_masks"]) == "all"
    with pytest.raises(ConfigError, match="--loss_on completion does not apply to messages data"):
        resolve_loss_on("messages", "completion", [])
    with pytest.raises(ConfigError, match="--loss_on assistant does not apply to text data"):
        resolve_loss_on("text", "assistant", [])
    with pytest.raises(ConfigError, match="--loss_on assistant: pre-tokenized data .* neither"):
        resolve_loss_on("tokens", "assistant", ["input_ids"])


# ---------------------------------------------------------------- through datasets and the cache

def _samples(path, tmp_path, tok, **kw):
    fmt = kw.pop("fmt", "auto")
    corpus = load_corpus(str(path))
    fmt = detect_format(list(corpus.column_names), fmt, None)
    return sft_samples(corpus, fmt, tok, kw.pop("seq_len", 128), dataset=str(path), split="train",
                       cache_dir=str(tmp_path / "cache"), **kw)


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_stored_conversations_and_the_cache_key(tok, tmp_path, suffix):
    import datasets

    rows = [{"messages": MULTI_TURN}, {"messages": MULTI_TURN[1:3]}]
    path = write_jsonl(tmp_path / "chats.jsonl", rows)
    if suffix == "parquet":
        path = str(tmp_path / "chats.parquet")
        datasets.Dataset.from_list(rows).to_parquet(path)
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML_QWEN)
    samples, store, settings = _samples(path, tmp_path, tok, chat_template=str(template))
    assert not store.cache_hit and settings["chat_template"] == CHATML_QWEN and settings["loss_on"] == "assistant"
    for c, messages in enumerate((MULTI_TURN, MULTI_TURN[1:3])):
        ids, mask = assistant_mask(tok, CHATML_QWEN, messages)
        piece = slice(store.doc_starts[c], store.doc_starts[c] + len(ids))
        assert np.array_equal(store.tokens[piece], ids) and np.array_equal(store.trained[piece], mask)
    assert len(store.tokens) == store.doc_starts[1] + len(assistant_mask(tok, CHATML_QWEN, MULTI_TURN[1:3])[0])
    assert _samples(path, tmp_path, tok, chat_template=str(template))[1].cache_hit
    assert not _samples(path, tmp_path, tok, chat_template=str(template), loss_on="all")[1].cache_hit
    template.write_text(CHATML_PLAIN)  # the same file, another text: another store (with the same masks)
    plain = _samples(path, tmp_path, tok, chat_template=str(template))[1]
    assert not plain.cache_hit and np.array_equal(plain.trained, store.trained)


@pytest.mark.parametrize("kind", ["jsonl", "save_to_disk"])
def test_prompt_completion_message_lists_through_the_store(tok, tmp_path, kind):
    import datasets

    rows = [{"prompt": MULTI_TURN[:2], "completion": MULTI_TURN[2:3]}] * 2
    path = write_jsonl(tmp_path / "pc.jsonl", rows)
    if kind == "save_to_disk":
        path = str(tmp_path / "saved")
        datasets.Dataset.from_list(rows).save_to_disk(path)
    samples, store, settings = _samples(path, tmp_path, tiny_tokenizer(template=CHATML_PLAIN))
    assert settings["data_format"] == "prompt_completion" and settings["loss_on"] == "completion"
    assert settings["chat_template"] == CHATML_PLAIN and len(samples) == 2
    ids, labels, valid, _ = samples.sample(0)
    assert trained_spans(tok, ids[:valid].tolist(), (labels[:valid] != -100).tolist()) == ASSISTANT_TURNS[:1]


def test_prompt_completion_strings_need_no_template(tmp_path):
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "2+2=", "completion": "4"}] * 3)
    samples, store, settings = _samples(path, tmp_path, ByteTokenizer(), seq_len=16)
    assert settings["chat_template"] is None and settings["data_format"] == "prompt_completion"
    assert np.asarray(store.tokens[:6]).tolist() == [ord(c) + 3 for c in "2+2=4"] + [1]
    assert np.asarray(store.trained[:6]).tolist() == [0, 0, 0, 0, 1, 1]
    with pytest.raises(ConfigError, match="the tokenizer .* has no chat template"):  # message lists do need one
        _samples(write_jsonl(tmp_path / "m.jsonl", [{"messages": MULTI_TURN}]), tmp_path, ByteTokenizer())


# ---------------------------------------------------------------- data that trains nothing, ids that do not fit

NO_ASSISTANT = [{"messages": [{"role": "user", "content": f"hello {i}"}]} for i in range(6)]


def test_data_that_trains_nothing_is_refused_naming_the_flags(tok, tmp_path):
    """Conversations without an assistant turn, pre-tokenized labels all -100, a template that does not render the
    messages: each used to train 0 tokens for a loss of 0.0000 and a checkpoint, exit 0."""
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML_QWEN)
    with pytest.raises(ConfigError, match=rf"--dataset .*noassist.jsonl: no target: none of its 6 conversations has "
                                          rf"a token the model is trained to write with --loss_on assistant \(do the "
                                          rf"conversations have assistant turns \(roles other than ShareGPT's are "
                                          rf"named with --role_map\), and does --chat_template {template} "
                                          rf"render them\?\); fix the data or the template, or train every token "
                                          rf"with --loss_on all"):
        _samples(write_jsonl(tmp_path / "noassist.jsonl", NO_ASSISTANT), tmp_path, tok, chat_template=str(template))
    rows = [{"input_ids": [5, 6, 7], "labels": [-100] * 3}] * 4
    with pytest.raises(ConfigError, match=r"none of its 4 conversations has a token the model is trained to write with "
                                          r"--loss_on labels \(every "
                                          r"`labels` entry is -100\); fix the data, or train every token with "
                                          r"--loss_on all"):
        _samples(write_jsonl(tmp_path / "tokens.jsonl", rows), tmp_path, tok)
    template.write_text("{{ bos_token }}{% for m in messages %}{% endfor %}")  # renders no message
    with pytest.raises(ConfigError, match="no target: none of its 2 conversations"):
        _samples(write_jsonl(tmp_path / "chats.jsonl", [{"messages": MULTI_TURN}] * 2), tmp_path,
                 tiny_tokenizer(bos="<s>"), chat_template=str(template))


def test_a_target_only_at_a_conversations_first_token_is_no_target(tmp_path):
    """The first token of a sample (and of each packed conversation) is never a label: a trained mask there
    alone trains nothing."""
    rows = [{"input_ids": [5, 6, 7], "assistant_masks": [1, 0, 0]}] * 3
    with pytest.raises(ConfigError, match="no target"):
        _samples(write_jsonl(tmp_path / "first.jsonl", rows), tmp_path, ByteTokenizer(), packing=True)


def test_a_large_share_of_samples_without_a_target_is_a_warning(tok, tmp_path):
    from ulysses_train.data.sft import untrained_warning

    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML_QWEN)
    path = write_jsonl(tmp_path / "some.jsonl", NO_ASSISTANT[:3] + [{"messages": MULTI_TURN}])
    samples, _, _ = _samples(path, tmp_path, tok, chat_template=str(template))
    assert untrained_warning(samples, path) == (
        f"--dataset {path}: 3 of 4 samples (75%) have no target (conversations without an assistant turn, or whose "
        f"trained tokens were cut by --truncation): they add nothing to training; check --loss_on and "
        f"--chat_template, or filter them out")
    packed, _, _ = _samples(path, tmp_path, tok, chat_template=str(template), packing=True, seq_len=1024)
    assert len(packed) == 1 and untrained_warning(packed, path) is None  # one packed sample, and it trains


@pytest.mark.parametrize("bad, message", [
    (2**32 + 7, r"`input_ids`\[1\] is 4294967303, outside the model's vocabulary \(0 to 99\)"),
    (-1, r"`input_ids`\[1\] is -1, outside the model's vocabulary"),
    (100, r"`input_ids`\[1\] is 100, outside the model's vocabulary \(0 to 99\): tokenize the data with the "
          r"model's tokenizer, or give the --model"),
    (7.5, r"`input_ids`\[1\] is 7.5, not an integer token id"),
])
def test_pre_tokenized_ids_are_checked_at_load_naming_the_row_and_file(tmp_path, bad, message):
    """Ids were cast to uint32 unchecked: 2**32 + 7 trained as 7, 7.5 as 7, and -1 or an id past the vocabulary
    crashed step 1 with an IndexError, only once its row was drawn."""
    path = write_jsonl(tmp_path / "tokens.jsonl", [{"input_ids": [5, 6, 7]}, {"input_ids": [5, bad, 7]}])
    with pytest.raises(ConfigError, match=rf"row 1 of --dataset {path}: {message}"):
        _samples(path, tmp_path, ByteTokenizer(), vocab_size=100)
    ok = write_jsonl(tmp_path / "ok.jsonl", [{"input_ids": [5.0, 6, 99]}] * 2)  # integral floats are ids
    assert np.asarray(_samples(ok, tmp_path, ByteTokenizer(), vocab_size=100)[1].tokens[:3]).tolist() == [5, 6, 99]


# ---------------------------------------------------------------- templates and rows that used to fail silently

USER_MARKED = CHATML_PLAIN.replace("'\\n' + message.content + '<|im_end|>' + '\\n' }}",
                                   "'\\n' }}{% generation %}{{ message.content }}{% endgeneration %}"
                                   "{{ '<|im_end|>\\n' }}")
EVERYTHING_MARKED = "{% generation %}" + CHATML_PLAIN + "{% endgeneration %}"


@pytest.mark.parametrize("tokenizer", ["bpe", "bytes"])
def test_generation_markers_outside_assistant_messages_are_refused_with_the_counts(tok, tokenizer):
    """Markers around the user's turns trained the user's text, and markers around everything trained every token,
    while the log said "loss on assistant"; the growing-prefix renderings say where each message is."""
    t = tok if tokenizer == "bpe" else ByteTokenizer()
    assert USER_MARKED != CHATML_PLAIN and "{% generation %}" in USER_MARKED
    users = sum(len(m["content"]) for m in MULTI_TURN if m["role"] == "user")  # what USER_MARKED marks
    for template, count, where in ((USER_MARKED, str(users), "user"),
                                   (EVERYTHING_MARKED, r"\d+", "system, tool, user")):
        assert any(marker_mask(t, template, MULTI_TURN)[1])
        with pytest.raises(ConfigError, match=rf"markers enclose {count} of the conversation's \d+ characters outside "
                                              rf"the assistant's messages \(in: {where}; \d+ marked characters are "
                                              rf"in assistant messages\): they would be trained"):
            assistant_mask(t, template, MULTI_TURN)
    with pytest.raises(ConfigError, match=r"row 0 of --dataset d.jsonl: --chat_template: its \{% generation %\} "
                                          r"markers enclose"):
        RowEncoder("messages", t, USER_MARKED, "assistant", dataset="d.jsonl")(
            {"messages": [MULTI_TURN[1:2]]}, [0])  # no assistant turn at all: the user's text was trained
    assert trained_spans(t, *assistant_mask(t, CHATML_QWEN, MULTI_TURN)) == ASSISTANT_TURNS  # the right ones pass


def test_content_parts_are_flattened_to_text_and_other_content_is_refused(tok, tmp_path):
    """`[{"type": "text", "text": ...}]` content rendered by a template that prints the content trained the
    list's Python repr (or failed with a TypeError in `content + '<|im_end|>'`); other content failed with a bare
    TypeError, exit 3."""
    parts = [dict(m, content=[{"type": "text", "text": m["content"][:3]}, {"type": "text", "text": m["content"][3:]}])
             for m in MULTI_TURN]
    printing = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    for template in (CHATML_QWEN, printing):
        as_parts = _encode("messages", tok, [{"messages": parts}], "all", template)
        assert as_parts == _encode("messages", tok, [{"messages": MULTI_TURN}], "all", template)
        assert "'type'" not in tok.decode(as_parts[0][0])
    path = write_jsonl(tmp_path / "parts.jsonl", [{"messages": parts}] * 2)  # through Arrow: absent keys are None
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML_QWEN)
    samples, store, _ = _samples(path, tmp_path, tok, chat_template=str(template))
    assert trained_spans(tok, store.tokens[:len(store.tokens) // 2], store.trained[:len(store.tokens) // 2]) == \
        ASSISTANT_TURNS
    for content, message in (([{"type": "image", "url": "cat.png"}], r"`messages`\[1\]\.content\[0\] is a part of "
                                                                     r"type 'image': content parts must be text"),
                             (5, r"`messages`\[1\]\.content is 5 \(int\): content must be text"),
                             ({"text": "hi"}, r"`messages`\[1\]\.content is \{'text': 'hi'\} \(dict\)"),
                             ([{"type": "text", "text": 7}],
                              r"`messages`\[1\]\.content\[0\] is a text part whose text is 7")):
        rows = [{"messages": MULTI_TURN}, {"messages": [MULTI_TURN[0], dict(MULTI_TURN[1], content=content)]}]
        with pytest.raises(ConfigError, match=r"row 1 of --dataset d.jsonl: " + message):
            RowEncoder("messages", tok, CHATML_QWEN, "assistant", dataset="d.jsonl")(
                {"messages": [r["messages"] for r in rows]}, [0, 1])


@pytest.mark.parametrize("template, message", [
    ("{{ 1/0 }}", "ZeroDivisionError: division by zero"),
    ("{% include 'other.jinja' %}", "TypeError: no loader for this environment specified"),
    ("{% for i in range(10**9) %}x{% endfor %}", "OverflowError: Range too big"),
    ("{{ messages[0].content.no_such_method() }}", "UndefinedError"),
])
def test_a_template_that_raises_is_one_error_naming_the_row_file_and_flag(tok, tmp_path, template, message):
    """Each failed with its own bare exception (exit 3) from inside datasets.map."""
    path = tmp_path / "t.jinja"
    path.write_text(template)
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": MULTI_TURN}])
    with pytest.raises(ConfigError, match=rf"^row 0 of --dataset {data}: --chat_template {path} fails on the "
                                          rf"conversation: {message}"):
        _samples(data, tmp_path, tok, chat_template=str(path))


def test_a_template_that_never_ends_is_stopped_naming_the_row(tok, tmp_path, monkeypatch):
    """Nested range loops held the run at "rendering 0/60" for ever (each loop is within the sandbox's limit)."""
    from ulysses_train.data import chat

    monkeypatch.setattr(chat, "RENDER_TIMEOUT_S", 1.0)
    path = tmp_path / "slow.jinja"
    path.write_text("{% for m in messages %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                    "{% endfor %}{% endfor %}")
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": MULTI_TURN}] * 3)
    with pytest.raises(ConfigError, match=rf"row 0 of --dataset {data}: --chat_template {path} did not finish "
                                          rf"rendering the conversation within 1 s"):
        _samples(data, tmp_path, tok, chat_template=str(path))


def test_rows_without_columns_name_the_flag(tmp_path):
    """Rows that are all `{}` failed inside datasets with `ValueError: Instruction "train" corresponds to no data!`
    (a traceback, exit 3)."""
    from ulysses_train.data.load import _Loader
    from ulysses_train.data.mixture import dataset_entries
    from ulysses_train.train.config.train_config import TrainConfig

    path = write_jsonl(tmp_path / "empty_rows.jsonl", [{}, {}])
    settings = TrainConfig.from_flags({"tokenizer": "bytes", "data_cache_dir": str(tmp_path / "c")}).data_settings()
    assert _Loader(settings, dataset_entries(str(path), "dataset"), "train", 64, 259, print, "dataset").load() == (
        f"--dataset {path} holds no columns (every row empty?): give rows with the columns of a format of "
        f"docs/data.md")


def test_empty_dataset_files_name_the_flag(tmp_path):
    """A 0-byte .jsonl failed with a bare StopIteration inside datasets (exit 3), for --dataset and --eval_dataset."""
    from ulysses_train.data.load import _Loader
    from ulysses_train.data.mixture import dataset_entries
    from ulysses_train.train.config.train_config import TrainConfig

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "a.jsonl").write_text("")
    (tmp_path / "folder" / "b.jsonl").write_text("")
    settings = TrainConfig.from_flags({"tokenizer": "bytes"}).data_settings()
    for flag in ("dataset", "eval_dataset"):
        assert _Loader(settings, dataset_entries(str(empty), flag), "train", 64, 259, print, flag).load() == (
            f"--{flag} {empty} is empty (0 bytes): nothing to read; give a file with rows")
    folder = dataset_entries(str(tmp_path / "folder"), "dataset")
    assert _Loader(settings, folder, "train", 64, 259, print, "dataset").load() == (
        f"--dataset {tmp_path / 'folder'}: its 2 file(s) are empty (0 bytes): nothing to read; give a file with rows")
