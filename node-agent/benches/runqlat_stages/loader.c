/* Loads one runqlat object's switch_hybrid program only, makes cgroup ID argv[1] target 1
 * (index 1, no flags) and attaches it; prints "ready", waits for SIGINT or SIGTERM, then
 * prints "waits N": the waits the target's histogram holds (all CPUs). Run by
 * ../runqlat_stages.sh, not by the agent. */
#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void on_signal(int sig)
{
	(void)sig;
}

int main(int argc, char **argv)
{
	unsigned long long waits = 0, *values;
	unsigned int key = 1;
	int cpus, slots;
	size_t size;
	struct { unsigned int index, flags; } target = { 1, 0 };
	unsigned long long cgroup, generation = 1;
	struct bpf_program *prog;
	struct bpf_object *obj;
	unsigned int zero = 0;

	if (argc != 3) {
		fprintf(stderr, "usage: %s CGROUP_ID OBJECT.bpf.o\n", argv[0]);
		return 2;
	}
	cgroup = strtoull(argv[1], NULL, 0);
	obj = bpf_object__open_file(argv[2], NULL);
	if (!obj)
		return 1;
	bpf_object__for_each_program(prog, obj)
		bpf_program__set_autoload(prog, !strcmp(bpf_program__name(prog), "switch_hybrid"));
	if (bpf_object__load(obj)) {
		fprintf(stderr, "loading %s failed\n", argv[2]);
		return 1;
	}
	if (bpf_map_update_elem(bpf_map__fd(bpf_object__find_map_by_name(obj, "targets")),
				&cgroup, &target, 0) ||
	    bpf_map_update_elem(bpf_map__fd(bpf_object__find_map_by_name(obj, "target_generation")),
				&zero, &generation, 0)) {
		fprintf(stderr, "setting the target failed\n");
		return 1;
	}
	prog = bpf_object__find_program_by_name(obj, "switch_hybrid");
	if (!prog || !bpf_program__attach(prog)) {
		fprintf(stderr, "attaching switch_hybrid failed\n");
		return 1;
	}
	signal(SIGINT, on_signal);
	signal(SIGTERM, on_signal);
	printf("ready\n");
	fflush(stdout);
	pause();
	/* Per-CPU values of element 1, each padded to 8 bytes: here a multiple already. */
	cpus = libbpf_num_possible_cpus();
	size = bpf_map__value_size(bpf_object__find_map_by_name(obj, "target_hists"));
	slots = (int)(size / sizeof(*values));
	values = calloc((size_t)cpus * slots, sizeof(*values));
	if (cpus < 1 || !values ||
	    bpf_map_lookup_elem(bpf_map__fd(bpf_object__find_map_by_name(obj, "target_hists")),
				&key, values)) {
		fprintf(stderr, "reading the histogram failed\n");
		return 1;
	}
	for (int i = 0; i < cpus * slots; i++)
		waits += values[i];
	printf("waits %llu\n", waits);
	return 0;
}
