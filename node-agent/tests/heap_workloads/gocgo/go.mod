module flamefleet.dev/gocgo

go 1.23
