"""Seeded offline generator of simplified-NQ files (no download, same bytes for the same config).

Each document is a Wikipedia-like page about one made-up organisation: ``<H1>`` title, an
infobox ``<Table>`` (nested ``<Tr>`` candidates), ``<P>`` paragraphs holding fact sentences
among filler, a ``<Ul>`` list (nested ``<Li>`` candidates). Questions paraphrase one fact
sentence ("X was founded in 1923 ." -> "what year was x founded"), so a small pretrained
encoder learns them in minutes. Answer kinds: short span in a paragraph, short span in a
table cell, YES/NO, long-only (a "why" paragraph, the list), and null (the asked fact is
absent from the page; some pages state it about a neighbouring organisation instead).

Train examples carry 1 clean annotation; dev examples carry 5 with realistic disagreement:
an annotator may miss the answer (null), drop the short answer, widen the span by a word,
choose the ``<Tr>`` row instead of the whole table, skip the YES/NO, or mark a spurious long
answer on an unanswerable question (which the >=2-annotator rule then outvotes).

SyntheticConfig mapping: ``n_*_contexts`` = documents, ``questions_per_context`` = questions
(examples) per document, ``min/mean/max_words`` = text words per document (HTML tags not
counted), ``long_context_fraction`` = share of documents made 3x ``max_words`` long.
"""
from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import numpy as np

from ...config import SyntheticConfig
from ...io import atomic_write_bytes

GENERATOR_VERSION = 1
TRAIN_NAME, DEV_NAME = "nq-train.jsonl.gz", "nq-dev.jsonl"
N_DEV_ANNOTATORS = 5

_SYL = ["ka", "lor", "ven", "mi", "dra", "tho", "sel", "rin", "bar", "qua", "zel", "om", "pa", "ter", "nis",
        "gal", "fe", "ru", "dor", "lim", "sa", "vik", "mon", "tal", "bre", "hu", "cas", "len", "or", "wey"]
_KINDS = ["museum", "company", "university", "orchestra", "library", "brewery", "observatory", "society"]
_FIRST = ["anna", "boris", "clara", "david", "elena", "felix", "greta", "hugo", "irene", "jonas", "karla", "leon",
          "marta", "nils", "olga", "peter", "rosa", "simon", "tessa", "victor"]
_PROFESSIONS = ["teacher", "merchant", "engineer", "painter", "doctor", "farmer", "banker", "sailor"]
_PRODUCTS = ["glass sculptures", "river maps", "wool blankets", "steam engines", "folk songs", "rare orchids",
             "mountain bicycles", "printed calendars", "silver coins", "wooden toys", "star charts", "herbal teas"]
_COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "grey", "white"]
_DEPTS = ["archives", "education", "research", "finance", "outreach", "design", "logistics", "publishing"]
_ADJ = ["quiet", "busy", "old", "modern", "narrow", "bright", "famous", "small", "large", "popular"]
_NOUNS = ["garden", "bridge", "market", "square", "harbour", "station", "chapel", "park", "theatre", "canal"]
_SEASONS = ["spring", "summer", "autumn", "winter"]
_FILLER = [
    "the {a} {n} near the {n2} attracts many visitors in {s} .",
    "local residents often describe the {n} as {a} and {a2} .",
    "a {a} {n} was built next to the {n2} during the same period .",
    "several {a} events take place around the {n} every {s} .",
    "visitors can walk from the {n} to the {a} {n2} in a few minutes .",
    "the surrounding area is known for its {a} {n} and its {n2} .",
]
# question kinds and their share of examples
_KIND_P = {"short": 0.42, "table": 0.10, "yesno": 0.12, "long": 0.11, "null": 0.25}


def _name(rng, n_syl) -> str:
    return "".join(_SYL[i] for i in rng.integers(0, len(_SYL), n_syl)).capitalize()


