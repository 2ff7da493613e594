"""Tokenizers: raw bytes for models trained here, and HuggingFace `tokenizer.json` for imported models.

Both implement `Tokenizer`. `encode` never adds special tokens unless asked (`add_bos`, `add_eos`);
`add_bos_default` / `add_eos_default` say what HuggingFace's `tokenizer(text)` would add, so a prompt
can be encoded exactly as transformers does with `encode(text, add_bos=t.add_bos_default, ...)`.
`gguf_tokenizer_files` rebuilds a GGUF file's tokenizer (`tokenizer.ggml.*`) as the files transformers loads.
"""

from __future__ import annotations

import abc
import json
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import crc32c as _crc32c
import tokenizers

from storage.errors import BadInputError

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
# every file a model's tokenizer reads (a store keeps them as side files)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json")
# Files of a HuggingFace tokenizer directory that name special tokens, most specific first.
_TOKEN_FILES = ("tokenizer_config.json", "special_tokens_map.json")
_MODEL_CONFIG = "config.json"


class Tokenizer(abc.ABC):
    """Text to token ids and back; `kind` and `fingerprint` identify it in data shards."""

    kind: str  # "byte" or "hf"
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    add_bos_default: bool = False  # what HuggingFace's `tokenizer(text)` prepends
    add_eos_default: bool = False

    @abc.abstractmethod
    def _encode_plain(self, text: str) -> list[int]:
        """Ids of `text` without any special token added."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, with special tokens left out."""

    @property
    @abc.abstractmethod
    def fingerprint(self) -> str:
        """A short string that changes whenever the id mapping could change."""

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Ids of `text`, with BOS in front and EOS at the end when asked and the tokenizer has them."""
        ids = self._encode_plain(text)
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens 0..255, plus BOS=256, EOS=257, PAD=258: the tokenizer of models trained here."""

    kind = "byte"
    BOS = 256
    EOS = 257
    PAD = 258
    VOCAB_SIZE = 259

    def __init__(self) -> None:
        self.vocab_size = self.VOCAB_SIZE
        self.bos_id = self.BOS
        self.eos_id = self.EOS
        self.pad_id = self.PAD

    def _encode_plain(self, text: str) -> list[int]:
        # A lone surrogate is not text, but json.loads can produce one; it decodes to U+FFFD.
        return list(text.encode("utf-8", errors="surrogatepass"))

    def decode(self, ids: Sequence[int]) -> str:
        """UTF-8 text of the byte ids; specials are skipped and broken sequences become U+FFFD."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    @property
    def fingerprint(self) -> str:
        return "byte-259"

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer(Tokenizer):
    """A HuggingFace fast tokenizer loaded from `<dir>/tokenizer.json` with the `tokenizers` library."""

    kind = "hf"

    def __init__(self, directory: str | None = None, *, files: Mapping[str, bytes] | None = None,
                 where: str | None = None) -> None:
        """From `directory`, or from `files` (the tokenizer's files' bytes by name, e.g. a store's side
        files read once: `where` names them in messages)."""
        if (directory is None) == (files is None):
            raise ValueError("HFTokenizer takes a directory or files, one of them")
        if files is None:
            files = _DirectoryFiles(directory)
        self.directory = directory if directory is not None else where or "tokenizer files"
        path = os.path.join(self.directory, TOKENIZER_FILE)
        raw = files.get(TOKENIZER_FILE)
        if raw is None:
            raise BadInputError(f"{path}: not found")
        try:
            self._tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # the library raises a bare Exception on any parse error
            raise BadInputError(f"{path}: not a readable tokenizers file ({e})") from e
        self._fingerprint = f"hf-{_crc32c.crc32c(raw):08x}"
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        token_cfg = {}
        # Later files only fill gaps: tokenizer_config.json wins over special_tokens_map.json.
        for name in reversed(_TOKEN_FILES):
            token_cfg.update({k: v for k, v in _json(files, self.directory, name).items() if v is not None})
        model_cfg = _json(files, self.directory, _MODEL_CONFIG)
        self.bos_id = self._special_id(token_cfg, model_cfg, "bos")
        self.eos_id = self._special_id(token_cfg, model_cfg, "eos")
        self.pad_id = self._special_id(token_cfg, model_cfg, "pad")
        # transformers skips every token its config names (bos, eos, pad, unk) when decoding, even
        # one that tokenizer.json does not mark special
        self._skipped = {i for i in (self.bos_id, self.eos_id, self.pad_id,
                                     self._special_id(token_cfg, {}, "unk")) if i is not None}
        self.add_bos_default, self.add_eos_default = self._post_processor_adds()

    def _special_id(self, token_cfg: dict[str, Any], model_cfg: dict[str, Any], which: str) -> int | None:
        """Id of a special token: named in the tokenizer files, else `<which>_token_id` of config.json."""
        token = token_cfg.get(f"{which}_token")
        if isinstance(token, dict):  # a serialised AddedToken
            token = token.get("content")
        if isinstance(token, str):
            tid = self._tok.token_to_id(token)
            if tid is not None:
                return tid
            log.warning("%s: %s_token %r is not in the vocabulary", self.directory, which, token)
        tid = model_cfg.get(f"{which}_token_id")
        if isinstance(tid, list):  # several stop ids (Llama 3 style): the first is the canonical one
            tid = tid[0] if tid else None
        return tid if isinstance(tid, int) else None

    def _post_processor_adds(self) -> tuple[bool, bool]:
        """Whether tokenizer.json's post-processor (which transformers applies by default) adds BOS / EOS."""
        plain = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        adds_bos = self.bos_id is not None and full[:1] == [self.bos_id] and plain[:1] != [self.bos_id]
        adds_eos = self.eos_id is not None and full[-1:] == [self.eos_id] and plain[-1:] != [self.eos_id]
        if len(full) - len(plain) != int(adds_bos) + int(adds_eos):
            log.warning("%s: the post-processor adds tokens other than BOS/EOS; encode() leaves them out",
                        self.directory)
        return adds_bos, adds_eos

    def _encode_plain(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens skipped, as transformers' `decode(..., skip_special_tokens=True)`."""
        return self._tok.decode([int(i) for i in ids if int(i) not in self._skipped], skip_special_tokens=True)

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def __repr__(self) -> str:
        return f"HFTokenizer({self.directory!r}, vocab_size={self.vocab_size})"


class _DirectoryFiles:
    """A directory's files by name, read when asked for (None where missing)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def get(self, name: str) -> bytes | None:
        path = os.path.join(self.directory, name)
        if not os.path.isfile(path):
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise BadInputError(f"{path}: not readable ({e})") from e


def _json(files: Mapping[str, bytes] | _DirectoryFiles, where: str, name: str) -> dict[str, Any]:
    raw = files.get(name)
    if raw is None:
        return {}
    path = os.path.join(where, name)
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise BadInputError(f"{path}: not readable JSON ({e})") from e
    if not isinstance(data, dict):
        raise BadInputError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def checked_vocab(tok: HFTokenizer, vocab_size: int | None) -> HFTokenizer:
    """`tok`, which must not have more tokens than the model has embeddings."""
    if vocab_size is not None and tok.vocab_size > vocab_size:
        raise BadInputError(f"{os.path.join(tok.directory, TOKENIZER_FILE)}: {tok.vocab_size} tokens, more than "
                            f"the model's vocab_size {vocab_size}")
    return tok


def trained_here_tokenizer(arch: str, vocab_size: int | None) -> ByteTokenizer | None:
    """The byte tokenizer for a model trained here (`gpt_moe` with its 259 embeddings), which ships no
    tokenizer.json; None for any other model."""
    return ByteTokenizer() if arch == "gpt_moe" and vocab_size == ByteTokenizer.VOCAB_SIZE else None


def store_tokenizer(store, vocab_size: int | None, arch: str | None = None) -> Tokenizer | None:
    """The tokenizer a store keeps as side files (a `storage.reader.StoreReader` or `storage.store.Store`),
    checked against the model's vocabulary. Without a tokenizer.json: the byte tokenizer where `arch`
    says the model was trained here, else None."""
    m = store.manifest
    if not m.has_file("tokenizer.json"):
        return trained_here_tokenizer(arch, vocab_size) if arch is not None else None
    files = {name: store.read_file(name) for name in TOKENIZER_FILES if m.has_file(name)}
    return checked_vocab(HFTokenizer(files=files, where=f"{store.root} (store)"), vocab_size)


def load_tokenizer(path: str | None, *, vocab_size: int | None = None) -> Tokenizer:
    """`path`/tokenizer.json as an HFTokenizer; the ByteTokenizer when `path` is None or has no tokenizer.json.

    `vocab_size` (the model's) is checked: the byte tokenizer needs exactly 259, a HuggingFace one
    must not have more tokens than the model has embeddings.
    """
    if path is not None and not os.path.isdir(path):
        raise BadInputError(f"{path}: expected a tokenizer directory (holding {TOKENIZER_FILE}), not found")
    if path is None or not os.path.isfile(os.path.join(path, TOKENIZER_FILE)):
        if vocab_size is not None and vocab_size != ByteTokenizer.VOCAB_SIZE:
            where = path if path is not None else "no tokenizer directory"
            raise BadInputError(f"{where}: no {TOKENIZER_FILE} and vocab_size {vocab_size} is not the byte "
                                f"tokenizer's {ByteTokenizer.VOCAB_SIZE}")
        return ByteTokenizer()
    return checked_vocab(HFTokenizer(path), vocab_size)


def default_stop_ids(config_eos: int | Sequence[int] | None, tokenizer: Tokenizer | None) -> tuple[int, ...]:
    """The token ids generation stops at by default, for every front-end alike: the model config's
    end-of-sequence id (or ids), else the tokenizer's."""
    eos: Any = config_eos
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_id
    ids = eos if isinstance(eos, (list, tuple)) else [eos]
    return tuple(int(i) for i in ids if i is not None)


def gguf_tokenizer_files(path: str) -> dict[str, bytes]:
    """The tokenizer files (tokenizer.json, tokenizer_config.json, a chat template) `AutoTokenizer` loads,
    rebuilt from the GGUF's `tokenizer.ggml.*` by transformers' converter; {} where it has none."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    try:
        arch, tokens, tok_config = get_gguf_tokenizer(path)
    except KeyError:
        return {}
    if not tokens.get("tokens"):
        return {}
    try:
        backend, extra = convert_gguf_tokenizer(arch, tokens)
    except (KeyError, ValueError, TypeError) as e:
        raise BadInputError(f"{path}: its tokenizer (tokenizer.ggml.model="
                            f"{tokens.get('tokenizer_type')!r}) cannot be rebuilt ({e})") from None
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **{k: v for k, v in tok_config.items() if v is not None},
                                  **extra)
    with tempfile.TemporaryDirectory() as d:
        tok.save_pretrained(d)
        out = {}
        for name in sorted(os.listdir(d)):
            with open(os.path.join(d, name), "rb") as f:
                out[name] = f.read()
    # the builders add their family's defaults (GPT-2's <|endoftext|>) past the file's vocabulary: not the model's
    data = json.loads(out["tokenizer.json"])
    n = len(tokens["tokens"])
    gone = {a["content"] for a in data.get("added_tokens", []) if a["id"] >= n}
    if gone:
        data["added_tokens"] = [a for a in data["added_tokens"] if a["id"] < n]
        out["tokenizer.json"] = json.dumps(data, ensure_ascii=False).encode()
        cfg = json.loads(out["tokenizer_config.json"])
        cfg = {k: v for k, v in cfg.items() if not (isinstance(v, str) and v in gone)}
        out["tokenizer_config.json"] = json.dumps(cfg, indent=2, ensure_ascii=False).encode()
    return out
