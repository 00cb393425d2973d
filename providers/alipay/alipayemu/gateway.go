package alipayemu

import (
	"bytes"
	"context"
	"encoding/json"
	"html"
	"io"
	"mime"
	"net/http"
	"net/url"
	"strings"
	"time"

	"kami/providers/fault"
)

// opOf maps the methods the emulator serves to fault-injection ops.
var opOf = map[string]fault.Op{
	"alipay.trade.page.pay":             fault.OpCreate,
	"alipay.trade.wap.pay":              fault.OpCreate,
	"alipay.trade.precreate":            fault.OpCreate,
	"alipay.trade.query":                fault.OpQueryPayment,
	"alipay.trade.close":                fault.OpClose,
	"alipay.trade.refund":               fault.OpRefund,
	"alipay.trade.fastpay.refund.query": fault.OpQueryRefund,
	billMethod:                          fault.OpStatement,
}

// pageMethods are opened by the buyer's browser; they answer HTML.
var pageMethods = map[string]bool{"alipay.trade.page.pay": true, "alipay.trade.wap.pay": true}

// businessFault is the sub code FaultBusiness answers per op: one a real
// gateway gives for a request it will never accept.
var businessFault = map[fault.Op][2]string{
	fault.OpCreate:       {"ACQ.ACCESS_FORBIDDEN", "无权限使用接口"},
	fault.OpQueryPayment: {"ACQ.INVALID_PARAMETER", "参数无效"},
	fault.OpClose:        {"ACQ.INVALID_PARAMETER", "参数无效"},
	fault.OpRefund:       {"ACQ.SELLER_BALANCE_NOT_ENOUGH", "卖家余额不足"},
	fault.OpQueryRefund:  {"ACQ.INVALID_PARAMETER", "参数无效"},
	fault.OpStatement:    {"isv.invalid-arguments", "入参不合法"},
}

const maxRequestBytes = 1 << 20

// reply is one gateway answer.
type reply struct {
	status int            // HTTP status of an unsigned answer; 0: signed JSON
	raw    string         // unsigned body
	key    string         // "alipay_trade_query_response" or "error_response"
	fields map[string]any // the xxx_response object
}

func success(key string, fields map[string]any) reply {
	fields["code"], fields["msg"] = "10000", "Success"
	return reply{key: key, fields: fields}
}

func failure(key, code, msg, subCode, subMsg string) reply {
	return reply{key: key, fields: map[string]any{"code": code, "msg": msg, "sub_code": subCode, "sub_msg": subMsg}}
}

func bizFailure(key, subCode, subMsg string) reply {
	return failure(key, "40004", "Business Failed", subCode, subMsg)
}

func responseKey(method string) string {
	return strings.ReplaceAll(method, ".", "_") + "_response"
}

