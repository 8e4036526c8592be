"""The documentation's pointers into the code hold, and its tables stay tables.

For README.md and every docs/*.md:

- every ``NOTE [Title]`` that names a file or folder next to it ("NOTE
  [Title] in `hp/pipeline/executor.cpp`", "... in lower.cpp", "... in
  `hp/pipeline/stage`" for stage.h or stage.cpp, "... in `hp/distributed`"
  for a folder) is found in that file, or in one of the files the stem or
  folder names; a NOTE named with no path is found somewhere in the code
  (hp/, python/, tests/, bench/, scripts/, tools/, examples/, cmake/ and the
  top CMakeLists.txt: *.h, *.cpp, *.py, *.sh, *.cmake, CMakeLists.txt);
- every cell of a markdown table is at most 500 characters (the long why
  belongs in the code's NOTEs, which a cell can name), and no row is
  continued below its table (a line of text directly under the last row,
  which markdown makes one more row, or a "**...** (continued):" paragraph);
- every relative link ``[text](path)`` points to a file or folder that
  exists, and where it names an ``#anchor`` in a markdown file, a heading
  of that file makes that anchor.

Reads files only: no extension, no torch. Runs under pytest or alone
(``python3 tests/python/test_docs.py``).
"""

import glob
import os
import re
import sys
import unicodedata

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CELL_LIMIT = 500

# Where a NOTE named without a path may live, and which files count.
CODE_DIRS = ("hp", "python", "tests", "bench", "scripts", "tools", "examples", "cmake")
CODE_SUFFIXES = (".h", ".cpp", ".py", ".sh", ".cmake")
SKIP_DIRS = {".git", ".venv", "__pycache__", "third_party"}

# A path-like word: has a folder separator or ends in a file suffix.
PATH_SUFFIXES = (".h", ".cpp", ".py", ".sh", ".cmake", ".txt", ".md", ".yaml", ".json", ".toml",
                 ".csv", ".cfg", ".ini", ".c", ".hpp")

