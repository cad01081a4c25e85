/* Communicator table: comm handle -> group key, rank, size, per-comm call counter (comms.c). */
#ifndef FAILSLOW_COMMS_H
#define FAILSLOW_COMMS_H

#include <stdint.h>

#include "writer.h"

typedef struct fls_comm {
  void *comm;          /* the ncclComm_t; NULL = empty slot, FLS_COMM_GONE = destroyed */
  uint64_t key;        /* equal on every member (see comms.c) */
  uint64_t parent_key; /* 0 unless made by ncclCommSplit */
  int color;           /* split color, -1 otherwise */
  int rank, size;      /* -1 until known */
  int published;       /* membership line written */
  uint64_t split_seq;  /* ncclCommSplit calls made on this comm (atomic) */
  uint64_t calls;      /* recorded calls on this comm (atomic) */
} fls_comm;

#define FLS_COMM_GONE ((void *)1)

typedef int (*fls_rank_query_t)(void *comm, int *out);

/* Lock-free lookup; NULL when the comm was not created through a hooked entry point. */
fls_comm *fls_comm_find(void *comm) FLS_HIDDEN;
/* Registers a new communicator and publishes its membership line when rank/size are known. */
fls_comm *fls_comm_add(void *comm, uint64_t key, uint64_t parent_key, int color, int rank,
                       int size) FLS_HIDDEN;
void fls_comm_remove(void *comm) FLS_HIDDEN;
/* Writes the membership line of a comm whose rank/size were unknown at creation (queried now
 * through ncclCommUserRank/ncclCommCount). */
void fls_comm_publish_late(fls_comm *c, fls_rank_query_t user_rank, fls_rank_query_t count)
    FLS_HIDDEN;

uint64_t fls_key_of_unique_id(const void *id, int len) FLS_HIDDEN;
uint64_t fls_key_of_split(uint64_t parent_key, int color, uint64_t split_seq) FLS_HIDDEN;
uint64_t fls_key_of_init_all(void) FLS_HIDDEN;
/* Counter shared by records of calls without a communicator (group start/end, unknown comm). */
extern uint64_t fls_nocomm_calls FLS_HIDDEN;

#endif /* FAILSLOW_COMMS_H */
