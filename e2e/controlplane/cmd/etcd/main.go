// Command etcd is etcd's own server entry point, built at the version that
// the pinned kube-apiserver's client library expects (Debian ships 3.4).
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
