// io.h: files. Every reader checks what it reads and fails with a message
// naming the file and what is wrong; every writer goes through a temporary
// file and a rename, so a crash never leaves a half-written file where a good
// one was.
#ifndef FITLM_IO_H
#define FITLM_IO_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "fitlm/core.h"
#include "fitlm/data.h"
#include "fitlm/device.h"
#include "fitlm/dtype.h"
#include "fitlm/model.h"
#include "fitlm/optim.h"
#include "fitlm/tokenizer.h"

uint32_t fl_crc32(uint32_t crc, const void *data, size_t n);

// little-endian fields of file headers
static inline void fl_put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void fl_put_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint32_t fl_get_u32(const uint8_t *p) {
    return p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline uint64_t fl_get_u64(const uint8_t *p) {
    return fl_get_u32(p) | (uint64_t)fl_get_u32(p + 4) << 32;
}

// ----------------------------------------------------------------------------
// crash-safe writing: begin (the temporary PATH.tmp.<pid>/<name>, see below),
// write..., commit (fsync, rename over PATH, fsync the directory). An error
// removes the temporary and dies. A link planted at PATH is replaced, its
// target never written.

#define FL_FILE_PATH_MAX 4096

typedef struct {
    int fd;
    char path[FL_FILE_PATH_MAX], tmp[FL_FILE_PATH_MAX];
    uint32_t crc; // CRC-32 of everything written so far
    uint64_t bytes;
} fl_file;

void fl_file_begin(fl_file *f, const char *path);
void fl_file_write(fl_file *f, const void *data, size_t n);
void fl_file_commit(fl_file *f);
void fl_fsync_dir_of(const char *path);
// Creates the missing directories above path (mkdir -p of its parent, as
// os.makedirs does for an output directory); dies naming the one that fails.
void fl_mkdir_parents(const char *path);
// begin + write + commit of one buffer
void fl_file_write_all(const char *path, const void *data, size_t n);
// (fl_file_read_all, the whole-file reader, is core's: fitlm/core.h)

// ----------------------------------------------------------------------------
// what fitlm may write, replace or delete (src/io/tmp.c). Outputs are new
// files (O_EXCL|O_NOFOLLOW) renamed into place. Every temporary (a file's,
// a directory set's) is a directory NAME.tmp.<pid> (or NAME.old.<pid>)
// whose first entry is the marker `.fitlm-dir`, created O_EXCL:
// "fitlm temporary directory\npid <pid>\nboot <boot id>\nstart <ticks>\n".
// A leftover is deleted (or restored) only when it is a directory, not a
// link, with that marker naming the pid of its name, and that writer is
// gone: no process has the pid, or the boot id or the start time of the one
// that has it differs (a reused pid). An empty directory so named (a writer
// killed between its mkdir and its marker) is removed too, its pid gone:
// nothing is lost. Anything else named like a leftover (a user's
// results.old.2024, log.txt.tmp.1) is left alone.

// Dies with the error of a failed fl_tmp_open of path.
void fl_die_not_new(const char *path);
// Opens path to append, only when it is a regular file of one link
// (O_NOFOLLOW; a link, FIFO, device or hard-linked file is refused). Dies
// naming it (what: "training log", ...).
FILE *fl_fopen_append(const char *path, const char *what);
// What an error may show of a file that failed validation: the bytes
// quoted when they could be a name (at most 40 of [A-Za-z0-9._-], starting
// with prefix), else only "<total> bytes that are not a name": a file a link
// points at (a key, a password) is never echoed.
void fl_name_excerpt(char *out, size_t size, const char *bytes, size_t n, uint64_t total,
                     const char *prefix);

// The temporary of path: PATH.tmp.<pid>/<name of PATH> (dies if too long).
void fl_tmp_name(char *out, size_t size, const char *path);
// Creates tmp's directory (new), marks it, and creates tmp in it (new). The
// fd, or -1 with errno and nothing left behind.
int fl_tmp_open(const char *tmp);
// Renames tmp over path and removes its directory; fsyncs path's
// directory. 0, or -1 with errno and tmp removed.
int fl_tmp_commit(const char *tmp, const char *path);
// Removes tmp and its directory (when they are this process's).
void fl_tmp_discard(const char *tmp);
// Deletes the temporaries (NAME.tmp.<pid>) that killed writers left in dir.
// A writer on another machine (another boot id) counts as gone: call it only
// while no other process writes there (a run holds DIR/.lock; rank 0 prunes
// after every rank's save).
void fl_tmp_clean(const char *dir);
// Marks dir as this process's temporary; removes the mark.
void fl_tmp_mark(const char *dir);
void fl_tmp_unmark(const char *dir);
// Whether name is the marker's.
int fl_tmp_is_mark(const char *name);
// Whether dir is the leftover of writer pid: marked by it and it is gone
// (see above; this process's pid counts as gone: it has none under way when
// this is asked), or empty (but for an empty marker) and no process has pid
// or the one that has it started after the directory was made (a writer
// killed between its mkdir and its marker, its pid perhaps reused since;
// an empty directory loses nothing).
int fl_tmp_is_leftover(const char *dir, long pid);
// The pid of dir's marker when its writer is gone, else 0.
long fl_tmp_dead_writer(const char *dir);
// Removes path and everything in it, never following a link.
void fl_tmp_remove_tree(const char *path);

// ----------------------------------------------------------------------------
// crash-safe directories: a set of files (an export, a shard set, an
// adapter) replaced as a whole. The new set is written into DIR.tmp.<pid>
// beside DIR; commit swaps it in (an atomic exchange where the kernel has
// one, else DIR is renamed to DIR.old.<pid> and the new one into place) and
// removes the old set. A kill at any moment leaves the old set or the new
// one. The next begin on DIR removes what dead writers left (DIR.tmp.<pid>,
// DIR.old.<pid> of pids no longer running); a DIR.old.<pid> with DIR missing
// (a kill between the two renames) is renamed back to DIR: the last complete
// set is never lost.
// Only marked siblings are touched (see above): the old set is marked
// before it is swapped out, and the marker is removed from DIR after the
// swap.
//
// DIR's other regular files (not in_set) are carried over by hard links. A
// DIR that cannot be swapped whole (a symlink, ".", one that holds
// subdirectories, or checkpoints, which a run may be writing into it) is
// written in place, one file at a time as before: t->whole is 0 then.

typedef struct {
    char dir[FL_FILE_PATH_MAX], tmp[FL_FILE_PATH_MAX], old[FL_FILE_PATH_MAX];
    int whole; // 1: writing into tmp, swapped by commit; 0: into dir itself
} fl_dir_txn;

// Creates the directory to write the new set into and returns it (t->tmp,
// or dir itself when it is written in place). in_set(name): the file
// belongs to the set (NULL: every file does, nothing is carried over).
const char *fl_dir_begin(fl_dir_txn *t, const char *dir, int (*in_set)(const char *name));
// Makes the new set durable and swaps it in (nothing to do in place).
void fl_dir_commit(fl_dir_txn *t);
// Removes what killed writers of dir left beside it (see above).
void fl_dir_recover(const char *dir);

// ----------------------------------------------------------------------------
// text: the input of `fitlm tokenize`

typedef struct {
    uint8_t *bytes;
    size_t n;
} fl_text;

// Loads a UTF-8 text file; an empty file or invalid UTF-8 is an error naming
// the file and the byte offset.
void fl_text_load(fl_text *text, const char *path);
void fl_text_free(fl_text *text);

// Lines end at "\n", and a "\r" before it is part of the line end (CRLF);
// a lone "\r" is white space within a line. A line is blank when it holds
// nothing but white space (space, \t, \r, \f, \v).
int fl_line_is_blank(const uint8_t *s, size_t n);
// Calls doc(ctx, bytes, n) for each document of text[0..n), in order, and
// returns their number. separator NULL: documents are separated by blank
// lines, LF and CRLF alike; a document runs from its first line that is not
// blank to the line end before the next blank line (or to the end of the
// text). Else at each occurrence of separator. No document is empty.
size_t fl_text_documents(const uint8_t *text, size_t n, const char *separator,
                         void (*doc)(void *ctx, const uint8_t *bytes, size_t n), void *ctx);

// ----------------------------------------------------------------------------
// checkpoints. DIR/ckpt_<step>.fitlm holds a JSON header (the caller's
// metadata plus a table of tensors) and the tensors, each with a CRC-32, and
// a CRC-32 over the header; DIR/latest names the newest complete one. A new
// checkpoint is written and made durable before `latest` moves to it, and
// older ones are deleted only after that, so a crash at any moment leaves a
// loadable checkpoint behind.
//
// File layout, little-endian:
//   bytes 0-7    magic "FITLMCKP"
//   bytes 8-11   uint32 format version (3, or 4 when it holds a strided piece;
//                versions 2, without files, and 3 are read too)
//   bytes 12-15  uint32 header length H
//   bytes 16-23  uint64 data length D
//   bytes 24-27  uint32 CRC-32 of bytes 0-23 and the header
//   H bytes      JSON: {"meta": {...}, "tensors": [{"name", "dtype",
//                "shape": [n], "offset", "crc32"}, ...], "files": [{"name",
//                "offset", "bytes", "crc32"}, ...]}
//   D bytes      the tensors, then the files, back to back, offsets
//                relative to here
// A file is stored whole (e.g. the run's tokenizer.json): a checkpoint
// carries what its readers need, so none of them opens a path it records.
//
// Sharded checkpoints (fl_ckpt_write_dist): DIR/ckpt_<step>.fitlm is then a
// manifest, a file of this layout with no tensors whose header adds
// "sharding": {"world": W, "shards": [{"file", "bytes", "header_crc32"},
// ...]}, and rank r's file DIR/ckpt_<step>.<tag>.rank<r>-of-<W>.fitlm (the
// tag is new at every save) adds "shard": {"of": manifest, "rank", "world"}
// and holds pieces: its table entries add "first" and "total" (elements
// [first, first + shape[0]) of a tensor of total elements), and a strided
// piece (a tensor-parallel rank's slice: version 4) adds "run" and
// "stride": shape[0] / run runs of run elements, run k at element first +
// k * stride, stored back to back. Tensors keep their global (Hugging Face)
// names; a file may hold several pieces of one tensor. A reader checks
// that each shard file is the one its manifest recorded (size, header
// CRC-32, step, run, rank) and that the pieces cover every tensor exactly
// once, and then sees whole tensors: fl_ckpt_read, fl_ckpt_read_range and
// fl_ckpt_read_runs gather the pieces, whatever the number of ranks reading
// and however they slice them (any TP, DP or ZeRO layout reads any other).

typedef struct {
    const char *name;
    fl_dtype dtype;
    const void *data;
    size_t numel;
} fl_ckpt_tensor;

// A file stored in a checkpoint: name (< 64 bytes, unique) and bytes.
typedef struct {
    const char *name;
    const void *data;
    size_t size;
} fl_ckpt_file;

// A piece of a tensor (in a shard file): elements [first, first + numel)
// of a tensor of total elements; total 0: the whole tensor.
typedef struct {
    const char *name;
    fl_dtype dtype;
    const void *data;
    size_t numel, first, total;
    // 0: contiguous. Else the piece is numel / run runs of `run` elements,
    // run k at tensor element first + k * stride (stride >= run; numel a
    // multiple of run); data holds them back to back
    size_t run, stride;
    // data's device (device.h): NULL or a host device: host memory; else
    // the writer stages it through a bounded host buffer
    const fl_device *dev;
} fl_ckpt_piece;

// meta_json: a JSON object (text) of the caller's state. keep > 0 deletes all
// but the `keep` newest checkpoints once the new one is in place.
void fl_ckpt_write(const char *dir, int step, const char *meta_json, const fl_ckpt_tensor *tensors,
                   int n_tensors, int keep);
// The same, recording `run` (an id of the training run, kept across resumes)
// in the header: pruning then deletes only checkpoints of that run, never
// another run's left in the same directory (fl_ckpt_write prunes any), and
// storing files[0..n_files) in it.
void fl_ckpt_write_run(const char *dir, int step, const char *meta_json,
                       const fl_ckpt_tensor *tensors, int n_tensors, int keep, const char *run,
                       const fl_ckpt_file *files, int n_files);
// fl_ckpt_write_run of whole tensors given as pieces (first and total 0),
// which may lie on a device (fl_ckpt_piece's dev).
void fl_ckpt_write_whole(const char *dir, int step, const char *meta_json,
                         const fl_ckpt_piece *whole, int n_tensors, int keep, const char *run,
                         const fl_ckpt_file *files, int n_files);
// The collective save of a run over ranks (every rank calls it, at the same
// step). sharded 0: rank 0 writes `tensors` as one checkpoint file (DDP:
// every rank holds everything), the others pass nothing. sharded 1: every
// rank writes its pieces (fl_ckpt_piece) with its own meta
// (shard_meta_json) to its shard file, then rank 0 the manifest with
// meta_json. Every file is written under a temporary name and made durable;
// the ranks agree (fl_comm_max) that all succeeded before any file takes its
// final name, and again before `latest` moves. An I/O error on any rank
// (FITLM_CKPT_FAULT=<rank>[:<step>] injects a full disk, for tests) stops
// every rank with an error naming the rank and the file, `latest` still
// naming the previous checkpoint. Rank 0 then prunes as fl_ckpt_write_run,
// a manifest with its shard files, and the shard files of `run` that no
// manifest lists (a failed or killed save's). files (rank 0's are used) go
// with meta_json: into the single file, or the manifest.
void fl_ckpt_write_dist(const char *dir, int step, const char *meta_json,
                        const char *shard_meta_json, const fl_ckpt_piece *tensors, int n_tensors,
                        int sharded, int keep, const char *run, const fl_ckpt_file *files,
                        int n_files);

typedef struct fl_ckpt fl_ckpt;

// Opens DIR's newest checkpoint (through DIR/latest) or a checkpoint file
// (or manifest, with its shard files), and checks its header(s). Dies naming
// the file on any damage, a missing shard or one of another save.
fl_ckpt *fl_ckpt_open(const char *path);
void fl_ckpt_close(fl_ckpt *ck);
const char *fl_ckpt_path(const fl_ckpt *ck);
int fl_ckpt_step(const fl_ckpt *ck);
// The caller's metadata object as JSON text (valid while ck is open).
const char *fl_ckpt_meta(const fl_ckpt *ck);
// The id of the run that wrote it ("" for checkpoints without one).
const char *fl_ckpt_run(const fl_ckpt *ck);
// The number of shard files of a sharded checkpoint (0: a single file).
int fl_ckpt_shards(const fl_ckpt *ck);
// A file stored in the checkpoint (its size in *size, a NUL after it; fl_free
// it), or NULL when it holds none of that name. Dies on a CRC mismatch.
uint8_t *fl_ckpt_file_read(const fl_ckpt *ck, const char *name, size_t *size);
int fl_ckpt_has(const fl_ckpt *ck, const char *name);
// Elements of tensor `name`; 0 when it is absent.
size_t fl_ckpt_numel(const fl_ckpt *ck, const char *name);
// The tensors, in file order: names of i in [0, fl_ckpt_tensor_count).
int fl_ckpt_tensor_count(const fl_ckpt *ck);
const char *fl_ckpt_tensor_name(const fl_ckpt *ck, int i);
// Reads tensor `name` (numel elements), converting to dt, and checks its
// CRC-32. Dies when it is missing, of another size, or damaged.
void fl_ckpt_read(fl_ckpt *ck, const char *name, fl_dtype dt, void *dst, size_t numel);
// Elements [first, first + count) of tensor `name` into dst (converted to
// dt): a shard's part of a row. The CRC-32 of every piece read is checked.
void fl_ckpt_read_range(fl_ckpt *ck, const char *name, fl_dtype dt, void *dst, size_t first,
                        size_t count);
// Elements first + k*stride + j (k < count/run, j < run) of tensor `name`,
// converted to dt, back to back into dst: a rank's strided slice of a
// global tensor. Each piece that holds any of them is read once (its CRC-32
// checked); dies as fl_ckpt_read_range does.
void fl_ckpt_read_runs(fl_ckpt *ck, const char *name, fl_dtype dt, void *dst, size_t first,
                       size_t run, size_t stride, size_t count);
// fl_ckpt_read_runs into device memory: dst is dev's (NULL or a host
// device: host memory); the elements pass through a bounded host buffer and
// the device's copies.
void fl_ckpt_read_runs_to(fl_ckpt *ck, const char *name, fl_dtype dt, const fl_device *dev,
                          void *dst, size_t first, size_t run, size_t stride, size_t count);
// fl_ckpt_read_range into dev's memory, as fl_ckpt_read_runs_to.
void fl_ckpt_read_range_to(fl_ckpt *ck, const char *name, fl_dtype dt, const fl_device *dev,
                           void *dst, size_t first, size_t count);

// The header parser on its own, for fuzzing: checks a whole checkpoint file
// image (prefix, header JSON, tensor table against the data length). Returns
// 0, or -1 with a message in err.
int fl_ckpt_parse(const uint8_t *file, size_t size, char *err, size_t errlen);

// True when path is a fitlm checkpoint (a directory with `latest`, or a
// checkpoint file); the second, only for the directory.
int fl_is_checkpoint(const char *path);
int fl_is_checkpoint_dir(const char *path);

// ----------------------------------------------------------------------------
// training checkpoints: everything a bitwise-identical resume needs. Meta:
// the step, the run's config, the model shape, precision and tokenizer, the
// optimizer's step count and loss-scaler state, the loader's position and
// RNG. Tensors: "weights" (fp32: the master copy under mixed precision) and
// the optimizer state ("adamw.m", "adamw.v" or "sgd.momentum").

// Under LoRA, optim is the adapters' and base the base's under LoRA + LOMO
// (else NULL): see train_state.c for the tensors. The tokenizer's name goes
// into the meta and its files (the bytes the run loaded) into the checkpoint
// as tokenizer/<file>: fl_ckpt_tokenizer gives them back.
void fl_train_ckpt_save(const char *dir, int step, const fl_model *model, const fl_optimizer *optim,
                        const fl_optimizer *base, const fl_loader_state *loader,
                        const fl_tokenizer_files *tokenizer, const char *config_json, int keep);
// The same as run `run` (fl_ckpt_write_run: pruning spares other runs').
// The meta also records the thread count in force (omp_get_max_threads).
void fl_train_ckpt_save_run(const char *dir, int step, const fl_model *model,
                            const fl_optimizer *optim, const fl_optimizer *base,
                            const fl_loader_state *loader, const fl_tokenizer_files *tokenizer,
                            const char *config_json, int keep, const char *run);
// The collective save of a data-parallel run (dist.h; every rank calls it):
// each rank's shard of the flat buffer [state_begin, state_end) of its
// optimizer (fp32 weights: the master, else the weights, optim->params at
// params_first; the optimizer state) as pieces of the rows ("model/<row>",
// "optim/<state>/<row>"), with the replicated meta in the manifest
// (fl_ckpt_write_dist). When every rank holds the whole buffer (DDP), rank 0
// writes a single file as fl_train_ckpt_save_run. The loader's position is
// saved with the world size, so a run can resume on any number of ranks.
void fl_train_ckpt_save_dist(const char *dir, int step, const fl_model *model,
                             const fl_optimizer *optim, const fl_loader_state *loader,
                             const fl_tokenizer_files *tokenizer, const char *config_json, int keep,
                             const char *run);
// The thread count the checkpoint's run computed with (0: not recorded).
int fl_train_ckpt_threads(const fl_ckpt *ck);
// The number of ranks that saved it (1: one process, or an older checkpoint).
int fl_train_ckpt_world(const fl_ckpt *ck);
// Initialises *model (shape from the checkpoint, weights rounded to dt) from
// a checkpoint directory or file; tokenizer receives the tokenizer's name.
void fl_ckpt_load_model(const char *path, fl_model *model, fl_dtype dt, char *tokenizer,
                        size_t tokenizer_size);
// A checkpoint's model as a weight source (model.h): the shape from its
// header (checked against its tensors), the rows "model/<row>" read in the
// model's dtype into whatever range it holds (a ZeRO-3 shard too). Dense
// only; a checkpoint of LoRA adapters alone is refused, naming the file.
// fl_ckpt_source borrows an open checkpoint (closed by its caller, after
// the source); fl_ckpt_source_open opens path (which must outlive the
// source) and closes it with the source.
void fl_ckpt_source(fl_weight_source *s, fl_ckpt *ck);
void fl_ckpt_source_open(fl_weight_source *s, const char *path);
// The model shape an open checkpoint holds, checked against its tensors
// (fl_ckpt_check_shape), so a caller may allocate by it.
void fl_ckpt_model_config(const fl_ckpt *ck, fl_model_config *cfg);
// Checks the header's model shape (meta.model, meta.lora.r) against the
// tensors before anything is allocated: every "model/<row>" (or the legacy
// "weights") and "lora/<row>" is a row of that shape with its element
// count, and a whole model has all its rows. Dies naming the file and the
// tensor.
void fl_ckpt_check_shape(const fl_ckpt *ck);
// The run's config (JSON text, caller frees with fl_free) of an open checkpoint.
char *fl_train_ckpt_config(const fl_ckpt *ck);
// The tokenizer a checkpoint contains: the name in its meta and the files
// its run stored (tokenizer/<file>); none (n 0, `missing` saying so) in a
// checkpoint saved before they were stored. The path its run's config
// records is never read: the checkpoint may come from anywhere.
void fl_ckpt_tokenizer(const fl_ckpt *ck, fl_tokenizer_files *f);
// The tokenizer a model source comes with: a checkpoint's
// (fl_ckpt_tokenizer); a Hugging Face directory holding a tokenizer.json:
// "hf" and its files; else GPT-2's ("gpt2", data/gpt2's files if there).
// Returns 0 only in the last case, where it is a guess.
int fl_source_tokenizer(const char *source, fl_tokenizer_files *f);
// Restores weights, optimizer state and loader position into a model and
// optimizer initialised with the checkpoint's shape and settings; dies if
// the shape, precision, optimizer or tokenizer differ. From a single file or
// a sharded checkpoint of any world size: the model's weights whole (every
// rank; before fl_dist_attach), the master and optimizer state over the
// optimizer's range [state_begin, state_end). The loader's position is the
// windows the whole world consumed in the epoch, split over this run's
// ranks (fl_comm_size; dies when they cannot split it evenly).
void fl_train_ckpt_restore(fl_ckpt *ck, fl_model *model, fl_optimizer *optim, fl_optimizer *base,
                           fl_loader_state *loader, const char *tokenizer);

// ----------------------------------------------------------------------------
// pretrained weights: a Hugging Face GPT-2 or LLaMA directory (config.json
// and model.safetensors or a sharded index), an llm.c model file (GPT-2;
// .bin, version 3 or 5) or a fitlm checkpoint (directory or file), told
// apart by content.

// Opens the weights at path as a weight source (model.h), its kind told by
// what the path holds: a checkpoint (fl_ckpt_source_open), a Hugging Face
// directory or .safetensors file (fl_hf_source_open), else an llm.c file
// (fl_llmc_source_open). The shape (s->config) is read once, here; the rows
// when a model is made of it (fl_model_init_from). path must outlive s.
void fl_weight_source_open(fl_weight_source *s, const char *path);
// Initialises *model from the weights at path, rounded to dt, with the
// base's linear layers stored in NF4 when q is enabled (a Hugging Face
// model only; q NULL: dense).
void fl_pretrained_load(const char *path, fl_model *model, fl_dtype dt, const fl_quant_config *q);
// Dies naming the tensor (source: the weights' path; adapter: the LoRA
// adapter's, or NULL) when a weight or adapter value is NaN or Inf: what a
// diverged run leaves, which sample and export refuse rather than pass on.
void fl_model_check_finite(const fl_model *m, const char *source, const char *adapter);

#endif
