package dev.flamefleet.demo;

/**
 * The Java demo workload: a ledger service whose batch loop spends its CPU in three
 * methods, 5:3:2 by construction (the same loop body run 5, 3 and 2 times as long):
 * reconcile, applyFees and postEntries, each compiled on its own by the JIT. Flamefleet names
 * the compiled frames from the perf map the JVM writes when the agent asks it (docs/capture.md,
 * "Java frames"); the image runs it with -XX:+PreserveFramePointer so that the callers of
 * compiled frames are found too. "ledger: serving" once the three have been compiled.
 */
public final class Ledger {
    static long sink;

    static long reconcile(long x, int n) {
        for (int i = 0; i < n * 5; i++) {
            x ^= x << 13;
            x ^= x >>> 7;
            x ^= x << 17;
        }
        return x;
    }

    static long applyFees(long x, int n) {
        for (int i = 0; i < n * 3; i++) {
            x ^= x << 13;
            x ^= x >>> 7;
            x ^= x << 17;
        }
        return x;
    }

    static long postEntries(long x, int n) {
        for (int i = 0; i < n * 2; i++) {
            x ^= x << 13;
            x ^= x >>> 7;
            x ^= x << 17;
        }
        return x;
    }

    public static void main(String[] args) {
        // Batches of varying size: a fixed one could beat in phase with the sampling period
        // and favour one method.
        java.util.Random rng = new java.util.Random(7);
        long x = 88172645463325252L;
        long warm = System.nanoTime() + 3_000_000_000L;
        boolean serving = false;
        while (true) {
            int n = 100_000 + rng.nextInt(200_000);
            x = reconcile(x, n);
            x = applyFees(x, n);
            x = postEntries(x, n);
            sink = x;
            if (!serving && System.nanoTime() > warm) {
                System.out.println("ledger: serving");
                System.out.flush();
                serving = true;
            }
        }
    }
}
