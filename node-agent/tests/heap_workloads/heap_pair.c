/*
 * Workload of the heap sampler sharing test: allocates on command, from named functions,
 * and keeps everything it allocates.
 *
 * Reads one command per line on stdin and answers "done <command>" on stdout once done:
 *   alpha       16 MiB from pair_alpha (64 blocks of 256 KiB)
 *   alpha_late  16 MiB from pair_alpha_late
 *   beta        16 MiB from pair_beta
 * Prints "ready <pid>" first; exits at the end of stdin.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define BLOCK (256 * 1024)
#define BLOCKS 64

static void *kept[4 * BLOCKS];
static int nkept;

static void keep(void *p)
{
	memset(p, 1, BLOCK);
	if (nkept < (int)(sizeof(kept) / sizeof(kept[0])))
		kept[nkept++] = p;
}

__attribute__((noinline)) void pair_alpha(void)
{
	for (int i = 0; i < BLOCKS; i++)
		keep(malloc(BLOCK));
}

__attribute__((noinline)) void pair_alpha_late(void)
{
	for (int i = 0; i < BLOCKS; i++)
		keep(malloc(BLOCK));
}

__attribute__((noinline)) void pair_beta(void)
{
	for (int i = 0; i < BLOCKS; i++)
		keep(malloc(BLOCK));
}

int main(void)
{
	char line[64];

	printf("ready %d\n", (int)getpid());
	fflush(stdout);
	while (fgets(line, sizeof(line), stdin)) {
		line[strcspn(line, "\n")] = 0;
		if (!strcmp(line, "alpha"))
			pair_alpha();
		else if (!strcmp(line, "alpha_late"))
			pair_alpha_late();
		else if (!strcmp(line, "beta"))
			pair_beta();
		printf("done %s\n", line);
		fflush(stdout);
	}
	return 0;
}
