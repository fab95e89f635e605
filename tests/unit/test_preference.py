"""Preference training, in one process: the formats (TRL's, with the implicit prompt split as TRL splits it), the
pairs as two documents of a packed row, --max_length and --truncation, the errors that name a pair and a flag, and
the losses (DPO sigmoid/ipo/hinge, SimPO, ORPO) with their gradients and metrics against TRL's own trainers on the
same batch and weights: our fused two-pass head (and --loss plain) on hidden states of the packed row, TRL's
DPOTrainer / CPOTrainer / ORPOTrainer code on the pairs as padded rows."""

import copy
from types import SimpleNamespace

import pytest
import torch

from tests.sft_fixtures import CHATML_QWEN, chat_folder, trained_spans, write_jsonl
from ulysses_train.errors import ConfigError
from ulysses_train.sp.sharding import IGNORE_INDEX, shift_labels

QUESTIONS = ["What is two plus two?", "What is one plus three?", "Where did the cat sit?"]
GOOD, BAD = [" Four.", " Four, I am fine.", " The cat sat on the mat."], [" Seven.", " Two.", " It sat there?"]


def _string_rows():
    return [{"prompt": q, "chosen": c, "rejected": r} for q, c, r in zip(QUESTIONS, GOOD, BAD)]


def _message_rows(implicit=False):
    rows = []
    for q, c, r in zip(QUESTIONS, GOOD, BAD):
        user = [{"role": "user", "content": q}]
        chosen, rejected = [{"role": "assistant", "content": c.strip()}], [{"role": "assistant", "content": r.strip()}]
        rows.append({"chosen": user + chosen, "rejected": user + rejected} if implicit else
                    {"prompt": user, "chosen": chosen, "rejected": rejected})
    return rows


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return chat_folder(tmp_path_factory.mktemp("preference"))


def _store(files, rows, name, template=False):
    from ulysses_train.data.corpus import load_corpus, load_tokenizer
    from ulysses_train.data.preference import preference_store

    path = write_jsonl(files["folder"] / f"{name}.jsonl", rows)
    return preference_store(load_corpus(path, "train", False), load_tokenizer(files["tokenizer"], None),
                            method="dpo", dataset=path, split="train", cache_dir=files["cache"],
                            chat_template=files["template"] if template else None)[0]


def _docs(store):
    ends = list(store.doc_starts[1:]) + [len(store.tokens)]
    return [(store.tokens[s:e].tolist(), store.trained[s:e].tolist()) for s, e in zip(store.doc_starts, ends)]


def _samples(store, seq_len=256, max_length=None, truncation="error", packing=False, max_prompt_length=None):
    from ulysses_train.data.pair_packing import PreferenceSamples

    return PreferenceSamples(store, seq_len, max_length or seq_len // 2, truncation, packing, 0, dataset="x",
                             max_prompt_length=max_prompt_length)


# ---------------------------------------------------------------- formats


def test_string_pairs_explicit_and_implicit_as_trl_splits_them(files):
    from trl.data_utils import extract_prompt

    from ulysses_train.data.chat import encode
    from ulysses_train.data.corpus import load_tokenizer
    from ulysses_train.data.preference import implicit_prompt

    tokenizer = load_tokenizer(files["tokenizer"], None)
    explicit = _docs(_store(files, _string_rows(), "strings"))
    implicit_rows = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}
                     for r in _string_rows()]
    assert [extract_prompt(dict(r)) for r in implicit_rows] == _string_rows()  # TRL's split is the explicit one
    for chosen, rejected in [("a b c", "a b d"), ("Four", "Five"), ("x ", "x y"), ("same start", "same end")]:
        trl = extract_prompt({"chosen": chosen, "rejected": rejected})
        assert implicit_prompt(chosen, rejected) == (trl["prompt"], trl["chosen"], trl["rejected"])
    assert _docs(_store(files, implicit_rows, "implicit_strings")) == explicit
    eos = tokenizer.eos_token_id
    for i, row in enumerate(_string_rows()):  # prompt, then the completion tokenized on its own, then EOS, scored
        for side, (ids, trained) in zip(("chosen", "rejected"), explicit[2 * i:2 * i + 2]):
            head, tail = encode(tokenizer, row["prompt"]), encode(tokenizer, row[side]) + [eos]
            assert ids == head + tail and trained == [0] * len(head) + [1] * len(tail)


