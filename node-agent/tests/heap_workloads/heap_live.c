/*
 * Heap test workload with a known live set.
 *
 *   heap_live            waits for a line on stdin, then keeps 48 MiB live from
 *                        site_a (malloc) and 16 MiB from site_b (calloc), in blocks
 *                        of 1 KiB - 1 MiB (log-uniform), churns 256 MiB through
 *                        churn_site (malloc/realloc/posix_memalign, all freed), starts
 *                        "heap_live child" (a new process image) and sleeps.
 *   heap_live child      keeps 8 MiB live from site_c and sleeps.
 *
 * Prints "live <site> <bytes>" for each site and "ready" when done; exits when stdin closes.
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

static void wait_for_stdin_eof(void)
{
	char buf[64];

	while (read(0, buf, sizeof(buf)) > 0)
		;
}

int main(int argc, char **argv)
{
	char line[64];
	size_t a = 0, b = 0;

	setvbuf(stdout, NULL, _IONBF, 0);
	if (argc > 1 && strcmp(argv[1], "child") == 0) {
		rng ^= 0x9e3779b97f4a7c15ULL;
		printf("live site_c %zu\n", fill(site_c, 8u << 20));
		printf("child-ready %d\n", getpid());
		wait_for_stdin_eof();
		return 0;
	}
	if (!fgets(line, sizeof(line), stdin))
		return 1;
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
	printf("live site_a %zu\n", a);
	printf("live site_b %zu\n", b);
	churn_site(256u << 20);
	if (fork() == 0) {
		execl("/proc/self/exe", argv[0], "child", (char *)NULL);
		_exit(127);
	}
	printf("ready %d\n", getpid());
	wait_for_stdin_eof();
	return 0;
}
