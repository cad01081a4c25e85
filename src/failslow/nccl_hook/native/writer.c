/* Native writer of the failslow event ring (failslow/core/ring.py and events.py are the definition) and the
 * pause trap (greyhound 4.2: the Monitor logs call types and timestamps into shared memory;
 * greyhound 4.3/6: validation pauses training at the next collective).
 *
 * The ring is opened lazily, at the first NCCL call of a process, so processes that run under
 * LD_PRELOAD but never call NCCL (launchers, shells, data loaders) leave no ring behind. It is
 * built under a temporary name and renamed into place, so a reader never maps a short file.
 * If it cannot be created the shim writes one stderr line and passes every call through. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "writer.h"

fls_writer fls_w;
uint64_t fls_ignored_control;

static int g_ready;       /* 0 = not tried, 1 = recording, -1 = pass-through */
static pthread_mutex_t g_init_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_parked_threads;

void fls_note(const char *fmt, ...) {
  char buf[1024];
  int n = snprintf(buf, sizeof buf, "failslow shim[%d]: ", (int)getpid());
  va_list ap;
  va_start(ap, fmt);
  n += vsnprintf(buf + n, sizeof buf - (size_t)n - 1, fmt, ap);
  va_end(ap);
  if (n > (int)sizeof buf - 2) n = (int)sizeof buf - 2;
  buf[n++] = '\n';
  ssize_t ignored = write(2, buf, (size_t)n);
  (void)ignored;
}

int64_t fls_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int64_t realtime_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int env_int(const char *const *names, int fallback) {
  for (; *names; names++) {
    const char *v = getenv(*names);
    if (v && *v) {
      char *end;
      long x = strtol(v, &end, 10);
      if (*end == '\0') return (int)x;
    }
  }
  return fallback;
}

static int mkdirs(const char *dir) {
  char buf[4096];
  size_t n = strlen(dir);
  if (n == 0 || n >= sizeof buf) return -1;
  memcpy(buf, dir, n + 1);
  for (size_t i = 1; i <= n; i++) {
    if (buf[i] == '/' || buf[i] == '\0') {
      char c = buf[i];
      buf[i] = '\0';
      if (mkdir(buf, 0755) != 0 && errno != EEXIST) return -1;
      buf[i] = c;
    }
  }
  return 0;
}

static uint64_t env_capacity(void) {
  const char *v = getenv("FAILSLOW_RING_CAPACITY");
  if (!v || !*v) return FLS_DEFAULT_CAPACITY;
  char *end;
  unsigned long long c = strtoull(v, &end, 10);
  if (*end != '\0' || c == 0 || (c & (c - 1)) != 0 || c > (1ULL << 26)) {
    fls_note("FAILSLOW_RING_CAPACITY=%s is not a power of two up to 2^26; using %u", v,
             FLS_DEFAULT_CAPACITY);
    return FLS_DEFAULT_CAPACITY;
  }
  return c;
}

static void after_fork_in_child(void) {
  /* The child must not write its parent's ring: it opens its own at its first NCCL call. */
  pthread_mutex_init(&g_init_lock, NULL);
  fls_w.hdr = NULL;
  g_parked_threads = 0;
  __atomic_store_n(&g_ready, 0, __ATOMIC_RELEASE);
}

static int open_ring(void) {
  const char *dir = getenv("FAILSLOW_RING_DIR");
  if (!dir || !*dir) return -1; /* shim inactive: pure pass-through */
  static const char *const rank_vars[] = {"RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", NULL};
  static const char *const local_vars[] = {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                                           "SLURM_LOCALID", NULL};
  fls_w.global_rank = env_int(rank_vars, -1);
  fls_w.local_rank = env_int(local_vars, -1);
  fls_w.pid = (int)getpid();
  const char *timeout = getenv("FAILSLOW_PAUSE_TIMEOUT_S");
  double t = timeout && *timeout ? strtod(timeout, NULL) : 60.0;
  fls_w.pause_timeout_ns = (int64_t)((t > 0 ? t : 60.0) * 1e9);
  if (gethostname(fls_w.host, sizeof fls_w.host - 1) != 0) strcpy(fls_w.host, "");
  uint64_t capacity = env_capacity();

  /* Same name as failslow.core.ring.ring_path / group_files.groups_path. */
  int n = snprintf(fls_w.ring_path, sizeof fls_w.ring_path, "%s/rank%05d-pid%d.ring", dir,
                   fls_w.global_rank, fls_w.pid);
  snprintf(fls_w.groups_path, sizeof fls_w.groups_path, "%.*s.groups.jsonl", n - 5,
           fls_w.ring_path);
  char tmp[4200];
  snprintf(tmp, sizeof tmp, "%s/.rank%05d-pid%d.ring.%d.tmp", dir, fls_w.global_rank, fls_w.pid,
           fls_w.pid);
  size_t size = FLS_HEADER_SIZE + capacity * FLS_RECORD_SIZE;
  const char *what = "mkdir";
  int fd = -1;
  void *map = MAP_FAILED;
  if (mkdirs(dir) != 0) goto fail;
  what = "open";
  fd = open(tmp, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) goto fail;
  what = "ftruncate";
  if (ftruncate(fd, (off_t)size) != 0) goto fail;
  what = "mmap";
  map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) goto fail;
  close(fd);
  fd = -1;
  fls_ring_header *h = map;
  h->version = FLS_RING_VERSION;
  h->record_size = FLS_RECORD_SIZE;
  h->capacity = capacity;
  h->pid = fls_w.pid;
  h->global_rank = fls_w.global_rank;
  h->local_rank = fls_w.local_rank;
  h->mono_anchor_ns = fls_now_ns();
  h->wall_anchor_ns = realtime_ns();
  __atomic_store_n(&h->magic, FLS_RING_MAGIC, __ATOMIC_RELEASE);
  what = "rename";
  if (rename(tmp, fls_w.ring_path) != 0) goto fail;
  fls_w.rec = (fls_record *)((char *)map + FLS_HEADER_SIZE);
  fls_w.mask = capacity - 1;
  fls_w.hdr = h;
  return 1;
