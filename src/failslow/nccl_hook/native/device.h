/* Optional device-side completion timing through CUDA events (device.c). */
#ifndef FAILSLOW_DEVICE_H
#define FAILSLOW_DEVICE_H

#include "writer.h"

/* 1 when FAILSLOW_DEVICE_TIMING is set and a loaded CUDA runtime has the event functions. */
int fls_device_enabled(void) FLS_HIDDEN;
/* Records a start event on the stream; NULL when the stream is being captured or on error. */
void *fls_device_begin(void *stream) FLS_HIDDEN;
/* Records the end event and queues the record for the harvester thread; returns 0 (and frees
 * the start event) when the caller must write the record with host timing instead. */
int fls_device_end(void *ev0, void *stream, int64_t t_start, int64_t t_end_host,
                   uint64_t nbytes, uint64_t group_key, uint64_t call_index, int op, int dtype,
                   int flags, int32_t peer) FLS_HIDDEN;

/* Frees a start event whose call will not be device-timed (it failed). */
void fls_device_drop(void *ev0) FLS_HIDDEN;
/* Queues a call issued inside ncclGroupStart/End until the group's end (its kernels launch
 * there); returns 0 (and frees the start event) when the queue is full. */
int fls_device_defer(void *ev0, void *stream, int64_t t_start, int64_t t_end_host,
                     uint64_t nbytes, uint64_t group_key, uint64_t call_index, int op,
                     int dtype, int flags, int32_t peer) FLS_HIDDEN;
/* At the outermost ncclGroupEnd: end events for the queued calls (launched = 1), or their
 * records with enqueue times (0: the group failed or has not finished launching). */
void fls_device_group_end(int launched) FLS_HIDDEN;

#endif /* FAILSLOW_DEVICE_H */
