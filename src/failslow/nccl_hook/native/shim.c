/* failslow NCCL capture shim (LD_PRELOAD), greyhound 4.2 and 6: the Monitor hooks NCCL's
 * top-level entry points and logs each call's type, size and timestamps into the shared-memory
 * ring of failslow/core/ring.py (written by writer.c), and pauses training at the next
 * collective when the controller asks (the pause trap, writer.c).
 *
 * Resolution of the real functions happens lazily, at the first call of each entry point
 * (libnccl may be loaded after the shim): dlopen(FAILSLOW_NCCL_LIB or "libnccl.so.2",
 * RTLD_NOW | RTLD_NOLOAD) and dlsym "pncclX" (real NCCL exports every API as a global pncclX and
 * a weak ncclX), then "ncclX" in that handle, then dlsym(RTLD_NEXT, "ncclX"). The NOLOAD path is
 * what works under PyTorch, which loads libnccl privately (RTLD_LOCAL) so RTLD_NEXT sees nothing;
 * it never loads a second copy. If no real function is found, the hooked entry point returns
 * ncclSystemError (2) and writes one stderr line: the library stack, not the caller, is at fault,
 * and the process keeps running. An application only calls what its NCCL exports, so this shows
 * up only when the shim cannot see the library the application uses (FAILSLOW_NCCL_LIB fixes it).
 *
 * Recording is on only when FAILSLOW_RING_DIR is set; otherwise every hook is a pass-through.
 * A thread-local depth guard makes NCCL's calls to its own entry points (ncclBcast calls
 * ncclBroadcast) pass straight through, so each application call is recorded once.
 *
 * Record fields as the shim fills them: nbytes is this rank's input (count * element size; for
 * AllGather the send count; for ReduceScatter and AlltoAll count * comm size; Scatter counts its
 * input on the root only). peer is the root (Broadcast, Reduce, Gather, Scatter) or the peer
 * (Send, Recv) as a rank WITHIN the communicator: NCCL does not know global ranks; map it
 * through GroupInfo.ranks[peer] of the record's group. t_end_ns is when the call returned
 * (Flags.END_IS_ENQUEUE) unless device timing is on (device.c). call_index counts the recorded
 * calls of each communicator; GroupStart/GroupEnd carry group_key 0. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comms.h"
#include "device.h"
#include "writer.h"

#define EXPORT __attribute__((visibility("default")))
#define FLS_SHIM_VERSION "0.1.0"

/* The NCCL ABI we need, declared here: the shim builds without nccl.h or CUDA headers. */
typedef int ncclResult_t;
typedef int ncclDataType_t;
typedef int ncclRedOp_t;
typedef struct ncclComm *ncclComm_t;
typedef struct CUstream_st *cudaStream_t;
typedef struct ncclConfig ncclConfig_t; /* passed through untouched */
typedef struct {
  char internal[128];
} ncclUniqueId;
enum { ncclSuccess = 0, ncclSystemError = 2, ncclInProgress = 7 };

/* Hooked entry points (names without the "nccl" prefix), then helpers the shim only calls. */
#define FLS_HOOKED(X)                                                                         \
  X(AllReduce) X(AllGather) X(ReduceScatter) X(Broadcast) X(Bcast) X(Reduce) X(AlltoAll)      \
  X(Gather) X(Scatter) X(Send) X(Recv) X(GroupStart) X(GroupEnd) X(CommInitRank)              \
  X(CommInitRankConfig) X(CommInitAll) X(CommSplit) X(CommDestroy) X(CommAbort)
#define FLS_HELPERS(X) X(CommUserRank) X(CommCount)

#define SYM_ENUM(n) SYM_##n,
enum { FLS_HOOKED(SYM_ENUM) SYM_N_HOOKED, SYM_HELPERS_ = SYM_N_HOOKED - 1, FLS_HELPERS(SYM_ENUM)
       SYM_COUNT };
#define SYM_NAME(n) #n,
static const char *const sym_names[SYM_COUNT] = {FLS_HOOKED(SYM_NAME) FLS_HELPERS(SYM_NAME)};

