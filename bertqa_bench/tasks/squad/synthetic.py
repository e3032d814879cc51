"""An offline, seeded SQuAD-v1.1-format dataset that a small encoder can learn.

Each context is a short encyclopaedia-style paragraph about several made-up entities of
mostly one kind (people, organisations, towns, rivers), so the same attribute types occur
several times in one paragraph: answering "Where was Marisa Okafor born?" needs matching
both the entity and the attribute. Filler sentences mention the same entities with
attributes of the same type ("Marisa Okafor later moved to Dranvik.") as distractors.
Questions paraphrase their evidence sentence lightly, answers are 1-4 word spans.

The hard preset (``synthetic.difficulty: hard``) makes the task about as hard for a
pretrained-derived BERT-base as SQuAD is for BERT-base (dev F1 in the high 80s, by the data, not
by under-training): entities get namesakes in the same paragraph ("Marisa Okafor" next to
"Tomas Okafor", "Telvik Press" next to "Telvik Shipyard") with facts of the same types; most
questions are worded away from their evidence ("Which year saw the birth of ..."); later facts
refer back ("she", "the press") more often; some gold spans take in the word before them
("in 1874", "about 4,000"), as SQuAD's annotators disagree on boundaries; and a share
``ambiguity`` of facts is contradicted by a second source ("Other records give 1881.") with
the gold answer being either claim — genuinely unanswerable from the text, the knob the preset
is calibrated with (F1 per setting: results/reference/).

Everything comes from ``random.Random(seed)`` and fixed word lists, so one config always
gives byte-identical files; ``GENERATOR_VERSION`` is part of the cache key and must be
bumped whenever the output for a given config changes (the standard preset's output has not
changed since version 1).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import re
from pathlib import Path
from typing import Callable, Iterable, Optional

from ...config import SyntheticConfig
from .reader import SQUAD_V2_VERSION, SQUAD_VERSION, write_json_atomic, write_squad_json

GENERATOR_VERSION = 1

# Contexts picked as "long" get this many words, enough for several 384-token windows.
LONG_WORDS = (350, 600)
# For long contexts one question always targets the deepest fact, which then lies past the
# first window (what doc_stride windowing exists for).

# -- vocabulary: made-up names from fixed syllables, so the set is varied but finite ---------------

_GIVEN_F = ("Marisa", "Ilse", "Lucia", "Dara", "Yara", "Edda", "Sanna", "Rhea", "Noor", "Alma", "Nadia",
            "Selma", "Livia", "Petra", "Greta", "Ines")
_GIVEN_M = ("Tomas", "Oren", "Kaveh", "Anselm", "Felix", "Bruno", "Ivo", "Milo", "Caspar", "Teodor", "Viggo",
            "Hugo", "Emil", "Jonas", "Aurel", "Matteo")
_GIVEN = _GIVEN_F + _GIVEN_M
_SURNAME_HEAD = ("Oka", "Bran", "Vel", "Mor", "Dun", "Kes", "Tal", "Har", "Lind", "Quor", "Sev", "Ash",
                 "Fen", "Gar", "Rud", "Wes", "Cor", "Pell", "Strand", "Ivar")
_SURNAME_TAIL = ("for", "dale", "ric", "stone", "wick", "berg", "mont", "ley", "ova", "sen", "ard", "hollow")
_PLACE_HEAD = ("Tel", "Dran", "Ost", "Ver", "Kal", "Mir", "Sol", "Brae", "Cas", "Lun", "Nor", "Pav", "Ruv",
               "Zel", "Hal", "Tor", "Ember", "Grim", "Ul", "Vas")
_PLACE_TAIL = ("uma", "vik", "ara", "mere", "ford", "ossa", "heim", "ino", "bury", "ava", "ton", "esk", "gard",
               "ora")
_OCCUPATIONS = ("glass engraver", "shipwright", "cartographer", "botanist", "clockmaker", "stonemason",
                "printer", "land surveyor", "physician", "architect", "weaver", "astronomer", "lawyer",
                "bookbinder", "organ builder", "painter", "chemist", "bridge engineer", "teacher", "sculptor")
_SUBJECTS = ("mathematics", "law", "botany", "medicine", "engineering", "history", "chemistry", "music",
             "theology", "philosophy", "geology", "architecture")
# organisation kind -> the noun that refers back to it ("the shipyard")
_ORG_KINDS = {"Trading Company": "company", "Shipyard": "shipyard", "Observatory": "observatory",
              "Press": "press", "Savings Bank": "bank", "Railway Company": "company",
              "Academy of Music": "academy", "Glassworks": "glassworks", "Brewery": "brewery",
              "Insurance Society": "society", "Mining Company": "company", "Museum": "museum"}
_PRODUCTS = ("copper lanterns", "river barges", "star charts", "pocket watches", "printed maps",
             "woollen cloth", "stained glass", "dark beer", "steam engines", "porcelain", "church bells",
             "rope")
_WATERS = ("Sea", "Bay", "Lagoon", "Gulf")
_RANGES = ("Mountains", "Hills", "Highlands")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
           "October", "November", "December")

# -- facts: evidence sentence variants and the questions each slot answers -----------------------
# Templates use {slot}s; the entity's own name is the slot named by its kind (P, G, C, V).


@dataclasses.dataclass(frozen=True)
class Fact:
    sentences: tuple[str, ...]
    questions: dict[str, tuple[str, ...]]  # answer slot -> question templates
    # Whether the sentences still read well with the entity's name replaced by a reference
    # ("she", "the shipyard"); facts whose answer is the name itself never use one.
    refs: bool = True
    # The hard preset's questions: worded away from the evidence sentence.
    paraphrases: dict = dataclasses.field(default_factory=dict)


PERSON_FACTS = (
    Fact(("{P} was born in {B} in {Y}.", "{P} was born in {Y} in the town of {B}.",
          "Born in {B} in {Y}, {P} grew up in a family of farmers."),
         {"B": ("Where was {P} born?", "In which town was {P} born?", "What is the birthplace of {P}?"),
          "Y": ("In what year was {P} born?", "When was {P} born?", "What year was {P} born in?")},
         paraphrases={"B": ("{P} came into the world in which town?", "What was the home town of {P} at birth?"),
                      "Y": ("{P} entered the world in what year?", "Which year saw the birth of {P}?")}),
    Fact(("{P} worked as {art} {O} for many years.", "{P} became a well-known {O}.",
          "By profession, {P} was {art} {O}."),
         {"O": ("What was the occupation of {P}?", "What did {P} work as?", "What was the profession of {P}?")},
         paraphrases={"O": ("How did {P} earn a living?", "What trade did {P} follow?")}),
    Fact(("{P} died in {D} at the age of {A}.", "{P} died at the age of {A} in {D}."),
         {"D": ("In what year did {P} die?", "When did {P} die?"),
          "A": ("At what age did {P} die?", "How old was {P} at the time of death?")},
         paraphrases={"D": ("In which year did {P} pass away?", "{P} passed away in what year?"),
                      "A": ("How many years did {P} live?", "What age did {P} reach?")}),
    Fact(("{P} married {S} in {M}.", "In {M}, {P} married {S}."),
         {"S": ("Who did {P} marry?", "Whom did {P} marry?"),
          "M": ("In what year did {P} marry {S}?", "When did {P} marry?")},
         paraphrases={"S": ("Who was the spouse of {P}?", "Who did {P} wed?"),
                      "M": ("In which year did {P} wed?", "When did the wedding of {P} take place?")}),
    Fact(("{P} studied {U} at the {UC}.", "At the {UC}, {P} studied {U}."),
         {"U": ("What did {P} study?", "Which subject did {P} study?"),
          "UC": ("At which university did {P} study?", "Where did {P} study {U}?")},
         paraphrases={"U": ("What was the field of {P} at university?", "Which discipline did {P} take up?"),
                      "UC": ("Which institution did {P} attend?", "Where was {P} educated?")}),
)
ORG_FACTS = (
    Fact(("The {G} was founded by {F} in {Y}.", "In {Y}, {F} founded the {G}.", "{F} established the {G} in {Y}."),
         {"F": ("Who founded the {G}?", "Who established the {G}?", "By whom was the {G} founded?"),
          "Y": ("When was the {G} founded?", "In what year was the {G} established?",
                "What year was the {G} founded in?")},
         paraphrases={"F": ("Who started the {G}?", "Who set up the {G}?"),
                      "Y": ("Since what year has the {G} existed?", "In which year did the {G} begin?")}),
    Fact(("The {G} is headquartered in {C}.", "The {G} has its headquarters in {C}."),
         {"C": ("Where is the {G} headquartered?", "In which city does the {G} have its headquarters?",
                "Where are the headquarters of the {G}?")},
         paraphrases={"C": ("Which city is home to the main office of the {G}?", "Where is the main office of the {G}?")}),
    Fact(("The {G} employs about {N} people.", "Today the {G} has roughly {N} employees."),
         {"N": ("How many people does the {G} employ?", "About how many employees does the {G} have?")},
         paraphrases={"N": ("What is the size of the workforce of the {G}?", "How large is the staff of the {G}?")}),
    Fact(("The {G} is best known for its {K}.", "The {G} became famous for its {K}."),
         {"K": ("What is the {G} best known for?", "What is the {G} famous for?")},
         paraphrases={"K": ("What product made the {G} famous?", "For which goods is the {G} renowned?")}),
)
TOWN_FACTS = (
    Fact(("{C} is the capital of {R}.", "{C} serves as the capital of {R}."),
         {"C": ("What is the capital of {R}?", "Which town is the capital of {R}?"),
          "R": ("Of which province is {C} the capital?", "{C} is the capital of which province?")},
         paraphrases={"C": ("Which town is the seat of government of {R}?",),
                      "R": ("{C} is the seat of which province?",)}),
    Fact(("{C} has a population of about {N}.", "About {N} people live in {C}."),
         {"N": ("What is the population of {C}?", "How many people live in {C}?")},
         paraphrases={"N": ("How many inhabitants does {C} have?", "What is the number of residents of {C}?")}),
    Fact(("{C} was founded in {Y}.", "{C} was first settled in {Y}."),
         {"Y": ("When was {C} founded?", "In what year was {C} established?")},
         paraphrases={"Y": ("Since when has {C} existed?", "In which year did settlement of {C} begin?")}),
    Fact(("{C} lies on the {V}.", "{C} was built on the banks of the {V}."),
         {"V": ("On which river does {C} lie?", "Which river flows through {C}?")},
         paraphrases={"V": ("Which river is {C} situated on?", "What river runs past {C}?")}),
    Fact(("The mayor of {C} is {M}.", "{M} serves as the mayor of {C}."),
         {"M": ("Who is the mayor of {C}?", "Who serves as mayor of {C}?")},
         paraphrases={"M": ("Who leads the town council of {C}?", "Who holds the office of mayor in {C}?")}),
    Fact(("The Treaty of {C} was signed on {T}.", "On {T}, the Treaty of {C} was signed."),
         {"T": ("On what date was the Treaty of {C} signed?", "When was the Treaty of {C} signed?")}, refs=False,
         paraphrases={"T": ("On which day was the Treaty of {C} concluded?",)}),
)
RIVER_FACTS = (
    Fact(("The {V} is {L} long.", "The {V} runs for {L}."),
         {"L": ("How long is the {V}?", "What is the length of the {V}?")},
         paraphrases={"L": ("What distance does the {V} cover?", "How many kilometres long is the {V}?")}),
    Fact(("The {V} rises in the {H}.", "The source of the {V} lies in the {H}."),
         {"H": ("Where does the {V} rise?", "In which mountains is the source of the {V}?")},
         paraphrases={"H": ("Where is the source of the {V}?", "From which mountains does the {V} come?")}),
    Fact(("The {V} flows into the {W}.", "The {V} empties into the {W}."),
         {"W": ("Into which body of water does the {V} flow?", "What does the {V} flow into?")},
         paraphrases={"W": ("Where does the {V} end?", "What is the mouth of the {V}?")}),
    Fact(("The first bridge over the {V} was built in {Y}.", "In {Y}, the first bridge across the {V} was built."),
         {"Y": ("When was the first bridge over the {V} built?",
                "In what year was the first bridge across the {V} built?")},
         paraphrases={"Y": ("When was the {V} first bridged?",)}),
)

# Fillers state nothing that is asked; the entity ones put same-type values next to an entity.
ENTITY_FILLERS = {
    "P": ("{P} later moved to {X}.", "{P} visited {X} in {Z}.", "{P} was a close friend of {Q}.",
          "Many letters written by {P} are kept in {X}."),
    "G": ("The {G} opened a branch in {X} in {Z}.", "In {Z}, the {G} was nearly closed by a long strike.",
          "The {G} once bought a warehouse in {X}."),
    "C": ("{C} is about {n} kilometres from {X}.", "In {Z}, a great flood damaged much of {C}.",
          "The painter {Q} often stayed in {C}."),
    "V": ("The {V} passes the village of {X}.", "In {Z}, the {V} froze over for two months.",
          "The {V} is crossed by {n} bridges."),
}
GENERIC_FILLERS = (
    "The surrounding region is known for its mild climate and long wet winters.",
    "Historians still disagree about the importance of these events.",
    "Little else is recorded about this period.",
    "Many local archives from that time were lost in a fire.",
    "Travellers often described the landscape as green and hilly.",
    "The area has changed a great deal since then.",
    "Several of these stories are still told in the local schools.",
    "A short guide to the region was printed much later.",
    "Most of the old buildings have since been restored.",
    "Records from the early years are incomplete.",
)

# -- values -----------------------------------------------------------------------------------------


def _person(rng: random.Random) -> str:
    return f"{rng.choice(_GIVEN)} {rng.choice(_SURNAME_HEAD)}{rng.choice(_SURNAME_TAIL)}"


def _place(rng: random.Random) -> str:
    return rng.choice(_PLACE_HEAD) + rng.choice(_PLACE_TAIL)


def _number(rng: random.Random, lo: int, hi: int) -> str:
    return f"{rng.randint(lo, hi):,}"


def _date(rng: random.Random) -> str:
    return f"{rng.randint(1, 28)} {rng.choice(_MONTHS)} {rng.randint(1600, 1950)}"


class _Names:
    """Proper names unique within one context, so every question has one right entity."""

    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, set()

    def new(self, make: Callable[[random.Random], str]) -> str:
        while True:
            name = make(self.rng)
            if name not in self.used:
                self.used.add(name)
                return name


def _person_values(rng: random.Random, names: _Names) -> dict[str, str]:
    born, age = rng.randint(1650, 1920), rng.randint(24, 95)
    occupation = rng.choice(_OCCUPATIONS)
    name = names.new(_person)
    return {"P": name, "ref": "she" if name.split()[0] in _GIVEN_F else "he", "B": names.new(_place), "Y": str(born), "O": occupation,
            "art": "an" if occupation[0] in "aeiou" else "a", "D": str(born + age), "A": str(age),
            "S": names.new(_person), "M": str(born + rng.randint(18, min(age, 50) - 1)),
            "U": rng.choice(_SUBJECTS), "UC": f"University of {names.new(_place)}"}


def _org_values(rng: random.Random, names: _Names) -> dict[str, str]:
    kind = rng.choice(sorted(_ORG_KINDS))
    return {"G": names.new(lambda r: f"{_place(r)} {kind}"), "ref": _ORG_KINDS[kind], "F": names.new(_person),
            "Y": str(rng.randint(1700, 1980)), "C": names.new(_place), "N": _number(rng, 40, 9000),
            "K": rng.choice(_PRODUCTS)}


def _town_values(rng: random.Random, names: _Names) -> dict[str, str]:
    return {"C": names.new(_place), "ref": "the town", "R": names.new(lambda r: f"{_place(r)} Province"),
            "N": _number(rng, 800, 250000), "Y": str(rng.randint(900, 1800)),
            "V": names.new(lambda r: f"{_place(r)} River"), "M": names.new(_person), "T": _date(rng)}


def _river_values(rng: random.Random, names: _Names) -> dict[str, str]:
    return {"V": names.new(lambda r: f"{_place(r)} River"), "ref": "river", "L": f"{rng.randint(12, 1900)} kilometres",
            "H": names.new(lambda r: f"{_place(r)} {r.choice(_RANGES)}"),
            "W": names.new(lambda r: f"{_place(r)} {r.choice(_WATERS)}"), "Y": str(rng.randint(1200, 1950))}


# kind -> (name slot, value maker, facts)
KINDS = {
    "person": ("P", _person_values, PERSON_FACTS),
    "org": ("G", _org_values, ORG_FACTS),
    "town": ("C", _town_values, TOWN_FACTS),
    "river": ("V", _river_values, RIVER_FACTS),
}

# -- rendering with answer offsets ------------------------------------------------------------------

_SLOT = re.compile(r"\{(\w+)\}")


def render(template: str, values: dict[str, str]) -> tuple[str, dict[str, int]]:
    """Fill a template; also return where each slot's value starts in the result."""
    out, starts, pos = [], {}, 0
    for m in _SLOT.finditer(template):
        out.append(template[pos:m.start()])
        starts[m.group(1)] = sum(map(len, out))
        out.append(values[m.group(1)])
        pos = m.end()
    out.append(template[pos:])
    return "".join(out), starts


