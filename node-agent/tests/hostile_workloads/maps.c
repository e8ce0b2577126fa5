/* A workload whose /proc/<pid>/maps is huge: maps one page of a file whose path is
 * nearly PATH_MAX long argv[2] times (executable, at offset 0 each, so that the
 * kernel cannot merge them), under directory argv[1]: argv[2] lines of ~3.9 KiB.
 * Prints "ready", then spins in maps_spin. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

volatile unsigned long sink;

__attribute__((noinline)) void maps_spin(void)
{
	for (;;)
		for (int i = 0; i < 1000000; i++)
			sink += i;
}

int main(int argc, char **argv)
{
	if (argc < 3)
		return 2;
	static char path[4096];
	char part[252];
	memset(part, 'd', 250);
	part[250] = 0;
	snprintf(path, sizeof path, "%s", argv[1]);
	while (strlen(path) + 252 < 3800) {
		strcat(path, "/");
		strcat(path, part);
		mkdir(path, 0755);
	}
	strcat(path, "/f");
	int fd = open(path, O_CREAT | O_RDWR, 0755);
	if (fd < 0 || ftruncate(fd, 4096) != 0)
		return 1;
	int count = atoi(argv[2]);
	for (int i = 0; i < count; i++)
		if (mmap(NULL, 4096, PROT_READ | PROT_EXEC, MAP_PRIVATE, fd, 0) == MAP_FAILED)
			return 1;
	printf("ready\n");
	fflush(stdout);
	maps_spin();
	return 0;
}
