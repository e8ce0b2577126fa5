/*
 * Allocation-heavy benchmark for the heap profiler overhead run
 * (node-agent/benches/heap_overhead.sh).
 *
 *   malloc_bench SECONDS WORK
 *
 * Loops for SECONDS: malloc a block of 16 B - 4 KiB (log-uniform), write it,
 * free the block allocated 1024 iterations earlier, then do WORK rounds of
 * arithmetic (the "application" between allocations; 0 = pure allocator
 * microbenchmark). Prints "ops_per_cpu_sec N": operations per second of CPU
 * time the process used (user + system, which includes uprobe handling), so
 * that other load on the machine does not skew the comparison; and a checksum
 * on stderr.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double clock_s(clockid_t clock)
{
	struct timespec ts;

	clock_gettime(clock, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static double now(void)
{
	return clock_s(CLOCK_MONOTONIC);
}

__attribute__((noinline)) static void *alloc_block(size_t n)
{
	void *p = malloc(n);

	memset(p, 0x5a, n < 64 ? n : 64);
	return p;
}

int main(int argc, char **argv)
{
	double seconds = argc > 1 ? atof(argv[1]) : 5;
	long work = argc > 2 ? atol(argv[2]) : 0;
	void *ring[1024] = { 0 };
	uint64_t rng = 88172645463325252ULL, ops = 0, sink = 0;
	double start = now(), end = start + seconds;
	double cpu0 = clock_s(CLOCK_PROCESS_CPUTIME_ID);

	while (1) {
		for (int i = 0; i < 1024; i++) {
			unsigned shift;

			rng ^= rng << 13;
			rng ^= rng >> 7;
			rng ^= rng << 17;
			shift = 4 + rng % 8;
			free(ring[i]);
			ring[i] = alloc_block(((size_t)1 << shift) + (rng >> 32) % ((size_t)1 << shift));
			for (long w = 0; w < work; w++)
				sink = sink * 6364136223846793005ULL + 1442695040888963407ULL;
		}
		ops += 1024;
		if (now() >= end)
			break;
	}
	printf("ops_per_cpu_sec %.0f\n", ops / (clock_s(CLOCK_PROCESS_CPUTIME_ID) - cpu0));
	/* Keeps the work loop from being optimised away. */
	fprintf(stderr, "checksum %llu\n", (unsigned long long)sink);
	return 0;
}
