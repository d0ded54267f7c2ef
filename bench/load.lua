-- wrk script for idem's benchmark. Environment:
--   IDEM_TOKEN   API key (Authorization: Bearer)
--   IDEM_PATH    /payments or /orders
--   IDEM_PATHS   optional: paths separated by spaces, taken in turn (the
--                refunds of many payments), instead of IDEM_PATH
--   IDEM_BODY    request body
--   IDEM_MODE    new      a new Idempotency-Key on every request
--                replay   IDEM_KEY on every request (created beforehand
--                         with IDEM_BODY): every answer a replay
--                mismatch IDEM_KEY with another body: every answer 422
--                mixed    every other request a new key, the others
--                         replays of the key just before
--   IDEM_KEY     the key of replay and mismatch
--   IDEM_EXPECT  the status every answer must have
--   IDEM_CLOSE   1: Connection: close on every request (wrk then opens a
--                new connection for each)
-- Prints one line: "result rps=... p50_ms=... p99_ms=... max_ms=... bad=N requests=N".
local mode = os.getenv("IDEM_MODE") or "new"
local expect = tonumber(os.getenv("IDEM_EXPECT") or "201")
local body = os.getenv("IDEM_BODY") or '{"amount": 15990, "currency": "BRL"}'
local other = body:gsub("}%s*$", ', "order_id": "other"}')
local prefix = "b" .. tostring(os.time()) .. "-" .. tostring(math.random(1, 1e9)) .. "-"
local counter = 0
bad = 0 -- global: done() reads it from each thread with thread:get()
first_bad = "" -- the first unexpected status, and the start of its body
local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

wrk.method = "POST"
wrk.path = os.getenv("IDEM_PATH") or "/payments"
wrk.body = body
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer " .. (os.getenv("IDEM_TOKEN") or "")

local paths = {}
for p in string.gmatch(os.getenv("IDEM_PATHS") or "", "%S+") do
  table.insert(paths, p)
end

local fixed = os.getenv("IDEM_KEY") or "bench-key"
if os.getenv("IDEM_CLOSE") == "1" then
  wrk.headers["Connection"] = "close"
end

request = function()
  counter = counter + 1
  local key, b = fixed, body
  if mode == "new" then
    key = prefix .. counter
  elseif mode == "mismatch" then
    b = other
  elseif mode == "mixed" then
    key = prefix .. (counter - counter % 2)
  end
  wrk.headers["Idempotency-Key"] = key
  if #paths > 0 then
    return wrk.format(nil, paths[counter % #paths + 1], nil, b)
  end
  return wrk.format(nil, nil, nil, b)
end

response = function(status, headers, resp)
  if status ~= expect then
    bad = bad + 1
    if first_bad == "" then
      first_bad = tostring(status) .. " " .. string.sub(resp or "", 1, 120)
    end
  end
end

-- done() runs in its own Lua state: the threads' counts come through get().
-- wrk's errors.status counts every status >= 400, expected or not, so it
-- is not used; transport errors are.
done = function(summary, latency, requests)
  local secs = summary.duration / 1e6
  local wrong, first = 0, ""
  for _, t in ipairs(threads) do
    wrong = wrong + (t:get("bad") or 0)
    if first == "" then
      first = t:get("first_bad") or ""
    end
  end
  local e = summary.errors
  io.write(string.format("result rps=%.0f p50_ms=%.3f p99_ms=%.3f max_ms=%.3f bad=%d requests=%d\n",
    summary.requests / secs, latency:percentile(50) / 1000, latency:percentile(99) / 1000,
    latency.max / 1000, wrong + e.connect + e.read + e.write + e.timeout, summary.requests))
  if wrong + e.connect + e.read + e.write + e.timeout > 0 then
    io.write(string.format("unexpected: %d answers (first: %s); transport errors: connect %d, read %d, write %d, timeout %d\n",
      wrong, first, e.connect, e.read, e.write, e.timeout))
  end
end
