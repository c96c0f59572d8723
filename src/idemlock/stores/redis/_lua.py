"""The Lua scripts of the Redis store: one script per port transition.

Scripts are composed once at import from shared snippets (the clock, the record
readers, the fence counter), loaded with SCRIPT LOAD and called with EVALSHA. User
data only ever travels in KEYS and ARGV.

Claim record (one packed string per (ns, key), ``struct`` format ``>c1I7I6Bc0Bc0Bc0``
followed by the result; a hash would turn into a large hashtable as soon as a result
passes 64 bytes, and every byte counts: the value of a completed record with a 100-byte
result stays within jemalloc's 160-byte class)::

    state  I (in flight), C (completed), A (abandoned), F (forgotten: counter only)
    fence  the last fence issued for this key (the counter), 7 bytes
    exp    expiry in ms on Redis's clock (lease end in flight, ttl end when completed), 6
           bytes
    token  token of the in-flight attempt ('' otherwise)
    fp     fingerprint ('' for None)
    nonce  (4 bytes) of the last freeing call, so a retried complete/abandon/forget (a lost reply
           re-sent by the client) is recognised instead of reported stale
    result the rest of the string (completed)

Steps of a claim (a hash beside its record, same hash tag, so a Cluster runs each
transition as one script): step name -> the fence of the attempt that wrote it
(``struct`` ``>I7``, 7 bytes) then nothing (a "started" marker) or '=' and the result.
The hash's PEXPIREAT is the steps' end: max(its end, now + ttl) at each step written,
the completed record's end at complete; abandon leaves it, forget deletes it. Redis
drops it at its end, so an expired hash is never revived: the next step starts a new
one.

Lock record (a hash, one per (ns, key)); a lock is the one-permit case (``limit=1``,
which travels with each acquire and is never stored) of a key many may hold::

    o  owner of the newest permit   t  token counter: the last token issued
    x  its lease end                n  nonce and token of the last releasing call
    v  its published value, as "<token>:<value>" (only read while t is that token)
    y  hand-off window end          g  the waiter (gid) the window is reserved for
    h<owner>  every other permit: "<token>:<lease end>[:<value>]"

The newest permit (token t) always lives in o/x, so a lock's record is exactly the
shape the previous release wrote and read (o, t, x, y, g, n): a lock held by a process
of either release is held for the other during a rolling upgrade. Granting another
permit moves the one in o/x to its own h-field. Expired permits are dropped by the next
script that writes the key; the key's PEXPIREAT covers its longest permit and window.

Waiters of a lock (a hash beside it, same slot): gid -> "first:until" (ms).

Fence gate: a string holding the highest accepted token in decimal.

Replies are arrays whose first element says which case happened, or a bare code; the
codes are the state table's (:mod:`idemlock._core.table`), interpolated below, and each
script names the rows it implements. Numbers are integers (Lua numbers stay exact
below 2**53: microsecond counters do until 2255).
"""

from __future__ import annotations

from ..._core import table as T

# The reply codes, from the one vocabulary of the state table (never typed here).
_CODES = f"""
local GRANTED, BUSY, DONE, MISMATCH = {T.GRANTED.code}, {T.BUSY.code}, {T.DONE.code}, {T.MISMATCH.code}
local ACQUIRED, HELD = {T.ACQUIRED.code}, {T.HELD.code}
local OK, STALE, NO_EXPIRY = {T.OK.code}, {T.STALE.code}, {T.NO_EXPIRY}
"""  # noqa: E501

# Redis's clock: TIME in microseconds, and ms for expiries. Counters are seeded from
# now_us so a counter lost with its data restarts above every token it issued.
_PRELUDE = (
    _CODES
    + """
local tm = redis.call('TIME')
local now_us = tonumber(tm[1]) * 1000000 + tonumber(tm[2])
local now = math.floor(now_us / 1000)
local function S(v) return string.format('%.0f', v) end
local function corrupt(why) return redis.error_reply('IDEMLOCK_CORRUPT ' .. why) end
local function next_fence(last) return math.max((last or 0) + 1, now_us) end
-- Claim records keep expiries in 6 bytes (ms up to year 10889): a later one would
-- wrap to the past and a completed record would read as expired, so it is refused.
local MAX_MS = 281474976710655
local function too_long(x)
  return redis.error_reply('IDEMLOCK_RANGE an expiry ' .. S(x - now) .. ' ms from now')
end
"""
)

