"""Chat templates and a tiny tokenizer for the SFT tests, written here (no hub): ChatML as Qwen2.5 uses it, with
`{% generation %}` markers and without, a Llama-3 template, a Mistral-style `[INST]` template, and one whose
renderings do not grow by whole turns (Qwen3-style: earlier assistant turns lose their reasoning)."""

import json

CHATML_QWEN = ("""{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' }}{% generation %}{{- message.content + '<|im_end|>' }}"""
"""{% endgeneration %}{{- '\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
""")
CHATML_PLAIN = CHATML_QWEN.replace("{% generation %}", "").replace("{% endgeneration %}", "")

LLAMA3 = ("""{{- bos_token }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + """
"""'<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
""")

MISTRAL = """{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}
        {{- '[INST] ' + message['content'] + ' [/INST]' }}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- endif %}
{%- endfor %}
"""

# earlier assistant turns are rendered without their <think> block, the last one with it: renderings of growing
# prefixes are not prefixes of the whole conversation, and there are no markers
REASONING = CHATML_PLAIN.replace(
    "{{- '<|im_start|>' + message.role + '\\n' }}{{- message.content + '<|im_end|>' }}",
    "{{- '<|im_start|>' + message.role + '\\n' }}{{- (message.content if loop.last else "
    "message.content.split('</think>')[-1]) + '<|im_end|>' }}")
assert REASONING != CHATML_PLAIN

# ChatML with markers whose assistant turns render their tool calls (what a tool-using template does with them)
CHATML_TOOLS = """{%- for message in messages %}
    {%- if message.role == "assistant" %}
        {{- '<|im_start|>assistant\n' }}{% generation %}{{- message.content or '' }}
        {%- for call in message.tool_calls or [] %}
            {{- '<tool_call>' + call.function.name + ' ' + (call.function.arguments | tojson) + '</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>' }}{% endgeneration %}{{- '\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# MULTI_TURN in ShareGPT's layout, with LLaMA-Factory's tool roles, and the messages it stands for
SHAREGPT = [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "What is two plus two?"},
            {"from": "gpt", "value": "Four."}, {"from": "human", "value": "And the cat?"},
            {"from": "function_call", "value": '{"name": "where", "arguments": {"animal": "cat"}}'},
            {"from": "observation", "value": "sat on the mat"}, {"from": "gpt", "value": "It sat on the mat."}]
SHAREGPT_AS_MESSAGES = [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "What is two plus two?"},
                        {"role": "assistant", "content": "Four."}, {"role": "user", "content": "And the cat?"},
                        {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                            "name": "where", "arguments": {"animal": "cat"}}}]},
                        {"role": "tool", "content": "sat on the mat"},
                        {"role": "assistant", "content": "It sat on the mat."}]

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>"]
CORPUS = ["What is two plus two? Four. Hello there, how are you? I am fine, thank you. The cat sat on the mat. "
          "Add the numbers and answer with the sum. system user assistant tool response"] * 4

MULTI_TURN = [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "What is two plus two?"},
              {"role": "assistant", "content": "Four."},
              {"role": "user", "content": "And the cat?"},
              {"role": "tool", "content": "sat on the mat"},
              {"role": "assistant", "content": "It sat on the mat."}]


NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve"]


def arithmetic_chats(n=48):
    """`n` conversations of sums in words ("What is two plus three?" "Five."), a third of them with a second turn,
    as {"messages": [...]} rows."""
    rows = []
    for i in range(n):
        a, b = i % 7, (3 * i) % 6
        messages = [{"role": "user", "content": f"What is {NUMBER_WORDS[a]} plus {NUMBER_WORDS[b]}?"},
                    {"role": "assistant", "content": f"{NUMBER_WORDS[a + b].capitalize()}."}]
        if i % 3 == 0:  # some multi-turn
            messages += [{"role": "user", "content": "And plus one?"},
                         {"role": "assistant", "content": f"{NUMBER_WORDS[a + b + 1].capitalize()}."}]
        rows.append({"messages": messages})
    return rows


def tiny_tokenizer(bos="<|begin_of_text|>", eos="<|im_end|>", template=None):
    """A byte-level BPE of about 400 ids (the tiny model has 512) with ChatML's, Llama-3's and Mistral's special
    tokens, trained in milliseconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos,
                                        pad_token="<|endoftext|>")
    tokenizer.chat_template = template
    return tokenizer


def trained_spans(tokenizer, ids, mask) -> list[str]:
    """The decoded text of each run of trained tokens."""
    spans, run = [], []
    for token, m in zip(list(ids) + [None], list(mask) + [0]):
        if m:
            run.append(token)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    return spans


def chat_folder(folder) -> dict:
    """`folder` with the tiny tokenizer saved in it and the ChatML template beside it: the paths the SFT and
    preference tests pass as --tokenizer and --chat_template, and where their token store goes (--data_cache_dir)."""
    tiny_tokenizer().save_pretrained(folder / "tokenizer")
    (folder / "chatml.jinja").write_text(CHATML_QWEN)
    return {"folder": folder, "tokenizer": str(folder / "tokenizer"), "template": str(folder / "chatml.jinja"),
            "cache": str(folder / "cache")}


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)
