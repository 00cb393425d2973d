package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// findRepoRoot walks up from dir to the folder whose go.mod declares module kami.
func findRepoRoot(dir string) (string, error) {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return "", err
	}
	for {
		if b, err := os.ReadFile(filepath.Join(dir, "go.mod")); err == nil {
			for _, line := range strings.Split(string(b), "\n") {
				if strings.TrimSpace(line) == "module kami" {
					return dir, nil
				}
			}
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no go.mod of module kami above the current folder; run from the repo or give -repo")
		}
		dir = parent
	}
}

// buildKami builds the server binary into dir.
func buildKami(ctx context.Context, repo, dir string) (string, error) {
	bin := filepath.Join(dir, "kami")
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, ".")
	cmd.Dir = repo
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("go build: %v\n%s", err, out)
	}
	return bin, nil
}

// freeLoopbackAddr returns 127.0.0.1:<a port free just now>.
func freeLoopbackAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// serverProc is the kami process the tool started.
type serverProc struct {
	cmd  *exec.Cmd
	log  *logTail
	done chan struct{} // closed when the process has exited
	err  error         // Wait's answer, once done is closed
}

// startKami runs bin with env (added to the environment without any
// inherited KAMI_* setting) and waits until baseURL/readyz answers 200.
func startKami(ctx context.Context, bin string, env []string, baseURL string) (*serverProc, error) {
	cmd := exec.Command(bin)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "KAMI_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, env...)
	cmd.Dir = filepath.Dir(bin)
	lt := &logTail{max: 20}
	cmd.Stdout = lt
	cmd.Stderr = lt
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	s := &serverProc{cmd: cmd, log: lt, done: make(chan struct{})}
	go func() { s.err = cmd.Wait(); close(s.done) }()

	client := &http.Client{Timeout: 2 * time.Second}
	deadline := time.Now().Add(60 * time.Second)
	for {
		select {
		case <-s.done:
			return nil, fmt.Errorf("kami exited before it was ready (%v):\n%s", s.err, strings.Join(lt.Tail(), "\n"))
		case <-ctx.Done():
			s.stop(5 * time.Second)
			return nil, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
		resp, err := client.Get(baseURL + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return s, nil
			}
		}
		if time.Now().After(deadline) {
			s.stop(5 * time.Second)
			return nil, fmt.Errorf("kami not ready after 60s:\n%s", strings.Join(lt.Tail(), "\n"))
		}
	}
}

func (s *serverProc) pid() int { return s.cmd.Process.Pid }

// stop sends SIGTERM and waits up to grace, then kills. It says how the
// process ended.
func (s *serverProc) stop(grace time.Duration) string {
	select {
	case <-s.done:
		return fmt.Sprintf("had already exited (%v)", s.err)
	default:
	}
	start := time.Now()
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.done:
		took := time.Since(start).Round(time.Millisecond)
		if s.err != nil {
			return fmt.Sprintf("UNCLEAN: SIGTERM → %v after %s", s.err, took)
		}
		return fmt.Sprintf("clean: SIGTERM → exit 0 in %s", took)
	case <-time.After(grace):
		_ = s.cmd.Process.Kill()
		<-s.done
		return fmt.Sprintf("UNCLEAN: still running %s after SIGTERM, killed", grace)
	}
}

// logTail keeps the last lines the server wrote and counts warnings and
// errors (KAMI_LOG_LEVEL=warn: those are all it writes).
type logTail struct {
	mu       sync.Mutex
	max      int
	partial  []byte
	lines    []string
	warnings int
	errors   int
}

func (l *logTail) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.partial = append(l.partial, p...)
	for {
		i := bytes.IndexByte(l.partial, '\n')
		if i < 0 {
			break
		}
		line := string(l.partial[:i])
		l.partial = l.partial[i+1:]
		switch {
		case strings.Contains(line, "level=ERROR"), strings.Contains(line, `"level":"ERROR"`):
			l.errors++
		case strings.Contains(line, "level=WARN"), strings.Contains(line, `"level":"WARN"`):
			l.warnings++
		}
		if len(line) > 300 {
			line = line[:300] + "…"
		}
		l.lines = append(l.lines, line)
		if len(l.lines) > l.max {
			l.lines = l.lines[len(l.lines)-l.max:]
		}
	}
	if len(l.partial) > 64<<10 {
		l.partial = l.partial[:0]
	}
	return len(p), nil
}

func (l *logTail) Tail() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.lines...)
}

func (l *logTail) Counts() (warnings, errors int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.warnings, l.errors
}

// --- /proc ----------------------------------------------------------------

// procStatusKiB reads a "Vm...:  N kB" line of /proc/<pid>/status.
func procStatusKiB(pid int, field string) (int64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), field+":"); ok {
			return strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
		}
	}
	return 0, fmt.Errorf("/proc/%d/status has no %s", pid, field)
}

