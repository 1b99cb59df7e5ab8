// Command pause is the pod sandbox's init process for a cluster without a registry:
// it holds the pod's namespaces, reaps orphaned children (it is PID 1 of the pod's
// PID namespace when process namespace sharing is on), and exits 0 on SIGINT or
// SIGTERM.  The role of registry.k8s.io/pause, built static from Go (CGO_ENABLED=0).
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