@dataclasses.dataclass
class _Sentence:
    text: str
    qas: list[tuple[str, str, int]]  # (question, answer text, answer offset in the sentence)


@dataclasses.dataclass(frozen=True)
class Hard:
    """The hard preset's knobs (see the module docstring)."""

    ambiguity: float = 0.0  # share of facts a second source contradicts
    paraphrase: float = 0.7  # share of questions worded away from the evidence
    boundary: float = 0.3  # share of answers whose gold span takes in the word before it
    reference: float = 0.8  # chance a later fact of an entity refers back ("she") instead of naming it
    namesake: float = 0.5  # chance an entity gets a namesake (same surname / place) in its paragraph


# Words a gold span may take in on its left ("in 1874", "about 4,000"): annotators disagree on
# these in SQuAD too, and F1 gives partial credit for them.
_SPAN_PREFIXES = frozenset({"in", "about", "of", "on", "at", "roughly", "for", "the"})
_CONTESTS = ("Other records give {X} instead.", "Some sources say {X}.", "A later account gives {X}.",
             "Older registers, however, give {X}.")


def _widen_left(text: str, start: int, answer: str) -> tuple[str, int]:
    m = re.search(r"(\w+) $", text[:start])
    if m and m.group(1).lower() in _SPAN_PREFIXES:
        return text[m.start(1):start + len(answer)], m.start(1)
    return answer, start


