#!/usr/bin/env python3
"""Writes the tau-bench trace with tau-bench's own system prompt and tools
before each call's conversation (README.md here). Deterministic: same
inputs, same bytes out.

    with_system.py OUT_DIR [RAW_DIR]   (RAW_DIR: ../shared/traces/taubench/raw)
"""
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
AIRLINE = ("flight", "reservation", "baggage", "cabin")
RETAIL = ("order", "item", "exchange", "return")


def prefix(domain):
    wiki = (HERE / f"{domain}-wiki.md").read_text()
    tools = (HERE / f"{domain}-tools.json").read_text()
    return f"{wiki}\n\n# Tools\n\n{tools}\n\n"


def domain_of(calls):
    text = " ".join(c["input"] for c in calls).lower()
    airline = sum(text.count(w) for w in AIRLINE)
    retail = sum(text.count(w) for w in RETAIL)
    if airline == retail:
        return None
    return "airline" if airline > retail else "retail"


def main():
    out = pathlib.Path(sys.argv[1])
    raw = pathlib.Path(sys.argv[2]) if len(sys.argv) > 2 else HERE.parents[2] / "../shared/traces/taubench/raw"
    out.mkdir(parents=True, exist_ok=True)
    prefixes = {d: prefix(d) for d in ("airline", "retail")}
    domains = {}
    for path in sorted(raw.glob("*.jsonl")):
        calls = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        domain = domain_of(calls)
        domains[domain] = domains.get(domain, 0) + 1
        with open(out / path.name, "w") as f:
            for call in calls:
                if domain:
                    call["input"] = prefixes[domain] + call["input"]
                f.write(json.dumps(call) + "\n")
    print(json.dumps({"sessions_by_domain": {str(k): v for k, v in sorted(domains.items(), key=str)}}))


if __name__ == "__main__":
    main()
