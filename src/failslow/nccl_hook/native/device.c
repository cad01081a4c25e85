/* Optional device-side timing of NCCL calls (FAILSLOW_DEVICE_TIMING=1), greyhound 4.2/6.
 *
 * The CUDA runtime is never linked: its functions are looked up at run time in a libcudart the
 * process has already loaded (RTLD_NOLOAD; FAILSLOW_CUDART_LIB overrides the name), else in the
 * global scope. With none found, device timing turns itself off with one stderr line and the
 * shim records enqueue times (Flags.END_IS_ENQUEUE).
 *
 * For a call issued outside a NCCL group, on a stream that is not being captured into a CUDA
 * graph, the shim records a CUDA event on the call's stream before and after it. The training
 * stream is never synchronized: a background thread polls cudaEventQuery and, once the end
 * event completed, writes the record with t_start_ns = host enqueue time and
 * t_end_ns = t_start_ns + cudaEventElapsedTime(start, end), so its duration is the device
 * duration of the collective (including the wait for its peers).
 *
 * Stream 0 (the legacy default stream) is timed like any other: PyTorch issues a synchronous
 * collective on the current stream, which is that one unless the job chose another (on an H200
 * under torch 2.11 no record of such a job had a device time before, issue 50).
 *
 * Calls inside ncclGroupStart/End (batched send/recv of pipeline parallelism, coalesced
 * collectives) are launched at the outermost ncclGroupEnd: such a call records its start event
 * when it is issued (before the launch on its stream) and is queued on its thread;
 * ncclGroupEnd records each queued call's end event once NCCL has launched the group. A
 * group's calls share one launch, so each such record spans its stream's part of the group. A
 * group that failed or did not finish launching (ncclInProgress, non-blocking communicators)
 * keeps enqueue times.
 *
 * Events are reused: a completed call's two events go back to a free list (at most POOL_MAX)
 * and the next calls record on them, so a call creates no event once the job runs (creating
 * two per call cost ~10 us on an H200, benchmarks/gpu row 3). The harvester takes the pending
 * calls out under the lock and queries them outside it: the training thread never waits for
 * cudaEventQuery. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "device.h"

typedef int (*ev_create_t)(void **, unsigned);
typedef int (*ev_record_t)(void *, void *);
typedef int (*ev_query_t)(void *);
typedef int (*ev_elapsed_t)(float *, void *, void *);
typedef int (*ev_destroy_t)(void *);
typedef int (*is_capturing_t)(void *, int *);

static struct {
  ev_create_t create;
  ev_record_t record;
  ev_query_t query;
  ev_elapsed_t elapsed;
  ev_destroy_t destroy;
  is_capturing_t is_capturing;
} cu;

#define CUDA_SUCCESS 0
#define CUDA_NOT_READY 600
#define PENDING_MAX 4096

typedef struct pending {
  void *ev0, *ev1;
  int64_t t_start, t_end_host;
  uint64_t nbytes, group_key, call_index;
  int op, dtype, flags;
  int32_t peer;
} pending;

static int g_state; /* 0 = not looked up, 1 = on, -1 = off */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pending g_pending[PENDING_MAX];
static int g_npending;
static int g_harvester_started;

#define POOL_MAX 1024
static pthread_mutex_t g_pool_lock = PTHREAD_MUTEX_INITIALIZER;
static void *g_free[POOL_MAX];
static int g_nfree;

/* A timing event: a free one if any, else a new one. 0 or the CUDA error. */
static int ev_get(void **ev) {
  pthread_mutex_lock(&g_pool_lock);
  void *e = g_nfree > 0 ? g_free[--g_nfree] : NULL;
  pthread_mutex_unlock(&g_pool_lock);
  if (e) {
    *ev = e;
    return CUDA_SUCCESS;
  }
  return cu.create(ev, 0 /* cudaEventDefault: timing on */);
}

/* Back to the free list; destroyed when the list is full. */
static void ev_put(void *ev) {
  if (!ev) return;
  pthread_mutex_lock(&g_pool_lock);
  int kept = g_nfree < POOL_MAX;
  if (kept) g_free[g_nfree++] = ev;
  pthread_mutex_unlock(&g_pool_lock);
  if (!kept) cu.destroy(ev);
}

