// test_docs.c: the documentation against the command it documents. Every
// command in a ```sh runnable block of README.md and docs/*.md runs against
// the built fitlm at tiny settings (a 2-layer model, two steps, small data
// made here), in document order, one scratch directory per page, so that a
// page may use what its earlier commands wrote (and the blocks marked
// file=NAME, written first); a command that fails names the file and line
// it is on. Every relative link of README.md, docs/*.md and
// bench/README.md must name a file that exists and, with #anchor, a heading
// of that file; README.md must link to every page of docs/. Under
// FITLM_TEST_QUICK (the sanitizer build) only the links are checked.
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "testlib.h"

static char base[] = "/tmp/fitlm_test_docs_XXXXXX";
static char output[65536];
static int commands_run;

// ---------------------------------------------------------------------------
// markdown

typedef struct {
    char *text;   // the file, its newlines replaced by NULs
    char **lines; // pointers into text
    int n;
} doc;

static doc read_doc(const char *rel) {
    size_t size;
    char *text = (char *)t_read_file(t_source_path(rel), &size);
    doc d = {text, NULL, 0};
    if (!t_check(text != NULL, "%s can be read", rel)) return d;
    int cap = 1;
    for (size_t i = 0; i < size; i++) cap += text[i] == '\n';
    d.lines = malloc((size_t)cap * sizeof *d.lines);
    for (char *s = text, *nl; s && *s; s = nl ? nl + 1 : NULL) {
        nl = strchr(s, '\n');
        if (nl) *nl = 0;
        d.lines[d.n++] = s;
    }
    return d;
}

static void free_doc(doc *d) {
    free(d->lines);
    free(d->text);
}

static int is_fence(const char *line) {
    return !strncmp(line, "```", 3);
}

// A heading's anchor as GitHub makes it: lower case, spaces to hyphens,
// punctuation other than - and _ dropped (bytes of UTF-8 letters kept).
static void slug(const char *heading, char *out, size_t size) {
    size_t k = 0;
    for (const unsigned char *c = (const unsigned char *)heading; *c && k + 1 < size; c++) {
        if (*c >= 'A' && *c <= 'Z')
            out[k++] = (char)(*c - 'A' + 'a');
        else if ((*c >= 'a' && *c <= 'z') || (*c >= '0' && *c <= '9') || *c == '-' || *c == '_' ||
                 *c >= 0x80)
            out[k++] = (char)*c;
        else if (*c == ' ')
            out[k++] = '-';
    }
    out[k] = 0;
}

// Whether the markdown file rel (source-relative) has a heading whose
// anchor is `anchor`; a repeated heading's later anchors end in -1, -2, ...
static int has_anchor(const char *rel, const char *anchor) {
    doc d = read_doc(rel);
    char seen[512][160];
    int n_seen = 0, fence = 0;
    for (int i = 0; i < d.n; i++) {
        if (is_fence(d.lines[i])) fence = !fence;
        if (fence || d.lines[i][0] != '#') continue;
        const char *h = d.lines[i];
        while (*h == '#') h++;
        if (*h != ' ') continue;
        char s[160], a[176];
        slug(h + 1, s, sizeof s);
        int repeats = 0;
        for (int k = 0; k < n_seen; k++) repeats += !strcmp(seen[k], s);
        if (n_seen < 512) strcpy(seen[n_seen++], s);
        if (repeats)
            snprintf(a, sizeof a, "%s-%d", s, repeats);
        else
            snprintf(a, sizeof a, "%s", s);
        if (!strcmp(a, anchor)) {
            free_doc(&d);
            return 1;
        }
    }
    free_doc(&d);
    return 0;
}

