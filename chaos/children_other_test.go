//go:build !linux

package chaos

import "os/exec"

// dieWithUs: only Linux can tie a child's life to ours; elsewhere a killed
// campaign may leave its children running.
func dieWithUs(*exec.Cmd) {}
