"""Import ShareGPT-style conversations (real turn structure) with SmolLM2 token counts, arrivals from the data or seeded.

Schema (FastChat's ShareGPT format, e.g. ``ShareGPT_V3_unfiltered_cleaned_split.json`` of the Hugging Face
dataset anon8231489123/ShareGPT_Vicuna_unfiltered, used by vLLM's and SGLang's serving benchmarks): a JSON array
(or JSON lines) of ``{"id": ..., "conversations": [{"from": "human" | "gpt" | ..., "value": text}, ...]}``.
Roles: ``human``/``user`` ask, ``gpt``/``assistant``/``chatgpt``/``bing``/``bard``/``model`` answer, ``system``
sets context. OpenAI-style ``{"role", "content"}`` messages are read too, under ``conversations``, ``conversation``
(LMSYS-Chat-1M's and WildChat's records, ids in ``conversation_id`` / ``conversation_hash``) or ``messages``.

Turns: each run of user (and system) messages is a turn's prompt, the following run of answers its output.
Answers before the first user message stay as context of the first prompt; a final unanswered user message
cannot be a turn (no output) and is dropped; both are counted in the report.

Token counts (docs/traces.md, "ShareGPT importer"): the conversation is rendered once in ChatML, the template
SmolLM2's GGUF ships (``<|im_start|>{role}\\n{text}<|im_end|>``, the answer ends with its ``<|im_end|>``), and
encoded with the project's SmolLM2 tokenizer (tangram/tokenizer.py); a turn's new tokens are the tokens
starting inside its prompt span, its output the tokens starting inside its answer span, so a session's context
is exactly the token count of the rendered conversation. No default system prompt is added.

Arrival times: WildChat's records carry the conversation's ``timestamp``, used when every conversation has one
(``arrivals``); otherwise (ShareGPT, LMSYS-Chat-1M) sessions arrive as a seeded Poisson process (``rate``
sessions/s, in file order). Think times are seeded draws from a distribution spec (generate.Dist) either way.
"""
from __future__ import annotations

import bisect
import json
import math
import os
from datetime import datetime
from typing import Iterator

import numpy as np

from tangram.errors import ConfigError, InputError

from .format import Trace, Turn, default_request_id
from .generate import Dist
from .importing import ImportReport, open_text, parse_datetime

USER_ROLES = frozenset({"human", "user"})
ASSISTANT_ROLES = frozenset({"gpt", "assistant", "chatgpt", "bing", "bard", "model"})
SYSTEM_ROLES = frozenset({"system"})
# FastChat's ShareGPT ("conversations"), LMSYS-Chat-1M and WildChat ("conversation", OpenAI-style messages), chat
# datasets in the OpenAI format ("messages"); their conversation ids
MESSAGE_KEYS = ("conversations", "conversation", "messages")
ID_KEYS = ("id", "conversation_id", "conversation_hash")
DEFAULT_RATE = 1.0  # sessions per second (an assumption: the data has no times)
DEFAULT_THINK = "lognormal:60:1.0:2:900"  # median 60 s to read an answer and type the next message (assumed)
BATCH = 512  # conversations per tokenizer call


