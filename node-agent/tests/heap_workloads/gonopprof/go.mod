module flamefleet.dev/gonopprof

go 1.23
