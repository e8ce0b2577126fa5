module gobuckets

go 1.23
