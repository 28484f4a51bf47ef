"""Open-ended chat instructions for self-distillation, generated from templates (no benchmark text).

Why: the bundled training prompts (`../shared/data/train_prompts.jsonl`) are 95 % T0 task templates
(classification, extractive QA, short answers) and only 427 open-ended instructions, while chat use, and
Spec-Bench, are mostly long free-form answers: writing, explanations, advice, code, step-by-step math,
role play, translation. Heads learn the base model's habits on the prompts they see, so their τ drops on
what they never saw (docs/history.md: translation and coding trail the other categories).

Every prompt is a template filled from word lists written for this file, with random numbers for the
math problems and simple templated German, French and Spanish sentences for translation. The output is
fully determined by `--num` and `--seed`:

    python -m hf_bpd.training.instructions --output training/data/instructions.jsonl --num 2000 --seed 0
    hf-bpd distill --prompts training/data/instructions.jsonl --output runs/distill_instructions ...
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Callable

from hf_bpd.io.jsonl import write_jsonl

TOPICS = [
    "a lighthouse keeper",
    "a lost dog",
    "the first day of school",
    "a rainy afternoon",
    "a robot learning to paint",
    "an old bookshop",
    "a trip to the mountains",
    "a family dinner",
    "a city at night",
    "a forgotten letter",
    "the ocean",
    "friendship",
    "a small bakery",
    "winter mornings",
    "a space station",
    "a garden in spring",
    "a train journey",
    "a chess tournament",
    "a village festival",
    "a scientist's discovery",
    "moving to a new city",
    "a thunderstorm",
    "an unexpected gift",
    "a football match",
    "a music teacher",
    "the last day of summer",
    "a haunted house",
    "a street market",
    "learning to ride a bike",
    "a desert island",
    "a birthday party",
    "a time traveller",
    "an artificial intelligence",
    "a fox in the forest",
    "grandparents",
    "a job interview",
    "climate change",
    "a new smartphone",
    "a coffee shop",
    "a marathon runner",
    "a snowy village",
]
FORMS = [
    "a short story",
    "a poem",
    "a blog post",
    "a diary entry",
    "a short speech",
    "a news article",
    "a product review",
    "a letter to a friend",
    "a dialogue between two characters",
    "a motivational paragraph",
    "a limerick",
    "a persuasive essay",
    "a movie plot summary",
    "a travel guide entry",
    "a social media post",
]
CONCEPTS = [
    "photosynthesis",
    "inflation",
    "gravity",
    "the water cycle",
    "machine learning",
    "blockchain",
    "vaccines",
    "the stock market",
    "black holes",
    "democracy",
    "compound interest",
    "climate change",
    "DNA",
    "electricity",
    "the internet",
    "supply and demand",
    "evolution",
    "the immune system",
    "renewable energy",
    "plate tectonics",
    "recursion",
    "encryption",
    "the French Revolution",
    "the Renaissance",
    "quantum computing",
    "the greenhouse effect",
    "neural networks",
    "the scientific method",
    "taxes",
    "the human heart",
    "volcanoes",
    "antibiotics",
    "the moon's phases",
    "cloud computing",
    "probability",
    "the Roman Empire",
    "opportunity cost",
    "sleep",
    "nutrition",
    "earthquakes",
]
AUDIENCES = ["a five-year-old", "a high school student", "a beginner", "an expert", "my grandmother", "a busy manager"]
ACTIVITIES = [
    "learning a new language",
    "saving money",
    "sleeping better",
    "starting a small business",
    "staying focused",
    "running a first marathon",
    "cooking healthy meals",
    "public speaking",
    "writing a resume",
    "learning to code",
    "reducing stress",
    "travelling on a budget",
    "making friends in a new city",
    "studying for exams",
    "keeping houseplants alive",
    "working from home",
    "preparing for a job interview",
    "managing time",
    "taking better photos",
    "decluttering a home",
    "training a puppy",
    "learning the guitar",
    "staying motivated",
]
PAIRS = [
    ("cats", "dogs"),
    ("Python", "JavaScript"),
    ("renting", "buying a home"),
    ("solar power", "wind power"),
    ("coffee", "tea"),
    ("books", "movies"),
    ("city life", "country life"),
    ("electric cars", "petrol cars"),
    ("capitalism", "socialism"),
    ("SQL", "NoSQL databases"),
    ("running", "swimming"),
    ("email", "instant messaging"),
    ("democracy", "monarchy"),
    ("online learning", "classroom learning"),
    ("stocks", "bonds"),
    ("summer", "winter"),
    ("mitosis", "meiosis"),
    ("weather", "climate"),
    ("viruses", "bacteria"),
    ("TCP", "UDP"),
]
LANGUAGES = ["Python", "JavaScript", "Java", "C++", "Go", "Rust", "C#", "TypeScript"]
CODE_TASKS = [
    "reverses a string",
    "checks whether a number is prime",
    "returns the n-th Fibonacci number",
    "sorts a list of numbers with bubble sort",
    "counts the words in a sentence",
    "finds the largest element of a list",
    "checks whether a string is a palindrome",
    "merges two sorted lists",
    "removes duplicates from a list",
    "computes the factorial of a number",
    "converts Celsius to Fahrenheit",
    "finds the greatest common divisor",
    "counts the vowels in a string",
    "implements binary search",
    "flattens a nested list",
    "validates an email address",
    "reads a CSV file and prints each row",
    "computes the average of a list",
    "checks whether two strings are anagrams",
    "returns the second largest number in a list",
    "implements a stack class",
    "transposes a matrix",
    "finds the longest word in a sentence",
    "computes the sum of the digits of a number",
    "generates all subsets of a set",
]
CODE_SNIPPETS = [
    "def f(xs):\n    return [x * x for x in xs if x % 2 == 0]",
    "for i in range(1, 16):\n    print('Fizz' * (i % 3 == 0) + 'Buzz' * (i % 5 == 0) or i)",
    "def g(n):\n    if n <= 1:\n        return n\n    return g(n - 1) + g(n - 2)",
    "const add = (a, b) => a + b;\nconsole.log([1, 2, 3].reduce(add, 0));",
    "SELECT name, COUNT(*) FROM orders GROUP BY name HAVING COUNT(*) > 5;",
    "def count(s):\n    d = {}\n    for c in s:\n        d[c] = d.get(c, 0) + 1\n    return d",
    "x = [3, 1, 2]\nx.sort(reverse=True)\nprint(x[0])",
    "def average(nums):\n    return sum(nums) / len(nums)",
]
ROLES = [
    "a pirate captain",
    "a medieval knight",
    "a detective",
    "a tour guide in Paris",
    "a personal trainer",
    "a chef",
    "a history teacher",
    "an astronaut",
    "a wise old wizard",
    "a customer service agent",
    "a museum guide",
    "a sports commentator",
    "a nervous job applicant",
    "a famous scientist",
    "a travel agent",
]
QUESTIONS = [
    "What advice would you give to someone starting out?",
    "Describe your typical day.",
    "What is the most important lesson you have learned?",
    "How would you convince me to try something new?",
    "Tell me about your biggest challenge.",
    "What do you think the world will look like in fifty years?",
]
COUNTRIES = [
    "France",
    "Japan",
    "Brazil",
    "Canada",
    "Egypt",
    "India",
    "Australia",
    "Germany",
    "Mexico",
    "Kenya",
    "Italy",
    "Norway",
    "Argentina",
    "South Korea",
    "Spain",
    "Turkey",
    "Vietnam",
    "Peru",
]
ITEMS = ["apples", "notebooks", "pencils", "cupcakes", "tickets", "shirts", "books", "oranges", "toy cars", "candles"]
NAMES = ["Tom", "Maria", "Ali", "Sara", "Ken", "Lena", "Omar", "Julia", "Ravi", "Emma"]

# Simple sentences for translation prompts: subject + predicate + time, in three languages.
SENTENCES = {
    "German": (
        ["Der Mann", "Die Frau", "Das Kind", "Mein Bruder", "Unsere Lehrerin", "Der Nachbar", "Meine Mutter"],
        ["liest ein Buch", "trinkt einen Kaffee", "fährt nach Berlin", "kocht das Abendessen", "arbeitet im Büro",
         "spielt im Garten", "schreibt einen Brief", "kauft frisches Brot", "besucht seine Freunde", "lernt Englisch"],
        ["heute", "am Morgen", "jeden Tag", "am Wochenende", "nach der Arbeit", "im Sommer"],
    ),
    "French": (
        ["L'homme", "La femme", "L'enfant", "Mon frère", "Notre professeur", "Le voisin", "Ma mère"],
        ["lit un livre", "boit un café", "va à Paris", "prépare le dîner", "travaille au bureau", "joue dans le jardin",
         "écrit une lettre", "achète du pain frais", "rend visite à ses amis", "apprend l'anglais"],
        ["aujourd'hui", "le matin", "tous les jours", "le week-end", "après le travail", "en été"],
    ),
    "Spanish": (
        ["El hombre", "La mujer", "El niño", "Mi hermano", "Nuestra profesora", "El vecino", "Mi madre"],
        ["lee un libro", "bebe un café", "viaja a Madrid", "prepara la cena", "trabaja en la oficina",
         "juega en el jardín", "escribe una carta", "compra pan fresco", "visita a sus amigos", "aprende inglés"],
        ["hoy", "por la mañana", "todos los días", "el fin de semana", "después del trabajo", "en verano"],
    ),
}  # fmt: skip


def _sentence(r: random.Random, language: str) -> str:
    subjects, predicates, times = SENTENCES[language]
    return f"{r.choice(subjects)} {r.choice(predicates)} {r.choice(times)}."


def _math(r: random.Random) -> str:
    a, b, c = r.randint(2, 40), r.randint(2, 25), r.randint(1, 9)
    name, other, item = r.choice(NAMES), r.choice(NAMES), r.choice(ITEMS)
    problems = [
        f"{name} buys {a} {item} at ${b} each and pays with ${a * b + r.randint(1, 50)}. How much change does "
        f"{name} get?",
        f"{name} has {a} {item} and gives {c} of them to each of {r.randint(2, 5)} friends. How many are left?",
        f"A train travels at {b * 4} km per hour for {c} hours. How far does it go?",
        f"Solve for x: {c}x + {a} = {c * b + a}.",
        f"{name} is {a + c} years old and {other} is {c} years younger. How old will {other} be in {b} years?",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        f"What is {a * 7} divided by 7, plus {b} times {c}?",
        f"A shop gives a {r.choice([10, 20, 25, 50])}% discount on a ${a * 10} jacket. What is the new price?",
        f"{name} reads {b} pages a day. How many days does a {b * a} page book take?",
    ]
    return r.choice(problems) + r.choice(["", " Explain your reasoning step by step.", " Show your work."])


TEMPLATES: list[Callable[[random.Random], str]] = [
    lambda r: f"Write {r.choice(FORMS)} about {r.choice(TOPICS)}.",
    lambda r: f"Write {r.choice(FORMS)} about {r.choice(TOPICS)} in under 150 words.",
    lambda r: f"Explain {r.choice(CONCEPTS)} to {r.choice(AUDIENCES)}.",
    lambda r: f"Tell me about {r.choice(CONCEPTS)} and why it matters.",
    lambda r: f"Give me {r.randint(3, 7)} tips for {r.choice(ACTIVITIES)}.",
    lambda r: f"How can I get better at {r.choice(ACTIVITIES)}?",
    lambda r: "Compare {} and {}: what are the main differences?".format(*r.choice(PAIRS)),
    lambda r: "What are the pros and cons of {} versus {}?".format(*r.choice(PAIRS)),
    lambda r: f"Write a {r.choice(LANGUAGES)} function that {r.choice(CODE_TASKS)}.",
    lambda r: f"Explain what this code does:\n\n{r.choice(CODE_SNIPPETS)}",
    _math,
    lambda r: f"Pretend you are {r.choice(ROLES)}. {r.choice(QUESTIONS)}",
    lambda r: f"Tell me about the history and culture of {r.choice(COUNTRIES)}.",
    lambda r: f"Plan a {r.randint(2, 7)}-day trip to {r.choice(COUNTRIES)}.",
    lambda r: (lambda lang: f"Translate the following {lang} text into English: {_sentence(r, lang)} "
               f"{_sentence(r, lang)}")(r.choice(list(SENTENCES))),
    lambda r: f"Write an email to {r.choice(['my manager', 'a client', 'my landlord', 'a teacher'])} about "
    f"{r.choice(['a delayed project', 'a broken heater', 'a meeting next week', 'a refund', 'a day off'])}.",
    lambda r: f"Summarize the main ideas of {r.choice(CONCEPTS)} in one paragraph, then list three key facts.",
]  # fmt: skip


def generate_instructions(num: int, seed: int = 0) -> list[dict]:
    """`num` distinct prompts `{id, source, prompt}` (source: template number), each from a template drawn
    at random; a repeated prompt is drawn again, so templates with few fillings do not repeat, and no
    template gives more than 2.5x its share, so the ones with endless fillings (math, translation) do not
    crowd out the rest."""
    r = random.Random(seed)
    cap = math.ceil(2.5 * num / len(TEMPLATES))
    seen: set[str] = set()
    used = [0] * len(TEMPLATES)
    out: list[dict] = []
    misses = 0  # draws in a row that gave nothing new
    while len(out) < num:
        misses += 1
        if misses > 100_000:
            raise ValueError(f"the templates give fewer than {num} distinct prompts (within the per-template cap)")
        t = r.randrange(len(TEMPLATES))
        prompt = TEMPLATES[t](r)
        if used[t] < cap and prompt not in seen:
            used[t] += 1
            misses = 0
            seen.add(prompt)
            out.append({"id": f"instr-{len(out)}", "source": f"template-{t}", "prompt": prompt})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--num", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = generate_instructions(args.num, args.seed)
    write_jsonl(args.output, rows)
    print(f"wrote {len(rows)} prompts to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
