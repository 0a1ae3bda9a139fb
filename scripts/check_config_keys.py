#!/usr/bin/env python3
"""Every config key docs/config.md lists is one the parser reads, and the other way round.

Takes the keys of docs/config.md's key tables (the rows "| `key` | ..." under "### Top level",
"### `model`", "### `runtime`", "### `tensor_parallel`" and "### `pools`") and the keys
src/config/config_yaml.cpp accepts (the known-key list of each Reader::section call, in
read_model, read_runtime, read_pools, read_tensor_parallel and, for the top level, parse), as
paths such as runtime.max_checkpoints. Prints each key found on one side only and
"config keys: N in docs/config.md and the parser, M on one side only"; exits 1 when M > 0.
Usage: scripts/check_config_keys.py [REPO_ROOT]
"""
import os
import re
import sys

root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
DOC = "docs/config.md"
PARSER = "src/config/config_yaml.cpp"


def read(rel):
    with open(os.path.join(root, rel), encoding="utf-8") as f:
        return f.read()


def doc_keys(text):
    """Key paths of the doc's key tables: a heading "### Top level" or "### `section`" starts one."""
    keys, section = set(), None
    for line in text.splitlines():
        if line.startswith("#"):
            heading = re.match(r"### (?:Top level|`(\w+)`)", line)
            section = (heading.group(1) or "") if heading else None
            continue
        row = re.match(r"\| `(\w+)` \|", line)
        if row and section is not None:
            keys.add(f"{section}.{row.group(1)}" if section else row.group(1))
    return keys


def parser_keys(text):
    """Key paths of the known-key lists passed to r.section, each under the section its enclosing
    function reads (read_<section>, or parse for the top level)."""
    keys = set()
    functions = [(m.start(), m.group(1) or "") for m in re.finditer(r"^(?:void read_(\w+)|Config parse)\(", text, re.M)]
    for call in re.finditer(r"r\.section\([^{;]*\{([^}]*)\}", text):
        enclosing = [name for start, name in functions if start < call.start()]
        if not enclosing:
            sys.exit(f"{PARSER}: an r.section call outside read_<section> and parse")
        section = enclosing[-1]
        for key in re.findall(r'"(\w+)"', call.group(1)):
            keys.add(f"{section}.{key}" if section else key)
    return keys


documented, parsed = doc_keys(read(DOC)), parser_keys(read(PARSER))
if not documented or not parsed:
    sys.exit(f"config keys: found {len(documented)} in {DOC} and {len(parsed)} in {PARSER}; the patterns no longer match")
for key in sorted(documented - parsed):
    print(f"{DOC}: {key} is documented, but {PARSER} does not read it")
for key in sorted(parsed - documented):
    print(f"{PARSER}: {key} is read, but {DOC} does not list it")
one_side = len(documented ^ parsed)
print(f"config keys: {len(documented & parsed)} in {DOC} and the parser, {one_side} on one side only")
sys.exit(1 if one_side else 0)