// clockTicks is USER_HZ, 100 on every Linux this runs on.
const clockTicks = 100

// procCPU is the user+system CPU time the process has used.
func procCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The command name may hold spaces; fields start after its ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, errors.New("unreadable /proc stat")
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0, errors.New("short /proc stat")
	}
	ut, _ := strconv.ParseInt(f[11], 10, 64) // field 14 utime
	st, _ := strconv.ParseInt(f[12], 10, 64) // field 15 stime
	return time.Duration(ut+st) * time.Second / clockTicks, nil
}

// selfCPU is this process's user+system CPU time.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// machineCPU returns the busy and total jiffies of all CPUs from /proc/stat.
func machineCPU() (busy, total int64) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 5 || f[0] != "cpu" {
		return 0, 0
	}
	for i, s := range f[1:] {
		v, _ := strconv.ParseInt(s, 10, 64)
		if i >= 8 { // guest time is already in user
			break
		}
		total += v
		if i != 3 && i != 4 { // idle, iowait
			busy += v
		}
	}
	return busy, total
}

// cpuProbe says which processes a CPU snapshot breaks out: the server,
// and the PostgreSQL backends serving dbName (their command line names the
// database) apart from the rest of PostgreSQL.
type cpuProbe struct {
	serverPID int
	dbName    string
}

// cpuSnapshot is the CPU time used so far by the processes the report
// breaks out, and by the whole machine.
type cpuSnapshot struct {
	at                                 time.Time
	server, self, pgDB, pgOther, redis time.Duration
	busy, total                        int64
}

func (p cpuProbe) take() cpuSnapshot {
	s := cpuSnapshot{at: time.Now(), self: selfCPU()}
	if p.serverPID > 0 {
		s.server, _ = procCPU(p.serverPID)
	}
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
		if err != nil {
			continue
		}
		switch strings.TrimSpace(string(comm)) {
		case "postgres":
			cpu, err := procCPU(pid)
			if err != nil {
				continue
			}
			cmdline, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
			if p.dbName != "" && bytes.Contains(cmdline, []byte(" "+p.dbName+" ")) {
				s.pgDB += cpu
			} else {
				s.pgOther += cpu
			}
		case "redis-server":
			if cpu, err := procCPU(pid); err == nil {
				s.redis += cpu
			}
		}
	}
	s.busy, s.total = machineCPU()
	return s
}

// CPUUse is how many cores each part used over a phase (1.0 = one core
// busy all along) and the share of the machine's CPUs that were busy.
// PostgresDB is the backends of the bench's database; PostgresOther the
// rest of PostgreSQL (WAL writer, checkpointer, other databases); Other is
// everything else busy on the machine (kernel, other programs): a large
// Other means the figures were taken on a machine that was not quiet.
type CPUUse struct {
	Server        float64 `json:"server_cores"`
	Bench         float64 `json:"bench_cores"`
	PostgresDB    float64 `json:"postgres_db_cores"`
	PostgresOther float64 `json:"postgres_other_cores"`
	Redis         float64 `json:"redis_cores"`
	Other         float64 `json:"other_cores"`
	MachineBusy   float64 `json:"machine_busy"`
}

func cpuUse(a, b cpuSnapshot) CPUUse {
	wall := b.at.Sub(a.at).Seconds()
	if wall <= 0 {
		return CPUUse{}
	}
	cores := func(x, y time.Duration) float64 { return max(0, (y-x).Seconds()/wall) }
	u := CPUUse{
		Server:        cores(a.server, b.server),
		Bench:         cores(a.self, b.self),
		PostgresDB:    cores(a.pgDB, b.pgDB),
		PostgresOther: cores(a.pgOther, b.pgOther),
		Redis:         cores(a.redis, b.redis),
	}
	if b.total > a.total {
		u.MachineBusy = float64(b.busy-a.busy) / float64(b.total-a.total)
		busyCores := u.MachineBusy * float64(runtime.NumCPU())
		u.Other = max(0, busyCores-u.Server-u.Bench-u.PostgresDB-u.PostgresOther-u.Redis)
	}
	return u
}

// rssSampler records the largest VmRSS of pid until stopped.
type rssSampler struct {
	maxKiB atomic.Int64
	stop   chan struct{}
	done   chan struct{}
}

func sampleRSS(pid int, every time.Duration) *rssSampler {
	s := &rssSampler{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			if kib, err := procStatusKiB(pid, "VmRSS"); err == nil && kib > s.maxKiB.Load() {
				s.maxKiB.Store(kib)
			}
			select {
			case <-s.stop:
				return
			case <-t.C:
			}
		}
	}()
	return s
}

func (s *rssSampler) Stop() int64 {
	close(s.stop)
	<-s.done
	return s.maxKiB.Load()
}
