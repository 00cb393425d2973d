package redistest

import (
	"os/exec"
	"syscall"
)

// dieWithTest has the kernel kill the server when the test process dies,
// also when it crashes or is killed before its cleanups run: a test
// cluster's six servers must not outlive it.
func dieWithTest(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
