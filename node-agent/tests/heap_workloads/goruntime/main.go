// Heap test workload for the Go runtime source: keeps 64 MiB live from
// keepA and 16 MiB from keepB in 2 MiB blocks (each sampled with
// probability 1-exp(-4) at the default MemProfileRate, so the estimate is
// within a few percent), churns small short-lived objects from churn so GC
// cycles keep completing while the agent reads, counts the iterations of a
// busy loop (served at /count), and serves net/http/pprof on 127.0.0.1.
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

// spin counts loop iterations: the test compares their rate with and
// without the agent reading the heap profile.
func spin() {
	x := uint64(1)
	for {
		for i := 0; i < 1000; i++ {
			x = x*6364136223846793005 + 1442695040888963407
		}
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
