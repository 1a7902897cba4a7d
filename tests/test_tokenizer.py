"""Tests for bgeserve.tokenizer: truncation flags, token-id input and loading, on a tiny
Unigram tokenizer built here with bge-m3's special tokens and ``<s> $A </s>`` template."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizers import AddedToken, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as HfTokenizer
from tokenizers.models import Unigram

from bgeserve.engine.tokenizer import Tokenizer
from bgeserve.errors import InvalidInput, ModelUnavailable, TooLarge
from bgeserve.vocab import CLS_ID, EOS_ID, PAD_ID, SPECIAL_IDS, UNK_ID

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
WORDS = ["hello", "world", "the", "cat", "sat", "on", "mat"]
LETTERS = "abcdefghijklmnopqrstuvwxyz"
# ids: 0-3 specials, 4-10 "▁word", 11 "▁", 12-37 single letters
ID = {w: 4 + i for i, w in enumerate(WORDS)}
VOCAB = 4 + len(WORDS) + 1 + len(LETTERS)


def hf_tokenizer() -> HfTokenizer:
    """A tiny XLM-R-style Unigram tokenizer: whole words, else letters, else ``<unk>``."""
    pieces = [(t, 0.0) for t in SPECIALS] + [("▁" + w, -1.0) for w in WORDS]
    pieces += [("▁", -3.0)] + [(c, -5.0) for c in LETTERS]
    tok = HfTokenizer(Unigram(pieces, unk_id=UNK_ID, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", CLS_ID), ("</s>", EOS_ID)])
    return tok


def make(max_seq: int = 512) -> Tokenizer:
    return Tokenizer(hf_tokenizer(), max_seq)


def words(n: int) -> str:
    """A text of ``n`` known words: exactly ``n`` content tokens."""
    return " ".join(WORDS[i % len(WORDS)] for i in range(n))


def content_ids(n: int) -> list[int]:
    return [ID[WORDS[i % len(WORDS)]] for i in range(n)]


def test_the_special_token_ids_are_bge_m3s():
    """<s>=0, <pad>=1, </s>=2, <unk>=3, as bge-m3's vocabulary has them."""
    assert (CLS_ID, PAD_ID, EOS_ID, UNK_ID) == (0, 1, 2, 3)
    assert SPECIAL_IDS == (0, 1, 2, 3)


# -------------------------------------------------------------------------------- encode
def test_encode_wraps_each_text_in_cls_and_eos():
    """Each text becomes <s> content </s> as int64, with no padding between texts."""
    enc = make().encode(["hello world", "the cat sat on the mat"])
    assert [x.tolist() for x in enc.ids] == [
        [0, ID["hello"], ID["world"], 2],
        [0, ID["the"], ID["cat"], ID["sat"], ID["on"], ID["the"], ID["mat"], 2]]
    assert all(x.dtype == np.int64 for x in enc.ids)
    np.testing.assert_array_equal(enc.lengths, [4, 8])
    assert enc.lengths.dtype == np.int64
    np.testing.assert_array_equal(enc.truncated, [False, False])
    np.testing.assert_array_equal(enc.full_lengths, [4, 8])


def test_an_empty_string_is_just_cls_and_eos():
    """"" encodes to [<s>, </s>]."""
    enc = make().encode([""])
    assert enc.ids[0].tolist() == [0, 2]
    assert not enc.truncated[0]


def test_unknown_characters_become_unk():
    """Characters outside the vocabulary map to <unk> (id 3), not an error."""
    assert UNK_ID in make().encode(["😀"]).ids[0].tolist()


def test_truncation_keeps_cls_the_first_content_tokens_and_eos():
    """An over-long text keeps <s>, its first max_seq-2 content tokens and </s>; flagged."""
    tok = make(max_seq=6)
    enc = tok.encode([words(10), words(2)])
    assert enc.ids[0].tolist() == [0, *content_ids(4), 2]
    assert enc.truncated.tolist() == [True, False]
    assert enc.full_lengths.tolist() == [12, 4]
    assert enc.lengths.tolist() == [6, 4]


@pytest.mark.parametrize("max_seq", [2, 3, 7, 50])
def test_a_text_of_exactly_max_seq_tokens_is_not_truncated(max_seq):
    """max_seq tokens fit; one more is cut back to max_seq and flagged."""
    enc = make(max_seq).encode([words(max_seq - 2), words(max_seq - 1)])
    assert len(enc.ids[0]) == max_seq and not enc.truncated[0]
    assert len(enc.ids[1]) == max_seq and enc.truncated[1]
    assert enc.ids[1][0] == CLS_ID and enc.ids[1][-1] == EOS_ID
    assert enc.full_lengths.tolist() == [max_seq, max_seq + 1]


def test_max_seq_two_keeps_only_the_special_tokens():
    """At max_seq=2 every non-empty text is cut to [<s>, </s>]."""
    enc = make(2).encode(["hello world"])
    assert enc.ids[0].tolist() == [0, 2] and enc.truncated[0]


def test_max_seq_below_two_is_refused():
    """A limit with no room for <s> and </s> is a programming error."""
    with pytest.raises(ValueError, match="max_seq"):
        Tokenizer(hf_tokenizer(), 1)


def test_the_files_own_padding_and_truncation_are_ignored():
    """A tokenizer.json that pads or truncates does not change ids or the truncated flag."""
    hf = hf_tokenizer()
    hf.enable_truncation(max_length=3)
    hf.enable_padding(pad_id=PAD_ID, pad_token="<pad>", length=20)
    enc = Tokenizer(hf, 6).encode([words(10), words(1)])
    assert enc.ids[0].tolist() == [0, *content_ids(4), 2] and enc.truncated[0]
    assert enc.full_lengths[0] == 12
    assert enc.ids[1].tolist() == [0, ID["hello"], 2]


def test_unencodable_input_is_invalid_input():
    """Something the tokenizer rejects (not a string) is InvalidInput on ``input``."""
    with pytest.raises(InvalidInput) as info:
        make().encode([123])  # type: ignore[list-item]
    assert info.value.param == "input"


