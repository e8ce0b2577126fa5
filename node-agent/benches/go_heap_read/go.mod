module flamefleet.dev/benches/goheapread

go 1.23
