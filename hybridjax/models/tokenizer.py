"""Tokenizers in HF's layout: `tokenizer.json` (Rust `tokenizers`) + `tokenizer_config.json`.

`Tokenizer` wraps `tokenizers.Tokenizer` and renders chat templates with jinja2 the way
`transformers` does (`transformers.utils.chat_template_utils._compile_jinja_template`): a sandboxed
environment with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter
that does not escape HTML, and the globals `raise_exception`, `strftime_now`; the special tokens
(`bos_token`, `eos_token`, `pad_token`, `unk_token`) are template variables. Rendered text is then
tokenised without adding special tokens, as `apply_chat_template(tokenize=True)` does.

Text lives only at the edges of the program (data loading, reward functions); everything between
sees token ids.
"""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from hybridjax.errors import InputFileError, MissingFileError, read_json

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compiles a chat template in the same jinja2 environment as `transformers`."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens and chat template of its config.

    Attributes:
      chat_template: jinja2 source or None.
      bos_token, eos_token, pad_token, unk_token: token strings or None.
    """

    # set from the config by __init__ (one per `_SPECIAL_KEYS` entry)
    bos_token: str | None
    eos_token: str | None
    unk_token: str | None
    pad_token: str | None

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: dict[str, Any],
        generation_eos: tuple[int, ...] = (),
    ):
        self.backend = backend
        self.config = dict(config)
        template = config.get("chat_template")
        if isinstance(template, list):  # HF allows named templates; "default" is the one used
            template = {t["name"]: t["template"] for t in template}.get("default")
        self.chat_template: str | None = template
        for key in _SPECIAL_KEYS:
            setattr(self, key, _token_content(config.get(key)))
        self._generation_eos = tuple(generation_eos)

    # ---- loading and saving -------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> Tokenizer:
        """Loads `<path>/tokenizer.json` and `<path>/tokenizer_config.json` (optional).

        `generation_config.json`'s `eos_token_id` (a list for Qwen2.5-Instruct) is read too, so
        `eos_token_ids` has every id that ends a generation.

        Raises:
          MissingFileError (a FileNotFoundError): `tokenizer.json` is missing (names the path).
          InputFileError: a file is not valid JSON or not a tokenizer (names it).
        """
        path = os.fspath(path)
        tok_file = os.path.join(path, TOKENIZER_FILE)
        if not os.path.isfile(tok_file):
            raise MissingFileError(
                f"no {TOKENIZER_FILE} at {tok_file} (data.tokenizer, or the model path's)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(tok_file)
        except Exception as err:  # the Rust library raises a plain Exception
            raise InputFileError(f"{tok_file}: not a readable tokenizer ({err})") from err
        config: dict[str, Any] = {}
        cfg_file = os.path.join(path, CONFIG_FILE)
        if os.path.isfile(cfg_file):
            config = read_json(cfg_file)
        template_file = os.path.join(path, "chat_template.jinja")
        if "chat_template" not in config and os.path.isfile(template_file):
            with open(template_file, encoding="utf-8") as f:
                config["chat_template"] = f.read()
        gen_eos: tuple[int, ...] = ()
        gen_file = os.path.join(path, GENERATION_CONFIG_FILE)
        if os.path.isfile(gen_file):
            eos = read_json(gen_file).get("eos_token_id")
            if eos is not None:
                gen_eos = tuple(eos) if isinstance(eos, list) else (eos,)
        return cls(backend, config, gen_eos)

    def save(self, path: str | os.PathLike) -> None:
        """Writes `tokenizer.json` and `tokenizer_config.json` (HF layout) into `path`."""
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        self.backend.save(os.path.join(path, TOKENIZER_FILE), pretty=True)
        config = dict(self.config)
        config["chat_template"] = self.chat_template
        with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
            f.write("\n")

    # ---- ids of special tokens ------------------------------------------------------------------

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        """The id of `eos_token` (the first of `eos_token_ids` when the config has none)."""
        eos = self.token_to_id(self.eos_token)
        if eos is None and self._generation_eos:
            return self._generation_eos[0]
        return eos

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation: `eos_token` and generation_config's `eos_token_id`."""
        ids = [] if self.eos_token_id is None else [self.eos_token_id]
        ids += [i for i in self._generation_eos if i not in ids]
        return tuple(ids)

    @property
    def pad_token_id(self) -> int | None:
        """The id of `pad_token`, falling back to `eos_token_id` (as verl sets it)."""
        pad = self.token_to_id(self.pad_token)
        return self.eos_token_id if pad is None else pad

    @property
    def vocab_size(self) -> int:
        """Number of ids, added/special tokens included (HF's `len(tokenizer)`)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    # ---- text <-> ids ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (`<|im_start|>`) map to their
        ids; `add_special_tokens=True` additionally runs the post-processor (e.g. Llama's BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """`encode` over many texts, in parallel threads inside `tokenizers`."""
        encodings = self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of a sequence of ids (a list or a 1-D integer array)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens: bool = True) -> list[str]:
        """`decode` over a list of id sequences (ragged lists or rows of a 2-D array)."""
        seqs = [[int(i) for i in s] for s in sequences]
        return self.backend.decode_batch(seqs, skip_special_tokens=skip_special_tokens)

    # ---- chat -----------------------------------------------------------------------------------

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        """The chat template applied to `messages` (a list of `{role, content}` dicts).

        Raises:
          ValueError: the tokenizer has no chat template.
          jinja2.TemplateError: the template called `raise_exception` (its message is kept).
        """
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template in tokenizer_config.json")
        # `transformers` always passes `tools` and `documents` (None when unused).
        variables = {"tools": None, "documents": None}
        variables.update(
            {k: getattr(self, k) for k in _SPECIAL_KEYS if getattr(self, k) is not None}
        )
        variables.update(kwargs)
        template = compile_chat_template(self.chat_template)
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        **kwargs,
    ) -> list[int] | str:
        """HF's `apply_chat_template` for one conversation: token ids, or the text if
        `tokenize=False`. Extra keyword arguments become template variables."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text) if tokenize else text
