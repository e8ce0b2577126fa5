// A Go program whose heap profile is hostile to readers of the runtime's own
// buckets (runtime.mbuckets), for the agent's Go runtime heap source:
//
//   - good:     keeps 16 MiB live from keepGood; its profile is real.
//   - victim:   the same from keepVictimSecret (another tenant's process).
//   - selfloop: points runtime.mbuckets at a fake bucket whose allnext is itself.
//   - overlap:  points it at 30,000 fake buckets packed 128 bytes apart in 4 MiB,
//     each claiming a stack of 1,020 frames, so that they overlap each other's
//     stacks: a reader that keeps what it reads holds 8 KiB per bucket, 245 MiB
//     for the whole list (which is read in 250 MB, within a 256 MiB read budget).
//
// The fake buckets pass every check a reader makes (type memProfile, at most 1,024
// frames, frees <= allocs, alloc_bytes = allocs x size). Garbage collection is
// switched off first: the runtime walks the same list when it flushes a cycle.
// Prints "ready" once done, then sleeps. Standard library only.
package main

import (
	"debug/elf"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"time"
	"unsafe"
)

const block = 2 << 20

var (
	live []([]byte)
	fake []uint64
)

//go:noinline
func keepGood(total int) {
	for n := 0; n < total; n += block {
		live = append(live, make([]byte, block))
	}
}

//go:noinline
func keepVictimSecret(total int) {
	for n := 0; n < total; n += block {
		live = append(live, make([]byte, block))
	}
}

// mbuckets is the address of runtime.mbuckets (the binary is not position-independent).
func mbuckets() uintptr {
	f, err := elf.Open("/proc/self/exe")
	if err != nil {
		panic(err)
	}
	syms, err := f.Symbols()
	if err != nil {
		panic(err)
	}
	for _, s := range syms {
		if s.Name == "runtime.mbuckets" {
			return uintptr(s.Value)
		}
	}
	panic("runtime.mbuckets not found")
}

// Word offsets in a bucket: next, allnext, typ, hash, size, nstk, then the stack and
// the memRecord (active cycle and three future ones, four words each).
const (
	allnext  = 1
	typ      = 2
	nstk     = 5
	header   = 6
	stride   = 16 // words: 128 bytes
	frames   = 1020
	memTyp   = 1
	nBuckets = 30000
)

func main() {
	mode := "good"
	if len(os.Args) > 1 {
		mode = os.Args[1]
	}
	if len(os.Args) > 99 {
		// Keeps runtime.MemProfile reachable, so the linker leaves memory profiling on.
		runtime.MemProfile(nil, false)
	}
	if mode == "victim" {
		keepVictimSecret(16 << 20)
	} else {
		keepGood(16 << 20)
	}
	runtime.GC()
	runtime.GC()
	switch mode {
	case "good", "victim":
	case "selfloop":
		fake = make([]uint64, header+frames+16)
		base := uint64(uintptr(unsafe.Pointer(&fake[0])))
		fake[allnext] = base
		fake[typ] = memTyp
		fake[nstk] = frames
		fake[header+frames] = 1 // one allocation of size 0: a valid record
		point(base)
	case "overlap":
		// With a stride of 16 words and 1,020 frames, each bucket's 16 record words are
		// one stride rotated by 2: the next headers' typ lands on allocs (1), their nstk
		// on free_bytes, their allnext on a free_bytes too, zeros elsewhere: valid.
		fake = make([]uint64, nBuckets*stride+header+frames+16)
		base := uint64(uintptr(unsafe.Pointer(&fake[0])))
		for i := 0; i < nBuckets; i++ {
			w := i * stride
			if i+1 < nBuckets {
				fake[w+allnext] = base + uint64((i+1)*stride*8)
			}
			fake[w+typ] = memTyp
			fake[w+nstk] = frames
		}
		point(base)
	default:
		panic("mode: good, victim, selfloop or overlap")
	}
	fmt.Println("ready")
	for {
		time.Sleep(time.Hour)
	}
}

// point makes runtime.mbuckets the fake list's head.
func point(head uint64) {
	debug.SetGCPercent(-1)
	*(*uint64)(unsafe.Pointer(mbuckets())) = head
}