enum { HOW_NONE = 0, HOW_PNCCL = 1, HOW_NCCL = 2, HOW_MISSING = 3 };
static void *sym_fn[SYM_COUNT];
static int sym_how[SYM_COUNT];
static void *own_fn[SYM_COUNT]; /* our own hooks, never to be mistaken for the real thing */

static __thread int t_depth;  /* > 0 while inside a hooked call: inner calls pass through */
static __thread int t_group;  /* ncclGroupStart nesting seen from this thread */

static const char *lib_name(void) {
  const char *v = getenv("FAILSLOW_NCCL_LIB");
  return v && *v ? v : "libnccl.so.2";
}

/* The lookup order of the hooks (and of failslow_shim_resolve) for one symbol. */
static void *lookup(void *handle, int id, int *how) {
  char name[64];
  void *f;
  if (handle) {
    snprintf(name, sizeof name, "pnccl%s", sym_names[id]);
    if ((f = dlsym(handle, name)) && f != own_fn[id]) return *how = HOW_PNCCL, f;
    snprintf(name, sizeof name, "nccl%s", sym_names[id]);
    if ((f = dlsym(handle, name)) && f != own_fn[id]) return *how = HOW_NCCL, f;
  }
  snprintf(name, sizeof name, "nccl%s", sym_names[id]);
  if ((f = dlsym(RTLD_NEXT, name)) && f != own_fn[id]) return *how = HOW_NCCL, f;
  return *how = HOW_MISSING, NULL;
}

static void *resolve_slow(int id) {
  int how = __atomic_load_n(&sym_how[id], __ATOMIC_ACQUIRE);
  if (how == HOW_MISSING) return NULL;
  void *handle = dlopen(lib_name(), RTLD_NOW | RTLD_NOLOAD);
  void *f = lookup(handle, id, &how);
  if (handle) dlclose(handle); /* drops the reference NOLOAD took; the library stays loaded */
  __atomic_store_n(&sym_fn[id], f, __ATOMIC_RELEASE);
  if (__atomic_exchange_n(&sym_how[id], how, __ATOMIC_ACQ_REL) != how && !f)
    fls_note("nccl%s: no real function in %s (pnccl%s) nor after the shim; returning "
             "ncclSystemError", sym_names[id], lib_name(), sym_names[id]);
  return f;
}

static inline void *real(int id) {
  void *f = __atomic_load_n(&sym_fn[id], __ATOMIC_ACQUIRE);
  return FLS_LIKELY(f != NULL) ? f : resolve_slow(id);
}

/* Element sizes by ncclDataType_t and the matching failslow DType. */
static const unsigned char dt_size[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1};
static const unsigned char dt_code[] = {
    FLS_DT_INT8,  FLS_DT_UINT8,   FLS_DT_INT32,   FLS_DT_UNKNOWN,  FLS_DT_INT64,   FLS_DT_UNKNOWN,
    FLS_DT_FLOAT16, FLS_DT_FLOAT32, FLS_DT_FLOAT64, FLS_DT_BFLOAT16, FLS_DT_FP8_E4M3,
    FLS_DT_FP8_E5M2};
#define N_DT ((int)sizeof dt_size)

typedef struct call {
  int64_t t_start;
  fls_comm *comm;
  void *ev0; /* device start event, NULL without device timing */
} call;

/* Entry of a recorded call: guard, pause trap, start time. Returns 0 for a pass-through. */
static inline int begin(call *c, ncclComm_t comm, cudaStream_t stream) {
  if (t_depth || !fls_writer_ready()) return 0;
  t_depth++;
  c->comm = fls_comm_find(comm);
  if (c->comm)
    fls_pause_trap(c->comm->key, __atomic_load_n(&c->comm->calls, __ATOMIC_RELAXED));
  else
    fls_pause_trap(0, 0);
  c->ev0 = NULL;
  /* stream 0 is the legacy default stream: PyTorch issues a synchronous collective on the
   * current stream, which is that one unless the job set another (seen on an H200) */
  if (FLS_UNLIKELY(fls_device_enabled())) c->ev0 = fls_device_begin(stream);
  c->t_start = fls_now_ns();
  return 1;
}

static void late_publish(fls_comm *fc) {
  fls_comm_publish_late(fc, (fls_rank_query_t)real(SYM_CommUserRank),
                        (fls_rank_query_t)real(SYM_CommCount));
}

