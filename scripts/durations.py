"""Writes tests/durations.json, the seconds each test file took, from the output of a whole run
with ``--durations=0``; conftest.py starts the longest files first, so that the two test processes
end together:

    ./scripts/test.sh --durations=0 | tee /tmp/run.log
    .venv/bin/python scripts/durations.py /tmp/run.log

Run it on a fresh clone, as CI runs: a checkout that has run the suite before keeps caches
(mypy's) that make some files far quicker than CI finds them.
"""
import collections
import json
import os
import re
import sys

LINE = re.compile(r"^([\d.]+)s (?:setup|call|teardown)\s+(\S+)")

if __name__ == "__main__":
    seconds: collections.Counter = collections.Counter()
    with open(sys.argv[1], encoding="utf-8") as f:
        for line in f:
            found = LINE.match(line.strip())
            if found:
                seconds[found.group(2).split("::")[0]] += float(found.group(1))
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "durations.json")
    root = os.path.dirname(out) + "/.."
    with open(out, encoding="utf-8") as f:  # files whose every test took under 5 ms are not listed: kept
        for name, took in json.load(f).items():
            if name not in seconds and os.path.exists(os.path.join(root, name)):
                seconds[name] = took
    with open(out, "w", encoding="utf-8") as f:
        json.dump({k: round(v, 1) for k, v in sorted(seconds.items())}, f, indent=0)
        f.write("\n")
    print(f"{out}: {len(seconds)} entries, {sum(seconds.values()):.0f} s in all")
