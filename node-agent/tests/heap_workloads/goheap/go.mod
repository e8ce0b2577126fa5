module flamefleet.dev/goheap

go 1.22
