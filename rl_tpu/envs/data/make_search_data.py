"""Writes the synthetic Deep-Search corpus and questions that `rl_tpu.envs.search` ships with.

    python rl_tpu/envs/data/make_search_data.py            # rewrites the two files beside it
    python rl_tpu/envs/data/make_search_data.py --check    # fails if the files are stale

Every entity (people, towns, rivers, organisations) is invented from nonsense syllables, so a
policy cannot answer from what a pretrained model already knows: it has to search. Passages are
short encyclopaedia-style paragraphs; questions need one search (a fact in the entity's own
passage) or two (a fact of an entity *named* in the first passage, the "bridge"). The final
answer of a two-hop question never appears in the first passage, so the second search is real.

Output (JSON lines, stable order, byte-identical for the same SEED):
  search_corpus.jsonl     {"id", "title", "text"}                          (200 passages)
  search_questions.jsonl  {"id", "split", "question", "answer", "type",
                           "hops": [{"query", "title", "evidence"}]}       (100 questions)

`hops` is what the scripted oracle follows: search `query`, expect a passage titled `title`
among the results whose text contains `evidence` (the bridge, or the answer on the last hop).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

SEED = 20240917
HERE = Path(__file__).resolve().parent
CORPUS_FILE = "search_corpus.jsonl"
QUESTIONS_FILE = "search_questions.jsonl"

# Counts add up to 200 passages.
NUM_TOWNS, NUM_RIVERS, NUM_PEOPLE, NUM_ORGS = 40, 30, 80, 50
NUM_QUESTIONS = 100  # half train, half eval

_ONSETS = ["b", "br", "d", "dr", "f", "g", "gl", "k", "kr", "l", "m", "n", "p", "qu", "r", "s",
           "sk", "t", "th", "v", "vr", "z", "h", "j", "w"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou", "y"]
_CODAS = ["", "", "n", "r", "l", "s", "th", "m", "nd", "sk", "x", "v"]
_TOWN_SUFFIXES = ["holm", "wick", "mere", "stead", "gard", "brae", "fell", "port", "combe", "ness"]
_PROFESSIONS = ["glassblower", "cartographer", "astronomer", "shipwright", "botanist", "luthier",
                "bookbinder", "clockmaker", "geologist", "composer", "weaver", "apothecary"]
_ORG_KINDS = ["Guild", "Observatory", "Foundry", "Press", "Academy", "Conservatory", "Company",
              "Workshop", "Institute", "Society"]
_SEAS = ["Sea of Ombrel", "Vask Sea", "Sea of Teloran", "Drumlic Sea", "Quessary Bight",
         "Gulf of Narrow Hathe"]
_PROVINCES = ["Tarsk", "Ellowen", "Brumeth", "Caddow", "Isprey", "Mornhallow", "Veskil", "Ardun"]
_LANDMARKS = ["a covered bridge", "a clock tower", "a salt market", "a stone lighthouse",
              "a botanical terrace", "a printing museum", "a bell foundry", "an old granary"]


class _Names:
    """Invented words, never repeated: a word shared by two names would make a question
    ambiguous and would let BM25 confuse the two entities."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set()

    def fresh(self, syllables: int) -> str:
        while True:
            parts = [self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(syllables)]
            word = ("".join(parts) + self.rng.choice(_CODAS)).capitalize()
            if word.lower() not in self.used:
                self.used.add(word.lower())
                return word


