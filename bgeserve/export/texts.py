"""Deterministic multilingual-looking texts: calibration and validation text for the export,
training text for the test models' tokenizers, and the benchmarks' corpora.

Words come from fixed Zipf-weighted lexicons in five scripts (Latin, Cyrillic, Greek, Arabic,
CJK), mixed with numbers, emoji, compatibility forms and punctuation: for a real model this
exercises the tokenizer and the activations much as real text does. Pure Python, no torch.
"""

from __future__ import annotations

import functools
import itertools
import random

_LATIN = ("bcdfghjklmnpqrstvwxz", "aeiouy", "áàâäãåçéèêëíîïñóôöøúùûüœæßłšžčř")
_CYRILLIC = ("бвгджзклмнпрстфхцчшщ", "аеиоуыэюяё", "йь")
_GREEK = ("βγδζθκλμνξπρστφχψ", "αεηιουω", "άέήίόύώ")
_ARABIC = "ابتثجحخدذرزسشصضطظعغفقكلمنهوي"
_EMOJI = ["😀", "🚀", "✨", "🎉", "👍", "🔥", "🌍", "💡", "❤️", "👍🏽", "🤖", "📚"]
_ODD = ["ﬁ", "Ｗ", "①", "½", "™", "…", "–", "—", "Å", "ǆ"]  # compatibility forms
_PUNCT = ",,,..;:!?"


@functools.cache
def _lexicon() -> dict[str, tuple[list[str], list[float]]]:
    """Fixed Zipf-weighted word lists, shared by all seeds so tokenizers cover each other's text."""
    rng = random.Random("bgeserve-lexicon")

    def syllabic(cons: str, vowels: str, extra: str) -> str:
        word = ""
        for _ in range(rng.choice((1, 1, 2, 2, 2, 3, 3, 4))):
            word += rng.choice(cons) + rng.choice(vowels)
            if rng.random() < 0.3:
                word += rng.choice(extra if rng.random() < 0.4 else cons)
        return word

    han = [chr(c) for c in rng.sample(range(0x4E00, 0x9FA6), 600)]
    kana = [chr(c) for c in range(0x3041, 0x3097)]
    makers = {
        "latin": lambda: syllabic(*_LATIN), "cyrillic": lambda: syllabic(*_CYRILLIC),
        "greek": lambda: syllabic(*_GREEK),
        "arabic": lambda: "".join(rng.choices(_ARABIC, k=rng.randint(2, 7))),
        "cjk": lambda: "".join(rng.choices(rng.choice((han, han, han, kana)), k=rng.randint(1, 4))),
    }
    lexicon = {}
    for script, make in makers.items():
        words = list(dict.fromkeys(make() for _ in range(6000)))
        zipf = itertools.accumulate(1.0 / rank for rank in range(2, len(words) + 2))
        lexicon[script] = (words, list(zipf))
    return lexicon


def _word(rng: random.Random, script: str) -> str:
    words, cum = _lexicon()[script]
    return rng.choices(words, cum_weights=cum)[0]


def _number(rng: random.Random) -> str:
    return rng.choice((
        str(rng.randint(0, 99)), str(rng.randint(1900, 2030)), f"{rng.uniform(0, 100):.2f}",
        f"{rng.randint(1, 99)},{rng.randint(0, 9)}%",
        f"{rng.randint(1990, 2030)}-0{rng.randint(1, 9)}",
    ))


def random_texts(seed: int, n: int, min_words: int = 1, max_words: int = 40) -> list[str]:
    """Return ``n`` deterministic multilingual-looking texts of ``min_words..max_words`` words.

    Text ``i`` depends only on ``(seed, i)``, so a shorter list is a prefix of a longer one. A
    "word" of CJK is a run of 1-4 characters, and neighbouring CJK words join without spaces.
    """
    scripts = ["latin", "cyrillic", "greek", "arabic", "cjk"]
    texts = []
    for i in range(n):
        rng = random.Random(f"{seed}:{i}")
        main = rng.choices(scripts, weights=(5, 2, 1, 1, 2))[0]
        parts: list[str] = []
        previous = ""  # the script of the last word, so CJK words can run together
        for k in range(rng.randint(min_words, max_words)):
            roll, script = rng.random(), ""
            if roll < 0.05:
                word = _number(rng)
            elif roll < 0.07:
                word = rng.choice(_EMOJI)
            elif roll < 0.08:
                word = rng.choice(_ODD) + _word(rng, "latin")
            else:
                script = main if rng.random() < 0.85 else rng.choice(scripts)
                word = _word(rng, script)
                if script == previous == "cjk" and rng.random() < 0.7:
                    parts[-1] += word
                    continue
                if script in ("latin", "cyrillic", "greek") and (k == 0 or parts[-1][-1] in ".!?"):
                    word = word.capitalize()
            punct = rng.random()
            if punct < 0.09:
                word = word + rng.choice(_PUNCT) if punct < 0.08 else f"({word})"
            parts.append(word)
            previous = script
        texts.append(" ".join(parts))
    return texts
