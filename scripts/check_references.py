#!/usr/bin/env python3
"""Every file reference in the repository resolves inside it.

Scans the tracked text files for repository paths (docs/x.md, src/..., include/kda/..., and
the other top-level directories) and for relative Markdown links, and reports each that names
no file or directory of the checkout, and every reference to the spec folder outside the
repository. Prints one line per problem and "references: N checked, M dangling"; exits 1 when
any dangles. Usage: scripts/check_references.py [REPO_ROOT]
"""
import os
import re
import subprocess
import sys

root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
TOP = r"(?:docs|src|include|tests|scripts|bench|examples|configs|graphs)"
PATH = re.compile(r"(?<![\w./-])(" + TOP + r"/[A-Za-z0-9_.\-/]*[A-Za-z0-9_])")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
OUTSIDE = re.compile(r"(?:\.\./)+shared/|/shared/spec|shared/spec/")
TEXT_ENDINGS = (".md", ".h", ".cuh", ".cpp", ".cu", ".sh", ".py", ".build", ".txt", ".yaml", ".csv")

files = subprocess.run(["git", "-C", root, "ls-files"], capture_output=True, text=True, check=True).stdout.split()
files = [f for f in files if f.endswith(TEXT_ENDINGS) or os.path.basename(f) in ("run", "meson.build")]
files = [f for f in files if f != "scripts/check_references.py"]  # its examples and patterns name no file


def exists(rel, base_dir):
    """A file or directory, or a stem naming one (a program built from examples/x.cpp, a module
    of src/runtime/x.h and x.cpp)."""
    for candidate in (os.path.join(root, rel), os.path.join(root, base_dir, rel)):
        candidate = os.path.normpath(candidate)
        if os.path.exists(candidate):
            return True
        folder, stem = os.path.split(candidate)
        if os.path.isdir(folder) and any(name.startswith(stem + ".") for name in os.listdir(folder)):
            return True
    return False


checked = dangling = 0
for f in files:
    try:
        text = open(os.path.join(root, f), encoding="utf-8").read()
    except (UnicodeDecodeError, FileNotFoundError):
        continue
    base = os.path.dirname(f)
    for n, line in enumerate(text.splitlines(), 1):
        if OUTSIDE.search(line):
            dangling += 1
            print(f"{f}:{n}: refers to a folder outside the repository: {line.strip()}")
        # A path followed by ":<line>" is a file named in an example error message.
        # A path followed by ":<line>" is a file named in an example error message; one on a
        # line that says "not a file" is a name given as a source.
        if "not a file" in line:
            continue
        refs = [m.group(1) for m in PATH.finditer(line) if not re.match(r":\d", line[m.end():m.end() + 2])]
        if f.endswith(".md"):
            refs += [m.group(1) for m in LINK.finditer(line) if "://" not in m.group(1)]
        for ref in refs:
            # Build outputs, globs and placeholders name no file of the checkout.
            if any(c in ref for c in "*<>{}$") or ref.startswith(("build", "/")) or "no-such" in ref:
                continue
            checked += 1
            if not exists(ref.rstrip("/."), base):
                dangling += 1
                print(f"{f}:{n}: {ref} does not exist in the repository")
print(f"references: {checked} checked, {dangling} dangling")
sys.exit(1 if dangling else 0)