def _build_world(rng: random.Random) -> dict:
    names = _Names(rng)
    # Reserve the words of seas and provinces so no invented name collides with them.
    names.used.update(w.lower() for n in _SEAS + _PROVINCES for w in n.split())
    rivers = []
    for _ in range(NUM_RIVERS):
        rivers.append({"name": names.fresh(2) + " River",
                       "sea": rng.choice(_SEAS), "length": rng.randrange(40, 900),
                       "source": "Mount " + names.fresh(2)})
    towns = []
    for i in range(NUM_TOWNS):
        towns.append({"name": names.fresh(1) + rng.choice(_TOWN_SUFFIXES),
                      # Every river gets at least one town so river passages are all reachable.
                      "river": rivers[i % NUM_RIVERS]["name"],
                      "province": rng.choice(_PROVINCES), "founded": rng.randrange(900, 1650),
                      "population": rng.randrange(2, 400) * 100, "landmark": rng.choice(_LANDMARKS)})
    people = []
    for _ in range(NUM_PEOPLE):
        people.append({"name": f"{names.fresh(1)} {names.fresh(2)}",
                       "profession": rng.choice(_PROFESSIONS), "born": rng.randrange(1700, 1960),
                       "birthplace": rng.choice(towns)["name"]})
    orgs = []
    for i in range(NUM_ORGS):
        founder = people[i]  # distinct founders: "who founded X" has one answer
        orgs.append({"name": f"{names.fresh(2)} {rng.choice(_ORG_KINDS)}",
                     "founder": founder["name"], "founded": founder["born"] + rng.randrange(25, 50),
                     "seat": rng.choice(towns)["name"]})
    for person in people:  # a workplace for everyone; founders work at what they founded
        person["employer"] = rng.choice(orgs)["name"]
    for org in orgs:
        next(p for p in people if p["name"] == org["founder"])["employer"] = org["name"]
    return {"rivers": rivers, "towns": towns, "people": people, "orgs": orgs}


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _passages(world: dict, rng: random.Random) -> list[dict]:
    out = []
    for r in world["rivers"]:
        out.append((r["name"], rng.choice([
            f"The {r['name']} rises on the slopes of {r['source']} and runs for {r['length']} "
            f"kilometres before it empties into the {r['sea']}.",
            f"{r['name']} is a {r['length']} km long waterway. Its source is on {r['source']}; "
            f"its mouth opens onto the {r['sea']}.",
        ])))
    for t in world["towns"]:
        out.append((t["name"], rng.choice([
            f"{t['name']} is a market town in the province of {t['province']}, founded in "
            f"{t['founded']}. The {t['river']} flows through its centre, and the town is known "
            f"for {t['landmark']}. About {t['population']} people live there.",
            f"Founded in {t['founded']}, {t['name']} lies on the banks of the {t['river']} in "
            f"{t['province']} province. Visitors come for {t['landmark']}; the population is "
            f"roughly {t['population']}.",
        ])))
    for p in world["people"]:
        out.append((p["name"], rng.choice([
            f"{p['name']} (born {p['born']}) is {_a(p['profession'])} from {p['birthplace']}. "
            f"{p['name'].split()[0]} spent most of a long career at the {p['employer']}.",
            f"{p['name']} was born in {p['birthplace']} in {p['born']} and became "
            f"{_a(p['profession'])}, working for many years at the {p['employer']}.",
        ])))
    for o in world["orgs"]:
        out.append((o["name"], rng.choice([
            f"The {o['name']} was established in {o['founded']} by {o['founder']}. It has its "
            f"seat in {o['seat']}.",
            f"{o['founder']} founded the {o['name']} in {o['founded']}; the house still keeps "
            f"its headquarters in {o['seat']}.",
        ])))
    return [{"id": f"p{i:03d}", "title": title, "text": text} for i, (title, text) in enumerate(out)]


