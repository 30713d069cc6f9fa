// offload.h: NVMe offload (DeepSpeed's zero_optimization.offload_optimizer
// and, under ZeRO-3, offload_param with device nvme, and its aio block).
// The fp32 master weights and the optimizer state of a rank's range (and
// with offload_param its shard of the model's weights) live in one scratch
// file under nvme_path; a step brings them into RAM one chunk
// (sub_group_size elements) at a time through buffer_count buffers, with
// asynchronous I/O (io_uring, O_DIRECT where the filesystem allows):
// pipeline_read reads the next chunks while one is updated, pipeline_write
// writes a chunk back while the next ones are. The file is unlinked as soon
// as it is open, so it disappears when the run ends, however it ends; it is
// scratch, never a checkpoint (checkpoints hold the whole state, read
// through a mapping of the file).
#ifndef FITLM_OFFLOAD_H
#define FITLM_OFFLOAD_H

#include <stddef.h>
#include <stdint.h>

#include "fitlm/config.h"
#include "fitlm/optim.h"

typedef struct {
    char dir[FL_PATH_MAX]; // nvme_path: an existing, writable directory
    int buffer_count;      // chunk buffers in RAM (>= 1)
    int pipeline_read;     // read ahead into free buffers while a chunk is updated
    int pipeline_write;    // a chunk's write-back runs on while the next is updated
    double chunk;          // elements per chunk (sub_group_size), rounded up to 4 KiB pages
    int block_size;        // bytes per I/O request (aio.block_size)
    int queue_depth;       // requests in flight per I/O thread (aio.queue_depth)
    int thread_count;      // I/O threads, each with its own ring (aio.thread_count)
    int single_submit;     // each request submitted on its own, else a batch at once
    int overlap_events;    // false: a batch completes before the next is submitted
    // weight offload on a device (offload_param.buffer_count, buffer_size):
    // the pinned buffers a unit's weights are read into, and their elements
    int staging_count;
    double staging_size;
} fl_offload_config;

enum { FL_OFFLOAD_MAX_STAGING = 64 }; // offload_param.buffer_count's most (reads in flight)

// Checks the offload_optimizer, offload_param and aio blocks against the
// ZeRO stage and each other (src/parallel/offload_config.c); sets
// cfg->zero.offload_params. Dies naming the key.
void fl_offload_check_config(fl_train_config *cfg);
// The offload settings of a training config's offload_optimizer and aio blocks.
fl_offload_config fl_offload_config_of(const fl_train_config *cfg);
// Whether a checked config offloads ZeRO-3's weights from a device other
// than the cpu (offload_param device cpu or nvme: device_weights.c).
int fl_dev_weights_offloaded(const fl_train_config *cfg);

// Elements per chunk for a range of numel elements.
size_t fl_offload_chunk(const fl_offload_config *cfg, size_t numel);
// What paging ntensors tensors of numel floats (and the weights, of
// weight_size bytes per element; 0: not paged) costs: RAM per tag (the
// buffers, FL_MEM_OFFLOAD; the bookkeeping, FL_MEM_OTHER) and bytes on disk.
void fl_offload_memory(const fl_offload_config *cfg, size_t numel, int ntensors, size_t weight_size,
                       size_t bytes[FL_MEM_NTAGS], size_t *disk);
// Dies naming `key` and the path unless dir is a directory this process
// can create files in, with at least `disk` bytes free.
void fl_offload_check_path(const char *key, const char *dir, size_t disk);

typedef struct fl_offload fl_offload;

// Pages optimizer o (initialised with cfg.paged) from a new file under
// cfg->dir: the master starts as the fp32 values of o's weights and the
// state as zeros (a resume then restores both through fl_optimizer_map).
// weights: the model's weights of o's range are paged too (offload_param):
// the step updates them chunk by chunk in the file, ZeRO-3 reads a unit's
// part with fl_offload_read_weights, and o->params is NULL between steps.
// The disk space is reserved at once: a full disk is an error here, not in
// the middle of a step. An I/O error or a short read later is fatal, naming
// the file, the operation and the offset.
fl_offload *fl_offload_optimizer(fl_optimizer *o, const fl_offload_config *cfg, int weights);
void fl_offload_free(fl_offload *f);

// Paged weights: the whole range's weights from src (its first element
// at o's state_begin), as ZeRO-3 hands them over once set up; and the n
// weights from flat element `first` on into dst (after the last step's
// write-backs), through the page cache, which is told to drop them again.
void fl_offload_write_weights(fl_offload *f, const void *src);
void fl_offload_read_weights(fl_offload *f, size_t first, size_t n, void *dst);
// The same read started on the offload's reader thread: a ticket to test
// (fl_offload_read_done) and wait for (fl_offload_wait_read, which dies
// naming the file on an I/O error or a short file), at most 80 at once.
int fl_offload_read_weights_async(fl_offload *f, size_t first, size_t n, void *dst);
int fl_offload_read_done(fl_offload *f, int ticket);
void fl_offload_wait_read(fl_offload *f, int ticket);

typedef struct {
    uint64_t bytes_read, bytes_written;
    double wait_s;    // the step stood waiting for I/O (what was not hidden)
    double busy_s;    // requests were in flight (summed over the I/O threads)
    double weights_s; // waiting for reads of paged weights (ZeRO-3's gathers)
} fl_offload_stats;

void fl_offload_stats_get(const fl_offload *f, fl_offload_stats *s);
// The file's name (already unlinked) and whether it is opened with O_DIRECT.
const char *fl_offload_path(const fl_offload *f);
int fl_offload_direct(const fl_offload *f);