def _fact_sentence(rng: random.Random, fact: Fact, values: dict[str, str], name_slot: str,
                   use_ref: bool, hard: Optional[Hard] = None, alt: Optional[Callable[[], dict]] = None) -> _Sentence:
    """The evidence sentence and its questions; questions always use the full name, the
    sentence may refer back to it, so the reader has to resolve the reference. ``hard``: the
    hard preset; ``alt`` makes other values of the same kind (for contradicting sources)."""
    shown = values
    if use_ref and fact.refs and name_slot not in fact.questions:
        shown = {**values, name_slot: values["ref"]}
    text, starts = render(rng.choice(fact.sentences), shown)
    text = text[0].upper() + text[1:]  # a reference may open the sentence; offsets are unchanged
    if hard is None:
        qas = [(render(rng.choice(questions), values)[0], values[slot], starts[slot])
               for slot, questions in fact.questions.items()]
        return _Sentence(text, qas)
    answers = {slot: (values[slot], starts[slot]) for slot in fact.questions}
    contestable = [slot for slot in fact.questions if slot != name_slot]
    if alt is not None and contestable and rng.random() < hard.ambiguity:
        slot = rng.choice(contestable)
        other = alt()[slot]
        if other != values[slot]:
            contest, at = render(rng.choice(_CONTESTS), {"X": other})
            base = len(text) + 1
            text = f"{text} {contest}"
            if rng.random() < 0.5:  # two sources, no way to tell: the gold is either claim
                answers[slot] = (other, base + at["X"])
    qas = []
    for slot, questions in fact.questions.items():
        pool = fact.paraphrases.get(slot) if rng.random() < hard.paraphrase else None
        question = render(rng.choice(pool or questions), values)[0]
        answer, start = answers[slot]
        if rng.random() < hard.boundary:
            answer, start = _widen_left(text, start, answer)
        qas.append((question, answer, start))
    return _Sentence(text, qas)


