/* failslow event ring: the C view of failslow/core/ring.py (HEADER_LAYOUT) and events.py
 * (RECORD_LAYOUT, OpCode, DType, Source, Flags). Those are the one definition; test_shim.py
 * compiles a program against this header and compares every offset and size with it. */
#ifndef FAILSLOW_RING_H
#define FAILSLOW_RING_H

#include <stddef.h>
#include <stdint.h>

#define FLS_RING_MAGIC 0x474E495257534C46ULL /* b"FLSWRING" as a little-endian u64 */
#define FLS_RING_VERSION 1u
#define FLS_HEADER_SIZE 256u
#define FLS_RECORD_SIZE 64u
#define FLS_DEFAULT_CAPACITY 65536u

typedef struct fls_ring_header {
  uint64_t magic;          /* 0   written last when the ring is created */
  uint32_t version;        /* 8 */
  uint32_t record_size;    /* 12 */
  uint64_t capacity;       /* 16  power of two */
  uint64_t write_index;    /* 24  atomic fetch-and-add by writers */
  uint64_t dropped;        /* 32 */
  int64_t pid;             /* 40 */
  int32_t global_rank;     /* 48 */
  int32_t local_rank;      /* 52 */
  int64_t mono_anchor_ns;  /* 56 */
  int64_t wall_anchor_ns;  /* 64 */
  uint64_t control;        /* 72  pause trap: 0 = run, else pause */
  uint64_t parked;         /* 80  write_index + 1 while a thread is parked, 0 = none */
  uint64_t self_releases;  /* 88  parks ended by the trap's timeout */
  uint64_t pause_group;    /* 96  0: park at the next call; else only at this group's call */
  uint64_t pause_call;     /* 104 with call_index >= pause_call (a targeted pause) */
  int64_t settled_ns;      /* 112 calls started before this are committed; 0 = not kept here */
  uint8_t reserved[136];   /* 120 */
} fls_ring_header;

typedef struct fls_record {
  uint64_t commit;      /* 0   0 while being written, index + 1 once complete (release store) */
  int64_t t_start_ns;   /* 8   CLOCK_MONOTONIC */
  int64_t t_end_ns;     /* 16  CLOCK_MONOTONIC, 0 = unknown */
  uint64_t nbytes;      /* 24 */
  uint64_t group_key;   /* 32 */
  uint64_t call_index;  /* 40 */
  uint16_t op;          /* 48  fls_op */
  uint16_t dtype;       /* 50  fls_dtype */
  uint8_t source;       /* 52  fls_source */
  uint8_t flags;        /* 53  fls_flags */
  uint16_t reserved0;   /* 54 */
  int32_t peer;         /* 56 */
  uint32_t reserved1;   /* 60 */
} fls_record;

_Static_assert(sizeof(fls_ring_header) == FLS_HEADER_SIZE, "ring header is 256 bytes");
_Static_assert(sizeof(fls_record) == FLS_RECORD_SIZE, "ring record is 64 bytes");
_Static_assert(offsetof(fls_ring_header, control) == 72, "control word at 72");
_Static_assert(offsetof(fls_record, peer) == 56, "peer at 56");

/* Appends one record: reserves slot write_index by fetch-and-add, then seqlock-style commit 0,
 * fence, body, commit index + 1 with a release store (events.py, the reader's protocol). The
 * one writer protocol of the C shim (writer.c) and the hook's C++ kernel (hook.cpp). */
static inline uint64_t fls_ring_emit(fls_ring_header *h, fls_record *rec, uint64_t mask,
                                     int64_t t_start, int64_t t_end, uint64_t nbytes,
                                     uint64_t group_key, uint64_t call_index, int op, int dtype,
                                     int source, int flags, int32_t peer) {
  uint64_t i = __atomic_fetch_add(&h->write_index, 1, __ATOMIC_RELAXED);
  fls_record *r = &rec[i & mask];
  __atomic_store_n(&r->commit, 0, __ATOMIC_RELAXED);
  __atomic_thread_fence(__ATOMIC_RELEASE);
  r->t_start_ns = t_start;
  r->t_end_ns = t_end;
  r->nbytes = nbytes;
  r->group_key = group_key;
  r->call_index = call_index;
  r->op = (uint16_t)op;
  r->dtype = (uint16_t)dtype;
  r->source = (uint8_t)source;
  r->flags = (uint8_t)flags;
  r->reserved0 = 0;
  r->peer = peer;
  r->reserved1 = 0;
  __atomic_store_n(&r->commit, i + 1, __ATOMIC_RELEASE);
  return i;
}

/* X-macro lists so a test program can print every name with its value. */
#define FLS_OPS(X)                                                                     \
  X(UNKNOWN, 0) X(ALLREDUCE, 1) X(ALLGATHER, 2) X(REDUCE_SCATTER, 3) X(BROADCAST, 4)   \
  X(REDUCE, 5) X(ALLTOALL, 6) X(GATHER, 7) X(SCATTER, 8) X(SEND, 9) X(RECV, 10)        \
  X(BARRIER, 11) X(ALLREDUCE_COALESCED, 12) X(ALLGATHER_COALESCED, 13)                 \
  X(REDUCE_SCATTER_COALESCED, 14) X(GROUP_START, 15) X(GROUP_END, 16)                 \
  X(STEP, 17) /* not a call: the Python hook's step marker */
#define FLS_DTYPES(X)                                                                  \
  X(UNKNOWN, 0) X(FLOAT32, 1) X(FLOAT16, 2) X(BFLOAT16, 3) X(FLOAT64, 4) X(INT8, 5)    \
  X(UINT8, 6) X(INT32, 7) X(INT64, 8) X(FP8_E4M3, 9) X(FP8_E5M2, 10) X(BOOL, 11)
#define FLS_SOURCES(X) X(UNKNOWN, 0) X(SHIM, 1) X(PYTHON, 2)
#define FLS_FLAGS(X) X(NONE, 0) X(ASYNC_OP, 1) X(COALESCED, 2) X(FAILED, 4) X(END_IS_ENQUEUE, 8)

#define FLS_ENUM_ITEM_OP(name, value) FLS_OP_##name = value,
#define FLS_ENUM_ITEM_DT(name, value) FLS_DT_##name = value,
#define FLS_ENUM_ITEM_SRC(name, value) FLS_SRC_##name = value,
#define FLS_ENUM_ITEM_FL(name, value) FLS_FL_##name = value,
enum fls_op { FLS_OPS(FLS_ENUM_ITEM_OP) };
enum fls_dtype { FLS_DTYPES(FLS_ENUM_ITEM_DT) };
enum fls_source { FLS_SOURCES(FLS_ENUM_ITEM_SRC) };
enum fls_flags { FLS_FLAGS(FLS_ENUM_ITEM_FL) };

/* Every header and record field: (name, offset, size), for the layout test. */
#define FLS_HEADER_FIELDS(X)                                                                 \
  X(magic) X(version) X(record_size) X(capacity) X(write_index) X(dropped) X(pid)            \
  X(global_rank) X(local_rank) X(mono_anchor_ns) X(wall_anchor_ns) X(control) X(parked)      \
  X(self_releases) X(pause_group) X(pause_call) X(settled_ns)
#define FLS_RECORD_FIELDS(X)                                                                 \
  X(commit) X(t_start_ns) X(t_end_ns) X(nbytes) X(group_key) X(call_index) X(op) X(dtype)    \
  X(source) X(flags) X(peer)

#endif /* FAILSLOW_RING_H */