// Every [text](target) of rel outside code blocks: a relative target must
// exist, and its #anchor (in this file or a markdown target) must be a heading.
static void check_links(const char *rel) {
    doc d = read_doc(rel);
    char dir[256] = "";
    const char *slash = strrchr(rel, '/');
    if (slash) snprintf(dir, sizeof dir, "%.*s/", (int)(slash - rel), rel);
    int fence = 0, links = 0;
    for (int i = 0; i < d.n; i++) {
        if (is_fence(d.lines[i])) fence = !fence;
        if (fence) continue;
        for (const char *p = strstr(d.lines[i], "]("); p; p = strstr(p + 2, "](")) {
            const char *t = p + 2, *end = strchr(t, ')');
            const char *blank = strchr(t, ' ');
            if (!end || (blank && blank < end)) continue;
            char target[512];
            snprintf(target, sizeof target, "%.*s", (int)(end - t), t);
            if (strstr(target, "://") || !strncmp(target, "mailto:", 7)) continue;
            links++;
            char *hash = strchr(target, '#'), file[1024];
            if (hash) *hash = 0;
            if (*target) {
                // the path relative to the source tree, ../ resolved
                char path[1024];
                snprintf(path, sizeof path, "%s%s", dir, target);
                char *dots;
                while ((dots = strstr(path, "/../")) != NULL) {
                    char *up = dots;
                    while (up > path && up[-1] != '/') up--;
                    memmove(up, dots + 4, strlen(dots + 4) + 1);
                }
                snprintf(file, sizeof file, "%s", path);
            } else {
                snprintf(file, sizeof file, "%s", rel);
            }
            struct stat st;
            if (!t_check(stat(t_source_path(file), &st) == 0, "%s:%d: link to a missing file %s",
                         rel, i + 1, file))
                continue;
            if (hash && strstr(file, ".md"))
                t_check(has_anchor(file, hash + 1), "%s:%d: link to %s#%s: no such heading", rel,
                        i + 1, file, hash + 1);
        }
    }
    printf("%s: %d relative links checked\n", rel, links);
    free_doc(&d);
}

// ---------------------------------------------------------------------------
// the scratch directories

// out = a/b; a path too long for out stops the test
static void join_path(char *out, size_t size, const char *a, const char *b) {
    if (snprintf(out, size, "%s/%s", a, b) >= (int)size) {
        fprintf(stderr, "test_docs: path too long: %s/%s\n", a, b);
        exit(1);
    }
}

static void make_dir(const char *path) {
    if (mkdir(path, 0755) != 0) {
        perror(path);
        exit(1);
    }
}

static void write_in(const char *dir, const char *name, const char *text) {
    char path[1024];
    join_path(path, sizeof path, dir, name);
    t_write_text(path, text);
}

static void link_in(const char *dir, const char *name, const char *target) {
    char path[1024];
    join_path(path, sizeof path, dir, name);
    if (symlink(target, path) != 0) {
        perror(path);
        exit(1);
    }
}

// base/shared: a small text of 80 documents (the start of each of the
// Brown corpus's first 80; the validation split's 4 hold a window of the
// 2048 tokens the planning examples ask for) and its GPT-2 token shards.
static void make_shared(void) {
    char dir[512], path[1024];
    snprintf(dir, sizeof dir, "%s/shared", base);
    make_dir(dir);
    size_t size;
    char *corpus = (char *)t_read_file(t_source_path("data/brown.txt"), &size);
    if (!t_check(corpus != NULL, "data/brown.txt can be read (scripts/setup.sh fetches it)"))
        exit(t_report());
    char *small = malloc(80 * 3000 + 1);
    size_t k = 0;
    const char *doc_start = corpus;
    for (int d = 0; d < 80 && doc_start && *doc_start; d++) {
        const char *next = strstr(doc_start, "\n\n");
        size_t len = next ? (size_t)(next - doc_start) : strlen(doc_start);
        if (len > 2990) len = 2990;
        while (len > 1 && doc_start[len - 1] != ' ') len--; // whole words
        memcpy(small + k, doc_start, len);
        k += len;
        memcpy(small + k, "\n\n", 2);
        k += 2;
        doc_start = next ? next + 2 : NULL;
    }
    small[k] = 0;
    snprintf(path, sizeof path, "%s/brown.txt", dir);
    t_write_text(path, small);
    free(small);
    free(corpus);
    char args[1024];
    snprintf(args, sizeof args, "tokenize brown.txt -o brown_gpt2 --tokenizer-path %s --threads 1",
             t_source_path("data/gpt2"));
    t_check(t_fitlm(dir, args, 1, output, sizeof output) == 0, "the small data is tokenized: %s",
            output);
}

// The JSON Lines a page's commands tokenize: enough examples for a
// validation split (every 20th), in the three layouts.
static void write_jsonl(const char *dir, const char *name) {
    char text[16384];
    size_t k = 0;
    for (int i = 0; i < 40; i++) {
        int a = i % 10, b = (i * 7) % 10;
        if (i % 3 == 0)
            k +=
                (size_t)snprintf(text + k, sizeof text - k,
                                 "{\"messages\": [{\"role\": \"user\", \"content\": \"What is %d "
                                 "plus %d?\"}, {\"role\": \"assistant\", \"content\": \"%d.\"}]}\n",
                                 a, b, a + b);
        else if (i % 3 == 1)
            k +=
                (size_t)snprintf(text + k, sizeof text - k,
                                 "{\"prompt\": \"%d + %d?\", \"response\": \"%d\"}\n", a, b, a + b);
        else
            k += (size_t)snprintf(text + k, sizeof text - k,
                                  "{\"instruction\": \"Add\", \"input\": \"%d %d\", \"output\": "
                                  "\"%d\"}\n",
                                  a, b, a + b);
    }
    write_in(dir, name, text);
}

