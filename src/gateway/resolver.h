/* The gateway's resolver of unsettled keys (docs/gateway.md, "Pending
 * requests"), on a thread of its own. */
#ifndef IDEM_GATEWAY_RESOLVER_H
#define IDEM_GATEWAY_RESOLVER_H

#include <stdint.h>

#include "gateway/gateway.h"

/* Starts the resolver over `gw` (its store, engine and upstream ready),
 * looking for due requests every `every_ms`. Returns the ticker to stop
 * with idem__ticker_stop() (util/ticker.h), or NULL when it cannot. */
struct idem__ticker *gw_resolver_start(gw_t *gw, int64_t every_ms);

#endif
