// A Go program that never links runtime.MemProfile (no runtime/pprof), so
// the linker sets runtime.disableMemoryProfiling and the runtime starts with
// MemProfileRate = 0: it keeps no heap samples. Keeps 16 MiB live and prints
// "ready" when done; then waits for stdin to close.
package main

import (
	"fmt"
	"os"
)

var live [][]byte

func main() {
	for n := 0; n < 16<<20; n += 1 << 20 {
		live = append(live, make([]byte, 1<<20))
	}
	fmt.Println("ready")
	buf := make([]byte, 1)
	os.Stdin.Read(buf)
}