// base/<page>: data/ as the commands expect it (the tokenizers, the small
// text and its shards under the default paths) and the files they name.
static void make_page_dir(const char *page, char *dir, size_t size) {
    join_path(dir, size, base, page);
    make_dir(dir);
    char data[1024], target[1024];
    join_path(data, sizeof data, dir, "data");
    make_dir(data);
    const char *tokenizers[] = {"gpt2", "llama", "llama3"};
    for (int i = 0; i < 3; i++) {
        char rel[64];
        snprintf(rel, sizeof rel, "data/%s", tokenizers[i]);
        snprintf(target, sizeof target, "%s", t_source_path(rel));
        link_in(data, tokenizers[i], target);
    }
    snprintf(target, sizeof target, "%s/shared/brown.txt", base);
    link_in(data, "brown.txt", target);
    link_in(dir, "my_text.txt", target);
    link_in(dir, "essay.txt", target);
    snprintf(target, sizeof target, "%s/shared/brown_gpt2", base);
    link_in(data, "brown_gpt2", target);
    write_jsonl(dir, "sft.jsonl");
    write_jsonl(dir, "chat.jsonl");
    char nvme[1024];
    join_path(nvme, sizeof nvme, dir, "nvme");
    make_dir(nvme);
}

// ---------------------------------------------------------------------------
// runnable blocks

static int has_flag(const char *args, const char *flag) {
    size_t n = strlen(flag);
    for (const char *p = strstr(args, flag); p; p = strstr(p + 1, flag))
        if ((p == args || p[-1] == ' ') && (p[n] == ' ' || p[n] == '=' || p[n] == 0)) return 1;
    return 0;
}

// What a command of the docs runs here: its arguments, then the tiny
// settings of its subcommand (a repeated flag's last value wins).
static void tiny_args(const char *args, char *out, size_t size) {
    char sub[32] = "";
    sscanf(args, "%31s", sub);
    const char *extra = "";
    char train[512];
    if (!strcmp(sub, "train")) {
        int resume = has_flag(args, "--resume");
        int shaped = resume || has_flag(args, "--model") || has_flag(args, "--init-from");
        snprintf(train, sizeof train,
                 " --steps %d --batch 2 --seq-len 32 --eval-iters 1 --eval-every 0"
                 " --sample-tokens 4 --threads 1 --peak-tflops 1%s%s",
                 resume ? 4 : 2, shaped ? "" : " --model tiny", resume ? "" : " --overwrite");
        extra = train;
    } else if (!strcmp(sub, "sample")) {
        extra = " --tokens 4 --threads 1";
    } else if (!strcmp(sub, "eval")) {
        extra = " --threads 1";
    } else if (!strcmp(sub, "tokenize")) {
        extra = has_flag(args, "--format") && strstr(args, "jsonl") ? " --threads 1 --seq-len 32"
                                                                    : " --threads 1";
    }
    if (snprintf(out, size, "%s%s", args, extra) >= (int)size) *out = 0; // never that long
}

// The command of a line (continuations joined, the comment cut off):
// returns the number of lines it took, and writes "" for a blank line.
static int join_command(char **lines, int n, char *out, size_t size) {
    size_t k = 0;
    int used = 0;
    for (; used < n; used++) {
        const char *s = lines[used];
        size_t len = strlen(s);
        int more = len && s[len - 1] == '\\';
        k += (size_t)snprintf(out + k, size - k, "%.*s ", (int)(len - (size_t)more), s);
        if (k >= size) k = size - 1;
        if (!more) break;
    }
    char quote = 0;
    for (size_t i = 0; out[i]; i++) { // a # after a blank, outside quotes
        if (quote) {
            if (out[i] == quote) quote = 0;
        } else if (out[i] == '"' || out[i] == '\'') {
            quote = out[i];
        } else if (out[i] == '#' && (i == 0 || out[i - 1] == ' ')) {
            out[i] = 0;
            break;
        }
    }
    size_t len = strlen(out);
    while (len && (out[len - 1] == ' ' || out[len - 1] == '\t')) out[--len] = 0;
    char *start = out;
    while (*start == ' ') start++;
    memmove(out, start, strlen(start) + 1);
    return used + 1;
}

