"""Prompts for self-distillation (`heron.plugins.mtp.train`): requests for short texts on
assorted subjects, then requests to edit the model's own answers (fix misspellings put
into them, summarise, rewrite; most of them with the sentences or the words shuffled), so
the head sees writing and input-grounded answers, and answers that copy text it could not
predict."""

from __future__ import annotations

import random
from collections.abc import Callable

SUBJECTS = (
    "the water cycle", "volcanoes", "honey bees", "the history of bread", "bicycles",
    "black holes", "the printing press", "coral reefs", "learning a language",
    "the immune system", "chess openings", "rainforests", "electric cars", "the moon",
    "composting", "the Roman roads", "solar panels", "sleep", "octopuses", "tea",
    "the internet", "glaciers", "public libraries", "vaccines", "the violin", "deserts",
    "recycling plastic", "earthquakes", "the stock market", "photosynthesis", "trains",
    "the human heart", "mushrooms", "lighthouses", "weather forecasts", "the Olympic games",
    "wolves", "paper money", "the Great Wall", "batteries", "running a marathon",
    "bridges", "owls", "the theory of evolution", "spices", "submarines", "the seasons",
    "cheese making", "lightning", "video games", "the Amazon river", "penguins",
    "databases", "clocks", "gardening in winter", "the alphabet", "wind turbines",
    "sharks", "museums", "the pyramids", "rice farming", "telescopes", "friendship",
    "cooking pasta", "the ocean tides", "caves", "maps", "elephants", "hurricanes",
    "coffee", "airplanes", "the brain", "snow", "city parks", "dinosaurs", "bees and flowers",
    "a first job interview", "saving money", "writing a good email", "sorting algorithms",
)

WRITE = (
    "Write a short paragraph about {}.",
    "Explain {} to a ten-year-old.",
    "Give three interesting facts about {}.",
    "Write a short story that involves {}.",
    "Describe {} in a few sentences.",
    "What are the pros and cons of {}?",
    "Write a short news report about {}.",
    "Summarize what people should know about {}.",
    "Write a friendly letter to a friend about {}.",
    "List some common questions about {} and answer them briefly.",
)

EDIT = (
    "Fix the spelling mistakes in this text and write it out again:\n\n{}",
    "Correct the typos in the following text:\n\n{}",
    "Rewrite this text in simpler words:\n\n{}",
    "Summarize this text in two sentences:\n\n{}",
    "Proofread this paragraph and return the corrected version:\n\n{}",
    "Repeat the following text, fixing any errors:\n\n{}",
)


def misspell(text: str, rng: random.Random, rate: float = 0.08) -> str:
    """``text`` with about ``rate`` of its longer words misspelt (letters swapped,
    dropped or doubled)."""
    words = text.split(" ")
    for i, w in enumerate(words):
        if len(w) > 3 and w.isalpha() and rng.random() < rate:
            j = rng.randrange(1, len(w) - 1)
            words[i] = rng.choice((w[:j] + w[j + 1] + w[j] + w[j + 2:], w[:j] + w[j + 1:],
                                   w[:j] + w[j] + w[j:]))
    return " ".join(words)


def shuffle(text: str, rng: random.Random) -> str:
    """``text`` with its sentences, or its words, in another order: text the model would not
    write itself, so that repeating it takes copying, not predicting."""
    sep = ". " if rng.random() < 0.5 else " "
    parts = [x.strip() for x in text.replace("\n", " ").split(sep) if x.strip()]
    rng.shuffle(parts)
    return sep.join(parts)


def training_prompts(num: int, seed: int = 0, subjects=SUBJECTS) -> tuple[
        list[dict], Callable[[list[str]], list[dict]]]:
    """``num // 2`` writing requests (chat messages) on ``subjects``, and a function from the
    answers to as many editing requests over them."""
    rng = random.Random(seed)
    pairs = [(t, s) for t in WRITE for s in subjects]
    rng.shuffle(pairs)
    first = [{"role": "user", "content": t.format(s)}
             for t, s in (pairs * (num // len(pairs) + 1))[:num // 2]]

    def second(answers: list[str]) -> list[dict]:
        prompts = []
        for a in answers:
            if a.strip():
                text = shuffle(a, rng) if rng.random() < 0.6 else a.strip()
                prompts.append({"role": "user",
                                "content": rng.choice(EDIT).format(misspell(text, rng))})
        return prompts[:num - num // 2]

    return first, second
