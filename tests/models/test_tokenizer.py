"""Tokenizer: parity with `transformers` (chat templates, ids) and the shipped GSM8K BPE asset."""

import json
import shutil
from pathlib import Path

import jinja2
import pytest
import transformers

from hybridjax.data.train_tokenizer import train
from hybridjax.models.tokenizer import Tokenizer

ASSET = Path(__file__).parents[2] / "hybridjax" / "assets" / "tokenizers" / "gsm8k_bpe"
GSM8K_TRAIN = Path(__file__).parents[1] / "assets" / "gsm8k" / "train.jsonl"

# Qwen2.5-Instruct's chat template (tools branch included: it exercises `tojson`).
QWEN2_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501

# A Llama-2-style template: block tags without `-` (trim_blocks/lstrip_blocks matter), bos/eos
# variables, and `raise_exception`.
LLAMA2_TEMPLATE = """{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {{ bos_token + '[INST] ' + message['content'].strip() + ' [/INST]' }}
    {% else %}
        {{ ' ' + message['content'].strip() + ' ' + eos_token }}
    {% endif %}
{% endfor %}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 + 30?"}],
    [
        {"role": "system", "content": "You solve grade-school maths."},
        {"role": "user", "content": "Natalia sold 48 clips.\nHow many in May?"},
        {"role": "assistant", "content": "She sold 48 / 2 = 24.\n#### 24"},
        {"role": "user", "content": "And in total, with ünïcode — 日本?"},
    ],
]


def _write_variant(directory: Path, template: str, **config_overrides) -> Path:
    shutil.copy(ASSET / "tokenizer.json", directory / "tokenizer.json")
    config = json.loads((ASSET / "tokenizer_config.json").read_text())
    config.update(chat_template=template, **config_overrides)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def qwen_style(tmp_path_factory):
    path = _write_variant(tmp_path_factory.mktemp("qwen_tok"), QWEN2_TEMPLATE)
    return Tokenizer.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["single", "multi_turn"])
def test_chat_template_matches_transformers(qwen_style, conversation, add_generation_prompt):
    ours, hf = qwen_style
    kwargs = dict(add_generation_prompt=add_generation_prompt)
    text = ours.apply_chat_template(conversation, tokenize=False, **kwargs)
    assert text == hf.apply_chat_template(conversation, tokenize=False, **kwargs)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt
    hf_ids = hf.apply_chat_template(conversation, tokenize=True, return_dict=False, **kwargs)
    assert ours.apply_chat_template(conversation, **kwargs) == list(hf_ids)


def test_tools_branch_matches_transformers(qwen_style):
    ours, hf = qwen_style
    tools = [{"type": "function", "function": {"name": "add", "description": "a+b → é"}}]
    conversation = CONVERSATIONS[0]
    ours_text = ours.apply_chat_template(conversation, tokenize=False, tools=tools)
    hf_text = hf.apply_chat_template(
        conversation, tokenize=False, tools=tools, add_generation_prompt=True
    )
    assert ours_text == hf_text and '"a+b → é"' in ours_text


def test_bos_eos_variables_and_raise_exception(tmp_path):
    path = _write_variant(tmp_path, LLAMA2_TEMPLATE, bos_token="<|endoftext|>")
    ours, hf = Tokenizer.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(path)
    conversation = [
        {"role": "user", "content": " hi "},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "2+2?"},
    ]
    text = ours.apply_chat_template(conversation, tokenize=False)
    assert text == hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    # lstrip_blocks + trim_blocks remove the block-tag lines; expression lines keep their indent.
    assert text == (
        "        <|endoftext|>[INST] hi [/INST]\n"
        "         hello <|im_end|>\n"
        "        <|endoftext|>[INST] 2+2? [/INST]\n"
    )
    with pytest.raises(jinja2.TemplateError, match="must alternate"):
        ours.apply_chat_template(conversation[1:])


def test_encode_decode_match_transformers(qwen_style):
    ours, hf = qwen_style
    texts = ["Janet’s ducks lay 16 eggs.", "  $1,234.50\n\n#### 18 ", "日本 <|im_end|> x"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.batch_decode([ours.encode(t) for t in texts]) == hf.batch_decode(
        [ours.encode(t) for t in texts], skip_special_tokens=True
    )


def test_special_token_ids(qwen_style, tmp_path):
    ours, hf = qwen_style
    assert ours.eos_token_id == hf.eos_token_id == ours.token_to_id("<|im_end|>")
    assert ours.pad_token_id == hf.pad_token_id == ours.token_to_id("<|endoftext|>")
    assert ours.bos_token_id is None and ours.vocab_size == len(hf) == 1000
    # Qwen2.5-Instruct lists two eos ids in generation_config.json; no pad falls back to eos.
    path = _write_variant(tmp_path, QWEN2_TEMPLATE, pad_token=None)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_pretrained(path)
    assert tok.eos_token_ids == (2, 0) and tok.pad_token_id == 2


def test_save_round_trip(qwen_style, tmp_path):
    ours, _ = qwen_style
    ours.save(tmp_path)
    again = Tokenizer.from_pretrained(tmp_path)
    conversation = CONVERSATIONS[1]
    assert again.apply_chat_template(conversation) == ours.apply_chat_template(conversation)
    assert again.eos_token_id == ours.eos_token_id


def test_missing_tokenizer_file_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_pretrained(tmp_path)


def test_shipped_asset_properties():
    tok = Tokenizer.from_pretrained(ASSET)
    assert tok.vocab_size <= 1000
    # Byte-level: any text round-trips; digits are single tokens.
    text = "Ünïcode ✓ 日本語\ttabs\r\n  and 9876543210 and emoji 🙂"
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    digits = [tok.backend.id_to_token(i) for i in tok.encode("1234567")]
    assert digits == list("1234567")
    ids = tok.apply_chat_template([{"role": "user", "content": "2+3?"}])
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert tok.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_shipped_asset_is_reproduced_by_its_command(tmp_path):
    train(str(GSM8K_TRAIN), str(tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (ASSET / name).read_bytes(), name
