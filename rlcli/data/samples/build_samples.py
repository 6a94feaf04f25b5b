"""Write the tiny sample files the `data` presets point at (regenerate: python rlcli/data/samples/build_samples.py).

Each file has the schema and format of the public dataset its preset targets, so the adapters are
tested offline, but the rows are original problems written for rlcli (not copied dataset rows):

  dapo_math_17k.parquet  DAPO-Math-17k: data_source, prompt=[{content, role}] with DAPO's instruction,
                         ability, reward_model={ground_truth, style}, extra_info={index}
  gsm8k.jsonl            GSM8K: question, answer (worked steps with <<calc>> notes, then '#### n')
  math.jsonl             MATH (Hendrycks et al.): problem, level, type, solution (ends in \\boxed{})
  math500.jsonl          MATH-500: problem, solution, answer, subject, level, unique_id
  aime.parquet           AIME-style: id, problem, solution, answer (int64)
  chat_add.jsonl         natural-language additions for chat models (data=chat_add): question, answer;
                         all 100 one-digit pairs and 900 seeded two-digit ones
  code_fns.jsonl         small Python functions for chat models (data=code_fns, reward=code): question, answer
                         (the code ground truth: JSON with assert tests and the entry point), solution (the
                         reference), template; 1,186 problems generated with seed 0 (rlcli.data.code_tasks)

Parquet needs pyarrow. Every file is plain ASCII, so the embedded character tokenizer reads it.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

HERE = Path(__file__).parent
DAPO_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of the "
    "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{question}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)

DAPO = [
    (r"Find the number of positive integers $n \le 100$ such that $n^2 + n$ is divisible by $6$.", "66"),
    (r"Let $a$ and $b$ be real numbers with $a + b = 7$ and $ab = 10$. Compute $a^3 + b^3$.", "133"),
    (r"How many ordered pairs of positive integers $(x, y)$ satisfy $xy = 144$?", "15"),
    (
        r"The interior angles of a convex polygon add up to $1980$ degrees. How many sides does the polygon have?",
        "13",
    ),
    (r"Compute the remainder when $2^{100}$ is divided by $7$.", "2"),
    (
        r"A bag holds $4$ red and $6$ blue marbles. Two marbles are drawn without replacement. The "
        r"probability that both are red is $\frac{m}{n}$ in lowest terms. Find $m + n$.",
        "17",
    ),
    (r"Find the smallest positive integer $k$ such that $k!$ ends in at least $6$ zeros.", "25"),
    (r"The roots of $x^2 - 13x + m = 0$ are two consecutive integers. Find $m$.", "42"),
]

GSM8K = [
    (
        "A bakery sells muffins for $3 each. On Monday it sold 45 muffins, and on Tuesday it sold twice as "
        "many. How much money did the bakery make from muffins on those two days?",
        "On Tuesday the bakery sold 45 * 2 = <<45*2=90>>90 muffins.\nOver both days it sold 45 + 90 = "
        "<<45+90=135>>135 muffins.\nSo it made 135 * 3 = $<<135*3=405>>405.\n#### 405",
    ),
    (
        "Maya reads 12 pages of her book every day. The book has 300 pages. How many pages does she still "
        "have to read after 15 days?",
        "In 15 days Maya reads 12 * 15 = <<12*15=180>>180 pages.\nShe still has 300 - 180 = "
        "<<300-180=120>>120 pages to read.\n#### 120",
    ),
    (
        "A school orders 48 boxes of pencils with 25 pencils in each box. How many pencils does the school "
        "order?",
        "The school orders 48 * 25 = <<48*25=1200>>1200 pencils.\n#### 1,200",
    ),
    (
        "Tom has 3 times as many stickers as Ben. Together they have 64 stickers. How many stickers does Tom "
        "have?",
        "Together they have 3 + 1 = <<3+1=4>>4 shares of stickers.\nOne share is 64 / 4 = <<64/4=16>>16 "
        "stickers.\nTom has 3 * 16 = <<3*16=48>>48 stickers.\n#### 48",
    ),
    (
        "A train travels at 60 miles per hour for 2.5 hours and then at 40 miles per hour for 1.5 hours. "
        "How many miles does it travel in total?",
        "First it travels 60 * 2.5 = <<60*2.5=150>>150 miles.\nThen it travels 40 * 1.5 = "
        "<<40*1.5=60>>60 miles.\nIn total it travels 150 + 60 = <<150+60=210>>210 miles.\n#### 210",
    ),
    (
        "Lena buys 4 notebooks at $2.50 each and a pen for $1.75. She pays with a $20 bill. How much change "
        "does she get?",
        "The notebooks cost 4 * 2.50 = $<<4*2.5=10>>10.\nWith the pen she spends 10 + 1.75 = "
        "$<<10+1.75=11.75>>11.75.\nHer change is 20 - 11.75 = $<<20-11.75=8.25>>8.25.\n#### 8.25",
    ),
    (
        "A garden has 7 rows of tomato plants with 9 plants in each row. Each plant gives 6 tomatoes. How "
        "many tomatoes does the garden give?",
        "The garden has 7 * 9 = <<7*9=63>>63 plants.\nThey give 63 * 6 = <<63*6=378>>378 tomatoes.\n#### 378",
    ),
    (
        "The temperature was 5 degrees in the morning and dropped by 12 degrees by midnight. What was the "
        "temperature at midnight?",
        "At midnight the temperature was 5 - 12 = <<5-12=-7>>-7 degrees.\n#### -7",
    ),
]

MATH = [
    (
        "What is the value of $x$ if $3x - 7 = 11$?",
        "Level 1",
        "Algebra",
        r"Adding $7$ to both sides gives $3x = 18$, so $x = \boxed{6}$.",
    ),
    (
        r"Simplify $\frac{18}{24}$.",
        "Level 1",
        "Prealgebra",
        r"Both numbers are divisible by $6$, so $\frac{18}{24} = \boxed{\frac{3}{4}}$.",
    ),
    (
        "A right triangle has legs of length $1$ and $1$. What is the length of its hypotenuse?",
        "Level 2",
        "Geometry",
        r"By the Pythagorean theorem the hypotenuse is $\sqrt{1^2 + 1^2} = \boxed{\sqrt{2}}$.",
    ),
    (
        "What is the greatest common divisor of $84$ and $126$?",
        "Level 2",
        "Number Theory",
        r"We have $84 = 2^2 \cdot 3 \cdot 7$ and $126 = 2 \cdot 3^2 \cdot 7$. A first guess of "
        r"$\boxed{21}$ misses a factor of $2$: the common factors are $2 \cdot 3 \cdot 7$, so the answer is "
        r"$\boxed{42}$.",
    ),
    (
        "Find all real solutions to $x^2 - 5x + 6 = 0$. Enter the solutions, separated by commas.",
        "Level 2",
        "Intermediate Algebra",
        r"The quadratic factors as $(x - 2)(x - 3) = 0$, so $x = \boxed{2, 3}$.",
    ),
    (
        "In how many ways can $3$ books be chosen from a shelf of $7$ different books?",
        "Level 2",
        "Counting & Probability",
        r"The order does not matter, so there are $\binom{7}{3} = \boxed{35}$ ways.",
    ),
    (
        r"Compute $\cos 60^\circ$.",
        "Level 1",
        "Precalculus",
        r"In a $30$-$60$-$90$ triangle the side next to the $60^\circ$ angle is half the hypotenuse, so "
        r"$\cos 60^\circ = \boxed{\frac{1}{2}}$.",
    ),
    (
        "Find the set of all integers $n$ with $n^2 = 4$.",
        "Level 1",
        "Algebra",
        r"Both $2^2$ and $(-2)^2$ equal $4$, so the set is $\boxed{\{-2, 2\}}$.",
    ),
]

MATH500 = [
    (
        "If $2a + 3 = 15$, what is $a$?",
        r"Subtracting $3$ gives $2a = 12$, so $a = \boxed{6}$.",
        "6",
        "Algebra",
        1,
        "test/algebra/5101.json",
    ),
    (
        "What is the sum of the positive divisors of $28$?",
        r"The divisors are $1, 2, 4, 7, 14, 28$, whose sum is $\boxed{56}$.",
        "56",
        "Number Theory",
        2,
        "test/number_theory/5102.json",
    ),
    (
        r"What is the area, in square units, of a circle with radius $3$? Express your answer in terms of $\pi$.",
        r"The area is $\pi r^2 = \boxed{9\pi}$.",
        r"9\pi",
        "Geometry",
        1,
        "test/geometry/5103.json",
    ),
    (
        "Find the sum of the roots of $2x^2 - 8x + 3 = 0$.",
        r"By Vieta's formulas the sum of the roots is $\frac{8}{2} = \boxed{4}$.",
        "4",
        "Intermediate Algebra",
        2,
        "test/intermediate_algebra/5104.json",
    ),
    (
        r"Express $0.\overline{3}$ as a common fraction.",
        r"If $x = 0.\overline{3}$ then $10x - x = 3$, so $x = \boxed{\frac{1}{3}}$.",
        r"\frac{1}{3}",
        "Prealgebra",
        2,
        "test/prealgebra/5105.json",
    ),
    (
        r"Convert the point $(0,3)$ in rectangular coordinates to polar coordinates. Enter your answer in the "
        r"form $(r,\theta),$ where $r > 0$ and $0 \le \theta < 2 \pi.$",
        r"The point is $3$ units from the origin on the positive $y$-axis, so it is "
        r"$\boxed{\left( 3, \frac{\pi}{2} \right)}$.",
        r"\left( 3, \frac{\pi}{2} \right)",
        "Precalculus",
        2,
        "test/precalculus/5106.json",
    ),
    (
        "How many distinct arrangements of the letters in the word BANANA are there?",
        r"There are $\frac{6!}{3! \cdot 2!} = \boxed{60}$ arrangements.",
        "60",
        "Counting & Probability",
        3,
        "test/counting_and_probability/5107.json",
    ),
    (
        r"What is the domain of the function $f(x) = \sqrt{x - 4}$? Express your answer in interval notation.",
        r"We need $x - 4 \ge 0$, so the domain is $\boxed{[4,\infty)}$.",
        r"[4,\infty)",
        "Algebra",
        3,
        "test/algebra/5108.json",
    ),
]

AIME = [
    (
        1,
        "Find the number of positive integers less than $1000$ that are divisible by $7$ but not by $11$.",
        r"There are $142$ multiples of $7$ below $1000$ and $12$ multiples of $77$, so the answer is "
        r"$142 - 12 = \boxed{130}$.",
        130,
    ),
    (
        2,
        "Find the remainder when $3^{2024}$ is divided by $1000$.",
        r"Since $3^{100} \equiv 1 \pmod{1000}$, we get $3^{2024} \equiv 3^{24} \equiv \boxed{481} \pmod{1000}$.",
        481,
    ),
    (
        3,
        "The product of two consecutive positive even integers is $728$. Find their sum.",
        r"Since $26 \cdot 28 = 728$, the sum is $\boxed{54}$.",
        54,
    ),
    (
        4,
        "Find the number of ordered triples of positive integers $(a, b, c)$ with $a + b + c = 12$.",
        r"By stars and bars there are $\binom{11}{2} = \boxed{55}$ triples.",
        55,
    ),
    (
        5,
        r"A sequence has $a_1 = 2$ and $a_{n+1} = 3a_n - 1$ for $n \ge 1$. Find the remainder when $a_{10}$ "
        r"is divided by $1000$.",
        r"Induction gives $a_n = \frac{3^n + 1}{2}$, so $a_{10} = 29525$ and the remainder is $\boxed{525}$.",
        525,
    ),
    (
        6,
        "Find the sum of all positive divisors of $360$ that are perfect squares.",
        r"Since $360 = 2^3 \cdot 3^2 \cdot 5$, the square divisors are $1, 4, 9, 36$, with sum $\boxed{50}$.",
        50,
    ),
    (
        7,
        "Find the least positive integer that leaves remainder $2$ when divided by $3$, remainder $3$ when "
        "divided by $5$, and remainder $4$ when divided by $7$.",
        r"The numbers that are $2 \pmod 3$ and $3 \pmod 5$ are $8 \pmod{15}$; among $8, 23, 38, 53$ the "
        r"first that is $4 \pmod 7$ is $\boxed{53}$.",
        53,
    ),
    (
        8,
        "Find the number of positive integers $n \\le 50$ such that $n$ and $n + 2$ are both prime.",
        r"The pairs are $(3,5), (5,7), (11,13), (17,19), (29,31), (41,43)$, so there are $\boxed{6}$.",
        6,
    ),
]


def _write_jsonl(name: str, rows: list[dict]) -> None:
    with (HERE / name).open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=True) + "\n")


def dapo_rows() -> list[dict]:
    return [
        {
            "data_source": "math_dapo",
            "prompt": [{"content": DAPO_INSTRUCTION.replace("{question}", q), "role": "user"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": a, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": str(uuid.uuid5(uuid.NAMESPACE_URL, f"rlcli/dapo_sample/{i}"))},
        }
        for i, (q, a) in enumerate(DAPO)
    ]


def chat_add_rows() -> list[dict]:
    """Addition in words with an answer-only instruction: what a small chat model gets right sometimes."""
    import random

    rng = random.Random(0)
    pairs = [(a, b) for a in range(10) for b in range(10)]
    pairs += [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(900)]
    return [{"question": f"What is {a} + {b}? Reply with only the number.", "answer": str(a + b)} for a, b in pairs]


def main() -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlcli.data.code_tasks import code_fn_rows

    dapo_schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
            ("extra_info", pa.struct([("index", pa.string())])),
        ]
    )
    pq.write_table(pa.Table.from_pylist(dapo_rows(), schema=dapo_schema), HERE / "dapo_math_17k.parquet")
    _write_jsonl("gsm8k.jsonl", [{"question": q, "answer": a} for q, a in GSM8K])
    _write_jsonl("chat_add.jsonl", chat_add_rows())
    _write_jsonl("code_fns.jsonl", code_fn_rows(seed=0))
    _write_jsonl(
        "math.jsonl", [{"problem": p, "level": lv, "type": t, "solution": s} for p, lv, t, s in MATH]
    )
    _write_jsonl(
        "math500.jsonl",
        [
            {"problem": p, "solution": s, "answer": a, "subject": subj, "level": lv, "unique_id": uid}
            for p, s, a, subj, lv, uid in MATH500
        ],
    )
    aime_schema = pa.schema(
        [("id", pa.int64()), ("problem", pa.string()), ("solution", pa.string()), ("answer", pa.int64())]
    )
    aime_rows = [{"id": i, "problem": p, "solution": s, "answer": a} for i, p, s, a in AIME]
    pq.write_table(pa.Table.from_pylist(aime_rows, schema=aime_schema), HERE / "aime.parquet")


if __name__ == "__main__":
    main()