def _entity_filler(rng: random.Random, slot: str, values: dict[str, str], names: _Names) -> _Sentence:
    extra = {"X": names.new(_place), "Q": names.new(_person), "Z": str(rng.randint(1700, 1990)),
             "n": str(rng.randint(3, 90))}
    return _Sentence(render(rng.choice(ENTITY_FILLERS[slot]), {**values, **extra})[0], [])


def _entity_block(rng: random.Random, kind: str, names: _Names, hard: Optional[Hard] = None,
                  like: Optional[dict] = None) -> tuple[str, list[_Sentence], dict]:
    """An entity's name and 2-4 of its facts (plus maybe a distractor filler), in random order.
    ``like``: make the entity a namesake of that one (same surname, same place...)."""
    slot, make_values, facts = KINDS[kind]
    values = make_values(rng, names)
    if like is not None:
        values = {**values, **_namesake(rng, kind, like, names)}
    chosen = rng.sample(facts, rng.randint(2, min(4, len(facts))))
    p_ref = 0.5 if hard is None else hard.reference
    alt = (lambda: make_values(rng, names)) if hard is not None else None
    block = [_fact_sentence(rng, fact, values, slot, use_ref=i > 0 and rng.random() < p_ref, hard=hard, alt=alt)
             for i, fact in enumerate(chosen)]
    if rng.random() < 0.5:
        # Last, so that a reference never follows a sentence that names another person.
        block.append(_entity_filler(rng, slot, values, names))
    return values[slot], block, values


