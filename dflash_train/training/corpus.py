"""The Python-stdlib corpus: the tiny target's training text and the trainer's built-in prompts.

One rule for both sides: `tools/build_tiny_target.py` trains the bundled target on it, and
`data.py` draws the demo drafter's prompts from it (`builtin:stdlib-*`), so the split between
what the target trained on and what it did not is written once, here.

- `collect_corpus`: the running interpreter's stdlib ``*.py`` files (``sysconfig.get_paths()["stdlib"]``),
  walked in sorted order, test directories and data tables skipped, files > 200 KB skipped,
  capped at `MAX_CORPUS_CHARS` characters; ~2% of the files (chosen by a hash of their
  relative path) are held out.
- `collect_chat_pairs`: from the same files, a documented public function's name, arguments
  and first docstring sentence as a coding request (phrased like the built-in eval suite's),
  its source as the answer. One function in `PAIR_SPARE_MODULUS` (by a hash of its qualified
  name) is kept out of the target's pairs: the demo drafter's prompts come from those.

Both are deterministic for a given stdlib.
"""
from __future__ import annotations

import ast
import hashlib
import os
import re
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

# ---- corpus -----------------------------------------------------------------
MAX_CORPUS_CHARS = 12_000_000  # cap on total characters (train + held-out)
MAX_FILE_BYTES = 200_000
HELDOUT_MODULUS = 50  # sha1(relpath) % 50 == 0  ->  ~2% of files held out
SKIP_DIR_NAMES = {
    "test",
    "tests",
    "idle_test",
    "__pycache__",
    "site-packages",
    "dist-packages",
}
# data tables rather than code (codec charmaps, entity dicts): skipped so greedy
# output is code, not "0x00b -> LATIN CAPITAL LETTER" tables
SKIP_TOP_DIRS = {"encodings", "pydoc_data"}
SKIP_FILES = {"html/entities.py"}

# ---- chat pairs ---------------------------------------------------------------
PAIR_SPARE_MODULUS = 10  # sha1(rel:qualname) % 10 == 0 -> not in the target's pairs
PAIR_MIN_LINES = 6  # short answers teach the model to stop after a line or two
PAIR_MAX_CHARS = 2400  # longer answers are cut by the 256-token window anyway


