module flamefleet.dev/goruntime

go 1.23
