// A Go program with a C part (cgo): keeps 64 MiB of Go heap live from keepGo
// (2 MiB blocks), can write its heap profile (so runtime.MemProfile is
// reachable and the runtime samples its heap; a blank import of
// runtime/pprof is not enough, the linker drops what nothing calls), and
// prints "ready". When a line arrives on stdin, c_site mallocs 32 MiB in
// 256 KiB blocks and keeps them, then it prints "c-ready". The Go heap is
// for the Go runtime source, the C heap for eBPF allocator probes.
package main

/*
#include <stdlib.h>
#include <string.h>

static void *kept[1024];

__attribute__((noinline)) void c_site(size_t total, size_t block) {
	size_t n = 0;
	for (size_t done = 0; done < total && n < 1024; done += block) {
		kept[n] = malloc(block);
		memset(kept[n], 1, block);
		n++;
	}
}
*/
import "C"

import (
	"bufio"
	"fmt"
	"os"
	"runtime"
	"runtime/pprof"
)

var live [][]byte

//go:noinline
func keepGo(total int) {
	for n := 0; n < total; n += 2 << 20 {
		live = append(live, make([]byte, 2<<20))
	}
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == "profile" {
		pprof.Lookup("heap").WriteTo(os.Stdout, 1)
	}
	keepGo(64 << 20)
	runtime.GC()
	runtime.GC()
	fmt.Println("ready")
	in := bufio.NewReader(os.Stdin)
	if _, err := in.ReadString('\n'); err != nil {
		return
	}
	C.c_site(32<<20, 256<<10)
	fmt.Println("c-ready")
	in.ReadString('\n')
}
