/* The native ring writer and pause trap shared by the NCCL shim's hooks (see writer.c). */
#ifndef FAILSLOW_WRITER_H
#define FAILSLOW_WRITER_H

#include <stdint.h>

#include "ring.h"

#define FLS_HIDDEN __attribute__((visibility("hidden")))
#define FLS_LIKELY(x) __builtin_expect(!!(x), 1)
#define FLS_UNLIKELY(x) __builtin_expect(!!(x), 0)

typedef struct fls_writer {
  fls_ring_header *hdr;     /* NULL when recording is off (pass-through) */
  fls_record *rec;
  uint64_t mask;            /* capacity - 1 */
  int64_t pause_timeout_ns; /* FAILSLOW_PAUSE_TIMEOUT_S */
  int32_t global_rank, local_rank;
  int pid;
  char ring_path[4096];
  char groups_path[4096];
  char host[256];
} fls_writer;

extern fls_writer fls_w FLS_HIDDEN;

/* One line on stderr, prefixed "failslow shim: ", written with a single write(). */
void fls_note(const char *fmt, ...) FLS_HIDDEN __attribute__((format(printf, 1, 2)));
int64_t fls_now_ns(void) FLS_HIDDEN;
/* Opens the ring from the environment once per process (again after fork). Returns 1 when
 * recording is on. */
int fls_writer_ready(void) FLS_HIDDEN;
/* Reserves a slot, writes the record and commits it (commit word last, release store). */
void fls_emit(int64_t t_start, int64_t t_end, uint64_t nbytes, uint64_t group_key,
              uint64_t call_index, int op, int dtype, int flags, int32_t peer) FLS_HIDDEN;
/* The pause trap: parks the caller while the control word asks for it (writer.c). */
void fls_park(uint64_t control) FLS_HIDDEN;
extern uint64_t fls_ignored_control FLS_HIDDEN;

/* `key`/`call_index`: the communicator key and the call_index the call about to start will
 * get. A targeted pause (pause_group != 0, written before control) parks only at that group's
 * call with call_index >= pause_call, so every member parks at the same collective. */
static inline void fls_pause_trap(uint64_t key, uint64_t call_index) {
  uint64_t control = __atomic_load_n(&fls_w.hdr->control, __ATOMIC_ACQUIRE);
  if (FLS_LIKELY(control == 0)) {
    if (FLS_UNLIKELY(__atomic_load_n(&fls_ignored_control, __ATOMIC_RELAXED) != 0))
      __atomic_store_n(&fls_ignored_control, 0, __ATOMIC_RELAXED);
    return;
  }
  uint64_t group = __atomic_load_n(&fls_w.hdr->pause_group, __ATOMIC_ACQUIRE);
  if (group != 0 &&
      (key != group || call_index < __atomic_load_n(&fls_w.hdr->pause_call, __ATOMIC_ACQUIRE)))
    return;
  if (control != __atomic_load_n(&fls_ignored_control, __ATOMIC_RELAXED)) fls_park(control);
}

/* Appends one line to the groups file beside the ring (O_APPEND, one write). */
void fls_append_group_line(const char *line, int len) FLS_HIDDEN;

#endif /* FAILSLOW_WRITER_H */
