"""Tokenizer and chat template: a ``tokenizers.Tokenizer`` plus what
tokenizer_config.json says (special tokens, BOS, Jinja chat template).

Built from a Hugging Face folder (tokenizer.json, tokenizer_config.json,
chat_template.jinja) or from the parts a GGUF file embeds.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer as Backend

# end-of-generation tokens llama.cpp also treats as EOG when the vocabulary has them
EOG_NAMES = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<|end|>")


class Tokenizer:
    def __init__(self, backend: Backend, config: dict | None = None):
        self.backend = backend
        self.config = dict(config or {})
        self.chat_template: str | None = self.config.get("chat_template")
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.add_bos = bool(self.config.get("add_bos_token", False))

    # ----- construction ---------------------------------------------------------
    @classmethod
    def from_folder(cls, folder: str | Path) -> "Tokenizer":
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(f"{folder}: no tokenizer.json (kvslim reads fast-tokenizer files only)")
        config = {}
        if (folder / "tokenizer_config.json").is_file():
            config = json.loads((folder / "tokenizer_config.json").read_text())
        if (folder / "chat_template.jinja").is_file():                # transformers 5 saves it apart
            config["chat_template"] = (folder / "chat_template.jinja").read_text()
        return cls(Backend.from_file(str(folder / "tokenizer.json")), config)

    # ----- ids <-> text -----------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids; ``add_special`` adds BOS where the tokenizer's post-processor or config asks for it."""
        if not isinstance(text, str):
            raise ValueError(f"text to tokenize must be a string, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=add_special).ids
        bos = self.token_id(self.bos_token) if self.bos_token else None
        if add_special and self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        n = self.vocab_size                                            # once, not once an id
        bad = [i for i in ids if not 0 <= int(i) < n]
        if bad:
            raise ValueError(f"token ids out of range 0..{self.vocab_size - 1}: {bad[:5]}")
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self.backend.token_to_id(text)

    def eog_ids(self, extra: list[int] | int | None = None) -> set[int]:
        """End-of-generation ids: the config's EOS, the model's eos_token_id(s) and known EOG tokens."""
        ids = {self.token_id(self.eos_token)} | {self.token_id(name) for name in EOG_NAMES}
        if extra is not None:
            ids |= set(extra if isinstance(extra, list) else [extra])
        return {i for i in ids if i is not None}

    # ----- chat -------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **extra) -> str:
        """Render ``messages`` with the model's Jinja template (sandboxed)."""
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
        return _compiled(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)


def _token_text(token) -> str | None:
    """tokenizer_config stores special tokens as strings or as {"content": ...} dicts."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _raise(message: str):
    raise ValueError(f"chat template: {message}")


@lru_cache(maxsize=8)
def _compiled(source: str):
    """A template compiled once: compiling the Qwen3.5 template took ~11 ms, rendering it ~0.1 ms,
    and the server renders every request (jinja2 templates render safely from several threads)."""
    return _jinja_env().from_string(source)


def _jinja_env():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, ensure_ascii=False, indent=indent)
    return env
