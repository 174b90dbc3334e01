"""A sequence model's alphabet, and sequences cleaned and checked against it.

Protein and DNA models read letters: ESM-2's tokenizer has one token per amino
acid, an Evo2-style model one per base. Such a model has an alphabet, and every
text a tool hands it as a sequence (the fields a tool names in `Tool.sequences`)
is cleaned the one documented way before it is queued: upper-cased, with
whitespace and line breaks removed (FASTA wraps its lines), the model's mask
token kept as it is. A letter outside the alphabet is refused with 422 naming the
field, the position and the letter, never tokenised as "unknown": a wrong letter
turned into <unk> would give numbers for a sequence nobody asked about.

A model of text (any tokenizer with more than single letters) has no alphabet,
and its texts are passed on exactly as written.

A model may also declare tags, named prefixes (Evo2 puts its organism's lineage,
`|D__BACTERIA;…|`, before a sequence). The `tag` param picks one; it goes before
each sequence after cleaning (its own letters are not the alphabet's, which is
also how `Model.own` tells it from the sequence and leaves it out of positions).
A tag the model does not have is a 422 listing those it has, never a silent run
without one.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from gateway.errors import ParamError

# A tokenizer whose every ordinary token is one character, and at most this many of them, reads letters.
MAX_LETTERS = 64
_WHITESPACE = re.compile(r"\s+")


def from_tokenizer(tokenizer: Any) -> str | None:
    """The letters a character-level tokenizer reads (in its vocabulary's order), or None for a tokenizer of text."""
    special = set(getattr(tokenizer, "all_special_tokens", []))
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    # Reserved slots such as ESM-2's <null_1> are special in all but name.
    ordinary = [token for token, _ in vocab if token not in special and not (token.startswith("<") and token.endswith(">"))]
    if not ordinary or len(ordinary) > MAX_LETTERS or any(len(token) != 1 for token in ordinary):
        return None
    if sum(token.isalpha() and token.isupper() for token in ordinary) < 4:
        return None
    return "".join(ordinary)


def clean(text: str, alphabet: str, field: str, keep: str | None = None) -> str:
    """`text` upper-cased and without whitespace, every letter in `alphabet` (`keep`, a mask token, stays as is);
    422 on `field` naming the first letter that is not, and its position (from 1, in the cleaned sequence)."""
    pieces = text.split(keep) if keep else [text]
    cleaned = [_WHITESPACE.sub("", piece).upper() for piece in pieces]
    position = 0
    for piece in cleaned:
        for letter in piece:
            position += 1
            if letter not in alphabet:
                raise ParamError(
                    field,
                    f"letter {letter!r} at position {position} is not in the model's alphabet ({alphabet}); "
                    "sequences are upper-cased and stripped of whitespace, nothing else is changed",
                )
        position += 1  # the mask token after it is one position
    return keep.join(cleaned) if keep else cleaned[0]


def _prefix(model: Any, tag: str) -> str:
    """The prefix text of `model`'s tag `tag`; 422 on `tag` for a model without tags or a tag it does not have."""
    if not model.tags:
        raise ParamError("tag", f"the model {model.name} declares no tags")
    if tag not in model.tags:
        raise ParamError("tag", f"unknown tag {tag!r}; the model's tags: {', '.join(sorted(model.tags))}")
    return model.tags[tag]


def clean_params(model: Any, fields: tuple[str, ...], params: Any, tagged: tuple[str, ...] | None = None) -> None:
    """Clean the sequence `fields` of `params` in place for `model`, if it has an alphabet; then put
    the prefix of the model's tag that `params.tag` names (if any) before each of those in `tagged`."""
    alphabet = getattr(model, "alphabet", None)
    tag = getattr(params, "tag", None)
    prefix = _prefix(model, tag) if tag is not None else ""
    if not alphabet and not prefix:
        return
    keep = model.token_text(model.mask_token_id) if model.mask_token_id is not None else None
    cleaned: dict[str, Any] = {}
    for name in fields:
        value = getattr(params, name, None)
        head = prefix if tagged is None or name in tagged else ""
        if isinstance(value, str):
            cleaned[name] = head + (clean(value, alphabet, name, keep) if alphabet else value)
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            cleaned[name] = [head + (clean(v, alphabet, f"{name}[{i}]", keep) if alphabet else v) for i, v in enumerate(value)]
    for name, value in cleaned.items():
        # In place (a frozen Struct's too): the params object is the job's, checked and then queued as it is.
        msgspec.structs.force_setattr(params, name, value)
