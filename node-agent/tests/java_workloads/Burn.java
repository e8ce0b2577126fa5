package dev.flamefleet.burn;

import java.util.Random;

/**
 * Three methods burning CPU 5:3:2: the same loop body, run 5, 3 and 2 times as long, each
 * in its own method so that each is compiled on its own. main stays interpreted (it loops
 * a few hundred times a second, far from the JIT's loop thresholds). "ready" once all
 * three have been compiled.
 */
public final class Burn {
    static long sink;

    static long alpha(long x, int n) {
        for (int i = 0; i < n * 5; i++) {
            x ^= x << 13;
            x ^= x >>> 7;
            x ^= x << 17;
        }
        return x;
    }

    static long beta(long x, int n) {
        for (int i = 0; i < n * 3; i++) {
            x ^= x << 13;
            x ^= x >>> 7;
            x ^= x << 17;
        }
        return x;
    }

    static long gamma(long x, int n) {
        for (int i = 0; i < n * 2; i++) {
            x ^= x << 13;
            x ^= x >>> 7;
            x ^= x << 17;
        }
        return x;
    }

    public static void main(String[] args) {
        // A varying round length: a fixed one could beat in phase with the sampling
        // period and favour one method.
        Random rng = new Random(7);
        long x = 88172645463325252L;
        long warm = System.nanoTime() + 3_000_000_000L;
        boolean ready = false;
        while (true) {
            int n = 100_000 + rng.nextInt(200_000);
            x = alpha(x, n);
            x = beta(x, n);
            x = gamma(x, n);
            sink = x;
            if (!ready && System.nanoTime() > warm) {
                System.out.println("ready");
                System.out.flush();
                ready = true;
            }
        }
    }
}
