"""Trains the project's small byte-level BPE tokenizer on GSM8K train text.

    python -m hybridjax.data.train_tokenizer \
        --input /path/to/gsm8k/train.jsonl --output hybridjax/assets/tokenizers/gsm8k_bpe

The tokenizer is built like Qwen2's (NFC normaliser, Qwen2's split regex, byte-level BPE, byte-level
decoder), so any text round-trips and every digit is its own pre-token (numbers are spelled digit by
digit, which helps arithmetic). The output directory has HF's layout — `tokenizer.json` and
`tokenizer_config.json` with a ChatML chat template and the special tokens `<|endoftext|>` (pad),
`<|im_start|>` and `<|im_end|>` (eos) — so both `hybridjax.models.tokenizer.Tokenizer` and
`transformers.AutoTokenizer` load it. Training is deterministic: the same input gives the same file.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from hybridjax.data.gsm8k import INSTRUCTION

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2's pre-tokenizer regex: words, single digits (\p{N}), punctuation runs, newlines, spaces.
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# ChatML, as Qwen2 writes it, without a default system message (keeps prompts short).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_level_bpe() -> tokenizers.Tokenizer:
    """An untrained Qwen2-style byte-level BPE tokenizer."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(QWEN2_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def gsm8k_texts(path: str) -> Iterator[str]:
    """Question and answer text of every row of a GSM8K jsonl file, then the prompt instruction."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            yield row["question"]
            yield row["answer"]
    yield INSTRUCTION


def tokenizer_config(vocab: dict[str, int]) -> dict:
    """HF `tokenizer_config.json` for the trained tokenizer (Qwen2-Instruct's token roles)."""
    added = {
        str(vocab[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHATML_TEMPLATE,
    }


def train(input_path: str, output_dir: str, vocab_size: int = 1000) -> tokenizers.Tokenizer:
    """Trains on `input_path` (GSM8K jsonl) and writes the HF-layout files into `output_dir`.

    `vocab_size` counts the 256 byte symbols, the merges and the 3 special tokens.
    """
    tok = byte_level_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(gsm8k_texts(input_path), trainer=trainer)
    os.makedirs(output_dir, exist_ok=True)
    tok.save(os.path.join(output_dir, "tokenizer.json"), pretty=True)
    config = tokenizer_config(tok.get_vocab(with_added_tokens=True))
    with open(os.path.join(output_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    return tok


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="GSM8K train.jsonl")
    parser.add_argument("--output", required=True, help="output directory")
    parser.add_argument("--vocab_size", type=int, default=1000)
    args = parser.parse_args(argv)
    tok = train(args.input, args.output, args.vocab_size)
    print(f"wrote {args.output} (vocab {tok.get_vocab_size(with_added_tokens=True)})")


if __name__ == "__main__":
    main()
