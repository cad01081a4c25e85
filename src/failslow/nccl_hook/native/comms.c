/* Communicator membership for the NCCL shim (greyhound 4.2/4.3: per-group durations need to
 * know which ranks form a group). Every communicator gets a 63-bit key that all its members
 * compute alike without talking to each other, and each member appends one
 * failslow.core.group_files.GroupMember JSON line (the exact bytes of GroupMember.to_json) to the
 * groups file beside its ring; merge_members() assembles the GroupInfo.
 *
 * Keys:
 * - ncclCommInitRank/InitRankConfig: a hash of the 128-byte ncclUniqueId, which every member
 *   receives. Under NCCL_COMM_ID, ncclGetUniqueId returns the same id for every communicator,
 *   so the per-process init sequence number is mixed in (members create communicators in the
 *   same order, as NCCL requires for a fixed rendezvous address).
 * - ncclCommSplit: hash(parent key, color, the parent's split sequence number). Every member of
 *   the parent calls ncclCommSplit collectively and in the same order, so the sequence number
 *   agrees; the `key` argument does not: it is each caller's ordering key and differs per rank.
 * - ncclCommInitAll: one process holds every member, so a hash of host, pid and a counter.
 *
 * The table is a fixed open-addressing array: writers (comm creation and destruction, rare)
 * take a mutex; lookups on the call path are lock-free (the slot's comm pointer is stored last
 * with release semantics). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comms.h"

#define SLOTS 4096 /* power of two */

static fls_comm g_table[SLOTS];
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t g_init_seq, g_init_all_seq;
uint64_t fls_nocomm_calls;

static inline uint64_t mix64(uint64_t x) { /* splitmix64 finalizer */
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

static uint64_t fnv1a(const void *data, size_t len, uint64_t h) {
  const unsigned char *p = data;
  for (size_t i = 0; i < len; i++) h = (h ^ p[i]) * 0x100000001b3ULL;
  return h;
}

static uint64_t finish_key(uint64_t h) {
  h = mix64(h) & 0x7fffffffffffffffULL;
  return h ? h : 1;
}

uint64_t fls_key_of_unique_id(const void *id, int len) {
  uint64_t h = fnv1a(id, (size_t)len, 0xcbf29ce484222325ULL);
  uint64_t seq = __atomic_fetch_add(&g_init_seq, 1, __ATOMIC_RELAXED);
  const char *fixed = getenv("NCCL_COMM_ID");
  if (fixed && *fixed) h = fnv1a(&seq, sizeof seq, h ^ 0x636f6d6d5f6964ULL);
  return finish_key(h);
}

uint64_t fls_key_of_split(uint64_t parent_key, int color, uint64_t split_seq) {
  uint64_t v[3] = {parent_key, (uint64_t)(int64_t)color, split_seq};
  return finish_key(fnv1a(v, sizeof v, 0x73706c6974ULL));
}

uint64_t fls_key_of_init_all(void) {
  uint64_t seq = __atomic_fetch_add(&g_init_all_seq, 1, __ATOMIC_RELAXED);
  uint64_t h = fnv1a(fls_w.host, strlen(fls_w.host), 0x696e6974616c6cULL);
  int64_t pid = fls_w.pid;
  h = fnv1a(&pid, sizeof pid, h);
  return finish_key(fnv1a(&seq, sizeof seq, h));
}

static inline size_t slot_of(void *comm) {
  return (size_t)(mix64((uint64_t)(uintptr_t)comm) & (SLOTS - 1));
}

fls_comm *fls_comm_find(void *comm) {
  if (!comm) return NULL;
  size_t i = slot_of(comm);
  for (int n = 0; n < SLOTS; n++, i = (i + 1) & (SLOTS - 1)) {
    void *c = __atomic_load_n(&g_table[i].comm, __ATOMIC_ACQUIRE);
    if (c == comm) return &g_table[i];
    if (c == NULL) return NULL;
  }
  return NULL;
}

static void publish(fls_comm *c) {
  char line[768];
  char host[300];
  size_t k = 0;
  for (const char *p = fls_w.host; *p && k < sizeof host - 3; p++) { /* JSON string escape */
    if (*p == '"' || *p == '\\') host[k++] = '\\';
    host[k++] = *p;
  }
  host[k] = '\0';
  /* Keys sorted, separators ", " and ": " - byte for byte GroupMember.to_json. */
  int n = snprintf(line, sizeof line,
                   "{\"color\": %d, \"comm_rank\": %d, \"global_rank\": %d, \"host\": \"%s\", "
                   "\"key\": %llu, \"member\": true, \"parent_key\": %llu, \"pid\": %d, "
                   "\"size\": %d}\n",
                   c->color, c->rank, fls_w.global_rank, host, (unsigned long long)c->key,
                   (unsigned long long)c->parent_key, fls_w.pid, c->size);
  if (n > 0 && n < (int)sizeof line) fls_append_group_line(line, n);
  c->published = 1;
}

fls_comm *fls_comm_add(void *comm, uint64_t key, uint64_t parent_key, int color, int rank,
                       int size) {
  if (!comm) return NULL;
  static int warned;
  pthread_mutex_lock(&g_lock);
  fls_comm *slot = NULL;
  size_t i = slot_of(comm);
  for (int n = 0; n < SLOTS; n++, i = (i + 1) & (SLOTS - 1)) {
    void *c = g_table[i].comm;
    if (c == comm) {
      slot = &g_table[i];
      break;
    }
    if (c == FLS_COMM_GONE && !slot) slot = &g_table[i];
    if (c == NULL) {
      if (!slot) slot = &g_table[i];
      break;
    }
  }
  if (slot) {
    __atomic_store_n(&slot->comm, FLS_COMM_GONE, __ATOMIC_RELEASE);
    slot->key = key;
    slot->parent_key = parent_key;
    slot->color = color;
    slot->rank = rank;
    slot->size = size;
    slot->published = 0;
    __atomic_store_n(&slot->split_seq, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&slot->calls, 0, __ATOMIC_RELAXED);
    if (rank >= 0 && size > 0) publish(slot);
    __atomic_store_n(&slot->comm, comm, __ATOMIC_RELEASE);
  } else if (!warned) {
    warned = 1;
    fls_note("more than %d live communicators; further ones are recorded with group_key 0",
             SLOTS);
  }
  pthread_mutex_unlock(&g_lock);
  return slot;
}

void fls_comm_remove(void *comm) {
  pthread_mutex_lock(&g_lock);
  fls_comm *c = fls_comm_find(comm);
  if (c) __atomic_store_n(&c->comm, FLS_COMM_GONE, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&g_lock);
}

void fls_comm_publish_late(fls_comm *c, fls_rank_query_t user_rank, fls_rank_query_t count) {
  pthread_mutex_lock(&g_lock);
  if (!c->published && user_rank && count) {
    int rank = -1, size = -1;
    void *comm = c->comm;
    if (user_rank(comm, &rank) == 0 && count(comm, &size) == 0 && rank >= 0 && size > 0) {
      c->rank = rank;
      c->size = size;
      publish(c);
    }
  }
  pthread_mutex_unlock(&g_lock);
}
