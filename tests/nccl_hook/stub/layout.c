/* Prints every field of the shim's ring header and record as "<struct> <field> <offset>
 * <size>", the enum values as "<enum> <name> <value>", and the constants, for the layout test
 * that compares them with failslow/core/events.py. */
#include <stdio.h>

#include "ring.h"

#define HDR(f) \
  printf("header %s %zu %zu\n", #f, offsetof(fls_ring_header, f), sizeof(((fls_ring_header *)0)->f));
#define REC(f) printf("record %s %zu %zu\n", #f, offsetof(fls_record, f), sizeof(((fls_record *)0)->f));
#define OP(n, v) printf("op %s %d\n", #n, FLS_OP_##n);
#define DT(n, v) printf("dtype %s %d\n", #n, FLS_DT_##n);
#define SRC(n, v) printf("source %s %d\n", #n, FLS_SRC_##n);
#define FL(n, v) printf("flag %s %d\n", #n, FLS_FL_##n);

int main(void) {
  FLS_HEADER_FIELDS(HDR)
  FLS_RECORD_FIELDS(REC)
  FLS_OPS(OP)
  FLS_DTYPES(DT)
  FLS_SOURCES(SRC)
  FLS_FLAGS(FL)
  printf("const HEADER_SIZE %zu\nconst RECORD_SIZE %zu\n", sizeof(fls_ring_header),
         sizeof(fls_record));
  printf("const RING_MAGIC %llu\nconst RING_VERSION %u\nconst DEFAULT_CAPACITY %u\n",
         (unsigned long long)FLS_RING_MAGIC, FLS_RING_VERSION, FLS_DEFAULT_CAPACITY);
  return 0;
}
