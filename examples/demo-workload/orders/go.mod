module flamefleet.dev/examples/orders

go 1.23
