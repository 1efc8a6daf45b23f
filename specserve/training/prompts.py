"""Prompts written for this project, to which the target's own answers become self-distillation data.

They cover the kinds of request a chat model serves (writing, role-play, reasoning, maths, coding,
extraction, science, humanities) without using any evaluation question: templates crossed with
subjects, so the set is large, varied and reproducible.
"""

from __future__ import annotations

import itertools
import random

_SUBJECTS = [
    "the water cycle",
    "black holes",
    "the French Revolution",
    "machine learning",
    "photosynthesis",
    "the stock market",
    "climate change",
    "the Roman Empire",
    "vaccines",
    "renewable energy",
    "the internet",
    "coffee",
    "sleep",
    "volcanoes",
    "the human heart",
    "electric cars",
    "bees",
    "the printing press",
    "jazz music",
    "the Moon landing",
    "inflation",
    "DNA",
    "earthquakes",
    "social media",
    "the Silk Road",
    "quantum computers",
    "rainforests",
    "chess",
    "the Olympic Games",
    "antibiotics",
    "gravity",
    "democracy",
    "the immune system",
    "plate tectonics",
    "recycling",
    "the Renaissance",
    "solar panels",
    "ocean tides",
    "memory",
    "cryptography",
    "bread baking",
    "marathon training",
    "urban gardening",
    "public libraries",
    "the periodic table",
    "volunteering",
]

_EXPLAIN = [
    "Explain {s} to a ten-year-old.",
    "What are the three most important facts about {s}?",
    "Write a short paragraph about {s}.",
    "What are common misconceptions about {s}?",
    "Give me a brief history of {s}.",
    "What are the advantages and disadvantages of {s}?",
    "Summarize what scientists know about {s} in five bullet points.",
    "Why does {s} matter for everyday life?",
    "Write a short quiz with three questions about {s}, with answers.",
]

_WRITING = [
    "Write a haiku about {s}.",
    "Write a short poem about {s}.",
    "Write a persuasive paragraph arguing that schools should teach more about {s}.",
    "Draft a friendly email inviting a colleague to a talk about {s}.",
    "Write the opening paragraph of a mystery story that involves {s}.",
    "Write a product description for a board game about {s}.",
    "Compose a tweet announcing a new podcast episode on {s}.",
]

_ROLEPLAY = [
    "Pretend you are a tour guide and describe {s} to visitors.",
    "You are a museum curator. Introduce an exhibition about {s}.",
    "Act as a teacher and give a short lesson plan about {s}.",
    "Imagine you are a journalist interviewing an expert on {s}. Write three questions and answers.",
]

_NAMES = ["Alice", "Bob", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana"]
_ITEMS = ["apples", "books", "marbles", "tickets", "cookies", "stamps", "pencils", "coins"]


def _math_prompts(rng: random.Random, count: int) -> list[str]:
    prompts = []
    for _ in range(count):
        a, b, c = rng.randint(2, 60), rng.randint(2, 30), rng.randint(2, 9)
        name, other, item = rng.choice(_NAMES), rng.choice(_NAMES), rng.choice(_ITEMS)
        prompts.append(
            rng.choice(
                [
                    f"{name} has {a} {item} and gives {b} to {other}. How many are left? Explain.",
                    f"Solve for x: {c}x + {b} = {a + c * b}. Show your work.",
                    f"What is {a} multiplied by {b}, and then divided by {c}? Round to two decimals.",
                    f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
                    f"If a train travels {a * 5} km in {c} hours, what is its average speed?",
                    f"What is the sum of all integers from 1 to {a}? Explain the formula.",
                    f"Is {a * b + 1} a prime number? Explain how you checked.",
                ]
            )
        )
    return prompts


_CODING = [
    "Write a Python function that reverses a string.",
    "Write a Python function to check whether a number is prime.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a function that returns the n-th Fibonacci number, iteratively.",
    "How do I read a CSV file in Python? Give an example.",
    "Write a SQL query that finds the five most recent orders in an orders table.",
    "Explain what a hash map is and when to use one.",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "What does the `yield` keyword do in Python?",
    "Write a function that merges two sorted lists into one sorted list.",
    "Explain recursion with a short example in Python.",
    "Write a bash command that counts the lines in all .txt files in a folder.",
    "How do I remove duplicates from a list in Python while keeping the order?",
    "Write a JavaScript function that debounces another function.",
    "Explain the time complexity of binary search.",
    "Write a Python function that counts word frequencies in a text.",
    "What is the difference between a process and a thread?",
    "Write a regular expression that matches an email address, and explain it.",
    "Explain what unit tests are and write one for a function that adds two numbers.",
    "How does garbage collection work in Python?",
]

_EXTRACTION = [
    "Extract the names and dates from this text: '{n1} met {n2} on 3 May 2021 in Paris, and again on "
    "14 June 2022 in Rome.'",
    "Turn this sentence into JSON with keys name, age and city: '{n1} is 34 years old and lives in Oslo.'",
    "List the verbs in this sentence: '{n1} quickly ran to the store, bought bread and walked home.'",
    "Classify the sentiment of this review as positive, negative or neutral: 'The food was cold but the "
    "staff were lovely.'",
    "Summarize in one sentence: '{n1} wanted to learn the piano. After two years of daily practice, "
    "{n1} played a concert for friends and family.'",
]

_REASONING = [
    "If all bloops are razzies and all razzies are lazzies, are all bloops lazzies? Explain.",
    "{n1} is taller than {n2}, and {n2} is taller than {n3}. Who is the shortest?",
    "A farmer has to cross a river with a wolf, a goat and a cabbage. How can he do it?",
    "What comes next in the sequence 2, 6, 12, 20, 30? Explain the pattern.",
    "If it takes 5 machines 5 minutes to make 5 widgets, how long do 100 machines take to make 100 widgets?",
    "{n1} says {n2} is lying. {n2} says {n3} is lying. {n3} says both are lying. Who tells the truth?",
]


def written_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` distinct prompts, a seeded mix of every kind; the first `count` of a fixed shuffle."""
    rng = random.Random(seed)
    prompts: list[str] = []
    for template, subject in itertools.product(_EXPLAIN + _WRITING + _ROLEPLAY, _SUBJECTS):
        prompts.append(template.format(s=subject))
    prompts += _math_prompts(rng, 120)
    prompts += _CODING
    for template in _EXTRACTION + _REASONING:
        for _ in range(6):
            n1, n2, n3 = rng.sample(_NAMES, 3)
            prompts.append(template.format(n1=n1, n2=n2, n3=n3))
    prompts = list(dict.fromkeys(prompts))  # distinct, order kept
    rng.shuffle(prompts)
    return prompts[:count]