def _questions(world: dict, rng: random.Random, corpus: list[dict]) -> list[dict]:
    text = {p["title"]: p["text"] for p in corpus}
    by_name = {e["name"]: e for kind in world.values() for e in kind}

    def hop(entity: str, evidence) -> dict:
        return {"query": entity, "title": entity, "evidence": str(evidence)}

    def one_hop(kind: str) -> tuple:
        if kind == "born":
            p = rng.choice(world["people"])
            return (f"In what year was {p['name']} born?", p["born"], [hop(p["name"], p["born"])])
        if kind == "profession":
            p = rng.choice(world["people"])
            return (f"What is the profession of {p['name']}?", p["profession"],
                    [hop(p["name"], p["profession"])])
        if kind == "province":
            t = rng.choice(world["towns"])
            return (f"In which province is {t['name']}?", t["province"],
                    [hop(t["name"], t["province"])])
        if kind == "founder":
            o = rng.choice(world["orgs"])
            return (f"Who founded the {o['name']}?", o["founder"], [hop(o["name"], o["founder"])])
        r = rng.choice(world["rivers"])
        return (f"Into which sea does the {r['name']} flow?", r["sea"], [hop(r["name"], r["sea"])])

    def two_hop(kind: str) -> tuple:
        if kind == "birth_river":
            p = rng.choice(world["people"])
            town = by_name[p["birthplace"]]
            return (f"Which river flows through the birthplace of {p['name']}?", town["river"],
                    [hop(p["name"], town["name"]), hop(town["name"], town["river"])])
        if kind == "founder_born":
            o = rng.choice(world["orgs"])
            f = by_name[o["founder"]]
            return (f"In what year was the founder of the {o['name']} born?", f["born"],
                    [hop(o["name"], f["name"]), hop(f["name"], f["born"])])
        if kind == "seat_province":
            o = rng.choice(world["orgs"])
            town = by_name[o["seat"]]
            return (f"In which province does the {o['name']} have its seat?", town["province"],
                    [hop(o["name"], town["name"]), hop(town["name"], town["province"])])
        if kind == "town_sea":
            t = rng.choice(world["towns"])
            river = by_name[t["river"]]
            return (f"Into which sea does the river of {t['name']} flow?", river["sea"],
                    [hop(t["name"], river["name"]), hop(river["name"], river["sea"])])
        p = rng.choice(world["people"])
        org = by_name[p["employer"]]
        return (f"In which town is the employer of {p['name']} based?", org["seat"],
                [hop(p["name"], org["name"]), hop(org["name"], org["seat"])])

    one_kinds = ["born", "profession", "province", "founder", "sea"]
    two_kinds = ["birth_river", "founder_born", "seat_province", "town_sea", "employer_seat"]
    rows, seen = [], set()
    while len(rows) < NUM_QUESTIONS:
        # 40% one-hop, 60% two-hop, interleaved so both splits get the same mix.
        two = len(rows) % 5 >= 2
        kind = rng.choice(two_kinds if two else one_kinds)
        question, answer, hops = (two_hop if two else one_hop)(kind)
        # Skip repeats, and two-hop questions whose answer the first passage already shows
        # (a person born in the town where their employer sits, say).
        if question in seen or (two and str(answer) in text[hops[0]["title"]]):
            continue
        seen.add(question)
        rows.append({"question": question, "answer": str(answer), "type": "2hop" if two else "1hop",
                     "kind": kind, "hops": hops})
    for i, row in enumerate(rows):
        row["id"] = f"q{i:03d}"
        row["split"] = "train" if i % 2 == 0 else "eval"
    keys = ["id", "split", "question", "answer", "type", "kind", "hops"]
    return [{k: row[k] for k in keys} for row in rows]


def _check_two_hop(corpus: list[dict], questions: list[dict]):
    """A two-hop answer must not be readable off the first passage (else one search suffices)."""
    text = {p["title"]: p["text"] for p in corpus}
    for q in questions:
        for h in q["hops"]:
            assert h["evidence"] in text[h["title"]], (q["id"], h)
        if q["type"] == "2hop":
            assert q["answer"] not in text[q["hops"][0]["title"]], q


def build() -> tuple[list[dict], list[dict]]:
    rng = random.Random(SEED)
    world = _build_world(rng)
    corpus = _passages(world, rng)
    questions = _questions(world, rng, corpus)
    _check_two_hop(corpus, questions)
    return corpus, questions


def _dumps(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=False) + "\n" for r in rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=HERE, help="output directory")
    parser.add_argument("--check", action="store_true", help="fail if the files on disk differ")
    args = parser.parse_args(argv)
    corpus, questions = build()
    files = {CORPUS_FILE: _dumps(corpus), QUESTIONS_FILE: _dumps(questions)}
    if args.check:
        stale = [n for n, body in files.items()
                 if not (args.out / n).exists() or (args.out / n).read_text("utf-8") != body]
        if stale:
            print(f"stale: {stale}; rerun {Path(__file__).name} without --check", file=sys.stderr)
            return 1
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, body in files.items():
        (args.out / name).write_text(body, encoding="utf-8")
    print(f"wrote {len(corpus)} passages and {len(questions)} questions to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
