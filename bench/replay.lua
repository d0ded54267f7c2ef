-- wrk script: POST /payments replaying one Idempotency-Key (created by the
-- first request). Needs IDEM_TOKEN in the environment.
wrk.method = "POST"
wrk.path = os.getenv("IDEM_PATH") or "/payments"
wrk.body = os.getenv("IDEM_BODY") or '{"amount": 15990, "currency": "BRL"}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer " .. (os.getenv("IDEM_TOKEN") or "")
wrk.headers["Idempotency-Key"] = os.getenv("IDEM_KEY") or "bench-replay-key"

local bad = 0
response = function(status, headers, body)
  if status ~= 201 then bad = bad + 1 end
end

done = function(summary, latency, requests)
  io.write(string.format("non-201 answers: %d\n", bad))
end
