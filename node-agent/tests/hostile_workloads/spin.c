/* A CPU-bound workload whose hot function's name is chosen at build time
 * (-DSPIN_FN=name), so that two builds differ only in that name: same code, same
 * layout, same offsets. With -DUSE_LIB the hot loop runs in libspin.so instead. */
#include <stdio.h>

#ifndef SPIN_FN
#define SPIN_FN hostile_spin
#endif

volatile unsigned long sink;

#ifdef USE_LIB
void lib_spin(void);
#endif

__attribute__((noinline)) void SPIN_FN(void)
{
	for (;;) {
#ifdef USE_LIB
		lib_spin();
#else
		for (int i = 0; i < 1000000; i++)
			sink += i;
#endif
	}
}

int main(void)
{
	printf("ready\n");
	fflush(stdout);
	SPIN_FN();
	return 0;
}
