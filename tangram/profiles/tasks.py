"""Accuracy tasks with known answers that SmolLM2-135M can solve (RULER- and SCBench-style), and natural text for KL.

Every sample is generated offline from a seed: a haystack, one or more needles
inserted at drawn depths, and questions whose answer is known. The assistant's
reply is primed with an answer prefix (as RULER does), so the gold answer is
the continuation right after it and exact match can be checked by teacher
forcing (see :mod:`tangram.profiles.evaluate`).

* ``passkey``: the pass key (5 digits) hidden in repeated filler sentences.
* ``niah_single``: one "special magic number" (7 digits) for a word key hidden
  in Python's own documentation text (``pydoc_data.topics`` of CPython 3.11.7,
  shipped as ``data/pydoc_topics.json.gz``: the same haystacks on every Python).
* ``niah_multikey``: two needles with different keys in the same haystack;
  the question asks for one of them (the other is the distractor). RULER's
  ``niah_multikey_1`` has four keys: SmolLM2-135M's full cache solves four
  keys at 70-81% (three: 85% at 512 tokens, 78% at 1024; two: 93% / 85%, 60
  ``calib`` samples each, tangram-accuracy's full-cache curve), so version 2
  of the task has two (version 1, four keys, is in git history).
* ``vt``: RULER's variable-tracking context -- a chain ``VAR A = 12345``,
  ``VAR B = VAR A``, ``VAR C = VAR B`` hidden in filler -- asked for the
  variable that holds the value (``A``; ``B`` and ``C`` are distractors that
  share the chain). SmolLM2-135M cannot follow a hop: RULER's question (all
  variables of the chain) and one-hop questions ("which variable is assigned
  the value of VAR B?") scored 0/8 and 9-10/16 at ~360 tokens, near guessing.
* ``mt_niah``: SCBench-style multi-turn over a shared context: one needle per
  turn in a documentation haystack, each asked once, one question per turn
  (every other needle is a distractor for it); only the first turn's question
  is in the prompt the engine compresses, later questions arrive after the
  context was compressed. Version 1 had four needles for two turns: its
  follow-up scored 65-85% on the full cache (no length with a 95% lower bound
  >= 80%); one needle per turn scores 90% / 92% (turn 1 / follow-up) at 512
  tokens (60 ``calib`` samples).

``kl_text`` samples are plain documentation passages (a context and a
continuation) for the KL divergence of next-token distributions.

Lengths: ``context_tokens`` is the length of the first turn's prompt as the
engine prefills it (chat template, context, question and answer prefix). With
a ``measure`` callable (the tokenizer's count) the generator sizes the
haystack by bisection on whole filler units; without one it estimates with
4 characters per token. The ``calib`` and ``heldout`` splits draw from
disjoint seed streams and disjoint documentation topics.
"""
from __future__ import annotations

import gzip
import json
import sys
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np

from tangram.errors import ConfigError

TASKS = ("passkey", "niah_single", "niah_multikey", "vt", "mt_niah")
KL_TASK = "kl_text"
SPLITS = {"calib": 0, "heldout": 1}
# A task's definition changes -> its version goes up, so results measured on the old one are never reused.
TASK_VERSIONS = {**{t: 1 for t in TASKS}, "niah_multikey": 2, "mt_niah": 2}
MULTIKEY_NEEDLES = 2  # niah_multikey v2 (v1: 4)


def task_version(task: str) -> int:
    return TASK_VERSIONS.get(task, 1)


_TASK_IDS = {t: i for i, t in enumerate(TASKS + (KL_TASK,))}

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_ADJECTIVES = (
    "amber", "ancient", "bold", "brave", "bright", "calm", "clever", "cold", "crimson", "curious", "dusty", "eager",
    "early", "elegant", "faint", "fancy", "fierce", "gentle", "giant", "golden", "grumpy", "hidden", "hollow",
    "humble", "icy", "jolly", "kind", "lazy", "little", "lively", "lucky", "misty", "modern", "noble", "odd",
    "orange", "pale", "polite", "proud", "quiet", "rapid", "royal", "rusty", "shiny", "silent", "silver", "sleepy",
    "smooth", "solid", "steady", "stormy", "sunny", "swift", "tall", "tidy", "tiny", "velvet", "violet", "wild",
    "wise", "witty", "wooden", "young", "zealous")
