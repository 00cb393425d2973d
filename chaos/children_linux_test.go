package chaos

import (
	"os/exec"
	"syscall"
)

// dieWithUs has the kernel kill a child (a kami process, the campaign's
// redis-server) when the test process dies, so a campaign whose go test is
// killed (a timeout, ^C, kill -9) leaves no process behind holding ports,
// the database and Redis.
func dieWithUs(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