fail:
  fls_note("cannot create ring %s (%s: %s); NCCL calls pass through unrecorded",
           fls_w.ring_path, what, strerror(errno));
  if (map != MAP_FAILED) munmap(map, size);
  if (fd >= 0) close(fd);
  unlink(tmp);
  return -1;
}

int fls_writer_ready(void) {
  int r = __atomic_load_n(&g_ready, __ATOMIC_ACQUIRE);
  if (FLS_LIKELY(r != 0)) return r > 0;
  pthread_mutex_lock(&g_init_lock);
  r = __atomic_load_n(&g_ready, __ATOMIC_ACQUIRE);
  if (r == 0) {
    static int atfork_done;
    if (!atfork_done) {
      pthread_atfork(NULL, NULL, after_fork_in_child);
      atfork_done = 1;
    }
    r = open_ring();
    __atomic_store_n(&g_ready, r, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&g_init_lock);
  return r > 0;
}

void fls_emit(int64_t t_start, int64_t t_end, uint64_t nbytes, uint64_t group_key,
              uint64_t call_index, int op, int dtype, int flags, int32_t peer) {
  fls_ring_emit(fls_w.hdr, fls_w.rec, fls_w.mask, t_start, t_end, nbytes, group_key, call_index,
                op, dtype, FLS_SRC_SHIM, flags, peer);
}

/* Parks the calling thread until the control word is 0 again, or releases it after
 * FAILSLOW_PAUSE_TIMEOUT_S. A control value whose park timed out is then ignored until the
 * word changes (to 0 or to another value): a dead controller costs one timeout, not one per
 * call. `parked` holds write_index + 1 while any thread is parked. */
void fls_park(uint64_t control) {
  fls_ring_header *h = fls_w.hdr;
  __atomic_fetch_add(&g_parked_threads, 1, __ATOMIC_ACQ_REL);
  __atomic_store_n(&h->parked, __atomic_load_n(&h->write_index, __ATOMIC_ACQUIRE) + 1,
                   __ATOMIC_RELEASE);
  int64_t deadline = fls_now_ns() + fls_w.pause_timeout_ns;
  const struct timespec nap = {0, 200000};
  for (;;) {
    nanosleep(&nap, NULL);
    uint64_t now_control = __atomic_load_n(&h->control, __ATOMIC_ACQUIRE);
    if (now_control == 0) break;
    if (fls_now_ns() >= deadline) {
      __atomic_fetch_add(&h->self_releases, 1, __ATOMIC_ACQ_REL);
      __atomic_store_n(&fls_ignored_control, now_control, __ATOMIC_RELAXED);
      fls_note("pause not released within %.3g s (control word %llu); resuming on my own",
               (double)fls_w.pause_timeout_ns / 1e9, (unsigned long long)now_control);
      (void)control;
      break;
    }
  }
  if (__atomic_sub_fetch(&g_parked_threads, 1, __ATOMIC_ACQ_REL) == 0)
    __atomic_store_n(&h->parked, 0, __ATOMIC_RELEASE);
}

void fls_append_group_line(const char *line, int len) {
  int fd = open(fls_w.groups_path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    fls_note("cannot append to %s: %s", fls_w.groups_path, strerror(errno));
    return;
  }
  ssize_t w = write(fd, line, (size_t)len);
  if (w != len) fls_note("short write to %s", fls_w.groups_path);
  close(fd);
}