// ZeRO-Offload on one device (src/parallel/device_offload.c): m on a device
// other than the cpu, with no gradient memory (fl_model_alloc_acts with
// FL_GRADS_HOOK), o made on its pinned host memory (master, state,
// gradient sum, and pinned copies of m's weights and gradients), cfg as
// fl_optimizer_init's. m's pre_unit hook binds each unit's gradients to a
// small device ring (fl_dev_offload_grad_bytes); they go down per unit from
// m's grad_ready hook (m->hooks is the offload's), the step updates on the
// host, and the new weights go up after it. host_params NULL: the pinned copy of the weights
// is made from m's; else (weight offload) m has no weights on the device
// and host_params, the whole weights built in pinned memory
// (fl_device_pinned's alloc, tag params), become the copy, freed with it.
struct fl_model;
typedef struct fl_dev_offload fl_dev_offload;
fl_dev_offload *fl_dev_offload_init(struct fl_model *m, fl_optimizer *o,
                                    const fl_optimizer_config *cfg, void *host_params);
// The host copy of the weights up to the model (after a restore wrote it);
// nothing under weight offload.
void fl_dev_offload_upload(fl_dev_offload *f);
// NVMe weight offload: the weights now live in the optimizer's NVMe file
// (fl_offload_optimizer with weights): the pinned copy is freed.
void fl_dev_offload_drop_params(fl_dev_offload *f);
// A delayed update still pending (offload_optimizer.delayed_update) run
// whole now and its weights sent up: the optimizer's master and state and
// the device's weights are those after every step (a checkpoint, an
// evaluation, the end of training). Nothing when none is pending.
void fl_dev_offload_flush(fl_dev_offload *f);
// How long the device waited on the host (timed on the device's compute
// stream, docs/offload.md): the steps' time, each from its first
// zero_grad to the end of its uploads, and the waits in it (the device
// idle while the host took the gradients down, updated and sent the
// weights up); a skipped step's count with the next step's.
typedef struct {
    double wait_ms, step_ms;
    long steps; // steps timed
} fl_dev_offload_waits;
void fl_dev_offload_waits_get(const fl_dev_offload *f, fl_dev_offload_waits *w);
void fl_dev_offload_free(fl_dev_offload *f); // after fl_optimizer_free; NULL is fine
// The device's gradient bytes under it (tag grads): two buffers of the
// table's largest unit, and the tied embedding's own.
size_t fl_dev_offload_grad_bytes(const fl_param_table *t, int tie_embeddings, fl_dtype dt);

// An offload's optimizer of device d's model (fl_optimizer_init's
// arguments): its state in host memory, pinned with cfg->pin_memory; its
// params and grads the offload's pinned copies.
void fl_dev_offload_optimizer_init(fl_optimizer *o, const fl_optimizer_config *cfg,
                                   const fl_param_table *t, fl_dtype dt, void *params, void *grads,
                                   const struct fl_device *d);

// ZeRO-Offload of LoRA adapters on one device (device_adapters.c): m on a
// device other than the cpu, with adapters (fl_model_add_lora) and their
// gradients (fl_model_alloc_acts); o made over their table in host memory
// (pinned with cfg->pin_memory) beside pinned copies of the adapters and
// their gradients, which move whole: the gradients down after each
// backward pass (fp32 ones after the last), the updated adapters up after
// the step. cfg as fl_optimizer_init's, without delayed_update or
// accumulate_on_device.
typedef struct fl_dev_adapters fl_dev_adapters;
fl_dev_adapters *fl_dev_adapters_init(struct fl_model *m, fl_optimizer *o,
                                      const fl_optimizer_config *cfg);
// The host copy of the adapters up to the model (after a restore wrote it).
void fl_dev_adapters_upload(fl_dev_adapters *a);
void fl_dev_adapters_free(fl_dev_adapters *a); // after fl_optimizer_free; NULL is fine

// Weight offload on one device (ZeRO-3 with offload_param): m has no
// weights on the device (m->params NULL: they were built in pinned host
// memory); with device cpu they are read from host_params (the offload's
// pinned copy, o->params; under LoRA the frozen base's pinned copy, which
// no update makes stale), with device nvme from the optimizer's NVMe file
// `store` (paged weights) through oc's staging buffers
// (offload_param.buffer_count of at most buffer_size elements). Each unit
// goes up ahead of use into stage 3's ring (fl_stage3_layout by cfg's
// stage3_* keys) through m's pre_unit hook, which chains the offload's
// pre_unit (the gradient ring) and grad_ready.
typedef struct fl_dev_weights fl_dev_weights;
fl_dev_weights *fl_dev_weights_attach(struct fl_model *m, void *host_params, fl_offload *store,
                                      const fl_zero_config *cfg, const fl_offload_config *oc);
// before fl_offload_free and fl_dev_offload_free; NULL is fine
void fl_dev_weights_free(fl_dev_weights *w);
// The device bytes of weights it holds (the residents and the ring).
size_t fl_dev_weights_bytes(const fl_zero_config *cfg, const fl_param_table *t, int n_layer,
                            fl_dtype dt);
// Under NVMe: the pinned staging buffers' bytes (tag offload).
size_t fl_dev_weights_staging_bytes(const fl_offload_config *oc, const fl_zero_config *cfg,
                                    const fl_param_table *t, int n_layer, fl_dtype dt);

#endif
