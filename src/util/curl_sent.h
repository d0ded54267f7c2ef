/* What a failed libcurl transfer says about the request it carried:
 * whether any byte of it left this process. The provider client
 * (provider/http.c) and the gateway's upstream client (gateway/upstream.c)
 * both tell "nothing was sent, safe to send again" from "sent, the answer
 * is unknown" with it (docs/payments.md, docs/gateway.md). */
#ifndef IDEM_UTIL_CURL_SENT_H
#define IDEM_UTIL_CURL_SENT_H

/* 1 when the transfer on `curl` (a CURL *, after curl_easy_perform()
 * failed) certainly sent nothing: not one byte of the request went out in
 * any of its attempts; 0 otherwise (then the peer may have acted on it). */
int idem__curl_nothing_sent(void *curl);

#endif
