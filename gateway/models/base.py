"""What a tool sees of a model, whatever its kind, and the capabilities a kind may have.

A `Model` is a loaded model and its tokenizer on one device. Tools never ask
what family or class it is: they call `encode`, `logits`, `hidden_states`
and the layer stack (`gateway/models/anatomy.py`), and they state which
`Capability` they need. Each kind of model (one module each beside this one)
loads a checkpoint and says which capabilities it has, each one proven on the
loaded weights by a probe (`gateway/models/probes.py`) rather than assumed
from a class name; a capability a model lacks carries the reason, so that a
refusal can say it (`gateway/models/capabilities.py`).

This class is the Hugging Face implementation (a transformers module and
tokenizer); `gateway/models/custom.py` is the one for a user's own model.
"""

from __future__ import annotations

import array
import collections
import enum
import functools
import inspect
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import TooLong


class Capability(str, enum.Enum):
    """What a tool may need from a model."""

    NEXT_TOKEN = "next_token"
    MASKED_LM = "masked_lm"
    HIDDEN_STATES = "hidden_states"
    LAYERS = "layers"
    INCREMENTAL = "incremental"
    CHAT = "chat"
    SAE = "sae"

    @property
    def meaning(self) -> str:
        return _MEANING[self]


_MEANING = {
    Capability.NEXT_TOKEN: "causal next-token logits",
    Capability.MASKED_LM: "a masked-LM head",
    Capability.HIDDEN_STATES: "hidden states per layer",
    Capability.LAYERS: "a layer stack with a readout to logits",
    Capability.INCREMENTAL: "an incremental decoding step",
    Capability.CHAT: "a chat template",
    Capability.SAE: "a sparse autoencoder on one of its layers",
}


class Kind(str, enum.Enum):
    """What a served model is, as its config (or its loader) says."""

    CAUSAL_LM = "causal_lm"
    MASKED_LM = "masked_lm"
    ENCODER = "encoder"  # hidden states only: a base model without a head
    CUSTOM = "custom"  # a user's model through --model-loader


TOKENS_KEPT = 1 << 21  # token ids of recent texts kept by a model (16 MB)


class _Returned(Exception):
    """The base model has returned what a pass was run for: the rest of the model is not run."""


DECODE = "decode"  # the model's memo: `_decoder`'s function
RUST_DECODER = "rust_decoder"  # the model's memo: `_rust_decoder`'s tokenizer (None: there is none)
TOKEN_CHARS = "token_chars"  # the model's memo: `token_chars`


def _rust_decoder(tokenizer: Any) -> Any:
    """The Rust tokenizer of a fast tokenizer whose decoding transformers does not change, else None:
    transformers' wrapper checks each id's type in Python first, which cost 5 times the decode itself
    on a generation step's short windows (every member's every token)."""
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    if (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is PreTrainedTokenizerFast._decode
        and callable(getattr(backend, "decode", None))
    ):
        return backend
    return None


def _decoder(tokenizer: Any) -> Any:
    """`ids -> text`, special tokens left out and spaces as they are."""
    backend = _rust_decoder(tokenizer)
    if backend is not None:
        return functools.partial(backend.decode, skip_special_tokens=True)
    return functools.partial(tokenizer.decode, skip_special_tokens=True, clean_up_tokenization_spaces=False)


# A text decoded a window a token in Python is checked against the decode of all its tokens after this
# many more: a tokenizer whose text for a token depends on tokens far before it is then decoded whole.
SETTLE_TOKENS = 32


class _Decoding:
    """`Model.decoding`'s decoder of one text, a piece a token.

    A fast tokenizer's own `DecodeStream` (`stream`: a short window a token, in
    Rust); for any other tokenizer, the same in Python: a token decodes the
    window from the last piece's first token, less what that window gave before
    it (a tokenizer that reads a token differently at the start of a text, as
    SentencePiece drops its leading space, reads the new one in context), and
    every `SETTLE_TOKENS` tokens the text is checked against the decode of them
    all. Where a token changes text already given (DecodeStream refuses it:
    bytes of a ByteFallback tokenizer that turn out to be no UTF-8 all read as
    U+FFFD), or a check fails, every token is decoded from then on; the text
    already given stands, and the completion's end says the rest.
    """

    def __init__(self, decode: Callable[[list[int]], str], stream: Callable[[int], str | None] | None) -> None:
        self.decode, self.stream = decode, stream
        self.ids: list[int] = []
        self.text = ""  # what it gave so far
        self.start = self.read = self.checked = 0  # (in Python) the window's first token; the first not given yet; the last check
        self.whole = False

    def __call__(self, token: int) -> str | None:
        self.ids.append(token)
        if not self.whole:
            try:
                return self._give(self.stream(token) if self.stream is not None else self._window())
            except _Misread:
                self.whole = True
            except Exception:  # noqa: BLE001 (DecodeStream's refusal of a token that changes what it gave)
                if self.stream is None:
                    raise
                self.whole = True
        whole = self.decode(self.ids)
        return self._give(whole[len(self.text) :]) if whole.startswith(self.text) else None

    def _window(self) -> str:
        before = self.decode(self.ids[self.start : self.read])
        now = self.decode(self.ids[self.start :])
        if not now.startswith(before):
            raise _Misread
        piece = now[len(before) :]
        if _unfinished(piece):
            return ""
        self.start, self.read = self.read, len(self.ids)
        if len(self.ids) - self.checked >= SETTLE_TOKENS:
            self.checked = len(self.ids)
            if self.decode(self.ids) != self.text + piece:
                raise _Misread
        return piece

    def _give(self, piece: str | None) -> str | None:
        if piece is None or _unfinished(piece):
            return None
        self.text += piece
        return piece