_READ_CLAIM = """
local FMT = '>c1I7I6Bc0Bc0Bc0'
local function read_claim(k)
  local v = redis.pcall('GET', k)
  if type(v) == 'table' then return nil, 'wrong type' end
  if not v then return {} end
  local ok, s, f, x, t, p, n, pos = pcall(struct.unpack, FMT, v)
  if not ok or not (s == 'I' or s == 'C' or s == 'A' or s == 'F') then
    return nil, 'not an idemlock record'
  end
  return {s = s, f = f, x = x, t = t, p = p, n = n, r = string.sub(v, pos)}
end
local function pack_claim(s, f, x, t, p, n, r)
  return struct.pack(FMT, s, f, x, #t, t, #p, p, #n, n) .. r
end
local function live(c) return (c.s == 'I' or c.s == 'C') and c.x > now end
"""

# The start of most claim scripts: the record KEYS[1] read as `c`, a corrupt one refused.
_WITH_CLAIM = (
    _PRELUDE
    + _READ_CLAIM
    + "\nlocal c, why = read_claim(KEYS[1])"
    + "\nif not c then return corrupt(why) end"
)

# The steps of key k as HGETALL answers them (name, value, ...), appended to `out`; nil
# and why for what idemlock did not write (another type, a value not fence + marker or
# '=' result), refused before anything is written. A missing hash (no steps: the hot
# path) is one empty HGETALL.
_READ_STEPS = """
local function read_steps(k, out)
  local r = redis.pcall('HGETALL', k)
  if r.err then return nil, 'steps: wrong type' end
  for i = 2, #r, 2 do
    local v = r[i]
    if not (#v == 7 or (#v > 7 and string.byte(v, 8) == 61)) then
      return nil, 'steps: not a step'
    end
  end
  for i = 1, #r do out[#out + 1] = r[i] end
  return out
end
"""

_READ_LOCK = """
local function read_lock(k)
  local r = redis.pcall('HGETALL', k)
  if r.err then return nil, 'wrong type' end
  local o, ts, xs, ys, g, n, v, hs
  for i = 1, #r, 2 do
    local name, val = r[i], r[i + 1]
    if name == 'o' then o = val
    elseif name == 't' then ts = val
    elseif name == 'x' then xs = val
    elseif name == 'n' then n = val
    elseif name == 'y' then ys = val
    elseif name == 'g' then g = val
    elseif name == 'v' then v = val
    elseif string.byte(name) == 104 then  -- 'h' .. owner: a permit beside the newest
      local pt, px, rest = string.match(val, '^(%d+):(%d+)(.*)$')
      if not pt or (rest ~= '' and string.byte(rest) ~= 58) then
        return nil, 'not a holder'
      end
      local pv = nil
      if rest ~= '' then pv = string.sub(rest, 2) end
      hs = hs or {}
      hs[string.sub(name, 2)] = {ts = pt, t = tonumber(pt), x = tonumber(px), v = pv, f = name}
    else
      return nil, 'foreign hash'
    end
  end
  local t, x, y = tonumber(ts), tonumber(xs), tonumber(ys)
  if (ts and not t) or (xs and not x) or (ys and not y) then
    return nil, 'not a number'
  end
  if (o and not x) or (x and not o) or (y and not g) then
    return nil, 'missing field'
  end
  if not t and #r > 0 then return nil, 'missing field' end
  local live, count = {}, 0
  if o and x > now then
    local pv = nil
    if v and string.sub(v, 1, #ts + 1) == ts .. ':' then pv = string.sub(v, #ts + 2) end
    live[o] = {ts = ts, t = t, x = x, v = pv}  -- no f: the fields o, x and v
    count = 1
  end
  local dead = {}
  if hs then
    for ho, p in pairs(hs) do
      if p.x > now and not live[ho] then
        live[ho] = p
        count = count + 1
      else
        dead[#dead + 1] = p.f
      end
    end
  end
  return {t = t, ts = ts, o = o, y = y, g = g, n = n, v = v, live = live, count = count,
          dead = dead}
end
-- a hand-off window kept (for l.g)
local function kept(l) return l.y and l.y > now end
-- Write permit p of owner o: the newest (no p.f) in the fields x and v, another in its
-- own field; expired holders' fields dropped with it.
local function put(k, l, o, p)
  if p.f then
    local enc = p.ts .. ':' .. S(p.x)
    if p.v then enc = enc .. ':' .. p.v end
    redis.call('HSET', k, p.f, enc)
  elseif p.v then
    redis.call('HSET', k, 'x', S(p.x), 'v', p.ts .. ':' .. p.v)
  else
    redis.call('HSET', k, 'x', S(p.x))
  end
end
local function prune(k, l, extra)
  local del = l.dead
  if extra then for _, e in ipairs(extra) do del[#del + 1] = e end end
  if #del > 0 then redis.call('HDEL', k, unpack(del)) end
end
-- The key outlives its longest holder and its window by keep ms.
local function expire_at(k, l, keep)
  local last = now
  for _, p in pairs(l.live) do if p.x > last then last = p.x end end
  if l.y and l.y > last then last = l.y end
  redis.call('PEXPIREAT', k, S(last + keep))
end
"""