def test_conversational_pairs_score_the_completion_as_sft_and_tokenize_as_trl(files):
    from trl.data_utils import extract_prompt

    from ulysses_train.data.corpus import load_tokenizer

    tokenizer = load_tokenizer(files["tokenizer"], None)
    explicit = _docs(_store(files, _message_rows(), "messages", template=True))
    implicit = _message_rows(implicit=True)
    assert [extract_prompt(dict(r)) for r in implicit] == _message_rows()
    assert _docs(_store(files, implicit, "implicit_messages", template=True)) == explicit
    for i, row in enumerate(_message_rows()):
        for side, (ids, trained) in zip(("chosen", "rejected"), explicit[2 * i:2 * i + 2]):
            # TRL's tokens: the prompt with the generation prompt, then prompt + completion rendered
            whole = tokenizer.apply_chat_template(row["prompt"] + row[side], chat_template=CHATML_QWEN,
                                                  tokenize=True, return_dict=True)["input_ids"]
            head = tokenizer.apply_chat_template(row["prompt"], chat_template=CHATML_QWEN, tokenize=True,
                                                 add_generation_prompt=True, return_dict=True)["input_ids"]
            assert ids == list(whole) and ids[:len(head)] == list(head)
            # scored: the answer and its end-of-turn token, not the newline after it (TRL scores that newline too)
            assert trained_spans(tokenizer, ids, trained) == [row[side][0]["content"] + "<|im_end|>"]
            assert trained == [0] * len(head) + [1] * (len(ids) - len(head) - 1) + [0]
            assert tokenizer.decode(ids[-1:]) == "\n"


def test_bad_rows_are_errors_naming_the_file_row_and_field(files):
    """Each bad row is named by --dataset, row and field, with the cause; the first row sets the format, so a file
    whose later rows switch to message lists, or an int among strings, is named where it switches (and a strings
    dataset needs no chat template: this tokenizer has none)."""
    rows, messages = _string_rows(), _message_rows()
    null_content = dict(messages[1], rejected=[{"role": "assistant", "content": None}])
    cases = {"empty_chosen": (rows[:1] + [dict(rows[1], chosen="")], False,
                              r"row 1: `chosen` has an empty completion"),
             "no_prompt": ([{"prompt": "", "chosen": "Four.", "rejected": "Five."}], False,
                           r"row 0: `prompt` is empty"),
             "mixed": ([{"prompt": "Hi?", "chosen": [{"role": "assistant", "content": "Yo."}], "rejected": "No."}],
                       False, r"row 0: `prompt` is a str \('Hi\?'\), but the first row's `chosen` is a message list"),
             "switch": (rows * 7 + messages * 7, False, r"row 21: `prompt` is a message list, but the first row's "
                                                        r"`chosen` is a string: every value must be a string"),
             "int": (rows + [dict(rows[0], chosen=5)], False, r"row 3: `chosen` is an int \(5\), but the first "
                                                               r"row's `chosen` is a string"),
             "null_content": (messages[:1] * 3 + [null_content], True,
                              r"row 3: `rejected\[0\].content` is null: every message needs a string `content`"),
             "no_role": (messages[:1] + [dict(messages[0], chosen=[{"content": "Yo."}])], True,
                         r"row 1: `chosen\[0\].role` is null"),
             "strings_after_messages": (messages[:2] + [rows[0]], True, r"row 2: `prompt` is a str \('What is two "
                                                                         r"plus two\?'\), but the first row's "
                                                                         r"`chosen` is a message list"),
             "null": (rows + [dict(rows[0], rejected=None)], False, r"row 3: `rejected` is null"),
             "columns": ([{"prompt": "Hi?", "completion": "Yo."}], False, r"--method dpo .*`chosen` and `rejected`")}
    for name, (data, template, message) in cases.items():
        with pytest.raises(ConfigError, match=rf"(--dataset \S*bad_{name}.jsonl )?{message}"):
            _store(files, data, f"bad_{name}", template=template)