def test_a_lone_surrogate_is_named_with_its_text_and_place():
    """tokenizers refuses a lone surrogate in words naming neither ("TextEncodeInput must be
    Union[...]"): the refusal names the text and the character; a rerank names the query or
    the document as its request does."""
    with pytest.raises(InvalidInput, match=r"input\[1\] holds a lone surrogate \(U\+D800 at "
                       r"character 6\)") as info:
        make().encode(["hello", "hello \ud800"])
    assert info.value.param == "input[1]"
    with pytest.raises(InvalidInput) as info:
        make().encode_rerank("hello", ["hello", "hello", "\udfff"], 64, lambda q: None)
    assert info.value.param == "documents[2]"
    with pytest.raises(InvalidInput) as info:
        make().encode_rerank("\udfff", ["hello"], 64, lambda q: None)
    assert info.value.param == "query"
    with pytest.raises(InvalidInput) as info:
        make().tokens(["hello"] * 70 + ["\ud800"])
    assert info.value.param == "inputs[70]"
    # A long text cut to its leading words, then encoded whole (its cut ended early): still
    # named by its place in the request.
    long = "hello " + "z" * 100 + "\ud800"  # cut after "hello": too few tokens, so whole
    with pytest.raises(InvalidInput) as info:
        make(max_seq=8).encode(["hello", "hello", long])
    assert info.value.param == "input[2]"


def test_encoding_nothing_gives_nothing():
    """No texts, no ids; the arrays are still well-typed."""
    enc = make().encode([])
    assert enc.ids == [] and enc.truncated.shape == (0,) and enc.lengths.shape == (0,)


# ------------------------------------------------------------------------------ from_ids
def test_from_ids_wraps_content_ids():
    """Ids without special tokens are wrapped, embedding exactly like the text they came from."""
    tok = make()
    enc = tok.from_ids([[ID["hello"], ID["world"]]])
    assert enc.ids[0].tolist() == tok.encode(["hello world"]).ids[0].tolist()
    assert enc.ids[0].dtype == np.int64


def test_from_ids_keeps_already_wrapped_ids():
    """Ids that start with <s> and end with </s> are taken as they are."""
    tok = make()
    wrapped = tok.encode(["the cat"]).ids[0].tolist()
    assert tok.from_ids([wrapped]).ids[0].tolist() == wrapped
    assert tok.from_ids([[0, 2]]).ids[0].tolist() == [0, 2]


def test_from_ids_adds_only_the_missing_special_end():
    """A sequence cut from a wrapped encoding (``<s>`` kept, ``</s>`` lost) or the reverse gets
    the missing end only, never a second ``<s>``."""
    tok = make()
    assert tok.from_ids([[0, 5]]).ids[0].tolist() == [0, 5, 2]
    assert tok.from_ids([[5, 2]]).ids[0].tolist() == [0, 5, 2]
    assert tok.from_ids([[0]]).ids[0].tolist() == [0, 2]
    assert tok.from_ids([[2]]).ids[0].tolist() == [0, 2]
    cut = tok.encode(["the cat sat on the mat"]).ids[0].tolist()[:4]
    assert tok.from_ids([cut]).ids[0].tolist() == [*cut, 2]


def test_ids_past_int64_are_outside_the_vocabulary():
    """2**63 is an integer too big for the vocabulary, not "not an integer"."""
    from bgeserve.errors import InvalidInput

    tok = make()
    for ids in ([5, 2**63], [2**64], (2**63,)):
        with pytest.raises(InvalidInput, match=f"token id {ids[-1]}, outside the vocabulary") \
                as refused:
            tok.from_ids([ids])
        assert refused.value.param == f"input[0][{len(ids) - 1}]"  # the id itself
    with pytest.raises(InvalidInput, match=r"input\[1\]\[2\] is token id 999999") as refused:
        tok.from_ids([[5], [6, 7, 999_999, -1]])
    assert refused.value.param == "input[1][2]"
    with pytest.raises(InvalidInput, match="integer token ids"):
        tok.from_ids([[5, "x"]])


def test_min_tokens_is_a_lower_bound_of_encode():
    """The cheap bound the overload check uses never exceeds the real count: words the
    vocabulary lacks, punctuation-only words, spacing, unicode, truncation."""
    texts = ["hello world", "the  cat sat", "zzzz qqq", "!!! ... hello", "", "   ",
             "日本語 text", "a\u200bb c", "tab\tseparated words", words(40),
             "cat. sat.. on... mat", "the cat.", " hello ", "_ _ cat_", "héllo wörld ñ"]
    for max_seq in (4, 16, 512):
        tok = make(max_seq)
        for text in texts:
            real = int(tok.encode([text]).lengths[0])
            assert 2 <= tok.min_tokens([text]) <= real, (text, max_seq)
        assert tok.min_tokens(texts) <= int(tok.encode(texts).lengths.sum())
    assert make().min_tokens([words(10)]) == 12  # known words: the bound is exact


def test_the_quick_bounds_word_count_is_the_same_in_numpy_and_in_bytes_count(monkeypatch):
    """Long texts count their word ends with numpy masks, short ones with bytes.count: the
    same number either way, at the ends, on runs of dots and spaces, at every length (the
    numpy path forced for the short ones)."""
    import random

    from bgeserve.engine import tokenizer as module

    rng = random.Random(3)
    pieces = ["a", "aa", " ", "  ", ".", "..", "a.", "a. ", "a ", ". a"]
    lengths = (0, 1, 2, 3, 4, 10, 97, module._NUMPY_COUNT_BYTES, 3 * module._NUMPY_COUNT_BYTES)
    for threshold in (module._NUMPY_COUNT_BYTES, 0):
        monkeypatch.setattr(module, "_NUMPY_COUNT_BYTES", threshold)
        for length in lengths:
            for _ in range(20):
                text = "".join(rng.choice(pieces) for _ in range(length))[:length].encode()
                assert module._word_ends(text) == text.count(b"a ") + text.count(b"a. "), text
    monkeypatch.undo()
    long_text = words(3000)  # past the threshold, known words: still the exact count
    tok = make(8192)
    assert len(long_text.encode()) > module._NUMPY_COUNT_BYTES
    assert tok.min_tokens([long_text]) == int(tok.encode([long_text]).lengths[0]) == 3002