# A grant or renew that publishes a value wakes the key's election observers, and them
# alone (payload '!': the key's waiters sleep through it, as no permit was freed), on
# the lock channel il{TAG}L that releases publish on: the lock's name up to its hash
# tag, then 'L'. Derived here, so a call without a value carries nothing more.
_OBSERVED = """
local function observed()
  redis.call('PUBLISH', string.match(KEYS[1], '^[^}]*}') .. 'L', '!')
end
"""

# The start of most lock scripts: the record KEYS[1] read as `l`, a corrupt one refused.
_WITH_LOCK = (
    _PRELUDE
    + _READ_LOCK
    + "\nlocal l, why = read_lock(KEYS[1])"
    + "\nif not l then return corrupt(why) end"
)

# Tokens given by users may exceed 2**53, so gates compare canonical decimals as
# strings: longer is larger, equal lengths compare lexically.
_READ_GATE = """
local function ge(a, b)
  if #a ~= #b then return #a > #b end
  return a >= b
end
local function read_gate(k)
  local v = redis.pcall('GET', k)
  if type(v) == 'table' and v.err then return nil, 'wrong type' end
  if not v then return false end
  if not (v == '0' or string.match(v, '^[1-9]%d*$')) then return nil, 'not a token' end
  return v
end
"""

# ---- claims ------------------------------------------------------------------------
# Rows claim.new, claim.resend, claim.mismatch, claim.replay, claim.busy; a grant
# carries the key's steps (read before anything is written).
# KEYS[1] record, KEYS[2] steps. ARGV: fp, token, lease_ms, keep_ms
# Reply: {GRANTED, fence, expiry, lease, step name, step value, ...} or as the rows say.
CLAIM = (
    _WITH_CLAIM
    + _READ_STEPS
    + """
if live(c) then
  if c.s == 'I' and c.t == ARGV[2] then
    local out, bad = read_steps(KEYS[2], {GRANTED, c.f, c.x, c.x - now})
    return out or corrupt(bad)
  end
  if c.p ~= ARGV[1] then return {MISMATCH, c.s} end
  if c.s == 'C' then return {DONE, c.x, c.r} end
  return {BUSY, c.x, c.x - now}
end
local f = next_fence(c.f)
local lease = tonumber(ARGV[3])
local x = now + lease
if x > MAX_MS then return too_long(x) end
local out, bad = read_steps(KEYS[2], {GRANTED, f, x, lease})
if not out then return corrupt(bad) end
local v = pack_claim('I', f, x, ARGV[2], ARGV[1], '', '')
redis.call('SET', KEYS[1], v, 'PXAT', S(x + tonumber(ARGV[4])))
return out
"""
)

# Rows extend.ok, extend.stale.
# KEYS[1] record. ARGV: token, lease_ms, keep_ms. Reply: the new lease end, or NO_EXPIRY.
EXTEND = (
    _WITH_CLAIM
    + """
if c.s == 'I' and c.t == ARGV[1] and c.x > now then
  local x = now + tonumber(ARGV[2])
  if x > MAX_MS then return too_long(x) end
  redis.call('SET', KEYS[1], pack_claim('I', c.f, x, c.t, c.p, c.n, c.r),
             'PXAT', S(x + tonumber(ARGV[3])))
  return x
end
return NO_EXPIRY
"""
)

