package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"kami/domain/dbtest"
)

// missingTool skips a test whose outside tool (Node, Chromium) is not on
// this machine, saying how to get it; in CI (KAMI_TEST_REQUIRE_SERVICES=1)
// a missing tool is a failure instead, so CI never skips.
func missingTool(t *testing.T, what, howToGet string) {
	t.Helper()
	if dbtest.Required() {
		t.Fatalf("%s is missing and KAMI_TEST_REQUIRE_SERVICES=1: %s", what, howToGet)
	}
	t.Skipf("%s is missing, skipped: %s", what, howToGet)
}

// nodeModules returns node's path and the node_modules folder that
// .ci/node-tools fills (KAMI_TEST_NODE_MODULES, or the user's cache).
func nodeModules(t *testing.T, pkg string) (node, modules string) {
	t.Helper()
	node, err := exec.LookPath("node")
	if err != nil {
		missingTool(t, "node", "install Node.js (Debian: apt-get install nodejs npm), then run bash .ci/node-tools")
	}
	modules = os.Getenv("KAMI_TEST_NODE_MODULES")
	if modules == "" {
		cache, err := os.UserCacheDir()
		if err != nil {
			missingTool(t, "a cache folder for npm packages", "set KAMI_TEST_NODE_MODULES")
		}
		modules = filepath.Join(cache, "kami", "node", "node_modules")
	}
	if _, err := os.Stat(filepath.Join(modules, pkg, "package.json")); err != nil {
		missingTool(t, "the npm package "+pkg+" in "+modules, "run bash .ci/node-tools")
	}
	return node, modules
}
