// The demo workload: a toy "checkout" service with four things worth
// profiling, each in a function whose name says what it is.
//
//  - CPU:     price_basket() is the hot spot (about 3/4 of the work);
//             render_receipt() is the rest.
//  - heap:    cache_session() is a slow allocation path that keeps memory
//             live (a session cache holding the newest ~48 MiB), while
//             scratch_buffer() churns short-lived allocations.
//  - runqlat: it runs more busy threads than the machine has CPUs, so its
//             threads wait in the run queue.
//  - offcpu:  two threads that use almost no CPU and wait: wait_for_payment()
//             blocks reading a pipe until the payment backend answers, and
//             call_payment_backend() (the backend) sleeps 20 ms per request.
//             Off-CPU, each is blocked nearly all the time, under the kernel's
//             pipe_read and hrtimer_nanosleep.
//
// Build: cc -O1 -g -fno-omit-frame-pointer -pthread checkout.c -o checkout
// (frame pointers let the kernel walk user stacks).
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static volatile uint64_t sink;

__attribute__((noinline)) static uint64_t price_basket(uint64_t seed) {
    uint64_t h = seed;
    for (int i = 0; i < 3000000; i++)
        h = h * 6364136223846793005ULL + 1442695040888963407ULL;
    return h;
}

__attribute__((noinline)) static uint64_t render_receipt(uint64_t seed) {
    uint64_t h = seed;
    for (int i = 0; i < 1000000; i++)
        h ^= (h << 13) ^ (h >> 7) ^ (uint64_t)i;
    return h;
}

#define SESSION_CAP (48u << 20)
#define SESSION_SLOTS 8192
static char *sessions[SESSION_SLOTS];
static size_t session_sizes[SESSION_SLOTS];
static size_t session_head, session_count, session_bytes;
static pthread_mutex_t session_lock = PTHREAD_MUTEX_INITIALIZER;

// A session cache that keeps the newest ~48 MiB of sessions and evicts the oldest: memory
// stays live long after it was allocated (what inuse_space shows), and new sessions keep
// arriving, so any capture window sees them.
__attribute__((noinline)) static void cache_session(size_t size) {
    char *p = malloc(size);
    if (!p)
        return;
    memset(p, 1, size);
    pthread_mutex_lock(&session_lock);
    while (session_count > 0 &&
           (session_bytes + size > SESSION_CAP || session_count == SESSION_SLOTS)) {
        size_t oldest = (session_head + SESSION_SLOTS - session_count) % SESSION_SLOTS;
        free(sessions[oldest]);
        session_bytes -= session_sizes[oldest];
        session_count--;
    }
    sessions[session_head] = p;
    session_sizes[session_head] = size;
    session_head = (session_head + 1) % SESSION_SLOTS;
    session_count++;
    session_bytes += size;
    pthread_mutex_unlock(&session_lock);
}

__attribute__((noinline)) static void scratch_buffer(size_t size) {
    char *p = malloc(size);
    if (p) {
        memset(p, 2, size < 4096 ? size : 4096);
        sink += (uint64_t)p[0];
        free(p);
    }
}

// Requests to the payment backend and its answers, one byte each.
static int payment_requests[2], payment_answers[2];

// The checkout side: send a payment and wait for the answer.
__attribute__((noinline)) static void wait_for_payment(void) {
    char c = 'p';
    if (write(payment_requests[1], &c, 1) != 1 || read(payment_answers[0], &c, 1) != 1)
        sleep(1);
    sink += (uint64_t)c;
}

// The backend's latency: 20 ms per request, spent asleep.
__attribute__((noinline)) static void call_payment_backend(void) {
    struct timespec latency = {0, 20 * 1000 * 1000};
    int rc = nanosleep(&latency, NULL);
    sink += (uint64_t)rc;
}

static void *payments(void *arg) {
    (void)arg;
    for (;;)
        wait_for_payment();
    return NULL;
}

static void *payment_backend(void *arg) {
    char c;
    (void)arg;
    for (;;) {
        if (read(payment_requests[0], &c, 1) != 1) {
            sleep(1);
            continue;
        }
        call_payment_backend();
        if (write(payment_answers[1], &c, 1) != 1)
            sleep(1);
    }
    return NULL;
}

static void *worker(void *arg) {
    uint64_t seed = (uint64_t)(uintptr_t)arg;
    for (uint64_t n = 0;; n++) {
        sink += price_basket(seed + n);
        sink += render_receipt(seed ^ n);
        scratch_buffer(64 * 1024 + (n % 16) * 4096);
        if (n % 4 == 0)
            cache_session(16 * 1024 + (n % 8) * 8192);
    }
    return NULL;
}

int main(int argc, char **argv) {
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int threads = (int)(cpus > 0 ? cpus : 1) + 2; // more runnable threads than CPUs
    if (argc > 1)
        threads = atoi(argv[1]);
    printf("checkout: %d worker threads, 2 payment threads\n", threads);
    fflush(stdout);
    if (pipe(payment_requests) == 0 && pipe(payment_answers) == 0) {
        pthread_t t;
        pthread_create(&t, NULL, payments, NULL);
        pthread_create(&t, NULL, payment_backend, NULL);
    }
    for (int i = 1; i < threads; i++) {
        pthread_t t;
        pthread_create(&t, NULL, worker, (void *)(uintptr_t)(i * 7919));
    }
    worker((void *)(uintptr_t)1);
    return 0;
}
