/*
 * Heap test workload with a known live set.
 *
 *   heap_live DIR        waits until DIR/go exists, then keeps 48 MiB live from
 *                        site_a (malloc) and 16 MiB from site_b (calloc), in blocks
 *                        of 1 KiB - 1 MiB (log-uniform), churns 256 MiB through
 *                        churn_site (malloc/realloc/posix_memalign, all freed), starts
 *                        "heap_live DIR child" (a new process image) and sleeps.
 *   heap_live DIR child  keeps 8 MiB live from site_c and sleeps.
 *
 * Appends "live <site> <bytes>" for each site, then "ready <pid>" / "child-ready <pid>", to
 * DIR/report; both sleep until killed.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static uint64_t rng = 0x2545f4914f6cdd1dULL;

static uint64_t next_rand(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return rng;
}

/* Log-uniform block size in [1 KiB, 1 MiB]. */
static size_t block_size(void)
{
	unsigned shift = 10 + next_rand() % 10;          /* 2^10 .. 2^19 */
	size_t base = (size_t)1 << shift;
	return base + next_rand() % base;                /* [2^k, 2^(k+1)) */
}

static void *blocks[100000];
static int nblocks;

static void keep(void *p, size_t n)
{
	memset(p, 0xab, n < 4096 ? n : 4096);
	blocks[nblocks++] = p;
}

__attribute__((noinline)) static void site_a(size_t n) { keep(malloc(n), n); }
__attribute__((noinline)) static void site_b(size_t n) { keep(calloc(1, n), n); }
__attribute__((noinline)) static void site_c(size_t n) { keep(malloc(n), n); }

__attribute__((noinline)) static void churn_site(uint64_t total)
{
	uint64_t done = 0;

	while (done < total) {
		size_t n = block_size();
		void *p = malloc(n);
		void *q;

		memset(p, 1, 64);
		q = realloc(p, n + 4096);
		if (q)
			p = q;
		free(p);
		if (posix_memalign(&q, 64, n) == 0)
			free(q);
		done += 2 * n + 4096;
	}
}

static size_t fill(void (*site)(size_t), size_t target)
{
	size_t live = 0;

	while (live < target) {
		size_t n = block_size();
		site(n);
		live += n;
	}
	return live;
}

static FILE *report;

static void say(const char *fmt, size_t v)
{
	fprintf(report, fmt, v);
	fflush(report);
}

static void sleep_forever(void)
{
	for (;;)
		pause();
}

int main(int argc, char **argv)
{
	char path[4096];
	size_t a = 0, b = 0;

	if (argc < 2)
		return 2;
	snprintf(path, sizeof(path), "%s/report", argv[1]);
	report = fopen(path, "a");
	if (!report)
		return 1;
	if (argc > 2 && strcmp(argv[2], "child") == 0) {
		rng ^= 0x9e3779b97f4a7c15ULL;
		say("live site_c %zu\n", fill(site_c, 8u << 20));
		say("child-ready %zu\n", (size_t)getpid());
		sleep_forever();
	}
	snprintf(path, sizeof(path), "%s/go", argv[1]);
	while (access(path, F_OK) != 0)
		usleep(10000);
	/* Interleave the sites 3:1 so that neither one's blocks come first. */
	while (a < (48u << 20) || b < (16u << 20)) {
		for (int i = 0; i < 3 && a < (48u << 20); i++) {
			size_t n = block_size();
			site_a(n);
			a += n;
		}
		if (b < (16u << 20)) {
			size_t n = block_size();
			site_b(n);
			b += n;
		}
	}
	say("live site_a %zu\n", a);
	say("live site_b %zu\n", b);
	churn_site(256u << 20);
	if (fork() == 0) {
		execl("/proc/self/exe", argv[0], argv[1], "child", (char *)NULL);
		_exit(127);
	}
	say("ready %zu\n", (size_t)getpid());
	sleep_forever();
}
