module goblock

go 1.21