/* Exit of a recorded call: writes the record (or hands it to the device harvester). */
static inline void finish(call *c, ncclResult_t res, int op, size_t count, ncclDataType_t dt,
                          size_t multiplier, int32_t peer, cudaStream_t stream) {
  int64_t t_end = fls_now_ns();
  fls_comm *fc = c->comm;
  uint64_t key = 0, index;
  if (fc) {
    if (FLS_UNLIKELY(!fc->published)) late_publish(fc);
    key = fc->key;
    index = __atomic_fetch_add(&fc->calls, 1, __ATOMIC_RELAXED);
  } else {
    index = __atomic_fetch_add(&fls_nocomm_calls, 1, __ATOMIC_RELAXED);
  }
  int known = dt >= 0 && dt < N_DT;
  uint64_t nbytes = (uint64_t)count * (known ? dt_size[dt] : 0) * multiplier;
  int dtype = known ? dt_code[dt] : FLS_DT_UNKNOWN;
  int flags = (res == ncclSuccess || res == ncclInProgress) ? 0 : FLS_FL_FAILED;
  if (c->ev0 && (flags & FLS_FL_FAILED)) {
    fls_device_drop(c->ev0);
  } else if (c->ev0 && t_group > 0) { /* launched at the group's end: its end event waits */
    if (fls_device_defer(c->ev0, stream, c->t_start, t_end, nbytes, key, index, op, dtype,
                         flags, peer)) {
      t_depth--;
      return;
    }
  } else if (c->ev0 && fls_device_end(c->ev0, stream, c->t_start, t_end, nbytes, key, index, op,
                                      dtype, flags, peer)) {
    t_depth--;
    return;
  }
  fls_emit(c->t_start, t_end, nbytes, key, index, op, dtype, flags | FLS_FL_END_IS_ENQUEUE, peer);
  t_depth--;
}

static ncclResult_t missing(int id) {
  (void)id; /* resolve_slow wrote the one-time note */
  return ncclSystemError;
}

static size_t comm_size(const call *c) {
  return c->comm && c->comm->size > 0 ? (size_t)c->comm->size : 1;
}

/* ---- collectives and point-to-point ------------------------------------------------------- */

