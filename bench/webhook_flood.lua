-- wrk script: a flood of forged provider events at POST /webhooks/provider
-- (docs/payments.md, "Webhooks"), for bench/webhook_flood.sh. Each request
-- is a well-formed event with a signature of the right shape and time but
-- made under another secret, so idemd checks the HMAC and answers 400.
-- Prints one line: "result rps=... bad=N requests=N" (bad: not 400).
local body = '{"id":"evt_forged","type":"charge.succeeded","created":1764984000,' ..
             '"data":{"key":"pay_forged","id":"ch_forged","amount":15990}}'
bad = 0
local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

wrk.method = "POST"
wrk.path = "/webhooks/provider"
wrk.body = body
wrk.headers["Content-Type"] = "application/json"

request = function()
  wrk.headers["Idem-Psp-Signature"] = "t=" .. os.time() .. ",v1=" .. string.rep("ab", 32)
  return wrk.format()
end

response = function(status, headers, b)
  if status ~= 400 then
    bad = bad + 1
  end
end

function done(summary, latency, requests)
  local n = 0
  for _, t in ipairs(threads) do
    n = n + t:get("bad")
  end
  io.write(string.format("result rps=%.0f bad=%d requests=%d\n",
                         summary.requests / (summary.duration / 1e6), n, summary.requests))
end
