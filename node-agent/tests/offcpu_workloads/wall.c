/* One thread splitting its wall time between burning the CPU and sleeping, in a known
 * ratio: each round burns BURN_NS of the thread's own CPU time (CLOCK_THREAD_CPUTIME_ID,
 * so preemption on a busy machine does not shorten it), then sleeps SLEEP_NS. Built
 * without frame pointers by the test. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

#define BURN_NS 6000000LL
#define SLEEP_NS 4000000LL

static volatile unsigned long sink;

static long long thread_cpu_ns(void)
{
	struct timespec t;
	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
	return t.tv_sec * 1000000000LL + t.tv_nsec;
}

__attribute__((noinline)) void burn_cpu(long long ns)
{
	long long end = thread_cpu_ns() + ns;
	while (thread_cpu_ns() < end)
		for (int i = 0; i < 20000; i++)
			sink += i;
}

__attribute__((noinline)) void rest(long long ns)
{
	struct timespec t = {ns / 1000000000LL, ns % 1000000000LL};
	nanosleep(&t, NULL);
}

static void *worker(void *arg)
{
	(void)arg;
	pthread_setname_np(pthread_self(), "ff-wall");
	printf("ready\n");
	fflush(stdout);
	for (;;) {
		burn_cpu(BURN_NS);
		rest(SLEEP_NS);
	}
	return NULL;
}

int main(void)
{
	pthread_t t;
	if (pthread_create(&t, NULL, worker, NULL))
		return 1;
	pause();
	return 0;
}
