"""A tool-call task whose answers must be read from the prompt (our generator over BFCL schemas).

The research model of block-size calibration (issue 20) needs a task that block-parallel decoding can
get wrong: argument values that are not predictable from the format alone. Each record offers 2-3
real BFCL function schemas (``BFCL_v4_simple_python.json``: functions whose required parameters are
1-3 strings / integers / booleans) and one user turn; the first assistant turn is the answer:

- ``single`` (50%): the user asks for one function by its name words ("calculate triangle area")
  with a value per required parameter; the call copies the string values verbatim, writes integers
  as JSON numbers (digits copied, or a number word "seven" transformed to 7) and booleans from
  "with X" / "without X";
- ``multi`` (30%): two such requests joined by " Then "; two calls in one assistant turn, in order;
- ``none`` (20%): small talk that names someone (the reply greets them) or a request for a function that is not offered (the
  reply names it: "None of the available tools can <name words>."); with ``unoffered_requests`` off, only small
  talk (no record asks for a function that is missing from the list).

Four options shape the task (all off by default, the task as above): ``quote_values`` writes string
values in double quotes in the user turn (``compound "Emeryville, CA"``), so a value's tokens are the
same in the user turn and in the call's JSON (unquoted, the first word is a different token there:
" Em" in the sentence, "Em" after the JSON quote) and its end is marked; ``value_words`` > 0 draws each
string value as 1-3 words of a fixed sample of that many words of the answer values ("Canyon red
Hotel"): frequent tokens in combinations that recur rarely, so a value must be read, not remembered;
``name_tools`` has the user name the function as the tool list writes it, in double quotes (``use
"calculate_density"``: the name's tokens are the same in the user turn, the tool list and the call,
so whether it is offered is a match of the same tokens, not a word-to-name mapping), and a "no tool
fits" reply names it the same way (``None of the available tools is "calculate_density".``);
``unoffered_requests`` (on by default) keeps the requests for a function that is not offered among the
"no call" turns: off, a turn that asks for a function always finds it offered, and the task measures
reading values from the prompt, not the offer check (issue 20: a 2-core model did not learn the check).

Training curricula (`CURRICULA`, keyword arguments of `generate_record(s)`; default 0: the task as
above): copy drills (`echo_share`: the user lists 2-4 values and the reply repeats them in order;
`echo_numbers`: the share of those values that are integers), extra "no tool fits" turns
(`unoffered_share`: a request for a function that is not offered, answered in text) and offer-check
drills (`check_share`: "Is there a tool to <name words>?" answered "Yes." or "No." from the offered
list, half of each: the check a "no tool fits" turn needs, without the call around it).

String values come from the string arguments of BFCL's possible answers (all categories that ship a
``possible_answer`` file next to the schemas): real values, shared by every function, so the value
cannot be guessed from the function. Record ``i`` of ``(seed, split)`` depends only on them: draws
are retried until the user turn's hash falls in the split's bucket (``heldout``: 1 in
``HELDOUT_BUCKETS``), so the train and held-out prompts are disjoint by construction
(``assert_disjoint`` checks it on any two record lists). Usage: ``python -m sft.data.tool_task
--bfcl /work/shared/data/bfcl/BFCL_v4_simple_python.json --split heldout --n 200 --out f.jsonl``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import random
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["CURRICULA", "HELDOUT_BUCKETS", "TASK_OPTIONS", "TaskSchemas", "assert_disjoint", "check_curricula",
           "generate_records", "load_schemas", "prompt_key", "schemas_from_options", "write_jsonl"]

HELDOUT_BUCKETS = 8  # 1 in 8 user turns belongs to the held-out split
SPLITS = ("train", "heldout")
# the options of a `tool_task` source that define the task (the study's eval prompts must use the same);
# the training curricula (keyword arguments of `generate_record`) stay out
TASK_OPTIONS = ("max_functions", "max_values", "value_words", "quote_values", "name_tools", "unoffered_requests")
CURRICULA = ("echo_share", "echo_numbers", "unoffered_share", "check_share")
_TYPES = ("string", "integer", "boolean")
_WORDS = ("zero one two three four five six seven eight nine ten eleven twelve").split()
# small talk greets a name (a value of the pool): varied user turns in both splits, copied into the reply
_SMALL_TALK = (("Hi, I am {v}.", "Hello {v}! How can I help you today?"),
               ("Thanks, that's all from {v}.", "You're welcome, {v}! Have a great day."),
               ("Good morning, this is {v}.", "Good morning, {v}! What can I do for you?"))
# the copy drill (a training curriculum, `echo_share`): the user lists values, the reply repeats them
_ECHO = (("Please note these names: {vs}.", "Noted: {vs}."),
         ("Remember {vs} for later.", "I will remember {vs}."))
# the offer-check drill (`check_share`): is the named function among the offered tools?
_CHECK = ("Is there a tool to {what}?", "Can any of the tools {what}?")
_VALUE_RE = re.compile(r"[A-Za-z][A-Za-z0-9 .,-]*")  # plain values: no quotes, escapes or markup
_WORD_RE = re.compile(r"[A-Za-z][A-Za-z-]+")  # the words of `value_words`
_ASK = ("Please {what} with {args}.", "Can you {what} with {args}?", "I need to {what}: {args}.")


class TaskSchemas:
    """The function pool (tool dicts in the canonical record layout), the string-value pool (or the
    words string values are made of, when `words` is not empty), whether the user quotes them and
    whether the user names functions as written (`name_tools`) and whether "no call" turns include
    requests for a function that is not offered (`unoffered_requests`)."""

    def __init__(self, tools: list[dict], values: list[str], where: str, words: Sequence[str] = (),
                 quote: bool = False, name_tools: bool = False, unoffered_requests: bool = True):
        if len(tools) < 4:
            raise ValueError(f"{where}: {len(tools)} eligible functions; the task needs at least 4")
        if len(values) < 8:
            raise ValueError(f"{where}: {len(values)} string values in the possible answers; need at least 8")
        if words and len(words) < 8:
            raise ValueError(f"{where}: {len(words)} value words in the possible answers; need at least 8")
        self.tools, self.values, self.where, self.words, self.quote = tools, values, where, list(words), quote
        self.name_tools, self.unoffered_requests = name_tools, unoffered_requests
        self.by_name = {t["function"]["name"]: t for t in tools}

    def value(self, rng: random.Random) -> str:
        """One string value: a pool value, or 1-3 distinct value words."""
        if self.words:
            return " ".join(rng.sample(self.words, rng.randint(1, 3)))
        return rng.choice(self.values)


def _eligible(fn: dict) -> dict | None:
    params = fn.get("parameters") or {}
    props, req = params.get("properties") or {}, list(params.get("required") or [])
    if not 1 <= len(req) <= 3 or any(k not in props for k in req):
        return None
    if any(props[k].get("type") not in _TYPES or "enum" in props[k] for k in req):
        return None
    return {"type": "function", "function": {
        "name": fn["name"], "parameters": {"type": "object", "properties": {k: {"type": props[k]["type"]} for k in req},
                       "required": req}}}


def _strings(obj: Any) -> Iterable[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, list):
        for x in obj:
            yield from _strings(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _strings(x)


@functools.lru_cache(maxsize=8)
def load_schemas(schema_file: str, max_functions: int = 32, max_values: int = 256, value_words: int = 0,
                 quote_values: bool = False, name_tools: bool = False,
                 unoffered_requests: bool = True) -> TaskSchemas:
    """The first `max_functions` eligible functions of a BFCL question file (JSON Lines), names
    unique (required parameters only, without descriptions: short prompts for a 2-core model),
    and the string values of the possible answers (1-3 words, <= 20 characters, starting with a letter, only letters, digits,
    spaces and `.,-`) of every `possible_answer/*.json` next to it: a fixed sample of `max_values`
    of them, sorted (deterministic). `value_words` > 0: also a fixed sample of that many of their
    words (letters and hyphens, 2+ characters), from which string values are then drawn."""
    if value_words < 0:
        raise ValueError(f"tool_task: value_words must be >= 0 (0 = whole pool values), got {value_words}")
    path = Path(schema_file)
    if not path.is_file():
        raise FileNotFoundError(f"tool_task: BFCL schema file {path} does not exist")
    tools: dict[str, dict] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        for fn in rec.get("function") or []:
            tool = _eligible(fn)
            if tool is not None and fn["name"] not in tools and len(tools) < max_functions:
                tools[fn["name"]] = tool
    values: set[str] = set()
    answers = sorted((path.parent / "possible_answer").glob("*.json"))
    for f in answers:
        for line in f.read_text().splitlines():
            if line.strip():
                for v in _strings(json.loads(line).get("ground_truth")):
                    v = v.strip()
                    if len(v) <= 20 and len(v.split()) <= 3 and _VALUE_RE.fullmatch(v):
                        values.add(v)
    # a fixed sample of `max_values`: each value recurs in training, so its tokens are learned
    pool = sorted(values)
    words = sorted({w for v in values for w in re.split(r"[ ,.]+", v) if _WORD_RE.fullmatch(w)})
    pool = sorted(random.Random("clover-tool-task-values").sample(pool, min(max_values, len(pool))))
    words = sorted(random.Random("clover-tool-task-words").sample(words, min(value_words, len(words))))
    return TaskSchemas(list(tools.values()), pool, str(path), words, quote_values, name_tools, unoffered_requests)


def schemas_from_options(schema_file: str, options: Mapping[str, Any]) -> TaskSchemas:
    """`load_schemas` with the task-defining options (`TASK_OPTIONS`) of a resolved `tool_task` source."""
    return load_schemas(schema_file, *(options[k] for k in TASK_OPTIONS))


def _name_words(name: str) -> str:
    return name.replace(".", " ").replace("_", " ").strip()


def _named(name: str, schemas: TaskSchemas) -> str:
    """How the user refers to a function: its name words, or (`name_tools`) its name in quotes."""
    return f'use "{name}"' if schemas.name_tools else _name_words(name)


def _request(rng: random.Random, tool: dict, schemas: TaskSchemas) -> tuple[str, dict]:
    """(user phrase, arguments) for one call of `tool`."""
    fn = tool["function"]
    parts, args = [], {}
    for k in fn["parameters"]["required"]:
        t, key = fn["parameters"]["properties"][k]["type"], _name_words(k)
        if t == "integer":
            v = rng.randint(0, 12) if rng.random() < 0.3 else rng.randint(13, 999)
            said = _WORDS[v] if v <= 12 else str(v)
            parts.append(f"{key} {said}")
        elif t == "boolean":
            v = rng.random() < 0.5
            parts.append(f"{'with' if v else 'without'} {key}")
        else:
            v = schemas.value(rng)
            parts.append(f'{key} "{v}"' if schemas.quote else f"{key} {v}")
        args[k] = v
    text = ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]
    return rng.choice(_ASK).format(what=_named(fn["name"], schemas), args=text), args


def _echo(rng: random.Random, schemas: TaskSchemas, numbers: float = 0.0) -> dict:
    """A copy-drill record: 2-4 values (distinct pool values, or drawn from the words; with probability
    `numbers` each is a 2-3 digit integer instead) in the user turn, repeated in order by the reply (no
    call; 2-3 tools offered as in every record)."""
    k = rng.randint(2, 4)
    if numbers > 0:  # digits repeat inside a prompt: copying them needs position, not only identity
        vals = [str(rng.randint(13, 999)) if rng.random() < numbers else schemas.value(rng) for _ in range(k)]
    elif schemas.words:
        vals = [schemas.value(rng) for _ in range(k)]
    else:
        vals = rng.sample(schemas.values, k)
    vs = ", ".join(vals[:-1]) + " and " + vals[-1]
    user, reply = (s.format(vs=vs) for s in rng.choice(_ECHO))
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}],
            "tools": rng.sample(schemas.tools, rng.randint(2, 3))}


def _check(rng: random.Random, schemas: TaskSchemas) -> dict:
    """An offer-check drill: the user asks whether a function is offered; it is in half of them."""
    fn = rng.choice(schemas.tools)
    others = [t for t in schemas.tools if t is not fn]
    offered = rng.sample(others, rng.randint(1, 2))
    present = rng.random() < 0.5
    if present:
        offered.insert(rng.randint(0, len(offered)), fn)
    user = rng.choice(_CHECK).format(what=_named(fn["function"]["name"], schemas))
    return {"messages": [{"role": "user", "content": user},
                         {"role": "assistant", "content": "Yes." if present else "No."}], "tools": offered}


def _draw(rng: random.Random, schemas: TaskSchemas, echo_share: float = 0.0, unoffered_share: float = 0.0,
          echo_numbers: float = 0.0, check_share: float = 0.0) -> dict:
    # no extra draw at share 0: the task's streams stay as they were
    if unoffered_share > 0 and not schemas.unoffered_requests:
        raise ValueError(f"tool_task: unoffered_share {unoffered_share} needs unoffered_requests on (the task "
                         f"of {schemas.where} has no requests for a function that is not offered)")
    if echo_share > 0 and rng.random() < echo_share:
        return _echo(rng, schemas, echo_numbers)
    if check_share > 0 and rng.random() < check_share:
        return _check(rng, schemas)
    unoffered = unoffered_share > 0 and rng.random() < unoffered_share
    scenario = "none" if unoffered else rng.choices(["single", "multi", "none"], [50, 30, 20])[0]
    needed = rng.sample(schemas.tools, 2 if scenario == "multi" else 1)
    others = [t for t in schemas.tools if t not in needed]
    offered = needed + rng.sample(others, rng.randint(1, 2)) if scenario != "none" else []
    if scenario == "none":
        offered = rng.sample(others, rng.randint(2, 3))
        # the coin is drawn either way: small talk turns stay the same records with or without the option
        if not unoffered and (rng.random() < 0.5 or not schemas.unoffered_requests):
            name = schemas.value(rng)
            user, reply = (s.format(v=name) for s in rng.choice(_SMALL_TALK))
        else:  # needed[0] is not offered
            user, _ = _request(rng, needed[0], schemas)
            fn_name = needed[0]["function"]["name"]
            reply = (f'None of the available tools is "{fn_name}".' if schemas.name_tools
                     else f"None of the available tools can {_name_words(fn_name)}.")
        answer: dict[str, Any] = {"role": "assistant", "content": reply}
    else:
        asks, calls = [], []
        for tool in needed:
            text, args = _request(rng, tool, schemas)
            asks.append(text)
            calls.append({"type": "function", "function": {"name": tool["function"]["name"], "arguments": args}})
        user = " Then ".join(asks)
        answer = {"role": "assistant", "content": "", "tool_calls": calls}
    rng.shuffle(offered)
    return {"messages": [{"role": "user", "content": user}, answer], "tools": offered}


def prompt_key(record: dict) -> str:
    """What the model is shown (user turn + offered tool names), as a comparable string."""
    return json.dumps([record["messages"][0]["content"], [t["function"]["name"] for t in record["tools"]]])


def _bucket(record: dict) -> str:
    h = int.from_bytes(hashlib.sha256(record["messages"][0]["content"].encode()).digest()[:8], "big")
    return "heldout" if h % HELDOUT_BUCKETS == 0 else "train"


def check_curricula(**curricula: float) -> None:
    """ValueError naming the curriculum whose value is out of range: the record shares must be in [0, 1)
    (1 would leave no task record), `echo_numbers` (a share of drill values) in [0, 1]."""
    for name, v in curricula.items():
        if name == "echo_numbers" and not 0.0 <= v <= 1.0:
            raise ValueError(f"tool_task: {name} must be in [0, 1], got {v}")
        if name != "echo_numbers" and not 0.0 <= v < 1.0:
            raise ValueError(f"tool_task: {name} must be in [0, 1), got {v}")


def generate_record(index: int, seed: int, split: str, schemas: TaskSchemas, *, echo_share: float = 0.0,
                    unoffered_share: float = 0.0, echo_numbers: float = 0.0, check_share: float = 0.0) -> dict:
    """Record `index` of stream (`seed`, `split`): draws until the user turn lies in `split`'s bucket.
    Training curricula (0 = the task): `echo_share`, the probability of a copy-drill record (`_echo`),
    `echo_numbers` the share of its values that are integers; `unoffered_share`, of an extra request for
    a function that is not offered (answered in text); `check_share`, of an offer-check drill."""
    check_curricula(echo_share=echo_share, unoffered_share=unoffered_share, echo_numbers=echo_numbers,
                    check_share=check_share)
    if split not in SPLITS:
        raise ValueError(f"tool_task: split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(f"clover-tool-task:{seed}:{split}:{index}")
    while True:
        rec = _draw(rng, schemas, echo_share, unoffered_share, echo_numbers, check_share)
        if _bucket(rec) == split:
            return rec


def generate_records(n: int, seed: int, split: str, schemas: TaskSchemas, **curricula: float) -> list[dict]:
    """Records 0..n-1 of stream (`seed`, `split`); `curricula`: `CURRICULA` keywords of `generate_record`."""
    return [generate_record(i, seed, split, schemas, **curricula) for i in range(n)]


def assert_disjoint(train: Sequence[dict], heldout: Sequence[dict]) -> None:
    """AssertionError naming a user turn that both lists show (the splits must never share one)."""
    seen = {r["messages"][0]["content"] for r in train}
    for r in heldout:
        assert r["messages"][0]["content"] not in seen, \
            f"tool_task: held-out user turn also in train: {r['messages'][0]['content']!r}"


def write_jsonl(path: str | Path, records: Sequence[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bfcl", required=True, help="BFCL question file (e.g. .../bfcl/BFCL_v4_simple_python.json)")
    ap.add_argument("--max-functions", type=int, default=32)
    ap.add_argument("--max-values", type=int, default=256)
    ap.add_argument("--value-words", type=int, default=0, help="> 0: string values are 1-3 of that many words")
    ap.add_argument("--quote-values", action="store_true", help="the user quotes string values")
    ap.add_argument("--name-tools", action="store_true", help="the user names functions as written, in quotes")
    ap.add_argument("--no-unoffered-requests", action="store_true",
                    help="no turn asks for a function that is not offered (the no-call turns are small talk)")
    ap.add_argument("--split", choices=SPLITS, default="heldout")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    schemas = load_schemas(a.bfcl, a.max_functions, a.max_values, a.value_words, a.quote_values, a.name_tools,
                           not a.no_unoffered_requests)
    print(write_jsonl(a.out, generate_records(a.n, a.seed, a.split, schemas)))


if __name__ == "__main__":
    main()