def _namesake(rng: random.Random, kind: str, like: dict, names: _Names) -> dict:
    """Name (and reference) of an entity easily confused with ``like``: the hard preset's distractor."""
    if kind == "person":
        surname = like["P"].split(" ", 1)[1]
        name = names.new(lambda r: f"{r.choice(_GIVEN)} {surname}")
        return {"P": name, "ref": "she" if name.split()[0] in _GIVEN_F else "he"}
    if kind == "org":  # the same town, another kind of organisation ("Telvik Press" / "Telvik Shipyard")
        place = like["G"].split(" ")[0]
        name = names.new(lambda r: f"{place} {r.choice(sorted(_ORG_KINDS))}")
        return {"G": name, "ref": _ORG_KINDS[name[len(place) + 1:]]}
    if kind == "town":
        return {"C": names.new(lambda r: f"{r.choice(('Upper', 'Lower', 'New', 'Old'))} {like['C']}")}
    return {"V": names.new(lambda r: f"{r.choice(('Little', 'Great', 'East', 'West'))} {like['V']}")}


def _words(sentences: Iterable[_Sentence]) -> int:
    return sum(len(s.text.split()) for s in sentences)


# -- context length ---------------------------------------------------------------------------------


def _truncated_exp_scale(span: float, mean: float) -> float:
    """Scale s of an exponential truncated to [0, span] whose mean is ``mean`` (< span/2)."""
    def mean_of(s: float) -> float:
        return s - span / math.expm1(span / s)

    lo, hi = span / 700.0, span * 1e6  # mean_of rises from ~0 to ~span/2 over this range
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if mean_of(mid) < mean else (lo, mid)
    return math.sqrt(lo * hi)