# Rows complete.ok, complete.late, complete.resend, complete.stale.
# KEYS[1] record, KEYS[2] steps, KEYS[3..] the caller's keys to write with the
# completion. ARGV: token, result, ttl_ms, channel, '' (a placeholder: the token's tag
# recognises a re-send), then one value per caller's key.
COMPLETE = (
    _PRELUDE
    + _READ_CLAIM
    + """
-- 4 bytes of the token's SHA-1 kept as the completed record's nonce: a completion
-- re-sent after a lost reply (same token, same result) is recognised, for 4 bytes
-- rather than the whole token.
local function tag(t)
  local h = redis.sha1hex(t)
  return string.char(tonumber(string.sub(h, 1, 2), 16), tonumber(string.sub(h, 3, 4), 16),
                     tonumber(string.sub(h, 5, 6), 16), tonumber(string.sub(h, 7, 8), 16))
end
local c, why = read_claim(KEYS[1])
if not c then return corrupt(why) end
-- Accepted after the lease ended too, while no other attempt took the key over
-- (the record still holds this token): refusing would throw finished work away.
if c.s == 'I' and c.t == ARGV[1] then
  local x = now + tonumber(ARGV[3])
  if x > MAX_MS then return too_long(x) end
  -- A completed record lives exactly its ttl: once it is gone, the next fence is
  -- seeded from the clock, far above this one.
  redis.call('SET', KEYS[1], pack_claim('C', c.f, x, '', c.p, tag(ARGV[1]), ARGV[2]),
             'PXAT', S(x))
  -- The key's steps end with the completed record (a no-op without steps).
  redis.call('PEXPIREAT', KEYS[2], S(x))
  -- The job's own effects commit with its record, or not at all (same script).
  for i = 3, #KEYS do redis.call('SET', KEYS[i], ARGV[i + 3]) end
  redis.call('PUBLISH', ARGV[4], '*')
  return OK
end
if c.s == 'C' and c.x > now and c.n == tag(ARGV[1]) and c.r == ARGV[2] then return OK end
return STALE
"""
)

# Rows abandon.ok, abandon.late, abandon.stale. The nonce recognises the driver's own
# retry of this call after a lost reply (its first attempt's answer), not a new call.
# KEYS[1] record. ARGV: token, keep_ms, channel, nonce
ABANDON = (
    _WITH_CLAIM
    + """
if c.s == 'I' and c.t == ARGV[1] then  -- late abandon too, as for complete
  redis.call('SET', KEYS[1], pack_claim('A', c.f, 0, '', '', ARGV[4], ''), 'PX', ARGV[2])
  redis.call('PUBLISH', ARGV[3], '*')
  return OK
end
if c.s == 'A' and c.n == ARGV[4] then return OK end
return STALE
"""
)

# Rows forget.live, forget.dead (the key's steps dropped with the record).
# KEYS[1] record, KEYS[2] steps. ARGV: keep_ms, channel, nonce
FORGET = (
    _WITH_CLAIM
    + """
if c.s == 'F' and c.n == ARGV[3] then return OK end
local was = live(c)
if c.s then
  -- only the counter stays
  local n = ''
  if was then n = ARGV[3] end
  redis.call('SET', KEYS[1], pack_claim('F', c.f, 0, '', '', n, ''), 'PX', ARGV[1])
end
redis.call('DEL', KEYS[2])
redis.call('PUBLISH', ARGV[2], '*')
if was then return OK end
return STALE
"""
)

# KEYS[1] record. Reply: {} or {state, fence, expires_ms}
PEEK_CLAIM = (
    _WITH_CLAIM
    + """
if live(c) then return {c.s, c.f, c.x} end
return {}
"""
)

# ---- steps inside a claim ----------------------------------------------------------
# The guard and renewal of extend.ok: the claim in flight with this token, its lease
# not ended; the step's write runs first, so a key holding something else than a hash
# (refused as corrupt) changes nothing.
_STEP_GUARD = (
    _WITH_CLAIM
    + """
if not (c.s == 'I' and c.t == ARGV[1] and c.x > now) then return NO_EXPIRY end
local x = now + tonumber(ARGV[2])
if x > MAX_MS then return too_long(x) end
local function renewed()
  redis.call('SET', KEYS[1], pack_claim('I', c.f, x, c.t, c.p, c.n, c.r),
             'PXAT', S(x + tonumber(ARGV[3])))
  return x
end
"""
)

