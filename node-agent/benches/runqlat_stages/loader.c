/* Loads one runqlat object's switch_hybrid program only, makes cgroup ID argv[1] target 1
 * (index 1, no flags) and attaches it; prints "ready" and waits for a signal. Run by
 * ../runqlat_stages.sh, not by the agent. */
#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv)
{
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
	printf("ready\n");
	fflush(stdout);
	pause();
	return 0;
}
