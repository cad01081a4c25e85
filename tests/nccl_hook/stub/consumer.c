/* A library that uses NCCL the way libtorch does: linked against libnccl.so.2 and loaded by
 * driver.c with RTLD_LOCAL, so NCCL is not in the global symbol scope. Each scenario is one
 * test case of tests/nccl_hook/test_shim.py; rank and world size come from RANK and
 * STUB_WORLD, the communicator's unique id from a seed (as if a launcher had broadcast it).
 * Build with -DSTUB_OLD against the old stub. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int ncclResult_t;
typedef struct ncclComm *ncclComm_t;
typedef void *cudaStream_t;
typedef struct {
  char internal[128];
} ncclUniqueId;
typedef struct ncclConfig ncclConfig_t;
enum { ncclInt8 = 0, ncclUint8 = 1, ncclInt32 = 2, ncclInt64 = 4, ncclFloat16 = 6,
       ncclFloat32 = 7, ncclFloat64 = 8, ncclBfloat16 = 9 };

ncclResult_t ncclGetUniqueId(ncclUniqueId *);
ncclResult_t ncclCommInitRank(ncclComm_t *, int, ncclUniqueId, int);
ncclResult_t ncclCommInitAll(ncclComm_t *, int, const int *);
ncclResult_t ncclCommDestroy(ncclComm_t);
ncclResult_t ncclCommAbort(ncclComm_t);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);
ncclResult_t ncclAllReduce(const void *, void *, size_t, int, int, ncclComm_t, cudaStream_t);
ncclResult_t ncclAllGather(const void *, void *, size_t, int, ncclComm_t, cudaStream_t);
ncclResult_t ncclReduceScatter(const void *, void *, size_t, int, int, ncclComm_t, cudaStream_t);
ncclResult_t ncclBroadcast(const void *, void *, size_t, int, int, ncclComm_t, cudaStream_t);
ncclResult_t ncclBcast(void *, size_t, int, int, ncclComm_t, cudaStream_t);
ncclResult_t ncclReduce(const void *, void *, size_t, int, int, int, ncclComm_t, cudaStream_t);
ncclResult_t ncclSend(const void *, size_t, int, int, ncclComm_t, cudaStream_t);
ncclResult_t ncclRecv(void *, size_t, int, int, ncclComm_t, cudaStream_t);
#ifndef STUB_OLD
ncclResult_t ncclCommInitRankConfig(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *);
ncclResult_t ncclCommSplit(ncclComm_t, int, int, ncclComm_t *, ncclConfig_t *);
ncclResult_t ncclAlltoAll(const void *, void *, size_t, int, ncclComm_t, cudaStream_t);
ncclResult_t ncclGather(const void *, void *, size_t, int, int, ncclComm_t, cudaStream_t);
ncclResult_t ncclScatter(const void *, void *, size_t, int, int, ncclComm_t, cudaStream_t);
void stub_set_next_split(int rank, int size);
#endif

#define STREAM ((cudaStream_t)0x1234)
#define CHECK(call)                                                             \
  do {                                                                          \
    ncclResult_t r_ = (call);                                                   \
    if (r_ != 0) {                                                              \
      fprintf(stderr, "consumer: %s failed: %d (line %d)\n", #call, r_, __LINE__); \
      exit(3);                                                                  \
    }                                                                           \
  } while (0)

static int env_int(const char *name, int fallback) {
  const char *v = getenv(name);
  return v && *v ? atoi(v) : fallback;
}

static ncclUniqueId id_from_seed(int seed) {
  ncclUniqueId id;
  memset(&id, 0, sizeof id);
  snprintf(id.internal, sizeof id.internal, "seed-%d", seed);
  return id;
}

static ncclComm_t init(int seed, int rank, int world) {
  ncclComm_t c;
  CHECK(ncclCommInitRank(&c, world, id_from_seed(seed), rank));
  return c;
}

static int basic(int rank, int world, int seed) {
  ncclComm_t a = init(seed, rank, world);
  CHECK(ncclAllReduce(NULL, NULL, 1000, ncclFloat32, 0, a, STREAM));
  CHECK(ncclAllGather(NULL, NULL, 256, ncclFloat16, a, STREAM));
  CHECK(ncclReduceScatter(NULL, NULL, 100, ncclFloat64, 0, a, STREAM));
  CHECK(ncclBroadcast(NULL, NULL, 10, ncclInt32, 1 % world, a, STREAM));
  CHECK(ncclBcast(NULL, 7, ncclInt8, 0, a, STREAM));
  CHECK(ncclReduce(NULL, NULL, 3, ncclInt64, 0, 0, a, STREAM));
#ifndef STUB_OLD
  CHECK(ncclAlltoAll(NULL, NULL, 5, ncclFloat32, a, STREAM));
  CHECK(ncclGather(NULL, NULL, 6, ncclUint8, 0, a, STREAM));
  CHECK(ncclScatter(NULL, NULL, 4, ncclBfloat16, 0, a, STREAM));
#endif
  CHECK(ncclGroupStart());
  CHECK(ncclSend(NULL, 11, ncclBfloat16, (rank + 1) % world, a, STREAM));
  CHECK(ncclRecv(NULL, 11, ncclBfloat16, (rank + world - 1) % world, a, STREAM));
  CHECK(ncclGroupEnd());
#ifndef STUB_OLD
  ncclComm_t b, s1, s2, s3;
  CHECK(ncclCommInitRankConfig(&b, world, id_from_seed(seed + 1), rank, NULL));
  CHECK(ncclAllReduce(NULL, NULL, 1, ncclFloat64, 0, b, STREAM));
  /* split 1: even / odd ranks; the key argument differs per rank on purpose */
  stub_set_next_split(rank / 2, (world - rank % 2 + 1) / 2);
  CHECK(ncclCommSplit(a, rank % 2, 100 - rank, &s1, NULL));
  CHECK(ncclAllReduce(NULL, NULL, 2, ncclFloat32, 0, s1, STREAM));
  /* split 2: the last rank opts out (no comm), the others form one comm */
  stub_set_next_split(rank, world - 1);
  CHECK(ncclCommSplit(a, rank == world - 1 ? -1 : 0, rank, &s2, NULL));
  if (s2) CHECK(ncclAllReduce(NULL, NULL, 3, ncclInt32, 0, s2, STREAM));
  /* split 3: same color as split 2, still a different comm (the split sequence differs) */
  stub_set_next_split(rank, world);
  CHECK(ncclCommSplit(a, 0, rank, &s3, NULL));
  CHECK(ncclAllReduce(NULL, NULL, 4, ncclInt32, 0, s3, STREAM));
  CHECK(ncclCommDestroy(s1));
  if (s2) CHECK(ncclCommDestroy(s2));
  CHECK(ncclCommAbort(s3));
  CHECK(ncclCommDestroy(b));
