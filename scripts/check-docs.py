#!/usr/bin/env python3
"""Checks the documentation's links (scripts/test.sh runs it after `mdbook build docs`).

For README.md, ARCHITECTURE.md and every docs/src/*.md: each relative link or image (inline
`[text](target)`, `![alt](target)`, a reference definition `[id]: target`, an HTML `href`/`src`)
names a file or directory that exists in this repository, and each `#anchor` (in the same file
or in another Markdown file) is one of the target's headings as GitHub and mdBook spell them: the
heading's text, lower case, letters, digits, `_` and `-` kept, spaces made `-`, everything else
dropped, `-1`, `-2`, ... added to repeats; an mdBook `{#id}` or an HTML `id`/`name` counts too.
Also: every chapter file in docs/src is listed in docs/src/SUMMARY.md (mdbook itself fails on a
listed chapter that is missing). Links with a scheme (`https:`, `mailto:`) are not followed.
Text in code blocks and code spans is not a link.

Usage: scripts/check-docs.py [FILE.md ...]   (default: the files above). Exit 1 on any problem.
"""
import glob
import os
import re
import sys

ROOT = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

FENCE = re.compile(r"^ {0,3}(```+|~~~+)")
# A code span: a run of backticks, then anything but a blank line, then the same run.
CODE_SPAN = re.compile(r"(`+)((?:[^`\n]|`(?!\1)|\n(?![ \t]*\n))+?)\1(?!`)")
INLINE = re.compile(
    r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*(<[^>\n]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)"
    r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)"
)
REF_DEF = re.compile(r"^ {0,3}\[([^\]]+)\]:\s*(<[^>\n]*>|\S+)", re.M)
HTML_ATTR = re.compile(r"<(?:a|img|source)\b[^>]*?\s(?:href|src)\s*=\s*[\"']([^\"']*)[\"']", re.I)
HTML_ID = re.compile(r"<[a-z][^>]*?\s(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.I)
ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def strip_code(text):
    """The text with fenced blocks and code spans blanked (same length, newlines kept)."""
    lines = text.split("\n")
    fence = None
    for i, line in enumerate(lines):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * len(m.group(1))
            lines[i] = ""
        elif fence is not None:
            if line.strip().startswith(fence) and set(line.strip()) == {fence[0]}:
                fence = None
            lines[i] = ""
    text = "\n".join(lines)
    return CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def heading_text(raw):
    """What a heading shows: code spans' text, links' text, no emphasis marks nor HTML tags."""
    t = re.sub(r"(`+)(.+?)\1", lambda m: m.group(2).strip(), raw)
    t = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", t)
    t = re.sub(r"<[^>]+>", "", t)
    t = t.replace("*", "")
    return t.strip()


def slug(text):
    out = []
    for ch in text.lower():
        if ch.isalnum() or ch in "_-":
            out.append(ch)
        elif ch == " ":
            out.append("-")
    return "".join(out)


_anchor_cache = {}


def anchors(path):
    """Every anchor a Markdown file defines."""
    if path in _anchor_cache:
        return _anchor_cache[path]
    with open(path, encoding="utf-8") as f:
        text = f.read()
    found, seen = set(), {}
    lines = text.split("\n")
    fence = None
    prev = ""
    for line in lines:
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0]
            prev = ""
            continue
        if fence is not None:
            if line.strip() and set(line.strip()) == {fence}:
                fence = None
            continue
        title = None
        h = ATX.match(line)
        if h:
            title = h.group(2) or ""
        elif prev.strip() and not prev.lstrip().startswith(("|", "-", "*", ">", "#")) and re.match(
            r"^ {0,3}(=+|-+)[ \t]*$", line
        ):
            title = prev.strip()
        if title is not None:
            custom = re.search(r"\s*\{#([^}\s]+)\}\s*$", title)
            if custom:
                found.add(custom.group(1))
                title = title[: custom.start()]
            base = slug(heading_text(title))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else "%s-%d" % (base, n))
        prev = line
    found.update(HTML_ID.findall(strip_code(text)))
    _anchor_cache[path] = found
    return found


def links(text):
    """(line number, target) for every link in text, code excluded."""
    clean = strip_code(text)

    def line_of(pos):
        return clean.count("\n", 0, pos) + 1

    for m in INLINE.finditer(clean):
        yield line_of(m.start()), m.group(2).strip("<>")
    for m in REF_DEF.finditer(clean):
        yield line_of(m.start()), m.group(2).strip("<>")
    for m in HTML_ATTR.finditer(clean):
        yield line_of(m.start()), m.group(1)


def check_file(path):
    problems = []
    rel = os.path.relpath(path, ROOT)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for line, target in links(text):
        if not target or SCHEME.match(target) or target.startswith("//"):
            continue
        where = "%s:%d: link %r" % (rel, line, target)
        file_part, _, anchor = target.partition("#")
        file_part = re.sub(r"%20", " ", file_part.split("?")[0])
        if file_part.startswith("/"):
            problems.append("%s: an absolute path (GitHub and mdBook resolve it differently)" % where)
            continue
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
        if not os.path.realpath(dest).startswith(ROOT + os.sep) and os.path.realpath(dest) != ROOT:
            problems.append("%s: leads out of the repository" % where)
            continue
        if not os.path.exists(dest):
            problems.append("%s: no such file %s" % (where, os.path.relpath(dest, ROOT)))
            continue
        if anchor:
            if os.path.isdir(dest) or not dest.endswith(".md"):
                problems.append("%s: an anchor into something that is not a Markdown file" % where)
            elif anchor not in anchors(dest):
                problems.append(
                    "%s: %s has no heading with the anchor #%s" % (where, os.path.relpath(dest, ROOT), anchor)
                )
    return problems


def check_summary():
    """Every chapter in docs/src is in SUMMARY.md."""
    src = os.path.join(ROOT, "docs", "src")
    summary = os.path.join(src, "SUMMARY.md")
    if not os.path.exists(summary):
        return ["docs/src/SUMMARY.md: missing"]
    with open(summary, encoding="utf-8") as f:
        listed = {
            os.path.normpath(os.path.join(src, t.split("#")[0])) for _, t in links(f.read()) if t and not SCHEME.match(t)
        }
    problems = []
    for chapter in sorted(glob.glob(os.path.join(src, "**", "*.md"), recursive=True)):
        if chapter != summary and os.path.normpath(chapter) not in listed:
            problems.append("%s: not listed in docs/src/SUMMARY.md" % os.path.relpath(chapter, ROOT))
    return problems


def main(argv):
    if argv:
        files = [os.path.abspath(a) for a in argv]
        problems = []
    else:
        files = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "ARCHITECTURE.md")]
        files += sorted(glob.glob(os.path.join(ROOT, "docs", "src", "**", "*.md"), recursive=True))
        problems = check_summary()
    count = 0
    for path in files:
        problems += check_file(path)
        with open(path, encoding="utf-8") as f:
            count += sum(1 for _ in links(f.read()))
    for p in problems:
        print("check-docs: " + p, file=sys.stderr)
    if problems:
        print("check-docs: %d broken link(s) in %d file(s)" % (len(problems), len(files)), file=sys.stderr)
        return 1
    print("check-docs: %d links in %d files, all resolve" % (count, len(files)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