def test_the_quick_bound_reads_a_prefix_when_it_holds_enough_words(monkeypatch):
    """Asked "more than stop_above?" of a long text, the quick bound counts a prefix of ~8
    characters per word it needs (a word that ends inside a prefix ends in the whole text);
    the whole text only where the prefix holds too few. Without a question it reads no more
    than the max_seq cap needs. Its answers are the same as reading everything."""
    from bgeserve.engine import tokenizer as module

    read: list[int] = []
    word_ends = module._word_ends
    monkeypatch.setattr(module, "_word_ends",
                        lambda b, enough=None: read.append(len(b)) or word_ends(b, enough))
    tok = make(8192)
    text = words(3000)  # ~17k characters of known words: 3,000 tokens
    assert tok.min_tokens([text], stop_above=100) > 100
    assert read == [module._PREFIX_CHARS_PER_WORD * 99]  # 2 + 99 words > 100
    read.clear()
    assert tok._quick_bound([text], None) == 3002  # under the cap: all of it, exact
    assert read == [len(text)]
    read.clear()
    assert make(512)._quick_bound([text], None) == 512  # past the cap: a prefix is enough
    assert read == [module._PREFIX_CHARS_PER_WORD * 510]
    read.clear()
    sparse = "x" * 20_000 + " " + words(10)  # a long first word: the prefix holds too few
    assert tok.min_tokens([sparse], stop_above=5) > 5
    assert read == [module._PREFIX_CHARS_PER_WORD * 4, len(sparse)]


def test_the_quick_bound_with_a_question_is_a_lower_bound_or_past_it():
    """Prefixes and the skipped "word. " pass only shorten the count where the answer is
    "more than stop_above" either way: for texts of words, punctuation and space runs at
    lengths past the prefix floor, the bound never exceeds the real tokens, and is past
    stop_above exactly when the whole count is."""
    import random

    rng = random.Random(5)
    pieces = [*WORDS, "the cat.", "sat,", "  ", "...", "é", "日本"]
    tok = make(8192)
    for _ in range(30):
        # Some end in a long run the quick bound counts nothing of: all of their words are
        # then in a prefix, where an off-by-one would show.
        texts = [" ".join(rng.choice(pieces) for _ in range(rng.randrange(1, 1500)))
                 + rng.choice(["", " 日本語" * rng.randrange(500, 3000)])
                 for _ in range(rng.randrange(1, 4))]
        real = int(tok.encode(texts).lengths.sum())
        whole = tok._quick_bound(texts, None)
        for stop in (0, 10, 300, 1000, 5000, whole - 1, whole, whole - 50):  # at the edge too
            bound = tok._quick_bound(texts, stop)
            assert bound <= real
            assert (bound > stop) == (whole > stop), (stop, bound, whole)
            assert bound == whole or bound > stop


def test_min_tokens_without_a_word_splitting_pre_tokenizer_counts_specials_only():
    hf = hf_tokenizer()
    hf.pre_tokenizer = None
    tok = Tokenizer(hf, 512)
    assert tok.min_tokens(["hello world", "cat"]) == 4


def test_from_ids_truncates_like_encode():
    """Over-long token-id input is cut to max_seq with </s> kept, and flagged."""
    tok = make(max_seq=5)
    enc = tok.from_ids([list(range(4, 14)), [0, *range(4, 14), 2], [5, 6, 7]])
    assert enc.ids[0].tolist() == [0, 4, 5, 6, 2]
    assert enc.ids[1].tolist() == [0, 4, 5, 6, 2]
    assert enc.ids[2].tolist() == [0, 5, 6, 7, 2]
    assert enc.truncated.tolist() == [True, True, False]
    assert enc.full_lengths.tolist() == [12, 12, 5]


@pytest.mark.parametrize(("bad", "j"), [([-1], 0), ([VOCAB], 0), ([4, 5, VOCAB + 100], 2),
                                        ([0, -7, 2], 1)])
def test_from_ids_rejects_ids_outside_the_vocabulary(bad, j):
    """A negative id or one ≥ the vocabulary size is InvalidInput naming input[i][j], the id
    itself (fuzz QA: input[i] named the text, where the parser's own checks name the id)."""
    with pytest.raises(InvalidInput) as info:
        make().from_ids([[4, 5], bad])
    assert info.value.param == f"input[1][{j}]"
    assert f"input[1][{j}]" in info.value.message and f"[0, {VOCAB})" in info.value.message


def test_from_ids_accepts_the_last_vocabulary_id():
    """vocab_size - 1 is a valid id."""
    assert make().from_ids([[VOCAB - 1]]).ids[0].tolist() == [0, VOCAB - 1, 2]


@pytest.mark.parametrize("bad", [[], [[4, 5]]])
def test_from_ids_rejects_empty_or_nested_sequences(bad):
    """An empty list (or a list of lists) is InvalidInput naming input[i]."""
    with pytest.raises(InvalidInput) as info:
        make().from_ids([[4], bad])
    assert info.value.param == "input[1]"
    assert "non-empty" in info.value.message


@pytest.mark.parametrize(("bad", "param"), [
    ([4, 5.5], "input[1]"), ([True], "input[1]"), (["4"], "input[1]"),
    ([4, 2**70], "input[1][1]"),  # an integer: outside the vocabulary, named as such
    ([[4], [4, 5]], "input[1]")])
def test_from_ids_rejects_non_integer_ids(bad, param):
    """Floats, a boolean list, strings, ints beyond int64 and ragged nesting are InvalidInput on
    input[i], never silently cast (1.5 → 1) nor a stray numpy error."""
    with pytest.raises(InvalidInput) as info:
        make().from_ids([[4], bad])
    assert info.value.param == param


def test_from_ids_accepts_numpy_integer_arrays():
    """int32 / uint16 arrays are accepted and come out int64."""
    enc = make().from_ids([np.array([4, 5], np.int32), np.array([6], np.uint16)])
    assert [x.tolist() for x in enc.ids] == [[0, 4, 5, 2], [0, 6, 2]]
    assert all(x.dtype == np.int64 for x in enc.ids)


def test_vocab_size_counts_the_special_tokens():
    """vocab_size is the full vocabulary, added tokens included."""
    assert make().vocab_size == VOCAB


# -------------------------------------------------------------------------------- tokens
def test_id_to_token_gives_piece_strings():
    """Ids map back to their pieces, special tokens included."""
    assert make().id_to_token([0, 1, 2, 3, ID["cat"], 11]) == [
        "<s>", "<pad>", "</s>", "<unk>", "▁cat", "▁"]


