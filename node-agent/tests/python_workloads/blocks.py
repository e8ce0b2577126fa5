import random, select, threading, time

# Three functions blocking 5:3:2 of the thread's wall time, each in another way: a sleep
# (nanosleep), a select on a pipe nothing writes to (poll), a wait on an event nothing
# sets (a futex, under threading.py's own Python frames).

_quiet_r, _quiet_w = __import__("os").pipe()
_never = threading.Event()

def alpha(u):
    time.sleep(5 * u)

def beta(u):
    select.select([_quiet_r], [], [], 3 * u)

def gamma(u):
    _never.wait(2 * u)

def main():
    alpha(0.001); beta(0.001); gamma(0.001)
    print("ready", flush=True)
    # Units of 4 to 8 ms: a sleep's overshoot (timer slack, the wakeup's latency) stays
    # small against the shortest block, and a varying round cannot beat in phase with
    # anything.
    rng = random.Random(7)
    while True:
        u = rng.uniform(0.004, 0.008)
        alpha(u)
        beta(u)
        gamma(u)

main()
