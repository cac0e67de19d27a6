"""Procedurally generated conversations: the default data, no downloaded corpus.

Each conversation is a small task whose answer is a function of the prompt (count, reverse,
spell, add, …), so a target trained on them continues prompts with structured, non-looping
text and a draft has real next-token regularities to learn. `vocabulary()` lists every word
these conversations can contain; the tiny target's word-level tokenizer is built from it.
"""

from __future__ import annotations

import random

COLORS = "red blue green yellow black white orange purple brown grey pink gold".split()
ANIMALS = "cat dog fox owl bee cow pig hen ant elk yak emu bat rat eel".split()
DAYS = "monday tuesday wednesday thursday friday saturday sunday".split()
LETTERS = list("abcdefghijklmnopqrstuvwxyz")
NUMBERS = [str(i) for i in range(200)]
TASK_WORDS = (
    "count from to reverse spell add and is the sum of list colors animals after day comes "
    "repeat times sort please answer : . , ? sure here it what which are then next week"
).split()
SPECIAL_TOKENS = ["<unk>", "<pad>", "<bos>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def vocabulary() -> list[str]:
    words = SPECIAL_TOKENS + NUMBERS + LETTERS + COLORS + ANIMALS + DAYS + TASK_WORDS
    seen: dict[str, None] = {}
    for w in words:
        seen.setdefault(w, None)
    return list(seen)


def _count(rng: random.Random) -> tuple[str, str]:
    start = rng.randrange(0, 150)
    stop = start + rng.randrange(3, 25)
    return f"count from {start} to {stop}", " ".join(str(i) for i in range(start, stop + 1)) + " ."


def _reverse(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(COLORS + ANIMALS, rng.randrange(3, 9))
    return "reverse : " + " ".join(words), " ".join(reversed(words)) + " ."


def _spell(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(COLORS + ANIMALS + DAYS)
    return f"spell {word}", " ".join(word) + " ."


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(0, 100), rng.randrange(0, 100)
    return f"add {a} and {b}", f"the sum of {a} and {b} is {a + b} ."


def _days(rng: random.Random) -> tuple[str, str]:
    i = rng.randrange(7)
    n = rng.randrange(2, 7)
    nxt = [DAYS[(i + k) % 7] for k in range(1, n + 1)]
    return f"what comes after {DAYS[i]} ?", "then " + " then ".join(nxt) + " ."


def _repeat(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(ANIMALS)
    n = rng.randrange(2, 9)
    return f"repeat {word} {n} times", " ".join([word] * n) + " ."


def _sort(rng: random.Random) -> tuple[str, str]:
    nums = rng.sample(range(200), rng.randrange(3, 9))
    return "sort " + " , ".join(map(str, nums)), " , ".join(map(str, sorted(nums))) + " ."


TASKS = [_count, _reverse, _spell, _add, _days, _repeat, _sort]


def conversation(rng: random.Random) -> list[dict[str, str]]:
    """One conversation in the OpenAI `messages` format: one or two user/assistant turns."""
    messages: list[dict[str, str]] = []
    for _ in range(1 if rng.random() < 0.75 else 2):
        prompt, answer = rng.choice(TASKS)(rng)
        if rng.random() < 0.3:
            prompt = "please " + prompt
        messages.append({"role": "user", "content": prompt})
        messages.append({"role": "assistant", "content": "sure , here it is : " + answer})
    return messages


def conversations(num: int, seed: int) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    return [conversation(rng) for _ in range(num)]
