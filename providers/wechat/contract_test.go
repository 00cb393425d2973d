package wechat_test

import (
	"net/http"
	"testing"

	"kami/providers"
	"kami/providers/providertest"
	"kami/providers/wechat/wechatemu"
)

func harness(t *testing.T, b *bundle) providertest.Harness {
	return providertest.Harness{
		Provider: b.client,
		Pay: func(t testing.TB, orderNo string, amountFen int64) (http.Header, []byte) {
			return must(t)(b.emu.Pay(orderNo, amountFen))
		},
		RefundNotification: func(t testing.TB, refundNo string) (http.Header, []byte) {
			return must(t)(b.emu.RefundNotification(refundNo))
		},
		Forge: func(t testing.TB, orderNo string, amountFen int64) (http.Header, []byte) {
			return must(t)(b.emu.Forge(orderNo, amountFen))
		},
		OtherMerchant: func(t testing.TB, orderNo string, amountFen int64) (http.Header, []byte) {
			return must(t)(b.emu.OtherMerchant(orderNo, amountFen))
		},
		InjectFault: b.emu.InjectFault,
		Refunded:    b.emu.Refunded,
		StatementFaults: []providertest.StatementFault{
			{Op: providertest.OpStatement, Fault: providertest.FaultBusiness, Kind: providers.Rejected},
			{Op: wechatemu.OpDownload, Fault: providertest.Fault5xx, Kind: providers.Temporary},
			{Op: wechatemu.OpDownload, Fault: providertest.FaultTimeout, Kind: providers.Temporary},
			{Op: wechatemu.OpDownload, Fault: wechatemu.FaultTamperedStatement, Kind: providers.Temporary},
		},
		SupportsClose:        true,
		SupportsQueryPayment: true,
	}
}

func TestContract(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{emu: early})
	providertest.Run(t, harness(t, b))
}

// The real gateway mostly answers a refund PROCESSING and finishes it a
// moment later; the contract must hold that way too.
func TestContractRefundProcessing(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{emu: func(o *wechatemu.Options) { o.RefundProcessing = true; o.EarlyStatements = true }})
	providertest.Run(t, harness(t, b))
}