def test_pairs_whose_sides_are_the_same_are_dropped_with_a_count_or_refused(files):
    """A pair with chosen == rejected has nothing to learn: some are left out of the rows (counted, their rows
    named in the log line); a dataset of only such pairs is refused naming its first rows."""
    rows = _string_rows()
    same = [{"prompt": "Hi?", "chosen": " Yo.", "rejected": " Yo."}, {"chosen": "a b", "rejected": "a b"}]
    samples = _samples(_store(files, [rows[0], same[0], rows[1], same[0], rows[2]], "some_same"), 256,
                       packing=True)
    assert samples.identical.tolist() == [False, True, False, True, False]
    assert sorted(p for i in range(len(samples)) for p in samples.pairs(i)) == [0, 2, 4]
    assert "3 pairs" in samples.describe() and \
        "2 left out: their chosen and rejected completions are the same (rows 1, 3)" in samples.describe()
    unpacked = _samples(_store(files, [rows[0], same[0], rows[1], same[0], rows[2]], "some_same"), 256)
    assert [unpacked.pairs(i) for i in range(len(unpacked))] == [[0], [2], [4]]
    for name, data in (("all_same", [same[0]] * 7), ("all_same_implicit", [same[1]] * 2)):
        store = _store(files, data, name)
        with pytest.raises(ConfigError, match=rf"--dataset x: every one of its {len(data)} pair\(s\) has the same "
                                              rf"chosen and rejected completion \(rows 0, 1.*\): such a pair has no "
                                              rf"preference to learn"):
            _samples(store, 256)


# ---------------------------------------------------------------- layout, truncation


def test_pairs_are_two_documents_of_a_row_packed_whole(files):
    import numpy as np

    from ulysses_train.data.pair_packing import preference_batch

    store = _store(files, _string_rows() * 3, "nine")
    docs = _docs(store)
    one = _samples(store, 64)
    assert len(one) == 9 and all(one.pairs(i) == [i] for i in range(9))
    packed = _samples(store, 64, packing=True)
    assert len(packed) < 9 and sorted(p for i in range(len(packed)) for p in packed.pairs(i)) == list(range(9))
    reference = np.arange(18, dtype=np.float64).reshape(9, 2)
    rows = [packed.sample(i) for i in range(2)]
    batch = preference_batch(rows, reference)
    pair_ids = [p for r in rows for p in r.pairs]
    assert batch["pair_ids"].tolist() == pair_ids and batch["conversations"] == len(pair_ids)
    assert batch["reference"].tolist() == reference[pair_ids].tolist()
    k = 0
    for r, row in enumerate(rows):
        start = 0
        for j, pair in enumerate(row.pairs):  # chosen then rejected, whole, positions restarting at each
            for side in (0, 1):
                ids, trained = docs[2 * pair + side]
                n = len(ids)
                assert batch["input_ids"][r, start:start + n].tolist() == ids
                assert batch["position_ids"][r, start:start + n].tolist() == list(range(n))
                seg = batch["segments"][r, start:start + n]
                assert seg.tolist() == [2 * k + side if t else IGNORE_INDEX for t in trained]
                assert int(batch["scored"][k, side]) == sum(trained) and not trained[0]
                start += n
            k += 1
        assert row.docs[:-1] == [len(docs[2 * p + s][0]) for p in row.pairs for s in (0, 1)]
        assert batch["segments"][r, start:].eq(IGNORE_INDEX).all()  # the padding scores nothing


