package queue

import "github.com/redis/go-redis/v9"

// Every Lua script kami runs. Scores are unix milliseconds; the "now" of
// due-ness comes from the caller (the ledger's clock), so tests control time
// and every process judges due-ness by the same clock as the database. Only
// the stock operations' record, which no due-ness depends on, keeps Redis's
// own time.

// claimScript moves up to ARGV[2] due members of a queue into its lease set,
// atomically: no two callers ever get the same member.
//
// KEYS[1] queue ZSET, KEYS[2] lease ZSET (same hash tag)
// ARGV[1] now (ms), ARGV[2] max members, ARGV[3] lease deadline (ms)
// Returns the claimed members with the scores they were queued at (member,
// score, member, score, ...), earliest due first.
var claimScript = redis.NewScript(`
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[2]))
if #due == 0 then return due end
local members, args = {}, {}
for i = 1, #due, 2 do
	members[#members+1] = due[i]
	args[#args+1] = ARGV[3]
	args[#args+1] = due[i]
end
redis.call('ZREM', KEYS[1], unpack(members))
redis.call('ZADD', KEYS[2], unpack(args))
return due
`)

// ackScript removes members from the lease set, but only those still held
// under the lease the caller claimed them with: a member whose lease expired
// and that another worker claimed again keeps that worker's lease.
//
// KEYS[1] lease ZSET
// ARGV[1] lease deadline (ms) the members were claimed with, ARGV[2..] members
// Returns the number of members removed.
var ackScript = redis.NewScript(`
local n = 0
for i = 2, #ARGV do
	local s = redis.call('ZSCORE', KEYS[1], ARGV[i])
	if s and tonumber(s) == tonumber(ARGV[1]) then
		n = n + redis.call('ZREM', KEYS[1], ARGV[i])
	end
end
return n
`)

// recoverScript puts members whose lease expired back on the queue, due at
// once; a member already back on the queue (rescheduled by its worker) keeps
// its queue score.
//
// KEYS[1] queue ZSET, KEYS[2] lease ZSET
// ARGV[1] now (ms), ARGV[2] max members per call
// Returns the number of members moved.
var recoverScript = redis.NewScript(`
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1], 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[2]))
local n = 0
for i = 1, #expired, 2 do
	redis.call('ZADD', KEYS[1], 'NX', expired[i+1], expired[i])
	redis.call('ZREM', KEYS[2], expired[i])
	n = n + 1
end
return n
`)

// releaseScript puts members back on the queue, each due at its own time,
// and ends their lease, in one step: a member no longer held under the
// caller's lease (it expired, another worker holds it now) is left alone,
// and one already on the queue due earlier keeps its time.
//
// KEYS[1] queue ZSET, KEYS[2] lease ZSET
// ARGV[1] lease deadline (ms) the members were claimed with, then due (ms),
// member pairs from ARGV[2]
// Returns the number of members put back.
var releaseScript = redis.NewScript(`
local n = 0
for i = 2, #ARGV, 2 do
	local due, m = tonumber(ARGV[i]), ARGV[i+1]
	local s = redis.call('ZSCORE', KEYS[2], m)
	if s and tonumber(s) == tonumber(ARGV[1]) then
		redis.call('ZREM', KEYS[2], m)
		local q = redis.call('ZSCORE', KEYS[1], m)
		if not q or tonumber(q) > due then
			redis.call('ZADD', KEYS[1], ARGV[i], m)
		end
		n = n + 1
	end
end
return n
`)

// advanceScript makes queued members due earlier, at ARGV[1]; a member not
// on the queue (claimed, done) or already due by then is left alone.
//
// KEYS[1] queue ZSET
// ARGV[1] due (ms), ARGV[2..] members
// Returns the number of members moved.
var advanceScript = redis.NewScript(`
local due = tonumber(ARGV[1])
local n = 0
for i = 2, #ARGV do
	local s = redis.call('ZSCORE', KEYS[1], ARGV[i])
	if s and tonumber(s) > due then
		redis.call('ZADD', KEYS[1], ARGV[1], ARGV[i])
		n = n + 1
	end
end
return n
`)

