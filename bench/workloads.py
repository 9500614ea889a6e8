"""Deterministic prompt texts shared by the benchmarks (same text on every run and date)."""

from __future__ import annotations

import random

TOPICS = ["the sea", "a lighthouse", "bread", "rivers", "a robot", "winter", "chess", "bees",
          "the moon", "trains", "a garden", "volcanoes", "libraries", "owls", "rain", "clocks"]
TASKS = ["Write a short poem about {}.", "Explain {} to a child.",
         "List three facts about {}.", "Tell a story about {} in a few sentences."]

POLICY_TOPICS = ["remote work", "travel expenses", "security badges", "code review",
                 "vacation days", "customer data", "parental leave", "on-call duty",
                 "hardware requests", "training", "meeting rooms", "open source", "overtime",
                 "gifts from vendors", "incident reports", "performance reviews"]
FOLLOW_UPS = ["Why does that rule exist?", "Give one concrete example.",
              "Summarize your last answer in one short sentence."]

SUBJECTS = ["Every employee", "Each team lead", "A new hire", "The security office",
            "Contractors", "The finance team", "Any manager", "The people team"]
VERBS = ["must document", "should review", "is responsible for", "may not delay",
         "is expected to report", "will approve", "needs to confirm", "must never share"]
OBJECTS = ["all requests for {t}", "changes that affect {t}", "the yearly budget for {t}",
           "questions about {t}", "written records of {t}", "exceptions to the rules on {t}"]
CLAUSES = ["within five working days", "before the end of each quarter",
           "in the shared policy tracker", "after talking to their manager",
           "unless the director agrees otherwise", "using the approved form"]


def chat_prompts(n: int) -> list[list[dict]]:
    """``n`` short single-turn chats (one user message each, ~30 tokens with a template)."""
    return [[{"role": "user", "content": TASKS[i % 4].format(TOPICS[i % 16])}] for i in range(n)]


def system_prompt(num_sentences: int, seed: int = 1234) -> str:
    """A varied company-policy text (40 sentences: ~700 SmolLM2 tokens); each ``seed`` words
    it differently."""
    rng = random.Random(seed)
    lines = ["You are the assistant of Northwind Lattice Ltd. Answer staff questions briefly, "
             "following the company policy below."]
    for i in range(num_sentences):
        topic = POLICY_TOPICS[i % len(POLICY_TOPICS)]
        if i % len(POLICY_TOPICS) == 0:
            lines.append(f"\nPart {i // len(POLICY_TOPICS) + 1}.")
        lines.append(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} "
                     f"{rng.choice(OBJECTS).format(t=topic)} {rng.choice(CLAUSES)}.")
    return " ".join(lines)


def policy_question(i: int) -> str:
    return f"What does the policy say about {POLICY_TOPICS[i % len(POLICY_TOPICS)]}?"
