/* A stand-in libcudart.so.13 for the shim's device timing on a machine without CUDA: an event
 * records the host clock when it is recorded and is complete at once; elapsed time is the
 * difference. Enough to check which calls get device times and when their end events are
 * recorded (tests/nccl_hook/test_shim.py); the real runtime is checked on a GPU
 * (tests/gpu, benchmarks/gpu). */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef struct {
  long long ns; /* -1 until recorded */
} event;

#define API __attribute__((visibility("default")))

static long g_created; /* events created, said at exit when STUB_CUDART_COUNT is set */

__attribute__((destructor)) static void say_created(void) {
  if (getenv("STUB_CUDART_COUNT")) fprintf(stderr, "cudart stub: %ld events created\n",
                                           __atomic_load_n(&g_created, __ATOMIC_RELAXED));
}

static long long now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

API int cudaEventCreateWithFlags(void **ev, unsigned flags) {
  (void)flags;
  event *e = malloc(sizeof *e);
  if (!e) return 2; /* cudaErrorMemoryAllocation */
  e->ns = -1;
  *ev = e;
  __atomic_fetch_add(&g_created, 1, __ATOMIC_RELAXED);
  return 0;
}

API int cudaEventRecord(void *ev, void *stream) {
  (void)stream;
  ((event *)ev)->ns = now_ns(); /* a reused event records again */
  return 0;
}

API int cudaEventQuery(void *ev) { return ((event *)ev)->ns >= 0 ? 0 : 600; }

API int cudaEventElapsedTime(float *ms, void *a, void *b) {
  *ms = (float)((((event *)b)->ns - ((event *)a)->ns) / 1e6);
  return 0;
}

API int cudaEventDestroy(void *ev) {
  free(ev);
  return 0;
}

API int cudaStreamIsCapturing(void *stream, int *status) {
  (void)stream;
  *status = 0;
  return 0;
}