# Rows step.record, step.stale. KEYS[1] record, KEYS[2] steps.
# ARGV: token, lease_ms, keep_ms, name, '' (a started marker) or '=' .. result, ttl_ms.
# Reply: the new lease end, or NO_EXPIRY. The steps' end becomes max(their end,
# now + ttl_ms); a hash past its end is gone already (Redis expired it), never revived.
STEP = (
    _STEP_GUARD
    + """
local e = now + tonumber(ARGV[6])
if e > MAX_MS then return too_long(e) end
local left = redis.call('PTTL', KEYS[2])  -- -2: no steps yet, -1: no end (not ours)
local w = redis.pcall('HSET', KEYS[2], ARGV[4], struct.pack('>I7', c.f) .. ARGV[5])
if type(w) == 'table' and w.err then return corrupt('steps: wrong type') end
if left < 0 or now + left < e then redis.call('PEXPIREAT', KEYS[2], S(e)) end
return renewed()
"""
)

# Rows step.drop, step.drop.stale. KEYS[1] record, KEYS[2] steps. ARGV: token,
# lease_ms, keep_ms, name. Reply: the new lease end, or NO_EXPIRY. The last step
# dropped takes the hash with it.
DROP_STEP = (
    _STEP_GUARD
    + """
local w = redis.pcall('HDEL', KEYS[2], ARGV[4])
if type(w) == 'table' and w.err then return corrupt('steps: wrong type') end
return renewed()
"""
)

# KEYS[1] steps. Reply: the live steps as HGETALL answers them (name, value, ...).
PEEK_STEPS = (
    _PRELUDE
    + _READ_STEPS
    + """
local out, bad = read_steps(KEYS[1], {})
return out or corrupt(bad)
"""
)

# ---- locks -------------------------------------------------------------------------
# Fair hand-off. A process with a caller waiting on a lock registers its waiter id
# (gid: random, one per process and key) with every failed attempt, in a small hash
# beside the lock (KEYS[2]: gid -> "first:until" ms), so registrations queue in
# arrival order and lapse register_ms after the last attempt (a waiter that died).
# A release that finds live registrations picks the oldest, opens a hand-off window
# reserved for it and names it in the notification: only that process wakes up and
# only its callers may take the lock during the window, so neither the releasing
# process nor a newcomer can barge in, and the other waiters sleep on. Getting the
# lock or giving up ends a registration.

_REGISTER = """
local function register()
  if ARGV[4] ~= '' then
    local cur = redis.call('HGET', KEYS[2], ARGV[4])
    local first = cur and string.match(cur, '^(%d+):') or S(now)
    redis.call('HSET', KEYS[2], ARGV[4], first .. ':' .. S(now + tonumber(ARGV[5])))
    redis.call('PEXPIRE', KEYS[2], ARGV[5])
  end
end
"""

