/* Loads and attaches every program of an object, prints "ready", waits for a signal. */
#include <bpf/libbpf.h>
#include <stdio.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	struct bpf_program *prog;
	struct bpf_object *obj;

	if (argc != 2) {
		fprintf(stderr, "usage: %s OBJECT.bpf.o\n", argv[0]);
		return 2;
	}
	obj = bpf_object__open_file(argv[1], NULL);
	if (!obj || bpf_object__load(obj)) {
		fprintf(stderr, "loading %s failed\n", argv[1]);
		return 1;
	}
	bpf_object__for_each_program(prog, obj) {
		if (!bpf_program__attach(prog)) {
			fprintf(stderr, "attaching %s failed\n", bpf_program__name(prog));
			return 1;
		}
	}
	printf("ready\n");
	fflush(stdout);
	pause();
	return 0;
}