def test_max_length_and_truncation(files):
    long_prompt = "What is two plus two? " * 6
    rows = [{"prompt": long_prompt, "chosen": " Four.", "rejected": " Five, I am fine."}] + _string_rows()[:1]
    store = _store(files, rows, "long")
    (c, tc), (r, tr) = _docs(store)[:2]
    limit = len(r) - 5
    with pytest.raises(ConfigError, match=r"1 preference pair\(s\) have a side .* longer than --max_length "
                                          rf"{limit} \(row 0 of --dataset x; the longest has {len(r)} tokens\): "
                                          r"raise --max_length .*"
                                          r"--truncation left .*--truncation right"):
        _samples(store, 256, limit)
    left = _samples(store, 256, limit, "left").sample(0)  # the prompt's start, 5 tokens from both sides
    assert left.ids[:len(c) - 5].tolist() == c[5:] and left.ids[len(c) - 5:len(c) + len(r) - 10].tolist() == r[5:]
    assert int((left.segments >= 0).sum()) == sum(tc) + sum(tr)  # the completions whole
    right = _samples(store, 256, limit, "right")
    assert right.sample(0).ids[:len(c)].tolist() == c and right.kept[0].tolist() == [len(c), limit]
    assert right.truncated == 1 and "1 cut (--truncation right)" in right.describe()
    prompt = tc.index(1)
    with pytest.raises(ConfigError, match=r"--truncation left cuts only prompts; raise --max_length or use "
                                          r"--truncation right"):
        _samples(store, 256, len(r) - prompt, "left")
    with pytest.raises(ConfigError, match=r"have a prompt of at least --max_length .*--truncation right would leave "
                                          r"no completion"):
        _samples(store, 256, prompt, "right")
    with pytest.raises(ConfigError, match=r"--seq_len 100 holds both sides of a pair: it must be at least 2 x "
                                          r"--max_length \(60\)"):
        _samples(store, 100, 60)
    # --max_prompt_length (TRL's): a longer prompt keeps its last tokens, on both sides, before --max_length
    short = _samples(store, 256, len(r), max_prompt_length=prompt - 4)
    assert short.head.tolist() == [4, 0] and short.truncated == 1 and "--max_prompt_length" in short.describe()
    row = short.sample(0)
    assert row.ids[:len(c) - 4].tolist() == c[4:] and row.ids[len(c) - 4:len(c) + len(r) - 8].tolist() == r[4:]
    both = _samples(store, 256, len(r) - 6, "right", max_prompt_length=prompt - 4)  # then the rejected end: 2 more
    assert both.kept[0].tolist() == [len(c) - 4, len(r) - 6] and both.sample(0).ids[:len(c) - 4].tolist() == c[4:]


def test_flags_are_checked_before_anything_runs():
    from ulysses_train.train.config.config_file import parse_args

    cases = [(["--beta", "0.2"], r"--beta applies to preference training: give --method dpo, simpo or orpo"),
             (["--method", "dpo"], r"--method dpo trains on preference pairs: give --dataset"),
             (["--method", "simpo", "--dataset", "x", "--loss_type", "ipo"],
              r"--loss_type ipo applies to --method dpo"),
             (["--method", "dpo", "--dataset", "x", "--simpo_gamma", "1"], r"--simpo_gamma applies to --method simpo"),
             (["--method", "dpo", "--dataset", "x", "--max_length", "600"], r"at least 2 x --max_length \(600\)"),
             (["--method", "dpo", "--dataset", "x", "--max_length", "64", "--max_prompt_length", "64"],
              r"--max_prompt_length 64 leaves no token of completion in a side of --max_length 64"),
             (["--max_prompt_length", "8"], r"--max_prompt_length applies to preference training"),
             (["--method", "dpo", "--dataset", "x", "--beta", "0"], r"--beta must be positive")]
    for argv, message in cases:
        cfg, _ = parse_args(argv)
        with pytest.raises(ConfigError, match=message):
            cfg.validate()