_NOUNS = (
    "anchor", "apple", "badger", "banner", "basket", "beacon", "bicycle", "bridge", "camera", "candle", "canyon",
    "castle", "cherry", "circus", "comet", "compass", "cottage", "dolphin", "dragon", "falcon", "feather", "forest",
    "fountain", "garden", "giraffe", "glacier", "harbor", "helmet", "island", "jacket", "kettle", "ladder", "lantern",
    "lemon", "meadow", "mirror", "monkey", "needle", "orchard", "otter", "palace", "panther", "pencil", "pepper",
    "piano", "pillow", "planet", "pocket", "puzzle", "rabbit", "river", "rocket", "saddle", "salmon", "shovel",
    "spider", "squirrel", "statue", "tiger", "tractor", "trumpet", "tunnel", "violin", "walrus", "window", "wizard")


@dataclass(frozen=True)
class Question:
    text: str  # the user's question
    answer_prefix: str  # the assistant's reply starts with this (RULER's answer prefix)
    answer: str  # gold continuation after the prefix (a space is put between them)


@dataclass(frozen=True)
class TaskSample:
    task: str
    split: str
    index: int
    context: str
    questions: tuple[Question, ...]
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def uid(self) -> str:
        return f"{self.split}/{self.task}/{self.index}"

    def user_message(self, turn: int) -> str:
        """Turn 0 carries the shared context and the first question; later turns only their question."""
        q = self.questions[turn].text
        return f"{self.context}\n\n{q}" if turn == 0 else q


@dataclass(frozen=True)
class TextSample:
    """A natural-text passage: the model reads ``context`` (compressed) and is scored on ``continuation``."""

    task: str
    split: str
    index: int
    context: str
    continuation: str
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def uid(self) -> str:
        return f"{self.split}/{self.task}/{self.index}"


def _rng(task: str, split: str, index: int) -> np.random.Generator:
    if task not in _TASK_IDS:
        raise ConfigError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
    return np.random.default_rng(np.random.SeedSequence([0x7A5C, _TASK_IDS[task], SPLITS[split], int(index)]))


# --------------------------------------------------------------------------- haystacks


def doc_split_of(topic: str) -> str:
    """Documentation topics are assigned to a split by a hash of their name: the splits never share a topic."""
    return "heldout" if zlib.crc32(topic.encode()) % 4 == 0 else "calib"


DOC_TOPICS = Path(__file__).resolve().parent / "data" / "pydoc_topics.json.gz"


@lru_cache(maxsize=1)
def doc_topics() -> dict[str, str]:
    """Python's documentation topics as shipped with the package (``data/pydoc_topics.json.gz``: CPython 3.11.7's
    ``pydoc_data.topics``), not the running interpreter's: that module's text differs between Python versions
    (for the same (task, index) 3.11 and 3.12 drew different haystacks), so a sample would depend on the Python
    that generated it. Regenerate with ``python -m tangram.profiles.tasks --write-doc-topics`` (changes every
    documentation sample: bump ``TASK_VERSIONS`` of the tasks that use it)."""
    try:
        with gzip.open(DOC_TOPICS, "rt", encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{DOC_TOPICS}: cannot read the shipped documentation text ({e})") from None
    topics = doc.get("topics") if isinstance(doc, dict) else None
    if not isinstance(topics, dict) or not all(isinstance(v, str) for v in topics.values()):
        raise ConfigError(f"{DOC_TOPICS}: field 'topics' must map topic names to text")
    return topics


def write_doc_topics(path: Path = DOC_TOPICS) -> Path:
    """Snapshot the running interpreter's ``pydoc_data.topics`` (byte-stable: sorted keys, gzip mtime 0)."""
    from pydoc_data.topics import topics

    ver = sys.version.split()[0]
    doc = {"source": f"pydoc_data.topics of CPython {ver} (Python Software Foundation License), the documentation "
                     "haystack of tangram.profiles.tasks", "python": ver, "topics": dict(sorted(topics.items()))}
    Path(path).write_bytes(gzip.compress(json.dumps(doc, sort_keys=True, ensure_ascii=False).encode(), 9, mtime=0))
    return Path(path)


@lru_cache(maxsize=2)
def doc_lines(split: str) -> tuple[str, ...]:
    """Lines of Python's documentation (the shipped :func:`doc_topics`) of one split, in a stable order."""
    topics = doc_topics()
    lines: list[str] = []
    for name in sorted(topics):
        if doc_split_of(name) == split:
            lines.extend(ln.rstrip() for ln in topics[name].splitlines())
    # drop runs of blank lines: one blank line keeps paragraphs apart
    out = [ln for i, ln in enumerate(lines) if ln or (i and lines[i - 1])]
    if len(out) < 200:
        raise ConfigError(f"{DOC_TOPICS}: too little documentation text for the {split!r} split")
    return tuple(out)


def _doc_units(rng: np.random.Generator, split: str) -> Callable[[int], list[str]]:
    lines = doc_lines(split)
    start = int(rng.integers(len(lines)))
    return lambda n: [lines[(start + i) % len(lines)] for i in range(n)]


def _filler_units(_rng: np.random.Generator, _split: str) -> Callable[[int], list[str]]:
    return lambda n: [FILLER] * n


def _insert(units: list[str], items: list[tuple[float, str]]) -> list[str]:
    """Insert needles at depth fractions in [0, 1] (between units; stable for equal depths)."""
    out = list(units)
    for depth, text in sorted(items, key=lambda x: x[0], reverse=True):
        out.insert(int(round(depth * len(units))), text)
    return out


def _keys(rng: np.random.Generator, n: int) -> list[str]:
    """``n`` distinct adjective-noun keys (distinct nouns too, so no key is a near-copy of another)."""
    adj = rng.choice(len(_ADJECTIVES), size=n, replace=False)
    noun = rng.choice(len(_NOUNS), size=n, replace=False)
    return [f"{_ADJECTIVES[a]}-{_NOUNS[b]}" for a, b in zip(adj, noun)]


def _number(rng: np.random.Generator, digits: int) -> str:
    return str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))


