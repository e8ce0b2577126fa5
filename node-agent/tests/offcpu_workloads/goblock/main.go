// Two goroutines that wait: one in a channel receive (fed every 30 ms), one in time.Sleep
// (20 ms at a time). Each is locked to its own OS thread, so that the thread blocks on
// behalf of that goroutine alone. Prints "ready" once both wait; runs until killed.
package main

import (
	"fmt"
	"os"
	"runtime"
	"sync"
	"time"
)

//go:noinline
func receive(ch chan int) int {
	return <-ch
}

//go:noinline
func receiver(ch chan int, started *sync.WaitGroup) {
	runtime.LockOSThread()
	started.Done()
	sum := 0
	for {
		sum += receive(ch)
	}
}

//go:noinline
func nap() {
	time.Sleep(20 * time.Millisecond)
}

//go:noinline
func sleeper(started *sync.WaitGroup) {
	runtime.LockOSThread()
	started.Done()
	for {
		nap()
	}
}

func main() {
	ch := make(chan int)
	var started sync.WaitGroup
	started.Add(2)
	go receiver(ch, &started)
	go sleeper(&started)
	started.Wait()
	go func() {
		for {
			time.Sleep(30 * time.Millisecond)
			ch <- 1
		}
	}()
	fmt.Fprintln(os.Stdout, "ready")
	select {}
}
