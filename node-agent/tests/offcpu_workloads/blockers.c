/*
 * Three threads that block in three known places for 5:3:2 of the time they spend there,
 * in cycles of 50 ms: each blocks, runs 2 ms on CPU, and sleeps to the end of its cycle
 * (pace_until, a stack of its own):
 *
 *   ff-sleep  nanosleep 25 ms          (block_in_sleep; kernel hrtimer_nanosleep)
 *   ff-pipe   read of a pipe, 15 ms    (block_in_pipe; kernel pipe_read)
 *   ff-mutex  contended mutex, 10 ms   (block_in_mutex; kernel futex_wait)
 *
 * Two helpers make the pipe and the mutex block for exactly that long, timed from the
 * moment the worker is seen asleep (its state in /proc), so that a worker that is late to
 * block (waiting for a CPU on a busy machine) still blocks for the whole time: ff-writer
 * writes the pipe 15 ms after ff-pipe sleeps in its read, ff-holder holds the mutex until
 * 10 ms after ff-mutex sleeps on it. They run at nice -15 with a 1 ns timer slack, and
 * wake 2 ms early to spin to the deadline, so that their own wait for a CPU does not
 * lengthen the workers' blocks (a timer wakes ff-sleep without any). Cycles are paced on
 * absolute deadlines and the workers need little CPU, so every worker runs the same number
 * of cycles even on a busy machine.
 *
 * Built without frame pointers (-O2 -fomit-frame-pointer): the callers are found by CFI.
 * Prints "ready" once all threads run; runs until killed.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MS 1000000ULL
#define CYCLE (50 * MS)

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static volatile uint64_t held_seq;
static volatile pid_t pipe_tid, mutex_tid;
static int to_writer[2], to_reader[2], to_holder[2];
static uint64_t start_ns;
static volatile int running;

static uint64_t now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ULL + ts.tv_nsec;
}

static void sleep_until(uint64_t t)
{
	struct timespec ts = { .tv_sec = t / 1000000000ULL, .tv_nsec = t % 1000000000ULL };

	while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL))
		;
}

/* Polls thread `tid`'s state until it sleeps ('S'); returns when it does. */
static void wait_asleep(pid_t tid)
{
	char path[64], buf[512];
	struct timespec pause = { .tv_sec = 0, .tv_nsec = 20000 };
	int fd;

	snprintf(path, sizeof(path), "/proc/self/task/%d/stat", (int)tid);
	fd = open(path, O_RDONLY);
	if (fd < 0)
		exit(2);
	for (;;) {
		ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
		char *end;

		if (n <= 0)
			exit(2);
		buf[n] = 0;
		end = strrchr(buf, ')');
		if (end && end[1] == ' ' && end[2] == 'S')
			break;
		nanosleep(&pause, NULL);
	}
	close(fd);
}

/* On CPU until `deadline`. */
static __attribute__((noinline)) void spin_until(uint64_t deadline)
{
	while (now() < deadline)
		__asm__ volatile("" ::: "memory");
}

static __attribute__((noinline)) void block_in_sleep(void)
{
	struct timespec ts = { .tv_sec = 0, .tv_nsec = 25 * MS };

	nanosleep(&ts, NULL);
	__asm__ volatile("" ::: "memory");
}

static __attribute__((noinline)) void block_in_pipe(void)
{
	uint64_t t = 0, got;

	if (write(to_writer[1], &t, sizeof(t)) != sizeof(t) ||
	    read(to_reader[0], &got, sizeof(got)) != sizeof(got))
		exit(1);
	__asm__ volatile("" ::: "memory");
}

static __attribute__((noinline)) void block_in_mutex(uint64_t seq)
{
	if (write(to_holder[1], &seq, sizeof(seq)) != sizeof(seq))
		exit(1);
	while (held_seq != seq)
		__asm__ volatile("" ::: "memory");
	pthread_mutex_lock(&lock);
	pthread_mutex_unlock(&lock);
	__asm__ volatile("" ::: "memory");
}

/* Sleeps until the end of a worker's cycle. */
static __attribute__((noinline)) void pace_until(uint64_t deadline)
{
	sleep_until(deadline);
	__asm__ volatile("" ::: "memory");
}

/* A worker's turn on CPU: 2 ms, then to the end of its cycle. */
static void run_then_pace(uint64_t k)
{
	spin_until(now() + 2 * MS);
	pace_until(start_ns + k * CYCLE);
}

/* Off CPU until 2 ms before `t`, then on CPU until `t`. */
static void wake_at(uint64_t t)
{
	sleep_until(t - 2 * MS);
	spin_until(t);
}

static void name(const char *n, int nice)
{
	pthread_setname_np(pthread_self(), n);
	if (nice) {
		setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), nice);
		prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
	}
	__sync_fetch_and_add(&running, 1);
}

static void *sleeper(void *arg)
{
	(void)arg;
	name("ff-sleep", 0);
	for (uint64_t k = 1;; k++) {
		block_in_sleep();
		run_then_pace(k);
	}
	return NULL;
}

static void *piper(void *arg)
{
	(void)arg;
	pipe_tid = (pid_t)syscall(SYS_gettid);
	name("ff-pipe", 0);
	for (uint64_t k = 1;; k++) {
		block_in_pipe();
		run_then_pace(k);
	}
	return NULL;
}

static void *locker(void *arg)
{
	(void)arg;
	mutex_tid = (pid_t)syscall(SYS_gettid);
	name("ff-mutex", 0);
	for (uint64_t k = 1;; k++) {
		block_in_mutex(k);
		run_then_pace(k);
	}
	return NULL;
}

static void *writer(void *arg)
{
	uint64_t t;

	(void)arg;
	name("ff-writer", -15);
	while (read(to_writer[0], &t, sizeof(t)) == sizeof(t)) {
		wait_asleep(pipe_tid);
		wake_at(now() + 15 * MS);
		if (write(to_reader[1], &t, sizeof(t)) != sizeof(t))
			exit(1);
	}
	return NULL;
}

static void *holder(void *arg)
{
	uint64_t seq;

	(void)arg;
	name("ff-holder", -15);
	while (read(to_holder[0], &seq, sizeof(seq)) == sizeof(seq)) {
		pthread_mutex_lock(&lock);
		held_seq = seq;
		wait_asleep(mutex_tid);
		wake_at(now() + 10 * MS);
		pthread_mutex_unlock(&lock);
	}
	return NULL;
}

int main(void)
{
	void *(*fns[])(void *) = { writer, holder, sleeper, piper, locker };
	pthread_t t;

	if (pipe(to_writer) || pipe(to_reader) || pipe(to_holder))
		return 1;
	start_ns = now();
	for (unsigned i = 0; i < sizeof(fns) / sizeof(fns[0]); i++)
		if (pthread_create(&t, NULL, fns[i], NULL))
			return 1;
	while (running < 5)
		usleep(1000);
	printf("ready\n");
	fflush(stdout);
	for (;;)
		pause();
}
