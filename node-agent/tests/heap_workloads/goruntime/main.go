// Heap test workload for the Go runtime source: keeps 64 MiB live from
// keepA and 16 MiB from keepB in 2 MiB blocks (each sampled with
// probability 1-exp(-4) at the default MemProfileRate, so the estimate is
// within a few percent), churns small short-lived objects from churn so GC
// cycles keep completing while the agent reads, counts the iterations of a
// busy loop (served at /count) whose time goes 3:1 to two call chains through
// a frameless leaf, and serves net/http/pprof on 127.0.0.1.
// Prints "ready <port>" once the live set is published (two GC cycles).
// Standard library only: building it downloads nothing.
package main

import (
	"fmt"
	"net"
	"net/http"
	_ "net/http/pprof"
	"os"
	"runtime"
	"sync/atomic"
)

const block = 2 << 20

var (
	liveA, liveB [][]byte
	sink         []byte
	iterations   atomic.Uint64
)

//go:noinline
func keepA(total int) {
	for n := 0; n < total; n += block {
		liveA = append(liveA, make([]byte, block))
	}
}

//go:noinline
func keepB(total int) {
	for n := 0; n < total; n += block {
		liveB = append(liveB, make([]byte, block))
	}
}

//go:noinline
func churn() {
	for {
		for i := 0; i < 1000; i++ {
			sink = make([]byte, 1024)
		}
		runtime.Gosched()
	}
}

// leaf has no frame (no locals on the stack, no calls): its caller is found
// only from unwind tables, never by frame pointer.
//
//go:noinline
func leaf(x uint64) uint64 {
	for i := 0; i < 1000; i++ {
		x = x*6364136223846793005 + 1442695040888963407
	}
	return x
}

// step is inlined into its callers: profiles show it as its own frame.
func step(x uint64) uint64 { return leaf(x) ^ 1 }

//go:noinline
func hotA(x uint64) uint64 {
	for i := 0; i < 3; i++ {
		x = step(x)
	}
	return x
}

//go:noinline
func hotB(x uint64) uint64 { return step(x) }

// spin counts loop iterations: the test compares their rate with and
// without the agent reading the heap profile. Its CPU time goes 3:1 to
// leaf ← step ← hotA and leaf ← step ← hotB (the CPU chains compared
// between this program built plain and stripped).
func spin() {
	x := uint64(1)
	for {
		x = hotB(hotA(x))
		if x == 0 {
			fmt.Println()
		}
		iterations.Add(1)
	}
}

func main() {
	keepA(64 << 20)
	keepB(16 << 20)
	runtime.GC()
	runtime.GC()
	if len(os.Args) > 1 && os.Args[1] == "churn" {
		go churn()
	}
	go spin()
	http.HandleFunc("/count", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintf(w, "%d\n", iterations.Load())
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Printf("ready %d\n", ln.Addr().(*net.TCPAddr).Port)
	if err := http.Serve(ln, nil); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
