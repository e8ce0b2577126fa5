/* The hot loop of spin.c -DUSE_LIB, in a shared library. */
volatile unsigned long lib_sink;

__attribute__((noinline)) void lib_spin(void)
{
	for (int i = 0; i < 1000000; i++)
		lib_sink += i;
}