# ------------------------------------------------------------------------------
# corpus
# ------------------------------------------------------------------------------
def _corpus_files(stdlib_root: str | None, max_chars: int):
    """(root, [(relpath, text, held_out)], skipped_big, skipped_undecodable), sorted by path."""
    root = Path(stdlib_root or sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        top = Path(dirpath) == root
        dirnames[:] = sorted(
            d for d in dirnames if d not in SKIP_DIR_NAMES and not (top and d in SKIP_TOP_DIRS)
        )
        for fn in sorted(filenames):
            if fn.endswith(".py"):
                files.append(Path(dirpath) / fn)
    files.sort(key=lambda p: p.relative_to(root).as_posix())

    out = []
    n_chars = 0
    skipped_big = skipped_decode = 0
    for p in files:
        rel = p.relative_to(root).as_posix()
        if rel in SKIP_FILES:
            continue
        if p.stat().st_size > MAX_FILE_BYTES:
            skipped_big += 1
            continue
        try:
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped_decode += 1
            continue
        if not text.strip():
            continue
        if n_chars + len(text) > max_chars:
            break
        n_chars += len(text)
        h = int(hashlib.sha1(rel.encode()).hexdigest(), 16)
        out.append((rel, text, h % HELDOUT_MODULUS == 0))
    return root, out, skipped_big, skipped_decode


def collect_corpus(stdlib_root: str | None = None, max_chars: int = MAX_CORPUS_CHARS):
    """Return (train_texts, heldout_texts, stats). Deterministic for a given stdlib."""
    root, files, skipped_big, skipped_decode = _corpus_files(stdlib_root, max_chars)
    train = [(r, t) for r, t, held in files if not held]
    heldout = [(r, t) for r, t, held in files if held]
    stats = dict(
        stdlib_root=str(root),
        n_train_files=len(train),
        n_heldout_files=len(heldout),
        n_chars=sum(len(t) for _, t, _ in files),
        n_train_chars=sum(len(t) for _, t in train),
        n_heldout_chars=sum(len(t) for _, t in heldout),
        skipped_big=skipped_big,
        skipped_undecodable=skipped_decode,
        heldout_files=[r for r, _ in heldout],
    )
    return [t for _, t in train], [t for _, t in heldout], stats


# ------------------------------------------------------------------------------
# chat pairs
# ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChatPair:
    qualname: str  # relpath:Class.method
    name: str
    args: str
    ask: str  # the user turn
    answer: str  # the function's source, dedented


# Requests phrased like the built-in eval suite's ("Write a Python function f(x) that ...").
_ASKS_THAT = (
    "Write a Python function {name}({args}) that {doc3}.",
    "Implement {name}({args}) in Python: it should {doc}.",
    "Define a Python function {name}({args}). It should {doc}.",
    "In Python, write {name}({args}), which should {doc}.",
)
_ASKS_PLAIN = ("Write a Python function {name}({args}). {Doc}.", "Implement {name}({args}) in Python. {Doc}.")
_ASKS_SIGNATURE = ("Write a Python function {name}({args}).", "Implement {name}({args}) in Python.")
_NOT_VERBS = {"a", "an", "the", "this", "these", "that", "if", "for", "in", "on", "used", "called", "internal",
              "helper", "private", "deprecated", "like", "same", "see", "note", "as", "when", "it", "true"}


def _third_person(word: str) -> str:
    """'Return' -> 'returns', 'Apply' -> 'applies', 'Fetch' -> 'fetches' (docstrings are imperative)."""
    w = word.lower()
    if w.endswith(("ss", "sh", "ch", "x", "z", "o")):
        return w + "es"
    if w.endswith("y") and len(w) > 1 and w[-2] not in "aeiou":
        return w[:-1] + "ies"
    return w if w.endswith("s") else w + "s"


def _first_sentence(doc: str) -> str | None:
    para = " ".join(doc.strip().split("\n\n")[0].split())
    m = re.match(r"([A-Z][^.!?]{9,150})[.!?](\s|$)", para)
    return m.group(1) if m and not re.search(r"[`>{}]|::", m.group(1)) else None


def _ask(qualname: str, name: str, args: str, sentence: str | None) -> str:
    k = int(hashlib.sha1(qualname.encode()).hexdigest(), 16)
    if sentence is None:  # undocumented: the signature alone
        return _ASKS_SIGNATURE[k % len(_ASKS_SIGNATURE)].format(name=name, args=args)
    first, _, rest = sentence.partition(" ")
    if first.lower() in _NOT_VERBS or not first.isalpha() or not rest:
        return _ASKS_PLAIN[k % len(_ASKS_PLAIN)].format(name=name, args=args, Doc=sentence)
    doc = sentence[0].lower() + sentence[1:]
    return _ASKS_THAT[k % len(_ASKS_THAT)].format(name=name, args=args, doc=doc,
                                                  doc3=f"{_third_person(first)} {rest}")


def extract_pairs(rel: str, text: str) -> list[ChatPair]:
    """Chat pairs from one file's documented public functions and methods (source order)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)
    out: list[ChatPair] = []

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if child.name.startswith("_"):
                    continue
                doc = ast.get_docstring(child)
                sentence = _first_sentence(doc) if doc else None
                src = textwrap.dedent("".join(lines[child.lineno - 1 : child.end_lineno])).rstrip()
                if (len(src) > PAIR_MAX_CHARS or src.count("\n") + 1 < PAIR_MIN_LINES
                        or not src.startswith(("def ", "async def "))):
                    continue
                a = child.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                names += [f"*{a.vararg.arg}"] if a.vararg else []
                names += [f"**{a.kwarg.arg}"] if a.kwarg else []
                args = ", ".join(names)
                qual = f"{rel}:{prefix}{child.name}"
                out.append(ChatPair(qual, child.name, args, _ask(qual, child.name, args, sentence), src))

    visit(tree, "")
    return out


def collect_chat_pairs(stdlib_root: str | None = None, max_chars: int = MAX_CORPUS_CHARS) -> dict[str, list[ChatPair]]:
    """Chat pairs by split: "train" (the target trains on them), "spare" (from the target's
    training files but kept out of its pairs: the demo drafter's requests), "heldout" (from
    the held-out files). Deterministic for a given stdlib."""
    _, files, _, _ = _corpus_files(stdlib_root, max_chars)
    out: dict[str, list[ChatPair]] = {"train": [], "spare": [], "heldout": []}
    for rel, text, held in files:
        for pair in extract_pairs(rel, text):
            spare = int(hashlib.sha1(pair.qualname.encode()).hexdigest(), 16) % PAIR_SPARE_MODULUS == 0
            out["heldout" if held else "spare" if spare else "train"].append(pair)
    return out
