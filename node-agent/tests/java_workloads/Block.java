package dev.flamefleet.block;

import java.util.concurrent.locks.LockSupport;

/**
 * Two threads that spend their time blocked: ff-nap in Thread.sleep under nap(), ff-park in
 * LockSupport.parkNanos under park(). Each first calls its method 20,000 times with a
 * (next to) zero wait, so that the JIT's last compilation of it (C2) is done before
 * "ready": code replaced during a capture is no longer in the perf map written after it.
 * Then each blocks 5 ms at a time: well above the off-CPU capture's 1 ms minimum block (a
 * 1 ms sleep returns in a little less or a little more, and the blocks below the minimum
 * are only counted, which left ff-nap with no attributed time in one run).
 */
public final class Block {
    static final int WARM = 20_000;

    static void nap(long millis) throws InterruptedException {
        Thread.sleep(millis);
    }

    static void park(long nanos) {
        LockSupport.parkNanos(nanos);
    }

    public static void main(String[] args) throws Exception {
        Thread napper = new Thread(() -> {
            try {
                for (int i = 0; i < WARM; i++) {
                    nap(0);
                }
                while (true) {
                    nap(5);
                }
            } catch (InterruptedException e) {
                return;
            }
        }, "ff-nap");
        Thread parker = new Thread(() -> {
            for (int i = 0; i < WARM; i++) {
                park(1);
            }
            while (true) {
                park(5_000_000L);
            }
        }, "ff-park");
        napper.setDaemon(true);
        parker.setDaemon(true);
        napper.start();
        parker.start();
        Thread.sleep(3000);
        System.out.println("ready");
        System.out.flush();
        napper.join();
    }
}
