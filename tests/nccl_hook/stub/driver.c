/* Loads the consumer library with RTLD_LOCAL (as Python loads libtorch and, through it,
 * libnccl) and runs one scenario: driver <consumer.so> <scenario> [args...]. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: driver <consumer.so> <scenario> [args...]\n");
    return 2;
  }
  void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    fprintf(stderr, "driver: %s\n", dlerror());
    return 2;
  }
  int (*scenario)(int, char **) = (int (*)(int, char **))dlsym(h, "fls_scenario");
  if (!scenario) {
    fprintf(stderr, "driver: %s\n", dlerror());
    return 2;
  }
  int status = scenario(argc - 2, argv + 2);
  /* STUB_EXIT_DELAY_MS: time for the shim's device-timing harvester to write its records */
  const char *delay = getenv("STUB_EXIT_DELAY_MS");
  if (delay && *delay) usleep((useconds_t)atoi(delay) * 1000);
  return status;
}