static void run_command(const char *rel, int line, const char *dir, const char *command) {
    const char *args = NULL;
    if (!strncmp(command, "./build/fitlm ", 14))
        args = command + 14;
    else if (!strncmp(command, "fitlm ", 6))
        args = command + 6;
    if (!t_check(args != NULL,
                 "%s:%d: a runnable block holds '%s', which is not a fitlm command (put it "
                 "in a plain ```sh block)",
                 rel, line, command))
        return;
    char full[4096];
    tiny_args(args, full, sizeof full);
    int rc = t_fitlm(dir, full, 1, output, sizeof output);
    commands_run++;
    size_t n = strlen(output);
    t_check(rc == 0, "%s:%d: '%s' (run as 'fitlm %s') exited with status %d:\n%s", rel, line,
            command, full, rc, n > 1500 ? output + n - 1500 : output);
}

// A block whose info string holds file=NAME (```json file=my.json) is a
// file the page's commands use: written into dir before any runs.
static void write_file_blocks(const doc *d, const char *dir) {
    for (int i = 0; i < d->n; i++) {
        if (!is_fence(d->lines[i])) continue;
        const char *name = strstr(d->lines[i], " file=");
        int end = i + 1;
        while (end < d->n && !is_fence(d->lines[end])) end++;
        if (name) {
            size_t len = 1;
            for (int j = i + 1; j < end; j++) len += strlen(d->lines[j]) + 1;
            char *text = malloc(len), path[1024];
            text[0] = 0;
            for (int j = i + 1; j < end; j++) strcat(strcat(text, d->lines[j]), "\n");
            join_path(path, sizeof path, dir, name + 6);
            t_write_text(path, text);
            free(text);
        }
        i = end;
    }
}

// Runs the ```sh runnable blocks of rel in its own scratch directory.
static void run_page(const char *rel) {
    doc d = read_doc(rel);
    char page[128], dir[1024];
    snprintf(page, sizeof page, "%s", rel);
    for (char *c = page; *c; c++)
        if (*c == '/') *c = '_';
    make_page_dir(page, dir, sizeof dir);
    write_file_blocks(&d, dir);
    int before = commands_run;
    for (int i = 0; i < d.n; i++) {
        if (!is_fence(d.lines[i])) continue;
        int runnable = !strcmp(d.lines[i], "```sh runnable");
        int end = i + 1;
        while (end < d.n && !is_fence(d.lines[end])) end++;
        for (int j = i + 1; runnable && j < end;) {
            char command[4096];
            int line = j + 1;
            j += join_command(d.lines + j, end - j, command, sizeof command);
            if (*command) run_command(rel, line, dir, command);
        }
        i = end;
    }
    printf("%s: %d commands run\n", rel, commands_run - before);
    free_doc(&d);
}

static int by_name(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int main(void) {
    if (!mkdtemp(base)) {
        perror(base);
        return 1;
    }
    if (!t_quick()) make_shared(); // the commands' data
    char *pages[64];
    int n_pages = 0;
    pages[n_pages++] = strdup("README.md");
    DIR *docs = opendir(t_source_path("docs"));
    t_check(docs != NULL, "docs/ exists");
    for (struct dirent *e; docs && (e = readdir(docs)) != NULL;) {
        size_t len = strlen(e->d_name);
        if (len > 3 && !strcmp(e->d_name + len - 3, ".md") && n_pages < 64) {
            char rel[300];
            snprintf(rel, sizeof rel, "docs/%s", e->d_name);
            pages[n_pages++] = strdup(rel);
        }
    }
    if (docs) closedir(docs);
    qsort(pages + 1, (size_t)(n_pages - 1), sizeof *pages, by_name);
    for (int i = 0; i < n_pages; i++) check_links(pages[i]);
    // no page the front page does not lead to
    size_t size;
    char *readme = (char *)t_read_file(t_source_path("README.md"), &size);
    for (int i = 1; readme && i < n_pages; i++) {
        char link[320];
        snprintf(link, sizeof link, "](%s)", pages[i]);
        t_check(strstr(readme, link) != NULL, "README.md links to %s", pages[i]);
    }
    free(readme);
    check_links("bench/README.md");
    // The commands run in the full case list (the release build); the
    // reduced one (the sanitizer build, t_quick) checks the links alone: the
    // commands' memory errors are test_cli's, at a fifth of the time.
    for (int i = 0; i < n_pages; i++) {
        if (!t_quick()) run_page(pages[i]);
        free(pages[i]);
    }
    // the pages' examples stay runnable: most of them, not a handful
    if (!t_quick())
        t_check(commands_run >= 40, "at least 40 documented commands run (%d)", commands_run);
    else
        printf("  the documented commands run in the release build (FITLM_TEST_QUICK set)\n");
    int status = t_report();
    if (status == 0) t_remove_dir(base); // kept for a look when a command failed
    return status;
}