def test_id_to_token_gives_unk_for_an_unknown_id():
    """An id the vocabulary lacks reads as <unk> instead of failing."""
    assert make().id_to_token([VOCAB + 5]) == ["<unk>"]


def test_id_to_token_accepts_numpy_ids():
    """numpy integers (what Encoded holds) are accepted."""
    tok = make()
    assert tok.id_to_token(tok.encode(["hello"]).ids[0]) == ["<s>", "▁hello", "</s>"]


# -------------------------------------------------------------------------------- load
def test_load_reads_a_tokenizer_json(tmp_path: Path):
    """A saved tokenizer.json loads and encodes like the in-memory tokenizer."""
    path = tmp_path / "tokenizer.json"
    hf_tokenizer().save(str(path))
    tok = Tokenizer.load(path, 8)
    assert tok.max_seq == 8
    assert tok.encode(["hello world"]).ids[0].tolist() == make().encode(["hello world"]).ids[
        0].tolist()


@pytest.mark.parametrize("content", [None, "{not json", '{"version": "1.0"}'])
def test_load_of_a_missing_or_broken_file_is_model_unavailable(tmp_path: Path, content):
    """A missing or invalid tokenizer.json is ModelUnavailable naming the path."""
    path = tmp_path / "tokenizer.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ModelUnavailable, match="tokenizer.json"):
        Tokenizer.load(path, 8)


