"""Built-in data generators: instruction data made locally, so a recipe needs no download."""

from __future__ import annotations

import random

from tunelab import registries

NAMES = ["Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kai", "Lena"]
ITEMS = ["apples", "marbles", "stickers", "pencils", "books", "cards", "shells", "stamps"]


def _add_sub(r: random.Random) -> tuple[str, str]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    a, b = r.randint(5, 60), r.randint(2, 40)
    c = r.randint(1, a + b - 1)
    q = f"{name} has {a} {item}. {name} buys {b} more and gives {c} to a friend. How many {item} does {name} have now?"
    s = (f"{name} starts with {a} {item}. After buying {b} more, {name} has {a} + {b} = {a + b}. "
         f"After giving away {c}, {name} has {a + b} - {c} = {a + b - c}. The answer is {a + b - c}.")
    return q, s


def _multiply(r: random.Random) -> tuple[str, str]:
    item = r.choice(ITEMS)
    a, b = r.randint(2, 25), r.randint(2, 12)
    q = f"A box holds {a} {item}. How many {item} are in {b} boxes?"
    return q, f"Each box holds {a} {item}, so {b} boxes hold {b} * {a} = {a * b}. The answer is {a * b}."


def _change(r: random.Random) -> tuple[str, str]:
    name = r.choice(NAMES)
    n, price = r.randint(2, 9), r.randint(1, 9)
    bill = next(b for b in (10, 20, 50, 100) if b >= n * price)
    q = (f"{name} buys {n} notebooks at {price} dollars each and pays with a {bill} dollar bill. "
         f"How much change does {name} get?")
    s = (f"The notebooks cost {n} * {price} = {n * price} dollars. "
         f"The change is {bill} - {n * price} = {bill - n * price} dollars. The answer is {bill - n * price}.")
    return q, s


def _share(r: random.Random) -> tuple[str, str]:
    k, each = r.randint(2, 12), r.randint(2, 15)
    q = f"{k * each} cookies are shared equally among {k} children. How many cookies does each child get?"
    return q, f"Each child gets {k * each} / {k} = {each} cookies. The answer is {each}."


KINDS = (_add_sub, _multiply, _change, _share)


def arithmetic(n: int = 1000, seed: int = 0) -> list[dict]:
    """Grade-school word problems with worked answers; every other row puts the problem in `input`."""
    r = random.Random(seed)
    rows = []
    for i in range(n):
        q, s = r.choice(KINDS)(r)
        if i % 2:
            rows.append({"instruction": "Solve the word problem. Show your work.", "input": q, "output": s})
        else:
            rows.append({"instruction": q, "input": "", "output": s})
    return rows


GENERATORS = registries.GENERATORS  # name -> generator function
