// The OOM demo workload: an orders service that, once asked to (POST /leak), keeps every
// order it sees in memory from one function, hoardOrders, until its container's memory
// limit gets it OOM-killed. A policy's memory trigger (docs/triggers.md) catches it near the
// limit and the agent reads its heap before the kill: the profile names hoardOrders.
//
// It idles until POST /leak (so a test or the demo starts the growth once Flamefleet
// watches it); GET /healthz answers while it runs. Standard library only.
package main

import (
	"fmt"
	"net/http"
	"os"
	"runtime/pprof"
	"sync"
	"time"
)

var (
	hoard   [][]byte
	leaking sync.Once
)

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

// leak grows the heap by 1 MiB every pause, forever.
func leak(pause time.Duration) {
	for {
		hoardOrders(1 << 20)
		time.Sleep(pause)
	}
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == "--never" {
		// Never taken: a reachable heap profile keeps the runtime's memory profiling on
		// (the linker turns it off in programs that cannot read it).
		_ = pprof.Lookup("heap").WriteTo(os.Stdout, 0)
	}
	http.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	http.HandleFunc("/leak", func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			http.Error(w, "POST only", http.StatusMethodNotAllowed)
			return
		}
		pause, err := time.ParseDuration(r.URL.Query().Get("pause"))
		if err != nil || pause <= 0 {
			pause = 20 * time.Millisecond
		}
		leaking.Do(func() { go leak(pause) })
		fmt.Fprintf(w, "leaking 1 MiB every %s\n", pause)
	})
	fmt.Println("orders: serving on :8080")
	if err := http.ListenAndServe(":8080", nil); err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
}