# ------------------------------------------------------------------ bounded encoding memory
def _reference(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Encode every text whole, then truncate as the server does (the definition)."""
    out = []
    for e in tok._tk.encode_batch(texts, add_special_tokens=True):
        ids = list(e.ids)
        out.append(ids if len(ids) <= tok.max_seq else ids[: tok.max_seq - 1] + ids[-1:])
    return out


def test_long_texts_cut_before_encoding_give_the_tokens_of_the_whole_text(monkeypatch):
    """A text far past max_seq is encoded from its leading words only, with exactly the ids
    and truncation flags of encoding it whole: spacing runs, unicode, unknown symbols, a
    literal special token at the cut; texts without spaces, or whose leading words give too
    few tokens, are encoded whole."""
    tok = make(max_seq=16)  # texts over 16 * 8 = 128 characters are cut
    rng = np.random.default_rng(3)
    vocab = WORDS + ["zq", "日本", "a\u00a0b", "e\u0301", "<s>", "</s>", "☃☃☃", "x" * 40]
    texts = []
    for n in (5, 30, 60, 200):
        for _ in range(5):
            picked = rng.choice(vocab, n)
            seps = rng.choice([" ", "  ", "   ", "\t", " \n "], n)
            texts.append("".join(w + s for w, s in zip(picked, seps, strict=True)))
    texts += ["x" * 500, ("☃" * 60 + " ") * 6, words(100) + "   ", "cat " * 100]
    encoded: list[int] = []
    real = tok._tk.encode_batch
    monkeypatch.setattr(tok, "_tk", type("Spy", (), {
        "encode_batch": lambda self, batch, **kw: encoded.extend(map(len, batch))
        or real(batch, **kw)})())
    enc = tok.encode(texts)
    monkeypatch.undo()
    want = _reference(tok, texts)
    assert [x.tolist() for x in enc.ids] == want
    full = [len(e.ids) for e in tok._tk.encode_batch(texts, add_special_tokens=True)]
    assert enc.truncated.tolist() == [n > 16 for n in full]
    assert all(16 < lo <= n or lo == n
               for lo, n in zip(enc.full_lengths.tolist(), full, strict=True))
    prepared = encoded[:len(texts)]  # the first call: every text as prepared, in one group
    cut = [p < len(t) for p, t in zip(prepared, texts, strict=True)]
    assert sum(cut) >= 10, "the long texts were not cut"
    assert not cut[texts.index("x" * 500)]  # no space to cut at


def _spy(monkeypatch, tok: Tokenizer) -> list[int]:
    """The length of every text ``tok`` hands to ``tokenizers``, as it does."""
    seen: list[int] = []
    real = tok._tk.encode_batch
    monkeypatch.setattr(tok, "_tk", type("Spy", (), {
        "encode_batch": lambda self, batch, **kw: seen.extend(map(len, batch))
        or real(batch, **kw)})())
    return seen


def test_a_text_over_the_whole_limit_is_served_by_its_leading_words(monkeypatch):
    """Past ``max_whole_chars`` a text is never tokenized whole: its leading words serve it
    exactly where they hold over max_seq tokens (the cut at max_seq * 8 characters, else a
    wider one within the limit), and any other is TooLarge, naming it, before anything of
    it is encoded."""
    tok = Tokenizer(hf_tokenizer(), 16, max_whole_chars=300)  # cut past 128 characters
    unknown = "☃" * 60 + " "  # one <unk>: two of these hold few tokens for 122 characters
    long_words = words(200)  # ~800 characters: its first 128 hold 30 words
    late_words = unknown * 2 + words(100)  # the first cut holds 2 tokens, the wider one many
    few = unknown * 6  # 366 characters, 6 tokens: no cut within 300 holds 16
    seen = _spy(monkeypatch, tok)
    enc = tok.encode(["cat sat", long_words, late_words, "x" * 250])
    monkeypatch.undo()
    assert [x.tolist() for x in enc.ids] == _reference(
        tok, ["cat sat", long_words, late_words, "x" * 250])
    assert enc.truncated.tolist() == [False, True, True, True]
    assert max(seen) <= 300 and len(long_words) not in seen and len(late_words) not in seen
    assert 250 in seen  # under the limit, a text without spaces is still tokenized whole
    for text, why in (("x" * 500, "its first 300 characters have no space after a word"),
                      (few, "hold no more than the 16 tokens")):
        seen = _spy(monkeypatch, tok)
        with pytest.raises(TooLarge, match=r"raise EngineConfig\(max_text_chars=") as refused:
            tok.encode(["cat", text])
        monkeypatch.undo()
        assert refused.value.param == "input[1]" and why in refused.value.message
        assert f"has {len(text)} characters" in refused.value.message
        assert max(seen, default=0) <= 300  # nothing of it was tokenized whole
        assert (not seen) == (text == "x" * 500)  # no cut to try: refused before "cat" is
    # No limit (the library's default): the same texts are tokenized whole, as before.
    free = make(16)
    assert [x.tolist() for x in free.encode(["x" * 500, few]).ids] == _reference(
        free, ["x" * 500, few])


def test_a_reader_of_leading_ids_gets_them_from_the_leading_words(monkeypatch):
    """``encode_leading`` (rerank: a query's cap, a document truncated from the right): a text
    whose reader needs only its first ``keep`` ids is tokenized from its leading words, past
    ``keep`` x 8 characters or the limit; its first ``keep - 1`` ids (``<s>`` and the content
    kept) are the whole text's and its length stays over ``keep``. A reader of every id
    (None) gets the whole text, refused past the limit before anything is tokenized; a cut
    with too few tokens is refused saying so, named as the caller names it."""
    tok = Tokenizer(hf_tokenizer(), 1 << 30, max_whole_chars=300)
    whole = _reference(make(1 << 30), [words(300), "cat sat", words(30)])
    seen = _spy(monkeypatch, tok)
    ids = tok.encode_leading([words(300), "cat sat", words(30)], [20, None, 20],
                             ["query", "documents[0]", "documents[1]"])
    monkeypatch.undo()
    assert max(seen) <= 160 and seen[1:] == [7, len(words(30))]  # 20 ids x 8 characters
    assert ids[0][:19].tolist() == whole[0][:19] and 20 < len(ids[0]) < len(whole[0])
    assert ids[0][-1] == EOS_ID
    assert [x.tolist() for x in ids[1:]] == whole[1:]  # under keep x 8 characters: whole
    # keep x 8 past the limit: cut within the limit, as encode's max_seq cut
    ids = tok.encode_leading([words(300)], [60], ["documents[3]"])
    assert ids[0][:59].tolist() == whole[0][:59] and 60 < len(ids[0]) < len(whole[0])
    few = ("☃" * 60 + " ") * 6  # 366 characters, 6 tokens
    for text, keep, why in ((words(300), None, "every token of it is read"),
                            ("x" * 500, 20, "its first 300 characters have no space"),
                            (few, 20, "hold no more than the 20 tokens")):
        seen = _spy(monkeypatch, tok)
        with pytest.raises(TooLarge, match=r"raise EngineConfig\(max_text_chars=") as refused:
            tok.encode_leading(["cat", text], [None, keep], ["query", "documents[2]"])
        monkeypatch.undo()
        assert refused.value.param == "documents[2]" and why in refused.value.message
        assert max(seen, default=0) <= 300
    # No limit: a reader of every id gets the whole of any text.
    free = Tokenizer(hf_tokenizer(), 1 << 30)
    assert free.encode_leading([words(300)], [None], ["q"])[0].tolist() == whole[0]


def test_a_leading_cut_is_used_only_over_keep_ids():
    """The boundary: a cut of exactly ``keep`` ids might end in a token the whole text lacks
    there, so it is refused; one id more, and its first ``keep - 1`` are the whole text's."""
    tok = Tokenizer(hf_tokenizer(), 1 << 30, max_whole_chars=40)
    text = words(30)
    cut = tok._leading(text, 40)
    assert cut is not None
    held = len(cut.split()) + 2  # one id a known word, and <s> </s>
    whole = _reference(make(1 << 30), [text])[0]
    ids = tok.encode_leading([text], [held - 1], ["documents[0]"])[0]
    assert len(ids) == held and ids[:held - 2].tolist() == whole[:held - 2]
    with pytest.raises(TooLarge, match=f"hold no more than the {held} tokens"):
        tok.encode_leading([text], [held], ["documents[0]"])


def test_a_limit_under_the_first_cut_is_where_texts_are_cut():
    """A limit under max_seq * 8 characters: a text over it is cut there (never tokenized
    past it, however long), served where its leading words hold over max_seq tokens, else
    refused, saying why; a longer text with the same opening fares the same."""
    tok = Tokenizer(hf_tokenizer(), 16, max_whole_chars=40)
    letters = " ".join(LETTERS)  # 51 characters, two tokens a letter: 40 of them hold 40
    assert [x.tolist() for x in tok.encode([words(8), letters]).ids] == _reference(
        tok, [words(8), letters])  # 36 characters: whole
    for n in (12, 40, 400):  # 46, 178, 1,798 characters: the same 36 leading ones, 9 tokens
        with pytest.raises(TooLarge, match="leading 36 characters hold no more than the 16"):
            tok.encode([words(n)])
    with pytest.raises(TooLarge, match="its first 40 characters have no space after a word"):
        tok.encode(["x" * 41])
    with pytest.raises(TooLarge, match="no space after a word"):
        tok.encode(["   " + "x" * 200])


def test_a_tokenizer_that_cannot_be_cut_refuses_texts_over_the_limit():
    """An added token spanning a space could straddle a cut: such a tokenizer's texts over
    the limit are refused, saying so, before anything is tokenized."""
    spanning = hf_tokenizer()
    spanning.add_tokens([AddedToken("cat sat", normalized=False)])
    tok = Tokenizer(spanning, 16, max_whole_chars=300)
    with pytest.raises(TooLarge, match="cannot be cut at a space without changing their"):
        tok.encode(["cat", "the cat sat on the mat " * 40])


def test_texts_are_cut_at_other_whitespace_only_where_the_tokenizer_splits_there(monkeypatch):
    """Besides the space, a text is cut at whitespace the tokenizer splits at as at a space
    (NFKC maps the ideographic space to one; nothing here maps a newline to one), and the
    ids are those of encoding it whole."""
    from tokenizers import normalizers

    assert make(16)._breaks == " "
    nfkc = hf_tokenizer()
    nfkc.normalizer = normalizers.NFKC()
    tok = Tokenizer(nfkc, 16, max_whole_chars=300)
    assert "\u3000" in tok._breaks and "\u00a0" in tok._breaks and "\n" not in tok._breaks
    ideographic = "\u3000".join(["cat"] * 200)  # 799 characters, no space
    seen = _spy(monkeypatch, tok)
    enc = tok.encode([ideographic])
    monkeypatch.undo()
    assert [x.tolist() for x in enc.ids] == _reference(tok, [ideographic])
    assert max(seen) <= 128  # cut at max_seq * 8 characters, not tokenized whole
    with pytest.raises(TooLarge, match="no space after a word"):
        tok.encode(["\n".join(["cat"] * 200)])  # a newline is no break for it


def test_no_break_where_the_tokenizer_splits_only_in_some_contexts():
    """A pre-tokenizer that splits at a newline only after "b" is not fooled into cutting at
    every newline (probed in several contexts); an added token matched on normalized text
    that holds a space there (NFKC: "¨" is a space and a diaeresis) could straddle a cut:
    no cut at all."""
    from tokenizers import Regex, normalizers

    picky = hf_tokenizer()
    picky.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex("(?<=b)\n"), "removed"),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")])
    assert "\n" not in Tokenizer(picky, 16)._breaks
    spanning = hf_tokenizer()
    spanning.normalizer = normalizers.NFKC()
    spanning.add_tokens([AddedToken("q\u00a8", normalized=True)])
    assert not Tokenizer(spanning, 16)._cut_exact
    plain = hf_tokenizer()
    plain.normalizer = normalizers.NFKC()
    plain.add_tokens([AddedToken("q\u00a8", normalized=False)])  # matched as written
    assert Tokenizer(plain, 16)._cut_exact


@pytest.mark.slow
def test_a_page_without_spaces_is_cut_at_its_line_breaks_with_the_models_tokenizer(
        tiny_model: Path):
    """bge-m3's layout splits at newlines: a long page of lines without spaces (CJK-like) is
    served from its leading lines with the ids of encoding it whole."""
    from bgeserve.export.texts import random_texts

    tok = Tokenizer.load(tiny_model / "tokenizer.json", 64, max_whole_chars=2_000)
    assert "\n" in tok._breaks and "\u3000" in tok._breaks
    page = "\n".join(t.replace(" ", "") for t in random_texts(5, 400, 5, 40))
    assert len(page) > 2_000 and " " not in page
    assert [x.tolist() for x in tok.encode([page]).ids] == _reference(tok, [page])
    assert tok._prefix(page, tok.max_seq) is not page


@pytest.mark.slow
@pytest.mark.parametrize("space", ["\u1680", "\u205f", "\u2005"])
def test_words_apart_only_by_other_unicode_spaces_are_cut_there(tiny_model: Path, space: str):
    """QA: words apart only by U+1680 (Ogham space) were refused as one word past the
    characters bound, where the tokenizer splits there as at a space; U+200B, which its
    normalizer drops, stays no break."""
    from bgeserve.export.texts import random_texts

    tok = Tokenizer.load(tiny_model / "tokenizer.json", 64, max_whole_chars=2_000)
    assert space in tok._breaks and "\u200b" not in tok._breaks
    page = space.join(" ".join(random_texts(3, 600, 5, 40)).split())
    assert len(page) > 2_000 and " " not in page
    assert [x.tolist() for x in tok.encode([page]).ids] == _reference(tok, [page])
    assert tok._prefix(page, tok.max_seq) is not page


def test_the_lower_bound_reads_no_more_of_a_text_than_encode_could(monkeypatch):
    """``min_tokens`` (admission, before tokenizing) reads a text only as far as ``encode``
    could tokenize it: the limit, or the cut at max_seq * 8 characters, whichever is longer;
    still a lower bound of what encode gives."""
    read: list[int] = []
    for limit, most in ((300, 300), (40, 40), (None, 128)):
        tok = Tokenizer(hf_tokenizer(), 16, max_whole_chars=limit)
        for walk in ("_quick_bound", "_walk_bound"):
            real = getattr(tok, walk)
            monkeypatch.setattr(tok, walk, lambda texts, stop, real=real: read.extend(
                map(len, texts)) or real(texts, stop))
        texts = ["x" * 5000, "cat sat", words(300)]
        assert 3 + 4 + 2 + 9 <= tok.min_tokens(texts) <= sum(map(len, _reference(tok, texts)))
        assert max(read) == most, (limit, read)
        read.clear()
        monkeypatch.undo()


def test_encoding_runs_in_groups_of_bounded_characters(monkeypatch):
    from bgeserve.engine import tokenizer as module

    monkeypatch.setattr(module, "GROUP_CHARS", 50)
    tok = make()
    groups: list[int] = []
    real = tok._tk.encode_batch
    monkeypatch.setattr(tok, "_tk", type("Spy", (), {
        "encode_batch": lambda self, batch, **kw: groups.append(sum(map(len, batch)))
        or real(batch, **kw)})())
    texts = [words(3)] * 20  # 14-15 characters each
    enc = tok.encode(texts)
    assert len(groups) > 1 and max(groups) <= 50
    assert [x.tolist() for x in enc.ids] == [enc.ids[0].tolist()] * 20


def test_no_cut_where_it_could_change_the_ids():
    """An added token spanning a space could straddle the cut, and a normalizer that strips
    the end of a text sees the cut's end: such tokenizers encode long texts whole."""
    spanning = hf_tokenizer()
    spanning.add_tokens([AddedToken("cat sat", normalized=False)])
    tok = Tokenizer(spanning, 16)
    text = "the cat sat on the mat " * 40
    assert tok._prefix(text, 16) is text
    assert [x.tolist() for x in tok.encode([text]).ids] == _reference(tok, [text])
    from tokenizers import normalizers

    stripping = hf_tokenizer()
    stripping.normalizer = normalizers.Strip(left=False, right=True)
    assert Tokenizer(stripping, 16)._prefix(text, 16) is text
    local = hf_tokenizer()
    local.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    assert Tokenizer(local, 16)._prefix(text, 16) is not text


@pytest.mark.slow
def test_the_cut_is_exact_with_the_models_own_tokenizer(tiny_model: Path):
    """bge-m3's tokenizer layout (WhitespaceSplit + Metaspace, as randmodel trains it): long
    multilingual texts give the ids of encoding them whole."""
    from bgeserve.export.texts import random_texts

    tok = Tokenizer.load(tiny_model / "tokenizer.json", 64)  # cut past 512 characters
    assert tok._cut_exact
    texts = [" ".join(random_texts(seed, 30, 5, 40)) for seed in range(12)]
    texts += [" " + texts[0], texts[1] + "   ", texts[2].replace(" ", "  ")]
    assert sum(tok._prefix(t, tok.max_seq) is not t for t in texts) == len(texts)
    assert [x.tolist() for x in tok.encode(texts).ids] == _reference(tok, texts)


# -------------------------------------------------------------------------------- TEI's tools
def test_tokens_give_utf8_byte_offsets_and_text_slices():
    """``tokens`` is TEI's ``/tokenize``: byte offsets (multi-byte characters count their
    bytes), the text's slice per regular token, specials with their string and no offsets."""
    text = "hello wörld 混 cat"
    tok = make()
    (tokens,) = tok.tokens([text])
    enc = hf_tokenizer().encode(text)
    assert [t.id for t in tokens] == enc.ids
    assert tokens[0].text == "<s>" and tokens[0].special and tokens[0].start is None
    assert tokens[-1].text == "</s>" and tokens[-1].stop is None
    raw = text.encode()
    for token, (lo, hi) in zip(tokens[1:-1], enc.offsets[1:-1], strict=True):
        assert not token.special
        assert (token.start, token.stop) == (len(text[:lo].encode()), len(text[:hi].encode()))
        assert raw[token.start:token.stop].decode() == token.text == text[lo:hi]
    assert any(t.stop - t.start > 1 for t in tokens[1:-1] if len(t.text) == 1)  # ö, 混


def test_tokens_are_held_as_arrays_and_rendered_as_the_token_objects_were(monkeypatch):
    """``TextTokens`` (21 bytes a token; a Token object each took ~140: QA, an OOM kill) reads
    as the list of Tokens it stands for: items, negative indices, slices with steps; and
    /tokenize's pieces are byte for byte orjson's rendering of those lists, whatever the
    slice of tokens made at a time."""
    import orjson

    from bgeserve.http import render
    from bgeserve.results import Token

    texts = ["hello wörld 混 cat", "", "the cat " * 9, "😀 x"]
    got = make().tokens(texts)
    enc = hf_tokenizer().encode_batch(texts)
    for tokens, e, text in zip(got, enc, texts, strict=True):
        starts = [len(text[:lo].encode()) for lo, _ in e.offsets]
        stops = [len(text[:hi].encode()) for _, hi in e.offsets]
        want = [Token(i, t, True, None, None) if special else
                Token(i, text[lo:hi], False, a, b)
                for i, t, special, (lo, hi), a, b in zip(e.ids, e.tokens, e.special_tokens_mask,
                                                         e.offsets, starts, stops, strict=True)]
        assert list(tokens) == want and len(tokens) == len(want)
        assert tokens[-1] == want[-1] and tokens[1:-1] == want[1:-1]
        assert tokens[::3] == want[::3] and tokens[5:2] == []
        with pytest.raises(IndexError):
            tokens[len(want)]
    whole = orjson.dumps([list(t) for t in got])
    for at_once in (1, 2, 7, 4096):
        monkeypatch.setattr(render, "TOKENS_AT_ONCE", at_once)
        for piece in (1, 50, 1 << 20):
            monkeypatch.setattr(render, "PIECE_BYTES", piece)
            assert b"".join(render.token_pieces(got)) == whole
    assert b"".join(render.token_pieces([])) == b"[]"


def test_tokens_without_special_tokens_and_of_an_ascii_text():
    """``add_special_tokens=False`` gives the content tokens only; ASCII offsets are the
    tokenizer's character offsets (this one's Metaspace pieces span the space before a word)."""
    (tokens,) = make().tokens(["the cat"], add_special_tokens=False)
    assert [(t.id, t.text, t.start, t.stop) for t in tokens] == [
        (ID["the"], "the", 0, 3), (ID["cat"], " cat", 3, 7)]


def test_tokens_are_bounded_per_request():
    """Past ``max_tokens`` tokens in all, TooLarge (the answer's memory is bounded)."""
    from bgeserve.errors import TooLarge

    assert len(make().tokens([words(3)] * 2, max_tokens=10)) == 2  # 2 x 5 tokens
    with pytest.raises(TooLarge, match="11|10"):
        make().tokens([words(3)] * 2 + ["a"], max_tokens=10)


def test_tokens_past_the_bound_are_refused_before_they_are_encoded_or_made(monkeypatch):
    """QA: 64 texts of 20,000 words were refused only once encoded all at once (+445 MiB of
    RSS), and two such requests got the server OOM-killed under a 600 MiB cap. Where the texts'
    words already pass ``max_tokens`` nothing is encoded; else they are encoded a group at a
    time, and no group's tokens are made once the count is past it."""
    from bgeserve.engine import tokenizer as module

    class Counting:
        def __init__(self, tk: HfTokenizer) -> None:
            self.tk, self.groups = tk, []

        def encode_batch(self, texts, **kwargs):
            self.groups.append(len(texts))
            return self.tk.encode_batch(texts, **kwargs)

        def id_to_token(self, i):
            return self.tk.id_to_token(i)

    made: list[str] = []
    tokens = module._tokens
    monkeypatch.setattr(module, "_tokens", lambda text, enc, strings: made.append(text) or
                        tokens(text, enc, strings))
    tok = make(max_seq=16)
    tok._tk = counting = Counting(tok._tk)  # type: ignore[assignment]
    with pytest.raises(TooLarge, match="more than 40 tokens"):
        tok.tokens([words(20)] * 3, max_tokens=40)  # 3 x 16 words at least, as truncated
    assert counting.groups == [] and made == []
    # Each text's words bound it at max_seq (48 of 150): encoded, one text a group here.
    monkeypatch.setattr(module, "GROUP_CHARS", 10)
    with pytest.raises(TooLarge, match="more than 150 tokens"):
        tok.tokens([words(100)] * 3, max_tokens=150)  # 102 tokens each, untruncated
    assert counting.groups == [1, 1] and len(made) == 1
    assert [len(t) for t in tok.tokens([words(100)] * 3, max_tokens=306)] == [102] * 3
    # Without <s> and </s>, 2 a text fewer: at the bound, answered (review: refused).
    monkeypatch.setattr(module, "GROUP_CHARS", 1 << 18)
    got = tok.tokens([words(10)] * 4, add_special_tokens=False, max_tokens=40)
    assert [len(t) for t in got] == [10] * 4
    with pytest.raises(TooLarge):
        tok.tokens([words(10)] * 4, add_special_tokens=False, max_tokens=39)


def test_decode_skips_special_tokens_by_default():
    """``decode`` gives the text of each sequence; specials only when not skipped."""
    hf = hf_tokenizer()
    hf.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok = Tokenizer(hf, 512)
    ids = tok.encode(["hello world", "cat"]).ids
    assert tok.decode([x.tolist() for x in ids]) == ["hello world", "cat"]
    assert tok.decode([ids[1].tolist()], skip_special_tokens=False) == ["<s> cat</s>"]


def test_decode_refuses_ids_outside_the_vocabulary():
    """An id past the vocabulary is InvalidInput naming the sequence."""
    with pytest.raises(InvalidInput, match=r"ids\[1\]"):
        make().decode([[4], [VOCAB]])


def test_encode_left_keeps_the_last_tokens():
    """``encode_left`` keeps <s>, the last max_seq - 2 content tokens and </s> (Hugging Face's
    ``truncation_side="left"``); a short text is untouched."""
    tok = make(max_seq=5)
    cut = tok.encode_left([words(3), words(9)])
    short, long = cut.ids
    assert cut.truncated.tolist() == [False, True] and cut.full_lengths.tolist() == [5, 11]
    assert short.tolist() == [CLS_ID, *content_ids(3), EOS_ID]
    assert long.tolist() == [CLS_ID, *content_ids(9)[-3:], EOS_ID]


def test_min_tokens_stops_once_past_the_question():
    """With ``stop_above`` the word walk looks at no more words than could pass it (the caller
    only asks "more than?"), and what it returns is still a lower bound."""
    tok = make(512)
    long = " ".join(["wörldö"] * 400)  # no word ends in ASCII: the quick bound cannot answer
    real = int(tok.encode([long]).lengths[0])
    for stop in (0, 5, 50, 1000):
        bound = tok.min_tokens([long, long], stop_above=stop)
        assert bound <= 2 * real
        assert bound > stop or bound == tok.min_tokens([long, long])
    assert tok.min_tokens([long], stop_above=5) <= 8  # six words looked at, plus <s> </s>


def test_the_quick_bound_answers_without_walking_the_words(monkeypatch: pytest.MonkeyPatch):
    """Words ending in an ASCII letter or digit (or in one and one more character) are
    counted in one pass in C: enough to say "more than stop_above" for a flood's texts without
    the word walk, and never more than the walk's count."""
    tok = make(512)
    texts = [words(300), "the cat. sat, on the mat!", "日本語 text"]
    walked = tok.min_tokens(texts)
    monkeypatch.setattr(tok, "_walk_bound", lambda *a: pytest.fail("walked the words"))
    assert tok.min_tokens(texts, stop_above=250) == 302  # the first text decides it
    assert tok._quick_bound(texts, None) == walked - 1 == 302 + 8 + 3  # not 日本語
    monkeypatch.undo()
    assert tok._quick_bound(["ñö ñú"], None) == 2 < tok.min_tokens(["ñö ñú"]) == 4


def test_a_tokenizer_numbering_its_special_tokens_otherwise_is_refused(tmp_path: Path) -> None:
    """The heads drop bge-m3's (XLM-R's) special ids and the padding is id 1: a tokenizer
    with its own order (``<unk>`` 4, ``<mask>`` 3) gave ``<unk>`` a sparse weight without a
    word. It is refused at load, naming what it found."""
    from tokenizers.models import WordLevel

    def save(order: list[str]) -> Path:
        raw = HfTokenizer(WordLevel({t: i for i, t in enumerate(order)}, unk_token="<unk>"))
        raw.pre_tokenizer = pre_tokenizers.Whitespace()
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.json"
        raw.save(str(path))
        return path

    Tokenizer.load(save(["<s>", "<pad>", "</s>", "<unk>", "hello"]), 16)  # bge-m3's order
    with pytest.raises(ModelUnavailable, match="'<unk>': 4"):
        Tokenizer.load(save(["<s>", "<pad>", "</s>", "<mask>", "<unk>", "hello"]), 16)


def test_a_byte_level_bpe_cuts_long_texts_exactly():
    """GPT-2 / RoBERTa's pre-tokenizer (ByteLevel: a space joins the word after it, runs of
    spaces are pieces of their own): a text past the characters bound is served from its
    leading words, with the ids of encoding it whole, whatever its spacing and punctuation
    (it was refused "cannot be cut at a space": QA)."""
    import random

    from tokenizers import models, trainers

    rnd = random.Random(3)
    alphabet = "abcdefghij0123456789.,'!-é漢"

    def text(n: int) -> str:
        out = []
        for _ in range(n):
            out.append("".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 9))))
            out.append(rnd.choice([" ", " ", " ", "  ", "   ", " \n ", "\t"]))
        return "".join(out)

    hf = HfTokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator([text(200) for _ in range(50)], trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", CLS_ID), ("</s>", EOS_ID)])
    tok = Tokenizer(hf, 64, max_whole_chars=600)
    assert tok._cut_exact
    texts = [text(rnd.randint(150, 400)) for _ in range(40)]
    assert all(len(t) > 600 for t in texts)
    assert [x.tolist() for x in tok.encode(texts).ids] == _reference(tok, texts)
    assert all(tok._prefix(t, tok.max_seq) is not t for t in texts)


def test_a_byte_level_cut_after_mixed_whitespace_ends_at_a_word():
    """ByteLevel's regex makes a run of tabs and spaces before a word one piece ("\\t\\t\\t "
    then " y"): a cut in the run's spaces that kept the tabs ended in a piece the whole text
    lacks, which BPE merged otherwise, and truncation kept a wrong token (review). The cut
    drops every trailing whitespace under ByteLevel."""
    from tokenizers import models

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(SPECIALS + alphabet)}
    merges = [("ĉ", "Ġ"), ("ĉ", "ĉĠ"), ("ĉ", "ĉ")]  # tab+space, tab+that, tab+tab
    for a, b in merges:
        vocab[a + b] = len(vocab)
    hf = HfTokenizer(models.BPE(vocab, merges, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", CLS_ID), ("</s>", EOS_ID)])
    wrong = []
    for keep in range(6, 40):
        tok = Tokenizer(hf, keep)
        for n in range(1, 80):
            text = "b" * n + "\t\t\t  " + "y" * 2000
            if tok.encode([text]).ids[0].tolist() != _reference(tok, [text])[0]:
                wrong.append((keep, n))
    assert not wrong, wrong[:5]
