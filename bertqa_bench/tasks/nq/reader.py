"""Reader for Natural Questions in the *simplified* jsonl format (plain or gzip).

One JSON object per line: ``example_id``, ``question_text``, ``document_text`` (space-separated
tokens, HTML tags included), ``long_answer_candidates`` and, for train/dev, ``annotations``.
Token offsets are end-exclusive indices into ``document_text.split(" ")``.

Reading is all-or-nothing: the first malformed line raises a DatasetFormatError naming the
file, the line and the field, and nothing is returned — a half-read dev set would silently
change every score.
"""
from __future__ import annotations

import gzip
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Union

from ...errors import DatasetFormatError

YES_NO_VALUES = ("NONE", "YES", "NO")


@dataclass(frozen=True)
class Candidate:
    start_token: int
    end_token: int  # exclusive
    top_level: bool


@dataclass(frozen=True)
class Annotation:
    """One annotator's answer; a null long answer has candidate_index -1 and span (-1, -1)."""

    long_start: int = -1
    long_end: int = -1
    candidate_index: int = -1
    short_answers: tuple[tuple[int, int], ...] = ()
    yes_no_answer: str = "NONE"

    @property
    def has_long(self) -> bool:
        return self.long_start >= 0

    @property
    def has_short(self) -> bool:
        # The official metric counts a YES/NO as a (non-span) short answer.
        return bool(self.short_answers) or self.yes_no_answer != "NONE"


@dataclass(frozen=True)
class NQExample:
    example_id: Union[int, str]  # kept as given so predictions echo the gold file's type
    question: str
    document_tokens: tuple[str, ...]
    candidates: tuple[Candidate, ...]
    annotations: tuple[Annotation, ...] = ()

    @property
    def key(self) -> str:
        """Join key between gold and predictions (ints and their string forms match)."""
        return str(self.example_id)

    # SQuAD-like alias so generic runner code (logging, agreement) can use .id
    @property
    def id(self) -> str:
        return self.key


def is_html_token(token: str) -> bool:
    return len(token) > 2 and token[0] == "<" and token[-1] == ">"


def _open_lines(path: Path) -> Iterator[str]:
    with open(path, "rb") as fh:
        magic = fh.read(2)
    # Sniff gzip by magic bytes, not by suffix: downloads are often renamed.
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, "r", encoding="utf-8")


class _LineChecker:
    """Field validation for one line; every failure names the JSON path of the field."""

    def __init__(self, path: Path, line_no: int):
        self.path, self.record = path, f"line {line_no}"

    def fail(self, field: str, reason: str):
        raise DatasetFormatError(self.path, self.record, field, reason)

    def get(self, obj: dict, key: str, where: str, *, optional=False):
        if key not in obj:
            if optional:
                return None
            self.fail(f"{where}.{key}" if where else key, "missing")
        return obj[key]

    def int_(self, obj: dict, key: str, where: str) -> int:
        name = f"{where}.{key}" if where else key
        if key not in obj:
            self.fail(name, "missing")
        v = obj[key]
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(name, f"must be an integer, got {type(v).__name__} {v!r:.40}")
        return v

    def list_(self, obj: dict, key: str, where: str = "", *, optional=False) -> Optional[list]:
        name = f"{where}.{key}" if where else key
        if key not in obj:
            if optional:
                return None
            self.fail(name, "missing")
        v = obj[key]
        if not isinstance(v, list):
            self.fail(name, f"must be a list, got {type(v).__name__}")
        return v

    def obj(self, v, name: str) -> dict:
        if not isinstance(v, dict):
            self.fail(name, f"must be an object, got {type(v).__name__}")
        return v

    def span(self, obj: dict, where: str, n_tokens: int, *, allow_null: bool) -> tuple[int, int]:
        s, e = self.int_(obj, "start_token", where), self.int_(obj, "end_token", where)
        if allow_null and s == -1 and e == -1:
            return -1, -1
        if not 0 <= s < e <= n_tokens:
            self.fail(f"{where}.end_token" if 0 <= s < n_tokens else f"{where}.start_token",
                      f"span [{s}, {e}) is not a non-empty range inside document_text's {n_tokens} tokens"
                      + (" (a null span is start_token=end_token=-1)" if allow_null else ""))
        return s, e