def iter_json_documents(path: str) -> Iterator[tuple[int, object]]:
    """(line, object) of each element of a top-level JSON array, or of each line of a JSON-lines file.

    The text is held once; objects are decoded one at a time (json.JSONDecoder.raw_decode), so memory is about
    the file's size, not the size of every decoded conversation at once.
    """
    with open_text(path) as f:
        try:
            s = f.read()
        except UnicodeDecodeError as e:
            raise InputError(path, None, None, f"not UTF-8 text ({e.reason})") from None
        except (OSError, EOFError) as e:
            raise InputError(path, None, None, f"cannot read: {e}") from None
    dec = json.JSONDecoder()
    n = len(s)
    pos, line = 0, 1

    def skip_ws(i: int) -> int:
        while i < n and s[i] in " \t\r\n":
            i += 1
        return i

    def advance(to: int) -> None:
        nonlocal pos, line
        line += s.count("\n", pos, to)
        pos = to

    def decode_at(i: int):
        advance(i)
        try:
            obj, end = dec.raw_decode(s, i)
        except json.JSONDecodeError as e:
            advance(min(e.pos, n))
            raise InputError(path, line, None, f"invalid JSON: {e.msg}") from None
        except RecursionError:
            raise InputError(path, line, None, "invalid JSON: nested too deeply") from None
        return obj, end

    i = skip_ws(0)
    if i < n and s[i] == "[":
        i = skip_ws(i + 1)
        if i < n and s[i] == "]":
            return
        while True:
            if i >= n:
                advance(n)
                raise InputError(path, line, None, "invalid JSON: the top-level array is not closed")
            start_line = line + s.count("\n", pos, i)
            obj, end = decode_at(i)
            yield start_line, obj
            advance(end)
            i = skip_ws(end)
            if i < n and s[i] == ",":
                i = skip_ws(i + 1)
                continue
            if i < n and s[i] == "]":
                if skip_ws(i + 1) < n:
                    advance(skip_ws(i + 1))
                    raise InputError(path, line, None, "invalid JSON: text after the top-level array")
                return
            advance(min(i, n))
            raise InputError(path, line, None, "invalid JSON: expected ',' or ']' between conversations")
    while i < n:  # JSON lines (or concatenated objects)
        start_line = line + s.count("\n", pos, i)
        obj, end = decode_at(i)
        yield start_line, obj
        advance(end)
        i = skip_ws(end)


def _role(path, line, i, m, key: str = "conversations") -> tuple[str, str]:
    if not isinstance(m, dict):
        raise InputError(path, line, f"{key}[{i}]", "expected an object {\"from\", \"value\"} or {\"role\", "
                         "\"content\"}")
    if "from" in m or "value" in m:
        rk, vk = "from", "value"
    else:
        rk, vk = "role", "content"
    r, v = m.get(rk), m.get(vk)
    if not isinstance(r, str):
        raise InputError(path, line, f"{key}[{i}].{rk}", f"expected a role string, got {r!r}"[:120])
    if not isinstance(v, str):
        raise InputError(path, line, f"{key}[{i}].{vk}", f"expected a string, got {type(v).__name__}")
    role = r.strip().lower()
    if role in USER_ROLES:
        return "user", v
    if role in ASSISTANT_ROLES:
        return "assistant", v
    if role in SYSTEM_ROLES:
        return "system", v
    known = ", ".join(sorted(USER_ROLES | ASSISTANT_ROLES | SYSTEM_ROLES))
    raise InputError(path, line, f"{key}[{i}].{rk}", f"unknown role {r!r} (expected one of {known})")


def render(messages: list[tuple[str, str]]) -> tuple[str, list[tuple[int, int, int]]] | None:
    """ChatML text of a conversation and (prompt start, answer start, answer end) character spans per turn.

    None when no user message is answered. Answers before the first user message join the first prompt;
    unanswered trailing messages are left out.
    """
    parts: list[str] = []
    spans = []
    size = 0
    prompt_start = 0
    pending_user = False
    i, m = 0, len(messages)
    while i < m:
        role, text = messages[i]
        if role == "assistant" and pending_user:
            j = i
            answers = []
            while j < m and messages[j][0] == "assistant":
                answers.append(messages[j][1])
                j += 1
            gen = "\n<|im_start|>assistant\n"
            parts.append(gen)
            size += len(gen)
            ans_start = size
            body = "<|im_end|>\n<|im_start|>assistant\n".join(answers) + "<|im_end|>"
            parts.append(body)
            size += len(body)
            spans.append((prompt_start, ans_start, size))
            prompt_start = size
            pending_user = False
            i = j
            continue
        piece = ("\n" if parts else "") + f"<|im_start|>{role}\n{text}<|im_end|>"
        if role == "user":
            pending_user = True
        parts.append(piece)
        size += len(piece)
        i += 1
    if not spans:
        return None
    text = "".join(parts)[: spans[-1][2]]
    return text, spans


def _counts(enc, spans) -> list[tuple[int, int]]:
    starts = [a for a, _ in enc.offsets]
    out = []
    for p0, a0, a1 in spans:
        i0, i1, i2 = (bisect.bisect_left(starts, x) for x in (p0, a0, a1))
        out.append((i1 - i0, i2 - i1))
    return out


