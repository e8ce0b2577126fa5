module gooom

go 1.23