// scheduleIfAbsentScript adds members that are neither queued nor leased
// (the sweeper's rebuild: a task being worked on is not added twice, and a
// queued task keeps its score).
//
// KEYS[1] queue ZSET, KEYS[2] lease ZSET
// ARGV[1], ARGV[2], ...: score, member pairs
// Returns the number of members added.
var scheduleIfAbsentScript = redis.NewScript(`
local n = 0
for i = 1, #ARGV, 2 do
	local m = ARGV[i+1]
	if not redis.call('ZSCORE', KEYS[2], m) then
		n = n + redis.call('ZADD', KEYS[1], 'NX', ARGV[i], m)
	end
end
return n
`)

// A take and a give-back are each sent with an operation id of their own
// (a random token per call) and recorded, under it, in the product's
// operations set, so that the same command sent again (a Redis Cluster
// client resends a command whose answer timed out, and the first copy may
// still run) counts once. The set is scored by the time of the operation
// and keeps it for stockOpsKeep: each call drops what is older, and the
// set expires with the last operation, so it holds at most the
// operations of that window. The time is Redis's own (TIME), not the
// caller's: processes whose clocks differ must not drop each other's
// records early.

// takeScript takes ARGV[1] from a stock counter if at least that many are
// left, once per operation id. Every answer is recorded (as the member
// "id:answer"), and a later copy of the operation gets the recorded one:
// a copy run after its caller was told "not enough" or "missing" (and
// refused the order, or rebuilt the counter and took under another id)
// must not take for an order that never was.
//
// KEYS[1] stock counter, KEYS[2] its operations set (same hash tag)
// ARGV[1] quantity, ARGV[2] operation id, ARGV[3] how long an operation is
// remembered (ms)
// Returns 1 taken, 0 not enough, -1 the counter is missing (the caller
// rebuilds it from the database and tries again under another id); an
// earlier copy's answer for a copy of the same operation.
var takeScript = redis.NewScript(`
local t = redis.call('TIME')
local now, keep = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. (now - keep))
for _, r in ipairs({'1', '0', '-1'}) do
	if redis.call('ZSCORE', KEYS[2], ARGV[2] .. ':' .. r) then return tonumber(r) end
end
local answer = -1
local v = redis.call('GET', KEYS[1])
if v then
	answer = 0
	if tonumber(v) >= tonumber(ARGV[1]) then
		redis.call('DECRBY', KEYS[1], ARGV[1])
		answer = 1
	end
end
redis.call('ZADD', KEYS[2], now, ARGV[2] .. ':' .. answer)
redis.call('PEXPIRE', KEYS[2], keep)
return answer
`)

// giveBackScript returns ARGV[1] to a stock counter, only if it exists,
// once per operation id: a missing counter is rebuilt from the database,
// never created at a value that counts only the give-backs. While a
// rebuild holds its lock, the give-back is kept aside instead, and the
// rebuild adds it (see rebuildSetScript): the cards it returns may have
// been freed after the rebuild counted, and would otherwise be lost until
// the next repair. A give-back that did neither (the counter missing, no
// rebuild running) is recorded too: the next rebuild counts its cards in
// the database, and a copy of it run after that rebuild must not add them
// again.
//
// KEYS[1] stock counter, KEYS[2] its rebuild lock, KEYS[3] its pending sum,
// KEYS[4] its operations set
// ARGV[1] quantity, ARGV[2] operation id, ARGV[3] how long an operation is
// remembered (ms)
// Returns the new value (the current one when an earlier copy of this
// operation gave back), or -1 when the counter is missing.
var giveBackScript = redis.NewScript(`
local t = redis.call('TIME')
local now, keep = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', '(' .. (now - keep))
local done = redis.call('ZSCORE', KEYS[4], ARGV[2])
local exists = redis.call('EXISTS', KEYS[1]) == 1
if done then
	if exists then return tonumber(redis.call('GET', KEYS[1])) end
	return -1
end
local v = -1
if exists then
	v = redis.call('INCRBY', KEYS[1], ARGV[1])
elseif redis.call('EXISTS', KEYS[2]) == 1 then
	redis.call('INCRBY', KEYS[3], ARGV[1])
	redis.call('EXPIRE', KEYS[3], 60)
end
redis.call('ZADD', KEYS[4], now, ARGV[2])
redis.call('PEXPIRE', KEYS[4], keep)
return v
`)

