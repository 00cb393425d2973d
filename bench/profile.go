package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"runtime/pprof"
	"time"
)

// profiler fetches the started server's profiles from its loopback pprof
// listener (KAMI_PPROF_ADDR) into dir.
type profiler struct {
	base string // http://127.0.0.1:port
	dir  string
	http *http.Client
}

func newProfiler(addr, dir string) *profiler {
	return &profiler{base: "http://" + addr, dir: dir, http: &http.Client{Timeout: 10 * time.Minute}}
}

// fetch saves /debug/pprof/<path> as dir/file.
func (p *profiler) fetch(ctx context.Context, path, file string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.base+"/debug/pprof/"+path, nil)
	if err != nil {
		return err
	}
	resp, err := p.http.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return fmt.Errorf("%s: HTTP %d: %s", path, resp.StatusCode, b)
	}
	f, err := os.Create(filepath.Join(p.dir, file))
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// cpu starts a CPU profile of the next d and returns a func that waits for
// it and says how it went.
func (p *profiler) cpu(ctx context.Context, d time.Duration, file string) func() error {
	done := make(chan error, 1)
	go func() { done <- p.fetch(ctx, fmt.Sprintf("profile?seconds=%d", max(1, int(d.Seconds()))), file) }()
	return func() error { return <-done }
}

// selfCPU profiles the bench process itself (the load it puts on the same
// cores) into dir/file until the returned func is called.
func (p *profiler) selfCPU(file string) (stop func() error) {
	f, err := os.Create(filepath.Join(p.dir, file))
	if err != nil {
		return func() error { return err }
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return func() error { return err }
	}
	return func() error {
		pprof.StopCPUProfile()
		return f.Close()
	}
}