// ServeHTTP is the gateway endpoint (any path): a form POST from the app's
// server, or a GET of a page/wap pay URL from the buyer's browser.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == billPath && r.Method == http.MethodGet {
		s.serveBill(w, r)
		return
	}
	params, rep, ok := s.readRequest(r)
	if !ok {
		if r.Method == http.MethodGet {
			s.writePage(w, rep)
		} else {
			s.write(w, rep, nil)
		}
		return
	}
	method := params["method"]
	key := responseKey(method)
	page := pageMethods[method]
	biz, rep, ok := readBiz(key, params["biz_content"])
	if !ok {
		if page {
			s.writePage(w, rep)
		} else {
			s.write(w, rep, nil)
		}
		return
	}

	s.mu.Lock()
	s.methods[method]++
	if method == "alipay.trade.refund" {
		s.calls[refundNoOf(biz)]++
	}
	s.mu.Unlock()

	op := opOf[method]
	switch f := s.faults.Take(op); f {
	case fault.Timeout:
		s.holdFor(r.Context())
		http.Error(w, "gateway timeout", http.StatusGatewayTimeout)
		return
	case fault.Server5xx:
		http.Error(w, "Service Unavailable", http.StatusServiceUnavailable)
		return
	case fault.Business:
		bf := businessFault[op]
		s.write(w, bizFailure(key, bf[0], bf[1]), nil)
		return
	case FaultSystemError:
		s.write(w, bizFailure(key, "ACQ.SYSTEM_ERROR", "系统错误"), nil)
		return
	case FaultUnknownError:
		s.write(w, failure(key, "20000", "Service Currently Unavailable", "isp.unknow-error", "系统繁忙"), nil)
		return
	case FaultGarbage:
		w.Header().Set("Content-Type", "text/html")
		io.WriteString(w, "<html><body>upstream proxy garbage</body></html>")
		return
	case fault.Slow:
		s.holdForAtMost(r.Context(), s.slow)
	case fault.TimeoutAfterEffect:
		s.dispatch(method, key, biz, baseURL(r))
		s.holdFor(r.Context())
		http.Error(w, "gateway timeout", http.StatusGatewayTimeout)
		return
	case FaultBadSignature:
		s.write(w, s.dispatch(method, key, biz, baseURL(r)), s.forger())
		return
	}
	if page {
		s.writePage(w, s.dispatch(method, key, biz, baseURL(r)))
		return
	}
	s.write(w, s.dispatch(method, key, biz, baseURL(r)), nil)
}

// readRequest reads and authenticates a request: one value per field, the
// configured app_id, RSA2, a valid signature by the app's key, a timestamp.
func (s *Server) readRequest(r *http.Request) (map[string]string, reply, bool) {
	var form url.Values
	switch r.Method {
	case http.MethodGet:
		form = r.URL.Query()
	case http.MethodPost:
		mt, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
		if mt != "application/x-www-form-urlencoded" {
			return nil, failure("error_response", "40002", "Invalid Arguments", "isv.invalid-content-type", "请求必须是表单"), false
		}
		body, err := io.ReadAll(io.LimitReader(r.Body, maxRequestBytes+1))
		if err != nil || len(body) > maxRequestBytes {
			return nil, reply{status: http.StatusRequestEntityTooLarge, raw: "request too large"}, false
		}
		if form, err = url.ParseQuery(string(body)); err != nil {
			return nil, failure("error_response", "40002", "Invalid Arguments", "isv.invalid-parameter", "请求不是表单编码"), false
		}
	default:
		return nil, reply{status: http.StatusMethodNotAllowed, raw: "method not allowed"}, false
	}
	params := make(map[string]string, len(form))
	for k, vs := range form {
		if len(vs) != 1 {
			return nil, failure("error_response", "40002", "Invalid Arguments", "isv.invalid-parameter", "参数重复: "+k), false
		}
		params[k] = vs[0]
	}
	method := params["method"]
	if method == "" {
		return nil, failure("error_response", "40001", "Missing Required Arguments", "isv.missing-method", "缺少方法名参数"), false
	}
	if _, known := opOf[method]; !known {
		return nil, failure("error_response", "40002", "Invalid Arguments", "isv.invalid-method", "不存在的方法名"), false
	}
	key := responseKey(method)
	switch {
	case params["app_id"] == "":
		return nil, failure(key, "40001", "Missing Required Arguments", "isv.missing-app-id", "缺少AppID参数"), false
	case params["app_id"] != s.appID:
		return nil, failure(key, "40002", "Invalid Arguments", "isv.invalid-app-id", "无效的AppID参数"), false
	case params["sign"] == "":
		return nil, failure(key, "40001", "Missing Required Arguments", "isv.missing-signature", "缺少签名参数"), false
	case params["sign_type"] != "RSA2":
		return nil, failure(key, "40002", "Invalid Arguments", "isv.invalid-signature-type", "无效的签名类型"), false
	}
	if err := rsa2Verify(s.appPub, signContent(params, "sign"), params["sign"]); err != nil {
		return nil, failure(key, "40002", "Invalid Arguments", "isv.invalid-signature", "验签出错"), false
	}
	if _, err := time.ParseInLocation(alipayTime, params["timestamp"], beijing); err != nil {
		return nil, failure(key, "40002", "Invalid Arguments", "isv.invalid-timestamp", "非法的时间戳参数"), false
	}
	if c := params["charset"]; c != "" && !strings.EqualFold(c, "utf-8") {
		return nil, failure(key, "40002", "Invalid Arguments", "isv.invalid-charset", "字符集错误"), false
	}
	return params, reply{}, true
}