def sample_words(rng: random.Random, lo: int, hi: int, mean: float) -> int:
    """A length in [lo, hi] whose expectation is ``mean``: a truncated exponential, skewed
    towards lo (or mirrored towards hi), so lengths vary like real paragraphs do."""
    span, offset = hi - lo, mean - lo
    if span == 0:
        return lo
    mirrored = offset > span / 2
    if mirrored:
        offset = span - offset
    u = rng.random()
    if offset >= span / 2 - 1e-9:
        x = u * span
    else:
        s = _truncated_exp_scale(span, max(offset, 1e-9))
        x = -s * math.log1p(u * math.expm1(-span / s))
    return int(round(hi - x if mirrored else lo + x))


# -- contexts and sets ------------------------------------------------------------------------------


def _context(rng: random.Random, cfg: SyntheticConfig, target: int, long: bool) -> tuple[str, str, list]:
    """One paragraph of about ``target`` words: (title, text, questions it answers as
    (question, answer, answer_start) triples)."""
    names = _Names(rng)
    kinds = sorted(KINDS)
    theme = rng.choice(kinds)
    hard = Hard(ambiguity=cfg.ambiguity) if cfg.difficulty == "hard" else None
    title, sentences, n_facts, words = "", [], 0, 0
    last: Optional[tuple[str, dict]] = None  # (kind, values) of the previous entity
    # Facts take about three quarters of the words; filler sentences make up the rest.
    while n_facts < cfg.questions_per_context or words < 0.75 * target:
        if hard is not None and last is not None and rng.random() < hard.namesake:
            kind, like = last[0], last[1]
        else:
            kind, like = (theme if rng.random() < 0.75 else rng.choice(kinds)), None
        if hard is None:
            name, block, _ = _entity_block(rng, kind, names)
        else:
            name, block, values = _entity_block(rng, kind, names, hard, like)
            last = None if like is not None else (kind, values)  # one namesake per entity
        if sentences and n_facts >= cfg.questions_per_context and words + _words(block) > target:
            break
        title = title or name
        sentences.extend(block)
        n_facts += sum(len(s.qas) for s in block)
        words += _words(block)
    ceiling = max(target, LONG_WORDS[1] if long else cfg.max_words)
    while words < target:
        filler = _Sentence(rng.choice(GENERIC_FILLERS), [])
        if words + _words([filler]) > ceiling and words >= cfg.min_words:
            break
        sentences.insert(rng.randint(0, len(sentences)), filler)
        words += _words([filler])

    text, qas, pos = [], [], 0
    for s in sentences:
        qas.extend((q, a, pos + off) for q, a, off in s.qas)
        text.append(s.text)
        pos += len(s.text) + 1
    return title, " ".join(text), qas