#define REAL(NAME, RET, ...)                                                  \
  typedef RET (*fn_t)(__VA_ARGS__);                                           \
  fn_t f = (fn_t)real(SYM_##NAME);                                            \
  if (FLS_UNLIKELY(!f)) return missing(SYM_##NAME)

EXPORT ncclResult_t ncclAllReduce(const void *s, void *r, size_t n, ncclDataType_t dt,
                                  ncclRedOp_t op, ncclComm_t comm, cudaStream_t st) {
  REAL(AllReduce, ncclResult_t, const void *, void *, size_t, ncclDataType_t, ncclRedOp_t,
       ncclComm_t, cudaStream_t);
  call c;
  if (!begin(&c, comm, st)) return f(s, r, n, dt, op, comm, st);
  ncclResult_t res = f(s, r, n, dt, op, comm, st);
  finish(&c, res, FLS_OP_ALLREDUCE, n, dt, 1, -1, st);
  return res;
}

EXPORT ncclResult_t ncclAllGather(const void *s, void *r, size_t sendcount, ncclDataType_t dt,
                                  ncclComm_t comm, cudaStream_t st) {
  REAL(AllGather, ncclResult_t, const void *, void *, size_t, ncclDataType_t, ncclComm_t,
       cudaStream_t);
  call c;
  if (!begin(&c, comm, st)) return f(s, r, sendcount, dt, comm, st);
  ncclResult_t res = f(s, r, sendcount, dt, comm, st);
  finish(&c, res, FLS_OP_ALLGATHER, sendcount, dt, 1, -1, st);
  return res;
}

EXPORT ncclResult_t ncclReduceScatter(const void *s, void *r, size_t recvcount,
                                      ncclDataType_t dt, ncclRedOp_t op, ncclComm_t comm,
                                      cudaStream_t st) {
  REAL(ReduceScatter, ncclResult_t, const void *, void *, size_t, ncclDataType_t, ncclRedOp_t,
       ncclComm_t, cudaStream_t);
  call c;
  if (!begin(&c, comm, st)) return f(s, r, recvcount, dt, op, comm, st);
  ncclResult_t res = f(s, r, recvcount, dt, op, comm, st);
  finish(&c, res, FLS_OP_REDUCE_SCATTER, recvcount, dt, comm_size(&c), -1, st);
  return res;
}

EXPORT ncclResult_t ncclBroadcast(const void *s, void *r, size_t n, ncclDataType_t dt, int root,
                                  ncclComm_t comm, cudaStream_t st) {
  REAL(Broadcast, ncclResult_t, const void *, void *, size_t, ncclDataType_t, int, ncclComm_t,
       cudaStream_t);
  call c;
  if (!begin(&c, comm, st)) return f(s, r, n, dt, root, comm, st);
  ncclResult_t res = f(s, r, n, dt, root, comm, st);
  finish(&c, res, FLS_OP_BROADCAST, n, dt, 1, root, st);
  return res;
}

EXPORT ncclResult_t ncclBcast(void *buf, size_t n, ncclDataType_t dt, int root, ncclComm_t comm,
                              cudaStream_t st) {
  REAL(Bcast, ncclResult_t, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  call c;
  if (!begin(&c, comm, st)) return f(buf, n, dt, root, comm, st);
  ncclResult_t res = f(buf, n, dt, root, comm, st);
  finish(&c, res, FLS_OP_BROADCAST, n, dt, 1, root, st);
  return res;
}

EXPORT ncclResult_t ncclReduce(const void *s, void *r, size_t n, ncclDataType_t dt,
                               ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t st) {
  REAL(Reduce, ncclResult_t, const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, int,
       ncclComm_t, cudaStream_t);
  call c;
  if (!begin(&c, comm, st)) return f(s, r, n, dt, op, root, comm, st);
  ncclResult_t res = f(s, r, n, dt, op, root, comm, st);
  finish(&c, res, FLS_OP_REDUCE, n, dt, 1, root, st);
  return res;
}

EXPORT ncclResult_t ncclAlltoAll(const void *s, void *r, size_t n, ncclDataType_t dt,
                                 ncclComm_t comm, cudaStream_t st) {
  REAL(AlltoAll, ncclResult_t, const void *, void *, size_t, ncclDataType_t, ncclComm_t,
       cudaStream_t);
  call c;
  if (!begin(&c, comm, st)) return f(s, r, n, dt, comm, st);
  ncclResult_t res = f(s, r, n, dt, comm, st);
  finish(&c, res, FLS_OP_ALLTOALL, n, dt, comm_size(&c), -1, st);
  return res;
}

EXPORT ncclResult_t ncclGather(const void *s, void *r, size_t n, ncclDataType_t dt, int root,
                               ncclComm_t comm, cudaStream_t st) {
  REAL(Gather, ncclResult_t, const void *, void *, size_t, ncclDataType_t, int, ncclComm_t,
       cudaStream_t);
  call c;
  if (!begin(&c, comm, st)) return f(s, r, n, dt, root, comm, st);
  ncclResult_t res = f(s, r, n, dt, root, comm, st);
  finish(&c, res, FLS_OP_GATHER, n, dt, 1, root, st);
  return res;
}

EXPORT ncclResult_t ncclScatter(const void *s, void *r, size_t n, ncclDataType_t dt, int root,
                                ncclComm_t comm, cudaStream_t st) {
  REAL(Scatter, ncclResult_t, const void *, void *, size_t, ncclDataType_t, int, ncclComm_t,
       cudaStream_t);
  call c;
  if (!begin(&c, comm, st)) return f(s, r, n, dt, root, comm, st);
  ncclResult_t res = f(s, r, n, dt, root, comm, st);
  size_t mult = c.comm && c.comm->rank == root ? comm_size(&c) : 0;
  finish(&c, res, FLS_OP_SCATTER, n, dt, mult, root, st);
  return res;
}

EXPORT ncclResult_t ncclSend(const void *s, size_t n, ncclDataType_t dt, int peer,
                             ncclComm_t comm, cudaStream_t st) {
  REAL(Send, ncclResult_t, const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  call c;
  if (!begin(&c, comm, st)) return f(s, n, dt, peer, comm, st);
  ncclResult_t res = f(s, n, dt, peer, comm, st);
  finish(&c, res, FLS_OP_SEND, n, dt, 1, peer, st);
  return res;
}

EXPORT ncclResult_t ncclRecv(void *r, size_t n, ncclDataType_t dt, int peer, ncclComm_t comm,
                             cudaStream_t st) {
  REAL(Recv, ncclResult_t, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  call c;
  if (!begin(&c, comm, st)) return f(r, n, dt, peer, comm, st);
  ncclResult_t res = f(r, n, dt, peer, comm, st);
  finish(&c, res, FLS_OP_RECV, n, dt, 1, peer, st);
  return res;
}

/* ---- groups (recorded, no pause trap: a group is not a collective yet) --------------------- */

static ncclResult_t group_call(int id, int op, int delta) {
  typedef ncclResult_t (*fn_t)(void);
  fn_t f = (fn_t)real(id);
  if (FLS_UNLIKELY(!f)) return missing(id);
  if (t_depth || !fls_writer_ready()) return f();
  t_depth++;
  int64_t t0 = fls_now_ns();
  ncclResult_t res = f();
  int64_t t1 = fls_now_ns();
  int ok = res == ncclSuccess || res == ncclInProgress;
  if (ok) t_group += delta;
  if (t_group < 0) t_group = 0;
  /* the outermost end launched the group's calls (ncclInProgress: not yet, or not all; an
   * error: none) */
  if (delta < 0 && (t_group == 0 || !ok))
    fls_device_group_end(res == ncclSuccess && t_group == 0);
  uint64_t index = __atomic_fetch_add(&fls_nocomm_calls, 1, __ATOMIC_RELAXED);
  int flags = FLS_FL_END_IS_ENQUEUE | (ok ? 0 : FLS_FL_FAILED);
  fls_emit(t0, t1, 0, 0, index, op, FLS_DT_UNKNOWN, flags, -1);
  t_depth--;
  return res;
}

EXPORT ncclResult_t ncclGroupStart(void) {
  return group_call(SYM_GroupStart, FLS_OP_GROUP_START, +1);
}

EXPORT ncclResult_t ncclGroupEnd(void) { return group_call(SYM_GroupEnd, FLS_OP_GROUP_END, -1); }

/* ---- communicator life cycle: membership lines --------------------------------------------- */

static int created(ncclResult_t res, ncclComm_t comm) {
  return (res == ncclSuccess || res == ncclInProgress) && comm != NULL;
}

EXPORT ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
  REAL(CommInitRank, ncclResult_t, ncclComm_t *, int, ncclUniqueId, int);
  if (t_depth || !fls_writer_ready()) return f(comm, nranks, id, rank);
  t_depth++;
  ncclResult_t res = f(comm, nranks, id, rank);
  uint64_t key = fls_key_of_unique_id(&id, (int)sizeof id);
  if (comm && created(res, *comm)) fls_comm_add(*comm, key, 0, -1, rank, nranks);
  t_depth--;
  return res;
}

EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id,
                                           int rank, ncclConfig_t *config) {
  REAL(CommInitRankConfig, ncclResult_t, ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *);
  if (t_depth || !fls_writer_ready()) return f(comm, nranks, id, rank, config);
  t_depth++;
  ncclResult_t res = f(comm, nranks, id, rank, config);
  uint64_t key = fls_key_of_unique_id(&id, (int)sizeof id);
  if (comm && created(res, *comm)) fls_comm_add(*comm, key, 0, -1, rank, nranks);
  t_depth--;
  return res;
}

EXPORT ncclResult_t ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist) {
  REAL(CommInitAll, ncclResult_t, ncclComm_t *, int, const int *);
  if (t_depth || !fls_writer_ready()) return f(comms, ndev, devlist);
  t_depth++;
  ncclResult_t res = f(comms, ndev, devlist);
  if ((res == ncclSuccess || res == ncclInProgress) && comms) {
    uint64_t key = fls_key_of_init_all();
    for (int i = 0; i < ndev; i++)
      if (comms[i]) fls_comm_add(comms[i], key, 0, -1, i, ndev);
  }
  t_depth--;
  return res;
}

EXPORT ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                                  ncclConfig_t *config) {
  REAL(CommSplit, ncclResult_t, ncclComm_t, int, int, ncclComm_t *, ncclConfig_t *);
  if (t_depth || !fls_writer_ready()) return f(comm, color, key, newcomm, config);
  t_depth++;
  fls_comm *parent = fls_comm_find(comm);
  static uint64_t orphan_splits; /* parent made outside the hooks: best effort */
  uint64_t seq = parent ? __atomic_fetch_add(&parent->split_seq, 1, __ATOMIC_RELAXED)
                        : __atomic_fetch_add(&orphan_splits, 1, __ATOMIC_RELAXED);
  uint64_t parent_key = parent ? parent->key : 0;
  ncclResult_t res = f(comm, color, key, newcomm, config);
  if (newcomm && created(res, *newcomm)) {
    /* Rank and size of the new comm come from NCCL; a nonblocking split may not know them yet,
     * then the membership line is written at the comm's first recorded call. */
    int rank = -1, size = -1;
    fls_rank_query_t user_rank = (fls_rank_query_t)real(SYM_CommUserRank);
    fls_rank_query_t count = (fls_rank_query_t)real(SYM_CommCount);
    if (!user_rank || !count || user_rank(*newcomm, &rank) != ncclSuccess ||
        count(*newcomm, &size) != ncclSuccess)
      rank = size = -1;
    fls_comm_add(*newcomm, fls_key_of_split(parent_key, color, seq), parent_key, color, rank,
                 size);
  }
  t_depth--;
  return res;
}

EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  REAL(CommDestroy, ncclResult_t, ncclComm_t);
  fls_comm_remove(comm); /* before: the address may be reused as soon as NCCL frees it */
  return f(comm);
}