// rebuildStartScript starts the rebuild of a product's counter: it takes the
// rebuild lock and clears the give-backs kept aside (the coming count of
// the database includes every one made so far). A missing counter is
// rebuilt; an existing one only with ARGV[3] = 1 (a repair), and then it is
// deleted here, under the lock, so that until the rebuild sets it, takes
// wait as they do for a missing counter and give-backs are kept aside: the
// rebuild's own SET can then overwrite nothing that happened since.
//
// The same command sent again (a cluster client resends one whose answer
// timed out) finds the lock holding the caller's own token: it started,
// and answers so again. Answering 0 would leave the caller to fail with
// the counter deleted under a lock nobody uses until it expires.
//
// KEYS[1] stock counter, KEYS[2] its rebuild lock, KEYS[3] its pending sum
// ARGV[1] lock token, ARGV[2] lock TTL (ms), ARGV[3] 1 to rebuild an
// existing counter
// Returns 1 started (the caller holds the lock and must count and set),
// 0 another process holds the lock, 2 the counter exists (nothing to do).
var rebuildStartScript = redis.NewScript(`
local mine = redis.call('GET', KEYS[2]) == ARGV[1]
local exists = redis.call('EXISTS', KEYS[1]) == 1
if not mine then
	if exists and ARGV[3] ~= '1' then return 2 end
	if not redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return 0 end
end
redis.call('DEL', KEYS[3])
if exists then redis.call('DEL', KEYS[1]) end
return 1
`)

// tryLockScript takes a lock that expires after ARGV[2] ms if it is free,
// and answers taken when it already holds the caller's token: the same
// command sent again by a cluster client, whose first copy took it.
//
// KEYS[1] lock
// ARGV[1] token, ARGV[2] TTL (ms)
// Returns 1 taken (now, or by an earlier copy), 0 held by another.
var tryLockScript = redis.NewScript(`
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then return 1 end
if v then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
`)

// rebuildSetScript creates a missing counter at the database's count plus
// what was given back while the rebuild counted, and clears that sum; only
// while the caller still holds the rebuild lock (a rebuild whose lock
// expired during a slow count may be older than another's).
//
// KEYS[1] stock counter, KEYS[2] its pending sum, KEYS[3] its rebuild lock
// ARGV[1] the database's count, ARGV[2] the caller's lock token
// Returns the counter's value, -1 when it already existed, -2 when the lock
// is no longer the caller's.
var rebuildSetScript = redis.NewScript(`
if redis.call('GET', KEYS[3]) ~= ARGV[2] then return -2 end
local pending = tonumber(redis.call('GET', KEYS[2]) or '0')
redis.call('DEL', KEYS[2])
if redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
local v = tonumber(ARGV[1]) + pending
redis.call('SET', KEYS[1], v)
return v
`)

// unlockScript deletes a lock only if it still holds the caller's token.
//
// KEYS[1] lock
// ARGV[1] token
// Returns 1 deleted, 0 not ours (expired, taken by another).
var unlockScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then
	return redis.call('DEL', KEYS[1])
end
return 0
`)

// lockScript takes a lock that expires at ARGV[2], if it is free or its
// holder's time ran out by ARGV[1], and answers taken when it holds the
// caller's token (the same command sent again by a cluster client, whose
// first copy took it). The deadline is kept in the value ("deadline:token")
// as well as in the key's TTL, so the lock also expires where keys do not
// expire on their own (miniredis, whose clock only moves when told).
//
// KEYS[1] lock
// ARGV[1] now (unix ms), ARGV[2] deadline (unix ms), ARGV[3] TTL (ms),
// ARGV[4] token
// Returns 1 taken, 0 held by another.
var lockScript = redis.NewScript(`
local v = redis.call('GET', KEYS[1])
if v then
	local deadline, holder = string.match(v, '^(%d+):?(.*)$')
	if holder == ARGV[4] then return 1 end
	if deadline and tonumber(deadline) > tonumber(ARGV[1]) then return 0 end
end
redis.call('SET', KEYS[1], ARGV[2] .. ':' .. ARGV[4], 'PX', ARGV[3])
return 1
`)
