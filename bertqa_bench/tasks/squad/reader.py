"""SQuAD v1.1 and v2.0 files: strict reading, the Hugging Face hub, and atomic writing.

Reading is all-or-nothing: the whole file is validated before any example is returned,
and every problem is reported as a DatasetFormatError that names the file, the record
(``data[3].paragraphs[1].qas[0] (id '5733be28')``) and the field, so a user can fix the
file without a debugger.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Union

from ...errors import DatasetFormatError, MissingDependencyError
from ...io import atomic_write_text
from .types import Answer, QAExample

SQUAD_VERSION = "1.1"
SQUAD_V2_VERSION = "v2.0"  # as the official v2.0 files spell it


def read_json(path, **json_kwargs) -> Any:
    """Parse a JSON file, turning decode errors into DatasetFormatError with line and column."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DatasetFormatError(path, "<file>", "<encoding>", f"not UTF-8 text: {e}") from None
    return parse_json_text(text, path, **json_kwargs)


def parse_json_text(text: str, path, **json_kwargs) -> Any:
    """``json.loads`` whose every failure is a DatasetFormatError naming ``path``.

    Besides syntax errors, json.loads raises RecursionError on deeply nested arrays/objects and
    ValueError on integers longer than Python's int-conversion limit (4300 digits); both are
    malformed input, not bugs.
    """
    try:
        return json.loads(text, **json_kwargs)
    except json.JSONDecodeError as e:
        raise DatasetFormatError(path, "<file>", "<json>",
                                 f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise DatasetFormatError(path, "<file>", "<json>", "not usable JSON: nested too deeply") from None
    except ValueError as e:  # e.g. "Exceeds the limit (4300 digits) for integer string conversion"
        raise DatasetFormatError(path, "<file>", "<json>", f"not usable JSON: {e}") from None


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def _get(obj: dict, key: str, kind: type, path, record: str):
    if key not in obj:
        raise DatasetFormatError(path, record, key, "missing")
    value = obj[key]
    # bool is an int subclass; an answer_start of true is a bug, not an offset.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise DatasetFormatError(path, record, key, f"expected {kind.__name__}, got {_type_name(value)}")
    return value


def _as_object(value, path, record: str, field: str) -> dict:
    if not isinstance(value, dict):
        raise DatasetFormatError(path, record, field, f"expected an object, got {_type_name(value)}")
    return value


def check_answer(context: str, text: str, start: int, path, record: str) -> None:
    """The answer must be the exact context slice at answer_start (what featurization relies on)."""
    if not text:
        raise DatasetFormatError(path, record, "text", "empty answer text")
    if not 0 <= start <= len(context) - len(text):
        raise DatasetFormatError(path, record, "answer_start",
                                 f"{start} is out of range for a {len(text)}-character answer "
                                 f"in a {len(context)}-character context")
    found = context[start:start + len(text)]
    if found != text:
        raise DatasetFormatError(path, record, "answer_start",
                                 f"context[{start}:{start + len(text)}] is {found!r}, not the answer text {text!r}")


def is_v2(obj: Any) -> bool:
    """A SQuAD v2.0 file: its version says so, or a question carries ``is_impossible``."""
    if not isinstance(obj, dict):
        return False
    if str(obj.get("version", "")).lstrip("v").startswith("2"):
        return True
    try:
        return any("is_impossible" in qa for a in obj["data"] for p in a["paragraphs"] for qa in p["qas"])
    except (KeyError, TypeError, AttributeError):
        return False


def _answers(raw, context: str, path, rec_q: str, field_name: str) -> tuple[Answer, ...]:
    out = []
    for k, ans in enumerate(raw):
        rec_k = f"{rec_q}.{field_name}[{k}]"
        ans = _as_object(ans, path, rec_k, "<answer>")
        text = _get(ans, "text", str, path, rec_k)
        start = _get(ans, "answer_start", int, path, rec_k)
        check_answer(context, text, start, path, rec_k)
        out.append(Answer(text=text, answer_start=start))
    return tuple(out)


def validate_squad(obj: Any, path) -> list[QAExample]:
    """Validate a parsed SQuAD v1.1 or v2.0 dict and turn it into examples, in file order.

    v2.0 (``version: v2.0``, or any ``is_impossible`` key): an unanswerable question has
    ``is_impossible: true``, no answers, and optional ``plausible_answers`` (checked like answers);
    an answerable one needs answers as in v1.1."""
    top = _as_object(obj, path, "<top level>", "<root>")
    articles = _get(top, "data", list, path, "<top level>")
    v2 = is_v2(top)
    examples: list[QAExample] = []
    seen: dict[str, str] = {}
    for a, article in enumerate(articles):
        rec_a = f"data[{a}]"
        article = _as_object(article, path, rec_a, "<article>")
        title = article.get("title", "")
        if not isinstance(title, str):
            raise DatasetFormatError(path, rec_a, "title", f"expected str, got {_type_name(title)}")
        for p, paragraph in enumerate(_get(article, "paragraphs", list, path, rec_a)):
            rec_p = f"{rec_a}.paragraphs[{p}]"
            paragraph = _as_object(paragraph, path, rec_p, "<paragraph>")
            context = _get(paragraph, "context", str, path, rec_p)
            for q, qa in enumerate(_get(paragraph, "qas", list, path, rec_p)):
                rec_q = f"{rec_p}.qas[{q}]"
                qa = _as_object(qa, path, rec_q, "<qa>")
                qid = _get(qa, "id", str, path, rec_q)
                if not qid:
                    raise DatasetFormatError(path, rec_q, "id", "empty question id")
                rec_q = f"{rec_q} (id '{qid}')"
                if qid in seen:
                    raise DatasetFormatError(path, rec_q, "id", f"duplicate id, first used at {seen[qid]}")
                seen[qid] = rec_q
                question = _get(qa, "question", str, path, rec_q)
                impossible = qa.get("is_impossible", False)
                if not isinstance(impossible, bool):
                    raise DatasetFormatError(path, rec_q, "is_impossible", f"expected bool, got {_type_name(impossible)}")
                raw_answers = _get(qa, "answers", list, path, rec_q)
                if impossible and raw_answers:
                    raise DatasetFormatError(path, rec_q, "answers",
                                             "an unanswerable question (is_impossible: true) has no answers; "
                                             "the spans it suggests go in plausible_answers")
                if not impossible and not raw_answers:
                    raise DatasetFormatError(path, rec_q, "answers",
                                             "an answerable question needs at least one answer (SQuAD v2.0 marks "
                                             "an unanswerable one with is_impossible: true)" if v2 else
                                             "SQuAD v1.1 needs at least one answer")
                answers = _answers(raw_answers, context, path, rec_q, "answers")
                plausible: tuple[Answer, ...] = ()
                if "plausible_answers" in qa:
                    plausible = _answers(_get(qa, "plausible_answers", list, path, rec_q), context, path, rec_q,
                                         "plausible_answers")
                examples.append(QAExample(id=qid, question=question, context=context, answers=answers, title=title,
                                          is_impossible=impossible, plausible_answers=plausible, version_2=v2))
    return examples


def load_squad_json(path) -> list[QAExample]:
    """Read and fully validate an official-format SQuAD v1.1 file."""
    return validate_squad(read_json(path), path)


def load_squad_hf(name: str = "squad", split: str = "validation") -> list[QAExample]:
    """SQuAD-format rows from the Hugging Face hub (``datasets.load_dataset(name, split=split)``)."""
    try:
        import datasets
    except ImportError:
        raise MissingDependencyError("datasets", "loading SQuAD from the Hugging Face hub") from None
    rows = datasets.load_dataset(name, split=split)
    where = f"hf:{name}[{split}]"
    examples: list[QAExample] = []
    seen: set[str] = set()
    for i, row in enumerate(rows):
        qid = str(row["id"])
        rec = f"row {i} (id '{qid}')"
        if qid in seen:
            raise DatasetFormatError(where, rec, "id", "duplicate id")
        seen.add(qid)
        texts, starts = row["answers"]["text"], row["answers"]["answer_start"]
        # squad_v2 on the hub marks an unanswerable question by an empty answer list
        v2 = name.endswith("_v2") or "v2" in name.split("/")[-1]
        if (not texts and not v2) or len(texts) != len(starts):
            raise DatasetFormatError(where, rec, "answers", "need at least one answer and one answer_start per text"
                                     + ("" if v2 else " (unanswerable questions: use a SQuAD v2.0 dataset, e.g. squad_v2)"))
        for k, (text, start) in enumerate(zip(texts, starts)):
            check_answer(row["context"], text, int(start), where, f"{rec}.answers[{k}]")
        examples.append(QAExample(id=qid, question=row["question"], context=row["context"],
                                  answers=tuple(Answer(t, int(s)) for t, s in zip(texts, starts)),
                                  title=row.get("title") or "", is_impossible=not texts, version_2=v2))
    return examples


def examples_to_squad_json(examples: Iterable[QAExample]) -> dict:
    """Official-format dict: articles grouped by title, paragraphs by context, in first-seen order."""
    articles: dict[str, dict[str, list]] = {}
    v2 = False
    for ex in examples:
        qas = articles.setdefault(ex.title, {}).setdefault(ex.context, [])
        qa = {"id": ex.id, "question": ex.question,
              "answers": [{"text": a.text, "answer_start": a.answer_start} for a in ex.answers]}
        if ex.version_2 or ex.is_impossible:
            v2 = True
            qa["is_impossible"] = ex.is_impossible
            if ex.plausible_answers:
                qa["plausible_answers"] = [{"text": a.text, "answer_start": a.answer_start}
                                           for a in ex.plausible_answers]
        qas.append(qa)
    return {"version": SQUAD_V2_VERSION if v2 else SQUAD_VERSION,
            "data": [{"title": title, "paragraphs": [{"context": c, "qas": qas} for c, qas in paragraphs.items()]}
                     for title, paragraphs in articles.items()]}


def write_json_atomic(obj: Any, path) -> Path:
    """Write JSON so readers see either the old file or the whole new one, never a torn write."""
    return atomic_write_text(path, json.dumps(obj, ensure_ascii=False))


def write_squad_json(examples_or_dict: Union[dict, Iterable[QAExample]], path) -> Path:
    obj = examples_or_dict if isinstance(examples_or_dict, dict) else examples_to_squad_json(examples_or_dict)
    return write_json_atomic(obj, path)
