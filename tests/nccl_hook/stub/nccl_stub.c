/* A stand-in libnccl.so.2 for testing the failslow shim without GPUs.
 *
 * Like real NCCL it exports every API twice: a global pnccl<X> and a weak nccl<X> alias, and
 * its ncclBcast calls the exported ncclBroadcast (so an LD_PRELOAD shim sees a nested call).
 * Collectives sleep STUB_NCCL_DELAY_US microseconds. Build with -DSTUB_OLD for an "older NCCL"
 * without ncclCommSplit, ncclCommInitRankConfig, ncclAlltoAll, ncclGather and ncclScatter.
 * Communicators are plain heap objects; ncclCommSplit takes the new rank and size from
 * stub_set_next_split() because a stub cannot ask its peers. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int ncclResult_t;
typedef int ncclDataType_t;
typedef int ncclRedOp_t;
typedef void *cudaStream_t;
typedef struct {
  char internal[128];
} ncclUniqueId;
typedef struct ncclConfig ncclConfig_t;
struct ncclComm {
  int rank, nranks, alive;
};
typedef struct ncclComm *ncclComm_t;

#define API(ret, name, ...)                                                             \
  __attribute__((visibility("default"))) ret p##name(__VA_ARGS__);                      \
  __attribute__((visibility("default"), weak, alias("p" #name))) ret name(__VA_ARGS__); \
  ret p##name(__VA_ARGS__)

static void delay(void) {
  static long us = -1;
  if (us < 0) {
    const char *v = getenv("STUB_NCCL_DELAY_US");
    us = v && *v ? atol(v) : 0;
  }
  if (us > 0) {
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
  }
}

static int check(ncclComm_t comm) { return comm && comm->alive ? 0 : 4 /* ncclInvalidArgument */; }

API(ncclResult_t, ncclGetUniqueId, ncclUniqueId *id) {
  static unsigned counter;
  memset(id, 0, sizeof *id);
  const char *fixed = getenv("NCCL_COMM_ID");
  if (fixed && *fixed) { /* like real NCCL: the id only carries the rendezvous address */
    strncpy(id->internal, fixed, sizeof id->internal - 1);
    return 0;
  }
  snprintf(id->internal, sizeof id->internal, "stub-%d-%u-%ld", (int)getpid(), counter++,
           (long)time(NULL));
  return 0;
}

static ncclComm_t new_comm(int rank, int nranks) {
  ncclComm_t c = calloc(1, sizeof *c);
  c->rank = rank;
  c->nranks = nranks;
  c->alive = 1;
  return c;
}

API(ncclResult_t, ncclCommInitRank, ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
  (void)id;
  if (rank < 0 || rank >= nranks) return 4;
  *comm = new_comm(rank, nranks);
  return 0;
}

API(ncclResult_t, ncclCommInitAll, ncclComm_t *comms, int ndev, const int *devlist) {
  (void)devlist;
  for (int i = 0; i < ndev; i++) comms[i] = new_comm(i, ndev);
  return 0;
}

API(ncclResult_t, ncclCommDestroy, ncclComm_t comm) {
  if (check(comm)) return 4;
  comm->alive = 0; /* leaked on purpose: a freed address could be reused by the next comm */
  return 0;
}

API(ncclResult_t, ncclCommAbort, ncclComm_t comm) { return pncclCommDestroy(comm); }

API(ncclResult_t, ncclCommUserRank, const ncclComm_t comm, int *rank) {
  if (check(comm)) return 4;
  *rank = comm->rank;
  return 0;
}

API(ncclResult_t, ncclCommCount, const ncclComm_t comm, int *count) {
  if (check(comm)) return 4;
  *count = comm->nranks;
  return 0;
}

API(ncclResult_t, ncclGroupStart, void) { return 0; }
API(ncclResult_t, ncclGroupEnd, void) {
  /* STUB_GROUP_END_DELAY_US: the group's launch takes this long (device timing tests) */
  const char *v = getenv("STUB_GROUP_END_DELAY_US");
  long us = v && *v ? atol(v) : 0;
  if (us > 0) {
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
  }
  return 0;
}