class _Doc:
    """Token list + long-answer candidates, built in document order."""

    def __init__(self):
        self.tokens: list[str] = []
        self.cands: list[dict] = []

    def open(self, tag: str, candidate: bool = True, top_level: bool = True):
        self.tokens.append(f"<{tag}>")
        if not candidate:
            return None
        self.cands.append({"start_token": len(self.tokens) - 1, "end_token": -1, "top_level": top_level})
        return len(self.cands) - 1

    def close(self, tag: str, idx=None):
        self.tokens.append(f"</{tag}>")
        if idx is not None:
            self.cands[idx]["end_token"] = len(self.tokens)

    def words(self, text: str) -> tuple[int, int]:
        ws = text.split()
        start = len(self.tokens)
        self.tokens.extend(ws)
        return start, len(self.tokens)

    def n_words(self) -> int:
        return sum(1 for t in self.tokens if not t.startswith("<"))


def _filler(rng) -> str:
    t = _FILLER[rng.integers(len(_FILLER))]
    a, a2 = rng.choice(_ADJ, 2, replace=False)
    n, n2 = rng.choice(_NOUNS, 2, replace=False)
    return t.format(a=a, a2=a2, n=n, n2=n2, s=_SEASONS[rng.integers(4)])


def _facts(rng, name: str) -> dict:
    """Fact sentences as (before, answer, after) plus question paraphrases."""
    city, other_city = _name(rng, 2), _name(rng, 2)
    year = str(int(rng.integers(1820, 2015)))
    person = f"{_FIRST[rng.integers(len(_FIRST))]} {_name(rng, 2)}".title()
    num = str(int(rng.integers(12, 9000)))
    product = _PRODUCTS[rng.integers(len(_PRODUCTS))]
    colour, other_colour = rng.choice(_COLOURS, 2, replace=False)
    prof = _PROFESSIONS[rng.integers(len(_PROFESSIONS))]
    n = name.lower()
    return {
        "founded": dict(sent=(f"{name} was founded in", year, "."), widen="in",
                        q=[f"when was {n} founded", f"what year was {n} founded", f"in which year did {n} open"]),
        "founder": dict(sent=(f"{name} was established by", person, f", a {prof} from {other_city} ."), widen="by",
                        q=[f"who established {n}", f"who was the founder of {n}", f"who started {n}"]),
        "city": dict(sent=(f"the headquarters of {name} are located in", city, "."), widen="in",
                     q=[f"where is {n} headquartered", f"in which city is {n} based"],
                     yes=f"is {n} based in {city.lower()}", no=f"is {n} based in {other_city.lower()}"),
        "staff": dict(sent=(f"{name} employs about", num, "people ."), widen="about",
                      q=[f"how many people work at {n}", f"how many employees does {n} have"]),
        "known": dict(sent=(f"{name} is best known for its", product, "."), widen="its",
                      q=[f"what is {n} famous for", f"what is {n} best known for"]),
        "colour": dict(sent=(f"the official colour of {name} is", colour, "."), widen="is",
                       q=[f"what is the official colour of {n}", f"which colour represents {n}"],
                       yes=f"is {colour} the official colour of {n}", no=f"is {other_colour} the official colour of {n}"),
    }


def _table_rows(rng) -> dict:
    return {
        "Director": (f"{_FIRST[rng.integers(len(_FIRST))]} {_name(rng, 2)}".title(), ["who is the director of {n}", "who leads {n}"]),
        "Members": (str(int(rng.integers(100, 50000))), ["how many members does {n} have"]),
        "Region": (_name(rng, 3), ["in what region is {n}", "which region is {n} in"]),
        "Budget": (f"{int(rng.integers(2, 900))} million", ["what is the budget of {n}", "how big is the budget of {n}"]),
    }


