/* POST /orders and GET /orders/{id}. An order has no outside effect, so it
 * is written together with its idempotency record, already completed, in
 * the one transaction that reserves the key. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "idem/canon.h"
#include "idem/clock.h"
#include "idem/crypto.h"
#include "server/flow.h"
#include "server/reply.h"
#include "server/validate.h"

#define OPERATION "create_order"

enum MHD_Result idemd_orders_create(idemd_request_t *r, const json_t *body) {
  json_t *cmd = NULL, *errors = NULL, *order;
  char fp[IDEM_FINGERPRINT_LEN];
  char token[25], id[32], location[64], created_at[32];
  char *text;
  int64_t total = 0;
  enum MHD_Result ret;

  if (idemd_validate_order(body, &cmd, &errors, &total) != 0) {
    r->outcome = OUTCOME_INVALID;
    return idemd_reply_errors(r, errors);
  }
  if (idem_fingerprint(OPERATION, cmd, fp) != IDEM_OK ||
      idem_random_token(token, 24) != IDEM_OK) {
    json_decref(cmd);
    return idemd_reply_store_error(r, IDEM_ECRYPTO);
  }
  snprintf(id, sizeof id, "ord_%s", token);
  snprintf(location, sizeof location, "/orders/%s", id);
  idem_format_time(idem_now_ms(), created_at, sizeof created_at);

  order = json_pack("{s:s, s:O, s:O, s:O, s:I, s:s, s:s}", "id", id,
                    "customer_id", json_object_get(cmd, "customer_id"), "items",
                    json_object_get(cmd, "items"), "currency",
                    json_object_get(cmd, "currency"), "total", (json_int_t)total,
                    "status", "created", "created_at", created_at);
  text = order ? json_dumps(order, JSON_COMPACT) : NULL;
  json_decref(order);
  json_decref(cmd);
  if (text == NULL)
    return idemd_reply_store_error(r, IDEM_ENOMEM);

  idem_resource_t res = {.kind = "order", .id = id, .status = "created",
                         .body = text};
  idem_outcome_t done = {.state = IDEM_STATE_COMPLETED, .status = 201,
                         .body = text, .location = location, .resource_id = id};
  idemd_effect_t e = {.operation = OPERATION, .fingerprint = fp,
                      .resource = &res, .outcome = &done};
  ret = idemd_flow_run(r, &e);
  free(text);
  return ret;
}