// biz is biz_content: strings, plus query_options as a list.
type biz map[string]any

func (b biz) str(k string) string {
	v, _ := b[k].(string)
	return v
}

func (b biz) has(listKey, item string) bool {
	list, _ := b[listKey].([]any)
	for _, v := range list {
		if v == item {
			return true
		}
	}
	return false
}

func readBiz(key, s string) (biz, reply, bool) {
	if s == "" {
		return nil, failure(key, "40001", "Missing Required Arguments", "isv.missing-biz-content", "缺少biz_content"), false
	}
	d := json.NewDecoder(strings.NewReader(s))
	d.UseNumber()
	var b biz
	if err := d.Decode(&b); err != nil || b == nil || d.More() {
		return nil, failure(key, "40002", "Invalid Arguments", "isv.invalid-parameter", "biz_content不是JSON对象"), false
	}
	for k, v := range b {
		switch v.(type) {
		case string, []any:
		default:
			// Alipay's amounts and numbers are strings; kami sends no
			// other kind.
			return nil, failure(key, "40002", "Invalid Arguments", "isv.invalid-parameter", "参数类型错误: "+k), false
		}
	}
	return b, reply{}, true
}

func refundNoOf(b biz) string {
	if n := b.str("out_request_no"); n != "" {
		return n
	}
	return b.str("out_trade_no")
}

// write sends a reply, signing JSON answers the way Alipay does: the
// signature covers the exact text of the xxx_response object.
// signer signs the text of an answer.
type signer interface{ sign(content string) string }

func (s *Server) write(w http.ResponseWriter, rep reply, signWith signer) {
	if rep.status != 0 {
		http.Error(w, rep.raw, rep.status)
		return
	}
	inner, err := json.Marshal(rep.fields)
	if err != nil {
		http.Error(w, "emulator: "+err.Error(), http.StatusInternalServerError)
		return
	}
	if signWith == nil {
		signWith = keySigner{s.key}
	}
	var b bytes.Buffer
	b.WriteString(`{"`)
	b.WriteString(rep.key)
	b.WriteString(`":`)
	b.Write(inner)
	b.WriteString(`,"sign":"`)
	b.WriteString(signWith.sign(string(inner)))
	b.WriteString(`"}`)
	w.Header().Set("Content-Type", "text/html;charset=utf-8") // what Alipay sends
	w.Write(b.Bytes())
}

// writePage answers a pay page: the cashier, or Alipay's error page.
func (s *Server) writePage(w http.ResponseWriter, rep reply) {
	if rep.status != 0 {
		http.Error(w, rep.raw, rep.status)
		return
	}
	w.Header().Set("Content-Type", "text/html;charset=utf-8")
	if rep.fields["code"] != "10000" {
		w.WriteHeader(http.StatusBadRequest)
		sub, _ := rep.fields["sub_code"].(string)
		io.WriteString(w, "<html><body>错误代码 "+html.EscapeString(sub)+"</body></html>")
		return
	}
	io.WriteString(w, "<html><body>支付宝收银台 "+html.EscapeString(rep.fields["out_trade_no"].(string))+"</body></html>")
}

// baseURL is the emulator's own address as the client reached it, for the
// bill download addresses it hands out.
func baseURL(r *http.Request) string {
	scheme := "http"
	if r.TLS != nil {
		scheme = "https"
	}
	return scheme + "://" + r.Host
}

// holdFor keeps a request until the client gives up or Hold passes.
func (s *Server) holdFor(ctx context.Context) { s.holdForAtMost(ctx, s.hold) }

func (s *Server) holdForAtMost(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
