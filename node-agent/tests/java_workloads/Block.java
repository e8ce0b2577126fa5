package dev.flamefleet.block;

import java.util.concurrent.locks.LockSupport;

/**
 * Two threads that spend their time blocked: ff-nap in Thread.sleep under nap(), ff-park in
 * LockSupport.parkNanos under park(). Each first calls its method 20,000 times with a
 * (next to) zero wait, so that the JIT's last compilation of it (C2) is done before
 * "ready": code replaced during a capture is no longer in the perf map written after it.
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
                    nap(1);
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
                park(1_000_000L);
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