ARRIVALS = ("auto", "timestamp", "poisson")


_EPOCH = datetime(1970, 1, 1)


def _timestamps(p: str, stamps: list[tuple[int, object]]) -> tuple[np.ndarray, str]:
    """Seconds of each record's ``timestamp`` and how they were read. Text: an ISO-like date-time (the Azure
    importer's :func:`.importing.parse_datetime`: ``2023-04-09 00:02:53+00:00``, ``...T00:02:53.123Z``; UTC when it
    names no zone). Numbers: since the epoch, in the unit their size implies (seconds below 1e11, i.e. before the
    year 5138; milliseconds, as pandas' and Hugging Face's JSON export writes date-times, below 1e14; microseconds
    below 1e17; else nanoseconds), or seconds from any origin when small. The first bad value is an error at its
    line."""
    out = np.empty(len(stamps))
    units = set()
    num = []
    for j, (line, v) in enumerate(stamps):
        if isinstance(v, str):
            out[j] = (parse_datetime(p, line, "timestamp", v) - _EPOCH).total_seconds()
            units.add("ISO 8601")
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            num.append(j)
        else:
            raise InputError(p, line, "timestamp", f"expected a date-time text or a finite number, got {v!r}"[:120])
    if num:
        x = np.array([float(stamps[j][1]) for j in num])
        scale = np.select([np.abs(x) < 1e11, np.abs(x) < 1e14, np.abs(x) < 1e17], [1.0, 1e-3, 1e-6], 1e-9)
        units |= {{1.0: "s", 1e-3: "ms", 1e-6: "us", 1e-9: "ns"}[u] for u in np.unique(scale).tolist()}
        out[num] = x * scale
    return out, "/".join(sorted(units))


