// Trigger test workload: a leak from one known function (hoardOrders) that grows the heap
// by 1 MiB every PAUSE (the first argument) until the cgroup's memory limit OOM-kills it.
// Standard library only. It prints "ready" once running.
package main

import (
	"fmt"
	"os"
	"runtime/pprof"
	"time"
)

var hoard [][]byte

// hoardOrders keeps n more bytes alive, touching every page so the cgroup is charged.
//
//go:noinline
func hoardOrders(n int) {
	b := make([]byte, n)
	for i := 0; i < n; i += 4096 {
		b[i] = 1
	}
	hoard = append(hoard, b)
}

func main() {
	pause, err := time.ParseDuration(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	if len(os.Args) > 2 {
		// Never taken: a reachable heap profile keeps the runtime's memory profiling on
		// (the linker turns it off in programs that cannot read it).
		_ = pprof.Lookup("heap").WriteTo(os.Stdout, 0)
	}
	fmt.Println("ready")
	for {
		hoardOrders(1 << 20)
		time.Sleep(pause)
	}
}