def _pick_questions(rng: random.Random, qas: list, k: int, long: bool) -> list:
    picked = rng.sample(qas, min(k, len(qas)))
    if long:
        deepest = max(qas, key=lambda qa: qa[2])
        if deepest not in picked:
            picked[-1] = deepest
    return sorted(picked, key=lambda qa: qa[2])  # in reading order, like SQuAD


def generate_squad(n_contexts: int, cfg: SyntheticConfig, seed: int, id_prefix: str = "syn-",
                   exclude_contexts: Iterable[str] = ()) -> dict:
    """An official-format SQuAD v1.1 dict with ``n_contexts`` paragraphs (one per article).

    ``exclude_contexts``: paragraphs that must not occur (the train set, when making dev).
    """
    rng = random.Random(seed)
    # v2.0 choices draw from their own stream: the v1.1 output of a config never changes
    v2_rng = random.Random(seed ^ 0x5EED2)
    long_ids = set(rng.sample(range(n_contexts), round(n_contexts * cfg.long_context_fraction)))
    seen = set(exclude_contexts)
    data = []
    for c in range(n_contexts):
        long = c in long_ids
        while True:
            target = rng.randint(*_long_range(cfg)) if long else \
                sample_words(rng, cfg.min_words, cfg.max_words, cfg.mean_words)
            title, context, qas = _context(rng, cfg, target, long)
            if context not in seen:
                seen.add(context)
                break
        picked = _pick_questions(rng, qas, cfg.questions_per_context, long)
        qa_records = [{"id": f"{id_prefix}{c:05d}-{j}", "question": q, "answers": [{"text": a, "answer_start": start}]}
                      for j, (q, a, start) in enumerate(picked)]
        if cfg.unanswerable:
            for qa in qa_records:
                if v2_rng.random() < cfg.unanswerable:
                    _make_unanswerable(v2_rng, qa, context)
                else:
                    qa["is_impossible"] = False
        data.append({"title": title, "paragraphs": [{"context": context, "qas": qa_records}]})
    return {"version": SQUAD_V2_VERSION if cfg.unanswerable else SQUAD_VERSION, "data": data}


