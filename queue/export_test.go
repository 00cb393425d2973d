package queue

// SetHook has the workers call hook at the named points of their claim
// loop and senders ("no-free-sender": a round found every sender busy and
// is about to stop; "claim-loop-done": the claim loop found no request to
// go round again and is about to let go of its lock; "sender-done": a
// sender is about to end, after it asked for a claim if it would), so a
// test can hold a goroutine exactly there. Set it before the workers run.
func (w *WebhookWorkers) SetHook(hook func(point string)) { w.hook = hook }
