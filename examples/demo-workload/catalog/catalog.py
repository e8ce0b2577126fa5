# The Python demo workload: a catalog service whose request loop spends its CPU in three
# functions, 5:3:2 by construction (the same loop body run 5, 3 and 2 times as long):
# render_listing, price_items and parse_query, each called from serve() at the module's top
# level. Flamefleet names these frames with no change to this program, no restart and no
# sidecar: the agent reads CPython's own frame chain at sample time (docs/capture.md,
# "Python frames"). Standard library only, nothing imported: the image holds the
# interpreter and the few modules it loads at startup.

def render_listing(n):
    s = 0
    for i in range(n * 5):
        s ^= i
    return s


def price_items(n):
    s = 0
    for i in range(n * 3):
        s ^= i
    return s


def parse_query(n):
    s = 0
    for i in range(n * 2):
        s ^= i
    return s


def serve():
    # Requests of varying size (a fixed one could beat in phase with the sampling period
    # and favour one function), from a small linear congruential generator.
    seed = 7
    render_listing(1000)
    price_items(1000)
    parse_query(1000)
    print("catalog: serving", flush=True)
    while True:
        seed = (seed * 1103515245 + 12345) % 2147483648
        n = 10000 + seed % 20000
        parse_query(n)
        price_items(n)
        render_listing(n)


serve()