#endif
  CHECK(ncclCommDestroy(a));
  return 0;
}

static int commid(int rank, int world) {
  /* NCCL_COMM_ID set: every ncclGetUniqueId returns the same id */
  ncclComm_t c[2];
  for (int i = 0; i < 2; i++) {
    ncclUniqueId id;
    CHECK(ncclGetUniqueId(&id));
    CHECK(ncclCommInitRank(&c[i], world, id, rank));
    CHECK(ncclAllReduce(NULL, NULL, 8, ncclFloat32, 0, c[i], STREAM));
  }
  for (int i = 0; i < 2; i++) CHECK(ncclCommDestroy(c[i]));
  return 0;
}

static int initall(void) {
  ncclComm_t c[2];
  CHECK(ncclCommInitAll(c, 2, NULL));
  for (int i = 0; i < 2; i++) CHECK(ncclAllReduce(NULL, NULL, 16, ncclFloat32, 0, c[i], STREAM));
  for (int i = 0; i < 2; i++) CHECK(ncclCommDestroy(c[i]));
  return 0;
}

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* AllReduce until `count` calls (0 = no limit) or until `stop_file` exists. */
static int loop(int rank, int world, long count, long sleep_us, const char *stop_file) {
  ncclComm_t c = init(7, rank, world);
  struct timespec nap = {sleep_us / 1000000, (sleep_us % 1000000) * 1000};
  for (long i = 0; count == 0 || i < count; i++) {
    CHECK(ncclAllReduce(NULL, NULL, 64, ncclFloat32, 0, c, STREAM));
    if (sleep_us > 0) nanosleep(&nap, NULL);
    if (stop_file && (i & 15) == 0 && access(stop_file, F_OK) == 0) break;
  }
  CHECK(ncclCommDestroy(c));
  return 0;
}

