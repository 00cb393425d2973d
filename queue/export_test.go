package queue

// SetHook has the workers call hook at the named points of their claim
// loop and senders ("no-free-sender": a round found every sender busy and
// is about to stop; "claim-loop-done": the claim loop found no request to
// go round again and is about to let go of its lock; "sender-done": a
// sender is about to end, after it asked for a claim if it would), so a
// test can hold a goroutine exactly there. Set it before the workers run.
func (w *WebhookWorkers) SetHook(hook func(point string)) { w.hook = hook }

// Dirty reports whether a take or give-back of this process failed on the
// product's counter since it was last dropped (the next take or sweep
// drops and rebuilds it).
func (g *StockGate) Dirty(productID int64) bool { return g.isDirty(productID) }