#define COLL_BODY \
  do {            \
    if (check(comm)) return 4; \
    delay();      \
    return 0;     \
  } while (0)

API(ncclResult_t, ncclAllReduce, const void *s, void *r, size_t n, ncclDataType_t dt,
    ncclRedOp_t op, ncclComm_t comm, cudaStream_t st) {
  (void)s, (void)r, (void)n, (void)dt, (void)op, (void)st;
  COLL_BODY;
}
API(ncclResult_t, ncclAllGather, const void *s, void *r, size_t n, ncclDataType_t dt,
    ncclComm_t comm, cudaStream_t st) {
  (void)s, (void)r, (void)n, (void)dt, (void)st;
  COLL_BODY;
}
API(ncclResult_t, ncclReduceScatter, const void *s, void *r, size_t n, ncclDataType_t dt,
    ncclRedOp_t op, ncclComm_t comm, cudaStream_t st) {
  (void)s, (void)r, (void)n, (void)dt, (void)op, (void)st;
  COLL_BODY;
}
API(ncclResult_t, ncclBroadcast, const void *s, void *r, size_t n, ncclDataType_t dt, int root,
    ncclComm_t comm, cudaStream_t st) {
  (void)s, (void)r, (void)n, (void)dt, (void)root, (void)st;
  COLL_BODY;
}
API(ncclResult_t, ncclBcast, void *buf, size_t n, ncclDataType_t dt, int root, ncclComm_t comm,
    cudaStream_t st) {
  return ncclBroadcast(buf, buf, n, dt, root, comm, st); /* through the exported name */
}
API(ncclResult_t, ncclReduce, const void *s, void *r, size_t n, ncclDataType_t dt,
    ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t st) {
  (void)s, (void)r, (void)n, (void)dt, (void)op, (void)root, (void)st;
  COLL_BODY;
}
API(ncclResult_t, ncclSend, const void *s, size_t n, ncclDataType_t dt, int peer,
    ncclComm_t comm, cudaStream_t st) {
  (void)s, (void)n, (void)dt, (void)peer, (void)st;
  COLL_BODY;
}
API(ncclResult_t, ncclRecv, void *r, size_t n, ncclDataType_t dt, int peer, ncclComm_t comm,
    cudaStream_t st) {
  (void)r, (void)n, (void)dt, (void)peer, (void)st;
  COLL_BODY;
}

#ifndef STUB_OLD
API(ncclResult_t, ncclCommInitRankConfig, ncclComm_t *comm, int nranks, ncclUniqueId id,
    int rank, ncclConfig_t *config) {
  (void)config;
  return pncclCommInitRank(comm, nranks, id, rank);
}

static int next_split_rank = -1, next_split_size = -1;
__attribute__((visibility("default"))) void stub_set_next_split(int rank, int size) {
  next_split_rank = rank;
  next_split_size = size;
}

API(ncclResult_t, ncclCommSplit, ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
    ncclConfig_t *config) {
  (void)key, (void)config;
  if (check(comm)) return 4;
  if (color == -1 /* NCCL_SPLIT_NOCOLOR */) {
    *newcomm = NULL;
    return 0;
  }
  *newcomm = new_comm(next_split_rank >= 0 ? next_split_rank : comm->rank,
                      next_split_size > 0 ? next_split_size : comm->nranks);
  return 0;
}

API(ncclResult_t, ncclAlltoAll, const void *s, void *r, size_t n, ncclDataType_t dt,
    ncclComm_t comm, cudaStream_t st) {
  (void)s, (void)r, (void)n, (void)dt, (void)st;
  COLL_BODY;
}
API(ncclResult_t, ncclGather, const void *s, void *r, size_t n, ncclDataType_t dt, int root,
    ncclComm_t comm, cudaStream_t st) {
  (void)s, (void)r, (void)n, (void)dt, (void)root, (void)st;
  COLL_BODY;
}
API(ncclResult_t, ncclScatter, const void *s, void *r, size_t n, ncclDataType_t dt, int root,
    ncclComm_t comm, cudaStream_t st) {
  (void)s, (void)r, (void)n, (void)dt, (void)root, (void)st;
  COLL_BODY;
}
#endif
