// Benchmark workload for the Go runtime heap source: about 16,384 distinct
// allocation stacks (a binary tree of two functions, 14 calls deep), every
// allocation sampled (MemProfileRate = 1), all kept live, and a spinner whose
// iteration rate is served at /count so the reader's effect can be measured.
package main

import (
	"fmt"
	"net"
	"net/http"
	_ "net/http/pprof"
	"os"
	"runtime"
	"strconv"
	"sync/atomic"
)

var (
	keep       [][]byte
	iterations atomic.Uint64
)

//go:noinline
func left(path, depth int) { step(path, depth) }

//go:noinline
func right(path, depth int) { step(path, depth) }

func step(path, depth int) {
	if depth == 0 {
		keep = append(keep, make([]byte, 64))
		return
	}
	if path&1 == 0 {
		left(path>>1, depth-1)
	} else {
		right(path>>1, depth-1)
	}
}

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
	runtime.MemProfileRate = 1
	depth := 14
	if len(os.Args) > 1 {
		depth, _ = strconv.Atoi(os.Args[1])
	}
	for p := 0; p < 1<<depth; p++ {
		step(p, depth)
	}
	runtime.GC()
	runtime.GC()
	go spin()
	http.HandleFunc("/count", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintf(w, "%d\n", iterations.Load())
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	fmt.Printf("ready %d\n", ln.Addr().(*net.TCPAddr).Port)
	http.Serve(ln, nil)
}
