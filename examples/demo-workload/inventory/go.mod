module flamefleet.dev/examples/inventory

go 1.23
