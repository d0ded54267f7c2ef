/* Whether a failed libcurl transfer sent anything (util/curl_sent.h). */
#include "util/curl_sent.h"

#include <curl/curl.h>

/* The error code alone does not say so: a request sent on a reused
 * keep-alive connection that closes unanswered (the peer acted, then
 * crashed) is sent again by libcurl on a new connection, and when that one
 * is refused the transfer fails with CURLE_COULDNT_CONNECT although the
 * peer had the request. CURLINFO_REQUEST_SIZE counts the bytes of every
 * attempt of the transfer, and is 0 only when none went out. The connect
 * time says nothing either: 0 on a reused connection. */
int idem__curl_nothing_sent(void *curl) {
  long sent = -1;
  return curl_easy_getinfo((CURL *)curl, CURLINFO_REQUEST_SIZE, &sent) == CURLE_OK &&
         sent == 0;
}