def _unfinished(piece: str) -> bool:
    """Nothing yet, or an incomplete character: the next token says."""
    return not piece or piece.endswith("\ufffd")


class _Misread(Exception):
    """A window's text that is not the decode of all the tokens."""


# Letters tokenized at once, at most, of a long protein or DNA sequence (`Model._tokenize`).
TOKENIZE_PIECE = 1 << 16


@dataclass(eq=False)
class Model:
    """A loaded model and its tokenizer on one device, as tools see it."""

    name: str
    module: Any  # a transformers PreTrainedModel (or a custom model), in eval mode, on `device`
    tokenizer: Any
    device: Any
    dtype: Any
    context_length: int
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    kind: Kind = Kind.CAUSAL_LM
    vocab_size: int = 0
    pad_token_id: int = 0
    # Tokens the tokenizer adds around a text (<cls>, <eos>, BOS, <sep>): never a text's own.
    special_ids: frozenset[int] = field(default_factory=frozenset)
    mask_token_id: int | None = None
    # The letters of a protein or DNA model's sequences; None for a model of text (gateway/models/alphabet.py).
    alphabet: str | None = None
    # Named prefixes a sequence may be given with the `tag` param (an Evo2-style model's organism tags).
    tags: dict[str, str] = field(default_factory=dict)
    # True when every position sees the whole sequence (encoders), False when only what precedes it.
    bidirectional: bool = False
    capabilities: frozenset[Capability] = field(default_factory=frozenset)
    # Why each capability the model lacks is missing, in words for a refusal.
    missing: dict[Capability, str] = field(default_factory=dict)
    # The sparse autoencoders served with it (`--sae`), by name: gateway/models/sae.py.
    saes: dict[str, Any] = field(default_factory=dict, repr=False)
    # What tools work out once per model and reuse (e.g. where its layers are).
    memo: dict[str, Any] = field(default_factory=dict, repr=False)
    # Recent texts' token ids, oldest first (`tokenize`); a job's check and its run are on two threads.
    _tokens: collections.OrderedDict[tuple[str, bool], array.array] = field(
        default_factory=collections.OrderedDict, init=False, repr=False
    )
    _tokens_held: int = field(default=0, init=False, repr=False)
    _tokens_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def has(self, capability: Capability) -> bool:
        return capability in self.capabilities

    # -- tokens ---------------------------------------------------------------------------

    def tokenize(self, text: str, special: bool = True, field: str = "input", bounded: bool = True) -> list[int]:
        """Token ids of `text`, with the tokenizer's special tokens around it when `special`.

        A job's texts are tokenized by its check, before it is queued, and again by its run (and
        a protein tokenizer written in Python takes a millisecond a sequence): the ids of recent
        texts are kept, up to `TOKENS_KEPT` ids, so that each text is tokenized once.
        """
        if bounded:
            self.bound_text(len(text), field)
        key = (text, special)
        with self._tokens_lock:
            kept = self._tokens.get(key)
            if kept is not None:
                self._tokens.move_to_end(key)
                return kept.tolist()
        ids = self._tokenize(text, special)
        with self._tokens_lock:
            if key not in self._tokens:
                self._tokens[key] = array.array("q", ids)
                self._tokens_held += len(ids)
            while self._tokens_held > TOKENS_KEPT and len(self._tokens) > 1:
                self._tokens_held -= len(self._tokens.popitem(last=False)[1])
        return ids

    def _tokenize(self, text: str, special: bool) -> list[int]:
        if self.alphabet is not None and len(text) > TOKENIZE_PIECE and self._tokenizes_by_letter():
            # A token a letter: a long sequence tokenized a piece at a time is the same ids, without
            # the tokenizer's working set for all of it at once (56 MB for 10^6 residues on ESM-2's).
            # Pieces end between two letters of the alphabet, never inside a token typed in (`<mask>`).
            letters = set(self.alphabet)
            ids: list[int] = []
            start = 0
            while start < len(text):
                end = min(len(text), start + TOKENIZE_PIECE)
                while end < len(text) and end > start + 1 and not (text[end - 1] in letters and text[end] in letters):
                    end -= 1
                if end == start + 1 and end < len(text):  # no place to cut: the rest whole
                    end = len(text)
                ids += self.tokenizer(text[start:end], add_special_tokens=False)["input_ids"]
                start = end
            return list(self.tokenizer.build_inputs_with_special_tokens(ids)) if special else ids
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def _tokenizes_by_letter(self) -> bool:
        """Whether this model's tokenizer makes each letter of its alphabet a token of its own, as it
        does in a sequence cut in two: found once, for `_tokenize` to cut long sequences."""
        if "by_letter" not in self.memo:
            assert self.alphabet is not None
            sample = (self.alphabet * 8)[:64]
            try:
                whole = list(self.tokenizer(sample)["input_ids"])
                bare = list(self.tokenizer(sample, add_special_tokens=False)["input_ids"])
                halves = [self.tokenizer(part, add_special_tokens=False)["input_ids"] for part in (sample[:29], sample[29:])]
                self.memo["by_letter"] = len(bare) == len(sample) and bare == [*halves[0], *halves[1]] and whole == list(
                    self.tokenizer.build_inputs_with_special_tokens(bare)
                )
            except Exception:  # a tokenizer without the API: whole texts, as before
                self.memo["by_letter"] = False
        return bool(self.memo["by_letter"])

    def encode(self, text: str, field: str = "input", bounded: bool = True) -> list[int]:
        """Token ids of a prompt, with the tokenizer's special tokens, never empty; `field` names the
        param a text too long to tokenize is refused as. `bounded=False`: a text run in windows
        (gateway/tools/windows.py), whose length the body limit bounds, not the context."""
        ids = self.tokenize(text, field=field, bounded=bounded)
        if not ids:
            # A model needs at least one token to predict from.
            start = getattr(self.tokenizer, "bos_token_id", None)
            ids = [start if start is not None else min(self.eos_token_ids or {self.pad_token_id})]
        return ids

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation rendered by the tokenizer's chat template, ready for the reply.

        The template writes every special token itself (BOS included, where the
        model wants one), so none is added; and a control token typed inside a
        message (`<|im_start|>system`) stays text, so no message can forge a turn.
        """
        self.bound_text(sum(len(m.get("content") or "") + len(m.get("role") or "") for m in messages), "messages")
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True, sanitize_control_tokens=True
        )["input_ids"]
        if not ids:
            raise ValueError("the chat template renders this conversation as no tokens")
        return list(ids)

    def encode_continuation(self, text: str, field: str = "input", bounded: bool = True) -> list[int]:
        """Token ids of text that follows a prompt: no special tokens."""
        return self.tokenize(text, special=False, field=field, bounded=bounded)

    def decode(self, ids: list[int]) -> str:
        decode = self.memo.get(DECODE)
        if decode is None:
            decode = self.memo[DECODE] = _decoder(self.tokenizer)
        return decode(ids)

    def decoding(self) -> Callable[[int], str | None]:
        """An incremental decoder of one text (`decode` of its tokens so far, a piece a token): each token
        in turn gives what the text gained, or None while the text ends in an incomplete character
        (`_Decoding`)."""
        backend = self.memo.get(RUST_DECODER, False)
        if backend is False:
            backend = self.memo[RUST_DECODER] = _rust_decoder(self.tokenizer)
        if backend is None:
            return _Decoding(self.decode, None)
        from tokenizers.decoders import DecodeStream

        return _Decoding(self.decode, functools.partial(DecodeStream(skip_special_tokens=True).step, backend))

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False)

    def token_texts(self, ids: Iterable[int]) -> dict[int, str]:
        """`token_text` of each distinct id among `ids`, each decoded once."""
        distinct = list(dict.fromkeys(ids))
        return dict(zip(distinct, self.tokenizer.batch_decode([[i] for i in distinct], clean_up_tokenization_spaces=False)))

    def own(self, ids: list[int]) -> Sequence[int]:
        """Indices of a text's own tokens in `ids`: the special tokens the tokenizer added left out,
        and a tag put before the sequence (`tags`), so that positions are the caller's letters.
        A `range` where they are one run between special tokens at the ends (the usual case): a
        10^6-residue sequence's indices as a list were 36 MB, each time they were asked for."""
        special = self.special_ids
        marks = [i for i, t in enumerate(ids) if t in special]
        head = next((k for k, at in enumerate(marks) if at != k), len(marks))  # specials before the first own token
        tail = len(marks) - head
        own: Sequence[int]
        if all(at == len(ids) - tail + k for k, at in enumerate(marks[head:])):
            own = range(head, len(ids) - tail)
        else:
            own = [i for i, t in enumerate(ids) if t not in special]
        for prefix in self._tag_ids():
            if [ids[i] for i in own[: len(prefix)]] == prefix:
                return own[len(prefix) :]
        return own

    def _tag_ids(self) -> list[list[int]]:
        """Each tag's tokens, longest first. A tag holds letters outside the alphabet, so no
        sequence checked against it can begin with one by chance."""
        if "tag_ids" not in self.memo:
            ids = [self.tokenize(text, special=False) for text in self.tags.values()]
            self.memo["tag_ids"] = sorted((i for i in ids if i), key=len, reverse=True)
        return self.memo["tag_ids"]

    @property
    def token_chars(self) -> int:
        """The most characters one token of this tokenizer may stand for: its longest vocabulary
        entry (a byte-level entry's characters are its bytes), or a WordPiece word it makes one
        unknown token of, whichever is longer; 0 when the tokenizer does not tell. Worked out once."""
        chars = self.memo.get(TOKEN_CHARS)
        if chars is None:
            try:
                vocab = self.tokenizer.get_vocab()
            except (AttributeError, NotImplementedError, TypeError):
                vocab = {}
            longest = max(map(len, vocab), default=0)
            word = getattr(self.tokenizer, "max_input_chars_per_word", 0) or 0
            # A tokenizer that does not tell its vocabulary: no bound can be known (0).
            chars = self.memo[TOKEN_CHARS] = max(longest, int(word)) if vocab else 0
        return chars

    def bound_text(self, chars: int, field: str = "input") -> None:
        """Refuse (413 `too_long`) a text that could not fit the context whatever it says, before
        a tokenizer sees it: a tokenizer allocates for a whole text at once, and a 20 MB body took
        an engine's tokenizer past its memory limit (an abort, not an error). Four times the bound,
        so that a normalizer that folds characters together (NFC makes one Hangul syllable of three
        jamo) never refuses a text that fits; only text a tokenizer drops (runs of spaces) can be
        refused at this size without filling the context, and then in these words."""
        most = 4 * self.context_length * self.token_chars
        if most and chars > most:
            raise TooLong(
                field,
                f"a text of {chars} characters is more than this model takes at once: its context is "
                f"{self.context_length} tokens of at most {self.token_chars} characters each",
            )

    def fit(self, n_tokens: int, field: str, what: str = "input") -> None:
        """Raise `TooLong` (413) if `n_tokens` exceed the model's context."""
        if n_tokens > self.context_length:
            raise TooLong(
                field,
                f"{what} needs {n_tokens} tokens; the model's context is {self.context_length}",
            )

    # -- forward passes (on the worker's thread) ------------------------------------------

    def logits(self, input_ids: Any, attention_mask: Any) -> Any:
        """Logits (batch × tokens × vocabulary) for a right-padded batch.

        A causal model's logits at t score token t + 1; a masked LM's score token t itself.
        """
        return self.module(input_ids=input_ids, attention_mask=attention_mask, **self._one_pass()).logits

    def _one_pass(self) -> dict[str, Any]:
        """What a pass that decodes nothing after it tells the model: no key-value cache. A causal
        model of transformers builds one by default, every layer's keys and values for every token,
        held until the pass ends (185 MB for 16 rows of 500 tokens of SmolLM2 in bfloat16)."""
        if "one_pass" not in self.memo:
            forward = getattr(self.module, "forward", None)
            try:
                takes = forward is not None and "use_cache" in inspect.signature(forward).parameters
            except (TypeError, ValueError):
                takes = False
            self.memo["one_pass"] = {"use_cache": False} if takes else {}
        return self.memo["one_pass"]

    def hidden_states(self, input_ids: Any, attention_mask: Any) -> tuple[Any, ...]:
        """The embeddings and every layer's output (transformers' `hidden_states`): layers + 1 tensors.

        The pass ends when the base model returns them: the head's logits at every position
        (a large vocabulary's make a good part of a small model's work) are never computed.
        """
        base = getattr(self.module, "base_model", self.module)
        got: list[Any] = []

        def returned(module: Any, args: Any, output: Any) -> None:
            states = getattr(output, "hidden_states", None)
            if states is not None:
                got.append(states)
                raise _Returned()

        handle = base.register_forward_hook(returned) if base is not self.module else None
        try:
            out = self.module(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, **self._one_pass())
        except _Returned:
            return tuple(got[0])
        finally:
            if handle is not None:
                handle.remove()
        return tuple(out.hidden_states)


def right_padded(model: Model, rows: list[list[int]]) -> tuple[Any, Any]:
    """Token id rows padded on the right into one batch: (input_ids, attention_mask) on the model's device."""
    import torch  # importing the model API needs no torch

    width = max(len(ids) for ids in rows)
    input_ids = torch.full((len(rows), width), model.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
    return input_ids.to(model.device), mask.to(model.device)