static void *find_cudart(void) {
  const char *forced = getenv("FAILSLOW_CUDART_LIB");
  static const char *const names[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0",
                                      "libcudart.so", NULL};
  if (forced && *forced) return dlopen(forced, RTLD_NOW | RTLD_NOLOAD);
  for (const char *const *n = names; *n; n++) {
    void *h = dlopen(*n, RTLD_NOW | RTLD_NOLOAD);
    if (h) return h;
  }
  return dlsym(RTLD_DEFAULT, "cudaEventRecord") ? RTLD_DEFAULT : NULL;
}

static int lookup(void) {
  const char *want = getenv("FAILSLOW_DEVICE_TIMING");
  if (!want || !*want || strcmp(want, "0") == 0) return -1;
  void *h = find_cudart();
  if (!h) {
    fls_note("FAILSLOW_DEVICE_TIMING=%s but no CUDA runtime is loaded in this process; "
             "recording enqueue times only", want);
    return -1;
  }
  cu.create = (ev_create_t)dlsym(h, "cudaEventCreateWithFlags");
  cu.record = (ev_record_t)dlsym(h, "cudaEventRecord");
  cu.query = (ev_query_t)dlsym(h, "cudaEventQuery");
  cu.elapsed = (ev_elapsed_t)dlsym(h, "cudaEventElapsedTime");
  cu.destroy = (ev_destroy_t)dlsym(h, "cudaEventDestroy");
  cu.is_capturing = (is_capturing_t)dlsym(h, "cudaStreamIsCapturing");
  if (!cu.create || !cu.record || !cu.query || !cu.elapsed || !cu.destroy || !cu.is_capturing) {
    fls_note("the loaded CUDA runtime lacks the event functions; recording enqueue times only");
    return -1;
  }
  Dl_info where;
  fls_note("device timing requested: CUDA events from %s (a failing CUDA call is said once)",
           dladdr((void *)cu.record, &where) && where.dli_fname ? where.dli_fname : "?");
  return 1;
}

static void note_failure(const char *what, int err) {
  static int noted;
  if (!__atomic_exchange_n(&noted, 1, __ATOMIC_RELAXED))
    fls_note("device timing: %s failed (CUDA error %d); such calls record enqueue times", what,
             err);
}

