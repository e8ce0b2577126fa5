/* A JIT-like workload with a huge perf map: writes /tmp/perf-<pid>.map of about
 * argv[1] bytes (default 64 MiB) of code objects with 500-byte names, then runs
 * forever in an anonymous executable page ("jmp ."), so that every CPU sample of it
 * is named from that map. Prints "ready" once the map is written. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	long bytes = argc > 1 ? atol(argv[1]) : 64L << 20;
	unsigned char *code = mmap(NULL, 4096, PROT_READ | PROT_WRITE | PROT_EXEC,
				   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (code == MAP_FAILED)
		return 1;
	code[0] = 0xeb; /* jmp . */
	code[1] = 0xfe;
	char path[64];
	snprintf(path, sizeof path, "/tmp/perf-%d.map", getpid());
	FILE *f = fopen(path, "w");
	if (!f)
		return 1;
	static char name[501];
	memset(name, 'n', 500);
	unsigned long addr = (unsigned long)code;
	long written = fprintf(f, "%lx 10 JS:hostile_jit_loop\n", addr);
	for (unsigned long i = 1; written < bytes; i++)
		written += fprintf(f, "%lx 1 %s%lu\n", addr + 0x1000 + i, name, i);
	fclose(f);
	printf("ready\n");
	fflush(stdout);
	((void (*)(void))code)();
	return 0;
}
