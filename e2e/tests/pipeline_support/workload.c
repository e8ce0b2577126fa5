/* Workloads for the pipeline tests, compiled with frame pointers.
 *   spin  - burns CPU in burn_cpu()
 *   alloc - allocates and frees in churn_heap(), keeping some blocks live
 *   wake  - short bursts then sleeps: many wakeups, for run-queue latency */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static volatile unsigned long sink;

__attribute__((noinline)) static void burn_cpu(unsigned long n) {
    for (unsigned long i = 0; i < n; i++) sink += i * i;
}

__attribute__((noinline)) static void churn_heap(void) {
    static void *live[256];
    for (int i = 0; i < 64; i++) {
        int k = rand() % 256;
        free(live[k]);
        live[k] = malloc(1024 + (size_t)(rand() % 65536));
        if (live[k]) memset(live[k], 1, 64);
    }
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "spin";
    for (;;) {
        if (strcmp(mode, "alloc") == 0) {
            churn_heap();
            usleep(500);
        } else if (strcmp(mode, "wake") == 0) {
            burn_cpu(20000);
            usleep(200);
        } else {
            burn_cpu(1000000);
        }
    }
}
