/* Workloads for the pipeline tests, compiled with frame pointers.
 *   spin  - burns CPU in burn_cpu()
 *   alloc - allocates and frees in churn_heap(), keeping some blocks live
 *   wake  - short bursts then sleeps: many wakeups, for run-queue latency
 *   grow N - grows its memory in grow_memory() to N MiB (1 MiB every 10 ms, touched), holds it
 *            200 ms, frees it all, waits 300 ms and starts again: usage that crosses a
 *            threshold below N MiB again and again (triggers)
 *   ramp N - N seconds of 15 ms bursts of burn_cpu() every 100 ms (15% of a core), then
 *            burn_cpu() all the time: load that grows into a CPU limit (lead-up of triggers) */
#include <malloc.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
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

__attribute__((noinline)) static void grow_memory(int mib) {
    static void *blocks[4096];
    if (mib > 4096) mib = 4096;
    for (int i = 0; i < mib; i++) {
        blocks[i] = malloc(1 << 20);
        if (blocks[i]) memset(blocks[i], 1, 1 << 20);
        usleep(10000);
    }
    usleep(200000);
    for (int i = 0; i < mib; i++) free(blocks[i]);
    usleep(300000);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "spin";
    if (strcmp(mode, "ramp") == 0) {
        double calm = argc > 2 ? atof(argv[2]) : 10, start = now();
        while (now() - start < calm) {
            double t = now();
            while (now() - t < 0.015) burn_cpu(20000);
            usleep(85000);
        }
    }
    if (strcmp(mode, "grow") == 0) {
        /* A fixed mmap threshold: every 1 MiB block is its own mapping, returned on free
         * (glibc would otherwise raise the threshold and keep freed blocks in its heap). */
        mallopt(M_MMAP_THRESHOLD, 64 * 1024);
        int mib = argc > 2 ? atoi(argv[2]) : 32;
        for (;;) grow_memory(mib);
    }
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