def test_method_and_packing_follow_from_the_data_unless_given(files):
    """A dataset of chosen/rejected columns trains DPO without --method (the line for the log says so), with TRL's
    --max_length and --max_prompt_length, and packed; a flag that says otherwise wins: --method, an SFT format flag,
    --packing false; SFT data stays SFT. TRL's truncation_mode reads as --truncation."""
    from ulysses_train.train.config.config_file import parse_args
    from ulysses_train.train.preference.pairs import resolve_preference

    pairs = write_jsonl(files["folder"] / "resolve_pairs.jsonl", _string_rows())
    implicit = write_jsonl(files["folder"] / "resolve_implicit.jsonl", _message_rows(implicit=True))
    chats = write_jsonl(files["folder"] / "resolve_chats.jsonl", [{"messages": r["chosen"]} for r in
                                                                  _message_rows(implicit=True)])

    def resolved(*argv):
        cfg, explicit = parse_args(list(argv))
        note = resolve_preference(cfg, explicit)
        cfg.validate()
        return cfg.pref.method, cfg.data.packing, note

    method, packing, note = resolved("--dataset", pairs, "--max_length", "200", "--max_prompt_length", "50")
    assert (method, packing) == ("dpo", True)
    assert note == (f"--method dpo: --dataset {pairs} holds preference pairs (columns `chosen` and `rejected`); "
                    f"give --method simpo, orpo or sft to train otherwise")
    assert resolved("--dataset", implicit)[:2] == ("dpo", True)
    assert resolved("--dataset", pairs, "--packing", "false")[:2] == ("dpo", False)
    assert resolved("--dataset", pairs, "--method", "simpo")[:2] == ("simpo", True)
    assert resolved("--dataset", pairs, "--method", "sft", "--data_format", "text", "--text_column", "prompt") == \
        ("sft", False, None)
    assert resolved("--dataset", pairs, "--text_column", "prompt") == ("sft", False, None)
    assert resolved("--dataset", chats) == ("sft", False, None)
    cfg, _ = parse_args(["--dataset", pairs, "--truncation_mode", "keep_start"])
    assert cfg.sft.truncation == "right"
    with pytest.raises(ConfigError, match="expected keep_start or keep_end, got 'middle'"):
        parse_args(["--dataset", pairs, "--truncation_mode", "middle"])


def test_ref_model_is_checked_before_the_model_is_built(tmp_path):
    """--ref_model: a path that is not there, and a model of another shape (from its config alone), are refused
    before any weight is loaded."""
    from transformers import AutoConfig

    from tests.models import TINY
    from ulysses_train.train.config.config_file import parse_args
    from ulysses_train.train.preference.reference_logps import check_reference_config
    from ulysses_train.train.run.preflight import preflight

    cfg, _ = parse_args(["--method", "dpo", "--dataset", str(tmp_path), "--ref_model", str(tmp_path / "none")])
    with pytest.raises(ConfigError, match=rf"--ref_model {tmp_path / 'none'}: no such file or folder"):
        preflight(cfg)
    ours = AutoConfig.for_model("qwen3", **TINY["qwen3"])
    AutoConfig.for_model("qwen3", **dict(TINY["qwen3"], hidden_size=2 * ours.hidden_size)).save_pretrained(
        tmp_path / "wide")
    ours.save_pretrained(tmp_path / "same")
    check_reference_config(str(tmp_path / "same"), ours)
    with pytest.raises(ConfigError, match=rf"--ref_model {tmp_path / 'wide'} is not a model of the policy's "
                                          rf"architecture and shape \(hidden_size {2 * ours.hidden_size} against "
                                          rf"{ours.hidden_size}\)"):
        check_reference_config(str(tmp_path / "wide"), ours)


# ---------------------------------------------------------------- the losses against TRL's trainers


def _model():
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.models import TINY

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3", **dict(TINY["qwen3"], vocab_size=512))
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


@pytest.fixture(scope="module")
def pair_batch(files):
    """Two rows of the message pairs, packed, with reference log-probs unlike the policy's."""
    import numpy as np

    from ulysses_train.data.pair_packing import preference_batch

    samples = _samples(_store(files, _message_rows() * 2, "six", template=True), 512, packing=True)
    reference = -30 + 4 * np.random.default_rng(0).standard_normal((samples.num_pairs, 2))
    return preference_batch([samples.sample(i) for i in range(len(samples))][:2], reference)


def _ours(model, batch, spec, fused):
    """Our head on the packed rows' hidden states (each document through the backbone on its own, positions from
    0: what the packed attention computes), fused with chunks of 3 rows or plain; the loss, grads and metrics."""
    from ulysses_train.levers.preference_loss import PreferenceObjective, step_means

    model.zero_grad()
    rows = []
    for r, lengths in enumerate(batch["docs"]):
        starts = [sum(lengths[:k]) for k in range(len(lengths))]
        rows.append(torch.cat([model.model(input_ids=batch["input_ids"][r, s:s + n][None]).last_hidden_state[0]
                               for s, n in zip(starts, lengths)]))
    labels, segments = (shift_labels(batch["input_ids"], batch[k]) for k in ("labels", "segments"))
    objective = PreferenceObjective(spec, segments, batch["scored"], batch.get("reference"),
                                    pairs_total=len(batch["scored"]),
                                    chosen_tokens_total=float(batch["scored"][:, 0].sum()))
    head = SimpleNamespace(bias=None, fused=fused, chunk_size=3, softcap=None)
    loss = objective(torch.stack(rows), model.lm_head.weight, labels, head)
    loss.backward()
    scored = batch["scored"]
    stats = step_means(objective.stats, len(scored), float(scored[:, 0].sum()), float(scored.sum()))
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, stats


