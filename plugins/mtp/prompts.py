"""Prompts for self-distillation (`heron.plugins.mtp.train`): requests for short texts on
assorted subjects, then requests to edit the model's own answers (fix misspellings put
into them, summarise, rewrite; most of them with the sentences or the words shuffled), so
the head sees writing and input-grounded answers, and answers that copy text it could not
predict; and for the copying stage, requests to write texts out again corrected
(`copy_prompts`)."""

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
    "the French Revolution", "ancient Egypt", "the Silk Road", "the Vikings", "the Renaissance",
    "the Industrial Revolution", "the Moon landing", "medieval castles", "the Byzantine Empire",
    "the invention of the telephone", "the history of medicine", "ancient Greek theatre",
    "the Aztec empire", "the Cold War", "the first computers", "the history of writing",
    "samurai", "pirates", "the Great Depression", "the history of chocolate",
    "magnets", "atoms", "gravity", "the speed of light", "rainbows", "sound waves", "DNA",
    "cells", "bacteria", "viruses", "the periodic table", "chemical reactions",
    "static electricity",
    "the greenhouse effect", "plate tectonics", "the solar system", "comets", "Mars",
    "Jupiter", "the Milky Way", "the Big Bang", "climate change", "ocean currents", "fossils",
    "erosion", "the nitrogen cycle", "the food chain", "migration of birds", "butterflies",
    "ants", "spiders", "frogs", "whales", "dolphins", "tigers", "giraffes", "bats", "crows",
    "parrots", "horses", "cats", "dogs", "goldfish", "jellyfish", "kangaroos", "pandas",
    "camels", "polar bears", "squirrels", "snails", "earthworms", "oak trees", "cactuses",
    "sunflowers", "bamboo", "seaweed", "wheat", "potatoes", "tomatoes", "apples", "bananas",
    "olive oil", "bread baking", "soup", "pizza", "sushi", "curry", "breakfast", "ice cream",
    "vegetarian cooking", "fermentation", "salt", "sugar", "vitamins", "drinking water",
    "exercise", "yoga", "meditation", "stress", "healthy eating", "dentists", "first aid",
    "the common cold", "allergies", "hospitals", "nurses", "the skeleton", "muscles",
    "the eyes", "hearing", "the lungs", "blood", "teachers", "firefighters", "farmers",
    "pilots", "architects", "software engineers", "librarians", "journalists", "scientists",
    "carpenters", "chefs", "lawyers", "doctors", "musicians", "painters", "poetry",
    "novels", "fairy tales", "comic books", "jazz", "classical music", "the piano", "drums",
    "guitars", "opera", "ballet", "photography", "sculpture", "pottery", "knitting",
    "woodworking", "film making", "theatre", "dance", "football", "basketball", "tennis",
    "swimming", "cycling races", "skiing", "surfing", "climbing mountains", "golf",
    "baseball", "the game of go", "card games", "board games", "puzzles", "camping",
    "hiking", "fishing", "sailing", "birdwatching", "gardening", "houseplants", "beekeeping",
    "raising chickens", "keeping a diary", "learning to swim", "learning to drive",
    "moving to a new city", "making friends", "public speaking", "time management",
    "studying for exams", "writing an essay", "reading more books", "budgeting",
    "credit cards", "taxes", "inflation", "banks", "small businesses", "advertising",
    "supply and demand", "international trade", "the job market", "working from home",
    "team meetings", "customer service", "online shopping", "smartphones", "laptops",
    "email", "social media", "search engines", "passwords", "computer viruses", "cloud storage",
    "artificial intelligence", "robots", "3D printing", "self-driving cars", "drones",
    "electric bikes", "space stations", "satellites", "GPS", "radio", "television",
    "the camera", "light bulbs", "refrigerators", "washing machines", "microwaves",
    "programming languages", "Python", "web browsers", "open source software",
    "version control", "unit tests", "spreadsheets", "binary numbers", "encryption",
    "compilers", "operating systems", "computer networks", "data centers", "keyboards",
    "cities", "villages", "islands", "mountains", "rivers", "lakes", "forests", "beaches",
    "the Arctic", "Antarctica", "the Sahara", "the Alps", "the Himalayas", "Japan", "Brazil",
    "Canada", "Australia", "Egypt", "India", "Italy", "Mexico", "Kenya", "Norway",
    "the Pacific Ocean", "the Mediterranean Sea", "the Nile", "Venice", "Paris", "New York",
    "London", "Tokyo", "public transport", "traffic jams", "highways", "airports",
    "harbours", "skyscrapers", "old houses", "tiny homes", "apartment living", "neighbours",
    "festivals", "birthdays", "weddings", "holidays by the sea", "winter holidays",
    "New Year traditions", "gift giving", "languages of the world", "sign language",
    "translation", "dictionaries", "handwriting", "calendars", "time zones", "money in history",
    "voting", "democracy", "the courts", "human rights", "volunteering", "charities",
    "endangered species", "national parks", "zoos", "pollution", "clean energy",
    "nuclear power", "water saving", "electric grids", "oil", "coal mining", "forestry",
    "fishing boats", "cargo ships", "chess champions",
    "mathematics", "prime numbers", "fractions", "geometry", "statistics", "probability",
    "the number zero", "infinity", "logic puzzles", "philosophy", "happiness", "kindness",
    "curiosity", "boredom", "habits", "motivation", "memory", "dreams", "laughter",
    "the colour blue", "the night sky", "sunsets", "rain", "fog", "autumn leaves", "spring",
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
    "Write a short poem about {}.",
    "Explain how {} works, step by step.",
    "Write a blog post introduction about {}.",
    "Tell me a fun fact about {} and explain why it is true.",
    "Compare {} with something similar and explain the differences.",
    "Write a short dialogue between two people talking about {}.",
    "Give some practical tips about {}.",
    "What is the history of {}? Answer in a short paragraph.",
    "Why is {} important? Explain briefly.",
    "Write a product description for a book about {}.",
    "Write a short speech about {}.",
    "Describe a day in the life of someone who loves {}.",
    "What are some common misconceptions about {}?",
    "Write a diary entry about {}.",
    "Write three quiz questions about {} with answers.",
    "Explain {} in one paragraph for a university student.",
)

EDIT = (
    "Fix the spelling mistakes in this text and write it out again:\n\n{}",
    "Correct the typos in the following text:\n\n{}",
    "Rewrite this text in simpler words:\n\n{}",
    "Summarize this text in two sentences:\n\n{}",
    "Proofread this paragraph and return the corrected version:\n\n{}",
    "Repeat the following text, fixing any errors:\n\n{}",
    "Fix the grammar in this text:\n\n{}",
    "Rewrite this text to sound more formal:\n\n{}",
    "Make this text shorter without losing its meaning:\n\n{}",
    "Turn this text into a bulleted list of its main points:\n\n{}",
    "Edit the following paragraph for clarity:\n\n{}",
    "Copy this text exactly, but correct the spelling:\n\n{}",
)

# the edits whose answers write their input out again
COPY = tuple(EDIT[i] for i in (0, 1, 4, 5, 11))


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


def copy_prompts(texts: list[str], seed: int = 0) -> list[dict]:
    """Requests to write ``texts`` out again with misspellings put into them fixed."""
    rng = random.Random(seed)
    return [{"role": "user", "content": rng.choice(COPY).format(misspell(t.strip(), rng))}
            for t in texts if t.strip()]