# A proper name in a question: capitalized words (the generator's names are all of this shape).
_NAME = re.compile(r"[A-Z][a-z]+(?: [A-Z][a-z]+)*")


def _make_unanswerable(rng: random.Random, qa: dict, context: str) -> None:
    """SQuAD v2.0's adversarial kind of unanswerable question: the question asks about a namesake
    of the entity the paragraph talks about (first word of its name replaced by a made-up one the
    paragraph never mentions), so the span that would answer it is there, about someone else.
    That span becomes ``plausible_answers``; a question naming nothing stays answerable."""
    q = qa["question"]
    names = [m for m in _NAME.finditer(q) if m.start() > 0 and m.group(0) in context]
    if not names:
        qa["is_impossible"] = False
        return
    m = max(names, key=lambda m: len(m.group(0)))
    rest = m.group(0).split(" ", 1)[1:]
    for _ in range(100):
        first = rng.choice(_GIVEN) if rest and m.group(0).split(" ")[0] in _GIVEN else _place(rng)
        new = " ".join([first] + rest)
        if first not in context and new != m.group(0):
            break
    else:
        qa["is_impossible"] = False
        return
    qa["question"] = q[:m.start()] + new + q[m.end():]
    qa["is_impossible"] = True
    qa["plausible_answers"] = qa.pop("answers")
    qa["answers"] = []


def _long_range(cfg: SyntheticConfig) -> tuple[int, int]:
    lo = max(LONG_WORDS[0], cfg.max_words + 1)
    return lo, max(LONG_WORDS[1], lo + 250)


def _contexts(squad: dict) -> set[str]:
    return {p["context"] for a in squad["data"] for p in a["paragraphs"]}


def derive_seed(seed: int, split: str) -> int:
    """Independent per-split seeds from one config seed (stable across Python versions)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{split}".encode()).digest()[:8], "big")


def config_hash(cfg: SyntheticConfig) -> str:
    payload = json.dumps({"generator": GENERATOR_VERSION, **cfg.identity()}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:10]


def ensure_squad_files(data_dir, cfg: SyntheticConfig) -> tuple[Path, Path]:
    """Generate (once) and return ``data_dir/synthetic-<hash>/{train,dev}-v1.1.json`` (``-v2.0``
    with ``unanswerable`` > 0).

    Existing files are reused: the directory name changes with the config and the generator
    version, so a file there is always what this config would produce.
    """
    out = Path(data_dir) / f"synthetic-{config_hash(cfg)}"
    v = "v2.0" if cfg.unanswerable else "v1.1"
    train_path, dev_path = out / f"train-{v}.json", out / f"dev-{v}.json"
    if not (train_path.exists() and dev_path.exists()):
        train = generate_squad(cfg.n_train_contexts, cfg, derive_seed(cfg.seed, "train"), "syn-train-")
        dev = generate_squad(cfg.n_dev_contexts, cfg, derive_seed(cfg.seed, "dev"), "syn-dev-",
                             exclude_contexts=_contexts(train))
        write_json_atomic({"generator_version": GENERATOR_VERSION, **dataclasses.asdict(cfg)},
                          out / "config.json")
        for squad, path in ((train, train_path), (dev, dev_path)):
            if not path.exists():
                write_squad_json(squad, path)
    return train_path, dev_path