def _padded(seqs, value):
    width = max(len(s) for s in seqs)
    return torch.stack([torch.cat([s, s.new_full((width - len(s),), value)]) for s in seqs])


def _assert_same(ours, theirs, keys=()):
    loss, grads, stats = ours
    assert loss == pytest.approx(theirs[0], rel=1e-5, abs=1e-6)
    if theirs[1] is not None:
        for name, grad in theirs[1].items():
            assert (grads[name] - grad).norm() <= 1e-5 * grad.norm(), name  # fp32 rounding: ~5e-7 here
    for key in keys:
        assert stats[key] == pytest.approx(theirs[2][key], rel=1e-5, abs=1e-6), key


@pytest.fixture(scope="module")
def dpo_trainer(files, tmp_path_factory):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from ulysses_train.data.corpus import load_tokenizer

    args = DPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), report_to="none", use_cpu=True, bf16=False,
                     max_length=None, precompute_ref_log_probs=True, beta=0.3, gradient_checkpointing=False)
    return DPOTrainer(model=_model(), args=args, processing_class=load_tokenizer(files["tokenizer"], None),
                      train_dataset=Dataset.from_dict({k: [v] for k, v in _string_rows()[0].items()}))


def test_dpo_loss_gradients_and_metrics_equal_trls_dpo_trainer(pair_batch, dpo_trainer):
    from ulysses_train.levers.preference_loss import STATS, PreferenceSpec
    from ulysses_train.train.preference.pairs import unpack_pairs

    pairs = unpack_pairs(pair_batch)
    seqs = [p["prompt_chosen"] for p in pairs] + [p["prompt_rejected"] for p in pairs]
    masks = [p["chosen_mask"] for p in pairs] + [p["rejected_mask"] for p in pairs]
    inputs = {"input_ids": _padded(seqs, 0), "attention_mask": _padded([torch.ones_like(s) for s in seqs], 0),
              "completion_mask": _padded(masks, 0),  # TRL's: 1 on the completion, which is what we score
              "ref_chosen_logps": torch.stack([p["ref"][0] for p in pairs]).float(),
              "ref_rejected_logps": torch.stack([p["ref"][1] for p in pairs]).float()}
    trainer, model = dpo_trainer, dpo_trainer.model
    trainer.precompute_ref_logps = True  # the reference's log-probs come with the batch, as ours do
    ours_model = copy.deepcopy(model)
    for loss_type in ("sigmoid", "ipo", "hinge"):
        trainer.loss_types, trainer.loss_weights = [loss_type], [1.0]
        model.zero_grad()
        trainer._metrics["train"].clear()
        loss = trainer._compute_loss(model, inputs, False)
        loss.backward()
        theirs = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()},
                  {k: v[-1] for k, v in trainer._metrics["train"].items()})
        spec = PreferenceSpec("dpo", beta=0.3, loss_type=loss_type)
        for fused in (True, False) if loss_type == "sigmoid" else (True,):  # --loss plain too
            _assert_same(_ours(ours_model, pair_batch, spec, fused), theirs, STATS)


def _trl_self(cls, **attrs):
    """The attributes and methods of a TRL CPO/ORPO trainer that its loss reads: TRL's own code on a batch."""
    fake = SimpleNamespace(is_encoder_decoder=False, aux_loss_enabled=False, label_smoothing=0.0, **attrs,
                           accelerator=SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x))
    for name in ("concatenated_forward", "get_batch_loss_metrics", "cpo_loss", "odds_ratio_loss"):
        if hasattr(cls, name):
            setattr(fake, name, getattr(cls, name).__get__(fake))
    fake.concatenated_inputs, fake.get_batch_logps = cls.concatenated_inputs, cls.get_batch_logps
    return fake


