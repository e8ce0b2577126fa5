/* Loads one program of a BPF object alone with the verifier's statistics on (log level 4)
 * and prints them: "NAME ms=TOTAL verifier_us=N processed=N states=N", or the error.
 * Run by ../verifier_cost.sh, not by the agent. */
#include <bpf/libbpf.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static char log_buf[1 << 20];

/* libbpf's own messages would interleave with the figures. */
static int quiet(enum libbpf_print_level level, const char *fmt, va_list args)
{
	return 0;
}

static const char *stat_of(const char *key)
{
	const char *at = strstr(log_buf, key);

	return at ? at + strlen(key) : "?";
}

int main(int argc, char **argv)
{
	struct bpf_program *prog, *want = NULL;
	struct timespec a, b;
	struct bpf_object *obj;
	int err;

	if (argc != 3) {
		fprintf(stderr, "usage: %s OBJECT.bpf.o PROGRAM\n", argv[0]);
		return 2;
	}
	libbpf_set_print(quiet);
	obj = bpf_object__open_file(argv[1], NULL);
	if (!obj)
		return 1;
	bpf_object__for_each_program(prog, obj) {
		bool it = !strcmp(bpf_program__name(prog), argv[2]);

		bpf_program__set_autoload(prog, it);
		if (it)
			want = prog;
	}
	if (!want) {
		fprintf(stderr, "no program %s in %s\n", argv[2], argv[1]);
		return 1;
	}
	bpf_program__set_log_level(want, 4);
	bpf_program__set_log_buf(want, log_buf, sizeof(log_buf));
	clock_gettime(CLOCK_MONOTONIC, &a);
	err = bpf_object__load(obj);
	clock_gettime(CLOCK_MONOTONIC, &b);
	if (err) {
		printf("%-22s not loadable alone by the system's libbpf (error %d)\n", argv[2], err);
		return 0;
	}
	printf("%-22s load %6.1f ms  verifier %7ld us  processed %7ld insns  states %ld\n", argv[2],
	       (b.tv_sec - a.tv_sec) * 1e3 + (b.tv_nsec - a.tv_nsec) / 1e6,
	       strtol(stat_of("verification time "), NULL, 10),
	       strtol(stat_of("processed "), NULL, 10), strtol(stat_of("total_states "), NULL, 10));
	bpf_object__close(obj);
	return 0;
}
