import random, signal, time

# Each iteration costs the same in every function on every version: `s ^= i` keeps s
# under 2**18, a one-digit int. (With `s += i`, s grows past 2**30 in alpha, whose
# two-digit additions cost more than beta's and gamma's: under 3.11 such a program
# burns 51.4:29.6:19.0, not 5:3:2.)

def alpha(n):
    s = 0
    for i in range(n * 5):
        s ^= i
    return s

def beta(n):
    s = 0
    for i in range(n * 3):
        s ^= i
    return s

def gamma(n):
    s = 0
    for i in range(n * 2):
        s ^= i
    return s

# The thread CPU time spent in each, in ns: what a profile's shares are checked against.
spent = [0, 0, 0]

def report(signum, frame):
    print("cpu %d %d %d" % tuple(spent), flush=True)

def main():
    signal.signal(signal.SIGUSR1, report)
    alpha(1000); beta(1000); gamma(1000)
    print("ready", flush=True)
    # A varying round length: a fixed one could beat in phase with the sampling period
    # and favour one function.
    rng = random.Random(7)
    now = time.thread_time_ns
    while True:
        n = rng.randint(10000, 30000)
        t0 = now()
        alpha(n)
        t1 = now()
        beta(n)
        t2 = now()
        gamma(n)
        t3 = now()
        spent[0] += t1 - t0
        spent[1] += t2 - t1
        spent[2] += t3 - t2

main()