def _trl_rows(pairs) -> dict:
    batch = {}
    for side in ("chosen", "rejected"):
        ids, masks = [p[f"prompt_{side}"] for p in pairs], [p[f"{side}_mask"] for p in pairs]
        batch[f"{side}_input_ids"] = _padded(ids, 0)
        batch[f"{side}_attention_mask"] = _padded([torch.ones_like(s) for s in ids], 0)
        batch[f"{side}_labels"] = _padded([torch.where(m.bool(), s, IGNORE_INDEX) for s, m in zip(ids, masks)],
                                          IGNORE_INDEX)
    return batch


def test_simpo_and_orpo_equal_trls_cpo_and_orpo_trainers(pair_batch):
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    from ulysses_train.levers.preference_loss import ORPO_STATS, PreferenceSpec
    from ulysses_train.levers.preference_loss import PAIR_STATS as STATS
    from ulysses_train.train.preference.pairs import unpack_pairs

    model = _model()
    batch = _trl_rows(unpack_pairs(pair_batch))
    # SimPO as published: TRL's CPOTrainer with loss_type="simpo" and cpo_alpha=0; loss, gradients and metrics
    cpo = _trl_self(CPOTrainer, beta=2.0, loss_type="simpo", simpo_gamma=0.7, cpo_alpha=0.0, alpha=0.0,
                    pad_token_id=0)
    loss, metrics = cpo.get_batch_loss_metrics(model, batch)
    loss.backward()
    theirs = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, metrics)
    ours_model = copy.deepcopy(model)
    for fused in (True, False):
        _assert_same(_ours(ours_model, pair_batch, PreferenceSpec("simpo", 2.0, simpo_gamma=0.7), fused), theirs,
                     STATS)
    # ORPO: TRL's odds ratio and metrics; its NLL covers the prompt too, ours (the paper's) the completion only
    orpo = _trl_self(ORPOTrainer, beta=0.25, padding_value=0)
    with torch.no_grad():
        loss, metrics = orpo.get_batch_loss_metrics(model, batch)
    loss_ours, _, stats = _ours(ours_model, pair_batch, PreferenceSpec("orpo", 0.25), fused=True)
    odds_ratio_term = (loss_ours - stats["nll_loss"], None, stats)
    _assert_same(odds_ratio_term, (loss.item() - metrics["nll_loss"], None, metrics),
                 [k for k in STATS + ORPO_STATS if k != "nll_loss"])
    from ulysses_train.train.verify.pairs import side_logp

    with torch.no_grad():  # our NLL: the chosen completions' tokens, plain transformers on each whole sequence
        chosen = sum(side_logp(model, p["prompt_chosen"], p["chosen_mask"], torch.float64)
                     for p in unpack_pairs(pair_batch))
    assert stats["nll_loss"] == pytest.approx(-float(chosen) / float(pair_batch["scored"][:, 0].sum()), rel=1e-5)


@pytest.mark.slow
def test_planner_counts_a_pair_row_and_the_reference_pass():
    from ulysses_train.levers.machine_constants import Constants
    from ulysses_train.tools.plan_command import Machine, command, evaluate

    machine, tokens = Machine(1, 140 * 2**30, 128 * 2**30), 65536
    flags = ["--model_config", "qwen3-4b", "--seq_len", str(tokens), "--loss_kernel", "ours", "--dataset", "x"]
    sft = evaluate(command(flags, machine), machine, Constants())
    dpo = evaluate(command(flags + ["--method", "dpo"], machine), machine, Constants())
    # two documents of 32k tokens: half the query-key pairs of one of 64k; the head's logits made twice
    assert dpo.time["parts"]["attention"] == pytest.approx(sft.time["parts"]["attention"] / 2, rel=1e-9)
    assert dpo.time["parts"]["loss"] == pytest.approx(sft.time["parts"]["loss"] * 8 / 6, rel=1e-9)
    assert dpo.memory["gpu"]["loss"] - sft.memory["gpu"]["loss"] == 2 * tokens * 2560 * 2 + 24 * tokens
    assert 0 < dpo.time["reference_pass_row_s"] < dpo.time["total"] / 2  # a forward alone
