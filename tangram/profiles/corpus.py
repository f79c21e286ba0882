"""Offline multi-turn calibration corpus: synthetic SCBench-style tasks with known answers.

Every sample is a shared context plus 2-4 question turns. Generation is seeded
and deterministic; the ``calib`` and ``heldout`` splits draw from disjoint seed
streams (and, for code retrieval, disjoint standard-library files), so a
profile calibrated on one split is evaluated on unseen inputs.

Context length is steered by ``context_tokens`` through a per-task
characters-per-token estimate for byte-level BPE vocabularies (SmolLM2: digits
are split one per token, so hex/number-heavy text is denser). The fidelity
report states measured token counts.
"""
from __future__ import annotations

import ast
import string
import sys
import sysconfig
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from tangram.errors import ConfigError

TASKS = ("kv_retrieval", "prefix_suffix", "math_find", "code_retrieval")
SPLITS = {"calib": 0, "heldout": 1}
CORPORA = ("scbench-synth",)
# Approximate characters per SmolLM2 token, measured on this generator's output.
_CHARS_PER_TOKEN = {"kv_retrieval": 1.13, "prefix_suffix": 1.6, "math_find": 1.08, "code_retrieval": 3.9}


@dataclass(frozen=True)
class Turn:
    question: str
    answer: str


@dataclass(frozen=True)
class Sample:
    task: str
    split: str
    index: int
    context: str
    turns: tuple[Turn, ...]

    @property
    def uid(self) -> str:
        return f"{self.split}/{self.task}/{self.index}"

    def user_message(self, turn: int) -> str:
        """Turn 0 carries the shared context; later turns only the question."""
        q = self.turns[turn].question
        return f"{self.context}\n\n{q}" if turn == 0 else q


def _rng(task: str, split: str, index: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([0x7A9, TASKS.index(task), SPLITS[split], index]))


def _uuid(rng: np.random.Generator) -> str:
    h = "".join(rng.choice(list("0123456789abcdef"), size=32))
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _kv_retrieval(rng, n_chars: int, n_q: int) -> tuple[str, list[Turn]]:
    pairs: list[tuple[str, str]] = []
    size = 2
    while size < n_chars:
        k, v = _uuid(rng), _uuid(rng)
        pairs.append((k, v))
        size += len(k) + len(v) + 8
    body = ",\n".join(f' "{k}": "{v}"' for k, v in pairs)
    ctx = "Extract the value corresponding to the specified key in the JSON object below.\n\n{\n" + body + "\n}"
    pick = rng.choice(len(pairs), size=min(n_q, len(pairs)), replace=False)
    turns = [Turn(f'What is the value of key "{pairs[i][0]}"? Answer with the value only.', pairs[i][1])
             for i in pick]
    return ctx, turns


def _word(rng, lo=5, hi=9) -> str:
    return "".join(rng.choice(list(string.ascii_lowercase), size=int(rng.integers(lo, hi + 1))))


def _prefix_suffix(rng, n_chars: int, n_q: int) -> tuple[str, list[Turn]]:
    items: list[str] = []
    size = 0
    seen = set()
    while size < n_chars:
        s = "".join(_word(rng) for _ in range(3))
        if s[:4] in seen or s[-4:] in seen:
            continue  # prefixes/suffixes unique so each question has one answer
        seen.update((s[:4], s[-4:]))
        items.append(s)
        size += len(s) + 3
    ctx = "Here is a list of strings, one per line.\n\n" + "\n".join(f"- {s}" for s in items)
    pick = rng.choice(len(items), size=min(n_q, len(items)), replace=False)
    turns = [Turn(f'Which string in the list starts with "{items[i][:4]}" and ends with "{items[i][-4:]}"? '
                  "Answer with the string only.", items[i]) for i in pick]
    return ctx, turns


def _math_find(rng, n_chars: int, n_q: int) -> tuple[str, list[Turn]]:
    n = max(8, int(n_chars / 5.5))
    nums = rng.integers(-9999, 10000, size=n)
    ctx = "Here is a list of numbers:\n\n" + ", ".join(str(int(x)) for x in nums)
    qs = [("What is the largest number in the list?", int(nums.max())),
          ("What is the smallest number in the list?", int(nums.min())),
          ("What is the first number in the list?", int(nums[0])),
          ("What is the last number in the list?", int(nums[-1]))]
    order = rng.permutation(len(qs))[:n_q]
    return ctx, [Turn(qs[i][0] + " Answer with the number only.", str(qs[i][1])) for i in order]