NOTE_RE = re.compile(r"NOTE\s+\[([^\]]+)\]")
PATH_AFTER_RE = re.compile(r"\s+in\s+(`[^`\n]+`|[^\s`]+)")
LINK_RE = re.compile(r"!?\[(?:[^\]\n]|\n(?!\n))*?\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE_RE = re.compile(r"(`+)(?:.|\n)*?\1")
COMMENT_MARK_RE = re.compile(r"^(?://[/!]?|#+|/\*+|\*+/?|\"\"\"|''')\s?")


def doc_files():
    """README.md and docs/*.md, as paths relative to ROOT."""
    docs = ["README.md"] + sorted(
        os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return [d for d in docs if os.path.isfile(os.path.join(ROOT, d))]


def read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def squash(text):
    return " ".join(text.split())


def without_fences(text):
    """The text with every fenced code block's lines blanked (line numbers kept)."""
    out, fence = [], None
    for line in text.split("\n"):
        stripped = line.lstrip()
        marker = re.match(r"(`{3,}|~{3,})", stripped)
        if fence is None and marker:
            fence = marker.group(1)[0] * len(marker.group(1))
            out.append("")
        elif fence is not None:
            if stripped.startswith(fence) and stripped.strip(fence[0]) == "":
                fence = None
            out.append("")
        else:
            out.append(line)
    return "\n".join(out)


def line_of(text, offset):
    return text.count("\n", 0, offset) + 1


# ---------------------------------------------------------------- the code


def all_files():
    """Every file of the work tree (relative paths), build outputs left out."""
    files = []
    for top, dirs, names in os.walk(ROOT):
        rel_top = os.path.relpath(top, ROOT)
        dirs[:] = sorted(
            d for d in dirs
            if d not in SKIP_DIRS and not d.endswith(".egg-info")
            and not (rel_top == "." and (d.startswith("build") or d.startswith(".")))
        )
        for n in names:
            files.append(os.path.normpath(os.path.join(rel_top, n)))
    return sorted(files)


def code_files(files):
    """The files a NOTE named without a path may live in."""
    out = ["CMakeLists.txt"] if "CMakeLists.txt" in files else []
    for f in files:
        if f.split(os.sep)[0] in CODE_DIRS and (
                f.endswith(CODE_SUFFIXES) or os.path.basename(f) == "CMakeLists.txt"):
            out.append(f)
    return out


_normalized = {}


def normalized(rel):
    """A file's text as one line: comment marks at line starts dropped and
    white space squashed, so a NOTE's title wrapped over comment lines reads
    as it does in prose."""
    if rel not in _normalized:
        try:
            text = read(rel)
        except (UnicodeDecodeError, OSError):
            text = ""
        lines = [COMMENT_MARK_RE.sub("", line.strip()) for line in text.split("\n")]
        _normalized[rel] = squash(" ".join(lines))
    return _normalized[rel]


def looks_like_path(word, files):
    if "/" in word or word.endswith(PATH_SUFFIXES):
        return True
    return word in files or os.path.isdir(os.path.join(ROOT, word))


def files_named(path, files):
    """The files a reference's path stands for: the file itself, files of that
    stem (``hp/pipeline/stage``: stage.h, stage.cpp), every file under a folder;
    a path without a folder (``lower.cpp``) or cut short with ``...`` names
    any file that ends so."""
    path = path.rstrip("/")
    suffix_only = path.startswith("...") or "/" not in path
    path = path.lstrip("./") if path.startswith("...") else path
    path = os.path.normpath(path) if path else path
    if not path:
        return []

    def matches(f, p):
        stem = os.path.splitext(f)[0]
        return f == p or stem == p or f.startswith(p + os.sep)

    found = [f for f in files if matches(f, path)]
    if not found and suffix_only:
        found = [f for f in files
                 if f.endswith(os.sep + path) or os.path.splitext(f)[0].endswith(os.sep + path)]
    return found


def note_references():
    """(doc, line, title, path or None) of every NOTE the docs name."""
    refs = []
    for doc in doc_files():
        text = read(doc)
        for m in NOTE_RE.finditer(text):
            title = squash(m.group(1))
            after = PATH_AFTER_RE.match(text, m.end())
            path = None
            if after:
                word = after.group(1).strip("`").strip()
                word = word.rstrip(").,;:'\"!?")
                path = word or None
            refs.append((doc, line_of(text, m.start()), title, path))
    return refs


def broken_note_references():
    files = all_files()
    code = code_files(files)
    broken = []
    for doc, line, title, path in note_references():
        needle = f"NOTE [{title}]"
        if path is not None and looks_like_path(path, files):
            named = files_named(path, files)
            if not named:
                broken.append(f"{doc}:{line}: {needle} in {path}: no such file or folder")
            elif not any(needle in normalized(f) for f in named):
                where = ", ".join(named[:4]) + (f" and {len(named) - 4} more" if len(named) > 4 else "")
                broken.append(f"{doc}:{line}: {needle} in {path}: not in {where}")
        elif not any(needle in normalized(f) for f in code):
            broken.append(f"{doc}:{line}: {needle}: in no file of "
                          f"{', '.join(d + '/' for d in CODE_DIRS)} or CMakeLists.txt")
    return broken


# ---------------------------------------------------------------- tables


def split_row(line):
    """A table row's cells (escaped pipes and pipes in code spans kept)."""
    body = line.strip()
    if body.startswith("|"):
        body = body[1:]
    if body.endswith("|") and not body.endswith("\\|"):
        body = body[:-1]
    cells, cell, code = [], [], None
    i = 0
    while i < len(body):
        ch = body[i]
        if ch == "\\" and i + 1 < len(body):
            cell.append(body[i:i + 2])
            i += 2
            continue
        if ch == "`":
            run = len(body[i:]) - len(body[i:].lstrip("`"))
            tick = "`" * run
            if code is None:
                code = tick
            elif code == tick:
                code = None
            cell.append(tick)
            i += run
            continue
        if ch == "|" and code is None:
            cells.append("".join(cell).strip())
            cell = []
        else:
            cell.append(ch)
        i += 1
    cells.append("".join(cell).strip())
    return cells


def long_table_cells():
    long = []
    for doc in doc_files():
        for n, line in enumerate(without_fences(read(doc)).split("\n"), 1):
            if not line.lstrip().startswith("|"):
                continue
            for k, cell in enumerate(split_row(line), 1):
                if len(cell) > CELL_LIMIT:
                    long.append(f"{doc}:{n}: cell {k} has {len(cell)} characters "
                                f"(at most {CELL_LIMIT}): {cell[:60]}...")
    return long


def rows_continued_below():
    """Lines of text directly under a table row (markdown reads them as rows),
    and a row's text carried on below the table ("**`--dp D`** (continued):")."""
    found = []
    for doc in doc_files():
        lines = without_fences(read(doc)).split("\n")
        for n in range(1, len(lines)):
            if (lines[n - 1].lstrip().startswith("|") and lines[n].strip()
                    and not lines[n].lstrip().startswith("|")):
                found.append(f"{doc}:{n + 1}: {lines[n].strip()[:70]}")
            elif re.match(r"\s*\*\*[^*]+\*\*\s*\(continued\)", lines[n]):
                found.append(f"{doc}:{n + 1}: a row continued below its table: "
                             f"{lines[n].strip()[:50]}")
    return found


# ---------------------------------------------------------------- links


def github_slug(heading):
    """The anchor GitHub makes of a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = text.strip().lower()
    kept = []
    for ch in text:
        cat = unicodedata.category(ch)
        if ch in " -_" or cat[0] in "LMN" or cat == "Pc":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


_anchors = {}


def anchors_of(rel):
    if rel not in _anchors:
        seen, out = {}, set()
        for line in without_fences(read(rel)).split("\n"):
            m = re.match(r"\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
            if not m:
                continue
            slug = github_slug(m.group(2))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
        _anchors[rel] = out
    return _anchors[rel]


def broken_links():
    broken = []
    for doc in doc_files():
        raw = without_fences(read(doc))
        # Code spans are not links: blank them, keeping the line breaks.
        text = INLINE_CODE_RE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), raw)
        for m in LINK_RE.finditer(text):
            target = m.group(1).strip("<>")
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                continue
            where = f"{doc}:{line_of(text, m.start())}: ({target})"
            path, _, anchor = target.partition("#")
            rel = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
            if rel.startswith(".."):
                broken.append(f"{where}: leaves the repository")
                continue
            if not os.path.exists(os.path.join(ROOT, rel)):
                broken.append(f"{where}: no such file {rel}")
                continue
            if anchor and rel.endswith(".md") and anchor not in anchors_of(rel):
                broken.append(f"{where}: no heading of {rel} makes the anchor #{anchor}")
    return broken


# ---------------------------------------------------------------- tests


def test_docs_are_found():
    docs = doc_files()
    assert "README.md" in docs and len(docs) > 5, docs


def test_note_references_resolve():
    broken = broken_note_references()
    assert not broken, (f"{len(broken)} NOTE reference(s) in the docs do not resolve (find the "
                        "NOTE with grep and name its true title or file):\n" + "\n".join(broken))


def test_note_references_are_parsed():
    # The check above reads wrapped titles and paths with or without backticks.
    refs = note_references()
    assert len(refs) > 100, len(refs)
    assert any(path for _, _, _, path in refs)
    assert all("\n" not in title and "  " not in title for _, _, title, _ in refs)


def test_table_cells_are_short():
    long = long_table_cells()
    assert not long, (f"{len(long)} table cell(s) over {CELL_LIMIT} characters (move the text "
                      "into a paragraph after the table, or name the NOTE that holds it):\n"
                      + "\n".join(long))


def test_tables_end_before_the_text_below():
    found = rows_continued_below()
    assert not found, (f"{len(found)} table row(s) continued below their table (a blank line "
                       "after the table, the text into a short cell or a paragraph of its "
                       "own):\n" + "\n".join(found))


def test_relative_links_resolve():
    broken = broken_links()
    assert not broken, f"{len(broken)} broken relative link(s):\n" + "\n".join(broken)


def test_the_checks_see_what_they_check():
    # The helpers on small inputs: a wrapped NOTE in a comment, a stem, a
    # folder, a pipe inside a code span, GitHub's anchors.
    assert "NOTE [One engine call for dw]" in squash(" ".join(
        COMMENT_MARK_RE.sub("", s.strip()) for s in ["// NOTE [One engine call", "// for dw]"]))
    files = ["hp/pipeline/stage.h", "hp/pipeline/stage.cpp", "hp/schedule/lower.cpp"]
    assert files_named("hp/pipeline/stage", files) == files[:2]
    assert files_named("hp/pipeline", files) == files[:2]
    assert files_named("lower.cpp", files) == files[2:]
    assert files_named(".../schedule/lower.cpp", files) == files[2:]
    assert split_row("| a | `x | y` | c |") == ["a", "`x | y`", "c"]
    assert github_slug("On a GPU (scripts/gpu_check.sh)") == "on-a-gpu-scriptsgpu_checksh"
    assert github_slug("`hp train --p2p`: the rings") == "hp-train---p2p-the-rings"
    assert github_slug("PP x FSDP2 against PyTorch's pipelining") == (
        "pp-x-fsdp2-against-pytorchs-pipelining")


if __name__ == "__main__":
    failed = 0
    for name, fn in sorted(globals().items()):
        if name.startswith("test_") and callable(fn):
            try:
                fn()
                print(f"ok      {name}")
            except AssertionError as e:
                failed += 1
                print(f"FAILED  {name}\n{e}\n")
    sys.exit(1 if failed else 0)
