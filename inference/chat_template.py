"""Chat messages to prompt token ids: the model's own jinja chat template, or a plain fallback.

A model's template comes, as transformers looks for it, from `chat_template.jinja` or from the
`chat_template` field of `tokenizer_config.json`, in a HuggingFace directory or among a store's side
files. It is rendered in a sandboxed jinja environment with `messages`, `add_generation_prompt=True`,
`bos_token` and `eos_token`. A model without one gets `FALLBACK_TEMPLATE`:

    <role>: <content>\n   (one line per message)
    assistant:
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from collections.abc import Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox

from semoe.checkpoints.tokenizer import Tokenizer
from storage.errors import BadInputError

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool", "developer")
FALLBACK_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}assistant:{% endif %}")
_TEMPLATE_FILE = "chat_template.jinja"
_TOKENIZER_CONFIG = "tokenizer_config.json"


class ChatTemplateError(ValueError):
    """The template does not compile, or it rejects the messages (its `raise_exception(...)`)."""


def _raise_exception(message: str) -> None:
    # Templates call this to reject a conversation, e.g. "roles must alternate user/assistant".
    raise ChatTemplateError(message)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    # The same options transformers renders with, so templates written for it render identically here;
    # sandboxed because a template is data shipped with a downloaded model.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)  # templates that date the system prompt
    return env


class ChatTemplate:
    """A compiled chat template and the special-token strings it may refer to."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", fallback: bool = False) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.fallback = fallback

    @classmethod
    def default(cls) -> "ChatTemplate":
        """The fallback template, for models that ship none."""
        return cls(FALLBACK_TEMPLATE, fallback=True)

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        """The prompt text of a conversation, ending where the assistant's reply begins."""
        try:
            return self._template.render(messages=list(messages), add_generation_prompt=True,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:  # includes sandbox violations
            raise ChatTemplateError(f"chat template failed: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            # a template indexing a field these messages lack, or the like
            raise ChatTemplateError(f"chat template failed on these messages: {type(e).__name__}: {e}") from e

    def encode(self, tokenizer: Tokenizer, messages: Sequence[dict[str, str]]) -> list[int]:
        """Prompt ids of a conversation. A model's template writes its own special tokens (as
        transformers' `apply_chat_template` assumes); the fallback gets the tokenizer's default BOS."""
        text = self.render(messages)
        return tokenizer.encode(text, add_bos=self.fallback and tokenizer.add_bos_default)

    def __repr__(self) -> str:
        return "ChatTemplate(fallback)" if self.fallback else f"ChatTemplate({len(self.source)} chars)"


def _token_text(value: object) -> str:
    """A special token as tokenizer_config.json writes it: a string or a serialised AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _pick_template(value: object, where: str) -> str | None:
    """`chat_template` is one string, or a list of {name, template} of which "default" is used."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default")
        if isinstance(chosen, str):
            return chosen
    raise BadInputError(f"{where}: chat_template must be a string or a list with a 'default' entry")


def _side_files(path: str, store=None) -> dict[str, bytes]:
    """The template-bearing files of a HuggingFace directory or a store (`store`, where the caller opened
    it), those that exist (through the store's torch-free reader: the torch-free runner's --chat reads
    them too)."""
    from storage.reader import StoreReader, is_store

    out: dict[str, bytes] = {}
    if store is not None or is_store(path):
        store = store or StoreReader.open(path)
        for name in (_TEMPLATE_FILE, _TOKENIZER_CONFIG):
            if store.manifest.has_file(name):
                out[name] = store.read_file(name)
        return out
    for name in (_TEMPLATE_FILE, _TOKENIZER_CONFIG):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file, "rb") as f:
                out[name] = f.read()
    return out


def load_chat_template(path: str, store=None) -> ChatTemplate:
    """The chat template of the model at `path` (HuggingFace directory or store: `store` where the caller
    opened it), else the fallback."""
    files = _side_files(path, store)
    config: dict = {}
    if _TOKENIZER_CONFIG in files:
        where = os.path.join(path, _TOKENIZER_CONFIG)
        try:
            config = json.loads(files[_TOKENIZER_CONFIG])
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BadInputError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(config, dict):
            raise BadInputError(f"{where}: expected a JSON object")
    if _TEMPLATE_FILE in files:  # transformers >= 4.43 writes the template to its own file
        source = files[_TEMPLATE_FILE].decode("utf-8")
    else:
        source = _pick_template(config.get("chat_template"), os.path.join(path, _TOKENIZER_CONFIG))
    if not source:
        log.info("%s: no chat template; using the fallback '<role>: <content>' template", path)
        return ChatTemplate.default()
    try:
        return ChatTemplate(source, bos_token=_token_text(config.get("bos_token")),
                            eos_token=_token_text(config.get("eos_token")))
    except ChatTemplateError as e:
        raise BadInputError(f"{path}: {e}") from e