EXPORT ncclResult_t ncclCommAbort(ncclComm_t comm) {
  REAL(CommAbort, ncclResult_t, ncclComm_t);
  fls_comm_remove(comm);
  return f(comm);
}

/* ---- diagnostics for `failslow doctor` ---------------------------------------------------- */

EXPORT const char *failslow_shim_version(void) { return FLS_SHIM_VERSION; }

__attribute__((constructor)) static void remember_own_functions(void) {
#define OWN(n) own_fn[SYM_##n] = (void *)&nccl##n;
  FLS_HOOKED(OWN)
#undef OWN
}

static void append(char *out, size_t out_len, size_t *used, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
#include <stdarg.h>
static void append(char *out, size_t out_len, size_t *used, const char *fmt, ...) {
  if (!out || *used + 1 >= out_len) return;
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(out + *used, out_len - *used, fmt, ap);
  va_end(ap);
  if (n > 0) *used = *used + (size_t)n < out_len ? *used + (size_t)n : out_len - 1;
}

/* Resolves every hooked symbol in nccl_path (NULL: FAILSLOW_NCCL_LIB or libnccl.so.2) the way
 * the hooks do and writes "name\tpnccl|nccl|missing\n" lines into out. Returns how many
 * resolved, or -1 with an "error\t<dlerror>\n" line when the library cannot be opened. An
 * already loaded library is used as is (RTLD_NOLOAD); otherwise it is loaded RTLD_LOCAL and
 * released afterwards. */
EXPORT int failslow_shim_resolve(const char *nccl_path, char *out, size_t out_len) {
  size_t used = 0;
  if (out && out_len) out[0] = '\0';
  const char *path = nccl_path && *nccl_path ? nccl_path : lib_name();
  void *handle = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
  if (!handle) handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    const char *err = dlerror();
    append(out, out_len, &used, "error\t%s\n", err ? err : path);
    return -1;
  }
  int resolved = 0;
  static const char *const how_names[] = {"missing", "pnccl", "nccl", "missing"};
  for (int id = 0; id < SYM_N_HOOKED; id++) {
    int how = HOW_NONE;
    if (lookup(handle, id, &how)) resolved++;
    append(out, out_len, &used, "nccl%s\t%s\n", sym_names[id], how_names[how]);
  }
  dlclose(handle);
  return resolved;
}
