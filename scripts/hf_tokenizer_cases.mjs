// hf_tokenizer_cases.mjs: the inputs of the Hugging Face tokenizer fixtures
// (scripts/make_hf_tokenizers.mjs). Each case is raw bytes, so invalid UTF-8
// can be written. U+0085 and U+FEFF are left out: JavaScript's \s (which
// the LLaMA-3 reference's regex uses) and Unicode's White_Space (what the
// Rust/Python tokenizers use) disagree on exactly these two.
const utf8 = (s) => new TextEncoder().encode(s);
const bytes = (...parts) =>
    Uint8Array.from(parts.flatMap((p) => (typeof p === 'string' ? [...utf8(p)] : p)));

// A long mixed text, the same on every run (a linear congruential choice of
// words), with long runs of one kind of character at the end.
function longText() {
    const words = ['the', 'The', 'of', 'and', 'to', 'in', 'a', 'tokenizer', 'merges', "isn't",
                   "WE'LL", '1961', '3.14159', 'café', 'naïve', '東京', '🤗', '--', '...', '\n',
                   '\n\n', '  ', '\t', 'Zürich', 'x²', 'αβγ', '(', ')', '"quoted"', '$100'];
    let x = 12345, out = '';
    for (let i = 0; i < 3000; i++) {
        x = (x * 1103515245 + 12345) % 2147483648;
        out += words[x % words.length] + (x % 7 === 0 ? '' : ' ');
    }
    return out + ' '.repeat(300) + '7'.repeat(200) + 'a'.repeat(1000) + '\n'.repeat(50) + 'end';
}

export const cases = [
    { name: 'ascii', bytes: bytes('Hello world! This is a test sentence.') },
    { name: 'single letter', bytes: bytes('I') },
    { name: 'single space', bytes: bytes(' ') },
    { name: 'whitespace runs', bytes: bytes('a  b   c    d\t\te \t x\n\n\nf  \n  g') },
    { name: 'leading and trailing spaces', bytes: bytes('   leading and trailing   ') },
    { name: 'newlines only', bytes: bytes('\n\n') },
    { name: 'crlf', bytes: bytes('line one\r\nline two\r\n\r\nline four') },
    { name: 'unicode spaces', bytes: bytes('nbsp\u00a0here, em\u2003space, ideographic\u3000space') },
    { name: 'digits', bytes: bytes('1234567890 3.14159 2024-11-22 1,000,000 007 42nd 1e-5') },
    { name: 'contractions', bytes: bytes("I'm you're they've he'll she'd it's IT'S Don't WE'D o'clock") },
    { name: 'punctuation', bytes: bytes('Hello!!! What?... (yes) [no] {maybe} <tag> #hash @user %50 ^&*~') },
    { name: 'code', bytes: bytes('def f(x):\n    return x**2  # square\n\nif __name__ == "__main__":\n\tprint(f(3))\n') },
    { name: 'accents', bytes: bytes('café naïve résumé Zürich Ångström São Paulo façade') },
    { name: 'decomposed accents', bytes: bytes('cafe\u0301 n\u0303') },
    { name: 'cjk', bytes: bytes('日本語のテキストです。中文文本，简体字。한국어 문장.') },
    { name: 'emoji', bytes: bytes('🤗 hugs 👍🏽 family 👨‍👩‍👧‍👦 flag 🇩🇪 ✨') },
    { name: 'scripts', bytes: bytes('Привет мир! Ελληνικά. مرحبا بالعالم. हिन्दी पाठ. ไทย') },
    { name: 'rare symbols', bytes: bytes('∮ E⋅da = Q, ⅓ ½ ∞ ≠ ≤ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u0007bell') },
    { name: 'invalid utf-8', bytes: bytes('abc', [0xff, 0xfe], ' def ', [0xc3, 0x28], ' x', [0xe2, 0x82], ' end', [0xf0, 0x9f, 0x98]) },
    { name: 'overlong and surrogate bytes', bytes: bytes('a', [0xc0, 0xaf], 'b', [0xed, 0xa0, 0x80], 'c') },
    { name: 'lone continuation bytes', bytes: bytes([0x80, 0x81], 'z', [0xbf]) },
    { name: 'long', bytes: bytes(longText()) },
];