def import_sharegpt(path: str | os.PathLike, *, seed: int = 0, rate: float = DEFAULT_RATE,
                    think_time: str | Dist = DEFAULT_THINK, keep_text: bool = False, limit: int | None = None,
                    tokenizer=None, progress: bool = False, report: ImportReport | None = None,
                    arrivals: str = "auto") -> Trace:
    """Sessions with the data's real turns; token counts from the SmolLM2 tokenizer; arrivals from the records'
    ``timestamp`` (WildChat's: the conversation's start) or a seeded Poisson process.

    ``keep_text`` stores each turn's prompt (its ChatML text) in ``text`` for the real engine. ``limit`` keeps
    the first N conversations of the file (skipped ones included in the count). ``arrivals``: ``timestamp`` (every
    record must have one), ``poisson`` (``rate`` sessions/s in file order) or ``auto`` (timestamps when every
    importable record has one, else Poisson, the report saying which and why).
    """
    p = str(path)
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise ConfigError(f"rate must be > 0 sessions/s, got {rate!r}")
    if arrivals not in ARRIVALS:
        raise ConfigError(f"arrivals must be one of {', '.join(ARRIVALS)}, got {arrivals!r}")
    think = Dist.parse(think_time, "--think-time")
    rep = report if report is not None else ImportReport("sharegpt", p)
    rep.format, rep.source = "sharegpt", p
    convs: list[tuple[int, str, str, list]] = []  # (line, id, text, spans)
    stamps: list[tuple[int, object]] = []  # (line, timestamp) of the importable records that have one
    unstamped = None  # the line of the first importable record without one
    leading = trailing = 0
    for line, obj in iter_json_documents(p):
        if limit is not None and rep.rows >= limit:
            break
        rep.rows += 1
        if not isinstance(obj, dict):
            raise InputError(p, line, None, "expected a conversation object {\"id\", \"conversations\"}")
        key = next((k for k in MESSAGE_KEYS if k in obj), None)
        if key is None:
            raise InputError(p, line, "conversations", "missing required field (a list of messages under "
                             + " or ".join(repr(k) for k in MESSAGE_KEYS) + ")")
        msgs = obj[key]
        if not isinstance(msgs, list):
            raise InputError(p, line, key, "expected a list of messages")
        cid = next((obj[k] for k in ID_KEYS if obj.get(k) is not None), None)
        cid = "" if cid is None else str(cid)
        roles = [_role(p, line, i, m, key) for i, m in enumerate(msgs)]
        r = render(roles)
        if r is None:
            rep.skip("conversation without an answered user message")
            continue
        first_user = next(i for i, (ro, _) in enumerate(roles) if ro == "user")
        leading += any(ro == "assistant" for ro, _ in roles[:first_user])
        last_answer = max(i for i, (ro, _) in enumerate(roles) if ro == "assistant")
        trailing += any(ro == "user" for ro, _ in roles[last_answer + 1:])
        convs.append((line, cid, r[0], r[1]))
        if obj.get("timestamp") is not None:
            stamps.append((line, obj["timestamp"]))
        elif arrivals == "timestamp":
            raise InputError(p, line, "timestamp", "missing (--arrivals timestamp needs one on every conversation)")
        elif unstamped is None:
            unstamped = line
    if not convs:
        raise InputError(p, None, None, "no importable conversations (" + "; ".join(rep.lines()) + ")")
    arr = None
    if arrivals != "poisson" and stamps and len(stamps) == len(convs):
        ts, how = _timestamps(p, stamps)
        arr = ts - ts.min()
    elif arrivals == "auto" and stamps:
        rep.notes.append(f"{len(stamps)} of {len(convs)} conversations have a timestamp (none at line {unstamped}): "
                         "arrivals generated instead")
    if tokenizer is None:  # after validating the input: loading the GGUF takes seconds
        from tangram.tokenizer import load_tokenizer

        tokenizer = load_tokenizer()
    tok = tokenizer.tok
    rng = np.random.default_rng(seed)
    n_turns = sum(len(c[3]) for c in convs)
    gen = np.concatenate([[0.0], np.cumsum(rng.exponential(1.0 / rate, len(convs) - 1))])  # drawn either way:
    thinks = np.round(think.sample(rng, n_turns), 3)  # a seed's think times do not depend on where arrivals come from
    arrivals_s = gen if arr is None else arr
    turns: list[Turn] = []
    k_think = 0
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(convs), desc="tokenizing", unit="conv", leave=False)
    for b0 in range(0, len(convs), BATCH):
        chunk = convs[b0:b0 + BATCH]
        encs = tok.encode_batch([c[2] for c in chunk], add_special_tokens=False)
        for j, ((line, cid, text, spans), enc) in enumerate(zip(chunk, encs)):
            sid = f"sg{b0 + j}"
            for k, ((new, out), (p0, a0, _)) in enumerate(zip(_counts(enc, spans), spans)):
                meta = {"x_line": line}
                if k == 0 and cid:
                    meta["x_id"] = cid
                txt = text[p0:a0] if keep_text else None
                if k == 0:
                    t = Turn(default_request_id(sid, 0), sid, 0, round(float(arrivals_s[b0 + j]), 6), 0.0,
                             max(new, 1), max(out, 1), text=txt, meta=meta)
                else:
                    t = Turn(default_request_id(sid, k), sid, k, None, float(thinks[k_think]), max(new, 1),
                             max(out, 1), text=txt, meta=meta)
                    k_think += 1
                turns.append(t)
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()
    rep.facts.update({"conversations": len(convs), "sessions": len(convs), "turns": len(turns),
                      "conversations_opening_with_an_answer": leading,
                      "conversations_ending_with_an_unanswered_message": trailing})
    if arr is None:
        rep.notes.append(f"arrivals are not in the data: seeded Poisson sessions at {rate:g}/s (seed {seed}), think "
                         f"time {think}")
    else:
        rep.facts["timestamp_span_s"] = round(float(arr.max()), 3)
        rep.notes.append(f"arrivals: each conversation's timestamp ({how}), from the earliest (span "
                         f"{float(arr.max()):.6g} s); later turns: think time {think} (seed {seed}), not in the data")
    rep.notes.append("token counts: ChatML rendering encoded with the SmolLM2 GGUF tokenizer")
    return Trace(turns, f"sharegpt:{p}")
