"""Synthetic agent traces (our own generator): seeded, deterministic, learnable by a tiny model.

Each record is a canonical chat record (``sft.data.records``) built from a small set of tools:
the user asks in one of a few phrasings, the assistant calls a tool whose JSON arguments are
**verbatim spans of the user message**, the tool returns a JSON result, and the assistant answers
with a **fixed template filled from that result**. Scenario mix: one call (50%), two parallel calls
(15%), two calls over two user turns (15%), no tool needed (small talk / a clarifying question when
the request lacks its argument, 20%). 30% of records carry ``reasoning_content`` on every
assistant turn; half have a system prompt; tools offered = the ones needed + up to two
distractors, shuffled.

Record ``i`` depends only on ``(seed, i)``, so ``generate_records(n, seed)[:m] ==
generate_records(m, seed)``. Usage: ``python -m sft.data.synthetic --n 1000 --seed 0 --out f.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any, Callable

__all__ = ["TOOLS", "generate_record", "generate_records", "write_jsonl"]


def _tool(name: str, description: str, props: dict[str, dict], required: list[str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": props, "required": required}}}


_S = {"type": "string"}
TOOLS: dict[str, dict] = {t["function"]["name"]: t for t in [
    _tool("get_weather", "Current weather in a city.",
          {"city": {**_S, "description": "City name"},
           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"]),
    _tool("search_flights", "Search flights between two cities on a date.",
          {"origin": {**_S, "description": "Departure city"},
           "destination": {**_S, "description": "Arrival city"},
           "date": {**_S, "description": "Date, YYYY-MM-DD"}}, ["origin", "destination", "date"]),
    _tool("calculator", "Evaluate an arithmetic expression.",
          {"expression": {**_S, "description": "e.g. 12 * 7"}}, ["expression"]),
    _tool("lookup_order", "Status of a customer order.",
          {"order_id": {**_S, "description": "Order id, e.g. A1234"}}, ["order_id"]),
    _tool("convert_currency", "Convert an amount between currencies.",
          {"amount": {"type": "number"}, "from_currency": {**_S, "description": "ISO code"},
           "to_currency": {**_S, "description": "ISO code"}},
          ["amount", "from_currency", "to_currency"]),
    _tool("get_time", "Current local time in a city.",
          {"city": {**_S, "description": "City name"}}, ["city"]),
]}

_CITIES = ["Paris", "Rome", "Tokyo", "Berlin", "Madrid", "Lisbon", "Oslo", "Cairo", "Lima",
           "Seoul", "Toronto", "Sydney", "Dublin", "Vienna", "Prague", "Nairobi", "Boston",
           "Denver", "Mumbai", "Hanoi"]
_CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy"]
_RATES = {"USD": 1.0, "EUR": 0.92, "GBP": 0.79, "JPY": 151.0, "CHF": 0.9, "CAD": 1.36}
_STATUS = ["processing", "shipped", "delivered"]
_SYSTEMS = ["You are a helpful assistant.", "You are a helpful assistant with access to tools.",
            "You are a concise assistant. Use the tools when they help."]


def _date(rng: random.Random) -> str:
    return f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


# A task = (tool name, user phrasing, arguments, result, answer, reasoning before, reasoning after).
Task = dict[str, Any]


def _weather(rng: random.Random) -> Task:
    city = rng.choice(_CITIES)
    unit = rng.choice([None, "celsius", "fahrenheit"])
    if unit is None:
        ask = rng.choice(["What's the weather in {city}?", "How is the weather in {city} today?",
                          "Is it nice outside in {city}?"]).format(city=city)
        args = {"city": city}
    else:
        ask = rng.choice(["What's the weather in {city} in {unit}?",
                          "Tell me the temperature in {city} in {unit}."]).format(city=city, unit=unit)
        args = {"city": city, "unit": unit}
    u = unit or "celsius"
    temp = rng.randint(-5, 35) if u == "celsius" else rng.randint(23, 95)
    result = {"city": city, "temperature": temp, "unit": u, "condition": rng.choice(_CONDITIONS)}
    answer = "It is {temperature} degrees {unit} and {condition} in {city}.".format(**result)
    return {"tool": "get_weather", "ask": ask, "args": args, "result": result, "answer": answer,
            "missing": "What's the weather like?", "clarify": "Which city do you want the weather for?"}


def _flights(rng: random.Random) -> Task:
    origin, destination = rng.sample(_CITIES, 2)
    date = _date(rng)
    ask = rng.choice(["Find flights from {o} to {d} on {t}.",
                      "Are there flights from {o} to {d} on {t}?",
                      "I need to fly from {o} to {d} on {t}."]).format(o=origin, d=destination, t=date)
    flights = sorted(({"flight": f"{rng.choice('ABCDEFGH')}{rng.choice('XYZ')}{rng.randint(100, 999)}",
                       "departure": f"{rng.randint(5, 22):02d}:{rng.choice(['00', '15', '30', '45'])}",
                       "price": rng.randint(60, 900)} for _ in range(rng.randint(1, 3))),
                     key=lambda f: f["price"])
    result = {"flights": flights}
    best = flights[0]
    answer = (f"I found {len(flights)} flight{'s' if len(flights) > 1 else ''} from {origin} to "
              f"{destination} on {date}. The cheapest is {best['flight']} at {best['departure']} "
              f"for ${best['price']}.")
    return {"tool": "search_flights", "ask": ask,
            "args": {"origin": origin, "destination": destination, "date": date},
            "result": result, "answer": answer, "missing": f"Find me a flight to {destination}.",
            "clarify": "Where are you flying from, and on which date?"}


def _calculator(rng: random.Random) -> Task:
    a, b = rng.randint(2, 999), rng.randint(2, 99)
    op = rng.choice(["+", "-", "*"])
    expr = f"{a} {op} {b}"
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    ask = rng.choice(["What is {e}?", "Calculate {e}.", "Can you compute {e} for me?"]).format(e=expr)
    return {"tool": "calculator", "ask": ask, "args": {"expression": expr},
            "result": {"result": value}, "answer": f"{expr} = {value}.",
            "missing": "Can you do a calculation for me?", "clarify": "Sure, which expression?"}


def _order(rng: random.Random) -> Task:
    oid = f"{rng.choice('ABCDEFGHJK')}{rng.randint(1000, 9999)}"
    status, eta = rng.choice(_STATUS), _date(rng)
    ask = rng.choice(["Where is my order {o}?", "What's the status of order {o}?",
                      "Has order {o} shipped yet?"]).format(o=oid)
    verb = "was delivered on" if status == "delivered" else "is expected on"
    answer = f"Order {oid} is {status}; it {verb} {eta}."
    return {"tool": "lookup_order", "ask": ask, "args": {"order_id": oid},
            "result": {"order_id": oid, "status": status, "eta": eta}, "answer": answer,
            "missing": "Where is my order?", "clarify": "Could you give me your order id?"}


def _currency(rng: random.Random) -> Task:
    src, dst = rng.sample(sorted(_RATES), 2)
    amount = rng.choice([rng.randint(1, 5000), rng.randint(1, 999) * 5])
    converted = round(amount * _RATES[dst] / _RATES[src], 2)
    ask = rng.choice(["Convert {a} {s} to {d}.", "How much is {a} {s} in {d}?"]).format(
        a=amount, s=src, d=dst)
    return {"tool": "convert_currency", "ask": ask,
            "args": {"amount": amount, "from_currency": src, "to_currency": dst},
            "result": {"amount": amount, "from_currency": src, "to_currency": dst,
                       "converted": converted},
            "answer": f"{amount} {src} is {converted} {dst}.",
            "missing": f"How much is that in {dst}?", "clarify": "Which amount and currency?"}


def _time(rng: random.Random) -> Task:
    city = rng.choice(_CITIES)
    t = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
    ask = rng.choice(["What time is it in {c}?", "Tell me the local time in {c}."]).format(c=city)
    return {"tool": "get_time", "ask": ask, "args": {"city": city},
            "result": {"city": city, "time": t}, "answer": f"It is {t} in {city}.",
            "missing": "What time is it there?", "clarify": "Which city do you mean?"}


_TASKS: list[Callable[[random.Random], Task]] = [_weather, _flights, _calculator, _order,
                                                 _currency, _time]
_SMALL_TALK = [("Hi!", "Hello! How can I help you today?"),
               ("Thanks, that's all.", "You're welcome! Have a great day."),
               ("Good morning.", "Good morning! What can I do for you?")]


def _call(task: Task) -> dict:
    return {"type": "function", "function": {"name": task["tool"], "arguments": dict(task["args"])}}


def _think_call(tasks: list[Task]) -> str:
    parts = [f"call {t['tool']} with {json.dumps(t['args'])}" for t in tasks]
    return "The user needs a tool. I will " + " and ".join(parts) + "."


def _assistant(content: str, think: str | None, calls: list[dict] | None = None) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = calls
    if think is not None:
        msg["reasoning_content"] = think
    return msg


def _tool_turns(tasks: list[Task], think: bool) -> list[dict]:
    """assistant call(s) -> tool result(s) -> templated answer."""
    out = [_assistant("", _think_call(tasks) if think else None, [_call(t) for t in tasks])]
    out += [{"role": "tool", "content": json.dumps(t["result"])} for t in tasks]
    answer = " ".join(t["answer"] for t in tasks)
    out.append(_assistant(answer, "I have the results and will report them." if think else None))
    return out


def generate_record(index: int, seed: int = 0) -> dict:
    """Record ``index`` of the stream ``seed`` (see the module docstring)."""
    rng = random.Random(f"clover-synthetic:{seed}:{index}")
    think = rng.random() < 0.3
    messages: list[dict] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(_SYSTEMS)})
    scenario = rng.choices(["single", "parallel", "sequential", "none"], [50, 15, 15, 20])[0]
    makers = rng.sample(_TASKS, 2)
    tasks = [makers[0](rng), makers[1](rng)]
    if scenario == "single":
        used = tasks[:1]
        messages.append({"role": "user", "content": tasks[0]["ask"]})
        messages += _tool_turns(tasks[:1], think)
    elif scenario == "parallel":
        used = tasks
        messages.append({"role": "user", "content": f"{tasks[0]['ask']} Also, {tasks[1]['ask']}"})
        messages += _tool_turns(tasks, think)
    elif scenario == "sequential":
        used = tasks
        for t in tasks:
            messages.append({"role": "user", "content": t["ask"]})
            messages += _tool_turns([t], think)
    else:
        used = tasks[:1]
        if rng.random() < 0.5:
            ask, reply = rng.choice(_SMALL_TALK)
            why = "No tool is needed; I will reply directly."
        else:
            ask, reply = tasks[0]["missing"], tasks[0]["clarify"]
            why = "The request lacks a required argument; I will ask for it."
        messages.append({"role": "user", "content": ask})
        messages.append(_assistant(reply, why if think else None))
    names = [t["tool"] for t in used]
    distractors = [n for n in rng.sample(sorted(TOOLS), rng.randint(0, 2)) if n not in names]
    offered = list(dict.fromkeys(names + distractors))
    rng.shuffle(offered)
    return {"messages": messages, "tools": [TOOLS[n] for n in offered]}


def generate_records(n: int, seed: int = 0) -> list[dict]:
    """The first ``n`` records of stream ``seed``."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return [generate_record(i, seed) for i in range(n)]


def write_jsonl(path: str | Path, n: int, seed: int = 0) -> Path:
    """Write ``generate_records(n, seed)`` as JSON Lines; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for rec in generate_records(n, seed):
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    print(write_jsonl(a.out, a.n, a.seed))


if __name__ == "__main__":
    main()