def _var(rng: np.random.Generator, used: set[str]) -> str:
    while True:
        v = "".join(rng.choice(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"), size=5))
        if v not in used:
            used.add(v)
            return v


# --------------------------------------------------------------------------- task builders
# Each builder draws everything random up front and returns build(n_units) -> (context, questions), so the
# haystack size can be searched without changing the needles.

_NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
               "I will quiz you about the numbers afterwards.")


def _niah_question(key: str, value: str) -> Question:
    # RULER's question without "mentioned in the provided text": follow-up turns are prefilled once per mode
    return Question(f"What is the special magic number for {key}?", f"The special magic number for {key} is", value)


def _build_passkey(rng, split, n_turns):
    units = _filler_units(rng, split)
    value, depth = _number(rng, 5), float(rng.uniform())
    needle = f"The pass key is {value}. Remember it. {value} is the pass key."
    intro = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
             "I will quiz you about the important information there.")
    q = Question("What is the pass key?", "The pass key is", value)

    def build(n):
        return intro + "\n\n" + " ".join(_insert(units(n), [(depth, needle)])), (q,)
    return build, {"depth": depth}


def _build_niah(rng, split, n_turns, n_needles: int, n_questions: int):
    units = _doc_units(rng, split)
    keys = _keys(rng, n_needles)
    values = [_number(rng, 7) for _ in keys]
    depths = [float(d) for d in rng.uniform(size=n_needles)]
    asked = [int(i) for i in rng.choice(n_needles, size=n_questions, replace=False)]
    needles = [(d, f"One of the special magic numbers for {k} is: {v}.") for d, k, v in zip(depths, keys, values)]
    qs = tuple(_niah_question(keys[i], values[i]) for i in asked)

    def build(n):
        return _NIAH_INTRO + "\n\n" + "\n".join(_insert(units(n), needles)), qs
    return build, {"depths": [depths[i] for i in asked], "keys": keys}


def _build_vt(rng, split, n_turns, hops: int = 3):
    units = _filler_units(rng, split)
    used: set[str] = set()
    names = [_var(rng, used) for _ in range(hops)]
    value = _number(rng, 5)
    depths = sorted(float(d) for d in rng.uniform(size=hops))
    stmts = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops)]
    intro = "Memorize and track the chain of variable assignments hidden in the following text."
    # The chain's first variable: SmolLM2-135M cannot follow a hop (see the module docstring), so the question
    # asks for the variable that holds the value itself; the other chain members are the distractors.
    q = Question(f"Which variable is assigned the value {value}?",
                 f"The variable assigned the value {value} is VAR", names[0])

    def build(n):
        return intro + "\n\n" + " ".join(_insert(units(n), list(zip(depths, stmts)))), (q,)
    return build, {"depths": depths, "chain": names}