def parse_line(line: str, path: Path, line_no: int) -> NQExample:
    ck = _LineChecker(path, line_no)
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        ck.fail("(json)", f"not valid JSON: {e.msg} at column {e.colno}")
    except RecursionError:  # json.loads' answer to deeply nested arrays/objects
        ck.fail("(json)", "not usable JSON: nested too deeply")
    except ValueError as e:  # integers past Python's 4300-digit conversion limit
        ck.fail("(json)", f"not usable JSON: {e}")
    ck.obj(rec, "(json)")

    if "example_id" not in rec:
        ck.fail("example_id", "missing")
    ex_id = rec["example_id"]
    if isinstance(ex_id, bool) or not isinstance(ex_id, (int, str)) or ex_id == "":
        ck.fail("example_id", f"must be an integer or a non-empty string, got {ex_id!r:.40}")

    question = ck.get(rec, "question_text", "")
    if not isinstance(question, str) or not question.strip():
        ck.fail("question_text", "must be a non-empty string")
    doc = ck.get(rec, "document_text", "")
    if not isinstance(doc, str) or not doc.strip():
        ck.fail("document_text", "must be a non-empty string")
    tokens = tuple(doc.split(" "))
    n = len(tokens)

    cands = []
    for i, c in enumerate(ck.list_(rec, "long_answer_candidates")):
        where = f"long_answer_candidates[{i}]"
        ck.obj(c, where)
        s, e = ck.span(c, where, n, allow_null=False)
        top = c.get("top_level", True)
        if not isinstance(top, bool):
            ck.fail(f"{where}.top_level", f"must be true or false, got {top!r:.20}")
        cands.append(Candidate(s, e, top))

    annotations = []
    raw_ann = ck.list_(rec, "annotations", optional=True)
    for i, a in enumerate(raw_ann or []):
        where = f"annotations[{i}]"
        ck.obj(a, where)
        la = ck.obj(ck.get(a, "long_answer", where), f"{where}.long_answer")
        ls, le = ck.span(la, f"{where}.long_answer", n, allow_null=True)
        ci = ck.int_(la, "candidate_index", f"{where}.long_answer")
        if ls < 0:
            if ci != -1:
                ck.fail(f"{where}.long_answer.candidate_index", f"is {ci} but the long answer span is null")
        else:
            if not 0 <= ci < len(cands):
                ck.fail(f"{where}.long_answer.candidate_index",
                        f"{ci} is not an index into the {len(cands)} long_answer_candidates")
            if (cands[ci].start_token, cands[ci].end_token) != (ls, le):
                ck.fail(f"{where}.long_answer",
                        f"span [{ls}, {le}) differs from candidate {ci}'s span "
                        f"[{cands[ci].start_token}, {cands[ci].end_token})")
        shorts = []
        for j, sa in enumerate(ck.list_(a, "short_answers", where)):
            sw = f"{where}.short_answers[{j}]"
            ck.obj(sa, sw)
            shorts.append(ck.span(sa, sw, n, allow_null=False))
        yn = a.get("yes_no_answer", "NONE")
        if not isinstance(yn, str) or yn.upper() not in YES_NO_VALUES:
            ck.fail(f"{where}.yes_no_answer", f"must be one of {', '.join(YES_NO_VALUES)}, got {yn!r:.20}")
        annotations.append(Annotation(ls, le, ci, tuple(shorts), yn.upper()))

    return NQExample(ex_id, question.strip(), tokens, tuple(cands), tuple(annotations))


def load_nq_jsonl(path: Union[str, Path], limit: Optional[int] = None) -> list[NQExample]:
    """Read a simplified-NQ jsonl(.gz). ``limit`` stops after that many examples (only those lines are checked)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"NQ file not found: {path}")
    examples: list[NQExample] = []
    seen: dict[str, int] = {}
    line_no = 0
    try:
        with _open_lines(path) as fh:
            for line_no, line in enumerate(fh, start=1):
                if limit is not None and len(examples) >= limit:
                    break
                if not line.strip():
                    continue  # blank lines (e.g. a trailing newline pair) carry no record
                ex = parse_line(line, path, line_no)
                if ex.key in seen:
                    raise DatasetFormatError(path, f"line {line_no}", "example_id",
                                             f"duplicate of line {seen[ex.key]} ({ex.example_id})")
                seen[ex.key] = line_no
                examples.append(ex)
    except (OSError, EOFError, zlib.error) as e:
        # gzip.BadGzipFile is an OSError; a truncated download ends in EOFError.
        raise DatasetFormatError(path, f"line {line_no + 1}", "(file)", f"corrupt or truncated file: {e}") from None
    except UnicodeDecodeError as e:
        raise DatasetFormatError(path, f"line {line_no + 1}", "(file)", f"not UTF-8: {e.reason}") from None
    if not examples:
        raise DatasetFormatError(path, "line 1", "(file)", "no examples in file")
    return examples
