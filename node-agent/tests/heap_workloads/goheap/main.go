// Heap test workload for the endpoint source: serves net/http/pprof on
// 127.0.0.1 (port printed on stdout) and keeps 32 MiB live from keepLive.
// Standard library only, so building it needs no module download. Every
// allocation is recorded (MemProfileRate = 1), so the profile is exact.
package main

import (
	"fmt"
	"net"
	"net/http"
	_ "net/http/pprof"
	"os"
	"runtime"
)

var live [][]byte

//go:noinline
func keepLive(total int) {
	for n := 0; n < total; n += 64 << 10 {
		live = append(live, make([]byte, 64<<10))
	}
}

func main() {
	// Record every allocation, so the test can compare with the exact truth.
	runtime.MemProfileRate = 1
	keepLive(32 << 20)
	runtime.GC()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Printf("port %d\n", ln.Addr().(*net.TCPAddr).Port)
	if err := http.Serve(ln, nil); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