int fls_device_enabled(void) {
  int s = __atomic_load_n(&g_state, __ATOMIC_ACQUIRE);
  if (FLS_LIKELY(s != 0)) return s > 0;
  pthread_mutex_lock(&g_lock);
  s = g_state;
  if (s == 0) {
    s = lookup();
    __atomic_store_n(&g_state, s, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&g_lock);
  return s > 0;
}

void *fls_device_begin(void *stream) {
  int capturing = 0, err;
  if ((err = cu.is_capturing(stream, &capturing)) != CUDA_SUCCESS) {
    note_failure("cudaStreamIsCapturing", err);
    return NULL;
  }
  if (capturing != 0) return NULL; /* a CUDA graph being captured: no events in it */
  void *ev = NULL;
  if ((err = ev_get(&ev)) != CUDA_SUCCESS) {
    note_failure("cudaEventCreateWithFlags", err);
    return NULL;
  }
  if ((err = cu.record(ev, stream)) != CUDA_SUCCESS) {
    note_failure("cudaEventRecord", err);
    cu.destroy(ev); /* not back to the pool: an event that failed to record may be bad */
    return NULL;
  }
  return ev;
}

void fls_device_drop(void *ev0) { ev_put(ev0); }

/* The harvester's own list: calls taken from g_pending whose end event has not completed. */
static pending h_work[PENDING_MAX];
static int h_nwork;

static void harvest_once(void) {
  pthread_mutex_lock(&g_lock);
  int room = PENDING_MAX - h_nwork, moved = g_npending < room ? g_npending : room;
  memcpy(&h_work[h_nwork], g_pending, (size_t)moved * sizeof *g_pending);
  h_nwork += moved;
  g_npending -= moved;
  memmove(g_pending, &g_pending[moved], (size_t)g_npending * sizeof *g_pending);
  pthread_mutex_unlock(&g_lock);
  int kept = 0;
  for (int i = 0; i < h_nwork; i++) {
    pending *p = &h_work[i];
    int q = cu.query(p->ev1);
    if (q == CUDA_NOT_READY) {
      h_work[kept++] = *p;
      continue;
    }
    float ms = 0.0f;
    int e = q == CUDA_SUCCESS ? cu.elapsed(&ms, p->ev0, p->ev1) : q;
    if (e == CUDA_SUCCESS) {
      fls_emit(p->t_start, p->t_start + (int64_t)((double)ms * 1e6), p->nbytes, p->group_key,
               p->call_index, p->op, p->dtype, p->flags, p->peer);
    } else {
      note_failure(q == CUDA_SUCCESS ? "cudaEventElapsedTime" : "cudaEventQuery", e);
      fls_emit(p->t_start, p->t_end_host, p->nbytes, p->group_key, p->call_index, p->op,
               p->dtype, p->flags | FLS_FL_END_IS_ENQUEUE, p->peer);
    }
    ev_put(p->ev0);
    ev_put(p->ev1);
  }
  h_nwork = kept;
}

static void *harvester(void *arg) {
  (void)arg;
  const struct timespec nap = {0, 500000};
  for (;;) {
    nanosleep(&nap, NULL);
    harvest_once();
  }
  return NULL;
}

int fls_device_end(void *ev0, void *stream, int64_t t_start, int64_t t_end_host,
                   uint64_t nbytes, uint64_t group_key, uint64_t call_index, int op, int dtype,
                   int flags, int32_t peer) {
  void *ev1 = NULL;
  int err;
  if ((err = ev_get(&ev1)) != CUDA_SUCCESS) {
    note_failure("cudaEventCreateWithFlags", err);
    goto host;
  }
  if ((err = cu.record(ev1, stream)) != CUDA_SUCCESS) {
    note_failure("cudaEventRecord", err);
    cu.destroy(ev1);
    goto host;
  }
  pthread_mutex_lock(&g_lock);
  if (g_npending == PENDING_MAX) {
    pthread_mutex_unlock(&g_lock);
    ev_put(ev1);
    goto host;
  }
  g_pending[g_npending++] = (pending){ev0, ev1, t_start, t_end_host, nbytes, group_key,
                                      call_index, op, dtype, flags, peer};
  if (!g_harvester_started) {
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    g_harvester_started = pthread_create(&t, &attr, harvester, NULL) == 0;
    pthread_attr_destroy(&attr);
  }
  pthread_mutex_unlock(&g_lock);
  return 1;
host:
  ev_put(ev0);
  return 0;
}

/* ---- calls inside a group: their end events wait for ncclGroupEnd ------------------------ */

#define GROUPED_MAX 256

typedef struct grouped {
  void *ev0, *stream;
  int64_t t_start, t_end_host;
  uint64_t nbytes, group_key, call_index;
  int op, dtype, flags;
  int32_t peer;
} grouped;

static __thread grouped t_grouped[GROUPED_MAX];
static __thread int t_ngrouped;

int fls_device_defer(void *ev0, void *stream, int64_t t_start, int64_t t_end_host,
                     uint64_t nbytes, uint64_t group_key, uint64_t call_index, int op,
                     int dtype, int flags, int32_t peer) {
  if (t_ngrouped == GROUPED_MAX) {
    ev_put(ev0);
    return 0;
  }
  t_grouped[t_ngrouped++] = (grouped){ev0,        stream, t_start, t_end_host, nbytes, group_key,
                                      call_index, op,     dtype,   flags,      peer};
  return 1;
}

void fls_device_group_end(int launched) {
  for (int i = 0; i < t_ngrouped; i++) {
    grouped *g = &t_grouped[i];
    if (launched && fls_device_end(g->ev0, g->stream, g->t_start, g->t_end_host, g->nbytes,
                                   g->group_key, g->call_index, g->op, g->dtype, g->flags,
                                   g->peer))
      continue;
    if (!launched) ev_put(g->ev0); /* fls_device_end frees it when it returns 0 */
    fls_emit(g->t_start, g->t_end_host, g->nbytes, g->group_key, g->call_index, g->op, g->dtype,
             g->flags | FLS_FL_END_IS_ENQUEUE, g->peer);
  }
  t_ngrouped = 0;
}
