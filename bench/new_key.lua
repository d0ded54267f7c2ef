-- wrk script: POST /payments with a new Idempotency-Key on every request.
-- Needs IDEM_TOKEN in the environment.
local counter = 0
local prefix = tostring(os.time()) .. "-" .. tostring(math.random(1, 1e9)) .. "-"
wrk.method = "POST"
wrk.path = os.getenv("IDEM_PATH") or "/payments"
wrk.body = os.getenv("IDEM_BODY") or '{"amount": 15990, "currency": "BRL"}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer " .. (os.getenv("IDEM_TOKEN") or "")

request = function()
  counter = counter + 1
  wrk.headers["Idempotency-Key"] = prefix .. counter
  return wrk.format()
end

local bad = 0
response = function(status, headers, body)
  if status ~= 201 then bad = bad + 1 end
end

done = function(summary, latency, requests)
  io.write(string.format("non-201 answers: %d\n", bad))
end
