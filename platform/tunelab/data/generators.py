"""Built-in data generators: instruction data made locally, so a recipe needs no download."""

from __future__ import annotations

import random

from tunelab.core import registries

NAMES = ["Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kai", "Lena"]
ITEMS = ["apples", "marbles", "stickers", "pencils", "books", "cards", "shells", "stamps"]


# Held-out problems draw their first number from a range training problems never use, so no held-out question
# can equal a training one (gsm8k_smoke is made that way; evals/contamination.py still checks each cell).
FIRST = {False: {"add": (5, 60), "mul": (2, 25), "notebooks": (2, 9), "children": (2, 12)},
         True: {"add": (61, 120), "mul": (26, 50), "notebooks": (10, 19), "children": (13, 24)}}


def _add_sub(r: random.Random, held_out: bool = False) -> tuple[str, str]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    a, b = r.randint(*FIRST[held_out]["add"]), r.randint(2, 40)
    c = r.randint(1, a + b - 1)
    q = f"{name} has {a} {item}. {name} buys {b} more and gives {c} to a friend. How many {item} does {name} have now?"
    s = (f"{name} starts with {a} {item}. After buying {b} more, {name} has {a} + {b} = {a + b}. "
         f"After giving away {c}, {name} has {a + b} - {c} = {a + b - c}. The answer is {a + b - c}.")
    return q, s


def _multiply(r: random.Random, held_out: bool = False) -> tuple[str, str]:
    item = r.choice(ITEMS)
    a, b = r.randint(*FIRST[held_out]["mul"]), r.randint(2, 12)
    q = f"A box holds {a} {item}. How many {item} are in {b} boxes?"
    return q, f"Each box holds {a} {item}, so {b} boxes hold {b} * {a} = {a * b}. The answer is {a * b}."


def _change(r: random.Random, held_out: bool = False) -> tuple[str, str]:
    name = r.choice(NAMES)
    n, price = r.randint(*FIRST[held_out]["notebooks"]), r.randint(1, 9)
    bill = next(b for b in (10, 20, 50, 100, 200) if b >= n * price)
    q = (f"{name} buys {n} notebooks at {price} dollars each and pays with a {bill} dollar bill. "
         f"How much change does {name} get?")
    s = (f"The notebooks cost {n} * {price} = {n * price} dollars. "
         f"The change is {bill} - {n * price} = {bill - n * price} dollars. The answer is {bill - n * price}.")
    return q, s


def _share(r: random.Random, held_out: bool = False) -> tuple[str, str]:
    k, each = r.randint(*FIRST[held_out]["children"]), r.randint(2, 15)
    q = f"{k * each} cookies are shared equally among {k} children. How many cookies does each child get?"
    return q, f"Each child gets {k * each} / {k} = {each} cookies. The answer is {each}."


KINDS = (_add_sub, _multiply, _change, _share)


def arithmetic(n: int = 1000, seed: int = 0, held_out: bool = False) -> list[dict]:
    """Grade-school word problems with worked answers; every other row puts the problem in `input`.
    `held_out`: problems no training call of this generator can produce (see FIRST)."""
    r = random.Random(seed)
    rows = []
    for i in range(n):
        q, s = r.choice(KINDS)(r, held_out)
        if i % 2:
            rows.append({"instruction": "Solve the word problem. Show your work.", "input": q, "output": s})
        else:
            rows.append({"instruction": q, "input": "", "output": s})
    return rows


GENERATORS = registries.GENERATORS  # name -> generator function


# A second generated workload (the tuned-optimizer study's CPU stand-in tunes on two recipes): short word
# puzzles answered by the word or words themselves, a skill arithmetic's worked answers do not train. Short, so
# that a 48-token row (the tests') keeps the prompt and its answer.
WORDS = ["apple", "river", "candle", "garden", "pencil", "window", "orange", "silver", "planet", "bottle", "forest",
         "ladder", "mirror", "rocket", "tunnel", "violin", "basket", "castle", "dragon", "island", "jacket", "kitten",
         "lemon", "magnet", "needle", "pillow", "rabbit", "saddle", "ticket", "wallet"]


def _reverse(r: random.Random) -> tuple[str, str]:
    w = r.choice(WORDS)
    return f"Spell backwards: {w}", f"{w[::-1]}"


def _sort(r: random.Random) -> tuple[str, str]:
    ws = r.sample(WORDS, 3)
    return f"Sort: {' '.join(ws)}", " ".join(sorted(ws))


def _count(r: random.Random) -> tuple[str, str]:
    w = r.choice(WORDS)
    letter = r.choice(sorted(set(w)))
    return f"Count '{letter}' in {w}", str(w.count(letter))


def _initials(r: random.Random) -> tuple[str, str]:
    ws = r.sample(WORDS, 3)
    return f"Initials: {' '.join(ws)}", "".join(w[0] for w in ws).upper()


def wordplay(n: int = 1000, seed: int = 0) -> list[dict]:
    """Short word puzzles (reverse a word, sort three words, count a letter, initials) and their answers."""
    r = random.Random(seed)
    kinds = (_reverse, _sort, _count, _initials)
    return [{"instruction": q, "input": "", "output": a} for q, a in (r.choice(kinds)(r) for _ in range(n))]
