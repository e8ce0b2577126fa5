// The Go demo workload: an inventory service whose heap Flamefleet reads from the Go
// runtime's own profile buckets, with no endpoint declared and no code added for it.
// loadCatalog keeps 48 MiB live and indexSKUs 16 MiB; handleOrders allocates short-lived
// objects all the time, so garbage collections keep completing.
//
// Go samples heap allocations only when the program links runtime.MemProfile (here through
// net/http/pprof, served on loopback only, as many services do); a program that does not
// gets a clear "memory profiling disabled" reason from the agent instead of a profile.
// Standard library only: building it downloads nothing.
package main

import (
	"fmt"
	"net/http"
	_ "net/http/pprof"
	"runtime"
	"time"
)

const block = 1 << 20

var (
	catalog [][]byte
	index   [][]byte
	sink    []byte
)

//go:noinline
func loadCatalog(total int) {
	for n := 0; n < total; n += block {
		catalog = append(catalog, make([]byte, block))
	}
}

//go:noinline
func indexSKUs(total int) {
	for n := 0; n < total; n += block {
		index = append(index, make([]byte, block))
	}
}

//go:noinline
func handleOrders() {
	for {
		for i := 0; i < 200; i++ {
			sink = make([]byte, 4096)
		}
		time.Sleep(time.Millisecond)
	}
}

func main() {
	loadCatalog(48 << 20)
	indexSKUs(16 << 20)
	runtime.GC()
	go handleOrders()
	fmt.Println("inventory ready")
	// Loopback only: the pod's own debugging port, never exposed.
	if err := http.ListenAndServe("127.0.0.1:6060", nil); err != nil {
		fmt.Println(err)
	}
}
