package domain

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"
)

// BenchmarkBusinessEventLine is the cost of one business event line (an
// order paid) at info, in text to a discarded writer, and at warn, when it
// is left out: what the hot path pays per order.
func BenchmarkBusinessEventLine(b *testing.B) {
	p := Payment{Provider: "sandbox", OrderNo: "26120112000000001234", TradeNo: "SB20261201120000abcdef", AmountFen: 1250, PaidAt: time.Now()}
	res := &PaymentResult{Outcome: PaymentDelivered}
	for _, level := range []slog.Level{slog.LevelInfo, slog.LevelWarn} {
		b.Run(level.String(), func(b *testing.B) {
			s := &Shop{Log: slog.New(slog.NewTextHandler(io.Discard, &slog.HandlerOptions{Level: level}))}
			ctx := context.Background()
			b.ReportAllocs()
			for b.Loop() {
				s.logPayment(ctx, p, res)
			}
		})
	}
}