# Rows lock.reacquire, lock.handoff.take, lock.acquire, lock.busy, lock.handoff (a lock
# is the limit=1 case of the same rows).
# KEYS[1] record, KEYS[2] waiters.
# ARGV: owner, ttl_ms, keep_ms, gid, register_ms, limit, value ('' none, '=' .. value)
# A grant with a value publishes '!' (observers only).
ACQUIRE = (
    _PRELUDE
    + _READ_LOCK
    + _OBSERVED
    + _REGISTER
    + """
local l, why = read_lock(KEYS[1])
if not l then return corrupt(why) end
local ttl = tonumber(ARGV[2])
local x = now + ttl
if x > MAX_MS then return too_long(x) end
local keep = tonumber(ARGV[3])
local val = nil
if ARGV[7] ~= '' then val = string.sub(ARGV[7], 2) end
local mine = l.live[ARGV[1]]
if mine then  -- lock.reacquire: a re-sent acquire
  mine.x = x
  if val then mine.v = val end
  put(KEYS[1], l, ARGV[1], mine)
  prune(KEYS[1], l)
  expire_at(KEYS[1], l, keep)
  if val then observed() end
  return {ACQUIRED, mine.t, x, ttl, 0}  -- 0: the owner held it already
end
local limit = tonumber(ARGV[6])
local window = kept(l)
local take = window and ARGV[4] == l.g
local room = l.count < limit  -- guard chosen (take), or room with no window kept
if window and not take then room = l.count + 1 < limit end  -- guard room: the window counts
if not room then  -- lock.busy, lock.handoff
  register()
  local u = nil
  if window then u = l.y end
  for _, p in pairs(l.live) do if not u or p.x < u then u = p.x end end
  return {HELD, u, u - now}
end
-- lock.acquire, lock.handoff.take: the next token; the newest permit always lives in
-- the fields o, t, x (the record of a lock, as the previous release wrote it), so a
-- permit held there before moves to a field of its own.
if l.y and not (window and not take) then  -- the window taken, or passed
  l.dead[#l.dead + 1] = 'y'
  l.dead[#l.dead + 1] = 'g'
  l.y = nil
end
if l.n then l.dead[#l.dead + 1] = 'n' end
if l.v and not val then l.dead[#l.dead + 1] = 'v' end
prune(KEYS[1], l)
local prev = l.o and l.live[l.o]
if prev and not prev.f then
  local enc = prev.ts .. ':' .. S(prev.x)
  if prev.v then enc = enc .. ':' .. prev.v end
  redis.call('HSET', KEYS[1], 'h' .. l.o, enc)
end
local t = next_fence(l.t)
local ts = S(t)
if val then
  redis.call('HSET', KEYS[1], 'o', ARGV[1], 't', ts, 'x', S(x), 'v', ts .. ':' .. val)
else
  redis.call('HSET', KEYS[1], 'o', ARGV[1], 't', ts, 'x', S(x))
end
if ARGV[4] ~= '' then redis.call('HDEL', KEYS[2], ARGV[4]) end
l.live[ARGV[1]] = {x = x}
expire_at(KEYS[1], l, keep)
if val then observed() end
return {ACQUIRED, t, x, ttl, 1}  -- 1: taken by this call
"""
)

# Rows lock.release (opening the hand-off window: state reserved), lock.release.stale.
# KEYS[1] record, KEYS[2] waiters. ARGV: owner, token, keep_ms, handoff_ms, channel, nonce
# Publishes the chosen waiter's gid, or '*' (wake every waiter) when there is none. A
# freed permit with waiters queued keeps one slot for the oldest (one window at a time).
RELEASE = (
    _WITH_LOCK
    + """
local p = l.live[ARGV[1]]
if p and p.ts == ARGV[2] then
  local keep = tonumber(ARGV[3])
  local g = tonumber(ARGV[4])
  local chosen, since = nil, nil
  if g > 0 and not kept(l) then
    local ws = redis.pcall('HGETALL', KEYS[2])
    if ws.err then return corrupt('waiters: wrong type') end
    for i = 1, #ws, 2 do
      local first, untl = string.match(ws[i + 1], '^(%d+):(%d+)$')
      first, untl = tonumber(first), tonumber(untl)
      if untl and untl > now and (not since or first < since) then
        chosen, since = ws[i], first
      end
    end
  end
  l.live[ARGV[1]] = nil
  if p.f then
    prune(KEYS[1], l, {p.f})
  elseif l.v then
    prune(KEYS[1], l, {'o', 'x', 'v'})
  else
    prune(KEYS[1], l, {'o', 'x'})
  end
  local n = ARGV[6] .. ARGV[2]
  if chosen then
    l.y = now + g
    redis.call('HSET', KEYS[1], 'y', S(l.y), 'g', chosen, 'n', n)
  else
    redis.call('HSET', KEYS[1], 'n', n)
  end
  expire_at(KEYS[1], l, keep)
  redis.call('PUBLISH', ARGV[5], chosen or '*')
  return OK
end
if l.n == ARGV[6] .. ARGV[2] then  -- this call, re-sent: its permit is gone
  for _, q in pairs(l.live) do if q.ts == ARGV[2] then return STALE end end
  return OK
end
return STALE
"""
)