def _make_document(rng, cfg: SyntheticConfig, n_questions: int, used_names: set) -> dict:
    """One document and its questions -> records (without annotations noise applied). The stages
    draw from ``rng`` in a fixed order: the generated set (and the expected scores) depend on it."""
    while True:
        name = _name(rng, int(rng.integers(2, 4)))
        if name not in used_names:
            used_names.add(name)
            break
    kind = _KINDS[rng.integers(len(_KINDS))]
    title = f"{name} {kind.capitalize()}"
    facts = _facts(rng, title)
    rows = _table_rows(rng)
    depts = list(rng.choice(_DEPTS, int(rng.integers(3, 6)), replace=False))
    plan, omitted = _question_plan(rng, facts, rows, n_questions)
    target = int(np.clip(rng.triangular(cfg.min_words, cfg.mean_words, cfg.max_words) if cfg.min_words < cfg.max_words
                         else cfg.mean_words, cfg.min_words, cfg.max_words))
    if rng.random() < cfg.long_context_fraction:
        target = 3 * cfg.max_words
    doc, spans = _write_document(rng, title, kind, facts, rows, omitted, depts, target)
    records = [_question(rng, k, key, facts, rows, spans, title.lower()) for k, key in plan]
    return dict(title=title, tokens=doc.tokens, cands=doc.cands, records=records)


def _question_plan(rng, facts: dict, rows: dict, n_questions: int) -> tuple[list, set]:
    """(question kind, fact key or table row) for each question asked of the page, and the facts
    the page leaves out (the null questions' and some unasked ones)."""
    kinds = list(_KIND_P)
    probs = np.array([_KIND_P[k] for k in kinds])
    plan = []
    free_facts = list(facts)
    rng.shuffle(free_facts)
    free_rows = list(rows)
    rng.shuffle(free_rows)
    long_targets = ["why", "list"]
    rng.shuffle(long_targets)
    omitted = set()
    for _ in range(n_questions):
        k = kinds[rng.choice(len(kinds), p=probs)]
        yes_no_keys = [f for f in free_facts if "yes" in facts[f]]
        if (k == "yesno" and not yes_no_keys or k == "table" and not free_rows
                or k == "long" and not long_targets):
            k = "short"
        if k in ("short", "null") and not free_facts:
            k = "table" if free_rows else "long" if long_targets else None
        if k is None:
            break  # more questions asked of one page than it has facts
        if k == "table":
            plan.append((k, free_rows.pop()))
        elif k == "long":
            plan.append((k, long_targets.pop()))
        else:
            key = yes_no_keys[0] if k == "yesno" else free_facts[-1]
            free_facts.remove(key)
            plan.append((k, key))
            if k == "null":
                omitted.add(key)
    # Some unasked facts are absent too, so "absent" does not mean "asked about".
    for f in list(free_facts):
        if rng.random() < 0.2:
            omitted.add(f)
    return plan, omitted


