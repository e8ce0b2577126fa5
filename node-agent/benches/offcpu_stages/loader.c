/* Loads one off-CPU object's offcpu_switch program only, makes cgroup ID argv[1] target 1
 * (index 1, no flags) and attaches it; prints "ready <program ID>", waits for SIGINT or
 * SIGTERM. Run by ../offcpu_stages.sh, not by the agent. */
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
	struct { unsigned int index, flags; } target = { 1, 0 };
	unsigned long long cgroup, generation = 1;
	struct bpf_prog_info info = {};
	__u32 info_len = sizeof(info);
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
		bpf_program__set_autoload(prog, !strcmp(bpf_program__name(prog), "offcpu_switch"));
	if (bpf_object__load(obj)) {
		fprintf(stderr, "loading %s failed\n", argv[2]);
		return 1;
	}
	/* The stages that return before the target lookups still have these maps. */
	if (bpf_map_update_elem(bpf_map__fd(bpf_object__find_map_by_name(obj, "targets")),
				&cgroup, &target, 0) ||
	    bpf_map_update_elem(bpf_map__fd(bpf_object__find_map_by_name(obj, "target_generation")),
				&zero, &generation, 0)) {
		fprintf(stderr, "setting the target failed\n");
		return 1;
	}
	prog = bpf_object__find_program_by_name(obj, "offcpu_switch");
	if (!prog || !bpf_program__attach(prog) ||
	    bpf_obj_get_info_by_fd(bpf_program__fd(prog), &info, &info_len)) {
		fprintf(stderr, "attaching offcpu_switch failed\n");
		return 1;
	}
	signal(SIGINT, on_signal);
	signal(SIGTERM, on_signal);
	printf("ready %u\n", info.id);
	fflush(stdout);
	pause();
	return 0;
}
