"""Adapter over Hugging Face ``tokenizers``: the only module that imports it.

Texts are encoded once, without padding (each chunk pads to its own longest text later).
Truncation is done here, by hand, so every text carries an exact ``truncated`` flag: an
over-long text keeps ``<s>``, its first ``max_seq - 2`` content tokens and ``</s>``, which is
what FlagEmbedding's ``tokenizer(..., truncation=True, max_length=max_seq)`` produces.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import json
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tokenizers

from bgeserve import stopping
from bgeserve.engine.names import SettingNames
from bgeserve.errors import InvalidInput, ModelUnavailable, NotReady, TooLarge, surrogate_error
from bgeserve.results import TextTokens
from bgeserve.vocab import CLS_ID, EOS_ID, SPECIAL_TOKENS

# Encoding memory bounds (see Tokenizer.encode): characters per encode_batch call, and the
# characters per max_seq token past which a text is cut before encoding (XLM-R averages ~3-4).
GROUP_CHARS = 1 << 18
CUT_CHARS_PER_TOKEN = 8
_WORD_CHAR = re.compile(r"[^\W_]")  # a letter or digit: no normalizer maps it to nothing
# UTF-8 bytes to classes for the quick bound: "a" an ASCII letter or digit, " " a space, "."
# anything else (non-ASCII bytes included: the quick bound never counts what it cannot tell).
_CLASSES = bytes(0x61 if b < 0x80 and chr(b).isalnum() else 0x20 if b == 0x20 else 0x2E
                 for b in range(256))
# Past this many bytes the quick bound's pair counts run in numpy: bytes.count meets a
# candidate at every letter of "aaaa a" and costs ~4 ns a byte (54 us for 12k characters),
# numpy's masks ~1 ns (13 us); below it numpy's fixed cost loses (measured, 2-core Zen 3).
_NUMPY_COUNT_BYTES = 4096
# Asked "more than?" of a long text, the quick bound reads a prefix of this many characters
# per word it needs first (English averages ~6 with the space; most scripts fewer); texts
# shorter than the floor are read whole (a second pass would cost more than it saves).
_PREFIX_CHARS_PER_WORD = 8
_PREFIX_MIN_CHARS = 2048
_WORD_SPLITTERS = {"WhitespaceSplit", "Whitespace", "BertPreTokenizer"}
# Whitespace besides the space where a long text may be cut, each where the tokenizer splits
# at it as at a space (``_splits_at``): every character Python calls whitespace (Unicode's
# White_Space, the last at U+3000), bge-m3's splitting at line and paragraph breaks, tabs,
# CJK's ideographic space, no-break, thin, Ogham and the other typographic spaces (QA: words
# apart only by U+1680 were refused as one word past BGE_M3_MAX_TEXT_CHARS). Not U+200B,
# which its normalizer drops: words apart only by it are one word to it.
_BREAK_CONTEXTS = ("ab{0}cd", "混{0}合", "1.{0}.2", "x{0}{0}y", "{0}q")
_OTHER_BREAKS = "".join(c for c in map(chr, range(0x3001)) if c.isspace() and c != " ")
EXIT_WAIT_S = 60.0  # the longest interpreter exit waits for tokenizing in progress


# ``tokenizers`` encodes in Rust with the GIL released. A thread still in there when the
# interpreter finalizes (a caller's daemon thread: a script that ends while another thread
# embeds) is ended as it takes the GIL back, and the forced unwind through Rust's frames
# aborts the process ("FATAL: exception not rethrown", exit 134). So calls are counted, exit
# waits for those in progress, and none starts once it began.
_calls = threading.Condition()
_inside = 0
_exiting = False


@contextlib.contextmanager
def _native() -> Iterator[None]:
    global _inside
    with _calls:
        if _exiting:
            raise NotReady("the Python interpreter is exiting")
        _inside += 1
    try:
        yield
    finally:
        with _calls:
            _inside -= 1
            _calls.notify_all()


@atexit.register
def _wait_for_native_calls() -> None:
    global _exiting
    with _calls:
        _exiting = True
        _calls.wait_for(lambda: _inside == 0, timeout=EXIT_WAIT_S)


# Normalizers that act on each character alone (or only at the start, or on runs of spaces
# that a cut never splits), so the leading words of a text normalize as in the whole text.
_LOCAL_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "StripAccents", "Precompiled",
                      "Prepend", "BertNormalizer"}


def _local_normalizer(normalizer: dict | None) -> bool:
    if not normalizer:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_local_normalizer(n) for n in normalizer.get("normalizers", []))
    if kind == "Replace":  # XLM-R's: runs of spaces to one
        pattern = normalizer.get("pattern") or {}
        return pattern.get("Regex", pattern.get("String")) in (" {2,}", "  ")
    if kind == "Strip":  # only stripping the start: the end of a cut text is not the text's
        return not normalizer.get("strip_right", True)
    return kind in _LOCAL_NORMALIZERS


def _cut_is_exact(spec: dict, normalize: Callable[[str], str]) -> bool:
    """Whether a text's leading words (cut at a space or other break) tokenize as they do in
    the whole text, from the tokenizer's tokenizer.json ``spec``: its pre-tokenizer splits at
    spaces (checked by the caller), its normalizer is local, and no added token spans
    whitespace (one could straddle the cut), as written or, when it is matched on normalized
    text, as ``normalize`` makes it (NFKC turns "¨" into a space and a diaeresis)."""
    added = spec.get("added_tokens") or []
    return _local_normalizer(spec.get("normalizer")) and not any(
        any(c.isspace() for c in a.get("content", ""))
        or a.get("normalized") and any(c.isspace() for c in normalize(a.get("content", "")))
        for a in added)


def _pre_tokenizers(pre_tokenizer: dict | None) -> Iterator[dict]:
    """The pre-tokenizers (tokenizer.json's) of ``pre_tokenizer``, a Sequence's unfolded."""
    if not pre_tokenizer:
        return
    if pre_tokenizer.get("type") == "Sequence":
        for p in pre_tokenizer.get("pretokenizers", []):
            yield from _pre_tokenizers(p)
    else:
        yield pre_tokenizer


def _splits_on_spaces(pre_tokenizer: dict | None) -> bool:
    """Whether a pre-tokenizer (tokenizer.json's) cuts text at spaces, so no token spans two
    space-separated words (XLM-R's: Metaspace with split, or WhitespaceSplit)."""
    # ByteLevel's regex (GPT-2's, RoBERTa's) takes a space into the word after it (" b"), and
    # a run of spaces into a piece of its own: a cut before a space, as ``_leading`` makes it,
    # ends a piece as in the whole text (QA: a ByteLevel BPE's long texts were refused).
    return any(p.get("type") in _WORD_SPLITTERS
               or (p.get("type") == "Metaspace" and p.get("split", True))
               or (p.get("type") == "ByteLevel" and p.get("use_regex", True))
               for p in _pre_tokenizers(pre_tokenizer))


def _splits_at(tokenizer: tokenizers.Tokenizer, char: str) -> bool:
    """Whether ``tokenizer`` (normalizer, then pre-tokenizer) splits words at ``char`` as at a
    space, between letters, CJK, digits, punctuation and another such character: then a cut
    there, too, leaves the words before it tokenized as in the whole text. bge-m3's layouts
    do for newlines and tabs (WhitespaceSplit, or sentencepiece's normalizer mapping them to
    spaces), so a page of CJK with line breaks can be cut."""
    if tokenizer.pre_tokenizer is None:
        return False

    def pieces(text: str) -> list[str]:
        if tokenizer.normalizer is not None:
            text = tokenizer.normalizer.normalize_str(text)
        return [p for p, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]

    return all(pieces(context.format(char)) == pieces(context.format(" "))
               for context in _BREAK_CONTEXTS)


def _word_ends(classes: bytes, enough: int | None = None) -> int:
    """How often ``"a "`` and ``"a. "`` occur in a text's class bytes (``_CLASSES``): the
    words it ends. Neither pattern can overlap the other or itself. ``enough``: a count of
    ``"a "`` alone that reaches it is returned as it is (a lower bound all the same; the
    caller only asks "at least?"), without the ``"a. "`` pass."""
    if len(classes) < _NUMPY_COUNT_BYTES:
        n = classes.count(b"a ")
        return n if enough is not None and n >= enough else n + classes.count(b"a. ")
    c = np.frombuffer(classes, np.uint8)
    alnum, space = c == 0x61, c == 0x20
    n = int(np.count_nonzero(alnum[:-1] & space[1:]))
    if enough is not None and n >= enough:
        return n
    return n + int(np.count_nonzero(alnum[:-2] & (c[1:-1] == 0x2E) & space[2:]))


def _text_word_ends(text: str, enough: int) -> int:
    """``_word_ends`` of a whole text (plus a last word at its very end), or, asked for at
    least ``enough``, of the shortest prefix likely to hold that many (the pairs inside a
    prefix are word ends of the whole text too): a 12k-character text asked for 100 words is
    read for 1k characters, not 12k. Where the prefix holds too few, the whole text."""
    if len(text) > _PREFIX_MIN_CHARS:
        cut = _PREFIX_CHARS_PER_WORD * enough
        if cut < len(text):
            n = _word_ends(text[:cut].encode("utf-8", "surrogatepass").translate(_CLASSES),
                           enough)
            if n >= enough:
                return n
    b = text.encode("utf-8", "surrogatepass").translate(_CLASSES)
    return _word_ends(b, enough) + b.endswith((b"a", b"a."))


@dataclass
class Encoded:
    """Token ids per text (int64, special tokens included) and whether each was truncated."""

    ids: list[np.ndarray]
    truncated: np.ndarray
    # Tokens before truncation; for a text cut before encoding (Tokenizer.encode), a lower
    # bound (still more than max_seq).
    full_lengths: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        return np.fromiter((len(x) for x in self.ids), dtype=np.int64, count=len(self.ids))


class Tokenizer:
    """bge-m3's XLM-R tokenizer with truncation at ``max_seq`` tokens."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, max_seq: int,
                 max_whole_chars: int | None = None,
                 chars_setting: str = SettingNames.max_text_chars):
        if max_seq < 2:
            raise ValueError("max_seq must leave room for <s> and </s>")
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self._tk = tokenizer
        self.max_seq = max_seq
        # The longest text tokenized whole (None: any). A longer one is served only cut to
        # its leading words (``_prefix``, ``_encode_long``), where that is exact; else it is
        # TooLarge.
        self.max_whole_chars = max_whole_chars
        self.chars_setting = chars_setting  # what the refusal of a longer one says to raise
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        try:
            spec = json.loads(tokenizer.to_str())
        except (ValueError, AttributeError):
            spec = {}
        self._word_bound = _splits_on_spaces(spec.get("pre_tokenizer"))
        normalizer = tokenizer.normalizer
        self._cut_exact = self._word_bound and _cut_is_exact(
            spec, normalizer.normalize_str if normalizer is not None else str)
        self._breaks = " " + "".join(c for c in _OTHER_BREAKS if self._cut_exact
                                     and _splits_at(tokenizer, c))
        # What a cut's end drops: its breaks; under ByteLevel every whitespace (None), whose
        # regex makes a run of mixed whitespace one piece, cut apart otherwise (review:
        # "x\t\t\t  y" cut after the tabs ended in a piece the whole text lacks).
        self._cut_strip: str | None = (
            None if any(p.get("type") == "ByteLevel"
                        for p in _pre_tokenizers(spec.get("pre_tokenizer"))) else self._breaks)

    @classmethod
    def load(cls, path: Path, max_seq: int, max_whole_chars: int | None = None,
             chars_setting: str = SettingNames.max_text_chars) -> Tokenizer:
        """Read ``tokenizer.json``; a missing or invalid file, or one whose special tokens are
        not bge-m3's ids, is ``ModelUnavailable``."""
        try:
            raw = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise ModelUnavailable(f"cannot load tokenizer {path}: {exc}") from exc
        # The heads drop these ids and the padding is <pad>'s, as bge-m3's (XLM-R's) vocabulary
        # has them: a tokenizer with its own order gave <unk> a sparse weight without a word.
        found = {token: raw.token_to_id(token) for token in SPECIAL_TOKENS}
        if found != SPECIAL_TOKENS:
            raise ModelUnavailable(
                f"tokenizer {path} numbers its special tokens {found}, not as bge-m3's "
                f"(XLM-R's) vocabulary does ({SPECIAL_TOKENS}): bgeserve serves bge-m3's layout")
        return cls(raw, max_seq, max_whole_chars, chars_setting)

    def encode(self, texts: Sequence[str]) -> Encoded:
        """Tokenize ``texts`` (in parallel, in Rust) and truncate each to ``max_seq``.

        Memory stays bounded whatever comes in: ``tokenizers`` keeps ~150 bytes per token of
        a text (strings, offsets) until it is converted, so 250 texts of 131k characters held
        2.6 GiB at once. So texts are encoded in groups of at most ``GROUP_CHARS`` characters,
        each group's ids kept as int64 arrays before the next; and a text far longer than
        ``max_seq`` tokens can hold is cut first (``_prefix``): its leading words, as long as
        they give more than ``max_seq`` tokens, produce exactly the tokens that truncation of
        the whole text keeps. Where they do not, the text is encoded whole, but past
        ``max_whole_chars`` only its leading words within that many characters are tried, and
        a text they cannot serve exactly either is ``TooLarge`` (``_encode_long``).
        """
        texts = list(texts)
        if not all(isinstance(t, str) for t in texts):
            raise InvalidInput("cannot tokenize input: every text must be a string",
                               param="input")
        names = [f"input[{i}]" for i in range(len(texts))]
        return self._truncate(self.encode_leading(texts, [self.max_seq] * len(texts), names))

    def encode_rerank(self, query: str, documents: Sequence[str], query_keep: int,
                      document_keep: Callable[[np.ndarray], int | None]) -> list[np.ndarray]:
        """The ids of ``query`` (its first ``query_keep`` read) and of each document (the
        first ``document_keep(query's ids)`` read; None: all), as ``encode_leading`` gives
        them, a text named as the rerank request names it (``documents[2]``)."""
        q = self.encode_leading([query], [query_keep], ["query"])[0]
        keep = document_keep(q)
        return [q, *self.encode_leading(documents, [keep] * len(documents),
                                        [f"documents[{i}]" for i in range(len(documents))])]

    def encode_leading(self, texts: Sequence[str], keeps: Sequence[int | None],
                       names: Sequence[str]) -> list[np.ndarray]:
        """The ids of ``texts``, untruncated, where the caller reads only the first
        ``keeps[i]`` ids of a text longer than that (``<s>`` and ``</s>`` counted; None: it
        reads every id). Such a text may be tokenized from its leading words (as ``encode``
        does for ``max_seq``): its ids then end past ``keeps[i]`` in ids the whole text need
        not share, but its first ``keeps[i] - 1`` are the whole text's (and its length says
        only "over ``keeps[i]``"). A text over ``max_whole_chars`` with no ``keeps`` is
        ``TooLarge``, named ``names[i]``, before any text is tokenized."""
        prepared = [self._prefix(t, keep) for t, keep in zip(texts, keeps, strict=True)]
        # A text with no cut at its first cut that would be tokenized whole past
        # max_whole_chars is cut within the limit instead; refused before any text is
        # tokenized where it cannot be.
        for i, (text, cut, keep) in enumerate(zip(texts, prepared, keeps, strict=True)):
            if cut is text and not self._fits_whole(text):
                wider = self._wider_cut(text) if keep is not None else None
                if wider is None:
                    raise self._refusal(names[i], text, None, keep)
                prepared[i] = wider
        ids = self._encode_grouped(prepared, names)
        for i, (text, cut, keep) in enumerate(zip(texts, prepared, keeps, strict=True)):
            if cut is not text and not self._holds(ids[i], keep):
                ids[i] = self._encode_long(names[i], text, cut, keep)
        return ids

    @staticmethod
    def _holds(ids: np.ndarray, keep: int | None) -> bool:
        """Whether a cut text's ids show the cut exact for a reader of its first ``keep`` ids:
        still over ``keep`` (so truncation keeps only tokens the whole text shares) and ending
        in </s> as the whole text would. "Over", not "at": a cut may end in one token the
        whole text lacks there (a character normalized to a space that is no break, its run
        collapsed to one "▁"), and over ``keep`` that last token is always one truncation
        drops. (``keep`` None: every id is read, and no cut is exact.)"""
        return keep is not None and len(ids) > keep and ids[-1] == EOS_ID

    def _fits_whole(self, text: str) -> bool:
        return self.max_whole_chars is None or len(text) <= self.max_whole_chars

    def _wider_cut(self, text: str) -> str | None:
        """The leading words of ``text`` within ``max_whole_chars`` (None: no limit, no
        exact cut for this tokenizer, or no word before a break within it)."""
        if self.max_whole_chars is None or not self._cut_exact:
            return None
        return self._leading(text, self.max_whole_chars)

    def _encode_long(self, name: str, text: str, tried: str, keep: int | None) -> np.ndarray:
        """The ids of a text (``name``) when its cut (``tried``) did not do: the whole text, if
        it fits ``max_whole_chars``; else its leading words within that many characters, if
        longer than ``tried`` and still over ``keep`` ids; else ``TooLarge``. ``tokenizers``
        holds ~150 bytes per token while it encodes, and only this limit bounds a text without
        breaks (a blob, CJK without line breaks)."""
        if self._fits_whole(text):
            return self._encode_one(name, text)
        wider = self._wider_cut(text)
        if wider is not None and len(wider) > len(tried):
            ids = self._encode_one(name, wider)
            if self._holds(ids, keep):
                return ids
            tried = wider
        raise self._refusal(name, text, tried, keep)

    def _refusal(self, name: str, text: str, tried: str | None, keep: int | None) -> TooLarge:
        """Why a text (``name``), over ``max_whole_chars``, cannot be served: every token of
        it is read (``keep`` None); ``tried``, the longest cut tokenized, held too few tokens;
        else no cut could be made."""
        if keep is None:
            why = "every token of it is read (it is not truncated from the right)"
        elif tried is not None:
            why = (f"its leading {len(tried)} characters hold no more than the {keep} tokens "
                   "truncation keeps")
        elif not self._cut_exact:
            why = "this tokenizer's texts cannot be cut at a space without changing their tokens"
        else:
            breaks = "space or line break" if "\n" in self._breaks else "space"
            why = f"its first {self.max_whole_chars} characters have no {breaks} after a word"
        how = f"split the text or raise {self.chars_setting}" if keep is not None else \
            f"truncate it from the right, split it or raise {self.chars_setting}"
        return TooLarge(f"{name} has {len(text)} characters, over the limit of "
                        f"{self.max_whole_chars} ({self.chars_setting}) for a text tokenized "
                        f"whole, and it cannot be cut to its leading words exactly: {why}; "
                        f"{how}", param=name)

    def _encode_one(self, name: str, text: str) -> np.ndarray:
        return self._encode_grouped([text], [name])[0]

    def _prefix(self, text: str, keep: int | None) -> str:
        """``text``, or its leading words when it is longer than a reader of its first ``keep``
        ids needs (``keep`` x 8 characters, far more than that many tokens can be) or than the
        limit: cut at a space or other break (``_breaks``: the tokenizer splits there, so every
        word before the cut tokenizes as it does in the whole text), trailing breaks dropped.
        ``keep`` None: the text itself."""
        if keep is None or not self._cut_exact:
            return text
        limit = keep * CUT_CHARS_PER_TOKEN
        if self.max_whole_chars is not None:
            limit = min(limit, self.max_whole_chars)
        if len(text) <= limit:
            return text
        return self._leading(text, limit) or text

    def _leading(self, text: str, limit: int) -> str | None:
        """The words of ``text`` before its last break (``_breaks``: a space, or other
        whitespace this tokenizer splits at) within ``limit`` characters, trailing breaks
        dropped (None: no such break, or only breaks before it)."""
        at = max(text.rfind(c, 0, limit) for c in self._breaks)
        head = text[:at].rstrip(self._cut_strip) if at > 0 else ""
        return head or None

    def _encode_grouped(self, texts: Sequence[str],
                        names: Sequence[str] | None = None) -> list[np.ndarray]:
        """Ids of ``texts`` in groups of at most ``GROUP_CHARS`` characters; a text the
        tokenizer refuses (a lone surrogate) named by ``names`` (default ``input[i]``)."""
        out: list[np.ndarray] = []
        for group in _groups(texts, GROUP_CHARS):
            stopping.check()  # a caller that gave up: not a group more (bgeserve.stopping)
            with _native():
                try:
                    encodings = self._tk.encode_batch(group, add_special_tokens=True)
                except Exception as exc:  # its words name neither text nor fault
                    raise _named_fault(texts, names) or InvalidInput(
                        f"cannot tokenize input: {exc}", param="input") from exc
            out += [np.asarray(e.ids, dtype=np.int64) for e in encodings]
            del encodings
        return out

    def min_tokens(self, texts: Sequence[str], stop_above: int | None = None) -> int:
        """A lower bound on the tokens ``encode(texts)`` gives, far cheaper than encoding (for
        refusing work before tokenizing it when the queue is full).

        Each text has ``<s>`` and ``</s>``; where the pre-tokenizer cuts at spaces, each
        space-separated word holding a letter or digit is at least one more token. Capped at
        ``max_seq`` per text, as truncation does. Only as much of a text is read as ``encode``
        could tokenize (the words of a prefix bound the whole text's too): a 30M-character
        text without spaces, which ``encode`` refuses at once, took 0.25-0.6 s to count whole.
        """
        if not self._word_bound:
            return 2 * len(texts)
        read = self.max_whole_chars or self.max_seq * CUT_CHARS_PER_TOKEN
        if any(len(t) > read for t in texts):
            texts = [t[:read] for t in texts]
        # The quick bound first (passes in C or numpy per text: ~35 us for 12k characters);
        # the word walk (~1 ms) only when the quick one cannot say "more than stop_above".
        quick = self._quick_bound(texts, stop_above)
        if stop_above is not None and quick > stop_above:
            return quick
        return max(quick, self._walk_bound(texts, stop_above))

    def _quick_bound(self, texts: Sequence[str], stop_above: int | None) -> int:
        """Words ending in an ASCII letter or digit, or in one and one other character (each
        holds a letter or digit, so each is a word ``_walk_bound`` counts too), per text."""
        total = 0
        for t in texts:
            # Words past the cap, or past what takes the total over stop_above, change
            # nothing the caller asks: no need to count them.
            enough = self.max_seq - 2 if stop_above is None else \
                min(self.max_seq - 2, stop_above - total - 1)
            enough = max(1, enough)
            total += min(self.max_seq, 2 + _text_word_ends(t, enough))
            if stop_above is not None and total > stop_above:
                break
        return total

    def _walk_bound(self, texts: Sequence[str], stop_above: int | None) -> int:
        """Space-separated words holding a letter or digit (any script), per text."""
        total = 0
        for t in texts:
            # At most max_seq words of a text are looked at (its bound is capped there), no
            # more than could take the total past ``stop_above`` (the caller only asks "more
            # than?"; a prefix's count is still a lower bound), and none once it is past.
            limit = self.max_seq if stop_above is None else \
                max(1, min(self.max_seq, stop_above - total + 1))
            words = t.split(" ", limit)[:limit]
            # str.isalnum (all letters or digits) in C first; the regex only for the rest.
            rest = list(itertools.filterfalse(str.isalnum, words))
            counted = len(words) - len(rest) + len(list(filter(_WORD_CHAR.search, rest)))
            total += min(self.max_seq, 2 + counted)
            if stop_above is not None and total > stop_above:
                break
        return total

    def from_ids(self, sequences: Sequence[Sequence[int]]) -> Encoded:
        """Accept pre-tokenized input in bge-m3's vocabulary.

        ``<s>`` is added unless the sequence starts with it and ``</s>`` unless it ends with
        it, so the ids a client got from ``tokenizer(text)`` with or without special tokens
        embed exactly like ``text`` (a text whose own words begin with a literal ``<s>`` or
        end with ``</s>`` is told apart only when sent with its special tokens: README).
        """
        out = []
        for i, seq in enumerate(sequences):
            try:  # not dtype=int64: that would silently turn 1.5 into 1 and True into 1
                ids = np.asarray(seq)
            except ValueError:  # ragged nesting
                ids = np.empty(0)
            if ids.dtype.kind in "fO" and isinstance(seq, (list, tuple)) and seq and all(
                    isinstance(x, int) and not isinstance(x, bool) for x in seq):
                # Integers past int64 (2**63: numpy makes floats or objects of them) are
                # outside the vocabulary, not "not integers".
                j, big = next((j, x) for j, x in enumerate(seq) if not 0 <= x < self.vocab_size)
                raise InvalidInput(f"input[{i}][{j}] is token id {big}, outside the vocabulary "
                                   f"[0, {self.vocab_size})", param=f"input[{i}][{j}]")
            if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
                raise InvalidInput(f"input[{i}] must be a non-empty list of integer token ids",
                                   param=f"input[{i}]")
            bad = (ids < 0) | (ids >= self.vocab_size)
            if bad.any():  # the id itself named (fuzz QA: input[1] for input[1][0])
                j = int(np.argmax(bad))
                raise InvalidInput(
                    f"input[{i}][{j}] is token id {int(ids[j])}, outside the vocabulary "
                    f"[0, {self.vocab_size})", param=f"input[{i}][{j}]")
            ids = ids.astype(np.int64)
            head = [] if ids[0] == CLS_ID else [CLS_ID]
            tail = [] if ids.size >= 1 + (not head) and ids[-1] == EOS_ID else [EOS_ID]
            if head or tail:
                ids = np.concatenate((head, ids, tail)).astype(np.int64)
            out.append(ids)
        return self._truncate(out)

    def _truncate(self, ids: list[np.ndarray]) -> Encoded:
        truncated = np.zeros(len(ids), dtype=bool)
        full = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        limit = self.max_seq
        for i, x in enumerate(ids):
            if len(x) > limit:
                ids[i] = np.concatenate((x[: limit - 1], [x[-1]]))
                truncated[i] = True
        return Encoded(ids, truncated, full)

    def encode_left(self, texts: Sequence[str]) -> Encoded:
        """Token ids per text, an over-long text keeping ``<s>``, its *last* ``max_seq - 2``
        content tokens and ``</s>`` (TEI's ``truncation_direction: left``; Hugging Face's
        ``truncation_side="left"``), and which were cut. Encoded whole, in bounded groups: the
        caller bounds each text's length (the server refuses one over BGE_M3_MAX_TEXT_CHARS
        before it comes here; ``max_whole_chars`` is not applied)."""
        ids = self._encode_grouped(list(texts))
        keep = self.max_seq - 1  # the last content tokens and </s>
        full = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        return Encoded([x if len(x) <= self.max_seq else np.concatenate((x[:1], x[len(x) - keep:]))
                        for x in ids], full > self.max_seq, full)

    def tokens(self, texts: Sequence[str], add_special_tokens: bool = True,
               max_tokens: int | None = None) -> list[TextTokens]:
        """Every token of each text, untruncated, with UTF-8 byte offsets (TEI's ``/tokenize``).

        ``max_tokens`` bounds the whole answer (~21 bytes a token as ``TextTokens``, ~65 as
        JSON): past it, ``TooLarge``, refused before encoding where the texts' words are
        already more (``min_tokens``), else once the texts encoded so far are, before their
        tokens are made. Each text is encoded whole: the caller bounds its length (the
        server: BGE_M3_MAX_TEXT_CHARS); texts are encoded ``GROUP_CHARS`` characters at a
        time, so no more than one group is encoded past the bound (QA: 64 texts of 20,000
        words, refused once 64 had been encoded at once, took +445 MiB of RSS with bge-m3's
        tokenizer, and two at once got the server OOM-killed under a 600 MiB cap; now +74,
        and 31 such texts, past the words' bound, +97 for +243).
        """
        if max_tokens is not None:
            # min_tokens counts <s> and </s> (2 a text); without them, 2 a text fewer, still
            # a lower bound: min(max_seq, 2 + words) - 2 <= words (review: requests under the
            # bound were refused).
            specials = 0 if add_special_tokens else 2 * len(texts)
            stop = max_tokens + specials
            if self.min_tokens(texts, stop_above=stop) - specials > max_tokens:
                raise self._too_many(max_tokens)
        out: list[TextTokens] = []
        total = 0
        for group in _groups(texts, GROUP_CHARS, most=64):
            stopping.check()
            with _native():
                try:
                    encodings = self._tk.encode_batch(group,
                                                      add_special_tokens=add_special_tokens)
                except Exception as exc:
                    raise surrogate_error(texts, "inputs") or InvalidInput(
                        f"cannot tokenize input: {exc}", param="inputs") from exc
            total += sum(len(enc.ids) for enc in encodings)
            if max_tokens is not None and total > max_tokens:
                raise self._too_many(max_tokens)
            out += [_tokens(text, enc, self._tk.id_to_token)
                    for text, enc in zip(group, encodings, strict=True)]
            del encodings
        return out

    @staticmethod
    def _too_many(max_tokens: int) -> TooLarge:
        return TooLarge(f"the texts of this request hold more than {max_tokens} tokens; send "
                        "fewer or shorter texts per /tokenize request", param="inputs")

    def decode(self, sequences: Sequence[Sequence[int]],
               skip_special_tokens: bool = True) -> list[str]:
        """The text of each id sequence (TEI's ``/decode``); an id outside the vocabulary is
        ``InvalidInput``."""
        for i, seq in enumerate(sequences):
            bad = [t for t in seq if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidInput(f"ids[{i}] has token id {bad[0]} outside the vocabulary "
                                   f"[0, {self.vocab_size})", param=f"ids[{i}]")
        with _native():
            return self._tk.decode_batch([list(s) for s in sequences],
                                         skip_special_tokens=skip_special_tokens)

    def id_to_token(self, ids: Sequence[int]) -> list[str]:
        """Token strings for ids (``<unk>`` for an id the vocabulary lacks)."""
        return [self._tk.id_to_token(int(i)) or "<unk>" for i in ids]


def _named_fault(texts: Sequence[str], names: Sequence[str] | None) -> InvalidInput | None:
    """The refusal of the first text holding a lone surrogate, named by ``names`` (default
    ``input[i]``); None when none does."""
    if names is None:
        return surrogate_error(list(texts), "input")
    for text, name in zip(texts, names, strict=True):
        found = surrogate_error(text, name)
        if found is not None:
            return found
    return None


def _byte_starts(text: str) -> np.ndarray | None:
    """UTF-8 byte offset of every character of ``text`` and of its end (None when ASCII,
    where characters and bytes coincide)."""
    if text.isascii():
        return None
    points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    widths = 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000)
    return np.concatenate(([0], np.cumsum(widths)))


def _groups(texts: Sequence[str], chars: int, most: int | None = None) -> Iterator[list[str]]:
    """``texts`` in order, in groups of at most ``chars`` characters (a longer text alone)
    and ``most`` texts."""
    group: list[str] = []
    size = 0
    for text in texts:
        if group and (len(group) == most or size + len(text) > chars):
            yield group
            group, size = [], 0
        group.append(text)
        size += len(text)
    if group:
        yield group


def _tokens(text: str, encoding: tokenizers.Encoding,
            id_to_token: Callable[[int], str | None]) -> TextTokens:
    """TEI's tokens for one encoding: ``tokenizers`` gives character offsets in Python, TEI
    (Rust) byte offsets, which the slice of the text between them is the same as."""
    ids = np.array(encoding.ids, dtype=np.int32)
    special = np.array(encoding.special_tokens_mask, dtype=bool)
    chars = np.array(encoding.offsets, dtype=np.int32).reshape(-1, 2)
    starts = _byte_starts(text)
    byte_offsets = chars if starts is None else starts[chars].astype(np.int32)
    strings = {int(t): id_to_token(int(t)) or "" for t in np.unique(ids[special])}
    return TextTokens(text, ids, special, chars, byte_offsets, strings)


@functools.lru_cache(maxsize=8)
def untruncated(path: Path, max_whole_chars: int | None = None,
                chars_setting: str = SettingNames.max_text_chars) -> Tokenizer:
    """``path``'s tokenizer without truncation, loaded once per file and limit: rerank windows
    need every token of a document they cover (``encode_leading`` reads fewer of a text cut
    from the right), and a text over ``max_whole_chars`` is tokenized only from its leading
    words."""
    return Tokenizer.load(path, 1 << 30, max_whole_chars, chars_setting)