static int bench(long count) {
  ncclComm_t c = init(11, 0, 1);
  for (long i = 0; i < 1000; i++) CHECK(ncclAllReduce(NULL, NULL, 64, ncclFloat32, 0, c, STREAM));
  int64_t t0 = now_ns();
  for (long i = 0; i < count; i++) CHECK(ncclAllReduce(NULL, NULL, 64, ncclFloat32, 0, c, STREAM));
  int64_t t1 = now_ns();
  printf("%lld %ld\n", (long long)(t1 - t0), count);
  CHECK(ncclCommDestroy(c));
  return 0;
}

typedef struct {
  int index;
  long calls;
  ncclComm_t shared;
} thread_arg;

static void *thread_main(void *p) {
  thread_arg *a = p;
  ncclComm_t own = init(1000 + a->index, 0, 1);
  for (long i = 0; i < a->calls; i++) {
    CHECK(ncclAllReduce(NULL, NULL, (size_t)a->index + 1, ncclInt8, 0, own, STREAM));
    CHECK(ncclAllReduce(NULL, NULL, 100, ncclInt8, 0, a->shared, STREAM));
  }
  CHECK(ncclCommDestroy(own));
  return NULL;
}

static int threads(int n, long calls) {
  ncclComm_t shared = init(999, 0, 1);
  pthread_t t[64];
  thread_arg args[64];
  if (n > 64) n = 64;
  for (int i = 0; i < n; i++) {
    args[i] = (thread_arg){i, calls, shared};
    pthread_create(&t[i], NULL, thread_main, &args[i]);
  }
  for (int i = 0; i < n; i++) pthread_join(t[i], NULL);
  CHECK(ncclCommDestroy(shared));
  return 0;
}

static int split_via_default(int rank, int world) {
  /* An application built against a newer NCCL calling ncclCommSplit on an old one: with the
   * shim preloaded the name resolves to the shim, which must answer with an error. */
  typedef ncclResult_t (*split_t)(ncclComm_t, int, int, ncclComm_t *, void *);
  split_t split = (split_t)dlsym(RTLD_DEFAULT, "ncclCommSplit");
  ncclComm_t a = init(5, rank, world), child = NULL;
  CHECK(ncclAllReduce(NULL, NULL, 1, ncclFloat32, 0, a, STREAM));
  printf("split %s", split ? "found" : "absent");
  if (split) printf(" result %d", split(a, 0, 0, &child, NULL));
  printf("\n");
  CHECK(ncclAllReduce(NULL, NULL, 1, ncclFloat32, 0, a, STREAM));
  CHECK(ncclCommDestroy(a));
  return 0;
}

__attribute__((visibility("default"))) int fls_scenario(int argc, char **argv) {
  int rank = env_int("RANK", 0), world = env_int("STUB_WORLD", 1);
  const char *name = argc > 0 ? argv[0] : "";
  int rc = 2;
  if (!strcmp(name, "basic")) rc = basic(rank, world, argc > 1 ? atoi(argv[1]) : 1);
  else if (!strcmp(name, "commid")) rc = commid(rank, world);
  else if (!strcmp(name, "initall")) rc = initall();
  else if (!strcmp(name, "loop"))
    rc = loop(rank, world, argc > 1 ? atol(argv[1]) : 0, argc > 2 ? atol(argv[2]) : 0,
              argc > 3 ? argv[3] : NULL);
  else if (!strcmp(name, "bench")) rc = bench(argc > 1 ? atol(argv[1]) : 100000);
  else if (!strcmp(name, "threads"))
    rc = threads(argc > 1 ? atoi(argv[1]) : 4, argc > 2 ? atol(argv[2]) : 1000);
  else if (!strcmp(name, "split_via_default")) rc = split_via_default(rank, world);
  else fprintf(stderr, "consumer: unknown scenario %s\n", name);
  if (rc == 0) printf("ok %s\n", name);
  fflush(stdout);
  return rc;
}