def _write_document(rng, title: str, kind: str, facts: dict, rows: dict, omitted: set, depts: list,
                    target: int) -> tuple:
    """The page: a title, the infobox table, fact paragraphs with filler (and decoys about a
    neighbouring organisation), the "why" paragraph, the departments list, filler up to
    ``target`` words. Returns (the document, where each answer is)."""
    # Paragraph contents: fact sentences scattered over paragraphs, filler around them.
    fact_keys = [f for f in facts if f not in omitted]
    rng.shuffle(fact_keys)
    n_paras = max(2, len(fact_keys) // 2 + 1)
    para_facts = [[] for _ in range(n_paras)]
    for f in fact_keys:
        para_facts[int(rng.integers(n_paras))].append(f)
    # Hard negatives: an absent fact sometimes appears about a neighbouring organisation.
    neighbour = f"{_name(rng, 2)} {kind.capitalize()}"
    # sorted: a set of strings iterates in an order that changes with each process's hash seed
    decoys = [f for f in sorted(omitted) if rng.random() < 0.3]
    decoy_facts = _facts(rng, neighbour)
    doc = _Doc()
    doc.open("H1", candidate=False)
    doc.words(title)
    doc.close("H1")
    spans = {}  # fact key / row name -> dict(answer=(s,e), cand=index, row=index, widen=(s,e))
    _write_table(rng, doc, rows, spans)
    intro = [f"{title} is a {kind} in {rows['Region'][0]} ."]
    for i, keys in enumerate(para_facts):
        items = (intro if i == 0 else []) + ([_filler(rng)] if rng.random() < 0.5 else [])
        for f in keys:
            items.append((f, facts[f]))
            if rng.random() < 0.3:
                items.append(_filler(rng))
        for f in decoys if i == n_paras - 1 else []:
            items.append((None, decoy_facts[f]))
        if not items:
            items.append(_filler(rng))
        _paragraph(doc, spans, items)
        if i == 0:
            doc.open("H2", candidate=False)
            doc.words("History")
            doc.close("H2")
    why_year = str(int(rng.integers(1950, 2020)))
    spans["why"] = dict(cand=_paragraph(doc, spans, [
        f"in {why_year} {title} moved to a new building because the old site near the "
        f"{_NOUNS[rng.integers(len(_NOUNS))]} had become too small .",
        f"the move was paid for by a public fund and took {int(rng.integers(2, 9))} years ."]))
    doc.open("H2", candidate=False)
    doc.words("Departments")
    doc.close("H2")
    ul = doc.open("Ul")
    for d in depts:
        li = doc.open("Li", top_level=False)
        doc.words(f"{d} department")
        doc.close("Li", li)
    doc.close("Ul", ul)
    spans["list"] = dict(cand=ul)
    while doc.n_words() < target:
        _paragraph(doc, spans, [_filler(rng) for _ in range(int(rng.integers(2, 5)))])
    return doc, spans


def _write_table(rng, doc, rows: dict, spans: dict) -> None:
    t_idx = doc.open("Table")
    row_keys = list(rows)
    rng.shuffle(row_keys)
    for rk in row_keys:
        r_idx = doc.open("Tr", top_level=False)
        doc.open("Th", candidate=False)
        doc.words(rk)
        doc.close("Th")
        doc.open("Td", candidate=False)
        ans = doc.words(rows[rk][0])
        doc.close("Td")
        doc.close("Tr", r_idx)
        spans[rk] = dict(answer=ans, cand=t_idx, row=r_idx)
    doc.close("Table", t_idx)


def _paragraph(doc, spans: dict, sentences_and_facts) -> int:
    """A paragraph of filler sentences and (fact key, fact) items; each fact's answer span noted."""
    p_idx = doc.open("P")
    for item in sentences_and_facts:
        if isinstance(item, str):
            doc.words(item)
        else:
            key, fact = item
            before, answer, after = fact["sent"]
            s0 = doc.words(before)
            ans = doc.words(answer)
            doc.words(after)
            if key is not None:
                spans[key] = dict(answer=ans, cand=p_idx, widen=(ans[0] - 1, ans[1]))
                assert doc.tokens[ans[0] - 1] == fact["widen"] and s0[1] == ans[0]
    doc.close("P", p_idx)
    return p_idx


def _question(rng, k: str, key: str, facts: dict, rows: dict, spans: dict, n: str) -> dict:
    """One planned question and its truth (kind, long candidate, short span)."""
    if k == "table":
        q = rows[key][1][rng.integers(len(rows[key][1]))].format(n=n)
        truth = dict(kind="short", long=spans[key]["cand"], short=spans[key]["answer"], row=spans[key]["row"])
    elif k == "long":
        q = {"why": f"why did {n} move to a new building", "list": f"what departments does {n} have"}[key]
        truth = dict(kind="long", long=spans[key]["cand"])
    elif k == "yesno":
        is_yes = rng.random() < 0.5
        q = facts[key]["yes"] if is_yes else facts[key]["no"]
        truth = dict(kind="YES" if is_yes else "NO", long=spans[key]["cand"])
    elif k == "short":
        qs = facts[key]["q"]
        q = qs[rng.integers(len(qs))]
        truth = dict(kind="short", long=spans[key]["cand"], short=spans[key]["answer"], widen=spans[key]["widen"])
    else:
        qs = facts[key]["q"]
        q = qs[rng.integers(len(qs))]
        truth = dict(kind="null")
    return dict(question=q, truth=truth)


def _annotation(doc, truth, rng, noisy: bool) -> dict:
    cands = doc["cands"]

    def ann(long_idx=None, shorts=(), yes_no="NONE"):
        if long_idx is None:
            la = {"start_token": -1, "end_token": -1, "candidate_index": -1}
        else:
            c = cands[long_idx]
            la = {"start_token": c["start_token"], "end_token": c["end_token"], "candidate_index": long_idx}
        return {"long_answer": la, "short_answers": [{"start_token": s, "end_token": e} for s, e in shorts],
                "yes_no_answer": yes_no}

    kind = truth["kind"]
    if not noisy:
        if kind == "null":
            return ann()
        if kind in ("YES", "NO"):
            return ann(truth["long"], yes_no=kind)
        return ann(truth["long"], [truth["short"]] if "short" in truth else [])
    u = rng.random()
    if kind == "null":
        if u < 0.15:  # a spurious long answer: outvoted by the >=2 rule
            return ann(int(rng.integers(len(cands))))
        return ann()
    if u < 0.12:
        return ann()  # annotator missed the answer
    if kind in ("YES", "NO"):
        return ann(truth["long"]) if rng.random() < 0.15 else ann(truth["long"], yes_no=kind)
    if "short" not in truth:
        return ann(truth["long"])
    long_idx = truth.get("row", truth["long"]) if "row" in truth and rng.random() < 0.3 else truth["long"]
    v = rng.random()
    if v < 0.1:
        return ann(long_idx)  # long answer only
    if v < 0.2 and "widen" in truth:
        return ann(long_idx, [truth["widen"]])  # "in 1923" instead of "1923"
    return ann(long_idx, [truth["short"]])


def generate_split(cfg: SyntheticConfig, split: str) -> list[dict]:
    """Records (dicts in simplified-NQ form) of one split; same cfg + split -> same records."""
    n_docs = cfg.n_train_contexts if split == "train" else cfg.n_dev_contexts
    rng = np.random.default_rng([cfg.seed, 0 if split == "train" else 1])
    used_names: set = set()
    used_ids: set = set()
    out = []
    for _ in range(n_docs):
        doc = _make_document(rng, cfg, cfg.questions_per_context, used_names)
        text = " ".join(doc["tokens"])
        cands = [dict(c) for c in doc["cands"]]
        for rec in doc["records"]:
            while True:
                ex_id = int(rng.integers(-(2 ** 62), 2 ** 62))
                if ex_id not in used_ids:
                    used_ids.add(ex_id)
                    break
            if split == "train":
                anns = [_annotation(doc, rec["truth"], rng, noisy=False)]
            else:
                anns = [_annotation(doc, rec["truth"], rng, noisy=True) for _ in range(N_DEV_ANNOTATORS)]
            out.append({
                "example_id": ex_id,
                "question_text": rec["question"],
                "document_text": text,
                "document_url": "https://en.wikipedia.org/wiki/" + doc["title"].replace(" ", "_"),
                "long_answer_candidates": cands,
                "annotations": anns,
            })
    return out


def config_hash(cfg: SyntheticConfig) -> str:
    payload = json.dumps({"generator": GENERATOR_VERSION, **cfg.identity()}, sort_keys=True)
    return hashlib.sha1(payload.encode()).hexdigest()[:10]


def _write_atomic(path: Path, records: list[dict], compress: bool) -> None:
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    if compress:
        # mtime=0 and no file name in the header: the same config gives byte-identical files.
        data = gzip.compress(data, compresslevel=6, mtime=0)
    atomic_write_bytes(path, data)  # readers never see a half-written file


def ensure_nq_files(data_dir: Path, cfg: SyntheticConfig) -> tuple[Path, Path]:
    """``data_dir/nq-synthetic-<hash>/{nq-train.jsonl.gz, nq-dev.jsonl}``, generated if absent."""
    out = Path(data_dir) / f"nq-synthetic-{config_hash(cfg)}"
    out.mkdir(parents=True, exist_ok=True)
    train, dev = out / TRAIN_NAME, out / DEV_NAME
    if not dev.exists():
        _write_atomic(dev, generate_split(cfg, "dev"), compress=False)
    if not train.exists():
        _write_atomic(train, generate_split(cfg, "train"), compress=True)
    return train, dev