def _builder(task: str, rng, split: str, n_turns: int):
    if task == "passkey":
        return _build_passkey(rng, split, n_turns)
    if task == "niah_single":
        return _build_niah(rng, split, n_turns, 1, 1)
    if task == "niah_multikey":
        return _build_niah(rng, split, n_turns, MULTIKEY_NEEDLES, 1)
    if task == "vt":
        return _build_vt(rng, split, n_turns)
    if task == "mt_niah":
        if not 2 <= n_turns <= 4:
            raise ConfigError(f"mt_niah needs 2..4 turns, got {n_turns}")
        return _build_niah(rng, split, n_turns, n_turns, n_turns)  # v2: one needle per turn (v1: 4)
    raise ConfigError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")


def _fit_units(make, measure: Callable[[object], int], target: int, est: int) -> tuple[object, int]:
    """Largest unit count whose sample measures <= target tokens (bisection around an estimate)."""
    lo, hi = 0, max(2, est)
    while measure(make(hi)) <= target:  # grow the bracket
        lo, hi = hi, hi * 2
        if hi > 1 << 20:
            raise ConfigError(f"cannot reach {target} tokens")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if measure(make(mid)) <= target:
            lo = mid
        else:
            hi = mid
    n = max(lo, 1)
    return make(n), n


def make_task(task: str, split: str, index: int, context_tokens: int, *,
              measure: Callable[[TaskSample], int] | None = None, n_turns: int = 2) -> TaskSample:
    """One seeded sample of ``task`` whose first-turn prompt is about ``context_tokens`` long."""
    if context_tokens < 64:
        raise ConfigError(f"context length must be >= 64 tokens, got {context_tokens}")
    rng = _rng(task, split, index)
    build, meta = _builder(task, rng, split, n_turns)
    unit_chars = len(FILLER) + 1 if task in ("passkey", "vt") else 40

    def make(n):
        ctx, qs = build(n)
        return TaskSample(task, split, index, ctx, qs, dict(meta, units=n))

    est = max(1, context_tokens * 4 // unit_chars)
    if measure is None:  # no tokenizer: about 4 characters per token
        return make(est)
    return _fit_units(make, measure, context_tokens, est)[0]


def make_text(split: str, index: int, context_tokens: int, continuation_tokens: int, *,
              encode: Callable[[str], list[int]] | None = None, decode: Callable[[list[int]], str] | None = None
              ) -> TextSample:
    """A documentation passage cut into a context of ``context_tokens`` and a continuation (token counts with
    ``encode``/``decode``, else about 4 characters per token)."""
    rng = _rng(KL_TASK, split, index)
    lines = doc_lines(split)
    start = int(rng.integers(len(lines)))
    need = (context_tokens + continuation_tokens) * 6
    text, i = "", start
    while len(text) < need:
        text += lines[i % len(lines)] + "\n"
        i += 1
    if encode is None or decode is None:
        c = context_tokens * 4
        return TextSample(KL_TASK, split, index, text[:c], text[c:c + continuation_tokens * 4], {"start": start})
    ids = encode(text)
    while len(ids) < context_tokens + continuation_tokens:  # very dense text: take more lines
        text += lines[i % len(lines)] + "\n"
        i += 1
        ids = encode(text)
    return TextSample(KL_TASK, split, index, decode(ids[:context_tokens]),
                      decode(ids[context_tokens:context_tokens + continuation_tokens]),
                      {"start": start, "context_ids": ids[:context_tokens],
                       "continuation_ids": ids[context_tokens:context_tokens + continuation_tokens]})


__all__ = ["TASKS", "KL_TASK", "SPLITS", "Question", "TaskSample", "TextSample", "make_task", "make_text",
           "doc_lines", "doc_split_of", "doc_topics", "write_doc_topics", "FILLER"]


if __name__ == "__main__":  # python -m tangram.profiles.tasks --write-doc-topics [PATH]
    from tangram.cli import Parser

    ap = Parser(prog="python -m tangram.profiles.tasks",
                description="Snapshot this interpreter's pydoc_data.topics as the shipped documentation haystack "
                            "(changes every documentation sample).")
    ap.add_argument("--write-doc-topics", nargs="?", const=str(DOC_TOPICS), metavar="PATH", required=True)
    print(write_doc_topics(Path(ap.parse_args().write_doc_topics)))