# Rows lock.break, lock.break.free: every holder (ARGV[3] '') or the permit with the
# token ARGV[3] -> freed, whatever its owner. KEYS[1] record. ARGV: keep_ms, channel,
# token. The counter 't' stays (the next acquire issues a higher token); the old holder's
# RENEW and RELEASE find no permit of theirs. Every waiter is woken ('*'): no hand-off
# window is opened, as nobody chose to hand the permit over.
BREAK = (
    _WITH_LOCK
    + """
if ARGV[3] == '' then
  if l.count == 0 then return STALE end
  local del = {'o', 'x', 'v', 'y', 'g', 'n'}
  for o, p in pairs(l.live) do if p.f then del[#del + 1] = p.f end end
  l.live, l.y = {}, nil
  prune(KEYS[1], l, del)
else
  local who, p = nil, nil
  for o, q in pairs(l.live) do if q.ts == ARGV[3] then who, p = o, q end end
  if not p then return STALE end
  l.live[who] = nil
  if p.f then prune(KEYS[1], l, {p.f}) else prune(KEYS[1], l, {'o', 'x', 'v'}) end
end
expire_at(KEYS[1], l, tonumber(ARGV[1]))
redis.call('PUBLISH', ARGV[2], '*')
return OK
"""
)

# KEYS[1] waiters. ARGV: gid. A process stopped waiting without getting the lock.
UNREGISTER = (
    _CODES
    + """
redis.pcall('HDEL', KEYS[1], ARGV[1])
return OK
"""
)

# Rows lock.renew, lock.renew.stale. KEYS[1] record.
# ARGV: owner, token, ttl_ms, keep_ms, value ('' keeps it, '=' .. value replaces it).
# Reply: the new expiry, or NO_EXPIRY. A renewal with a value publishes '!' (observers
# only).
RENEW = (
    _WITH_LOCK
    + _OBSERVED
    + """
local p = l.live[ARGV[1]]
if p and p.ts == ARGV[2] then
  local x = now + tonumber(ARGV[3])
  if x > MAX_MS then return too_long(x) end
  p.x = x
  local val = ARGV[5] and ARGV[5] ~= ''
  if val then p.v = string.sub(ARGV[5], 2) end
  put(KEYS[1], l, ARGV[1], p)
  prune(KEYS[1], l)
  expire_at(KEYS[1], l, tonumber(ARGV[4]))
  if val then observed() end
  return x
end
return NO_EXPIRY
"""
)

# KEYS[1] record. Reply: the live holders, lowest token first, four items each: owner,
# token, expires_ms, value ('' for none, else '=' .. value).
PEEK_LOCK = (
    _WITH_LOCK
    + """
local ps = {}
for o, p in pairs(l.live) do ps[#ps + 1] = {o, p} end
table.sort(ps, function(a, b) return a[2].t < b[2].t end)
local out = {}
for _, e in ipairs(ps) do
  local p = e[2]
  out[#out + 1] = e[1]
  out[#out + 1] = p.t
  out[#out + 1] = p.x
  if p.v then out[#out + 1] = '=' .. p.v else out[#out + 1] = '' end
end
return out
"""
)

# ---- fence gates -------------------------------------------------------------------
# Every gate script reads KEYS[1], the gate, first, refusing a corrupt one.
_GATE = (
    _READ_GATE
    + """
local cur, why = read_gate(KEYS[1])
if cur == nil then return redis.error_reply('IDEMLOCK_CORRUPT ' .. why) end
"""
)

# Rows fence.advance, fence.stale: a token below the highest accepted is refused, any
# other becomes the highest. ARGV[1]: token.
_ADVANCE = (
    _CODES
    + _GATE
    + "if cur and not ge(ARGV[1], cur) then return {STALE, cur} end\n"
    + "if cur ~= ARGV[1] then redis.call('SET', KEYS[1], ARGV[1]) end\n"
)

# KEYS[1] gate. ARGV: token. Reply: {OK or STALE, highest (decimal string)}
FENCE_ADVANCE = _ADVANCE + "return {OK, ARGV[1]}\n"

# KEYS[1] gate, KEYS[2] the user's key. ARGV: token, value
FENCE_SET = _ADVANCE + "redis.call('SET', KEYS[2], ARGV[2])\nreturn {OK, ARGV[1]}\n"

# KEYS[1] gate. Reply: false or the highest accepted (decimal string)
FENCE_CURRENT = _GATE + "return cur\n"
