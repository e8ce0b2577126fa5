// Command coredns is CoreDNS with only the plugins the local one-node cluster's DNS needs
// (kubernetes, forward, cache, errors, health, ready, loop, reload, loadbalance, log), so it
// builds from source in a minute instead of pulling every cloud provider's SDK.
// It serves cluster DNS for the real-node tests and the demo (scripts/cluster.sh).
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"
)

// The order in which plugins handle a query (CoreDNS's plugin.cfg order for these).
var directives = []string{
	"reload",
	"ready",
	"health",
	"errors",
	"log",
	"loadbalance",
	"cache",
	"loop",
	"kubernetes",
	"forward",
}

func init() {
	dnsserver.Directives = directives
}

func main() {
	coremain.Run()
}
