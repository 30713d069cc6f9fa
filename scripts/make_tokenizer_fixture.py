#!/usr/bin/python3
"""Writes tests/fixtures/gpt2_tokens.json: the GPT-2 token ids of a fixed set
of byte strings, from a reference implementation of OpenAI's GPT-2 encoder.

    /usr/bin/python3 scripts/make_tokenizer_fixture.py [GPT2_DIR [OUT]]

GPT2_DIR (default data/gpt2, made by scripts/setup.sh) holds encoder.json and
vocab.bpe. Needs the `regex` module (Debian: python3-regex).

The reference is encoder.py of OpenAI's gpt-2 repository (src/encoder.py:
bytes_to_unicode, get_pairs, Encoder.bpe, Encoder.encode), transcribed below
with one extension so that any byte string can be encoded: the bytes are
decoded with 'surrogateescape' (each byte of invalid UTF-8 becomes a lone
surrogate, which the regex sees as neither letter, number nor space) and each
piece is encoded back the same way, restoring its bytes.

Output: a JSON list of {"hex": input bytes as hex, "ids": [token ids]}, one
entry per line, the same on every run.
"""
import json
import os
import random
import sys

import regex

PATTERN = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def bytes_to_unicode():
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) +
          list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(2**8):
        if b not in bs:
            bs.append(b)
            cs.append(2**8 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def get_pairs(word):
    return set(zip(word, word[1:]))


class Encoder:
    def __init__(self, encoder, bpe_merges):
        self.encoder = encoder
        self.byte_encoder = bytes_to_unicode()
        self.bpe_ranks = dict(zip(bpe_merges, range(len(bpe_merges))))
        self.cache = {}

    def bpe(self, token):
        if token in self.cache:
            return self.cache[token]
        word = tuple(token)
        pairs = get_pairs(word)
        if not pairs:
            return token
        while True:
            bigram = min(pairs, key=lambda pair: self.bpe_ranks.get(pair, float('inf')))
            if bigram not in self.bpe_ranks:
                break
            first, second = bigram
            new_word = []
            i = 0
            while i < len(word):
                try:
                    j = word.index(first, i)
                except ValueError:
                    new_word.extend(word[i:])
                    break
                new_word.extend(word[i:j])
                i = j
                if word[i] == first and i < len(word) - 1 and word[i + 1] == second:
                    new_word.append(first + second)
                    i += 2
                else:
                    new_word.append(word[i])
                    i += 1
            word = tuple(new_word)
            if len(word) == 1:
                break
            pairs = get_pairs(word)
        word = ' '.join(word)
        self.cache[token] = word
        return word

    def encode(self, data):
        text = data.decode('utf-8', 'surrogateescape')
        ids = []
        for token in regex.findall(PATTERN, text):
            token = ''.join(self.byte_encoder[b] for b in token.encode('utf-8', 'surrogateescape'))
            ids.extend(self.encoder[t] for t in self.bpe(token).split(' '))
        return ids


def load(gpt2_dir):
    with open(os.path.join(gpt2_dir, 'encoder.json'), encoding='utf-8') as f:
        encoder = json.load(f)
    with open(os.path.join(gpt2_dir, 'vocab.bpe'), encoding='utf-8') as f:
        bpe_data = f.read()
    merges = [tuple(line.split()) for line in bpe_data.split('\n')[1:-1]]
    return Encoder(encoder, merges)


# White_Space and near misses: \s in `regex` is White_Space, which has
# U+0085, U+00A0, U+1680, U+2000..U+200A, U+2028/9, U+202F, U+205F, U+3000
# but not U+001C..U+001F (str.isspace() has them), U+200B or U+FEFF.
SPACES = ['\x0b', '\x0c', '\x1c', '\x1d', '\x1e', '\x1f', '\x85', '\xa0', '\u1680', '\u2000',
          '\u200a', '\u200b', '\u2028', '\u2029', '\u202f', '\u205f', '\u3000', '\ufeff']

TEXTS = [
    # prose
    "", "Hello world", "Hello, world!", "The quick brown fox jumps over the lazy dog.",
    "It was the best of times, it was the worst of times; it was the age of wisdom.\n"
    "\"Are you sure?\" she asked -- and he said (quietly): 'yes'.",
    "the the the the the the", "e-mail: someone@example.com, https://example.org/a?b=c&d=e",
    "function(x) { return x * 2; } // C-like\n\tif (a != b) {}",
    # contractions, and what GPT-2 does not split ('S, 'T, ...)
    "I'm you're we've they'll she'd he's it's don't", "IT'S DON'T I'M YOU'RE WE'VE THEY'LL",
    "Bob's 'quote' ''s '' 's 'x rock'n'roll", "'s't're've'm'll'd", "x'sy 'ss 'res 'lll",
    " 's", "'", "''", "' '", "'re", "'r",
    # runs of spaces, before words and at the end of the text
    "a b", "a  b", "a   b", "a    b", "a     b", " x", "  x", "   x", "    x", "     x",
    "x ", "x  ", "x   ", "x    ", "x     ", " ", "  ", "     ",
    # tabs, newlines, carriage returns, mixed whitespace
    "a\tb", "\tindented", "a\t\tb", "line1\nline2", "a\n\nb", "a\n\n\nb", "a\r\nb", "a\r\n\r\nb",
    "a \n b", " \n\n  x", "\t \n\r\n x", "x\n", "x\n\n", "end \n", "a\n b\n  c\n   d",
    # numbers
    "12345678901234567890", "3.14", "1,000", "in 1999, 42 of 1,000,000 (3.14159%)", "x1y22z333",
    " 7 77 777", "\u0663\u0664\u0665 \u216b \xbd \xb2\xb3",
    # accented Latin, Greek, Cyrillic, CJK, Japanese, Korean, other scripts
    "caf\xe9 na\xefve r\xe9sum\xe9 Stra\xdfe \xc5ngstr\xf6m \u0141\xf3d\u017a",
    "\u039a\u03b1\u03bb\u03b7\u03bc\u03ad\u03c1\u03b1 \u03ba\u03cc\u03c3\u03bc\u03b5",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440!",
    "\u4f60\u597d\uff0c\u4e16\u754c\u3002", "\u3053\u3093\u306b\u3061\u306f\u4e16\u754c\u3001"
    "\u30ab\u30bf\u30ab\u30ca", "\uc548\ub155\ud558\uc138\uc694",
    "\u0645\u0631\u062d\u0628\u0627", "\u0928\u092e\u0938\u094d\u0924\u0947",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35",
    # emoji: single, skin tone, ZWJ sequences, flags, variation selector
    "\U0001f600", "\U0001f44d\U0001f3fd", "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d"
    "\U0001f466", "\U0001f1fa\U0001f1f8\U0001f1ef\U0001f1f5", "I \u2764\ufe0f NY \U0001f5fd!",
    # combining marks
    "e\u0301 a\u0300\u0301\u0302 Z\u0324\u0308 \u0301x", "n\u0303o\u0308",
    # <|endoftext|> is text
    "<|endoftext|>", "Hello<|endoftext|>World", " <|endoftext|>\n",
    # long pieces
    "a" * 300, " " * 100 + "x", "1" * 100, "!" * 200,
]

for c in SPACES:
    TEXTS += ["a" + c + "b", "a" + c + c + "b", "a " + c + "b", c + "x", "x" + c, "1" + c + " 2"]

INVALID = [
    b"\x80", b"abc\x80def", b"\x80\x80\x80", b"\xbf", b"\xc3", b"\xc3(", b"\xc3 x", b"\xe2\x82",
    b"\xe2\x82 x", b"\xe2\x82\xe2\x82\xac", b"\xf0\x9f\x98", b"\xf0\x9f\x98 smile", b"\xff",
    b"\xfe\xff", b"\xc0\xaf", b"\xc1\xbf", b"\xe0\x80\xaf", b"\xe0\x9f\xbf", b"\xf0\x80\x80\xaf",
    b"\xf0\x8f\xbf\xbf", b"\xed\xa0\x80", b"\xed\xbf\xbf", b"x\xed\xa0\xbd\xed\xb8\x80y",
    b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b" \xff\xfe", b"word\xffword", b"'\xffs", b"'s\x80",
    b"caf\xc3\xa9\x80", b"\x80caf\xc3\xa9", b"1\x802", b"\xa0x", b"a \xc2\xa0\x80b",
    bytes(range(256)),
]


def random_texts(n, seed):
    """Random mixes of the fragments above: the pre-tokenizer's corner cases
    next to each other."""
    rng = random.Random(seed)
    pool = [b"a", b"Z", b"word", b" ", b"  ", b"\t", b"\n", b"\r\n", b"'", b"'s", b"'ll", b"7",
            b"42", b".", b",", b"!?", b"\xc3\xa9", b"\xce\xb1", b"\xe4\xb8\x96", b"\xcc\x81",
            b"\xf0\x9f\x98\x80", b"\x80", b"\xff", b"\xe2\x82"] + [
                c.encode() for c in SPACES]
    texts = [b"".join(rng.choice(pool) for _ in range(rng.randint(1, 24))) for _ in range(n)]
    # long pieces (more than 64 bytes merge through a heap in the C encoder)
    for alphabet, n in [("abcdefghijklmnopqrstuvwxyz", 300), ("ACGT", 300), ("0123456789", 200),
                        ("!-=*#", 200), ("\u0430\u0431\u0432\u0433\u0434\u0435\u0436", 100),
                        ("\u7684\u4e00\u662f\u4e0d\u4e86\u4eba", 70), ("etaoinshrdlu", 400)]:
        texts.append("".join(rng.choice(alphabet) for _ in range(n)).encode())
    texts.append(b" " + b"thethe" * 50 + b" end")
    return texts


def main():
    gpt2_dir = sys.argv[1] if len(sys.argv) > 1 else 'data/gpt2'
    out = sys.argv[2] if len(sys.argv) > 2 else 'tests/fixtures/gpt2_tokens.json'
    enc = load(gpt2_dir)
    inputs = [t.encode('utf-8') for t in TEXTS] + INVALID + random_texts(60, 1234)
    lines = []
    for data in inputs:
        entry = {"hex": data.hex(), "ids": enc.encode(data)}
        lines.append(json.dumps(entry, separators=(',', ':')))
    with open(out + '.tmp', 'w') as f:
        f.write('[\n' + ',\n'.join(lines) + '\n]\n')
    os.replace(out + '.tmp', out)
    print(f"{out}: {len(inputs)} strings, {os.path.getsize(out)} bytes")


if __name__ == '__main__':
    main()