@lru_cache(maxsize=1)
def stdlib_files() -> tuple[Path, ...]:
    """Pure-Python standard-library modules of the running interpreter, in a stable order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if any(part in ("test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo") for part in p.parts):
            continue
        if 4_000 < p.stat().st_size < 400_000:
            out.append(p)
    if not out:
        raise ConfigError(f"no standard-library sources found under {root} (needed for code_retrieval)")
    return tuple(out)


def code_split_of(path: Path) -> str:
    """Files are assigned to a split by a hash of their stdlib-relative path: the splits never share a file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return "heldout" if zlib.crc32(path.relative_to(root).as_posix().encode()) % 4 == 0 else "calib"


def _functions(src: str) -> list[tuple[str, int, int]]:
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError):
        return []
    return [(n.name, n.lineno, n.end_lineno or n.lineno) for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _code_retrieval(rng, n_chars: int, n_q: int, split: str) -> tuple[str, list[Turn]]:
    files = [p for p in stdlib_files() if code_split_of(p) == split]
    for _ in range(50):
        path = files[int(rng.integers(len(files)))]
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        funcs = [f for f in _functions("\n".join(lines)) if f[2] - f[1] >= 3]
        if len(funcs) < n_q + 2:
            continue
        # a window of whole top-level lines of about n_chars, starting at a random function
        start = funcs[int(rng.integers(max(1, len(funcs) // 2)))][1] - 1
        end, size = start, 0
        while end < len(lines) and size < n_chars:
            size += len(lines[end]) + 1
            end += 1
        inside = [f for f in funcs if f[1] - 1 >= start and f[2] <= end]
        counts: dict[str, int] = {}
        for ln in lines[start:end]:
            counts[ln.strip()] = counts.get(ln.strip(), 0) + 1
        cands = []
        for name, a, b in inside:
            body = [lines[i].strip() for i in range(a, b)]  # lines after the def line
            good = [s for s in body if len(s) > 24 and counts.get(s, 0) == 1 and not s.startswith(("#", "@", '"', "'"))
                    and "def " not in s]
            if good and sum(1 for f in inside if f[0] == name) == 1:
                cands.append((name, good[int(rng.integers(len(good)))]))
        # a line inside a nested function belongs to the innermost one: skip names that contain others
        if len(cands) < n_q:
            continue
        pick = rng.choice(len(cands), size=n_q, replace=False)
        ctx = f"Here is the source of part of the Python module {path.stem}.py:\n\n" + "\n".join(lines[start:end])
        turns = [Turn(f"Which function contains the line `{cands[i][1]}`? Answer with the function name only.",
                      _innermost(inside, lines, cands[i][1], start, end)) for i in pick]
        return ctx, turns
    raise ConfigError("could not build a code_retrieval sample from the standard library")


def _innermost(funcs, lines, text, start, end) -> str:
    i = next(j for j in range(start, end) if lines[j].strip() == text) + 1  # 1-based line number
    best = min((f for f in funcs if f[1] < i <= f[2]), key=lambda f: f[2] - f[1])
    return best[0]


def make_sample(task: str, split: str, index: int, context_tokens: int = 1024, n_turns: int | None = None) -> Sample:
    if task not in TASKS:
        raise ConfigError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
    rng = _rng(task, split, index)
    n_q = int(n_turns or rng.integers(2, 5))
    if not 1 <= n_q <= 8:
        raise ConfigError(f"turns per sample must be in 1..8, got {n_q}")
    n_chars = int(context_tokens * _CHARS_PER_TOKEN[task])
    if task == "code_retrieval":
        ctx, turns = _code_retrieval(rng, n_chars, n_q, split)
    else:
        ctx, turns = {"kv_retrieval": _kv_retrieval, "prefix_suffix": _prefix_suffix,
                      "math_find": _math_find}[task](rng, n_chars, n_q)
    return Sample(task, split, index, ctx, tuple(turns))


def build_corpus(n: int, split: str = "calib", *, corpus: str = "scbench-synth", context_tokens: int = 1024,
                 tasks: tuple[str, ...] = TASKS, n_turns: int | None = None) -> list[Sample]:
    """``n`` samples, tasks interleaved round-robin (sample i is task i mod len(tasks))."""
    if corpus not in CORPORA:
        raise ConfigError(f"unknown corpus {corpus!r}; available: {', '.join(CORPORA)}")
    if n < 1:
        raise ConfigError(f"number of samples must be >= 1, got {n}")
    return [make_sample(tasks[i % len(tasks)], split, i // len(tasks), context_tokens, n_turns) for i in range(n)]


def answer_correct(generated: str, answer: str) -> bool:
    """Exact answer string appears in the generated text (whitespace- and case-insensitive for names)."""
    g = " ".join(generated.split()).lower()
    return answer.lower() in g


__all__ = ["TASKS", "SPLITS", "CORPORA", "Turn", "Sample", "make_sample", "build_corpus", "answer_correct",
           "stdlib_files", "code_split_of"]
